"""Unit tests for the SFT data pipeline: loading, loss masks, truncation, packing and batch order."""

import json
import logging
import types
from pathlib import Path

import datasets
import numpy
import pytest
import torch
import transformers

from data.batches import Example, collate, collate_packed, pack, padded_size, token_budget_microbatches
from data.conversations import DropReport, load_rows, to_conversations
from data import conversations
from data.encode import encode_texts
from data.sft import BatchSchedule, build_examples, cached_examples, tokenize_conversation, tokenize_conversations
from model.tiny import ensure_tiny_checkpoint
from config.errors import UserError

GSM8K = Path(__file__).resolve().parents[2] / "shared/data/gsm8k"
# Pinned for the tiny tokenizer at max_seq_len=512: the tiny BPE is trained on arithmetic text only,
# so GSM8K prose takes ~400 tokens a sample; the longest prompts leave no answer token after truncation.
GSM8K_USED, GSM8K_DROPPED, GSM8K_TRUNCATED = 7463, 10, 1539


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """Build (or reuse) the tiny checkpoint in a per-session cache."""
    return ensure_tiny_checkpoint(tmp_path_factory.getbasetemp() / "tiny-cache")


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    """The tiny checkpoint's tokenizer, with its Qwen-style chat template."""
    return transformers.AutoTokenizer.from_pretrained(checkpoint)


def learned_spans(tokenizer, input_ids: list[int], loss_mask: list[int]) -> list[str]:
    """Decode each contiguous run of loss-masked tokens."""
    spans, current = [], []
    for token, flag in zip(input_ids, loss_mask):
        if flag:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    spans += [current] if current else []
    return [tokenizer.decode(span, skip_special_tokens=False) for span in spans]


# --- loss masking ---------------------------------------------------------------------------------


def test_loss_mask_covers_exactly_the_assistant_content_and_its_end_of_turn(tokenizer):
    messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5\n#### 5"},
    ]
    input_ids, loss_mask = tokenize_conversation(messages, tokenizer)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert input_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert len(loss_mask) == len(input_ids) and set(loss_mask) == {0, 1}
    assert learned_spans(tokenizer, input_ids, loss_mask) == ["2 + 3 = 5\n#### 5<|im_end|>"]
    unlearned = [token for token, flag in zip(input_ids, loss_mask) if not flag]
    assert tokenizer.decode(unlearned, skip_special_tokens=False) == (
        "<|im_start|>system\nYou add numbers.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n\n"
    )


def test_a_template_that_trims_content_learns_the_text_it_shows(checkpoint):
    """Llama 3's template renders `content | trim`: a response with surrounding whitespace learns the trimmed text the
    template shows (it refused the whole run, naming the model, over one such row)."""
    trimming = transformers.AutoTokenizer.from_pretrained(checkpoint)
    trimming.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
                              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5\n#### 5\n"}]
    input_ids, loss_mask = tokenize_conversation(messages, trimming)
    assert learned_spans(trimming, input_ids, loss_mask) == ["2 + 3 = 5\n#### 5<|im_end|>"]
    # Qwen3's writes an empty <think></think> block before the last turn's content: learned with it (the model writes
    # it after the generation prompt), where the run was refused.
    thinking = transformers.AutoTokenizer.from_pretrained(checkpoint)
    thinking.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                              "<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
                              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    input_ids, loss_mask = tokenize_conversation(messages, thinking)
    assert learned_spans(thinking, input_ids, loss_mask) == ["<think>\n\n</think>\n\n2 + 3 = 5\n#### 5\n<|im_end|>"]


# Qwen3's chat template as its checkpoints ship it, without the tool parts: a think block is rendered only on the
# assistant turns after the last user turn, and a `<think>...</think>` opening the content is moved into one.
QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and not("
    "message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') }}{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and "
    "enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def test_qwen3_multi_turn_rows_learn_each_turn_as_the_whole_conversation_renders_it(checkpoint, caplog):
    """Qwen3's template renders a turn differently once a user turn follows it (its think block goes): every turn is
    learned as the whole conversation shows it (such rows refused the run: "rendering more turns rewrites earlier
    ones"). `reasoning_content` is kept from the data and rendered; a `<think>` block opening the content too."""
    qwen3 = transformers.AutoTokenizer.from_pretrained(checkpoint)
    qwen3.chat_template = QWEN3_TEMPLATE
    plain = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"},
             {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]
    input_ids, loss_mask = tokenize_conversation(plain, qwen3)
    assert input_ids == encode_texts([qwen3.apply_chat_template(plain, tokenize=False)], qwen3)[0]
    assert learned_spans(qwen3, input_ids, loss_mask) == ["2<|im_end|>", "<think>\n\n</think>\n\n4<|im_end|>"]
    row = {"messages": [plain[0], {**plain[1], "reasoning_content": "one and one"}, plain[2],
                        {**plain[3], "reasoning_content": "two and two"}]}
    conversations, _ = to_conversations([row], messages_field="messages")
    assert conversations[0][3]["reasoning_content"] == "two and two"
    expected = ["2<|im_end|>", "<think>\ntwo and two\n</think>\n\n4<|im_end|>"]
    assert learned_spans(qwen3, *tokenize_conversation(conversations[0], qwen3)) == expected
    # A template that leaves reasoning out (the tiny model's ChatML, as Qwen2.5's) says it is not learned.
    from data.sft import warn_if_reasoning_unrendered

    with caplog.at_level(logging.WARNING):
        warn_if_reasoning_unrendered(conversations, qwen3)
        assert "reasoning_content" not in caplog.text
        warn_if_reasoning_unrendered(conversations, transformers.AutoTokenizer.from_pretrained(checkpoint))
    assert "does not render the assistant turns' `reasoning_content`: it is not learned" in caplog.text
    inline = [plain[0], {"role": "assistant", "content": "<think>\none and one\n</think>\n\n2"}, plain[2],
              {"role": "assistant", "content": "<think>two and two</think>4"}]
    assert learned_spans(qwen3, *tokenize_conversation(inline, qwen3)) == expected



def test_chat_template_kwargs_reach_every_rendering_and_the_caches(checkpoint, tmp_path):
    """`data.chat_template_kwargs` (`{enable_thinking: false}`, Qwen3's non-thinking mode) could not be given: GRPO's
    prompts always ended with `<|im_start|>assistant\\n`, so a Qwen3 policy spent its completions thinking. Now the
    variables reach every rendering: prompts end with the empty think block (a cache entry of the prompts rendered
    without them is not read), SFT learns the last turn after it, and a name `apply_chat_template` takes is refused."""
    from config.cli import parse_args
    from config.hf import set_template_variables
    from config.loops import GRPOConfig
    from data import prompts as prompt_data

    config, _ = parse_args(GRPOConfig, ["--data.chat_template_kwargs={enable_thinking: false}"], "trainer.grpo")
    assert config.data.chat_template_kwargs == {"enable_thinking": False}
    thinking, plain = (transformers.AutoTokenizer.from_pretrained(checkpoint) for _ in range(2))
    thinking.chat_template = plain.chat_template = QWEN3_TEMPLATE
    set_template_variables(thinking, config.data.chat_template_kwargs)
    messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "#### 5"}]
    rendered = {name: thinking.decode(prompt_data.prompts_from_conversations([messages], tokenizer, cache_dir=tmp_path)[0].ids)
                for name, tokenizer in (("plain", plain), ("thinking", thinking))}
    assert rendered["plain"].endswith("<|im_start|>assistant\n")
    assert rendered["thinking"] == rendered["plain"] + "<think>\n\n</think>\n\n"
    assert len(list((tmp_path / "prompts").glob("*.npz"))) == 2
    # SFT: the empty think block is the prompt's (the model does not write it), so only the answer is learned.
    assert learned_spans(plain, *tokenize_conversation(messages, plain)) == ["<think>\n\n</think>\n\n#### 5<|im_end|>"]
    assert learned_spans(thinking, *tokenize_conversation(messages, thinking)) == ["#### 5<|im_end|>"]
    # Rows of several assistant turns: Qwen3 writes the non-thinking prompt's block on the last turn only; refused by name.
    two_turns = [*messages, {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "#### 6"}]
    with pytest.raises(UserError, match=r"here with `data.chat_template_kwargs=\{'enable_thinking': False\}`"):
        tokenize_conversation(two_turns, thinking)
    with pytest.raises(UserError, match=r"`data.chat_template_kwargs` sets `tools`, which `apply_chat_template` takes"):
        set_template_variables(plain, {"tools": [], "enable_thinking": False})


def test_chat_template_kwargs_that_no_template_can_take_are_refused_by_name(checkpoint):
    """`{messages: [...]}` (the name transformers renders the conversation under) and `{1: 2}` (a name that is no
    text) passed start-up and ended the run at its first rendering with a TypeError traceback ("got multiple values
    for keyword argument 'messages'", "keywords must be strings"); now each is one paragraph naming the key."""
    from config.hf import set_template_variables

    for variables, named in (({"messages": [], "enable_thinking": False}, "sets `messages`"), ({1: 2}, "has 1 as a")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
        with pytest.raises(UserError, match=f"`data.chat_template_kwargs` {named}.*--data.chat_template_kwargs"):
            set_template_variables(tokenizer, variables)
        assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)  # left as it was

def test_a_generation_prompt_the_written_turns_do_not_start_with_is_refused_by_name(checkpoint):
    """DeepSeek-R1's template opens a think block in the generation prompt but writes past turns without it: learning
    the turns as written would teach a start the prompt never gives, so the template is refused, its prompt named."""
    opening = transformers.AutoTokenizer.from_pretrained(checkpoint)
    opening.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    with pytest.raises(UserError, match=r"generation prompt '<\|im_start\|>assistant\\n<think>\\n' is not how it renders"):
        tokenize_conversation([{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}], opening)


def sentencepiece_tokenizer(legacy: bool, chat_template: str):
    """A Llama-family fast tokenizer trained here (byte-fallback BPE over `▁`-joined words, as SentencePiece models
    convert): `legacy` prepends `▁` by a normalizer as Llama 2's does, else by a Metaspace pre-tokenizer as Mistral's."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    if legacy:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    text = [f"What is {a} + {b}? It is {a + b}." for a in range(30) for b in range(30)]
    alphabet = [chr(code) for code in range(32, 127)] + ["▁", "\n"]
    backend.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                          initial_alphabet=alphabet, show_progress=False))
    tokenizer = transformers.LlamaTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", legacy=legacy, add_bos_token=False)
    tokenizer.chat_template = chat_template
    return tokenizer


LLAMA2_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + "
                   "message['content'].strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
                   "{{ ' ' + message['content'].strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
                    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}")


# Mistral-7B-Instruct-v0.3's handling of a system message: written into the user turn only when that turn is the last
# message, so a conversation that ends with the answer never shows it.
MISTRAL_V03_SYSTEM_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}")


def test_a_template_that_writes_the_system_message_only_last_is_refused_with_what_to_do(tokenizer):
    """Mistral v0.3 writes a system message before the last user turn only: the context of the answer shows it, the
    whole conversation does not, so no mask can be cut from the whole. The refusal says why and what to change."""
    mistral = transformers.AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    mistral.chat_template = MISTRAL_V03_SYSTEM_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "5."}]
    with pytest.raises(UserError) as error:
        tokenize_conversation(messages, mistral)
    assert "rendering more turns rewrites earlier ones (this conversation has a system message" in str(error.value)
    assert "fold it into the first user message, or leave it out" in str(error.value)
    # Without the system message the same template is learned as written.
    input_ids, loss_mask = tokenize_conversation(messages[1:], mistral)
    assert learned_spans(mistral, input_ids, loss_mask) == [" 5.<|im_end|>"]


@pytest.mark.parametrize("legacy, chat_template", [(True, LLAMA2_TEMPLATE), (False, MISTRAL_TEMPLATE)],
                         ids=["llama2", "mistral"])
def test_sentencepiece_templates_learn_on_the_whole_renderings_ids(legacy, chat_template):
    """Mistral's and Llama 2's templates have no generation prompt, and their tokenizers write a word differently at
    the start of a text (`▁It` alone, `It` after `[/INST]`): the ids are the whole rendering's, the mask follows each
    token's characters (every row was refused: the turns tokenized alone differed from the whole)."""
    from data.sft import split_turns, tokenize_pieces

    tokenizer = sentencepiece_tokenizer(legacy, chat_template)
    messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is 5."},
                {"role": "user", "content": "What is 4 + 4?"}, {"role": "assistant", "content": "It is 8."}]
    input_ids, loss_mask = tokenize_conversation(messages, tokenizer)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert input_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    spaced = " " if legacy else ""  # Llama 2's turn is " content </s>"
    assert learned_spans(tokenizer, input_ids, loss_mask) == [f"It is 5.{spaced}</s>", f"It is 8.{spaced}</s>"]
    unlearned = tokenizer.decode([t for t, f in zip(input_ids, loss_mask) if not f])
    assert "It is" not in unlearned and unlearned.count("[INST]") == 2
    if not legacy:  # the pieces alone tokenize otherwise: what refused every Mistral row
        assert tokenize_pieces(*split_turns(messages, tokenizer), tokenizer) is None
    # Padding and truncation a tokenizer.json carries are not applied (padded ids after the end token were learned).
    tokenizer.backend_tokenizer.enable_padding(pad_id=0, pad_token="<unk>")
    tokenizer.backend_tokenizer.enable_truncation(max_length=8)
    shorter = messages[:2]
    assert tokenize_conversations([messages, shorter], tokenizer) == [
        (input_ids, loss_mask), tokenize_conversations([shorter], sentencepiece_tokenizer(legacy, chat_template))[0]]
    assert tokenizer.backend_tokenizer.padding["pad_id"] == 0 and tokenizer.backend_tokenizer.truncation["max_length"] == 8
    from data.tool_text import encode_plain  # a tool result's ids, as GRPO appends them

    text = "It is 5. What is 4 + 4? It is 8."
    assert encode_plain(tokenizer, text) == encode_plain(sentencepiece_tokenizer(legacy, chat_template), text)


def test_a_base_models_tokenizer_learns_and_stops_at_the_templates_turn_end(checkpoint, tmp_path):
    """Qwen2.5's base checkpoints (the README's example) end text with <|endoftext|> while their ChatML template closes
    turns with <|im_end|>: the turn's end is the first special token after the content (the run was refused); it is
    an end id of generation, and the export's generation_config.json lists it."""
    from config.hf import turn_end
    from model.generate import end_token_ids
    from model.providers import declare_end_ids

    base = transformers.AutoTokenizer.from_pretrained(checkpoint)
    base.eos_token = "<|endoftext|>"
    messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5\n#### 5"}]
    input_ids, loss_mask = tokenize_conversation(messages, base)
    assert learned_spans(base, input_ids, loss_mask) == ["2 + 3 = 5\n#### 5<|im_end|>"]
    im_end = base.convert_tokens_to_ids("<|im_end|>")
    assert turn_end(base) == "<|im_end|>" and (tmp_path / "hf").mkdir() is None
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "hf" / "generation_config.json").write_text('{"eos_token_id": %d}' % base.eos_token_id)
    assert end_token_ids(tmp_path / "hf", base) == (base.eos_token_id, im_end)
    declare_end_ids(tmp_path / "hf", (base.eos_token_id, im_end))
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == [base.eos_token_id, im_end]


def test_without_a_generation_config_generation_stops_at_config_jsons_end_ids_as_transformers_does(checkpoint, tmp_path):
    """A checkpoint without generation_config.json (a converted or hand-saved Llama 3.1: config.json lists
    <|end_of_text|> and <|eom_id|> beside the tokenizer's <|eot_id|>) generates in transformers until any of config.json's
    end ids; generation here stopped only at the tokenizer's (and the template's turn end), and ran past the others."""
    import torch
    from model.generate import end_token_ids

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    other_end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert other_end != tokenizer.eos_token_id
    config = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      intermediate_size=32, vocab_size=512, eos_token_id=[other_end, tokenizer.eos_token_id])
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).generation_config.eos_token_id == [
        other_end, tokenizer.eos_token_id]
    assert end_token_ids(tmp_path, tokenizer) == (tokenizer.eos_token_id, other_end)  # was (eos,)
    # A generation_config.json, when there is one, is what transformers reads, and so does this trainer.
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": %d}' % tokenizer.eos_token_id)
    assert end_token_ids(tmp_path, tokenizer) == (tokenizer.eos_token_id,)


def test_a_template_with_generation_markers_gives_the_mask_its_markers_give(checkpoint):
    """TRL's `assistant_only_loss` reads `{% generation %}` markers; the mask read off the renderings is the one the
    markers give (transformers' `return_assistant_tokens_mask`), on a multi-turn row."""
    marked = transformers.AutoTokenizer.from_pretrained(checkpoint)
    marked.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
        "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    messages = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "1 + 1 = 2\n#### 2"},
                {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "2 + 2 = 4\n#### 4"}]
    input_ids, loss_mask = tokenize_conversation(messages, marked)
    markers = marked.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert (input_ids, loss_mask) == (markers["input_ids"], markers["assistant_masks"])
    assert learned_spans(marked, input_ids, loss_mask) == ["1 + 1 = 2\n#### 2<|im_end|>", "2 + 2 = 4\n#### 4<|im_end|>"]


def test_a_tool_call_that_opens_with_a_special_token_is_learned_through_the_turns_end(checkpoint):
    """Mistral's template writes a tool-call turn as `[TOOL_CALLS]` (a special token) + the calls + eos, and Llama 3.1's
    a built-in tool's call as `<|python_tag|>` + the call + `<|eom_id|>`: the turn is learned through the token that
    closes it. Before, the mask ended at the first special token after the (empty) content, so only `[TOOL_CALLS]`
    was learned, neither the call nor its end."""
    mistral = transformers.AutoTokenizer.from_pretrained(checkpoint)
    mistral.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "<|python_tag|>", "<|eom_id|>"]})
    mistral.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}[/INST]"
        "{% elif m['role'] == 'assistant' and m.tool_calls %}[TOOL_CALLS] "
        "{{ m.tool_calls | map(attribute='function') | list | tojson }}{{ eos_token }}"
        "{% elif m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}"
        "{% elif m['role'] == 'tool' %}[TOOL_RESULTS] {{ m['content'] }}[/TOOL_RESULTS]{% endif %}{% endfor %}")
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 1}}}]}
    messages = [{"role": "user", "content": "1 + 1?"}, call, {"role": "tool", "name": "add", "content": "2"},
                {"role": "assistant", "content": "It is 2."}]
    input_ids, loss_mask = tokenize_conversation(messages, mistral)
    assert learned_spans(mistral, input_ids, loss_mask) == [
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 1}}]<|im_end|>', " It is 2.<|im_end|>"]
    assert sum(loss_mask) == 58  # 11 before: `[TOOL_CALLS]` alone of the call turn
    llama = transformers.AutoTokenizer.from_pretrained(checkpoint)
    llama.add_special_tokens({"additional_special_tokens": ["<|python_tag|>", "<|eom_id|>"]})
    llama.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.tool_calls %}<|python_tag|>"
        "{{ m.tool_calls[0].function.name }}({{ m.tool_calls[0].function.arguments | tojson }})<|eom_id|>"
        "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    input_ids, loss_mask = tokenize_conversation(messages, llama)
    assert learned_spans(llama, input_ids, loss_mask) == [
        '<|python_tag|>add({"a": 1, "b": 1})<|eom_id|>', "It is 2.<|im_end|>"]


def test_multi_turn_messages_row_learns_every_assistant_turn(tokenizer):
    row = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tom has 3 apples and buys 4 more."},
        {"role": "assistant", "content": "3 + 4 = 7\n#### 7"},
        {"role": "user", "content": "And 2 more?"},
        {"role": "assistant", "content": "7 + 2 = 9\n#### 9"},
    ]}
    conversations, report = to_conversations([row], messages_field="messages")
    assert conversations == [row["messages"]] and report.used == 1
    input_ids, loss_mask = tokenize_conversation(conversations[0], tokenizer)
    assert learned_spans(tokenizer, input_ids, loss_mask) == [
        "3 + 4 = 7\n#### 7<|im_end|>",
        "7 + 2 = 9\n#### 9<|im_end|>",
    ]


def test_a_multi_turn_row_with_an_empty_assistant_turn_is_dropped_as_a_pair_with_an_empty_response_is(tokenizer):
    """An assistant turn with nothing in it (blank content, no tool calls, no reasoning) in a multi-turn row taught the
    model to close its turn at once after that user turn (its learned span was `<|im_end|>` alone), where the same
    turn as a prompt/response pair is dropped as an empty response. Now the row is dropped and counted; a turn of tool
    calls alone, one of reasoning alone, and one of weight 0 are kept."""
    def conversation(first: dict) -> dict:
        return {"messages": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", **first},
                             {"role": "user", "content": "3 + 3?"}, {"role": "assistant", "content": "6"}]}
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
    rows = [conversation({"content": ""}), conversation({"content": " \n"}), conversation({"content": "4"}),
            conversation({"content": "", "tool_calls": [call]}), conversation({"content": "", "reasoning_content": "2+2"}),
            conversation({"content": "", "weight": 0})]
    rows[3]["messages"].insert(2, {"role": "tool", "content": "4"})
    conversations, report = to_conversations(rows, messages_field="messages")
    examples = build_examples(conversations, tokenizer, 128, report)
    assert report.kept_rows == [2, 3, 4, 5]  # before: [0, 1, 2, 3, 4, 5]
    assert report.first_drops == [(0, "an empty assistant turn"), (1, "an empty assistant turn")]
    assert [learned_spans(tokenizer, *vars(example).values()) for example in examples] == [
        ["4<|im_end|>", "6<|im_end|>"],
        ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>', "6<|im_end|>"],
        ["<|im_end|>", "6<|im_end|>"],  # the tiny template writes no reasoning: its content, empty, is learned
        ["6<|im_end|>"]]


# Qwen2.5's chat template as its checkpoints ship it, without the tool-call parts: a role it does not know is not written.
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}{%- if (message.role == 'user') or (message.role == 'system' and not "
    "loop.first) or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}{{- '\\n<tool_response>\\n' }}{{- message.content }}"
    "{{- '\\n</tool_response>' }}{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_message_the_chat_template_does_not_render_drops_its_row_by_name(checkpoint):
    """Qwen's templates write nothing for a role they do not know (OpenAI's older `function` results, its `developer`
    instructions): the answer after such a message was learned without it, silently. Such a row is dropped and counted
    under the role; a tool result a template writes through `tojson` (Llama 3.1's) is rendered, and kept."""
    qwen = transformers.AutoTokenizer.from_pretrained(checkpoint)
    qwen.chat_template = QWEN25_TEMPLATE
    rows = [{"messages": [{"role": "user", "content": "Weather in Paris?"}, {"role": "function", "content": "21 C, sun"},
                          {"role": "assistant", "content": "It is 21 C and sunny."}]},
            {"messages": [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Bonjour"}]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    conversations, report = to_conversations(rows, messages_field="messages")
    examples = build_examples(conversations, qwen, 128, report)
    assert len(examples) == 1 and report.kept_rows == [2]
    assert report.summary() == (
        "1 of 3 rows used, 2 dropped (a 'developer' message the chat template does not render: 1, a 'function' message "
        "the chat template does not render: 1), 0 truncated; first dropped: row 0 (a 'function' message the chat "
        "template does not render), row 1 (a 'developer' message the chat template does not render)")
    with pytest.raises(UserError, match="a 'function' message the chat template does not render"):
        tokenize_conversation(conversations[0], qwen)
    as_json = transformers.AutoTokenizer.from_pretrained(checkpoint)
    as_json.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'tool' %}"
                             "{{ m['content'] | tojson }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    messages = [{"role": "user", "content": "Weather?"}, {"role": "tool", "content": 'sky: "clear"\ntemp: 21 °C'},
                {"role": "assistant", "content": "Clear, 21 C."}]
    assert learned_spans(as_json, *tokenize_conversation(messages, as_json)) == ["Clear, 21 C.<|im_end|>"]


def test_an_assistant_turn_of_weight_0_is_context_not_learned(tokenizer):
    """OpenAI's fine-tuning form marks an assistant turn not to learn with `"weight": 0`: it is shown, not learned (it
    was learned like every other turn). A row whose every assistant turn has weight 0 has nothing to learn, and a
    weight other than 0 or 1 is named."""
    row = {"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "3", "weight": 0},
                        {"role": "user", "content": "Wrong. 1 + 1?"}, {"role": "assistant", "content": "2", "weight": 1}]}
    nothing = {"messages": row["messages"][:2]}
    odd = {"messages": [row["messages"][0], {"role": "assistant", "content": "2", "weight": 0.5}]}
    conversations, report = to_conversations([row, nothing, odd], messages_field="messages")
    assert report.first_drops == [(1, "no assistant turn"), (2, "assistant weight not 0 or 1")]
    input_ids, loss_mask = tokenize_conversation(conversations[0], tokenizer)
    assert learned_spans(tokenizer, input_ids, loss_mask) == ["2<|im_end|>"]  # before: ["3<|im_end|>", "2<|im_end|>"]
    assert input_ids == tokenize_conversation([{key: value for key, value in message.items() if key != "weight"}
                                               for message in row["messages"]], tokenizer)[0]


def test_messages_rows_without_a_usable_assistant_turn_are_dropped():
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
        {"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "seven"}]},
        {"messages": [{"role": "assistant", "content": "hello"}]},
        {"messages": None},
    ]
    conversations, report = to_conversations(rows, messages_field="messages")
    assert len(conversations) == 1 and report.kept_rows == [0]
    assert report.first_drops == [(1, "no assistant turn"), (2, "no assistant turn"), (3, "malformed messages"),
                                  (4, "starts with assistant turn"), (5, "missing 'messages'")]


def test_text_parts_are_read_as_text_and_other_message_forms_are_named(tokenizer):
    """OpenAI's content parts (`[{"type": "text", "text": ...}]`) are the texts one after another, as templates that
    take parts write them: such rows were all dropped as "malformed messages". ShareGPT's from/value messages, messages
    given as JSON text and image parts are named, where each was "malformed messages"."""
    def parts(*texts):
        return [{"type": "text", "text": text} for text in texts]

    rows = [{"messages": [{"role": "user", "content": parts("What is ", "2 + 3?")},
                          {"role": "assistant", "content": parts("2 + 3 = 5")}]},
            {"messages": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
            {"messages": json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])},
            {"messages": [{"role": "user", "content": [{"type": "image", "url": "cat.png"}, *parts("What is it?")]},
                          {"role": "assistant", "content": "A cat."}]}]
    conversations, report = to_conversations(rows, messages_field="messages")
    assert conversations == [[{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5"}]]
    assert report.first_drops == [(1, "ShareGPT's from/value messages, not role/content"), (2, "'messages' not a list (str)"),
                                  (3, "content parts not text (image)")]
    input_ids, loss_mask = tokenize_conversation(conversations[0], tokenizer)
    assert learned_spans(tokenizer, input_ids, loss_mask) == ["2 + 3 = 5<|im_end|>"]
    with pytest.raises(UserError, match=r"not role/content\)\. .*\(data\.messages_field: a column of role/content"):
        to_conversations(rows[1:2], messages_field="messages")


def test_a_template_that_does_not_close_assistant_turns_with_eos_is_refused(checkpoint):
    plain = transformers.AutoTokenizer.from_pretrained(checkpoint)
    plain.chat_template = (
        "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    with pytest.raises(UserError, match="end-of-turn token"):
        tokenize_conversation([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], plain)


# --- dropping and truncation ----------------------------------------------------------------------


def test_malformed_rows_are_counted_by_reason_with_their_indices():
    rows = [
        {"question": "q0", "answer": "a0"},
        {"question": "q1"},
        {"question": "q2", "answer": None},
        {"question": "q3", "answer": 42},
        {"question": "q4", "answer": "   \n"},
        {"question": "q5", "answer": "a5"},
        {"question": None, "answer": "a6"},
    ]
    conversations, report = to_conversations(rows)
    assert conversations == [
        [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0"}],
        [{"role": "user", "content": "q5"}, {"role": "assistant", "content": "a5"}],
    ]
    assert report.kept_rows == [0, 5] and report.rows_read == 7 and report.used + report.dropped == 7
    assert report.dropped_by_reason == {"missing 'answer'": 2, "missing 'question'": 1, "'answer' not a string (int)": 1,
                                        "empty response": 1}
    assert report.first_drops == [(1, "missing 'answer'"), (2, "missing 'answer'"), (3, "'answer' not a string (int)"),
                                  (4, "empty response"), (6, "missing 'question'")]
    assert report.summary().startswith("2 of 7 rows used, 5 dropped ('answer' not a string (int): 1, empty response: 1, "
                                       "missing 'answer': 2, missing 'question': 1")


def test_truncation_cuts_from_the_right_and_drops_samples_left_without_loss_tokens(tokenizer):
    short = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]
    long_answer = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "1 + 1 = 2 " * 40}]
    long_prompt = [{"role": "user", "content": "1 + 1 " * 60}, {"role": "assistant", "content": "2"}]
    max_seq_len = 32
    report = DropReport()
    examples = build_examples([short, long_answer, long_prompt], tokenizer, max_seq_len, report)
    assert (report.used, report.dropped, report.truncated) == (2, 1, 1)
    assert report.first_drops == [(2, "no loss tokens after truncation")]
    full_ids, full_mask = tokenize_conversation(long_answer, tokenizer)
    assert examples[0].input_ids == tokenize_conversation(short, tokenizer)[0]
    assert examples[1] == Example(full_ids[: max_seq_len + 1], full_mask[: max_seq_len + 1])
    with pytest.raises(UserError, match="data.max_seq_len"):
        build_examples([long_prompt], tokenizer, max_seq_len, DropReport())


def test_responses_whose_tokens_merge_with_the_header_are_dropped_not_guessed(tokenizer):
    # The header ends in a newline; a response starting with one tokenizes as a single "\n\n" token.
    merging = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "\n2"}]
    fine = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]
    report = DropReport()
    assert len(build_examples([fine, merging], tokenizer, 64, report)) == 1
    assert report.first_drops == [(1, "tokens merge across a turn boundary")]
    with pytest.raises(UserError, match="chat template"):
        tokenize_conversation(merging, tokenizer)


def test_cached_examples_equal_a_fresh_tokenization_and_follow_every_input(tokenizer, tmp_path, monkeypatch):
    """The cache returns exactly what tokenizing gives (examples and the drop report), and a change to anything tokenizing
    reads (conversations, max_seq_len, the chat template) is a new entry; a damaged entry is rebuilt."""
    import data.sft as sft_data

    rows = [{"question": "1 + 1?", "answer": "2"}, {"question": "x", "answer": ""}, {"question": "2 + 2?", "answer": "1 + 1 = 2 " * 40},
            {"question": "1 + 1 " * 60, "answer": "2"}, {"question": "1 + 1?", "answer": "\n2"}]

    def tokenized(max_seq_len=32, cache=tmp_path, source=rows):
        conversations, report = to_conversations(source)
        return cached_examples(conversations, tokenizer, max_seq_len, report, cache), report.summary()

    fresh = tokenized(cache=None)
    assert fresh[1] == ("2 of 5 rows used, 3 dropped (empty response: 1, no loss tokens after truncation: 1, tokens merge "
                        "across a turn boundary: 1), 1 truncated; first dropped: row 1 (empty response), row 3 (no loss "
                        "tokens after truncation), row 4 (tokens merge across a turn boundary)")
    assert not (tmp_path / "sft-examples").exists()
    assert tokenized() == fresh  # written
    (entry,) = (tmp_path / "sft-examples").iterdir()
    monkeypatch.setattr(sft_data, "build_examples", lambda *args: pytest.fail("tokenized again"))
    assert tokenized() == fresh  # read: no tokenizing
    monkeypatch.undo()

    assert tokenized(max_seq_len=64) != fresh  # the longer limit keeps row 3's answer and cuts nothing
    assert tokenized(source=rows[:1])[0] == fresh[0][:1]
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = original.replace("<|im_start|>", "<|im_start|> ")
        assert tokenized()[0] != fresh[0]
    finally:
        tokenizer.chat_template = original
    assert len(list((tmp_path / "sft-examples").iterdir())) == 4
    entry.write_bytes(entry.read_bytes()[:300])  # cut short
    assert tokenized() == fresh and json.loads(str(numpy.load(entry)["report"]))["truncated"] == 1
    unwritable = tmp_path / "unwritable"
    unwritable.mkdir()
    (unwritable / "sft-examples").write_text("a file where the cache's folder would go")
    assert tokenized(cache=unwritable) == fresh  # tokenized, not cached, and the run goes on


def test_the_examples_cache_key_follows_the_code_that_finds_each_turns_end(tokenizer, tmp_path, monkeypatch):
    """`config.hf`'s special-token helpers decide where each learned turn ends: a change to them is a new cache entry,
    not the old masks read back (the key covered data/sft.py, data/encode.py and data/batches.py, not config/hf.py)."""
    import config.hf
    import data.sft as sft_data

    conversations, report = to_conversations([{"question": "1 + 1?", "answer": "2"}])
    key = sft_data.examples_cache_key(conversations, tokenizer, 32, report)
    assert sft_data.examples_cache_key(conversations, tokenizer, 32, report) == key
    changed = tmp_path / "hf.py"
    changed.write_text(Path(config.hf.__file__).read_text() + "\n# the turn's end found another way\n")
    monkeypatch.setattr(config.hf, "__file__", str(changed))
    assert sft_data.examples_cache_key(conversations, tokenizer, 32, report) != key


def test_tokenized_examples_are_held_in_flat_arrays_and_index_as_the_list(tokenizer):
    """A large set's examples are three flat arrays, not a Python list per token, and read back as the examples `build_examples` gives, one by one, sliced or from the end."""
    rows = [{"question": f"{number} + 1?", "answer": f"{number + 1} " * (number + 1)} for number in range(5)]
    conversations, report = to_conversations(rows)
    fresh = build_examples(conversations, tokenizer, 32, to_conversations(rows)[1])
    examples = cached_examples(conversations, tokenizer, 32, report, None)
    assert list(examples) == fresh and examples[-1] == fresh[-1] and examples[1:4:2] == fresh[1:4:2] and examples == fresh
    tokens = sum(len(example.input_ids) for example in fresh)
    assert (examples.input_ids.nbytes, examples.loss_mask.nbytes, len(examples)) == (4 * tokens, tokens, 5)
    with pytest.raises(IndexError):
        examples[5]


def test_a_missing_cache_entry_is_built_by_one_process_while_the_others_wait_and_read_it(tokenizer, tmp_path, monkeypatch):
    """Ranks starting together on a cold cache tokenize once: a process that finds another building the same entry
    waits for it, then reads the entry instead of tokenizing the whole set again."""
    import threading
    import time

    import data.sft as sft_data
    from data import encode

    rows = [{"question": f"{number} + 1?", "answer": f"{number + 1}"} for number in range(6)]
    conversations, report = to_conversations(rows)
    fresh = build_examples(conversations, tokenizer, 32, to_conversations(rows)[1])
    key = sft_data.examples_cache_key(conversations, tokenizer, 32, report)
    results, failures = [], []

    def other_rank():
        try:
            results.append(cached_examples(conversations, tokenizer, 32, report, tmp_path))
        except BaseException as error:  # noqa: BLE001 - a thread's failure is reported by the test
            failures.append(error)

    monkeypatch.setattr(sft_data, "build_examples", lambda *args: pytest.fail("tokenized while another process built it"))
    with encode.building(tmp_path, sft_data.CACHE_FOLDER, key):  # the rank that builds
        waiting = threading.Thread(target=other_rank)
        waiting.start()
        time.sleep(0.5)
        assert waiting.is_alive() and not results
        packed = fresh
        report_json = json.dumps({"kept_rows": list(range(6)), "truncated": 0, "dropped": [], "first_drops": []})
        encode.write_cached_arrays(tmp_path, sft_data.CACHE_FOLDER, key,
                                   {"input_ids": packed.input_ids, "loss_mask": packed.loss_mask, "starts": packed.starts,
                                    "report": numpy.array(report_json)})
    waiting.join(30)
    assert not failures and results == [fresh]


def test_long_tokenizing_says_how_far_it_is(tokenizer, monkeypatch, caplog):
    """Tokenizing a large set takes minutes: a line on rank 0 at least every `PROGRESS_INTERVAL_S` says how many are done, where there was silence."""
    from data import encode

    monkeypatch.setattr(encode, "PROGRESS_INTERVAL_S", 0.0)
    rows = [{"question": f"{number} + 1?", "answer": f"{number + 1}"} for number in range(3)]
    with caplog.at_level(logging.INFO, logger="data.encode"):
        build_examples(*to_conversations(rows)[:1], tokenizer, 32, to_conversations(rows)[1])
    lines = [record.getMessage() for record in caplog.records if "conversations tokenized" in record.getMessage()]
    assert [line.split(" (")[0] for line in lines] == ["conversations tokenized: 1 of 3", "conversations tokenized: 2 of 3"]


def test_cached_prompt_ids_equal_a_fresh_rendering_and_follow_the_tools_and_template(tokenizer, tmp_path, monkeypatch):
    """GRPO's prompt ids from the cache equal a fresh rendering; other tools or another chat template are new entries;
    a damaged entry is rendered again; functions offered as tools are never cached. The key renders the first prompt (a
    template may print today's date), the rest are read."""
    import data.encode as encode
    from data import prompts as prompt_data

    conversations, _ = to_conversations([{"question": f"{n} + {n}?", "answer": f"#### {2 * n}"} for n in range(6)])
    schema = {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object", "properties": {}}}}

    def ids(cache=tmp_path, tools=None):
        return [prompt.ids for prompt in prompt_data.prompts_from_conversations(conversations, tokenizer, tools, cache)]

    fresh, with_tools = ids(cache=None), ids(cache=None, tools=[schema])
    assert fresh != with_tools and not (tmp_path / "prompts").exists()
    assert ids() == fresh and ids(tools=[schema]) == with_tools  # written
    assert len(list((tmp_path / "prompts").iterdir())) == 2
    rendered = []
    render = encode.chat_text
    monkeypatch.setattr(encode, "chat_text", lambda *args, **kwargs: rendered.append(1) or render(*args, **kwargs))
    # A read takes no lock: a rank reading a whole entry never waits on one, nor says it waits for a build.
    monkeypatch.setattr(encode, "building", lambda *args: pytest.fail("a cached entry's read took the lock"))
    assert ids() == fresh and ids(tools=[schema]) == with_tools  # read: only the first prompt rendered, for the key
    assert len(rendered) == 2
    monkeypatch.undo()
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = original.replace("<|im_start|>", "<|im_start|> ")
        assert ids() != fresh
    finally:
        tokenizer.chat_template = original
    entries = sorted((tmp_path / "prompts").iterdir())
    assert len(entries) == 3
    for entry in entries:
        entry.write_text('{"ids": [[1')  # cut short
    assert ids() == fresh

    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    assert ids(tools=[add]) == ids(cache=None, tools=[add]) and len(list((tmp_path / "prompts").iterdir())) == 3


# --- configuration mistakes -----------------------------------------------------------------------


def test_unknown_field_names_the_key_and_the_existing_columns():
    rows = [{"question": "q", "solution": "s"}, {"question": "q", "extra": 1}]
    with pytest.raises(UserError) as raised:
        to_conversations(rows)
    assert "data.response_field" in str(raised.value) and "['extra', 'question', 'solution']" in str(raised.value)
    with pytest.raises(UserError, match="data.prompt_field"):
        to_conversations(rows, prompt_field="prompt", response_field="solution")
    with pytest.raises(UserError, match="data.messages_field"):
        to_conversations(rows, messages_field="conversation")


def test_chat_rows_read_as_prompt_and_response_name_data_messages_field_and_back():
    """Chat rows under the default fields said only "Set data.prompt_field to one of them ['messages']", which reads a
    list of messages as a prompt; prompt/response rows with data.messages_field set, to set it to a text column."""
    chat = [{"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]}]
    with pytest.raises(UserError, match=r"data.prompt_field is 'question', .* its columns are \['messages'\]\. The "
                                        r"column 'messages' holds chat messages: set data.messages_field=messages"):
        to_conversations(chat)
    with pytest.raises(UserError, match=r"data.messages_field is 'messages', .* The rows have the data.prompt_field and "
                                        r"data.response_field columns \('question', 'answer'\): leave data.messages_field unset"):
        to_conversations([{"question": "1 + 1?", "answer": "2"}], messages_field="messages")


def test_no_usable_rows_names_data_path():
    with pytest.raises(UserError, match="data.path"):
        to_conversations([{"question": "q", "answer": ""}])


def test_missing_local_file_names_data_path(tmp_path):
    for path in [str(tmp_path / "absent.jsonl"), "./absent/train.parquet", "absent.json"]:
        with pytest.raises(UserError, match="data.path") as raised:
            load_rows(path)
        assert "does not exist" in str(raised.value)


def test_unreachable_hub_dataset_names_data_path(monkeypatch):
    # Offline mode makes the hub lookup fail at once instead of retrying the network for ~20 s.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="not found locally") as raised:
        load_rows("nobody/no-such-dataset")
    assert "data.path" in str(raised.value)


def test_data_smaller_than_one_global_batch_names_the_key():
    with pytest.raises(UserError, match="train.global_batch_size"):
        BatchSchedule(7, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=2, seed=0)


def test_the_start_up_data_line_says_how_many_rows_each_epoch_leaves_out(tokenizer, tmp_path, caplog):
    """100 examples at train.global_batch_size=64 train on 64 an epoch: the data line says 36 are left out (it said
    nothing); a global batch that divides the examples adds nothing. The schedule itself is unchanged."""
    from config.loops import SFTConfig
    from trainer.sft import load_data

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{index} + 1", "answer": f"#### {index + 1}"}) + "\n"
                            for index in range(100)))
    config = SFTConfig()
    config.data.path, config.data.cache, config.train.global_batch_size = str(rows), False, 64
    with caplog.at_level("INFO"):
        assert len(load_data(config, tokenizer, data_parallel_size=1).train) == 100
    assert ("100 samples used; 100 of 100 rows used, 0 dropped (none), 0 truncated; 36 rows an epoch are left out "
            "(reshuffled each epoch): an epoch trains on 64, whole batches of train.global_batch_size=64") in caplog.text
    caplog.clear()
    config.train.global_batch_size = 50
    with caplog.at_level("INFO"):
        load_data(config, tokenizer, data_parallel_size=1)
    assert "100 samples used" in caplog.text and "left out" not in caplog.text
    assert BatchSchedule(100, 64, 32, 0, 1, seed=0).batches_per_epoch == 1


def test_a_held_out_set_smaller_than_the_data_parallel_size_is_a_warning_naming_the_file(tokenizer, tmp_path, caplog):
    """Trimming the held-out rows to a multiple of the data-parallel size once emptied them without a word, and
    SFT's and GRPO's evaluation did nothing; now one warning names the file, train.eval_samples and the DP size,
    and a trim that keeps some rows says how many it dropped."""
    from config.loops import SFTConfig
    from data.prompts import trim_for_data_parallel
    from trainer.sft import load_data

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"question": f"{index} + 1", "answer": f"#### {index + 1}"})
                                                + "\n" for index in range(64)))
    (folder / "test.jsonl").write_text(json.dumps({"question": "1 + 1", "answer": "#### 2"}) + "\n")
    config = SFTConfig()
    config.data.path, config.data.cache, config.train.global_batch_size = str(folder), False, 64
    with caplog.at_level("INFO"):
        data = load_data(config, tokenizer, data_parallel_size=2)
    assert data.eval == [] and data.eval_prompts == []
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert warnings == [f"nothing is evaluated: `{folder}` (test) gives held-out rows: 1 (train.eval_samples=100), fewer "
                        f"than the data-parallel size 2, and every rank scores an equal share; give `{folder}` (test) at "
                        "least 2 rows, or use fewer data-parallel ranks"]
    caplog.clear()
    with caplog.at_level("INFO"):
        assert trim_for_data_parallel(list(range(10)), 5, 4, "`held.jsonl` (test)") == [0, 1, 2, 3]
        assert trim_for_data_parallel(list(range(10)), 1, 4, "`held.jsonl` (test)") == []
        assert trim_for_data_parallel(list(range(10)), 8, 4, "`held.jsonl` (test)") == list(range(8))
        assert trim_for_data_parallel(list(range(10)), 0, 4, "`held.jsonl` (test)") == []  # no evaluation asked for
        assert trim_for_data_parallel(list(range(1)), 8, 4) == []  # a second trim of the same rows: silent
    assert [record.getMessage() for record in caplog.records] == [
        "held-out `held.jsonl` (test): 4 of its 5 rows are evaluated (train.eval_samples=5), a multiple of the "
        "data-parallel size 4 so that every rank scores an equal share",
        "nothing is evaluated: `held.jsonl` (test) gives held-out rows: 1 (train.eval_samples=1), fewer than the "
        "data-parallel size 4, and every rank scores an equal share; raise train.eval_samples to at least 4, or use "
        "fewer data-parallel ranks"]


def test_held_out_answers_without_the_graded_form_say_there_is_no_accuracy(tokenizer, tmp_path, caplog):
    """A held-out set with an answer the accuracy cannot grade (no `#### N`) has no held-out accuracy, which was left
    out without a word: a run on GSM8K-style data with one such row showed no `eval_accuracy`, and nothing said why."""
    from config.loops import SFTConfig
    from trainer.sft import load_data

    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"question": f"{index} + 1", "answer": f"#### {index + 1}"})
                                                  + "\n" for index in range(8)))
    held_out = [{"question": "1 + 1", "answer": "#### 2"}, {"question": "2 + 2", "answer": "4"}]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in held_out))
    config = SFTConfig()
    config.data.path, config.data.cache, config.train.global_batch_size = str(tmp_path), False, 8
    with caplog.at_level("INFO"):
        data = load_data(config, tokenizer, data_parallel_size=1)
    assert len(data.eval) == 2 and data.eval_prompts == []
    assert (f"no held-out accuracy: 1 of the 2 held-out answers of `{tmp_path}` (test) have no GSM8K `#### N` line, "
            "which the accuracy grades (the held-out loss is computed)") in caplog.messages


def test_held_out_prompts_offering_tools_say_the_accuracy_runs_none(tokenizer, caplog):
    """SFT's held-out accuracy samples one turn and runs no tool, so on prompts that offer tools (the bundled calculator
    task's: every held-out row offers `calculator`) a completion that calls one was scored as a wrong answer without a
    word; GRPO refuses such prompts without `grpo.tools`. Now the start-up says what the figure counts."""
    from config.loops import SFTConfig
    from trainer.sft import load_data

    config = SFTConfig()
    config.data.path, config.data.messages_field, config.data.cache = "calculator", "messages", False
    config.train.eval_samples = 8
    with caplog.at_level("INFO"):
        data = load_data(config, tokenizer, data_parallel_size=1)
    assert len(data.eval_prompts) == 8 and data.eval_prompts.offering_tools() == 8
    assert [message for message in caplog.messages if message.startswith("held-out accuracy:")] == [
        "held-out accuracy: 8 of the 8 held-out prompts of `calculator` (test) offer tools (the rows' `tools`), which "
        "SFT's evaluation does not run: a completion that calls one is scored as its answer, wrong, so eval_accuracy "
        "counts only answers given without a call. GRPO with `--grpo.tools` evaluates with the tools run "
        "(`eval_tool_call_rate` beside it)"]


def test_held_out_accuracy_is_measured_on_the_rows_the_held_out_loss_keeps(tokenizer, tmp_path, caplog):
    """A held-out row too long for `data.max_seq_len` (no response token left) is dropped from the held-out loss, and the
    log says which rows are evaluated; the accuracy's prompts were built from every held-out row, so the accuracy was
    measured on rows the log said were not evaluated (measured: 2 rows for `eval_loss`, 4 for `eval_accuracy`, the
    dropped 360-token prompt among them, generated past data.max_seq_len). Both now read the same rows."""
    from config.loops import SFTConfig
    from trainer.sft import load_data

    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"question": f"{index} + 1", "answer": f"#### {index + 1}"})
                                                  + "\n" for index in range(8)))
    held_out = [{"question": f"{index} + 1" + " Think it over." * 60 * (index == 1), "answer": f"#### {index + 1}"}
                for index in range(4)]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in held_out))
    config = SFTConfig()
    config.data.path, config.data.cache, config.train.global_batch_size = str(tmp_path), False, 8
    with caplog.at_level("INFO"):
        data = load_data(config, tokenizer, data_parallel_size=2)
    assert f"held-out `{tmp_path}` (test): 2 of its 3 rows are evaluated (train.eval_samples=100), a multiple of the " \
           "data-parallel size 2 so that every rank scores an equal share" in caplog.messages
    assert len(data.eval) == 2 and [prompt.reference for prompt in data.eval_prompts] == ["#### 1", "#### 3"]
    assert [tokenizer.decode(example.input_ids).count("Think") for example in data.eval] == [0, 0]


# --- loading --------------------------------------------------------------------------------------


def test_local_jsonl_parquet_and_split_folders_load(tmp_path):
    train = [{"question": f"q{index}", "answer": f"a{index}"} for index in range(3)]
    test = [{"question": "tq", "answer": "ta"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in train))
    (tmp_path / "test.jsonl").write_text(json.dumps(test[0]) + "\n")
    parquet = tmp_path / "parquet" / "data.parquet"
    parquet.parent.mkdir()
    datasets.Dataset.from_list(train).to_parquet(str(parquet))
    assert load_rows(str(tmp_path / "train.jsonl")) == train
    assert load_rows(str(parquet)) == train
    assert load_rows(str(parquet.parent)) == train
    assert load_rows(str(tmp_path)) == train
    assert load_rows(str(tmp_path), split="test") == test


def test_a_parquet_file_rewritten_in_place_is_read_anew(tmp_path):
    """`datasets` keeps a local Parquet file's table under its path and modification time: the file rewritten with
    the same size and its time kept (`touch -r`, `cp -p`) was read as its old rows ("#### 3" where it now says
    "#### 4"), and the tokenized-example cache, keyed on the rows, trained on them."""
    import os

    parquet = tmp_path / "train.parquet"
    datasets.Dataset.from_list([{"question": "What is 1 + 2?", "answer": "#### 3"}]).to_parquet(str(parquet))
    assert load_rows(str(parquet)) == [{"question": "What is 1 + 2?", "answer": "#### 3"}]
    before = parquet.stat()
    datasets.Dataset.from_list([{"question": "What is 1 + 2?", "answer": "#### 4"}]).to_parquet(str(parquet))
    os.utime(parquet, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert parquet.stat().st_size == before.st_size and parquet.stat().st_mtime_ns == before.st_mtime_ns
    assert load_rows(str(parquet)) == [{"question": "What is 1 + 2?", "answer": "#### 4"}]


def test_split_folders_and_dev_files_keep_held_out_rows_out_of_training(tmp_path, caplog):
    """Splits named by a folder (`train/part-0.jsonl`, `test/part-0.jsonl`) or by the hub's layout
    (`data/train-00000-of-00001.parquet`) are read apart, and `dev`/`validation` files are held out: a split folder's
    training split once read every file, test included, and a `dev.jsonl` beside `data.jsonl` was trained on."""
    from data.prompts import held_out_split

    def write(file: Path, rows: list[dict]) -> None:
        file.parent.mkdir(parents=True, exist_ok=True)
        if file.suffix == ".parquet":
            datasets.Dataset.from_list(rows).to_parquet(str(file))
        else:
            file.write_text("".join(json.dumps(row) + "\n" for row in rows))

    train, test = [{"question": "q", "answer": "a"}] * 2, [{"question": "held", "answer": "out"}]
    write(tmp_path / "nested" / "train" / "part-0.jsonl", train)
    write(tmp_path / "nested" / "test" / "part-0.jsonl", test)
    write(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet", train)
    write(tmp_path / "hub" / "data" / "test-00000-of-00001.parquet", test)
    for folder in ("nested", "hub"):
        assert load_rows(str(tmp_path / folder)) == train
        assert load_rows(str(tmp_path / folder), split="test") == test
    # Without train* names the training split is every file not named after a held-out split, nor in such a folder.
    write(tmp_path / "dev" / "data.jsonl", train)
    write(tmp_path / "dev" / "dev.jsonl", test)
    write(tmp_path / "dev" / "validation" / "part-0.jsonl", test)
    write(tmp_path / "dev" / "devices.jsonl", train)  # "dev" only as a whole word
    assert load_rows(str(tmp_path / "dev")) == train * 2
    (tmp_path / "dev" / "devices.jsonl").unlink()  # a split's own name is a prefix: data.eval_split=dev reads it too
    assert load_rows(str(tmp_path / "dev"), split="dev") == test
    with pytest.raises(UserError, match=r"has no test split: none of its files, nor a folder they are in, is named "
                                        r"test\*; dev.jsonl is named after a held-out split: data.eval_split=dev"):
        load_rows(str(tmp_path / "dev"), split="test")
    data = types.SimpleNamespace(path=str(tmp_path / "dev"), eval_path="", eval_split="test")
    with caplog.at_level("WARNING"):
        assert held_out_split(data, lambda path, split: load_rows(path, split=split)) is None
    assert "evaluation is skipped: data.path" in caplog.text and "data.eval_split=dev" in caplog.text


def test_hub_shards_name_their_split_whole_so_train_never_reads_train_sft_and_train_gen(tmp_path):
    """A local copy of HuggingFaceH4/ultrachat_200k (`data/{train,test}_{sft,gen}-00000-of-00001.parquet`) at the default
    splits trained on train_gen and train_sft together and evaluated on both test sets, where the hub refuses split
    `train`: a hub shard's name is its split whole, and a split none of them has is a paragraph naming the key."""
    for split in ("train_sft", "train_gen", "test_sft", "test_gen"):
        shard = tmp_path / "data" / f"{split}-00000-of-00001.parquet"
        shard.parent.mkdir(exist_ok=True)
        datasets.Dataset.from_list([{"question": split, "answer": "a"}]).to_parquet(str(shard))
    (tmp_path / "data" / "train_sft-00000-of-00001.parquet").rename(
        tmp_path / "data" / "train_sft-00000-of-00001-2a1df75c6bce91ab.parquet")  # an older push's fingerprint
    assert [row["question"] for row in load_rows(str(tmp_path), split="train_sft")] == ["train_sft"]
    assert [row["question"] for row in load_rows(str(tmp_path), split="test_sft")] == ["test_sft"]
    shards = "laid out as the hub's, in the splits test_gen, test_sft, train_gen, train_sft"
    with pytest.raises(UserError, match=f"has no train split: its files are {shards}. Set data.train_split to one of them"):
        load_rows(str(tmp_path))  # before: rows train_gen and train_sft
    with pytest.raises(UserError, match=f"has no test split: its files are {shards}. Set data.eval_split to one of them"):
        load_rows(str(tmp_path), split="test")  # before: rows test_gen and test_sft
    # The hub's Parquet conversion (`refs/convert/parquet`): each split a folder of numbered files.
    converted = tmp_path / "converted"
    for split in ("train_sft", "train_gen"):
        (converted / "default" / split).mkdir(parents=True)
        datasets.Dataset.from_list([{"question": split, "answer": "a"}]).to_parquet(str(converted / "default" / split / "0000.parquet"))
    assert [row["question"] for row in load_rows(str(converted), split="train_sft")] == ["train_sft"]
    with pytest.raises(UserError, match="has no train split: its files are laid out as the hub's, in the splits train_gen, "):
        load_rows(str(converted))  # before: rows train_gen and train_sft


def test_training_rows_are_never_taken_for_held_out_ones(tmp_path, caplog):
    """A single file, or a folder without test* files, has no held-out split: evaluation is skipped with a warning
    (their rows were once read back as the "held-out" ones); `data.eval_path` names held-out rows in any file."""
    from data.prompts import held_out_split

    rows = [{"question": f"q{index}", "answer": f"a{index}"} for index in range(3)]
    folder = tmp_path / "folder"
    folder.mkdir()
    for file in (tmp_path / "rows.jsonl", folder / "part-0.jsonl"):
        file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(UserError, match="has no test split: none of its files, nor a folder they are in, is named test"):
        load_rows(str(folder), split="test")
    assert load_rows(str(folder)) == rows
    # Without train* files the training split is every file but the held-out ones, and never a hidden copy.
    (folder / "test.jsonl").write_text(json.dumps({"question": "t", "answer": "t"}) + "\n")
    (folder / ".ipynb_checkpoints").mkdir()
    (folder / ".ipynb_checkpoints" / "part-0-checkpoint.jsonl").write_text(json.dumps({"question": "x", "answer": "x"}) + "\n")
    assert load_rows(str(folder)) == rows and load_rows(str(folder), split="test") == [{"question": "t", "answer": "t"}]
    (folder / "test.jsonl").unlink()
    # Split names as ultrachat_200k's (train_sft / test_sft): `data.train_split` and `data.eval_split` pick the files.
    named = tmp_path / "named"
    named.mkdir()
    (named / "train_sft-00000.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (named / "test_sft-00000.jsonl").write_text(json.dumps({"question": "t", "answer": "t"}) + "\n")
    data = types.SimpleNamespace(path=str(named), eval_path="", hub_config="", train_split="train_sft", eval_split="test_sft")
    assert conversations.load_split(data, str(named), "train_sft") == rows
    assert held_out_split(data, lambda path, split: conversations.load_split(data, path, split)) == [{"question": "t", "answer": "t"}]
    assert len(conversations.load_split(data, "arithmetic", "train_sft")) == 10000  # the bundled set: its train split
    for path in (tmp_path / "rows.jsonl", folder):
        data = types.SimpleNamespace(path=str(path), eval_path="", eval_split="test")
        with caplog.at_level("WARNING"):
            assert held_out_split(data, lambda path, split: load_rows(path, split=split)) is None
        assert "evaluation is skipped" in caplog.text
    data = types.SimpleNamespace(path=str(folder), eval_path=str(tmp_path / "rows.jsonl"), eval_split="test",
                                 train_split="train")
    assert held_out_split(data, lambda path, split: load_rows(path, split=split)) == rows


def test_a_held_out_file_the_training_folder_also_reads_is_refused(tmp_path):
    """`data.path=folder` with `prompts.jsonl` and `heldout.jsonl`, `data.eval_path=folder/heldout.jsonl`: the folder's
    training split reads every file not named after a held-out split, so the held-out rows were trained on too (both
    loads returned the 2 held-out rows: 5 training rows, 2 of them the held-out ones), without a word."""
    from data.prompts import held_out_split

    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"question": f"q{index}", "answer": "a"}) + "\n"
                                                  for index in range(3)))
    held_out = [{"question": f"h{index}", "answer": "a"} for index in range(2)]
    (folder / "heldout.jsonl").write_text("".join(json.dumps(row) + "\n" for row in held_out))
    assert len(load_rows(str(folder))) == 5
    load = lambda path, split: load_rows(path, split=split)  # noqa: E731
    data = types.SimpleNamespace(path=str(folder), eval_path=str(folder / "heldout.jsonl"), eval_split="test",
                                 train_split="train")
    with pytest.raises(UserError, match=r"`data.eval_path=.*heldout.jsonl` holds heldout.jsonl, which the training "
                                        r"split of `data.path=.*folder` reads too"):
        held_out_split(data, load)
    # Named after a held-out split it is held out, named as the file itself or by its folder's split.
    (folder / "heldout.jsonl").rename(folder / "test.jsonl")
    for eval_path in (folder / "test.jsonl", folder):
        data.eval_path = str(eval_path)
        assert held_out_split(data, load) == held_out and len(load_rows(str(folder))) == 3


def test_a_held_out_split_the_training_split_also_reads_is_refused(tmp_path):
    """`data.path=folder` with `all.jsonl` and `heldout.jsonl`, `--data.eval_split heldout` (as docs/sft.md gives
    `--data.eval_split dev` for a dev.jsonl): the folder has no train* file, so its training split read every file not
    named after a held-out split, heldout.jsonl included: 600 rows trained on (500 + the 100 held-out ones) and the
    held-out figures measured on 100 of them, without a word. The same for a held-out split whose name starts with the
    training split's (`train_holdout` beside `train`)."""
    from data.prompts import held_out_split

    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "all.jsonl").write_text("".join(json.dumps({"question": f"q{index}", "answer": "a"}) + "\n"
                                              for index in range(3)))
    held_out = [{"question": f"h{index}", "answer": "a"} for index in range(2)]
    (folder / "heldout.jsonl").write_text("".join(json.dumps(row) + "\n" for row in held_out))
    load = lambda path, split: load_rows(path, split=split)  # noqa: E731
    data = types.SimpleNamespace(path=str(folder), eval_path="", eval_split="heldout", train_split="train")
    with pytest.raises(UserError, match=r"`data.eval_split=heldout` reads heldout.jsonl of `data.path=.*folder`, which "
                                        r"the training split reads too"):
        held_out_split(data, load)
    (folder / "all.jsonl").rename(folder / "train.jsonl")  # named after the training split: heldout.jsonl is held out
    assert held_out_split(data, load) == held_out and len(load_rows(str(folder))) == 3
    (folder / "heldout.jsonl").rename(folder / "train_holdout.jsonl")
    data.eval_split = "train_holdout"
    with pytest.raises(UserError, match=r"`data.eval_split=train_holdout` reads train_holdout.jsonl"):
        held_out_split(data, load)


def test_arithmetic_splits():
    assert len(load_rows("arithmetic")) == 10000
    assert len(load_rows("arithmetic", split="test")) == 1000
    assert load_rows("arithmetic", split="eval") == load_rows("arithmetic", split="test")


@pytest.mark.slow
def test_gsm8k_train_goes_through_the_whole_pipeline(tokenizer):
    train_file = GSM8K / "train.jsonl"
    if not train_file.exists():
        pytest.skip(f"GSM8K is not at {train_file}")
    line_count = sum(1 for line in train_file.read_text().splitlines() if line.strip())
    conversations, report = to_conversations(load_rows(str(train_file)))
    examples = build_examples(conversations, tokenizer, 512, report)
    assert report.used + report.dropped == line_count == report.rows_read
    assert (report.used, report.dropped, report.truncated) == (GSM8K_USED, GSM8K_DROPPED, GSM8K_TRUNCATED)
    assert len(examples) == report.used and max(len(example.input_ids) for example in examples) == 513


def test_encode_texts_gives_the_tokenizers_own_ids(tokenizer):
    """The Rust-backend shortcut equals `tokenizer(texts)`, special tokens written in the text included."""
    conversations, _ = to_conversations(load_rows("arithmetic", sft_targets=True)[:200])
    texts = [tokenizer.apply_chat_template(turns, tokenize=False) for turns in conversations]
    texts += ["", " leading space", "<|im_end|> in text\n\n#### 1,000"]
    expected = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert tokenizer.is_fast and encode_texts(texts, tokenizer) == expected
    assert encode_texts([], tokenizer) == []


# --- batching and packing -------------------------------------------------------------------------


def test_collate_right_pads_with_no_loss_on_padding():
    batch = collate([Example([5, 6, 7], [0, 1, 1]), Example([8, 9], [0, 1])], seq_len=4, pad_id=0)
    assert batch["tokens"].tolist() == [[5, 6, 0, 0], [8, 0, 0, 0]]
    assert batch["labels"].tolist() == [[6, 7, 0, 0], [9, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]
    assert batch["position_ids"][0, :2].tolist() == [0, 1] and batch["attention_mask"] is None
    dtypes = (batch["tokens"].dtype, batch["labels"].dtype, batch["loss_mask"].dtype)
    assert dtypes == (torch.int64, torch.int64, torch.float32)


def test_packed_rows_restart_positions_and_attend_block_diagonally():
    first, second = Example([10, 11, 12], [0, 1, 1]), Example([20, 21, 22, 23], [0, 0, 1, 1])
    rows = pack([first, second], seq_len=6)
    assert rows == [[first, second]]
    batch = collate_packed(rows, seq_len=6, pad_id=0)
    assert batch["tokens"].tolist() == [[10, 11, 20, 21, 22, 0]]
    # The first sample's last input predicts its own last token (12), never the second sample's first.
    assert batch["labels"].tolist() == [[11, 12, 21, 22, 23, 0]]
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0]]
    attends = [  # 1 = may attend; the mask holds True where attention is blocked
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert batch["attention_mask"].shape == (1, 1, 6, 6) and batch["attention_mask"].dtype == torch.bool
    assert (~batch["attention_mask"][0, 0]).int().tolist() == attends


def test_packed_microbatches_are_padded_to_their_own_longest_row():
    """Packed rows were padded to `data.max_seq_len` whatever they held: at 2048, two samples of 9 and 11 input tokens
    went in as one row of 2048 positions (99% padding, where unpacked rows of 16 hold 38%). Each micro-batch's rows
    are padded to its own longest row, rounded up to 8 (and to sequence parallelism's multiple), as unpacked ones."""
    from config.loops import SFTConfig
    from trainer.sft import collate_microbatches

    config = SFTConfig()
    config.data.pack, config.data.max_seq_len = True, 2048
    examples = [Example(list(range(3, 13)), [1] * 10), Example(list(range(3, 15)), [1] * 12),
                Example(list(range(3, 33)), [1] * 30)]
    collated, seq_len = collate_microbatches(examples, [[0, 1], [2]], config, 0, torch.device("cpu"))
    assert [tuple(batch["tokens"].shape) for batch in collated] == [(1, 24), (1, 32)] and seq_len == 32
    assert collated[0]["attention_mask"].shape == (1, 1, 24, 24)
    assert collated[0]["labels"][0, :20].tolist() == [*range(4, 13), *range(4, 15)]
    config.parallel.tp, config.parallel.sequence_parallel = 2, True
    assert config.parallel.sequence_multiple == 2  # rounded to lcm(8, 2): the same shapes
    assert [batch["tokens"].shape[1] for batch in collate_microbatches(examples, [[0, 1], [2]], config, 0, "cpu")[0]] == [24, 32]


def test_pack_is_first_fit_in_order_and_keeps_every_example_once():
    lengths = [5, 3, 4, 2, 6, 1, 3]  # input tokens per example
    examples = [Example([number] * (length + 1), [1] * (length + 1)) for number, length in enumerate(lengths)]
    rows = pack(examples, seq_len=8)
    assert [[examples.index(example) for example in row] for row in rows] == [[0, 1], [2, 3, 5], [4], [6]]
    assert sorted(id(example) for row in rows for example in row) == sorted(id(example) for example in examples)
    assert all(sum(len(example.input_ids) - 1 for example in row) <= 8 for row in rows)
    with pytest.raises(ValueError):
        pack([Example(list(range(10)), [1] * 10)], seq_len=8)


def test_a_token_budget_groups_rows_of_similar_length_and_agrees_on_the_count():
    """`train.micro_batch_tokens`: longest rows first, a micro-batch filled while rows x padded length fits; each
    mini-batch split (halving its largest micro-batch) to the count the ranks agree on; every row exactly once."""
    lengths = [8, 99, 16, 32, 99, 8, 59, 16]  # input positions; padded: 8, 104, 16, 32, 104, 8, 64, 16

    def pad(longest):
        return padded_size(longest, max_seq_len=128)

    def padded(group):
        return pad(max(lengths[index] for index in group))

    assert token_budget_microbatches(lengths, [list(range(8))], 256, pad, lambda count: count) == [
        [1, 4], [6, 3, 2, 7], [0, 5]]
    # Another rank needed 5: the largest micro-batch is halved, then the first of two rows.
    assert token_budget_microbatches(lengths, [list(range(8))], 256, pad, lambda count: max(count, 5)) == [
        [1], [4], [6, 3], [2, 7], [0, 5]]
    # GRPO's mini-batches are grouped apart and get one count: here 2 each (the second needed 2, the first 2).
    assert token_budget_microbatches(lengths, [[0, 1, 2, 3], [4, 5, 6, 7]], 256, pad, lambda count: count) == [
        [1, 3], [2, 0], [4, 6], [7, 5]]
    for budget in (128, 256, 1000):
        groups = token_budget_microbatches(lengths, [list(range(8))], budget, pad, lambda count: count)
        assert sorted(index for group in groups for index in group) == list(range(8))
        assert all(len(group) * padded(group) <= budget for group in groups)
    # Against 2 rows a micro-batch in order (padded to 104, 32, 104, 64: 608 tokens), 480: 208 + 256 + 16.
    assert sum(len(group) * padded(group)
               for group in token_budget_microbatches(lengths, [list(range(8))], 256, pad, lambda count: count)) == 480


def test_held_out_forwards_keep_the_token_budget_of_the_training_micro_batches(tmp_path):
    """Under `train.micro_batch_tokens` the held-out loss's forwards were `train.micro_batch_size` rows each (32 by
    default): the baseline evaluation fed 6 rows x 64 = 384 positions at once under a budget of 128. Now they are
    grouped by the same budget; without one, `train.micro_batch_size` rows a call, as before."""
    import socket

    import torch.distributed as dist

    from config.loops import SFTConfig
    from trainer.sft import held_out_calls, interleaved_share

    share = [Example(list(range(length + 1)), [0] + [1] * length) for length in (60, 10, 60, 10, 10, 10)]
    config = SFTConfig()
    config.data.max_seq_len, config.train.micro_batch_size = 64, 4
    assert held_out_calls(share, config, interleaved=0) == [[[0, 1, 2, 3]], [[4, 5]]]
    assert held_out_calls(share, config, interleaved=2) == [[[0], [1], [2], [3]], [[4], [5]]]
    # The interleaved schedule takes a multiple of PP micro-batches a call: megatron-core raised on calls of 3 (and of
    # 1) rows at PP=2 in the baseline evaluation, a traceback before the first step.
    config.train.micro_batch_size = 3
    assert held_out_calls(share, config, interleaved=2) == [[[0], [1]], [[2], [3]], [[4], [5]]]
    config.train.micro_batch_size = 1
    assert held_out_calls(share, config, interleaved=2) == [[[0], [1]], [[2], [3]], [[4], [5]]]
    # An odd number of rows (train.eval_samples=7) is filled up to a multiple of PP with a row the loss does not read.
    odd = interleaved_share(share[:5], 2)
    assert odd[:5] == share[:5] and odd[5] == Example(share[4].input_ids, [0] * 11) and interleaved_share(share, 2) == share
    config.train.micro_batch_tokens = 128
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        calls = held_out_calls(share, config, interleaved=0)
    finally:
        dist.destroy_process_group()
    assert calls == [[[0, 2], [1, 3, 4, 5]]]  # 2 rows x 64 and 4 rows x 16 positions, each within 128
    assert [len(batch) * padded_size(max(len(share[row].input_ids) - 1 for row in batch), 64) for batch in calls[0]] == [128, 64]


def test_packed_and_unpacked_batches_give_identical_token_losses(checkpoint, tokenizer):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    conversations, report = to_conversations(load_rows("arithmetic")[:6])
    examples = build_examples(conversations, tokenizer, 100, report)

    def token_losses(batch: dict) -> torch.Tensor:
        """Per-token masked losses [batch, seq] from the Hugging Face model."""
        mask = batch["attention_mask"]
        # Hugging Face adds a 4D float mask to the scores, so blocked pairs become -inf-like.
        additive = None if mask is None else torch.zeros(mask.shape).masked_fill(mask, torch.finfo(torch.float32).min)
        with torch.no_grad():
            output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=additive)
        logits = output.logits  # [batch, seq, vocab]
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
        return losses * batch["loss_mask"]  # [batch, seq]

    rows = pack(examples, seq_len=100)
    assert len(rows) < len(examples)
    unpacked = token_losses(collate(examples, 100, tokenizer.pad_token_id))
    packed = token_losses(collate_packed(rows, 100, tokenizer.pad_token_id))
    assert torch.equal(unpacked[unpacked != 0], packed[packed != 0])


# --- batch order ----------------------------------------------------------------------------------


def schedule(dp_rank: int = 0, dp_size: int = 1, seed: int = 7) -> BatchSchedule:
    """A schedule over 20 examples with global batches of 8 in microbatches of 2."""
    return BatchSchedule(20, global_batch_size=8, micro_batch_size=2, dp_rank=dp_rank, dp_size=dp_size, seed=seed)


def flatten(microbatches: list[list[int]]) -> list[int]:
    """Join microbatches into one list of indices."""
    return [index for microbatch in microbatches for index in microbatch]


def test_schedule_is_deterministic_and_shapes_microbatches():
    first, again = schedule(), schedule()
    batches = [first.next_global_batch() for _ in range(5)]
    assert batches == [again.next_global_batch() for _ in range(5)]
    assert first.batches_per_epoch == 2 and all(len(batch) == 4 and len(batch[0]) == 2 for batch in batches)
    assert batches != [schedule(seed=8).next_global_batch() for _ in range(5)]
    # Each epoch draws 16 distinct indices of 20 (the tail of 4 is dropped), in a fresh order.
    epoch_zero, epoch_one = flatten(batches[0]) + flatten(batches[1]), flatten(batches[2]) + flatten(batches[3])
    assert len(set(epoch_zero)) == len(set(epoch_one)) == 16 and epoch_zero != epoch_one
    assert first.epoch == 2


def test_data_parallel_shares_are_disjoint_and_make_up_the_global_batch():
    whole, rank_zero, rank_one = schedule(), schedule(dp_rank=0, dp_size=2), schedule(dp_rank=1, dp_size=2)
    for _ in range(5):
        share_zero, share_one = rank_zero.next_global_batch(), rank_one.next_global_batch()
        assert len(share_zero) == len(share_one) == 2 and len(share_zero[0]) == 2
        assert flatten(share_zero) + flatten(share_one) == flatten(whole.next_global_batch())
        assert not set(flatten(share_zero)) & set(flatten(share_one))


# Mid-epoch, exactly at the epoch boundary (the next batch opens epoch 1), and into epoch 1.
@pytest.mark.parametrize("consumed, epoch, consumed_in_epoch", [(1, 0, 1), (2, 0, 2), (3, 1, 1)])
def test_resume_from_state_dict_reproduces_the_next_batches(consumed, epoch, consumed_in_epoch):
    original = schedule()
    for _ in range(consumed):
        original.next_global_batch()
    state = original.state_dict()
    assert state == {"epoch": epoch, "batches_consumed_in_epoch": consumed_in_epoch, "seed": 7, "examples": 20,
                     "contents": ""}
    resumed = schedule(seed=999)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [resumed.next_global_batch() for _ in range(4)] == [original.next_global_batch() for _ in range(4)]
    assert resumed.state_dict() == original.state_dict()


def test_a_resume_onto_data_of_another_size_says_the_epochs_rest_is_reordered(caplog):
    """data.max_seq_len or data.pack changed on resume change how many examples there are: the rest of the epoch's
    order is then another (some repeat, some are left out), which used to pass without a word."""
    original = schedule()
    original.next_global_batch()
    resumed = BatchSchedule(24, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1, seed=7)
    with caplog.at_level("INFO", logger="data.sft"):
        resumed.load_state_dict(original.state_dict())
    assert "the data holds 24 examples and the checkpoint's held 20" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="data.sft"):
        schedule().load_state_dict({**original.state_dict(), "examples": 20})
        schedule().load_state_dict({key: value for key, value in original.state_dict().items() if key != "examples"})
    assert "examples" not in caplog.text  # the same data, and a checkpoint from before the count was kept


def test_a_resume_onto_reordered_data_of_the_same_size_says_the_epochs_rest_is_reordered(caplog):
    """Rows reordered (or replaced) in place keep the count, and the epoch's order indexes rows by position: the rest
    of the epoch then repeats some examples and leaves others out, which passed without a word. The checkpoint notes
    the examples' digest (`model.collectives.content_digest`), and a resume over other contents says so."""
    from model.collectives import content_digest

    rows = [Example([n, n + 1, n + 2], [0, 1, 1]) for n in range(20)]
    original = BatchSchedule(20, 8, 2, 0, 1, seed=7, contents=content_digest(rows))
    original.next_global_batch()
    with caplog.at_level("INFO", logger="data.sft"):
        BatchSchedule(20, 8, 2, 0, 1, seed=7, contents=content_digest(rows[::-1])).load_state_dict(original.state_dict())
    assert "the data holds as many examples as the checkpoint's (20), but other ones or in another order" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="data.sft"):
        BatchSchedule(20, 8, 2, 0, 1, seed=7, contents=content_digest(list(rows))).load_state_dict(original.state_dict())
        schedule().load_state_dict({**original.state_dict(), "contents": ""})  # saved before the digest was kept
    assert not caplog.text


def test_a_chat_template_that_refuses_a_conversation_is_a_paragraph_naming_its_roles():
    """Mistral's and Llama 2's templates raise on roles that do not alternate: a UserError naming the roles, not a
    jinja2 traceback."""
    from data.encode import chat_text
    from model.tiny import ensure_tiny_checkpoint

    tokenizer = transformers.AutoTokenizer.from_pretrained(ensure_tiny_checkpoint())
    tokenizer.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                               "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                               "{{ m['content'] }}{% endfor %}")
    with pytest.raises(UserError, match=r"refused a conversation \(system -> user -> assistant\): Conversation roles must "
                                        "alternate user/assistant. Give the rows in the form this template takes"):
        chat_text([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                   {"role": "assistant", "content": "a"}], tokenizer, None)
    assert chat_text([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], tokenizer, None) == "ua"


def test_a_missing_column_or_empty_data_names_the_file_it_is_in():
    """A held-out file (`data.eval_path`) whose rows lack the field was reported as if the training data did."""
    with pytest.raises(UserError, match=r"^data.prompt_field is 'question', but `held.jsonl` \(train\) has no such column; "
                                        r"its columns are \['messages'\]"):
        to_conversations([{"messages": []}], source="`held.jsonl` (train)")
    with pytest.raises(UserError, match=r"^`held.jsonl` \(train\) holds no rows"):
        to_conversations([], source="`held.jsonl` (train)")
    with pytest.raises(UserError, match=r"^`held.jsonl` \(train\) gave no usable rows: 0 of 1 rows used"):
        to_conversations([{"question": "q", "answer": 3}], source="`held.jsonl` (train)")
