"""Model room: host work between one iteration's optimizer step and the next iteration's first forward."""

from __future__ import annotations

from collections.abc import Mapping

from hops_calib.model.terms.base import Context, Contribution, Param, Term


class IterationHostOverhead(Term):
    """Every rank spends a fixed host time between its optimizer step and its next iteration.

    Physics: Megatron's training loop runs Python on the host between one
    optimizer step and the next forward: `training_log` (with --log-interval 1 it
    reduces and prints the loss, timers and throughput every iteration), the
    learning-rate scheduler step, and `get_batch` for the next iteration. None of
    it is traced, and none of it scales with the model: a per-iteration constant
    per rank (post_optimizer_ms), of the order of a millisecond of Python.
    Reporting the timers gathers them from every rank (a collective), so no rank
    starts its next iteration before the slowest optimizer step is done: the term
    switches the simulator's iteration barrier on. The traces show it: stage 0,
    whose optimizer step is short, starts its next forward a few ms after the
    last stage's long step ends, not after its own.

    That gather is an all-gather over the pipeline's ranks: NCCL's ring takes
    pp - 1 steps, each a socket round of the order of a few hundred
    microseconds on these TCP links, so the gap grows with the pipeline depth
    (`per_peer_ms` per other rank; the train runs show about 2.2 ms at pp = 2
    and 3.4 ms at pp = 6).
    """

    name = "iteration_host_overhead"
    category = "host"
    params = (
        Param(
            "host_ms",
            1.0,
            0.0,
            500.0,
            "ms",
            "host time per iteration between optimizer end and next forward",
            per_device=True,
        ),
        Param(
            "per_peer_ms", 0.0, 0.0, 10.0, "ms", "one ring step of the per-iteration timer all-gather, per other rank"
        ),
    )

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        gather_ms = params["per_peer_ms"] * (context.layout.ranks - 1)
        if not any(f"host_ms@{device.type}" in params for device in context.devices):
            return Contribution(post_optimizer_ms=params["host_ms"] + gather_ms, iteration_barrier=True)
        # a device type's own host time (NAME@TYPE: its host CPU runs the loop's Python): each rank its own
        return Contribution(
            post_optimizer_ms=gather_ms,
            iteration_barrier=True,
            post_optimizer_rank_ms=tuple(self.value(params, "host_ms", device.type) for device in context.devices),
        )
