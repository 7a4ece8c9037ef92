"""Unit tests for the arithmetic problem generator and the embedded tiny checkpoint."""

import json
import pathlib
import re
import shutil

import pytest
import tokenizers
import torch
import transformers

from data import arithmetic
from data.arithmetic import EVAL_SEED, TRAIN_SEED, extract_final_answer, generate_problems, training_text
from model import tiny
from model.tiny import ensure_tiny_checkpoint

# Pinned: 448 * 128 tied embeddings + 4 layers * 184,832 + 128 final norm.
TINY_PARAMETER_COUNT = 796_800
TINY_VOCAB_SIZE = 448

# --- arithmetic -------------------------------------------------------------------------------


def test_generation_is_deterministic_per_seed():
    assert generate_problems(50, seed=3) == generate_problems(50, seed=3)
    assert generate_problems(50, seed=3) != generate_problems(50, seed=4)
    assert TRAIN_SEED != EVAL_SEED
    assert training_text(count=10).startswith(generate_problems(1, TRAIN_SEED)[0]["question"])


def test_answers_are_gsm8k_formatted_and_correct():
    for problem in generate_problems(500, seed=EVAL_SEED):
        reasoning, final_line = problem["answer"].split("\n")
        left, symbol, right, result = re.fullmatch(r"(\d+) ([+\-*]) (\d+) = (\d+)", reasoning).groups()
        assert int(result) == arithmetic.OPERATIONS[symbol](int(left), int(right)) >= 0
        assert final_line == f"#### {result}"
        assert re.findall(r"\d+", problem["question"]) == [left, right]


@pytest.mark.parametrize(
    "text, strict, expected",
    [
        ("3 + 5 = 8\n#### 8", True, "8"),
        ("#### 1 then\n#### 1,234.", True, "1234"),
        ("so the answer is #### $42", True, "42"),
        ("#### -7", True, "-7"),
        ("#### +7", True, "7"),
        ("#### .5", True, ".5"),
        ("#### $ 18", True, "18"),
        ("The answer is 12.", True, None),
        ("#### none", True, None),
        ("The answer is 12.", False, "12"),
        ("3 + 5 = 8, so 1,000 apples.", False, "1000"),
        ("half of it, .5 of a cake", False, ".5"),
        ("it went up by +3", False, "3"),
        ("no digits here", False, None),
    ],
)
def test_extract_final_answer(text, strict, expected):
    assert extract_final_answer(text, strict=strict) == expected


# --- tiny checkpoint ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("cache"))


def test_tiny_model_shape(checkpoint):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    assert model.config.model_type == "qwen2"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.vocab_size == TINY_VOCAB_SIZE and TINY_VOCAB_SIZE % 64 == 0
    assert sum(parameter.numel() for parameter in model.parameters()) == TINY_PARAMETER_COUNT
    assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_tiny_tokenizer_and_chat_template(checkpoint):
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    problem = generate_problems(1, EVAL_SEED)[0]
    text = f"{problem['question']}\n{problem['answer']}"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    messages = [{"role": "user", "content": "1 + 2?"}, {"role": "assistant", "content": "#### 3"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "<|im_start|>user\n1 + 2?<|im_end|>\n<|im_start|>assistant\n#### 3<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == model.config.eos_token_id == model.generation_config.eos_token_id == end_of_turn
    assert tokenizer.pad_token_id == model.config.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert len(tokenizer) <= model.config.vocab_size


def test_committed_tokenizer_is_the_one_trained_on_the_bundled_text():
    """model/tiny_tokenizer.json is the recipe's result on data.arithmetic's training text (model/ cannot import data/)."""
    trained = tiny.train_tokenizer(training_text(tiny.TOKENIZER_SETTINGS["training_problems"]))
    assert trained.to_str() == tokenizers.Tokenizer.from_file(str(tiny.TOKENIZER_FILE)).to_str()


def test_a_retrained_tokenizer_file_is_a_new_build(tmp_path, monkeypatch):
    """The built tiny model is kept under a hash of its recipe; a regenerated `tiny_tokenizer.json` (same settings,
    other merges) was served the earlier build, whose tokenizer wrote 14 ids where the file's writes 35."""
    first = ensure_tiny_checkpoint(tmp_path)
    spec = json.loads(tiny.TOKENIZER_FILE.read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:-200]
    changed = tmp_path / "retrained.json"
    changed.write_text(json.dumps(spec))
    monkeypatch.setattr(tiny, "TOKENIZER_FILE", changed)
    second = ensure_tiny_checkpoint(tmp_path)
    text = "Tom has 12 apples and gives 3 away."
    wanted = tokenizers.Tokenizer.from_file(str(changed)).encode(text).ids
    assert len(wanted) == 35 and second != first
    assert tokenizers.Tokenizer.from_file(str(second / "tokenizer.json")).encode(text).ids == wanted


def test_auto_tokenizer_matches_trained_tokenizer(checkpoint):
    # AutoTokenizer rebuilds qwen2 tokenizers as Qwen2Tokenizer; its ids must match what was trained.
    trained = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    loaded = transformers.AutoTokenizer.from_pretrained(checkpoint)
    for problem in generate_problems(100, EVAL_SEED):
        text = f"<|im_start|>user\n{problem['question']}<|im_end|>\n{problem['answer']}"
        assert loaded(text)["input_ids"] == trained.encode(text).ids


def test_tiny_build_is_byte_identical_and_leaves_rng_alone(checkpoint, tmp_path):
    rng_state = torch.get_rng_state()
    rebuilt = ensure_tiny_checkpoint(tmp_path)
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert rebuilt.name == checkpoint.name
    for name in ["model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"]:
        assert (rebuilt / name).read_bytes() == (checkpoint / name).read_bytes(), name


def test_tiny_checkpoint_is_reused(checkpoint, monkeypatch):
    modified = (checkpoint / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(tiny, "build_checkpoint", lambda directory: pytest.fail("rebuilt a cached checkpoint"))
    assert ensure_tiny_checkpoint(checkpoint.parent) == checkpoint
    assert (checkpoint / "model.safetensors").stat().st_mtime_ns == modified


def test_tiny_build_losing_the_rename_race_uses_the_winner(checkpoint, tmp_path, monkeypatch):
    target = tmp_path / checkpoint.name

    def build_while_another_rank_finishes(directory):
        shutil.copytree(checkpoint, target)
        (directory / "partial").touch()

    monkeypatch.setattr(tiny, "build_checkpoint", build_while_another_rank_finishes)
    assert ensure_tiny_checkpoint(tmp_path) == target
    assert sorted(path.name for path in tmp_path.iterdir()) == [checkpoint.name]
    assert not (target / "partial").exists()


def test_default_cache_dir_follows_environment(tmp_path, monkeypatch):
    from config import process

    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path))
    assert process.cache_dir() == tmp_path
    monkeypatch.delenv("TRAINER_CACHE_DIR")
    assert process.cache_dir() == pathlib.Path.home() / ".cache" / "megatron-trainer"
