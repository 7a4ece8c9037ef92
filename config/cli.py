"""The command line of both loops: a YAML file and `--a.b=value` overrides onto the config dataclasses, `--help`.

`parse_args(ConfigClass, argv, program)` returns the config and the resume target; `run_cli(main)` turns a
`UserError` into a one-paragraph message on rank 0 and exit status 2.
"""

import contextlib
import dataclasses
import difflib
import json
import math
import os
import re
import sys
import time
import types
import typing
from pathlib import Path

import yaml

from config.errors import UserError
from config.process import is_global_rank_zero, peer_paragraph, tell_peers_at_startup, tell_peers_mid_run
from config.sections import LORA_SETTINGS

# Named GRPO recipes (`--config dapo`): YAML files of a handful of keys each, citing the paper and the peers' keys.
RECIPES = Path(__file__).resolve().parents[1] / "recipes"


# ---------------------------------------------------------------- keys, values, parsing


def flat_keys(config_class) -> dict[str, dataclasses.Field]:
    """Every dotted key of a config class, mapped to its dataclass field."""
    keys = {}
    for section in dataclasses.fields(config_class):
        for item in dataclasses.fields(section.type):
            keys[f"{section.name}.{item.name}"] = item
    return keys


def _coerce(key: str, value, annotation):
    """Check/convert one value to the field's type; raise UserError naming the key otherwise."""
    optional = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else ()
    if type(None) in optional:  # `float | None`: null (YAML `null`/`~`) leaves it unset
        if value is None:
            return None
        annotation = next(arg for arg in optional if arg is not type(None))
    origin = typing.get_origin(annotation) or annotation
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}[origin]
    if origin is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is float and isinstance(value, str):
        try:  # YAML 1.1 reads `1e-3` (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    if origin is float and isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"`{key}` must be a finite number, got {value!r}. Change `--{key}` (or `{key}` in the YAML file).")
    if origin is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if origin is list and isinstance(value, str):  # `--grpo.tools=module:function`: a list of one; `--grpo.tools=`: none
        value = [value] if value.strip() else []
    if origin is list and value is None:  # YAML `tools:` with every item commented out
        value = []
    if (origin is int and isinstance(value, bool)) or not isinstance(value, origin):
        raise UserError(f"`{key}` must be {expected}, got {value!r}. Change `--{key}` (or `{key}` in the YAML file).")
    if origin is list:
        item_type = typing.get_args(annotation)[0]
        try:
            return [_coerce(key, item, item_type) for item in value]
        except UserError:  # said of the whole list, not of the item (`optim.betas` is a list, not "a number")
            raise UserError(f"`{key}` must be a list of {LIST_ITEMS[item_type]}, got {value!r}. Change `--{key}` (or "
                            f"`{key}` in the YAML file).") from None
    if origin is dict:  # megatron-core's fields: `1e-5` inside a mapping is a number there too
        return _numbers_in(value)
    return value


LIST_ITEMS = {float: "finite numbers", int: "integers", str: "strings"}  # what a list key holds, in its error

SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")  # a number YAML 1.1 reads as a string


def _numbers_in(value):
    """`value` with every string written in exponent notation (`1e-5`) read as the number it is, at any depth."""
    if isinstance(value, dict):
        return {key: _numbers_in(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_numbers_in(item) for item in value]
    return float(value) if isinstance(value, str) and SCIENTIFIC.fullmatch(value) else value


def _set(config, key: str, value, keys: dict) -> None:
    """Set one dotted key, rejecting unknown keys with the closest known ones."""
    if key not in keys:
        close = difflib.get_close_matches(key, keys, n=2, cutoff=0.8)
        hint = f" Did you mean {', '.join(f'`{k}`' for k in close)}?" if close else ""
        sections = list(dict.fromkeys(known.split(".")[0] for known in keys))
        named = ", ".join(f"`{known}`" for known in keys if known.split(".")[1] == key)
        if key in sections:
            hint = f" `{key}` is a section: set its keys, `--{key}.KEY=VALUE`."
        elif "." not in key:  # `--steps=3`: every key is `section.name`
            hint = " Keys are `section.name`" + (f"; did you mean {named}?" if named else ".")
        elif not close and key.split(".")[0] not in sections:  # `grpo.*` given to trainer.sft, say
            hint = f" This entry point has no `{key.split('.')[0]}` section (its sections: {', '.join(sections)})."
        raise UserError(f"Unknown config key `{key}`.{hint} `--help` lists every key.")
    section, name = key.split(".")
    setattr(getattr(config, section), name, _coerce(key, value, keys[key].type))


def _flatten(mapping: dict, prefix: str = "", source: str = "") -> dict:
    """YAML nesting -> dotted keys (stopping at mapping-valued fields such as override_* dicts); a key given both
    nested and dotted (`train: {steps: 5}` and `train.steps: 6`) is refused, as YAML's own repeated keys are."""
    flat = {}
    for name, value in mapping.items():
        dotted = f"{prefix}{name}"
        is_section = isinstance(value, dict) and dotted.count(".") == 0
        nested = _flatten(value, dotted + ".", source) if is_section else {dotted: value}
        if twice := sorted(nested.keys() & flat.keys()):
            raise UserError(f"`{twice[0]}` is given twice in config file `{source}`, once nested under its section and "
                            f"once as `{twice[0]}:`: the second would replace the first without a word. Keep one of them.")
        flat.update(nested)
    return flat


def help_text(config_class, program: str) -> str:
    """`--help`: every key with its default and meaning."""
    recipes = ", ".join(sorted(item.stem for item in RECIPES.glob("*.yaml")))
    lines = [f"usage: torchrun --nproc-per-node N -m {program} [--config FILE.yaml|RECIPE] [--KEY=VALUE ...] "
             "[--resume-from-checkpoint latest|PATH]",
             f"  RECIPE: a bundled recipe by name, recipes/RECIPE.yaml ({recipes}); command-line keys win over it",
             "", "keys (default: meaning):"]
    defaults = config_class()  # a loop's own defaults override the shared sections'
    for key, item in flat_keys(config_class).items():
        section, name = key.split(".")
        default = getattr(getattr(defaults, section), name)
        lines.append(f"  --{key}={json.dumps(default)}\n      {item.metadata['help']}")
    return "\n".join(lines)


# The arguments that are not keys, refused empty: what an empty value would do, and what to give instead.
EMPTY_MEANS = {"config": ("read no config file", "a YAML file or a recipe name"),
               "resume-from-checkpoint": ("start the run afresh", "`latest` or a checkpoint path")}


def parse_args(config_class, argv: list[str], program: str):
    """Parse `--config`, `--resume-from-checkpoint` and `--key=value` / `--key value`; returns (config, resume)."""
    keys = flat_keys(config_class)
    if "--help" in argv or "-h" in argv:
        if is_global_rank_zero():  # once under torchrun, not once a process
            print(help_text(config_class, program))
        sys.exit(0)
    pairs, resume, config_file = [], "", None
    position = 0
    while position < len(argv):
        argument = argv[position]
        if not argument.startswith("--"):
            raise UserError(f"Unexpected argument `{argument}`: settings are given as `--key=value`. `--help` lists every key.")
        name, has_value, value = argument[2:].partition("=")
        if not has_value:
            # The next argument a key of its own: `--log.wandb_name $EMPTY --train.steps=100` took the key as the name
            # and trained the default steps without a word.
            if position + 1 >= len(argv) or argv[position + 1].startswith("--"):
                raise UserError(f"`--{name}` needs a value (`--{name}=VALUE`)"
                                + (f", and the next argument is `{argv[position + 1]}`" if position + 1 < len(argv) else "")
                                + ". Give one, or drop the key.")
            position += 1
            value = argv[position]
        if name in EMPTY_MEANS and not value.strip():  # `--config=$UNSET`
            effect, wanted = EMPTY_MEANS[name]
            raise UserError(f"`--{name}` is given an empty value{f' ({value!r})' if value else ''}, which would {effect} "
                            f"without a word. Give `--{name}` {wanted}, or drop it.")
        if name == "config":
            if config_file is not None:
                raise UserError(f"`--config` is given twice ({config_file} and {value}): the second would replace the "
                                "first whole, not add to it. Give one `--config` (copy the recipe and merge the keys you "
                                "want into one YAML file), or set the other recipe's keys on the command line.")
            config_file = value
        elif name == "resume-from-checkpoint":
            resume = value
        elif keys.get(name) is not None and keys[name].type in (str, "str"):
            pairs.append((name, value))  # a text key takes the text as typed (`--log.wandb_name=0001` stays 0001)
        else:
            pairs.append((name, _parse_value(name, value)))
        position += 1
    config = config_class()
    if config_file:
        path = config_path(config_file)
        check_recipe_program(path, config_file, program, config_class)
        try:
            loaded = load_yaml(path.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as error:
            raise UserError(f"Config file `{config_file}` is not valid YAML ({error}). Fix it or change `--config`.") from None
        if not isinstance(loaded, dict):
            raise UserError(f"Config file `{config_file}` must hold a mapping of sections (model:, train:, ...).")
        sections = {section.name for section in dataclasses.fields(config_class)}
        for name, value in loaded.items():  # a section whose keys are all commented out is empty, not a key
            if name in sections and value is not None and not isinstance(value, dict):
                raise UserError(f"`{name}:` in config file `{config_file}` must be a section: its keys indented below "
                                f"it (`{name}:` then `  key: value` lines), got {value!r}. Fix it or change `--config`.")
        loaded = {name: value for name, value in loaded.items() if not (name in sections and value is None)}
        for key, value in _flatten(loaded, source=config_file).items():
            _set(config, key, value, keys)
    for key, value in pairs:
        _set(config, key, value, keys)
    if config_file and "peft.method" in dict(pairs):
        _drop_file_lora_settings(config, config_class, loaded, dict(pairs))
    return config, resume


def _drop_file_lora_settings(config, config_class, loaded: dict, command_line: dict) -> None:
    """`--peft.method=none` over a config file that sets up LoRA switches LoRA off whole: the file's adapter settings
    (`peft.rank`, ...) go back to their defaults, not refused as LoRA keys without LoRA. Those set on the command line
    stay (and are refused)."""
    peft = loaded.get("peft") or {}
    if config.peft.method == "lora" or peft.get("method") != "lora":
        return
    defaults = config_class().peft
    for name in LORA_SETTINGS:
        if name in peft and f"peft.{name}" not in command_line:
            setattr(config.peft, name, getattr(defaults, name))


def config_path(value: str) -> Path:
    """`--config`'s file: a path, or the name of a bundled recipe (`dapo` is `recipes/dapo.yaml`)."""
    path, recipe = Path(value), RECIPES / f"{value}.yaml"
    if path.is_file():
        return path
    if "/" not in value and recipe.is_file():
        return recipe
    if path.exists():
        raise UserError(f"Config file `{value}` is {'a directory' if path.is_dir() else 'not a regular file'}, not a "
                        "YAML file. Change `--config`.")
    names = ", ".join(sorted(item.stem for item in RECIPES.glob("*.yaml")))
    raise UserError(f"Config file `{value}` does not exist, and it is not one of the bundled recipes ({names}). "
                    "Change `--config`.")


def recipe_program(name: str) -> str:
    """The entry point a bundled recipe is written for: `rm` is trainer.rm's, `sft_*` trainer.sft's, the rest GRPO's."""
    return "trainer.rm" if name == "rm" else "trainer.sft" if name.startswith("sft_") else "trainer.grpo"


# The config class of each entry point: a script reading a recipe as its loop does (scripts/tool_task_figures.py reads
# `tools` into GRPOConfig under its own program name) is that loop's.
PROGRAM_CONFIGS = {"trainer.sft": "SFTConfig", "trainer.grpo": "GRPOConfig", "trainer.rm": "RMConfig"}


def check_recipe_program(path: Path, value: str, program: str, config_class) -> None:
    """Refuse a bundled recipe given to another entry point (`trainer.grpo --config sft_moe` trained GRPO from the bare
    tiny-moe into the MoE SFT's `train.out_dir`, where GRPO on the MoE then found a finished "SFT")."""
    if path.resolve().parent != RECIPES.resolve():
        return
    owner = recipe_program(path.stem)
    if PROGRAM_CONFIGS[owner] != config_class.__name__:
        names = ", ".join(sorted(item.stem for item in RECIPES.glob("*.yaml") if recipe_program(item.stem) == program))
        raise UserError(f"`--config {value}` is the recipe of `{owner}`, not of `{program}`: its keys set up a run of "
                        f"`{owner}`. Run `torchrun -m {owner} --config {path.stem}`, or "
                        f"give `{program}` {f'one of its own recipes ({names})' if names else 'your own YAML file'}.")


class DuplicateKey(yaml.YAMLError):
    """A mapping that gives one key twice: plain YAML keeps the last and drops the first without a word (a second
    `train:` section replaced the whole first one)."""


class UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` refusing a key given twice in one mapping (`DuplicateKey`)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key != "<<" and key in seen:
                raise DuplicateKey(f"`{key}` is given twice, on lines {seen[key]} and {line}: the second would "
                                   "replace the first without a word")
            if isinstance(key, typing.Hashable):
                seen.setdefault(key, line)
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        """A number written with leading zeros is decimal: YAML 1.1 reads `010` as octal 8 (`--train.steps=010` ran 8
        steps, `--train.seed=0042` seeded 34) and `08` as a string."""
        text = self.construct_scalar(node).replace("_", "")
        if DECIMAL_WITH_LEADING_ZEROS.fullmatch(text):
            return int(text, 10)
        return super().construct_yaml_int(node)


DECIMAL_WITH_LEADING_ZEROS = re.compile(r"[-+]?0[0-9]+")
UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", UniqueKeyLoader.construct_yaml_int)
UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:int", DECIMAL_WITH_LEADING_ZEROS, list("-+0"))


def load_yaml(text: str):
    """`text` read as YAML (safe), refusing a key given twice in one mapping."""
    return yaml.load(text, Loader=UniqueKeyLoader)


def to_dict(config) -> dict:
    """The config as a plain nested dict (for logs and checkpoints)."""
    return dataclasses.asdict(config)


def _parse_value(name: str, text: str):
    """A command-line value read as YAML (`3`, `true`, `[0.9, 0.95]`, `{a: 1}`), or a UserError naming the key."""
    if text == "":
        return ""
    try:
        return load_yaml(text)
    except yaml.YAMLError:
        raise UserError(f"`--{name}={text}` is not a valid value (numbers, true/false, strings, lists as `[a,b]`, "
                        f"mappings as `{{key: value}}`). Change `--{name}`.") from None


def run_cli(main) -> None:
    """Run `main(argv)`; a UserError becomes a one-paragraph message on rank 0 and exit status 2, and so does a failed
    collective on the peers of a rank that stopped with one alone."""
    # megatron-core forks a writer for every background checkpoint save; once a tokenizer has run in parallel, the
    # tokenizers library prints a warning at each fork and turns its parallelism off in the child anyway.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        main(sys.argv[1:])
    except UserError as error:
        # One paragraph: a message quoting a library's multi-line error is folded onto one line.
        message = ' '.join(str(error).split())
        paragraph = f"error: {message}"
        if is_global_rank_zero():
            print(paragraph, file=sys.stderr)
        tell_torchrun(paragraph)
        tell_peers_at_startup(message)
        tell_peers_mid_run(message)  # raised on this rank alone, perhaps: a peer's collective fails, and says this
        sys.exit(2)
    except Exception as error:
        if (peer := peer_paragraph()) is not None:  # a collective that failed because a peer stopped with its paragraph
            paragraph = f"error: {' '.join(peer.split())}"
            if is_global_rank_zero():
                print(paragraph, file=sys.stderr)
            tell_torchrun(paragraph)
            sys.exit(2)
        # A fault of this rank's own: its peers must not wait for it (before the process group), nor print a failed
        # collective's traceback in place of its line (after).
        line = f"{type(error).__name__}: {' '.join(str(error).split())[:300]} (its traceback is in that node's log)"
        tell_peers_at_startup(line)
        tell_peers_mid_run(line)
        raise


def tell_torchrun(paragraph: str) -> None:
    """Under torchrun, write `paragraph` where its agent reads a failed worker's cause (the error file it names in
    $TORCHELASTIC_ERROR_FILE, in the plain-message form it reads): the failure summary torchrun prints last then
    shows the paragraph as its `traceback`, not a pointer to its docs on enabling tracebacks."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    # An unwritable file costs only the summary's line (rank 0 has printed the paragraph): no reason to fail otherwise.
    with contextlib.suppress(OSError):
        if path:
            Path(path).write_text(json.dumps({"message": paragraph, "timestamp": int(time.time())}))
