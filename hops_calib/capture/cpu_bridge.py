"""Capture room: runs Megatron-core's CUDA-assuming code paths on the CPU, from outside, without editing Megatron.

Megatron-core's pipeline path assumes CUDA only shallowly: tensors created with
`device="cuda"` or `device=torch.cuda.current_device()`, `.cuda()` on tensors and
modules, `torch.cuda.synchronize()` after p2p calls, and the CUDA RNG tracker's
`fork()` around attention dropout. `install()` bridges each one in this process
(a worker process of the capture; never the caller's): a torch function mode
sends device placements to the CPU, each `torch.cuda` function is replaced by its
own small function (one shared function object would confuse torch's compiler
registry, which keys on the function), and the RNG tracker forks into a no-op
(seeding is done with `torch.manual_seed`; dropout is 0 in every capture anyway).
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

    mode = CudaToCpu()
    mode.__enter__()
    return mode
