"""The `bench` verb: measure this machine's component tables (`hops_calib.capture.bench`) and print what it wrote."""

from __future__ import annotations

from pathlib import Path

import typer


def bench(
    out: Path = typer.Option(..., "--out", help="Folder to write gemm.csv, memory.csv and collectives/ into."),
    job: Path = typer.Option(
        None,
        "--job",
        help="A job directory: measure the GEMM shapes its layer runs (t, micro "
        "batch, s, h, ffn from its launch) instead of the standard grid.",
    ),
    device: str = typer.Option(
        "", "--device", help="The catalog device type the tables are for (default: from the GPU's name, or cpu)."
    ),
    dtype: list[str] = typer.Option(
        [], "--dtype", help="GEMM dtypes: bf16, fp16, fp32 (repeatable; default bf16 on a GPU, fp32 on the CPU)."
    ),
    budget_s: float = typer.Option(300.0, "--budget-s", help="Time budget in s: items beyond it are left out."),
    group_sizes: str = typer.Option(
        "", "--group-sizes", help="Ranks per collective group, e.g. 2,4,8 (default: 2, 4, 8 up to the GPUs or cores)."
    ),
    quick: bool = typer.Option(False, "--quick", help="A tiny grid (a few seconds): checks the setup."),
    repeats: int = typer.Option(5, "--repeats", help="Timed repeats per item (the median is written)."),
) -> None:
    """Measure this machine's component tables (GEMMs, memory-bound kernels, collectives) with torch (needs the capture extra)."""
    raise typer.Exit(bench_command(out, job, device, list(dtype), budget_s, group_sizes, quick, repeats))


def bench_command(
    out: Path,
    job: Path | None,
    device: str,
    dtypes: list[str],
    budget_s: float,
    group_sizes: str,
    quick: bool,
    repeats: int,
) -> int:
    """0 and the tables written; 2 without torch or on a bad option or job."""
    from hops_calib.capture.bench import (
        DTYPES,
        _torch,
        default_plan,
        device_type_of,
        job_gemm_shapes,
        run_bench,
    )
    from hops_calib.errors import InputError
    from hops_calib.progress import progress_bar
    from hops_calib.trace.errors import TraceError

    try:
        torch = _torch()
    except RuntimeError as err:
        typer.echo(f"bench: {err}", err=True)
        return 2
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or budget_s <= 0 or repeats < 1:
        typer.echo(f"bench: --dtype takes {', '.join(DTYPES)}; --budget-s and --repeats must be positive", err=True)
        return 2
    try:
        sizes = tuple(int(g) for g in group_sizes.split(",") if g.strip()) if group_sizes else ()
    except ValueError:
        sizes = (0,)
    if any(g < 2 for g in sizes):
        typer.echo(
            f"bench: --group-sizes {group_sizes!r}: give ranks per group, at least 2 each (e.g. 2,4,8)", err=True
        )
        return 2
    cuda = torch.cuda.is_available()
    shapes: tuple[tuple[int, int, int], ...] = ()
    row: int | None = None
    if job is not None:
        try:
            (row, shapes), words = job_gemm_shapes(job)
        except (TraceError, InputError) as err:
            typer.echo(f"bench: {err}", err=True)
            return 2
        typer.echo(f"GEMM shapes of {words}: {len(shapes)}")
    device = device or device_type_of(torch)
    plan = default_plan(
        device=device,
        cuda=cuda,
        dtypes=dtypes,
        shapes=shapes,
        row=row or 1024,
        group_sizes=sizes,
        budget_s=budget_s,
        quick=quick,
        repeats=repeats,
    )
    typer.echo(
        f"bench on {'GPU ' + torch.cuda.get_device_name(0) if cuda else 'the CPU'} as device {device!r}: "
        f"{len(plan.gemm_shapes) * len(plan.dtypes)} GEMMs, {len(plan.memory_bytes) * len(plan.kernels)} "
        f"memory kernels, {len(plan.ops)} collectives x {len(plan.message_bytes)} sizes on groups of "
        f"{', '.join(map(str, plan.group_sizes)) or 'none'} ({'NCCL' if cuda else 'gloo'}); budget "
        f"{budget_s:g} s"
    )
    with progress_bar("bench", total=plan.items()) as progress:
        result = run_bench(plan, out, advance=progress.advance)
    for path in result.files:
        typer.echo(f"wrote {path}")
    for note in result.notes:
        typer.echo(f"note: {note}")
    typer.echo(f"{result.measured} items measured in {result.seconds:.1f} s")
    return 0
