"""Plot room: timelines as Chrome trace JSON (the Trace Event Format that Perfetto and chrome://tracing open).

One process per panel (the real run, each prediction), in the panels' order; in each, one thread per stage for its
compute (forward, backward and its halves, the optimizer step) and one per stage for its sends, so a send never
hides the compute it overlaps. The format wants the slices of a thread disjoint or nested; where a stage's
intervals overlap without nesting (real traces have compute events overlapping by up to 3 ms, and sends of both
directions overlap), the later one goes to an extra thread of the stage ("stage 2 compute +1"). Every interval
is a complete event (`"ph": "X"`) with microsecond `ts` and `dur` from the start of its timeline; its `args` carry
the iteration, microbatch, model chunk and, for a send, the stage it goes to. Metadata events (`"ph": "M"`) name
and order the processes and threads.

The export is a window: each panel's first CHROME_ITERATIONS iterations (`iterations`; None exports whole runs).
A whole run of a large job does not stay usable in a viewer (the 175B job of docs/whatif.md predicts 98
iterations of 192 microbatches on 8 stages: 565,000 intervals, 218 MB of JSON), and its iterations repeat one
another. The trace says what it holds: `otherData.window` gives, per panel, the iterations and intervals shown of
how many, and each process carries a `process_labels` entry ("first 3 of 98 iterations").

A real run read from a profiler trace (Kineto, Nsight) carries its per-kernel truth: under each of its compute
bars the export nests one slice per kernel class (gemm, attention, ...), in order of time, each the class's mean
time per step of that stage and phase (`per_iteration_ms` over the phase's steps per iteration), scaled down
together where they would overrun the bar. They are aggregates of the trace's kernels, not the kernels
themselves (the fixture keeps durations by kernel and shape, not each kernel's start).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hops_calib.files import atomic_write
from hops_calib.plot.timeline import Panel, kernel_classes_per_step, kernel_segments
from hops_calib.timeline import TRANSFER

US_PER_MS = 1000.0
CHROME_ITERATIONS = 3  # iterations per panel an export holds by default
THREADS_PER_STAGE = 100  # thread ids: stage k's compute k*100 + lane, its sends k*100 + 50 + lane
SEND_LANE_OFFSET = 50


def _metadata(name: str, pid: int, args: dict[str, Any], tid: int | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"name": name, "ph": "M", "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def _thread(stage: int, send: bool, lane: int) -> int:
    return stage * THREADS_PER_STAGE + (SEND_LANE_OFFSET if send else 0) + lane


def _lanes(stage: np.ndarray, send: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Per interval, the first lane of its stage and kind whose last interval ended by its start (greedy interval
    partitioning: as few lanes as the most intervals overlapping at once)."""
    lanes = np.zeros(len(start), dtype=np.int64)
    ends: dict[tuple[int, bool], list[float]] = {}
    for i in np.lexsort((-end, start)):  # by start; of equal starts the longer first (it would hold the other)
        busy = ends.setdefault((int(stage[i]), bool(send[i])), [])
        lane = next((k for k, last in enumerate(busy) if last <= start[i]), len(busy))
        if lane == len(busy):
            if lane >= SEND_LANE_OFFSET:
                raise ValueError(
                    f"stage {int(stage[i])} has more than {SEND_LANE_OFFSET} intervals of one kind "
                    "overlapping at once; not a pipeline timeline"
                )
            busy.append(end[i])
        else:
            busy[lane] = end[i]
        lanes[i] = lane
    return lanes


def window_note(window: dict[str, Any]) -> str:
    """One line on what an export's window holds (`otherData.window`)."""
    shown = "; ".join(
        f"{p['label']}: {p['iterations_shown']} of {p['iterations']} iterations, "
        f"{p['intervals_shown']:,} of {p['intervals']:,} intervals"
        for p in window["panels"]
    )
    how = (
        "whole runs"
        if window["iterations"] is None
        else f"the first {window['iterations']} iterations of each panel (--chrome-all exports whole runs)"
    )
    return f"{how}: {shown}"


def chrome_trace(
    title: str, devices: Sequence[str], panels: Sequence[Panel], iterations: int | None = CHROME_ITERATIONS
) -> dict[str, Any]:
    """The Trace Event Format object of `panels` (one process each) over stages running on `devices`: each panel's
    first `iterations` iterations (None: all of them; module docstring)."""
    if iterations is not None and iterations < 1:
        raise ValueError(f"a Chrome export holds at least one iteration, not {iterations}")
    events: list[dict[str, Any]] = []
    shown_panels: list[dict[str, Any]] = []
    for pid, panel in enumerate(panels, start=1):
        frame = panel.timeline
        numbers = sorted(set(frame["iteration"].tolist()))
        kept = numbers if iterations is None else numbers[:iterations]
        if len(kept) < len(numbers):
            frame = frame[frame["iteration"].isin(kept)]
        shown_panels.append(
            {
                "label": panel.label,
                "iterations_shown": len(kept),
                "iterations": len(numbers),
                "intervals_shown": len(frame),
                "intervals": len(panel.timeline),
            }
        )
        events.append(_metadata("process_name", pid, {"name": panel.label}))
        events.append(
            _metadata(
                "process_labels",
                pid,
                {
                    "labels": f"first {len(kept)} of {len(numbers)} iterations"
                    if len(kept) < len(numbers)
                    else f"all {len(numbers)} iterations"
                },
            )
        )
        events.append(_metadata("process_sort_index", pid, {"sort_index": pid}))
        origin = float(frame["start_ms"].min()) if len(frame) else 0.0
        columns = {
            name: frame[name].to_numpy()
            for name in (
                "stage",
                "chunk",
                "iteration",
                "microbatch",
                "kind",
                "phase",
                "start_ms",
                "end_ms",
                "peer_stage",
            )
        }
        # to the nanosecond: bars that touch up to floating-point noise (1e-9 us) share a lane
        start_us = np.round((columns["start_ms"].astype(float) - origin) * US_PER_MS, 3)
        end_us = np.round((columns["end_ms"].astype(float) - origin) * US_PER_MS, 3)
        duration_us = np.maximum(end_us - start_us, 0.0)
        is_send = columns["kind"] == TRANSFER
        # iterations numbered as the panel says (a simulation counts from 1, a real trace from Megatron's 3)
        shift = (
            panel.first_iteration_label - int(columns["iteration"].min())
            if panel.first_iteration_label is not None and len(frame)
            else 0
        )
        lanes = _lanes(columns["stage"], is_send, start_us, start_us + duration_us)
        for stage, send, lane in sorted(set(zip(columns["stage"].tolist(), is_send.tolist(), lanes.tolist()))):
            tid = _thread(stage, send, lane)
            device = devices[stage] if 0 <= stage < len(devices) else "?"
            name = f"stage {stage} ({device}) {'sends' if send else 'compute'}" + (f" +{lane}" if lane else "")
            events.append(_metadata("thread_name", pid, {"name": name}, tid))
            events.append(_metadata("thread_sort_index", pid, {"sort_index": tid}, tid))
        for i in range(len(frame)):
            stage, phase = int(columns["stage"][i]), str(columns["phase"][i])
            args: dict[str, Any] = {
                "iteration": int(columns["iteration"][i]) + shift,
                "chunk": int(columns["chunk"][i]),
            }
            if int(columns["microbatch"][i]) >= 0:
                args["microbatch"] = int(columns["microbatch"][i])
            if is_send[i]:
                args["to_stage"] = int(columns["peer_stage"][i])
            label = f"{'send ' if is_send[i] else ''}{phase}" + (
                f" mb{args['microbatch']}" if "microbatch" in args else ""
            )
            events.append(
                {
                    "name": label,
                    "cat": "transfer" if is_send[i] else "compute",
                    "ph": "X",
                    "ts": float(start_us[i]),
                    "dur": float(duration_us[i]),
                    "pid": pid,
                    "tid": _thread(stage, bool(is_send[i]), int(lanes[i])),
                    "args": args,
                }
            )
        if panel.kernels:
            events += _kernel_slices(panel.kernels, columns, start_us, duration_us, is_send, lanes, pid)
    window: dict[str, Any] = {
        "iterations": iterations,
        "panels": shown_panels,
        "windowed": any(p["iterations_shown"] < p["iterations"] for p in shown_panels),
    }
    window["note"] = window_note(window)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": title, "window": window}}


def _kernel_slices(
    kernels: Sequence[Any],
    columns: dict[str, np.ndarray],
    start_us: np.ndarray,
    duration_us: np.ndarray,
    is_send: np.ndarray,
    lanes: np.ndarray,
    pid: int,
) -> list[dict[str, Any]]:
    """Slices of kernel classes nested under each compute bar (module docstring)."""
    compute = ~is_send
    per_step = kernel_classes_per_step(
        kernels, columns["stage"][compute], columns["phase"][compute], columns["iteration"][compute]
    )
    out: list[dict[str, Any]] = []
    for i in np.flatnonzero(compute):
        stage, phase = int(columns["stage"][i]), str(columns["phase"][i])
        step_classes = per_step.get((stage, phase))
        if not step_classes:
            continue
        segments, scaled = kernel_segments(step_classes, float(start_us[i]), float(duration_us[i]), US_PER_MS, digits=3)
        for label, at, width, ms in segments:
            out.append(
                {
                    "name": f"{label} (kernels)",
                    "cat": "kernels",
                    "ph": "X",
                    "ts": at,
                    "dur": width,
                    "pid": pid,
                    "tid": _thread(stage, False, int(lanes[i])),
                    "args": {"kernel_class": label, "mean_ms_per_step": ms, "scaled": scaled},
                }
            )
    return out


def write_chrome_trace(
    path: Path | str,
    title: str,
    devices: Sequence[str],
    panels: Sequence[Panel],
    iterations: int | None = CHROME_ITERATIONS,
) -> Path:
    """Write `chrome_trace(...)` to `path` (whole or not at all) and return the path."""
    path = Path(path)
    atomic_write(path, json.dumps(chrome_trace(title, devices, panels, iterations), separators=(",", ":")))
    return path
