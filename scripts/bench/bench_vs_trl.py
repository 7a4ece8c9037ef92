"""Our GRPO step against TRL's `GRPOTrainer` (1.16), on the same CPU, model, prompts, reward and settings; with
`--loop sft`, our SFT step against TRL's `SFTTrainer` on the same model, conversations and settings.

What it measures: the seconds of one GRPO step on each side (sample `--batch-prompts` x 8 completions of at most
`--new-tokens` tokens, score them with the project's `arithmetic` reward, the KL reference's and the policy's forwards,
the backward and one optimizer step over the whole batch), in fp32 on CPU, one process each. Ours is the `step_time_s`
of each metrics.jsonl row of `torchrun --nproc-per-node 1 -m trainer.grpo`; TRL's is the time from its
`on_step_begin` to its `on_step_end` callback, which holds generation, scoring, the reference forward, every
micro-batch's forward and backward and the optimizer step. Each run's first step (warm-up) is left out; the medians
are over the other steps of every round, and the ratio TRL / ours is our speed-up.

How: both sides load the HF checkpoint `--model` (default: the default SFT's export `outputs/sft/hf` when it exists,
else the embedded tiny model), prompt with the bundled arithmetic train split through the tokenizer's chat template and
score with `data/rewards.py`. Every other setting is GRPO's default in our config, mapped once onto TRL's `GRPOConfig`
fields (`trl_arguments`, which names each counterpart). TRL is no dependency of the project: its side runs in a scratch
virtualenv built once with uv from `scripts/bench/bench_vs_trl.requirements.txt` (under `$TRAINER_CACHE_DIR`, default
`~/.cache/megatron-trainer`; torch is the project's pin, so uv's cache supplies it), as a subprocess of this script
(`--trl-worker`): the two stacks never share a process. The runs alternate, the side that starts swapping each round,
and both get the same intra-op thread count (`--threads`) and no GPU (`CUDA_VISIBLE_DEVICES=`). Run it on an idle
machine, or give `--threads` no more than the idle cores: an intra-op thread whose core is busy holds up every other
one, and the slowdown differs between the stacks (the summary prints the load average before and after).

    .venv/bin/python scripts/bench/bench_vs_trl.py                       # 6 steps x 2 rounds at GRPO's default batch
    .venv/bin/python scripts/bench/bench_vs_trl.py --steps 2 --rounds 1 --batch-prompts 4    # a check that both sides run
    .venv/bin/python scripts/bench/bench_vs_trl.py --ours=--train.micro_batch_tokens=8192     # ours with a token budget
    .venv/bin/python scripts/bench/bench_vs_trl.py --loop sft --model tiny --steps 12    # SFT's default step

SFT: ours is `trainer.sft`'s step (global batch 64 in micro-batches of 32, the loss on the response tokens, fp32,
AdamW, warmup then cosine); TRL's `SFTTrainer` gets the same rows of the bundled arithmetic train split as
prompt-completion conversations (`completion_only_loss`: the loss on the completion only, as ours), the same batch,
sequence cap (`max_length`), optimizer and schedule (`sft_trl_arguments`), no packing.
"""

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).with_suffix(".requirements.txt")
# Our loss aggregations under TRL's `loss_type` names (docs/grpo.md, "Coming from verl or TRL").
LOSS_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}
LOG_TAIL_LINES = 40


# --- the scratch environment of the TRL side ----------------------------------------------------------------------


def trl_python() -> Path:
    """The python of the TRL virtualenv, built on first use (one per content of the requirements file)."""
    from config import process

    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:12]
    venv = process.cache_dir() / f"trl-venv-{digest}"
    python = venv / "bin" / "python"
    if (venv / ".complete").exists():
        return python
    shutil.rmtree(venv, ignore_errors=True)  # a build that stopped half-way
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv:
        commands = [[uv, "venv", "--python", sys.executable, str(venv)],
                    [uv, "pip", "install", "--python", str(python), "-r", str(REQUIREMENTS)]]
    else:
        commands = [[sys.executable, "-m", "venv", str(venv)],
                    [str(python), "-m", "pip", "install", "-r", str(REQUIREMENTS)]]
    print(f"building the TRL environment in {venv} (once) from {REQUIREMENTS.name} ...", flush=True)
    start = time.perf_counter()
    for command in commands:
        subprocess.run(command, check=True)
    (venv / ".complete").touch()
    print(f"built in {time.perf_counter() - start:.0f} s", flush=True)
    return python


# --- the settings: GRPO's defaults, and the same choices under TRL's names -----------------------------------------


def resolve_model(name: str | None) -> Path:
    """The HF checkpoint directory both sides load: `name`, an embedded model's name, or the default SFT's export
    when it exists, else the embedded tiny model."""
    from config.loops import GRPOConfig
    from model import tiny

    if name is None:
        default = Path(GRPOConfig().model.path)
        name = str(default) if (default / "config.json").is_file() else "tiny"
    path = tiny.ensure_tiny_checkpoint(name=name) if name in tiny.EMBEDDED else Path(name)
    if not (path / "config.json").is_file():
        sys.exit(f"error: --model {name} is not an HF checkpoint directory (no config.json); give one, or `tiny`.")
    return path.resolve()


def our_arguments(model: Path, completions: int, micro_batch: int, new_tokens: int, steps: int) -> list[str]:
    """`trainer.grpo`'s arguments: GRPO's defaults but for the batch, the budget and the steps; no evaluation."""
    return [f"--model.path={model}", f"--train.steps={steps}", f"--train.global_batch_size={completions}",
            f"--train.micro_batch_size={micro_batch}", f"--grpo.max_new_tokens={new_tokens}",
            "--train.eval_samples=0", "--train.log_interval=1", "--train.overwrite_output_dir=true"]


def trl_arguments(config, completions: int, micro_batch: int, new_tokens: int, steps: int) -> dict:
    """TRL `GRPOConfig` fields that make its step ours (`config`: our GRPOConfig), each from the setting it mirrors."""
    grpo, optim = config.grpo, config.optim
    if grpo.kl_estimator != "k3" or grpo.mini_batches != 1 or optim.min_lr_ratio != 1.0:
        sys.exit("error: TRL's GRPO has only the k3 KL, one optimizer step per generation batch here and no decay to "
                 "map; this benchmark needs our defaults of grpo.kl_estimator, grpo.mini_batches, optim.min_lr_ratio.")
    return {
        # The batch: `completions` per step in groups of n_samples, micro-batches of train.micro_batch_size; TRL's
        # steps_per_generation defaults to the accumulation steps, so each optimizer step samples its own batch.
        "num_generations": grpo.n_samples,
        "per_device_train_batch_size": micro_batch,
        "gradient_accumulation_steps": completions // micro_batch,
        "num_iterations": grpo.ppo_epochs,
        "max_steps": steps,
        # Sampling (TRL generates with transformers' `generate`, its default without vLLM).
        "max_completion_length": new_tokens,
        "temperature": grpo.temperature,
        "top_p": grpo.top_p,
        "top_k": grpo.top_k,
        # The loss. TRL's KL is k3, as ours; it has no dual clip (ours bounds negative advantages' loss at
        # grpo.dual_clip |A|, which costs no time); its advantages are (r - mean) / (std + 1e-4), as ours.
        "beta": grpo.kl_coef,
        "loss_type": LOSS_TYPES[grpo.loss_aggregation],
        "epsilon": grpo.clip_low,
        "epsilon_high": grpo.clip_high,
        "scale_rewards": "group" if grpo.scale_rewards else "none",
        "importance_sampling_level": grpo.importance_ratio,
        "mask_truncated_completions": grpo.mask_truncated,
        # The optimizer: AdamW, warmup then a constant rate (our optim.min_lr_ratio=1), global-norm clipping.
        "learning_rate": optim.lr,
        "adam_beta1": optim.betas[0],
        "adam_beta2": optim.betas[1],
        "adam_epsilon": optim.eps,
        "weight_decay": optim.weight_decay,
        "max_grad_norm": optim.clip_grad,
        "lr_scheduler_type": "constant_with_warmup",
        "warmup_steps": optim.warmup_steps,
        # Precision and device: fp32 on CPU (TRL's defaults are bf16 and gradient checkpointing; ours model.dtype=fp32
        # and model.recompute=none).
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "model_init_kwargs": {"dtype": "float32"},
        "gradient_checkpointing": config.model.recompute != "none",
        "seed": config.train.seed,
        # Logging as ours with train.log_interval=1; no checkpoints, no reporting services.
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }


# --- one run of each side --------------------------------------------------------------------------------------------


def run_logged(command: list[str], log: Path, env: dict, cwd: Path) -> float:
    """Run `command` with its output in `log`; its wall seconds, or exit with the log's tail when it fails."""
    start = time.perf_counter()
    with log.open("w") as output:
        code = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
        sys.exit(f"error: {' '.join(command[:6])} ... exited with {code}; the end of {log}:\n{tail}")
    return time.perf_counter() - start


def run_ours(loop: str, arguments: list[str], work: Path, env: dict) -> dict:
    """Per-step seconds and what the run learned (GRPO: mean reward and completion length; SFT: the loss) of one
    `trainer.grpo` or `trainer.sft` run."""
    out = work / "ours"
    torchrun = Path(sys.executable).parent / "torchrun"
    # --standalone: a free rendezvous port, so a test suite's torchrun on the default port does not collide.
    command = [str(torchrun), "--standalone", "--nproc-per-node", "1", "-m", f"trainer.{loop}", *arguments,
               f"--train.out_dir={out}"]
    wall = run_logged(command, work / "ours.log", env, REPO)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = sorted((row for row in rows if "step_time_s" in row), key=lambda row: row["step"])
    if loop == "sft":
        outcome = f"loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}"
    else:
        outcome = (f"reward {statistics.mean(row['reward_mean'] for row in steps):.3f}, completion "
                   f"{statistics.mean(row['response_len'] for row in steps):.1f} tokens")
    return {"step_time_s": [row["step_time_s"] for row in steps], "wall_s": wall, "outcome": outcome}


def run_trl(python: Path, job: dict, work: Path, env: dict) -> dict:
    """Per-step seconds, what it learned and the versions of one TRL run, in the scratch venv."""
    job_file, result_file = work / "trl-job.json", work / "trl-result.json"
    job_file.write_text(json.dumps({**job, "output_dir": str(work / "trl"), "result": str(result_file)}))
    command = [str(python), str(Path(__file__).resolve()), "--trl-worker", str(job_file)]
    wall = run_logged(command, work / "trl.log", env, work)
    return {**json.loads(result_file.read_text()), "wall_s": wall}


def trl_worker(job_file: Path) -> None:
    """The TRL side, in the scratch venv: GRPOTrainer on the job's model, prompts and reward (or SFTTrainer on its
    conversations); writes the step times."""
    job = json.loads(job_file.read_text())
    sys.path.append(str(REPO))  # our data/ package, for the prompts and the reward, not our stack
    if job["loop"] == "sft":
        return trl_sft_worker(job)
    import datasets
    import torch
    import trl
    from transformers import TrainerCallback

    from data import rewards
    from data.arithmetic import generate_problems

    torch.set_num_threads(job["threads"])
    reward = rewards.get_reward(job["reward"])

    def project_reward(completions, reference, **_) -> list[float]:
        """Our scoring (`rewards.score`, as trainer.grpo calls it) of each completion's text against its reference."""
        texts = [completion[-1]["content"] for completion in completions]
        return rewards.score(reward, texts, reference, job["format_bonus"]).rewards

    problems = generate_problems(*job["problems"])
    dataset = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": problem["question"]}],
                                           "reference": problem["answer"]} for problem in problems])
    times = step_times(TrainerCallback)
    arguments = trl.GRPOConfig(output_dir=job["output_dir"], **job["arguments"])
    trainer = trl.GRPOTrainer(model=job["model"], reward_funcs=project_reward, args=arguments, train_dataset=dataset,
                              callbacks=[times])
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "reward" in entry]
    outcome = (f"reward {statistics.mean(entry['reward'] for entry in logged):.3f}, completion "
               f"{statistics.mean(entry['completions/mean_length'] for entry in logged):.1f} tokens")
    write_trl_result(job, times, outcome, arguments)


def trl_sft_worker(job: dict) -> None:
    """TRL's SFTTrainer on the bundled arithmetic train split as prompt-completion conversations, the loss on the
    completion only; writes the step times."""
    import datasets
    import torch
    import trl
    from transformers import TrainerCallback

    from data.conversations import load_rows

    torch.set_num_threads(job["threads"])
    rows = load_rows("arithmetic", split="train", sft_targets=True)
    dataset = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": row["question"]}],
                                           "completion": [{"role": "assistant", "content": row["answer"]}]}
                                          for row in rows])
    times = step_times(TrainerCallback)
    arguments = trl.SFTConfig(output_dir=job["output_dir"], **job["arguments"])
    trainer = trl.SFTTrainer(model=job["model"], args=arguments, train_dataset=dataset, callbacks=[times])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    write_trl_result(job, times, f"loss {losses[0]:.3f} -> {losses[-1]:.3f}", arguments)


def step_times(callback_class):
    """A TrainerCallback timing each optimizer step from its begin to its end (GRPO: generation, scoring, forwards,
    backwards, update; SFT: forwards, backwards, update), in `.seconds`."""

    class StepTimes(callback_class):
        def __init__(self):
            self.seconds, self.start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.start)

    return StepTimes()


def write_trl_result(job: dict, times, outcome: str, arguments) -> None:
    """The TRL run's step times, what it learned, its versions and settings, for the parent process."""
    import torch

    versions = {name: metadata.version(name) for name in ("trl", "transformers", "torch", "accelerate", "datasets")}
    Path(job["result"]).write_text(json.dumps({
        "step_time_s": times.seconds, "outcome": outcome, "versions": versions, "threads": torch.get_num_threads(),
        "optim": getattr(arguments.optim, "value", arguments.optim),
        "checkpointing": arguments.gradient_checkpointing}))


# --- the benchmark ---------------------------------------------------------------------------------------------------


def describe(side: str, round_number: int, rounds: int, result: dict) -> str:
    """One line per run: the timed steps' median and values, the warm-up step, the wall time, what was sampled."""
    first, timed = result["step_time_s"][0], result["step_time_s"][1:]
    return (f"round {round_number}/{rounds} {side:4s}: median {statistics.median(timed):.3f} s/step over {len(timed)} "
            f"steps [{', '.join(f'{seconds:.3f}' for seconds in timed)}], warm-up step {first:.3f} s, "
            f"wall {result['wall_s']:.0f} s; {result['outcome']}")


def grpo_setup(args, model: Path) -> tuple[list[str], dict, str]:
    """(our arguments, TRL's job, a header line) for the GRPO step at GRPO's defaults."""
    from config.loops import GRPOConfig
    from data.conversations import ARITHMETIC_SPLITS

    config = GRPOConfig()
    batch_prompts = args.batch_prompts or config.train.global_batch_size // config.grpo.n_samples
    new_tokens = args.new_tokens or config.grpo.max_new_tokens
    completions = batch_prompts * config.grpo.n_samples
    micro_batch = math.gcd(config.train.micro_batch_size, completions)  # our default micro-batch, or what divides
    job = {"reward": config.grpo.reward, "format_bonus": config.grpo.format_bonus,
           "problems": ARITHMETIC_SPLITS["train"],
           "arguments": trl_arguments(config, completions, micro_batch, new_tokens, args.steps)}
    header = (f"{batch_prompts} prompts x {config.grpo.n_samples} completions of at most {new_tokens} tokens per step, "
              f"micro-batch {micro_batch}")
    return our_arguments(model, completions, micro_batch, new_tokens, args.steps), job, header


def sft_setup(args, model: Path) -> tuple[list[str], dict, str]:
    """(our arguments, TRL's job, a header line) for the SFT step at SFT's defaults."""
    from config.loops import SFTConfig

    config = SFTConfig()
    train, optim = config.train, config.optim
    ours = [f"--model.path={model}", f"--train.steps={args.steps}", "--train.eval_samples=0", "--train.log_interval=1",
            "--train.overwrite_output_dir=true"]
    arguments = {
        "per_device_train_batch_size": train.micro_batch_size,
        "gradient_accumulation_steps": train.global_batch_size // train.micro_batch_size,
        "max_steps": args.steps, "max_length": config.data.max_seq_len, "completion_only_loss": True, "packing": False,
        # The optimizer and schedule: AdamW, linear warmup, then cosine down to optim.lr x optim.min_lr_ratio.
        "learning_rate": optim.lr, "adam_beta1": optim.betas[0], "adam_beta2": optim.betas[1],
        "adam_epsilon": optim.eps, "weight_decay": optim.weight_decay, "max_grad_norm": optim.clip_grad,
        "lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": optim.min_lr_ratio},
        "warmup_steps": optim.warmup_steps,
        "use_cpu": True, "bf16": False, "fp16": False, "model_init_kwargs": {"dtype": "float32"},
        "gradient_checkpointing": False, "seed": train.seed,
        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
    }
    header = (f"global batch {train.global_batch_size} in micro-batches of {train.micro_batch_size}, sequences of at "
              f"most {config.data.max_seq_len} tokens, the bundled arithmetic SFT set")
    return ours, {"arguments": arguments}, header


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", choices=["grpo", "sft"], default="grpo", help="which loop's step to compare")
    parser.add_argument("--steps", type=int, default=6, help="steps per run; the first is warm-up, left out")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of both sides")
    parser.add_argument("--model", default=None, help="HF checkpoint directory, or `tiny` (default: GRPO, outputs/sft/hf "
                                                      "when it exists, else the embedded tiny model; SFT, tiny)")
    parser.add_argument("--batch-prompts", type=int, default=None, help="prompts per step (default: GRPO's, 64)")
    parser.add_argument("--new-tokens", type=int, default=None, help="completion budget (default: GRPO's, 32)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads of each side (default: torch's default here, the physical cores)")
    parser.add_argument("--ours", action="append", default=[], metavar="--KEY=VALUE",
                        help="a further argument of our side, e.g. --ours=--train.micro_batch_tokens=8192 (repeatable)")
    parser.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    if args.steps < 2 or args.rounds < 1:
        sys.exit("error: --steps must be at least 2 (the first is left out) and --rounds at least 1.")

    sys.path.insert(0, str(REPO))
    import torch

    threads = args.threads or torch.get_num_threads()
    model = resolve_model(args.model or ("tiny" if args.loop == "sft" else None))  # each loop's default start
    python = trl_python()
    ours, job, header = (sft_setup if args.loop == "sft" else grpo_setup)(args, model)
    ours += args.ours
    job |= {"loop": args.loop, "model": str(model), "threads": threads}
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    print(f"model {model}; {header}; {args.steps} steps x {args.rounds} rounds; {threads} threads", flush=True)
    print(f"ours: torchrun --nproc-per-node 1 -m trainer.{args.loop} {' '.join(ours)}", flush=True)
    print(f"TRL:  {'SFTConfig' if args.loop == 'sft' else 'GRPOConfig'}"
          f"({', '.join(f'{key}={value!r}' for key, value in job['arguments'].items())})", flush=True)

    load_before = os.getloadavg()[0]
    results = {"ours": [], "TRL": []}
    for round_number in range(1, args.rounds + 1):
        order = ["ours", "TRL"] if round_number % 2 else ["TRL", "ours"]  # the side that starts alternates
        for side in order:
            with tempfile.TemporaryDirectory(prefix=f"bench-vs-trl-{side}-") as work:
                result = (run_ours(args.loop, ours, Path(work), env) if side == "ours"
                          else run_trl(python, job, Path(work), env))
            results[side].append(result)
            print(describe(side, round_number, args.rounds, result), flush=True)

    medians = {side: statistics.median(seconds for run in runs for seconds in run["step_time_s"][1:])
               for side, runs in results.items()}
    trl_run = results["TRL"][-1]
    our_versions = ", ".join(f"{name} {metadata.version(name)}" for name in ("torch", "transformers", "megatron-core"))
    trl_versions = ", ".join(f"{name} {version}" for name, version in trl_run["versions"].items())
    print(f"\nsummary ({args.rounds} rounds x {args.steps - 1} timed steps per side, each run's first step left out)"
          f"\n  ours median: {medians['ours']:.3f} s/step"
          f"\n  TRL median:  {medians['TRL']:.3f} s/step"
          f"\n  ratio TRL / ours: {medians['TRL'] / medians['ours']:.2f}x (our speed-up; below 1, TRL is faster)"
          f"\n  environment: {platform.platform()}, Python {platform.python_version()}, {os.cpu_count()} CPUs "
          f"(load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after), "
          f"{threads} intra-op threads per side (TRL's torch reports {trl_run['threads']}), fp32, no GPU, one process "
          f"per side\n  ours: {our_versions}\n  TRL:  {trl_versions}; optimizer {trl_run['optim']}, gradient "
          f"checkpointing {'on' if trl_run['checkpointing'] else 'off'}")


if __name__ == "__main__":
    main()
