"""Start-up of GRPO on a large prompt set: synthetic question/answer rows (JSON lines, `bench_data_startup.write_rows`),
`trainer.grpo` under torchrun for one tiny step on a fresh prompt cache (cold) and again on the cache it wrote (warm);
prints each run's wall time, its start-up report's "tokenizer and data" share, and the largest resident memory of a
rank.

    .venv/bin/python scripts/bench/bench_prompt_startup.py [--rows 100000] [--nproc 2] [--max-seq-len 128]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))  # bench_data_startup, beside this one

from bench_data_startup import cold_and_warm, timed_run  # noqa: E402


def run(data: Path, out: Path, cache: Path, args) -> dict:
    """One 1-step GRPO run from the embedded tiny model (2 prompts of 2 samples, 8 new tokens): its figures."""
    return timed_run("trainer.grpo", ["--model.path=tiny", f"--data.path={data}", "--data.prompt_field=question",
                                      "--data.response_field=answer", f"--data.max_seq_len={args.max_seq_len}",
                                      "--train.steps=1", "--train.global_batch_size=4", "--train.micro_batch_size=2",
                                      "--grpo.n_samples=2", "--grpo.max_new_tokens=8", "--train.eval_samples=0",
                                      "--ckpt.save_interval=0", f"--train.out_dir={out}",
                                      "--train.overwrite_output_dir=true"], cache, args.nproc)


def main() -> None:
    cold_and_warm(run, __doc__, 100_000)


if __name__ == "__main__":
    main()
