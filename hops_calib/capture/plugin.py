"""Capture room: a tracer for an unmodified Megatron-LM / Megatron-core run, writing the documented event logs.

No fork and no patch of Megatron's files: the tracer wraps, from outside and at run time, the functions of the
installed megatron-core that the schedules call through module attributes, as `capture`'s own tracer does
(megatron_engine.MegatronTracer):

- `megatron.core.pipeline_parallel.get_forward_backward_func` (and the schedules module's): the schedule it
  returns is wrapped, each training call (not `forward_only`, evaluation) is one iteration;
- `schedules.forward_step` / `backward_step`: FORWARD / BACKWARD per microbatch and model chunk;
- `p2p_communication._batched_p2p_ops` / `_p2p_ops`: a transfer per tensor sent (host dispatch time, as the
  cluster logs), labelled with the step that produced it;
- torch.distributed collectives on the tensor-parallel group inside a step (the `collective` lines);
- torch's global optimizer-step hooks (`torch.optim.optimizer.register_optimizer_step_pre_hook` / `_post_hook`):
  OPTIMIZER, from the first step of the iteration's optimizers to the end of the last (Megatron's optimizer wraps
  torch optimizers: FusedAdam, Adam; its own bookkeeping around them is outside).

Every stamp is the host's wall clock (`events.WallClock`, as `capture` stamps its CPU runs). On a GPU, where
kernels run asynchronously, a step's host span is then its launch time, not the device time the fork's CUDA events
measure: device timing (CUDA events resolved at the iteration's end) waits for a GPU to be built and verified on,
and until then a GPU run's compute is best read from a profiler trace (Kineto or Nsight, docs/traces.md).

Use it either way, without touching Megatron:

    # in your launch: torchrun ... -m hops_calib.capture.plugin --out JOB_DIR -- pretrain_gpt.py ARGS...
    # or in your own script, before training starts:
    from hops_calib.capture import plugin
    plugin.install("JOB_DIR")          # writes JOB_DIR/megatron_trace/rank<r>.jsonl when the process exits

Rank 0 also writes the job directory's `megatron_args.txt` (the script's command line) and
`hops_trace_map.json` (a device id per stage: host and local rank), unless they exist. The tracer's own cost is
timed (the time spent in its wrappers and hooks, per event) and written beside the log,
`megatron_trace/tracer.rank<r>.json`.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hops_calib.capture.events import EventLog, WallClock
from hops_calib.spec import TRACE_FIRST_ITERATION
from hops_calib.timeline import OPTIMIZER

TRACE_DIR = "megatron_trace"


class PluginTracer:
    """The state of the tracer in one rank's process (see the module docstring)."""

    def __init__(
        self, out: Path, *, trace_from: int = TRACE_FIRST_ITERATION, first_iteration: int | None = None
    ) -> None:
        import torch

        self.out = Path(out)
        self.trace_from = trace_from
        self.first_iteration = first_iteration
        self.wall = WallClock()
        self.cuda = bool(torch.cuda.is_available())  # (named in the device ids; the stamps are the host's)
        self.log: EventLog | None = None
        self.tracer: Any = None
        self.iteration = 0
        self.overhead_ns = 0  # time spent in the tracer's own code (wrappers, hooks, resolving)
        self.optimizer_span: list[Any] = []
        self._restore: list[tuple[Any, str, Any]] = []
        self._hooks: list[Any] = []
        self.written = False

    # -- installation -----------------------------------------------------------------------------------------
    def install(self) -> None:
        import torch.optim.optimizer as optim
        from megatron.core import pipeline_parallel
        from megatron.core.pipeline_parallel import schedules

        original = schedules.get_forward_backward_func

        def get_forward_backward_func(*args: Any, **kwargs: Any) -> Any:
            return self._wrap_schedule(original(*args, **kwargs))

        for owner in (schedules, pipeline_parallel):
            self._restore.append((owner, "get_forward_backward_func", owner.get_forward_backward_func))
            owner.get_forward_backward_func = get_forward_backward_func
        for module_name in ("megatron.training.training",):  # a name imported before install (Megatron-LM)
            module: Any = sys.modules.get(module_name)
            if module is not None and hasattr(module, "get_forward_backward_func"):
                self._restore.append((module, "get_forward_backward_func", module.get_forward_backward_func))
                module.get_forward_backward_func = get_forward_backward_func
        self._hooks.append(optim.register_optimizer_step_pre_hook(self._optimizer_pre))
        self._hooks.append(optim.register_optimizer_step_post_hook(self._optimizer_post))
        atexit.register(self.close)

    def uninstall(self) -> None:
        if self.tracer is not None:
            self.tracer.uninstall()
        while self._restore:
            owner, name, value = self._restore.pop()
            setattr(owner, name, value)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _start_log(self) -> None:
        """The rank's log and the step wrappers, once Megatron's parallel state exists (first schedule call)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        from hops_calib.capture.megatron_engine import MegatronTracer

        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        host = socket.gethostname()
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = f"{host}_{'gpu' if self.cuda else 'rank'}{local}"
        devices = [device] * world
        if world > 1:
            dist.all_gather_object(devices, device)
        stages = [0] * world
        if world > 1:
            dist.all_gather_object(stages, parallel_state.get_pipeline_model_parallel_rank())
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        stage_devices = tuple(devices[stages.index(s)] for s in range(pp))
        vp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
        several = world > pp
        self.log = EventLog(
            rank=rank,
            device_ids=tuple(devices),
            hostname=host,
            with_chunks=vp > 1,
            rank_stage=tuple(stages) if several else (),
            stage_devices=stage_devices if several else (),
        )
        if not several:  # rank r runs stage r: the device of a rank is its stage's
            self.log.device_ids = tuple(stage_devices)
        self.tracer = MegatronTracer(self.log, _TimedClock(self))
        self.tracer.install()
        if rank == 0:
            self._write_job_files(stage_devices)

    def _write_job_files(self, stage_devices: tuple[str, ...]) -> None:
        from hops_calib.files import atomic_write

        self.out.mkdir(parents=True, exist_ok=True)
        args = self.out / "megatron_args.txt"
        if not args.exists():
            atomic_write(args, " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) + "\n")
        stage_map = self.out / "hops_trace_map.json"
        if not stage_map.exists():
            atomic_write(stage_map, json.dumps({"stages": {str(s): d for s, d in enumerate(stage_devices)}}) + "\n")

    # -- iterations ------------------------------------------------------------------------------------------
    def _wrap_schedule(self, schedule: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(schedule, "_hops_calib_traced", False):
            return schedule

        def forward_backward(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("forward_only"):  # evaluation: not an iteration of training
                return schedule(*args, **kwargs)
            if self.log is None:  # (set-up, once: not counted as the tracer's per-event cost)
                self._start_log()
                if self.first_iteration is None:
                    self.first_iteration = _megatron_iteration() + 1
            began = time.perf_counter_ns()
            self._end_iteration()
            assert self.log is not None and self.first_iteration is not None
            number = self.first_iteration + self.iteration
            self.iteration += 1
            self.log.begin_iteration(number if number >= self.trace_from else None)
            self.overhead_ns += time.perf_counter_ns() - began
            return schedule(*args, **kwargs)

        forward_backward._hops_calib_traced = True  # type: ignore[attr-defined]
        forward_backward.__name__ = getattr(schedule, "__name__", "forward_backward")
        return forward_backward

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.log is not None and self.log.recording and not self.optimizer_span:
            began = time.perf_counter_ns()
            self.optimizer_span = [self._mark(), None]
            self.overhead_ns += time.perf_counter_ns() - began

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.optimizer_span:
            began = time.perf_counter_ns()
            self.optimizer_span[1] = self._mark()
            self.overhead_ns += time.perf_counter_ns() - began

    def _mark(self) -> int:
        return self.wall.now_ns()

    def _end_iteration(self) -> None:
        """The finished iteration's OPTIMIZER into the log."""
        if self.log is None:
            return
        if self.tracer is not None:
            self.tracer.end_iteration()
        if self.optimizer_span and self.optimizer_span[1] is not None and self.log.recording:
            start, end = self.optimizer_span
            self.log.compute(OPTIMIZER, 0, 0, start, end)
        self.optimizer_span = []

    def close(self) -> None:
        """Write the rank's log (once; also at exit) and the tracer's own cost."""
        if self.written or self.log is None:
            return
        self._end_iteration()
        self.log.begin_iteration(None)
        self.written = True
        from hops_calib.files import atomic_write

        folder = self.out / TRACE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.log.write(folder / f"rank{self.log.rank}.jsonl")
        events = len(self.log.events)
        atomic_write(
            folder / f"tracer.rank{self.log.rank}.json",
            json.dumps(
                {
                    "events": events,
                    "iterations_seen": self.iteration,
                    "clock": "host wall clock",
                    "overhead_ms": self.overhead_ns / 1e6,
                    "overhead_us_per_event": self.overhead_ns / 1e3 / events if events else None,
                },
                indent=1,
            )
            + "\n",
        )
        self.uninstall()


class _TimedClock:
    """The step wrappers' clock: the wall clock, its reads counted as the tracer's own time."""

    def __init__(self, tracer: PluginTracer) -> None:
        self.tracer = tracer

    def now_ns(self) -> int:
        began = time.perf_counter_ns()
        value = self.tracer.wall.now_ns()
        self.tracer.overhead_ns += time.perf_counter_ns() - began
        return value


def _megatron_iteration() -> int:
    """Megatron-LM's iteration count at the start of training (a resumed run's), 0 where it is not known."""
    try:
        from megatron.training.global_vars import get_args

        return int(getattr(get_args(), "iteration", 0) or 0)
    except Exception:  # noqa: BLE001 - Megatron-core alone (no Megatron-LM arguments): count from 1
        return 0


_ACTIVE: PluginTracer | None = None


def install(out: str | Path, **options: Any) -> PluginTracer:
    """Trace this process's Megatron run into the job directory `out` (module docstring); returns the tracer."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = PluginTracer(Path(out), **options)
        _ACTIVE.install()
    return _ACTIVE


def _parser() -> Any:
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> Any:  # (exits 2, as argparse does, saying where the help is)
            self.print_usage(sys.stderr)
            self.exit(2, f"{self.prog}: error: {message}\n(python -m hops_calib.capture.plugin --help says more)\n")

    parser = Parser(
        prog="python -m hops_calib.capture.plugin",
        usage="%(prog)s --out JOB_DIR [--trace-from N] [--] SCRIPT [ARGS...]",
        description="Run a Megatron-LM or Megatron-core training script unmodified, with the hops-calib tracer "
        "loaded: each rank writes the documented event log JOB_DIR/megatron_trace/rank<r>.jsonl (and "
        "tracer.rank<r>.json, the tracer's own cost) when its process exits. Every stamp is the host's "
        "wall clock: on a GPU a step's span is its launch time (docs/traces.md).",
        epilog="examples:\n"
        "  torchrun --nproc-per-node 8 -m hops_calib.capture.plugin --out runs/my_job -- pretrain_gpt.py "
        "ARGS...\n"
        "  python -m hops_calib.capture.plugin --out runs/my_job train.py --num-layers 4\n"
        "then: add hops.base.yaml (the device types) to the job directory, and "
        "hops-calib ingest runs/my_job --fixtures STORE.\n"
        "In your own script instead: from hops_calib.capture import plugin; plugin.install('runs/my_job')",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="JOB_DIR",
        help="the job directory to write (megatron_trace/, and megatron_args.txt and "
        "hops_trace_map.json on rank 0 where absent)",
    )
    parser.add_argument(
        "--trace-from",
        type=_positive,
        default=TRACE_FIRST_ITERATION,
        metavar="N",
        help=f"log iterations from the N-th training call on (default {TRACE_FIRST_ITERATION}: the first ones warm up)",
    )
    parser.add_argument(
        "script",
        metavar="SCRIPT",
        help="the training script, run as __main__ (as python SCRIPT "
        "ARGS...); ARGS, the script's own, are passed unchanged",
    )
    return parser


_VALUED = ("--out", "--trace-from")  # the plugin's options that take a value


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the plugin's own arguments up to and with SCRIPT, the script's ARGS): SCRIPT is the first word after `--`,
    or else the first that is neither an option nor an option's value."""
    k = 0
    while k < len(argv):
        word = argv[k]
        if word == "--":
            return argv[:k] + argv[k + 1 : k + 2], argv[k + 2 :]
        if not word.startswith("-"):
            return argv[: k + 1], argv[k + 1 :]
        k += 2 if word in _VALUED else 1
    return argv, []


def _positive(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1 (the first training call to log)")
    return value


def main(argv: list[str] | None = None) -> None:
    """`python -m hops_calib.capture.plugin --out JOB_DIR [--trace-from N] [--] SCRIPT ARGS...`: run SCRIPT traced.
    --help prints what it does and exits 0; bad usage exits 2 with the usage and what is wrong."""
    import runpy

    parser = _parser()
    own, args = _split(list(sys.argv[1:] if argv is None else argv))
    unknown = [
        word
        for k, word in enumerate(own)
        if word.startswith("-")
        and (k == 0 or own[k - 1] not in _VALUED)
        and word.split("=")[0] not in _VALUED + ("-h", "--help")
    ]
    if unknown:
        parser.error(
            f"unknown option {unknown[0]}: the plugin's own options (--out, --trace-from) come before "
            "SCRIPT; the script's options after it (or after --)"
        )
    parsed = parser.parse_args(own)
    script = parsed.script
    if not Path(script).is_file():
        parser.error(
            f"SCRIPT {script!r} is not a file: give the training script's path (e.g. pretrain_gpt.py), "
            "after --out JOB_DIR and --"
        )
    install(parsed.out, trace_from=parsed.trace_from)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
