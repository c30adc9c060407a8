"""The `capture` verb: record a real pipeline run on this machine's CPU cores (`hops_calib.capture`) and print the
job directory written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer


def capture(
    out: Path = typer.Option(
        ..., "--out", help="Job directory to write; its name is the run id (cpu_<config>_run<k>)."
    ),
    pp: int = typer.Option(
        2, "--pp", help="Pipeline ranks (one process each, pinned to its own core; 1 with --dp 2 or more)."
    ),
    vp: int = typer.Option(1, "--vp", help="Model chunks per rank (>1 runs the interleaved 1F1B schedule)."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks per stage (megatron engine; gloo)."),
    dp: int = typer.Option(
        1, "--dp", help="Data-parallel replicas (megatron engine; gradients all-reduced after the backwards)."
    ),
    microbatches: int = typer.Option(4, "--microbatches", help="Microbatches per iteration per replica."),
    iterations: int = typer.Option(4, "--iterations", help="Traced iterations, after 2 untraced warm-up ones."),
    layers: int = typer.Option(4, "--layers", help="Decoder layers in all (split evenly over pp * vp chunks)."),
    hidden: int = typer.Option(512, "--hidden", help="Hidden size."),
    seq: int = typer.Option(256, "--seq", help="Sequence length."),
    heads: int = typer.Option(8, "--heads", help="Attention heads."),
    ffn_hidden: int = typer.Option(0, "--ffn-hidden", help="FFN hidden size (0 = 4 * hidden)."),
    vocab: int = typer.Option(8192, "--vocab", help="Vocabulary size."),
    engine: str = typer.Option(
        "megatron", "--engine", help="megatron (Megatron-core schedules) or torch (torch.distributed.pipelining)."
    ),
    schedule: str = typer.Option("", "--schedule", help="1f1b, interleaved_1f1b, gpipe, zb_h1 (default: from --vp)."),
    seed: int = typer.Option(1234, "--seed", help="Seed of weights and mock data."),
    link_bench: bool = typer.Option(
        True,
        "--link-bench/--no-link-bench",
        help="Run the gloo p2p link benchmark (without it the run ingests, but predict, "
        "evaluate and report refuse it: hops are priced from the benchmark).",
    ),
    link_bench_iters: int = typer.Option(50, "--link-bench-iters", help="Timed sends per message size."),
    overlap_p2p: bool = typer.Option(
        False,
        "--overlap-p2p",
        help="Overlap the interleaved schedule's p2p with "
        "compute (Megatron's overlap_p2p_comm, Megatron-LM's default with --vp > 1).",
    ),
    experts: int = typer.Option(
        0,
        "--experts",
        help="Routed experts per layer (megatron engine): every MLP becomes Megatron-core's MoE layer (TopKRouter, "
        "all-to-all token dispatcher, SequentialMLP experts); 0 = the dense MLP.",
    ),
    topk: int = typer.Option(1, "--topk", help="Experts the router picks per token (--moe-router-topk)."),
    ep: int = typer.Option(
        1, "--ep", help="Expert-parallel ranks (out of the --dp ones; each holds experts / ep experts)."
    ),
    force: bool = typer.Option(False, "--force", help="Replace --out if it is an earlier capture (nothing else)."),
    profile: bool = typer.Option(
        False,
        "--profile",
        help="Also record a PyTorch profiler (Kineto) trace of the traced "
        "iterations per rank, torch_profile/rank-<r>.json.gz, as Megatron's --profile "
        "--use-pytorch-profiler (shapes and call stack; it slows the run: docs/traces.md).",
    ),
) -> None:
    """Record a real pipeline run on this machine's CPU cores into a cluster-style job directory (needs the capture extra)."""
    raise typer.Exit(
        capture_command(
            out,
            force,
            pp=pp,
            vp=vp,
            tp=tp,
            dp=dp,
            microbatches=microbatches,
            iterations=iterations,
            layers=layers,
            hidden=hidden,
            seq=seq,
            heads=heads,
            ffn_hidden=ffn_hidden,
            vocab=vocab,
            engine=engine,
            schedule=schedule,
            seed=seed,
            link_bench=link_bench,
            link_bench_iters=link_bench_iters,
            profile=profile,
            overlap_p2p=overlap_p2p,
            experts=experts,
            topk=topk,
            ep=ep,
        )
    )


def capture_command(out: Path, force: bool, **settings: Any) -> int:
    """Capture into `out` with the CaptureConfig `settings`; 0 and the folder written, 2 on a refused configuration
    or a failed run, 130 when interrupted (nothing written)."""
    from hops_calib.capture import CaptureConfig, CaptureConfigError, CaptureError
    from hops_calib.capture import capture as run_capture

    config = CaptureConfig(**settings)
    try:
        written = run_capture(config, out, force=force)
    except (CaptureConfigError, CaptureError) as err:
        typer.echo(f"capture: {err}", err=True)
        return 2
    except KeyboardInterrupt:
        typer.echo(
            f"capture: interrupted; nothing was written at {out} (the ranks and their staging folder are "
            "gone), run the same command again to capture",
            err=True,
        )
        return 130
    typer.echo(str(written))
    return 0
