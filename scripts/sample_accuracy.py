"""Sampled and greedy accuracy of an HF checkpoint on the bundled arithmetic training prompts, with the wrong samples sorted by kind.

The figures the README quotes for GRPO's ceiling on the tiny model come from here: `n` completions per prompt at
temperature 1 (what GRPO's rollouts see) and one greedy completion, scored by the `arithmetic` reward.

    .venv/bin/python scripts/sample_accuracy.py [HF_DIR (default outputs/sft/hf)] [--prompts 256] [--samples 8]

`random_reward` is a reward that ignores correctness (a coin flip per completion), for measuring what updates
without signal do: `PYTHONPATH=scripts torchrun ... -m trainer.grpo --grpo.reward=sample_accuracy:random_reward`.
"""

import argparse
import collections
import hashlib
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.arithmetic import TRAIN_SEED, generate_problems  # noqa: E402
from data.rewards import arithmetic  # noqa: E402

SHOWN = re.compile(r"\s*(\d+) (.) (\d+) = (\d+)\n#### (\d+)")


def random_reward(completion: str, reference: str) -> float:
    """1.0 or 0.0, a fixed coin flip per (completion, reference): no information about correctness."""
    return float(hashlib.sha256((completion + reference).encode()).digest()[0] % 2)


def kind_of_error(completion: str, reference: str) -> str:
    """Why a wrong completion is wrong: format, copy_operands, inconsistent_final or wrong_fact."""
    shown = SHOWN.match(completion)
    if not shown:
        return "format"
    left, symbol, right, result, final = shown.groups()
    if (left, symbol, right) != re.match(r"(\d+) (.) (\d+)", reference).groups():
        return "copy_operands"
    return "inconsistent_final" if result != final else "wrong_fact"


def main() -> None:
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="outputs/sft/hf")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args()

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    problems = generate_problems(10000, TRAIN_SEED)[: args.prompts]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": problem["question"]}], add_generation_prompt=True,
                                           tokenize=False) for problem in problems]
    torch.manual_seed(0)
    sampled, greedy, kinds = [], [], collections.Counter()
    for start in range(0, len(problems), 32):
        batch = tokenizer(texts[start : start + 32], add_special_tokens=False, padding=True, return_tensors="pt")
        width = batch["input_ids"].shape[1]
        with torch.no_grad():
            samples = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=32,
                                     num_return_sequences=args.samples, pad_token_id=tokenizer.pad_token_id)
            best = model.generate(**batch, do_sample=False, max_new_tokens=32, pad_token_id=tokenizer.pad_token_id)
        sample_texts = tokenizer.batch_decode(samples[:, width:], skip_special_tokens=True)
        greedy_texts = tokenizer.batch_decode(best[:, width:], skip_special_tokens=True)
        for offset, problem in enumerate(problems[start : start + 32]):
            own = sample_texts[offset * args.samples : (offset + 1) * args.samples]
            scores = [arithmetic(text, problem["answer"]) for text in own]
            kinds.update(kind_of_error(text, problem["answer"]) for text, score in zip(own, scores) if score < 1)
            sampled.append(statistics.mean(scores))
            greedy.append(arithmetic(greedy_texts[offset], problem["answer"]))
    wrong = sum(kinds.values())
    print(f"{args.model}: {len(problems)} training prompts, sampled accuracy (temperature 1, {args.samples} each) "
          f"{statistics.mean(sampled):.3f}, greedy {statistics.mean(greedy):.3f}")
    print("wrong samples: " + ", ".join(f"{kind} {count} ({count / max(wrong, 1):.0%})" for kind, count in kinds.most_common()))


if __name__ == "__main__":
    main()
