"""Capture room: runs Megatron-core's CUDA-assuming code paths on the CPU, from outside, without editing Megatron.

Megatron-core's pipeline path assumes CUDA only shallowly: tensors created with
`device="cuda"` or `device=torch.cuda.current_device()`, `.cuda()` on tensors and
modules, `torch.cuda.synchronize()` after p2p calls, the MoE token dispatcher's side stream for
host copies (`torch.cuda.Stream`, `current_stream`, `stream`), and the CUDA RNG tracker's
`fork()` around attention dropout. `install()` bridges each one in this process
(a worker process of the capture; never the caller's): a torch function mode
sends device placements to the CPU, each `torch.cuda` function is replaced by its
own small function (one shared function object would confuse torch's compiler
registry, which keys on the function), and the RNG tracker forks into a no-op
(seeding is done with `torch.manual_seed`; dropout is 0 in every capture anyway). One more is not CUDA's but
Transformer Engine's: the MoE router's gating GEMM reads a name bound only when Transformer Engine imports.
"""

from __future__ import annotations

import contextlib
from typing import Any


def install() -> contextlib.AbstractContextManager[Any]:
    """Bridge CUDA calls to the CPU in this process; returns the active device mode (already entered)."""
    import torch
    from torch.overrides import TorchFunctionMode

    def is_cuda_device(device: object) -> bool:
        if isinstance(device, bool):
            return False
        if isinstance(device, int):  # torch.cuda.current_device() style ordinal
            return True
        if isinstance(device, str):
            return device.startswith("cuda")
        return isinstance(device, torch.device) and device.type == "cuda"

    class CudaToCpu(TorchFunctionMode):
        """Rewrites CUDA placements of torch calls to the CPU."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.to and len(args) > 1 and is_cuda_device(args[1]):
                args = (args[0], "cpu", *args[2:])
            return func(*args, **kwargs)

    def current_device() -> int:
        return 0

    def device_count() -> int:
        return 1

    def synchronize(device: object = None) -> None:
        return None

    def set_device(device: object) -> None:
        return None

    class HostStream:
        """The CPU's one stream: work runs in program order, so waiting on it or on its events returns at once.
        Megatron's MoEAlltoAllTokenDispatcher copies its split sizes to the host on a side stream
        (`cuda_dtoh_stream`, `_maybe_dtoh_and_synchronize`); on the CPU that stream is the current one, so the
        dispatcher sees no side stream and records none on its tensors."""

        def wait_stream(self, stream: object) -> None:
            return None

        def record_event(self, event: object = None) -> HostStream:
            return self

        def synchronize(self) -> None:
            return None

        def query(self) -> bool:
            return True

    host_stream = HostStream()

    def stream_factory(*args: object, **kwargs: object) -> HostStream:
        return host_stream

    def current_stream(device: object = None) -> HostStream:
        return host_stream

    def use_stream(stream: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    torch.cuda.Stream = stream_factory  # type: ignore[misc,assignment]
    torch.cuda.current_stream = current_stream  # type: ignore[assignment]
    torch.cuda.stream = use_stream  # type: ignore[assignment]
    torch.cuda.current_device = current_device
    torch.cuda.device_count = device_count
    torch.cuda.synchronize = synchronize
    torch.cuda.set_device = set_device

    def module_cuda(self: torch.nn.Module, device: object = None) -> torch.nn.Module:
        return self

    # A method replaced on the class for every module (setattr: mypy refuses assigning to a method).
    setattr(torch.nn.Module, "cuda", module_cuda)  # noqa: B010

    from megatron.core.tensor_parallel import random as megatron_random

    def fork(self: object, name: str = "") -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    megatron_random.CudaRNGStatesTracker.fork = fork

    from megatron.core.transformer.moe import moe_utils

    # moe_utils.RouterGatingLinearFunction tests `te_general_gemm is not None` to pick Transformer Engine's GEMM
    # over torch.mm, but the name is bound only when Transformer Engine imports: without it the router's first
    # forward raises NameError. None is the value the test expects for "not installed".
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    from megatron.core.transformer.moe import token_dispatcher

    def host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        """moe_utils.maybe_move_tensor_to_cpu on a host that holds every tensor already: what its copy of a device
        tensor returns, the NumPy array where asked (the all-to-all's split sizes, which torch.distributed takes
        as a sequence of ints and refuses as a tensor), without the copy."""
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = host_copy  # the dispatcher's own binding of the name

    from megatron.core.tensor_parallel import mappings

    # The autograd engine runs a backward with an empty torch-function-mode stack, so the device mode above does
    # not reach it; mappings._AllToAll.backward re-applies _AllToAll, whose forward allocates the all-to-all-v
    # output on torch.cuda.current_device(). Only that backward is bridged (the dense layers' backwards allocate
    # nothing on a named device, and their timing stays as the shipped captures measured it).
    all_to_all_backward = mappings._AllToAll.backward

    def bridged_backward(ctx: Any, *grad_output: Any) -> Any:
        with CudaToCpu():
            return all_to_all_backward(ctx, *grad_output)

    mappings._AllToAll.backward = staticmethod(bridged_backward)

    mode = CudaToCpu()
    mode.__enter__()
    return mode
