"""Capture room: one pipeline rank running Megatron-core's own schedules on the CPU, traced.

Megatron-core picks its schedule function itself (`get_forward_backward_func()`):
the non-interleaved 1F1B for one model chunk per rank, the interleaved 1F1B for
several. Tracing wraps, from outside, the schedules module's `forward_step` and
`backward_step` (the functions Megatron's own `forward-compute` and
`backward-compute` timers bracket) and the functions its p2p communicator posts
exchanges through:

- FORWARD: `forward_step`, labelled with the microbatch and model chunk Megatron passes it;
- BACKWARD: `backward_step`, labelled with the forward whose output it differentiates
  (found by the identity of that output tensor, which the schedule hands back);
- a transfer: the host-side dispatch of a p2p exchange (Megatron's `_batched_p2p_ops`
  or `_p2p_ops`, the sends and receives posted together) that sends a tensor a
  FORWARD produced (activation) or a BACKWARD produced (input gradient), as the
  cluster traces log NCCL dispatch. Like theirs, its duration is not the wire
  time; the link benchmark is;
- OPTIMIZER: `optimizer.step()` plus zeroing the gradients, once per iteration;
- a `collective` line (the schema extension of issue #19) for every collective on the tensor-parallel group
  that a forward or backward step issues through torch.distributed (Megatron's mappings, the column-parallel
  layers' input-gradient all-reduce, the vocabulary-parallel cross entropy), with its host-side call time, and
  for the data-parallel gradient all-reduce after the last backward (`--dp`: one flat all-reduce of every
  gradient, averaged, as Megatron's DDP without --overlap-grad-reduce).

With `--experts E` every decoder layer's MLP is Megatron-core's MoE layer (`install_moe` traces its router,
token exchanges and experts); with `--ep e` its experts are spread over e of the data-parallel ranks, and with
`--pp 1` Megatron runs its schedule without pipelining (`forward_backward_no_pipelining`).

With `--tp t` Megatron-core splits each layer over t ranks (`tensor_model_parallel_size`, no sequence
parallelism); with `--dp d` it builds d replicas of each stage, in its default rank order (tp-cp-ep-dp-pp).

The optimizer is torch's AdamW (Megatron's Adam with decoupled weight decay),
not Megatron's distributed optimizer wrapper, which needs its CUDA-only DDP
buffers; the model is Megatron's `GPTModel` with the local (non-Transformer-Engine)
layer spec, fp32, dropout 0, untied embeddings.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hops_calib.capture.config import CaptureConfig
from hops_calib.capture.events import Clock, EventLog, WallClock
from hops_calib.spec import TRACE_FIRST_ITERATION
from hops_calib.timeline import BACKWARD, FORWARD, OPTIMIZER

# Megatron-core announces each optional accelerator library it falls back from; on a CPU run
# every fallback is expected, and the announcements would bury real errors.
_EXPECTED_WARNINGS = (
    r".*(Apex|Transformer Engine).* not installed.*",
    r".*full scope is deprecated.*",
    # megatron/core/tensor_parallel/mappings.py gathers with all_gather_into_tensor (the MoE dispatcher's split sizes)
    r".*all_gather_into_tensor.* is deprecated.*",
)


def silence_expected_warnings() -> None:
    for pattern in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


@dataclass
class _Label:
    """What produced a tensor: used to label the backward of a forward output and the send of a tensor."""

    phase: str
    microbatch: int
    chunk: int
    tensor: Any  # kept alive so that its id() is not reused while labelled


def _first_tensor(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


class MegatronTracer:
    """Wraps Megatron's forward/backward steps and p2p exchange posting; records into an EventLog."""

    def __init__(self, log: EventLog, clock: Clock) -> None:
        self.log = log
        self.clock = clock
        self._labels: dict[int, _Label] = {}
        self._restore: list[tuple[Any, str, Callable[..., Any]]] = []
        self._handles: list[Any] = []  # module hooks to remove
        self._step: tuple[str, int] | None = None  # (phase, microbatch) of the forward or backward step running
        self._exchange: tuple[str, int] | None = None  # (MoE step, layer) of the token dispatcher's call running
        self._moe_started: dict[tuple[int, str], int] = {}  # (module id, phase) -> start of its compute

    def install(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import p2p_communication, schedules

        self._tp_group = parallel_state.get_tensor_model_parallel_group()
        self._tp_size = parallel_state.get_tensor_model_parallel_world_size()  # Megatron still calls a group of 1
        for owner, name, wrapper in (
            (schedules, "forward_step", self._wrap_forward),
            (schedules, "backward_step", self._wrap_backward),
            (p2p_communication, "_batched_p2p_ops", self._wrap_p2p),
            (p2p_communication, "_p2p_ops", self._wrap_p2p),
            (dist, "all_reduce", self._wrap_tp("all_reduce")),
            (dist, "all_gather_into_tensor", self._wrap_tp("all_gather")),
            (dist, "reduce_scatter_tensor", self._wrap_tp("reduce_scatter")),
            (dist, "all_to_all_single", self._wrap_tp("all_to_all")),
        ):
            original = getattr(owner, name)
            self._restore.append((owner, name, original))
            setattr(owner, name, wrapper(original))

    def install_moe(self, chunks: list[Any]) -> None:
        """Trace every MoE layer of the rank's chunks (megatron/core/transformer/moe/moe_layer.py, MoELayer.forward:
        route -> preprocess -> dispatch -> routed_experts_compute -> combine):

        - the router (`TopKRouter`) and the experts (`SequentialMLP`): module hooks, forward ones around the
          module's call and full backward ones from the gradient of its outputs to that of its inputs, logged as
          `moe` lines;
        - the token dispatcher's exchanges (`MoEAlltoAllTokenDispatcher`): its `dispatch_preprocess` (the
          all-gather of every rank's tokens per expert, for the split sizes), `token_dispatch` (the all-to-alls
          of the tokens and of their probabilities) and `token_combine` (the all-to-all of the experts' outputs)
          name the collectives they issue; in the backward, each all-to-all's autograd node
          (tensor_parallel/mappings.py, _AllToAll.backward: the reverse all-to-all) names its own.
        """
        from megatron.core.tensor_parallel import mappings
        from megatron.core.transformer.moe.moe_layer import MoELayer

        # mappings.py binds its all-gather at import (dist_all_gather_func: torch's all_gather_into_tensor), so
        # the dispatcher's gather of the split sizes (gather_from_sequence_parallel_region) bypasses the wrapper
        # of torch.distributed's; wrapped where it is bound
        original = mappings.dist_all_gather_func
        self._restore.append((mappings, "dist_all_gather_func", original))
        mappings.dist_all_gather_func = self._wrap_tp("all_gather")(original)
        for chunk in chunks:
            for layer in chunk.decoder.layers:
                moe = layer.mlp
                if not isinstance(moe, MoELayer):
                    continue
                number = int(layer.layer_number)
                self._hook_compute(moe.router, "router", number)
                self._hook_compute(moe.experts, "experts", number)
                for method, step in (
                    ("dispatch_preprocess", "preprocess"),
                    ("token_dispatch", "dispatch"),
                    ("token_combine", "combine"),
                ):
                    self._wrap_exchange(moe.token_dispatcher, method, step, number)

    def _hook_compute(self, module: Any, step: str, layer: int) -> None:
        def started(phase: str) -> Callable[..., None]:
            def hook(*_: Any) -> None:
                self._moe_started[(id(module), phase)] = self.clock.now_ns()

            return hook

        def ended(phase: str) -> Callable[..., None]:
            def hook(*_: Any) -> None:
                start = self._moe_started.pop((id(module), phase), None)
                if start is not None and self._step is not None and self._step[0] == phase:
                    self.log.moe(step, layer, phase, self._step[1], start, self.clock.now_ns())

            return hook

        self._handles.extend(
            (
                module.register_forward_pre_hook(started(FORWARD)),
                module.register_forward_hook(ended(FORWARD)),
                module.register_full_backward_pre_hook(started(BACKWARD)),
                module.register_full_backward_hook(ended(BACKWARD)),
            )
        )

    def _wrap_exchange(self, dispatcher: Any, method: str, step: str, layer: int) -> None:
        original = getattr(dispatcher, method)

        def enter(*_: Any) -> None:
            self._exchange = (step, layer)

        def leave(*_: Any) -> None:
            self._exchange = None

        def exchange(*args: Any, **kwargs: Any) -> Any:
            self._exchange = (step, layer)
            try:
                result = original(*args, **kwargs)
            finally:
                self._exchange = None
            if step != "preprocess":  # the all-to-alls' outputs: their nodes run the reverse all-to-alls
                for tensor in result if isinstance(result, tuple) else (result,):
                    node = getattr(tensor, "grad_fn", None)
                    if node is not None:
                        node.register_prehook(enter)
                        node.register_hook(leave)
            return result

        self._restore.append((dispatcher, method, original))
        setattr(dispatcher, method, exchange)

    def uninstall(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        while self._restore:
            owner, name, original = self._restore.pop()
            setattr(owner, name, original)

    def end_iteration(self) -> None:
        self._labels.clear()

    def _label(self, value: Any, phase: str, microbatch: int, chunk: int) -> None:
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if tensor is not None:
                self._labels[id(tensor)] = _Label(phase, microbatch, chunk, tensor)

    def _wrap_forward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward_step(*args: Any, **kwargs: Any) -> Any:
            microbatch = kwargs.get("current_microbatch")
            if microbatch is None:
                raise RuntimeError(
                    "Megatron's forward_step was called without current_microbatch; "
                    "this megatron-core version is not supported by hops-calib capture"
                )
            chunk = kwargs.get("vp_stage") or 0
            start = self.clock.now_ns()
            self._step = (FORWARD, microbatch)
            try:
                result = original(*args, **kwargs)
            finally:
                self._step = None
            end = self.clock.now_ns()
            self.log.compute(FORWARD, microbatch, chunk, start, end)
            self._label(result[0], FORWARD, microbatch, chunk)
            return result

        return forward_step

    def _wrap_backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def backward_step(input_tensor: Any, output_tensor: Any, *args: Any, **kwargs: Any) -> Any:
            label = self._labels.pop(id(_first_tensor(output_tensor)), None)
            if label is None or label.phase != FORWARD:
                raise RuntimeError("Megatron ran a backward step whose forward output was not traced")
            start = self.clock.now_ns()
            self._step = (BACKWARD, label.microbatch)
            try:
                input_grad = original(input_tensor, output_tensor, *args, **kwargs)
            finally:
                self._step = None
            end = self.clock.now_ns()
            self.log.compute(BACKWARD, label.microbatch, label.chunk, start, end)
            self._label(input_grad, BACKWARD, label.microbatch, label.chunk)
            return input_grad

        return backward_step

    def _wrap_tp(self, op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Every tensor-parallel collective goes through torch.distributed (Megatron's mappings, the column-parallel
        layers' input-gradient all-reduce in their backward, the vocabulary-parallel cross entropy): one on the
        tensor-parallel group inside a forward or backward step is logged in that step, with the host time of its
        call (an asynchronous one's dispatch, as the p2p transfers'). So is every collective the MoE token
        dispatcher issues inside a forward or backward step (`install_moe`), on the expert-parallel group."""

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            def collective(*args: Any, **kwargs: Any) -> Any:
                start = self.clock.now_ns()
                result = original(*args, **kwargs)
                end = self.clock.now_ns()
                group = kwargs.get("group", args[2] if op == "all_reduce" and len(args) > 2 else None)
                if self._step is None:
                    return result
                if group is self._tp_group and self._tp_size > 1:
                    name, moe = "tp", None
                elif self._exchange is not None and group is not None and group.size() > 1:
                    # the token dispatcher's: its expert-parallel group (tp_ep with --tp 1, which MoE captures run)
                    name, moe = "ep", self._exchange
                else:
                    return result
                tensor = args[1] if op != "all_reduce" else args[0]  # the input (a gather's output is args[0])
                phase, microbatch = self._step
                nbytes = tensor.numel() * tensor.element_size()  # an all-to-all's: all it scatters, its own share too
                if op == "all_gather":
                    nbytes = args[0].numel() * args[0].element_size()  # the whole gathered buffer
                self.log.collective(op, name, phase, microbatch, nbytes, start, end, moe=moe)
                return result

            return collective

        return wrap

    def _wrap_p2p(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """Megatron's communicator posts each exchange through one of these (batched or not), by keyword."""

        def p2p_ops(**kwargs: Any) -> Any:
            start = self.clock.now_ns()
            requests = original(**kwargs)
            end = self.clock.now_ns()
            # the peers' ranks are required keywords of Megatron's _p2p_ops and _batched_p2p_ops
            for tensor, peer in (
                (kwargs.get("tensor_send_next"), kwargs["next_pipeline_rank"]),
                (kwargs.get("tensor_send_prev"), kwargs["prev_pipeline_rank"]),
            ):
                label = self._labels.get(id(tensor)) if tensor is not None else None
                if label is not None and label.tensor is tensor:
                    self.log.transfer(label.phase, label.microbatch, label.chunk, int(peer), start, end)
            return requests

        return p2p_ops


def _reduce_gradients(parameters: list[Any], log: EventLog, clock: WallClock) -> None:
    """Average the gradients over the data-parallel replicas after the last backward, as Megatron's DDP does
    without --overlap-grad-reduce (one flat buffer, one all-reduce: its finalize_model_grads), logged as the
    BACKWARD phase's `dp` all-reduce with no microbatch. An expert's parameters (`allreduce` False, which
    tensor_parallel/layers.py sets on expert-parallel linears) are reduced apart, over the expert-data-parallel group
    (`edp`, skipped where it is one rank), and scaled by 1 / dp all the same
    (distributed/distributed_data_parallel.py, DistributedDataParallel.__init__: expert_gradient_scaling_factor):
    the tokens of every data-parallel rank reach them through the all-to-alls."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dense = [p.grad for p in parameters if p.grad is not None and getattr(p, "allreduce", True)]
    experts = [p.grad for p in parameters if p.grad is not None and not getattr(p, "allreduce", True)]
    replicas = dist.get_world_size(parallel_state.get_data_parallel_group())
    _reduce_flat(dense, parallel_state.get_data_parallel_group(), "dp", replicas, log, clock)
    if experts:
        _reduce_flat(experts, parallel_state.get_expert_data_parallel_group(), "edp", replicas, log, clock)


def _reduce_flat(grads: list[Any], group: Any, name: str, replicas: int, log: EventLog, clock: WallClock) -> None:
    """Sum `grads` over `group` in one flat all-reduce (none where the group is one rank), divide by `replicas`."""
    import torch
    import torch.distributed as dist

    start = clock.now_ns()
    flat = torch.cat([g.reshape(-1) for g in grads])
    reduced = dist.get_world_size(group) > 1
    if reduced:
        dist.all_reduce(flat, group=group)
    flat /= replicas
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    end = clock.now_ns()
    if reduced:
        log.collective("all_reduce", name, BACKWARD, None, flat.numel() * flat.element_size(), start, end)


@dataclass
class RankModel:
    """One rank's Megatron-core model chunks, optimizer and step function, as `build` makes them."""

    chunks: list[Any]
    parameters: list[Any]
    optimizer: Any
    forward_step_func: Callable[..., Any]
    vp_size: int | None
    transformer: Any

    def train_step(self, forward_backward: Callable[..., Any], config: CaptureConfig) -> None:
        """One schedule call of Megatron's (the microbatches' forwards and backwards)."""
        forward_backward(
            forward_step_func=self.forward_step_func,
            data_iterator=[None] * config.vp if self.vp_size else None,
            model=self.chunks if self.vp_size else self.chunks[0],
            num_microbatches=config.microbatches,
            seq_length=config.seq,
            micro_batch_size=1,
        )


def build(config: CaptureConfig) -> RankModel:
    """Megatron's parallel state, this rank's GPT model chunks (local layer spec, fp32), AdamW and mock data."""
    import torch

    from hops_calib.capture import cpu_bridge

    silence_expected_warnings()
    cpu_bridge.install()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    vp_size = config.vp if config.vp > 1 else None
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tp,
        pipeline_model_parallel_size=config.pp,
        virtual_pipeline_model_parallel_size=vp_size,
        expert_model_parallel_size=config.ep,
    )
    torch.manual_seed(config.seed)
    moe: dict[str, Any] = {}
    if config.experts:
        # Megatron-core's MoE layer in every decoder layer (TransformerConfig's moe_* fields; Megatron-LM's
        # --num-experts, --moe-router-topk, --moe-token-dispatcher-type alltoall): TopKRouter (softmax top-k, no
        # aux loss: --moe-aux-loss-coeff defaults to 0), MoEAlltoAllTokenDispatcher, SequentialMLP experts of
        # the dense MLP's ffn size, dropless (no capacity factor).
        moe = {
            "num_moe_experts": config.experts,
            "moe_router_topk": config.topk,
            "moe_token_dispatcher_type": "alltoall",
            "expert_model_parallel_size": config.ep,
            "moe_ffn_hidden_size": config.ffn,
            "moe_grouped_gemm": False,
            "moe_permute_fusion": False,
            "moe_router_fusion": False,
            # TransformerConfig.__post_init__ refuses a softmax over the one chosen expert (a zero gradient)
            "moe_router_pre_softmax": config.topk == 1,
        }
    transformer = TransformerConfig(
        num_layers=config.layers,
        hidden_size=config.hidden,
        num_attention_heads=config.heads,
        ffn_hidden_size=config.ffn,
        pipeline_model_parallel_size=config.pp,
        tensor_model_parallel_size=config.tp,
        sequence_parallel=False,
        virtual_pipeline_model_parallel_size=vp_size,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        # Without --overlap-p2p (megatron_args.txt says --no-overlap-p2p-communication for interleaved runs) the
        # exchanges block around each compute; with it the interleaved schedule posts its steady state's ahead
        # (overlap_p2p_comm). Unbatched isend/irecv either way (gloo has no coalescing, so batching would only
        # reorder the same calls; Megatron refuses batching with overlap).
        overlap_p2p_comm=config.overlap_p2p,
        batch_p2p_comm=False,
        **moe,
    )
    chunks = []
    for chunk in range(config.vp):
        chunks.append(
            GPTModel(
                config=transformer,
                transformer_layer_spec=get_gpt_layer_local_spec(num_experts=config.experts or None),
                vocab_size=config.vocab,
                max_sequence_length=config.seq,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=chunk),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=chunk),
                vp_stage=chunk if vp_size else None,
            )
        )
    parameters = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=1e-4, weight_decay=0.01)

    # Mock data, as Megatron's --mock-data: random tokens, drawn once (the batch is not what is measured).
    # With experts, each data-parallel rank draws its own batch, as Megatron's mock dataset hands each its own
    # samples: the router then splits the two ranks' tokens differently and the all-to-alls are uneven.
    data_seed = config.seed + (parallel_state.get_data_parallel_rank() if config.experts else 0)
    generator = torch.Generator().manual_seed(data_seed)
    tokens = torch.randint(0, config.vocab, (1, config.seq), generator=generator)
    labels = torch.randint(0, config.vocab, (1, config.seq), generator=generator)
    positions = torch.arange(config.seq).unsqueeze(0)
    causal_mask = torch.ones(1, 1, config.seq, config.seq, dtype=torch.bool).triu(diagonal=1)

    def forward_step_func(data_iterator: Any, model: Any) -> Any:
        output = model(tokens, positions, causal_mask, labels=labels)

        def loss_func(per_token_loss: Any) -> Any:
            loss = per_token_loss.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    return RankModel(chunks, parameters, optimizer, forward_step_func, vp_size, transformer)


def run(
    rank: int, world: int, config: CaptureConfig, log: EventLog, clock: WallClock, profile_path: Any = None
) -> dict[str, Any]:
    """Build this rank's model chunks, run warm-up and traced iterations; return facts for the manifest.
    `profile_path`: where the rank's PyTorch profiler trace of the traced iterations goes (`config.profile`)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    built = build(config)
    chunks, parameters, optimizer, transformer = built.chunks, built.parameters, built.optimizer, built.transformer
    forward_backward = get_forward_backward_func()
    tracer = MegatronTracer(log, clock)
    tracer.install()
    if config.experts:
        tracer.install_moe(chunks)
    profiler = None
    if profile_path is not None:
        from hops_calib.capture.profiling import RankProfiler

        profiler = RankProfiler(profile_path, TRACE_FIRST_ITERATION, config.train_iters)
        profiler.start()
    try:
        for iteration in range(1, config.train_iters + 1):
            if profiler is not None:
                profiler.step()
            log.begin_iteration(iteration if iteration >= TRACE_FIRST_ITERATION else None)
            built.train_step(forward_backward, config)
            if config.dp > 1:
                _reduce_gradients(parameters, log, clock)
            start = clock.now_ns()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            end = clock.now_ns()
            log.compute(OPTIMIZER, config.microbatches - 1, 0, start, end)
            tracer.end_iteration()
        if profiler is not None:
            profiler.stop()
    finally:
        tracer.uninstall()
        log.begin_iteration(None)
    layers_here = sum(len(chunk.decoder.layers) for chunk in chunks)
    return {
        "schedule_function": forward_backward.__name__,
        "overlap_p2p_comm": bool(transformer.overlap_p2p_comm),
        "batch_p2p_comm": bool(transformer.batch_p2p_comm),
        "parameters": int(sum(p.numel() for p in parameters)),
        "layers": int(layers_here),
        **(
            {
                "experts_per_rank": int(
                    sum(
                        len(layer.mlp.experts.local_experts)
                        for layer in chunks[0].decoder.layers
                        if hasattr(layer.mlp, "experts")
                    )
                    // max(len(chunks[0].decoder.layers), 1)
                ),
                "expert_parameters": int(sum(p.numel() for p in parameters if not getattr(p, "allreduce", True))),
            }
            if config.experts
            else {}
        ),
    }
