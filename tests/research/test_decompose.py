"""`decompose`: iteration times cut into a layer's, a microbatch's and an iteration's time, on a closed form and on
the public vTrain runs (read from ../shared, never vendored)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.loop.model_files import load_model
from hops_calib.research.decompose import Sample, decompose, layer_bound
from hops_calib.spec import Hardware, spec_from_args


def launch(layers: int, batch: int, micro: int, dp: int, tp: int = 2) -> dict:
    return {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1, "data_parallel_size": dp,
            "world_size": tp * dp, "num_layers": layers, "hidden_size": 1024, "num_attention_heads": 16,
            "seq_length": 1024, "max_position_embeddings": 1024, "micro_batch_size": micro,
            "global_batch_size": batch, "vocab_size": 50257, "fp16": True, "transformer_impl": "local"}


def spec(layers: int, batch: int, micro: int, dp: int, tp: int = 2):
    return spec_from_args(launch(layers, batch, micro, dp, tp), "test", run_id=f"l{layers}_g{batch}_m{micro}_d{dp}",
                          iterations=2, hardware=Hardware(gpu="a100", gpus_per_node=8))


# a closed form: T = a(d) + b(d) L + m (c(mb) + x(mb) L), its coefficients chosen
A, B = {1: 5.0, 2: 9.0}, {1: 0.2, 2: 0.7}
C, X = {1: 2.5, 2: 4.0}, {1: 3.0, 2: 3.4}


def closed_form(s) -> float:
    d, mb = s.dp, s.model.micro_batch_size
    return A[d] + B[d] * s.model.num_layers + s.microbatches * (C[mb] + X[mb] * s.model.num_layers)


def test_decompose_recovers_the_coefficients_of_a_closed_form():
    specs = [spec(layers, batch, micro, dp) for layers in (12, 16, 24) for batch in (8, 16, 32) for micro in (1, 2)
             for dp in (1, 2)]
    samples = [Sample(s.run_id, s, closed_form(s), 1.1 * closed_form(s)) for s in specs]
    result = decompose(samples)
    assert len(result.families) == 1 and not result.not_identified
    family = result.families[0]
    assert family.runs == len(specs) and family.residual_max_pct < 1e-9
    for row in family.rows:
        assert row.layer_ms == pytest.approx(X[row.micro_batch])
        assert row.microbatch_ms == pytest.approx(C[row.micro_batch])
        assert row.predicted_layer_ms == pytest.approx(1.1 * X[row.micro_batch])
        assert row.layer_error_pct == pytest.approx(10.0)


def test_the_error_is_cut_into_the_part_that_carries_it():
    """A model wrong only in its layer time (x 10 % slow) carries its whole error in the layers' part; one 10 % slow
    everywhere splits it by each part's share of the time, and the parts add up to the mean error."""
    specs = [spec(layers, batch, micro, dp) for layers in (12, 16, 24) for batch in (8, 16, 32) for micro in (1, 2)
             for dp in (1, 2)]
    slow_layers = {mb: 1.1 * x for mb, x in X.items()}

    def form(s, x):
        d, mb = s.dp, s.model.micro_batch_size
        return A[d] + B[d] * s.model.num_layers + s.microbatches * (C[mb] + x[mb] * s.model.num_layers)

    layers_only = decompose([Sample(s.run_id, s, form(s, X), form(s, slow_layers)) for s in specs]).error_by_part()
    share = [s.microbatches * X[s.model.micro_batch_size] * s.model.num_layers / form(s, X) for s in specs]
    assert layers_only["layers"] == pytest.approx(10.0 * sum(share) / len(share))
    assert layers_only["microbatch"] == pytest.approx(0.0, abs=1e-9) and layers_only["iteration"] == pytest.approx(0.0, abs=1e-9)
    everywhere = decompose([Sample(s.run_id, s, form(s, X), 1.1 * form(s, X)) for s in specs]).error_by_part()
    assert sum(everywhere.values()) == pytest.approx(10.0)
    assert everywhere["layers"] == pytest.approx(layers_only["layers"])
    assert 0 < everywhere["iteration"] < everywhere["microbatch"] < everywhere["layers"]


def test_a_pipelined_closed_form_is_read_in_1f1b_slots():
    """With p stages a 1F1B iteration is a(d) + b(d) L + (m + p - 1) (c + x L / p): the fill and drain are p - 1
    more slots of the same stage time, so x (one layer's time) reads the same at any p."""
    def pipelined(layers, batch, micro, dp):
        return spec_from_args({**launch(layers, batch, micro, dp), "pipeline_model_parallel_size": 2,
                               "world_size": 4 * dp}, "test", run_id=f"p2_l{layers}_g{batch}_m{micro}_d{dp}",
                              iterations=2, hardware=Hardware(gpu="a100", gpus_per_node=8))

    def total(s) -> float:
        d, mb, p = s.dp, s.model.micro_batch_size, s.pp
        return A[d] + B[d] * s.model.num_layers + (s.microbatches + p - 1) * (C[mb] + X[mb] * s.model.num_layers / p)

    specs = [pipelined(layers, batch, micro, dp) for layers in (12, 16, 24) for batch in (8, 16, 32)
             for micro in (1, 2) for dp in (1, 2)]
    family = decompose([Sample(s.run_id, s, total(s), total(s)) for s in specs]).families[0]
    assert family.label.startswith("t2 p2 ") and family.residual_max_pct < 1e-9
    for row in family.rows:
        assert row.layer_ms == pytest.approx(X[row.micro_batch]) and row.microbatch_ms == pytest.approx(C[row.micro_batch])


def test_a_layer_faster_with_more_work_is_an_inversion_and_says_whether_the_model_follows_it():
    """Closed forms: at micro batch 2 the measured layer takes 10 % less than at 1 (an inversion); a model that
    predicts the same inversion follows it, one whose layers grow with the micro batch does not. Across widths, an
    h 2048 family whose layer is faster than the h 1024 one's at the same micro batch is an inversion too."""
    inverted = {1: 3.0, 2: 2.7}

    def form(s, x):
        d, mb = s.dp, s.model.micro_batch_size
        return A[d] + B[d] * s.model.num_layers + s.microbatches * (C[mb] + x[mb] * s.model.num_layers)

    specs = [spec(layers, batch, micro, dp) for layers in (12, 16, 24) for batch in (8, 16, 32) for micro in (1, 2)
             for dp in (1, 2)]
    followed = decompose([Sample(s.run_id, s, form(s, inverted), 1.2 * form(s, inverted)) for s in specs])
    (inversion,) = followed.inversions
    assert (inversion.less.micro_batch, inversion.more.micro_batch) == (1, 2) and inversion.why == "micro batch 1 -> 2"
    assert inversion.shortfall_pct == pytest.approx(10.0) and inversion.followed
    assert followed.inverted_runs() == len(specs) and followed.inverted_runs(followed=False) == 0
    not_followed = decompose([Sample(s.run_id, s, form(s, inverted), form(s, X)) for s in specs])
    assert [i.followed for i in not_followed.inversions] == [False]
    assert not_followed.inverted_runs(followed=False) == len(specs)
    # monotone layers: none
    assert decompose([Sample(s.run_id, s, form(s, X), form(s, X)) for s in specs]).inversions == ()

    def wide(layers, batch, micro, dp):
        return spec_from_args({**launch(layers, batch, micro, dp), "hidden_size": 2048}, "test",
                              run_id=f"w_l{layers}_g{batch}_m{micro}_d{dp}", iterations=2,
                              hardware=Hardware(gpu="a100", gpus_per_node=8))

    narrow_x, wide_x = {1: 3.0, 2: 3.4}, {1: 2.5, 2: 3.6}
    samples = [Sample(s.run_id, s, form(s, narrow_x), form(s, narrow_x)) for s in specs]
    samples += [Sample(w.run_id, w, form(w, wide_x), form(w, wide_x))
                for w in (wide(layers, batch, micro, dp) for layers in (12, 16, 24) for batch in (8, 16, 32)
                          for micro in (1, 2) for dp in (1, 2))]
    result = decompose(samples)
    (across,) = result.inversions
    assert across.why == "hidden 1024 -> 2048" and across.less.family.startswith("t2 p1 h1024")
    assert across.more.family.startswith("t2 p1 h2048") and across.more.micro_batch == 1
    assert across.shortfall_pct == pytest.approx(100 * (1 - 2.5 / 3.0))


def test_a_family_too_small_for_the_form_is_named_not_fitted():
    specs = [spec(12, 8, 1, 1), spec(16, 8, 1, 1)]
    result = decompose([Sample(s.run_id, s, closed_form(s), closed_form(s)) for s in specs])
    assert not result.families
    assert result.not_identified == ("t2 p1 h1024 s1024 a16 a100 (2 runs: one microbatch count at micro batch 1)",)


def test_layer_bound_is_its_flops_at_peak_where_the_gemms_dominate():
    """At t 1, h 2048, s 1024, micro batch 8 a layer's forward is 24 b s h^2 (1 + s / 6h) FLOPs (Megatron's
    count, `megatron/training/training.py` num_floating_point_operations); its bound is that at 312 TFLOP/s plus its
    memory-bound kernels at 2,039 GB/s, so at least the FLOPs' time and not much more."""
    big = spec_from_args({**launch(24, 32, 8, 1, tp=1), "hidden_size": 2048}, "test", run_id="big", iterations=2,
                         hardware=Hardware(gpu="a100", gpus_per_node=8))
    bound = layer_bound(big, load_model().device("a100"))
    flops_ms = 24 * 8 * 1024 * 2048**2 * (1 + 1024 / (6 * 2048)) / 312e12 * 1e3
    assert flops_ms < bound.forward_ms < 1.5 * flops_ms
    assert 2 * flops_ms < bound.backward_ms < 3 * flops_ms
    assert bound.with_recompute_ms == pytest.approx(bound.without_recompute_ms + bound.forward_ms)


def test_the_vtrain_table_is_composed_and_its_layers_did_not_recompute(vtrain):
    """The published vTrain runs without a pipeline fit the form to within a twentieth of a percent in 7 of their
    8 families and 0.7 % in the last (composed from per-component timings), and at t 1, h 2048, micro batch 8 one layer takes at most 1.1 x its least time
    with a recomputed forward: below what any A100 reaches, so those layers did not recompute."""
    out = CliRunner().invoke(app, ["decompose", "--fixtures", str(vtrain.root), "--json"])
    assert out.exit_code == 0, out.output
    families = {f["label"]: f for f in json.loads(out.output)["families"]}
    unpipelined = [f for label, f in families.items() if " p1 " in label]
    assert len(unpipelined) == 8 and all(f["residual_max_pct"] < 1.0 for f in unpipelined)
    assert sum(f["residual_max_pct"] < 0.05 for f in unpipelined) == 7
    gpu_bound = next(r for r in families["t1 p1 h2048 s1024 a16 a100"]["rows"] if r["micro_batch"] == 8)
    assert gpu_bound["over_recompute_bound"] < 1.1
    assert gpu_bound["layer_ms"] > gpu_bound["bound_without_recompute_ms"]
    # the pipelined families depart from the form by more than a real run's spread: flagged, not read as layers
    pipelined = [f for label, f in families.items() if " p1 " not in label]
    assert pipelined and all(not f["form_holds"] for f in pipelined if f["residual_max_pct"] > 1.0)
    assert all(f["form_holds"] for f in unpipelined)
    assert all(r["physical"] for f in families.values() for r in f["rows"])
    # under 1F1B's (m + p - 1) slots the pipelined families' layers are the unpipelined ones' (the table composes
    # every layout from one set of layer timings): t 1, h 2048, micro batch 8 at p 1, 2 and 4
    layer = {p: next(r["layer_ms"] for r in families[f"t1 p{p} h2048 s1024 a16 a100"]["rows"] if r["micro_batch"] == 8)
             for p in (1, 2, 4)}
    assert layer[2] == pytest.approx(layer[1], rel=0.01) and layer[4] == pytest.approx(layer[1], rel=0.01)
    text = CliRunner().invoke(app, ["decompose", "--fixtures", str(vtrain.root)])
    assert text.exit_code == 0 and "t1 p1 h2048 s1024 a16 a100: 77 runs" in text.output
    assert "so the form does not hold here" in text.output
    assert "t4 p2 h2048 s1024 a16 a100 (27 runs: one microbatch count at micro batch 8)" in text.output
    # inversions: each pair's cells are rows of the families above, the faster one with more work; the model
    # follows those at t 8 micro batch 1 (b x heads / t = 2, not a multiple of 4: megatron-core's fused softmax
    # falls back to unfused kernels, `softmax_fallback`), and none at t 1, where every layer is GPU- or host-bound
    # alike
    report = json.loads(out.output)
    rows = {(f["label"], r["micro_batch"]): r["layer_ms"] for f in families.values() for r in f["rows"]}
    assert report["inversions"]
    for inversion in report["inversions"]:
        less, more = inversion["less"], inversion["more"]
        assert rows[(less["family"], less["micro_batch"])] == less["layer_ms"] > more["layer_ms"] * 1.01
        assert rows[(more["family"], more["micro_batch"])] == more["layer_ms"]
        assert more["micro_batch"] > less["micro_batch"] or inversion["why"].startswith("hidden")
    followed = [i for i in report["inversions"] if i["followed"]]
    assert followed and all(i["less"]["family"].startswith("t8 ") and i["less"]["micro_batch"] == 1 for i in followed)
    assert not any(i["less"]["family"].startswith("t1 ") for i in report["inversions"])
    assert 0 < report["inverted_runs_not_followed"] <= report["inverted_runs"] <= report["iteration_runs"]
    assert "inversions:" in text.output and "the model does not follow" in text.output
    # where the error lives: the four parts, and the text's total is their sum
    parts = report["error_by_part"]
    assert set(parts) == {"layers", "microbatch", "iteration", "outside the form"}
    assert f"together {sum(parts.values()):+.1f} %" in text.output
    assert abs(parts["outside the form"]) < 0.5  # least squares: what the form misses averages out per d
    assert report["decomposed_runs"] == sum(f["runs"] for f in report["families"]) < report["iteration_runs"]
    assert report["outside_form_abs_pct"] >= abs(parts["outside the form"])
    assert f"over the {report['decomposed_runs']} decomposed runs" in text.output
    refused = CliRunner().invoke(app, ["decompose", "--fixtures", str(vtrain.root), "--split", "test"])
    assert refused.exit_code != 0


def test_a_store_of_runs_with_events_says_decompose_has_nothing_to_cut(repo_root):
    """The shipped CPU captures carry events: nothing to decompose, and the text says where to look instead."""
    out = CliRunner().invoke(app, ["decompose", "--fixtures", str(repo_root / "fixtures"), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["iteration_runs"] == 0 and json.loads(out.output)["families"] == []
    text = CliRunner().invoke(app, ["decompose", "--fixtures", str(repo_root / "fixtures")]).output
    assert "no runs measured at iteration level" in text and "observe" in text
