"""Start-up of SFT on a large data set: synthetic prompt/response rows (JSON lines), `trainer.sft` under torchrun for one
step on a fresh tokenized-data cache (cold) and again on the cache it wrote (warm); prints each run's wall time, its
start-up report's "tokenizer and data" share, and the largest resident memory of a rank.

    .venv/bin/python scripts/bench/bench_data_startup.py [--rows 300000] [--nproc 2] [--max-seq-len 128]
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORDS = "the a of to and in is it you that he was for on are with as I his they be at one have this from".split()


def write_rows(path: Path, rows: int) -> None:
    """`rows` arithmetic questions with a filler sentence each, answered in GSM8K's `#### N` form (seeded)."""
    rng = random.Random(0)
    sentence = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))  # noqa: E731
    with open(path, "w") as file:
        for _ in range(rows):
            a, b = rng.randint(1, 999), rng.randint(1, 999)
            file.write(json.dumps({"question": f"What is {a} + {b}? {sentence()}",
                                   "answer": f"{sentence()}\n#### {a + b}"}) + "\n")


def peak_rss_kib(pid: int, stop: threading.Event, peaks: dict) -> None:
    """Poll the children of torchrun `pid` for their peak resident memory (VmHWM) until `stop`."""
    while not stop.wait(1.0):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split() if Path(f"/proc/{pid}").exists() else []:
            try:
                line = next(line for line in Path(f"/proc/{child}/status").read_text().splitlines() if line.startswith("VmHWM"))
            except (OSError, StopIteration):
                continue
            peaks[child] = max(peaks.get(child, 0), int(line.split()[1]))


def run(data: Path, out: Path, cache: Path, args) -> dict:
    """One 1-step SFT run; its wall time, data seconds from the start-up report, and a rank's peak memory."""
    return timed_run("trainer.sft", [f"--data.path={data}", "--data.prompt_field=question", "--data.response_field=answer",
                                     f"--data.max_seq_len={args.max_seq_len}", "--train.steps=1",
                                     "--train.global_batch_size=8", "--train.micro_batch_size=2",
                                     "--train.eval_samples=0", "--ckpt.save_interval=0", f"--train.out_dir={out}",
                                     "--train.overwrite_output_dir=true"], cache, args.nproc)


def timed_run(module: str, arguments: list[str], cache: Path, nproc: int) -> dict:
    """`module` under torchrun with `arguments` on the tokenized-data cache `cache`: its wall time, the "tokenizer and
    data" seconds of its start-up report, and the largest peak resident memory of a rank."""
    command = [str(REPO / ".venv/bin/torchrun"), "--nproc-per-node", str(nproc), "-m", module, *arguments]
    env = {**os.environ, "TRAINER_CACHE_DIR": str(cache), "TORCH_COMPILE_DISABLE": "1"}
    start, stop, peaks = time.monotonic(), threading.Event(), {}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watcher = threading.Thread(target=peak_rss_kib, args=(process.pid, stop, peaks), daemon=True)
    watcher.start()
    log = process.communicate()[0]
    stop.set()
    if process.returncode:
        sys.exit(f"{module} failed:\n{log[-3000:]}")
    data_seconds = re.search(r"tokenizer and data ([\d.]+)/", log)
    return {"wall_s": round(time.monotonic() - start, 1), "data_s": float(data_seconds.group(1)) if data_seconds else None,
            "peak_rss_gib": round(max(peaks.values(), default=0) / 2**20, 2)}


def cold_and_warm(run, description: str, rows: int) -> None:
    """Parse the command line, write the synthetic rows, and print `run(data, out, cache, args)`'s figures for a fresh
    cache (cold), then for the cache that run wrote (warm)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=rows)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--max-seq-len", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        write_rows(work / "train.jsonl", args.rows)
        for label in ("cold", "warm"):
            print(label, run(work / "train.jsonl", work / "out", work / "cache", args), flush=True)


def main() -> None:
    cold_and_warm(run, __doc__, 300_000)


if __name__ == "__main__":
    main()
