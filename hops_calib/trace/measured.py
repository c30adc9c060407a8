"""Trace room: a measured run without events (a Megatron training log, a row of a run table).

What every iteration-level reader returns: the launch in Megatron's `args.` names, the hardware, and what was
measured (iteration times, each the mean over the iterations it covers; the timers where logged; the run's own
throughput figures as printed). Nothing here knows about fixtures, specs or models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Megatron-LM's defaults (megatron/training/arguments.py) for the settings a run table may leave out. A setting
# with no default (the shape, the vocabulary) must be given.
MEGATRON_DEFAULTS: dict[str, Any] = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "context_parallel_size": 1,
    "micro_batch_size": 1,
    "fp16": False,
    "bf16": False,
    "recompute_granularity": None,
    "recompute_method": None,
    "recompute_num_layers": None,
    "num_layers_per_virtual_pipeline_stage": None,
    "sequence_parallel": False,
}
REQUIRED_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
# The vocabulary has no default either: one of these (Megatron's args.padded_vocab_size, the one it allocated, or
# the tokenizer's vocab_size, which the spec pads to a multiple of 128).
VOCAB_ARGS = ("padded_vocab_size", "vocab_size")
# Megatron-LM's common settings (megatron/training/arguments.py; Megatron-DeepSpeed's own) that change nothing the
# model prices: the optimizer's hyper-parameters, initialization, data and tokenizer, checkpoints, logging and
# evaluation, kernels and fusions that move no priced term. Known, so that a real launch line earns no
# "ignored" note (`hops_calib.spec.unknown_flags`); never part of a run's configuration (measured_ingest). A setting
# that changes what an iteration computes, sends or keeps (--kv-channels, --optimizer sgd,
# DeepSpeed's activation partitioning, ...) is left out on purpose: unpriced, so it is noted.
QUIET_ARGS = frozenset(
    {
        "lr",
        "min_lr",
        "lr_decay_style",
        "lr_decay_iters",
        "lr_decay_samples",
        "lr_warmup_fraction",
        "lr_warmup_iters",
        "lr_warmup_samples",
        "lr_warmup_init",
        "decoupled_lr",
        "decoupled_min_lr",
        "weight_decay",
        "start_weight_decay",
        "end_weight_decay",
        "weight_decay_incr_style",
        "adam_beta1",
        "adam_beta2",
        "adam_eps",
        "loss_scale",
        "initial_loss_scale",
        "min_loss_scale",
        "loss_scale_window",
        "hysteresis",
        "override_opt_param_scheduler",
        "use_checkpoint_opt_param_scheduler",
        "rampup_batch_size",
        "train_samples",
        "init_method_std",
        "init_method_xavier_uniform",
        "use_cpu_initialization",
        "perform_initialization",
        "layernorm_epsilon",
        "norm_epsilon",
        "apply_layernorm_1p",
        "apply_residual_connection_post_layernorm",
        "persist_layer_norm",
        "no_persist_layer_norm",
        "openai_gelu",
        "squared_relu",
        "onnx_safe",
        "rotary_percent",
        "rotary_base",
        "rotary_interleaved",
        "rotary_seq_len_interpolation_factor",
        "use_rope_scaling",
        "rope_fusion",
        "no_rope_fusion",
        "qk_layernorm",
        "add_bias_linear",
        "disable_bias_linear",
        "add_qkv_bias",
        "bias_swiglu_fusion",
        "no_bias_swiglu_fusion",
        "no_bias_gelu_fusion",
        "no_bias_dropout_fusion",
        "cross_entropy_loss_fusion",
        "async_tensor_model_parallel_allreduce",
        "no_async_tensor_model_parallel_allreduce",
        "save",
        "load",
        "save_interval",
        "non_persistent_save_interval",
        "no_save_optim",
        "no_save_rng",
        "no_load_optim",
        "no_load_rng",
        "finetune",
        "pretrained_checkpoint",
        "use_checkpoint_args",
        "exit_on_missing_checkpoint",
        "ckpt_format",
        "auto_detect_ckpt_format",
        "use_dist_ckpt",
        "dist_ckpt_strictness",
        "ckpt_fully_parallel_save",
        "ckpt_fully_parallel_load",
        "async_save",
        "exit_interval",
        "exit_duration_in_mins",
        "exit_signal_handler",
        "data_path",
        "train_data_path",
        "valid_data_path",
        "test_data_path",
        "data_cache_path",
        "mock_data",
        "split",
        "dataloader_type",
        "num_workers",
        "num_dataset_builder_threads",
        "reset_position_ids",
        "reset_attention_mask",
        "eod_mask_loss",
        "create_attention_mask_in_dataloader",
        "no_create_attention_mask_in_dataloader",
        "data_sharding",
        "tokenizer_model",
        "vocab_file",
        "merge_file",
        "vocab_extra_ids",
        "eval_interval",
        "eval_iters",
        "skip_train",
        "distributed_backend",
        "distributed_timeout_minutes",
        "local_rank",
        "lazy_mpu_init",
        "use_mcore_models",
        "use_legacy_models",
        "tensorboard_dir",
        "tensorboard_log_interval",
        "tensorboard_queue_size",
        "log_timers_to_tensorboard",
        "log_params_norm",
        "log_num_zeros_in_grad",
        "log_throughput",
        "log_validation_ppl_to_tensorboard",
        "log_memory_to_tensorboard",
        "log_world_size_to_tensorboard",
        "log_loss_scale_to_tensorboard",
        "log_batch_size_to_tensorboard",
        "log_learning_rate_to_tensorboard",
        "log_progress",
        "log_straggler",
        "wandb_project",
        "wandb_exp_name",
        "wandb_save_dir",
        "enable_one_logger",
        "one_logger_project",
        "barrier_with_L1_time",
        "no_barrier_with_level_1_timing",
        "empty_unused_memory_level",
        "check_for_nan_in_loss_and_grad",
        "no_check_for_nan_in_loss_and_grad",
        "manual_gc",
        "manual_gc_interval",
        "deterministic_mode",
        "calculate_per_token_loss",
        "profile",
        "profile_step_start",
        "profile_step_end",
        "profile_ranks",
        "use_pytorch_profiler",
        "pytorch_profiler_collect_shapes",
        "pytorch_profiler_collect_callstack",
        "pytorch_profiler_collect_chakra",
        "record_shapes",
        "nvtx_ranges",
        "record_memory_history",
        "memory_snapshot_path",
        "bert_binary_head",
        "test_mode",
    }
)
# Megatron's arguments (args. spelling) a run table or a sidecar may give: what the spec and the cost model read, what
# they refuse when set (hops_calib.spec.ASSUMPTIONS; a test keeps the two in step), and common settings that do not
# change what is priced. Any other column is refused as unknown (a misspelling would silently take the default)
# unless it is declared as the table's own: an `x_` prefix, or the sidecar's `extra_columns`.
KNOWN_ARGS = (
    frozenset(MEGATRON_DEFAULTS)
    | frozenset(REQUIRED_ARGS)
    | frozenset(VOCAB_ARGS)
    | frozenset(
        {
            "fp8_recipe",
            "first_last_layers_bf16",
            "fp8_multi_head_attention",
            "fp8_dot_product_attention",
            "cp_comm_type",
            "tp_comm_overlap_rs_dgrad",
            "data_parallel_size",
            "world_size",
            "global_batch_size",
            "ffn_hidden_size",
            "max_position_embeddings",
            "make_vocab_size_divisible_by",
            "untie_embeddings_and_output_weights",
            "clip_grad",
            "virtual_pipeline_model_parallel_size",
            "decoder_first_pipeline_num_layers",
            "decoder_last_pipeline_num_layers",
            "checkpoint_activations",
            "checkpoint_num_layers",
            "recompute_activations",
            "distribute_saved_activations",
            "num_experts",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
            "moe_router_topk",
            "moe_grouped_gemm",
            "moe_token_dispatcher_type",
            "moe_shared_expert_intermediate_size",
            "moe_shared_expert_overlap",
            "moe_ffn_hidden_size",
            "moe_expert_capacity_factor",
            "moe_pad_expert_input_to_capacity",
            "moe_layer_freq",
            "moe_layer_recompute",
            "moe_router_dtype",
            "moe_router_load_balancing_type",
            "moe_aux_loss_coeff",
            "moe_z_loss_coeff",
            "moe_permute_fusion",
            "moe_router_score_function",
            "moe_router_pre_softmax",
            "swiglu",
            "group_query_attention",
            "num_query_groups",
            "multi_latent_attention",
            "normalization",
            "position_embedding_type",
            "transformer_impl",
            "use_flash_attn",
            "fp8_format",
            "fp8",
            "fp8_param_gather",
            "fp8_wgrad",
            "fp8_amax_history_len",
            "fp8_amax_compute_algo",
            "fp8_margin",
            "overlap_p2p_comm",
            "overlap_p2p_communication",
            "masked_softmax_fusion",
            "no_masked_softmax_fusion",
            "bias_gelu_fusion",
            "bias_dropout_fusion",
            "gradient_accumulation_fusion",
            "no_gradient_accumulation_fusion",
            "accumulate_allreduce_grads_in_fp32",
            "attention_softmax_in_fp32",
            "apply_query_key_layer_scaling",
            "attention_dropout",
            "hidden_dropout",
            "use_distributed_optimizer",
            "overlap_grad_reduce",
            "overlap_param_gather",
            "train_iters",
            "log_interval",
            "seed",
            "lr",
            "timing_log_level",
            "timing_log_option",
            "tokenizer_type",
            "params_dtype",
            "attention_backend",
            "num_key_value_heads",
            "no_overlap_p2p_communication",
            "use_rotary_position_embeddings",
            "use_tp_pp_dp_mapping",
            "zero_stage",
            "ds_sequence_parallel_size",
            "tp_comm_overlap",
            "fp8_hybrid",
            "fp8_e4m3",
            "hybrid_override_pattern",
            "use_flash_attn_v1",
            "use_flash_attn_v2",
            "use_flash_attn_triton",
            "use_flash_attn_builder",
            "rank_order",
            "pipeline_model_parallel_layout",
            "account_for_embedding_in_pipeline_split",
            "account_for_loss_in_pipeline_split",
            "batch_p2p_comm",
            "overlap_p2p_comm_warmup_flush",
            "overlap_p2p_communication_warmup_flush",
            "ddp_bucket_size",
            # Megatron-FSDP (`spec.fsdp_strategy`, priced by model/fsdp.py) and the gradient buffer's dtype
            # (`model.memory.gradient_bytes`)
            "data_parallel_sharding_strategy",
            "suggested_communication_unit_size",
            "grad_reduce_in_bf16",
            "use_megatron_fsdp",
            "use_custom_fsdp",
            # what Megatron-FSDP refuses (`spec.assumptions`): read, so that a launch naming them is refused, not
            # silently priced without them
            "fsdp_double_buffer",
            "nccl_ub",
            "use_nccl_ub",
            "num_distributed_optimizer_instances",
            "outer_dp_sharding_strategy",
            "use_torch_fsdp2",
        }
    )
    | QUIET_ARGS
)
EXTRA_PREFIX = "x_"  # a run table's own column (a note, a date, ...): kept out of the launch, never read


@dataclass(frozen=True)
class RunHardware:
    """The machine a run used: a device type of the model's catalog, and how many of them share a node."""

    gpu: str
    gpus_per_node: int
    # The folder of the machine's collective benchmark (nccl-tests all-reduce tables, `trace.collective_bench`),
    # which prices the hops inside a node; None when the source has none.
    collective_tables: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"gpu": self.gpu, "gpus_per_node": self.gpus_per_node}
        if self.collective_tables is not None:
            data["collective_tables"] = self.collective_tables
        return data


MAX_FOLDER_ENTRIES = 10_000  # entries of a collective_tables folder looked at (real: 7 tables)


def _check_tables_folder(path: Path, named: Any, origin: Path) -> None:
    """TraceError when a named collective_tables folder holds no all-reduce table: no regular file AR_GPU<n>_...
    among its first MAX_FOLDER_ENTRIES entries (a system folder such as /proc, or the wrong folder)."""
    import itertools
    import stat

    from hops_calib.trace.collective_bench import gpus_of
    from hops_calib.trace.errors import TraceError

    try:
        entries = list(itertools.islice(path.iterdir(), MAX_FOLDER_ENTRIES))
    except OSError as err:
        raise TraceError(
            origin,
            f"names {named!r}, a folder that cannot be read ({err.strerror})",
            field="collective_tables",
            hint="give the folder of the machine's all-reduce tables",
        ) from None
    for entry in entries:
        try:
            if gpus_of(entry) is not None and stat.S_ISREG(entry.lstat().st_mode):
                return
        except OSError:
            continue
    more = "+" if len(entries) == MAX_FOLDER_ENTRIES else ""
    raise TraceError(
        origin,
        f"names {named!r}, a folder of {len(entries)}{more} entries none of which is an "
        "all-reduce table (a regular file named AR_GPU<n>_...)",
        field="collective_tables",
        hint="give the folder of the machine's nccl-tests all-reduce tables, relative to the file",
    )


def collective_tables_beside(folder: Path, named: Any = None, origin: Path | None = None) -> str | None:
    """The collective benchmark of a log or table in `folder`: `named` (a `collective_tables` setting, relative to
    `folder`), else `calibration/allreduce/` there (as in a job directory); None when there is none."""
    from hops_calib.trace.collective_bench import ALLREDUCE_DIR
    from hops_calib.trace.errors import TraceError

    if named is not None:
        path = (folder / str(named)).resolve()
        if not path.is_dir():
            raise TraceError(
                origin or folder,
                f"names {named!r}, which is not a folder",
                field="collective_tables",
                hint="give the folder of the machine's all-reduce tables (AR_GPU<n>_...), relative to the file",
            )
        _check_tables_folder(path, named, origin or folder)
        return str(path)
    default = folder / ALLREDUCE_DIR
    return str(default.resolve()) if default.is_dir() else None


@dataclass(frozen=True)
class MeasuredRun:
    """One run measured at iteration level."""

    run_id: str
    group: str  # runs that repeat one configuration share it (and so a split)
    args: dict[str, Any]  # Megatron's arguments, `args.` spelling
    hardware: RunHardware
    # Iteration time per kept log interval (ms), each the mean over `interval_iterations[k]` iterations (Megatron
    # averages over --log-interval); a table row gives one value.
    iteration_times_ms: tuple[float, ...]
    interval_iterations: tuple[int, ...]
    last_iterations: tuple[int, ...] = ()  # the iteration each kept interval ends at (logs only)
    # Timer name -> {"min": ms, "max": ms} or {"rank 0": ms, ...}: per iteration, median over the kept intervals.
    timers_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    timing_log_option: str | None = None  # max, minmax or all (logs with timers)
    reported: dict[str, float] = field(default_factory=dict)  # the run's own throughput figures, as printed
    origin: str = ""  # file (and line or row) it was read from
    warnings: tuple[str, ...] = ()


def world_size(args: dict[str, Any]) -> int:
    """GPUs of a launch: `world_size` when given, else t x p x d (d defaults to 1)."""
    if args.get("world_size"):
        return int(args["world_size"])
    return int(
        (args.get("tensor_model_parallel_size") or 1)
        * (args.get("pipeline_model_parallel_size") or 1)
        * (args.get("context_parallel_size") or 1)
        * (args.get("data_parallel_size") or 1)
    )


def model_flops_per_iteration(args: dict[str, Any]) -> float:
    """Megatron-LM's `num_floating_point_operations(args, global_batch_size)` (megatron/training/training.py): the
    model's FLOPs of one iteration, forward and backward, without recomputation, for a GPT without GQA, SwiGLU or
    experts: 12 B s L h^2 ((1 + 1 + s/h) + ffn/h + V/(2 L h)). Its "throughput per GPU (TFLOP/s/GPU)" is this over
    (iteration time x world size x 1e12)."""
    batch, seq, layers, hidden = (
        int(args[k]) for k in ("global_batch_size", "seq_length", "num_layers", "hidden_size")
    )
    ffn = int(args.get("ffn_hidden_size") or 4 * hidden)
    vocab = int(args.get("padded_vocab_size") or args.get("vocab_size") or 0)
    heads = int(args["num_attention_heads"])
    groups = heads if not args.get("group_query_attention") else int(args.get("num_query_groups") or heads)
    return (
        12.0
        * batch
        * seq
        * layers
        * hidden
        * hidden
        * ((1 + groups / heads + seq / hidden) + ffn / hidden + vocab / (2 * layers * hidden))
    )
