"""The command layer: the typer app and `main` (the entry point), one thin function per verb that parses its
options and calls its group's module, the only layer that prints: `data` (ingest, fixtures), `loop` (predict,
evaluate, compare, report, ledger, terms), `research` (observe, tune, crossval), `whatif` (plan, predict --job),
`plot`, `capture`; `output` holds what they share (JSON, error objects, exit codes)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeGuard

import typer

from hops_calib import __version__

app = typer.Typer(
    name="hops-calib",
    help="Calibrate and validate a pipeline-parallel training simulator against real Megatron-LM traces.",
    no_args_is_help=True,
    add_completion=False,
)
fixtures_app = typer.Typer(help="Look at the fixture store.", no_args_is_help=True)
app.add_typer(fixtures_app, name="fixtures")

def _default(kind: str) -> Callable[[], Path | None]:
    """The default of --fixtures or --cluster, found when a verb runs (`hops_calib.cli.settings`): the environment,
    the nearest hops-calib.toml, else ./fixtures and no cluster. A bad project file is a usage error (exit 2)."""
    def factory() -> Path | None:
        from hops_calib.cli import settings
        from hops_calib.errors import InputError

        try:
            return (settings.default_fixtures() if kind == "fixtures" else settings.default_cluster()).path
        except InputError as error:
            raise typer.BadParameter(str(error), param_hint=f"--{kind}") from None

    return factory


FIXTURES_HELP = ("Fixture store folder. Default: $HOPS_CALIB_FIXTURES, else `fixtures` under \\[defaults] of the nearest "
                 "hops-calib.toml, else ./fixtures of the current directory (from the repository root: the CPU "
                 "captures' store).")
FIXTURES_OPTION = typer.Option(..., "--fixtures", default_factory=_default("fixtures"), show_default=False,
                               help=FIXTURES_HELP)
# Verbs that judge (evaluate, compare, tune): --fixtures may be repeated, for a judgement covering every store a
# model is calibrated on (the union of their train splits; the gate's rules hold on each store).
FIXTURES_MANY_OPTION = typer.Option(None, "--fixtures", show_default=False,
                                    help=FIXTURES_HELP + " Repeat it to judge on several stores at once (every store "
                                    "the changed part was calibrated on; the gate's rules must hold on each).")


def fixtures_given(fixtures: list[Path] | None) -> list[Path]:
    """The stores of a repeatable --fixtures: those given, else the default store (as --fixtures alone finds it)."""
    if fixtures:
        return list(fixtures)
    found = _default("fixtures")()
    return [found] if found is not None else []  # (the default store is always a path)


MODEL_OPTION = typer.Option(None, "--model",
                            help="Model file (default: the shipped hops_calib/model/models/baseline.toml).")
CLUSTER_OPTION = typer.Option(..., "--cluster", default_factory=_default("cluster"), show_default=False,
                              help="Cluster file (hosts, devices, links; `hops-calib cluster` writes one): each hop is "
                                   "priced by the hosts at its ends. Default: $HOPS_CALIB_CLUSTER, else `cluster` "
                                   "under \\[defaults] of the nearest hops-calib.toml, else none (each device's host "
                                   "is the one the job's own link benchmark names at its stage position).")
NO_CLUSTER_OPTION = typer.Option(False, "--no-cluster", help="Use no cluster, whatever $HOPS_CALIB_CLUSTER or a "
                                 "hops-calib.toml sets (HOPS_CALIB_CLUSTER= set empty does the same).")


def _cluster(ctx: typer.Context, cluster: Path | None, no_cluster: bool):
    """The cluster a verb uses and where it came from (`cli.settings.cluster_choice`)."""
    from hops_calib.cli.settings import cluster_choice

    if no_cluster and _given(ctx, "cluster"):
        raise typer.BadParameter("--cluster and --no-cluster contradict each other", param_hint="--no-cluster")
    return cluster_choice(cluster, _given(ctx, "cluster"), no_cluster)


@app.command()
def bench(
    out: Path = typer.Option(..., "--out", help="Folder to write gemm.csv, memory.csv and collectives/ into."),
    job: Path = typer.Option(None, "--job", help="A job directory: measure the GEMM shapes its layer runs (t, micro "
                             "batch, s, h, ffn from its launch) instead of the standard grid."),
    device: str = typer.Option("", "--device", help="The catalog device type the tables are for (default: from "
                               "the GPU's name, or cpu)."),
    dtype: list[str] = typer.Option([], "--dtype", help="GEMM dtypes: bf16, fp16, fp32 (repeatable; default bf16 "
                                    "on a GPU, fp32 on the CPU)."),
    budget_s: float = typer.Option(300.0, "--budget-s", help="Time budget in s: items beyond it are left out."),
    group_sizes: str = typer.Option("", "--group-sizes", help="Ranks per collective group, e.g. 2,4,8 (default: "
                                    "2, 4, 8 up to the GPUs or cores)."),
    quick: bool = typer.Option(False, "--quick", help="A tiny grid (a few seconds): checks the setup."),
    repeats: int = typer.Option(5, "--repeats", help="Timed repeats per item (the median is written)."),
) -> None:
    """Measure this machine's component tables (GEMMs, memory-bound kernels, collectives) with torch (needs the capture extra)."""
    from hops_calib.cli.bench import bench_command

    raise typer.Exit(bench_command(out, job, device, list(dtype), budget_s, group_sizes, quick, repeats))


@app.command()
def version() -> None:
    """Print the hops-calib version."""
    typer.echo(__version__)


@app.command()
def capture(
    out: Path = typer.Option(..., "--out", help="Job directory to write; its name is the run id (cpu_<config>_run<k>)."),
    pp: int = typer.Option(2, "--pp", help="Pipeline ranks (one process each, pinned to its own core)."),
    vp: int = typer.Option(1, "--vp", help="Model chunks per rank (>1 runs the interleaved 1F1B schedule)."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks per stage (megatron engine; gloo)."),
    dp: int = typer.Option(1, "--dp", help="Data-parallel replicas (megatron engine; gradients all-reduced after "
                                           "the backwards)."),
    microbatches: int = typer.Option(4, "--microbatches", help="Microbatches per iteration per replica."),
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
    link_bench: bool = typer.Option(True, "--link-bench/--no-link-bench", help="Run the gloo p2p link benchmark (without it the run ingests, but predict, "
                                    "evaluate and report refuse it: hops are priced from the benchmark)."),
    link_bench_iters: int = typer.Option(50, "--link-bench-iters", help="Timed sends per message size."),
    overlap_p2p: bool = typer.Option(False, "--overlap-p2p", help="Overlap the interleaved schedule's p2p with "
                                     "compute (Megatron's overlap_p2p_comm, Megatron-LM's default with --vp > 1)."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it is an earlier capture (nothing else)."),
    profile: bool = typer.Option(False, "--profile", help="Also record a PyTorch profiler (Kineto) trace of the traced "
                                 "iterations per rank, torch_profile/rank-<r>.json.gz, as Megatron's --profile "
                                 "--use-pytorch-profiler (shapes and call stack; it slows the run: docs/traces.md)."),
) -> None:
    """Record a real pipeline run on this machine's CPU cores into a cluster-style job directory (needs the capture extra)."""
    from hops_calib.cli.capture import capture_command

    raise typer.Exit(capture_command(out, force, pp=pp, vp=vp, tp=tp, dp=dp, microbatches=microbatches, iterations=iterations,
                                     layers=layers, hidden=hidden, seq=seq, heads=heads, ffn_hidden=ffn_hidden,
                                     vocab=vocab, engine=engine, schedule=schedule, seed=seed, link_bench=link_bench,
                                     link_bench_iters=link_bench_iters, profile=profile,
                                     overlap_p2p=overlap_p2p))


@app.command()
def ingest(
    sources: list[Path] = typer.Argument(
        ..., help="Job directories, or folders holding job directories (searched recursively); Megatron training "
                  "logs; run tables (.csv, .parquet), the published vTrain table included."),
    fixtures: Path = FIXTURES_OPTION,
    split: str = typer.Option(
        "source", "--split", help="source (default): the split the source states in a hops-calib-source.toml beside "
                                  "it, else train (your own runs); auto: the grouped, hashed train/test split the "
                                  "calibration sets need; or force train / test. A stored group keeps its split."),
    test_fraction: float = typer.Option(0.3, "--test-fraction", help="Share of new configuration groups put in test."),
    lenient: bool = typer.Option(
        False, "--lenient", help="Drop bad event lines, repeated events and iterations a cut-short log left "
                                 "incomplete (counted in quality flags) instead of rejecting the run."),
    clock_skew_ms: float | None = typer.Option(
        None, "--clock-skew-ms", min=0.0,
        help="How far (ms) a stage may seem to start before the stage feeding it finished, from the nodes' clock "
             "offsets, before the run is refused as impossible (default: 2)."),
    gpu: str | None = typer.Option(
        None, "--gpu", help="Device type (of the model's catalog, e.g. a100) of logs and run tables that do not "
                            "name theirs (no hops.base.yaml beside a log, no gpu column or sidecar)."),
    gpus_per_node: int | None = typer.Option(
        None, "--gpus-per-node", min=1, help="GPUs per node, with --gpu."),
    warmup_iterations: int = typer.Option(
        2, "--warmup-iterations", min=0,
        help="Training logs: drop every logged interval that holds one of the log's first N iterations (slow "
             "warm-up)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: counts, every run's outcome and "
                                                       "warnings."),
    lock_timeout: float = typer.Option(
        600.0, "--lock-timeout", min=0.0,
        help="Seconds to wait for the store lock another ingest holds (it says whose) before giving up (exit 2)."),
) -> None:
    """Ingest Megatron job directories, training logs and run tables into the Parquet fixture store. Exit 0 every
    run stored, 6 some rejected (the others stored), 2 a bad store."""
    from hops_calib.cli.data import ingest_command

    raise typer.Exit(ingest_command(sources, fixtures, split, test_fraction, lenient, clock_skew_ms, gpu,
                                    gpus_per_node, warmup_iterations, as_json, lock_timeout=lock_timeout))


LEDGER_OPTION = typer.Option(None, "--ledger", show_default=False, help=(
    "Experiment ledger (JSON lines). Default: ledger/ledger.jsonl of the hops-calib checkout enclosing the current "
    "directory, else of the one the package runs from; it must exist: a new ledger only at a path named here."))


@fixtures_app.command("list")
def fixtures_list(
    fixtures: Path = FIXTURES_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (fixtures: one row each)."),
    ledger: Path = LEDGER_OPTION,
) -> None:
    """One line per fixture: split, observed and declared schedule, devices, throughput, bubble (test, and train runs
    held out: withheld)."""
    from hops_calib.cli.data import list_command

    raise typer.Exit(list_command(fixtures, as_json, ledger))


@fixtures_app.command("show")
def fixtures_show(
    fixture_id: str = typer.Argument(..., metavar="ID", help="Fixture id (see fixtures list)."),
    fixtures: Path = FIXTURES_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    ledger: Path = LEDGER_OPTION,
) -> None:
    """A readable summary of one fixture: configuration, devices, per-stage medians, metrics, quality flags."""
    from hops_calib.cli.data import show_command

    raise typer.Exit(show_command(fixture_id, fixtures, as_json, ledger))


# Stragglers and failures, for predict --job, plot timeline --job and plan --job (hops_calib.whatif.perturbations):
# (parameter, option, type, help). `with_perturbations` adds them; the command takes one `perturbations` dict.
PERTURBATION_OPTIONS = (
    ("slow_device", "--slow-device", list[str],
     "DEVICE:FACTOR: that device (an id of the stage map, or a stage number with predict/plot) runs its compute "
     "FACTOR times slower (1.1 = 10 %; thermal throttling, a degraded HBM stack). Repeatable."),
    ("slow_link", "--slow-link", list[str],
     "A-B:FACTOR: the hop between devices (or stages) A and B moves data FACTOR times slower: predict/plot refuse a "
     "pair that is no hop of the stage map; plan slows it in the launches where A and B are neighbours. The "
     "all-reduce between the pipeline's ends is not slowed. Repeatable."),
    ("stragglers", "--stragglers", str,
     "P:LOW:HIGH: in every iteration each GPU straggles with chance P, its compute slowed by a factor drawn from "
     "\\[LOW, HIGH] (seeded)."),
    ("failure_rate", "--failure-rate", float,
     "Failures per hour of the whole job (any device or link; it stops): the cost is the work lost since the last "
     "checkpoint plus --recovery-s."),
    ("recovery_s", "--recovery-s", float, "Seconds to recover from a failure (detect, restart, reload; default 300)."),
    ("checkpoint_every", "--checkpoint-every", int, "Iterations between checkpoints (default 1)."),
    ("run_iterations", "--run-iterations", int, "Iterations of the run that failures strike (default: the launch's --train-iters, else 1000)."),
    ("samples", "--samples", int, "Seeded draws per launch when stragglers or failures are random (default 32)."),
    ("seed", "--seed", int, "Seed of the draws (default 0)."),
)


def option_group(param: str, options: tuple) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A decorator giving a typer command the options of a group ((name, flag, type, help) each); the command takes
    them as one dict parameter `param` (None where not given)."""
    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(command, eval_str=True)
        keep = [p for p in signature.parameters.values() if p.name != param]
        added = [inspect.Parameter(f"{param}__{name}", inspect.Parameter.KEYWORD_ONLY, annotation=kind | None,
                                   default=typer.Option(None, flag, help=text))
                 for name, flag, kind, text in options]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> None:
            group = {name: kwargs.pop(f"{param}__{name}") for name, *_ in options}
            return command(**kwargs, **{param: group})

        wrapper.__signature__ = signature.replace(parameters=[*keep, *added])  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in [*keep, *added]}
        del wrapper.__wrapped__  # typer must read the signature above, not the command's
        return wrapper

    return decorate


with_perturbations = option_group("perturbations", PERTURBATION_OPTIONS)


@app.command()
def cluster(
    sources: list[Path] | None = typer.Argument(None, help="Job directories, or folders holding them (found "
                                                   "recursively)."),
    out: Path | None = typer.Option(None, "--out", help="Cluster file to write (YAML)."),
    check: Path | None = typer.Option(None, "--check", help="Instead: read this cluster file (written by hand or "
                                         "edited) and say what it holds, or the line, field and fix of its first "
                                         "error (exit 2)."),
    as_json: bool = typer.Option(False, "--json", help="Print the cluster as JSON instead of a summary."),
) -> None:
    """Build the cluster of job directories: every device's host (the pair files name the hosts of their ranks) and
    every benchmarked host pair's link (pooled over the runs that measured it). Edit it by hand to declare links;
    --check FILE validates it."""
    from hops_calib.cli.whatif import cluster_check_command, cluster_command

    if check is not None:
        if sources or out is not None:
            raise typer.BadParameter("--check reads a cluster file; it takes no job directories and no --out",
                                     param_hint="--check")
        raise typer.Exit(cluster_check_command(check, as_json))
    if not sources or out is None:
        raise typer.BadParameter("give job directories and --out FILE (or --check FILE)", param_hint="--out")
    raise typer.Exit(cluster_command(sources, out, as_json))


# What each way of planning reads of plan's options, and how to name it. An option given on the command line to a
# way that does not read it is refused (exit 2) naming the way that does, never silently ignored; a new option of
# plan is refused everywhere until it is listed for the ways that read it.
_PLAN_WAYS = {
    "abstract": ("the abstract plan (--stages, --microbatches, --memory-budget)",
                 {"stages", "microbatches", "memory_budget", "forward_cost", "backward_cost", "weight_grad_cost",
                  "chunks", "target_bubble", "as_json"}),
    "job": ("plan --job DIR without --parallel (its search of stage order, layer split, schedule, micro batch)",
            {"job", "cluster", "no_cluster", "fixtures", "model", "top", "schedules", "fixed_order", "fixed_split",
             "fixed_micro_batch", "device_memory", "trials", "exhaustive_limit", "rank_by", "as_json",
             "any_runtime", "memory_headroom", "keep_levers",
             *(f"perturbations__{name}" for name, *_ in PERTURBATION_OPTIONS)}),
    "parallel": ("plan --job DIR --parallel (its search of t x p x d layouts and micro batch, hops priced from "
                 "the placement)",
                 {"job", "parallel", "model", "top", "as_json"}),
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
        switch = ("; or drop --parallel to run that search" if way == "parallel" and "job" in others else
                  "; or plan a real job with --job DIR" if way == "abstract" and others else
                  "; or drop --job for the abstract plan" if others == ["abstract"] else "")
        raise typer.BadParameter(f"it does nothing in {what}: only {where} reads it. Drop {flag}{switch}.",
                                 param_hint=flag)


@app.command()
@with_perturbations
def plan(
    ctx: typer.Context,
    stages: int | None = typer.Option(None, "--stages", help="Pipeline stages (devices), p (abstract plan; "
                                         "required there)."),
    microbatches: int | None = typer.Option(None, "--microbatches", help="Microbatches per iteration, m "
                                               "(abstract plan; required there)."),
    memory_budget: float | None = typer.Option(None, "--memory-budget",
                                                  help="Abstract plan, required there: activations per device, in "
                                                       "stage microbatches (one "
                                                       "microbatch's activations of a whole stage; an interleaved "
                                                       "chunk counts 1/v)."),
    forward_cost: float = typer.Option(1.0, "--forward-cost", help="Forward time of one microbatch on one stage."),
    backward_cost: float = typer.Option(2.0, "--backward-cost", help="Whole backward time (input + weight grads)."),
    weight_grad_cost: float = typer.Option(0.0, "--weight-grad-cost",
                                           help="Weight-gradient part of the backward; > 0 adds ZB-H1."),
    chunks: int = typer.Option(1, "--chunks", help="Model chunks per device; > 1 adds interleaved 1F1B."),
    target_bubble: float = typer.Option(None, "--target-bubble",
                                        help="Also print the microbatches balanced 1F1B needs for this bubble."),
    job: Path | None = typer.Option(None, "--job", help="Plan a real job instead: its model and global batch on "
                                       "its devices (stage order, layer split, schedule, micro-batch size)."),
    cluster: Path | None = CLUSTER_OPTION,
    no_cluster: bool = NO_CLUSTER_OPTION,
    fixtures: Path = typer.Option(..., "--fixtures", default_factory=_default("fixtures"), show_default=False,
                                  help=FIXTURES_HELP + " With --job, the store whose train split the best launches "
                                  "are checked against: what lies outside it is extrapolated."),
    model: Path | None = MODEL_OPTION,
    top: int = typer.Option(5, "--top", help="With --job: how many launches to print."),
    schedules: list[str] | None = typer.Option(None, "--schedule", help="With --job: search only these schedules "
                                                  "(repeatable: 1f1b, interleaved_1f1b, zb_h1, gpipe, auto; "
                                                  "default all)."),
    parallel: bool = typer.Option(False, "--parallel", help="With --job: the layout-only table (plan --job alone "
                                  "searches t x p x d with every other lever): tensor x pipeline x data parallel "
                                  "and the micro-batch size (one GPU type), keeping the launch's other settings; it "
                                  "takes --model, --top and --json, and refuses the other search's options "
                                  "(--schedule, --keep-*, --trials, --cluster, stragglers, ...)."),
    fixed_order: bool = typer.Option(False, "--keep-order", help="With --job: keep the job's stage order."),
    fixed_split: bool = typer.Option(False, "--keep-split", help="With --job: keep the job's layer split."),
    fixed_micro_batch: bool = typer.Option(False, "--keep-micro-batch", help="With --job: keep its micro-batch size."),
    keep_levers: bool = typer.Option(False, "--keep-levers", help="With --job: keep its tensor and pipeline parallel "
                                     "sizes, recomputation, sequence parallelism and distributed optimizer."),
    device_memory: list[str] | None = typer.Option(None, "--device-memory",
                                                      help="With --job: TYPE:BYTES, a device type's usable memory "
                                                           "(default the catalog's capacity). Repeatable."),
    trials: int | None = typer.Option(None, "--trials", help="With --job: optuna trials when the space is too "
                                                    "large to search exhaustively (default 400 where the stage "
                                                    "order is searched; with one distinct order none unless "
                                                    "given); the coordinate ascent after them prices "
                                                    "at most 2,000,000 simulated tasks' worth of launches at the "
                                                    "job's own launch's size, or this many if more."),
    exhaustive_limit: int = typer.Option(10000, "--exhaustive-limit",
                                         help="With --job: search exhaustively up to this many launches."),
    any_runtime: bool = typer.Option(False, "--any-runtime", help="With --job: also search schedules Megatron-LM "
                                     "has no flag for (ZB-H1, GPipe, auto), for a runtime that runs them; default "
                                     "Megatron's own (1F1B, interleaved 1F1B)."),
    memory_headroom: float | None = typer.Option(None, "--memory-headroom", help="With --job: GB of each GPU's "
                                                 "memory left out of every pick (default 1.5 on a GPU: the CUDA "
                                                 "context and NCCL's buffers; 0 on a CPU)."),
    rank_by: str = typer.Option("throughput", "--rank-by", help="With --job: throughput (nominal), expected or p5 "
                                "(the mean or the 5th percentile under the stragglers and failures given)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    perturbations: dict | None = None,
) -> None:
    """Choose the pipeline schedule with the lowest bubble that fits a per-device activation budget (abstract costs);
    or, with --job, the fastest launches of a real job on its devices, priced by the calibrated model."""
    from hops_calib.cli.whatif import plan_command, plan_job_command

    _refuse_unread(ctx, "abstract" if job is None else "parallel" if parallel else "job")
    if job is None:
        if stages is None or microbatches is None or memory_budget is None:
            missing = [flag for flag, value in (("--stages", stages), ("--microbatches", microbatches),
                                                ("--memory-budget", memory_budget)) if value is None]
            raise typer.BadParameter(f"an abstract plan needs {', '.join(missing)} (or plan a real job with --job)",
                                     param_hint=missing[0])
        plan_command(stages, microbatches, memory_budget, forward_cost, backward_cost, weight_grad_cost, chunks,
                     target_bubble, as_json)
        return
    if parallel:
        from hops_calib.cli.whatif import plan_layouts_command

        raise typer.Exit(plan_layouts_command(job, model, top, as_json))
    raise typer.Exit(plan_job_command(job, _cluster(ctx, cluster, no_cluster), model, top, tuple(schedules or ()), fixed_order, fixed_split,
                                      fixed_micro_batch, tuple(device_memory or ()), trials, exhaustive_limit,
                                      rank_by, perturbations, as_json, fixtures, any_runtime, memory_headroom,
                                      keep_levers))


# --- the loop: predict, evaluate, report, ledger (hops_calib.cli.loop) --------------------------------

# The gate's tolerance options, declared once: (Tolerances field, option, type, help). `with_tolerances` adds them
# to a command, which receives them as one `tolerances` dict (None where not given).
TOLERANCE_OPTIONS = (
    ("throughput_mape_pp", "--tolerance-mape-pp", float,
     "Suite throughput MAPE may grow by this many pp (default 0: hold)."),
    ("bubble_mae_pp", "--tolerance-bubble-mae-pp", float,
     "Suite bubble MAE may grow by this many pp (default 0: hold)."),
    ("util_spearman", "--tolerance-rho", float, "Mean utilization rho may fall by this much (default 0: hold)."),
    ("run_throughput_pp", "--tolerance-run-throughput-pp", float,
     "Any run's |throughput error| may grow by this (default 2 pp)."),
    ("run_bubble_pp", "--tolerance-run-bubble-pp", float, "Any run's |bubble error| may grow by this (default 2 pp)."),
    ("run_throughput_error", "--run-error", str,
     "Which throughput error the per-run rule reads: window (default) or stall-free (the runs' random retransmission "
     "stalls taken out of both sides, where the trace shows them); the suite rules always read the window error."),
)
OFF_RECORD_OPTION = typer.Option(
    False, "--off-record", help="Judge on a store other than the one the model was calibrated on (per the ledger), "
                                "or a change that moves no run there; the ledger entry is marked off_record (a change "
                                "that moves no run is never committed).")
PLAN_OPTION = typer.Option(
    None, "--plan", help="Judge under the tolerances of this ledger plan entry (`ledger plan`), stated beforehand; "
                         "cited in the entry. Without it a judgement is under the defaults (recorded as such); the "
                         "tolerance options are refused on a judgement: put them in the plan.")
ALLOW_HELD_OUT_OPTION = typer.Option(
    False, "--allow-held-out", help="Go on although the store holds in train a group the ledger remembers as held out "
                                    "(refused otherwise, naming the groups); the ledger records the override.")


# Give a command the tolerance options; it takes them as its `tolerances` parameter (a dict).
with_tolerances = option_group("tolerances", TOLERANCE_OPTIONS)
ledger_app = typer.Typer(help="The append-only, hash-chained experiment ledger.", no_args_is_help=True)
app.add_typer(ledger_app, name="ledger")
candidate_app = typer.Typer(help="Candidate files (experiments/ID.toml): one term's change each.", no_args_is_help=True)
app.add_typer(candidate_app, name="candidate")


@candidate_app.command("new")
def candidate_new(
    term: str = typer.Argument(..., help="The cost term the candidate changes (see `hops-calib terms`)."),
    candidate_id: str | None = typer.Option(None, "--id", help="The candidate's id and file name (default: the "
                                                                  "next number in the folder, then the term)."),
    folder: Path = typer.Option(Path("experiments"), "--dir", help="Where to write it."),
    model: Path | None = MODEL_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (path, id, text)."),
    device: list[str] | None = typer.Option(
        None, "--device", help="Also write a per-device override NAME@TYPE for this device type (repeatable), for "
                               "every parameter that takes one and has none for it yet, at its current value."),
) -> None:
    """Write a scaffold DIR/ID.toml for a one-term change: the term's parameters with the model's current values,
    defaults and bounds, and the hypothesis and grounding to fill in (evaluate refuses it until they are)."""
    from hops_calib.cli.loop import candidate_new_command

    raise typer.Exit(candidate_new_command(term, candidate_id, folder, model, as_json, tuple(device or ())))


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the option `name` was given on the command line (not its default or a setting)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


@app.command()
@with_perturbations
def predict(
    ctx: typer.Context,
    fixture_id: str | None = typer.Argument(None, metavar="[ID]", help="Fixture id (train split)."),
    all_train: bool = typer.Option(False, "--all", help="Every train fixture: per-run errors and the suite."),
    job: Path | None = typer.Option(None, "--job", help="A job directory to predict before it runs: "
                                       "megatron_args.txt (Megatron's flags: tensor, pipeline, data and sequence "
                                       "parallelism, distributed optimizer, recomputation, modern layers; torchrun "
                                       "--nnodes/--nproc-per-node place ranks on nodes), hops_trace_map.json, "
                                       "hops.base.yaml (the GPU type), link benchmark (optional on nodes). Prints "
                                       "the time by kind per stage, memory per GPU, samples/s and MFU; a flag the "
                                       "model does not price is refused naming it, one it does not know is "
                                       "named in a note."),
    schedules: list[str] | None = typer.Option(None, "--schedule", help="With --job: simulate this schedule "
                                                  "(repeatable: 1f1b, interleaved_1f1b, gpipe, zb_h1, auto); "
                                                  "default the configured one."),
    fixtures: Path = typer.Option(..., "--fixtures", default_factory=_default("fixtures"), show_default=False,
                                  help=FIXTURES_HELP + " With --job, the store whose train split the configuration "
                                  "is checked against for coverage: pass the store the model was calibrated on."),
    cluster: Path | None = CLUSTER_OPTION,
    no_cluster: bool = NO_CLUSTER_OPTION,
    model: Path | None = MODEL_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    kernels: bool = typer.Option(False, "--kernels", help="With --job: also the kernel table of a stage (each "
                                 "kernel Megatron launches per microbatch: shape, FLOPs, bytes, time, what bounds "
                                 "it; priced by decoder_kernels' values, its defaults when the model does not "
                                 "activate it)."),
    kernel_stage: int | None = typer.Option(None, "--kernel-stage", help="With --kernels: the virtual stage to "
                                               "list (default: the slowest).", show_default=False),
    perturbations: dict | None = None,
    ledger: Path = LEDGER_OPTION,
    allow_held_out: bool = ALLOW_HELD_OUT_OPTION,
) -> None:
    """Predicted vs real throughput, bubble, per-stage utilization and phase times of a fixture, from the spec
    alone; or, with --job, of a configuration that has not run (what-if, several schedules side by side; each hop
    priced by the hosts at its ends; with stragglers and failures, also their mean and 5th-percentile throughput)."""
    from hops_calib.cli.loop import predict_command

    raise typer.Exit(predict_command(fixture_id, all_train, fixtures, model, as_json, job, schedules or (),
                                     fixtures_defaulted=not _given(ctx, "fixtures"),
                                     cluster=_cluster(ctx, cluster, no_cluster),
                                     perturbations=perturbations, ledger_path=ledger,
                                     allow_held_out=allow_held_out, kernels=kernels, kernel_stage=kernel_stage))


@app.command()
@with_tolerances
def evaluate(
    candidate: Path | None = typer.Argument(None, help="Candidate file (experiments/*.toml): one term changed."),
    fixtures: list[Path] | None = FIXTURES_MANY_OPTION,
    model: Path | None = MODEL_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    commit: bool = typer.Option(False, "--commit", help="Write an accepted candidate into the model file."),
    ledger: Path = LEDGER_OPTION,
    split: str = typer.Option("train", "--split", help="Only 'train': the test split is for `report`."),
    tolerances: dict | None = None,  # the tolerance options, added by with_tolerances
    plan: int | None = PLAN_OPTION,
    off_record: bool = OFF_RECORD_OPTION,
    again: bool = typer.Option(False, "--again", help="Judge again a change the ledger already judged on this model "
                                                      "and fixture set, under the same rules (refused otherwise: it "
                                                      "would repeat it; other rules need `ledger plan --rejudge`)."),
    allow_held_out: bool = ALLOW_HELD_OUT_OPTION,
) -> None:
    """Score the model on the train split; with a candidate, gate it and record the answer.

    Exit 0 accepted (or no candidate), 1 rejected, 2 invalid input, 4 refused: the store is not the one the model
    was calibrated on, or the candidate moves no run (see README, exit codes). A judgement is under the gate's
    defaults (hops_calib.loop.gate.Tolerances) or, with --plan N, under plan N's tolerances.
    """
    from hops_calib.cli.loop import evaluate_command

    raise typer.Exit(evaluate_command(candidate, fixtures_given(fixtures), model, as_json, commit, ledger, split, tolerances or {}, plan,
                                      off_record=off_record, again=again, allow_held_out=allow_held_out))


@app.command()
@with_tolerances
def compare(
    before: Path = typer.Argument(..., help="The model file to compare against (e.g. the model before a move)."),
    fixtures: list[Path] | None = FIXTURES_MANY_OPTION,
    model: Path | None = MODEL_OPTION,
    note: str = typer.Option("", "--note", help="What the comparison judges (e.g. 'move 029-035'), for the ledger."),
    ledger: Path = LEDGER_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    tolerances: dict | None = None,  # the tolerance options, added by with_tolerances
    commit_into: Path | None = typer.Option(
        None, "--commit", help="Carry the verdict out in this model file (the one the move's steps were committed "
                               "into, e.g. the shipped model): the model after if accepted, BEFORE if rejected."),
    plan: int | None = PLAN_OPTION,
    off_record: bool = OFF_RECORD_OPTION,
    allow_held_out: bool = ALLOW_HELD_OUT_OPTION,
) -> None:
    """Gate a whole model (--model, default the shipped one) against BEFORE on the train split; record the answer.

    For a move: candidates that hold the suite only together land one by one, each with the relaxed tolerances it
    needed; this judges the end against the start under the usual ones, and with --commit keeps the end or undoes
    the move. Exit 0 accepted, 1 rejected, 2 invalid, 4 off the record (another store than the model's, or the
    models predict every run alike).
    """
    from hops_calib.cli.loop import compare_command

    raise typer.Exit(compare_command(before, fixtures_given(fixtures), model, note, ledger, as_json, tolerances or {}, commit_into, plan,
                                     off_record=off_record, allow_held_out=allow_held_out))


@app.command()
def report(
    split: str | None = typer.Option(
        None, "--split", help="test: an audited look at the held-out split (counted in the ledger); train. Required "
                              "for a look, so that none is taken by default; --preview alone previews test."),
    fixtures: Path = FIXTURES_OPTION,
    model: Path | None = MODEL_OPTION,
    ledger: Path = LEDGER_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    html: Path | None = typer.Option(
        None, "--html", help="Also write a self-contained HTML page (aggregates, breakdowns; for train also the "
                             "parity plot and one row per run)."),
    again: bool = typer.Option(
        False, "--again", help="Look even when an earlier look's model predicted every held-out configuration as "
                               "this one does (refused otherwise: its answer is in the ledger)."),
    preview: bool = typer.Option(
        False, "--preview", help="Only say what a look would tell that the ledger does not: on how many held-out "
                                 "configurations the predictions changed since the last look, or which look it "
                                 "would repeat. Reads no result, appends nothing."),
    against: Path | None = typer.Option(
        None, "--against", help="With --preview: also count the held-out configurations this model predicts "
                                "otherwise than the model file given (for a look made before digests were "
                                "recorded: git show REV:hops_calib/model/models/baseline.toml > old.toml)."),
) -> None:
    """Suite aggregates only on the held-out split, with an audit entry in the ledger for every look (train: none).

    A look that would repeat an earlier one (the same predictions on every
    held-out configuration) is refused with exit 2 before anything is scored,
    unless --again. Otherwise it says on how many configurations the
    predictions changed since the last look.
    """
    from hops_calib.cli.loop import report_command

    raise typer.Exit(report_command(split, fixtures, model, ledger, as_json, html, again, preview, against))


@app.command()
def terms(
    model: Path | None = MODEL_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print JSON (with every device constant's source)."),
) -> None:
    """The cost terms a candidate can add, remove or set: which are active, their parameters and bounds; devices."""
    from hops_calib.cli.loop import terms_command

    raise typer.Exit(terms_command(model, as_json))


@ledger_app.command("show")
def ledger_show(
    ledger: Path = LEDGER_OPTION,
    last: int | None = typer.Option(None, "--last", min=1, help="Only the last N entries (N >= 1)."),
    as_json: bool = typer.Option(False, "--json", help="Print the entries as JSON."),
) -> None:
    """One line per entry: time, decision, candidate and change, MAPE before -> after."""
    from hops_calib.cli.loop import ledger_show_command

    raise typer.Exit(ledger_show_command(ledger, last, as_json))


@ledger_app.command("plan")
@with_tolerances
def ledger_plan(
    note: str = typer.Option(..., "--note", help="What will be tried, and why these tolerances."),
    candidate: list[Path] | None = typer.Option(
        None, "--candidate", help="A candidate file the plan is for (repeatable): pinned by its text's sha256, so "
                                  "evaluate --plan N refuses any other candidate, an edited one included."),
    rejudge: int | None = typer.Option(
        None, "--rejudge", help="The ledger entry (seq) of an earlier judgement of the same change, judged again under "
                                "this plan's rules; required to judge a change the ledger already judged on that "
                                "model and store."),
    fixtures: list[Path] | None = typer.Option(
        None, "--fixtures", help="The store(s) its judgements will be made on (repeatable): their train runs' fixture "
                                 "set is recorded, evaluate/compare --plan N refuse others, and a candidate judged "
                                 "before only on other runs needs no --rejudge."),
    ledger: Path = LEDGER_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print the entry as JSON."),
    tolerances: dict | None = None,  # the tolerance options, added by with_tolerances
) -> None:
    """Record, before any of its evaluations, what will be tried and the tolerances it will be judged under (the only
    way to judge under tolerances other than the defaults)."""
    from hops_calib.cli.loop import ledger_plan_command

    raise typer.Exit(ledger_plan_command(ledger, note, tolerances or {}, as_json, tuple(candidate or ()), rejudge,
                                         tuple(fixtures or ())))


@ledger_app.command("looks")
def ledger_looks(
    ledger: Path = LEDGER_OPTION,
    split: str = typer.Option("test", "--split", help="The held-out split whose reports are listed."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Every look at the held-out split: its model, result, the work since the look before, repeats."""
    from hops_calib.cli.loop import ledger_looks_command

    raise typer.Exit(ledger_looks_command(ledger, split, as_json))


@ledger_app.command("verify")
def ledger_verify(
    ledger: Path = LEDGER_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Check every line and the hash chain; name each damaged, edited or truncated line. Exit 1 on any problem."""
    from hops_calib.cli.loop import ledger_verify_command

    raise typer.Exit(ledger_verify_command(ledger, as_json))


@ledger_app.command("hold-out")
def ledger_hold_out(
    fixtures: Path = FIXTURES_OPTION,
    ledger: Path = LEDGER_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Record a store's test groups (names and events digests) in the ledger without looking at them, so every verb
    refuses them in a train split from then on (a report or a judgement records them too)."""
    from hops_calib.cli.loop import ledger_hold_out_command

    raise typer.Exit(ledger_hold_out_command(fixtures, ledger, as_json))


@ledger_app.command("export")
def ledger_export(
    out: Path = typer.Argument(..., help="Parquet file to write."),
    ledger: Path = LEDGER_OPTION,
) -> None:
    """Write the ledger as a Parquet table, one row per entry."""
    from hops_calib.cli.loop import ledger_export_command

    raise typer.Exit(ledger_export_command(ledger, out))


@ledger_app.command("repair")
def ledger_repair(
    ledger: Path = LEDGER_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Set aside an incomplete last line left by an interrupted append (complete entries are never touched)."""
    from hops_calib.cli.loop import ledger_repair_command

    raise typer.Exit(ledger_repair_command(ledger, as_json))


# --- pictures (hops_calib.cli.plot, drawn by hops_calib.plot) --------------------------------------------

plot_app = typer.Typer(help="Pictures: timelines (real vs predicted), parity plots, ledger history. PNG or SVG by "
                            "the --out suffix.", no_args_is_help=True)
app.add_typer(plot_app, name="plot")
DPI_OPTION = typer.Option(150.0, "--dpi", help="Pixels per inch of a PNG (the figure's size is fixed in inches).")


@plot_app.command("timeline")
@with_perturbations
def plot_timeline(
    ctx: typer.Context,
    fixture_id: str | None = typer.Argument(None, metavar="[ID]",
                                               help="Fixture id (train split; see fixtures list)."),
    job: Path | None = typer.Option(None, "--job", help="Instead of a fixture: a job directory that has not run "
                                       "(what-if; its configuration files only)."),
    schedules: list[str] | None = typer.Option(None, "--schedule", help="With --job: one predicted panel per "
                                                  "schedule (repeatable); default the configured one."),
    iterations: int | None = typer.Option(None, "--iterations", help="Show the first K whole iterations. "
                                             "Default 2, fewer, down to the start of one, when a forward would be "
                                             "under 6 px wide (the title says which window is drawn)."),
    fixtures: Path = FIXTURES_OPTION,
    cluster: Path | None = CLUSTER_OPTION,
    no_cluster: bool = NO_CLUSTER_OPTION,
    model: Path | None = MODEL_OPTION,
    out: Path | None = typer.Option(None, "--out", help="Image to write, *.png or *.svg (default: "
                                       "timeline-ID.png, with --job timeline-<job folder name>.png, in the current "
                                       "directory)."),
    chrome: Path | None = typer.Option(None, "--chrome", help="Also write the panels as Chrome trace JSON (*.json: "
                                          "Perfetto or chrome://tracing opens it, zoomable): their first 3 "
                                          "iterations, see --chrome-iterations and --chrome-all."),
    chrome_iterations: int | None = typer.Option(None, "--chrome-iterations", help="With --chrome: export each "
                                                    "panel's first K iterations (default 3)."),
    chrome_all: bool = typer.Option(False, "--chrome-all", help="With --chrome: export whole runs (a large job's "
                                       "can be hundreds of MB)."),
    dpi: float = DPI_OPTION,
    ledger: Path = LEDGER_OPTION,
    perturbations: dict | None = None,
) -> None:
    """The real run above its prediction on one time axis: a lane per stage, bars by phase, sends, idle time; with
    --job, a configuration's predictions under each schedule (and, with stragglers or failures, a perturbed draw)."""
    from hops_calib.cli.plot import timeline_command

    raise typer.Exit(timeline_command(fixture_id, fixtures, model, iterations, out, dpi, job, tuple(schedules or ()),
                                      _cluster(ctx, cluster, no_cluster), perturbations, chrome, ledger,
                                      _chrome_window(chrome_iterations, chrome_all)))


def _chrome_window(iterations: int | None, whole: bool) -> int | None:
    """The Chrome export's window: K iterations, None for whole runs, -1 for the default."""
    if whole and iterations is not None:
        raise typer.BadParameter("--chrome-iterations and --chrome-all given together: give one (K iterations, or "
                                 "whole runs)", param_hint="--chrome-all")
    return None if whole else -1 if iterations is None else iterations


@plot_app.command("parity")
def plot_parity(
    split: str = typer.Option("train", "--split", help="Only 'train': held-out runs are seen only in aggregate."),
    fixtures: Path = FIXTURES_OPTION,
    model: Path | None = MODEL_OPTION,
    out: Path | None = typer.Option(None, "--out", help="Image to write, *.png or *.svg (default: "
                                       "parity-train.png in the current directory)."),
    label_worst: int = typer.Option(3, "--label-worst", help="Label this many worst runs in each panel."),
    dpi: float = DPI_OPTION,
    ledger: Path = LEDGER_OPTION,
) -> None:
    """Predicted vs real throughput and bubble, one point per run, coloured by device mix."""
    from hops_calib.cli.plot import parity_command

    raise typer.Exit(parity_command(split, fixtures, model, out, label_worst, dpi, ledger))


@plot_app.command("ledger")
def plot_ledger(
    ledger: Path = LEDGER_OPTION,
    out: Path | None = typer.Option(None, "--out", help="Image to write, *.png or *.svg (default: "
                                       "ledger-history.png in the current directory)."),
    dpi: float = DPI_OPTION,
    candidates: str | None = typer.Option(
        None, "--candidates", help="Only candidates whose id matches this regular expression (one campaign, when "
                                   "a ledger holds campaigns on different fixture sets)."),
) -> None:
    """Suite MAPE, bubble MAE and rho after each accepted change; rejected candidates and held-out reports marked."""
    from hops_calib.cli.plot import ledger_command

    raise typer.Exit(ledger_command(ledger, out, dpi, candidates))


# --- research (hops_calib.cli.research): where the error comes from, one term's parameters, whether they travel ---


@app.command()
def observe(
    fixtures: Path = FIXTURES_OPTION,
    model: Path | None = MODEL_OPTION,
    split: str = typer.Option("train", "--split", help="Only 'train': the test split is for `report`."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (every contributor and run)."),
    top: int = typer.Option(12, "--top", min=1, help="Contributors and runs shown in the text output."),
    ledger: Path = LEDGER_OPTION,
    allow_held_out: bool = ALLOW_HELD_OUT_OPTION,
) -> None:
    """Where the throughput error comes from: iteration parts and stage times by group, largest MAPE share first."""
    from hops_calib.cli.research import observe_command

    raise typer.Exit(observe_command(fixtures, model, split, as_json, top, ledger, allow_held_out))


@app.command()
def tune(
    term: str = typer.Argument(..., help="The cost term whose parameters are searched (see `hops-calib terms`)."),
    trials: int = typer.Option(60, "--trials", min=1, help="Trials to run (shared among the workers)."),
    storage: str | None = typer.Option(
        None, "--storage", help="Optuna storage URL: sqlite:///FILE, postgresql://USER:PASSWORD@HOST/DB (the [db] "
                                "extra) or any RDB URL. Default: $HOPS_CALIB_STORAGE, else `storage` under \\[defaults] "
                                "of the nearest hops-calib.toml, else in memory."),
    study: str | None = typer.Option(None, "--study", help="Study name (default: term, model and fixture set)."),
    workers: int = typer.Option(1, "--workers", min=1, help="Processes working on the study (needs --storage)."),
    fixtures: list[Path] | None = FIXTURES_MANY_OPTION,
    model: Path | None = MODEL_OPTION,
    out: Path | None = typer.Option(
        None, "--out", help="Candidate file to write (default: experiments/tune-TERM-trialN.toml)."),
    seed: int = typer.Option(0, "--seed", help="Sampler seed (tpe: worker k uses seed + k; sobol: the study's)."),
    sampler: str = typer.Option(
        "tpe", "--sampler", help="tpe (learns from the trials so far), or sobol (trial k is the study's k-th Sobol "
                                 "point: the same study with any number of workers; docs/distributed-tuning.md)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    objective: str = typer.Option(
        "suite", "--objective", help="suite: throughput MAPE, bubble MAE, -rho (Pareto); components: the error of "
                                     "the stage, optimizer and between-iteration times the traces measure."),
    only: list[str] | None = typer.Option(
        None, "--only", help="Search only this parameter (repeatable); the others keep the model's values."),
    ledger: Path = LEDGER_OPTION,
    off_record: bool = OFF_RECORD_OPTION,
    split: str = typer.Option("train", "--split", help="Only 'train': the test split is for `report`."),
    allow_held_out: bool = ALLOW_HELD_OUT_OPTION,
) -> None:
    """Optuna study over one term's parameters on the train split; writes the chosen Pareto point as a candidate
    (experiments/ID.toml). Exit 0 written, 1 none (no trial beats the model: status no_candidate), 4 off the record."""
    from hops_calib.cli.research import tune_command

    raise typer.Exit(tune_command(term, fixtures_given(fixtures), model, trials, storage, study, workers, seed, out, as_json,
                                  objective, tuple(only or ()), ledger, off_record, split, allow_held_out, sampler))


@app.command()
def crossval(
    term: str = typer.Argument(..., help="The cost term whose fit is cross-validated (see `hops-calib terms`)."),
    folds: int = typer.Option(5, "--folds", help="Folds of the train split's configurations (repeats stay together); "
                                                 "as many as configurations: leave one configuration out."),
    evaluations: int = typer.Option(150, "--evaluations", min=1,
                                    help="Model evaluations per refit at most (one refit per fold, from defaults)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the fold assignment."),
    fixtures: Path = FIXTURES_OPTION,
    model: Path | None = MODEL_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (every fold and train run)."),
    objective: str = typer.Option("suite", "--objective", help="As for tune: suite or components."),
    only: list[str] | None = typer.Option(
        None, "--only", help="Refit only this parameter (repeatable); the others keep the model's values."),
    shared: bool = typer.Option(False, "--shared", help="Take the refit parameters' per-device values (NAME@TYPE) "
                                                        "out first: one value for every device."),
    also: list[str] | None = typer.Option(
        None, "--also", help="Another term's parameter refit together with TERM's, as TERM:PARAM (repeatable)."),
    split: str = typer.Option("train", "--split", help="Only 'train': the test split is for `report`."),
    ledger: Path = LEDGER_OPTION,
    allow_held_out: bool = ALLOW_HELD_OUT_OPTION,
) -> None:
    """Refit one term without each fold of train configurations and predict that fold: held-out error from train."""
    from hops_calib.cli.research import crossval_command

    raise typer.Exit(crossval_command(term, fixtures, model, folds, evaluations, seed, as_json, objective,
                                      tuple(only or ()), shared, tuple(also or ()), split, ledger, allow_held_out))


class _UsageError(Protocol):
    """A usage error as typer raises it (click's ClickException, which typer vendors in its recent versions)."""

    exit_code: int

    def show(self) -> None: ...

    def format_message(self) -> str: ...


def _is_usage_error(error: Exception) -> TypeGuard[_UsageError]:
    return hasattr(error, "show") and isinstance(getattr(error, "exit_code", None), int)


# --- a ledger is the held-out memory: one that does not exist is started only on purpose --------------------

NEW_LEDGER_OPTION = typer.Option(False, "--new-ledger", help="Start a new ledger at the --ledger PATH given (a "
                                 "--ledger that does not exist is refused otherwise: a new ledger remembers nothing "
                                 "held out).")


def _with_new_ledger(command: Callable[..., None]) -> Callable[..., None]:
    """A command with a `ledger` parameter, given --new-ledger: without it, a --ledger naming no file is refused
    (exit 2) before the command runs."""
    signature = inspect.signature(command, eval_str=True)
    if "ledger" not in signature.parameters or "new_ledger" in signature.parameters:
        return command
    added = inspect.Parameter("new_ledger", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                              default=NEW_LEDGER_OPTION)

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> None:
        from hops_calib.cli.output import refuse_missing_ledger

        code = refuse_missing_ledger(kwargs.get("ledger"), kwargs.pop("new_ledger"), bool(kwargs.get("as_json")))
        if code:
            raise typer.Exit(code)
        return command(**kwargs)

    parameters = [*signature.parameters.values(), added]
    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    del wrapper.__wrapped__
    return wrapper


for _typer in [app, *(group.typer_instance for group in app.registered_groups if group.typer_instance)]:
    for _info in _typer.registered_commands:
        if _info.callback is not None:
            _info.callback = _with_new_ledger(_info.callback)


def main() -> None:
    """The entry point. Exit codes (hops_calib.cli.output; README, "Exit codes"): 0 ok / accepted, 1 rejected, 2 bad
    input or usage, 4 refused off the record, 5 a broken ledger, 6 a partial ingest, 3 an internal error (a bug;
    the verbs report their own, this catches the rest).
    A usage error (an option's value, an unknown verb) under --json is also one {"error": ...} object on stdout,
    as the verbs' own errors are."""
    import sys

    from hops_calib.cli.output import error_record, internal_error

    try:
        code = app(standalone_mode=False)
    except typer.Abort:
        print("Aborted!", file=sys.stderr)
        sys.exit(1)
    except BrokenPipeError:  # stdout's reader went away (`| head`): end quietly, as a process killed by SIGPIPE
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except Exception as error:  # noqa: BLE001 - a crash must not exit 1, which reads as "rejected"
        usage = error if _is_usage_error(error) else None
        if usage is not None:
            usage.show()
            if "--json" in sys.argv[1:] and usage.exit_code != 0:
                import json

                record = error_record(error, usage.exit_code)
                record["error"]["message"] = record["error"]["problem"] = usage.format_message()
                param = getattr(error, "param", None)
                record["error"]["field"] = "/".join(getattr(param, "opts", None) or []) or None
                print(json.dumps(record, indent=1, default=str))
            sys.exit(usage.exit_code)
        sys.exit(internal_error(error))
    sys.exit(code if isinstance(code, int) else 0)
