"""Candidates: one change, read as data, refused with a reason otherwise."""

from __future__ import annotations

import pytest
from conftest import plain_model

from hops_calib.errors import InputError
from hops_calib.loop.candidate import TooManyChanges, parse_candidate

HEADER = 'id = "c1"\nhypothesis = "link time matters"\ngrounding = "bytes over bandwidth"\n'


def parse(body: str):
    return parse_candidate(HEADER + body, origin="experiments/c1.toml")


def test_set_params_changes_only_that_term():
    model = plain_model()
    candidate = parse('[change]\naction = "set"\nterm = "decoder_roofline"\nparams = { compute_efficiency = 0.25 }\n')
    changed = candidate.apply(model)
    assert changed.active("decoder_roofline").params()["compute_efficiency"] == 0.25
    # Parameters the candidate does not name keep the model's values, not the defaults.
    assert changed.active("decoder_roofline").params()["memory_efficiency"] == \
        model.active("decoder_roofline").params()["memory_efficiency"]
    assert changed.active("link_transfer") == model.active("link_transfer")
    assert changed.sha256 != model.sha256 and candidate.change.target == "term decoder_roofline"


def test_remove_and_add_are_inverse():
    model = plain_model()
    removed = parse('[change]\naction = "remove"\nterm = "link_transfer"\n').apply(model)
    assert removed.active("link_transfer") is None
    added = parse('[change]\naction = "add"\nterm = "link_transfer"\n').apply(removed)
    assert added.sha256 == model.sha256


def test_device_constant_needs_a_source_and_changes_that_constant():
    body = ('[change]\naction = "set_device"\ndevice = "a10g"\nconstant = "peak_bf16_flops_per_s"\n'
            'value = 7.0e13\nsource = "a datasheet"\n')
    changed = parse(body).apply(plain_model())
    assert changed.device("a10g").peak_bf16_flops_per_s == 7.0e13
    assert changed.device("a10g").source("peak_bf16_flops_per_s") == "a datasheet"
    with pytest.raises(InputError, match="needs the source"):
        parse(body.replace('"a datasheet"', '"  "'))


@pytest.mark.parametrize("body, touched", [
    ('[[change]]\naction = "remove"\nterm = "link_transfer"\n'
     '[[change]]\naction = "set"\nterm = "decoder_roofline"\nparams = { backward_factor = 3.0 }\n',
     ["term link_transfer", "term decoder_roofline"]),
    ('[change]\naction = "remove"\nterm = ["link_transfer", "decoder_roofline"]\n',
     ["term link_transfer", "term decoder_roofline"]),
    ('[[change]]\naction = "remove"\nterm = "link_transfer"\n'
     '[[change]]\naction = "set_device"\ndevice = "l4"\nconstant = "memory_bytes"\nvalue = 1.0\nsource = "x"\n',
     ["term link_transfer", "device l4.memory_bytes"]),
])
def test_more_than_one_term_is_refused_naming_every_term_touched(body, touched):
    with pytest.raises(TooManyChanges) as caught:
        parse(body)
    assert caught.value.touched == touched
    for name in touched:
        assert name in str(caught.value)


def test_two_changes_to_the_same_term_are_refused_too():
    body = ('[[change]]\naction = "set"\nterm = "decoder_roofline"\nparams = { backward_factor = 3.0 }\n'
            '[[change]]\naction = "set"\nterm = "decoder_roofline"\nparams = { compute_efficiency = 0.3 }\n')
    with pytest.raises(InputError, match="exactly one change"):
        parse(body)


def test_a_second_change_table_under_another_name_is_named_as_a_second_change():
    body = ('[change]\naction = "set"\nterm = "decoder_roofline"\nparams = { backward_factor = 3.0 }\n'
            '[change2]\naction = "set"\nterm = "optimizer_step"\nparams = { fixed_ms = 3.0 }\n')
    with pytest.raises(InputError, match=r"\[change2\] is a second change table \(of optimizer_step\)") as caught:
        parse(body)
    assert caught.value.field == "change2" and caught.value.line is not None
    assert "its own candidate file" in str(caught.value)


def test_reading_a_candidate_never_executes_what_it_names(tmp_path):
    canary = tmp_path / "executed"
    body = (f'[change]\naction = "add"\nterm = "__import__(\'pathlib\').Path(\'{canary}\').touch()"\n')
    with pytest.raises(InputError, match="unknown term") as caught:
        parse(body)
    assert "implemented in hops_calib.model.terms" in str(caught.value)
    with pytest.raises(InputError, match="unknown term"):
        parse('[change]\naction = "add"\nterm = "os.system"\n')
    assert not canary.exists()


@pytest.mark.parametrize("text, needle, line", [
    ('id = "c1"\ngrounding = "g"\n[change]\naction = "remove"\nterm = "link_transfer"\n', "'hypothesis' is required",
     None),
    (HEADER + 'colour = "red"\n', "unknown top-level key", 4),
    (HEADER + '[change]\naction = "replace"\nterm = "link_transfer"\n', "not one of", 5),
    (HEADER + '[change]\naction = "set"\nterm = "decoder_roofline"\nparams = {}\n', "at least one parameter", None),
    (HEADER + '[change]\naction = "remove"\nterm = "link_transfer"\nparams = { a = 1 }\n', "not allowed", 7),
    (HEADER + '[change]\naction = "set_device"\ndevice = "l4"\nconstant = "clock_hz"\nvalue = 1.0\nsource = "x"\n',
     "unknown device constant", 7),
    (HEADER + '[change\n', "not valid TOML", 4),
    (HEADER, "no \\[change\\] table", None),
    ('id = "has space"\nhypothesis = "h"\ngrounding = "g"\n[change]\naction = "remove"\nterm = "link_transfer"\n',
     "must be letters", 1),
])
def test_malformed_candidates_are_named(text, needle, line):
    with pytest.raises(InputError, match=needle) as caught:
        parse_candidate(text, origin="experiments/bad.toml")
    assert str(caught.value).startswith("experiments/bad.toml")
    if line is not None:
        assert caught.value.line == line


@pytest.mark.parametrize("body, needle", [
    ('[change]\naction = "add"\nterm = "link_transfer"\n', "already active"),
    ('[change]\naction = "set"\nterm = "decoder_roofline"\nparams = { compute_efficiency = 0.5 }\n',
     "leaves the model's predictions unchanged"),
    ('[change]\naction = "set"\nterm = "decoder_roofline"\nparams = { compute_efficiency = 7.0 }\n',
     "outside the plausible range"),
    ('[change]\naction = "set"\nterm = "decoder_roofline"\nparams = { efficiency = 0.7 }\n', "has no parameter"),
    ('[change]\naction = "add"\nterm = "embedding_grad_allreduce"\nparams = { realize_stalls = 0.5 }\n',
     "not one of the values realize_stalls takes"),
    ('[change]\naction = "set_device"\ndevice = "tpu"\nconstant = "memory_bytes"\nvalue = 1.0\nsource = "x"\n',
     "unknown device type"),
    ('[change]\naction = "set"\nterm = "decoder_roofline"\nparams = { "compute_efficiency@tpu" = 0.4 }\n',
     "device type 'tpu', which the model does not know"),
    ('[change]\naction = "add"\nterm = "elementwise_traffic"\nparams = { "memory_efficiency@l4" = 0.4 }\n',
     "has no parameter"),
])
def test_changes_that_do_not_apply_to_the_model_are_refused(body, needle):
    with pytest.raises(InputError, match=needle):
        parse(body).apply(plain_model())


def test_removing_the_last_term_is_refused():
    model = plain_model()
    *others, last = [active.name for active in model.terms]
    for name in others:
        model = parse(f'[change]\naction = "remove"\nterm = "{name}"\n').apply(model)
    with pytest.raises(InputError, match="no terms"):
        parse(f'[change]\naction = "remove"\nterm = "{last}"\n').apply(model)


def test_a_bad_inline_parameter_points_at_its_line():
    body = '[change]\naction = "set"\nterm = "decoder_roofline"\nparams = { compute_efficiency = 7.0 }\n'
    with pytest.raises(InputError, match="outside the plausible range") as caught:
        parse(body).apply(plain_model())
    assert caught.value.line == 7 and caught.value.field == "change.params.compute_efficiency"



def _with_l4_floor():
    """The shipped model with a per-device launch floor for the L4 set (whatever the shipped file says)."""
    from hops_calib.loop.model_files import load_model

    return parse('[change]\naction = "set"\nterm = "layer_launch_floor"\n'
                 'params = { "forward_ms_per_layer@l4" = 1.234, "backward_ms_per_layer@l4" = 2.345 }\n'
                 ).apply(load_model(None))


def test_unset_takes_per_device_values_out_so_the_device_falls_back_to_the_shared_value():
    model = _with_l4_floor()
    before = model.active("layer_launch_floor").params()
    candidate = parse('[change]\naction = "set"\nterm = "layer_launch_floor"\n'
                      'params = { forward_ms_per_layer = 1.5 }\nunset = ["forward_ms_per_layer@l4"]\n')
    after = candidate.apply(model).active("layer_launch_floor").params()
    assert "forward_ms_per_layer@l4" not in after and after["forward_ms_per_layer"] == 1.5
    # Per-device values the candidate does not name stay as they were.
    assert {k: v for k, v in after.items() if "@" in k} == \
        {k: v for k, v in before.items() if "@" in k and k != "forward_ms_per_layer@l4"}
    assert "forward_ms_per_layer@l4 unset" in candidate.change.describe()
    # Unset alone is a change too.
    alone = parse('[change]\naction = "set"\nterm = "layer_launch_floor"\nunset = ["backward_ms_per_layer@l4"]\n')
    assert "backward_ms_per_layer@l4" not in alone.apply(model).active("layer_launch_floor").params()


@pytest.mark.parametrize("body, needle", [
    ('unset = ["forward_ms_per_layer@tpu"]\n', "no per-device value 'forward_ms_per_layer@tpu' to unset"),
    ('unset = ["forward_ms_per_layer"]\n', "list of per-device parameter names"),
    ('unset = "forward_ms_per_layer@l4"\n', "list of per-device parameter names"),
    ('params = { "forward_ms_per_layer@l4" = 1.0 }\nunset = ["forward_ms_per_layer@l4"]\n', "both set and unset"),
])
def test_a_bad_unset_is_named(body, needle):
    with pytest.raises(InputError, match=needle) as caught:
        parse('[change]\naction = "set"\nterm = "layer_launch_floor"\n' + body).apply(_with_l4_floor())
    assert caught.value.field == "change.unset"


def test_unset_belongs_to_set_only():
    with pytest.raises(InputError, match="not allowed"):
        parse('[change]\naction = "add"\nterm = "link_transfer"\nunset = ["burst_mib@l4"]\n')
