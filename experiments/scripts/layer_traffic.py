"""Count a Megatron decoder layer's memory traffic and FLOPs from the code the cluster ran, op by op.

Evidence for the GPU-bound layer terms that does not come from any trace: one
megatron-core GPT layer, built with the cluster runs' flags (`--transformer-impl
local`, `--no-masked-softmax-fusion`, `--no-persist-layer-norm`,
`--no-gradient-accumulation-fusion`, `--bf16`, dropout 0.0; see any run's
megatron_args.txt), runs one forward and one backward on the CPU (the capture's
CUDA bridge) under a TorchDispatchMode that sees every ATen op the layer issues,
the same ops eager PyTorch issues on a GPU (no fusion happens in eager mode). For
each op it adds up the bytes of its tensor inputs and outputs (each op reads its
inputs and writes its outputs once: the unfused kernels' traffic) and its FLOPs
(torch's FlopCounterMode), and splits them into

  - score traffic: tensors with b*a*s*s elements, the attention score matrix,
    counted in 16-bit passes over it (bytes / (b*a*s*s*2));
  - other traffic: everything else (weights, activations, their gradients);
  - GEMM FLOPs.

Usage: python experiments/scripts/layer_traffic.py [--hidden H] [--seq S] [--heads A] [--ffn F]
       [--softmax-in-fp32] [--json]

Needs the [capture] extra (torch, megatron-core). Shapes are free: the pass
counts should not depend on them (that is the check that they are passes).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections import defaultdict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--seq", type=int, default=320)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--ffn", type=int, default=0, help="default 4 x hidden, as Megatron")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--softmax-in-fp32", action="store_true",
                        help="Megatron's --attention-softmax-in-fp32 (off in every shared run: the flag is absent)")
    args = parser.parse_args()
    ffn = args.ffn or 4 * args.hidden

    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from hops_calib.capture import cpu_bridge

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cpu_bridge.install()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads, ffn_hidden_size=ffn,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        attention_softmax_in_fp32=args.softmax_in_fp32,
    )
    block = TransformerBlock(config, get_gpt_layer_local_spec(), post_layer_norm=False)
    seq, batch = args.seq, 1
    score_elements = batch * args.heads * seq * seq
    hidden = torch.randn(seq, batch, args.hidden, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(diagonal=1)

    class Traffic(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes: dict[str, float] = defaultdict(float)
            self.ops: dict[str, float] = defaultdict(float)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch protocol)
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"):
                return out  # an allocation: nothing read or written
            if any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
                return out  # a view (view, t, transpose, detach, permute...): metadata, no traffic
            kwargs = kwargs or {}
            inputs = list(args)
            if name == "copy_":
                inputs = inputs[1:]  # copy_ writes its destination (the output) without reading it
            if func.overloadpacket is torch.ops.aten.baddbmm and kwargs.get("beta", 1) == 0:
                inputs = inputs[1:]  # beta = 0: cuBLAS does not read C, so the preallocated buffer is not traffic
            tensors = [t for t in torch.utils._pytree.tree_leaves((inputs, kwargs, out)) if isinstance(t, torch.Tensor)]
            for t in tensors:
                kind = "score" if t.numel() in (score_elements, seq * seq) and t.dim() >= 2 else "other"
                nbytes = t.numel() * t.element_size()
                self.bytes[kind] += nbytes
                if kind == "score":
                    self.ops[name] += nbytes / (score_elements * 2)
                    if os.environ.get("TRAFFIC_DEBUG"):
                        print("   ", func, tuple(t.shape), t.dtype, t.stride())
            return out

    results = {}
    for phase in ("forward", "backward"):
        traffic, flops = Traffic(), FlopCounterMode(display=False)
        with flops, traffic:
            if phase == "forward":
                output = block(hidden, attention_mask=mask)
            else:
                output.float().sum().backward()
        results[phase] = (traffic, flops.get_total_flops())

    dist.destroy_process_group()
    layer_flops = 24 * batch * seq * args.hidden ** 2 + 4 * batch * seq ** 2 * args.hidden
    if args.json:
        print(json.dumps({
            "shape": {"hidden": args.hidden, "seq": seq, "heads": args.heads, "ffn": ffn,
                      "softmax_in_fp32": args.softmax_in_fp32},
            "formula_forward_flops": layer_flops,
            **{phase: {"gemm_flops": flops, "score_passes": traffic.bytes["score"] / (score_elements * 2),
                       "other_bytes": traffic.bytes["other"], "score_passes_by_op": dict(traffic.ops)}
               for phase, (traffic, flops) in results.items()},
        }))
        return 0
    print(f"layer h={args.hidden} s={seq} a={args.heads} ffn={ffn}, bf16, megatron-core local spec, unfused softmax"
          f"{' in fp32' if args.softmax_in_fp32 else ' in bf16'}")
    print(f"Megatron's forward FLOPs formula 24bsh^2 + 4bs^2h = {layer_flops / 1e9:.3f} GFLOP")
    for phase, (traffic, flops) in results.items():
        passes = traffic.bytes["score"] / (score_elements * 2)
        print(f"{phase:8s}: GEMM {flops / 1e9:8.3f} GFLOP ({flops / layer_flops:4.2f} x formula)  "
              f"score traffic {passes:5.2f} passes  other traffic {traffic.bytes['other'] / 1e6:8.2f} MB")
        for op, p in sorted(traffic.ops.items(), key=lambda kv: -kv[1]):
            print(f"    {op:32s} {p:5.2f} passes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
