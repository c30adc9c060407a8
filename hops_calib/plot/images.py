"""What the `plot timeline|parity|ledger` verbs draw: each loads what it pictures, refuses what rule 2 protects
(no per-run picture of a held-out run) and returns the figure with the file it goes to; `write_image` writes it
atomically and says its size. Printing is the command layer's (`hops_calib.cli.plot`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError, given_together
from hops_calib.loop.score import SuiteScore
from hops_calib.model import Model
from hops_calib.plot import style
from hops_calib.plot.groups import RunPoint, run_points
from hops_calib.progress import QUIET, Progress


@dataclass(frozen=True)
class Image:
    """A figure to write to `target`, and lines to say before it is written (what was not drawn, and why). No
    figure and no target: only the Chrome trace was asked for (`plot timeline --chrome` without --out)."""

    figure: Any
    target: Path | None
    dpi: float
    notes: tuple[str, ...] = ()
    # the same timelines as Chrome trace JSON (Perfetto, chrome://tracing): the file, and the trace to write there
    chrome: tuple[Path, dict] | None = None


def write_image(image: Image) -> str:
    """Write the figure atomically; its format and size as the line saying where it went shows them
    ('PNG, 1200x800 px')."""
    figure, out, dpi = image.figure, image.target, image.dpi
    assert out is not None, "an image without a target has nothing to write"
    fmt = style.image_format(out)
    width, height = style.pixel_size(figure, dpi)
    style.save_figure(figure, out, dpi)
    if fmt == "png":  # the file's own size (the figure's rounds differently by a pixel)
        import struct

        with open(out, "rb") as image_file:
            header = image_file.read(24)
        width, height = struct.unpack(">II", header[16:24])
    return f"{fmt.upper()}, " + (
        f"{width}x{height} px" if fmt == "png" else f"{width / dpi * 72:.0f}x{height / dpi * 72:.0f} pt"
    )


def shown_path(path: Path) -> str:
    """A path as a picture's title shows it: relative to the current directory when below it, else the last two
    parts (an absolute path overflows the title and says where one machine keeps it)."""
    import os

    path = Path(path)
    try:
        return (
            os.path.relpath(path.resolve(), Path.cwd())
            if Path.cwd() in path.resolve().parents
            else str(Path(*path.resolve().parts[-2:]))
        )
    except ValueError:
        return path.name


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _target(out: Path | None, default: str, dpi: float) -> Path:
    """The image to write (`default` in the current directory when --out is not given, named in full so the line
    saying where it went does); checked before any work is done."""
    target = out if out is not None else Path.cwd() / default
    style.image_format(target)
    _check_dpi(dpi)
    return target


def _check_dpi(dpi: float) -> None:
    if not 20 <= dpi <= 600:
        raise InputError("plot", f"--dpi {dpi} is outside 20..600", field="--dpi", hint="150 suits a screen")


def metrics_note(metrics) -> str:
    """The headline numbers of a whole run, real or predicted, for a panel title."""
    return (
        f"iteration {metrics.iteration_time_ms:,.0f} ms · idle share (bubble) {100 * metrics.bubble_ratio:.0f} % · "
        f"{metrics.throughput_per_s:.1f} microbatches/s (whole run)"
    )


def model_label(model: Model) -> str:
    return f"model {model.name} ({model.sha256[:8]})"


# --- timeline ------------------------------------------------------------------------------------


def timeline_image(
    fixture_id: str | None,
    fixtures: Path,
    model_path: Path | None,
    iterations: int | None,
    out: Path | None,
    dpi: float,
    job: Path | None = None,
    schedules: tuple[str, ...] = (),
    cluster: Any = None,
    perturbations: Any = None,
    chrome: Path | None = None,
    chrome_iterations: int | None = -1,
) -> Image:
    """A fixture's real timeline above the model's prediction, or a job's predicted timeline under each schedule
    (hops priced by the hosts at their ends, with `cluster`; under `perturbations`, each schedule's first perturbed
    draw below it). With `chrome`, the same panels as Chrome trace JSON too: their first `chrome_iterations`
    iterations (-1: `plot.chrome.CHROME_ITERATIONS`; None: whole runs), and the picture only where `out` asks for
    it (with `chrome` and no `out`, nothing is drawn: the Chrome trace is what was asked)."""
    from hops_calib.loop.model_files import load_model
    from hops_calib.loop.suite import TEST, open_store
    from hops_calib.model.predict import predict
    from hops_calib.plot.timeline import Panel, figure_size, shown_window

    if (fixture_id is None) == (job is None):
        raise InputError(
            "plot timeline",
            f"{given_together({f'ID {fixture_id}': fixture_id is not None, f'--job {job}': job is not None})}"
            "give a fixture ID (real above predicted) or --job DIR (a configuration "
            "that has not run: one predicted panel per --schedule)",
            field="ID",
        )
    if schedules and job is None:
        raise InputError(
            "plot timeline", "--schedule applies to --job (a fixture is drawn as it ran)", field="--schedule"
        )
    if iterations is not None and iterations < 1:
        raise InputError(
            "plot timeline", f"--iterations is {iterations}", field="--iterations", hint="show at least one iteration"
        )
    if chrome_iterations is not None and chrome_iterations != -1 and chrome_iterations < 1:
        raise InputError(
            "plot timeline",
            f"--chrome-iterations is {chrome_iterations}",
            field="--chrome-iterations",
            hint="export at least one iteration, or --chrome-all for whole runs",
        )
    if chrome is not None and Path(chrome).suffix.lower() != ".json":
        raise InputError(
            str(chrome),
            "is not a .json file",
            field="--chrome",
            hint="Chrome trace JSON: open it in ui.perfetto.dev or chrome://tracing",
        )
    if perturbations is not None and job is None:
        raise InputError(
            "plot timeline",
            "stragglers and failures apply to --job (a fixture is drawn as it ran)",
            field="--slow-device",
        )
    if job is not None:
        from hops_calib.spec import TRACE_FIRST_ITERATION
        from hops_calib.whatif.job import what_if

        target = _timeline_target(out, chrome, f"timeline-{Path(job).name}.png", dpi)
        result = what_if(job, load_model(model_path), schedules, cluster=cluster)
        spec = result.spec
        panels = []
        for prediction in result.predictions:
            # numbered as a trace of the launch would be: the tracing fork starts at iteration TRACE_FIRST_ITERATION
            panels.append(
                Panel(
                    f"Predicted under {prediction.schedule} by {model_label(result.model)}",
                    prediction.result.timeline,
                    metrics_note(prediction.metrics),
                    first_iteration_label=TRACE_FIRST_ITERATION,
                )
            )
            if perturbations is not None:
                drawn = perturbations.results(prediction.pipeline, prediction.schedule, spec.device_ids)[0]
                draws = perturbations.samples if perturbations.stragglers is not None else 1
                panels.append(
                    Panel(
                        f"{prediction.schedule} slowed (draw 1 of {draws}, seed {perturbations.seed})",
                        drawn.timeline,
                        metrics_note(drawn.metrics()),
                        first_iteration_label=TRACE_FIRST_ITERATION,
                    )
                )
        shown = shown_window([panel.timeline for panel in panels], iterations, figure_size(spec.pp)[0], dpi)
        title = (
            f"{spec.run_id} (what-if): {spec.pp} stages, {spec.microbatches} microbatches per iteration, "
            f"{shown.describe(spec.iterations, spec.microbatches)}"
        )
        notes = _window_notes(shown, iterations)
        notes += tuple(f"not drawn: {refused.sentence()}" for refused in result.refused)
        if perturbations is not None:
            notes += (
                f"slowed panels: {perturbations.describe()} (failures cost whole iterations and recoveries, "
                "which a timeline of the traced window does not show; predict --job gives their throughput)",
            )
        return Image(
            _timeline_figure(target, title, spec.devices, panels, shown, dpi),
            target,
            dpi,
            notes,
            _chrome(chrome, title, spec.devices, panels, chrome_iterations),
        )
    target = _timeline_target(out, chrome, f"timeline-{fixture_id}.png", dpi)
    fixture = open_store(fixtures).load(fixture_id)
    if fixture.split == TEST:
        raise InputError(
            f"{fixtures}/{fixture_id}",
            "is in the test split, which is seen only in aggregate",
            field="split",
            hint="plot a train run; `hops-calib report --split test` prints the held-out aggregates",
        )
    model = load_model(model_path)
    prediction = predict(fixture.spec, model)
    real = fixture.timeline()
    first_real = int(real["iteration"].min())
    spec = fixture.spec
    panels = [
        Panel("Real run (trace)", real, metrics_note(fixture.truth.metrics), kernels=fixture.truth.kernels),
        Panel(
            f"Predicted by {model_label(model)}",
            prediction.result.timeline,
            metrics_note(prediction.metrics),
            first_iteration_label=first_real,
        ),
    ]
    shown = shown_window([panel.timeline for panel in panels], iterations, figure_size(spec.pp)[0], dpi)
    traced = len(fixture.truth.iterations) or spec.iterations
    title = (
        f"{fixture.id}: {prediction.schedule}, {spec.pp} stages, {spec.microbatches} microbatches per "
        f"iteration ({shown.describe(traced, spec.microbatches)})"
    )
    return Image(
        _timeline_figure(target, title, spec.devices, panels, shown, dpi),
        target,
        dpi,
        _window_notes(shown, iterations),
        chrome=_chrome(chrome, title, spec.devices, panels, chrome_iterations),
    )


def _timeline_target(out: Path | None, chrome: Path | None, default: str, dpi: float) -> Path | None:
    """The timeline picture to write: --out, else `default` in the current directory, except where --chrome alone
    was given (then no picture)."""
    if chrome is not None and out is None:
        _check_dpi(dpi)
        return None
    return _target(out, default, dpi)


def _timeline_figure(target: Path | None, title: str, devices: Any, panels: list, shown: Any, dpi: float) -> Any:
    from hops_calib.plot.timeline import timeline_figure

    return None if target is None else timeline_figure(title, devices, panels, shown, dpi=dpi)


def _window_notes(shown: Any, asked: int | None) -> tuple[str, ...]:
    """What the default window left out, and how to draw more: said when it drew less than the default."""
    from hops_calib.plot.timeline import DEFAULT_ITERATIONS, MIN_TASK_PX

    if asked is not None or (shown.span_ms is None and shown.iterations == DEFAULT_ITERATIONS):
        return ()
    window = (
        f"the first {shown.span_ms:,.0f} ms of one iteration"
        if shown.span_ms is not None
        else f"{shown.iterations} iteration(s)"
    )
    return (
        f"drawn: {window}, so that a forward is at least {MIN_TASK_PX:.0f} px wide; --iterations K draws K "
        "whole iterations (dense), --chrome FILE writes a Chrome trace to zoom into",
    )


def _chrome(path: Path | None, title: str, devices, panels, iterations: int | None = -1) -> tuple[Path, dict] | None:
    """The panels as a Chrome trace for `path` (their first `iterations`, -1: the export's default; None: whole
    runs), or None without one."""
    if path is None:
        return None
    from hops_calib.plot.chrome import CHROME_ITERATIONS, chrome_trace

    return Path(path), chrome_trace(title, devices, panels, CHROME_ITERATIONS if iterations == -1 else iterations)


# --- parity --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScoredSplit:
    """Every run of a split predicted by one model and scored: what parity plots and reports draw from."""

    split: str
    model: Model
    fixture_set_sha256: str
    points: list[RunPoint]
    suite: SuiteScore


def score_split(fixtures: Path, split: str, model_path: Path | None, progress: Progress = QUIET) -> ScoredSplit:
    """Predict and score every run of `split`. Callers guard the test split: this function does not."""
    from hops_calib.loop.model_files import default_model, load_model
    from hops_calib.loop.suite import load_suite, score_model

    model = load_model(model_path)
    suite = load_suite(fixtures, split)
    progress.start(len(suite.ids))
    scored = score_model(suite, model, origin=str(model_path or default_model()), progress=progress)
    return ScoredSplit(
        split=split,
        model=model,
        fixture_set_sha256=suite.sha256,
        points=run_points(suite.specs, scored.runs),
        suite=scored.suite,
    )


def parity_title(scored: ScoredSplit) -> str:
    return (
        f"Predicted vs real, {scored.split} split ({_count(scored.suite.n_fixtures, 'run')}), "
        f"{model_label(scored.model)}"
    )


def parity_image(
    split: str, fixtures: Path, model_path: Path | None, out: Path | None, label_worst: int, dpi: float
) -> Image:
    """Predicted against real throughput of every run of a (train) split, the worst `label_worst` labelled."""
    from hops_calib.loop.suite import refuse_test_split
    from hops_calib.plot.parity import parity_figure
    from hops_calib.progress import progress_bar

    refuse_test_split(split, "plot parity")
    target = _target(out, f"parity-{split}.png", dpi)
    if label_worst < 0:
        raise InputError(
            "plot parity", f"--label-worst is {label_worst}", field="--label-worst", hint="0 labels no run"
        )
    with progress_bar("predict") as progress:
        scored = score_split(fixtures, split, model_path, progress)
    return Image(parity_figure(scored.points, scored.suite, parity_title(scored), label_worst, dpi=dpi), target, dpi)


# --- ledger --------------------------------------------------------------------------------------


def ledger_image(ledger: Path | None, out: Path | None, dpi: float, candidates: str | None = None) -> Image:
    """The ledger's history: every candidate judged (those whose id matches `candidates`), the model line and the
    held-out reports."""
    from hops_calib.loop.ledger import read_entries, resolve, warn_if_broken
    from hops_calib.plot.ledger import ledger_figure, read_history

    ledger = resolve(ledger)
    target = _target(out, "ledger-history.png", dpi)
    if not ledger.exists():
        raise InputError(
            ledger, "no ledger here", hint=f"`hops-calib evaluate CANDIDATE --ledger {ledger}` records the first entry"
        )
    warn_if_broken(ledger)
    attempts, audits = read_history(list(read_entries(ledger)))
    if candidates is not None:
        import re

        try:
            pattern = re.compile(candidates)
        except re.error as error:
            raise InputError("--candidates", f"not a regular expression: {error}") from None
        # Committed comparisons stay whatever the filter: they set the model the line follows.
        attempts = [a for a in attempts if a.comparison or pattern.search(a.candidate_id)]
        if not any(not a.comparison for a in attempts):
            raise InputError(
                ledger,
                f"no candidate id matches --candidates {candidates!r}",
                field="--candidates",
                hint="`hops-calib ledger show` lists the candidate ids; the expression is searched "
                "in each id (re.search)",
            )
    if not attempts and not audits:
        raise InputError(
            ledger,
            "has no candidate evaluations or held-out reports to plot",
            hint="`hops-calib evaluate CANDIDATE` or `hops-calib report --split test` adds one",
        )
    evaluated = [a for a in attempts if not a.comparison]
    accepted = sum(a.accepted for a in evaluated)
    moves = len(attempts) - len(evaluated)
    title = (
        f"Ledger history — {shown_path(ledger)}\n{_count(len(evaluated), 'candidate')} ({accepted} "
        f"accepted, {len(evaluated) - accepted} rejected)"
        + (f", {_count(moves, 'committed comparison')}" if moves else "")
        + f", {_count(len(audits), 'held-out report')}"
    )
    return Image(ledger_figure(attempts, audits, title, dpi=dpi), target, dpi)
