"""The GPU check for the path without Transformer Engine, in one go (run through scripts/gpu_check.sh).

On one GPU, for a random-weight model of Qwen2.5-0.5B's shape (model/tiny.py builds it offline):
  1. parity: transformers vs megatron-core logits in bf16. Tolerance: megatron's bf16 logits may be at
     most PARITY_FACTOR times as far from transformers' fp32 logits (max abs) as transformers' own bf16
     logits are; so bf16 rounding passes and a wrong layer does not. Also reports which SDPA kernels
     accept the model's attention shapes.
  2. SFT_STEPS steps of `trainer.sft` at seq len 2048 with the SDPA spec, then with megatron-core's
     local spec: tokens/s, MFU against the GPU's bf16 dense peak, peak memory, and the SDPA / local ratio.
  3. GRPO_STEPS steps of `trainer.grpo`: rollout tokens/s.
  4. Memory of each precision mode: scripts/bench_optimizer_memory.py at DP=1 on the same model.
Each step runs the project's own entry points in a subprocess (its own CUDA context); a failed step is
reported and the others still run. `--cpu-smoke` runs the same steps on the tiny model on CPU with
small sizes, to check this script where there is no GPU: its figures mean nothing.

Targets: SFT MFU >= 35% for the 0.5B shape at seq len 2048 on one H200 without TE; SDPA >= 2x local.
"""

import argparse
import json
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
MFU_TARGET, SPEEDUP_TARGET = 0.35, 2.0
# model, SFT sequence length and batch, steps, the steps left out of the timing (kernel compilation,
# allocator growth), GRPO response length, parity sequence length, per-step time limit in seconds.
SETTINGS = {
    "gpu": dict(model="qwen2-0.5b", seq_len=2048, global_batch=16, micro_batch=4, sft_steps=20, warmup_steps=3,
                grpo_steps=5, grpo_new_tokens=256, parity_len=256, limit_s=300),
    "cpu-smoke": dict(model="tiny", seq_len=64, global_batch=4, micro_batch=2, sft_steps=3, warmup_steps=1,
                      grpo_steps=2, grpo_new_tokens=16, parity_len=32, limit_s=900),
}


def say(text: str) -> None:
    """Progress line with the time, flushed at once (the caller may be a remote log)."""
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {text}", flush=True)


def run_step(name: str, command: list[str], work: Path, limit_s: int) -> bool:
    """Run one step's command from the repository root, its output in `<work>/<name>.log`; True when it exits 0."""
    log = work / f"{name}.log"
    say(f"{name}: {' '.join(command[2:] if command[1] == '-m' else command[1:])}")
    start = time.perf_counter()
    with open(log, "w") as output:
        try:
            code = subprocess.run(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, timeout=limit_s).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    say(f"{name}: exit {code} after {time.perf_counter() - start:.0f} s (log {log})")
    if code != 0:
        print("".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:]), flush=True)
    return code == 0


def torchrun(*arguments: str) -> list[str]:
    """One-process torchrun of this interpreter (the venv's, or the GPU image's with carried wheels)."""
    from model.parallel import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()),
            *arguments]


# ---------------------------------------------------------------- steps


def environment() -> dict:
    """Versions and the device, printed first so a report says what it measured."""
    import torch

    from config.sections import have_transformer_engine
    from trainer.metrics import peak_flops

    packages = {name: metadata.version(name) for name in
                ("torch", "megatron-core", "megatron-bridge", "megatron-fsdp", "transformers", "tokenizers")}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    info = {"device": device, "peak_bf16_flops": peak_flops(), "packages": packages,
            "transformer_engine": have_transformer_engine()}
    say(f"environment: {json.dumps(info)}")
    return info


def build_model(settings: dict) -> Path:
    """The checkpoint to measure, built offline on first use."""
    from model.tiny import ensure_qwen2_0p5b_checkpoint, ensure_tiny_checkpoint

    start = time.perf_counter()
    path = ensure_qwen2_0p5b_checkpoint() if settings["model"] == "qwen2-0.5b" else ensure_tiny_checkpoint()
    say(f"model: {path} ({time.perf_counter() - start:.0f} s)")
    return path


def parity_worker(model_path: Path, seq_len: int, out: Path) -> None:
    """In its own process: transformers fp32 and bf16 logits, then megatron-core's (default spec, bf16), on one device."""
    import torch
    import transformers

    from config.sections import DataConfig, ModelConfig, SFTConfig
    from model import build, parallel

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
    result = {"layer_spec": build.layer_spec_name(), "seq_len": seq_len,
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
    """Step 1, in a subprocess."""
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


def sft(attention: str, model_path: Path, data: Path, settings: dict, work: Path) -> dict:
    """Step 2 for one layer spec: trainer.sft, then the figures from its metrics.jsonl."""
    out_dir = work / f"sft-{attention}"
    command = torchrun(
        "-m", "trainer.sft", f"--model.path={model_path}", "--model.dtype=bf16", f"--model.attention={attention}",
        f"--data.path={data}", f"--data.max_seq_len={settings['seq_len']}", f"--train.steps={settings['sft_steps']}",
        f"--train.global_batch_size={settings['global_batch']}", f"--train.micro_batch_size={settings['micro_batch']}",
        "--train.eval_samples=0", "--train.log_interval=5", "--optim.warmup_steps=2", "--optim.lr=1e-5", "--optim.min_lr=1e-6",
        f"--train.out_dir={out_dir}")
    succeeded = run_step(f"sft-{attention}", command, work, settings["limit_s"])
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()] if succeeded else []
    shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)  # several GB for the 0.5B model
    timed = [row for row in rows if "loss" in row][settings["warmup_steps"]:]
    if not timed:
        return {"attention": attention, "error": "see its log"}
    result = {"attention": attention, "steps": len(rows), "timed_steps": len(timed),
              "tokens_per_s": statistics.median(row["tokens_per_s"] for row in timed),
              "step_time_s": statistics.median(row["step_time_s"] for row in timed),
              "losses": [row["loss"] for row in rows if "loss" in row]}
    if "mfu" in timed[0]:
        result["mfu"] = statistics.median(row["mfu"] for row in timed)
    if "peak_memory_gib" in timed[-1]:
        result["peak_memory_gib"] = max(row["peak_memory_gib"] for row in timed)
    say(f"sft-{attention}: {result['tokens_per_s']:.0f} tokens/s (median of {len(timed)} steps), "
        f"MFU {result.get('mfu', float('nan')):.1%}, peak memory {result.get('peak_memory_gib', float('nan')):.1f} GiB, "
        f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}")
    return result


def grpo(model_path: Path, settings: dict, work: Path) -> dict:
    """Step 3: a few steps of trainer.grpo: rollout and training tokens/s."""
    out_dir = work / "grpo"
    command = torchrun("-m", "trainer.grpo", f"--model.path={model_path}", "--model.dtype=bf16",
                       f"--train.steps={settings['grpo_steps']}", f"--grpo.max_new_tokens={settings['grpo_new_tokens']}",
                       "--train.eval_samples=0", f"--train.out_dir={out_dir}")  # rollouts and updates, no evaluation
    succeeded = run_step("grpo", command, work, settings["limit_s"])
    shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()] if succeeded else []
    rows = [row for row in rows if "rollout_tokens_per_s" in row]
    if not rows:
        return {"error": "see grpo.log"}
    result = {"steps": len(rows), "rollout_tokens_per_s": statistics.median(row["rollout_tokens_per_s"] for row in rows),
              "tokens_per_s": statistics.median(row["tokens_per_s"] for row in rows)}
    if "peak_memory_gib" in rows[-1]:
        result["peak_memory_gib"] = max(row.get("peak_memory_gib", 0.0) for row in rows)
    say(f"grpo: rollout {result['rollout_tokens_per_s']:.0f} tokens/s, training {result['tokens_per_s']:.0f} tokens/s "
        f"(medians of {len(rows)} steps)")
    return result


def precision_memory(model_path: Path, settings: dict, work: Path) -> dict:
    """Step 4: bytes per parameter and peak memory of each precision mode (fp32, bf16, bf16 precision-aware) at DP=1."""
    command = [sys.executable, "scripts/bench_optimizer_memory.py", f"--model-path={model_path}", "--data-parallel-sizes=1"]
    if not run_step("precision-memory", command, work, settings["limit_s"]):
        return {"error": "see precision-memory.log"}
    table = (work / "precision-memory.log").read_text().split("bytes per parameter", 1)[-1]
    print("bytes per parameter" + table, flush=True)
    return {"table": "bytes per parameter" + table}


def summary(report: dict) -> None:
    """The figures the issue asks for, against its targets."""
    sdpa, local = report["sft"].get("sdpa", {}), report["sft"].get("local", {})
    lines = ["", "=== summary ===", f"device: {report['environment']['device']}"]
    lines.append(f"parity (bf16): {'PASS' if report['parity'].get('passed') else 'FAIL'}")
    for result in (sdpa, local):
        if "tokens_per_s" in result:
            lines.append(f"SFT {result['attention']:5s}: {result['tokens_per_s']:9.0f} tokens/s   MFU {result.get('mfu', float('nan')):6.1%}"
                         f"   peak memory {result.get('peak_memory_gib', float('nan')):6.1f} GiB")
    if "tokens_per_s" in sdpa and "tokens_per_s" in local:
        ratio = sdpa["tokens_per_s"] / local["tokens_per_s"]
        report["sdpa_over_local"] = ratio
        lines.append(f"SDPA / local tokens/s: {ratio:.2f} (target >= {SPEEDUP_TARGET}: {'met' if ratio >= SPEEDUP_TARGET else 'NOT met'})")
    if "mfu" in sdpa:
        lines.append(f"SFT MFU with SDPA: {sdpa['mfu']:.1%} (target >= {MFU_TARGET:.0%}: {'met' if sdpa['mfu'] >= MFU_TARGET else 'NOT met'})")
    grpo_result = report["grpo"]
    lines.append("GRPO: " + (grpo_result.get("error") or f"rollout {grpo_result['rollout_tokens_per_s']:.0f} tokens/s"))
    lines.append("precision modes: " + ("see the table above" if "table" in report["precision_memory"] else "failed"))
    print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU, small sizes: checks the script only")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/gpu-check"), help="logs, data and run outputs")
    parser.add_argument("--report", type=Path, help="also write the results as JSON here")
    parser.add_argument("--parity-worker", type=Path, help="internal: run the parity measurement for this checkpoint")
    parser.add_argument("--seq-len", type=int, help="internal: parity sequence length")
    parser.add_argument("--worker-out", type=Path, help="internal: where the parity worker writes its result")
    args = parser.parse_args()
    if args.parity_worker:
        parity_worker(args.parity_worker, args.seq_len, args.worker_out)
        return
    settings = SETTINGS["cpu-smoke" if args.cpu_smoke else "gpu"]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    report = {"settings": settings, "environment": environment()}
    if not args.cpu_smoke and report["environment"]["device"] == "CPU":
        sys.exit("no GPU visible: run on a GPU machine, or pass --cpu-smoke to check the script on CPU")
    model_path = build_model(settings)
    report["parity"] = parity(model_path, settings, args.work_dir)
    data = sft_data(model_path, settings, args.work_dir)
    report["sft"] = {attention: sft(attention, model_path, data, settings, args.work_dir) for attention in ("sdpa", "local")}
    report["grpo"] = grpo(model_path, settings, args.work_dir)
    report["precision_memory"] = precision_memory(model_path, settings, args.work_dir)
    summary(report)
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
