"""How much of the bundled arithmetic task's held-out split also appears in its training split, and an exported
model's greedy held-out answer accuracy on each part (the README's default-SFT row).

The task draws small numbers into a few templates, so some held-out questions are, word for word, training ones.
With a model directory (an HF export, e.g. `outputs/sft/hf`), its greedy answers (`transformers.generate`, 32 new
tokens, the chat template with the generation prompt) are graded as the held-out evaluation grades them.

    .venv/bin/python scripts/bench/held_out_overlap.py [MODEL_DIR]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.arithmetic import extract_final_answer, generate_problems  # noqa: E402
from data.conversations import ARITHMETIC_SPLITS  # noqa: E402


def greedy_accuracy(model_dir: str, problems: list[dict], batch: int = 100) -> float:
    """The share of `problems` whose greedy answer's final number is the reference's."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    right = 0
    for start in range(0, len(problems), batch):
        chunk = problems[start:start + batch]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": problem["question"]}], tokenize=False,
                                               add_generation_prompt=True) for problem in chunk]
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**encoded, max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        for problem, ids in zip(chunk, out[:, encoded["input_ids"].shape[1]:]):
            answer = extract_final_answer(tokenizer.decode(ids, skip_special_tokens=True), strict=False)
            right += answer == extract_final_answer(problem["answer"], strict=False)
    return right / len(problems)


def main() -> None:
    train = {problem["question"] for problem in generate_problems(*ARITHMETIC_SPLITS["train"])}
    test = generate_problems(*ARITHMETIC_SPLITS["test"])
    seen = [problem for problem in test if problem["question"] in train]
    unseen = [problem for problem in test if problem["question"] not in train]
    print(f"{len(seen)} of the {len(test)} held-out questions also appear in the {len(train)} distinct training ones")
    if len(sys.argv) > 1:
        on_seen, on_unseen = greedy_accuracy(sys.argv[1], seen), greedy_accuracy(sys.argv[1], unseen)
        on_all = (on_seen * len(seen) + on_unseen * len(unseen)) / len(test)
        print(f"greedy answer accuracy: {on_seen:.3f} on those, {on_unseen:.3f} on the other {len(unseen)}, "
              f"{on_all:.3f} on all")


if __name__ == "__main__":
    main()
