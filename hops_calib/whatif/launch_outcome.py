"""The launch search's priced launch: `Outcome` (what a launch of the job runs at, holds in memory and changes in
its launch) and `Refusal` (a launch that cannot run or be priced), and the size limit of a launch simulated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hops_calib.spec import Spec
from hops_calib.whatif.launch_space import (
    Launch,
    Levers,
)


@dataclass(frozen=True)
class Outcome:
    launch: Launch
    resolved: str  # the schedule simulated (auto resolved)
    microbatches: int
    layers_per_stage: tuple[int, ...]
    samples_per_s: float  # window throughput in samples (microbatches x micro batch size x replicas) per second
    steady_samples_per_s: float
    iteration_ms: float
    idle_share: float  # the simulated timeline's idle share (HOPS's bubble definition: what a trace would measure)
    schedule_bubble: float  # the schedule's own bubble on balanced stages, (p-1)/(v m + p-1)
    peak_memory_bytes: tuple[float, ...]  # per GPU
    memory_bytes: tuple[float, ...]  # per GPU, the device's capacity
    flags: tuple[str, ...]  # changes to the job's launch, in words (one per change)
    stage_map: dict[str, str]
    expected_samples_per_s: float | None = None  # under Perturbations: the run's work over its expected wall time
    p5_samples_per_s: float | None = None  # and the draws' 5th percentile
    argv: tuple[str, ...] = ()  # Megatron-LM arguments to add or set, as argv tokens (flag, value, flag, ...)
    remove: tuple[str, ...] = ()  # Megatron-LM arguments to remove from the launch
    launch_notes: tuple[str, ...] = ()  # what no flag says: a schedule Megatron-LM lacks, moving ranks between hosts
    expected_ci95: tuple[float, float] | None = None  # the expected throughput's 95 % Monte-Carlo interval
    outside: tuple[str, ...] | None = None  # features outside the calibration runs (None: not checked)
    settings: Levers | None = None  # t, p, recomputation, SP, distributed optimizer, cp, FP8, ep, etp as simulated
    dp: int = 1  # data-parallel replicas
    edp: int | None = None  # the experts' data-parallel size, world / (etp x ep x p) (None: no experts)
    band: float = 0.0  # the relative uncertainty of samples_per_s (the model's train MAPE; 0: not given)
    # the linear GEMMs' precision: fp8 (Transformer Engine's FP8 GEMMs), else the launch's own (bf16, fp16, fp32),
    # in --precision's words
    precision: str = "bf16"

    @property
    def fits(self) -> bool:
        return all(peak <= cap for peak, cap in zip(self.peak_memory_bytes, self.memory_bytes))

    def to_dict(self) -> dict[str, Any]:
        launch = self.launch
        return {
            "schedule": launch.schedule,
            "resolved_schedule": self.resolved,
            "chunks": launch.chunks,
            "micro_batch_size": launch.micro_batch_size,
            "microbatches": self.microbatches,
            "decoder_first_pipeline_num_layers": launch.first,
            "decoder_last_pipeline_num_layers": launch.last,
            "account_for_embedding_in_pipeline_split": launch.accounted[0],
            "account_for_loss_in_pipeline_split": launch.accounted[1],
            "layers_per_stage": list(self.layers_per_stage),
            "order": list(launch.order),
            "throughput_samples_per_s": self.samples_per_s,
            "steady_throughput_samples_per_s": self.steady_samples_per_s,
            "iteration_time_ms": self.iteration_ms,
            "idle_share": self.idle_share,
            "schedule_bubble": self.schedule_bubble,
            "peak_memory_bytes_per_gpu": list(self.peak_memory_bytes),
            "memory_bytes_per_gpu": list(self.memory_bytes),
            "fits": self.fits,
            "precision": self.precision,
            "flags": list(self.argv),
            "remove_flags": list(self.remove),
            "notes": list(self.launch_notes),
            "changes": list(self.flags),
            "stage_map": self.stage_map,
            "expected_throughput_samples_per_s": self.expected_samples_per_s,
            "expected_throughput_ci95": list(self.expected_ci95) if self.expected_ci95 is not None else None,
            "p5_throughput_samples_per_s": self.p5_samples_per_s,
            "outside_calibration": list(self.outside) if self.outside is not None else None,
            **(
                {
                    "tp": self.settings.tp,
                    "pp": self.settings.pp,
                    "cp": self.settings.cp,
                    "dp": self.dp,
                    "ep": self.settings.ep,
                    "etp": self.settings.etp,
                    "edp": self.edp,
                    "fp8": self.settings.fp8,
                    "recompute": self.settings.recompute_label(),
                    "recompute_granularity": self.settings.recompute[0],
                    "recompute_method": self.settings.recompute[1],
                    "recompute_num_layers": self.settings.recompute[2],
                    "sequence_parallel": self.settings.sequence_parallel,
                    "distributed_optimizer": self.settings.distributed_optimizer,
                    "megatron_runnable": self.resolved in ("1f1b", "interleaved_1f1b"),
                }
                if self.settings is not None
                else {}
            ),
            "throughput_band_samples_per_s": (
                [self.samples_per_s * (1 - self.band), self.samples_per_s * (1 + self.band)] if self.band else None
            ),
        }


class Refusal(Exception):
    """A candidate that cannot run (Megatron refuses the launch, a schedule cannot run the shape) or cannot be
    priced (a hop with no link); the reason is counted."""


# A launch with more compute tasks per iteration than this is not simulated (a microbatch count in the millions would
# take minutes per candidate): the planner counts it as refused and says to raise the micro-batch size.
MAX_TASKS = 200_000


def _tasks_of(spec: Spec) -> int:
    """The compute tasks of one iteration of `spec` (a forward and a backward per microbatch and virtual stage)."""
    return 2 * spec.microbatches * spec.pp * spec.vp


def _step_samples(launch: Launch, spec: Spec) -> int:
    """Samples per microbatch step of the pipeline, every data-parallel replica's: what turns its throughput
    (microbatches per second) into the job's samples per second, nominal or under perturbations alike."""
    return launch.micro_batch_size * spec.dp
