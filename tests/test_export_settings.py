"""What the Hugging Face export says about itself: the dtype its tensors are saved in, and its tokenizer's padding as
the source had it (`model.providers.declare_saved_dtype`, `keep_source_tokenizer_settings`; the runs' exports:
tests/test_precision_e2e.py)."""

import json

import pytest
import torch
import transformers

from model import build
from model.providers import declare_saved_dtype, export_hf, keep_source_tokenizer_settings, saved_dtype
from model.tiny import ensure_tiny_checkpoint


def test_the_exports_config_names_the_dtype_its_tensors_are_saved_in(tmp_path):
    """Bridge keeps the source's config.json: a bf16 run's export said float32, and `dtype="auto"` loaded it at twice
    the memory."""
    model = transformers.AutoModelForCausalLM.from_pretrained(ensure_tiny_checkpoint())
    model.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["dtype"] = "float32"  # as the source's said
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert saved_dtype(tmp_path) == "bfloat16"
    declare_saved_dtype(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto")
    assert next(loaded.parameters()).dtype == torch.bfloat16


def test_the_export_pads_only_where_its_source_did(tmp_path):
    """A tokenizer without a padding token pads with its end token for the run; its export must not keep that (a
    collator masking labels equal to pad_token_id would mask every end of turn). One with its own keeps it."""
    source, export = tmp_path / "source", tmp_path / "export"
    tokenizer = transformers.AutoTokenizer.from_pretrained(ensure_tiny_checkpoint())
    assert tokenizer.pad_token is not None
    tokenizer.save_pretrained(source)
    settings = json.loads((source / "tokenizer_config.json").read_text())
    kept = settings.pop("pad_token")
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"  # as Llama 3's (a Qwen2Tokenizer defaults its padding)
    (source / "tokenizer_config.json").write_text(json.dumps(settings))
    loaded = build.load_tokenizer(source)
    assert loaded.pad_token == loaded.eos_token  # the run's padding
    loaded.save_pretrained(export)
    assert json.loads((export / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    keep_source_tokenizer_settings(export, source)
    assert transformers.AutoTokenizer.from_pretrained(export).pad_token is None
    # transformers 5 wrote its own class name, which transformers 4 cannot load; the source's is kept, and reads as
    # the same tokenizer.
    assert json.loads((export / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert type(transformers.AutoTokenizer.from_pretrained(export)) is type(loaded)
    with_padding = tmp_path / "with_padding"
    tokenizer.save_pretrained(with_padding)
    keep_source_tokenizer_settings(with_padding, ensure_tiny_checkpoint())
    assert transformers.AutoTokenizer.from_pretrained(with_padding).pad_token == kept


def test_the_export_keeps_a_padding_token_its_source_names_in_special_tokens_map_alone(tmp_path):
    """Older tokenizers name their padding token in special_tokens_map.json only, which transformers reads: the export
    dropped it (its source's tokenizer_config.json names none), so the export had no padding token where its source
    had one."""
    source, export = tmp_path / "source", tmp_path / "export"
    transformers.AutoTokenizer.from_pretrained(ensure_tiny_checkpoint()).save_pretrained(source)
    settings = json.loads((source / "tokenizer_config.json").read_text())
    kept = settings.pop("pad_token")
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    (source / "tokenizer_config.json").write_text(json.dumps(settings))
    (source / "special_tokens_map.json").write_text(json.dumps({"pad_token": kept, "eos_token": settings["eos_token"]}))
    loaded = build.load_tokenizer(source)
    assert loaded.pad_token == kept != loaded.eos_token  # the source's own, not the run's end token
    loaded.save_pretrained(export)
    keep_source_tokenizer_settings(export, source)
    assert transformers.AutoTokenizer.from_pretrained(export).pad_token == kept  # was None


def test_the_export_leaves_out_only_bridges_bare_success_line(capsys):
    """Bridge prints a line after every export; the bare success line is left out, and every other line passes: the
    success line that says tensors were left out, and an error's lines before its exception."""
    class Bridge:
        def __init__(self, lines, error=None):
            self.lines, self.error = lines, error

        def save_hf_pretrained(self, chunks, path, show_progress):
            print("\n".join(self.lines))
            if self.error:
                raise self.error

    export_hf(Bridge(["", "Success: All tensors from the original checkpoint were written."]), [], "out")
    assert capsys.readouterr().out == ""
    extra = ("Success: All tensors from the original checkpoint were written. (2 extra tensors from generator were "
             "ignored as per strict=False).")
    export_hf(Bridge(["", extra]), [], "out")
    assert capsys.readouterr().out == extra + "\n"
    with pytest.raises(RuntimeError, match="not written"):
        export_hf(Bridge(["Error: 1 tensors from the original checkpoint were not written:", "  - lm_head.weight"],
                         RuntimeError("1 tensors ... not written")), [], "out")
    assert "  - lm_head.weight" in capsys.readouterr().out
