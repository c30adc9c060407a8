"""spec_from_args: a Spec from Megatron's arguments and the hardware alone, the function build_spec calls."""

from __future__ import annotations

from pathlib import Path

import pytest

from hops_calib.spec import Hardware, Spec, build_spec, spec_from_args
from hops_calib.trace import TraceError, find_arguments, read_device_types, read_link_fits, read_stage_map

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "traces" / "cpu_interleaved_v2_l8_h512_s256_m4_run1"


def test_job_directory_spec_is_spec_from_args_of_its_files():
    args, source = find_arguments(JOB)
    ids = read_stage_map(JOB)
    types = read_device_types(JOB)
    spec = spec_from_args(args, source, run_id=JOB.name,
                          hardware=Hardware(devices=tuple(types[d].type for d in ids), device_ids=ids,
                                            device_names=tuple(types[d].name for d in ids)),
                          links=read_link_fits(JOB / "calibration" / "link_bench", len(ids)))
    built = build_spec(JOB)
    assert (spec.pp, spec.vp, spec.schedule, spec.layers_per_stage, spec.links, spec.model) == (
        built.pp, built.vp, built.schedule, built.layers_per_stage, built.links, built.model)
    assert spec.vp > 1 and spec.schedule == "interleaved_1f1b"


def _launch(**changes):
    args = {"pipeline_model_parallel_size": 4, "num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16,
            "seq_length": 1024, "max_position_embeddings": 1024, "micro_batch_size": 2, "global_batch_size": 64,
            "vocab_size": 50257, "fp16": True, "transformer_impl": "local", "masked_softmax_fusion": False}
    args.update(changes)
    return args


def test_gpu_type_hardware_places_pipeline_ranks_on_nodes_in_rank_order():
    spec = spec_from_args(_launch(), "table.csv", run_id="row7", iterations=3,
                          hardware=Hardware(gpu="a100", gpus_per_node=2))
    assert spec.devices == ("a100",) * 4
    assert spec.device_ids == ("node0_gpu0", "node0_gpu1", "node1_gpu0", "node1_gpu1")
    assert (spec.microbatches, spec.iterations, spec.layers_per_stage) == (32, 3, (6, 6, 6, 6))
    assert spec.model.precision == "fp16" and spec.gpus_per_node == 2
    assert Spec.from_json(spec.to_json()) == spec


def test_stage_count_of_the_hardware_must_match_the_launch():
    with pytest.raises(TraceError, match="maps 2 stages but table.csv says --pipeline-model-parallel-size 4"):
        spec_from_args(_launch(), "table.csv", run_id="row7", iterations=3,
                       hardware=Hardware(devices=("a100", "a100")))


def test_without_iterations_the_traced_window_of_train_iters_is_required():
    with pytest.raises(TraceError, match="--train-iters"):
        spec_from_args(_launch(), "table.csv", run_id="row7", hardware=Hardware(gpu="a100", gpus_per_node=8))
    spec = spec_from_args(_launch(train_iters=10), "table.csv", run_id="row7",
                          hardware=Hardware(gpu="a100", gpus_per_node=8))
    assert spec.iterations == 8


def test_unpriced_launch_is_refused_by_name():
    with pytest.raises(TraceError, match="--context-parallel-size 2"):
        spec_from_args(_launch(context_parallel_size=2), "table.csv", run_id="row7", iterations=3,
                       hardware=Hardware(gpu="a100", gpus_per_node=8))
