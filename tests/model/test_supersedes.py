"""A superseding term (`Term.supersedes`, `Term.covers`) takes over the layer work of the terms it replaces on the
device types it covers, and leaves them standing elsewhere (`Model.contributions`)."""

from pathlib import Path

import pytest

from hops_calib.loop.model_files import load_model
from hops_calib.loop.suite import load_suite
from hops_calib.model.kernels import layer_backward, layer_forward
from hops_calib.model.model import resolve_params
from hops_calib.model.terms.decoder_kernels import DecoderKernels, kernel_settings

REPO = Path(__file__).resolve().parents[2]


def kernels_on(model, **values):
    return model.with_term(resolve_params(DecoderKernels.name, values, origin="test"))


def test_kernel_term_disabled_for_a_device_type_leaves_its_runs_as_they_were():
    base = load_model(None)
    specs = load_suite(REPO / "fixtures", "train").specs[:3]
    only_a100 = kernels_on(base, enabled=0.0, **{"enabled@a100": 1.0})
    for spec in specs:
        assert set(spec.devices) == {"cpu"}
        assert only_a100.pipeline(spec) == base.pipeline(spec)
        assert only_a100.breakdown(spec) == base.breakdown(spec)


def test_kernel_term_enabled_replaces_the_superseded_layer_work():
    base = load_model(None)
    spec = load_suite(REPO / "fixtures", "train").specs[0]
    on = kernels_on(base, **{"enabled@cpu": 1.0})
    # by hand: the replaced terms out; the dispatch floor's per-layer host time, on top of the GPU work, stays
    by_hand = base
    for name in ("decoder_roofline", "attention_score_traffic", "elementwise_traffic", "layer_launch_floor"):
        by_hand = by_hand.without_term(name)
    by_hand = kernels_on(by_hand)
    assert base.active("layer_dispatch_floor").params()["forward_ms_per_layer"] > 0
    assert on.pipeline(spec) == by_hand.pipeline(spec)
    assert on.pipeline(spec) != base.pipeline(spec)
    # the floors are the layers' kernels at the forward's and the backward's launch time
    model = kernels_on(base, launch_us=20.0, backward_launch_us=150.0)
    active, context = model.active(DecoderKernels.name), model.context(spec)
    part = active.term.contribute(context, active.params())
    settings = kernel_settings(spec)
    for k, layers in enumerate(context.layout.layers):
        assert part.forward_floor_ms[k] == pytest.approx(layers * len(layer_forward(spec.model, settings)) * 0.020)
        assert part.backward_floor_ms[k] == pytest.approx(layers * len(layer_backward(spec.model, settings)) * 0.150)
