"""Lets megatron-core 0.19.2, Megatron-Bridge 0.6.2 and Megatron-FSDP run on a machine without a GPU.

These packages assume CUDA in a handful of ways (see ../shared/notes/megatron-on-cpu.md). Each
patch below answers one of them, maps the CUDA notion to its CPU counterpart, and is documented
with the assumption it answers. `activate()` is called from exactly one place
(`model.parallel.init_distributed`) and refuses to run when CUDA is present, so none of this is
ever active on a GPU. The versions it was written against are checked and a mismatch is logged.
"""

import contextlib
import functools
import logging
from importlib.metadata import version

import torch
import torch.distributed

log = logging.getLogger(__name__)

PINNED_VERSIONS = {"megatron-core": "0.19.2", "megatron-bridge": "0.6.2", "megatron-fsdp": "0.6.1"}

# Megatron-FSDP divides gradients inside a fused reduce-scatter (ReduceOp.PREMUL_SUM) that gloo
# lacks; the plain division path is numerically the same. Applied by the DDP config rules.
DDP_CONFIG_OVERRIDES = {"gradient_reduce_div_fusion": False}

_active = False


def _is_cuda_device(device) -> bool:
    """True for every spelling megatron uses for a CUDA device: 'cuda', 'cuda:N', an int, a torch.device."""
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _on_cpu(function, device_position=None):
    """Wrap `function` so a CUDA `device` argument (keyword, or positional at `device_position`) becomes CPU."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if device_position is not None and len(args) > device_position and _is_cuda_device(args[device_position]):
            args = (*args[:device_position], "cpu", *args[device_position + 1 :])
        return function(*args, **kwargs)

    return wrapper


class _Stream:
    """Stands in for torch.cuda.Stream: CPU work is already ordered, so every wait is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self):
        pass

    def query(self):
        return True


class _Event:
    """Stands in for torch.cuda.Event (recorded work on CPU is complete when the call returns)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _tensor_type(original):
    """Report CPU float tensors under their CUDA type names.

    The optimizer and gradient clipping check `param.type() == 'torch.cuda.FloatTensor'` (and the
    half/bf16 names) to sort parameters; on CPU the names lack '.cuda', so those checks reject
    every parameter.
    """

    @functools.wraps(original)
    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or self.is_cuda or name.startswith("torch.cuda."):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    return type_


def _uneven_all_gather(original):
    """Let a synchronous all_gather take tensors of different sizes per rank, as NCCL's does and gloo's does not.

    Megatron-FSDP shards parameters unevenly over data-parallel ranks, and its
    `uneven_dtensor_to_full_tensor` (used by Megatron-Bridge's HF export when the parameters are
    sharded DTensors, e.g. right after a checkpoint save) gathers the shards with one all_gather whose
    output tensors have each rank's own size. Pad every shard to the largest, gather, and trim.
    """

    @functools.wraps(original)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        sizes = [output.numel() for output in tensor_list]
        if async_op or len(set(sizes)) <= 1:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(sizes)
        padded_local = torch.zeros(longest, dtype=tensor.dtype)
        padded_local[: tensor.numel()] = tensor.reshape(-1)
        padded = [torch.empty(longest, dtype=tensor.dtype) for _ in tensor_list]
        original(padded, padded_local, group=group)
        for output, gathered, size in zip(tensor_list, padded, sizes):
            output.copy_(gathered[:size].view(output.shape))
        return None

    return all_gather


def _synchronous_gathers(all_gather_params):
    """Megatron-FSDP's `AllGatherPipeline.all_gather_params` with `async_param_gather=False` always."""

    @functools.wraps(all_gather_params)
    def synchronous(self, *args, **kwargs):
        kwargs["async_param_gather"] = False
        return all_gather_params(self, *args, **kwargs)

    return synchronous


def _numpy_when_asked(move_to_cpu):
    """megatron-core's `maybe_move_tensor_to_cpu` that also turns a CPU tensor into NumPy when `as_numpy` asks.

    The alltoall MoE dispatcher computes its split sizes as device tensors and moves them to the host as NumPy arrays,
    the form `all_to_all_single` takes; the helper converts only tensors on CUDA, so on CPU the splits stayed torch
    tensors, which `all_to_all_single` rejects ("incompatible function arguments").
    """

    @functools.wraps(move_to_cpu)
    def move(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move_to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move


def activate() -> None:
    """Install every patch once; raises if CUDA is available (the layer must never run on a GPU)."""
    global _active
    if _active:
        return
    if torch.cuda.is_available():
        raise RuntimeError("model.cpu_compat.activate() called with CUDA available; it is for CPU-only machines.")

    # Literal device='cuda' / device=torch.cuda.current_device() in tensor factories, including
    # Megatron-FSDP's bucket allocation inside autograd hooks (so patch the functions themselves,
    # not a TorchFunctionMode, which those hooks do not see).
    for name in ("empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "rand", "randn",
                 "randint", "empty_strided", "empty_like", "zeros_like", "ones_like", "full_like", "eye"):
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    # The same on a tensor's own factories: megatron's expert-parallel all-to-all allocates its output with
    # `input.new_empty(..., device=torch.cuda.current_device())` (tensor_parallel.mappings._AllToAll).
    for name in ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor"):
        setattr(torch.Tensor, name, _on_cpu(getattr(torch.Tensor, name)))
    # `.to('cuda')`, `.to(device_index)`, `.cuda()` on tensors and modules.
    torch.Tensor.to = _on_cpu(torch.Tensor.to, device_position=1)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.to = _on_cpu(torch.nn.Module.to, device_position=1)
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.type = _tensor_type(torch.Tensor.type)

    cuda = torch.cuda
    # The "current CUDA device" is index 0; every factory/`.to` above maps it to the CPU.
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.device_count = lambda: 0
    # Streams and events order GPU kernels; CPU ops run in program order.
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda device=None: _Stream()
    cuda.default_stream = lambda device=None: _Stream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    # Memory statistics are reported as zero rather than raising.
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_reserved = lambda device=None: 0
    # The CUDA RNG becomes the CPU RNG: megatron's model-parallel RNG tracker forks "the CUDA
    # generator" for dropout in tensor-parallel regions, which on CPU is the default generator.
    # (torch.manual_seed itself calls cuda.manual_seed_all, so that one must not recurse into it.)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)

    torch.distributed.all_gather = _uneven_all_gather(torch.distributed.all_gather)

    # Megatron-FSDP all-gathers parameters asynchronously (the next layers are prefetched during a forward and a
    # backward) and orders what reads and frees those buckets by CUDA streams and events, which order nothing here:
    # gloo's worker threads would write into parameter storage while the model runs. Its gathers are made
    # synchronous instead (the same collectives, each finished when issued).
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import AllGatherPipeline

    AllGatherPipeline.all_gather_params = _synchronous_gathers(AllGatherPipeline.all_gather_params)

    # Expert parallelism's alltoall dispatcher: its split sizes reach gloo's all_to_all_single as NumPy, as on CUDA.
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _numpy_when_asked(token_dispatcher.maybe_move_tensor_to_cpu)

    for package, pinned in PINNED_VERSIONS.items():
        if version(package) != pinned:
            log.warning("CPU layer written for %s %s, found %s: untested combination", package, pinned, version(package))
    _active = True
