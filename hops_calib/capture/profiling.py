"""Capture room: the PyTorch profiler (Kineto) trace of a capture, recorded as Megatron-LM records it.

Megatron-LM's `train()` with `--profile --use-pytorch-profiler` builds
`torch.profiler.profile(schedule=schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0,
active=end - start, repeat=1), on_trace_ready=trace_handler, record_shapes=..., with_stack=...)`, calls
`prof.start()` before the training loop and `prof.step()` at the top of every loop pass, and its handler
writes `<tensorboard_dir>/../torch_profile/rank-<global rank>.json.gz`
(megatron/training/training.py, NVIDIA/Megatron-LM @d98e8a6, lines 4478-4508 and 4560-4567, as
../shared/docs/profiler-traces.md §1.9 reads them). `ProfilerStep#k` then spans loop pass k, which trains
iteration k (1-based, no checkpoint resume).

Here `start` is the first traced iteration and `end` one past the last, so the profiled passes are exactly the
iterations the event log records, on the CPU activity only (no CUDA on a CPU capture), with shapes and the
Python call stack (`--pytorch-profiler-collect-shapes --pytorch-profiler-collect-callstack`): the stack's
`schedules.py(N): forward_step` / `backward_step` spans are what tells microbatches apart in the trace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PROFILE_DIR = "torch_profile"


def trace_name(rank: int) -> str:
    """The file Megatron's trace handler writes for a global rank."""
    return f"rank-{rank}.json.gz"


class RankProfiler:
    """One rank's profiler over the loop: `start()` before the first pass, `step()` at the top of each pass,
    `stop()` after the last (which writes the trace when the last pass was profiled)."""

    def __init__(self, path: Path, first_iteration: int, last_iteration: int) -> None:
        import torch.profiler as tp

        self.path = path
        start, end = first_iteration, last_iteration + 1
        self._profiler = tp.profile(
            activities=[tp.ProfilerActivity.CPU],
            schedule=tp.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0, active=end - start, repeat=1),
            on_trace_ready=self._write,
            record_shapes=True,
            with_stack=True,
        )
        self.written = False

    def _write(self, profiler: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f".{self.path.name}.partial.json.gz")  # (export gzips on the .gz suffix)
        profiler.export_chrome_trace(str(partial))
        partial.replace(self.path)
        self.written = True

    def start(self) -> None:
        self._profiler.start()

    def step(self) -> None:
        self._profiler.step()

    def stop(self) -> None:
        self._profiler.stop()
