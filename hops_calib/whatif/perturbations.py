"""What-if room: stragglers and failures of a job's devices and links, named by device id (a launch moves devices
between stages), turned into the simulator's perturbations (`hops_calib.sim.perturb`) for one stage order.

`predict --job`, `plot timeline --job` and `plan --job` take them: a device slowed by a factor, a link (between two
devices) slowed by a factor, random transient stragglers, and failures that stop the job (rate per hour, recovery
time; lost work since the last checkpoint). With random ones, a launch is simulated `samples` times with seeded
draws and its throughput given as the mean and the 5th percentile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hops_calib.sim import Pipeline, SimResult, simulate
from hops_calib.sim.perturb import (
    Failure,
    RandomStragglers,
    SlowDevice,
    SlowLink,
    expected_failure_wall_ms,
    failure_run_ms,
    perturbed,
    straggler_factors,
)

Z95 = 1.959963984540054  # the normal distribution's two-sided 95 % quantile


@dataclass(frozen=True)
class Estimate:
    """A launch's throughput (per second) under perturbations: the expected one, total work over the expected wall
    time (failures in closed form, `expected_failure_wall_ms`; stragglers averaged over the seeded draws), with the
    95 % confidence interval of the Monte-Carlo part (equal to it when nothing random is drawn), and the 5th
    percentile of the draws' throughputs."""

    expected: float
    low: float
    high: float
    p5: float
    draws: int

    def scaled(self, factor: float) -> Estimate:
        return Estimate(self.expected * factor, self.low * factor, self.high * factor, self.p5 * factor, self.draws)

    @property
    def half_width_pct(self) -> float:
        return 100 * (self.high - self.low) / 2 / self.expected if self.expected > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "expected": self.expected,
            "expected_ci95": [self.low, self.high],
            "expected_ci95_half_width_pct": self.half_width_pct,
            "p5": self.p5,
            "draws": self.draws,
        }


# Iterations of a run the failures strike when neither the launch (--train-iters) nor --run-iterations says.
DEFAULT_RUN_ITERATIONS = 1000


@dataclass(frozen=True)
class Perturbations:
    slow_devices: tuple[tuple[str, float], ...] = ()  # (device id, compute factor)
    slow_links: tuple[tuple[str, str, float], ...] = ()  # (device id, device id, transfer factor)
    stragglers: RandomStragglers | None = None
    failures: tuple[Failure, ...] = ()  # the whole job stops when any one fails
    checkpoint_every: int = 1  # iterations between checkpoints: a failure loses those since the last one
    run_iterations: int = DEFAULT_RUN_ITERATIONS  # iterations of the run the failures strike (the whole run)
    run_iterations_from: str = ""  # where run_iterations came from (the launch's --train-iters, --run-iterations)
    samples: int = 32  # draws per launch when something is random
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.samples <= 10_000 or self.run_iterations < 1 or self.checkpoint_every < 1:
            raise ValueError("samples (1..10000), run iterations and checkpoint interval (at least 1) are out of range")

    @property
    def random(self) -> bool:
        return self.stragglers is not None or bool(self.failures)

    def pipeline(self, pipeline: Pipeline, order: Sequence[str]) -> Pipeline:
        """`pipeline` (stages run by the devices of `order`) with the slow devices and links that are in it."""
        devices = [
            SlowDevice(list(order).index(device), factor) for device, factor in self.slow_devices if device in order
        ]
        links = [
            SlowLink(list(order).index(a), list(order).index(b), factor)
            for a, b, factor in self.slow_links
            if a in order and b in order
        ]
        return perturbed(pipeline, devices, links)

    def results(self, pipeline: Pipeline, schedule: str, order: Sequence[str]) -> list[SimResult]:
        """The perturbed pipeline simulated once per draw (once when nothing is random), seeded."""
        slowed = self.pipeline(pipeline, order)
        rng = np.random.default_rng(self.seed)
        out = []
        for _ in range(self.samples if self.stragglers is not None else 1):
            factors = (
                straggler_factors(self.stragglers, slowed.iterations, slowed.ranks, rng)
                if self.stragglers is not None
                else None
            )
            out.append(simulate(slowed, schedule, compute_factors=factors))
        return out

    def throughputs(self, pipeline: Pipeline, schedule: str, order: Sequence[str]) -> np.ndarray:
        """Microbatches per second of each draw: the perturbed window throughput, and under failures the share of
        a `run_iterations` run left once the failures' lost work and recoveries are paid (one failure draw per
        straggler draw, or `samples` of them)."""
        rng = np.random.default_rng(self.seed + 1)
        results = self.results(pipeline, schedule, order)
        if self.failures and len(results) == 1:
            results = results * self.samples
        rates = []
        for result in results:
            rate = result.metrics().throughput_per_s
            if self.failures:
                period_ms = pipeline.microbatches / rate * 1e3
                run = failure_run_ms(period_ms, self.run_iterations, self.failures, rng, self.checkpoint_every)
                rate *= period_ms * self.run_iterations / run.wall_ms
            rates.append(rate)
        return np.asarray(rates)

    def estimate(self, pipeline: Pipeline, schedule: str, order: Sequence[str]) -> Estimate:
        """The expected throughput (microbatches per second: the run's work over its expected wall time), its 95 %
        interval and the draws' 5th percentile (see `Estimate`)."""
        results = self.results(pipeline, schedule, order)
        periods = np.array([pipeline.microbatches / r.metrics().throughput_per_s * 1e3 for r in results])
        walls = np.array(
            [
                expected_failure_wall_ms(period, self.run_iterations, self.failures, self.checkpoint_every)
                for period in periods
            ]
        )
        work = pipeline.microbatches * self.run_iterations * 1e3  # microbatches, per ms -> per s
        mean = float(walls.mean())
        half = Z95 * float(walls.std(ddof=1)) / np.sqrt(len(walls)) if len(walls) > 1 else 0.0
        p5 = float(np.percentile(self.throughputs(pipeline, schedule, order), 5))
        return Estimate(
            work / mean,
            work / (mean + half),
            work / (mean - half) if mean > half else np.inf,
            p5,
            len(results) * (self.samples if self.failures and len(results) == 1 else 1),
        )

    def describe(self) -> str:
        parts = [f"{device} {factor:g}x slower" for device, factor in self.slow_devices]
        parts += [
            f"hop {a}-{b} {factor:g}x slower (where they are neighbouring stages)" for a, b, factor in self.slow_links
        ]
        if self.stragglers is not None:
            s = self.stragglers
            parts.append(
                f"random stragglers (each GPU, each iteration, chance {s.probability:g}, {s.low:g}-{s.high:g}x)"
            )
        parts += [f"{f.what} fails {f.rate_per_hour:g}/h, {f.recovery_s:g} s to recover" for f in self.failures]
        if self.failures:
            parts.append(
                f"checkpoint every {self.checkpoint_every} iteration(s), over {self.run_iterations} "
                f"iterations ({self.run_iterations_from or 'default'})"
            )
        if self.random:
            parts.append(f"{self.samples} seeded draws (seed {self.seed})")
        return "; ".join(parts) or "none"
