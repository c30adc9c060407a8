"""Trace room: the published vTrain table (`ground_truth_single.csv`, VIA-Research/vTrain) read as it is.

Its columns map onto the run-table columns one to one (`COLUMNS`); what every one of its runs shares comes from
the publishers' per-run configuration files (`example_config.json` beside the table, and its README; `STATED`),
from the table's own measurements where they contradict those files (`MEASURED`, with the evidence) or, where
they are silent, is assumed (`ASSUMED`, each with the reason). A table is recognised by its header.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hops_calib.trace.measured import RunHardware
from hops_calib.trace.run_table import TableRead, read_run_table

COLUMNS = {
    "# GPUs": "world_size",
    "global batch": "global_batch_size",
    "micro batch": "micro_batch_size",
    "hidden size": "hidden_size",
    "attention heads": "num_attention_heads",
    "# layers": "num_layers",
    "sequence length": "seq_length",
    "tensor parallelism": "tensor_model_parallel_size",
    "data parallelism": "data_parallel_size",
    "pipeline parallelism": "pipeline_model_parallel_size",
    "iteration time (ms)": "iteration_time_ms",
}
# Stated by the publishers' configuration files (example_config.json): fp16, 1F1B (no virtual stages), A100, 8 GPUs
# per node, no gradient bucketing.
STATED: dict[str, Any] = {
    "fp16": True,
    "bf16": False,
    "num_layers_per_virtual_pipeline_stage": None,
}
# Stated, and contradicted by the measurements, which win: the configuration files say `use_checkpoint: true`
# (Megatron-DeepSpeed's --checkpoint-activations: a recomputed forward in every backward), but the table's own layer
# times contradict it. `hops-calib decompose` cuts its runs into T = a(d) + b(d) L + (m + p - 1) (c + x L / p) (they
# fit it to within 0.04 % without a pipeline: composed from per-component timings), and at t 1, h 2048, micro batch 8
# one layer's forward and backward take x = 16.3 ms, where the same layer with a recomputed forward cannot take less
# than 15.5 ms on an A100 (its kernels each at 312 TFLOP/s or 2,039 GB/s, no gap between them; 11.5 ms of it the
# GEMMs alone): a recomputing layer would have run at 95 % of the hardware's limits. Without recomputation the bound
# is 11.5 ms, 70 % of the measured layer, what cuBLAS and memory-bound kernels reach. Nor is it flash attention with
# recomputation: the h 2048 layer takes 2.04 x the h 1024 one (micro batch 8), where the GEMM-bound flash layer would
# take about 3.5 x and the unfused one (its score traffic independent of h) 2.3 x. Recorded in
# experiments/CAMPAIGN.md, session 19.
MEASURED: dict[str, Any] = {
    "recompute_granularity": None,
    "recompute_method": None,
    "recompute_num_layers": None,
}
# Not recorded anywhere in the source; assumed (README of the data set):
ASSUMED: dict[str, Any] = {
    # Megatron-DeepSpeed's GPT examples: the GPT-2 BPE, 50,257 tokens, padded to a multiple of 128 x t
    "vocab_size": 50257,
    "make_vocab_size_divisible_by": 128,
    # Megatron-DeepSpeed has no Transformer Engine path: its layer is the local one, with LayerNorm and learned
    # absolute positions; its defaults fuse the masked softmax and the bias-GeLU (no flag says otherwise)
    "transformer_impl": "local",
    "normalization": "LayerNorm",
    "position_embedding_type": "learned_absolute",
    "masked_softmax_fusion": True,
    "bias_gelu_fusion": True,
    "attention_dropout": 0.1,  # Megatron's default, as in Megatron-DeepSpeed's GPT examples (not stated)
    "hidden_dropout": 0.1,
    "use_flash_attn": False,  # presumably off (not stated)
    "use_distributed_optimizer": False,  # no ZeRO / distributed optimizer (presumably)
    "overlap_grad_reduce": False,  # gradient all-reduce after the backward (use_gradient_bucket: false)
    "max_position_embeddings": None,  # set to the sequence length per row
}
GPU = "a100"  # the catalog's A100 SXM4 80 GB (229 GB/s all-reduce bus bandwidth on 8 GPUs means NVSwitch); 80 vs 40 GB not stated
GPUS_PER_NODE = 8
ALLREDUCE_DIR = "allreduce-a100"  # the publishers' NCCL all-reduce tables of the same machine kind, beside the table
MAPPING = "vTrain ground_truth_single.csv (hops_calib/trace/vtrain.py)"


def is_vtrain_table(path: Path) -> bool:
    """Whether a CSV's header is the vTrain table's."""
    from hops_calib.trace.reading import MAX_LINE_BYTES, open_regular

    if path.suffix.lower() != ".csv" or not path.is_file():
        return False
    with open_regular(path) as handle:
        header = handle.readline(MAX_LINE_BYTES).decode("utf-8-sig", errors="replace")
    return {name.strip() for name in header.split(",")} == set(COLUMNS)


def padded_vocab(vocab: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's `_vocab_size_with_padding`: the vocabulary rounded up to a multiple of divisible_by x t."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab // multiple) * multiple


def translate(cells: dict[str, Any]) -> dict[str, Any]:
    """One vTrain row as run-table columns (with the stated, measured and assumed settings)."""
    row = {COLUMNS[name]: value for name, value in cells.items() if name in COLUMNS}
    row.update(STATED)
    row.update(MEASURED)
    row.update({k: v for k, v in ASSUMED.items() if k not in ("max_position_embeddings",)})
    t = row.get("tensor_model_parallel_size")
    if type(t) is int and t > 0:
        row["padded_vocab_size"] = padded_vocab(ASSUMED["vocab_size"], ASSUMED["make_vocab_size_divisible_by"], t)
    row["max_position_embeddings"] = row.get("seq_length")
    return row


def read_vtrain_table(path: Path | str, *, table_id: str = "vtrain") -> TableRead:
    """The vTrain runs as run-table runs (A100, 8 per node), priced inside the node from the publishers'
    all-reduce tables beside the table (`allreduce-a100/`) when they are there."""
    path = Path(path)
    folder = path.parent / ALLREDUCE_DIR
    hardware = RunHardware(
        gpu=GPU, gpus_per_node=GPUS_PER_NODE, collective_tables=str(folder.resolve()) if folder.is_dir() else None
    )
    return read_run_table(path, hardware=hardware, table_id=table_id, translate=translate, mapping=MAPPING)
