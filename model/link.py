"""The link between trainers and rollout processes (asynchronous GRPO, `grpo.rollout_processes`): two gloo process
groups over the torchrun world, beside each side's own default group (`model.parallel.init_distributed` makes all
three). `pairs` joins every process, for a rollout process's batches to the trainers it samples for (picklable
objects, point to point); `weights` joins trainer rank 0 and every rollout process, for the policy's weights after
each update (`push_weights` / `receive_weights`).

The weights travel in Hugging Face names: Megatron-Bridge's export gathers them from the trainers' layout (TP, PP,
EP, Megatron-FSDP) on every trainer, rank 0 broadcasts them in buckets of at most `BUCKET_BYTES`, and each rollout
process loads them into its replica (tensor-, pipeline- and expert-parallel size 1) with Bridge's import. Both
conversions copy values, so the replica holds the trainers' weights bit for bit. megatron-core's
`resharding.refit` moves weights between two layouts of one process group's model; the two sides here are separate
worlds (each its own megatron-core parallel state), which it does not cover."""

import contextlib
import datetime
import io
import itertools
import pickle
from types import SimpleNamespace

import torch
import torch.distributed as dist

from config.errors import UserError

BUCKET_BYTES = 256 * 2**20  # a bucket's payload; one broadcast each
# How long one side waits for the other on the link. Each waits through work of the other's that has no bound of its
# own, so not `parallel.timeout_minutes`: a rollout process through the trainers' evaluation, checkpoint saves and final
# export (a blocking send until they take its batch), the trainers through a rollout process's sampling of a step. A
# process that exits ends the run at once all the same: gloo sees its socket close, and torchrun stops the rest.
WAIT = datetime.timedelta(hours=24)


# Each run in a process (tests run several in one launch) keys its groups apart in the launch's store.
_RUNS = itertools.count()


def store_prefix() -> str:
    """This run's prefix in the launch's key-value store (the same on every process: runs happen in the same order)."""
    return f"async-grpo-{next(_RUNS)}/"


class Link:
    """The two process groups joining trainers (global ranks 0..trainers-1) and rollout processes (the rest)."""

    def __init__(self, store, rank: int, world_size: int, trainers: int, timeout: datetime.timedelta = WAIT):
        self.rank, self.trainers, self.rollouts, self.timeout = rank, trainers, world_size - trainers, timeout
        self.pairs = dist.ProcessGroupGloo(dist.PrefixStore("pairs/", store), rank, world_size, timeout)
        members = [0, *range(trainers, world_size)]
        self.weights = (dist.ProcessGroupGloo(dist.PrefixStore("weights/", store), members.index(rank),
                                              len(members), timeout) if rank in members else None)

    @property
    def is_rollout(self) -> bool:
        return self.rank >= self.trainers

    def send(self, value, destination: int) -> None:
        """A picklable value to global rank `destination` (which calls `receive` with this rank)."""
        data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
        with self._peer(destination):
            self.pairs.send([torch.tensor([data.numel()], dtype=torch.long)], destination, 0).wait()
            self.pairs.send([data], destination, 0).wait()

    def receive(self, source: int):
        """The value global rank `source` sends next."""
        size = torch.zeros(1, dtype=torch.long)
        with self._peer(source):
            self.pairs.recv([size], source, 0).wait()
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            self.pairs.recv([data], source, 0).wait()
        return pickle.loads(data.numpy().tobytes())

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` from trainer rank 0 to every rollout process, in place (CPU)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        with self._peer(0 if self.is_rollout else self.trainers):
            self.weights.broadcast([tensor], options).wait()
        return tensor

    @contextlib.contextmanager
    def _peer(self, rank: int):
        """A peer that exited (it failed, or was killed), or one that did not answer within the link's wait, ends this
        process with a paragraph, not gloo's traceback."""
        try:
            yield
        except RuntimeError as error:
            side = "rollout process" if rank >= self.trainers else "trainer"
            text = " ".join(str(error).split())
            if "timed out" in text.lower():
                seconds = self.timeout.total_seconds()
                waited = f"{seconds / 3600:g} hours" if seconds >= 3600 else f"{seconds:g} s"
                raise UserError(f"Asynchronous GRPO's {side} (global rank {rank}) did not answer within {waited} "
                                f"({text}): it is alive but stuck. Its log, and a stack dump of it (py-spy dump --pid), "
                                "say where.") from None
            raise UserError(f"Asynchronous GRPO lost its {side} (global rank {rank}): {text}. "
                            "That process ended first; its log, and torchrun's summary of failed ranks, say why.") from None

    def broadcast_object(self, value=None):
        """A picklable value from trainer rank 0 to every rollout process."""
        data = pickle.dumps(value) if not self.is_rollout else b""
        size = self.broadcast(torch.tensor([len(data)], dtype=torch.long))
        buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if not self.is_rollout
                  else torch.empty(int(size.item()), dtype=torch.uint8))
        return pickle.loads(self.broadcast(buffer).numpy().tobytes())


def push_weights(policy, link: Link, header: dict) -> None:
    """Every trainer: the policy's weights, gathered into Hugging Face tensors by Megatron-Bridge (collective over the
    trainers); rank 0 broadcasts `header`, then bucket after bucket, to the rollout processes (`receive_weights`).

    The export reads the parameters outside a forward, so the last optimizer step's parameter gathers are finished
    first (`Policy.sync_parameters`): with `overlap_param_gather` (on GPUs the default at more than one data-parallel
    rank) the distributed optimizer leaves the shards other ranks updated ungathered until the next forward, and the
    rollout processes would sample with a mix of updated and previous weights."""
    policy.sync_parameters()
    sender = link.weights is not None
    if sender:
        link.broadcast_object(header)
    bucket, size = [], 0
    for name, tensor in policy.bridge.export_hf_weights(policy.chunks, cpu=sender, show_progress=False):
        if not sender:
            continue
        bucket.append((name, tensor.contiguous()))
        size += tensor.numel() * tensor.element_size()
        if size >= BUCKET_BYTES:
            _send_bucket(link, bucket)
            bucket, size = [], 0
    if sender:
        _send_bucket(link, bucket)
        link.broadcast_object(None)  # the last bucket


def _send_bucket(link: Link, bucket: list) -> None:
    if not bucket:
        return
    link.broadcast_object([(name, tensor.shape, tensor.dtype) for name, tensor in bucket])
    link.broadcast(torch.cat([tensor.view(-1).view(torch.uint8) for _, tensor in bucket]))


def receive_header(link: Link) -> dict:
    """A rollout process: the next message from trainer rank 0 (a push's header, or the run's end)."""
    return link.broadcast_object()


def receive_weights(policy, link: Link) -> None:
    """A rollout process: the buckets `push_weights` sends after its header, loaded into the replica through
    Megatron-Bridge's import (the same conversion the start-up load does, from memory instead of safetensors)."""
    from megatron.bridge.models.hf_pretrained.state import StateDict

    weights = {}
    while (layout := link.broadcast_object()) is not None:
        total = sum(shape.numel() * torch.empty((), dtype=dtype).element_size() for _, shape, dtype in layout)
        data, offset = link.broadcast(torch.empty(total, dtype=torch.uint8)), 0
        for name, shape, dtype in layout:
            length = shape.numel() * torch.empty((), dtype=dtype).element_size()
            weights[name] = data[offset : offset + length].view(dtype).view(shape)
            offset += length
    pretrained = policy.bridge.hf_pretrained
    source = SimpleNamespace(state=StateDict(weights), config=pretrained.config,
                             model_name_or_path=pretrained.model_name_or_path)
    # Its progress bar would print on every push: the load is quiet (a failure still raises).
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        policy.bridge._model_bridge.load_weights_hf_to_megatron(source, policy.chunks)
