"""Megatron-core's MoE layer captured on the CPU (issue #28): 2 experts on 2 expert-parallel ranks over gloo.

The shipped capture (`traces/cpu_moe_e2_ep2_*`, recorded with `hops-calib capture --experts 2 --ep 2`, docs/
captures.md) is read through the event-log reader ingest uses (`hops_calib.trace.events.read_rank_events`), and its
rank logs must hold what megatron/core/transformer/moe/moe_layer.py (MoELayer.forward) runs: in every forward of
every microbatch, layer after layer, the router (TopKRouter), the all-gather of the split sizes
(MoEAlltoAllTokenDispatcher.preprocess), the dispatch all-to-alls (token_dispatch: the tokens, then their
probabilities), the expert (SequentialMLP), the combine all-to-all (token_combine); in the backward the reverse,
layer after layer from the last: combine, experts, dispatch, router. Both ranks take part in every exchange (their
calls overlap in time: a blocking gloo all-to-all returns only once the other rank has sent), every token sent out
comes back, and an iteration holds 2 x layers x microbatches all-to-all steps per direction (3 calls each: the
dispatch's 2 and the combine's 1). Two quiet repeats ship in `traces/` and so in the fixture store (the model
prices MoE since issue #28; tests/model/test_moe.py checks its collectives against this capture's).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from hops_calib.capture import CaptureConfig, CaptureConfigError, capture
from hops_calib.timeline import BACKWARD, COMPUTE, FORWARD, KINDS, PHASES
from hops_calib.trace import TraceError, find_arguments
from hops_calib.trace.events import read_rank_events

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p for p in (REPO / "traces").glob("cpu_moe_e2_ep2_*") if p.is_dir())
# Ranks stamp one host clock, each anchored once to the wall clock when it starts (capture/events.py WallClock):
# the anchors of two processes started together differ by at most NTP's slew (<= 500 ppm) over the second between
# them, 0.5 ms.
ANCHOR_SKEW_NS = 500_000

FORWARD_LAYER = ["router", "preprocess:all_gather", "dispatch:all_to_all", "dispatch:all_to_all", "experts",
                 "combine:all_to_all"]
BACKWARD_LAYER = ["combine:all_to_all", "experts", "dispatch:all_to_all", "dispatch:all_to_all", "router"]


def configuration(job: Path) -> dict[str, int]:
    """The launch's shape, from its megatron_args.txt (as ingest reads it)."""
    args, _ = find_arguments(job)
    dp = args["world_size"] // (args["tensor_model_parallel_size"] * args["pipeline_model_parallel_size"])
    return {
        "world": args["world_size"],
        "dp": dp,
        "layers": args["num_layers"],
        "microbatches": args["global_batch_size"] // (dp * args["micro_batch_size"]),
        "tokens": args["seq_length"] * args["micro_batch_size"],
        "hidden": args["hidden_size"],
        "experts": args["num_experts"],
        "ep": args["expert_model_parallel_size"],
        "topk": args["moe_router_topk"],
    }


def read_job(job: Path) -> dict[int, dict[str, Any]]:
    """Per rank: its compute events and its MoE steps, as the ingest's reader reads them."""
    stage_map = json.loads((job / "hops_trace_map.json").read_text())["stages"]
    device_stage = {device: int(stage) for stage, device in stage_map.items()}
    ranks = {}
    for rank in range(configuration(job)["world"]):
        columns, report = read_rank_events(
            job / "megatron_trace" / f"rank{rank}.jsonl", rank=rank, pp=len(stage_map), device_stage=device_stage
        )
        compute = [
            (int(it), PHASES[ph], int(mb), int(s), int(e))
            for it, ph, mb, kind, s, e in zip(columns["iteration"], columns["phase"], columns["microbatch"],
                                              columns["kind"], columns["start_ns"], columns["end_ns"])
            if KINDS[kind] == COMPUTE
        ]
        steps = [(c.iteration, c.phase, c.microbatch, c.layer, f"{c.moe_step}:{c.op}", c.start_ns, c.end_ns, c.nbytes)
                 for c in report.collectives if c.moe_step is not None]
        steps += [(m.iteration, m.phase, m.microbatch, m.layer, m.step, m.start_ns, m.end_ns, None) for m in report.moe]
        ranks[rank] = {"compute": compute, "steps": sorted(steps, key=lambda s: s[5]), "report": report}
    return ranks


def check_moe_structure(job: Path) -> None:
    shape = configuration(job)
    assert shape["experts"] == 2 and shape["ep"] == 2 == shape["world"], "two experts, one per rank"
    ranks = read_job(job)
    layers, microbatches = shape["layers"], shape["microbatches"]
    iterations = sorted({event[0] for event in ranks[0]["compute"]})
    assert iterations, f"{job}: no traced iteration"
    for rank, logged in ranks.items():
        assert not logged["report"].dropped
        by_step: dict[tuple[int, str, int], list[tuple]] = defaultdict(list)
        for step in logged["steps"]:
            by_step[step[:3]].append(step)
        for iteration, phase, microbatch, start, end in logged["compute"]:
            if phase not in (FORWARD, BACKWARD):
                continue
            inside = by_step.pop((iteration, phase, microbatch), [])
            # forward: layer 1 to L; backward: layer L to 1, each in MoELayer's order (or its reverse)
            order = range(1, layers + 1) if phase == FORWARD else range(layers, 0, -1)
            expected = [(layer, name) for layer in order
                        for name in (FORWARD_LAYER if phase == FORWARD else BACKWARD_LAYER)]
            assert [(s[3], s[4]) for s in inside] == expected, (rank, iteration, phase, microbatch)
            # one after another on the rank's one thread, all inside the step that ran them
            assert all(a[6] <= b[5] for a, b in zip(inside, inside[1:])), (rank, iteration, phase, microbatch)
            assert start <= inside[0][5] and inside[-1][6] <= end, (rank, iteration, phase, microbatch)
        assert not by_step, f"rank {rank}: MoE steps outside any forward or backward: {sorted(by_step)[:3]}"
        # per iteration: a dispatch and a combine per layer and microbatch, each way; 3 all-to-all calls per layer
        for iteration in iterations:
            for phase in (FORWARD, BACKWARD):
                steps = Counter(s[4].split(":")[0] for s in logged["steps"]
                                if s[0] == iteration and s[1] == phase and s[4].endswith("all_to_all"))
                assert steps["dispatch"] // 2 + steps["combine"] == 2 * layers * microbatches
                assert sum(steps.values()) == 3 * layers * microbatches

    # Both ranks take part in every exchange: the k-th call of each (iteration, phase, microbatch, layer, step)
    # on one rank overlaps the k-th on the other
    calls: dict[tuple, dict[int, list[tuple]]] = defaultdict(lambda: defaultdict(list))
    for rank, logged in ranks.items():
        for step in logged["steps"]:
            if step[7] is not None:
                calls[step[:5]][rank].append(step)
    for key, per_rank in calls.items():
        assert set(per_rank) == set(ranks), key
        for pair in zip(*per_rank.values()):
            assert max(s[5] for s in pair) <= min(s[6] for s in pair) + ANCHOR_SKEW_NS, key

    # What each rank dispatches is its tokens, topk times each; every token dispatched comes back in the combine,
    # and the backward sends each rank's gradients the reverse way (combine's backward the dispatched tokens'
    # gradients, dispatch's backward the combined ones')
    token_bytes = shape["hidden"] * 4  # fp32
    sent: dict[tuple, int] = {}
    for key, per_rank in calls.items():
        for rank, steps in per_rank.items():
            if key[4].endswith("all_to_all"):
                sent[(*key, rank)] = max(s[7] for s in steps)  # the tokens' all-to-all; the probabilities' is smaller
    for (iteration, phase, microbatch, layer, step, rank), nbytes in sent.items():
        if phase == FORWARD and step == "dispatch:all_to_all":
            assert nbytes == shape["tokens"] * shape["topk"] * token_bytes
            combined = [sent[(iteration, FORWARD, microbatch, layer, "combine:all_to_all", r)] for r in ranks]
            assert sum(combined) == len(ranks) * nbytes
            assert sent[(iteration, BACKWARD, microbatch, layer, "combine:all_to_all", rank)] == nbytes
            assert sent[(iteration, BACKWARD, microbatch, layer, "dispatch:all_to_all", rank)] == sent[
                (iteration, FORWARD, microbatch, layer, "combine:all_to_all", rank)]


@pytest.mark.parametrize("job", SHIPPED, ids=lambda p: p.name)
def test_the_shipped_moe_capture_runs_megatron_cores_moe_layer_in_order(job: Path) -> None:
    check_moe_structure(job)


def test_the_moe_captures_ship_in_traces_and_in_the_fixture_store() -> None:
    """Two repeats of the MoE capture ship in traces/, and the shipped store holds them as one configuration
    group (repeats share a split), read from the same job directories."""
    assert len(SHIPPED) == 2, "traces/ holds no two cpu_moe_e2_ep2_* repeats"
    from hops_calib.loop.suite import open_store

    store = open_store(REPO / "fixtures")
    assert {job.name for job in SHIPPED} <= set(store.ids())
    splits = {split for split in ("train", "test") if {job.name for job in SHIPPED} & set(store.ids(split))}
    assert len(splits) == 1


def test_a_mixed_up_moe_line_is_refused_by_field(tmp_path: Path) -> None:
    job = SHIPPED[0]
    lines = (job / "megatron_trace" / "rank0.jsonl").read_text().splitlines()
    device = json.loads((job / "hops_trace_map.json").read_text())["stages"]["0"]
    moe = next(k for k, line in enumerate(lines) if '"event_type": "moe"' in line)
    exchange = next(k for k, line in enumerate(lines) if '"moe_step": "dispatch"' in line)
    for k, field, value in ((moe, "moe_step", "dispatch"), (moe, "layer", 0), (exchange, "moe_step", "router"),
                            (exchange, "group", "expert")):
        record = json.loads(lines[k])
        record[field] = value
        bad = tmp_path / f"rank0_{k}_{field}.jsonl"
        bad.write_text("\n".join([*lines[:k], json.dumps(record), *lines[k + 1:]]) + "\n")
        with pytest.raises(TraceError, match=field) as raised:
            read_rank_events(bad, rank=0, pp=1, device_stage={device: 0})
        assert f":{k + 1}" in str(raised.value) or f"line {k + 1}" in str(raised.value)


# ---- configuration (no torch needed) ----

@pytest.mark.parametrize("changes, option", [
    ({"experts": 2, "ep": 2, "dp": 2, "engine": "torch"}, "--experts"),
    ({"experts": 2, "topk": 3, "dp": 2, "pp": 1, "link_bench": False}, "--topk"),
    ({"experts": 3, "ep": 2, "dp": 2}, "--ep"),  # an expert-parallel rank holds experts / ep
    ({"experts": 2, "ep": 2, "dp": 1}, "--ep"),  # the expert-parallel ranks are data-parallel ones
    ({"experts": 2, "ep": 2, "dp": 2, "tp": 2}, "--tp"),  # Megatron's MoE layer needs sequence parallelism
    ({"ep": 2, "dp": 2}, "--ep"),
    ({"topk": 2}, "--topk"),
    ({"pp": 1, "dp": 2}, "--link-bench"),  # no pipeline hop to benchmark
    ({"pp": 1}, "--pp"),
])
def test_moe_configurations_megatron_refuses_are_refused_first(changes: dict, option: str) -> None:
    with pytest.raises(CaptureConfigError, match=option):
        CaptureConfig(**changes).validate()


def test_megatron_args_state_the_moe_layer() -> None:
    config = CaptureConfig(pp=1, dp=2, ep=2, experts=2, topk=1, link_bench=False)
    config.validate()
    words = config.megatron_args().split()
    flag = {word: words[k + 1] for k, word in enumerate(words[:-1]) if word.startswith("--")}
    assert flag["--num-experts"] == "2" and flag["--expert-model-parallel-size"] == "2"
    assert flag["--moe-router-topk"] == "1" and flag["--moe-token-dispatcher-type"] == "alltoall"
    assert "--moe-router-pre-softmax" in words  # Megatron refuses top-1 routing without it
    assert "--moe-router-pre-softmax" not in CaptureConfig(pp=1, dp=2, ep=2, experts=2, topk=2).megatron_args()
    assert flag["--pipeline-model-parallel-size"] == "1" and words[:3] == ["torchrun", "--nproc-per-node", "2"]
    assert "--num-experts" not in CaptureConfig().megatron_args()
    assert {"--experts=2", "--topk=1", "--ep=2"} <= set(config.cli_args())


# ---- a real capture (the [capture] extra) ----

@pytest.mark.capture
def test_a_fresh_top2_capture_has_the_same_structure(tmp_path: Path) -> None:
    """The tracer end to end on a tiny run with top-2 routing (every token to both experts)."""
    from importlib.util import find_spec

    if find_spec("torch") is None or find_spec("megatron") is None:
        pytest.skip("torch or megatron not importable: install the capture extra (pip install -e '.[capture]')")
    config = CaptureConfig(pp=1, dp=2, ep=2, experts=2, topk=2, layers=2, hidden=64, seq=32, heads=4, vocab=512,
                           microbatches=2, iterations=1, link_bench=False)
    job = capture(config, tmp_path / "cpu_moe_e2_ep2_k2_tiny_run1")
    check_moe_structure(job)
    manifest = (job / "manifest.yaml").read_text()
    assert "schedule_function: forward_backward_no_pipelining" in manifest
    assert "experts_per_rank:\n- 1\n- 1" in manifest
