"""The user's own code named in the config as `module:name` (a reward function, tools, an environment class)."""

import importlib

from config import console
from config.errors import UserError


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
        raise UserError(f"`{key}={spec}`: cannot load `{name}` from module `{module_name}` "
                        f"({type(error).__name__}: {error}). Put the module on PYTHONPATH (or run from its folder) "
                        f"and check it imports. {hint} Change `--{key}`.") from None
    if getattr(module, "__file__", None):
        console.USER_FILES.add(module.__file__)  # its warnings print on every rank that meets them
    return found
