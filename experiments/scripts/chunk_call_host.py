"""Evidence for the chunk_call_host term: the host time of one forward_step / backward_step call outside its work.

Reads the profiled CPU captures' Kineto traces (profiles/RUN/torch_profile/rank-R.json.gz, `capture --profile`) and,
for every call the capture traced (hops_calib/capture/megatron_engine.py wraps Megatron's
schedules.forward_step and backward_step), measures the time in the call before its first and after its last
operator: top-level aten ops for a forward, autograd nodes (`autograd::engine::evaluate_function: ...`) for a
backward. That head and tail is the per-call Python of megatron/core/pipeline_parallel/schedules.py (set_input_tensor,
forward_step_func, forward_step_calc_loss; backward_step's checks, torch.autograd.backward's start and end), which
does not grow with the chunk's layers. The gaps between the operators (the modules' own Python) are printed apart:
they grow with the layers, and the per-layer terms price them.

Also prints, from the event logs of the traces given with --traces, each rank's and chunk's forward and backward
medians: a one-layer chunk against a stage of two of the same shape, captured back to back, is how a per-chunk
cost shows (issue #28).

    python experiments/scripts/chunk_call_host.py profiles/cpu_1f1b_l2_h256_s128_m4_prof_run1
    python experiments/scripts/chunk_call_host.py --traces traces/cpu_1f1b_l4_h384_s128_m4_run1 traces/cpu_interleaved_v2_l4_h384_s128_m6_run1
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path
from typing import Any

FORWARD_SPAN = "hops_calib/capture/megatron_engine.py(116): forward_step"
BACKWARD_SPAN = "hops_calib/capture/megatron_engine.py(136): backward_step"


def _top_level(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operators not nested in another (sorted by start)."""
    top: list[dict[str, Any]] = []
    end = -1.0
    for op in sorted(ops, key=lambda e: e["ts"]):
        if op["ts"] >= end:
            top.append(op)
            end = op["ts"] + op["dur"]
    return top


def call_overheads(path: Path) -> dict[str, list[tuple[float, float]]]:
    """Per phase, each traced call's (head + tail, gaps between its operators) in ms."""
    with gzip.open(path) as raw:
        events = [e for e in json.load(raw)["traceEvents"] if e.get("ph") == "X"]
    ops_by_tid: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            ops_by_tid.setdefault(e["tid"], []).append(e)
    out: dict[str, list[tuple[float, float]]] = {"FORWARD": [], "BACKWARD": []}
    for phase, span_name, prefix in (
        ("FORWARD", FORWARD_SPAN, "aten::"),
        ("BACKWARD", BACKWARD_SPAN, "autograd::engine::evaluate_function"),
    ):
        for span in (e for e in events if e["name"].startswith(span_name)):
            start, end = span["ts"], span["ts"] + span["dur"]
            inside = [
                o
                for o in ops_by_tid.get(span["tid"], [])
                if o["ts"] >= start and o["ts"] + o["dur"] <= end and o["name"].startswith(prefix)
            ]
            ops = _top_level(inside)
            if not ops:
                continue
            first, last = ops[0]["ts"], ops[-1]["ts"] + ops[-1]["dur"]
            busy = sum(o["dur"] for o in ops)
            out[phase].append((((first - start) + (end - last)) / 1e3, ((last - first) - busy) / 1e3))
    return out


def chunk_medians(run: Path) -> dict[tuple[int, int, str], float]:
    """(rank, chunk, phase) -> median compute duration (ms) from the run's event logs."""
    durations: dict[tuple[int, int, str], list[float]] = {}
    for log in sorted((run / "megatron_trace").glob("rank*.jsonl")):
        for line in log.read_text().splitlines():
            e = json.loads(line)
            if e["event_type"] == "compute" and e["phase"] in ("FORWARD", "BACKWARD"):
                key = (e["rank"], e.get("model_chunk", 0), e["phase"])
                durations.setdefault(key, []).append(e["duration_ms"])
    return {key: statistics.median(v) for key, v in sorted(durations.items())}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="*", type=Path, help="profiled capture directories (torch_profile/)")
    parser.add_argument("--traces", nargs="*", type=Path, default=[], help="capture directories: chunk medians")
    args = parser.parse_args(argv)
    for run in args.profiles:
        pooled: dict[str, list[float]] = {"FORWARD": [], "BACKWARD": []}
        for path in sorted((run / "torch_profile").glob("rank-*.json.gz")):
            for phase, rows in call_overheads(path).items():
                ends = [r[0] for r in rows]
                pooled[phase] += ends
                print(
                    f"{run.name} {path.name} {phase}: {len(rows)} calls, head+tail median "
                    f"{statistics.median(ends):.3f} ms ({min(ends):.3f}-{max(ends):.3f}), gaps between operators "
                    f"median {statistics.median(r[1] for r in rows):.3f} ms"
                )
        for phase, ends in pooled.items():
            print(f"{run.name} {phase}: pooled median head+tail {statistics.median(ends):.3f} ms over {len(ends)}")
    for run in args.traces:
        medians = chunk_medians(run)
        print(run.name + ": " + ", ".join(f"r{r}c{c} {p[:3].lower()} {m:.2f}" for (r, c, p), m in medians.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
