"""Writes docs/config.md, every config key of the three loops with its default and meaning, from their `--help`.

    .venv/bin/python scripts/config_reference.py           # rewrite docs/config.md
    .venv/bin/python scripts/config_reference.py --check   # exit 1 when docs/config.md is not current (a test runs this)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config.cli import help_text  # noqa: E402
from config.loops import GRPOConfig, RMConfig, SFTConfig  # noqa: E402

TARGET = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def render() -> str:
    """The reference page: SFT's `--help`, then GRPO's (the same sections with GRPO's defaults, and `grpo.*`), then
    reward-model training's."""
    return (
        "# Every config key\n\n[Back to the README](../README.md)\n\n"
        "Generated from `--help` by `scripts/config_reference.py`; a test fails when it is not current.\n"
        "Keys are dotted: `--a.b=v` and `--a.b v` both work on the command line, and a YAML file given with\n"
        "`--config FILE` uses the same nesting (`train: {steps: 100}`); command-line keys win over the file.\n\n"
        "## `trainer.sft`\n\n```text\n" + help_text(SFTConfig, "trainer.sft") + "\n```\n\n"
        "## `trainer.grpo`\n\nThe same sections with GRPO's own defaults, and the `grpo` section.\n\n"
        "```text\n" + help_text(GRPOConfig, "trainer.grpo") + "\n```\n\n"
        "## `trainer.rm`\n\nThe same sections with reward-model training's defaults, and the preference pairs' columns.\n\n"
        "```text\n" + help_text(RMConfig, "trainer.rm") + "\n```\n")


if __name__ == "__main__":
    if "--check" in sys.argv:
        current = TARGET.is_file() and TARGET.read_text() == render()
        if not current:
            print(f"{TARGET} is not current: run `.venv/bin/python scripts/config_reference.py`", file=sys.stderr)
        sys.exit(0 if current else 1)
    TARGET.write_text(render())
    print(f"wrote {TARGET}")
