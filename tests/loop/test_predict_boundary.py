"""Rule 1: a prediction sees the spec, never the answer. Proven on a real run whose events are rewritten."""

from __future__ import annotations

import inspect
import json
import random
import shutil

import pytest

from hops_calib.loop.model_files import load_model
from hops_calib.model.predict import Prediction, predict
from hops_calib.spec import Spec

RUN = "exp2_8_h100_pair_pp2_run63"


def rewrite_events(job_dir, scale: float, seed: int) -> None:
    """Stretch every event's times by `scale` about the run's first event, and shuffle each rank file's lines."""
    files = sorted((job_dir / "megatron_trace").glob("rank*.jsonl"))
    events = {path: [json.loads(line) for line in path.read_text().splitlines() if line.strip()] for path in files}
    t0 = min(e["start_wall_ns"] for rows in events.values() for e in rows)
    rng = random.Random(seed)
    for path, rows in events.items():
        for event in rows:
            event["start_wall_ns"] = t0 + int((event["start_wall_ns"] - t0) * scale)
            event["end_wall_ns"] = t0 + int((event["end_wall_ns"] - t0) * scale)
            event["duration_ms"] = (event["end_wall_ns"] - event["start_wall_ns"]) / 1e6
        rng.shuffle(rows)
        path.write_text("".join(json.dumps(e) + "\n" for e in rows))


@pytest.fixture(scope="module")
def twin_fixtures(shared_runs, tmp_path_factory):
    """The same job directory ingested twice: once as recorded, once with its events stretched and shuffled."""
    from hops_calib.store import FixtureStore
    from hops_calib.store.ingest import ingest

    root = tmp_path_factory.mktemp("twins")
    original, rewritten = root / "src" / RUN, root / "src" / f"{RUN}_rewritten"
    shutil.copytree(shared_runs / RUN, original)
    shutil.copytree(shared_runs / RUN, rewritten)
    rewrite_events(rewritten, scale=1.5, seed=7)
    store = FixtureStore(root / "fixtures")
    report = ingest([root / "src"], store, split="train")
    assert report.ok, [o.error for o in report.rejected]
    ids = store.ids()
    assert len(ids) == 2
    return [store.load(i) for i in ids]


def test_rewriting_the_events_changes_the_truth_but_not_the_spec_or_the_prediction(twin_fixtures):
    a, b = twin_fixtures
    # The events really differ: the rewritten run is 1.5x slower.
    assert b.truth.metrics.window_ms == pytest.approx(1.5 * a.truth.metrics.window_ms, rel=1e-3) or \
        a.truth.metrics.window_ms == pytest.approx(1.5 * b.truth.metrics.window_ms, rel=1e-3)
    spec_a, spec_b = a.spec.to_dict(), b.spec.to_dict()
    assert spec_a.pop("run_id") != spec_b.pop("run_id")
    assert spec_a == spec_b
    model = load_model()
    pa, pb = predict(a.spec, model), predict(b.spec, model)
    assert pa.metrics == pb.metrics and pa.pipeline == pb.pipeline


def test_predict_takes_a_spec_and_a_model_and_refuses_a_fixture(twin_fixtures):
    parameters = inspect.signature(predict).parameters
    assert list(parameters) == ["spec", "model", "schedule"]
    assert parameters["spec"].annotation in (Spec, "Spec")
    fixture = twin_fixtures[0]
    with pytest.raises(TypeError, match="takes a Spec.*not a Fixture"):
        predict(fixture, load_model())
    with pytest.raises(TypeError, match="takes a Model"):
        predict(fixture.spec, fixture)
    assert isinstance(predict(fixture.spec, load_model()), Prediction)
