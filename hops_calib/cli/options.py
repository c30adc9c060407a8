"""The options several verbs share, each declared once (a typer option, or a group of them that a decorator adds
and the verb receives as one dict), and what reads them: where --fixtures and --cluster default to, whether an
option was given on the command line, the cluster a verb uses, --new-ledger for every verb with a --ledger."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer


def default_path(kind: str) -> Callable[[], Path | None]:
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


FIXTURES_HELP = (
    "Fixture store folder. Default: $HOPS_CALIB_FIXTURES, else `fixtures` under \\[defaults] of the nearest "
    "hops-calib.toml, else ./fixtures of the current directory (from the repository root: the CPU "
    "captures' store)."
)
FIXTURES_OPTION = typer.Option(
    ..., "--fixtures", default_factory=default_path("fixtures"), show_default=False, help=FIXTURES_HELP
)
# Verbs that judge (evaluate, compare, tune): --fixtures may be repeated, for a judgement covering every store a
# model is calibrated on (the union of their train splits; the gate's rules hold on each store).
FIXTURES_MANY_OPTION = typer.Option(
    None,
    "--fixtures",
    show_default=False,
    help=FIXTURES_HELP + " Repeat it to judge on several stores at once (every store "
    "the changed part was calibrated on; the gate's rules must hold on each).",
)


def fixtures_given(fixtures: list[Path] | None) -> list[Path]:
    """The stores of a repeatable --fixtures: those given, else the default store (as --fixtures alone finds it)."""
    if fixtures:
        return list(fixtures)
    found = default_path("fixtures")()
    return [found] if found is not None else []  # (the default store is always a path)


MODEL_OPTION = typer.Option(
    None, "--model", help="Model file (default: the shipped hops_calib/model/models/baseline.toml)."
)
CLUSTER_OPTION = typer.Option(
    ...,
    "--cluster",
    default_factory=default_path("cluster"),
    show_default=False,
    help="Cluster file (hosts, devices, links; `hops-calib cluster` writes one): each hop is "
    "priced by the hosts at its ends. Default: $HOPS_CALIB_CLUSTER, else `cluster` "
    "under \\[defaults] of the nearest hops-calib.toml, else none (each device's host "
    "is the one the job's own link benchmark names at its stage position).",
)
NO_CLUSTER_OPTION = typer.Option(
    False,
    "--no-cluster",
    help="Use no cluster, whatever $HOPS_CALIB_CLUSTER or a "
    "hops-calib.toml sets (HOPS_CALIB_CLUSTER= set empty does the same).",
)


def cluster_of(ctx: typer.Context, cluster: Path | None, no_cluster: bool):
    """The cluster a verb uses and where it came from (`cli.settings.cluster_choice`)."""
    from hops_calib.cli.settings import cluster_choice

    if no_cluster and given(ctx, "cluster"):
        raise typer.BadParameter("--cluster and --no-cluster contradict each other", param_hint="--no-cluster")
    return cluster_choice(cluster, given(ctx, "cluster"), no_cluster)


LEDGER_OPTION = typer.Option(
    None,
    "--ledger",
    show_default=False,
    help=(
        "Experiment ledger (JSON lines). Default: ledger/ledger.jsonl of the hops-calib checkout enclosing the current "
        "directory, else of the one the package runs from; it must exist: a new ledger only at a path named here."
    ),
)


def given(ctx: typer.Context, name: str) -> bool:
    """Whether the option `name` was given on the command line (not its default or a setting)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


# Stragglers and failures, for predict --job, plot timeline --job and plan --job (hops_calib.whatif.perturbations):
# (parameter, option, type, help). `with_perturbations` adds them; the command takes one `perturbations` dict.
PERTURBATION_OPTIONS = (
    (
        "slow_device",
        "--slow-device",
        list[str],
        "DEVICE:FACTOR: that device (an id of the stage map, or a stage number with predict/plot) runs its compute "
        "FACTOR times slower (1.1 = 10 %; thermal throttling, a degraded HBM stack). Repeatable.",
    ),
    (
        "slow_link",
        "--slow-link",
        list[str],
        "A-B:FACTOR: the hop between devices (or stages) A and B moves data FACTOR times slower: predict/plot refuse a "
        "pair that is no hop of the stage map; plan slows it in the launches where A and B are neighbours. The "
        "all-reduce between the pipeline's ends is not slowed. Repeatable.",
    ),
    (
        "stragglers",
        "--stragglers",
        str,
        "P:LOW:HIGH: in every iteration each GPU straggles with chance P, its compute slowed by a factor drawn from "
        "\\[LOW, HIGH] (seeded).",
    ),
    (
        "failure_rate",
        "--failure-rate",
        float,
        "Failures per hour of the whole job (any device or link; it stops): the cost is the work lost since the last "
        "checkpoint plus --recovery-s.",
    ),
    ("recovery_s", "--recovery-s", float, "Seconds to recover from a failure (detect, restart, reload; default 300)."),
    ("checkpoint_every", "--checkpoint-every", int, "Iterations between checkpoints (default 1)."),
    (
        "run_iterations",
        "--run-iterations",
        int,
        "Iterations of the run that failures strike (default: the launch's --train-iters, else 1000).",
    ),
    ("samples", "--samples", int, "Seeded draws per launch when stragglers or failures are random (default 32)."),
    ("seed", "--seed", int, "Seed of the draws (default 0)."),
)


def option_group(param: str, options: tuple) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A decorator giving a typer command the options of a group ((name, flag, type, help) each); the command takes
    them as one dict parameter `param` (None where not given)."""

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(command, eval_str=True)
        keep = [p for p in signature.parameters.values() if p.name != param]
        added = [
            inspect.Parameter(
                f"{param}__{name}",
                inspect.Parameter.KEYWORD_ONLY,
                annotation=kind | None,
                default=typer.Option(None, flag, help=text),
            )
            for name, flag, kind, text in options
        ]

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

# The gate's tolerance options, declared once: (Tolerances field, option, type, help). `with_tolerances` adds them
# to a command, which receives them as one `tolerances` dict (None where not given).
TOLERANCE_OPTIONS = (
    (
        "throughput_mape_pp",
        "--tolerance-mape-pp",
        float,
        "Suite throughput MAPE may grow by this many pp (default 0: hold).",
    ),
    (
        "bubble_mae_pp",
        "--tolerance-bubble-mae-pp",
        float,
        "Suite bubble MAE may grow by this many pp (default 0: hold).",
    ),
    ("util_spearman", "--tolerance-rho", float, "Mean utilization rho may fall by this much (default 0: hold)."),
    (
        "run_throughput_pp",
        "--tolerance-run-throughput-pp",
        float,
        "Any run's |throughput error| may grow by this (default 2 pp).",
    ),
    ("run_bubble_pp", "--tolerance-run-bubble-pp", float, "Any run's |bubble error| may grow by this (default 2 pp)."),
    (
        "run_throughput_error",
        "--run-error",
        str,
        "Which throughput error the per-run rule reads: window (default) or stall-free (the runs' random retransmission "
        "stalls taken out of both sides, where the trace shows them); the suite rules always read the window error.",
    ),
)
OFF_RECORD_OPTION = typer.Option(
    False,
    "--off-record",
    help="Judge on a store other than the one the model was calibrated on (per the ledger), "
    "or a change that moves no run there; the ledger entry is marked off_record (a change "
    "that moves no run is never committed).",
)
PLAN_OPTION = typer.Option(
    None,
    "--plan",
    help="Judge under the tolerances of this ledger plan entry (`ledger plan`), stated beforehand; "
    "cited in the entry. Without it a judgement is under the defaults (recorded as such); the "
    "tolerance options are refused on a judgement: put them in the plan.",
)
ALLOW_HELD_OUT_OPTION = typer.Option(
    False,
    "--allow-held-out",
    help="Go on although the store holds in train a group the ledger remembers as held out "
    "(refused otherwise, naming the groups); the ledger records the override.",
)


# Give a command the tolerance options; it takes them as its `tolerances` parameter (a dict).
with_tolerances = option_group("tolerances", TOLERANCE_OPTIONS)


# A ledger is the held-out memory: one that does not exist is started only on purpose.
NEW_LEDGER_OPTION = typer.Option(
    False,
    "--new-ledger",
    help="Start a new ledger at the --ledger PATH given (a "
    "--ledger that does not exist is refused otherwise: a new ledger remembers nothing "
    "held out).",
)


def with_new_ledger(command: Callable[..., None]) -> Callable[..., None]:
    """A command with a `ledger` parameter, given --new-ledger: without it, a --ledger naming no file is refused
    (exit 2) before the command runs."""
    signature = inspect.signature(command, eval_str=True)
    if "ledger" not in signature.parameters or "new_ledger" in signature.parameters:
        return command
    added = inspect.Parameter("new_ledger", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=NEW_LEDGER_OPTION)

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


def add_new_ledger(app: typer.Typer) -> None:
    """Give every command of `app` and of its groups that has a --ledger the --new-ledger option (`with_new_ledger`);
    run once, after every verb is registered."""
    for group in [app, *(group.typer_instance for group in app.registered_groups if group.typer_instance)]:
        for info in group.registered_commands:
            if info.callback is not None:
                info.callback = with_new_ledger(info.callback)
