"""Episodes: what GRPO's rollouts and the held-out evaluation sample, single-turn or with tools.

Without tools an episode is one completion. With tools (`grpo.tools`, `grpo.environment`) it is a trajectory of
turns, kept as token ids from the first to the last:
- a turn ends at an end id; its text is parsed for tool calls (`data.tools.parse_turn`). No call: the episode ends,
  and that turn is its answer (what the reward function scores). Calls: they run in parallel threads within
  `grpo.tool_timeout`, their results become the template's tool messages, and the ids of those messages and of
  the next assistant header (`data.tools.appended_text`, tokenized alone) are appended into the same KV cache
  while generation goes on (`model.generate`'s `continue_rows`); the policy's own ids are never re-tokenized;
- a call that does not parse becomes an error message the policy sees next (as a raising tool does) and the
  episode goes on; an unknown tool, a raising tool and a timeout likewise, each counted;
- an episode ends at `grpo.max_turns` assistant turns (a call in the last one is not run: counted), and when the
  next messages would not fit in what is left of `grpo.max_new_tokens` (counted), which bounds the whole
  trajectory, appended tokens included; a tool result longer than `grpo.max_tool_response_tokens` is cut, and
  its message says so;
- only sampled tokens are trained (`Episode.sampled`): appended ones get loss mask 0, so no log-prob, KL or entropy
  term, and every token-counting normaliser of the loss counts sampled tokens only.

Under tensor parallelism the user's code (tools, environments, and the reward) runs on the first rank of the
tensor-parallel group only, and its results are sent to the others (`model.parallel.tensor_parallel_shared`), so a
tool that answers differently each call never splits the peers that hold one model's shards.
"""

import collections
import dataclasses
import logging
import time

from data import prompts as prompt_data, rewards, tools as tool_data
from data.sft import encode_texts
from model import generate, parallel

log = logging.getLogger(__name__)
# A tool call's outcome (`data.tools.OUTCOMES`) -> the counter it adds to.
FAILURES = {"error": "tool_errors", "timeout": "tool_timeouts", "unknown_tool": "unknown_tools"}

# Per-episode counters of tool use, summed over a step's episodes for metrics.jsonl.
COUNTERS = ("turns", "tool_calls", "tool_errors", "parse_errors", "tool_timeouts", "unknown_tools",
            "max_turns_reached", "out_of_room", "truncated_tool_responses")


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


@dataclasses.dataclass
class _Trajectory:
    """An episode's state while it is generated (on the rank that runs the tools)."""

    messages: list[dict]
    tools: object  # data.tools.Episode
    consumed: int = 0  # ids of the completion already turned into messages
    ended: bool = False  # ended by continue_rows (its last turn is counted there)


class Rollout:
    """Samples episodes from prompts: single-turn without a toolset, multi-turn with one. Built once per run."""

    def __init__(self, tokenizer, toolset, end_ids, *, max_turns: int = 1, max_tool_response_tokens: int = 0,
                 tool_timeout: float = 0.0):
        self.tokenizer, self.toolset, self.end_ids = tokenizer, toolset, tuple(end_ids)
        self.max_turns, self.max_tool_response_tokens, self.tool_timeout = max_turns, max_tool_response_tokens, tool_timeout
        self.ends = tool_data.end_texts(tokenizer, self.end_ids)
        self.schemas = toolset.schemas if toolset is not None else []

    @classmethod
    def from_config(cls, grpo, tokenizer, toolset, end_ids, tools_on: bool = True) -> "Rollout":
        """The run's rollout (`tools_on=False`: the same model and prompts with no tools, for comparison)."""
        return cls(tokenizer, toolset if tools_on else None, end_ids, max_turns=grpo.max_turns,
                   max_tool_response_tokens=grpo.max_tool_response_tokens, tool_timeout=grpo.tool_timeout)

    # ---- sampling

    def run(self, generator, prompts: list, *, samples: int, max_new_tokens: int,
            sampling: generate.Sampling) -> tuple[list[Episode], float]:
        """`samples` episodes of each prompt (a prompt's consecutively) and the seconds spent in tools. Collective like
        `Generator.generate`, and over the tensor-parallel group with tools."""
        if self.toolset is None:
            completions = generator.generate([prompt.ids for prompt in prompts], samples=samples,
                                             max_new_tokens=max_new_tokens, sampling=sampling)
            texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
            rows = [prompt for prompt in prompts for _ in range(samples)]
            return [Episode(prompt, prompt.ids, ids, [1] * len(ids), text, collections.Counter({"turns": 1}))
                    for prompt, ids, text in zip(rows, completions, texts)], 0.0
        prompt_ids = parallel.tensor_parallel_shared(self._start, prompts, samples)
        self.counts = [collections.Counter() for _ in range(len(prompts) * samples)]
        self.spans = [[] for _ in range(len(prompts) * samples)]  # (start, length) of each appended run of ids
        self.tool_seconds = 0.0
        completions = generator.generate(prompt_ids, samples=samples, max_new_tokens=max_new_tokens, sampling=sampling,
                                         continue_rows=self._continue_rows)
        rows = [index for index in range(len(prompts)) for _ in range(samples)]
        finals = parallel.tensor_parallel_shared(self._finish, completions)
        episodes = []
        for row, (prompt_index, ids) in enumerate(zip(rows, completions)):
            sampled = [1] * len(ids)
            for start, length in self.spans[row]:
                sampled[start : start + length] = [0] * length
            answer, environment_reward, last_turn = finals[row]
            self.counts[row]["turns"] += last_turn
            episodes.append(Episode(prompts[prompt_index], prompt_ids[prompt_index], ids, sampled, answer,
                                    self.counts[row], environment_reward))
        return episodes, self.tool_seconds

    def _start(self, prompts: list, samples: int) -> list[list[int]]:
        """Each episode's tools (an environment instance each) and each prompt's ids, reshaped by `reset` when the
        environment returns text (the group's first episode's text: a group shares its prompt)."""
        self.trajectories, prompt_ids = [], []
        for prompt in prompts:
            started = [self.toolset.episode(prompt.row) for _ in range(samples)]
            messages = [dict(message) for message in prompt.messages]
            extra = started[0][1]
            if extra:
                messages[-1]["content"] = f"{messages[-1]['content']}\n\n{extra}"
                text = self.tokenizer.apply_chat_template(messages, tools=self.schemas, tokenize=False,
                                                          add_generation_prompt=True)
                prompt_ids.append(encode_texts([text], self.tokenizer)[0])
            else:
                prompt_ids.append(prompt.ids)
            self.trajectories += [_Trajectory(list(messages), episode) for episode, _ in started]
        return prompt_ids

    def _continue_rows(self, requests: list[tuple[int, list[int], int]]) -> list[list[int] | None]:
        """`Generator.generate`'s hook: the ids to append for rows that ended a turn (None: the episode ends)."""
        records, seconds = parallel.tensor_parallel_shared(self._advance, requests)
        self.tool_seconds += seconds
        appended = []
        for (row, _, _), (ids, start, counts) in zip(requests, records):
            self.counts[row].update(counts)
            if ids is not None:
                self.spans[row].append((start, len(ids)))
            appended.append(ids)
        return appended

    def _advance(self, requests: list[tuple[int, list[int], int]]) -> list[tuple]:
        """Parse each ended turn, run every call of them together, and render what each episode appends (on the
        rank that runs the tools): per request (ids or None, where they start, counters), and the seconds in tools."""
        work = []  # (request index, trajectory, assistant message, calls, parse error)
        records = [(None, 0, collections.Counter({"turns": 1})) for _ in requests]
        for index, (row, completion, _) in enumerate(requests):
            trajectory = self.trajectories[row]
            text = self.tokenizer.decode(completion[trajectory.consumed :], skip_special_tokens=True)
            content, calls, error = tool_data.parse_turn(self.tokenizer, text)
            trajectory.ended = True  # unless continued below
            if not calls and error is None:
                continue  # an answer: the episode ends
            turns = sum(message["role"] == "assistant" for message in trajectory.messages) + 1
            if turns >= self.max_turns:
                records[index][2]["max_turns_reached"] += 1
                continue
            assistant = {"role": "assistant", "content": content if error is None else text,
                         "tool_calls": [{"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                                        for call in calls]}
            work.append((index, trajectory, assistant, calls, error))
        started = time.perf_counter()
        outcomes = iter(tool_data.run_calls([(trajectory.tools, call) for _, trajectory, _, calls, _ in work for call in calls],
                                            self.tool_timeout))
        seconds = time.perf_counter() - started
        for index, trajectory, assistant, calls, error in work:
            row, completion, left = requests[index]
            counts = records[index][2]
            if error is not None:
                counts["parse_errors"] += 1
                new = [{"role": "tool", "content": f"Error: {error}."}]
            else:
                counts["tool_calls"] += len(calls)
                new = []
                for call in calls:
                    result = next(outcomes)
                    if result.kind in FAILURES:
                        counts[FAILURES[result.kind]] += 1
                    new.append({"role": "tool", "name": call.name, "content": self._cut(result.text, counts)})
            text = tool_data.appended_text(self.tokenizer, trajectory.messages + [assistant], new, self.schemas, self.ends)
            if text is None:
                log.warning("the chat template rewrote an episode's earlier turns; the episode ends there")
                continue
            ids = encode_texts([text], self.tokenizer)[0]
            if len(ids) >= left:
                counts["out_of_room"] += 1
                continue
            trajectory.messages += [assistant, *new]
            trajectory.consumed, trajectory.ended = len(completion) + len(ids), False
            records[index] = (ids, len(completion), counts)
        return records, seconds

    def _cut(self, text: str, counts: collections.Counter) -> str:
        """A tool result cut to `grpo.max_tool_response_tokens`, saying so."""
        ids = encode_texts([text], self.tokenizer)[0]
        if len(ids) <= self.max_tool_response_tokens:
            return text
        counts["truncated_tool_responses"] += 1
        return (self.tokenizer.decode(ids[: self.max_tool_response_tokens])
                + f" [cut: {len(ids)} tokens, the limit is {self.max_tool_response_tokens}]")

    def _finish(self, completions: list[list[int]]) -> list[tuple[str, float, int]]:
        """Per episode: its answer (the last turn's text), the environment's reward, and whether its last turn still
        needs counting (cut at the budget rather than ended by an end id)."""
        return [(self.tokenizer.decode(ids[trajectory.consumed :], skip_special_tokens=True), trajectory.tools.reward(),
                 int(not trajectory.ended)) for trajectory, ids in zip(self.trajectories, completions)]


def score(reward, episodes: list[Episode], format_bonus: float = 0.0) -> rewards.Scores:
    """The reward function's scores of each episode's answer, plus its environment's reward (added); computed on the
    first tensor-parallel rank and shared, so a reward that varies between calls cannot split the peers."""
    def compute():
        scores = rewards.score(reward, [episode.answer for episode in episodes],
                               [episode.prompt.reference for episode in episodes], format_bonus)
        scores.rewards = [value + episode.environment_reward for value, episode in zip(scores.rewards, episodes)]
        return scores
    return parallel.tensor_parallel_shared(compute)


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
