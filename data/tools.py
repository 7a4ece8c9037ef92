"""Tools the policy calls inside its GRPO rollouts: the user's side (functions and environments), reading a turn's
tool calls, running them, and the token ids of the messages a turn appends.

The user's side, the smaller of TRL's and verl's:
- a tool is a plain function with type hints and a Google-style docstring (`grpo.tools: [module:function]`); its
  schema is transformers' `get_json_schema`, never written by hand;
- a stateful task is an environment class (`grpo.environment: module:Class`): one instance per episode,
  `reset(row)` called first (it may return text, appended to the prompt's last user message), its public methods
  the tools, and an optional `reward()` whose value is ADDED to the reward function's score.

Reading a turn: `tokenizer.parse_response` with the tokenizer's own `response_schema`, or, where it has none,
`TOOL_CALL_SCHEMA`, the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` form of Qwen2.5 and Hermes
(the fallback transformers' own server uses for Qwen's families).

Appending: a turn's tool messages become token ids as the difference between two renders of the conversation by
the model's chat template, without and with them (plus the generation header of the next assistant turn); only
that difference is tokenized, so the ids of earlier turns, the policy's own samples, are never re-tokenized. A
template that rewrites earlier turns when more are added cannot be continued this way and is refused at start-up.
"""

import dataclasses
import inspect
import json
import logging
import math
import threading
import time
from collections.abc import Callable

from config.errors import UserError
from data import user_code

log = logging.getLogger(__name__)

# `tokenizer.parse_response`'s schema for the common form: free text, then each call as JSON in <tool_call> tags.
TOOL_CALL_SCHEMA = {
    "type": "object",
    "properties": {
        "role": {"const": "assistant"},
        "content": {"type": "string", "x-regex": r"^(.*?)\s*(?:<tool_call>|\Z)"},
        "tool_calls": {"type": "array", "x-regex-iterator": r"<tool_call>\s*(.*?)\s*</tool_call>",
                       "items": {"type": "object", "x-parser": "json"}},
    },
}
TOOL_CALL_START = "<tool_call>"
# Methods of an environment that are not tools.
ENVIRONMENT_HOOKS = ("reset", "reward")
# What a tool call ended as (a key of `Outcome.kind`); the episode's counters use the same names.
OUTCOMES = ("ok", "error", "timeout", "unknown_tool")


# ---------------------------------------------------------------- the user's side


def tool_schema(function: Callable, key: str, spec: str) -> dict:
    """The JSON schema transformers derives from `function`'s signature and docstring; a UserError naming `key` when
    it cannot (no docstring, an argument without a type hint or without a description)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as error:  # DocstringParsingException, TypeHintParsingException
        raise UserError(f"`{key}`: the tool {spec} has no schema transformers can read ({error}). A tool needs type "
                        "hints on every argument and a Google-style docstring with a description and an `Args:` "
                        f"line per argument (docs/tools.md has an example). Fix the function or change `--{key}`.") from None


@dataclasses.dataclass
class Toolset:
    """The tools a run offers, loaded and checked at start-up: functions, or an environment class (one per episode)."""

    functions: dict[str, Callable]  # the plain tools, by name (an environment's are bound per episode)
    environment: type | None
    schemas: list[dict]  # in the order the system prompt lists them

    @classmethod
    def from_config(cls, grpo) -> "Toolset | None":
        """The tools of `grpo.tools` and `grpo.environment`, or None without either; UserErrors before any model is built."""
        if not grpo.tools and not grpo.environment:
            return None
        functions, schemas = {}, []
        for spec in grpo.tools:
            function = user_code.load(spec, "grpo.tools", "Each tool is a function given as `module:function`.")
            if not callable(function):
                raise UserError(f"`grpo.tools`: {spec} is not a function. Change `--grpo.tools`.")
            schema = tool_schema(function, "grpo.tools", spec)
            functions[schema["function"]["name"]] = function
            schemas.append(schema)
        environment = None
        if grpo.environment:
            environment = user_code.load(grpo.environment, "grpo.environment", "An environment is a class given as `module:Class`.")
            if not inspect.isclass(environment):
                raise UserError(f"`grpo.environment={grpo.environment}` is not a class. Change `--grpo.environment`.")
            for name, method in environment_methods(environment):
                schema = tool_schema(method, "grpo.environment", f"{grpo.environment}.{name}")
                schemas.append(schema)
        names = [schema["function"]["name"] for schema in schemas]
        if len(set(names)) != len(names):
            raise UserError(f"`grpo.tools` and `grpo.environment` name a tool twice ({', '.join(names)}); tool names "
                            "must be unique. Change one of them.")
        if not names:
            raise UserError(f"`grpo.environment={grpo.environment}` has no public method to offer as a tool (methods "
                            f"named {' or '.join(ENVIRONMENT_HOOKS)}, or starting with `_`, are not tools).")
        return cls(functions, environment, schemas)

    def episode(self, row: dict) -> tuple["Episode", str | None]:
        """A new episode's tools (its own environment instance, reset with the data row) and the text reset returned."""
        if self.environment is None:
            return Episode(dict(self.functions), None), None
        try:
            environment = self.environment()
            extra = environment.reset(row) if hasattr(environment, "reset") else None
        except Exception as error:  # a user's environment may fail in any way; no episode can start without it
            raise UserError(f"`grpo.environment`: {self.environment.__name__}() or its reset(row) raised "
                            f"{type(error).__name__}: {error} (row: {str(row)[:200]}). Fix the environment, or change "
                            "`--grpo.environment`.") from None
        tools = {**self.functions, **dict(environment_methods(environment))}
        return Episode(tools, environment), None if extra is None else str(extra)


def environment_methods(environment) -> list[tuple[str, Callable]]:
    """An environment's (class or instance) tools: its public methods other than reset and reward."""
    return [(name, member) for name, member in inspect.getmembers(environment, callable)
            if not name.startswith("_") and name not in ENVIRONMENT_HOOKS]


# ---------------------------------------------------------------- a turn's tool calls


@dataclasses.dataclass
class Call:
    """One parsed tool call."""

    name: str
    arguments: dict


def parse_turn(tokenizer, text: str) -> tuple[str, list[Call], str | None]:
    """(content, tool calls, parse error) of one assistant turn's text: by the tokenizer's `response_schema`, else
    `TOOL_CALL_SCHEMA`. A turn that tries to call (or whose schema raises) and yields no well-formed call has an error."""
    schema = getattr(tokenizer, "response_schema", None) or TOOL_CALL_SCHEMA
    try:
        parsed = tokenizer.parse_response(text, schema)
    except Exception as error:  # the schema's JSON parser raises on malformed calls, ending its message with json's
        return text, [], f"the tool call could not be parsed ({str(error).strip().rsplit('Error: ', 1)[-1]})"
    calls = []
    for item in parsed.get("tool_calls") or []:
        function = item.get("function", item) if isinstance(item, dict) else None
        arguments = function.get("arguments", {}) if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not isinstance(arguments, dict):
            return text, [], f"the tool call {item!r} has no name or no arguments object"
        calls.append(Call(function["name"], arguments))
    if not calls and TOOL_CALL_START in text and schema is TOOL_CALL_SCHEMA:
        return text, [], f"`{TOOL_CALL_START}` without a closing tag"
    return parsed.get("content") or "", calls, None


@dataclasses.dataclass
class Outcome:
    """A tool call's result as the tool message's text, and what it ended as (one of `OUTCOMES`)."""

    text: str
    kind: str


class Episode:
    """One episode's tools: the functions by name, and its environment instance (None without)."""

    def __init__(self, tools: dict[str, Callable], environment):
        self.tools, self.environment = tools, environment

    def reward(self) -> float:
        """The environment's own reward for the episode (0 without an environment or a `reward` method)."""
        if self.environment is None or not hasattr(self.environment, "reward"):
            return 0.0
        try:
            value = float(self.environment.reward())
            if not math.isfinite(value):
                raise ValueError(f"reward {value}")
            return value
        except Exception as error:  # as a failing reward function: scores 0, is said, and the run goes on
            log.warning("the environment's reward() raised %s: %s; the episode's environment reward is 0",
                        type(error).__name__, error)
            return 0.0


def run_calls(calls: list[tuple[Episode, Call]], timeout: float) -> list[Outcome]:
    """Run tool calls in parallel threads, each within `timeout` seconds; never raises.

    A tool that raises gives its error text as the result (as TRL and verl do), an unknown name an error naming the
    tools, a call past its timeout an error saying so. A timed-out tool's thread cannot be stopped: it runs on
    (a daemon thread, so it never holds the process at exit) and its result is dropped."""
    boxes: list[list] = [[] for _ in calls]

    def call_into(box: list, function: Callable, arguments: dict) -> None:
        try:
            box.append(Outcome(result_text(function(**arguments)), "ok"))
        except Exception as error:  # a user's tool may fail in any way
            box.append(Outcome(f"Error: {type(error).__name__}: {error}", "error"))

    threads = []
    for box, (episode, call) in zip(boxes, calls):
        function = episode.tools.get(call.name)
        if function is None:
            box.append(Outcome(f"Error: unknown tool {call.name!r}; the tools are {', '.join(sorted(episode.tools))}.",
                               "unknown_tool"))
            continue
        thread = threading.Thread(target=call_into, args=(box, function, call.arguments), daemon=True)
        thread.start()
        threads.append((box, thread))
    deadline = time.monotonic() + timeout
    for box, thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        if not box:
            box.append(Outcome(f"Error: the tool did not answer within {timeout:g} s (grpo.tool_timeout).", "timeout"))
    return [box[0] for box in boxes]


def result_text(result) -> str:
    """A tool's return value as the tool message's text: strings as they are, anything else as JSON where it can be."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


# ---------------------------------------------------------------- rendering: the ids a turn appends


def end_texts(tokenizer, end_ids) -> list[str]:
    """The text of each end id (the template writes one of them to close a turn)."""
    return [tokenizer.convert_ids_to_tokens(int(token)) for token in end_ids]


def appended_text(tokenizer, messages: list[dict], new: list[dict], schemas: list[dict], ends: list[str]) -> str | None:
    """The text the chat template adds after a conversation's last assistant turn's end id for `new` messages and
    the next assistant header: the glue after that end id, then the difference of the two renders. None when the
    template rewrites the conversation's earlier text instead of appending."""
    render = tokenizer.apply_chat_template
    before = render(messages, tools=schemas or None, tokenize=False)
    after = render(messages + new, tools=schemas or None, tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        return None
    closed = [before.rfind(end) + len(end) for end in ends if end in before]
    if not closed:
        return None
    return before[max(closed):] + after[len(before):]


def check_template(tokenizer, schemas: list[dict], ends: list[str]) -> None:
    """Refuse, before any model is built, a chat template multi-turn rollouts cannot continue: one that rewrites
    earlier turns as turns are added, does not close an assistant turn with an end id, or renders tool calls in a form
    `parse_turn` cannot read back. Checked on a dummy conversation calling the first tool."""
    function = schemas[0]["function"]
    arguments = {name: "1" for name in function.get("parameters", {}).get("properties", {})}
    user = {"role": "user", "content": "What is 1 + 1?"}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": function["name"], "arguments": arguments}}]}
    answer = {"role": "assistant", "content": "2"}
    name = getattr(tokenizer, "name_or_path", "") or "(unnamed)"

    def refuse(problem: str):
        raise UserError(f"The chat template of tokenizer {name!r} cannot run multi-turn tool rollouts: {problem}. Each turn "
                        "must render as a plain suffix of the conversation before it, so that only the new messages' "
                        "tokens are appended and the policy's own tokens are never re-tokenized. Use a model whose "
                        "template appends turns (Qwen2.5 and Llama 3's do; Qwen3's drops earlier reasoning), or set "
                        "the tokenizer's `chat_template` to such a template; or run without `grpo.tools` and "
                        "`grpo.environment`.")

    try:
        prompt = tokenizer.apply_chat_template([user], tools=schemas, tokenize=False, add_generation_prompt=True)
        called = tokenizer.apply_chat_template([user, call], tools=schemas, tokenize=False)
    except Exception as error:  # a template may raise on tools or tool_calls it does not know
        refuse(f"rendering a conversation with a tool call raised {type(error).__name__}: {error}")
    if not called.startswith(prompt):
        refuse("the assistant turn does not continue the generation header")
    turn = called[len(prompt):]
    cut = min((turn.find(end) for end in ends if end in turn), default=-1)
    if cut < 0:
        refuse(f"an assistant turn is not closed by an end id ({', '.join(ends)})")
    _, calls, error = parse_turn(tokenizer, turn[:cut])
    if error or [parsed.name for parsed in calls] != [function["name"]]:
        refuse(f"its tool call renders as {turn[:cut]!r}, which does not parse back as a call of {function['name']!r} "
               "(the tokenizer has no `response_schema` and the text is not the `<tool_call>{json}</tool_call>` form)")
    tool = {"role": "tool", "name": function["name"], "content": "2"}
    try:
        text = appended_text(tokenizer, [user, call], [tool], schemas, ends)
        header = tokenizer.apply_chat_template([user, call, tool], tools=schemas, tokenize=False, add_generation_prompt=True)
        final = tokenizer.apply_chat_template([user, call, tool, answer], tools=schemas, tokenize=False)
    except Exception as error:
        refuse(f"rendering a tool message raised {type(error).__name__}: {error}")
    if text is None:
        refuse("adding a tool message rewrites the text before it")
    if not final.startswith(header):
        refuse("adding the answer after a tool message rewrites the text before it")
