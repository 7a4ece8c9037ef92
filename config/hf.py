"""Reading a Hugging Face checkpoint's JSON files (config.json, generation_config.json) for the checks and the builders."""

import json
from pathlib import Path

from config.errors import UserError
from config.sections import HF_EXPERT_KEYS


def read_hf_config(path: Path, key: str, name: str = "config.json") -> dict:
    """config.json (or another JSON file `name`, such as generation_config.json, when present: else {}) of an HF
    checkpoint directory, or a UserError naming the file and `key`."""
    config_file = Path(path) / name
    if not config_file.is_file():
        if name != "config.json":
            return {}
        raise UserError(f"`{key}={path}` is not a Hugging Face checkpoint directory (no config.json there). "
                        f"Point `--{key}` at a directory saved with `save_pretrained`, or use `tiny`.")
    try:
        return json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise UserError(f"`{config_file}` is not valid JSON ({error}). Fix the file or point `--{key}` elsewhere.") from None


def hf_expert_count(hf: dict) -> int:
    """Routed experts per MoE layer of an HF config.json (0: a dense model)."""
    return next((int(hf[key]) for key in HF_EXPERT_KEYS if hf.get(key)), 0)
