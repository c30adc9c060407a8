"""The what-if verbs: `plan` (a schedule for a pipeline that fits a memory budget) and `predict --job` (a job
directory priced before it runs), computed by `hops_calib.whatif` and printed here."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from hops_calib.cli.output import EXIT_OK, print_json
from hops_calib.errors import InputError
from hops_calib.trace.job import require_job_dir

if TYPE_CHECKING:
    from hops_calib.model.coverage import Coverage


def plan_command(
    stages: int,
    microbatches: int,
    memory_budget: float,
    forward_cost: float,
    backward_cost: float,
    weight_grad_cost: float,
    chunks: int,
    target_bubble: float | None,
    as_json: bool,
) -> None:
    """Print the plan (a bad value is a usage error naming it, exit 2)."""
    from hops_calib.cli.render.plan import format_plan
    from hops_calib.whatif.plan import plan

    try:
        result = plan(
            stages, microbatches, memory_budget, forward_cost, backward_cost, weight_grad_cost, chunks, target_bubble
        )
        report = json.dumps({"status": "ok", **result.to_dict()}, indent=2) if as_json else format_plan(result)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error
    typer.echo(report)


def _calibration_band(fixtures: Path, model_path: Path | None) -> tuple[float, int, set[str]]:
    """The model's train MAPE on the store's train split, as the band a plan's throughputs carry, the runs it
    averages and their device types; (0, 0, none) without a store."""
    from hops_calib.loop.model_files import load_model
    from hops_calib.loop.suite import load_suite
    from hops_calib.whatif.job_plan import throughput_band

    try:
        suite = load_suite(fixtures, "train")
    except InputError:
        return 0.0, 0, set()
    band, runs = throughput_band(suite.specs, suite.truths, load_model(model_path))
    return band, runs, {device for spec in suite.specs for device in spec.devices}


def _band_source(band: float, runs: int, store_devices: set[str], fixtures: Path, job_devices: Sequence[str]) -> str:
    """Where a plan's band comes from, and, when the store holds no train run of the job's device types, that the
    band is another device's error and which store to pass instead."""
    if not runs:
        return ""
    source = f"+/- {100 * band:.1f} %: the model's throughput MAPE on the {runs} train runs of {fixtures.resolve()}"
    missing = sorted(set(job_devices) - store_devices)
    if not missing:
        return source
    return (
        f"{source}; no train run of {', '.join(missing)} in that store (its runs are on "
        f"{', '.join(sorted(store_devices))}): the band is the {'/'.join(sorted(store_devices))} runs' error, "
        f"not measured on {', '.join(missing)}; pass --fixtures the store calibrated on that device"
    )


def _calibration_coverage(fixtures: Path, defaulted: bool = False) -> tuple[Coverage | None, str]:
    """The train split of the fixture store as a what-if's calibration runs, and how to name them (its absolute
    path, and that it is the default store when --fixtures was not given); (None, why) when there is no store."""
    from hops_calib.loop.suite import load_suite
    from hops_calib.model.coverage import coverage

    default = ""
    if defaulted:
        from hops_calib.cli.settings import default_fixtures

        origin = default_fixtures().origin
        default = (
            f"; --fixtures not given: {origin}"
            if origin.startswith("the default")
            else f"; --fixtures not given: the store set by {origin}"
        )
    try:
        suite = load_suite(fixtures, "train")
    except InputError as error:
        return None, (
            f"{error} (store {fixtures.resolve()}{default}; pass --fixtures with the store the model was calibrated on)"
        )
    return coverage(suite.specs), f"train split of {fixtures.resolve()}, {len(suite.ids)} runs{default}"


def predict_job(
    job: Path,
    model_path: Path | None,
    schedules: Sequence[str],
    fixtures: Path,
    fixtures_defaulted: bool,
    as_json: bool,
    cluster: Path | None = None,
    perturbations: dict | None = None,
    *,
    kernels: bool = False,
    kernel_stage: int | None = None,
) -> int:
    """`predict --job DIR`: the configuration under each schedule, and where it lies outside the store's train
    runs. Errors are the caller's (`hops_calib.cli.output.guarded`)."""
    from hops_calib.cli.render.predict import what_if_text
    from hops_calib.loop.model_files import load_model
    from hops_calib.whatif.job import what_if

    result = what_if(
        job,
        load_model(model_path),
        schedules,
        *_calibration_coverage(fixtures, fixtures_defaulted),
        cluster=load_cluster(cluster),
        perturbations=parse_perturbations(perturbations, job),
        kernels=kernels,
        kernel_stage=kernel_stage,
    )
    if as_json:
        print_json(result.to_dict())
    else:
        print(what_if_text(result))
    return EXIT_OK


def launch_sections(
    spec, model, prediction, real=None, throughput_per_s: float | None = None
) -> tuple[dict, list[str]]:
    """What `predict --job` prints of a launch beside its throughput, for `predict ID` of a stored run: the time by
    kind per stage, the memory per GPU, samples/s and MFU/HFU, what it is priced with, and (`real`: the run's
    measured metrics) Megatron's logged timers beside the simulation's; `throughput_per_s`: the predicted
    throughput the run is scored by (`whatif.job.model_rates`). JSON fields and text lines."""
    from hops_calib.cli.render.predict import breakdown_lines, pricing_lines, timer_lines
    from hops_calib.loop.timers import timer_rows
    from hops_calib.whatif.job import (
        launch_memory,
        memory_headroom_bytes,
        model_rates,
        peak_flops_per_s,
        pricing_inputs,
    )

    breakdown = model.breakdown(spec)
    memory = launch_memory(spec, model, prediction)
    rates = model_rates(prediction, spec, peak_flops_per_s(spec, model), throughput_per_s)
    timers = timer_rows(getattr(real, "timers_ms", None), prediction.result.columns)
    inputs = pricing_inputs(spec)
    data = {
        "breakdown_ms_per_iteration": [{"stage": k, **parts} for k, parts in enumerate(breakdown)],
        "memory": [stage.to_dict() for stage in memory],
        "fits": all(stage.fits for stage in memory),
        "memory_headroom_bytes": memory_headroom_bytes(memory),
        "predicted_rates": rates,
        "timers": timers,
        "pricing_inputs": inputs,
    }
    lines = [
        "",
        f"predicted: {rates['samples_per_s']:.2f} samples/s, {rates['tokens_per_s']:.0f} tokens/s (all "
        f"replicas); TFLOP/s/GPU model {rates['model_tflops_per_gpu']:.3g} (MFU {100 * rates['mfu']:.1f} %), "
        f"hardware {rates['hardware_tflops_per_gpu']:.3g} (HFU {100 * rates['hfu']:.1f} %; model FLOPs leave "
        "recomputation out, as Megatron-LM logs them, hardware FLOPs count it)",
    ]
    lines += breakdown_lines(breakdown, memory) + timer_lines(timers) + pricing_lines(inputs)
    return data, lines


def load_cluster(choice):
    """The cluster file of `choice` (a `cli.settings.Setting`, or a path: given on the command line), or None when
    none is given or set. A default one knows where it was set (`Cluster.default_from`)."""
    from dataclasses import replace

    from hops_calib.cli.settings import Setting
    from hops_calib.whatif.cluster import read_cluster

    if not isinstance(choice, Setting):
        choice = Setting(choice, "--cluster")
    if choice.path is None:
        return None
    cluster = read_cluster(choice.path)
    return cluster if choice.origin == "--cluster" else replace(cluster, default_from=choice.origin)


def _factor(text: str, option: str) -> tuple[str, float]:
    name, sep, value = text.rpartition(":")
    try:
        factor = float(value)
    except ValueError:
        factor = math.nan
    if not sep or not name or not (1 <= factor < math.inf):
        raise InputError(
            option,
            f"{text!r} is not NAME:FACTOR with a finite FACTOR >= 1",
            field=option,
            hint=f"e.g. {option} l4_node0_gpu0:1.1 (10 % slower)",
        )
    return name, factor


def parse_perturbations(options: dict | None, job: Path | None = None, stages_allowed: bool = True):
    """The straggler and failure options as `Perturbations` (None when none is given). Devices are named by id, or,
    with `stages_allowed`, by stage number in `job`'s stage map."""
    from hops_calib.sim.perturb import Failure, RandomStragglers
    from hops_calib.whatif.perturbations import Perturbations

    options = options or {}
    if all(value in (None, []) for value in options.values()):
        return None
    ids: tuple[str, ...] = ()
    if job is not None and Path(job).is_dir():
        from hops_calib.trace import read_stage_map

        ids = read_stage_map(Path(job))

    # what names a device: its id in the stage map, or (where allowed) its stage number
    valid = (
        f"a stage number 0-{len(ids) - 1} ({len(ids)} stages) or a device id of the stage map ({', '.join(ids)})"
        if stages_allowed
        else f"a device id of the stage map ({', '.join(ids)})"
    )

    def device(name: str, option: str) -> str:
        if stages_allowed and name.isdigit() and int(name) < len(ids):
            return ids[int(name)]
        if ids and name not in ids:
            problem = (
                f"{name!r} is no device of the job"
                if not name.isdigit()
                else f"stage {name} is outside the job's stages 0-{len(ids) - 1}"
                if stages_allowed
                else f"{name!r} is no device of the job (a plan moves devices between stages: a stage number "
                "names none)"
            )
            raise InputError(option, problem, field=option, hint=f"name {valid}")
        return name

    slow_devices = []
    for text in options.get("slow_device") or []:
        name, factor = _factor(text, "--slow-device")
        slow_devices.append((device(name, "--slow-device"), factor))
    slow_links = []
    for text in options.get("slow_link") or []:
        pair, factor = _factor(text, "--slow-link")
        cuts = [k for k, char in enumerate(pair) if char == "-"]
        ends = next(
            (
                (pair[:k], pair[k + 1 :])
                for k in cuts
                if all(
                    not ids or end in ids or (stages_allowed and end.isdigit() and int(end) < len(ids))
                    for end in (pair[:k], pair[k + 1 :])
                )
            ),
            None,
        )
        if ends is None:
            raise InputError(
                "--slow-link",
                f"{pair!r} is not two devices A-B of the job",
                field="--slow-link",
                hint=(f"each end {valid}; " if ids else "")
                + "e.g. --slow-link 0-1:2 (stages) or l4_node0_gpu0-l4_node1_gpu0:2",
            )
        a, b = device(ends[0], "--slow-link"), device(ends[1], "--slow-link")
        if stages_allowed and ids and abs(ids.index(a) - ids.index(b)) != 1:
            # a what-if's stage map is fixed: a pair that is no hop of it would change nothing
            i, j = sorted((ids.index(a), ids.index(b)))
            ends_pair = (i, j) == (0, len(ids) - 1)
            raise InputError(
                "--slow-link",
                f"{pair!r} (stages {i}-{j}) is no hop of the pipeline, so no transfer "
                "runs over it"
                + (
                    ": it names the pipeline's ends, whose tied-embedding all-reduce "
                    "before the optimizer is priced by an estimate from the ends' links "
                    "(the 'between the ends' line), not by a link --slow-link slows"
                    if ends_pair
                    else ""
                ),
                field="--slow-link",
                hint="name two neighbouring stages, e.g. "
                + ", ".join(f"{k}-{k + 1}" for k in range(len(ids) - 1))
                + " (a slowed hop's transfers stretch)",
            )
        slow_links.append((a, b, factor))
    stragglers = None
    if options.get("stragglers"):
        parts = options["stragglers"].split(":")
        try:
            values = [float(x) for x in parts]
            stragglers = RandomStragglers(*values) if len(values) in (1, 3) else None
        except ValueError as error:
            raise InputError(
                "--stragglers",
                f"{options['stragglers']!r}: {error}",
                field="--stragglers",
                hint="P or P:LOW:HIGH, e.g. 0.05:1.05:1.3",
            ) from None
        if stragglers is None:
            raise InputError(
                "--stragglers",
                f"{options['stragglers']!r} is not P or P:LOW:HIGH",
                field="--stragglers",
                hint="e.g. 0.05:1.05:1.3",
            )
    failures: tuple[Failure, ...] = ()
    rate = options.get("failure_rate")
    if rate is not None or options.get("recovery_s") is not None:
        if rate is None:
            raise InputError("--recovery-s", "applies with --failure-rate", field="--recovery-s")
        try:
            failures = (Failure("the job (any device or link)", rate, options.get("recovery_s") or 300.0),)
        except ValueError as error:
            raise InputError("--failure-rate", str(error), field="--failure-rate") from None
    run_iterations, run_from = _run_iterations(options.get("run_iterations"), job)
    try:
        return Perturbations(
            slow_devices=tuple(slow_devices),
            slow_links=tuple(slow_links),
            stragglers=stragglers,
            failures=failures,
            checkpoint_every=options.get("checkpoint_every") or 1,
            run_iterations=run_iterations,
            run_iterations_from=run_from,
            samples=options.get("samples") or 32,
            seed=options.get("seed") or 0,
        )
    except ValueError as error:
        raise InputError("predict", str(error), field="--samples") from None


def _run_iterations(given: int | None, job: Path | None) -> tuple[int, str]:
    """The iterations of the run failures strike and where that number comes from: --run-iterations when given,
    else the launch's --train-iters (the whole run, warm-up included), else DEFAULT_RUN_ITERATIONS."""
    from hops_calib.whatif.perturbations import DEFAULT_RUN_ITERATIONS

    if given is not None:
        return given, "--run-iterations"
    if job is not None and Path(job).is_dir():
        from hops_calib.trace import TraceError
        from hops_calib.trace.megatron_args import find_launch

        try:
            launch = find_launch(Path(job))
        except TraceError:  # the prediction itself reports the launch it cannot read
            launch = None
        iters = launch.args.get("train_iters") if launch is not None else None
        if launch is not None and type(iters) is int and iters >= 1:
            return iters, f"the launch's --train-iters, {launch.source.name}"
    return DEFAULT_RUN_ITERATIONS, "default: the launch gives no --train-iters; --run-iterations N sets it"


def cluster_command(sources: Sequence[Path], out: Path, as_json: bool) -> int:
    """`hops-calib cluster SRC... --out FILE`: build the cluster of the job directories and write it."""
    from hops_calib.cli.output import guarded
    from hops_calib.files import atomic_write
    from hops_calib.whatif.cluster import cluster_from_jobs, cluster_yaml

    def run() -> int:
        if out.exists() and not out.is_file():
            raise InputError(str(out), "is not a file", field="--out", hint="name the cluster file to write")
        if out.suffix.lower() not in (".yaml", ".yml", ".json"):
            raise InputError(
                str(out),
                "is not a .yaml, .yml or .json file",
                field="--out",
                hint="a cluster file is YAML (JSON is YAML too)",
            )
        cluster = cluster_from_jobs(sources)
        text = (
            cluster_yaml(cluster)
            if out.suffix.lower() != ".json"
            else __import__("json").dumps(cluster.to_dict(), indent=1)
        )
        atomic_write(out, text)
        for note in cluster.notes:
            print(f"warning: {note}", file=sys.stderr)
        if as_json:
            print_json({"out": str(out), **cluster.to_dict(), "notes": list(cluster.notes)})
            return EXIT_OK
        print(f"wrote {out}: {_cluster_summary(cluster)} from {cluster.origin}")
        _print_links(cluster)
        return EXIT_OK

    return guarded(run, as_json)


def _cluster_summary(cluster) -> str:
    benchmarked = sum(link.benchmarked for link in cluster.links)
    devices = sum(node.gpus for node in cluster.nodes)
    return (
        f"{len(cluster.nodes)} hosts, {devices} devices, {len(cluster.links)} links ({benchmarked} benchmarked "
        f"host pairs, {len(cluster.links) - benchmarked} declared)"
    )


def _print_links(cluster) -> None:
    for link in cluster.links:
        print(
            f"  {link.src_host} -> {link.dst_host}: {link.bandwidth_gbit_s:.1f} Gbit/s, "
            f"{link.latency_ms:.3f} ms ({link.source or ('benchmarked' if link.benchmarked else 'declared')})"
        )


def cluster_check_command(path: Path, as_json: bool) -> int:
    """`hops-calib cluster --check FILE`: read a cluster file as every command would; its summary, or its first
    error (file, line, field, what to do; exit 2)."""
    from hops_calib.cli.output import guarded
    from hops_calib.whatif.cluster import read_cluster

    def run() -> int:
        cluster = read_cluster(path)
        if as_json:
            print_json({"status": "ok", "file": str(path), **cluster.to_dict()})
            return EXIT_OK
        print(f"{path}: ok, {_cluster_summary(cluster)}")
        _print_links(cluster)
        return EXIT_OK

    return guarded(run, as_json)


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def _bytes(text: str) -> float:
    """A memory size: bytes, or a number with a unit (GiB, GB, MiB, MB, ...; any case); nan when it is neither."""
    import re

    found = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", text)
    try:
        return float(found.group(1)) * _UNITS[found.group(2).lower()] if found else math.nan
    except (KeyError, ValueError):
        return math.nan


@dataclass(frozen=True)
class PlanJobRequest:
    """What `plan job DIR` (and the old `plan --job DIR`) was asked: the job, the model and cluster files (the cluster
    already resolved), the search's options, and the shared study's storage (`storage` None: the study in memory)."""

    job: Path
    cluster: Path | None = None
    model: Path | None = None
    top: int = 5
    schedules: tuple[str, ...] = ()
    keep_order: bool = False
    keep_split: bool = False
    keep_micro_batch: bool = False
    keep_levers: bool = False
    device_memory: tuple[str, ...] = ()
    trials: int | None = None
    exhaustive_limit: int = 10000
    any_runtime: bool = False
    precision: str | None = None
    memory_headroom_gb: float | None = None
    rank_by: str = "throughput"
    perturbations: dict | None = None
    fixtures: Path | None = None
    storage: str | None = None
    study: str | None = None
    workers: int = 1
    sampler: str = "tpe"


def plan_job_command(request: PlanJobRequest, as_json: bool) -> int:
    """`plan --job DIR`: the best launches of the job on its devices, under a progress bar."""
    from dataclasses import replace

    from hops_calib.cli.output import run_and_print
    from hops_calib.cli.render.plan import format_job_plan
    from hops_calib.loop.model_files import load_model
    from hops_calib.whatif.job_plan import MEGATRON_SCHEDULES, SCHEDULES, plan_job
    from hops_calib.whatif.launch_study import StudyRun

    seed = (request.perturbations or {}).get("seed") or 0

    def compute(bar):
        from hops_calib.study import SAMPLERS

        if request.sampler not in SAMPLERS:
            raise InputError(
                "--sampler",
                f"unknown sampler {request.sampler!r}",
                field="--sampler",
                hint=f"one of {', '.join(SAMPLERS)}",
            )
        if request.storage is None and (request.workers > 1 or request.study is not None):
            raise InputError(
                "plan",
                "--workers and --study share a study among processes, and the study is in memory",
                field="--storage",
                hint="pass --storage sqlite:///plan.db (one machine) or postgresql://USER@HOST/DB (several), or set "
                "storage in hops-calib.toml (docs/distributed-tuning.md)",
            )
        if request.trials is not None and not 1 <= request.trials <= 100_000:
            raise InputError("plan", f"--trials {request.trials} is outside 1..100000", field="--trials")
        memory: dict[str, float] = {}
        for text in request.device_memory:
            name, sep, value = text.rpartition(":")
            memory[name.lower()] = _bytes(value)
            if not sep or not name or not (0 < memory[name.lower()] < math.inf):
                raise InputError(
                    "--device-memory",
                    f"{text!r} is not TYPE:SIZE with SIZE > 0 (bytes, or with a unit: GiB, GB, MiB, MB)",
                    field="--device-memory",
                    hint="e.g. --device-memory a10g:20GiB or a10g:22e9 (leave room for the CUDA context)",
                )
        require_job_dir(request.job)
        if (
            request.schedules
            and not request.any_runtime
            and any(s not in MEGATRON_SCHEDULES for s in request.schedules)
        ):
            raise InputError(
                "--schedule",
                f"{next(s for s in request.schedules if s not in MEGATRON_SCHEDULES)!r} has no Megatron-LM flag",
                field="--schedule",
                hint="add --any-runtime to plan for a runtime that has it (torch.distributed.pipelining)",
            )
        band, runs, store_devices = (
            _calibration_band(request.fixtures, request.model) if request.fixtures is not None else (0.0, 0, set())
        )
        plan = plan_job(
            request.job,
            load_model(request.model),
            cluster=load_cluster(request.cluster),
            top=request.top,
            schedules=request.schedules or (SCHEDULES if request.any_runtime else MEGATRON_SCHEDULES),
            any_runtime=request.any_runtime,
            precision=request.precision,
            band=band,
            headroom_bytes=None if request.memory_headroom_gb is None else request.memory_headroom_gb * 1e9,
            study_trials=request.trials,
            levers=not request.keep_levers,
            orders=not request.keep_order,
            splits=not request.keep_split,
            micro_batch_sizes=not request.keep_micro_batch,
            memory_bytes=memory or None,
            trials=request.trials or 400,
            seed=seed,
            exhaustive_limit=request.exhaustive_limit,
            perturbations=parse_perturbations(request.perturbations, request.job, stages_allowed=False),
            rank_by=request.rank_by,
            progress=bar,
            calibration=coverage,
            store=store,
            study_run=None
            if request.storage is None
            else StudyRun(request.storage, request.study, request.workers, request.sampler),
        )
        if request.fixtures is None:
            return plan
        return replace(
            plan, band_source=_band_source(band, runs, store_devices, request.fixtures, list(plan.capacity_bytes or ()))
        )

    coverage, store = _calibration_coverage(request.fixtures) if request.fixtures is not None else (None, "")

    return run_and_print("plan", as_json, compute, format_job_plan)


PARALLEL_NOTE = (
    "--parallel is no longer needed: plan --job without it searches these layouts together with "
    "every other lever (recomputation, sequence parallelism, the distributed optimizer, the schedule, the "
    "micro batch), within each GPU's memory less a headroom; --parallel keeps its layout-only table"
)


def plan_layouts_command(job: Path, model_path: Path | None, top: int, as_json: bool) -> int:
    """`plan --job DIR --parallel`: the fastest tensor x pipeline x data parallel layouts of the job's GPUs."""
    from hops_calib.cli.output import run_and_print
    from hops_calib.cli.render.plan import format_layout_plan
    from hops_calib.loop.model_files import load_model
    from hops_calib.whatif.layouts import search_layouts

    def compute(bar):
        from dataclasses import replace

        require_job_dir(job)
        found = search_layouts(job, load_model(model_path), top=top, progress=bar)
        return replace(found, notes=(*found.notes, PARALLEL_NOTE))

    return run_and_print("plan", as_json, compute, format_layout_plan)
