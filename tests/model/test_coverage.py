"""Calibration coverage on the real runs: the train configurations span themselves, and every feature named as
outside them for a held-out configuration really is (configurations only: no result of any run is read)."""

from __future__ import annotations

import dataclasses

import pytest

from hops_calib.model import gpt
from hops_calib.model.coverage import coverage, extrapolations


def test_train_runs_lie_within_their_own_coverage_and_test_ones_are_named_where_they_leave_it(shared_store):
    train = [shared_store.load(i).spec for i in shared_store.ids("train")]
    test = [shared_store.load(i).spec for i in shared_store.ids("test")]
    span = coverage(train)
    assert span.runs == len(train)
    assert all(extrapolations(spec, span) == [] for spec in train)
    hidden = [s.model.hidden_size for s in train]
    seen_devices = {d for s in train for d in s.devices}
    flagged_any = False
    for spec in test:
        for e in extrapolations(spec, span):
            flagged_any = True
            if e.feature == "hidden size":
                assert not min(hidden) <= spec.model.hidden_size <= max(hidden)
                assert e.calibrated == f"{min(hidden)}-{max(hidden)}"
            elif e.feature == "hop message MiB":
                sizes = [gpt.boundary_activation_bytes(s.model) for s in train]
                assert not min(sizes) <= gpt.boundary_activation_bytes(spec.model) <= max(sizes)
            elif e.feature == "end device pair":
                ends = {"-".join(sorted((s.devices[0], s.devices[-1]))) for s in train}
                assert e.value not in ends and e.value == "-".join(sorted((spec.devices[0], spec.devices[-1])))
            elif e.feature == "device type":
                assert e.value not in seen_devices
    assert flagged_any  # the held-out split holds configurations train has no neighbour for


def test_a_new_device_type_is_named_with_the_pairs_it_makes(shared_store):
    train = [shared_store.load(i).spec for i in shared_store.ids("train")]
    span = coverage(train)
    base = train[0]
    assert "cpu" not in span.seen["device type"]
    swapped = dataclasses.replace(base, devices=tuple("cpu" for _ in base.devices))
    found = {(e.feature, e.value) for e in extrapolations(swapped, span)}
    assert ("device type", "cpu") in found and ("hop device pair", "cpu-cpu") in found
    assert ("end device pair", "cpu-cpu") in found
    with pytest.raises(ValueError, match="no configurations"):
        coverage([])


def test_parallelism_and_layer_settings_the_calibration_runs_lacked_are_named():
    """A 512-GPU launch with sequence parallelism, the distributed optimizer, flash attention, bf16 and a
    data-parallel group across nodes, against single-node fp16 runs with none of them: each is named."""
    from hops_calib.spec import Hardware, spec_from_args

    def spec(**changes):
        args = {"pipeline_model_parallel_size": 2, "num_layers": 8, "hidden_size": 1024, "num_attention_heads": 16,
                "seq_length": 1024, "max_position_embeddings": 1024, "micro_batch_size": 1,
                "global_batch_size": 16, "vocab_size": 50257, "fp16": True, "transformer_impl": "local",
                "tensor_model_parallel_size": 2, "world_size": 8, **changes}
        return spec_from_args(args, "launch.txt", run_id="r", iterations=3,
                              hardware=Hardware(gpu="a100", gpus_per_node=8))

    span = coverage([spec(), spec(micro_batch_size=2)])
    assert extrapolations(spec(), span) == []
    big = spec(fp16=False, bf16=True, sequence_parallel=True, use_distributed_optimizer=True, use_flash_attn=True,
               world_size=64, global_batch_size=256)
    named = {e.feature: (e.value, e.calibrated) for e in extrapolations(big, span)}
    assert named["precision"] == ("bf16", "fp16") and named["attention kernel"][0] == "flash"
    assert named["sequence parallelism"] == ("on", "off") and named["distributed optimizer"] == ("on", "off")
    assert named["tensor or data parallel group across nodes"] == ("yes", "no")
    assert named["data parallel size"][0] == "16"


def test_an_fp8_launch_is_named_by_its_gemms_precision_not_its_16_bit_weights():
    """Transformer Engine's FP8 (--fp8-format) runs the linear GEMMs in FP8 over bf16 weights: coverage names the
    precision fp8 against bf16 runs, and bf16 against FP8 runs; the same launch in BF16 lies within bf16 runs."""
    from hops_calib.spec import Hardware, spec_from_args

    def spec(**changes):
        args = {"pipeline_model_parallel_size": 2, "num_layers": 8, "hidden_size": 1024, "num_attention_heads": 16,
                "seq_length": 1024, "max_position_embeddings": 1024, "micro_batch_size": 1,
                "global_batch_size": 16, "vocab_size": 50257, "bf16": True,
                "transformer_impl": "transformer_engine", "world_size": 2, **changes}
        return spec_from_args(args, "launch.txt", run_id="r", iterations=3,
                              hardware=Hardware(gpu="h100_dgx", gpus_per_node=8))

    fp8 = spec(fp8_format="hybrid", fp8_recipe="delayed")
    assert fp8.model.precision == "bf16"  # the weights' dtype
    named = {e.feature: (e.value, e.calibrated) for e in extrapolations(fp8, coverage([spec()]))}
    assert named["precision"] == ("fp8", "bf16")
    back = {e.feature: (e.value, e.calibrated) for e in extrapolations(spec(), coverage([fp8]))}
    assert back["precision"] == ("bf16", "fp8")
    assert extrapolations(spec(), coverage([spec()])) == []
