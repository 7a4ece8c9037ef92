"""Episodes: what GRPO's rollouts and the held-out evaluation sample, single-turn or with tools.

Without tools an episode is one completion. With tools (`grpo.tools`, `grpo.environment`) it is a trajectory of
turns, kept as token ids from the first to the last:
- a turn ends at an end id; its text (special tokens kept: a call marker may be one) is parsed for tool calls
  (`data.tool_text.parse_turn`). No call: the episode ends, and that turn is its answer (what the reward function
  scores). Calls: an episode's run one after another in the order written, different episodes' side by side, each
  within `grpo.tool_timeout` of its own start (`tool_runtime.runner`); their results become the template's tool
  messages, and the ids of those messages and of the next assistant header (`data.tool_text.appended_ids`: the
  results tokenized as plain text, so they cannot forge a turn) are appended into the same KV cache while
  generation goes on (`model.generate`'s `continue_rows`); the policy's own ids are never re-tokenized;
- a call that does not parse becomes an error message the policy sees next (as a raising tool does) and the
  episode goes on; an unknown tool, a raising tool and a plain function's timeout likewise, each counted; a call of
  an environment past its timeout ends the episode (counted), and its environment's reward is 0, never read;
- an episode ends at `grpo.max_turns` assistant turns of its own (the prompt's earlier turns do not count; a call in
  the last one is not run: counted), and when the next messages would not fit in what is left of
  `grpo.max_new_tokens` (counted), which bounds the whole trajectory, appended tokens included; a tool result
  longer than `grpo.max_tool_response_tokens` is cut, and its message says so (error and timeout texts never are);
- a prompt that an environment's `reset` text makes longer than `data.max_seq_len - grpo.max_new_tokens` is skipped
  and counted (`prompts_too_long`): its group's episodes score 0 and train no token;
- only sampled tokens are trained (`Episode.sampled`): appended ones get loss mask 0, so no log-prob, KL or entropy
  term, and every token-counting normaliser of the loss counts sampled tokens only.

Under tensor and pipeline parallelism the user's code (tools, environments, and the reward) runs on the first rank of
the model-parallel group only, and its results are sent to the others (`model.parallel.run_once_per_replica`), so a
tool runs once per model replica, and one that answers differently each call never splits the peers that hold one
model's shards and stages.
"""

import collections
import dataclasses
import hashlib
import logging
import time

from config import console
from config.errors import UserError
from data import prompts as prompt_data, rewards, tool_text
from tool_runtime import runner as tool_runner
from model import replica
from model.sampling import Sampling

log = logging.getLogger(__name__)
# A tool call's outcome (`tool_runtime.runner.Outcome.kind`) -> the counter it adds to.
FAILURES = {"error": "tool_errors", "timeout": "tool_timeouts", "unknown_tool": "unknown_tools"}

# An environment's reward() calls of a batch that all run past `grpo.reward_timeout` before the rest are not made.
GIVE_UP_AFTER = 4
# The prefix of an environment's reward() failure kinds among a step's reward failures (`score`).
ENVIRONMENT_FAILURE = "reward() "

# Per-episode counters of tool use, summed over a step's episodes for metrics.jsonl.
COUNTERS = ("turns", "tool_calls", "tool_errors", "parse_errors", "tool_timeouts", "timeout_ends", "unknown_tools",
            "max_turns_reached", "out_of_room", "truncated_tool_responses", "prompts_too_long")


@dataclasses.dataclass
class Episode:
    """One sampled episode: its prompt ids, the ids after them (sampled and appended), which of those were sampled,
    the answer (the last assistant turn's text), and its tool counters."""

    prompt: prompt_data.Prompt
    prompt_ids: list[int]
    ids: list[int]
    sampled: list[int]  # 1 where the policy sampled the token, 0 where it was appended (tool messages, glue)
    answer: str
    counts: collections.Counter
    environment_reward: float = 0.0
    environment_correct: bool | None = None  # the environment's own verdict, when its reward() returns (reward, correct)
    skipped: bool = False  # its prompt no longer fit after the environment's reset text: scores 0, trains nothing
    logprobs: list[float] = dataclasses.field(default_factory=list)  # the sampler's log-prob of each of `ids` (0: appended)
    routes: object = None  # Mixture-of-Experts: [prompt + ids, layers, top-k] experts each id took (model.generate)
    environment_failure: tuple[str, str] | None = None  # its reward() failed (raised, no number, past its time): how, why


@dataclasses.dataclass
class _Trajectory:
    """An episode's state while it is generated (on the rank that runs the tools)."""

    messages: list[dict]
    tools: object  # data.tools.EpisodeTools
    consumed: int = 0  # ids of the completion already turned into messages
    ended: bool = False  # ended by continue_rows (its last turn is counted there)
    turns: int = 0  # assistant turns the episode has produced (the prompt's own are not counted)
    skipped: bool = False  # its prompt no longer fits after the reset text


def group_seed(seed: int, group: int) -> int:
    """The seed an environment's `reset(row, seed)` gets for group `group` of a round sampled with `seed`."""
    digest = hashlib.sha256(f"reset:{seed}:{group}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Rollout:
    """Samples episodes from prompts: single-turn without a toolset, multi-turn with one. Built once per run."""

    def __init__(self, tokenizer, toolset, end_ids, *, max_turns: int = 1, max_tool_response_tokens: int = 0,
                 tool_timeout: float = 0.0, tool_workers: int = 0, tool_isolation: str = "process",
                 max_prompt_tokens: int | None = None, reward_timeout: float = 0.0):
        self.tokenizer, self.toolset, self.end_ids = tokenizer, toolset, tuple(end_ids)
        self.max_turns, self.max_tool_response_tokens = max_turns, max_tool_response_tokens
        self.max_prompt_tokens = max_prompt_tokens  # data.max_seq_len - grpo.max_new_tokens (None: unchecked)
        self.reward_timeout = reward_timeout  # each environment reward() call's limit (0: none)
        self.said_skipped = False  # the first skipped prompt is said once
        self.runner = tool_runner.ToolRunner(tool_timeout, tool_workers, tool_isolation,
                                             preload=list(toolset.specs.values()) if toolset is not None else [])
        self.ends = tool_text.end_texts(tokenizer, self.end_ids)
        self.schemas = toolset.schemas if toolset is not None else []

    @classmethod
    def from_config(cls, config, tokenizer, toolset, end_ids, tools_on: bool = True) -> "Rollout":
        """The run's rollout (`tools_on=False`: the same model and prompts with no tools, for comparison)."""
        grpo = config.grpo
        return cls(tokenizer, toolset if tools_on else None, end_ids, max_turns=grpo.max_turns,
                   max_tool_response_tokens=grpo.max_tool_response_tokens, tool_timeout=grpo.tool_timeout,
                   tool_workers=grpo.tool_workers, tool_isolation=grpo.tool_isolation,
                   max_prompt_tokens=config.data.max_seq_len - grpo.max_new_tokens, reward_timeout=grpo.reward_timeout)

    def close(self) -> None:
        """Stop the tool worker processes."""
        self.runner.close()

    # ---- sampling

    def run(self, engine, prompts: list, *, samples: int, max_new_tokens: int, sampling: Sampling,
            record_routes: bool = False) -> tuple[list[Episode], float]:
        """`samples` episodes of each prompt (a prompt's consecutively) and the seconds spent in tools. Collective like
        `Engine.generate`, and over the model-parallel group with tools. `record_routes`: a Mixture-of-Experts
        policy's episodes keep their routes (`Episode.routes`)."""
        if self.toolset is None:
            completions = engine.generate([prompt.ids for prompt in prompts], samples=samples,
                                             max_new_tokens=max_new_tokens, sampling=sampling, record_routes=record_routes)
            texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
            rows = [prompt for prompt in prompts for _ in range(samples)]
            routes = completions.routes or [None] * len(completions)
            return [Episode(prompt, prompt.ids, ids, [1] * len(ids), text, collections.Counter({"turns": 1}),
                            logprobs=logprobs, routes=taken)
                    for prompt, ids, text, logprobs, taken in zip(rows, completions, texts, completions.logprobs, routes)], 0.0
        prompt_ids, skipped_prompts = replica.run_once_per_replica(self._start, prompts, samples, sampling.seed)
        self.counts = [collections.Counter() for _ in range(len(prompts) * samples)]
        for index in skipped_prompts:
            self.counts[index * samples]["prompts_too_long"] += 1  # once per prompt, on its group's first episode
        self.spans = [[] for _ in range(len(prompts) * samples)]  # (start, length) of each appended run of ids
        self.tool_seconds = 0.0
        completions = engine.generate(prompt_ids, samples=samples, max_new_tokens=max_new_tokens, sampling=sampling,
                                         continue_rows=self._continue_rows, record_routes=record_routes)
        routes = completions.routes or [None] * len(completions)
        rows = [index for index in range(len(prompts)) for _ in range(samples)]
        finals = replica.run_once_per_replica(self._finish, completions)
        episodes = []
        for row, (prompt_index, ids) in enumerate(zip(rows, completions)):
            sampled = [1] * len(ids)
            for start, length in self.spans[row]:
                sampled[start : start + length] = [0] * length
            answer, (environment_reward, correct, failure), last_turn, skipped = finals[row]
            self.counts[row]["turns"] += last_turn
            if skipped:  # nothing of it is trained, and it scores 0 (`score`)
                sampled = [0] * len(ids)
            episodes.append(Episode(prompts[prompt_index], prompt_ids[prompt_index], ids, sampled, answer,
                                    self.counts[row], environment_reward, correct, skipped, completions.logprobs[row],
                                    routes[row], failure))
        return episodes, self.tool_seconds

    def _start(self, prompts: list, samples: int, seed: int) -> tuple[list[list[int]], list[int]]:
        """Each episode's tools (an environment instance each, reset with its group's seed) and each prompt's ids,
        reshaped by `reset` when the environment returns text (a group shares its prompt, so its episodes must return
        the same text), tokenized as plain text; a prompt it makes too long keeps its ids, and its group is skipped
        (said once a run): the ids, and the skipped prompts."""
        self.trajectories, prompt_ids, skipped_prompts = [], [], []
        for number, prompt in enumerate(prompts):
            started = [self.toolset.episode(prompt.row, seed=group_seed(seed, number), timeout=self.runner.timeout)
                       for _ in range(samples)]
            messages = [dict(message) for message in prompt.messages]
            extra, ids, skipped = self._group_text([text for _, text in started]), prompt.ids, False
            if extra:
                def render(texts: list[str], messages=messages) -> str:
                    last = dict(messages[-1], content=f"{messages[-1]['content']}\n\n{texts[0]}")
                    return self.tokenizer.apply_chat_template(messages[:-1] + [last], tools=self.schemas, tokenize=False,
                                                              add_generation_prompt=True)
                reshaped = tool_text.render_ids(self.tokenizer, render, [extra])
                if reshaped is None or (self.max_prompt_tokens is not None and len(reshaped) > self.max_prompt_tokens):
                    skipped = True
                    skipped_prompts.append(number)
                    self._say_skipped(reshaped)
                else:
                    ids = reshaped
                    messages[-1]["content"] = f"{messages[-1]['content']}\n\n{extra}"
            prompt_ids.append(ids)
            self.trajectories += [_Trajectory(list(messages), episode, skipped=skipped) for episode, _ in started]
        return prompt_ids, skipped_prompts

    def _group_text(self, texts: list) -> str | None:
        """The text a group's resets returned, refused in one paragraph when its episodes returned different texts
        (a reset drawing its state at random without the seed: episodes 2..n would play states their prompt never
        showed)."""
        if len(set(texts)) > 1:
            first, other = texts[0], next(text for text in texts if text != texts[0])
            name = self.toolset.environment.__name__
            raise UserError(f"`grpo.environment`: {name}.reset(row) returned different texts for the episodes of one "
                            f"group ({str(first)[:80]!r} and {str(other)[:80]!r}), but a group shares one prompt, so its "
                            f"episodes would play states their prompt never showed. If reset draws its state at random, "
                            f"give it a `seed` parameter, `def reset(self, row, seed)`, and draw from "
                            f"`random.Random(seed)`: the episodes of a group get the same seed (and a resumed run the same "
                            f"seeds); docs/tools.md shows it.")
        return texts[0]

    def _say_skipped(self, reshaped: list[int] | None) -> None:
        """One warning, the first time a prompt is skipped: the budget and the key that raises it."""
        if self.said_skipped:
            return
        self.said_skipped = True
        size = "could not be rendered" if reshaped is None else f"has {len(reshaped)} tokens"
        log.warning("a prompt with the environment's reset text %s, more than the prompt budget of %s tokens "
                    "(data.max_seq_len - grpo.max_new_tokens): its group is skipped (scores 0, trains nothing; counted in "
                    "prompts_too_long). Raise --data.max_seq_len or shorten reset's text.", size, self.max_prompt_tokens,
                    extra=console.ABOUT_THIS_RANK)  # this rank's prompts; another's may fit

    def _continue_rows(self, requests: list[tuple[int, list[int], int]]) -> list[list[int] | None]:
        """`Engine.generate`'s hook: the ids to append for rows that ended a turn (None: the episode ends)."""
        records, seconds = replica.run_once_per_replica(self._advance, requests)
        self.tool_seconds += seconds
        appended = []
        for (row, _, _), (ids, start, counts) in zip(requests, records):
            self.counts[row].update(counts)
            if ids is not None:
                self.spans[row].append((start, len(ids)))
            appended.append(ids)
        return appended

    def _advance(self, requests: list[tuple[int, list[int], int]]) -> list[tuple]:
        """Parse each ended turn, run the calls (`tool_runtime.runner`), and render what each episode appends (on the
        rank that runs the tools): per request (ids or None, where they start, counters), and the seconds in tools."""
        work = []  # (request index, trajectory, assistant message, calls, parse error)
        records = [(None, 0, collections.Counter({"turns": 1})) for _ in requests]
        for index, (row, completion, _) in enumerate(requests):
            trajectory = self.trajectories[row]
            trajectory.turns += 1
            trajectory.ended = True  # unless continued below
            if trajectory.skipped:
                continue
            text = tool_text.turn_text(self.tokenizer, completion[trajectory.consumed :], self.end_ids)
            content, calls, error = tool_text.parse_turn(self.tokenizer, text)
            if not calls and error is None:
                continue  # an answer: the episode ends
            if trajectory.turns >= self.max_turns:
                records[index][2]["max_turns_reached"] += 1
                continue
            assistant = {"role": "assistant", "content": content if error is None else text,
                         "tool_calls": [{"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                                        for call in calls]}
            work.append((index, trajectory, assistant, calls, error))
        started = time.perf_counter()
        called = [item for item in work if item[4] is None]
        outcomes = dict(zip((id(item) for item in called),
                            self.runner.run([trajectory.tools.job(calls) for _, trajectory, _, calls, _ in called])))
        seconds = time.perf_counter() - started
        for item in work:
            index, trajectory, assistant, calls, error = item
            row, completion, left = requests[index]
            counts = records[index][2]
            if error is not None:
                counts["parse_errors"] += 1
                new = [{"role": "tool", "content": f"Error: {error}."}]
            else:
                counts["tool_calls"] += len(calls)
                new = []
                for call, result in zip(calls, outcomes[id(item)]):
                    if result.kind in FAILURES:
                        counts[FAILURES[result.kind]] += 1
                    new.append({"role": "tool", "name": call.name, "content": self._cut(result, counts)})
                if trajectory.tools.environment is not None and any(result.kind == "timeout" for result in outcomes[id(item)]):
                    # Its environment may still be running the call: the episode ends, and its state is never read.
                    trajectory.tools.abandoned = True
                    counts["timeout_ends"] += 1
                    continue
            ids = tool_text.appended_ids(self.tokenizer, trajectory.messages + [assistant], new, self.schemas, self.ends)
            if ids is None:
                log.warning("the chat template rewrote an episode's earlier turns; the episode ends there",
                            extra=console.ABOUT_THIS_RANK)
                continue
            if len(ids) >= left:
                counts["out_of_room"] += 1
                continue
            trajectory.messages += [assistant, *new]
            trajectory.consumed, trajectory.ended = len(completion) + len(ids), False
            records[index] = (ids, len(completion), counts)
        return records, seconds

    def _cut(self, result: tool_runner.Outcome, counts: collections.Counter) -> str:
        """A tool result cut to `grpo.max_tool_response_tokens`, saying so; error and timeout texts are never cut."""
        if result.kind != "ok":
            return result.text
        text, cut = tool_text.cut_result(self.tokenizer, result.text, self.max_tool_response_tokens)
        if cut:
            counts["truncated_tool_responses"] += 1
        return text

    def _finish(self, completions: list[list[int]]) -> list[tuple]:
        """Per episode: its answer (the last turn's text), the environment's (reward, correct, failure), whether its
        last turn still needs counting (cut at the budget rather than ended by an end id), and whether it was skipped.
        `GIVE_UP_AFTER` reward() calls spread over the batch are made first (its first episodes are one prompt's group,
        whose row may be the one reward() hangs on); when they all ran past `grpo.reward_timeout`, the rest are not
        made (each would wait as long): they fail as those did."""
        rewarded = [index for index, trajectory in enumerate(self.trajectories) if trajectory.tools.has_reward]
        probes = [rewarded[position] for position in rewards.spread(len(rewarded), GIVE_UP_AFTER)]
        environments, calls, timeouts, not_made, failure = {}, 0, 0, 0, None
        for index in probes + sorted(set(rewarded) - set(probes)):
            if calls >= GIVE_UP_AFTER and timeouts == calls:
                environments[index], not_made = (0.0, None, failure), not_made + 1
            else:
                environments[index] = self.trajectories[index].tools.reward(self.reward_timeout)
                failure = environments[index][2]
                calls, timeouts = calls + 1, timeouts + (failure is not None and failure[0] == "TimeoutError")
        finals = []
        for index, (trajectory, ids) in enumerate(zip(self.trajectories, completions)):
            finals.append((self.tokenizer.decode(ids[trajectory.consumed :], skip_special_tokens=True),
                           environments.get(index, (0.0, None, None)), int(not trajectory.ended), trajectory.skipped))
        if not_made:
            log.warning("the environment's first %d reward() calls of a batch each ran past `grpo.reward_timeout` "
                        "(%g s): its other %d were not made, and score 0 as failures", calls, self.reward_timeout, not_made,
                        extra=console.ABOUT_THIS_RANK)
        return finals


def score(reward, episodes: list[Episode], format_bonus: float = 0.0) -> rewards.Scores:
    """The reward function's scores of each episode's answer, plus its environment's reward (added); an episode is
    correct by the environment's verdict where its reward() gives one, else by the reward function's full marks; a
    skipped episode scores 0. An episode whose environment's reward() failed counts as one the reward failed on
    (`reward_errors`), once however many of its parts failed. Computed on the first model-parallel rank and shared, so a reward that varies between
    calls cannot split the peers."""
    def compute():
        scores = rewards.score(reward, [episode.answer for episode in episodes],
                               [episode.prompt.reference for episode in episodes], format_bonus)
        scores.rewards = [0.0 if episode.skipped else value + episode.environment_reward
                          for value, episode in zip(scores.rewards, episodes)]
        scores.correct = [not episode.skipped and (correct if episode.environment_correct is None else episode.environment_correct)
                          for correct, episode in zip(scores.correct, episodes)]
        for index, episode in enumerate(episodes):
            if episode.environment_failure is not None and not episode.skipped:
                kind, described = episode.environment_failure
                scores.fail(index, ENVIRONMENT_FAILURE + kind, described)
        return scores
    return replica.run_once_per_replica(compute)


def totals(episodes: list[Episode]) -> dict[str, float]:
    """The tool counters summed over episodes, with the episodes that called a tool at least once."""
    summed = collections.Counter()
    for episode in episodes:
        summed.update(episode.counts)
    return {**{name: float(summed[name]) for name in COUNTERS},
            "episodes_with_calls": float(sum(episode.counts["tool_calls"] > 0 for episode in episodes))}


def trajectory(tokenizer, episode: Episode) -> list[dict]:
    """An episode's ids after the prompt as text, in runs of what the policy sampled (`policy`) and what was appended
    (`appended`: tool messages and the template's glue around them), for samples.jsonl."""
    runs, start = [], 0
    for end in range(1, len(episode.ids) + 1):
        if end == len(episode.ids) or episode.sampled[end] != episode.sampled[start]:
            kind = "policy" if episode.sampled[start] else "appended"
            runs.append({kind: tokenizer.decode(episode.ids[start:end], skip_special_tokens=False)})
            start = end
    return runs
