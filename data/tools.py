"""Tools the policy calls inside its GRPO rollouts: the user's side (functions and environments), reading a turn's
tool calls, running them, and the token ids of the messages a turn appends.

The user's side, the smaller of TRL's and verl's:
- a tool is a plain function with type hints and a Google-style docstring (`grpo.tools: [module:function]`); its
  schema is transformers' `get_json_schema`, never written by hand;
- a stateful task is an environment class (`grpo.environment: module:Class`): one instance per episode,
  `reset(row)` (or `reset(row, seed)`: the group's seed) called first (it may return text, appended to the prompt's
  last user message; a group's episodes must return the same), its public methods
  the tools, and an optional `reward()` whose value is ADDED to the reward function's score.

Reading a turn: `tokenizer.parse_response` with the tokenizer's own `response_schema`, or, where it has none,
`TOOL_CALL_SCHEMA`, the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` form of Qwen2.5 and Hermes
(the fallback transformers' own server uses for Qwen's families).

Appending: a turn's tool messages become token ids as the difference between two renders of the conversation by
the model's chat template, without and with them (plus the generation header of the next assistant turn); only
that difference is tokenized, so the ids of earlier turns, the policy's own samples, are never re-tokenized. A
template that rewrites earlier turns when more are added cannot be continued this way and is refused at start-up.
"""

import copy
import dataclasses
import inspect
import json
import logging
import math
from collections.abc import Callable

from config.errors import UserError
from config import user_code
from tool_runtime import runner as tool_runner
from data.encode import encode_texts, unpadded_backend

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
    specs: dict[str, str] = dataclasses.field(default_factory=dict)  # the plain tools' `module:function`, by name

    @classmethod
    def from_config(cls, grpo) -> "Toolset | None":
        """The tools of `grpo.tools` and `grpo.environment`, or None without either; UserErrors before any model is built."""
        if not grpo.tools and not grpo.environment:
            return None
        functions, schemas, specs = {}, [], {}
        for spec in grpo.tools:
            function = user_code.load(spec, "grpo.tools", "Each tool is a function given as `module:function`.")
            if not callable(function):
                raise UserError(f"`grpo.tools`: {spec} is not a function. Change `--grpo.tools`.")
            schema = tool_schema(function, "grpo.tools", spec)
            functions[schema["function"]["name"]] = function
            specs[schema["function"]["name"]] = spec
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
        return cls(functions, environment, schemas, specs)

    def episode(self, row: dict, seed: int = 0, timeout: float | None = None) -> tuple["EpisodeTools", str | None]:
        """A new episode's tools (its own environment instance, reset with the data row, and with `seed` when reset
        takes one: `reset_environment`, within `timeout` seconds: `grpo.tool_timeout`) and the text reset returned."""
        if self.environment is None:
            return EpisodeTools(dict(self.functions), None, self.specs), None
        try:
            environment, extra = tool_runner.call_within(timeout, start_environment, self.environment, row, seed)
        except Exception as error:  # a user's environment may fail in any way; no episode can start without it
            raise UserError(f"`grpo.environment`: {self.environment.__name__}() or its reset(row) raised "
                            f"{type(error).__name__}: {error} (row: {str(row)[:200]}). Fix the environment, or change "
                            "`--grpo.environment`" + (" (or raise `--grpo.tool_timeout`)." if isinstance(error, TimeoutError)
                                                      else ".")) from None
        tools = {**self.functions, **dict(environment_methods(environment))}
        return EpisodeTools(tools, environment, self.specs), None if extra is None else str(extra)


def start_environment(environment_class: type, row: dict, seed: int) -> tuple:
    """A new instance of the environment, reset (`reset_environment`): the instance and the text reset returned."""
    environment = environment_class()
    # Its own copy of the row: an environment that changes what reset was given (pops the answer, say) would change
    # it for the group's next episodes.
    return environment, reset_environment(environment, copy.deepcopy(row), seed)


def reset_environment(environment, row: dict, seed: int):
    """`environment.reset(row)`, or `reset(row, seed)` when it has a `seed` parameter (what reset returns; None without
    reset). A group's episodes share one prompt, so they get one seed: an environment that draws its state at random
    (a hidden number, a maze) draws it from the seed, and the group's episodes start from the same state, which the
    prompt shows; the seed comes from the step's sampling seed, so a resumed run draws the same states."""
    if not hasattr(environment, "reset"):
        return None
    takes_seed = "seed" in inspect.signature(environment.reset).parameters
    return environment.reset(row, seed=seed) if takes_seed else environment.reset(row)


def check_turn_fits_collective_timeout(config, world_size: int) -> None:
    """Refuse, before any model is built, tools whose one turn on a rank could outlast the collective timeout: while a
    rank runs its turn's calls its tensor- and pipeline-parallel peers wait in a broadcast and its data-parallel peers in
    the step's agreement, and on NCCL the watchdog ends the job there without a word of why. The bound counts one call
    per episode per turn, each at `grpo.tool_timeout`, on `grpo.tool_workers` at once."""
    grpo, parallel = config.grpo, config.parallel
    if not (grpo.tools or grpo.environment):
        return
    episodes = config.train.global_batch_size // max(1, parallel.data_parallel_size(world_size))  # a round, one rank
    workers = grpo.tool_workers or tool_runner.default_workers()
    worst = math.ceil(episodes / workers) * grpo.tool_timeout
    if worst > parallel.timeout_minutes * 60:
        raise UserError(f"With tools, one turn of a rank's {episodes} episodes on {workers} tool workers could take "
                        f"{worst:g} s (one call each, each at `grpo.tool_timeout={grpo.tool_timeout:g}`), longer than the "
                        f"collective timeout its peers wait in meanwhile, `parallel.timeout_minutes="
                        f"{parallel.timeout_minutes}` ({parallel.timeout_minutes * 60} s): on NCCL the watchdog would end "
                        "the run mid-step. Raise `--parallel.timeout_minutes`, lower `--grpo.tool_timeout`, or raise "
                        "`--grpo.tool_workers`.")


def check_filter_reads_accuracy(toolset: "Toolset | None", grpo, row: dict) -> None:
    """Refuse, before any model is built, DAPO's accuracy filter where no episode could ever be correct:
    `grpo.reward=none` (the environment's reward alone) and an environment whose `reward()` gives no verdict (a
    plain number, not `(reward, correct)`), probed on a throwaway episode of the first training row. Every group
    would be dropped: each step would run all `grpo.max_sampling_rounds` and train on fill-ins. The episode starts as
    the run's do (within `grpo.tool_timeout`; one that fails is the run's error, said now) and `reward()` runs on this
    thread, as in the run."""
    if toolset is None or not (grpo.dynamic_sampling and grpo.filter_metric == "accuracy" and grpo.reward == "none"):
        return
    instance = toolset.episode(row, seed=0, timeout=grpo.tool_timeout)[0].environment
    try:
        value = instance.reward() if hasattr(instance, "reward") else None
    except Exception as error:  # a fresh episode's reward may not be defined yet: the run says it at its first step
        log.info("could not probe %s.reward() on a fresh episode (%s: %s)", toolset.environment.__name__,
                 type(error).__name__, error)
        return
    if not (isinstance(value, tuple) and len(value) == 2):
        raise UserError(f"DAPO's filter (`grpo.dynamic_sampling=true`, `grpo.filter_metric=accuracy`) keeps groups whose "
                        f"accuracy varies, but with `grpo.reward=none` accuracy can only come from the environment, and "
                        f"`{toolset.environment.__name__}.reward()` returns {type(value).__name__} {str(value)[:40]}, not "
                        "`(reward, correct)`: no episode would ever be correct, every group would be dropped, and every "
                        "step would run all its sampling rounds. Return `(reward, correct)` from `reward()`, or set "
                        "`--grpo.filter_metric=reward` to keep groups whose reward varies.")


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


class EpisodeTools:
    """One episode's tools: the functions by name, the `module:function` of the plain ones (a worker process imports
    them by it), and its environment instance (None without)."""

    def __init__(self, tools: dict[str, Callable], environment, specs: dict[str, str] | None = None):
        self.tools, self.environment, self.specs = tools, environment, specs or {}
        self.abandoned = False  # a call of its environment timed out and may still run against the instance

    def job(self, calls: list[Call]) -> tool_runner.Job:
        """These calls, in order, for the tool runner (against the environment instance when the episode has one)."""
        return tool_runner.Job([(call.name, self.tools.get(call.name), self.specs.get(call.name), call.arguments)
                                for call in calls], self.environment is not None, list(self.tools))

    def reward(self) -> tuple[float, bool | None]:
        """The environment's own reward for the episode and, when `reward()` returns `(reward, correct)`, whether the
        episode is correct (DAPO's filter reads it); (0, None) without an environment or a `reward` method, and for
        an episode whose environment was abandoned at a timeout (its reward is never read while a call may run).
        Called on the trainer's main thread, with no time limit: graders that time themselves with signals (as
        math_verify does) only work there, and one that failed on a thread would score every episode 0."""
        if self.environment is None or not hasattr(self.environment, "reward") or self.abandoned:
            return 0.0, None
        try:
            value, correct = self.environment.reward(), None
            if isinstance(value, tuple) and len(value) == 2:
                value, correct = value[0], bool(value[1])
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"reward {value}")
            return value, correct
        except Exception as error:  # as a failing reward function: scores 0, is said, and the run goes on
            log.warning("the environment's reward() raised %s: %s; the episode's environment reward is 0",
                        type(error).__name__, error)
            return 0.0, None


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


# Rendered where a text goes, to find where the template puts it (letters only: no template escapes or trims them).
SLOT = "TEXTSLOTQX{}QX"
# A token is at most this many characters, in practice: a tool result is cut to the limit's characters before it is
# tokenized, so a 1 MB result costs no more to cut than a short one.
MAX_CHARS_PER_TOKEN = 32


def encode_plain(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as plain text: a special token's string in it (`<|im_end|>`) is tokenized as the characters
    it is, never as the control id."""
    if getattr(tokenizer, "is_fast", False):
        with unpadded_backend(tokenizer) as backend:
            previous = backend.encode_special_tokens  # a flag on the shared backend: restored for every other caller
            backend.encode_special_tokens = True
            try:
                return backend.encode(text, add_special_tokens=False).ids
            finally:
                backend.encode_special_tokens = previous
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def render_ids(tokenizer, render: Callable[[list[str]], str | None], texts: list[str]) -> list[int] | None:
    """Token ids of `render(texts)`, a chat template's text holding `texts` (tool results, an environment's reset
    text), where each of `texts` is plain text and the template's own tokens around them stay special: a result
    holding `<|im_end|>\n<|im_start|>assistant\n` cannot forge a turn. None when `render` gives None, or does not
    place each text where its slot goes."""
    slots = [SLOT.format(index) for index in range(len(texts))]
    templated, full = render(slots), render(texts)
    if templated is None or full is None:
        return None
    spans, cursor = [], 0
    for slot in slots:
        start = templated.find(slot, cursor)
        if start < 0:
            return None
        spans.append((start, start + len(slot)))
        cursor = start + len(slot)
    pieces = [templated[end:start] for (_, end), (start, _) in zip([(0, 0), *spans], [*spans, (len(templated), 0)])]
    rendered = list(texts)  # as the template writes them: verbatim, or escaped (a template may `tojson` a result)
    if "".join(piece + text for piece, text in zip(pieces, [*rendered, ""])) != full:
        for index, (start, end) in enumerate(spans):
            one = render(slots[:index] + [texts[index]] + slots[index + 1 :])
            suffix = len(templated) - end
            if one is None or not (one.startswith(templated[:start]) and one.endswith(templated[end:])) or len(one) < start + suffix:
                return None
            rendered[index] = one[start : len(one) - suffix]
        if "".join(piece + text for piece, text in zip(pieces, [*rendered, ""])) != full:
            return None
    templates = encode_texts(pieces, tokenizer)  # the template's own text: special tokens live
    ids = list(templates[0])
    for text, piece_ids in zip(rendered, templates[1:]):
        ids += encode_plain(tokenizer, text) + piece_ids
    return ids


def appended_ids(tokenizer, messages: list[dict], new: list[dict], schemas: list[dict], ends: list[str]) -> list[int] | None:
    """The ids of `appended_text`, each new message's content tokenized as plain text (`render_ids`); None where the
    template rewrites the conversation's earlier text."""
    def render(contents: list[str]) -> str | None:
        filled = [dict(message, content=content) for message, content in zip(new, contents)]
        return appended_text(tokenizer, messages, filled, schemas, ends)

    return render_ids(tokenizer, render, [message["content"] for message in new])


def cut_result(tokenizer, text: str, max_tokens: int) -> tuple[str, bool]:
    """A tool result cut to `max_tokens` tokens of plain text, its message saying so, and whether it was cut; cut to
    `max_tokens * MAX_CHARS_PER_TOKEN` characters before it is tokenized."""
    head = text[: max_tokens * MAX_CHARS_PER_TOKEN]
    ids = encode_plain(tokenizer, head)
    if len(ids) <= max_tokens and len(head) == len(text):
        return text, False
    kept = tokenizer.decode(ids[:max_tokens], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return f"{kept} [cut: {len(text):,} characters, the limit is {max_tokens} tokens]", True


def turn_text(tokenizer, ids: list[int], end_ids) -> str:
    """A turn's sampled ids as the text `parse_turn` reads: special tokens kept (a call marker may be one, as
    Mistral's `[TOOL_CALLS]`), the end id that closed the turn left off."""
    if ids and ids[-1] in end_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


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
