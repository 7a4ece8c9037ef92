"""Every `torchrun ... -m trainer.*` command in the README and docs/ runs: validated as written, then two steps of it, with the
reader's paths replaced by test fixtures (a tiny checkpoint for `/models/...`, slices of the real GSM8K for the data
files, a small YAML for `run.yaml`). So no documented command can rot."""

import shlex
from pathlib import Path

import pytest

from tests.conftest import GSM8K, REPO, launch, write_pairs

# Two steps, a few held-out prompts, a small batch (SFT: 16 rows; GRPO: 2 prompts x 8 samples), in micro-batches of 2
# (so that the GRPO recipes' 4 updates a step divide it at DP=2), and GRPO's completions cut at the default 32 new
# tokens (the README's 256 and the tools recipe's 176 are validated as written; sampled in full by a model two steps
# into its SFT, which never ends a completion early, they took 22-35 s a command): the commands' own models, data,
# sequence lengths, precision and keys run, not their full scale (two steps of the README's bf16 SFT at its own batch
# took 32-37 s each on CPU).
# The README's commands run in its order without overwriting anything, after what scripts/run.sh leaves; the docs' examples
# (several write the default `outputs/grpo`) then replace each other, as a reader would be told to.
SMOKE = {"trainer.sft": ["--train.steps=2", "--train.eval_samples=4", "--train.global_batch_size=16",
                         "--train.micro_batch_size=2", "--train.overwrite_output_dir=true"],
         "trainer.grpo": ["--train.steps=2", "--train.eval_samples=4", "--train.global_batch_size=16",
                          "--train.micro_batch_size=2", "--grpo.max_new_tokens=32", "--train.overwrite_output_dir=true"],
         "trainer.rm": ["--train.steps=2", "--train.eval_samples=4", "--train.global_batch_size=4",
                        "--train.micro_batch_size=2", "--train.overwrite_output_dir=true"]}


def documented_commands(markdown: str) -> list[dict]:
    """Each torchrun command of the ```bash blocks: its environment prefix, process count, entry point and arguments."""
    commands, in_bash = [], False
    logical = ""
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_bash = line.strip() == "```bash"
            continue
        if not in_bash:
            continue
        logical += line.rstrip().removesuffix("\\") + " "
        if line.rstrip().endswith("\\"):
            continue
        text, logical = logical.strip(), ""
        if "torchrun" not in text or "-m trainer." not in text:
            continue
        tokens = shlex.split(text, comments=True)
        env = {}
        while "=" in tokens[0] and not tokens[0].startswith("-"):
            key, _, value = tokens.pop(0).partition("=")
            env[key] = value
        module_at = tokens.index("-m")
        launcher = tokens[:module_at]
        count = {name: int(launcher[launcher.index(name) + 1]) if name in launcher else 1
                 for name in ("--nproc-per-node", "--nnodes")}
        commands.append({"line": text, "env": env, "module": tokens[module_at + 1], "argv": tokens[module_at + 2 :],
                         "world_size": count["--nproc-per-node"] * count["--nnodes"]})
    return commands


def every_documented_command() -> list[dict]:
    """The commands of README.md (in its order) and docs/*.md, each once, with the page it is on."""
    commands = {}
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for command in documented_commands(page.read_text()):
            commands.setdefault(command["line"], {**command, "page": page.name})
    return list(commands.values())


def test_the_docs_have_the_commands_users_copy():
    modules = [command["module"] for command in every_documented_command()]
    assert modules.count("trainer.sft") >= 3 and modules.count("trainer.grpo") >= 2, modules


def fixtures(root: Path) -> dict[str, str]:
    """The reader's paths in the README -> files made under `root` from the tiny checkpoint and the real GSM8K."""
    from model.tiny import ensure_tiny_checkpoint

    gsm8k = root / "gsm8k"
    gsm8k.mkdir()
    for split, rows in (("train", 600), ("test", 16)):
        lines = (GSM8K / f"{split}.jsonl").read_text().splitlines()[:rows]
        (gsm8k / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    (root / "run.yaml").write_text("data: {path: arithmetic}\ntrain: {global_batch_size: 64, micro_batch_size: 4}\n")
    pairs = write_pairs(root / "pairs")
    return {"/models/Qwen2.5-0.5B": str(ensure_tiny_checkpoint()), "train.jsonl": str(gsm8k / "train.jsonl"),
            "openai/gsm8k": str(gsm8k), "run.yaml": str(root / "run.yaml"), "prefs.jsonl": str(pairs / "train.jsonl")}


def launches(tmp_path_factory):
    """Every documented command, two steps each, in one launch (conftest's `joint_launches`); returns the commands and
    their results."""
    root = tmp_path_factory.mktemp("readme")
    paths, commands = fixtures(root), every_documented_command()
    work = root / "work"  # the reader's current directory: relative outputs (runs/, outputs/) land here
    # What scripts/run.sh leaves there first (its SFT and GRPO runs): the README's commands, run in its order after it,
    # overwrite nothing, so none of them may write where another run already is.
    for earlier in ("outputs/sft", "outputs/grpo"):
        (work / earlier).mkdir(parents=True)
        (work / earlier / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    # The embedded preference set as a first `trainer.rm` leaves it (its sampling, 40 s, is tested in test_rm).
    write_pairs(work / "outputs" / "preferences")
    for command in commands:
        command["argv"] = [paths.get(token, token) for token in command["argv"]]
        smoke = SMOKE[command["module"]]
        if command["page"] == "README.md":
            smoke = [flag for flag in smoke if not flag.startswith("--train.overwrite_output_dir")]
        command.update(cwd=str(work), smoke=smoke)
    results = yield launch(commands)
    return commands, results


@pytest.mark.distributed
def test_every_readme_torchrun_command_logs_step_one(joint_launches):
    commands, results = joint_launches[__name__]
    assert len(results) == len(commands)
    for result in results:
        print(f"README command ran: {result['line']}\n    step 1: loss {result['step1'] and result['step1']['loss']}")
        assert result["step1"] is not None and result["step1"]["loss"] == result["step1"]["loss"], result["line"]
    # Every recipe ran its first steps from the default SFT (docs/grpo.md lists each), with its own terms.
    by_recipe = {result["line"].split("--config ")[1].split()[0]: result["step1"] for result in results if "--config " in result["line"]}
    assert {"grpo", "dapo", "dr_grpo", "gspo", "rloo"} <= set(by_recipe)
    assert by_recipe["dapo"]["sampling_rounds"] >= 1 and by_recipe["dapo"]["overlong_penalty"] <= 0
    assert by_recipe["dapo"]["kl"] is None and by_recipe["gspo"]["kl"] is None and by_recipe["grpo"]["kl"] is not None
    assert by_recipe["dr_grpo"]["kl"] is None  # no KL term, as Dr. GRPO's scripts (`--beta 0`)
    assert "sampling_rounds" not in by_recipe["gspo"]
