"""Tools the policy calls inside its GRPO rollouts: the user's side (functions and environments), and each episode's
tools and environment. Reading a turn's calls and the token ids its tool messages append are `data.tool_text`.

The user's side, the smaller of TRL's and verl's:
- a tool is a plain function with type hints and a Google-style docstring (`grpo.tools: [module:function]`); its
  schema is transformers' `get_json_schema`, never written by hand;
- a stateful task is an environment class (`grpo.environment: module:Class`): one instance per episode,
  `reset(row)` (or `reset(row, seed)`: the group's seed) called first (it may return text, appended to the prompt's
  last message, usually its last user message; a group's episodes must return the same), its public methods
  the tools, and an optional `reward()` whose value is ADDED to the reward function's score.
"""

import copy
import dataclasses
import inspect
import logging
import math
import sys
from collections.abc import Callable

from config.errors import UserError
from config import user_code
from tool_runtime import runner as tool_runner
from tool_runtime import worker as tool_worker
from data import rewards
from data.tool_text import Call

log = logging.getLogger(__name__)

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
            if inspect.isclass(function):  # calling it would answer with a new instance's repr
                raise UserError(f"`grpo.tools`: {spec} is a class, not a function: a tool is called and its return "
                                "value is the tool message. A class whose methods are the tools, one instance per "
                                f"episode, is an environment: `--grpo.environment {spec}`. Change `--grpo.tools`.")
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
            where = tool_worker.where_raised(error, getattr(sys.modules.get(self.environment.__module__), "__file__", None))
            raise UserError(f"`grpo.environment`: {self.environment.__name__}() or its reset(row) raised "
                            f"{type(error).__name__}: {error}{f' ({tool_worker.RAISED_AT}{where})' if where else ''} "
                            f"(row: {str(row)[:200]}). Fix the environment, or change "
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
    return tool_worker.awaited(environment.reset(row, seed=seed) if takes_seed else environment.reset(row))


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
        raise UserError(f"With tools, one turn of a rank's {episodes} episodes on {workers} tool worker{'s' * (workers != 1)} could take "
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
    thread within `grpo.reward_timeout`, as in the run."""
    if toolset is None or not (grpo.filters_by_accuracy() and grpo.reward == "none"):
        return
    instance = toolset.episode(row, seed=0, timeout=grpo.tool_timeout)[0].environment
    try:
        value = tool_runner.call_on_main_thread_within(
            grpo.reward_timeout, instance.reward, f"it did not return within {grpo.reward_timeout:g} s (grpo.reward_timeout)"
        ) if hasattr(instance, "reward") else None
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


def check_offered_tools_run(toolset: "Toolset | None", prompts, path: str) -> None:
    """Refuse, before any model is built, prompts that offer tools of their own (a `tools` column beside chat messages)
    in a run with no tools to run: the policy would be shown tools it cannot call, and a call it wrote would be scored
    as its answer."""
    offering = prompts.offering_tools() if prompts else 0  # a `data.prompts.PromptSet`, or no prompts ([])
    if toolset is None and offering:
        raise UserError(f"{offering} of the {len(prompts)} prompts of `{path}` offer tools of their own (the rows' "
                        "`tools` column), and neither `grpo.tools` nor `grpo.environment` is set: the policy would be "
                        "shown tools it cannot call, and a call it wrote would be scored as its answer. Set "
                        "`--grpo.tools` to the functions (`[module:function, ...]`, offered with every prompt instead), "
                        "or use data without the `tools` column.")


def environment_methods(environment) -> list[tuple[str, Callable]]:
    """An environment's (class or instance) tools: its public methods other than reset and reward."""
    return [(name, member) for name, member in inspect.getmembers(environment, callable)
            if not name.startswith("_") and name not in ENVIRONMENT_HOOKS]


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

    @property
    def has_reward(self) -> bool:
        """Whether `reward()` will call its environment's: it has one, and the episode was not abandoned."""
        return self.environment is not None and hasattr(self.environment, "reward") and not self.abandoned

    def reward(self, seconds: float = 0.0) -> tuple[float, bool | None, tuple[str, str] | None]:
        """The environment's own reward for the episode; when `reward()` returns `(reward, correct)`, whether the
        episode is correct (DAPO's filter reads it); and what went wrong (the exception's name, and a line naming the
        method and the exception), when it raised, returned no finite
        number or ran past `seconds` (`grpo.reward_timeout`; 0: no limit): the reward is then 0, and the loop counts it
        in `reward_errors` as a reward function's failure. (0, None, None) without an environment or a `reward`
        method, and for an episode whose environment was abandoned at a timeout (its reward is never read while a call
        may run). Called on the trainer's main thread, stopped there by a SIGALRM timer: graders that time themselves
        with signals (as math_verify does) only work there, and one that failed on a thread would score every episode 0."""
        if not self.has_reward:
            return 0.0, None, None
        name = f"`{type(self.environment).__name__}.reward()`"
        try:
            value, correct = tool_runner.call_on_main_thread_within(
                seconds, self.environment.reward, f"it did not return within {seconds:g} s (grpo.reward_timeout)"), None
            if isinstance(value, tuple) and len(value) == 2:
                value, correct = value[0], rewards.as_verdict(value[1])
            return rewards.as_reward(value), correct, None
        except Exception as error:  # as a failing reward function: scores 0, is counted and said, and the run goes on
            where = tool_worker.where_raised(error, getattr(getattr(self.environment.reward, "__code__", None),
                                                            "co_filename", None))
            return 0.0, None, (type(error).__name__, f"{name} raised {type(error).__name__}: "
                                                     f"{' '.join(str(error).split())[:200]}"
                                                     f"{f' ({tool_worker.RAISED_AT}{where})' if where else ''}")
