"""Per-device values a candidate can add (`candidate new TERM --device TYPE`), the optimizer's bytes per parameter
and the between-iteration host time among them, priced on the shipped CPU captures."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.loop.candidate import read_candidate
from hops_calib.loop.model_files import load_model
from hops_calib.model.predict import predict
from hops_calib.store import FixtureStore

REPO = Path(__file__).resolve().parents[2]


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def scaffold(tmp_path: Path, term: str, name: str, keep: dict[str, float]) -> Path:
    """`candidate new TERM --device cpu` offers the `keep` parameters; the candidate keeps only them, set so."""
    written = cli("candidate", "new", term, "--device", "cpu", "--dir", tmp_path, "--id", f"{name}-scaffold")
    assert written.exit_code == 0, written.output
    assert set(keep) <= read_names(tmp_path / f"{name}-scaffold.toml")
    path = tmp_path / f"{name}.toml"
    path.write_text(f'id = "{name}"\nhypothesis = "h"\ngrounding = "g"\n\n[change]\naction = "set"\nterm = "{term}"\n'
                    "[change.params]\n" + "".join(f'"{key}" = {value!r}\n' for key, value in keep.items()))
    return path


def read_names(path: Path) -> set[str]:
    """The parameter names the scaffold lists under [change.params]."""
    text = path.read_text().split("[change.params]", 1)[1]
    return {line.split(" = ")[0].strip('"') for line in text.splitlines() if " = " in line}


def cpu_runs():
    store = FixtureStore(REPO / "fixtures")
    return [store.load(i) for i in store.ids("train")][:4]


def test_candidate_new_writes_new_per_device_overrides_and_refuses_unknown_types(tmp_path):
    written = cli("candidate", "new", "optimizer_step", "--device", "a100", "--dir", tmp_path, "--id", "o")
    assert written.exit_code == 0, written.output
    names = read_names(tmp_path / "o.toml")
    # every per-device parameter gets an a100 line; the ones with an a100 value already keep theirs
    assert {"bytes_per_parameter@a100", "fixed_ms@a100", "per_layer_ms@a100", "memory_efficiency@a100"} <= names
    assert (tmp_path / "o.toml").read_text().count('"memory_efficiency@a100"') == 1
    unknown = cli("candidate", "new", "optimizer_step", "--device", "v100", "--dir", tmp_path, "--json")
    assert unknown.exit_code == 2 and '"field": "--device"' in unknown.stdout
    shared_only = cli("candidate", "new", "gradient_sync", "--device", "a100", "--dir", tmp_path, "--json")
    assert shared_only.exit_code == 2 and "no parameter that takes a per-device value" in shared_only.stdout


def test_host_time_between_iterations_per_device_prices_each_rank(tmp_path):
    model = load_model(None)
    host = model.active("iteration_host_overhead").params()["host_ms"]
    same = read_candidate(scaffold(tmp_path, "iteration_host_overhead", "same", {"host_ms@cpu": host + 0.0}))
    more = read_candidate(scaffold(tmp_path, "iteration_host_overhead", "more", {"host_ms@cpu": host + 5.0}))
    assert set(more.change.params) == {"host_ms@cpu"}
    for fixture in cpu_runs():
        base = predict(fixture.spec, model).metrics
        # the device's own value, equal to the shared one: the same iterations
        assert predict(fixture.spec, same.apply(model)).metrics.iteration_time_ms == pytest.approx(
            base.iteration_time_ms, rel=1e-12)
        # 5 ms more on every (cpu) rank between its step and its next iteration: every iteration 5 ms longer
        longer = predict(fixture.spec, more.apply(model)).metrics
        assert longer.iteration_time_ms - base.iteration_time_ms == pytest.approx(5.0, abs=1e-6)


def test_bytes_per_parameter_per_device_scales_the_optimizer_traffic(tmp_path):
    model = load_model(None)
    params = model.active("optimizer_step").params()
    shared = params["bytes_per_parameter"]
    double = read_candidate(scaffold(tmp_path, "optimizer_step", "bpp", {"bytes_per_parameter@cpu": 2 * shared}))
    for fixture in cpu_runs():
        before = model.pipeline(fixture.spec).optimizer_ms
        after = double.apply(model).pipeline(fixture.spec).optimizer_ms
        fixed = params.get("fixed_ms@cpu", params["fixed_ms"])
        layers = [sum(fixture.spec.layers_per_stage[r:r + 1]) for r in range(fixture.spec.pp)]
        per_layer = params.get("per_layer_ms@cpu", params["per_layer_ms"])
        # the traffic part (bytes per parameter over the bandwidth) doubles; the fixed and per-layer parts do not
        for rank, (was, now) in enumerate(zip(before, after)):
            traffic = was - fixed - per_layer * layers[rank]
            assert traffic > 0 and now - was == pytest.approx(traffic, rel=1e-9)
