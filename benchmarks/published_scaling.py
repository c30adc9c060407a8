"""Benchmark: the shipped model against published Megatron-LM throughput at scale (32 to 3,072 A100s). Prints
figures; asserts nothing.

    python benchmarks/published_scaling.py [--micro-batch 1 2 4] [--model MODEL.toml] [--collectives STORE]

The model is calibrated on one A100 node (the public vTrain runs: h <= 2048, s = 1024, <= 8 GPUs). Whether its
terms extrapolate by their physics is what a user asks before trusting `plan` on a large job; no measurement of
such a job is in the repository or in `../shared`. The one public yardstick is Table 1 of Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC21, arXiv 2104.04473):
ten GPT models, 1.7B to 1T parameters, on DGX A100 nodes (8 GPUs and 8 HDR InfiniBand NICs each), s = 2048,
vocabulary 51,200, mixed precision, full activation recomputation, Megatron of 2021 (no flash attention, so the
launch here says `--transformer-impl local`). The table gives achieved teraFLOP/s per GPU counting the
recomputed forward (their eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per iteration), which this script
computes from the predicted iteration time the same way.

What the table does not give is the micro-batch size (and, for the pipelined models, whether the interleaved
schedule ran), so each model is priced at every --micro-batch and the spread is part of the answer.
Without tables the collectives inside a node are priced by the ring model at the catalog's NVLink bandwidth;
`--collectives STORE` prices them instead from the all-reduce tables of an A100 node that STORE keeps (the vTrain
store's: NCCL on an 8-GPU SXM4 node on NVSwitch, the node type of the paper), as `predict` does for a stored run. The
published figures below are transcribed from the paper's Table 1 (columns: parameters, heads, hidden, layers,
t, p, GPUs, batch, teraFLOP/s per GPU); check them against the paper before citing this script's output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

VOCAB, SEQ = 51200, 2048
# Narayanan et al. SC21, Table 1: name, heads, hidden, layers, t, p, GPUs, global batch, teraFLOP/s per GPU
TABLE_1 = (
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137), ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142), ("18B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39B", 64, 8192, 48, 8, 2, 512, 1536, 138), ("76B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145B", 96, 12288, 80, 8, 8, 1536, 2304, 148), ("310B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("530B", 128, 20480, 105, 8, 35, 2520, 2520, 163), ("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def launch(heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int, micro: int) -> dict:
    return {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "world_size": gpus,
            "num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "seq_length": SEQ,
            "max_position_embeddings": SEQ, "micro_batch_size": micro, "global_batch_size": batch,
            "vocab_size": VOCAB, "fp16": True, "recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": 1, "transformer_impl": "local"}


def hardware_flops(batch: int, layers: int, hidden: int) -> float:
    """FLOPs of one iteration as the paper counts them (eq. 3: forward, backward and the recomputed forward)."""
    return 96.0 * batch * SEQ * layers * hidden ** 2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def node_tables(store: Path) -> tuple:
    """The all-reduce tables of the first A100 run in `store` that has any (a run's tables are its node's)."""
    from hops_calib.store import FixtureStore

    fixtures = FixtureStore(store)
    for fixture_id in fixtures.ids():
        fixture = fixtures.load(fixture_id)
        if getattr(fixture, "hardware", {}).get("gpu") == "a100" and fixture.spec.collectives:
            return tuple(fixture.spec.collectives)
    raise SystemExit(f"{store}: no A100 run with collective tables")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--model", type=Path, default=None,
                        help="model file to price with (default: the shipped model); e.g. one that activates "
                             "decoder_kernels in place of decoder_roofline")
    parser.add_argument("--collectives", type=Path, default=None,
                        help="fixture store whose A100 runs' all-reduce tables price the collectives inside a node "
                             "(e.g. a store the vTrain table was ingested into)")
    options = parser.parse_args()

    from hops_calib.errors import InputError
    from hops_calib.loop.model_files import load_model
    from hops_calib.model.predict import predict
    from hops_calib.spec import Hardware, spec_from_args

    model = load_model(options.model) if options.model else load_model()
    tables = node_tables(options.collectives) if options.collectives else ()
    if options.collectives:
        print(f"collectives inside a node: the all-reduce tables of {options.collectives} "
              f"({', '.join(str(t.gpus) for t in tables)} GPUs)")
    print(f"model {model.name} ({model.sha256[:12]}); teraFLOP/s per GPU, recomputation counted (SC21 eq. 3); "
          f"ratio = predicted / published")
    header = f"{'model':>5} {'t':>2} {'p':>3} {'d':>3} {'GPUs':>5} {'published':>9}"
    for micro in options.micro_batch:
        header += f" | mb {micro}: {'pred':>5} {'ratio':>5}"
    print(header)
    ratios: dict[int, list[float]] = {micro: [] for micro in options.micro_batch}
    for name, heads, hidden, layers, tp, pp, gpus, batch, published in TABLE_1:
        line = f"{name:>5} {tp:>2} {pp:>3} {gpus // (tp * pp):>3} {gpus:>5} {published:>9}"
        for micro in options.micro_batch:
            try:
                spec = spec_from_args(launch(heads, hidden, layers, tp, pp, gpus, batch, micro), "benchmark",
                                      run_id=f"sc21_{name}_mb{micro}", iterations=2,
                                      hardware=Hardware(gpu="a100", gpus_per_node=8), collectives=tables)
            except InputError as error:  # a micro batch the batch does not divide
                line += f" | {'':>6}{'-':>5} {'-':>5}"
                print(f"  ({name} mb {micro}: {error})", file=sys.stderr)
                continue
            prediction = predict(spec, model)
            per_gpu = hardware_flops(batch, layers, hidden) / (prediction.metrics.iteration_time_ms / 1e3) / gpus
            ratio = per_gpu / 1e12 / published
            ratios[micro].append(ratio)
            line += f" | {'':>6}{per_gpu / 1e12:>5.0f} {ratio:>5.2f}"
        print(line, flush=True)
    for micro, values in ratios.items():
        if values:
            print(f"mb {micro}: predicted / published from {min(values):.2f} to {max(values):.2f}, "
                  f"median {sorted(values)[len(values) // 2]:.2f} over {len(values)} models")


if __name__ == "__main__":
    main()
