"""One launch priced three ways: a row of the published vTrain table, a Megatron training log of the same launch, and
the job directory `hops-calib job from-log` makes of that log. `predict ID` of the row and of the log give what
`predict --job DIR` gives (the prediction, the time by kind per stage, the memory per GPU, what they are priced
with) and the log's timers; where the inputs differ the output names it.

The log is written with the format strings of the code that prints it (tests/megatron_log_text.py): the row's
launch in Megatron's arguments block, its measured iteration time in the iteration lines, and two timers (their
values chosen by this test, as shares of that time: Megatron's timers are not in the published table)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hops_calib.cli import app
from tests.conftest import need_public_runs
from tests.megatron_log_text import arguments_block, megatron_lm_iteration, padded_vocab_line, timers_block, write_log


def _cli(*args) -> tuple[int, dict]:
    out = CliRunner().invoke(app, [str(a) for a in args])
    try:
        return out.exit_code, json.loads(out.stdout)
    except json.JSONDecodeError:
        raise AssertionError(out.output) from None


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """The vTrain store (train/test split auto), one train row of t 2 x p 2 on one node, and a log of its launch
    beside hops.base.yaml and the publishers' all-reduce tables (calibration/allreduce/, linked in place)."""
    from hops_calib.store import FixtureStore
    from hops_calib.store.ingest import ingest

    table = need_public_runs("vtrain", "ground_truth_single.csv")
    root = tmp_path_factory.mktemp("launch")
    rows = FixtureStore(root / "vtrain")
    assert ingest([table], rows, split="auto").ok
    index = rows.index()
    row = index[(index.split == "train") & (index.tp == 2) & (index.pp == 2) & (index.dp == 1)].iloc[0]
    fixture = rows.load(row.id)
    runs = root / "runs"
    (runs / "calibration").mkdir(parents=True)
    (runs / "calibration" / "allreduce").symlink_to(table.parent / "allreduce-a100", target_is_directory=True)
    (runs / "hops.base.yaml").write_text("hardware: {gpu: a100, gpus_per_node: 8}\n")
    args = {**fixture.launch, "log_interval": 10, "train_iters": 100, "timing_log_level": 1,
            "timing_log_option": "max"}
    args.pop("padded_vocab_size")  # Megatron computes it: the tokenizer's line gives it
    lines = [*arguments_block(args), padded_vocab_line(args["vocab_size"], fixture.launch["padded_vocab_size"])]
    seconds = fixture.truth.metrics.iteration_time_ms / 1000.0
    for k in range(6):
        iteration = (k + 1) * 10
        lines.append(megatron_lm_iteration(iteration, 100, iteration * args["global_batch_size"], seconds,
                                           batch_size=args["global_batch_size"]))
        lines += timers_block("max", {"forward-backward": [0.97 * seconds * 1000], "optimizer": [0.01 * seconds * 1000]})
    log = runs / "t2p2_run.log"
    write_log(log, lines)
    logs = FixtureStore(root / "logs")
    assert ingest([log], logs).ok
    return {"rows": rows.root, "row": row.id, "logs": logs.root, "log": log, "root": root, "seconds": seconds}


def test_a_row_a_log_and_its_job_directory_give_one_prediction(launch):
    code, from_row = _cli("predict", launch["row"], "--fixtures", launch["rows"], "--json")
    assert code == 0
    code, from_log = _cli("predict", "t2p2_run", "--fixtures", launch["logs"], "--json")
    assert code == 0
    job = launch["root"] / "job"
    code, converted = _cli("job", "from-log", launch["log"], job, "--json")
    assert code == 0 and converted["agreement"]["same_prediction"] and converted["agreement"]["differs"] == []
    assert (job / "megatron_args.txt").read_text().startswith("torchrun --nproc-per-node 4 pretrain_gpt.py ")
    assert sorted(p.name for p in (job / "calibration" / "allreduce").iterdir()) == sorted(
        p.name for p in (launch["log"].parent / "calibration" / "allreduce").iterdir() if p.name.startswith("AR_"))
    code, from_job = _cli("predict", "--job", job, "--fixtures", launch["rows"], "--json")
    assert code == 0
    ms = from_job["predictions"][0]["iteration_time_ms"]
    assert from_row["predicted"]["iteration_time_ms"] == pytest.approx(ms, rel=1e-12)
    assert from_log["predicted"]["iteration_time_ms"] == pytest.approx(ms, rel=1e-12)
    for key in ("breakdown_ms_per_iteration", "memory", "fits", "pricing_inputs"):
        assert from_row[key] == from_log[key] == from_job[key], key
    # what predict --job prints of a launch, predict ID prints of the stored run: time by kind, memory, MFU/HFU
    assert {"compute", "recompute", "tp_comm", "p2p", "optimizer", "host"} <= set(from_log["breakdown_ms_per_iteration"][0])
    # vTrain's runs are read without recomputation (hops_calib/trace/vtrain.py MEASURED)
    assert from_log["breakdown_ms_per_iteration"][0]["recompute"] == 0
    rates = from_log["predicted_rates"]
    assert rates["hfu"] == pytest.approx(rates["mfu"]) and rates["mfu"] > 0  # nothing recomputed: HFU is MFU
    # the log's timers beside the simulation's; the table logged none
    timers = {t["timer"]: t for t in from_log["timers"]}
    assert timers["forward-backward"]["logged_ms"] == pytest.approx(round(0.97 * launch["seconds"] * 1000, 2))
    assert timers["forward-backward"]["predicted_ms"] > 0 and from_row["timers"] == []
    text = CliRunner().invoke(app, ["predict", "t2p2_run", "--fixtures", str(launch["logs"])]).output
    assert "peak memory per GPU" in text and "Megatron's logged timers" in text and "priced with:" in text


def test_what_differs_between_two_prices_of_a_launch_is_named(launch, tmp_path):
    """The job directory without the node's all-reduce tables and link benchmark: its one-node launch keeps the hop
    on the node, priced by the catalog's NVLink (predict --job says so), and the comparison with the stored run
    names the collective tables and the link they gave."""
    from hops_calib.spec import build_spec
    from hops_calib.store import FixtureStore
    from hops_calib.whatif.job import pricing_differences, pricing_inputs

    job = tmp_path / "job"
    assert _cli("job", "from-log", launch["log"], job, "--json")[0] == 0
    shutil.rmtree(job / "calibration")
    code, priced = _cli("predict", "--job", job, "--fixtures", launch["rows"], "--json")
    assert code == 0 and any("no link benchmark" in note and "NVLink" in note for note in priced["notes"])
    stored = FixtureStore(launch["logs"]).load("t2p2_run").spec
    differs = pricing_differences(pricing_inputs(stored), pricing_inputs(build_spec(job)))
    assert "collective_tables" in differs and "link_benchmark" in differs and "transport" not in differs


def test_from_log_refuses_a_full_directory_and_leaves_nothing_on_error(launch, tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    (job / "mine.txt").write_text("keep me\n")
    code, out = _cli("job", "from-log", launch["log"], job, "--json")
    assert code == 2 and out["error"]["field"] == "DIR" and [p.name for p in job.iterdir()] == ["mine.txt"]
    # a log cut before its arguments block ends: refused naming the file and line, and nothing written
    cut = tmp_path / "cut.log"
    cut.write_text("\n".join(launch["log"].read_text().splitlines()[:5]) + "\n")
    shutil.copy(launch["log"].parent / "hops.base.yaml", tmp_path / "hops.base.yaml")
    code, out = _cli("job", "from-log", cut, tmp_path / "new", "--json")
    assert code == 2 and out["error"]["file"].endswith("cut.log") and out["error"]["line"] is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.log", "hops.base.yaml", "job"]
    # an empty directory is taken
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out = _cli("job", "from-log", launch["log"], empty, "--json")
    assert code == 0 and (empty / "megatron_args.txt").is_file() and Path(out["job"]) == empty
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_predict_of_a_capture_gives_its_job_directory_s_breakdown_and_memory(repo_root):
    run = "cpu_1f1b_l4_h512_s256_m4_run1"
    code, stored = _cli("predict", run, "--fixtures", repo_root / "fixtures", "--json")
    assert code == 0
    code, job = _cli("predict", "--job", repo_root / "traces" / run, "--fixtures", repo_root / "fixtures", "--json")
    assert code == 0
    for key in ("breakdown_ms_per_iteration", "memory", "pricing_inputs"):
        assert stored[key] == job[key], key
    assert stored["timers"] == []  # a capture logs no Megatron timers
