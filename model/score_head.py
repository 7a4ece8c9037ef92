"""A scalar head on megatron-core's GPT model: the reward model `trainer.rm` trains and `grpo.reward_model` scores with.

It is Hugging Face's `...ForSequenceClassification` with `num_labels=1`, the form reward models are shared in: the
decoder's last hidden state (after the final norm) at each row's last token that is not padding, times
`score.weight` [1, hidden], no bias. Here the head is a `torch.nn.Linear(hidden, 1, bias=False)` child `score` of the
last pipeline stage's GPTModel, so DDP, the optimizer and the distributed checkpoint hold it as any other replicated
weight; megatron-core's `output_processor` hook hands it the hidden states in place of the vocabulary's projection
(`scores_at`). Megatron-Bridge converts causal LMs only: a classification checkpoint is read through a view of it
as one (`causal_view`: the same files, the architecture renamed, the embeddings tied so no `lm_head` is looked for)
and written as Bridge's causal export with `lm_head` replaced by `score` (`Classifier.export`).
"""

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from config import outputs
from config.errors import UserError
from config.hf import CAUSAL, CLASSIFIER, architecture as hf_architecture, causal_architecture, is_classifier as hf_is_classifier, read_hf_config
from model.policy import Policy
from model.providers import declare_saved_dtype, export_hf, keep_source_tokenizer_settings

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"


def gpt_model(chunk):
    """The GPTModel inside a chunk's wrappers (DDP or Megatron-FSDP, Float16Module)."""
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def head_of(chunk) -> torch.nn.Linear | None:
    """The chunk's score head (on the last pipeline stage's last chunk; None elsewhere)."""
    return getattr(gpt_model(chunk), "score", None)


# ---------------------------------------------------------------- the head and its forward


def attach_head(chunks: list, provider, seed: int, weight: torch.Tensor | None = None) -> None:
    """Give the chunk that holds the output layer a score head: `weight` [1, hidden] (a classification checkpoint's
    `score.weight`), else drawn as transformers initialises one (normal, std `initializer_range`) from `seed`, the same
    on every rank. A separate output layer (untied embeddings) is frozen: the head replaces it, so it has no gradient."""
    for chunk in chunks:
        model = gpt_model(chunk)
        if not model.post_process:
            continue
        hidden = provider.hidden_size
        if weight is None:
            generator = torch.Generator().manual_seed(seed)
            weight = torch.randn(1, hidden, generator=generator) * provider.init_method_std
        head = torch.nn.Linear(hidden, 1, bias=False)
        device = next(model.parameters()).device
        with torch.no_grad():
            head.weight.copy_(weight.reshape(1, hidden))
        model.score = head.to(device=device, dtype=provider.params_dtype)
        if not model.share_embeddings_and_output_weights and model.output_layer.weight is not None:
            model.output_layer.weight.requires_grad_(False)


@dataclasses.dataclass
class LastTokens:
    """Each row's scored position: its last token that is not padding (as transformers pools), and the head."""

    rows: torch.Tensor  # [batch]
    columns: torch.Tensor  # [batch]
    head: torch.nn.Linear | None = None

    @classmethod
    def of(cls, tokens: torch.Tensor, pad_id: int) -> "LastTokens":
        """tokens [batch, seq]: the rightmost position of each row whose token is not `pad_id`."""
        positions = torch.arange(tokens.size(1), device=tokens.device)
        columns = (positions * (tokens != pad_id)).argmax(-1)
        return cls(torch.arange(tokens.size(0), device=tokens.device), columns)


def scores_at(*, hidden_states, context: LastTokens, config, **_) -> torch.Tensor:
    """megatron-core's `output_processor`: the head at each row's last token, scores [batch] in fp32."""
    from megatron.core import parallel_state, tensor_parallel

    # hidden_states: [sequence (/ tp under sequence parallelism), batch, hidden]
    if config.sequence_parallel:
        # Every tensor-parallel rank then runs the head on the whole rows, so the head's gradient is the same on each;
        # the gather's backward takes this rank's part of the sequence.
        hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=False, group=parallel_state.get_tensor_model_parallel_group())
    picked = hidden_states[context.columns, context.rows]  # [batch, hidden]
    return context.head(picked).squeeze(-1).float()  # [batch]


def forward_scores(model, batch: dict, pad_id: int) -> torch.Tensor:
    """A chunk's forward of a collated batch: scores [batch] on the last stage, hidden states elsewhere."""
    read = LastTokens.of(batch["tokens"], pad_id)
    read.head = head_of(model)
    return model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"],
                 output_processor=scores_at, output_processor_context=read)


def head_weight(chunks: list) -> torch.Tensor:
    """The score head's weight [1, hidden] in fp32 on every rank (it lives on the last pipeline stage). Collective."""
    from megatron.core import parallel_state

    from model import collectives

    from torch.distributed.tensor import DTensor

    heads = [head for head in map(head_of, chunks) if head is not None]
    weight = torch.zeros(1, gpt_model(chunks[0]).config.hidden_size)
    if heads:
        weight = heads[0].weight.detach()
        if isinstance(weight, DTensor):  # Megatron-FSDP's shards: gathered over the data-parallel ranks (collective)
            from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor

            weight = uneven_dtensor_to_full_tensor(weight)
        weight = weight.float().cpu().reshape(1, -1)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        weight = collectives.all_reduce(weight, parallel_state.get_pipeline_model_parallel_group())
    return weight


@contextlib.contextmanager
def heads_detached(chunks: list):
    """The chunks without their score heads inside the block (for Megatron-Bridge's causal conversion)."""
    models = [model for model in map(gpt_model, chunks) if getattr(model, "score", None) is not None]
    heads = [model.score for model in models]
    for model in models:
        del model.score
    try:
        yield
    finally:
        for model, head in zip(models, heads):
            model.score = head


# ---------------------------------------------------------------- checkpoints


def is_classifier(path: Path) -> bool:
    """Whether an HF checkpoint directory is a sequence classifier (a reward model)."""
    return hf_is_classifier(read_hf_config(path, "model.path"))


def causal_view(path: Path, key: str) -> tuple[Path, torch.Tensor | None]:
    """A sequence-classification checkpoint as Megatron-Bridge reads one: a directory of links to its files whose
    config names the causal architecture with tied embeddings (so no `lm_head` is looked for), and its
    `score.weight` [1, hidden]. A causal LM is returned as it is, with no head. `key` names the setting in errors."""
    config = read_hf_config(path, key)
    architecture = hf_architecture(config)
    if not architecture.endswith(CLASSIFIER):
        return path, None
    # The head's rows are the labels: transformers writes no id2label for its default of two.
    weight = _read_tensor(path, "score.weight", key)
    labels = weight.shape[0] if weight.dim() == 2 else 0
    if labels != 1:
        raise UserError(f"`{key}={path}` is a {architecture} with {labels} labels; a reward model has one "
                        "(`num_labels=1`, a scalar score). Point `--{key}` at a reward model.")
    view = Path(tempfile.mkdtemp(prefix="causal-view-"))
    atexit.register(shutil.rmtree, view, ignore_errors=True)
    for item in path.iterdir():
        if item.name not in ("config.json", INDEX):
            os.symlink(item.resolve(), view / item.name)
    causal = dict(config, architectures=[causal_architecture(config)], tie_word_embeddings=True)
    (view / "config.json").write_text(json.dumps(causal, indent=2))
    # An index of the backbone's tensors alone: Bridge then neither reads the head nor, exporting, waits for it.
    (view / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {
        name: file for name, file in _tensor_files(path).items() if name not in ("score.weight", "lm_head.weight")}}))
    return view, weight


def _tensor_files(path: Path) -> dict[str, str]:
    """Each tensor of an HF checkpoint -> the safetensors file holding it (read from the files' headers)."""
    from safetensors import safe_open

    names = {}
    for weights in sorted(path.glob("*.safetensors")):
        with safe_open(weights, "pt") as handle:
            names.update(dict.fromkeys(handle.keys(), weights.name))
    return names


def _read_tensor(path: Path, name: str, key: str) -> torch.Tensor:
    """One tensor of an HF checkpoint's safetensors files."""
    from safetensors import safe_open

    if (file := _tensor_files(path).get(name)) is not None:
        with safe_open(path / file, "pt") as handle:
            return handle.get_tensor(name).float()
    raise UserError(f"`{key}={path}` is a sequence classifier without a `{name}` tensor in its safetensors files. "
                    f"Point `--{key}` at a complete reward-model checkpoint.")


def write_classifier(directory: Path, weight: torch.Tensor, pad_id: int) -> None:
    """Turn Bridge's causal export in `directory` into a `...ForSequenceClassification` with one label: `lm_head`
    dropped, `score.weight` added, the config's architecture, labels and padding id set."""
    from safetensors.torch import load_file, save_file

    files = sorted(directory.glob("*.safetensors"))
    index_path = directory / INDEX
    for weights in files:
        tensors = load_file(weights)
        if "lm_head.weight" in tensors:
            del tensors["lm_head.weight"]
            save_file(tensors, weights, metadata={"format": "pt"})
    if len(files) == 1:  # one file, no index (transformers reads `model.safetensors` before any index)
        save_file({**load_file(files[0]), "score.weight": weight.contiguous()}, files[0], metadata={"format": "pt"})
        index_path.unlink(missing_ok=True)
    else:
        save_file({"score.weight": weight.contiguous()}, directory / "score.safetensors", metadata={"format": "pt"})
        index = json.loads(index_path.read_text())
        index["weight_map"].pop("lm_head.weight", None)
        index["weight_map"]["score.weight"] = "score.safetensors"
        index_path.write_text(json.dumps(index, indent=2))
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    architecture = config["architectures"][0]
    config.update(architectures=[architecture.removesuffix(CAUSAL) + CLASSIFIER], id2label={"0": "LABEL_0"},
                  label2id={"LABEL_0": 0}, pad_token_id=pad_id)
    config_path.write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").unlink(missing_ok=True)


@dataclasses.dataclass
class Classifier(Policy):
    """A policy with a score head in place of its output layer: a reward model. Its export is a Hugging Face
    `...ForSequenceClassification` with one label."""

    def export(self, directories: dict, is_main: bool) -> None:
        """Bridge's causal export, rewritten as a sequence classifier on the main rank. Collective."""
        self.sync_parameters()
        weight = head_weight(self.chunks)
        with heads_detached(self.chunks):  # Bridge converts every parameter it finds, and knows no `score`
            export_hf(self.bridge, self.chunks, directories[outputs.HF])
        if is_main:
            self.tokenizer.save_pretrained(directories[outputs.HF])
            write_classifier(Path(directories[outputs.HF]), weight, self.tokenizer.pad_token_id)
            declare_saved_dtype(directories[outputs.HF])
            keep_source_tokenizer_settings(directories[outputs.HF], self.bridge.hf_pretrained.model_name_or_path,
                                           padding=False)

    def exports(self) -> tuple[str, ...]:
        return (outputs.HF,)
