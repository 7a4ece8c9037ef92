"""GRPO's prompt set: flat arrays with each prompt read by index, the .npz cache of its token ids (round trip, a new
key when the prompts, a tool's parameter order or the rendering libraries change, a damaged or unwritable entry said by
the rank that meets it), and the prompt order drawn once per epoch."""

import json
import logging
import pickle

import numpy
import pytest
import torch
import transformers

from config import console
from config.cli import parse_args
from config.loops import GRPOConfig
from data import encode, prompts as prompt_data
from data.conversations import to_conversations
from model.tiny import ensure_tiny_checkpoint
from trainer import grpo_sampling

ROWS = [{"question": f"What is {n} + {n}?", "answer": f"#### {2 * n}", "id": n} for n in range(7)]


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny checkpoint's tokenizer, with its Qwen-style chat template."""
    return transformers.AutoTokenizer.from_pretrained(ensure_tiny_checkpoint())


def prompt_set(tokenizer, rows=ROWS, cache=None):
    """The prompts of `rows` (question/answer), each carrying its row."""
    conversations, _ = to_conversations(rows)
    return prompt_data.prompts_from_conversations(conversations, tokenizer, None, cache, rows)


def as_dicts(prompts) -> list[dict]:
    """Every field of every prompt, for comparison."""
    return [vars(prompt) for prompt in prompts]


def test_a_prompt_read_by_index_is_the_prompt_it_was_built_from(tokenizer):
    prompts = prompt_set(tokenizer)
    assert prompts.token_ids.dtype == numpy.int32 and prompts.records.dtype == numpy.uint8 and len(prompts) == 7
    third = prompts[2]
    assert tokenizer.decode(third.ids) == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert (third.reference, third.messages, third.tools, third.row) == (
        "#### 4", [{"role": "user", "content": "What is 2 + 2?"}], None, ROWS[2])
    assert prompts[-1].row == ROWS[6] and [prompt.row["id"] for prompt in prompts] == list(range(7))
    with pytest.raises(IndexError):
        prompts[7]
    # A slice or subset views the same arrays, in the order asked.
    assert as_dicts(prompts[1::3]) == as_dicts([prompts[1], prompts[4]])
    picked = prompts.subset(numpy.array([5, 0]))
    assert picked.token_ids is prompts.token_ids and as_dicts(picked) == as_dicts([prompts[5], prompts[0]])
    assert list(prompts.lengths()) == [len(prompt.ids) for prompt in prompts]
    assert prompts.offering_tools() == 0 and picked.offering_tools() == 0


def test_cache_round_trip_and_a_new_key_when_a_prompt_changes(tokenizer, tmp_path, monkeypatch):
    fresh = as_dicts(prompt_set(tokenizer))
    assert as_dicts(prompt_set(tokenizer, cache=tmp_path)) == fresh  # written
    [entry] = (tmp_path / "prompts").glob("*.npz")
    with numpy.load(entry) as stored:
        assert sorted(stored.files) == ["ids", "offsets"] and stored["offsets"][-1] == len(stored["ids"])
    rendered = []
    render = encode.chat_text
    monkeypatch.setattr(encode, "chat_text", lambda *args, **kwargs: rendered.append(1) or render(*args, **kwargs))
    assert as_dicts(prompt_set(tokenizer, cache=tmp_path)) == fresh and len(rendered) == 1  # read: the key's one render
    changed = [dict(row) for row in ROWS]
    changed[4]["question"] = "What is 40 + 40?"
    again = as_dicts(prompt_set(tokenizer, changed, cache=tmp_path))
    assert len(list((tmp_path / "prompts").glob("*.npz"))) == 2
    assert again[4]["ids"] != fresh[4]["ids"] and again[:4] == fresh[:4]


@pytest.mark.parametrize("damage", ["cut short", "offsets disagree", "ids missing"])
def test_a_damaged_cache_entry_is_rendered_again_and_said(tokenizer, tmp_path, caplog, damage):
    fresh = as_dicts(prompt_set(tokenizer))
    prompt_set(tokenizer, cache=tmp_path)
    [entry] = (tmp_path / "prompts").glob("*.npz")
    if damage == "cut short":
        entry.write_bytes(entry.read_bytes()[:100])
    else:
        with numpy.load(entry) as stored:
            ids, offsets = stored["ids"], stored["offsets"]
        arrays = {"ids": ids, "offsets": offsets[:-1]} if damage == "offsets disagree" else {"offsets": offsets}
        with open(entry, "wb") as file:
            numpy.savez(file, **arrays)
    with caplog.at_level(logging.WARNING, logger="data.prompts"):
        assert as_dicts(prompt_set(tokenizer, cache=tmp_path)) == fresh
    assert "is damaged: its prompts are rendered again" in caplog.text
    # Said by the rank that renders it again, which need not be rank 0 (the first to take the entry's lock).
    [damaged] = [record for record in caplog.records if "is damaged" in record.getMessage()]
    assert console.RankFilter(2, 4).filter(damaged).getMessage().startswith("rank 2: the prompt cache entry")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="data.prompts"):
        assert as_dicts(prompt_set(tokenizer, cache=tmp_path)) == fresh  # the entry was written whole again
    assert "read from the cache" in caplog.text and "is damaged" not in caplog.text


def test_a_tool_schema_with_its_parameters_reordered_is_not_read_from_the_old_entry(tokenizer, tmp_path):
    """A chat template prints a mapping in its order (here the parameters' names; Qwen's `tojson` of a tool or a call's
    arguments): a row's tools with their parameters swapped render other ids, so they are another cache entry, not
    the ids of the order rendered before (a key that sorted the keys). Row 0 has no tools: the key's one rendered
    sample does not show the change."""
    def schema(*names):
        return [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
            "type": "object", "properties": {name: {"type": "integer"} for name in names}}}}]

    def rows(*names):
        question = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "#### 5"}]
        return [{"messages": question}, {"messages": question, "tools": schema(*names)}]

    def ids(names, cache):
        conversations, _ = to_conversations(rows(*names), messages_field="messages")
        return [prompt.ids for prompt in prompt_data.prompts_from_conversations(conversations, tokenizer, None, cache)]

    before, after = ids(("a", "b"), None), ids(("b", "a"), None)
    assert before[1] != after[1] and "add(b, a)" in tokenizer.decode(after[1])
    assert ids(("a", "b"), tmp_path) == before
    assert ids(("b", "a"), tmp_path) == after  # read the a, b entry before
    assert len(list((tmp_path / "prompts").glob("*.npz"))) == 2


def test_the_cache_key_follows_the_libraries_that_render_and_encode(tokenizer, monkeypatch):
    """transformers renders the template (its `tojson`, its jinja2 environment) and tokenizers encodes: an upgrade may
    change the ids of a prompt whose inputs are all the same, and the key's one rendered sample need not show it."""
    import importlib

    def key():
        return encode.cache_key({"prompts": [[{"role": "user", "content": "hi"}]]}, tokenizer, "sample")

    first = key()
    assert key() == first
    for name in ("transformers", "tokenizers", "jinja2"):
        with monkeypatch.context() as patched:
            patched.setattr(importlib.import_module(name), "__version__", "0.0.1")  # the module imports now find
            assert key() != first, name


def test_a_cache_that_cannot_be_written_is_said_by_the_rank_that_could_not(tokenizer, tmp_path, caplog):
    """A node's own disk may be the read-only or full one: its ranks say so (`config.console`), not only rank 0,
    and the prompts are rendered as without a cache."""
    fresh = as_dicts(prompt_set(tokenizer))
    (tmp_path / "prompts").write_text("a file where the cache's folder would go")
    with caplog.at_level(logging.WARNING, logger="data.encode"):
        assert as_dicts(prompt_set(tokenizer, cache=tmp_path)) == fresh
    [record] = [record for record in caplog.records if "not cached" in record.getMessage()]
    assert console.RankFilter(1, 2).filter(record).getMessage().startswith("rank 1: tokenized data not cached")


def test_load_prompts_keeps_rows_in_order_and_skips_the_long_ones(tokenizer, tmp_path):
    rows = [dict(row) for row in ROWS]
    rows[3]["question"] = "Count the apples in this long story. " * 6 + rows[3]["question"]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config, _ = parse_args(GRPOConfig, ["--data.max_seq_len=80"], "trainer.grpo")
    prompts = prompt_data.load_prompts(config.data, tokenizer, str(path), "train", config.grpo.max_new_tokens,
                                       cache_dir=tmp_path / "cache")
    assert [prompt.row["id"] for prompt in prompts] == [0, 1, 2, 4, 5, 6]
    assert all(len(prompt.ids) <= 48 for prompt in prompts) and prompts[3].reference == "#### 8"



def test_a_messages_row_ending_after_its_reference_is_skipped_and_counted(tokenizer, tmp_path, caplog):
    """A prompt is the turns before a row's last assistant turn (the reference): a row that goes on after it (a user's
    next question, a tool's result) lost those turns from its prompt without a word. Such rows are skipped and counted
    now, as every unusable row is; SFT trains on the same rows as they are."""
    turns = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "#### 4"}]
    rows = [{"messages": turns}, {"messages": turns + [{"role": "user", "content": "And 3 + 3?"}]},
            {"messages": [{"role": "system", "content": "Be brief."}] + turns}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config, _ = parse_args(GRPOConfig, ["--data.messages_field=messages"], "trainer.grpo")
    with caplog.at_level(logging.INFO, logger="data.prompts"):
        prompts = prompt_data.load_prompts(config.data, tokenizer, str(path), "train", config.grpo.max_new_tokens)
    assert [len(prompt.messages) for prompt in prompts] == [1, 2] and {prompt.reference for prompt in prompts} == {"#### 4"}
    assert ("2 of 3 rows used, 1 dropped (ends with a user turn, not the assistant's reference: 1), 0 truncated; "
            "first dropped: row 1") in caplog.text
    conversations, report = to_conversations(rows, messages_field="messages")  # SFT's reading: all three
    assert len(conversations) == 3 and report.dropped == 0

def test_a_row_and_its_turns_share_their_strings_in_the_records(tokenizer):
    """Each prompt's record pickles its row and turns together: the question is stored once, not twice."""
    long_rows = [{"question": "x" * 5000, "answer": "y" * 3000}]
    prompts = prompt_set(tokenizer, long_rows)
    assert len(prompts.records) < 5000 + 3000 + 500
    assert pickle.loads(prompts.records.tobytes())[3] == long_rows[0]


def test_a_resume_onto_another_prompt_set_says_the_epochs_rest_is_reordered(tokenizer, caplog):
    """Each step's prompts are positions in a shuffle of the set's size (`step_prompt_indices`): 6 rows added in place
    to a 24-prompt file made 5 of the 12 prompts of steps 4-6 (4 a step) repeat prompts of steps 1-3, and left 9 of the
    24 out of the epoch, without a word (SFT said it of its examples). The checkpoint now notes the set, and a resume
    on a set of another size, or of the same size in another order, says so."""
    saved = grpo_sampling.PromptSetRecord(prompt_set(tokenizer)).state_dict()
    added, reordered = prompt_set(tokenizer, ROWS + ROWS[:2]), prompt_set(tokenizer, ROWS[::-1])
    before = [index for step in (1, 2, 3) for index in grpo_sampling.step_prompt_indices(24, 4, step, 1234)]
    after = [index for step in (4, 5, 6) for index in grpo_sampling.step_prompt_indices(30, 4, step, 1234)]
    assert len(set(before) & set(after)) == 5 and len(set(range(24)) - set(before) - set(after)) == 9
    with caplog.at_level(logging.INFO, logger="trainer"):
        grpo_sampling.PromptSetRecord(added).load_state_dict(saved)
        grpo_sampling.PromptSetRecord(reordered).load_state_dict(saved)
    said = [record.getMessage() for record in caplog.records]
    assert said[0].startswith("the data holds 9 prompts and the checkpoint's held 7")
    assert said[1].startswith("the data holds as many prompts as the checkpoint's (7), but other ones or in another order")
    assert all("some of its prompts may repeat and others be left out" in line for line in said) and len(said) == 2
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer"):
        grpo_sampling.PromptSetRecord(prompt_set(tokenizer)).load_state_dict(saved)  # the same prompts
        grpo_sampling.PromptSetRecord(added).load_state_dict(None)  # a checkpoint saved before the set was noted
    assert not caplog.records


def test_the_prompt_order_is_the_shuffle_it_always_was():
    """The epoch's permutation is drawn once, not at every step; the indices are those the per-step shuffle gave (a
    run's prompts, so its metrics, are unchanged), as are dynamic sampling's extra draws."""
    def per_step_shuffle(num_prompts, prompts_per_step, step, seed):
        orders, indices = {}, []
        for position in range((step - 1) * prompts_per_step, step * prompts_per_step):
            epoch, offset = divmod(position, num_prompts)
            if epoch not in orders:
                orders[epoch] = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
            indices.append(orders[epoch][offset])
        return indices

    def listed_extra_draw(num_prompts, count, seed, step, round_index, used):
        generator = torch.Generator().manual_seed(grpo_sampling.rollout_seed(seed, step, -1, round_index))
        order = torch.randperm(num_prompts, generator=generator).tolist()
        order = [index for index in order if index not in set(used)] + [index for index in order if index in set(used)]
        return [order[position % num_prompts] for position in range(count)]

    for num_prompts, per_step in ((10, 4), (7, 16), (1000, 64)):
        for step in range(1, 25):
            indices = grpo_sampling.step_prompt_indices(num_prompts, per_step, step, 1234)
            assert indices == per_step_shuffle(num_prompts, per_step, step, 1234)
            assert all(type(index) is int for index in indices)
            for round_index in (1, 2):
                assert (grpo_sampling.extra_prompt_indices(num_prompts, per_step, 1234, step, round_index, indices)
                        == listed_extra_draw(num_prompts, per_step, 1234, step, round_index, indices))


def test_a_long_cold_build_says_how_far_it_is(tokenizer, tmp_path, monkeypatch, caplog):
    """Rendering and tokenizing 100,000 prompts takes minutes: a line at least every `PROGRESS_INTERVAL_S` (rank 0
    prints it) says how many are done."""
    monkeypatch.setattr(encode, "PROGRESS_INTERVAL_S", 0.0)
    with caplog.at_level(logging.INFO, logger="data.encode"):
        prompt_set(tokenizer, ROWS[:3], cache=tmp_path)
    lines = [record.getMessage() for record in caplog.records if "prompts rendered and tokenized" in record.getMessage()]
    assert [line.split(" (")[0] for line in lines] == ["prompts rendered and tokenized: 1 of 3",
                                                       "prompts rendered and tokenized: 2 of 3"]


def test_a_process_waiting_for_another_to_build_the_entry_says_how_long_it_has_waited(tmp_path, monkeypatch, caplog):
    """The process that builds a cold entry may be a rank other than 0, whose progress lines the console drops: rank 0,
    waiting for it, says every `PROGRESS_INTERVAL_S` how long it has waited instead of nothing for minutes."""
    import threading
    import time

    monkeypatch.setattr(encode, "PROGRESS_INTERVAL_S", 0.0)
    monkeypatch.setattr(encode, "LOCK_POLL_S", 0.02)
    entered = []

    def waiting_rank():
        with encode.building(tmp_path, "prompts", "entry"):
            entered.append(time.monotonic())

    with caplog.at_level(logging.INFO, logger="data.encode"):
        with encode.building(tmp_path, "prompts", "entry"):  # the rank that builds
            waiting = threading.Thread(target=waiting_rank)
            waiting.start()
            time.sleep(0.3)
            assert waiting.is_alive() and not entered
            released = time.monotonic()
        waiting.join(5)
    assert entered and entered[0] >= released
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0].startswith("waiting for another process that is building the cache entry")
    assert sum(line.startswith("still waiting for another process") for line in lines) >= 2


def test_a_prompt_set_smaller_than_a_step_is_said(tmp_path, caplog):
    """A step's prompts wrap around a set smaller than the step (`step_prompt_indices`): a 1-prompt file at
    `train.global_batch_size=16`, `grpo.n_samples=2` trained 8 groups of that one prompt every step, and 3 prompts
    at the same sizes 3, 3 and 2 groups of each, without a word. The start-up now says so; a set of a step's size
    is not warned of."""
    from trainer.grpo import load_tokenizer_and_prompts

    assert grpo_sampling.step_prompt_indices(1, 8, 1, 1234) == [0] * 8
    assert sorted(numpy.bincount(grpo_sampling.step_prompt_indices(3, 8, 1, 0))) == [2, 3, 3]
    said = {}
    for count in (1, 8):
        path = tmp_path / f"train{count}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in (ROWS * 2)[:count]))
        config = GRPOConfig()
        config.data.path, config.data.cache = str(path), False
        config.train.global_batch_size, config.grpo.n_samples = 16, 2
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainer"):
            _, _, train_prompts, _ = load_tokenizer_and_prompts(config, ensure_tiny_checkpoint(), None, 1)
        assert len(train_prompts) == count
        said[count] = [record.getMessage() for record in caplog.records if record.name == "trainer"]
    assert said[8] == []
    assert said[1] == [f"`data.path={tmp_path / 'train1.jsonl'}` gives 1 usable prompts, fewer than the 8 each step takes "
                       "(`train.global_batch_size=16` / `grpo.n_samples=2`): each step samples the same prompts over "
                       "again, about 8 groups of each, so a step's 8 groups are not 8 prompts. Add prompts, or lower "
                       "`--train.global_batch_size` to at most 2 completions."]
