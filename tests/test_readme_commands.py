"""Every `torchrun ... -m trainer.*` command in the README and docs/ runs: validated as written, then two steps of it, with the
reader's paths replaced by test fixtures (a tiny checkpoint for `/models/...`, slices of the real GSM8K for the data
files, a small YAML for `run.yaml`). So no documented command can rot."""

import re
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


# What the pages name besides their ```bash commands, checked without running anything: a renamed key, module, script or
# heading otherwise left a page pointing at nothing (in a ``` block or an inline `...` span alike).
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Dotted names of the peers' configs and libraries that the comparison tables quote under our section names.
NOT_OURS = {"data.train_batch_size", "data.default.env_name", "model.resize_token_embeddings",
            "peft.PeftModel.from_pretrained"}
FILE_SUFFIXES = {"md", "py", "yaml", "json", "jsonl", "parquet", "png", "txt", "npz", "sbatch", "sh"}


def code_spans(page: Path) -> list[tuple[int, str]]:
    """Each inline `...` span and ``` block of a page, with the line it starts on."""
    text, spans = page.read_text(), []
    for match in re.finditer(r"```.*?```|`[^`]+`", text, flags=re.S):
        spans.append((text.count("\n", 0, match.start()) + 1, match.group(0).strip("`")))
    return spans


def names_something(dotted: str, keys: set[str]) -> bool:
    """`dotted` is a config key, or a module of ours (`data.sandbox`) with the attribute it goes on to name, if any
    (`data.sandbox.run`, or `data.sandbox:python` as a tool is named)."""
    if dotted in keys or dotted in NOT_OURS or dotted.rsplit(".", 1)[-1] in FILE_SUFFIXES:
        return True
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = REPO.joinpath(*parts[:cut])
        source = module.with_suffix(".py") if module.with_suffix(".py").is_file() else module / "__init__.py"
        if source.is_file():
            rest = parts[cut:]
            return not rest or bool(re.search(rf"^\s*(def|class) {rest[0]}\b|^\s*{rest[0]}\s*[:=]", source.read_text(), re.M))
    return False


def test_every_dotted_name_the_docs_give_is_a_key_or_a_module_of_ours():
    """`grpo.kl_coef`, `--train.steps 3`, `data.sandbox:python`, `ckpt.checkpoint.save`: each names a key or code."""
    from config.cli import flat_keys
    from config.loops import GRPOConfig, RMConfig, SFTConfig

    keys = {key for loop in (SFTConfig, GRPOConfig, RMConfig) for key in flat_keys(loop)}
    sections = "|".join(sorted({key.split(".")[0] for key in keys}))
    wrong = [f"{page.name}:{line}: {dotted}{name and ':' + name}" for page in PAGES for line, span in code_spans(page)
             for dotted, name in re.findall(rf"(?<![\w./-])(?:--)?((?:{sections})(?:\.[A-Za-z_]\w*)+)(?::(\w+))?", span)
             if not names_something(f"{dotted}.{name}" if name else dotted, keys)]
    assert not wrong, wrong


def test_every_inline_command_the_docs_give_parses():
    """The `... -m trainer.X --key value` commands written inline in the prose (the ```bash ones run above), with
    placeholders (`S`, `DIR`) given a value: every key exists in the loop it is given to."""
    from config import cli
    from config.loops import GRPOConfig, RMConfig, SFTConfig

    loops = {"trainer.sft": SFTConfig, "trainer.grpo": GRPOConfig, "trainer.rm": RMConfig}
    commands = [(page.name, line, text) for page in PAGES for line, span in code_spans(page) if "\n" not in span
                for text in re.split(r"(?=-m trainer\.)", " ".join(span.split()))[1:]]
    assert len(commands) >= 20, commands
    for page, line, text in commands:
        module, *argv = shlex.split(text.split(" && ")[0])[1:]
        argv = ["1" if re.fullmatch(r"[A-Z]+", token) else token.strip("[]") if token.startswith("[--") else token
                for token in argv if token != "--help"]
        argv = [token.replace("=S", "=1") for token in argv]
        try:
            cli.parse_args(loops[module], argv, module)
        except cli.UserError as error:
            if "Config file" not in str(error):  # `--config run.yaml`: the reader's own file
                raise AssertionError(f"{page}:{line}: `{text}`: {error}") from None


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)}


def test_every_link_and_repository_path_the_docs_give_exists():
    """Links to pages and their headings, and the `scripts/...`, `recipes/...`, `tests/...` paths a reader would open."""
    wrong = []
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path, _, anchor = target.partition("#")
            if target.startswith("http"):
                continue
            linked = (page.parent / path) if path else page
            if not linked.exists() or anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
                wrong.append(f"{page.name}: ({target})")
        for path in re.findall(r"(?<![\w./-])((?:scripts|recipes|tests|trainer|config|model|data|ckpt|tool_runtime)"
                               r"/[\w./-]*\w)", text):
            if not (REPO / path).exists() and "RECIPE" not in path and "test_x" not in path and "train-0" not in path:
                wrong.append(f"{page.name}: {path}")
    assert not wrong, wrong
