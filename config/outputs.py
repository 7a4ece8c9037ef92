"""What a run writes into `train.out_dir` besides its checkpoints, named once: the code that writes each output and
`train.overwrite_output_dir`, which deletes an earlier run's, both read these names; and how its rows are read back."""

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"
PLOT = "metrics.png"
TENSORBOARD = "tb"
HF = "hf"  # the trained model as a Hugging Face checkpoint (with LoRA, the adapters merged)
HF_ADAPTER = "hf_adapter"  # with LoRA, the adapters alone in PEFT format
EXPORTS = (HF, HF_ADAPTER)
RUN_OUTPUTS = (METRICS, SAMPLES, PLOT, TENSORBOARD, *EXPORTS)
# An export is written under this prefix and renamed when complete, so a directory named HF is always whole.
PARTIAL = ".partial-"


def read_rows(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl or samples.jsonl ([] when there is none). A line that is not a whole JSON object
    (the end of a file whose last write a kill or a full disk cut short) is left out, with a warning: it made the run
    impossible to resume, with a traceback after the model's build."""
    if not path.exists():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            row = None
            log.warning("%s line %d is not a whole row (a write cut short): left out", path, number)
        if isinstance(row, dict):
            rows.append(row)
    return rows


def write_rows(path: Path, rows: list[dict]) -> None:
    """`rows` as the whole of `path`, replacing it at once (written beside it, then renamed: a kill leaves the old file
    or the new, never an empty one)."""
    staged = path.with_name(f".{path.name}.writing")
    with open(staged, "w") as stream:
        stream.write("".join(json.dumps(row) + "\n" for row in rows))
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(staged, path)
