"""GRPO's reward model (`grpo.reward_model`): a frozen sequence classifier with one label (a `trainer.rm` export, or a
Hugging Face reward model of a family Megatron-Bridge loads), built at the policy's parallel layout beside the KL
reference, forward only. It scores each sampled episode as a whole conversation, as the chat template renders it:
the prompt's rendering, every turn after it (tool calls and tool messages included), and, when the last turn ended
with an end token, the template's text after it (Qwen's newline): the form preference sets and `trainer.rm` train
on. The text is tokenized with the reward model's own tokenizer, so one of another family works too (with a warning:
it then reads the policy's chat template). The step's reward is `grpo.reward_weight` x the reward function's score
+ `grpo.reward_model_weight` x this score (`trainer.grpo_sampling.sample_round`).
"""

import math
from pathlib import Path

import torch

from config.errors import UserError
from model import build, collectives, score_head
from trainer.metrics import log


def template_tail(tokenizer) -> str:
    """The chat template's text after an assistant turn's end token (`\\n` for Qwen's), found by rendering a turn."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}],
                                             tokenize=False)
    end = tokenizer.eos_token or ""
    return rendered[rendered.rindex(end) + len(end):] if end and end in rendered else ""


class RewardModel:
    """A frozen reward model at the policy's layout; `score(episodes)` gives each episode's scalar score."""

    def __init__(self, config, policy):
        path = Path(config.grpo.reward_model)
        build.check_weight_files(path)
        view, weight = score_head.causal_view(path, "grpo.reward_model")
        if weight is None:
            raise UserError(f"`grpo.reward_model={path}` is a causal language model, not a reward model (a "
                            "`...ForSequenceClassification` with one label). Train one with `torchrun -m trainer.rm` "
                            "and point `--grpo.reward_model` at its `hf/` output.")
        self.tokenizer = build.load_tokenizer(path)
        if self.tokenizer.get_vocab() != policy.tokenizer.get_vocab():
            log.warning("grpo.reward_model=%s has another tokenizer than the policy: each episode is decoded to text "
                        "(as the policy's chat template rendered it) and re-tokenized with the reward model's", path)
        self.model = build.build_policy(config, view, self.tokenizer, trainable=False, score_head=(0, weight))
        for chunk in self.model.chunks:
            chunk.requires_grad_(False).eval()
        self.policy_tokenizer, self.tail = policy.tokenizer, template_tail(policy.tokenizer)
        self.rows = config.train.micro_batch_size
        self.multiple = math.lcm(8, config.parallel.sequence_multiple)
        log.info("reward model: %s (%d layers, hidden %d), at the policy's parallel layout", path,
                 self.model.hf_config.get("num_hidden_layers", 0), self.model.hf_config.get("hidden_size", 0))

    def texts(self, episodes) -> list[str]:
        """Each episode as the chat template renders the conversation (see the module's docstring)."""
        end = self.policy_tokenizer.eos_token or "\0"
        texts = self.policy_tokenizer.batch_decode([episode.prompt_ids + episode.ids for episode in episodes])
        return [text + self.tail if text.endswith(end) else text for text in texts]

    def score(self, episodes) -> torch.Tensor:
        """Scores [episodes] in fp32, the same on every rank of the model replica. Collective over it: micro-batches of
        `train.micro_batch_size` rows, all padded to the longest, through megatron-core's pipeline schedule."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        ids = self.tokenizer(self.texts(episodes), add_special_tokens=False)["input_ids"]
        count = -(-len(ids) // self.rows) * self.rows  # whole micro-batches: rows of padding alone fill the last
        length = -(-max(map(len, ids)) // self.multiple) * self.multiple
        tokens = torch.full((count, length), pad, dtype=torch.int64)
        for row, row_ids in enumerate(ids):
            tokens[row, : len(row_ids)] = torch.tensor(row_ids)
        device = next(self.model.chunks[0].parameters()).device
        batches = [{"tokens": part.to(device), "position_ids": torch.arange(length, device=device).repeat(len(part), 1),
                    "attention_mask": None} for part in tokens.split(self.rows)]

        def step(data_iterator, model):
            return score_head.forward_scores(model, next(data_iterator), pad), lambda scores, non_loss_data=True: scores

        with torch.no_grad():
            outputs = get_forward_backward_func()(
                forward_step_func=step, data_iterator=iter(batches), model=self.model.chunks, num_microbatches=len(batches),
                seq_length=length, micro_batch_size=self.rows, forward_only=True, collect_non_loss_data=True)
        scores = torch.cat(outputs).float().cpu()[: len(ids)] if outputs else torch.zeros(len(ids))
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # known on the last stage only
            scores = collectives.all_reduce(scores, parallel_state.get_pipeline_model_parallel_group())
        return scores
