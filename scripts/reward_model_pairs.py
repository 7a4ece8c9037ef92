"""A reward model's held-out pair accuracy by the kind of pair, in transformers (a fresh process, as a user loads the
export): pairs whose rejected side is in the answer's form (`#### N`: a wrong number or working) apart from the others
(another form). The figures docs/rewards.md gives for the embedded set.

    .venv/bin/python scripts/reward_model_pairs.py outputs/rm/hf [outputs/preferences/test.jsonl]
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config.sections import PreferenceDataConfig  # noqa: E402
from data import preferences, rewards  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a ...ForSequenceClassification directory (trainer.rm's hf/)")
    parser.add_argument("pairs", nargs="?", default="outputs/preferences/test.jsonl", help="a preference set's jsonl")
    args = parser.parse_args()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(args.model).eval()
    data = PreferenceDataConfig(max_seq_len=10**9)  # trainer.rm's fields, no length limit
    rows = [json.loads(line) for line in Path(args.pairs).read_text().splitlines()]
    pairs, report = preferences.load_pairs(args.pairs, "test", data, tokenizer)
    kinds = {"rejected in the answer's form": [], "rejected in another form": []}
    for index, pair in zip(report.kept_rows, pairs):
        rejected = rows[index]["rejected"]
        text = rejected if isinstance(rejected, str) else rejected[-1]["content"]
        batch = preferences.collate_pairs([pair], max(len(pair.chosen), len(pair.rejected)), tokenizer.pad_token_id)
        with torch.no_grad():
            chosen, other = model(input_ids=batch["tokens"]).logits.squeeze(-1).tolist()
        kind = "rejected in the answer's form" if rewards.has_answer_format(text) else "rejected in another form"
        kinds[kind].append(chosen > other)
    every = [right for rights in kinds.values() for right in rights]
    for kind, rights in [("every pair", every), *kinds.items()]:
        print(f"{kind}: {sum(rights) / max(len(rights), 1):.3f} of {len(rights)} pairs scored the right way round")


if __name__ == "__main__":
    main()
