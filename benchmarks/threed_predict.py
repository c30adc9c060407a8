"""Benchmark: predicting a 512-GPU 3D launch (t 8 x p 8 x d 8, 64 microbatches) from its arguments. Prints figures;
asserts nothing.

    python benchmarks/threed_predict.py [--repeats 5]

A GPT-3 175B-like shape (96 layers, h 12288, 96 heads, s 2048) on A100 nodes of 8 GPUs, with sequence
parallelism, the distributed optimizer, overlapped gradient reduction and full recomputation, priced by the
shipped model with the tensor- and data-parallel terms added. Prints the spec + pipeline + simulation time of
`predict` (in process, after one warm-up), the simulated task count (it grows with stages x microbatches, not with
GPUs: replicas that run alike are simulated once), the predicted iteration time and the peak memory per GPU; and
the same for t 1 x p 8 x d 1 to show that the task count does not change with t and d.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def launch(tp: int, dp: int) -> dict:
    return {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 8, "world_size": tp * 8 * dp,
            "num_layers": 96, "hidden_size": 12288, "num_attention_heads": 96, "seq_length": 2048,
            "max_position_embeddings": 2048, "micro_batch_size": 1, "global_batch_size": 64 * dp,
            "vocab_size": 50257, "bf16": True, "sequence_parallel": True, "use_distributed_optimizer": True,
            "overlap_grad_reduce": True, "recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": 1, "transformer_impl": "transformer_engine"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()

    from hops_calib.loop.model_files import load_model
    from hops_calib.model.memory import stage_memory
    from hops_calib.model.model import resolve_params
    from hops_calib.model.predict import predict
    from hops_calib.spec import Hardware, spec_from_args

    model = load_model()
    for name in ("tensor_parallel_comm", "data_parallel_grad_reduce"):
        if model.active(name) is None:
            model = model.with_term(resolve_params(name, {}, origin="benchmark"))
    for tp, dp in ((8, 8), (1, 1)):
        def run():
            spec = spec_from_args(launch(tp, dp), "benchmark", run_id=f"t{tp}p8d{dp}", iterations=4,
                                  hardware=Hardware(gpu="a100", gpus_per_node=8))
            return spec, predict(spec, model)

        run()  # warm-up: imports and caches
        times = []
        for _ in range(options.repeats):
            start = time.perf_counter()
            spec, prediction = run()
            times.append(time.perf_counter() - start)
        memory = stage_memory(spec, [model.device(d).memory_bytes for d in spec.devices],
                              prediction.result.peak_activations)
        worst = max(memory, key=lambda m: m.total_bytes)
        print(f"t{tp} p8 d{dp} ({spec.gpus} GPUs, {spec.microbatches} microbatches): predict median "
              f"{statistics.median(times) * 1e3:.0f} ms (min {min(times) * 1e3:.0f}, max {max(times) * 1e3:.0f}, "
              f"{options.repeats} runs); {len(prediction.result.columns['stage'])} simulated tasks; iteration "
              f"{prediction.metrics.iteration_time_ms:.0f} ms; peak memory {worst.total_bytes / 1e9:.1f} GB of "
              f"{worst.device_bytes / 1e9:.0f} GB on stage {worst.stage}")


if __name__ == "__main__":
    main()
