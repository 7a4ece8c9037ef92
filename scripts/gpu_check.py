"""The GPU check for the path without Transformer Engine, in one go (run through scripts/gpu_check.sh).

On one GPU, for a random-weight model of Qwen2.5-0.5B's shape (model/tiny.py builds it offline), bf16:
  parity    transformers vs megatron-core logits. Tolerance: megatron's bf16 logits may be at most PARITY_FACTOR
            times as far from transformers' fp32 logits (max abs) as transformers' own bf16 logits are; so bf16
            rounding passes and a wrong layer does not. Also reports which SDPA kernels accept the model's attention.
  sft       `trainer.sft` at seq len 2048 with the SDPA spec: tokens/s, MFU against the GPU's bf16 dense peak, peak
            memory (medians after the warm-up steps).
  profile   a few steps of the same SFT under torch.profiler: the operators with the most GPU time, and how busy the
            GPU was (its kernels' time over the wall time).
  grpo      `trainer.grpo`, GRPO_STEPS steps at GRPO_NEW_TOKENS new tokens (the default batch: 64 prompts x 8): the
            step's phases (rollout, reward, reference, update), rollout tokens/s, peak memory, and the bf16
            rollout/training gap (`rollout_logprob_diff_mean/max`).
  rollout   scripts/bench/bench_rollout.py: our generation vs `transformers.generate` on the same GPU, prompts and lengths.
  moe       `trainer.grpo` on tiny-moe in bf16 with routing replay off and on: the gap and `moe_route_mismatch`.
  memory    bytes per parameter of each precision mode at DP=1 (scripts/bench/bench_optimizer_memory.py).
  sft-local (only when named in --steps) the SFT again with megatron-core's local attention, for the SDPA/local ratio.
  grpo-rows (only when named in --steps) the GRPO step again with `--grpo.share_prompts=false` (a row per completion,
            causal attention), for the ratio to `grpo`'s prompts computed once under a per-group mask.
Each step runs the project's own entry points in a subprocess (its own CUDA context); a failed step is reported and
the others still run. `--steps a,b` runs only those (a second try of what failed). With --report, the JSON report is
rewritten after every step, so a run cut short keeps what it measured. `--cpu-smoke` runs the same steps on the tiny
model on CPU with small sizes, to check this script where there is no GPU: its figures mean nothing.

Targets: SFT MFU >= 35% at the 0.5B shape, seq len 2048, without TE; rollout tokens/s >= 1.0x transformers.generate.
"""

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PARITY_FACTOR = 2.0
MFU_TARGET, ROLLOUT_TARGET = 0.35, 1.0
STEPS = ("parity", "sft", "profile", "grpo", "rollout", "moe", "memory")
OPTIONAL_STEPS = ("sft-local", "grpo-rows")
# The versions this check can run with. torch: megatron-core 0.19 declares >=2.6, nvidia-modelopt (imported by
# Megatron-Bridge's HF export) >=2.8. transformers and tokenizers: Megatron-Bridge 0.6.2 pins transformers to
# 5.8-5.12.1, which takes tokenizers 0.22-0.23.0 (the carried wheels are at uv.lock's versions).
VERSION_RANGES = {"torch": ("2.8", None), "transformers": ("5.8", "5.12.1"), "tokenizers": ("0.22", "0.23.0"),
                  "megatron-core": ("0.19", None)}
PHASES = ("rollout_time_s", "reward_time_s", "pi_old_time_s", "reference_time_s", "update_time_s", "rank_wait_time_s")
GAP = ("rollout_logprob_diff_mean", "rollout_logprob_diff_max", "rollout_kl", "moe_route_mismatch")
SETTINGS = {
    "gpu": dict(model="qwen2-0.5b", seq_len=2048, global_batch=16, micro_batch=4, sft_steps=12, warmup_steps=3,
                profile_steps=4, grpo_steps=3, grpo_new_tokens=256, moe_steps=3, rollout_rounds=2, parity_len=256,
                limit_s=240),
    "cpu-smoke": dict(model="tiny", seq_len=64, global_batch=4, micro_batch=2, sft_steps=3, warmup_steps=1,
                      profile_steps=2, grpo_steps=2, grpo_new_tokens=16, moe_steps=1, rollout_rounds=1, parity_len=32,
                      limit_s=900),
}


def say(text: str) -> None:
    """Progress line with the time, flushed at once (the caller may be a remote log)."""
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {text}", flush=True)


def run_step(name: str, command: list[str], work: Path, limit_s: int) -> bool:
    """Run one command from the repository root, its output in `<work>/<name>.log`; True when it exits 0."""
    log = work / f"{name}.log"
    say(f"{name}: {' '.join(command[2:] if command[1] == '-m' else command[1:])}")
    start = time.perf_counter()
    with open(log, "w") as output:
        try:
            code = subprocess.run(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, timeout=limit_s).returncode
        except subprocess.TimeoutExpired:
            code = f"timeout ({limit_s} s)"
    say(f"{name}: exit {code} after {time.perf_counter() - start:.0f} s (log {log})")
    if code != 0:
        print("".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:]), flush=True)
    return code == 0


def torchrun(*arguments: str) -> list[str]:
    """One-process torchrun of this interpreter (the venv's, or the GPU image's with carried wheels)."""
    from model.parallel import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()),
            *arguments]


def checkpoint_dir(out_dir: Path) -> Path:
    """Where a measured run saves its last checkpoint (about 7 GB for the 0.5B model): in memory (/dev/shm) when it has
    room, so the save costs the check less of its GPU time; else under the run's directory."""
    memory = Path("/dev/shm")
    roomy = memory.is_dir() and shutil.disk_usage(memory).free > 32 * 2**30
    return memory / f"gpu-check-{out_dir.name}" if roomy else out_dir / "checkpoints"


def clear(out_dir: Path) -> None:
    """Remove what an earlier try of the check left of a run (its output and its checkpoints)."""
    for path in (out_dir, checkpoint_dir(out_dir)):
        shutil.rmtree(path, ignore_errors=True)


def metric_rows(out_dir: Path) -> list[dict]:
    """A run's metrics.jsonl rows, its checkpoints removed."""
    shutil.rmtree(checkpoint_dir(out_dir), ignore_errors=True)
    path = out_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def median_of(rows: list[dict], key: str) -> float | None:
    """The median of `key` over the rows that have it as a number."""
    values = [row[key] for row in rows if isinstance(row.get(key), (int, float))]
    return statistics.median(values) if values else None


# ---------------------------------------------------------------- environment


def version_problems() -> list[str]:
    """What in this Python environment the stack cannot run with: one sentence each."""
    from packaging.version import Version

    problems = []
    if sys.version_info[:2] != (3, 12):
        problems.append(f"Python {sys.version.split()[0]}: megatron-core 0.19 and Megatron-Bridge 0.6 need 3.12.")
    for name, (low, high) in VERSION_RANGES.items():
        try:
            found = metadata.version(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name} is not installed.")
            continue
        version = Version(found.split("+")[0])
        if version < Version(low) or (high is not None and version > Version(high)):
            wanted = f">= {low}" + (f" and <= {high}" if high else "")
            problems.append(f"{name} {found} is installed; this stack needs {wanted}.")
    return problems


def environment() -> dict:
    """Versions and the device, printed first so a report says what it measured."""
    import torch

    from config.sections import have_transformer_engine
    from trainer.metrics import peak_flops

    names = ("torch", "megatron-core", "megatron-bridge", "megatron-fsdp", "transformers", "tokenizers", "numpy",
             "pyarrow", "huggingface-hub", "safetensors", "triton")
    packages = {}
    for name in names:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    info = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
            "peak_bf16_flops": peak_flops(), "packages": packages, "transformer_engine": have_transformer_engine(),
            "python": sys.version.split()[0], "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    say(f"environment: {json.dumps(info)}")
    return info


def build_model(settings: dict) -> Path:
    """The checkpoint to measure, built offline on first use."""
    from model.tiny import ensure_qwen2_0p5b_checkpoint, ensure_tiny_checkpoint

    start = time.perf_counter()
    path = ensure_qwen2_0p5b_checkpoint() if settings["model"] == "qwen2-0.5b" else ensure_tiny_checkpoint()
    say(f"model: {path} ({time.perf_counter() - start:.0f} s)")
    return path


# ---------------------------------------------------------------- parity


def parity_worker(model_path: Path, seq_len: int, out: Path) -> None:
    """In its own process: transformers fp32 and bf16 logits, then megatron-core's (default spec, bf16), on one device."""
    import torch
    import transformers

    from config.loops import SFTConfig
    from config.sections import DataConfig, ModelConfig
    from model import build, parallel, providers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator().manual_seed(0)
    vocab = transformers.AutoConfig.from_pretrained(model_path).vocab_size
    tokens = torch.randint(0, vocab, (2, seq_len), generator=generator).to(device)  # [batch, seq]
    reference = {}
    # transformers first: loading Qwen2 after megatron's parallel state exists leaves its rotary buffer unset.
    for dtype in (torch.float32, torch.bfloat16):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
        with torch.no_grad():
            reference[dtype] = model(tokens).logits.float()  # [batch, seq, vocab]
        del model
    config = SFTConfig(model=ModelConfig(dtype="bf16"), data=DataConfig(max_seq_len=seq_len))
    runtime = parallel.init_distributed(config.parallel, seed=0)
    policy = build.build_policy(config, model_path, build.load_tokenizer(model_path), trainable=False)
    provider, model = policy.provider, policy.chunks[0].eval()
    positions = torch.arange(seq_len, device=device).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        logits = model(input_ids=tokens, position_ids=positions, attention_mask=None)[..., :vocab].float()
    hf_error = (reference[torch.bfloat16] - reference[torch.float32]).abs().max().item()
    megatron_error = (logits - reference[torch.float32]).abs().max().item()
    result = {"layer_spec": providers.layer_spec_name(), "seq_len": seq_len,
              "max_abs_megatron_bf16_vs_hf_bf16": (logits - reference[torch.bfloat16]).abs().max().item(),
              "max_abs_megatron_bf16_vs_hf_fp32": megatron_error, "max_abs_hf_bf16_vs_hf_fp32": hf_error,
              "logit_scale": reference[torch.float32].abs().max().item(),
              "passed": megatron_error <= PARITY_FACTOR * hf_error, "sdpa_kernels": sdpa_kernels(provider, device)}
    out.write_text(json.dumps(result))
    parallel.shutdown(runtime)


def sdpa_kernels(provider, device) -> dict:
    """Which SDPA kernels accept this model's attention at seq len 2048 in bf16: causal (SFT) and masked (packing)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type != "cuda":
        return {}
    heads, groups, head_dim = provider.num_attention_heads, provider.num_query_groups, provider.kv_channels
    query = torch.randn(1, heads, 2048, head_dim, device=device, dtype=torch.bfloat16)
    key = torch.randn(1, groups, 2048, head_dim, device=device, dtype=torch.bfloat16)
    allowed = torch.ones(2048, 2048, dtype=torch.bool, device=device).tril()
    usable = {}
    for label, backend, mask in (("flash_causal", SDPBackend.FLASH_ATTENTION, None),
                                 ("efficient_causal", SDPBackend.EFFICIENT_ATTENTION, None),
                                 ("efficient_masked", SDPBackend.EFFICIENT_ATTENTION, allowed),
                                 ("cudnn_causal", SDPBackend.CUDNN_ATTENTION, None)):
        try:
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(query, key, key, attn_mask=mask, is_causal=mask is None,
                                                                 enable_gqa=True)
            usable[label] = True
        except RuntimeError as error:
            usable[label] = str(error).splitlines()[0][:200]
    return usable


def parity(model_path: Path, settings: dict, work: Path) -> dict:
    """Step `parity`, in a subprocess."""
    out = work / "parity.json"
    command = [sys.executable, __file__, "--parity-worker", str(model_path), "--seq-len", str(settings["parity_len"]),
               "--worker-out", str(out)]
    if not run_step("parity", command, work, settings["limit_s"]):
        return {"passed": False, "error": "see parity.log"}
    result = json.loads(out.read_text())
    say(f"parity (bf16, seq {result['seq_len']}, spec {result['layer_spec']}): max |megatron - transformers| = "
        f"{result['max_abs_megatron_bf16_vs_hf_bf16']:.3g}; vs transformers fp32: megatron {result['max_abs_megatron_bf16_vs_hf_fp32']:.3g}, "
        f"transformers bf16 {result['max_abs_hf_bf16_vs_hf_fp32']:.3g} (tolerance: megatron <= {PARITY_FACTOR} x transformers; "
        f"logits up to {result['logit_scale']:.3g}) -> {'PASS' if result['passed'] else 'FAIL'}")
    if result["sdpa_kernels"]:
        say(f"SDPA kernels for the model's attention (bf16, seq 2048, GQA): {json.dumps(result['sdpa_kernels'])}")
    return result


# ---------------------------------------------------------------- SFT and its profile


def sft_data(model_path: Path, settings: dict, work: Path) -> Path:
    """Prompt/response rows long enough that every sample fills `seq_len` (truncated from the right)."""
    import transformers

    from data.arithmetic import generate_problems

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    per_problem = len(tokenizer("\n\n".join(f"{p['question']}\n{p['answer']}" for p in generate_problems(20, 0)))["input_ids"]) / 20
    problems_per_row = int(settings["seq_len"] / per_problem * 1.2) + 1
    path = work / "sft_data.jsonl"
    with open(path, "w") as rows:
        for row in range(64):
            problems = generate_problems(problems_per_row, seed=row)
            rows.write(json.dumps({"question": "Solve these problems.",
                                   "answer": "\n\n".join(f"{p['question']}\n{p['answer']}" for p in problems)}) + "\n")
    return path


def sft_arguments(attention: str, model_path: Path, data: Path, settings: dict, steps: int, out_dir: Path) -> list[str]:
    """trainer.sft's arguments for the measured SFT."""
    return [f"--model.path={model_path}", "--model.dtype=bf16", f"--model.attention={attention}", f"--data.path={data}",
            f"--data.max_seq_len={settings['seq_len']}", f"--train.steps={steps}",
            f"--train.global_batch_size={settings['global_batch']}", f"--train.micro_batch_size={settings['micro_batch']}",
            "--train.eval_samples=0", "--train.log_interval=5", "--optim.warmup_steps=2", "--optim.lr=1e-5",
            "--optim.min_lr=1e-6", f"--train.out_dir={out_dir}", f"--ckpt.dir={checkpoint_dir(out_dir)}"]


def sft(attention: str, model_path: Path, data: Path, settings: dict, work: Path) -> dict:
    """Step `sft` (or `sft-local`): trainer.sft, then the figures from its metrics.jsonl."""
    name, out_dir = f"sft-{attention}", work / f"sft-{attention}"
    clear(out_dir)
    command = torchrun("-m", "trainer.sft", *sft_arguments(attention, model_path, data, settings, settings["sft_steps"], out_dir))
    succeeded = run_step(name, command, work, settings["limit_s"])
    rows = [row for row in metric_rows(out_dir) if "loss" in row] if succeeded else []
    timed = rows[settings["warmup_steps"]:]
    if not timed:
        return {"attention": attention, "error": f"see {name}.log"}
    result = {"attention": attention, "steps": len(rows), "timed_steps": len(timed),
              "tokens_per_s": median_of(timed, "tokens_per_s"), "step_time_s": median_of(timed, "step_time_s"),
              "mfu": median_of(timed, "mfu"), "peak_memory_gib": max((row.get("peak_memory_gib", 0.0) for row in timed)),
              "losses": [row["loss"] for row in rows]}
    say(f"{name}: {result['tokens_per_s']:.0f} tokens/s (median of {len(timed)} steps), MFU {result['mfu'] or float('nan'):.1%}, "
        f"peak memory {result['peak_memory_gib']:.1f} GiB, loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}")
    return result


def profile_worker(out: Path, arguments: list[str]) -> None:
    """Under torchrun: trainer.sft with `arguments`, profiled over its steps after the first (which compiles kernels);
    the operators' GPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from config import cli
    from trainer import metrics, sft as sft_loop

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    steps = int(next(argument for argument in arguments if argument.startswith("--train.steps=")).split("=")[1])
    sys.argv = [sys.argv[0], *arguments]
    with profile(activities=activities, schedule=schedule(skip_first=1, wait=0, warmup=0, active=steps - 1, repeat=1)) as profiler:
        step_timer_exit = metrics.StepTimer.__exit__

        def exit_and_mark(timer, *exc):  # the profiler's schedule advances at each step's end
            step_timer_exit(timer, *exc)
            profiler.step()

        metrics.StepTimer.__exit__ = exit_and_mark
        cli.run_cli(sft_loop.main)
    # Each operator's own GPU time (on CPU, for the smoke run, its CPU time), in microseconds. The averages hold the
    # operators (recorded on the CPU, each with the time of the kernels it launched) and the kernels themselves: the
    # operators are ranked, and the kernels' own total is the GPU's busy time.
    from torch.autograd import DeviceType

    field = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    device_time = lambda event: getattr(event, field)  # noqa: E731
    events = [event for event in profiler.key_averages() if not event.key.startswith("ProfilerStep")]
    operators = [event for event in events if event.device_type == DeviceType.CPU and device_time(event) > 0]
    kernels = [event for event in events if event.device_type != DeviceType.CPU] if torch.cuda.is_available() else operators
    total_us = sum(device_time(event) for event in kernels)
    ranked = sorted(operators, key=device_time, reverse=True)
    top = [{"op": event.key, "gpu_ms": device_time(event) / 1e3, "share": device_time(event) / max(total_us, 1),
            "calls": event.count} for event in ranked[:25]]
    out.write_text(json.dumps({"gpu_kernel_s": total_us / 1e6, "profiled_steps": steps - 1, "top": top}))


def profile_sft(model_path: Path, data: Path, settings: dict, work: Path) -> dict:
    """Step `profile`: where the SFT's GPU time goes, over its steps after the first: each operator's own GPU time, and
    the kernels' time over the steps' wall time (under the profiler, which slows the host a little)."""
    out_dir, out = work / "profile-sft", work / "profile.json"
    clear(out_dir)
    arguments = sft_arguments("sdpa", model_path, data, settings, settings["profile_steps"], out_dir)
    command = torchrun(__file__, "--profile-worker", str(out), "--", *arguments)
    if not run_step("profile", command, work, settings["limit_s"]) or not out.is_file():
        return {"error": "see profile.log"}
    result = json.loads(out.read_text())
    rows = [row for row in metric_rows(out_dir) if "loss" in row][1:]
    steps_s = sum(row["step_time_s"] for row in rows)
    result["steps_wall_s"], result["gpu_busy_in_steps"] = steps_s, min(result["gpu_kernel_s"] / max(steps_s, 1e-9), 1.0)
    say(f"profile: {result['gpu_kernel_s']:.2f} s of GPU kernels in {len(rows)} steps of {steps_s:.2f} s (profiled): "
        f"the GPU busy {result['gpu_busy_in_steps']:.0%} of the steps' time; largest costs:")
    for row in result["top"][:15]:
        print(f"    {row['share']:6.1%} {row['gpu_ms']:9.1f} ms {row['calls']:6d} calls  {row['op'][:110]}", flush=True)
    return result


# ---------------------------------------------------------------- GRPO, rollout, MoE


def grpo_run(name: str, arguments: list[str], settings: dict, work: Path, steps: int) -> list[dict]:
    """One trainer.grpo run's step rows ([] when it failed)."""
    out_dir = work / name
    clear(out_dir)
    command = torchrun("-m", "trainer.grpo", "--model.dtype=bf16", f"--train.steps={steps}", "--train.eval_samples=0",
                       "--train.log_interval=1", f"--train.out_dir={out_dir}", f"--ckpt.dir={checkpoint_dir(out_dir)}",
                       *arguments)
    succeeded = run_step(name, command, work, settings["limit_s"])
    return [row for row in metric_rows(out_dir) if "loss" in row] if succeeded else []


def grpo(model_path: Path, settings: dict, work: Path, name: str = "grpo") -> dict:
    """Step `grpo` (or `grpo-rows`, a row per completion): the step's phases, rollout tokens/s, peak memory and the
    rollout/training gap (the first step, with its kernels' compilation and the allocator's growth, left out of the
    medians)."""
    new_tokens = settings["grpo_new_tokens"]
    rows = grpo_run(name, [f"--model.path={model_path}", f"--grpo.max_new_tokens={new_tokens}",
                           f"--data.max_seq_len={64 + new_tokens}", "--grpo.share_prompts=" + ("true" if name == "grpo" else "false")],
                    settings, work, settings["grpo_steps"])
    if not rows:
        return {"error": f"see {name}.log"}
    timed = rows[1:] or rows
    result = {"steps": len(rows), "timed_steps": len(timed), "max_new_tokens": new_tokens,
              **{key: median_of(timed, key) for key in ("step_time_s", *PHASES, "rollout_tokens_per_s", "tokens_per_s",
                                                        "response_len", *GAP[:3])},
              "peak_memory_gib": max(row.get("peak_memory_gib", 0.0) for row in rows), "rows": rows}
    step = result["step_time_s"]
    shares = ", ".join(f"{key.removesuffix('_time_s')} {result[key]:.2f} s ({result[key] / step:.0%})" for key in PHASES)
    say(f"{name}: step {step:.2f} s = {shares} (medians of {len(timed)} steps); rollout {result['rollout_tokens_per_s']:.0f} "
        f"tokens/s at {result['response_len']:.0f} tokens a completion; peak memory {result['peak_memory_gib']:.1f} GiB; "
        f"rollout_logprob_diff_mean {result['rollout_logprob_diff_mean']:.4g}, max {result['rollout_logprob_diff_max']:.4g}")
    return result


def rollout_bench(model_path: Path, settings: dict, work: Path) -> dict:
    """Step `rollout`: scripts/bench/bench_rollout.py at the GRPO step's shape (64 prompts x 8, GRPO_NEW_TOKENS new tokens)."""
    batch, group = (512, 8) if settings["model"] == "qwen2-0.5b" else (16, 4)
    command = [sys.executable, "scripts/bench/bench_rollout.py", f"--model={model_path}", f"--batch={batch}", f"--group={group}",
               f"--new-tokens={settings['grpo_new_tokens']}", f"--rounds={settings['rollout_rounds']}", "--dtype=bf16"]
    if not run_step("rollout", command, work, settings["limit_s"]):
        return {"error": "see rollout.log"}
    text = (work / "rollout.log").read_text()
    figures = {key: float(re.search(pattern, text).group(1)) for key, pattern in
               (("transformers_tokens_per_s", r"transformers generate:\s+([\d.]+)"),
                ("ours_tokens_per_s", r"model.generate:\s+([\d.]+)"), ("ratio", r"ratio ours / transformers: ([\d.]+)"))}
    say(f"rollout ({batch} rows = {batch // group} prompts x {group}, {settings['grpo_new_tokens']} new tokens): ours "
        f"{figures['ours_tokens_per_s']:.0f} tokens/s, transformers.generate {figures['transformers_tokens_per_s']:.0f}: "
        f"{figures['ratio']:.2f}x")
    return {"batch": batch, "group": group, **figures}


def moe(settings: dict, work: Path) -> dict:
    """Step `moe`: tiny-moe GRPO in bf16, routing replay off and on (random weights, the default batch)."""
    result = {}
    for replay in ("false", "true"):
        rows = grpo_run(f"moe-replay-{replay}", ["--model.path=tiny-moe", f"--grpo.routing_replay={replay}"], settings,
                        work, settings["moe_steps"])
        result[f"replay_{replay}"] = {key: median_of(rows, key) for key in GAP} if rows else {"error": f"see moe-replay-{replay}.log"}
    for replay, figures in result.items():
        if "error" not in figures:
            say(f"moe {replay}: " + ", ".join(f"{key} {figures[key]:.4g}" for key in GAP if figures[key] is not None))
    return result


def precision_memory(model_path: Path, settings: dict, work: Path) -> dict:
    """Step `memory`: bytes per parameter and peak memory of each precision mode (fp32, bf16, bf16 precision-aware)."""
    command = [sys.executable, "scripts/bench/bench_optimizer_memory.py", f"--model-path={model_path}", "--data-parallel-sizes=1"]
    if not run_step("memory", command, work, settings["limit_s"]):
        return {"error": "see memory.log"}
    table = "bytes per parameter" + (work / "memory.log").read_text().split("bytes per parameter", 1)[-1]
    print(table, flush=True)
    return {"table": table}


# ---------------------------------------------------------------- summary and main


def summary(report: dict) -> None:
    """The figures the issue asks for, against its targets."""
    def number(value, form: str) -> str:
        return format(value, form) if isinstance(value, (int, float)) else "n/a"

    lines = ["", "=== summary ===", f"device: {report['environment']['device']} ({report['environment']['date']})"]
    if "parity" in report:
        lines.append(f"parity (bf16): {'PASS' if report['parity'].get('passed') else 'FAIL'}")
    for name in ("sft", "sft-local"):
        result = report.get(name, {})
        if "tokens_per_s" in result:
            lines.append(f"SFT {result['attention']:5s}: {result['tokens_per_s']:9.0f} tokens/s   MFU {number(result['mfu'], '6.1%')}"
                         f"   peak memory {result['peak_memory_gib']:6.1f} GiB"
                         + (f"   (target MFU >= {MFU_TARGET:.0%}: {'met' if (result['mfu'] or 0) >= MFU_TARGET else 'NOT met'})"
                            if name == "sft" else ""))
    if "tokens_per_s" in report.get("sft", {}) and "tokens_per_s" in report.get("sft-local", {}):
        lines.append(f"SDPA / local tokens/s: {report['sft']['tokens_per_s'] / report['sft-local']['tokens_per_s']:.2f}")
    if "update_time_s" in report.get("grpo", {}) and "update_time_s" in report.get("grpo-rows", {}):
        lines.append(f"GRPO update, prompts shared / a row per completion: "
                     f"{report['grpo']['update_time_s'] / report['grpo-rows']['update_time_s']:.2f}")
    if "profile" in report:
        result = report["profile"]
        lines.append("SFT profile: " + (result.get("error") or f"GPU busy {result['gpu_busy_in_steps']:.0%} of the steps; top: "
                                        + ", ".join(f"{row['op'][:40]} {row['share']:.0%}" for row in result["top"][:3])))
    if "grpo" in report:
        result = report["grpo"]
        lines.append("GRPO: " + (result.get("error") or (
            f"step {result['step_time_s']:.2f} s: " + ", ".join(f"{key.removesuffix('_time_s')} {result[key] / result['step_time_s']:.0%}"
                                                               for key in PHASES)
            + f"; rollout {result['rollout_tokens_per_s']:.0f} tokens/s; peak {result['peak_memory_gib']:.1f} GiB; "
            f"logprob diff mean {result['rollout_logprob_diff_mean']:.3g} max {result['rollout_logprob_diff_max']:.3g}")))
    if "rollout" in report:
        result = report["rollout"]
        lines.append("rollout vs transformers.generate: " + (result.get("error") or (
            f"{result['ratio']:.2f}x (target >= {ROLLOUT_TARGET}: {'met' if result['ratio'] >= ROLLOUT_TARGET else 'NOT met'})")))
    if "moe" in report:
        lines.append("tiny-moe bf16 gap: " + "; ".join(
            f"{replay}: " + (figures.get("error") or f"diff mean {number(figures['rollout_logprob_diff_mean'], '.3g')}, "
                                                     f"route mismatch {number(figures['moe_route_mismatch'], '.3g')}")
            for replay, figures in report["moe"].items()))
    if "memory" in report:
        lines.append("precision modes: " + ("see the table above" if "table" in report["memory"] else "failed"))
    print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU, small sizes: checks the script only")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"comma-separated steps to run, of {', '.join(STEPS + OPTIONAL_STEPS)} (default: all but sft-local and grpo-rows)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/gpu-check"), help="logs, data and run outputs")
    parser.add_argument("--report", type=Path, help="also write the results as JSON here (after every step)")
    parser.add_argument("--parity-worker", type=Path, help="internal: run the parity measurement for this checkpoint")
    parser.add_argument("--profile-worker", type=Path, help="internal: profile trainer.sft, write the result here")
    parser.add_argument("--seq-len", type=int, help="internal: parity sequence length")
    parser.add_argument("--worker-out", type=Path, help="internal: where the parity worker writes its result")
    args, rest = parser.parse_known_args()
    if args.parity_worker:
        return parity_worker(args.parity_worker, args.seq_len, args.worker_out)
    if args.profile_worker:
        return profile_worker(args.profile_worker, [argument for argument in rest if argument != "--"])
    steps = [step.strip() for step in args.steps.split(",") if step.strip()]
    if unknown := sorted(set(steps) - set(STEPS + OPTIONAL_STEPS)):
        parser.error(f"unknown step(s) {', '.join(unknown)}: choose from {', '.join(STEPS + OPTIONAL_STEPS)}")
    if problems := version_problems():
        sys.exit("error: this Python environment cannot run the stack: " + " ".join(problems) + " Use scripts/setup.sh's "
                 ".venv, or carry the pinned wheels (scripts/gpu_check.sh --download-wheels) to a Python 3.12 with "
                 "torch >= 2.8; docs/gpus.md says which versions were measured.")
    settings = SETTINGS["cpu-smoke" if args.cpu_smoke else "gpu"]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    report = {"settings": settings, "environment": environment()}
    if not args.cpu_smoke and report["environment"]["device"] == "CPU":
        sys.exit("error: no GPU visible: run on a GPU machine, or pass --cpu-smoke to check the script on CPU")

    def record(name: str, result: dict) -> None:
        report[name] = result
        if args.report:
            args.report.write_text(json.dumps(report, indent=1))

    model_path = build_model(settings)
    data = sft_data(model_path, settings, args.work_dir) if {"sft", "sft-local", "profile"} & set(steps) else None
    runners = {"parity": lambda: parity(model_path, settings, args.work_dir),
               "sft": lambda: sft("sdpa", model_path, data, settings, args.work_dir),
               "sft-local": lambda: sft("local", model_path, data, settings, args.work_dir),
               "profile": lambda: profile_sft(model_path, data, settings, args.work_dir),
               "grpo": lambda: grpo(model_path, settings, args.work_dir),
               "grpo-rows": lambda: grpo(model_path, settings, args.work_dir, "grpo-rows"),
               "rollout": lambda: rollout_bench(model_path, settings, args.work_dir),
               "moe": lambda: moe(settings, args.work_dir),
               "memory": lambda: precision_memory(model_path, settings, args.work_dir)}
    for step in steps:
        try:
            record(step, runners[step]())
        except Exception as error:  # noqa: BLE001 -- a step's failure is reported; the others still run
            say(f"{step}: failed in the check itself: {type(error).__name__}: {error}")
            record(step, {"error": f"{type(error).__name__}: {error}"})
    summary(report)


if __name__ == "__main__":
    main()
