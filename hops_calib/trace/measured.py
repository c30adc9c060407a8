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
# Megatron's arguments (args. spelling) a run table or a sidecar may give: what the spec and the cost model read, what
# they refuse when set (hops_calib.spec.ASSUMPTIONS; a test keeps the two in step), and common settings that do not
# change what is priced. Any other column is refused as unknown (a misspelling would silently take the default)
# unless it is declared as the table's own: an `x_` prefix, or the sidecar's `extra_columns`.
KNOWN_ARGS = frozenset(MEGATRON_DEFAULTS) | frozenset(REQUIRED_ARGS) | frozenset(VOCAB_ARGS) | frozenset({
    "data_parallel_size", "world_size", "global_batch_size", "ffn_hidden_size", "max_position_embeddings",
    "make_vocab_size_divisible_by", "untie_embeddings_and_output_weights", "clip_grad",
    "virtual_pipeline_model_parallel_size", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
    "checkpoint_activations", "checkpoint_num_layers", "recompute_activations", "distribute_saved_activations",
    "num_experts", "expert_model_parallel_size", "swiglu", "group_query_attention", "num_query_groups",
    "multi_latent_attention", "normalization", "position_embedding_type", "transformer_impl", "use_flash_attn",
    "fp8_format", "fp8", "overlap_p2p_comm", "overlap_p2p_communication", "masked_softmax_fusion",
    "no_masked_softmax_fusion", "bias_gelu_fusion", "bias_dropout_fusion", "gradient_accumulation_fusion",
    "no_gradient_accumulation_fusion", "accumulate_allreduce_grads_in_fp32", "attention_softmax_in_fp32",
    "apply_query_key_layer_scaling", "attention_dropout", "hidden_dropout", "use_distributed_optimizer",
    "overlap_grad_reduce", "overlap_param_gather", "train_iters", "log_interval", "seed", "lr",
    "timing_log_level", "timing_log_option", "tokenizer_type", "params_dtype", "attention_backend",
    "num_key_value_heads", "no_overlap_p2p_communication", "use_rotary_position_embeddings", "use_tp_pp_dp_mapping",
    "zero_stage", "ds_sequence_parallel_size", "tp_comm_overlap", "fp8_hybrid", "fp8_e4m3", "hybrid_override_pattern",
    "use_flash_attn_v1", "use_flash_attn_v2", "use_flash_attn_triton", "use_flash_attn_builder",
})
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


def collective_tables_beside(folder: Path, named: Any = None, origin: Path | None = None) -> str | None:
    """The collective benchmark of a log or table in `folder`: `named` (a `collective_tables` setting, relative to
    `folder`), else `calibration/allreduce/` there (as in a job directory); None when there is none."""
    from hops_calib.trace.collective_bench import ALLREDUCE_DIR
    from hops_calib.trace.errors import TraceError

    if named is not None:
        path = (folder / str(named)).resolve()
        if not path.is_dir():
            raise TraceError(origin or folder, f"names {named!r}, which is not a folder", field="collective_tables",
                             hint="give the folder of the machine's all-reduce tables (AR_GPU<n>_...), relative to "
                                  "the file")
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
    return int((args.get("tensor_model_parallel_size") or 1) * (args.get("pipeline_model_parallel_size") or 1)
               * (args.get("context_parallel_size") or 1) * (args.get("data_parallel_size") or 1))


def model_flops_per_iteration(args: dict[str, Any]) -> float:
    """Megatron-LM's `num_floating_point_operations(args, global_batch_size)` (megatron/training/training.py): the
    model's FLOPs of one iteration, forward and backward, without recomputation, for a GPT without GQA, SwiGLU or
    experts: 12 B s L h^2 ((1 + 1 + s/h) + ffn/h + V/(2 L h)). Its "throughput per GPU (TFLOP/s/GPU)" is this over
    (iteration time x world size x 1e12)."""
    batch, seq, layers, hidden = (int(args[k]) for k in ("global_batch_size", "seq_length", "num_layers",
                                                         "hidden_size"))
    ffn = int(args.get("ffn_hidden_size") or 4 * hidden)
    vocab = int(args.get("padded_vocab_size") or args.get("vocab_size") or 0)
    heads = int(args["num_attention_heads"])
    groups = heads if not args.get("group_query_attention") else int(args.get("num_query_groups") or heads)
    return 12.0 * batch * seq * layers * hidden * hidden * (
        (1 + groups / heads + seq / hidden) + ffn / hidden + vocab / (2 * layers * hidden))
