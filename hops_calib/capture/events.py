"""Capture room: one rank's event log, written in the HOPS tracing fork's `megatron_trace/rank<r>.jsonl` schema.

Field for field the cluster schema (docs/megatron-trace-format.md), plus one
optional field:

- `model_chunk` (int): the model chunk of the rank that ran the event, present on
  FORWARD/BACKWARD compute events and on transfers when the run has more than one
  chunk per rank (interleaved schedules). With `pp` ranks and `vp` chunks, chunk c
  of rank r is virtual stage `c * pp + r`, as in Megatron; `stage` stays the rank.
  OPTIMIZER events have no `model_chunk`: one optimizer step covers every chunk of
  the rank. A reader that finds no `model_chunk` should take chunk 0.

With `--experts` (Megatron-core's MoE layer) two more kinds of line, both kept off the timeline: `collective`
lines for the expert-parallel exchanges (`collective` all_to_all, or all_gather for the split sizes; `group` ep;
`moe_step` preprocess | dispatch | combine; `layer`), and `event_type: moe` lines for the router's and the
experts' compute (`moe_step` router | experts, `layer`), each in the FORWARD or BACKWARD step that ran it.

Torch-free; the engines call `compute()` and `transfer()` with stamps from
`WallClock`, a monotonic clock anchored once to the wall clock, so stamps never
step backwards within a rank and ranks on one host share a time base.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from hops_calib.files import atomic_write
from hops_calib.timeline import COMPUTE, OPTIMIZER, PHASES, TRANSFER
from hops_calib.trace.events import COLLECTIVE, MOE


class Clock(Protocol):
    """What a tracer reads its times from: nanoseconds since the Unix epoch."""

    def now_ns(self) -> int: ...


class WallClock:
    """Unix-epoch nanoseconds read from the monotonic counter, anchored to the wall clock at construction."""

    def __init__(self) -> None:
        self._wall_anchor_ns = time.time_ns()
        self._counter_anchor_ns = time.perf_counter_ns()

    def now_ns(self) -> int:
        return self._wall_anchor_ns + (time.perf_counter_ns() - self._counter_anchor_ns)


@dataclass
class EventLog:
    """Events of one rank; only iterations opened with `begin_iteration(n)` (n not None) are recorded."""

    rank: int
    device_ids: tuple[str, ...]  # per rank
    hostname: str
    with_chunks: bool = False  # write `model_chunk` (runs with more than one chunk per rank)
    events: list[dict[str, object]] = field(default_factory=list)
    iteration: int | None = None
    # With tensor or data parallelism, the stage of every global rank and the stage map's device per stage (a
    # transfer names the receiving stage's device); empty: rank r runs stage r on device_ids[r]
    rank_stage: tuple[int, ...] = ()
    stage_devices: tuple[str, ...] = ()

    @property
    def stage(self) -> int:
        return self.rank_stage[self.rank] if self.rank_stage else self.rank

    def _stage_device(self, rank: int) -> str:
        return self.stage_devices[self.rank_stage[rank]] if self.rank_stage else self.device_ids[rank]

    @property
    def recording(self) -> bool:
        return self.iteration is not None

    def begin_iteration(self, iteration: int | None) -> None:
        """Label the following events with `iteration`; None stops recording (warm-up iterations)."""
        self.iteration = iteration

    def _event(self, kind: str, phase: str, microbatch: int, start_ns: int, end_ns: int) -> dict[str, object]:
        if phase not in PHASES:
            raise ValueError(f"rank {self.rank}: unknown phase {phase!r}; expected one of {PHASES}")
        return {
            "rank": self.rank,
            "stage": self.stage,
            "iteration": self.iteration,
            "microbatch": int(microbatch),
            "event_type": kind,
            "phase": phase,
            "start_wall_ns": int(start_ns),
            "end_wall_ns": int(end_ns),
            "duration_ms": (end_ns - start_ns) / 1e6,
            "device_id": self.device_ids[self.rank],
        }

    def compute(self, phase: str, microbatch: int, chunk: int, start_ns: int, end_ns: int) -> None:
        if not self.recording:
            return
        event = self._event(COMPUTE, phase, microbatch, start_ns, end_ns)
        event["hostname"] = self.hostname
        if self.with_chunks and phase != OPTIMIZER:
            event["model_chunk"] = int(chunk)
        self.events.append(event)

    def transfer(self, phase: str, microbatch: int, chunk: int, dst_rank: int, start_ns: int, end_ns: int) -> None:
        """A send logged by its sender: FORWARD = activation to the next stage, BACKWARD = gradient to the previous."""
        if not self.recording:
            return
        event = self._event(TRANSFER, phase, microbatch, start_ns, end_ns)
        event["src_device"] = self._stage_device(self.rank)
        event["dst_device"] = self._stage_device(dst_rank)
        event["hostname"] = self.hostname
        if self.with_chunks:
            event["model_chunk"] = int(chunk)
        self.events.append(event)

    def collective(
        self,
        op: str,
        group: str,
        phase: str,
        microbatch: int | None,
        nbytes: int,
        start_ns: int,
        end_ns: int,
        moe: tuple[str, int] | None = None,
    ) -> None:
        """A collective this rank took part in (`op` over its `group`, "tp", "dp", "ep" or "edp"), in the phase that
        issued it: the layer's forward or backward of `microbatch`, or the gradient reduction after the backwards
        (BACKWARD, microbatch None). An `event_type: collective` line; readers before it skip nothing else.
        `moe`: (step, layer) of an MoE layer's exchange (`moe_step` preprocess | dispatch | combine, `layer`)."""
        if not self.recording:
            return
        event: dict[str, object] = {
            "rank": self.rank,
            "stage": self.stage,
            "iteration": self.iteration,
            "microbatch": None if microbatch is None else int(microbatch),
            "event_type": COLLECTIVE,
            "phase": phase,
            "collective": op,
            "group": group,
            "bytes": int(nbytes),
            "start_wall_ns": int(start_ns),
            "end_wall_ns": int(end_ns),
            "duration_ms": (end_ns - start_ns) / 1e6,
            "device_id": self.device_ids[self.rank],
            "hostname": self.hostname,
        }
        if moe is not None:
            event["moe_step"], event["layer"] = moe[0], int(moe[1])
        self.events.append(event)

    def moe(self, step: str, layer: int, phase: str, microbatch: int, start_ns: int, end_ns: int) -> None:
        """A compute step of an MoE layer inside a forward or backward step (`moe_step` router | experts, the
        1-based decoder `layer`): an `event_type: moe` line. It lies inside that step's FORWARD or BACKWARD compute
        event, so it is kept off the timeline, as collective lines are."""
        if not self.recording:
            return
        event = self._event(MOE, phase, microbatch, start_ns, end_ns)
        event["moe_step"], event["layer"], event["hostname"] = step, int(layer), self.hostname
        self.events.append(event)

    def write(self, path: Path) -> None:
        """One JSON object per line, in the order recorded; never half-written."""
        atomic_write(path, "".join(json.dumps(event) + "\n" for event in self.events))
