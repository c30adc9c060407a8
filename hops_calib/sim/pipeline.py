"""The simulator's input: a pipeline description with per-task costs (no I/O, no model knowledge).

A cost model (`hops_calib.model`) turns a `Spec` into a `Pipeline`; the
simulator turns a `Pipeline` and a schedule into a timeline
(`hops_calib.timeline`). All times are milliseconds.

Virtual stages: with `chunks = v > 1` (interleaved 1F1B) the model is cut into
p * v virtual stages; virtual stage k is model chunk k // p on rank k % p, as in
Megatron. `stages` and the transfer tuples are indexed by virtual stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hops_calib.sim.cores import check_load, is_unshared


@dataclass(frozen=True)
class StageCosts:
    """Per-microbatch costs of one virtual stage, in ms."""

    forward_ms: float
    backward_ms: float  # the whole backward: input gradient + weight gradient
    weight_grad_ms: float = 0.0  # the weight-gradient part of backward_ms (zero-bubble schedules run it apart)
    # Host time before each task of this virtual stage, after its input has arrived: Python and dispatch work
    # (schedule bookkeeping, posting p2p, autograd set-up) that holds the rank but runs no traced compute.
    host_ms: float = 0.0


@dataclass(frozen=True)
class Pipeline:
    stages: tuple[StageCosts, ...]  # one per virtual stage (p * chunks)
    microbatches: int  # per iteration
    chunks: int = 1  # model chunks per rank (v)
    iterations: int = 1
    forward_transfer_ms: tuple[float, ...] = ()  # virtual stage k -> k+1, activation; len p*v - 1 (empty = free)
    backward_transfer_ms: tuple[float, ...] = ()  # virtual stage k+1 -> k, gradient; len p*v - 1 (empty = free)
    optimizer_ms: tuple[float, ...] = ()  # per rank (len p; empty = no optimizer step)
    # Work of each iteration outside the pipeline: after the last backward on every rank
    # (a barrier: all ranks wait for the slowest) and before the optimizer step, e.g.
    # gradient and embedding all-reduces, loss reporting.
    pre_optimizer_ms: float = 0.0
    # Per rank, its data-parallel gradient reduction (all-reduce, or reduce-scatter under the distributed
    # optimizer), which each rank starts on its own after its backwards, before any barrier: `grad_reduce_ms` is
    # its whole time, `grad_reduce_tail_ms` the part that cannot run under the rank's last backward. Without
    # overlap the two are equal (the reduction follows the last backward); with Megatron's --overlap-grad-reduce
    # the buckets reduce while the last backward runs and only the last bucket follows it, so the rank is done at
    # max(last backward end + tail, last backward start + whole). Empty: no reduction.
    grad_reduce_ms: tuple[float, ...] = ()
    grad_reduce_tail_ms: tuple[float, ...] = ()
    # Per rank, between its optimizer end and its first task of the next iteration: post_optimizer_ms on every
    # rank, plus the rank's own post_optimizer_rank_ms where given (host time that differs by device type).
    post_optimizer_ms: float = 0.0
    post_optimizer_rank_ms: tuple[float, ...] = ()
    # An occasional delay of the pre-optimizer work (a TCP retransmission timeout on the all-reduce's flow):
    # with probability stall_probability an iteration's pre-optimizer work takes stall_ms longer. The simulator
    # realizes it as a typical run would (see `simulate`), so the window averages the stalls and the median
    # iteration, like a real run's, has none when they are rare.
    stall_ms: float = 0.0
    stall_probability: float = 0.0
    # Whether every rank waits for the slowest optimizer step before its next iteration (a collective after
    # the step, such as Megatron's per-iteration timer and loss reporting with --log-interval 1).
    iteration_barrier: bool = False
    # Whether the optimizer step waits for the last backward on every rank (a collective before it: the
    # tied-embedding all-reduce, the gradient-norm all-reduce of clipping). Without one, each rank steps
    # as soon as its own last task is done, and pre_optimizer_ms counts from there.
    optimizer_barrier: bool = True
    # Megatron's 1F1B exchanges are blocking send/receive pairs: a transfer starts only when
    # both sender and receiver have reached it, and both are held until it completes.
    blocking_p2p: bool = True
    # Megatron's overlap_p2p_comm (interleaved 1F1B only; Megatron-LM's default there): the steady state's p2p calls
    # are posted after each task and waited on before the task that needs them (`schedules` module docstring).
    overlap_p2p: bool = False
    # Whether a task's untraced host time (StageCosts.host_ms) shows only when its input arrives over a link.
    # Megatron's p2p calls synchronize the host with the GPU (batch_p2p_sync), so the host work of a step that
    # received its input follows the receive on the rank's critical path; a step whose input is the rank's own
    # previous step (stage 0's forwards after a backward, the last stage's backward after its forward: no p2p
    # call between them) was dispatched while the GPU still ran the previous one, and its host time hides.
    host_after_receive_only: bool = False
    # Ranks that time-share processors (a CPU capture with more ranks than cores; `hops_calib.sim.cores`):
    # core_load[r][q] processes running rank q's work share rank r's core, so r computes at
    # 1 / sum_q core_load[r][q] * busy_q of full speed. Its tasks, host time, gradient reduction and optimizer step
    # are served so; transfers are not (they wait on the link). Empty: every rank has a device of its own.
    core_load: tuple[tuple[float, ...], ...] = ()

    @property
    def ranks(self) -> int:
        return len(self.stages) // self.chunks

    def __post_init__(self) -> None:
        if self.chunks < 1 or len(self.stages) % self.chunks:
            raise ValueError(f"{len(self.stages)} virtual stages cannot be split into {self.chunks} chunks per rank")
        if self.microbatches < 1 or self.iterations < 1:
            raise ValueError("microbatches and iterations must be at least 1")
        hops = len(self.stages) - 1
        for name in ("forward_transfer_ms", "backward_transfer_ms"):
            value = getattr(self, name)
            if value and len(value) != hops:
                raise ValueError(
                    f"{name} has {len(value)} entries; expected {hops} (one per adjacent virtual-stage pair)"
                )
        if self.optimizer_ms and len(self.optimizer_ms) != self.ranks:
            raise ValueError(f"optimizer_ms has {len(self.optimizer_ms)} entries; expected {self.ranks} (one per rank)")
        for name in ("grad_reduce_ms", "grad_reduce_tail_ms", "post_optimizer_rank_ms"):
            if getattr(self, name) and len(getattr(self, name)) != self.ranks:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries; expected {self.ranks} (one per rank)")
        if len(self.grad_reduce_tail_ms) != len(self.grad_reduce_ms) or any(
            tail > whole for tail, whole in zip(self.grad_reduce_tail_ms, self.grad_reduce_ms)
        ):
            raise ValueError("grad_reduce_tail_ms needs one entry per grad_reduce_ms entry, none longer than it")
        for k, cost in enumerate(self.stages):
            values = (cost.forward_ms, cost.backward_ms, cost.weight_grad_ms, cost.host_ms)
            if not all(0 <= v < math.inf for v in values) or cost.weight_grad_ms > cost.backward_ms:
                raise ValueError(
                    f"virtual stage {k}: costs must be finite, >= 0 and weight_grad_ms <= backward_ms ({cost})"
                )
        # A negative or NaN time would silently reorder the simulated timeline.
        for name in (
            "forward_transfer_ms",
            "backward_transfer_ms",
            "optimizer_ms",
            "grad_reduce_ms",
            "grad_reduce_tail_ms",
            "post_optimizer_rank_ms",
        ):
            for index, value in enumerate(getattr(self, name)):
                if not 0 <= value < math.inf:
                    raise ValueError(f"{name}[{index}] = {value}: times must be finite and >= 0")
        for name in ("pre_optimizer_ms", "post_optimizer_ms", "stall_ms"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} = {getattr(self, name)}: times must be finite and >= 0")
        if self.core_load:
            check_load(self.core_load, self.ranks)
        if not 0 <= self.stall_probability <= 1:
            raise ValueError(f"stall_probability = {self.stall_probability}: a probability must be in [0, 1]")

    @property
    def shares_cores(self) -> bool:
        """Whether some ranks time-share a processor (a `core_load` other than the identity)."""
        return bool(self.core_load) and not is_unshared(self.core_load)

    def post_ms(self, rank: int) -> float:
        """Rank `rank`'s time between its optimizer end and its next iteration's first task."""
        return self.post_optimizer_ms + (self.post_optimizer_rank_ms[rank] if self.post_optimizer_rank_ms else 0.0)

    @property
    def expected_pre_optimizer_ms(self) -> float:
        """The pre-optimizer work of an average iteration: the stall weighted by its probability."""
        return self.pre_optimizer_ms + self.stall_probability * self.stall_ms
