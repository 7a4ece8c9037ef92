"""How a rollout chooses each next token: greedy or top-k / top-p sampling from the last position's logits, the
sampler's own log-prob of each id, and the seeded generator it draws with (`model.generate`'s decode loop calls it at
every step)."""

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy at temperature 0, else top-k / top-p sampling from a seeded generator;
    `logprobs`: whether the sampler's log-prob of each id is computed (training reads it; evaluation does not)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    logprobs: bool = True


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                generator, logprobs: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens from last-position logits (greedy at temperature 0, else top-k / top-p sampling), and the sampler's
    log-prob of each in fp32: under the distribution it drew from, after temperature, top-k and top-p (vLLM's
    processed log-probs), so the rollout/training gap and its correction (`grpo.rollout_correction=tis`) see the
    behaviour policy that really sampled; greedy: the plain softmax's. Without `logprobs` (nothing reads them, as in
    held-out evaluation) no log-softmax over the vocabulary is computed and each is 0.0."""
    # logits: [batch, vocab]
    if temperature <= 0:
        ids = logits.argmax(dim=-1, keepdim=True)  # [batch, 1]
        if not logprobs:
            return ids.squeeze(1), torch.zeros(len(ids), dtype=torch.float32, device=ids.device)
        return ids.squeeze(1), _as_fp32(logits).log_softmax(dim=-1).gather(1, ids).squeeze(1)
    logits = _as_fp32(logits)
    if temperature != 1.0:  # dividing by 1 changes no bit: skip the [batch, vocab] pass
        logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]  # [batch, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)  # [batch, vocab]
        sorted_probabilities = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop_sorted = sorted_probabilities.cumsum(dim=-1) - sorted_probabilities >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probabilities = logits.softmax(dim=-1)  # [batch, vocab]
    # Our own generator, seeded per call, lives where the logits are (`sampling_generator`): the draws never depend on
    # the global RNG, so a run and its resume sample the same ids.
    ids = torch.multinomial(probabilities, 1, generator=generator)  # [batch, 1]
    if not logprobs:
        return ids.squeeze(1), torch.zeros(len(ids), dtype=torch.float32, device=ids.device)
    return ids.squeeze(1), logits.log_softmax(dim=-1).gather(1, ids).squeeze(1)


def _as_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in fp32, without an operator when it is already (`.float()` dispatches one either way)."""
    return tensor if tensor.dtype == torch.float32 else tensor.float()


def sampling_generator(seed: int, device: torch.device) -> torch.Generator:
    """The generator `sample_next` draws with: on the CPU bit-identical on every machine; on a GPU the device's own
    (Philox: reproducible on GPUs for a seed, though not equal to the CPU's draws). Sampling there on the host instead
    copied the [rows, vocab] probabilities to it and drew vocab-sized noise on the CPU at every token: on an H200, the
    first GRPO step of 512 completions of 256 tokens over 151,936 ids had not ended after 3.5 minutes (docs/gpus.md)."""
    return torch.Generator(device=device).manual_seed(seed)
