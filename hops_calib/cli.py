"""The typer app: one thin function per verb, no logic of its own."""

from __future__ import annotations

from pathlib import Path

import typer

from hops_calib import __version__

app = typer.Typer(
    name="hops-calib",
    help="Calibrate and validate a pipeline-parallel training simulator against real Megatron-LM traces.",
    no_args_is_help=True,
    add_completion=False,
)


@app.command()
def version() -> None:
    """Print the hops-calib version."""
    typer.echo(__version__)


@app.command()
def capture(
    out: Path = typer.Option(..., "--out", help="Job directory to write; its name is the run id (cpu_<config>_run<k>)."),
    pp: int = typer.Option(2, "--pp", help="Pipeline ranks (one process each, pinned to its own core)."),
    vp: int = typer.Option(1, "--vp", help="Model chunks per rank (>1 runs the interleaved 1F1B schedule)."),
    microbatches: int = typer.Option(4, "--microbatches", help="Microbatches per iteration (= global batch)."),
    iterations: int = typer.Option(4, "--iterations", help="Traced iterations, after 2 untraced warm-up ones."),
    layers: int = typer.Option(4, "--layers", help="Decoder layers in all (split evenly over pp * vp chunks)."),
    hidden: int = typer.Option(512, "--hidden", help="Hidden size."),
    seq: int = typer.Option(256, "--seq", help="Sequence length."),
    heads: int = typer.Option(8, "--heads", help="Attention heads."),
    ffn_hidden: int = typer.Option(0, "--ffn-hidden", help="FFN hidden size (0 = 4 * hidden)."),
    vocab: int = typer.Option(8192, "--vocab", help="Vocabulary size."),
    engine: str = typer.Option("megatron", "--engine", help="megatron (Megatron-core schedules) or torch "
                               "(torch.distributed.pipelining)."),
    schedule: str = typer.Option("", "--schedule", help="1f1b, interleaved_1f1b, gpipe, zb_h1 (default: from --vp)."),
    seed: int = typer.Option(1234, "--seed", help="Seed of weights and mock data."),
    link_bench: bool = typer.Option(True, "--link-bench/--no-link-bench", help="Run the gloo p2p link benchmark."),
    link_bench_iters: int = typer.Option(50, "--link-bench-iters", help="Timed sends per message size."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it exists."),
) -> None:
    """Record a real pipeline run on this machine's CPU cores into a cluster-style job directory (needs the capture extra)."""
    from hops_calib.capture import CaptureConfig, CaptureConfigError, CaptureError
    from hops_calib.capture import capture as run_capture

    config = CaptureConfig(pp=pp, vp=vp, microbatches=microbatches, iterations=iterations, layers=layers,
                           hidden=hidden, seq=seq, heads=heads, ffn_hidden=ffn_hidden, vocab=vocab, engine=engine,
                           schedule=schedule, seed=seed, link_bench=link_bench,
                           link_bench_iters=link_bench_iters)
    try:
        written = run_capture(config, out, force=force)
    except (CaptureConfigError, CaptureError) as err:
        typer.echo(f"capture: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(written))


def main() -> None:
    app()
