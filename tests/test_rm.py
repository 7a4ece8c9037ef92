"""Reward models: `trainer.rm` (preference pairs in every form, the Bradley-Terry loss on a scalar head, TP/PP/DP,
exact resume, the export transformers loads as a sequence classifier, the embedded preference set and reward model),
and what GRPO asks of a reward model (`grpo.reward_model`) before it is built."""

import dataclasses
import json
import logging
import shutil
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from config.cli import parse_args
from config.errors import UserError
from config.loops import GRPOConfig, RMConfig
from config.sections import PreferenceDataConfig
from data import preferences
from model import score_head
from model.tiny import ensure_tiny_checkpoint
from tests.conftest import REPO, launch, metrics_rows, tiny_reward_model, write_pairs


@pytest.fixture(scope="module")
def tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(ensure_tiny_checkpoint())


# ---------------------------------------------------------------- pairs, the head's position, the loss


def test_pairs_are_read_in_every_form_the_preference_sets_use(tokenizer, tmp_path):
    """An explicit prompt (text or messages) beside each side, or each side a whole conversation, or plain text: the
    chat template renders a conversation; plain text is tokenized with the end token. Malformed, alike and overlong
    pairs are dropped and counted; a missing column names the key to set."""
    question, good, bad = "What is 2 + 2?", "2 + 2 = 4\n#### 4", "2 + 2 = 5\n#### 5"
    user = [{"role": "user", "content": question}]

    def chat(answer):
        return tokenizer.apply_chat_template(user + [{"role": "assistant", "content": answer}], tokenize=True)["input_ids"]

    rows = [{"prompt": question, "chosen": good, "rejected": bad},
            {"prompt": user, "chosen": [{"role": "assistant", "content": good}],
             "rejected": [{"role": "assistant", "content": bad}]},
            {"prompt": question, "chosen": good, "rejected": good},  # alike
            {"prompt": question, "chosen": None, "rejected": bad},  # malformed
            {"prompt": question, "chosen": good * 40, "rejected": bad}]  # too long
    (tmp_path / "explicit").mkdir()
    (tmp_path / "explicit" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = PreferenceDataConfig(max_seq_len=128)
    pairs, report = preferences.load_pairs(str(tmp_path / "explicit"), "train", data, tokenizer)
    assert [(pair.chosen, pair.rejected) for pair in pairs] == [(chat(good), chat(bad))] * 2
    assert chat(good)[-1] != tokenizer.eos_token_id  # the template's newline after the end token is part of it
    assert report.dropped_by_reason == {"chosen and rejected alike": 1, "malformed or missing side": 1,
                                        "longer than data.max_seq_len=128": 1}
    # Each side a whole conversation (no prompt column), and plain text.
    (tmp_path / "implicit").mkdir()
    (tmp_path / "implicit" / "train.jsonl").write_text(json.dumps(
        {"chosen": user + [{"role": "assistant", "content": good}], "rejected": bad}) + "\n")
    pair = preferences.load_pairs(str(tmp_path / "implicit"), "train", data, tokenizer)[0][0]
    assert pair.chosen == chat(good)
    assert pair.rejected == tokenizer(bad, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    # A prompt column beside sides that already hold it (HuggingFaceH4/ultrafeedback_binarized's `prompt` text beside
    # `chosen` [user, assistant]; TRL reads the sides as whole conversations): the prompt once, not twice as before.
    (tmp_path / "h4").mkdir()
    (tmp_path / "h4" / "train.jsonl").write_text("".join(json.dumps(
        {"prompt": prompt, "chosen": user + [{"role": "assistant", "content": good}],
         "rejected": user + [{"role": "assistant", "content": bad}]}) + "\n" for prompt in (question, user)))
    pairs = preferences.load_pairs(str(tmp_path / "h4"), "train", data, tokenizer)[0]
    assert [(pair.chosen, pair.rejected) for pair in pairs] == [(chat(good), chat(bad))] * 2
    assert tokenizer.decode(pairs[0].chosen).count(question) == 1
    # Tool calls and reasoning are part of a side, as SFT reads them: sides that differ only in a call's arguments were
    # dropped as alike before (each message was cut to its role and content).
    def called(a: int, b: int) -> list[dict]:
        return [{"role": "assistant", "content": "", "reasoning_content": "Multiply.",
                 "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": json.dumps({"a": a, "b": b})}}]}]

    (tmp_path / "calls").mkdir()
    (tmp_path / "calls" / "train.jsonl").write_text(json.dumps({"prompt": user, "chosen": called(12, 34),
                                                                "rejected": called(12, 43)}) + "\n")
    pairs, report = preferences.load_pairs(str(tmp_path / "calls"), "train", data, tokenizer)
    assert len(pairs) == 1 and report.dropped_by_reason == {}
    assert '"a": 12, "b": 34' in tokenizer.decode(pairs[0].chosen) and '"b": 43' in tokenizer.decode(pairs[0].rejected)
    with pytest.raises(UserError, match="`data.chosen_field` is 'better', but"):
        preferences.load_pairs(str(tmp_path / "explicit"), "train", dataclasses.replace(data, chosen_field="better"),
                               tokenizer)
    # A prompt column the user named and the data lacks is a mistake, not the whole-conversation form (it trained on
    # the sides without their prompts, saying nothing).
    with pytest.raises(UserError, match="`data.prompt_field` is 'question', but .* has no such column"):
        preferences.load_pairs(str(tmp_path / "explicit"), "train", dataclasses.replace(data, prompt_field="question"),
                               tokenizer)


def test_a_row_without_the_prompt_its_set_gives_is_dropped_not_scored_as_bare_text(tokenizer, tmp_path):
    """A row of a set with a prompt column whose prompt is null or absent, with text sides: it was scored as the bare
    texts (`2<|im_end|>` beside the other rows' whole chat renderings), and counted as used."""
    rows = [{"prompt": "1 + 1?", "chosen": "2", "rejected": "3"}, {"prompt": None, "chosen": "2", "rejected": "3"},
            {"chosen": "4", "rejected": "5"},
            {"prompt": None, "chosen": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}],
             "rejected": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "5"}]}]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    pairs, report = preferences.load_pairs(str(tmp_path / "pairs.jsonl"), "train", PreferenceDataConfig(), tokenizer)
    assert (len(pairs), report.dropped_by_reason, [row for row, _ in report.first_drops]) == (
        2, {"missing 'prompt'": 2}, [1, 2])
    assert all(tokenizer.decode(pair.chosen).startswith("<|im_start|>user") for pair in pairs)


def test_held_out_pairs_dropped_are_counted_in_a_start_up_line(tokenizer, tmp_path, caplog):
    """The held-out split's malformed and alike pairs were dropped without a word (only the training split's line
    counted its drops), so the held-out accuracy was measured on fewer pairs than the file gives, unsaid."""
    rows = [{"prompt": "1 + 1?", "chosen": "2", "rejected": "3"}, {"prompt": "1 + 1?", "chosen": "2", "rejected": "2"},
            {"prompt": "1 + 1?", "chosen": None, "rejected": "3"}]
    (tmp_path / "pairs").mkdir()
    for split in ("train", "test"):
        (tmp_path / "pairs" / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with caplog.at_level(logging.INFO):
        pairs = preferences.held_out_pairs(PreferenceDataConfig(path=str(tmp_path / "pairs")), tokenizer)
    assert len(pairs) == 1
    assert (f"pairs {tmp_path / 'pairs'} (test): 1 used; 1 of 3 rows used, 2 dropped (chosen and rejected alike: 1, "
            "malformed or missing side: 1)") in caplog.text


def test_the_scored_position_is_the_last_token_that_is_not_padding_as_transformers_pools():
    tokens = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9], [0, 0, 0, 0, 0], [5, 0, 6, 0, 0]])
    read = score_head.LastTokens.of(tokens, pad_id=0)
    # transformers' rule (Qwen2ForSequenceClassification): the rightmost position whose id is not the pad id.
    expected = [max([i for i, token in enumerate(row) if token != 0], default=0) for row in tokens.tolist()]
    assert read.columns.tolist() == expected == [2, 4, 0, 2]
    assert read.rows.tolist() == [0, 1, 2, 3]


def test_the_bradley_terry_loss_of_a_micro_batch():
    """Rows chosen, rejected, ...: -log sigmoid(r_c - r_r) summed, the pair count, and the report's sums."""
    from trainer import rm

    loss, pairs, report = rm.pair_loss(torch.tensor([2.0, 0.0, -1.0, 1.0]))
    expected = -torch.nn.functional.logsigmoid(torch.tensor(2.0)) - torch.nn.functional.logsigmoid(torch.tensor(-2.0))
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6) and pairs.item() == 2
    sums = dict(zip(rm.SUMS, report["rm"].tolist()))
    assert sums == pytest.approx({"loss": expected.item(), "pairs": 2, "accuracy": 1, "margin": 0.0,
                                  "chosen_score": 1.0, "rejected_score": 1.0}, abs=1e-6)
    assert rm.figures(sums, "eval_") == pytest.approx({"eval_loss": expected.item() / 2, "eval_accuracy": 0.5,
                                                       "eval_margin": 0.0, "eval_chosen_score": 0.5,
                                                       "eval_rejected_score": 0.5}, abs=1e-6)


def test_the_embedded_set_pairs_each_prompts_right_completions_with_its_wrong_ones():
    """One pair per right completion while wrong ones last; the wrong ones in the answer's form (`#### N`) first."""
    from trainer import preference_set

    prompt = types.SimpleNamespace(messages=[{"role": "user", "content": "q"}])
    answers = ["The answer is 4.", "#### 4", "#### 5", "#### 4", "The answer is 5.", "no answer"]
    episodes = [types.SimpleNamespace(prompt=prompt, answer=text) for text in answers]
    rows = preference_set.pairs_of(episodes, [False, True, False, True, False, False], samples=3)
    assert [(row["chosen"][0]["content"], row["rejected"][0]["content"]) for row in rows] == [("#### 4", "#### 5"),
                                                                                              ("#### 4", "The answer is 5.")]
    rows = preference_set.pairs_of(episodes, [True, True, False, False, False, False], samples=3)
    assert [(row["chosen"][0]["content"], row["rejected"][0]["content"]) for row in rows] == [("The answer is 4.", "#### 5")]
    assert rows[0]["prompt"] == prompt.messages


def test_the_embedded_sets_chunks_give_every_data_parallel_rank_as_many_generation_calls():
    """Generation is collective over the data-parallel group under Megatron-FSDP (`model.generate.Engine`): each rank
    makes the same number of calls at every DP size (8 train chunks at DP=3 were 3, 3 and 2 calls: the third rank
    left the others waiting), and the kept calls cover each chunk once, so the set is the same at any process count."""
    from trainer import preference_set

    for count in (4, 8):
        for dp_size in range(1, 10):
            dealt = [preference_set.dealt_chunks(count, rank, dp_size) for rank in range(dp_size)]
            assert {len(calls) for calls in dealt} == {-(-count // dp_size)}, (count, dp_size)
            assert sorted(index for calls in dealt for index, kept in calls if kept) == list(range(count))
    assert preference_set.dealt_chunks(8, 2, 3) == [(2, True), (5, True), (2, False)]


def test_metrics_png_names_a_reward_models_panels_by_pairs(tmp_path):
    """A `trainer.rm` run's accuracy panels say pairs (not rollouts), its scores get a panel, and a legend lists only
    the keys drawn."""
    from trainer import plots

    rows = [{"step": 0, "eval_loss": 0.69, "eval_accuracy": 0.7, "eval_margin": 0.0}] + [
        {"step": step, "loss": 0.6 / step, "accuracy": 0.8, "margin": step, "chosen_score": step / 2,
         "rejected_score": -step / 2, "lr": 1e-4, "grad_norm": 1.0} for step in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    axes = plots.figure([tmp_path]).axes
    assert [panel.get_title() for panel in axes] == [
        "training loss", "learning rate", "grad norm", "held-out loss", "held-out pair accuracy",
        "pair accuracy (chosen scored higher)", "reward model: pairs' scores"]
    assert axes[4].get_legend() is None  # `eval_accuracy` alone of the held-out accuracy keys
    assert [text.get_text() for text in axes[6].get_legend().get_texts()] == ["chosen", "rejected", "margin",
                                                                               "held-out margin"]


@pytest.mark.slow
def test_the_pair_kinds_script_scores_an_export_in_transformers(tmp_path):
    """scripts/reward_model_pairs.py, the command behind docs/rewards.md's split by pair kind, on a transformers-made
    reward model and the small set (16 pairs of each kind)."""
    model, pairs = tiny_reward_model(tmp_path / "rm"), write_pairs(tmp_path / "pairs")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "reward_model_pairs.py"), str(model),
                           str(pairs / "test.jsonl")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["every pair", "rejected in the answer's form",
                                                      "rejected in another form"]
    assert [line.split(" of ")[1] for line in lines] == [f"{count} pairs scored the right way round"
                                                         for count in (32, 16, 16)]


# ---------------------------------------------------------------- checkpoints and start-up refusals


def test_a_classifier_is_read_through_a_causal_view_and_one_of_several_labels_is_refused(tmp_path):
    """A downloaded-style reward model: Bridge reads it as the causal LM with tied embeddings, its head apart; the
    tiny causal LM passes through; a two-label classifier is refused, naming the key."""
    from safetensors import safe_open

    path = tiny_reward_model(tmp_path / "rm")
    view, weight = score_head.causal_view(path, "grpo.reward_model")
    config = json.loads((view / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is True
    with safe_open(path / "model.safetensors", "pt") as handle:
        assert torch.equal(weight, handle.get_tensor("score.weight").float()) and weight.shape == (1, 128)
    assert score_head.causal_view(ensure_tiny_checkpoint(), "model.path") == (ensure_tiny_checkpoint(), None)
    # Two labels, as transformers saves them: no id2label in config.json (its default), the head two rows.
    import transformers

    transformers.AutoModelForSequenceClassification.from_pretrained(ensure_tiny_checkpoint(), num_labels=2).save_pretrained(tmp_path / "two")
    assert "id2label" not in json.loads((tmp_path / "two" / "config.json").read_text())
    with pytest.raises(UserError, match="with 2 labels; a reward model has one"):
        score_head.causal_view(tmp_path / "two", "grpo.reward_model")


def test_a_tokenizer_without_a_padding_token_pads_with_its_end_token(tmp_path):
    """Llama 3's and Mistral's tokenizers have no padding token: every loop pads with the end token (it was None, and
    collating raised a TypeError); a pair's sides then collate, and each side is scored at its last token that is not
    padding, as transformers does with that pad_token_id."""
    import transformers

    from model import build

    tokenizer = transformers.AutoTokenizer.from_pretrained(ensure_tiny_checkpoint())
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = build.load_tokenizer(tmp_path / "tok")
    assert loaded.pad_token_id == loaded.eos_token_id is not None
    pair = preferences.Pair([5, 6, 7], [5, 8])
    batch = preferences.collate_pairs([pair], 4, loaded.pad_token_id)
    assert batch["tokens"].tolist() == [[5, 6, 7, loaded.eos_token_id], [5, 8, loaded.eos_token_id, loaded.eos_token_id]]
    assert score_head.LastTokens.of(batch["tokens"], loaded.pad_token_id).columns.tolist() == [2, 1]
    # A base model's tokenizer has no chat template: a pair with a prompt is refused with a paragraph, not a
    # ValueError from transformers; whole-text sides need none.
    loaded.chat_template = None
    with pytest.raises(UserError, match="has no chat template, and every prompt and conversation is rendered by one"):
        preferences.render("What is 2 + 2?", "4", loaded)
    assert preferences.render(None, "2 + 2 = 4", loaded)[-1] == loaded.eos_token_id


def test_grpo_refuses_a_reward_model_it_cannot_use(tmp_path):
    """Beside rollout processes (they hold no reward model), a causal LM given as one, a reward model given as the
    teacher or the policy, and a directory without a tokenizer; a Mixture-of-Experts one and the weights without the
    models they weigh are refused in test_grpo_e2e."""
    from trainer.reward_model import template_tail

    path = tiny_reward_model(tmp_path / "rm")
    config, _ = parse_args(GRPOConfig, [f"--grpo.reward_model={path}", "--grpo.reward_weight=0"], "trainer.grpo")
    config.validate(world_size=2)
    config, _ = parse_args(GRPOConfig, [f"--grpo.reward_model={path}", "--grpo.rollout_processes=1"], "trainer.grpo")
    with pytest.raises(UserError, match="does not run with `grpo.reward_model`"):
        config.validate(world_size=2)
    import shutil

    import transformers

    from config.loops import SFTConfig
    from model import build

    def refusal(config_class, argv: list[str], module: str = "trainer.grpo") -> str:
        config, _ = parse_args(config_class, argv, module)
        with pytest.raises(UserError) as raised:
            config.validate(world_size=2)
        return str(raised.value)

    # Checked from the config.json alone, before any model is built (a causal LM as the reward model was found once
    # the policy was built; a reward model as the teacher or the policy reached the user as Bridge's traceback).
    assert "is not a reward model" in refusal(GRPOConfig, [f"--grpo.reward_model={ensure_tiny_checkpoint()}"])
    assert refusal(GRPOConfig, [f"--grpo.teacher={path}"]).startswith(
        f"`grpo.teacher={path}` is a reward model (Qwen2ForSequenceClassification: a score head")
    for config_class, module in ((GRPOConfig, "trainer.grpo"), (SFTConfig, "trainer.sft")):
        assert refusal(config_class, [f"--model.path={path}"], module).startswith(f"`model.path={path}` is a reward model")
    parse_args(RMConfig, [f"--model.path={path}"], "trainer.rm")[0].validate(world_size=2)  # trained on
    # A directory without a tokenizer (transformers made an empty one, and every episode became no tokens).
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(path / name, bare / name)
    assert "holds no tokenizer (none of tokenizer.json" in refusal(GRPOConfig, [f"--grpo.reward_model={bare}"])
    (bare / "config.json").write_text((ensure_tiny_checkpoint() / "config.json").read_text())
    assert refusal(GRPOConfig, [f"--grpo.teacher={bare}"]).startswith(f"`grpo.teacher={bare}` holds no tokenizer")
    with pytest.raises(UserError, match=f"`model.path={bare}` holds no tokenizer"):  # before the model is built
        build.load_tokenizer(bare)

    # An encoder's classifier (DeBERTa's reward models): no causal LM to read it as. It was taken, and once the policy
    # was built the run stopped saying it lacked `score.weight` ("Point at a complete reward-model checkpoint").
    encoder = tmp_path / "deberta"
    transformers.DebertaV2ForSequenceClassification(transformers.DebertaV2Config(
        vocab_size=448, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_labels=1)).save_pretrained(encoder)
    transformers.AutoTokenizer.from_pretrained(path).save_pretrained(encoder)
    for config_class, key, module in ((GRPOConfig, "grpo.reward_model", "trainer.grpo"), (RMConfig, "model.path", "trainer.rm")):
        assert refusal(config_class, [f"--{key}={encoder}", "--grpo.reward_weight=0"][: 2 if key.startswith("grpo") else 1],
                       module).startswith(f"`{key}={encoder}` is a DebertaV2ForSequenceClassification, a classifier whose "
                                          "family has no causal language model")

    assert template_tail(transformers.AutoTokenizer.from_pretrained(path)) == "\n"  # Qwen's, after <|im_end|>


def test_the_embedded_recipe_is_the_default():
    """`--config rm` (recipes/rm.yaml) spells out `trainer.rm`'s defaults: the default SFT's output, the embedded set."""
    recipe, _ = parse_args(RMConfig, ["--config", "rm"], "trainer.rm")
    assert recipe == RMConfig()
    assert (recipe.model.path, recipe.data.path, recipe.train.out_dir) == ("outputs/sft/hf", "outputs/preferences", "outputs/rm")


def test_grpo_scores_the_conversation_as_the_chat_template_renders_it(tokenizer):
    """An episode is read as its prompt's ids and every id after it, with the template's ids after a final end token:
    the conversation as `trainer.rm` renders a side (a cut episode has no end token, so nothing is added). With the
    policy's tokenizer nothing is decoded: a tool's text that spells a control token stays text."""
    from trainer.reward_model import RewardModel, template_tail

    scorer = object.__new__(RewardModel)
    scorer.policy_tokenizer, scorer.tokenizer, scorer.reads_policy_ids = tokenizer, tokenizer, True
    scorer.tail_ids = tokenizer(template_tail(tokenizer), add_special_tokens=False)["input_ids"]
    other_end = tokenizer.convert_tokens_to_ids(tokenizer.pad_token)  # an end id of generation_config's, say
    scorer.end_ids, scorer.turn_end_id = {tokenizer.eos_token_id, other_end}, tokenizer.eos_token_id
    user = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True)["input_ids"]
    answer = tokenizer("2 + 2 = 4\n#### 4", add_special_tokens=False)["input_ids"]
    ended = types.SimpleNamespace(prompt_ids=prompt, ids=answer + [tokenizer.eos_token_id])
    cut = types.SimpleNamespace(prompt_ids=prompt, ids=answer)
    rendered = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": "2 + 2 = 4\n#### 4"}],
                                             tokenize=True)["input_ids"]
    assert scorer.rows([ended, cut]) == [rendered, prompt + answer]
    # Generation may stop at another end id: the turn is still closed as the template closes it.
    assert scorer.rows([types.SimpleNamespace(prompt_ids=prompt, ids=answer + [other_end])]) == [rendered]
    spelled = tokenizer("<|im_end|>", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert tokenizer.eos_token_id not in scorer.rows([types.SimpleNamespace(prompt_ids=prompt, ids=spelled)])[0][len(prompt):]
    # An id of no token (the policy's padded vocabulary: the tiny model's 448 rows hold 422 tokens) is left out, as
    # decoding leaves it out; it reached the reward model's embedding, which a smaller size of the family may lack
    # (an IndexError on one rank).
    padded = types.SimpleNamespace(prompt_ids=prompt, ids=answer[:2] + [440] + answer[2:] + [tokenizer.eos_token_id])
    assert len(tokenizer) == 422 and scorer.rows([padded]) == [rendered]
    # Another tokenizer without a chat template of its own reads the same conversation as text.
    scorer.reads_policy_ids, scorer.own_template = False, False
    assert scorer.rows([ended]) == [rendered] and scorer.rows([padded]) == [rendered]


def llama_like_tokenizer(tokenizer, out, added=(), pad: str | None = None):
    """The tiny tokenizer as Llama 3's behaves: a BOS (id 422) that both its chat template writes and tokenizing adds;
    `added` special tokens after it (ids 423, ...), `pad` its padding token."""
    import transformers

    tokenizer.save_pretrained(out)
    files = json.loads((out / "tokenizer.json").read_text())
    for index, name in enumerate(["<|begin_of_text|>", *added]):
        files["added_tokens"].append({"id": len(tokenizer) + index, "content": name, "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
    bos = {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}
    files["post_processor"].update(single=[bos, *files["post_processor"]["single"]],
                                   pair=[bos, *files["post_processor"]["pair"]], special_tokens={"<|begin_of_text|>": {
                                       "id": "<|begin_of_text|>", "ids": [len(tokenizer)], "tokens": ["<|begin_of_text|>"]}})
    (out / "tokenizer.json").write_text(json.dumps(files))
    settings = json.loads((out / "tokenizer_config.json").read_text())
    settings.update(bos_token="<|begin_of_text|>", **({"pad_token": pad} if pad else {}))
    (out / "tokenizer_config.json").write_text(json.dumps(settings))
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    loaded.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    return loaded


def test_a_rows_tools_are_offered_to_the_chat_template_of_both_sides(tokenizer, tmp_path):
    """A preference row's `tools` (OpenAI schemas, or that list as JSON text, as SFT reads a row's) are passed to the
    chat template with each side, as TRL's RewardTrainer passes `example["tools"]` and as GRPO's reward model reads a
    tool episode (the policy's prompt, which offers them). They were left out: the reward model never saw the tool
    block it is scored with. Malformed tools drop the row under that reason."""
    schema = {"type": "function", "function": {"name": "multiply", "description": "Multiply.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    user = [{"role": "user", "content": "What is 12 x 34?"}]

    def side(answer):
        return [{"role": "assistant", "content": answer}]

    rows = [{"prompt": user, "chosen": side("408"), "rejected": side("406"), "tools": [schema]},
            {"prompt": user, "chosen": side("408"), "rejected": side("406"), "tools": json.dumps([schema])},
            {"prompt": user, "chosen": side("408"), "rejected": side("406"), "tools": [{"type": "function"}]}]
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    pairs, report = preferences.load_pairs(str(tmp_path / "tools"), "train", PreferenceDataConfig(max_seq_len=128),
                                           tokenizer)
    expected = [tokenizer.apply_chat_template(user + side(answer), tools=[schema], tokenize=True)["input_ids"]
                for answer in ("408", "406")]
    assert [[pair.chosen, pair.rejected] for pair in pairs] == [expected] * 2
    assert tokenizer.decode(pairs[0].chosen).startswith("<|im_start|>system\nTools: multiply(a, b)<|im_end|>")
    assert report.dropped_by_reason == {"malformed tools": 1}


def test_a_side_with_a_message_its_chat_template_leaves_out_is_dropped_by_name(tokenizer):
    """Mistral v0.3's template writes the system message only into a last user turn, so a side [system, user,
    assistant] rendered without it: the reward model learned to score answers without the instruction GRPO's prompt
    (the user turn last) shows it. Such a pair is dropped and counted under the role, as SFT drops such a row; a
    conversation the template renders whole is kept, and its ids are the template's."""
    import transformers

    mistral = transformers.AutoTokenizer.from_pretrained(ensure_tiny_checkpoint())
    mistral.chat_template = (
        "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
        "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
        "{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
        "{%- if loop.last and system_message is defined %}{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
        "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
        "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}")
    system = [{"role": "system", "content": "Answer with the number alone."}, {"role": "user", "content": "2 + 2?"}]
    answer = [{"role": "assistant", "content": "4"}]
    assert "Answer with" not in mistral.apply_chat_template(system + answer, tokenize=False)
    assert preferences.render(system, answer, mistral) == "a 'system' message the chat template does not render"
    assert preferences.render(system[1:], answer, mistral) == mistral.apply_chat_template(
        system[1:] + answer, tokenize=True)["input_ids"]


def test_a_plain_text_side_reads_the_tokenizers_bos_and_one_end_token_as_trl_tokenizes_it(tokenizer, tmp_path):
    """A side of plain text with no prompt (Anthropic HH's form) is tokenized as TRL's RewardTrainer does,
    `processing_class(text + eos_token)`: a Llama tokenizer's BOS first, then the text and one end token; and as GRPO's
    reward model reads a text row (`RewardModel.retokenized`, its special tokens added). It was the text without
    special tokens: a Llama reward model trained on [2, ..., eos] and scored on [BOS, 2, ..., eos]."""
    llama = llama_like_tokenizer(tokenizer, tmp_path / "llama")
    bos, eos = llama.bos_token_id, llama.eos_token_id
    text = "2 + 2 = 4\n#### 4"
    side = preferences.render(None, text, llama)
    assert side == llama(text + llama.eos_token)["input_ids"]
    assert side[0] == bos == 422 and side.count(bos) == 1 and side[-1] == eos and side.count(eos) == 1
    assert side[1:-1] == llama(text, add_special_tokens=False)["input_ids"]
    # A text that already ends with the end token, or starts with the BOS, has each once.
    assert preferences.render(None, "<|begin_of_text|>" + text + llama.eos_token, llama) == side
    # The tiny (Qwen-like) tokenizer adds no special tokens: the text and the end token, as before.
    assert preferences.render(None, text, tokenizer) == tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]


def test_a_reward_model_of_the_policys_family_reads_one_bos(tokenizer, tmp_path):
    """A Llama 3 policy's template writes the BOS, and its tokenizer adds one too. A reward model whose tokenizer is the
    policy's with its own padding token added (as Llama 3 reward models add one) reads the episode's ids; one whose
    vocabulary differs (an id of the policy's another token) reads the text once tokenized, the BOS once: the conversation as `trainer.rm` renders a side.
    Both read the BOS twice before (the added padding token made any vocabulary "another tokenizer", and the
    tokenizer added a BOS to the text that held one)."""
    from config.hf import turn_end
    from trainer.reward_model import RewardModel, holds_vocabulary, template_tail

    policy = llama_like_tokenizer(tokenizer, tmp_path / "policy", ["<|think|>"])
    user = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt = policy.apply_chat_template(user, add_generation_prompt=True, tokenize=True)["input_ids"]
    episode = types.SimpleNamespace(prompt_ids=prompt,
                                    ids=policy("#### 4", add_special_tokens=False)["input_ids"] + [policy.eos_token_id])
    bos = policy.bos_token_id
    assert bos == 422 and prompt[0] == bos and policy("4")["input_ids"][0] == bos  # written and added
    for added, reads_ids in (["<|think|>", "[PAD]"], True), (["[PAD]"], False):  # id 423 another token
        own = llama_like_tokenizer(tokenizer, tmp_path / "-".join(added), added, pad="[PAD]")
        scorer = object.__new__(RewardModel)
        scorer.policy_tokenizer, scorer.tokenizer = policy, own
        scorer.reads_policy_ids, scorer.own_template = holds_vocabulary(own, policy), False  # the text's path
        scorer.tail_ids = policy(template_tail(policy), add_special_tokens=False)["input_ids"]
        scorer.end_ids, scorer.turn_end_id = {policy.eos_token_id}, policy.convert_tokens_to_ids(turn_end(policy))
        rendered = own.apply_chat_template(user + [{"role": "assistant", "content": "#### 4"}], tokenize=True)["input_ids"]
        assert scorer.reads_policy_ids is reads_ids and own.pad_token_id == 422 + len(added)  # the padding token added
        (row,) = scorer.rows([episode])
        assert row[:2] == [bos, 1] and row == rendered, (added, row[:4])


def test_a_row_of_the_policys_padded_vocabulary_is_left_out_where_the_reward_model_adds_tokens(tokenizer, tmp_path):
    """A reward model whose tokenizer is the policy's with a padding token added reads the episode's ids. An id of no
    policy token (a row of its padded vocabulary, sampled with a tiny probability) is left out, as decoding leaves it
    out; before, only ids past the reward model's tokens were, so the policy's id 424 (decoded as '') was read as the
    reward model's [PAD], a token it never saw inside a conversation (and, at a cut episode's end, the scored position
    moved to the token before it)."""
    from config.hf import turn_end
    from trainer.reward_model import RewardModel, holds_vocabulary, template_tail

    policy = llama_like_tokenizer(tokenizer, tmp_path / "policy", ["<|think|>"])
    own = llama_like_tokenizer(tokenizer, tmp_path / "own", ["<|think|>", "[PAD]"], pad="[PAD]")
    scorer = object.__new__(RewardModel)
    scorer.policy_tokenizer, scorer.tokenizer = policy, own
    scorer.reads_policy_ids, scorer.own_template = holds_vocabulary(own, policy), False
    scorer.tail_ids = policy(template_tail(policy), add_special_tokens=False)["input_ids"]
    scorer.end_ids, scorer.turn_end_id = {policy.eos_token_id}, policy.convert_tokens_to_ids(turn_end(policy))
    user = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt = policy.apply_chat_template(user, add_generation_prompt=True, tokenize=True)["input_ids"]
    answer = policy("#### 4", add_special_tokens=False)["input_ids"]
    assert scorer.reads_policy_ids and len(policy) == 424 and own.pad_token_id == 424 and policy.decode([424]) == ""
    padded = [types.SimpleNamespace(prompt_ids=prompt, ids=answer[:1] + [424] + answer[1:] + [policy.eos_token_id]),
              types.SimpleNamespace(prompt_ids=prompt, ids=answer + [424])]  # cut at the budget on that id
    rendered = own.apply_chat_template(user + [{"role": "assistant", "content": "#### 4"}], tokenize=True)["input_ids"]
    assert scorer.rows(padded) == [rendered, prompt + answer]


def test_a_reward_model_of_another_family_reads_the_conversation_in_its_own_chat_template(tokenizer, tmp_path, caplog):
    """A reward model of another vocabulary reads a plain episode as its own chat template renders the prompt's turns
    and the completion's text (the turn closed when the episode ended, open when it was cut), as TRL and verl render
    for it; a tool episode, and any episode after the template refused a conversation, as the policy's rendering in
    text, its BOS once. Before, every episode was the policy's rendering as text: a Llama reward model read Qwen's
    `<|im_start|>` markup."""
    import collections

    from data.prompts import Prompt
    from trainer.reward_model import RewardModel, holds_vocabulary, template_tail
    from trainer.rollout import Episode

    policy = llama_like_tokenizer(tokenizer, tmp_path / "policy", ["<|think|>"])
    own = llama_like_tokenizer(tokenizer, tmp_path / "own", ["[PAD]"], pad="[PAD]")  # id 423 another token
    own.chat_template = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}"
                         "{{ raise_exception('no system turns') }}{% endif %}### {{ m.role }}: {{ m.content }}\n"
                         "{% endfor %}")
    scorer = object.__new__(RewardModel)
    scorer.policy_tokenizer, scorer.tokenizer, scorer.reads_policy_ids = policy, own, holds_vocabulary(own, policy)
    scorer.own_template, scorer.said_refused = True, False  # as built from a tokenizer with a chat template
    scorer.tail_ids = policy(template_tail(policy), add_special_tokens=False)["input_ids"]
    scorer.end_ids, scorer.turn_end_id = {policy.eos_token_id}, policy.eos_token_id
    assert scorer.reads_policy_ids is False
    user = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt = Prompt(policy.apply_chat_template(user, add_generation_prompt=True, tokenize=True)["input_ids"], "4", user,
                    None)
    answer = policy("2 + 2 = 4\n#### 4", add_special_tokens=False)["input_ids"]

    def episode(ids, sampled=None, of=prompt):
        return Episode(of, of.ids, ids, sampled or [1] * len(ids), policy.decode(ids, skip_special_tokens=True),
                       collections.Counter())

    bos = own.bos_token_id
    closed = [bos] + own("### user: What is 2 + 2?\n### assistant: 2 + 2 = 4\n#### 4\n", add_special_tokens=False)["input_ids"]
    left_open = [bos] + own("### user: What is 2 + 2?\n### assistant: " + policy.decode(answer[:-2]),
                            add_special_tokens=False)["input_ids"]
    assert scorer.rows([episode(answer + [policy.eos_token_id]), episode(answer[:-2])]) == [closed, left_open]
    # A tool episode (ids appended between its turns) is the policy's rendering as text, its BOS once.
    as_text = own(policy.decode(prompt.ids + answer))["input_ids"][1:]  # the template's BOS and the tokenizer's
    assert scorer.rows([episode(answer, [1, 1] + [0] * (len(answer) - 2))]) == [as_text] and as_text[:2] == [bos, 1]
    # A template that refuses an episode's turns (a system turn here) is said once; that episode is read as text, and
    # each other one still in the template (decided per episode: every rank, and a resumed run, reads it alike).
    system = [{"role": "system", "content": "Be brief."}, *user]
    with_system = Prompt(policy.apply_chat_template(system, add_generation_prompt=True, tokenize=True)["input_ids"], "4",
                         system, None)
    with caplog.at_level("WARNING", logger="trainer"):
        refused = scorer.rows([episode(answer, of=with_system), episode(answer[:-2]), episode(answer, of=with_system)])
    refused_as_text = own(policy.decode(with_system.ids + answer))["input_ids"][1:]
    assert refused == [refused_as_text, left_open, refused_as_text]
    assert caplog.text.count("refused a conversation") == 1


@pytest.mark.parametrize("argv, expected", [
    (["--data.pack=true"], "Remove `--data.pack=true`"),
    (["--parallel.pp=2", "--parallel.vpp=2"], "Set `--parallel.vpp=1`"),
    (["--peft.method=lora"], "Set `--peft.method=none`"),
    (["--train.micro_batch_tokens=512"], "Use `--train.micro_batch_size` (pairs per micro-batch) instead"),
    (["--data.response_field=better"], "are not read by `trainer.rm`: a pair's sides are the columns `data.chosen_field`"),
    (["--data.messages_field=messages"], "Remove them and set those two."),
    (["--model.path=tiny-moe", "--model.moe_aux_loss_coeff=1e-3"], "a reward model's is averaged over pairs"),
])
def test_reward_model_training_refuses_what_a_scalar_head_over_pairs_cannot_take(argv, expected):
    config, _ = parse_args(RMConfig, [f"--model.path={ensure_tiny_checkpoint()}", *argv], "trainer.rm")
    with pytest.raises(UserError) as error:
        config.validate(world_size=2)
    assert expected in str(error.value)


# ---------------------------------------------------------------- the runs


def launches(default_sft, tmp_path_factory):
    """`trainer.rm` runs in two launches (conftest's `joint_launches`): straight, stopped at step 3, at TP=2, at PP=2 and
    under Megatron-FSDP on the small set, and the embedded default (its preference set sampled from the default SFT) followed by GRPO
    scored by it alone; then the stopped run resumed, and a reward model's own export trained on."""
    root = tmp_path_factory.mktemp("rm-runs")
    write_pairs(root / "pairs")
    small = [f"--model.path={default_sft / 'hf'}", f"--data.path={root / 'pairs'}", "--train.steps=6",
             "--train.global_batch_size=8", "--train.micro_batch_size=2", "--train.eval_samples=16",
             "--train.eval_interval=3", "--ckpt.save_interval=3", "--optim.lr=1e-3"]

    def command(name: str, *extra: str) -> dict:
        return {"module": "trainer.rm", "argv": [*small, f"--train.out_dir={root / name}", *extra]}

    home = root / "home"  # a user's directory, where the default SFT's output already is
    (home / "outputs" / "sft").mkdir(parents=True)
    (home / "outputs" / "sft" / "hf").symlink_to(default_sft / "hf")
    defaults = [{"module": "trainer.rm", "argv": [], "cwd": str(home)},
                {"module": "trainer.grpo", "cwd": str(home),
                 "argv": ["--grpo.reward_model=outputs/rm/hf", "--grpo.reward_weight=0", "--train.steps=2",
                          "--train.eval_samples=0", "--train.out_dir=outputs/grpo-rm"]}]
    first = yield launch([command("straight"), command("split", "--train.exit_interval=3"),
                          command("tp2", "--parallel.tp=2", "--train.exit_interval=3"),
                          command("pp2", "--parallel.pp=2", "--train.exit_interval=3"),
                          command("fsdp", "--parallel.use_megatron_fsdp=true", "--train.exit_interval=3"), *defaults])
    broken = root / "nan-rm"  # the export with its head's weights NaN: every score NaN
    shutil.copytree(root / "straight" / "hf", broken)
    weights = load_file(broken / "model.safetensors")
    weights["score.weight"] = torch.full_like(weights["score.weight"], float("nan"))
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    second = yield launch([command("split", "--resume-from-checkpoint", "latest"),
                           command("continued", f"--model.path={root / 'straight' / 'hf'}", "--train.steps=1"),
                           {"module": "trainer.grpo", "expect_error": True,
                            "argv": [f"--model.path={default_sft / 'hf'}", f"--grpo.reward_model={broken}",
                                     "--train.steps=2", "--train.global_batch_size=32", "--train.micro_batch_size=16",
                                     "--train.eval_samples=0", f"--train.out_dir={root / 'grpo-nan'}"]}])
    return {"root": root, "home": home, "default_log": first[5]["log"], "grpo_log": first[6]["log"],
            "continued": second[1], "nan_scores": second[2]}


@pytest.fixture(scope="module")
def runs(joint_launches) -> dict:
    return joint_launches[__name__]


@pytest.mark.distributed
def test_reward_model_training_resumes_exactly_and_agrees_across_layouts(runs):
    """3 + resume + 3 steps equal 6 straight (every figure, and the exported weights); at TP=2, at PP=2 (one
    replica, all 4 micro-batches on it) and under Megatron-FSDP the same global batches give the same losses within float error, stopped at
    step 3 of the same schedule; the held-out loss falls."""
    root = runs["root"]
    straight, split = metrics_rows(root / "straight"), metrics_rows(root / "split")
    print("rm straight:", straight)
    assert split == straight and [row["step"] for row in straight] == [0, 1, 2, 3, 4, 5, 6]
    exported = [load_file(root / run / "hf" / "model.safetensors") for run in ("straight", "split")]
    assert exported[0].keys() == exported[1].keys() and all(torch.equal(exported[0][k], exported[1][k]) for k in exported[0])
    assert "score.weight" in exported[0] and "lm_head.weight" not in exported[0]
    for layout in ("tp2", "pp2", "fsdp"):
        rows = metrics_rows(root / layout)
        assert [row["step"] for row in rows] == [0, 1, 2, 3]  # stopped at step 3 of the same 6-step schedule
        for mine, theirs in zip(rows, straight[:4]):
            keys = [key for key in ("loss", "eval_loss", "margin", "eval_margin") if key in theirs]
            assert [key for key in keys if key in mine] == keys, (layout, mine, theirs)
            assert [mine[key] for key in keys] == pytest.approx([theirs[key] for key in keys], rel=1e-5, abs=1e-6), (layout, mine, theirs)
            assert mine.get("accuracy") == theirs.get("accuracy") and mine.get("eval_accuracy") == theirs.get("eval_accuracy")
    # From the default SFT, 48 pairs (half told apart by the answer's form) move the held-out loss from about ln 2
    # (measured 0.671 -> 0.387 in 6 steps).
    assert straight[-1]["eval_loss"] < straight[0]["eval_loss"] - 0.15 and straight[0]["eval_loss"] < 0.75


@pytest.mark.distributed
def test_the_export_loads_in_transformers_and_scores_as_the_trainer_did(runs):
    """The final model as `AutoModelForSequenceClassification` (in a fresh process): its mean scores of the held-out
    chosen and rejected sides equal the trainer's last evaluation within 1e-5; a reward model's export trains on from
    its own head (its baseline evaluation is the run's last)."""
    root = runs["root"]
    script = f"""
import json, sys, torch, transformers
sys.path.insert(0, {str(REPO)!r})
from config.sections import PreferenceDataConfig
from data import preferences
path = {str(root / 'straight' / 'hf')!r}
tokenizer = transformers.AutoTokenizer.from_pretrained(path)
model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
data = PreferenceDataConfig(max_seq_len=128)
pairs = preferences.load_pairs({str(root / 'pairs')!r}, "test", data, tokenizer)[0][:16]
batch = preferences.collate_pairs(pairs, max(len(side) for pair in pairs for side in (pair.chosen, pair.rejected)),
                                  tokenizer.pad_token_id)
with torch.no_grad():
    scores = model(input_ids=batch["tokens"]).logits.squeeze(-1)
print(json.dumps([scores[0::2].mean().item(), scores[1::2].mean().item()]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    chosen, rejected = json.loads(done.stdout.strip().splitlines()[-1])
    last = metrics_rows(root / "straight")[-1]
    assert chosen == pytest.approx(last["eval_chosen_score"], abs=1e-5)
    assert rejected == pytest.approx(last["eval_rejected_score"], abs=1e-5)
    continued = metrics_rows(root / "continued")
    assert continued[0]["eval_loss"] == pytest.approx(last["eval_loss"], abs=1e-5)


@pytest.mark.distributed
def test_a_reward_model_scoring_nan_stops_grpo_at_its_first_step_naming_it(runs):
    """A reward model whose head is NaN scored every rollout NaN: its groups' advantages were NaN and the update's
    gradients after them. Each non-finite score is now a counted reward failure, so a step on which all are stops
    the run with one paragraph naming `grpo.reward_model`, before any update."""
    error, root = runs["nan_scores"]["error"], runs["root"]
    assert error.startswith("The reward (`grpo.reward=arithmetic` plus the reward model `grpo.reward_model="), error
    assert "failed on every one of the 32 completions of step 1" in error and "scored nan (on the completion" in error
    assert "A reward model's scores must be finite numbers: check its weights" in error
    assert "A reward function takes" not in error and "--grpo.tolerate_reward_errors=true" in error
    assert not (root / "grpo-nan" / "metrics.jsonl").is_file() or all(
        row["step"] == 0 for row in metrics_rows(root / "grpo-nan"))


def test_an_embedded_set_sampled_from_a_model_since_changed_is_said(tmp_path, monkeypatch, caplog):
    """The embedded set is kept once built (whoever wrote it): one sampled from the model as it is now passes without
    a word; after the model's weights change (the default SFT run again), a run is told the pairs are the earlier
    model's and how to sample them again. A set without the record (the user's own) is not judged."""
    from trainer import preference_set

    monkeypatch.chdir(tmp_path)
    model = tmp_path / "outputs" / "sft" / "hf"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights")
    folder = write_pairs(tmp_path / preference_set.DEFAULT_PREFERENCES)
    with caplog.at_level("WARNING"):
        preference_set.warn_if_stale(preference_set.DEFAULT_PREFERENCES, model)  # no record: the user's set
        (folder / preference_set.SOURCE).write_text(json.dumps(preference_set.model_stamp(model)))
        preference_set.warn_if_stale(preference_set.DEFAULT_PREFERENCES, model)
        assert caplog.text == ""
        (model / "model.safetensors").write_bytes(b"retrained weights")
        preference_set.warn_if_stale(preference_set.DEFAULT_PREFERENCES, model)
    assert (f"outputs/preferences was sampled from {model} as its weights were then, and they have changed since"
            in caplog.text and "Delete outputs/preferences to sample it again" in caplog.text)
    assert [path.name for path in sorted(folder.iterdir())] == [".sampled_from.json", "test.jsonl", "train.jsonl"]
    caplog.clear()
    other = tmp_path / "mine"  # `trainer.rm --model.path=mine` on the embedded set: another model, not changed weights
    other.mkdir()
    with caplog.at_level("WARNING"):
        preference_set.warn_if_stale(preference_set.DEFAULT_PREFERENCES, other)
        assert f"this run trains from another model, {other}" in caplog.text and "changed since" not in caplog.text
        caplog.clear()
        (folder / preference_set.SOURCE).write_text("[]")  # a record not written by the set's sampling: not judged
        preference_set.warn_if_stale(preference_set.DEFAULT_PREFERENCES, model)
    assert caplog.text == ""


def test_an_embedded_set_sampled_at_other_settings_is_said(tmp_path, monkeypatch, caplog):
    """The set's sampling reads `train.seed` (each chunk's seed), `data.max_seq_len` and `model.dtype`: a run at
    other settings, from the same model, reused the set sampled at the earlier run's without a word (a fresh set at
    seed 7 is other pairs than the kept one of 1234). It is now warned, naming each setting; a set reused at the same
    settings is said once as reused."""
    from trainer import preference_set

    monkeypatch.chdir(tmp_path)
    model = tmp_path / "outputs" / "sft" / "hf"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights")
    folder = write_pairs(tmp_path / preference_set.DEFAULT_PREFERENCES)
    built, _ = parse_args(RMConfig, [], "trainer.rm")
    (folder / preference_set.SOURCE).write_text(json.dumps({**preference_set.model_stamp(model),
                                                            "sampling": preference_set.sampling_stamp(built)}))
    with caplog.at_level("INFO"):
        preference_set.warn_if_stale(preference_set.DEFAULT_PREFERENCES, model, built)
    assert [record.levelname for record in caplog.records] == ["INFO"]
    assert f"outputs/preferences: the set sampled earlier from {model} (train.seed=1234, " in caplog.text
    caplog.clear()
    other, _ = parse_args(RMConfig, ["--train.seed=7"], "trainer.rm")
    with caplog.at_level("WARNING"):
        preference_set.warn_if_stale(preference_set.DEFAULT_PREFERENCES, model, other)
    assert (f"outputs/preferences was sampled from {model} at other settings than this run's: train.seed=1234 (this "
            "run: 7); the reward model trains on the pairs those settings sampled" in caplog.text), caplog.text
    assert "data.max_seq_len" not in caplog.text


@pytest.mark.distributed
def test_the_embedded_reward_model_ranks_held_out_pairs_and_grpo_scores_with_it(runs):
    """`torchrun -m trainer.rm` with no arguments, where the default SFT's output is: the preference set is sampled
    from it first (1,024 prompts), and after its 50 steps the reward model ranks at least 0.93 of the held-out pairs
    (0.951-0.954 over three seeds; 0.940-0.959 after 100 steps on 2,048 prompts' set, 0.941-0.959 on 4,096's; from
    0.25-0.92 with the untrained head); GRPO then runs scored by that export alone."""
    home = runs["home"]
    assert "does not exist yet: sampling it from outputs/sft/hf" in runs["default_log"]
    pairs = [len((home / "outputs" / "preferences" / f"{split}.jsonl").read_text().splitlines()) for split in ("train", "test")]
    assert pairs[0] > 1200 and pairs[1] > 600, pairs  # 1,687 and 802 measured (the samples differ between CPUs)
    sampled_from = json.loads((home / "outputs" / "preferences" / ".sampled_from.json").read_text())
    assert sampled_from["model"] == str((home / "outputs" / "sft" / "hf").resolve()) and sampled_from["weights"]
    rows = metrics_rows(home / "outputs" / "rm")
    evaluated = [row for row in rows if "eval_accuracy" in row]
    print("embedded reward model:", evaluated)
    assert [row["step"] for row in evaluated] == [0, 25, 50]
    # The untrained head's accuracy spreads widely (0.25-0.92; 0.89 on 2026-12-07, after the default SFT's loss
    # gradients became exact fp32): its loss, about ln 2, is what shows the learning (0.657 -> 0.051 that day).
    assert evaluated[-1]["eval_accuracy"] >= 0.93 and evaluated[-1]["eval_accuracy"] > evaluated[0]["eval_accuracy"]
    assert evaluated[-1]["eval_loss"] < 0.5 * evaluated[0]["eval_loss"]
    grpo = metrics_rows(home / "outputs" / "grpo-rm")
    assert [row["step"] for row in grpo] == [1, 2] and all(row["reward_model_score"] != 0 for row in grpo)


def test_columns_that_cannot_be_the_pairs_are_refused_at_start_up(tmp_path, monkeypatch):
    """The same column for both sides (every pair dropped as alike, after tokenizing), and another column name with
    the embedded set not built yet (said only after the default SFT and the set's sampling)."""
    from config.cli import parse_args
    from config.errors import UserError
    from config.loops import RMConfig

    monkeypatch.chdir(tmp_path)
    config, _ = parse_args(RMConfig, ["--data.path=pairs.jsonl", "--data.chosen_field=text", "--data.rejected_field=text"],
                           "trainer.rm")
    with pytest.raises(UserError, match="`data.chosen_field` and `data.rejected_field` are both `text`"):
        config.validate(world_size=1)
    config, _ = parse_args(RMConfig, ["--data.chosen_field=better"], "trainer.rm")
    with pytest.raises(UserError, match="`data.chosen_field=better` names no column of it"):
        config.validate(world_size=1)
    (tmp_path / "outputs" / "preferences").mkdir(parents=True)  # a set there, whoever wrote it: its columns are read
    config.validate(world_size=1)


def test_a_reward_model_or_teacher_of_a_family_refused_is_named_by_its_key(tmp_path):
    """A Gemma 2 reward model (a family built from Bridge's own layer spec, which this trainer refuses) is refused naming
    `grpo.reward_model` and its directory, a Gemma 2 teacher naming `grpo.teacher`: the refusal named `model.path` and
    the reward model's temporary causal view (`/tmp/causal-view-...`), which the user never set."""
    import transformers

    from model import build

    tokenizer = transformers.AutoTokenizer.from_pretrained(ensure_tiny_checkpoint())
    shape = dict(vocab_size=448, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, pad_token_id=0)
    transformers.Gemma2ForSequenceClassification(transformers.Gemma2Config(num_labels=1, **shape)).save_pretrained(
        tmp_path / "rm")
    transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**shape)).save_pretrained(tmp_path / "teacher")
    for key in ("reward_model", "teacher"):
        path = tmp_path / ("rm" if key == "reward_model" else key)
        tokenizer.save_pretrained(path)
        config, _ = parse_args(GRPOConfig, [f"--grpo.{key}={path}", "--grpo.reward_weight=0"], "trainer.grpo")
        config.validate(world_size=1)  # the family is known once Bridge's provider is made
        view, weight = score_head.causal_view(path, f"grpo.{key}")
        with pytest.raises(UserError) as refused:
            build.build_frozen_dense(config, view, tokenizer, f"grpo.{key}",
                                     score_head=None if weight is None else (0, weight))
        assert str(refused.value).startswith(f"`grpo.{key}={path}` is a Gemma2ForCausalLM checkpoint"), refused.value
        assert f"Point `--grpo.{key}` at a Llama" in str(refused.value)
