"""Whether Megatron would start a launch: a job's command line with a plan's changes applied (`apply_changes`), read
as Megatron-LM's argument parser reads it (`read_launch`: the flags the planner writes, with Megatron's defaults),
turned into megatron-core 0.16.1's `TransformerConfig` as `megatron/training/arguments.py`
`core_transformer_config_from_args` builds it (its `__post_init__`, and `ModelParallelConfig.__post_init__`, raise
ValueError on what Megatron refuses), plus the checks Megatron makes elsewhere before the first step:
`megatron/core/parallel_state.py` `initialize_model_parallel` (world size divisible by t x p x cp, p > 1 under
virtual stages), `megatron/training/arguments.py` `validate_args` (layers per virtual stage integral, the even split
dividing the layers), `megatron/core/num_microbatches_calculator.py` (the global batch a multiple of micro batch x
d), `megatron/core/pipeline_parallel/schedules.py` `forward_backward_pipelining_with_interleaving` (microbatches a
multiple of p under the default `microbatch_group_size_per_vp_stage` = p) and `megatron/core/utils.py`
`get_batch_on_this_cp_rank` (the sequence in 2 cp chunks). A mixture of experts (--num-experts) adds its own:
`initialize_model_parallel` again (the world divisible by etp x ep x p, the experts' data-parallel size world /
(etp x ep x p)), `megatron/core/transformer/moe/moe_layer.py` `MoELayer.__init__` (the experts divisible by ep) and
`MoELayer.forward` (tensor parallelism needs sequence parallelism in training). Runs on the CPU: no GPU, no process
group.

Megatron-LM's training package (`megatron/training`) is not installed with megatron-core; the mapping of flags to
the config below follows its `core_transformer_config_from_args` for the settings the planner changes and the
model's shape. Fusions whose availability the config checks against the installed Transformer Engine (RoPE fusion)
are left off: no flag the planner writes turns them on, and this machine has no TE."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Megatron-LM flags that take a value, by the args. name and type they parse to (megatron/training/arguments.py)
VALUED: dict[str, tuple[str, type]] = {
    "--num-layers": ("num_layers", int),
    "--hidden-size": ("hidden_size", int),
    "--ffn-hidden-size": ("ffn_hidden_size", int),
    "--num-attention-heads": ("num_attention_heads", int),
    "--num-query-groups": ("num_query_groups", int),
    "--seq-length": ("seq_length", int),
    "--max-position-embeddings": ("max_position_embeddings", int),
    "--micro-batch-size": ("micro_batch_size", int),
    "--global-batch-size": ("global_batch_size", int),
    "--tensor-model-parallel-size": ("tensor_model_parallel_size", int),
    "--pipeline-model-parallel-size": ("pipeline_model_parallel_size", int),
    "--context-parallel-size": ("context_parallel_size", int),
    "--num-layers-per-virtual-pipeline-stage": ("num_layers_per_virtual_pipeline_stage", int),
    "--virtual-pipeline-model-parallel-size": ("virtual_pipeline_model_parallel_size", int),
    "--decoder-first-pipeline-num-layers": ("decoder_first_pipeline_num_layers", int),
    "--decoder-last-pipeline-num-layers": ("decoder_last_pipeline_num_layers", int),
    "--recompute-granularity": ("recompute_granularity", str),
    "--recompute-method": ("recompute_method", str),
    "--recompute-num-layers": ("recompute_num_layers", int),
    "--fp8-format": ("fp8", str),
    "--fp8-recipe": ("fp8_recipe", str),
    "--normalization": ("normalization", str),
    "--position-embedding-type": ("position_embedding_type", str),
    "--vocab-size": ("vocab_size", int),
    "--train-iters": ("train_iters", int),
    "--attention-dropout": ("attention_dropout", float),
    "--hidden-dropout": ("hidden_dropout", float),
    "--transformer-impl": ("transformer_impl", str),
    "--data-parallel-size": ("data_parallel_size", int),
    "--num-experts": ("num_experts", int),
    "--moe-router-topk": ("moe_router_topk", int),
    "--moe-ffn-hidden-size": ("moe_ffn_hidden_size", int),
    "--expert-model-parallel-size": ("expert_model_parallel_size", int),
    "--expert-tensor-parallel-size": ("expert_tensor_parallel_size", int),
    "--moe-token-dispatcher-type": ("moe_token_dispatcher_type", str),
    "--moe-router-load-balancing-type": ("moe_router_load_balancing_type", str),
    "--moe-aux-loss-coeff": ("moe_aux_loss_coeff", float),
}
# the choices argparse allows (megatron/training/arguments.py `choices=`)
CHOICES: dict[str, tuple[str, ...]] = {
    "--fp8-format": ("e4m3", "hybrid"),
    "--fp8-recipe": ("tensorwise", "delayed", "mxfp8", "blockwise", "custom"),
    "--recompute-granularity": ("full", "selective"),
    "--recompute-method": ("uniform", "block"),
    "--normalization": ("LayerNorm", "RMSNorm"),
    "--transformer-impl": ("local", "transformer_engine"),
    "--moe-token-dispatcher-type": ("allgather", "alltoall", "flex"),
    "--moe-router-load-balancing-type": ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"),
}
# switches (store_true; --no-* store_false), by the args. name they set
SWITCHES: dict[str, tuple[str, bool]] = {
    "--sequence-parallel": ("sequence_parallel", True),
    "--use-distributed-optimizer": ("use_distributed_optimizer", True),
    "--overlap-grad-reduce": ("overlap_grad_reduce", True),
    "--overlap-param-gather": ("overlap_param_gather", True),
    "--account-for-embedding-in-pipeline-split": ("account_for_embedding_in_pipeline_split", True),
    "--account-for-loss-in-pipeline-split": ("account_for_loss_in_pipeline_split", True),
    "--group-query-attention": ("group_query_attention", True),
    "--swiglu": ("swiglu", True),
    "--untie-embeddings-and-output-weights": ("untie_embeddings_and_output_weights", True),
    "--disable-bias-linear": ("add_bias_linear", False),
    "--bf16": ("bf16", True),
    "--fp16": ("fp16", True),
    "--use-flash-attn": ("use_flash_attn", True),
    "--fp8-param-gather": ("fp8_param_gather", True),
    "--moe-grouped-gemm": ("moe_grouped_gemm", True),
}
DEFAULTS: dict[str, Any] = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "context_parallel_size": 1,
    "micro_batch_size": 1,
    "add_bias_linear": True,
    "normalization": "LayerNorm",
    "attention_dropout": 0.1,
    "hidden_dropout": 0.1,
    "expert_model_parallel_size": 1,
    "moe_router_topk": 2,
    "moe_token_dispatcher_type": "allgather",
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
}


class Refused(Exception):
    """What Megatron refuses of a launch, before or at its first step (the message says which check)."""


def _tokens(argv: list[str]) -> list[tuple[str, str | None]]:
    """(flag, value or None) of an argv list of Megatron flags."""
    out: list[tuple[str, str | None]] = []
    k = 0
    while k < len(argv):
        flag = argv[k]
        if not flag.startswith("--"):
            raise Refused(f"{flag!r} is no flag (argparse: unrecognized arguments)")
        if flag in VALUED:
            if k + 1 >= len(argv) or argv[k + 1].startswith("--"):
                raise Refused(f"{flag} expects one argument")
            if flag in CHOICES and argv[k + 1] not in CHOICES[flag]:
                raise Refused(f"argument {flag}: invalid choice: {argv[k + 1]!r} (choose from {CHOICES[flag]})")
            out.append((flag, argv[k + 1]))
            k += 2
        elif flag in SWITCHES:
            out.append((flag, None))
            k += 1
        else:
            raise Refused(f"unrecognized arguments: {flag}")
    return out


@dataclass(frozen=True)
class JobLaunch:
    """A job directory's launch: torchrun's world size and Megatron's flags (argv after the script)."""

    world_size: int
    argv: tuple[str, ...]


def job_launch(job_dir: Path) -> JobLaunch:
    """`megatron_args.txt` of a job directory: `torchrun --nnodes N --nproc-per-node G SCRIPT.py FLAGS...`."""
    words = shlex.split((job_dir / "megatron_args.txt").read_text())
    script = next(k for k, w in enumerate(words) if w.endswith(".py"))
    runner = dict(zip(words[1:script:2], words[2:script:2]))
    world = int(runner.get("--nnodes", "1")) * int(runner.get("--nproc-per-node", "1"))
    return JobLaunch(world, tuple(words[script + 1 :]))


def apply_changes(argv: tuple[str, ...], flags: list[str], remove: list[str]) -> list[str]:
    """The job's flags with a plan's `remove_flags` taken out and its `flags` (argv tokens) added or set."""
    current = dict(_tokens(list(argv)))
    for flag in remove:
        current.pop(flag, None)
    for flag, value in _tokens(list(flags)):
        current[flag] = value
    out: list[str] = []
    for flag, value in current.items():
        out += [flag] if value is None else [flag, value]
    return out


def read_launch(argv: list[str]) -> dict[str, Any]:
    """The args. of a Megatron flag list, Megatron's defaults for the rest (argparse refuses unknown flags)."""
    args = dict(DEFAULTS)
    for flag, value in _tokens(argv):
        if value is None:
            name, on = SWITCHES[flag]
            args[name] = on
        else:
            name, kind = VALUED[flag]
            args[name] = kind(value)
    return args


def transformer_config(args: dict[str, Any], world_size: int):
    """megatron-core's TransformerConfig of a launch (`core_transformer_config_from_args`), after the checks of
    `validate_args` that derive its virtual-stage count; Refused with Megatron's message where it refuses."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    t, p, cp = (args[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"))
    layers = args["num_layers"]
    vp = args.get("virtual_pipeline_model_parallel_size")
    per_chunk = args.get("num_layers_per_virtual_pipeline_stage")
    if per_chunk is not None:  # validate_args: the virtual stages per rank from the layers per virtual stage
        if vp is not None:
            raise Refused("--num-layers-per-virtual-pipeline-stage and --virtual-pipeline-model-parallel-size together")
        counted = layers + bool(args.get("account_for_embedding_in_pipeline_split")) + bool(
            args.get("account_for_loss_in_pipeline_split")
        )
        if counted % p or (counted // p) % per_chunk:
            raise Refused(
                f"{counted} layers over {p} stages are not whole virtual stages of {per_chunk} layers (validate_args)"
            )
        vp = counted // p // per_chunk
    dtype = torch.bfloat16 if args.get("bf16") else torch.float16 if args.get("fp16") else torch.float32
    swiglu = bool(args.get("swiglu"))
    kwargs: dict[str, Any] = dict(
        num_layers=layers,
        hidden_size=args["hidden_size"],
        ffn_hidden_size=args.get("ffn_hidden_size"),
        num_attention_heads=args["num_attention_heads"],
        num_query_groups=args.get("num_query_groups") if args.get("group_query_attention") else None,
        tensor_model_parallel_size=t,
        pipeline_model_parallel_size=p,
        context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=vp if vp and vp > 1 else None,
        sequence_parallel=bool(args.get("sequence_parallel")),
        num_layers_in_first_pipeline_stage=args.get("decoder_first_pipeline_num_layers"),
        num_layers_in_last_pipeline_stage=args.get("decoder_last_pipeline_num_layers"),
        account_for_embedding_in_pipeline_split=bool(args.get("account_for_embedding_in_pipeline_split")),
        account_for_loss_in_pipeline_split=bool(args.get("account_for_loss_in_pipeline_split")),
        recompute_granularity=args.get("recompute_granularity"),
        recompute_method=args.get("recompute_method"),
        recompute_num_layers=args.get("recompute_num_layers"),
        fp8=args.get("fp8"),
        fp8_recipe=args.get("fp8_recipe") or "delayed",
        fp8_param=bool(args.get("fp8_param_gather")),
        bf16=bool(args.get("bf16")),
        fp16=bool(args.get("fp16")),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        add_bias_linear=args["add_bias_linear"],
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        bias_activation_fusion=True,  # --bias-swiglu-fusion / --bias-gelu-fusion default on
        normalization=args["normalization"],
        attention_dropout=args["attention_dropout"],
        hidden_dropout=args["hidden_dropout"],
        apply_rope_fusion=False,
        # the experts (core_transformer_config_from_args: --num-experts is num_moe_experts; validate_args leaves
        # --moe-ffn-hidden-size None for the config to take --ffn-hidden-size)
        num_moe_experts=args.get("num_experts"),
        moe_router_topk=args["moe_router_topk"],
        moe_ffn_hidden_size=args.get("moe_ffn_hidden_size")
        or (args.get("ffn_hidden_size") if args.get("num_experts") else None),
        expert_model_parallel_size=args["expert_model_parallel_size"],
        expert_tensor_parallel_size=args.get("expert_tensor_parallel_size"),
        moe_token_dispatcher_type=args["moe_token_dispatcher_type"],
        moe_grouped_gemm=bool(args.get("moe_grouped_gemm")),
        moe_router_load_balancing_type=args["moe_router_load_balancing_type"],
        moe_aux_loss_coeff=args["moe_aux_loss_coeff"],
    )
    if not swiglu and not kwargs["add_bias_linear"]:
        kwargs["bias_activation_fusion"] = False  # validate_args turns the bias-GeLU fusion off without biases
    try:
        config = TransformerConfig(**kwargs)
    except (ValueError, AssertionError) as error:
        raise Refused(f"TransformerConfig: {error}") from None
    return config


def check_launch(args: dict[str, Any], world_size: int):
    """The TransformerConfig Megatron builds of `args` on `world_size` GPUs, and the data-parallel size; Refused
    with the check that fails (module docstring)."""
    config = transformer_config(args, world_size)
    t, p, cp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.context_parallel_size
    if world_size % (t * p * cp):
        raise Refused(f"world_size ({world_size}) is not divisible by {t * p * cp} (initialize_model_parallel)")
    if config.virtual_pipeline_model_parallel_size is not None and p < 2:
        raise Refused("pipeline-model-parallel size should be greater than 1 with interleaved schedule")
    dp = world_size // (t * p * cp)
    if args.get("data_parallel_size") not in (None, dp):
        raise Refused(f"--data-parallel-size {args['data_parallel_size']} but the world gives {dp}")
    mbs, gbs = args["micro_batch_size"], args["global_batch_size"]
    if gbs % (mbs * dp):
        raise Refused(f"global batch size ({gbs}) is not divisible by micro batch size ({mbs}) times data parallel size ({dp})")
    if config.virtual_pipeline_model_parallel_size is not None and (gbs // (mbs * dp)) % p:
        raise Refused(f"{gbs // (mbs * dp)} microbatches are not a multiple of the {p} stages (interleaved schedule)")
    if cp > 1 and args["seq_length"] % (2 * cp):
        raise Refused(f"sequence length {args['seq_length']} is not divisible by 2 x cp {cp} (get_batch_on_this_cp_rank)")
    if config.num_moe_experts:
        expert_data_parallel(config, world_size)
    pinned = config.num_layers_in_first_pipeline_stage is not None or config.num_layers_in_last_pipeline_stage is not None
    accounted = config.account_for_embedding_in_pipeline_split or config.account_for_loss_in_pipeline_split
    if not pinned and not accounted and config.num_layers % p:
        raise Refused(f"num_layers ({config.num_layers}) is not divisible by pipeline parallel size ({p})")
    return config, dp


def expert_data_parallel(config, world_size: int) -> int:
    """The experts' data-parallel size Megatron lays out on `world_size` GPUs, world / (etp x ep x p)
    (`parallel_state.initialize_model_parallel`'s expert rank generator); Refused where it refuses the experts'
    layout (the module docstring)."""
    experts, ep, etp = config.num_moe_experts, config.expert_model_parallel_size, config.expert_tensor_parallel_size
    t, p = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    if experts % ep:
        raise Refused(f"num_moe_experts ({experts}) is not divisible by expert parallel size ({ep}) (MoELayer.__init__)")
    if world_size % (etp * ep * p):
        raise Refused(
            f"world_size ({world_size}) is not divisible by expert_tensor_model_pipeline_parallel size ({etp * ep * p}) "
            "(initialize_model_parallel)"
        )
    if t > 1 and not config.sequence_parallel:
        raise Refused("MoE with tensor parallelism in training needs sequence parallelism (MoELayer.forward)")
    return world_size // (etp * ep * p)


def layers_per_rank(config) -> list[int]:
    """The decoder layers each pipeline rank builds, as megatron-core's `get_num_layers_to_build` counts them (its
    model chunks summed)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    chunks = config.virtual_pipeline_model_parallel_size or 1
    return [
        sum(
            get_num_layers_to_build(config, vp_stage=v if chunks > 1 else None, pp_rank=r)
            for v in range(chunks)
        )
        for r in range(config.pipeline_model_parallel_size)
    ]
