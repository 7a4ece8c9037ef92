"""Unit tests for SFT on tool-use conversations: row tools, tool calls and results, their loss mask, and prompts."""

import json

import pytest

from data.prompts import prompts_from_conversations
from data.conversations import to_conversations
from data.sft import examples_cache_key, tokenize_conversation
from model.tiny import build_tokenizer

CALCULATOR_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
WEATHER_SCHEMA = {"type": "function", "function": {
    "name": "weather", "description": "Today's weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# One call in the OpenAI form, one flat with the arguments as JSON text (as the OpenAI API writes them).
TOOL_ROW = {"messages": [
    {"role": "user", "content": "What is 12 * 7 and 3 + 4?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 7"}}},
        {"name": "calculator", "arguments": '{"expression": "3 + 4"}'},
    ]},
    {"role": "tool", "name": "calculator", "tool_call_id": "call_0", "content": "84"},
    {"role": "tool", "name": "calculator", "content": "7"},
    {"role": "assistant", "content": "12 * 7 = 84 and 3 + 4 = 7."},
], "tools": [CALCULATOR_SCHEMA]}
TOOL_CALL_TURN = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call><|im_end|>')
ANSWER_TURN = "12 * 7 = 84 and 3 + 4 = 7.<|im_end|>"
# Counted on the tokens printed once: each `<tool_call>` block is 9 (`<tool_call>`) + 1 (`\n`) + the JSON line
# (54 tokens with "12 * 7", 53 with "3 + 4") + 1 (`\n`) + 10 (`</tool_call>`), so 75 and 74; with the `\n`
# between them and `<|im_end|>` the turn is 151. The answer is 19 tokens + `<|im_end|>` = 20. In all 171.
TRAINED_TOKENS = 171


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression to evaluate, such as "3 + 4".
    """
    return str(eval(expression))


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny model's tokenizer, whose chat template renders tools in Qwen2.5's form."""
    return build_tokenizer()


def learned_spans(tokenizer, input_ids: list[int], loss_mask: list[int]) -> list[str]:
    """Decode each contiguous run of loss-masked tokens."""
    spans, current = [], []
    for token, flag in zip(input_ids, loss_mask):
        if flag:
            current.append(token)
        elif current:
            spans, current = spans + [current], []
    spans += [current] if current else []
    return [tokenizer.decode(span, skip_special_tokens=False) for span in spans]


def unlearned_text(tokenizer, input_ids: list[int], loss_mask: list[int]) -> str:
    """Decode every token outside the loss mask, in order."""
    return tokenizer.decode([token for token, flag in zip(input_ids, loss_mask) if not flag], skip_special_tokens=False)


# --- the loss mask --------------------------------------------------------------------------------


def test_tool_calls_are_learned_and_tool_results_are_not(tokenizer):
    conversations, report = to_conversations([TOOL_ROW], messages_field="messages")
    (conversation,) = conversations
    assert report.used == 1 and conversation.tools == [CALCULATOR_SCHEMA]
    assert conversation[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 7"}}},
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3 + 4"}}},
    ]}
    assert conversation[2] == {"role": "tool", "content": "84", "name": "calculator", "tool_call_id": "call_0"}

    input_ids, loss_mask = tokenize_conversation(conversation, tokenizer)
    rendered = tokenizer.apply_chat_template(conversation, tools=[CALCULATOR_SCHEMA], tokenize=False)
    assert rendered.startswith("<|im_start|>system\nTools: calculator(expression)<|im_end|>\n")
    assert input_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert sum(loss_mask) == TRAINED_TOKENS
    assert learned_spans(tokenizer, input_ids, loss_mask) == [TOOL_CALL_TURN, ANSWER_TURN]
    # The tool results and the template's text around them are context, not targets.
    assert unlearned_text(tokenizer, input_ids, loss_mask) == (
        "<|im_start|>system\nTools: calculator(expression)<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 * 7 and 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
        "\n<|im_start|>user\n<tool_response>\n84\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n\n"
    )


def test_a_parquet_files_unified_schema_adds_no_null_arguments_or_parameters(tmp_path, tokenizer):
    """A Parquet column has one schema, so pyarrow gives each row's call arguments and tool schemas every other row's
    names as nulls: the calculator call was trained as `{"city": null, "expression": "12 * 7"}` and offered a `city`
    parameter. Read through `data.path` as a user's file is."""
    import pyarrow
    import pyarrow.parquet

    from data.conversations import load_rows

    weather_row = {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "name": "weather", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."}], "tools": [WEATHER_SCHEMA]}
    calculator_row = {"messages": TOOL_ROW["messages"][:2] + TOOL_ROW["messages"][3:], "tools": [CALCULATOR_SCHEMA]}
    calculator_row["messages"][1] = {**calculator_row["messages"][1], "tool_calls": calculator_row["messages"][1]["tool_calls"][:1]}
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([weather_row, calculator_row]), tmp_path / "train.parquet")
    rows = load_rows(str(tmp_path / "train.parquet"))
    assert rows[1]["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"city": None, "expression": "12 * 7"}

    conversations, report = to_conversations(rows, messages_field="messages")
    assert report.used == 2
    assert [conversation.tools for conversation in conversations] == [[WEATHER_SCHEMA], [CALCULATOR_SCHEMA]]
    assert conversations[1][1]["tool_calls"][0]["function"]["arguments"] == {"expression": "12 * 7"}
    input_ids, loss_mask = tokenize_conversation(conversations[1], tokenizer)
    assert learned_spans(tokenizer, input_ids, loss_mask)[0] == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call><|im_end|>')
    # Arguments as JSON text (the OpenAI API's form) passed through no table schema: a null there is the data's own.
    texts = {"messages": [weather_row["messages"][0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris", "unit": null}'}}]},
        *weather_row["messages"][2:]]}
    (conversation,), _ = to_conversations([texts], messages_field="messages")
    assert conversation[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": None}


# Mistral-7B-Instruct-v0.3's chat template, its tool parts as it ships them (the tools list left out): each call is
# written with its `id`, which must be 9 characters, and a tool result names the call it answers.
MISTRAL_TOOL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message.role == 'user' %}[INST] {{ message.content }}[/INST]"
    "{% elif message.tool_calls is defined and message.tool_calls is not none %}[TOOL_CALLS] ["
    "{% for tool_call in message.tool_calls %}{% set out = tool_call.function|tojson %}{{ out[:-1] }}"
    "{% if not tool_call.id is defined or tool_call.id|length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{{ ', \"id\": \"' + tool_call.id + '\"}' }}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif message.role == 'assistant' %} {{ message.content }}{{ eos_token }}"
    "{% elif message.role == 'tool' %}[TOOL_RESULTS] {\"content\": {{ message.content }}, "
    "\"call_id\": \"{{ message.tool_call_id }}\"}[/TOOL_RESULTS]{% endif %}{% endfor %}")


def test_a_tool_calls_id_is_kept_and_learned_where_the_template_writes_it():
    """A call's `id` (OpenAI's form) is kept: Mistral's template writes it into the call the model learns and refuses
    a call without one. It was dropped, so every tool row was refused for Mistral ("Tool call IDs should be
    alphanumeric strings with length 9!"), and a template that writes it when given learned calls without it."""
    mistral = build_tokenizer()
    mistral.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]})
    mistral.chat_template = MISTRAL_TOOL_TEMPLATE
    row = {"messages": [
        {"role": "user", "content": "What is 12 * 7?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call00001", "type": "function", "function": {
            "name": "calculator", "arguments": '{"expression": "12 * 7"}'}}]},
        {"role": "tool", "name": "calculator", "tool_call_id": "call00001", "content": "84"},
        {"role": "assistant", "content": "84."}]}
    (conversation,), _ = to_conversations([row], messages_field="messages")
    assert conversation[1]["tool_calls"][0]["id"] == "call00001"
    input_ids, loss_mask = tokenize_conversation(conversation, mistral)
    assert learned_spans(mistral, input_ids, loss_mask) == [
        '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "12 * 7"}, "id": "call00001"}]<|im_end|>',
        " 84.<|im_end|>"]


def test_a_row_without_tools_renders_and_masks_as_the_plain_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tom has 3 apples and buys 4 more."},
        {"role": "assistant", "content": "3 + 4 = 7\n#### 7"},
        {"role": "user", "content": "And 2 more?"},
        {"role": "assistant", "content": "7 + 2 = 9\n#### 9"},
    ]
    rows = [{"messages": messages}, {"messages": messages, "tools": None}, {"messages": messages, "tools": "[]"}]
    conversations, _ = to_conversations(rows, messages_field="messages")
    assert conversations == [messages] * 3 and [conversation.tools for conversation in conversations] == [None] * 3
    for conversation in conversations:
        input_ids, loss_mask = tokenize_conversation(conversation, tokenizer)
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        assert input_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        # 11 tokens for each answer ("3", " +", " ", "4", " =", " ", "7", "\n", "####", " ", "7") + `<|im_end|>`.
        assert sum(loss_mask) == 24
        assert learned_spans(tokenizer, input_ids, loss_mask) == ["3 + 4 = 7\n#### 7<|im_end|>",
                                                                  "7 + 2 = 9\n#### 9<|im_end|>"]
        assert "Tools:" not in rendered


def test_the_cache_key_follows_the_tools(tokenizer):
    without, report = to_conversations([{**TOOL_ROW, "tools": None}], messages_field="messages")
    with_tools, _ = to_conversations([TOOL_ROW], messages_field="messages")
    assert without == with_tools  # the messages are the same; only the tools differ
    assert examples_cache_key(without, tokenizer, 64, report) != examples_cache_key(with_tools, tokenizer, 64, report)


# --- malformed rows -------------------------------------------------------------------------------


def test_malformed_tool_messages_are_dropped_and_counted_by_reason():
    user = {"role": "user", "content": "What is 3 + 4?"}
    answer = {"role": "assistant", "content": "7"}

    def call(function: dict) -> dict:
        """An assistant turn of one tool call in the OpenAI form."""
        return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": function}]}

    rows = [
        {"messages": TOOL_ROW["messages"], "tools": json.dumps(TOOL_ROW["tools"])},  # tools as JSON text: kept
        {"messages": [user, call({"name": "calculator", "arguments": {}})]},  # a turn of tool calls alone: kept
        {"messages": [user, call({"arguments": {"expression": "3 + 4"}}), answer]},
        {"messages": [user, call({"name": "calculator", "arguments": "3 + 4"}), answer]},
        {"messages": [{**user, "tool_calls": [{"name": "calculator", "arguments": {}}]}, answer]},
        {"messages": [user, {"role": "tool", "content": {"result": 7}}, answer]},
        {"messages": [user, {"role": "tool", "content": "7", "tool_call_id": 3}, answer]},
        {"messages": [user, {"role": "assistant", "content": None}, answer]},
        {"messages": [user, {"role": "assistant", "content": "", "tool_calls": []}]},
        {"messages": [user, answer], "tools": "[{"},
        {"messages": [user, answer], "tools": [{"type": "function", "function": {"description": "no name"}}]},
    ]
    conversations, report = to_conversations(rows, messages_field="messages")
    assert report.kept_rows == [0, 1] and conversations[0].tools == [CALCULATOR_SCHEMA]
    assert conversations[1][1]["tool_calls"] == [
        {"type": "function", "function": {"name": "calculator", "arguments": {}}}]
    assert report.dropped_by_reason == {"tool call without a name": 1, "tool call arguments not JSON": 1,
                                        "malformed tool call": 1, "malformed tool message": 2, "malformed messages": 1,
                                        "no assistant turn": 1, "malformed tools": 2}
    assert report.first_drops == [(2, "tool call without a name"), (3, "tool call arguments not JSON"),
                                  (4, "malformed tool call"), (5, "malformed tool message"),
                                  (6, "malformed tool message")]


def test_broken_tool_calls_and_results_without_a_call_are_skipped_and_named():
    """The module's rule for a bad row (skip it, count it by reason, name the first ones in the summary the loops log)
    holds for broken calls too: none of a broken call is trained on."""
    user, answer = {"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "7"}
    result = {"role": "tool", "name": "calculator", "content": "7"}

    def calls(*functions: dict) -> dict:
        """An assistant turn of tool calls in the OpenAI form."""
        return {"role": "assistant", "content": None,
                "tool_calls": [{"type": "function", "function": function} for function in functions]}

    good = {"name": "calculator", "arguments": '{"expression": "3 + 4"}'}
    rows = [
        {"messages": [user, calls(good), result, answer]},  # arguments as JSON text: kept
        {"messages": [user, calls({"name": "calculator", "arguments": '{"expression": "3 + 4"'}), result, answer]},
        {"messages": [user, calls({"name": "calculator", "arguments": '["3 + 4"]'}), result, answer]},
        {"messages": [user, calls({"arguments": '{"expression": "3 + 4"}'}), result, answer]},
        {"messages": [user, calls(good, {"name": " ", "arguments": {}}), result, result, answer]},
        {"messages": [user, result, answer]},  # a result before any call
        {"messages": [user, calls(good), result, result, answer]},  # one call, two results
        {"messages": [user, answer, result, {"role": "assistant", "content": "Still 7."}]},  # after a plain answer
    ]
    conversations, report = to_conversations(rows, messages_field="messages")
    assert report.kept_rows == [0]
    assert conversations[0][1]["tool_calls"] == [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3 + 4"}}}]
    assert report.first_drops == [(1, "tool call arguments not JSON"), (2, "tool call arguments not an object"),
                                  (3, "tool call without a name"), (4, "tool call without a name"),
                                  (5, "tool result without a call")]
    assert report.dropped_by_reason["tool result without a call"] == 3
    assert report.summary() == (
        "1 of 8 rows used, 7 dropped (tool call arguments not JSON: 1, tool call arguments not an object: 1, "
        "tool call without a name: 2, tool result without a call: 3), 0 truncated; first dropped: "
        "row 1 (tool call arguments not JSON), row 2 (tool call arguments not an object), row 3 (tool call without a "
        "name), row 4 (tool call without a name), row 5 (tool result without a call)")


# --- prompts --------------------------------------------------------------------------------------


def test_prompts_offer_the_given_tools_or_else_the_rows_own(tokenizer):
    plain = [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "#### 7"}]
    conversations, _ = to_conversations([{"messages": plain}, {**TOOL_ROW, "tools": [WEATHER_SCHEMA]}],
                                        messages_field="messages")

    given = prompts_from_conversations(conversations, tokenizer, tools=[calculator])
    texts = [tokenizer.decode(prompt.ids) for prompt in given]
    assert texts[0] == ("<|im_start|>system\nTools: calculator(expression)<|im_end|>\n"
                        "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n")
    assert texts[1].startswith("<|im_start|>system\nTools: calculator(expression)<|im_end|>\n<|im_start|>user\n")
    assert texts[1].endswith("<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert [prompt.tools for prompt in given] == [[calculator], [calculator]]

    own = prompts_from_conversations(conversations, tokenizer)
    assert tokenizer.decode(own[0].ids) == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(own[1].ids).startswith("<|im_start|>system\nTools: weather(city)<|im_end|>\n")
    assert [prompt.tools for prompt in own] == [None, [WEATHER_SCHEMA]]
    assert [prompt.reference for prompt in own] == ["#### 7", "12 * 7 = 84 and 3 + 4 = 7."]
    assert own[0].messages == plain[:1] and own[1].messages == conversations[1][:4]


def test_grpo_refuses_prompts_offering_tools_it_cannot_run(tokenizer):
    """Rows whose `tools` column offers tools, in a GRPO run with no `grpo.tools` or environment: the policy was shown
    tools it could not call, and a call it wrote was scored as its answer, without a word."""
    from config.errors import UserError
    from data import tools

    conversations, _ = to_conversations([TOOL_ROW, {"messages": TOOL_ROW["messages"]}], messages_field="messages")
    prompts = prompts_from_conversations(conversations, tokenizer)
    assert [bool(prompt.tools) for prompt in prompts] == [True, False]
    with pytest.raises(UserError, match=r"1 of the 2 prompts of `rows.jsonl` offer tools of their own .* neither "
                                        r"`grpo.tools` nor `grpo.environment` is set"):
        tools.check_offered_tools_run(None, prompts, "rows.jsonl")
    tools.check_offered_tools_run(None, prompts[1:], "rows.jsonl")  # no tools offered
    toolset = tools.Toolset.from_config(type("Settings", (), {"tools": ["tests.tool_fixtures:digits"], "environment": ""})())
    tools.check_offered_tools_run(toolset, prompts, "rows.jsonl")  # the run's own tools are offered instead
