"""The training loops, one file each (`python -m trainer.sft`, `trainer.grpo`, `trainer.rm`), and what they share.

Importing this package binds this project's other packages first. Python puts the directory a run starts in at the
front of the import path, so a user's `model.py` or `config.py` there, or a `data/sft/` folder of JSON lines, was
imported in their place, and start-up stopped with an ImportError or AttributeError traceback.
"""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The project's packages besides this one (pyproject.toml's [tool.setuptools] packages).
PACKAGES = ("ckpt", "config", "data", "model", "tool_runtime")


def bind_project_packages() -> None:
    """Import each of `PACKAGES` from this project's folder, whatever the import path would find first by its name."""
    for name in PACKAGES:
        init = ROOT / name / "__init__.py"
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None) and pathlib.Path(module.__file__).resolve() == init:
            continue
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


bind_project_packages()
