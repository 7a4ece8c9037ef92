"""The user's own code named in the config as `module:name` (a reward function, tools, an environment class)."""

import importlib
import pathlib
import sys

from config import console
from config.errors import UserError

# The trainer's own packages (pyproject.toml's), beside this one: a user's module named like one (`data.py`,
# `model.py`) is shadowed by it.
TRAINER_ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("config", "ckpt", "data", "model", "tool_runtime", "trainer")


def load(spec: str, key: str, hint: str) -> object:
    """The object `spec` (`module:name`) names; a UserError naming `key` (the config key) when it cannot be loaded.

    `hint` ends the message: what else the key accepts. A module that fails while importing (a syntax error, a
    missing dependency of its own) is reported with its error, before any model is built."""
    module_name, colon, name = spec.partition(":")
    if not colon or not module_name or not name:
        raise UserError(f"`{key}={spec}` is not of the form `module:name`. {hint} Change `--{key}`.")
    try:
        module = importlib.import_module(module_name)
        found = getattr(module, name)
    except Exception as error:  # a user's module may fail to import in any way
        own = pathlib.Path(getattr(sys.modules.get(module_name), "__file__", None) or "/").resolve()
        if module_name in PACKAGES and own.is_relative_to(TRAINER_ROOT / module_name):  # a user's `data.py` read as ours
            raise UserError(f"`{key}={spec}`: `{module_name}` is this trainer's own package ({own}), which has no "
                            f"`{name}`: a file of yours of that name is shadowed by it. Rename your file "
                            f"(`my_{module_name}.py`, say) and change `--{key}`. {hint}") from None
        raise UserError(f"`{key}={spec}`: cannot load `{name}` from module `{module_name}` "
                        f"({type(error).__name__}: {error}). Put the module on PYTHONPATH (or run from its folder) "
                        f"and check it imports. {hint} Change `--{key}`.") from None
    if getattr(module, "__file__", None):
        console.USER_FILES.add(module.__file__)  # its warnings print on every rank that meets them
    return found
