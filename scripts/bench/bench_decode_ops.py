"""Operators launched and host time per decode step: our generation (model.generate) vs transformers `generate`.

On a GPU a small model's decode step is bound by the host launching operators, not by arithmetic (docs/gpus.md: 22.5 ms
a step at 512 rows of Qwen2.5-0.5B's shape against 1-1.5 ms of arithmetic and memory traffic), so the number of
operators a step launches, and the host time it takes with a tiny model, are what a launch-bound GPU step pays. Both
are measurable on the CPU.

Same checkpoint, prompts (the bundled arithmetic task's, of varied lengths, so left pads), groups (`--group` samples
of each distinct prompt), lengths (every row generates exactly --new-tokens tokens: EOS is ignored by both) and
sampling settings: temperature 1 as GRPO's rollouts (ours with the sampler's log-probs), and greedy. A forward
pre-hook on each model marks the steps: a step runs from one forward's start to the next (its forward, sampling and
bookkeeping); the first (the prefill) and the last are left out. Counted under torch.profiler (CPU), per step:
- `aten calls`: the outermost aten operators, each one a dispatch from Python (what costs host time);
- `kernels`: the innermost aten operators that compute (views, reshapes and allocations left out), about the
  kernels a GPU step would launch.
Host time per step is the median over the steps of an unprofiled run, the median over `--rounds` alternating rounds.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench/bench_decode_ops.py [--model tiny|HF_DIR] [--batch 64] [--group 8]
        [--new-tokens 32] [--rounds 5]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from config.loops import SFTConfig  # noqa: E402
from config.sections import DataConfig, ModelConfig  # noqa: E402
from data.arithmetic import EVAL_SEED, generate_problems  # noqa: E402
from model import build, generate, parallel  # noqa: E402

STEP = "decode_step"
# Operators that compute nothing (views, reshapes, allocations, metadata): no kernel on a GPU.
NO_KERNEL = {
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::as_strided", "aten::slice", "aten::select",
    "aten::transpose", "aten::t", "aten::permute", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::alias",
    "aten::detach", "aten::detach_", "aten::lift_fresh", "aten::empty", "aten::empty_strided", "aten::empty_like",
    "aten::resize_", "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::unbind", "aten::narrow",
    "aten::contiguous", "aten::to", "aten::_to_copy", "aten::flatten", "aten::unflatten", "aten::view_as_real",
    "aten::view_as_complex", "aten::result_type", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense",
    "aten::set_", "aten::expand_as", "aten::_reshape_alias", "aten::movedim", "aten::clone", "aten::matmul",
    "aten::linear", "aten::dropout", "aten::type_as", "aten::new_empty", "aten::new_empty_strided", "aten::numpy_T",
    "aten::index_select_backward", "aten::_has_compatible_shallow_copy_type", "aten::align_to", "aten::refine_names",
}


class StepMarks:
    """A forward pre-hook that closes the previous step's profiler range and opens the next, and notes the host time."""

    def __init__(self, module):
        self.starts, self.range = [], None
        self.handle = module.register_forward_pre_hook(self)

    def __call__(self, *_):
        self.close()
        self.starts.append(time.perf_counter())
        self.range = record_function(STEP)
        self.range.__enter__()

    def close(self):
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None

    def step_times(self, end: float) -> list[float]:
        """Seconds of each decode step: the first interval (prefill) and the last (cut by the end) left out."""
        marks = [*self.starts, end]
        return [later - earlier for earlier, later in zip(marks[1:-1], marks[2:-1])]


def ops_per_step(run, module) -> tuple[float, float]:
    """Median per decode step of the outermost aten calls and of the kernel-like innermost ones, in one profiled run."""
    marks = StepMarks(module)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        run()
        marks.close()
    marks.handle.remove()
    events = profiler.events()
    steps = sorted((event for event in events if event.name == STEP), key=lambda event: event.time_range.start)[1:-1]
    outer, kernels = [0] * len(steps), [0] * len(steps)
    starts = [step.time_range.start for step in steps]
    ends = [step.time_range.end for step in steps]
    for event in events:
        if not event.name.startswith("aten::"):
            continue
        index = next((i for i, (start, end) in enumerate(zip(starts, ends))
                      if start <= event.time_range.start <= end), None)
        if index is None:
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            outer[index] += 1
        if event.name not in NO_KERNEL and not any(child.name.startswith("aten::") and child.name not in NO_KERNEL
                                                   for child in _descendants(event)):
            kernels[index] += 1
    return statistics.median(outer), statistics.median(kernels)


def _descendants(event):
    """Every event under `event`."""
    for child in event.cpu_children:
        yield child
        yield from _descendants(child)


def host_ms_per_step(run, module) -> float:
    """Median host milliseconds of a decode step in one unprofiled run."""
    marks = StepMarks(module)
    run()
    end = time.perf_counter()
    marks.close()
    marks.handle.remove()
    return 1000 * statistics.median(marks.step_times(end))


def main() -> None:
    """Build transformers' model and ours from one checkpoint; count and time each one's decode steps."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="`tiny` or an HF checkpoint directory")
    parser.add_argument("--batch", type=int, default=64, help="completions per call")
    parser.add_argument("--group", type=int, default=8, help="completions per distinct prompt (divides --batch)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.batch % args.group:
        parser.error(f"--group {args.group} must divide --batch {args.batch}")
    torch.set_grad_enabled(False)

    path = build.resolve_model_path(SFTConfig(model=ModelConfig(path=args.model)))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    distinct = args.batch // args.group
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}], add_generation_prompt=True,
                                             tokenize=False) for row in generate_problems(distinct, EVAL_SEED)]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    # transformers 5.12 leaves Qwen2's rotary inv_freq uninitialised when loaded after initialize_model_parallel.
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer.padding_side = "left"
    padded = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
    # Greedy transformers refuses num_return_sequences > 1: it gets each prompt's rows repeated instead.
    repeated = {key: value.repeat_interleave(args.group, dim=0) for key, value in padded.items()}

    config = SFTConfig(model=ModelConfig(dtype="fp32"),
                       data=DataConfig(max_seq_len=max(map(len, prompt_ids)) + args.new_tokens))
    runtime = parallel.init_distributed(config.parallel, seed=0)
    policy = build.build_policy(config, path, tokenizer, trainable=False)

    def theirs(temperature: float):
        sampled = temperature > 0
        inputs = padded if sampled else repeated
        return lambda: reference.generate(
            **inputs, do_sample=sampled, temperature=temperature if sampled else None, top_k=0 if sampled else None,
            top_p=1.0 if sampled else None, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
            pad_token_id=tokenizer.pad_token_id, num_return_sequences=args.group if sampled else 1)

    def ours(temperature: float):
        # end_ids=() never matches a token, so every row runs the full length, as with min_new_tokens above.
        return lambda: generate.generate(policy.chunks, prompt_ids, samples=args.group, max_new_tokens=args.new_tokens,
                                         end_ids=(), vocab_size=policy.vocab_size, temperature=temperature, seed=0)

    lengths = sorted(map(len, prompt_ids))
    print(f"model {args.model} (fp32, cpu, {torch.get_num_threads()} threads), batch {args.batch} = {distinct} prompts "
          f"x {args.group}, prompts of {lengths[0]}-{lengths[-1]} tokens, {args.new_tokens} new tokens per row; "
          f"per decode step, host time the median of {args.rounds} alternating rounds")
    print(f"{'sampling':<16} {'generation':<14} {'aten calls':>10} {'kernels':>8} {'host ms':>8}")
    for label, temperature in (("temperature 1", 1.0), ("greedy", 0.0)):
        runs = {"transformers": (theirs(temperature), reference), "ours": (ours(temperature), policy.chunks[0])}
        figures = {name: ops_per_step(run, module) for name, (run, module) in runs.items()}
        times = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, (run, module) in runs.items():
                times[name].append(host_ms_per_step(run, module))
        for name in runs:
            print(f"{label:<16} {name:<14} {figures[name][0]:>10.0f} {figures[name][1]:>8.0f} "
                  f"{statistics.median(times[name]):>8.2f}")
        ratio = [figures["ours"][i] / figures["transformers"][i] for i in range(2)]
        print(f"{label:<16} {'ours / theirs':<14} {ratio[0]:>10.2f} {ratio[1]:>8.2f} "
              f"{statistics.median(times['ours']) / statistics.median(times['transformers']):>8.2f}")
    parallel.shutdown(runtime)


if __name__ == "__main__":
    main()
