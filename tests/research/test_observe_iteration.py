"""observe on a store of runs measured at iteration level (the published vTrain A100 table, its train split): the
contributors are the terms of each run's predicted iteration, fitted to the runs' iteration residuals within each
configuration group, in the event stores' schema (hops_calib/research/observe_iteration.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from hops_calib.cli import app
from tests.conftest import need_public_runs


@pytest.fixture(scope="module")
def observation(vtrain):
    from hops_calib.research.observe import observe

    return observe(vtrain.root)


def test_every_run_s_terms_add_up_to_its_predicted_iteration(observation):
    from hops_calib.research.observe_iteration import ITERATION_QUANTITIES

    for run in observation.runs:
        terms = run.breakdown_ms
        assert set(terms) == set(ITERATION_QUANTITIES)
        assert sum(terms.values()) == pytest.approx(run.prediction.metrics.iteration_time_ms, rel=1e-9)
        # vTrain's runs are read without recomputation (hops_calib/trace/vtrain.py MEASURED): nothing runs twice
        assert terms["recompute"] == 0 and terms["compute"] > 0
        assert (terms["tp_comm"] > 0) == (run.spec.tp > 1)


def test_observe_names_contributors_by_term_and_configuration_on_the_train_split(vtrain, observation):
    train = set(vtrain.ids("train"))
    assert {r.id for r in observation.runs} <= train and len(observation.runs) == len(train)
    ranked = observation.ranked
    assert ranked and all(c.level == "iteration" and c.implied for c in ranked)
    assert {"tp", "dp", "pp", "micro_batch", "hidden"} <= {c.dimension for c in ranked}
    assert {"compute", "tp_comm", "host", "bubble", "optimizer"} <= {c.quantity for c in ranked}
    fixable = [c.fixable_mape_pp for c in ranked]
    assert fixable == sorted(fixable, reverse=True) and fixable[0] > 0
    for c in ranked[:20]:
        assert {r["id"] for r in c.dominant_runs} <= train and set(c.carriers) <= train
        assert -1.0 <= c.scale <= 1.0
        assert c.residual_ms_mean == pytest.approx(c.scale * c.predicted_ms_mean)
        assert c.real_ms_mean == pytest.approx(c.predicted_ms_mean - c.residual_ms_mean)
        assert c.contribution_pp >= c.fixable_mape_pp - 1e-9  # a whole residual taken out removes at least as much
    # compute is priced by the decoder's terms, and every contributor of it names a parameter that moves it there
    compute = [c for c in ranked if c.quantity == "compute"]
    assert compute and all(any(t["applies"] for t in c.terms) for c in compute)
    assert not [c for c in ranked if c.quantity == "bubble" and c.terms and not any(t["applies"] for t in c.terms)]


def test_fixable_is_the_suite_mape_the_fitted_scale_saves(observation):
    """Recomputed from the runs: each member's predicted iteration `scale x term` shorter, scored again."""
    runs = {r.id: r for r in observation.runs}
    n = len(runs)
    for c in observation.ranked[:5]:
        saved = 0.0
        for run_id, _ in c.members:
            run = runs[run_id]
            period = run.prediction.metrics.iteration_time_ms
            error = run.score.throughput_error_pct
            after = ((1 + error / 100) * period / (period - c.scale * run.breakdown_ms[c.quantity]) - 1) * 100
            saved += (abs(error) - abs(after)) / n
        assert saved == pytest.approx(c.fixable_mape_pp, rel=1e-9, abs=1e-12)
        # the fit: a least-absolute-deviation scale, so no other scale of the term saves more on those members
        members = [runs[m] for m, _ in c.members]
        real = np.array([r.real_metrics.iteration_time_ms for r in members])
        x = np.array([r.breakdown_ms[c.quantity] for r in members]) / real
        y = np.array([r.prediction.metrics.iteration_time_ms for r in members]) / real - 1
        if abs(c.scale) < 1.0:
            best, lower, upper = (float(np.abs(y - a * x).sum()) for a in (c.scale, c.scale - 0.01, c.scale + 0.01))
            assert best <= min(lower, upper) + 1e-12


def test_observe_json_on_the_vtrain_store_has_the_event_stores_schema(vtrain, repo_root):
    out = CliRunner().invoke(app, ["observe", "--fixtures", str(vtrain.root), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["status"] == "ok" and data["contributors"] and data["iteration_level_runs"] == data["n_fixtures"]
    events = json.loads(CliRunner().invoke(app, ["observe", "--fixtures", str(repo_root / "fixtures"),
                                                 "--json"]).stdout)
    assert set(data["contributors"][0]) == set(events["contributors"][0])
    assert {"level", "scale", "implied"} <= set(data["fields"])
    assert all(run["predicted_terms_ms"] for run in data["runs"])
    text = CliRunner().invoke(app, ["observe", "--fixtures", str(vtrain.root)])
    assert text.exit_code == 0 and "Largest contributors (a term within one group)" in text.output
    # the held-out promise holds on this store too
    refused = CliRunner().invoke(app, ["observe", "--fixtures", str(vtrain.root), "--split", "test", "--json"])
    assert refused.exit_code == 2 and json.loads(refused.stdout)["status"] == "invalid"


def test_ingest_of_the_vtrain_folder_names_the_table_to_ingest(tmp_path):
    """The folder holds the table beside its licence and README, no job directory: ingest names the file."""
    table = need_public_runs("vtrain", "ground_truth_single.csv")
    out = CliRunner().invoke(app, ["ingest", str(table.parent), "--fixtures", str(tmp_path / "fx"), "--json"])
    assert out.exit_code == 2
    [run] = json.loads(out.stdout)["runs"]
    assert run["error"].endswith(f"ingest them by name ({table})")


def test_tune_components_on_runs_measured_per_iteration_is_refused_not_nan(vtrain):
    """Every vTrain run is one iteration time: the components objective has nothing to fit, so tune says so (exit
    2, naming the store and the objective) instead of running trials that all score NaN."""
    out = CliRunner().invoke(app, ["tune", "decoder_roofline", "--objective", "components", "--fixtures",
                                   str(vtrain.root), "--trials", "2", "--json"])
    assert out.exit_code == 2, out.output
    data = json.loads(out.stdout)
    assert data["status"] == "invalid" and data["error"]["field"] == "objective"
    assert str(vtrain.root) in data["error"]["message"] and "--objective suite" in data["error"]["hint"]
