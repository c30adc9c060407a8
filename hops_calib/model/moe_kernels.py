"""Model room: the kernels of one decoder layer's mixture-of-experts MLP, forward and backward, counted from
megatron-core's code (paths relative to `megatron/core/transformer/moe/`). Pure: shapes and settings in, kernels out.

Per GPU and microbatch, of T tokens entering its MoE layer (`gpt.moe_tokens`: s/cp x b, split t ways by sequence
parallelism), E experts, top-k routing, ep expert-parallel and etp expert tensor-parallel GPUs, E / ep local experts:

- `moe_layer.py` MoELayer.forward: the shared expert (`shared_experts.py` SharedExpertMLP, a dense MLP over the
  tensor-parallel group), route, dispatch, the experts, combine, the shared output added;
- the router (`router.py` TopKRouter): the gating GEMM logits[T, E] = x W^T (`moe_utils.py`
  router_gating_linear, in --moe-router-dtype, else the input's), the softmax and top-k
  (`moe_utils.py` topk_softmax_with_capacity: fp32 probabilities, a boolean routing map [T, E]);
- the alltoall dispatcher (`token_dispatcher.py` MoEAlltoAllTokenDispatcher): `preprocess`'s all-gather of the
  tokens per expert over the etp x ep group (E int64 counts a rank; none when padded to capacity), `permute`
  (`moe_utils.py`: the T x k routed rows gathered with their probabilities), the all-to-all of the rows and of their probabilities over the
  expert-parallel group, under etp > 1 an all-gather over the expert tensor-parallel group, `sort_chunks_by_idxs`
  by local expert (more than one local expert); combine: the unsort, under etp > 1 a reduce-scatter (in the
  probabilities' fp32), the all-to-all back, `unpermute` (a scatter-add of the rows into the T tokens);
- the allgather dispatcher (MoEAllGatherTokenDispatcher): the routing map, the probabilities and the tokens
  all-gathered over the etp x ep group (T x etp x ep rows), the local experts' rows permuted out; combine:
  unpermute into the gathered rows and a reduce-scatter of them (in fp32) back over the group;
- the experts (`experts.py`): GroupedMLP / TEGroupedMLP (--moe-grouped-gemm: one grouped GEMM for the local
  experts) or SequentialMLP (one GEMM per local expert), each expert fc1 [m, 2 f / etp under SwiGLU], the
  activation weighted by the routing probabilities (`bias_act_func(..., permuted_probs)`), fc2 [m, h]; m = the
  expert's tokens: T x k x etp / (E / ep) balanced, times `gpt.expert_token_scale` (the load imbalance, the
  capacity factor).

The backward mirrors it: the collectives' backward (all-to-all for all-to-all, reduce-scatter for all-gather), the
experts' input and weight gradients, the permutations' gradients, the softmax's, the router's GEMMs. Megatron's
`num_floating_point_operations` counts the experts at the balanced T x k tokens and the shared expert, never the
router: the GEMMs' `model_flops` are those (the router's 0), the executed `flops` the busiest expert's.
"""

from __future__ import annotations

import math

from hops_calib.model import gpt
from hops_calib.model.kernel_types import (
    DGRAD,
    FP32,
    INDEX_BYTES,
    MASK_BYTES,
    WGRAD,
    KernelSettings,
    _Builder,
    _Dims,
)

_MOE = "transformer/moe/"
_ROUTER = f"{_MOE}router.py TopKRouter"
_UTILS = f"{_MOE}moe_utils.py"
_A2A = f"{_MOE}token_dispatcher.py MoEAlltoAllTokenDispatcher"
_AG = f"{_MOE}token_dispatcher.py MoEAllGatherTokenDispatcher"
_EXPERTS = f"{_MOE}experts.py"
# the groups of the MoE layer's collectives (`Spec.group_ranks`): the dispatchers' and the aux loss's "tp_cp"
EXPERT_GROUPS = ("ep", "etp", "tp_ep", "tp_cp")


class _Moe:
    """The sizes of one GPU's MoE layer."""

    def __init__(self, b: _Builder, d: _Dims, s: KernelSettings) -> None:
        shape = b.shape
        self.h = d.h
        self.tokens = d.local  # the GPU's T tokens (s / t x b under sequence parallelism)
        self.experts = int(shape.num_experts or 0)
        self.topk = shape.moe_router_topk
        self.ep = max(1, shape.expert_parallel)
        self.etp = max(1, shape.expert_tensor_parallel)
        self.local_experts = shape.local_experts
        self.sent = self.tokens * self.topk  # rows this GPU routes (the all-to-all's buffer, balanced)
        # the capacity (padded or dropped) moves what travels; the imbalance only what the busiest expert computes
        self.travel = gpt.expert_token_scale(shape, 1.0)
        self.balanced = self.sent * self.etp  # rows the GPU's local experts compute at balanced load
        self.rows = self.balanced * gpt.expert_token_scale(shape, s.expert_load_imbalance)
        self.per_expert = max(1, math.ceil(self.rows / max(1, self.local_experts)))
        self.ffn = shape.expert_ffn // self.etp
        self.fc1 = self.ffn * (2 if shape.swiglu else 1)
        self.router_dtype = "fp32" if shape.moe_router_fp32 else b.dtype
        self.router_e = FP32 if shape.moe_router_fp32 else b.e
        self.alltoall = shape.moe_dispatcher == "alltoall"
        self.gathered = self.tokens * self.etp * self.ep  # the allgather dispatcher's rows


def moe_forward(b: _Builder, d: _Dims, s: KernelSettings) -> None:
    """One layer's routed experts' forward on one GPU (after the pre-MLP norm and the shared expert,
    `layer_kernels._shared_expert`; before the bias-dropout-add), the shared expert's output added at its end."""
    m, e = _Moe(b, d, s), b.e
    b.gemm(
        "mlp.router",
        m.tokens,
        m.experts,
        m.h,
        source=f"{_ROUTER}.gating (router_gating_linear)",
        dtype=m.router_dtype,
        model_flops=0.0,
    )
    b.memory(
        "mlp.router.softmax_topk",
        "softmax",
        m.tokens * m.experts * (m.router_e + FP32 + MASK_BYTES) + m.sent * (FP32 + INDEX_BYTES),
        source=f"{_UTILS} topk_softmax_with_capacity",
    )
    _router_losses(b, m, False)
    if m.alltoall:
        if not b.shape.moe_pad_to_capacity:  # dropless or dropping: the split sizes, E int64 counts per rank
            _collective(
                b,
                "mlp.dispatch_split_sizes_all_gather",
                "all_gather",
                m.experts * INDEX_BYTES * m.etp * m.ep,
                "tp_ep",
                f"{_A2A}.preprocess (num_global_tokens_per_expert)",
                "int64",
            )
        b.memory(
            "mlp.permute",
            "copy",
            (m.tokens + m.sent) * m.h * e + m.sent * (FP32 + INDEX_BYTES),
            source=f"{_UTILS} permute",
        )
        _collective(b, "mlp.dispatch_all_to_all", "all_to_all", m.sent * m.travel * m.h * e, "ep", _A2A)
        _collective(b, "mlp.dispatch_probs_all_to_all", "all_to_all", m.sent * m.travel * FP32, "ep", _A2A, "fp32")
        _collective(
            b, "mlp.dispatch_all_gather", "all_gather", m.balanced * m.travel * m.h * e, "etp", f"{_A2A} (etp > 1)"
        )
        if m.local_experts > 1:
            b.memory("mlp.sort_chunks", "copy", 2 * m.rows * (m.h * e + FP32), source=f"{_UTILS} sort_chunks_by_idxs")
    else:
        for what, width, dtype in (
            ("routing_map", m.experts * MASK_BYTES, "bool"),
            ("probs", m.experts * FP32, "fp32"),
        ):
            _collective(b, f"mlp.dispatch_{what}_all_gather", "all_gather", m.gathered * width, "tp_ep", _AG, dtype)
        _collective(b, "mlp.dispatch_all_gather", "all_gather", m.gathered * m.h * e, "tp_ep", _AG)
        b.memory(
            "mlp.local_map",
            "copy",
            2 * m.gathered * m.local_experts * (MASK_BYTES + FP32),
            source=f"{_AG}.dispatch_postprocess",
        )
        b.memory(
            "mlp.permute",
            "copy",
            m.gathered * m.h * e + m.rows * (m.h * e + INDEX_BYTES),
            source=f"{_UTILS} permute",
        )
    _experts(b, m, s, False)
    if m.alltoall:
        if m.local_experts > 1:
            b.memory("mlp.unsort_chunks", "copy", 2 * m.rows * m.h * e, source=f"{_UTILS} sort_chunks_by_idxs")
        _collective(
            b,
            "mlp.combine_reduce_scatter",
            "reduce_scatter",
            m.balanced * m.travel * m.h * FP32,
            "etp",
            f"{_A2A}.combine_preprocess (etp > 1, in the probabilities' fp32)",
            "fp32",
        )
        _collective(b, "mlp.combine_all_to_all", "all_to_all", m.sent * m.travel * m.h * e, "ep", _A2A)
        b.memory(
            "mlp.unpermute",
            "add",
            (m.sent + m.tokens) * m.h * e + m.sent * INDEX_BYTES,
            source=f"{_UTILS} unpermute (scatter-add)",
        )
    else:
        b.memory(
            "mlp.unpermute",
            "add",
            m.rows * m.h * e + m.gathered * m.h * (e + FP32) + m.rows * INDEX_BYTES,
            source=f"{_UTILS} unpermute, then .to(probs dtype)",
        )
        _collective(
            b,
            "mlp.combine_reduce_scatter",
            "reduce_scatter",
            m.gathered * m.h * FP32,
            "tp_ep",
            f"{_AG}.token_combine (in fp32)",
            "fp32",
        )
    if b.shape.moe_shared_expert_ffn:
        b.memory("mlp.shared_expert_add", "add", 3 * m.tokens * m.h * e, source=f"{_A2A}.combine_postprocess")


def moe_backward(b: _Builder, d: _Dims, s: KernelSettings) -> None:
    """One layer's routed experts' backward on one GPU, in autograd's order (the forward's reversed; the shared
    expert's follows)."""
    m, e = _Moe(b, d, s), b.e
    if m.alltoall:
        b.memory(
            "mlp.unpermute.backward",
            "copy",
            (m.sent + m.tokens) * m.h * e + m.sent * INDEX_BYTES,
            source=f"{_UTILS} unpermute (backward: a gather)",
        )
        _collective(b, "mlp.combine_all_to_all.backward", "all_to_all", m.sent * m.travel * m.h * e, "ep", _A2A)
        _collective(
            b,
            "mlp.combine_reduce_scatter.backward",
            "all_gather",
            m.balanced * m.travel * m.h * FP32,
            "etp",
            _A2A,
            "fp32",
        )
        if m.local_experts > 1:
            b.memory("mlp.unsort_chunks.backward", "copy", 2 * m.rows * m.h * e, source=f"{_UTILS} sort_chunks_by_idxs")
    else:
        _collective(
            b, "mlp.combine_reduce_scatter.backward", "all_gather", m.gathered * m.h * FP32, "tp_ep", _AG, "fp32"
        )
        b.memory(
            "mlp.unpermute.backward",
            "copy",
            m.rows * m.h * e + m.gathered * m.h * (e + FP32) + m.rows * INDEX_BYTES,
            source=f"{_UTILS} unpermute (backward)",
        )
    _experts(b, m, s, True)
    if m.alltoall:
        if m.local_experts > 1:
            b.memory(
                "mlp.sort_chunks.backward",
                "copy",
                2 * m.rows * (m.h * e + FP32),
                source=f"{_UTILS} sort_chunks_by_idxs",
            )
        _collective(
            b, "mlp.dispatch_all_gather.backward", "reduce_scatter", m.balanced * m.travel * m.h * e, "etp", _A2A
        )
        _collective(b, "mlp.dispatch_all_to_all.backward", "all_to_all", m.sent * m.travel * m.h * e, "ep", _A2A)
        _collective(
            b, "mlp.dispatch_probs_all_to_all.backward", "all_to_all", m.sent * m.travel * FP32, "ep", _A2A, "fp32"
        )
        b.memory(
            "mlp.permute.backward",
            "add",
            (m.tokens + m.sent) * m.h * e + m.sent * (2 * FP32 + INDEX_BYTES) + m.tokens * m.experts * FP32,
            source=f"{_UTILS} permute (backward: a scatter-add of the rows and their probabilities)",
        )
    else:
        b.memory(
            "mlp.permute.backward",
            "add",
            m.gathered * m.h * e + m.rows * (m.h * e + INDEX_BYTES + FP32) + m.gathered * m.local_experts * FP32,
            source=f"{_UTILS} permute (backward)",
        )
        _collective(b, "mlp.dispatch_all_gather.backward", "reduce_scatter", m.gathered * m.h * e, "tp_ep", _AG)
        _collective(
            b,
            "mlp.dispatch_probs_all_gather.backward",
            "reduce_scatter",
            m.gathered * m.experts * FP32,
            "tp_ep",
            _AG,
            "fp32",
        )
    _router_losses(b, m, True)
    b.memory(
        "mlp.router.softmax_topk.backward",
        "softmax",
        m.tokens * m.experts * (2 * FP32 + m.router_e),
        source=f"{_UTILS} topk_softmax_with_capacity (autograd)",
    )
    source = f"{_UTILS} RouterGatingLinearFunction.backward"
    b.gemm("mlp.router.dgrad", m.tokens, m.h, m.experts, source=source, dtype=m.router_dtype, model_flops=0.0)
    b.gemm(
        "mlp.router.wgrad",
        m.experts,
        m.h,
        m.tokens,
        source=source,
        phase=WGRAD,
        dtype=m.router_dtype,
        model_flops=0.0,
    )
    b.memory(
        "mlp.router.main_grad_add",
        "add",
        m.experts * m.h * (m.router_e + 2 * FP32),
        source="distributed/distributed_data_parallel.py _make_backward_post_hook (main_grad.add_)",
        phase=WGRAD,
    )
    b.memory(
        "mlp.router.input_grad_add",
        "add",
        3 * m.tokens * m.h * b.e,
        source=f"{_MOE}moe_layer.py (autograd adds the router's input gradient to the experts')",
    )


def _router_losses(b: _Builder, m: _Moe, backward: bool) -> None:
    """The router's z-loss (`router.py` TopKRouter.apply_z_loss: the logits' logsumexp, squared and averaged; under
    --moe-z-loss-coeff) and load-balancing loss (`_apply_aux_loss` and its seq / global variants, under
    --moe-aux-loss-coeff: `moe_utils.py` compute_routing_scores_for_aux_loss, a softmax and top-k of its own;
    get_tokens_per_expert_and_token_count, the routing map's column sums all-reduced over the tensor x
    context-parallel group; switch_load_balancing_loss_func over the scores), and their gradients."""
    shape, cells = b.shape, m.tokens * m.experts
    if shape.moe_z_loss:
        b.memory(
            "mlp.router.z_loss" + (".backward" if backward else ""),
            "softmax",
            cells * (2 * m.router_e + FP32) if backward else cells * m.router_e,
            source=f"{_ROUTER}.apply_z_loss (z_loss_func)",
        )
    if not shape.moe_aux_loss:
        return
    if backward:
        b.memory(
            "mlp.router.aux_loss.backward", "add", 3 * cells * FP32, source=f"{_UTILS} switch_load_balancing_loss_func"
        )
        b.memory(
            "mlp.router.aux_scores.backward",
            "softmax",
            cells * (2 * FP32 + m.router_e),
            source=f"{_UTILS} compute_routing_scores_for_aux_loss (autograd)",
        )
        return
    b.memory(
        "mlp.router.aux_scores",
        "softmax",
        cells * (m.router_e + FP32 + MASK_BYTES),
        source=f"{_UTILS} compute_routing_scores_for_aux_loss",
    )
    b.memory(
        "mlp.router.aux_tokens_per_expert",
        "sum",
        cells * MASK_BYTES + m.experts * INDEX_BYTES,
        source=f"{_UTILS} get_tokens_per_expert_and_token_count",
    )
    _collective(
        b,
        "mlp.router.aux_tokens_all_reduce",
        "all_reduce",
        m.experts * INDEX_BYTES,
        "tp_cp",
        f"{_UTILS} get_tokens_per_expert_and_token_count (reduce_from_tensor_model_parallel_region)",
        "int64",
    )
    b.memory("mlp.router.aux_loss", "sum", cells * FP32, source=f"{_UTILS} switch_load_balancing_loss_func")


def _collective(b: _Builder, name: str, op: str, nbytes: float, group: str, source: str, dtype: str = "") -> None:
    """An expert layer's collective, listed where its group has more than one GPU."""
    shape = b.shape
    size = {
        "ep": shape.expert_parallel,
        "etp": shape.expert_tensor_parallel,
        "tp_ep": shape.expert_parallel * shape.expert_tensor_parallel,
        "tp_cp": shape.tensor_parallel * shape.context_parallel,
    }[group]
    if size > 1:
        b.collective(name, op, nbytes, source=source, group=group, dtype=dtype)


def _experts(b: _Builder, m: _Moe, s: KernelSettings, backward: bool) -> None:
    """The local experts' GEMMs and activation: one grouped GEMM each (--moe-grouped-gemm: GroupedMLP /
    TEGroupedMLP, `grouped_gemm_util` / TE's GroupedLinear) or one GEMM per local expert (SequentialMLP). The
    executed GEMMs take the busiest expert's tokens (`m.per_expert`), the count the balanced ones."""
    e = b.e
    grouped = b.shape.moe_grouped_gemm
    source = f"{_EXPERTS} " + ("TEGroupedMLP / GroupedMLP (grouped GEMM)" if grouped else "SequentialMLP")
    batches = (("", m.local_experts),) if grouped else tuple((f".{k}", 1) for k in range(m.local_experts))
    share = 1.0 if grouped else 1.0 / max(1, m.local_experts)

    def gemm(name: str, rows: int, cols: int, inner: int, wgrad: bool, model: float) -> None:
        for tag, batch in batches:
            b.gemm(
                f"{name}{tag}",
                rows,
                cols,
                inner,
                batch=batch,
                source=source,
                phase=(WGRAD if wgrad else DGRAD) if backward else None,
                accumulate_fp32=wgrad and s.gradient_accumulation_fusion,
                model_flops=model * share,
            )
            if wgrad and not s.gradient_accumulation_fusion:
                b.memory(
                    f"{name}{tag}.main_grad_add",
                    "add",
                    batch * rows * cols * (e + 2 * FP32),
                    source="distributed/distributed_data_parallel.py _make_backward_post_hook (main_grad.add_)",
                    phase=WGRAD,
                )

    fc1_model = 2.0 * m.balanced * m.fc1 * m.h
    fc2_model = 2.0 * m.balanced * m.h * m.ffn
    kind = "swiglu" if b.shape.swiglu else "gelu"
    act = f"{_EXPERTS} (bias_act_func with the routing probabilities)"
    if not backward:
        gemm("mlp.experts.linear_fc1", m.per_expert, m.fc1, m.h, False, fc1_model)
        b.memory(f"mlp.experts.{kind}", kind, m.rows * ((m.fc1 + m.ffn) * e + FP32), source=act)
        gemm("mlp.experts.linear_fc2", m.per_expert, m.h, m.ffn, False, fc2_model)
        return
    gemm("mlp.experts.linear_fc2.dgrad", m.per_expert, m.ffn, m.h, False, fc2_model)
    gemm("mlp.experts.linear_fc2.wgrad", m.h, m.ffn, m.per_expert, True, fc2_model)
    b.memory(f"mlp.experts.{kind}.backward", kind, m.rows * ((m.ffn + 2 * m.fc1) * e + 2 * FP32), source=act)
    gemm("mlp.experts.linear_fc1.dgrad", m.per_expert, m.h, m.fc1, False, fc1_model)
    gemm("mlp.experts.linear_fc1.wgrad", m.fc1, m.h, m.per_expert, True, fc1_model)
