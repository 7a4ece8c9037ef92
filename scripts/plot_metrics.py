"""Draw runs' metrics.jsonl as a picture: one run, or several overlaid (e.g. GRPO against its lr-0 control).

    .venv/bin/python scripts/plot_metrics.py RUN_DIR [RUN_DIR ...] [--out FILE.png] [--labels NAME ...]

Panels: training loss, learning rate, grad norm; SFT's held-out loss and accuracy; GRPO's reward, rollout accuracy,
KL, entropy and response length (those no run has are left out). Each run has one colour. The default output is
RUN_DIR/metrics.png for one run (what every run writes when it ends) and ./metrics.png for several.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer import plots  # noqa: E402


def main() -> None:
    """Parse the run directories and write the picture."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (train.out_dir), each with a metrics.jsonl")
    parser.add_argument("--out", type=Path, help="PNG to write, or a folder for its metrics.png (default: RUN_DIR/metrics.png, or ./metrics.png for several)")
    parser.add_argument("--labels", nargs="+", help="legend names, one per run (default: the directory names)")
    args = parser.parse_args()
    missing = [str(run) for run in args.runs if not (run / "metrics.jsonl").is_file()]
    if missing:
        parser.error(f"no metrics.jsonl in {', '.join(missing)}")
    if args.labels and len(args.labels) != len(args.runs):
        parser.error(f"--labels needs one name per run ({len(args.runs)})")
    empty = [str(run) for run in args.runs if not plots.read_rows(run)]
    if empty:
        parser.error(f"metrics.jsonl in {', '.join(empty)} holds no rows: nothing to draw")
    out = args.out or (args.runs[0] / "metrics.png" if len(args.runs) == 1 else Path("metrics.png"))
    if out.is_dir():  # matplotlib wrote DIR.png beside it, and the line below named DIR
        out = out / "metrics.png"
    if out.suffix.lower() != ".png":  # matplotlib added .png to a name without it, and refused .jpg with a traceback
        parser.error(f"--out {out}: the picture is a PNG; give a path ending in .png")
    out.parent.mkdir(parents=True, exist_ok=True)
    panels = plots.draw_runs(args.runs, out, args.labels)
    print(f"wrote {out} ({len(args.runs)} run{'s' * (len(args.runs) > 1)}: {', '.join(panels)})")


if __name__ == "__main__":
    main()
