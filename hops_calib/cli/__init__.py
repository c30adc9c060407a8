"""The command layer: the typer app and `main` (the entry point), built from one module per verb group, the only
layer that prints: `ingest`, `fixtures` (list, show), `evaluate` (evaluate, compare), `report`, `ledger`,
`candidate` (terms, candidate new), `research` (observe, tune, crossval), `cluster`, `plot`, `capture`, `bench`,
`version`; plan, predict and observe are declared here (their bodies in `whatif`, `loop` and `research`). `options`
holds the options the verbs share, `output` what they print with (JSON, error objects, exit codes), `render` their
text for people. The order of registration is the order of `hops-calib --help`."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, TypeGuard

import typer

from hops_calib.cli import (
    bench,
    candidate,
    capture,
    cluster,
    evaluate,
    fixtures,
    ingest,
    job,
    ledger,
    plot,
    report,
    research,
    version,
)
from hops_calib.cli.options import (
    ALLOW_HELD_OUT_OPTION,
    CLUSTER_OPTION,
    FIXTURES_HELP,
    FIXTURES_OPTION,
    LEDGER_OPTION,
    MODEL_OPTION,
    NO_CLUSTER_OPTION,
    PERTURBATION_OPTIONS,
    TOLERANCE_OPTIONS,
    add_new_ledger,
    with_perturbations,
)
from hops_calib.cli.options import cluster_of as _cluster
from hops_calib.cli.options import default_path as _default
from hops_calib.cli.options import given as _given

__all__ = ["TOLERANCE_OPTIONS", "app", "main"]

app = typer.Typer(
    name="hops-calib",
    help="Calibrate and validate a pipeline-parallel training simulator against real Megatron-LM traces.",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(fixtures.app, name="fixtures")
for verb in (bench.bench, version.version, capture.capture, ingest.ingest, cluster.cluster):
    app.command()(verb)


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


for verb in (evaluate.evaluate, evaluate.compare, report.report, candidate.terms):
    app.command()(verb)


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


for verb in (research.tune, research.crossval):
    app.command()(verb)
app.add_typer(ledger.app, name="ledger")
app.add_typer(candidate.app, name="candidate")
app.add_typer(plot.app, name="plot")
app.add_typer(job.app, name="job")
add_new_ledger(app)


class _UsageError(Protocol):
    """A usage error as typer raises it (click's ClickException, which typer vendors in its recent versions)."""

    exit_code: int

    def show(self) -> None: ...

    def format_message(self) -> str: ...


def _is_usage_error(error: Exception) -> TypeGuard[_UsageError]:
    return hasattr(error, "show") and isinstance(getattr(error, "exit_code", None), int)


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
