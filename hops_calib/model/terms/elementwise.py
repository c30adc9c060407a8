"""Model room: the memory traffic of a decoder layer's unfused elementwise kernels, and of its gradient accumulation."""

from __future__ import annotations

from collections.abc import Mapping

from hops_calib.model import gpt
from hops_calib.model.terms.base import Context, Contribution, Param, Term


def gradient_accumulation_fused(megatron_args: Mapping[str, object]) -> bool:
    """Whether Megatron accumulates weight gradients inside the weight-gradient GEMM (its default) rather than in a
    separate pass: `--no-gradient-accumulation-fusion` on a command line, `gradient_accumulation_fusion ... False`
    in a rank log's arguments block."""
    if "gradient_accumulation_fusion" in megatron_args:
        return bool(megatron_args["gradient_accumulation_fusion"])
    return not bool(megatron_args.get("no_gradient_accumulation_fusion", False))


class ElementwiseTraffic(Term):
    """A layer's elementwise kernels stream their tensors through memory one after another, beside its GEMMs.

    Physics: in eager PyTorch every elementwise op of a `--transformer-impl local`
    layer with the fusions off (bias adds, residual adds, GeLU, LayerNorm, the
    bias-gradient reductions, the QKV gradient's concatenation, the softmax
    scale's gradient) is its own kernel: it reads its inputs and writes its
    output once, at the memory roof, and the GEMMs on the same stream wait for
    it. So that time adds to the roofline of the GEMMs rather than hiding under
    it. `experiments/scripts/layer_traffic.py` counts it op by op from
    megatron-core's own layer (forward 22.1 passes over the s x b x h
    activations plus 4 over the s x b x f MLP activations, backward 27.1 plus 4,
    16-bit), so the passes are counted, not fitted. With
    --no-gradient-accumulation-fusion (every shared run), Megatron's
    data-parallel wrapper adds each weight's bf16 gradient into its fp32
    main_grad after every microbatch's backward (`param.main_grad.add_(grad)`):
    2 + 4 + 4 bytes per parameter (16-bit training, as every shared run; an
    fp32 run reads a 4-byte gradient: 12). Streaming kernels reach a fraction of the
    datasheet bandwidth (`memory_efficiency`, as the attention scores').
    """

    name = "elementwise_traffic"
    scope = "layers"
    params = (
        Param(
            "hidden_passes_forward",
            22.1,
            0.0,
            60.0,
            "passes",
            "16-bit passes over the s x b x h activations in a layer's forward elementwise kernels",
        ),
        Param(
            "ffn_passes_forward",
            4.0,
            0.0,
            20.0,
            "passes",
            "16-bit passes over the s x b x f MLP activations in a layer's forward elementwise kernels",
        ),
        Param(
            "hidden_passes_backward",
            27.1,
            0.0,
            60.0,
            "passes",
            "16-bit passes over the s x b x h activations in a layer's backward elementwise kernels",
        ),
        Param(
            "ffn_passes_backward",
            4.0,
            0.0,
            20.0,
            "passes",
            "16-bit passes over the s x b x f MLP activations in a layer's backward elementwise kernels",
        ),
        Param(
            "accumulation_bytes_per_parameter",
            10.0,
            0.0,
            16.0,
            "bytes",
            "bytes per layer parameter that unfused gradient accumulation moves after each microbatch's backward "
            "(16-bit gradient read, fp32 main_grad read and written: 10)",
        ),
        Param(
            "memory_efficiency",
            0.8,
            0.05,
            1.0,
            "fraction of peak",
            "achieved fraction of the device memory bandwidth in the elementwise kernels",
        ),
    )

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        shape = context.spec.model
        element = gpt.bytes_per_element(shape)
        tokens = gpt.local_tokens(shape)  # s / cp x b under context parallelism
        # Per GPU of a tensor-parallel group: the MLP's s x b x f activations split t ways; the s x b x h ones
        # (norms, residuals, dropouts) stay whole unless sequence parallelism splits them.
        t = shape.tensor_parallel
        hidden = shape.hidden_size / (t if shape.sequence_parallel else 1)
        # under experts a GPU's routed rows (T x topk x etp of f_moe / etp each) and its shared expert's: as many
        # elements as an MLP of topk x f_moe + f_shared over t
        width = shape.moe_router_topk * shape.expert_ffn + shape.moe_shared_expert_ffn if shape.moe else None
        ffn = shape.ffn_hidden_size / t if width is None else width / t
        forward_bytes = (
            tokens * element * (params["hidden_passes_forward"] * hidden + params["ffn_passes_forward"] * ffn)
        )
        backward_bytes = (
            tokens * element * (params["hidden_passes_backward"] * hidden + params["ffn_passes_backward"] * ffn)
        )
        if not gradient_accumulation_fused(context.spec.megatron_args):
            backward_bytes += params["accumulation_bytes_per_parameter"] * gpt.layer_parameters(shape)
        forward, backward = [], []
        for k, layers in enumerate(context.layout.layers):
            bytes_per_ms = context.device_of(k).memory_bandwidth_bytes_per_s * params["memory_efficiency"] / 1e3
            forward.append(layers * forward_bytes / bytes_per_ms)
            backward.append(layers * backward_bytes / bytes_per_ms)
        return Contribution(forward_ms=tuple(forward), backward_ms=tuple(backward))
