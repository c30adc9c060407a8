"""Capture room: what one CPU capture runs (shape, pipeline, schedule) and its equivalent Megatron command line.

Pure: no torch, no I/O. `CaptureConfig.validate()` rejects a configuration that
Megatron or torch would reject later inside a worker process, where the error is
harder to read.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace

from hops_calib.spec import SCHEDULES, TRACE_FIRST_ITERATION

ENGINES = ("megatron", "torch")
# Schedules each engine can run. Megatron-core picks its own function from (pp, vp):
# the non-interleaved 1F1B for vp == 1, the interleaved 1F1B for vp > 1.
ENGINE_SCHEDULES = {
    "megatron": ("1f1b", "interleaved_1f1b"),
    "torch": ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1"),
}
# Iterations run before tracing starts, matching the HOPS tracing fork (it traces from
# iteration TRACE_FIRST_ITERATION on); they also pay the one-off allocator and import costs.
WARMUP_ITERATIONS = TRACE_FIRST_ITERATION - 1
# Megatron-LM's flags that every capture shares (fp32: no --bf16, since the CPU run is fp32; --clip-grad 0.0,
# since each rank steps torch's AdamW on its own, with no gradient-norm all-reduce across the pipeline).
_FIXED_ARGS = (
    "--tensor-model-parallel-size {tp} --micro-batch-size 1 --lr 1.0e-4 --min-lr 1.0e-4 "
    "--lr-decay-style constant --transformer-impl local --no-persist-layer-norm "
    "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion "
    "--untie-embeddings-and-output-weights --clip-grad 0.0 --mock-data --tokenizer-type NullTokenizer "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --eval-iters 0 --log-interval 1"
)


class CaptureConfigError(ValueError):
    """A capture configuration that cannot run; the message names the option and what to pass instead."""


def _memory_bytes() -> int | None:
    """This machine's physical memory, or None when it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class CaptureConfig:
    """One capture: a GPT model split over `pp` pipeline stages (each with `vp` model chunks), each stage on a
    tensor-parallel group of `tp` CPU ranks, replicated `dp` times (tp x dp x pp ranks in all)."""

    pp: int = 2
    vp: int = 1
    tp: int = 1
    dp: int = 1
    microbatches: int = 4
    iterations: int = 4  # traced iterations (numbered from TRACE_FIRST_ITERATION)
    layers: int = 4
    hidden: int = 512
    seq: int = 256
    heads: int = 8
    ffn_hidden: int = 0  # 0 = 4 * hidden, Megatron's default
    vocab: int = 8192
    engine: str = "megatron"
    schedule: str = ""  # "" = the engine's default for (pp, vp)
    seed: int = 1234
    link_bench: bool = True
    link_bench_iters: int = 50  # timed sends per message size (after 10 warm-up sends), as the cluster benchmark
    # Record a PyTorch profiler (Kineto) trace of the traced iterations on every rank, beside the event log, as
    # Megatron-LM's --profile --use-pytorch-profiler (capture/profiling.py)
    profile: bool = False
    # Megatron's overlap_p2p_comm (interleaved only, Megatron-LM's default there): the steady state's sends and
    # receives posted ahead and waited on later; off, the calls block around each task (--no-overlap-p2p-communication)
    overlap_p2p: bool = False
    # Megatron-core's mixture of experts (megatron/core/transformer/moe/): `experts` routed experts per MoE layer
    # (0: the dense MLP), every decoder layer an MoE layer; TopKRouter choosing `topk` experts a token,
    # MoEAlltoAllTokenDispatcher, SequentialMLP experts; `ep` expert-parallel ranks (carved out of the
    # data-parallel ones, as Megatron's expert_model_parallel_size: each holds experts / ep experts)
    experts: int = 0
    topk: int = 1
    ep: int = 1

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def world(self) -> int:
        """Ranks of the capture: tp x dp x pp."""
        return self.tp * self.dp * self.pp

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.vp

    @property
    def layers_per_chunk(self) -> int:
        return self.layers // self.virtual_stages

    @property
    def train_iters(self) -> int:
        return self.iterations + WARMUP_ITERATIONS

    @property
    def resolved_schedule(self) -> str:
        if self.schedule:
            return self.schedule
        return "interleaved_1f1b" if self.vp > 1 else "1f1b"

    def resolved(self) -> CaptureConfig:
        """This configuration with the schedule filled in, after validation."""
        self.validate()
        return replace(self, schedule=self.resolved_schedule)

    def validate(self) -> None:
        def need(condition: bool, option: str, message: str) -> None:
            if not condition:
                raise CaptureConfigError(f"--{option}: {message}")

        for option, value in (
            ("pp", self.pp),
            ("vp", self.vp),
            ("tp", self.tp),
            ("dp", self.dp),
            ("microbatches", self.microbatches),
            ("iterations", self.iterations),
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("seq", self.seq),
            ("heads", self.heads),
            ("vocab", self.vocab),
            ("link-bench-iters", self.link_bench_iters),
            ("topk", self.topk),
            ("ep", self.ep),
        ):
            need(isinstance(value, int) and value >= 1, option, f"is {value!r}; pass a positive integer")
        need(
            isinstance(self.ffn_hidden, int) and self.ffn_hidden >= 0,
            "ffn-hidden",
            f"is {self.ffn_hidden!r}; pass a positive integer (or 0 for 4 x --hidden)",
        )
        need(
            isinstance(self.experts, int) and self.experts >= 0,
            "experts",
            f"is {self.experts!r}; pass a positive integer (or 0 for the dense MLP)",
        )
        need(
            self.pp >= 2 or (self.pp == 1 and self.world >= 2),
            "pp",
            f"is {self.pp}; a capture needs at least 2 ranks: 2 pipeline stages, or --pp 1 with --dp 2 or more",
        )
        self._validate_experts(need)
        need(
            self.pp > 1 or not self.link_bench,
            "link-bench",
            "with --pp 1 there is no pipeline hop to benchmark; pass --no-link-bench",
        )
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        need(
            self.world <= max(cores, 2) * 4,
            "pp",
            f"gives {self.world} ranks (tp x dp x pp): one process per "
            f"rank on {cores} core(s) would time mostly the scheduler; pass at most 4 ranks per core (one per core "
            "gives honest timings)",
        )
        for option, size in (("heads", self.heads), ("ffn-hidden", self.ffn), ("vocab", self.vocab)):
            need(
                size % self.tp == 0,
                option,
                f"{size} is not divisible by --tp {self.tp}: Megatron splits it over the tensor-parallel group",
            )
        need(
            (self.tp == 1 and self.dp == 1) or self.engine == "megatron",
            "tp",
            "tensor and data parallelism run on the megatron engine only",
        )
        need(
            not self.profile or self.engine == "megatron",
            "profile",
            "the PyTorch profiler trace is recorded on the megatron engine only",
        )
        # A rank holds its chunk's weights and fp32 optimizer state (~16 bytes per parameter) plus activations:
        # refuse what cannot fit in this machine's memory before any rank starts.
        experts_here = self.experts // self.ep if self.experts else 1  # an MoE layer holds its rank's experts' MLPs
        per_layer = 4 * self.hidden * self.hidden + experts_here * 2 * self.hidden * self.ffn
        params = (self.layers // max(self.pp, 1)) * per_layer + self.vocab * self.hidden
        activations = (
            self.microbatches
            * self.seq
            * (self.hidden * 34 + 5 * self.heads * self.seq)
            * 4
            * max(self.layers // max(self.pp, 1), 1)
        )
        need_bytes = self.dp * self.pp * (16 * params + activations)  # tensor parallelism splits, replicas copy
        total = _memory_bytes()
        need(
            total is None or need_bytes <= 0.8 * total,
            "hidden",
            f"this shape needs about {need_bytes / 2**30:.1f} GiB over {self.pp} ranks, more than 80 % of this "
            f"machine's {total / 2**30 if total else 0:.1f} GiB; pass a smaller --hidden, --seq, --layers, --vocab "
            "or --microbatches",
        )
        need(self.engine in ENGINES, "engine", f"is {self.engine!r}; pass one of {', '.join(ENGINES)}")
        schedule = self.resolved_schedule
        need(schedule in SCHEDULES, "schedule", f"is {schedule!r}; pass one of {', '.join(SCHEDULES)}")
        allowed = ENGINE_SCHEDULES[self.engine]
        need(
            schedule in allowed,
            "schedule",
            f"{schedule!r} does not run on the {self.engine} engine; it runs {', '.join(allowed)}",
        )
        need(self.hidden % self.heads == 0, "heads", f"{self.heads} does not divide --hidden {self.hidden}")
        need(
            self.layers % self.virtual_stages == 0,
            "layers",
            f"{self.layers} layers cannot be split evenly over pp*vp = {self.virtual_stages} model chunks; "
            f"pass a multiple of {self.virtual_stages}",
        )
        if schedule == "interleaved_1f1b":
            need(self.vp >= 2, "vp", f"is {self.vp}; the interleaved schedule needs at least 2 chunks per rank")
            # Megatron groups microbatches by pp per virtual stage and refuses a partial last group.
            need(
                self.microbatches % self.pp == 0,
                "microbatches",
                f"{self.microbatches} is not a multiple of --pp {self.pp}, which the interleaved schedule requires",
            )
        else:
            need(
                self.vp == 1,
                "vp",
                f"is {self.vp}, but schedule {schedule!r} runs one model chunk per rank; pass --vp 1",
            )
        need(
            not self.overlap_p2p or (schedule == "interleaved_1f1b" and self.engine == "megatron"),
            "overlap-p2p",
            "overlaps only Megatron's interleaved schedule's p2p (its non-interleaved one refuses overlap_p2p_comm); "
            "pass --vp 2 or drop --overlap-p2p",
        )
        need(
            self.microbatches >= self.pp or schedule == "gpipe",
            "microbatches",
            f"{self.microbatches} is fewer than --pp {self.pp}; the pipeline would never fill",
        )

    def _validate_experts(self, need: Callable[[bool, str, str], None]) -> None:
        """Megatron-core's own refusals of an MoE configuration, before any rank starts."""
        if not self.experts:
            need(self.ep == 1, "ep", f"is {self.ep}; expert parallelism needs --experts")
            need(self.topk == 1, "topk", f"is {self.topk}; the router's top-k needs --experts")
            return
        need(self.engine == "megatron", "experts", "the mixture of experts runs on the megatron engine only")
        need(self.topk <= self.experts, "topk", f"is {self.topk}, more than the {self.experts} experts")
        # TransformerConfig.__post_init__: num_moe_experts % expert_model_parallel_size == 0
        need(
            self.experts % self.ep == 0,
            "ep",
            f"{self.ep} does not divide --experts {self.experts}: each expert-parallel rank holds experts / ep",
        )
        # parallel_state.initialize_model_parallel: the expert-parallel ranks come out of the data-parallel ones
        need(self.dp % self.ep == 0, "ep", f"{self.ep} does not divide --dp {self.dp}: EP ranks are DP ranks")
        # MoELayer.forward refuses tensor parallelism without sequence parallelism in training
        need(
            self.tp == 1,
            "tp",
            "is not 1: Megatron's MoE layer needs sequence parallelism with --tp > 1, which "
            "captures do not run; pass --tp 1",
        )

    def megatron_args(self) -> str:
        """The Megatron-LM launch command line equivalent to this capture (one line, like megatron_args.txt)."""
        parts = [
            *([f"torchrun --nproc-per-node {self.world}"] if self.world > self.pp else []),
            "pretrain_gpt.py",
            f"--pipeline-model-parallel-size {self.pp}",
        ]
        if self.vp > 1:
            # Megatron-LM overlaps the interleaved schedule's p2p with compute unless told not to.
            parts.append(
                f"--num-layers-per-virtual-pipeline-stage {self.layers_per_chunk}"
                + ("" if self.overlap_p2p else " --no-overlap-p2p-communication")
            )
        parts += [
            f"--num-layers {self.layers}",
            f"--hidden-size {self.hidden}",
            f"--ffn-hidden-size {self.ffn}",
            f"--num-attention-heads {self.heads}",
            f"--seq-length {self.seq}",
            f"--max-position-embeddings {self.seq}",
            f"--global-batch-size {self.microbatches * self.dp}",
            f"--train-iters {self.train_iters}",
            f"--eval-interval {self.train_iters}",
            f"--vocab-size {self.vocab}",
            f"--seed {self.seed}",
            _FIXED_ARGS.format(tp=self.tp),
        ]
        if self.experts:  # Megatron-LM's MoE flags (no aux loss: --moe-aux-loss-coeff defaults to 0)
            parts.append(
                f"--num-experts {self.experts} --expert-model-parallel-size {self.ep} "
                f"--moe-router-topk {self.topk} --moe-token-dispatcher-type alltoall"
                + (" --moe-router-pre-softmax" if self.topk == 1 else "")
            )
        if self.profile:  # Megatron's flags for the same trace: the profiled passes are the traced iterations
            parts.append(
                f"--profile --use-pytorch-profiler --profile-step-start {TRACE_FIRST_ITERATION} "
                f"--profile-step-end {self.train_iters + 1} --profile-ranks "
                + " ".join(str(rank) for rank in range(self.world))
                + " --pytorch-profiler-collect-shapes --pytorch-profiler-collect-callstack"
            )
        return " ".join(parts)

    def cli_args(self) -> list[str]:
        """The `hops-calib capture` options that reproduce this configuration."""
        args = [
            f"--pp={self.pp}",
            f"--vp={self.vp}",
            *([f"--tp={self.tp}"] if self.tp > 1 else []),
            *([f"--dp={self.dp}"] if self.dp > 1 else []),
            f"--microbatches={self.microbatches}",
            f"--iterations={self.iterations}",
            f"--layers={self.layers}",
            f"--hidden={self.hidden}",
            f"--seq={self.seq}",
            f"--heads={self.heads}",
            f"--ffn-hidden={self.ffn}",
            f"--vocab={self.vocab}",
            f"--engine={self.engine}",
            f"--schedule={self.resolved_schedule}",
            f"--seed={self.seed}",
        ]
        if self.experts:
            args += [f"--experts={self.experts}", f"--topk={self.topk}", f"--ep={self.ep}"]
        if self.profile:
            args.append("--profile")
        if self.overlap_p2p:
            args.append("--overlap-p2p")
        if not self.link_bench:
            args.append("--no-link-bench")
        elif self.link_bench_iters != CaptureConfig.link_bench_iters:
            args.append(f"--link-bench-iters={self.link_bench_iters}")
        return args

    def command_line(self, out: str) -> str:
        return shlex.join(["hops-calib", "capture", *self.cli_args(), f"--out={out}"])
