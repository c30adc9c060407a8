"""Megatron-FSDP's flags and the gradient dtype's (issue #28) are read, not ignored: the spec shards per
--data-parallel-sharding-strategy, and what the model does not price is refused naming the flag."""

from __future__ import annotations

import pytest

from hops_calib.errors import InputError
from hops_calib.spec import Hardware, fsdp_strategy, spec_from_args, unknown_flags
from hops_calib.trace.megatron_args import parse_command_line

LAUNCH = (
    "pretrain_gpt.py --tensor-model-parallel-size 8 --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 "
    "--num-attention-heads 64 --group-query-attention --num-query-groups 8 --seq-length 8192 "
    "--max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 128 --sequence-parallel --bf16 "
    "--normalization RMSNorm --swiglu --position-embedding-type rope --vocab-size 128256 --train-iters 10"
)


def _args(flags: str) -> dict:
    return {**parse_command_line(f"{LAUNCH} {flags}"), "world_size": 64}


def _spec(flags: str):
    return spec_from_args(_args(flags), "megatron_args.txt", run_id="l70", iterations=1,
                          hardware=Hardware(gpu="h100_dgx", gpus_per_node=8))


def test_the_fsdp_and_gradient_dtype_flags_are_known():
    args = _args("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --grad-reduce-in-bf16 "
                 "--suggested-communication-unit-size 2000000000")
    assert unknown_flags(args) == []
    assert fsdp_strategy(args) == "optim_grads_params"


@pytest.mark.parametrize(("strategy", "sharded", "grads", "params"), [
    ("no_shard", False, False, False),
    ("optim", True, False, False),
    ("optim_grads", True, True, False),
    ("optim_grads_params", True, True, True),
])
def test_the_strategy_decides_what_is_sharded_and_overlapped(strategy, sharded, grads, params):
    spec = _spec(f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}")
    assert spec.dp == 8
    assert spec.distributed_optimizer is sharded
    # MegatronFSDP.__init__ turns the overlaps on when it shards gradients, and parameters
    assert spec.overlap_grad_reduce is grads
    assert spec.overlap_param_gather is params


def test_megatron_lm_defaults_to_no_shard_and_the_strategy_alone_changes_nothing():
    assert fsdp_strategy(_args("--use-megatron-fsdp")) == "no_shard"
    alone = _spec("--data-parallel-sharding-strategy optim_grads_params")  # Megatron's DDP does not read it
    assert fsdp_strategy(alone.megatron_args) == "" and not alone.distributed_optimizer
    # the deprecated spelling counts
    assert fsdp_strategy(_args("--use-custom-fsdp --data-parallel-sharding-strategy optim")) == "optim"


@pytest.mark.parametrize(("flags", "field"), [
    ("--use-megatron-fsdp --data-parallel-sharding-strategy zero3", "--data-parallel-sharding-strategy"),
    ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --fp8-format hybrid",
     "--use-megatron-fsdp"),
    ("--use-megatron-fsdp --num-distributed-optimizer-instances 2", "--num-distributed-optimizer-instances"),
    ("--use-megatron-fsdp --outer-dp-sharding-strategy optim", "--outer-dp-sharding-strategy"),
    ("--use-megatron-fsdp --use-nccl-ub", "--use-nccl-ub"),
    ("--use-megatron-fsdp --fsdp-double-buffer", "--fsdp-double-buffer"),
    ("--use-torch-fsdp2", "--use-torch-fsdp2"),
])
def test_what_is_not_priced_is_refused_naming_the_flag(flags, field):
    with pytest.raises(InputError) as caught:
        _spec(flags)
    assert caught.value.field == field
