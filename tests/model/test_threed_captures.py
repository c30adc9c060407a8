"""Real CPU captures with tensor and data parallelism (traces/cpu_1f1b_{t2,d2,t2d2}_*): what Megatron-core issued,
recorded by `hops-calib capture --tp/--dp`, equals the structure the model simulates: the tensor-parallel
collectives of every stage per microbatch and phase (`tp_collectives`), the data-parallel gradient reduction after
the last backward (`data_parallel_grad_reduce` without --overlap-grad-reduce) with the bytes of the rank's
parameters, and the 1F1B order of every rank. The issue's three (l4_h256_s128) are held out in the shipped store's
test split; the others, in other shapes, are in its train split (the CPU pricing of the collectives is fitted on
them), and stay there when a fresh clone ingests traces/ again."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

from hops_calib.capture.config import CaptureConfig, CaptureConfigError
from hops_calib.loop.model_files import load_model
from hops_calib.loop.suite import open_store
from hops_calib.model.memory import gradient_bytes
from hops_calib.model.terms.optimizer import rank_parameters
from hops_calib.model.terms.parallel import tp_collectives
from hops_calib.sim.schedules import COMPUTE, build_programs
from hops_calib.timeline import OPTIMIZER, PHASES

REPO = Path(__file__).resolve().parents[2]
CAPTURES = sorted(p.name for p in (REPO / "traces").iterdir() if p.is_dir() and ("_t2" in p.name or "_d2" in p.name))


@pytest.fixture(scope="module")
def store():
    return open_store(REPO / "fixtures")


# Held out on purpose (seen only through the audited report); every other parallel capture is for fitting.
HELD_OUT = {f"cpu_1f1b_{kind}_l4_h256_s128_m4_run1" for kind in ("t2", "d2", "t2d2")}


def test_the_parallel_captures_are_shipped_and_ingested(store):
    assert {name.split("_")[2] for name in CAPTURES} == {"t2", "d2", "t2d2"}
    for name in CAPTURES:
        spec = store.load(name).spec
        assert (spec.tp, spec.dp) == {"t2": (2, 1), "d2": (1, 2), "t2d2": (2, 2)}[name.split("_")[2]]
    index = store.index().set_index("id")["split"]
    assert HELD_OUT <= set(CAPTURES)
    assert {name for name in CAPTURES if index[name] == "test"} == HELD_OUT
    # train holds tensor parallelism in two shapes, data parallelism and both together
    train = [name for name in CAPTURES if index[name] == "train"]
    kinds = [name.split("_")[2] for name in train]
    assert kinds.count("t2") >= 2 and "d2" in kinds and "t2d2" in kinds


def test_a_fresh_ingest_of_traces_keeps_every_split(store, tmp_path):
    """README's first command on a fresh clone (`ingest traces --fixtures fixtures`, no --split) keeps each shipped
    run in its stored split, whatever a hash of its group would say (several parallel groups would hash the other
    way): the store's index and fixture.json keep it."""
    from typer.testing import CliRunner

    from hops_calib.cli import app

    copy = tmp_path / "fixtures"
    shutil.copytree(REPO / "fixtures", copy)
    before = dict(store.index()[["id", "split"]].itertuples(index=False))
    result = CliRunner().invoke(app, ["ingest", str(REPO / "traces"), "--fixtures", str(copy), "--json"])
    assert result.exit_code == 0, result.output
    assert dict(open_store(copy).index()[["id", "split"]].itertuples(index=False)) == before
    assert {run["split"] for run in json.loads(result.stdout)["runs"]} <= {"train", "test"}


@pytest.mark.parametrize("name", CAPTURES)
def test_captured_collectives_are_the_simulated_ones(store, name):
    fixture = store.load(name)
    spec = fixture.spec
    summary = {entry["stage"]: entry for entry in fixture.quality["collectives"]}
    context = load_model().context(spec)
    for stage in range(spec.pp):
        captured = {(row["phase"], row["collective"], row["bytes"]): row["count"]
                    for row in summary[stage]["per_microbatch"] if row["group"] == "tp"}
        expected = {(phase, op, nbytes): count
                    for phase, counts in tp_collectives(spec, stage, spec.layers_per_stage[stage]).items()
                    for (op, nbytes), count in counts.items()}
        assert captured == expected, f"{name} stage {stage}"
        reductions = summary[stage]["per_iteration"]
        if spec.dp == 1:
            assert reductions == []
            continue
        # one all-reduce of the rank's gradients (fp32 here) per iteration, after its last backward and before
        # its optimizer step: where the simulator puts it without --overlap-grad-reduce
        (reduction,) = reductions
        assert (reduction["collective"], reduction["group"], reduction["count"]) == ("all_reduce", "dp", 1.0)
        assert reduction["placement"] == "after_last_backward"
        assert reduction["bytes"] == rank_parameters(context, stage) * gradient_bytes(spec)


@pytest.mark.parametrize("name", CAPTURES)
def test_every_rank_runs_the_simulated_1f1b_order(name):
    run = REPO / "traces" / name
    order = defaultdict(list)
    for path in sorted((run / "megatron_trace").glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["event_type"] == "compute" and event["phase"] != OPTIMIZER:
                order[(event["iteration"], event["rank"], event["stage"])].append(
                    (event["start_wall_ns"], event["phase"], event["microbatch"]))
    ranks = {rank for _, rank, _ in order}
    stages = 1 + max(stage for _, _, stage in order)
    microbatches = 1 + max(mb for found in order.values() for _, phase, mb in found if phase == "FORWARD")
    programs = build_programs("1f1b", stages, 1, microbatches)
    simulated = [[(PHASES[op[1]], op[3]) for op in ops if op[0] == COMPUTE] for ops in programs.per_rank]
    assert len(ranks) > stages
    for (iteration, rank, stage), found in order.items():
        assert [(phase, mb) for _, phase, mb in sorted(found)] == simulated[stage], (name, iteration, rank)


def test_capture_configuration_of_tensor_and_data_parallelism():
    config = CaptureConfig(pp=2, tp=2, dp=2, layers=4, hidden=256, heads=4, seq=128, microbatches=4)
    config.validate()
    args = config.megatron_args()
    assert args.startswith("torchrun --nproc-per-node 8 pretrain_gpt.py")
    assert "--tensor-model-parallel-size 2" in args and "--global-batch-size 8" in args
    assert "--tp=2" in config.cli_args() and "--dp=2" in config.cli_args()
    assert "--tp" not in " ".join(CaptureConfig().cli_args())
    with pytest.raises(CaptureConfigError, match="--heads: 6 is not divisible by --tp 4"):
        CaptureConfig(pp=2, tp=4, hidden=384, heads=6).validate()
    with pytest.raises(CaptureConfigError, match="megatron engine only"):
        CaptureConfig(pp=2, dp=2, engine="torch", schedule="gpipe").validate()
