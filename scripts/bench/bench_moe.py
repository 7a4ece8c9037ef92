"""The Mixture-of-Experts SFT step at EP=2 against EP=1 on 2 processes, side by side in one run.

    .venv/bin/python scripts/bench/bench_moe.py                     # tiny-moe, 12 steps per layout, 2 rounds
    .venv/bin/python scripts/bench/bench_moe.py --steps 20 --rounds 3 --model MODEL_DIR

One torchrun launch of 2 processes runs `trainer.sft` (its `main`, as the entry point does) on `tiny-moe` for each
layout, one after another in the same process group, `--rounds` times in turn (EP=1, EP=2 with the alltoall
dispatcher, ...), so a machine that slows down mid-run slows every layout alike.
Each layout's figure is the median `step_time_s` of metrics.jsonl over every round's steps after the first two
(warm-up); the ratio is EP=2's median over EP=1's. At EP=1 each rank runs all 8 experts on its half of the batch and
DDP sums the expert gradients; at EP=2 each rank runs 4 experts on the tokens of both halves, exchanged by an
all-to-all (or, with `allgather`, every rank gathering every token) in each MoE layer, forward and backward.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = {"EP=1 (DP=2)": ["--parallel.ep=1"],
           "EP=2, alltoall": ["--parallel.ep=2", "--model.moe_dispatcher=alltoall"]}
WARMUP_STEPS = 2


def worker(args) -> None:
    """Inside torchrun: every layout's SFT in turn, `args.rounds` times; rank 0 prints the table."""
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    from trainer import sft

    dist.init_process_group("gloo")  # the loops keep a group they did not create
    times = {name: [] for name in LAYOUTS}
    out = Path(args.out)
    for round_index in range(args.rounds):
        for index, (name, layout) in enumerate(LAYOUTS.items()):
            run_dir = out / f"round{round_index}-layout{index}"
            sft.main([f"--model.path={args.model}", f"--train.steps={args.steps}", "--train.eval_samples=0",
                      f"--train.out_dir={run_dir}", *layout])
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            times[name] += [row["step_time_s"] for row in rows if row.get("step", 0) > WARMUP_STEPS]
    if dist.get_rank() == 0:
        baseline = statistics.median(times["EP=1 (DP=2)"])
        print(f"MoE SFT step time, {args.model}, 2 processes, {args.rounds} rounds x {args.steps - WARMUP_STEPS} "
              f"steps per layout (median):")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"  {name:<18} {median:.3f} s   {median / baseline:.2f}x EP=1")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-moe", help="model.path: an MoE HF checkpoint or tiny-moe")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from model.parallel import free_port

    with tempfile.TemporaryDirectory() as out:
        command = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "--master-port",
                   str(free_port()), __file__, "--worker", f"--out={out}", f"--model={args.model}",
                   f"--steps={args.steps}", f"--rounds={args.rounds}"]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    table = result.stdout[result.stdout.index("MoE SFT step time"):]
    print(table.rstrip())


if __name__ == "__main__":
    main()
