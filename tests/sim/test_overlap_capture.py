"""A real CPU capture of interleaved 1F1B with Megatron's overlapped p2p (traces/cpu_interleaved_overlap_*): the
order in which every rank ran its forwards and backwards and posted its sends is the simulator's overlapped program
(`hops_calib.sim.schedules`, Megatron's forward_backward_pipelining_with_interleaving with overlap_p2p_comm), and
not the blocking one; the shipped blocking interleaved captures follow the blocking program."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from hops_calib.loop.suite import open_store
from hops_calib.sim.schedules import COMPUTE, build_programs
from hops_calib.timeline import OPTIMIZER, PHASES

REPO = Path(__file__).resolve().parents[2]
OVERLAPPED = sorted(p for p in (REPO / "traces").glob("cpu_interleaved_overlap_*") if p.is_dir())
BLOCKING = sorted(p for p in (REPO / "traces").glob("cpu_interleaved_v*") if p.is_dir())


def recorded_order(run: Path) -> dict[tuple[int, int], list[tuple]]:
    """{(iteration, rank): [(kind, phase, chunk, microbatch), ...]} of compute and sent transfers, by start time."""
    events = defaultdict(list)
    for path in sorted((run / "megatron_trace").glob("rank*.jsonl")):
        with path.open() as lines:
            for line in lines:
                event = json.loads(line)
                if event["event_type"] in ("compute", "transfer") and event["phase"] != OPTIMIZER:
                    events[(event["iteration"], event["stage"])].append(
                        (event["start_wall_ns"], event["event_type"], event["phase"], event.get("model_chunk", 0),
                         event["microbatch"]))
    return {key: [found[1:] for found in sorted(found)] for key, found in events.items()}


def program_order(ranks: int, chunks: int, microbatches: int, overlap: bool) -> list[list[tuple]]:
    """Per rank, the program's tasks and, where a call first posts it, each send, in program order."""
    programs = build_programs("interleaved_1f1b", ranks, chunks, microbatches, None, overlap)
    per_direction = ranks * chunks * microbatches
    orders = []
    for ops in programs.per_rank:
        order, posted = [], set()
        for op in ops:
            if op[0] == COMPUTE:
                order.append(("compute", PHASES[op[1]], op[2] // ranks, op[3]))
                continue
            for transfer in op[1]:  # the call's sends
                if transfer not in posted:
                    posted.add(transfer)
                    direction, rest = divmod(transfer, per_direction)
                    stage, microbatch = divmod(rest, microbatches)
                    order.append(("transfer", "FORWARD" if direction == 0 else "BACKWARD", stage // ranks, microbatch))
        orders.append(order)
    return orders


def shape(run: Path) -> tuple[int, int, int]:
    manifest = yaml.safe_load((run / "manifest.yaml").read_text())
    layers = manifest["layers_per_rank"]
    args = (run / "megatron_args.txt").read_text().split()
    per_chunk = int(args[args.index("--num-layers-per-virtual-pipeline-stage") + 1])
    return len(layers), layers[0] // per_chunk, int(args[args.index("--global-batch-size") + 1])


def test_an_overlapped_capture_is_shipped_and_ingested():
    assert OVERLAPPED, "traces/ ships an interleaved capture with overlapped p2p"
    store = open_store(REPO / "fixtures")
    for run in OVERLAPPED:
        manifest = yaml.safe_load((run / "manifest.yaml").read_text())
        assert manifest["overlap_p2p_comm"] is True and manifest["batch_p2p_comm"] is False
        assert manifest["schedule_function"] == "forward_backward_pipelining_with_interleaving"
        assert "--no-overlap-p2p-communication" not in (run / "megatron_args.txt").read_text()
        spec = store.load(run.name).spec
        assert spec.overlap_p2p and spec.schedule == "interleaved_1f1b"
    for run in BLOCKING:
        assert not store.load(run.name).spec.overlap_p2p


@pytest.mark.parametrize("run", OVERLAPPED, ids=lambda p: p.name)
def test_every_rank_ran_megatrons_overlapped_order(run):
    ranks, chunks, microbatches = shape(run)
    overlapped = program_order(ranks, chunks, microbatches, True)
    blocking = program_order(ranks, chunks, microbatches, False)
    recorded = recorded_order(run)
    assert len(recorded) == ranks * len({iteration for iteration, _ in recorded}) >= 2 * ranks
    for (iteration, rank), order in recorded.items():
        assert order == overlapped[rank], f"iteration {iteration}, rank {rank}"
        # the steady state's activations leave right after their forward, before the backward that follows
        assert order != blocking[rank]


def calls(order: list[tuple]) -> list:
    """The order with each run of sends between two tasks as one set: the sends one blocking p2p call posts
    together (`send_forward_backward_recv_forward_backward` posts its isends at once and waits on them together,
    megatron/core/pipeline_parallel/p2p_communication.py, `_p2p_ops`), so which the tracer stamps first is no
    property of the schedule."""
    grouped: list = []
    for item in order:
        if item[0] == "transfer" and grouped and isinstance(grouped[-1], frozenset):
            grouped[-1] = grouped[-1] | {item}
        else:
            grouped.append(frozenset({item}) if item[0] == "transfer" else item)
    return grouped


@pytest.mark.parametrize("run", BLOCKING, ids=lambda p: p.name)
def test_the_blocking_interleaved_captures_ran_the_blocking_order(run):
    ranks, chunks, microbatches = shape(run)
    blocking = program_order(ranks, chunks, microbatches, False)
    overlapped = program_order(ranks, chunks, microbatches, True)
    for (iteration, rank), order in recorded_order(run).items():
        assert calls(order) == calls(blocking[rank]), f"iteration {iteration}, rank {rank}"
        assert calls(order) != calls(overlapped[rank])
