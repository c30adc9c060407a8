"""The `plan` verbs: `plan job DIR` (the fastest launches of a real job on its devices, every lever searched),
`plan layouts DIR` (the t x p x d layout table of one GPU type), `plan abstract` (the schedule with the lowest
bubble for abstract costs); computed in `hops_calib.whatif` and printed by `cli.whatif`. The old spellings
(`plan --job DIR`, `plan --job DIR --parallel`, `plan --stages ...`) still work (`cli.verbs.DefaultVerbGroup`). Each
option is declared once, here, and shared by the sub-verb that reads it and the old spelling."""

from __future__ import annotations

from pathlib import Path

import typer

from hops_calib.cli.options import (
    CLUSTER_OPTION,
    FIXTURES_HELP,
    MODEL_OPTION,
    NO_CLUSTER_OPTION,
    PERTURBATION_OPTIONS,
    with_perturbations,
)
from hops_calib.cli.options import cluster_of as _cluster
from hops_calib.cli.options import default_path as _default
from hops_calib.cli.options import given as _given
from hops_calib.cli.verbs import LEGACY, DefaultVerbGroup, OldSpelling

app = typer.Typer(
    cls=DefaultVerbGroup,
    no_args_is_help=True,
    help="Plan a job: `plan job DIR` (the fastest launches of a real job on its devices, priced by the calibrated "
    "model), `plan layouts DIR` (its t x p x d layout table), `plan abstract` (a schedule for abstract costs). "
    "The old spellings `plan --job DIR`, `plan --job DIR --parallel` and `plan --stages ...` still work.",
)

STAGES = typer.Option(None, "--stages", help="Pipeline stages (devices), p (abstract plan; required there).")
MICROBATCHES = typer.Option(
    None, "--microbatches", help="Microbatches per iteration, m (abstract plan; required there)."
)
MEMORY_BUDGET = typer.Option(
    None,
    "--memory-budget",
    help="Abstract plan, required there: activations per device, in stage microbatches (one "
    "microbatch's activations of a whole stage; an interleaved chunk counts 1/v).",
)
FORWARD_COST = typer.Option(1.0, "--forward-cost", help="Forward time of one microbatch on one stage.")
BACKWARD_COST = typer.Option(2.0, "--backward-cost", help="Whole backward time (input + weight grads).")
WEIGHT_GRAD_COST = typer.Option(0.0, "--weight-grad-cost", help="Weight-gradient part of the backward; > 0 adds ZB-H1.")
CHUNKS = typer.Option(1, "--chunks", help="Model chunks per device; > 1 adds interleaved 1F1B.")
TARGET_BUBBLE = typer.Option(
    None, "--target-bubble", help="Also print the microbatches balanced 1F1B needs for this bubble."
)
JOB_HELP = "A real job's directory: its model and global batch on its devices."
PLAN_FIXTURES = typer.Option(
    ...,
    "--fixtures",
    default_factory=_default("fixtures"),
    show_default=False,
    help=FIXTURES_HELP + " With --job, the store whose train split the best launches are "
    "checked against: what lies outside it is extrapolated.",
)
TOP = typer.Option(5, "--top", help="With --job: how many launches to print.")
SCHEDULES = typer.Option(
    None,
    "--schedule",
    help="With --job: search only these schedules (repeatable: 1f1b, "
    "interleaved_1f1b, zb_h1, gpipe, auto; default Megatron-LM's own, 1f1b and interleaved_1f1b, and with "
    "--any-runtime all).",
)
PARALLEL = typer.Option(
    False,
    "--parallel",
    help="With --job: the layout-only table (plan --job alone searches t x p "
    "x d with every other lever): tensor x pipeline x data parallel and "
    "the micro-batch size (one GPU type), keeping the launch's other "
    "settings; it takes --model, --top and --json, and refuses the "
    "other search's options (--schedule, --keep-*, --trials, --cluster, "
    "stragglers, ...).",
)
KEEP_ORDER = typer.Option(False, "--keep-order", help="With --job: keep the job's stage order.")
KEEP_SPLIT = typer.Option(False, "--keep-split", help="With --job: keep the job's layer split.")
KEEP_MICRO_BATCH = typer.Option(False, "--keep-micro-batch", help="With --job: keep its micro-batch size.")
KEEP_LEVERS = typer.Option(
    False,
    "--keep-levers",
    help="With --job: keep its tensor, pipeline, context and expert parallel sizes, "
    "recomputation, sequence parallelism and distributed optimizer (--precision still applies).",
)
DEVICE_MEMORY = typer.Option(
    None,
    "--device-memory",
    help="With --job: TYPE:BYTES, a device type's usable memory (default the catalog's capacity). Repeatable.",
)
TRIALS = typer.Option(
    None,
    "--trials",
    help="With --job: optuna trials when the space is too large to search "
    "exhaustively (default 400 where the stage order is searched; with one "
    "distinct order none unless given); the coordinate ascent after them "
    "prices at most 2,000,000 simulated tasks' worth of launches at the "
    "job's own launch's size, or this many if more.",
)
EXHAUSTIVE_LIMIT = typer.Option(
    10000, "--exhaustive-limit", help="With --job: search exhaustively up to this many launches."
)
ANY_RUNTIME = typer.Option(
    False,
    "--any-runtime",
    help="With --job: also search schedules Megatron-LM has no flag "
    "for (ZB-H1, GPipe, auto), for a runtime that runs them; "
    "default Megatron's own (1F1B, interleaved 1F1B).",
)
PRECISION = typer.Option(
    None,
    "--precision",
    help="With --job: the precisions a pick may run in: bf16 (16-bit GEMMs), fp8 (Transformer Engine's FP8 GEMMs, "
    "--fp8-format hybrid --fp8-recipe delayed where the job runs none; only on devices whose catalog entry has an "
    "FP8 peak), any (both); default the job's own.",
)
MEMORY_HEADROOM = typer.Option(
    None,
    "--memory-headroom",
    help="With --job: GB of each GPU's memory left out of every "
    "pick (default 1.5 on a GPU: the CUDA context and "
    "NCCL's buffers; 0 on a CPU).",
)
RANK_BY = typer.Option(
    "throughput",
    "--rank-by",
    help="With --job: throughput (nominal), expected or p5 (the mean or "
    "the 5th percentile under the stragglers and failures given).",
)
AS_JSON = typer.Option(False, "--json", help="Print the plan as JSON.")
STORAGE = typer.Option(
    None,
    "--storage",
    help="With --job: run the optuna study of a large space on this storage, shared with other processes: "
    "sqlite:///FILE (one machine), postgresql://USER:PASSWORD@HOST/DB (several; the [db] extra) or any RDB URL. "
    "Default: $HOPS_CALIB_STORAGE, else `storage` under \\[defaults] of the nearest hops-calib.toml, else in "
    "memory (docs/distributed-tuning.md).",
)
STUDY = typer.Option(
    None, "--study", help="With --job and a storage: the study's name (default: the job and what is planned)."
)
WORKERS = typer.Option(
    1, "--workers", min=1, help="With --job and a storage: processes working on the study (its --trials shared)."
)
SAMPLER = typer.Option(
    "tpe",
    "--sampler",
    help="With --job and a storage: tpe (learns from the trials so far), or sobol (trial k is the study's k-th "
    "Sobol point: the same plan with any number of workers).",
)

# The options `plan job DIR` and the old `plan --job DIR` pass on to the search, by parameter name.
_JOB_OPTIONS = (
    "job",
    "model",
    "top",
    "schedules",
    "fixed_order",
    "fixed_split",
    "fixed_micro_batch",
    "keep_levers",
    "device_memory",
    "trials",
    "exhaustive_limit",
    "any_runtime",
    "precision",
    "memory_headroom",
    "rank_by",
    "fixtures",
    "perturbations",
    "storage",
    "study",
    "workers",
    "sampler",
)


# What each way of planning reads of the old spelling's options, and how to name it. An option given on the command
# line to a way that does not read it is refused (exit 2) naming the way that does, never silently ignored; a new
# option is refused everywhere until it is listed for the ways that read it.
_PLAN_WAYS = {
    "abstract": (
        "the abstract plan (--stages, --microbatches, --memory-budget)",
        {
            "stages",
            "microbatches",
            "memory_budget",
            "forward_cost",
            "backward_cost",
            "weight_grad_cost",
            "chunks",
            "target_bubble",
            "as_json",
        },
    ),
    "job": (
        "plan --job DIR without --parallel (its search of stage order, layer split, schedule, micro batch)",
        {
            *(name for name in _JOB_OPTIONS if name != "perturbations"),  # the perturbations: their options, below
            "cluster",
            "no_cluster",
            "as_json",
            *(f"perturbations__{name}" for name, *_ in PERTURBATION_OPTIONS),
        },
    ),
    "parallel": (
        "plan --job DIR --parallel (its search of t x p x d layouts and micro batch, hops priced from the placement)",
        {"job", "parallel", "model", "top", "as_json"},
    ),
}


def _refuse_unread(ctx: typer.Context, way: str) -> None:
    """Refuse (a usage error, exit 2) the first option given on the command line that `way` of planning does not
    read, naming the option, the way that reads it and what to do."""
    what, reads = _PLAN_WAYS[way]
    for param in ctx.command.params:
        if param.name in reads or not _given(ctx, param.name):
            continue
        flag = max(param.opts, key=len)
        others = [name for name, (_, read) in _PLAN_WAYS.items() if param.name in read]
        where = " or ".join(_PLAN_WAYS[name][0] for name in others) or "no way of planning"
        switch = (
            "; or drop --parallel to run that search"
            if way == "parallel" and "job" in others
            else "; or plan a real job with --job DIR"
            if way == "abstract" and others
            else "; or drop --job for the abstract plan"
            if others == ["abstract"]
            else ""
        )
        raise typer.BadParameter(
            f"it does nothing in {what}: only {where} reads it. Drop {flag}{switch}.", param_hint=flag
        )


def _abstract(
    stages: int | None,
    microbatches: int | None,
    memory_budget: float | None,
    forward_cost: float,
    backward_cost: float,
    weight_grad_cost: float,
    chunks: int,
    target_bubble: float | None,
    as_json: bool,
) -> None:
    from hops_calib.cli.whatif import plan_command

    if stages is None or microbatches is None or memory_budget is None:
        missing = [
            flag
            for flag, value in (
                ("--stages", stages),
                ("--microbatches", microbatches),
                ("--memory-budget", memory_budget),
            )
            if value is None
        ]
        raise typer.BadParameter(
            f"an abstract plan needs {', '.join(missing)} (or plan a real job with --job)", param_hint=missing[0]
        )
    plan_command(
        stages,
        microbatches,
        memory_budget,
        forward_cost,
        backward_cost,
        weight_grad_cost,
        chunks,
        target_bubble,
        as_json,
    )


def _job(ctx: typer.Context, given: dict) -> int:
    """Run `plan job` on the options a command was given (its parameters by name: `_JOB_OPTIONS`, `cluster`,
    `no_cluster`, `as_json`)."""
    from hops_calib.cli.settings import default_storage
    from hops_calib.cli.whatif import PlanJobRequest, plan_job_command

    o = {name: given[name] for name in _JOB_OPTIONS}
    request = PlanJobRequest(
        job=o["job"],
        cluster=_cluster(ctx, given["cluster"], given["no_cluster"]),
        model=o["model"],
        top=o["top"],
        schedules=tuple(o["schedules"] or ()),
        keep_order=o["fixed_order"],
        keep_split=o["fixed_split"],
        keep_micro_batch=o["fixed_micro_batch"],
        keep_levers=o["keep_levers"],
        device_memory=tuple(o["device_memory"] or ()),
        trials=o["trials"],
        exhaustive_limit=o["exhaustive_limit"],
        any_runtime=o["any_runtime"],
        precision=o["precision"],
        memory_headroom_gb=o["memory_headroom"],
        rank_by=o["rank_by"],
        perturbations=o["perturbations"],
        fixtures=o["fixtures"],
        # without --storage: $HOPS_CALIB_STORAGE, else the nearest hops-calib.toml's [defaults] storage, else memory
        storage=o["storage"] if o["storage"] is not None else default_storage()[0],
        study=o["study"],
        workers=o["workers"],
        sampler=o["sampler"],
    )
    return plan_job_command(request, given["as_json"])


@app.command("job")
@with_perturbations
def plan_job(
    ctx: typer.Context,
    job: Path = typer.Argument(..., metavar="DIR", help=JOB_HELP),
    cluster: Path | None = CLUSTER_OPTION,
    no_cluster: bool = NO_CLUSTER_OPTION,
    fixtures: Path = PLAN_FIXTURES,
    model: Path | None = MODEL_OPTION,
    top: int = TOP,
    schedules: list[str] | None = SCHEDULES,
    fixed_order: bool = KEEP_ORDER,
    fixed_split: bool = KEEP_SPLIT,
    fixed_micro_batch: bool = KEEP_MICRO_BATCH,
    keep_levers: bool = KEEP_LEVERS,
    device_memory: list[str] | None = DEVICE_MEMORY,
    trials: int | None = TRIALS,
    exhaustive_limit: int = EXHAUSTIVE_LIMIT,
    any_runtime: bool = ANY_RUNTIME,
    precision: str | None = PRECISION,
    memory_headroom: float | None = MEMORY_HEADROOM,
    rank_by: str = RANK_BY,
    as_json: bool = AS_JSON,
    storage: str | None = STORAGE,
    study: str | None = STUDY,
    workers: int = WORKERS,
    sampler: str = SAMPLER,
    perturbations: dict | None = None,
) -> None:
    """The fastest launches of a real job on its devices, priced by the calibrated model: one search over t, p, cp,
    d, the experts' ep and etp (a mixture of experts), virtual stages, micro batch, recomputation, sequence
    parallelism, the distributed optimizer, FP8 or BF16 (--precision), stage order, layer split and schedule
    (Megatron's own unless --any-runtime), each pick within memory less a stated headroom (the old spelling: plan
    --job DIR)."""
    raise typer.Exit(_job(ctx, locals()))


@app.command("layouts")
def plan_layouts(
    job: Path = typer.Argument(..., metavar="DIR", help=JOB_HELP),
    model: Path | None = MODEL_OPTION,
    top: int = TOP,
    as_json: bool = AS_JSON,
) -> None:
    """The layout-only table of a job on one GPU type: tensor x pipeline x data parallel and the micro-batch size,
    keeping the launch's other settings, hops priced from the placement (the old spelling: plan --job DIR
    --parallel)."""
    from hops_calib.cli.whatif import plan_layouts_command

    raise typer.Exit(plan_layouts_command(job, model, top, as_json))


@app.command("abstract")
def plan_abstract(
    stages: int | None = STAGES,
    microbatches: int | None = MICROBATCHES,
    memory_budget: float | None = MEMORY_BUDGET,
    forward_cost: float = FORWARD_COST,
    backward_cost: float = BACKWARD_COST,
    weight_grad_cost: float = WEIGHT_GRAD_COST,
    chunks: int = CHUNKS,
    target_bubble: float = TARGET_BUBBLE,
    as_json: bool = AS_JSON,
) -> None:
    """The pipeline schedule with the lowest bubble that fits a per-device activation budget, for abstract costs
    (the old spelling: plan --stages P --microbatches M --memory-budget B)."""
    _abstract(
        stages,
        microbatches,
        memory_budget,
        forward_cost,
        backward_cost,
        weight_grad_cost,
        chunks,
        target_bubble,
        as_json,
    )


@app.command(LEGACY, hidden=True, cls=OldSpelling)
@with_perturbations
def plan(
    ctx: typer.Context,
    stages: int | None = STAGES,
    microbatches: int | None = MICROBATCHES,
    memory_budget: float | None = MEMORY_BUDGET,
    forward_cost: float = FORWARD_COST,
    backward_cost: float = BACKWARD_COST,
    weight_grad_cost: float = WEIGHT_GRAD_COST,
    chunks: int = CHUNKS,
    target_bubble: float = TARGET_BUBBLE,
    job: Path | None = typer.Option(
        None,
        "--job",
        help="Plan a real job instead: its model and global batch on "
        "its devices (stage order, layer split, schedule, micro-batch size).",
    ),
    cluster: Path | None = CLUSTER_OPTION,
    no_cluster: bool = NO_CLUSTER_OPTION,
    fixtures: Path = PLAN_FIXTURES,
    model: Path | None = MODEL_OPTION,
    top: int = TOP,
    schedules: list[str] | None = SCHEDULES,
    parallel: bool = PARALLEL,
    fixed_order: bool = KEEP_ORDER,
    fixed_split: bool = KEEP_SPLIT,
    fixed_micro_batch: bool = KEEP_MICRO_BATCH,
    keep_levers: bool = KEEP_LEVERS,
    device_memory: list[str] | None = DEVICE_MEMORY,
    trials: int | None = TRIALS,
    exhaustive_limit: int = EXHAUSTIVE_LIMIT,
    any_runtime: bool = ANY_RUNTIME,
    precision: str | None = PRECISION,
    memory_headroom: float | None = MEMORY_HEADROOM,
    rank_by: str = RANK_BY,
    as_json: bool = AS_JSON,
    storage: str | None = STORAGE,
    study: str | None = STUDY,
    workers: int = WORKERS,
    sampler: str = SAMPLER,
    perturbations: dict | None = None,
) -> None:
    """The old spelling of the plan verbs: plan --stages ... (plan abstract), plan --job DIR (plan job DIR), plan
    --job DIR --parallel (plan layouts DIR)."""
    _refuse_unread(ctx, "abstract" if job is None else "parallel" if parallel else "job")
    if job is None:
        _abstract(
            stages,
            microbatches,
            memory_budget,
            forward_cost,
            backward_cost,
            weight_grad_cost,
            chunks,
            target_bubble,
            as_json,
        )
        return
    if parallel:
        from hops_calib.cli.whatif import plan_layouts_command

        raise typer.Exit(plan_layouts_command(job, model, top, as_json))
    raise typer.Exit(_job(ctx, locals()))
