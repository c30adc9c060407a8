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
  - GEMM operands: the other tensors GEMMs read and write (weights,
    activations, their gradients), which the roofline prices with the FLOPs;
  - elementwise traffic: the other tensors of every other kernel (bias and
    residual adds, GeLU, LayerNorm, bias-gradient sums...), in 16-bit passes
    over the s x b x f MLP activations (tensors of that size) and over the
    s x b x h activations (all the rest): the elementwise_traffic term's unit
    (forward 22.1 + 4, backward 27.1 + 4);
  - GEMM FLOPs.

A fill (new_zeros, zeros_like...) writes its output and reads nothing.

With `--part output` it runs a one-layer GPT (embedding, layer, output layer,
Megatron's vocab-parallel cross entropy, pretrain_gpt's masked loss) and counts
the traffic of the s x b x V logits in fp32 passes instead: the unit of the
output_layer_loss term (forward 10, backward 4.5; the fitted values are 10.15
and 7.08: the traces' last-stage backwards grow with s x V by more than the
ops' own traffic, as the decoder layers' backward GEMMs run below their
forward rate).

Usage: python experiments/scripts/layer_traffic.py [--part layer|output] [--hidden H] [--seq S] [--heads A]
       [--ffn F] [--vocab V] [--softmax-in-fp32] [--json]

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
    parser.add_argument("--part", choices=("layer", "output"), default="layer",
                        help="layer: one decoder layer's score traffic; output: a one-layer GPT's logit traffic "
                             "(output layer, cross entropy, loss)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary (--part output)")
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
    seq, batch = args.seq, 1
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(diagonal=1)
    if args.part == "layer":
        block = TransformerBlock(config, get_gpt_layer_local_spec(), post_layer_norm=False)
        hidden = torch.randn(seq, batch, args.hidden, dtype=torch.bfloat16, requires_grad=True)
        # the a x s x s scores in 16-bit passes (and the s x s boolean mask, counted against them)
        unit = batch * args.heads * seq * seq * 2

        def watched(t) -> bool:
            # by shape, not by size alone: at h = s an s x b x h activation has as many elements as the s x s mask
            # and an h x h weight is s x s. Scores and mask are batched ([b*a or b, a or 1,] s, s); a flat buffer of
            # the scores' size (autograd's zero-filled gradient storage) is score traffic too
            return ((t.dim() >= 3 and tuple(t.shape[-2:]) == (seq, seq))
                    or (t.dim() == 1 and t.numel() == batch * args.heads * seq * seq))

        def forward():
            return block(hidden, attention_mask=mask)

        def backward(output):
            # the gradient the next layer would send, made before counting starts: no op of the harness is counted
            output.backward(upstream[0])
    else:
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.module import Float16Module

        # Megatron's --bf16 wraps the model in Float16Module: bf16 weights, fp32 outputs on the last stage.
        model = Float16Module(config, GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
            max_sequence_length=seq, pre_process=True, post_process=True))
        tokens = torch.randint(0, args.vocab, (batch, seq))
        labels = torch.randint(0, args.vocab, (batch, seq))
        positions = torch.arange(seq).unsqueeze(0)
        # the s x b x V logits in fp32 passes (the output_layer_loss term's unit)
        unit = batch * seq * args.vocab * 4

        def watched(t) -> bool:
            return t.numel() == batch * seq * args.vocab
        loss_mask = torch.ones(batch * seq)

        def forward():
            losses = model(tokens, positions, mask, labels=labels)
            # pretrain_gpt.py's loss_func: masked sum over the tokens, fp32
            return torch.sum(losses.view(-1).float() * loss_mask) / loss_mask.sum()

        def backward(loss):
            loss.backward()

    GEMMS = ("mm", "addmm", "bmm", "baddbmm")  # their operands' traffic is the GEMM's own (the roofline's)
    hidden_pass, ffn_pass = batch * seq * args.hidden * 2, batch * seq * ffn * 2  # bytes of one 16-bit pass

    class Traffic(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes: dict[str, float] = defaultdict(float)
            self.ops: dict[str, float] = defaultdict(float)
            self.elementwise: dict[str, float] = defaultdict(float)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch protocol)
            result = out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"):
                return result  # an allocation: nothing read or written
            if any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
                return result  # a view (view, t, transpose, detach, permute...): metadata, no traffic
            if name == "_unsafe_view":
                return result  # a view whose schema does not say so
            kwargs = dict(kwargs or {})
            inputs = list(args)
            kwargs.pop("out", None)  # an out= argument is the output, written, not read (counted once, as `out`)
            if name == "copy_":
                inputs = inputs[1:]  # copy_ writes its destination (the output) without reading it
            if name in ("new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like"):
                inputs = []  # a fill: the tensor it is called on gives only dtype and device, and is not read
            if name in ("index", "index_put", "index_put_", "_index_put_impl_", "gather", "scatter", "scatter_"):
                # indexing touches only the indexed elements: the big tensor indexed into is neither read nor
                # written whole (an in-place index_put_ returns it: not counted either)
                inputs = inputs[1:]
                if name.endswith("_"):
                    out = None
            if func.overloadpacket is torch.ops.aten.baddbmm and kwargs.get("beta", 1) == 0:
                inputs = inputs[1:]  # beta = 0: cuBLAS does not read C, so the preallocated buffer is not traffic
            tensors = [t for t in torch.utils._pytree.tree_leaves((inputs, kwargs, out)) if isinstance(t, torch.Tensor)]
            gemm = name in GEMMS
            for t in tensors:
                kind = "watched" if watched(t) else "other" if gemm else "elementwise"
                nbytes = t.numel() * t.element_size()
                self.bytes[kind] += nbytes
                if kind == "elementwise":
                    # in 16-bit passes over the s x b x f MLP activations if it is one, else over s x b x h
                    ffn_sized = t.numel() == batch * seq * ffn
                    self.bytes["elementwise_ffn" if ffn_sized else "elementwise_hidden"] += nbytes
                    self.elementwise[name] += nbytes / hidden_pass
                if kind == "watched":
                    self.ops[name] += nbytes / unit
                    if os.environ.get("TRAFFIC_DEBUG"):
                        print("   ", func, tuple(t.shape), t.dtype, t.stride())
            return result

    results = {}
    upstream, output = [], None
    for phase in ("forward", "backward"):
        if phase == "backward" and args.part == "layer":
            upstream.append(torch.ones_like(output))
        traffic, flops = Traffic(), FlopCounterMode(display=False)
        with flops, traffic:
            if phase == "forward":
                output = forward()
            else:
                backward(output)
        results[phase] = (traffic, flops.get_total_flops())

    dist.destroy_process_group()
    layer_flops = 24 * batch * seq * args.hidden ** 2 + 4 * batch * seq ** 2 * args.hidden
    output_flops = 2 * batch * seq * args.hidden * args.vocab
    formula = layer_flops if args.part == "layer" else layer_flops + output_flops
    watched_name = "score" if args.part == "layer" else "logit"
    if args.json:
        print(json.dumps({
            "part": args.part,
            "shape": {"hidden": args.hidden, "seq": seq, "heads": args.heads, "ffn": ffn, "vocab": args.vocab,
                      "softmax_in_fp32": args.softmax_in_fp32},
            "formula_forward_flops": formula,
            **{phase: {"gemm_flops": flops, f"{watched_name}_passes": traffic.bytes["watched"] / unit,
                       f"{watched_name}_passes_by_op": dict(traffic.ops),
                       "gemm_operand_bytes": traffic.bytes["other"],
                       "elementwise_hidden_passes": traffic.bytes["elementwise_hidden"] / hidden_pass,
                       "elementwise_ffn_passes": traffic.bytes["elementwise_ffn"] / ffn_pass,
                       "elementwise_passes_by_op": dict(traffic.elementwise)}
               for phase, (traffic, flops) in results.items()},
        }))
        return 0
    if args.part == "layer":
        print(f"layer h={args.hidden} s={seq} a={args.heads} ffn={ffn}, bf16, megatron-core local spec, unfused "
              f"softmax{' in fp32' if args.softmax_in_fp32 else ' in bf16'}")
        print(f"Megatron's forward FLOPs formula 24bsh^2 + 4bs^2h = {formula / 1e9:.3f} GFLOP")
        what = "score traffic (16-bit passes over a x s x s)"
    else:
        print(f"GPT with one layer, h={args.hidden} s={seq} V={args.vocab}: embedding, layer, output layer, "
              "vocab-parallel cross entropy, pretrain_gpt's loss")
        print(f"forward FLOPs formula (layer + 2bshV) = {formula / 1e9:.3f} GFLOP")
        what = "logit traffic (fp32 passes over s x b x V)"
    for phase, (traffic, flops) in results.items():
        passes = traffic.bytes["watched"] / unit
        print(f"{phase:8s}: GEMM {flops / 1e9:8.3f} GFLOP ({flops / formula:4.2f} x formula)  "
              f"{what} {passes:5.2f}  GEMM operands {traffic.bytes['other'] / 1e6:8.2f} MB")
        for op, p in sorted(traffic.ops.items(), key=lambda kv: -kv[1]):
            print(f"    {op:32s} {p:5.2f} passes")
        if args.part == "layer":
            print(f"          elementwise kernels: {traffic.bytes['elementwise_hidden'] / hidden_pass:5.2f} 16-bit "
                  f"passes over s x b x h + {traffic.bytes['elementwise_ffn'] / ffn_pass:5.2f} over s x b x f")
            for op, p in sorted(traffic.elementwise.items(), key=lambda kv: -kv[1]):
                print(f"    {op:32s} {p:5.2f} passes over s x b x h")
    return 0


if __name__ == "__main__":
    sys.exit(main())
