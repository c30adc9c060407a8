"""Simulator room: stragglers and failures, as data applied to a pipeline (pure; every random draw takes the caller's
numpy Generator).

A real cluster is not the nominal one. Three kinds of slowness and one kind of stop:

- `SlowDevice(rank, factor)`: one GPU runs its compute `factor` times slower in every iteration (thermal
  throttling, a degraded HBM stack, a lower clock: 5-15 % is typical at scale). Its forward, backward and
  optimizer step stretch; its host time (the CPU's dispatch work) does not.
- `SlowLink(a, b, factor)`: the link between ranks a and b moves data `factor` times slower, both directions
  (a flapping NIC, a congested switch port).
- `RandomStragglers(probability, low, high)`: in every iteration each rank is, with `probability`, a
  transient straggler whose compute that iteration is slowed by a factor drawn uniformly from [low, high]
  (a garbage-collection pause, a noisy neighbour, a throttling episode). Drawn per (iteration, rank) from the
  Generator passed in, so a seed reproduces a run.
- `Failure(what, rate_per_hour, recovery_s)`: a device or a link goes down at a Poisson rate per hour of wall
  time; the synchronous job stops, loses the work since its last checkpoint (the iteration in progress, and the
  completed iterations since the checkpoint when checkpoints are `checkpoint_every` iterations apart) and
  restarts after `recovery_s` (detection, restart, checkpoint reload). This is the published HOPS simulator's
  accounting: the cost of a failure is the lost iterations plus the recovery.

`perturbed(pipeline, ...)` gives the slowed pipeline for the deterministic parts; `straggler_factors` the
per-iteration compute factors that `simulate(..., compute_factors=...)` takes; `failure_run_ms` the wall time of
N iterations under failures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hops_calib.sim.pipeline import Pipeline, StageCosts


@dataclass(frozen=True)
class SlowDevice:
    rank: int
    factor: float  # compute time multiplier (1.1 = 10 % slower)

    def __post_init__(self) -> None:
        _check_factor("device", self.factor)
        if self.rank < 0:
            raise ValueError(f"slow device: rank {self.rank} must be >= 0")


@dataclass(frozen=True)
class SlowLink:
    rank_a: int
    rank_b: int
    factor: float  # transfer time multiplier, both directions

    def __post_init__(self) -> None:
        _check_factor("link", self.factor)
        if self.rank_a == self.rank_b or min(self.rank_a, self.rank_b) < 0:
            raise ValueError(f"slow link: {self.rank_a}-{self.rank_b} must name two different ranks >= 0")


@dataclass(frozen=True)
class RandomStragglers:
    probability: float  # chance that a rank straggles in an iteration
    low: float = 1.05  # its compute factor that iteration, uniform in [low, high]
    high: float = 1.15

    def __post_init__(self) -> None:
        if not 0 <= self.probability <= 1:
            raise ValueError(f"random stragglers: probability {self.probability} must be in [0, 1]")
        _check_factor("straggler", self.low)
        _check_factor("straggler", self.high)
        if self.high < self.low:
            raise ValueError(f"random stragglers: high {self.high} is below low {self.low}")


@dataclass(frozen=True)
class Failure:
    what: str  # "device R" or "link A-B": a label, the cost is the same whichever fails (the whole job stops)
    rate_per_hour: float  # failures per hour of wall time
    recovery_s: float  # down time after each failure (detect, restart, reload the checkpoint)

    def __post_init__(self) -> None:
        if not (0 <= self.rate_per_hour < math.inf and 0 <= self.recovery_s < math.inf):
            raise ValueError(
                f"failure of {self.what}: rate {self.rate_per_hour} /h and recovery {self.recovery_s} s "
                "must be finite and >= 0"
            )


def _check_factor(what: str, factor: float) -> None:
    if not (1 <= factor < math.inf):
        raise ValueError(f"slow {what}: factor {factor} must be finite and >= 1 (1.1 = 10 % slower)")


def perturbed(pipeline: Pipeline, devices: Sequence[SlowDevice] = (), links: Sequence[SlowLink] = ()) -> Pipeline:
    """`pipeline` with the slow devices' compute (forward, backward, optimizer step; not host time) and the slow
    links' transfers stretched by their factors. Virtual stage k runs on rank k % ranks, as in Megatron."""
    ranks = pipeline.ranks
    for slow in devices:
        if slow.rank >= ranks:
            raise ValueError(f"slow device: rank {slow.rank} is not in a pipeline of {ranks} ranks")
    for link in links:
        if max(link.rank_a, link.rank_b) >= ranks:
            raise ValueError(f"slow link {link.rank_a}-{link.rank_b}: not in a pipeline of {ranks} ranks")
    factor = [1.0] * ranks
    for slow in devices:
        factor[slow.rank] *= slow.factor
    stages = tuple(
        StageCosts(
            c.forward_ms * factor[k % ranks],
            c.backward_ms * factor[k % ranks],
            c.weight_grad_ms * factor[k % ranks],
            c.host_ms,
        )
        for k, c in enumerate(pipeline.stages)
    )
    optimizer = tuple(ms * factor[r] for r, ms in enumerate(pipeline.optimizer_ms))
    hop_factor = [1.0] * (len(pipeline.stages) - 1)
    for link in links:
        pair = {link.rank_a, link.rank_b}
        for k in range(len(hop_factor)):
            if {k % ranks, (k + 1) % ranks} == pair:
                hop_factor[k] *= link.factor
    forward = tuple(ms * f for ms, f in zip(pipeline.forward_transfer_ms, hop_factor))
    backward = tuple(ms * f for ms, f in zip(pipeline.backward_transfer_ms, hop_factor))
    return replace(
        pipeline, stages=stages, optimizer_ms=optimizer, forward_transfer_ms=forward, backward_transfer_ms=backward
    )


def straggler_factors(
    stragglers: RandomStragglers, iterations: int, ranks: int, rng: np.random.Generator
) -> np.ndarray:
    """Compute factors per (iteration, rank): 1 where a rank runs normally, U[low, high] where it straggles."""
    hit = rng.random((iterations, ranks)) < stragglers.probability
    slow = rng.uniform(stragglers.low, stragglers.high, (iterations, ranks))
    return np.where(hit, slow, 1.0)


# Bounds that keep a draw finite: a stretch between checkpoints restarts e^(rate x length) times in expectation.
_MAX_RESTART_EXPONENT = 10.0
_MAX_SEGMENTS = 1_000_000


@dataclass(frozen=True)
class FailureRun:
    """N iterations under failures: the wall time, and what the failures cost."""

    wall_ms: float
    failures: int
    lost_ms: float  # work redone (the iteration in progress and those since the last checkpoint)
    recovery_ms: float


def failure_run_ms(
    period_ms: float, iterations: int, failures: Sequence[Failure], rng: np.random.Generator, checkpoint_every: int = 1
) -> FailureRun:
    """Run `iterations` iterations of `period_ms` each, with failures striking at their Poisson rates over wall
    time (the job also runs, and can fail, while it redoes lost work; not while it recovers).

    A failure at a point in the run loses the work since the last checkpoint (one every `checkpoint_every`
    iterations; 1: only the iteration in progress) and adds its recovery; the job then redoes the lost work.
    """
    if not (period_ms > 0 and math.isfinite(period_ms)):
        raise ValueError(f"iteration period {period_ms} ms must be finite and > 0")
    if iterations < 1 or checkpoint_every < 1:
        raise ValueError("iterations and checkpoint_every must be at least 1")
    rate_per_ms = sum(f.rate_per_hour for f in failures) / 3.6e6
    if rate_per_ms == 0:
        return FailureRun(period_ms * iterations, 0, 0.0, 0.0)
    segment_ms = period_ms * min(checkpoint_every, iterations)  # work between checkpoints
    if rate_per_ms * segment_ms > _MAX_RESTART_EXPONENT:
        raise ValueError(
            f"failures at {rate_per_ms * 3.6e6:g} /h strike about every {1 / rate_per_ms:.0f} ms, "
            f"so a checkpointed stretch of {segment_ms:.0f} ms would need about "
            f"e^{rate_per_ms * segment_ms:.0f} restarts: the job would never finish (checkpoint more "
            "often, or check the rate's unit: failures per hour)"
        )
    if -(-iterations // checkpoint_every) > _MAX_SEGMENTS:
        raise ValueError(
            f"{iterations} iterations in stretches of {checkpoint_every}: at most {_MAX_SEGMENTS} "
            "checkpointed stretches are drawn one by one (use expected_failure_wall_ms for more)"
        )
    weights = np.array([f.rate_per_hour for f in failures], dtype=float)
    recoveries = np.array([f.recovery_s * 1e3 for f in failures])
    wall = lost = recovery = 0.0
    count = 0
    remaining = iterations
    # Each checkpointed segment runs until it completes without a failure; a failure during it costs the time
    # already spent in it, plus the recovery of whichever component failed.
    while remaining > 0:
        length = min(checkpoint_every, remaining) * period_ms
        while True:
            strike = rng.exponential(1.0 / rate_per_ms)
            if strike >= length:
                wall += length
                break
            count += 1
            which = rng.choice(len(failures), p=weights / weights.sum())
            wall += strike + recoveries[which]
            lost += strike
            recovery += recoveries[which]
        remaining -= checkpoint_every
    return FailureRun(wall, count, lost, recovery)


def expected_failure_wall_ms(
    period_ms: float, iterations: int, failures: Sequence[Failure], checkpoint_every: int = 1
) -> float:
    """The expected wall time of `failure_run_ms` in closed form: a stretch of length T between checkpoints
    under rate lambda takes (e^(lambda T) - 1) (1 / lambda + R) in expectation (restart until a failure-free T),
    with R the rate-weighted mean recovery."""
    rate_per_ms = sum(f.rate_per_hour for f in failures) / 3.6e6
    if rate_per_ms == 0:
        return period_ms * iterations
    mean_recovery = sum(f.rate_per_hour * f.recovery_s * 1e3 for f in failures) / (rate_per_ms * 3.6e6)
    full, rest = divmod(iterations, checkpoint_every)
    total = 0.0
    for count, length in ((full, checkpoint_every * period_ms), (1 if rest else 0, rest * period_ms)):
        total += count * math.expm1(rate_per_ms * length) * (1.0 / rate_per_ms + mean_recovery)
    return total
