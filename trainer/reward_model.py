"""GRPO's reward model (`grpo.reward_model`): a frozen sequence classifier with one label (a `trainer.rm` export, or a
Hugging Face reward model of a family Megatron-Bridge loads), built at the policy's parallel layout beside the KL
reference, forward only. It scores each sampled episode as a whole conversation, as the chat template renders it:
the prompt's rendering, every turn after it (tool calls and tool messages included), and, when the last turn ended
with an end token, the template's text after it (Qwen's newline): the form preference sets and `trainer.rm` train
on. With the policy's tokenizer (or one with tokens added) it reads the episode's own ids; one of another family reads
the conversation rendered by its own chat template (the prompt's turns and the completion's text, as TRL and verl
render for a reward model of its own tokenizer), and a tool episode, or with a reward model without a chat template
any episode, as the policy's template rendered it, the text tokenized with its own tokenizer. The step's reward is
`grpo.reward_weight` x the reward function's score + `grpo.reward_model_weight` x this score, + the unweighted shaping
(`trainer.grpo_sampling.shaped_rewards`).
"""

import math
from pathlib import Path

import torch

from config.hf import turn_end
from data import batches, preferences
from model import build, collectives, parallel, score_head
from trainer.metrics import log


def template_tail(tokenizer) -> str:
    """The chat template's text after the token that closes an assistant turn (`\\n` after Qwen's <|im_end|>),
    found by rendering a turn."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}],
                                             tokenize=False)
    end = turn_end(tokenizer) or ""
    return rendered[rendered.rindex(end) + len(end):] if end and end in rendered else ""


def holds_vocabulary(tokenizer, policy_tokenizer) -> bool:
    """Whether `tokenizer` holds the policy's vocabulary at the same ids: the same tokenizer, or one with tokens added
    (a reward model's own padding token, as Llama 3 reward models add one), to which the policy's ids mean the same."""
    own = tokenizer.get_vocab()
    return all(own.get(token) == index for token, index in policy_tokenizer.get_vocab().items())


class RewardModel:
    """A frozen reward model at the policy's layout; `score(episodes)` gives each episode's scalar score."""

    def __init__(self, config, policy):
        path = Path(config.grpo.reward_model)
        build.check_weight_files(path)
        view, weight = score_head.causal_view(path, "grpo.reward_model")
        assert weight is not None, "GRPOConfig.validate refuses a reward model that is not a classifier"
        self.tokenizer = build.load_tokenizer(path, "grpo.reward_model")
        self.reads_policy_ids = holds_vocabulary(self.tokenizer, policy.tokenizer)
        self.own_template = not self.reads_policy_ids and bool(self.tokenizer.chat_template)
        self.said_refused = False  # a template that refused an episode's turns is said once a run
        if not self.reads_policy_ids:
            log.warning("grpo.reward_model=%s has another tokenizer than the policy: %s", path,
                        "each episode is rendered by the reward model's own chat template (the prompt's turns and the "
                        "completion's text; a tool episode as the policy's template rendered it, tokenized with the "
                        "reward model's tokenizer)" if self.own_template else
                        "it has no chat template, so each episode is read as the policy's chat template rendered it, "
                        "tokenized with the reward model's tokenizer")
        self.model = build.build_frozen_dense(config, view, self.tokenizer, "grpo.reward_model", score_head=(0, weight))
        self.policy_tokenizer = policy.tokenizer
        self.end_ids = set(policy.engine.end_ids)  # generation stops at any (the tokenizer's, generation_config's)
        self.turn_end_id = policy.tokenizer.convert_tokens_to_ids(turn_end(policy.tokenizer))  # the template's
        self.tail_ids = policy.tokenizer(template_tail(policy.tokenizer), add_special_tokens=False)["input_ids"]
        self.pad = self.tokenizer.pad_token_id  # the end token where the tokenizer has none (`build.load_tokenizer`)
        self.micro = config.train.micro_batch_size
        self.multiple = math.lcm(8, config.parallel.sequence_multiple)
        log.info("reward model: %s (%d layers, hidden %d), at the policy's parallel layout", path,
                 self.model.hf_config.get("num_hidden_layers", 0), self.model.hf_config.get("hidden_size", 0))

    def rows(self, episodes) -> list[list[int]]:
        """Each episode's token ids as the reward model reads the conversation (see the module's docstring): with the
        policy's tokenizer (or one that holds its vocabulary at the same ids), the ids in hand (the prompt's, then every id
        after it: nothing is decoded, so no text a tool returned becomes a control token), an episode ended by any end id
        closed as the template closes a turn (its end token, then the text after it); with another tokenizer, the
        conversation rendered by the reward model's own template (`own_rendering`), or where it cannot be (a tool
        episode, no template) the policy's rendering as text tokenized with the reward model's tokenizer, its BOS once.
        An id of no token (a row of the policy's padded vocabulary, sampled with a tiny probability) is left out, as
        decoding leaves it out: the reward model's embedding may not have its row (one of the family's smaller sizes,
        whose vocabulary is padded less)."""
        if self.reads_policy_ids:
            # The policy's token count, not the reward model's: one that adds tokens (its padding token) would read a
            # row of the policy's padded vocabulary as one of them.
            tokens = len(self.policy_tokenizer)
            return [[token for token in self.policy_row(episode) if token < tokens] for episode in episodes]
        return [self.own_rendering(episode) or self.retokenized(self.policy_row(episode)) for episode in episodes]

    def ended(self, episode) -> bool:
        """Whether the episode's last turn ended with an end id (else it was cut at the token budget)."""
        return bool(episode.ids) and episode.ids[-1] in self.end_ids

    def policy_row(self, episode) -> list[int]:
        """The episode's conversation in the policy's ids: its prompt's, every id after them, and a turn ended by any end
        id closed as the policy's template closes one (its end token, then the text after it)."""
        ended = self.ended(episode)
        return episode.prompt_ids + (episode.ids[:-1] + [self.turn_end_id] + self.tail_ids if ended else episode.ids)

    def own_rendering(self, episode) -> list[int] | None:
        """A plain episode (no tools offered, its prompt as the data gave it) rendered by the reward model's chat
        template: the prompt's turns, then the completion's text as the assistant's turn (closed when the episode ended,
        left open when it was cut at the budget), as TRL and verl render for a reward model of another tokenizer. None
        where it cannot be: a tool episode (its turns are token ids, not messages), no template, or a template that
        refuses this episode's turns (said once a run). Decided per episode alone, so every rank of a replica, and a
        resumed run, reads an episode alike."""
        if not self.own_template:
            return None
        prompt = episode.prompt
        if prompt.tools or episode.prompt_ids != prompt.ids or not all(episode.sampled):
            return None
        import jinja2

        messages = [*prompt.messages, {"role": "assistant", "content": episode.answer}]
        try:
            return list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                           continue_final_message=not self.ended(episode))["input_ids"])
        except (jinja2.TemplateError, ValueError) as error:
            if not self.said_refused:
                self.said_refused = True
                log.warning("grpo.reward_model's chat template refused a conversation (%s): such episodes are read as "
                            "the policy's chat template rendered them, tokenized with the reward model's tokenizer", error)
            return None

    def retokenized(self, row: list[int]) -> list[int]:
        """The policy's rendering of an episode (`row`, its ids) as text, tokenized with the reward model's tokenizer."""
        # With its own special tokens (a Llama BOS), once: the policy's template may already have written that BOS.
        return preferences.text_ids(self.policy_tokenizer.decode(row), self.tokenizer)

    def score(self, episodes) -> torch.Tensor:
        """Scores [episodes] in fp32, the same on every rank of the model replica. Collective over it: micro-batches of
        `train.micro_batch_size` rows, each padded to its own longest (with pipeline stages, which exchange fixed
        shapes, whole micro-batches all padded to the longest), through megatron-core's pipeline schedule."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        rows = self.rows(episodes)
        parts = [rows[start : start + self.micro] for start in range(0, len(rows), self.micro)]
        longest = [max(map(len, part)) for part in parts]
        if parallel.fixed_microbatch_shape():
            parts[-1] = parts[-1] + [[]] * (self.micro - len(parts[-1]))  # rows of padding alone fill the last
            longest = [max(longest)] * len(parts)
        device = next(self.model.chunks[0].parameters()).device
        microbatches = [batches.to_device(preferences.collate_sides(part, -(-length // self.multiple) * self.multiple,
                                                                    self.pad), device)
                        for part, length in zip(parts, longest)]

        def step(data_iterator, model):
            return score_head.forward_scores(model, next(data_iterator), self.pad), lambda scores, non_loss_data=True: scores

        with torch.no_grad():
            outputs = get_forward_backward_func()(
                forward_step_func=step, data_iterator=iter(microbatches), model=self.model.chunks,
                num_microbatches=len(microbatches), seq_length=microbatches[0]["tokens"].size(1),
                micro_batch_size=microbatches[0]["tokens"].size(0),
                forward_only=True, collect_non_loss_data=True)
        scores = torch.cat(outputs).float().cpu()[: len(rows)] if outputs else torch.zeros(len(rows))
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # known on the last stage only
            scores = collectives.all_reduce(scores, parallel_state.get_pipeline_model_parallel_group())
        return scores
