"""What every run pays besides its steps, side by side in one process (medians of interleaved rounds):

1. GRPO's prompts: the bundled task's train split rendered through the chat template and tokenized, against the same
   ids read from the data cache (`data.cache`, `$TRAINER_CACHE_DIR/prompts`).
2. A full garbage collection after the stack's imports (torch, megatron-core, Megatron-Bridge, transformers), with
   the imports' objects in the collector's sight and frozen out of it (`model.providers.freeze_imported_objects`):
   Python runs such collections on its own during training, and the tests' shared launches between runs.

    .venv/bin/python scripts/bench/bench_run_overhead.py [--rounds 5]
"""

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from config.loops import GRPOConfig  # noqa: E402
from data import prompts as prompt_data  # noqa: E402
from model import build, providers  # noqa: E402
from model.tiny import ensure_tiny_checkpoint  # noqa: E402


def seconds(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def report(name: str, before: list[float], after: list[float], labels: tuple[str, str]) -> None:
    print(f"{name}: {labels[0]} {statistics.median(before):.3f} s, {labels[1]} {statistics.median(after):.3f} s, "
          f"ratio {statistics.median(after) / statistics.median(before):.2f} (median of {len(before)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    checkpoint = ensure_tiny_checkpoint()
    tokenizer = build.load_tokenizer(checkpoint)
    config = GRPOConfig()
    cache = Path(tempfile.mkdtemp(prefix="prompt-cache-"))

    def load(cache_dir):
        return lambda: prompt_data.load_prompts(config.data, tokenizer, config.data.path, "train",
                                                config.grpo.max_new_tokens, cache_dir=cache_dir)

    load(cache)()  # writes the entry
    fresh, cached = [], []
    for _ in range(rounds):
        fresh.append(seconds(load(None)))
        cached.append(seconds(load(cache)))
    report("prompts of the bundled train split", fresh, cached, ("rendered", "from the cache"))

    providers.auto_bridge(checkpoint)  # the whole stack imported, and frozen once
    seen, frozen = [], []
    for _ in range(rounds):
        gc.unfreeze()
        seen.append(seconds(gc.collect))
        gc.freeze()
        frozen.append(seconds(gc.collect))
    report("a full garbage collection", seen, frozen, ("imports in sight", "frozen"))


if __name__ == "__main__":
    main()
