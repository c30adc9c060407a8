"""DGX H100 job directories for the what-if tests: a launch's megatron_args.txt, its stage map and its devices."""

from __future__ import annotations

import json
from pathlib import Path

# A Mixtral-8x7B shape (Jiang et al. 2024, table 1: 32 layers, h 4096, 32 heads in 8 query groups, SwiGLU experts of
# 14336, 8 experts, top-2; Megatron-LM examples/mixtral's flags) on 8 DGX H100 nodes at t 1 x p 4 x d 16 with EP 2
# (4 experts per GPU), BF16. The numbers are this test's own.
MIXTRAL = (
    "torchrun --nnodes 8 --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 1 "
    "--pipeline-model-parallel-size 4 --expert-model-parallel-size 2 --num-experts 8 --moe-router-topk 2 "
    "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss "
    "--moe-aux-loss-coeff 1e-2 --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 "
    "--num-attention-heads 32 --group-query-attention --num-query-groups 8 --seq-length 4096 "
    "--max-position-embeddings 32768 --micro-batch-size 1 --global-batch-size 256 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
    "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --bf16 --transformer-impl "
    "transformer_engine --vocab-size 32000 --train-iters 20"
)


def make_job(folder: Path, command: str, stages: int = 4) -> Path:
    """A job directory in `folder`: `command` as its megatron_args.txt, `stages` stages on DGX H100 GPUs."""
    folder.mkdir(parents=True)
    (folder / "megatron_args.txt").write_text(command + "\n")
    (folder / "hops_trace_map.json").write_text(json.dumps({"stages": {str(k): f"gpu{k}" for k in range(stages)}}))
    (folder / "hops.base.yaml").write_text(
        "hardware:\n  devices:\n" + "".join(f"  - {{id: gpu{k}, gpu: h100_dgx}}\n" for k in range(stages))
    )
    return folder
