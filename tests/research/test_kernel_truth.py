"""Kernel truth in the loop (hops_calib.research.kernel_truth): the shipped profiled CPU captures (profiles/), read
from their PyTorch profiler traces alone, against the kernels `decoder_kernels` prices; `observe --json`'s
per-class section and `tune decoder_kernels --objective components` fitting the term to the kernels' times."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[2]
PROFILED = sorted((REPO / "profiles").glob("*_prof_run*"))


@pytest.fixture(scope="module")
def kineto_store(tmp_path_factory):
    """A store of the profiled captures ingested from their profiler traces alone (train split)."""
    from hops_calib.store import FixtureStore
    from hops_calib.store.ingest import ingest

    root = tmp_path_factory.mktemp("kernel_truth")
    for job in PROFILED:
        shutil.copytree(job, root / "jobs" / job.name, ignore=shutil.ignore_patterns("megatron_trace"))
    store = FixtureStore(root / "store")
    report = ingest([root / "jobs"], store, split="train")
    assert report.ok, [o.error for o in report.rejected]
    return store


def _observe_json(store_root: Path) -> dict:
    from hops_calib.cli import app

    result = CliRunner().invoke(app, ["observe", "--fixtures", str(store_root), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_observe_json_compares_kernel_classes_and_gemm_shapes(kineto_store):
    from hops_calib.cli import app

    section = _observe_json(kineto_store.root)["kernel_classes"]
    assert sorted(section["runs"]) == sorted(p.name for p in PROFILED)
    classes = {c["kernel_class"]: c for c in section["classes"]}
    # measured: what `fixtures show --json` lists, summed over the phases the kernel model prices
    measured_gemm = 0.0
    for job in PROFILED:
        shown = CliRunner().invoke(app, ["fixtures", "show", job.name, "--fixtures", str(kineto_store.root), "--json"])
        assert shown.exit_code == 0, shown.output
        measured_gemm += sum(k["per_iteration_ms"] for k in json.loads(shown.stdout)["kernels"]
                             if k["kernel_class"] == "gemm" and k["phase"] in ("FORWARD", "BACKWARD"))
    assert classes["gemm"]["measured_ms"] == pytest.approx(measured_gemm)
    assert classes["gemm"]["priced"] and classes["gemm"]["predicted_ms"] > 0
    assert classes["gemm"]["bias_ms"] == pytest.approx(classes["gemm"]["predicted_ms"] - measured_gemm)
    assert "gemm_efficiency" in classes["gemm"]["fixed_by"]
    assert {"norm", "softmax", "elementwise"} <= {label for label, c in classes.items() if c["priced"]}
    assert not classes["other"]["priced"]  # the trace's catch-all: nothing in the model prices it
    # GEMMs meet by shape: the decoder layer's projections, forward and both gradients, from the launch's sizes
    fixture = kineto_store.load(next(p.name for p in PROFILED if "1f1b" in p.name))
    seq, hidden, ffn = fixture.spec.model.seq_length, fixture.spec.model.hidden_size, fixture.spec.model.ffn_hidden_size
    rows = {(r["run"], r["stage"], r["phase"], tuple(r["batch_m_n_k"])): r for r in section["gemm_shapes"]["rows"]}
    for phase, shape in (("FORWARD", (1, seq, 3 * hidden, hidden)), ("FORWARD", (1, seq, hidden, ffn)),
                         ("BACKWARD", (1, seq, hidden, 3 * hidden)), ("BACKWARD", (1, 3 * hidden, hidden, seq)),
                         ("BACKWARD", (1, ffn, hidden, seq))):
        row = rows[(fixture.id, 0, phase, shape)]
        assert row["measured_ms"] > 0 and row["predicted_ms"] is not None and row["predicted_ms"] > 0, (phase, shape)
    matched = section["gemm_shapes"]
    assert matched["matched_measured_ms"] > 0.9 * classes["gemm"]["measured_ms"]  # nearly all GEMM time meets


def test_a_store_without_kernel_truth_has_no_kernel_section(tmp_path):
    from hops_calib.store import FixtureStore
    from hops_calib.store.ingest import ingest

    store = FixtureStore(tmp_path / "store")
    # its event logs alone (--source events): truth from them, no kernels
    assert ingest([PROFILED[0]], store, split="train", source="events").ok
    assert _observe_json(store.root)["kernel_classes"] is None


def test_tune_components_fits_decoder_kernels_to_the_kernels(kineto_store):
    from hops_calib.research.kernel_truth import kernel_section
    from hops_calib.research.tune import load_problem

    problem = load_problem("decoder_kernels", kineto_store.root, None, "components")
    assert problem.kernel_runs == len(PROFILED) and problem.identity()["kernel_truth_runs"] == len(PROFILED)
    fixtures = [kineto_store.load(p.name) for p in PROFILED]
    start = problem.model_with({"use_tables": 0.0})
    before = {c["kernel_class"]: c for c in kernel_section(fixtures, start)["classes"]}
    # the one GEMM efficiency that makes the GEMMs' predicted time their measured time (GEMM time ~ 1 / efficiency
    # on the default curve): the GEMM class's bias goes, the memory-bound classes do not move
    efficiency = 0.8 / before["gemm"]["scale_to_fit"]
    fitted = problem.model_with({"use_tables": 0.0, "gemm_efficiency": efficiency})
    after = {c["kernel_class"]: c for c in kernel_section(fixtures, fitted)["classes"]}
    assert abs(before["gemm"]["bias_pct"]) > 20 and abs(after["gemm"]["bias_pct"]) < 5
    for label in ("norm", "softmax", "elementwise"):
        assert after[label]["predicted_ms"] == pytest.approx(before[label]["predicted_ms"])
    assert problem.component_mape(fitted) < problem.component_mape(start) - 10


def test_tune_cli_components_on_kernel_truth(kineto_store):
    from hops_calib.cli import app

    result = CliRunner().invoke(app, ["tune", "decoder_kernels", "--objective", "components", "--fixtures",
                                      str(kineto_store.root), "--trials", "6", "--only", "gemm_efficiency",
                                      "--off-record", "--json"])
    out = json.loads(result.stdout)
    assert result.exit_code == (0 if out["candidate"] else 1), result.output  # 1: no candidate passed the gate
    current = next(t for t in out["trials"] if t["number"] == 0)  # the current values, the study's first trial
    assert current["params"] == {"gemm_efficiency": 0.8}
    assert current["objectives"] == [current["score"]["component_mape_pct"]]
    scores = [t["score"]["component_mape_pct"] for t in out["front"]]
    # the CPU's GEMMs run slower than the default curve's 0.8 of peak: a lower efficiency misprices less
    assert scores == sorted(scores) and scores[0] < current["objectives"][0]
    assert out["front"][0]["params"]["gemm_efficiency"] < 0.8
