"""Peak memory of GRPO's loss and its backward on one micro-batch at Qwen2.5's vocabulary, with the logged entropy
computed in one piece (as before) and in chunks (now), and with the entropy bonus, side by side in one run.

Run: .venv/bin/python scripts/bench/bench_loss_memory.py [--batch 4] [--seq 128] [--vocab 151936]

One process (a tensor-parallel group of one, gloo on CPU; CUDA when there is a GPU). The logits stand for the
model's output: an fp32 leaf tensor [1, read positions, vocab] that requires grad (every position read here). `trainer.grpo_update.policy_loss` runs on them
with the default loss settings (`entropy_coef=0`, KL to reference log-probs given), then its backward. Every
tensor the two allocate is counted through a TorchDispatchMode (each storage from its creation until it is freed),
so the figure is the same on CPU and GPU: the peak of live bytes beyond the logits, and its ratio to the logits'
bytes (their gradient alone is 1.0x). The two variants' losses and logit gradients are compared bit for bit.
"""

import argparse
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class PeakMemory(TorchDispatchMode):
    """Live bytes of the storages created inside the block, and their peak; the storages of `existing` tensors (made
    before it: the logits, the batch) are not counted when an op returns a view of them."""

    def __init__(self, existing=()):
        super().__init__()
        self.live = self.peak = 0
        self.alive = {id(tensor.untyped_storage()) for tensor in existing}

    def _freed(self, key: int, size: int) -> None:
        self.alive.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage.nbytes() and id(storage) not in self.alive:
                    self.alive.add(id(storage))
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, id(storage), storage.nbytes())
        return out


def measure(batch: dict, logits_shape: tuple, chunk_elements: int, device, entropy_coef: float = 0.0) -> dict:
    """Peak bytes of one loss + backward beyond the logits, with the entropy in pieces of `chunk_elements`."""
    from config.sections import GRPOSection
    from trainer import grpo_math, grpo_update as grpo

    grpo_math.ENTROPY_CHUNK_ELEMENTS = chunk_elements
    settings = grpo.LossSettings.from_config(GRPOSection(entropy_coef=entropy_coef))
    logits = torch.randn(logits_shape, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_()
    with PeakMemory([logits, *(value for value in batch.values() if torch.is_tensor(value))]) as memory:
        loss_sum, count, report = grpo.policy_loss(batch, settings, logits)
        (loss_sum / count).backward()
        loss, entropy = float(loss_sum.detach()), float(report["stats"][1])
    gradient = logits.grad.clone()
    return {"peak": memory.peak, "loss": loss, "entropy": entropy, "gradient": gradient,
            "logits_bytes": logits.numel() * logits.element_size()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()

    from config.sections import ParallelConfig
    from model import output, parallel
    from config import console

    console.setup(rank=0)
    runtime = parallel.init_distributed(ParallelConfig(), seed=0)
    generator = torch.Generator().manual_seed(1)
    shape = (args.batch, args.seq, args.vocab)
    labels = torch.randint(0, args.vocab, shape[:2], generator=generator)
    mask = torch.ones(shape[:2], device=runtime.device)  # every position read: the logits are [1, batch x seq, vocab]
    batch = {"labels": labels.to(runtime.device), "loss_mask": mask, "read": output.ReadPositions.where(mask),
             "advantages": torch.randn(args.batch, 1, generator=generator).to(runtime.device),
             "old_logprobs": None, "pi_old_recomputed": False, "sampler_logprobs": torch.zeros(shape[:2], device=runtime.device),
             "ref_logprobs": (-torch.rand(shape[:2], generator=generator) * 5).to(runtime.device)}
    shape = (1, args.batch * args.seq, args.vocab)  # the read positions' logits, as the model's output layer gives them
    logits_elements = args.batch * args.seq * args.vocab
    from trainer import grpo_math

    variants = {"entropy logged in one piece (before)": (logits_elements, 0.0),
                "entropy logged in chunks (now, the default entropy_coef=0)": (grpo_math.ENTROPY_CHUNK_ELEMENTS, 0.0),
                "entropy bonus in chunks, recomputed in the backward (entropy_coef=0.01)":
                    (grpo_math.ENTROPY_CHUNK_ELEMENTS, 0.01)}
    results = {name: measure(batch, shape, elements, runtime.device, coef) for name, (elements, coef) in variants.items()}
    logits_gib = next(iter(results.values()))["logits_bytes"] / 2**30
    print(f"one micro-batch of {args.batch} x {args.seq} tokens at a {args.vocab}-token vocabulary: fp32 logits of "
          f"{logits_gib:.2f} GiB (their gradient is 1.0x of that)")
    print("| entropy | peak memory of loss + backward beyond the logits | x the logits |\n|---|---|---|")
    for name, result in results.items():
        print(f"| {name} | {result['peak'] / 2**30:.2f} GiB | {result['peak'] / result['logits_bytes']:.2f}x |")
    before, after, _ = results.values()
    same_gradient = torch.equal(before["gradient"], after["gradient"])
    print(f"ratio now / before: {after['peak'] / before['peak']:.2f}x; loss identical: {before['loss'] == after['loss']}; "
          f"logit gradients identical: {same_gradient}; logged entropy {before['entropy']:.6g} vs {after['entropy']:.6g}")
    parallel.shutdown(runtime)


if __name__ == "__main__":
    main()
