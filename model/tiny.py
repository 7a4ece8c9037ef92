"""The embedded default models, built offline with their own arithmetic tokenizer: `tiny`, a 0.8M-parameter Qwen2, and
`tiny-moe`, a 1.5M-parameter Qwen3-MoE (8 experts, top-2, every layer sparse) for expert parallelism and routing replay.

The same recipe also builds a random-weight model of Qwen2.5-0.5B's shape for the GPU check.

The tokenizer is byte-level BPE trained on the bundled task's text: `train_tokenizer(text)` with
`data.arithmetic.training_text(TOKENIZER_SETTINGS["training_problems"])`, which its caller passes (model/ imports
nothing from data/). The result, vocabulary and merges, is kept in `tiny_tokenizer.json`, which the build reads;
tests/test_tiny_and_arithmetic.py trains it anew and compares. After a change to the recipe, write
`train_tokenizer(...).to_str(pretty=True)` to that file.
"""

import hashlib
import json
import math
import os
import pathlib
import shutil
import tempfile

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from config import process

# Bump when the build code changes in a way the recipe below does not capture.
RECIPE_VERSION = 1
COMPLETE_MARKER = ".complete"
WEIGHT_SEED = 0

PAD_TOKEN, TURN_START, TURN_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen2.5's chat template, shortened for a 512-token vocabulary: with `tools=` a one-line system turn names each
# tool and its parameters; assistant tool calls render as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
# and tool results as `<tool_response>` blocks in one user turn, both as Qwen2.5 writes them. Without tools a
# conversation renders exactly as the plain template did (the default runs' token ids are unchanged).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\nTools:' }}"
    "{%- for tool in tools %}{%- set function = tool.function if tool.function is defined else tool %}"
    "{{ ' ' + function.name + '(' + (function.parameters.properties.keys() | join(', ')) + ')' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{ '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}{%- set call = call.function if call.function is defined else call %}"
    "{{ ('\\n' if message.content or not loop.first else '') + '<tool_call>\\n{\"name\": \"' + call.name"
    " + '\", \"arguments\": ' + (call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Role lines the chat template emits; repeated so they clear min_frequency and become merges.
CHAT_LITERALS = ["system\n", "user\n", "assistant\n"] * 2

TOKENIZER_SETTINGS = {
    "vocab_size": 512,
    "min_frequency": 2,
    "special_tokens": [PAD_TOKEN, TURN_START, TURN_END],
    "training_problems": 2000,
    "chat_template": CHAT_TEMPLATE,
    "split_pattern": PRETOKENIZE_REGEX,
}
TOKENIZER_FILE = pathlib.Path(__file__).with_name("tiny_tokenizer.json")

# Qwen2.5-0.5B's shape family, scaled down; vocab_size is filled in from the tokenizer.
MODEL_CONFIG = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 352,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "max_position_embeddings": 512,
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "dtype": "float32",
}
# Qwen3-30B-A3B's shape family (Qwen3-MoE: per-head q/k norms, every layer's MLP a routed mixture of experts with
# normalised top-k weights), scaled down to the tiny model's attention; `intermediate_size` is unused (no dense layer).
MOE_MODEL_CONFIG = {
    **{key: value for key, value in MODEL_CONFIG.items() if key not in ("use_sliding_window", "tie_word_embeddings")},
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 96,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
}
# `model.path` names of the embedded models: the cache directory's prefix and the shape each is built with.
EMBEDDED = {"tiny": ("tiny-qwen2", MODEL_CONFIG), "tiny-moe": ("tiny-qwen3-moe", MOE_MODEL_CONFIG)}
# Embedding rows are split across tensor-parallel ranks, so the padded vocab must divide evenly.
VOCAB_MULTIPLE = 64

# Qwen2.5-0.5B's exact shape (494M parameters with its 151,936-row tied embedding), random weights, for GPU
# throughput checks (scripts/gpu_check.sh). It keeps the tiny tokenizer: throughput depends on the
# embedding's size, not on which rows the tokenizer reaches, and nothing has to be downloaded.
QWEN2_0P5B_CONFIG = {
    **MODEL_CONFIG,
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "dtype": "bfloat16",
}
QWEN2_0P5B_VOCAB_SIZE = 151936


def recipe_hash(model_config: dict = MODEL_CONFIG, vocab_size: int | None = None) -> str:
    """Return a short hash of everything that determines the built checkpoint: the tokenizer file's contents too (a
    retrained `tiny_tokenizer.json` under the same settings, its merges changed, was served the old build's tokenizer)."""
    recipe = {"version": RECIPE_VERSION, "seed": WEIGHT_SEED, "model": model_config, "tokenizer": TOKENIZER_SETTINGS,
              "tokenizer_file": hashlib.sha256(TOKENIZER_FILE.read_bytes()).hexdigest()}
    if vocab_size is not None:
        recipe["vocab_size"] = vocab_size
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def train_tokenizer(text: str) -> Tokenizer:
    """The tokenizer's recipe: byte-level BPE trained on `text` (the bundled arithmetic text) and the chat roles."""
    tokenizer = Tokenizer(models.BPE())
    # AutoTokenizer loads every qwen2 checkpoint as Qwen2Tokenizer, which rebuilds this exact
    # pipeline (NFC, Qwen2's split with one token per digit, then bytes) around our vocab and merges;
    # training with the same pipeline keeps the merges valid for the tokens it will produce.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_SETTINGS["vocab_size"],
        min_frequency=TOKENIZER_SETTINGS["min_frequency"],
        special_tokens=TOKENIZER_SETTINGS["special_tokens"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([text, *CHAT_LITERALS], trainer=trainer)
    return tokenizer


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The tiny tokenizer (`TOKENIZER_FILE`) wrapped with the chat template."""
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(TOKENIZER_FILE)), eos_token=TURN_END, pad_token=PAD_TOKEN, bos_token=None
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_checkpoint(directory: pathlib.Path, model_config: dict = MODEL_CONFIG, vocab_size: int | None = None) -> None:
    """Write the tokenizer, config and seeded weights of the tiny model (or another shape: a Qwen3-MoE when
    `model_config` names experts) into `directory`."""
    family = "Qwen3Moe" if "num_experts" in model_config else "Qwen2"
    config_class, model_class = getattr(transformers, f"{family}Config"), getattr(transformers, f"{family}ForCausalLM")
    tokenizer = build_tokenizer()
    vocab_size = vocab_size or math.ceil(len(tokenizer) / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    end_of_turn = tokenizer.convert_tokens_to_ids(TURN_END)
    config = config_class(
        **model_config,
        vocab_size=vocab_size,
        eos_token_id=end_of_turn,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    # Seed a forked RNG so building the model never shifts the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(WEIGHT_SEED)
        model = model_class(config).to(getattr(torch, model_config["dtype"]))
    model.generation_config = transformers.GenerationConfig(eos_token_id=end_of_turn, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory, safe_serialization=True)
    # Keep the chat template inside tokenizer_config.json, where older readers look for it.
    tokenizer.save_pretrained(directory, save_jinja_files=False)


def ensure_tiny_checkpoint(cache_dir: str | os.PathLike | None = None, name: str = "tiny") -> pathlib.Path:
    """Return the directory of the embedded Hugging Face checkpoint `name` (`EMBEDDED`), building it once per recipe."""
    cache_dir = pathlib.Path(cache_dir) if cache_dir is not None else process.cache_dir()
    prefix, model_config = EMBEDDED[name]
    shape = () if model_config is MODEL_CONFIG else (model_config,)
    return _ensure_built(cache_dir / f"{prefix}-{recipe_hash(model_config)}",
                         lambda directory: build_checkpoint(directory, *shape))


def ensure_qwen2_0p5b_checkpoint(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Return the directory of the random-weight Qwen2.5-0.5B-shaped checkpoint, building it once (about 1 GB, bf16)."""
    cache_dir = pathlib.Path(cache_dir) if cache_dir is not None else process.cache_dir()
    target = cache_dir / f"qwen2-0.5b-random-{recipe_hash(QWEN2_0P5B_CONFIG, QWEN2_0P5B_VOCAB_SIZE)}"
    return _ensure_built(target, lambda directory: build_checkpoint(directory, QWEN2_0P5B_CONFIG, QWEN2_0P5B_VOCAB_SIZE))


def _ensure_built(target: pathlib.Path, build) -> pathlib.Path:
    """Build a checkpoint into `target` with `build(directory)` unless a complete one is there."""
    if (target / COMPLETE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several torchrun ranks may get here at once: each builds privately and renames into place,
    # which is atomic on one filesystem, so readers never see a half-written checkpoint.
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(staging)
        (staging / COMPLETE_MARKER).touch()
        os.rename(staging, target)
    except OSError:
        if not (target / COMPLETE_MARKER).exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
