"""The embedded preference set (`outputs/preferences`, `trainer.rm`'s default data), built on first use: the default
SFT model's own samples of the bundled arithmetic prompts (GRPO's, at GRPO's sampling settings), judged by the
arithmetic rule: for each prompt, a right completion is chosen over a wrong one (as many disjoint pairs as it has
both). Rows are TRL's conversational form: `prompt` (the chat messages), `chosen` and `rejected` (one assistant
message each). `train.jsonl` from the train split's prompts, `test.jsonl` from the held-out split's.
"""

import json
import os
import shutil
from pathlib import Path

from config.errors import UserError
from config.sections import DEFAULT_REWARD, GRPOSection
from data import prompts as prompt_data, rewards
from model import build, collectives, generate
from model.sampling import Sampling
from trainer import rollout
from trainer.metrics import log

DEFAULT_PREFERENCES = "outputs/preferences"
# In the set's folder (hidden: the data loaders skip it): the model its completions were sampled from, as it was then.
SOURCE = ".sampled_from.json"
# (split, prompts, samples per prompt)
SPLITS = (("train", 1024, 8), ("test", 512, 8))
CHUNK = 128  # prompts per generation call


def missing(path: str) -> bool:
    """Whether `data.path` is the embedded set and it is not built yet (a directory there, whoever wrote it, is kept)."""
    return path == DEFAULT_PREFERENCES and not Path(path).exists()


def model_stamp(model_path: Path) -> dict:
    """The model's directory and its weight files (names, sizes, modification times): a retrained or re-exported model
    (the default SFT run again, say) has another."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    return {"model": str(Path(model_path).resolve()),
            "weights": [[file.name, file.stat().st_size, file.stat().st_mtime_ns] for file in files]}


def sampling_stamp(config) -> dict:
    """The run's settings the set's sampling reads (the seed of each chunk's sampling, the prompts' room, the dtype the
    model samples in): a run with others would have sampled another set."""
    return {"train.seed": config.train.seed, "data.max_seq_len": config.data.max_seq_len,
            "model.dtype": config.model.dtype}


def warn_if_stale(path: str, model_path: Path, config=None) -> None:
    """Warn (a run-wide warning) when the embedded set at `path` was sampled from another model than `model_path` as
    it is now, or (with `config`) at other settings (`sampling_stamp`) than this run's: it is kept, whoever wrote it,
    and a reward model would learn the earlier model's pairs without a word. A set reused as it is is said (info)."""
    if path != DEFAULT_PREFERENCES or not (Path(path) / SOURCE).is_file():
        return
    try:
        sampled_from = json.loads((Path(path) / SOURCE).read_text())
    except (OSError, ValueError):
        return
    now = model_stamp(model_path)
    if not isinstance(sampled_from, dict):  # a record not ours to judge
        return
    sampling = sampled_from.pop("sampling", None)
    if sampled_from == now:  # the same model: the settings it was sampled at, when recorded, against this run's
        mine = sampling_stamp(config) if config is not None else None
        if isinstance(sampling, dict) and mine is not None and sampling != mine:
            changed = ", ".join(f"{key}={sampling.get(key)!r} (this run: {value!r})" for key, value in mine.items()
                                if sampling.get(key) != value)
            log.warning("%s was sampled from %s at other settings than this run's: %s; the reward model trains on "
                        "the pairs those settings sampled, not on this run's. Delete %s to sample it again at this "
                        "run's settings, or run at the set's.", path, model_path, changed, path)
        else:
            log.info("%s: the set sampled earlier from %s%s is reused (delete it to sample it again)", path, model_path,
                     f" ({', '.join(f'{key}={value}' for key, value in sampling.items())})" if isinstance(sampling, dict) else "")
        return
    if sampled_from.get("model") != now["model"]:  # the run's `model.path` is another model than the set's
        log.warning("%s was sampled from %s, and this run trains from another model, %s: the reward model learns the "
                    "other model's pairs. Delete %s to sample it from %s, or point `--data.path` at a set of its own.",
                    path, sampled_from.get("model"), model_path, path, model_path)
        return
    log.warning("%s was sampled from %s as its weights were then, and they have changed since (the default SFT "
                "run again, say): the reward model trains on the earlier model's pairs. Delete %s to sample it "
                "again from the current %s.", path, sampled_from.get("model"), path, model_path)


def pairs_of(episodes: list[rollout.Episode], correct: list[bool], samples: int) -> list[dict]:
    """Each prompt's right completions paired with its wrong ones, one use each: first the wrong ones in the answer's
    form (`#### N`: a wrong number or working, the pairs that teach correctness rather than form), then the others,
    each in sampling order."""
    rows = []
    for start in range(0, len(episodes), samples):
        group = list(zip(episodes[start : start + samples], correct[start : start + samples]))
        right = [episode for episode, ok in group if ok]
        wrong = sorted((episode for episode, ok in group if not ok),
                       key=lambda episode: not rewards.has_answer_format(episode.answer))
        for chosen, rejected in zip(right, wrong):
            rows.append({"prompt": chosen.prompt.messages, "chosen": [{"role": "assistant", "content": chosen.answer}],
                         "rejected": [{"role": "assistant", "content": rejected.answer}]})
    return rows


def dealt_chunks(count: int, dp_rank: int, dp_size: int) -> list[tuple[int, bool]]:
    """This rank's generation calls over `count` chunks dealt to the data-parallel ranks in turn, as (chunk, kept):
    every rank makes as many calls, as the engine's generation needs (collective over the data-parallel group under
    Megatron-FSDP: 8 chunks at DP=3 were 3, 3 and 2 calls); a rank short of a chunk samples its first (or chunk 0)
    again, unused."""
    mine = list(range(dp_rank, count, dp_size))
    return [(index, True) for index in mine] + [(mine[0] if mine else 0, False)] * (-(-count // dp_size) - len(mine))


def build_preference_set(config, model_path: Path, runtime) -> None:
    """Sample, judge and write the embedded set into `data.path` (collective: every rank samples its share of the
    prompts; rank 0 writes the files into a staging directory, renamed into place whole; a failure to write, a full
    disk say, ends every rank with one paragraph)."""
    grpo = GRPOSection()
    tokenizer = build.load_tokenizer(model_path)
    policy = build.build_policy(config, model_path, tokenizer, trainable=False)
    sampler = rollout.Rollout(tokenizer, None, generate.end_token_ids(model_path, tokenizer))
    reward = rewards.get_reward(DEFAULT_REWARD)
    out = Path(config.data.path)
    staged = out.parent / f".{out.name}.partial"  # a killed build's leftovers are replaced
    data = type(config.data)(path="arithmetic", prompt_field="question", max_seq_len=config.data.max_seq_len)
    written = {}
    for split, count, samples in SPLITS:
        prompts = prompt_data.load_prompts(data, tokenizer, "arithmetic", split, grpo.max_new_tokens)[:count]
        # Chunks of prompts dealt to the data-parallel ranks in turn, each sampled from its own seed: the same set
        # whatever the number of processes.
        chunks = {}
        for index, kept in dealt_chunks(-(-len(prompts) // CHUNK), runtime.dp_rank, runtime.dp_size):
            sampling = Sampling(grpo.temperature, grpo.top_p, grpo.top_k, seed=config.train.seed + index,
                                         logprobs=False)
            episodes, _ = sampler.run(policy.engine, prompts[index * CHUNK : (index + 1) * CHUNK], samples=samples,
                                      max_new_tokens=grpo.max_new_tokens, sampling=sampling)
            if kept:
                correct = rollout.score(reward, episodes).correct
                chunks[index] = (pairs_of(episodes, correct, samples), sum(correct))
        gathered = {index: chunk for part in collectives.data_parallel_gather(chunks) for index, chunk in part.items()}
        rows = [row for index in sorted(gathered) for row in gathered[index][0]]
        if not rows:
            right = sum(count for _, count in gathered.values())
            raise UserError(f"The embedded preference set needs completions of `{model_path}` both right and wrong by "
                            f"the {DEFAULT_REWARD} rule, and its {len(prompts) * samples} samples of the {split} prompts "
                            f"gave no such pair ({right} of them right): the model is "
                            f"{'too little trained to answer any' if right == 0 else 'right on every prompt'}. Start "
                            "from the default SFT's output after its full run (`--model.path outputs/sft/hf`, 600 steps; "
                            "a run stopped early, with `--train.steps 3` say, answers nothing right), or point "
                            "`--data.path` at your own preference pairs.")
        if runtime.is_main:
            right = sum(count for _, count in gathered.values())
            hard = sum(rewards.has_answer_format(row["rejected"][0]["content"]) for row in rows)
            log.info("preference set %s: %d pairs (%d of them rejecting a wrong answer in the answer's form) from %d "
                     "completions of %s (%.2f right by the %s rule)", split, len(rows), hard, len(prompts) * samples,
                     model_path, right / max(len(prompts) * samples, 1), DEFAULT_REWARD)
            written[split] = rows
    sampler.close()
    failure = None
    if runtime.is_main:
        try:
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(parents=True)
            for split, rows in written.items():
                (staged / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
            (staged / SOURCE).write_text(json.dumps({**model_stamp(model_path), "sampling": sampling_stamp(config)}))
            os.replace(staged, out)
        except OSError as error:
            shutil.rmtree(staged, ignore_errors=True)
            failure = (f"Writing the embedded preference set into `{out}` failed ({error}). Make room there (or fix "
                       f"what the error names) and rerun; nothing of it was kept.")
    failures = [message for message in collectives.world_gather(failure) if message]  # the files are whole after it
    if failures:
        raise UserError(failures[0])
