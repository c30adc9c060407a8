"""Capture room: one pipeline rank running torch.distributed.pipelining's schedules on the CPU, traced.

For the schedules Megatron-core's schedule functions do not provide: GPipe
(`ScheduleGPipe`), 1F1B (`Schedule1F1B`), interleaved 1F1B
(`ScheduleInterleaved1F1B`, virtual stage k = chunk * pp + rank, as in Megatron)
and zero-bubble ZB-H1 (`ScheduleInterleavedZeroBubble` with one stage per rank,
the paper's ZB1P, which splits each backward into an input-gradient half,
BACKWARD_B, and a weight-gradient half, BACKWARD_W, scheduled into the bubbles).

The model is a plain-torch GPT of the same shape as the Megatron engine's
(learned token and position embeddings, pre-LayerNorm decoder layers with causal
attention and a GELU MLP, final LayerNorm and an untied LM head), fp32: the same
work per layer, but not Megatron's modules. Tracing wraps the stage's own
methods: `forward_one_chunk` (FORWARD; the last stage's loss is computed by the
schedule right after it and is not inside the event), `backward_one_chunk`
(BACKWARD, or BACKWARD_B when the schedule splits the backward),
`backward_weight_one_chunk` (BACKWARD_W), and the dispatch of the send ops the
stage builds (`get_fwd_send_ops` / `get_bwd_send_ops`), as the cluster traces log
NCCL dispatch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hops_calib.capture.config import CaptureConfig
from hops_calib.capture.events import EventLog, WallClock
from hops_calib.spec import TRACE_FIRST_ITERATION
from hops_calib.timeline import BACKWARD, BACKWARD_B, BACKWARD_W, FORWARD, OPTIMIZER

SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zb_h1": "ScheduleInterleavedZeroBubble",
}


def build_stage_module(config: CaptureConfig, virtual_stage: int) -> Any:
    """The decoder layers of one virtual stage, with the embeddings on the first and the LM head on the last."""
    import torch
    from torch import nn
    from torch.nn import functional

    class DecoderLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_norm = nn.LayerNorm(config.hidden)
            self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
            self.attention_out = nn.Linear(config.hidden, config.hidden)
            self.mlp_norm = nn.LayerNorm(config.hidden)
            self.mlp_in = nn.Linear(config.hidden, config.ffn)
            self.mlp_out = nn.Linear(config.ffn, config.hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            batch, seq, hidden = x.shape
            q, k, v = self.qkv(self.attention_norm(x)).split(hidden, dim=-1)
            query, key, value = (
                t.view(batch, seq, config.heads, hidden // config.heads).transpose(1, 2) for t in (q, k, v)
            )
            attended = functional.scaled_dot_product_attention(query, key, value, is_causal=True)
            x = x + self.attention_out(attended.transpose(1, 2).reshape(batch, seq, hidden))
            return x + self.mlp_out(functional.gelu(self.mlp_in(self.mlp_norm(x))))

    class StageModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = virtual_stage == 0
            self.last = virtual_stage == config.virtual_stages - 1
            if self.first:
                self.token_embedding = nn.Embedding(config.vocab, config.hidden)
                self.position_embedding = nn.Embedding(config.seq, config.hidden)
            self.layers = nn.ModuleList(DecoderLayer() for _ in range(config.layers_per_chunk))
            if self.last:
                self.final_norm = nn.LayerNorm(config.hidden)
                self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.first:
                x = self.token_embedding(x) + self.position_embedding(torch.arange(x.shape[1]))
            for layer in self.layers:
                x = layer(x)
            if self.last:
                x = self.lm_head(self.final_norm(x))
            return x

    return StageModule()


class TorchPipelineTracer:
    """Wraps a stage's compute and send-op methods and the schedules' p2p dispatch; records into an EventLog."""

    def __init__(self, log: EventLog, clock: WallClock, pp: int) -> None:
        self.log = log
        self.clock = clock
        self.pp = pp
        self._sends: dict[int, tuple[str, int, int, int, Any]] = {}
        self._restore: list[tuple[Any, str, Callable[..., Any]]] = []

    def _patch(self, owner: Any, name: str, replacement: Callable[..., Any]) -> None:
        self._restore.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def uninstall(self) -> None:
        while self._restore:
            owner, name, original = self._restore.pop()
            setattr(owner, name, original)

    def install_schedules(self) -> None:
        from torch.distributed.pipelining import schedules

        original = schedules._batch_p2p

        def batch_p2p(p2p_ops: list[Any], desc: str | None = None) -> Any:
            start = self.clock.now_ns()
            works = original(p2p_ops, desc=desc)
            end = self.clock.now_ns()
            for op in p2p_ops:
                label = self._sends.pop(id(op), None)
                if label is not None and label[4] is op:
                    phase, microbatch, chunk, peer, _ = label
                    self.log.transfer(phase, microbatch, chunk, peer, start, end)
            return works

        self._patch(schedules, "_batch_p2p", batch_p2p)

    def install_stage(self, stage: Any) -> None:
        chunk = stage.stage_index // self.pp
        log, clock = self.log, self.clock

        def timed(name: str, phase_of: Callable[..., str]) -> None:
            original = getattr(stage, name)

            def wrapper(microbatch: int, *args: Any, **kwargs: Any) -> Any:
                start = clock.now_ns()
                result = original(microbatch, *args, **kwargs)
                log.compute(phase_of(*args, **kwargs), microbatch, chunk, start, clock.now_ns())
                return result

            self._patch(stage, name, wrapper)

        def backward_phase(*args: Any, full_backward: bool = True, **kwargs: Any) -> str:
            return BACKWARD if full_backward else BACKWARD_B

        timed("forward_one_chunk", lambda *a, **k: FORWARD)
        timed("backward_one_chunk", backward_phase)
        timed("backward_weight_one_chunk", lambda *a, **k: BACKWARD_W)

        def labelled(name: str, phase: str) -> None:
            original = getattr(stage, name)

            def wrapper(microbatch: int, *args: Any, **kwargs: Any) -> Any:
                ops = original(microbatch, *args, **kwargs)
                for op in ops:
                    self._sends[id(op)] = (phase, microbatch, chunk, int(op.peer), op)
                return ops

            self._patch(stage, name, wrapper)

        labelled("get_fwd_send_ops", FORWARD)
        labelled("get_bwd_send_ops", BACKWARD)


def run(rank: int, world: int, config: CaptureConfig, log: EventLog, clock: WallClock) -> dict[str, Any]:
    """Build this rank's stages and schedule, run warm-up and traced iterations; return facts for the manifest."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.nn import functional

    torch.manual_seed(config.seed)
    virtual_stages = [chunk * world + rank for chunk in range(config.vp)]
    modules = []
    stages = []
    for virtual_stage in virtual_stages:
        torch.manual_seed(config.seed + virtual_stage)
        module = build_stage_module(config, virtual_stage)
        modules.append(module)
        stages.append(
            pipelining.PipelineStage(
                module, virtual_stage, config.virtual_stages, torch.device("cpu"), group=dist.group.WORLD
            )
        )
    parameters = [p for module in modules for p in module.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=1e-4, weight_decay=0.01)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    schedule_class = getattr(pipelining, SCHEDULE_CLASSES[config.resolved_schedule])
    multi_stage = config.resolved_schedule in ("interleaved_1f1b", "zb_h1")
    schedule = schedule_class(stages if multi_stage else stages[0], n_microbatches=config.microbatches, loss_fn=loss_fn)

    generator = torch.Generator().manual_seed(config.seed)
    tokens = torch.randint(0, config.vocab, (config.microbatches, config.seq), generator=generator)
    targets = torch.randint(0, config.vocab, (config.microbatches, config.seq), generator=generator)
    holds_first = 0 in virtual_stages
    holds_last = config.virtual_stages - 1 in virtual_stages

    tracer = TorchPipelineTracer(log, clock, world)
    tracer.install_schedules()
    for stage in stages:
        tracer.install_stage(stage)
    try:
        for iteration in range(1, config.train_iters + 1):
            log.begin_iteration(iteration if iteration >= TRACE_FIRST_ITERATION else None)
            args = (tokens,) if holds_first else ()
            kwargs: dict[str, Any] = {"target": targets, "losses": []} if holds_last else {}
            schedule.step(*args, **kwargs)
            start = clock.now_ns()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log.compute(OPTIMIZER, config.microbatches - 1, 0, start, clock.now_ns())
    finally:
        tracer.uninstall()
        log.begin_iteration(None)
    return {
        "schedule_function": f"torch.distributed.pipelining.{schedule_class.__name__}",
        "parameters": int(sum(p.numel() for p in parameters)),
        "layers": config.layers_per_chunk * config.vp,
    }
