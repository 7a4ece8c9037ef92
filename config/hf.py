"""Reading a Hugging Face checkpoint's JSON files (config.json, generation_config.json) for the checks and the builders."""

import functools
import inspect
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
        loaded = json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise UserError(f"`{config_file}` is not valid JSON ({error}). Fix the file or point `--{key}` elsewhere.") from None
    if not isinstance(loaded, dict):
        raise UserError(f"`{config_file}` holds a JSON {type(loaded).__name__}, not the mapping of settings a "
                        f"checkpoint's config has. Fix the file or point `--{key}` elsewhere.")
    return loaded


# Files a tokenizer is read from (any one of them); without any, transformers makes an empty tokenizer that writes
# every text as nothing.
TOKENIZER_FILES = ("tokenizer.json", "tekken.json", "vocab.json", "vocab.txt", "*.model", "*.tiktoken")
CAUSAL, CLASSIFIER = "ForCausalLM", "ForSequenceClassification"  # the ends of the architectures' names


def check_tokenizer_files(path: Path, key: str) -> None:
    """Refuse a checkpoint directory that holds no tokenizer, naming `key`."""
    path = Path(path)
    if not any(found.is_file() for pattern in TOKENIZER_FILES for found in path.glob(pattern)):
        raise UserError(f"`{key}={path}` holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): transformers would "
                        "make an empty one, and every text would become no tokens. Save the model's tokenizer beside "
                        f"it (`tokenizer.save_pretrained(DIR)`), or point `--{key}` at a directory that has one.")


def architecture(hf: dict) -> str:
    """The architecture an HF config.json names first ("" when none)."""
    return (hf.get("architectures") or [""])[0] or ""


def is_classifier(hf: dict) -> bool:
    """Whether an HF config.json is a sequence classifier's (a reward model: a score head, no language-model head)."""
    return architecture(hf).endswith(CLASSIFIER)


def causal_architecture(hf: dict) -> str | None:
    """The causal LM a sequence classifier's backbone is read as (Qwen2ForSequenceClassification: Qwen2ForCausalLM);
    None when transformers has no such class, as for an encoder's classifier (DeBERTa's)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = architecture(hf).removesuffix(CLASSIFIER) + CAUSAL
    return causal if causal in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() else None


def hf_expert_count(hf: dict) -> int:
    """Routed experts per MoE layer of an HF config.json (0: a dense model)."""
    return next((int(hf[key]) for key in HF_EXPERT_KEYS if hf.get(key)), 0)


def special_texts(tokenizer) -> set[str]:
    """The text of every special token of a tokenizer (its named ones and every added token marked special)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {*tokenizer.all_special_tokens, *(token.content for token in added.values() if getattr(token, "special", False))}


def first_special(tokenizer, text: str) -> str | None:
    """The special token that occurs first in `text` (the longest at one position), or None."""
    hits = [(text.find(special), -len(special), special) for special in special_texts(tokenizer) if special and special in text]
    return min(hits)[2] if hits else None


def turn_end(tokenizer) -> str | None:
    """The token that closes an assistant turn in the chat template: the first special token after an assistant's
    content when a turn is rendered (ChatML's `<|im_end|>`, also under a base model's tokenizer whose end token is
    `<|endoftext|>`; Llama 3's `<|eot_id|>`), else the end token."""
    if getattr(tokenizer, "chat_template", None) is None:
        return tokenizer.eos_token
    marker = "Fine."
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hello."},
                                              {"role": "assistant", "content": marker}], tokenize=False)
    after = rendered[rendered.rindex(marker) + len(marker):] if marker in rendered else ""
    return first_special(tokenizer, after) or tokenizer.eos_token


TEMPLATE_VARIABLES = "chat_template_variables"  # the tokenizer's attribute holding `data.chat_template_kwargs`


def set_template_variables(tokenizer, variables: dict) -> None:
    """`data.chat_template_kwargs`: variables the tokenizer's chat template gets at every rendering from here on (every
    caller renders through `apply_chat_template`: prompts, training rows, multi-turn rollouts, the tools' probes), as
    transformers passes its extra keywords to the template; `{"enable_thinking": false}` is Qwen3's non-thinking mode.
    Cache keys cover them (`data.encode.tokenizer_digest_parts`). A name `apply_chat_template` takes itself is refused."""
    if not variables:
        return
    unnamed = [name for name in variables if not isinstance(name, str)]
    if unnamed:  # `{1: 2}`: a TypeError at the first rendering, mid-start-up
        raise UserError(f"`data.chat_template_kwargs` has {', '.join(repr(name) for name in unnamed)} as a variable's "
                        "name; the template's variables are named by text, such as `{enable_thinking: false}`. Change "
                        "`--data.chat_template_kwargs`.")
    own = [name for name, parameter in inspect.signature(tokenizer.apply_chat_template).parameters.items()
           if parameter.kind is not parameter.VAR_KEYWORD]
    # `messages`: transformers renders the template with the conversation under that name, beside these variables.
    taken = [name for name in variables if name in own or name in ("conversation", "messages")]
    if taken:
        raise UserError(f"`data.chat_template_kwargs` sets {', '.join(f'`{name}`' for name in taken)}, which "
                        "`apply_chat_template` takes itself (the trainer sets them for each rendering); the key is for "
                        "the template's own variables, such as `{enable_thinking: false}` for Qwen3. Remove them from "
                        "`--data.chat_template_kwargs`.")
    tokenizer.apply_chat_template = functools.partial(tokenizer.apply_chat_template, **variables)
    setattr(tokenizer, TEMPLATE_VARIABLES, dict(variables))
