"""Plot room: the self-contained HTML report (`hops-calib report --html FILE`).

One file, no network: styles inline and figures as base64 PNG, so it can be
mailed, attached to a review, or opened years later. It holds the suite
aggregates, a breakdown by device mix and by pipeline depth, and the ledger's
history when there is one. For the train split it adds the parity plot and one
row per run. The held-out (test) report keeps rule 2: aggregates only. Its
group breakdown shows only groups that no single run's error can be read off
(`groups.disclosable`), and it draws no point per run.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.loop.score import SuiteScore
from hops_calib.plot import style
from hops_calib.plot.groups import MIN_DISCLOSED_RUNS, GroupRow, RunPoint, disclosable, group_rows
from hops_calib.plot.parity import BAND

REPORT_DPI = 110
TEST = "test"

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto; max-width: 1250px;
       padding: 0 1em; color: #1a1a1a; line-height: 1.45; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.25em; margin-top: 1.8em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
.meta { color: #555; font-size: 0.9em; }
.meta code { font-size: 0.95em; }
.note { background: #f4f7fb; border-left: 4px solid #0072B2; padding: 0.6em 1em; margin: 1em 0; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.9em; }
th, td { padding: 0.3em 0.7em; border-bottom: 1px solid #e6e6e6; text-align: right; white-space: nowrap; }
th { background: #f2f2f2; position: sticky; top: 0; }
td.text, th.text { text-align: left; }
td.off { color: #B35900; font-weight: 600; }
.headline td { font-size: 1.1em; }
.scroll { overflow-x: auto; max-width: 100%; }
img { max-width: 100%; height: auto; border: 1px solid #eee; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _f(value: float | None, digits: int = 1, signed: bool = False) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def png_data_uri(figure: Any, dpi: float = REPORT_DPI) -> str:
    data = style.figure_bytes(figure, "png", dpi)
    style.close(figure)
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _image(uri: str, alt: str) -> str:
    return f'<img src="{uri}" alt="{_e(alt)}">'


def _off(text: str, outside_band: bool) -> str | tuple[str, str]:
    """A cell highlighted when its value lies outside the ±10 % band."""
    return (text, "off") if outside_band else text


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[str | tuple[str, str]]], text_columns: int = 1, css: str = ""
) -> str:
    """Cells are escaped strings, or (escaped string, CSS class); the first `text_columns` are left-aligned."""
    head = "".join(
        f'<th class="text">{_e(h)}</th>' if i < text_columns else f"<th>{_e(h)}</th>" for i, h in enumerate(headers)
    )
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            text, cls = cell if isinstance(cell, tuple) else (cell, "text" if i < text_columns else "")
            cells.append(f'<td class="{cls}">{text}</td>' if cls else f"<td>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (
        f'<div class="scroll"><table class="{css}"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def aggregates_table(suite: SuiteScore) -> str:
    return _table(
        [
            "runs",
            "throughput MAPE %",
            "median APE %",
            "steady throughput MAPE %",
            "bubble MAE pp",
            "mean utilization rho",
            "stall-noise floor %",
        ],
        [
            [
                str(suite.n_fixtures),
                _f(suite.throughput_mape_pct, 2),
                _f(suite.throughput_median_ape_pct, 2),
                _f(suite.steady_throughput_mape_pct, 2),
                _f(suite.bubble_mae_pp, 2),
                _f(suite.util_spearman_mean, 3),
                _f(suite.stall_noise_mape_pct, 2),
            ]
        ],
        text_columns=0,
        css="headline",
    )


def groups_table(title: str, rows: Sequence[GroupRow]) -> str:
    return _table(
        [
            title,
            "runs",
            "throughput MAPE %",
            "mean throughput error %",
            "bubble MAE pp",
            "mean bubble error pp",
            "mean rho",
        ],
        [
            [
                _e(r.label),
                str(r.suite.n_fixtures),
                _f(r.suite.throughput_mape_pct),
                _f(r.mean_throughput_error_pct, signed=True),
                _f(r.suite.bubble_mae_pp),
                _f(r.mean_bubble_error_pp, signed=True),
                _f(r.suite.util_spearman_mean, 2),
            ]
            for r in rows
        ],
    )


def runs_table(points: Sequence[RunPoint]) -> str:
    ordered = sorted(points, key=lambda p: -abs(p.score.throughput_error_pct))
    rows = []
    for p in ordered:
        s = p.score
        rows.append(
            [
                _e(p.run_id),
                _e(p.device_mix),
                str(p.pp),
                str(p.microbatches),
                _f(s.real_throughput_per_s, 2),
                _f(s.predicted_throughput_per_s, 2),
                _off(_f(s.throughput_error_pct, signed=True), abs(s.throughput_error_pct) > 100 * BAND),
                _f(s.stall_noise_ape_pct, 1),
                _f(100 * s.real_bubble_ratio if s.real_bubble_ratio is not None else None),
                _f(100 * s.predicted_bubble_ratio if s.real_bubble_ratio is not None else None),
                # Relative, as on the parity plot: 10 % of a real bubble ratio r is 10 * r pp.
                _off(
                    _f(s.bubble_error_pp, signed=True),
                    s.bubble_error_pp is not None
                    and s.real_bubble_ratio is not None
                    and abs(s.bubble_error_pp) > 100 * BAND * s.real_bubble_ratio,
                ),
                _f(s.util_spearman_rho, 2),
            ]
        )
    return _table(
        [
            "run",
            "device mix",
            "stages",
            "microbatches",
            "real tput /s",
            "predicted tput /s",
            "tput error %",
            "random stalls ± %",
            "real bubble %",
            "predicted bubble %",
            "bubble error pp",
            "rho",
        ],
        rows,
        text_columns=2,
    )


def _breakdowns(points: Sequence[RunPoint], held_out: bool) -> str:
    parts = []
    for title, key, label in (
        ("device mix", lambda p: p.device_mix, str),
        ("pipeline depth", lambda p: p.pp, lambda pp: f"{pp} stages"),
    ):
        if held_out:
            rows = disclosable(points, key, label)
            if rows is None:
                parts.append(
                    f'<p class="note">No breakdown by {title}: the groups outside the shown ones would '
                    f"hold fewer than {MIN_DISCLOSED_RUNS} runs, and their errors could be recovered "
                    "from the suite aggregates.</p>"
                )
                continue
        else:
            rows = group_rows(points, key, label)
        parts.append(f"<h3>By {title}</h3>" + groups_table(title, rows))
    return "".join(parts)


def render(
    *,
    split: str,
    suite: SuiteScore,
    points: Sequence[RunPoint],
    model_label: str,
    meta: dict[str, str],
    parity_uri: str | None,
    ledger_uri: str | None,
) -> str:
    """The page. `points` are used only as groups (and, outside the test split, as rows)."""
    held_out = split == TEST
    title = f"hops-calib report: {split} split"
    meta_lines = "".join(f"<div>{_e(name)}: <code>{_e(value)}</code></div>" for name, value in meta.items())
    sections = [f"<h1>{_e(title)}</h1>", f'<div class="meta">{meta_lines}</div>']
    if held_out:
        sections.append(
            '<p class="note">Held-out report: suite aggregates only (rule 2). No per-run rows or '
            f"points; a group is shown only with at least {MIN_DISCLOSED_RUNS} runs. Writing this page "
            "appended an audit entry to the ledger.</p>"
        )
    sections.append(f"<h2>Suite aggregates ({_e(model_label)})</h2>" + aggregates_table(suite))
    sections.append("<h2>Breakdown</h2>" + _breakdowns(points, held_out))
    if parity_uri and not held_out:
        sections.append("<h2>Predicted vs real</h2>" + _image(parity_uri, f"parity plot of the {split} split"))
    if ledger_uri:
        sections.append("<h2>Ledger history</h2>" + _image(ledger_uri, "ledger history"))
    if not held_out:
        sections.append(
            "<h2>Runs</h2><p>Sorted by |throughput error|; highlighted: outside ±10 % of the real "
            "value.</p>" + runs_table(points)
        )
    body = "\n".join(sections)
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">\n<title>{_e(title)}</title>\n'
        f"<style>{CSS}</style>\n</head>\n<body>\n{body}\n</body>\n</html>\n"
    )


def check_html_path(out: Path) -> None:
    if Path(out).suffix.lower() not in (".html", ".htm"):
        raise InputError(out, "is not an .html file", field="--html", hint="name the report *.html")


def write_report(out: Path, result: Any, fixtures: Path, model_path: Path | None) -> Path:
    """Write the HTML page for `result` (an `evaluate.Report`; a held-out one's audit entry is already in the ledger)."""
    from hops_calib.files import atomic_write
    from hops_calib.loop.ledger import read_entries
    from hops_calib.plot.images import model_label, parity_title, score_split
    from hops_calib.plot.ledger import entries_on, ledger_figure, read_history
    from hops_calib.plot.parity import parity_figure

    check_html_path(out)
    scored = score_split(fixtures, result.split, model_path)
    entry = result.ledger_entry
    # The page must describe exactly what the audit entry recorded.
    if (scored.model.sha256, scored.fixture_set_sha256) != (entry["model_sha256"], entry["fixture_set_sha256"]):
        raise InputError(
            fixtures,
            "the model file or the fixture store changed while the report was written",
            hint="run the report again",
        )
    parity_uri = None
    if result.split != TEST:
        parity_uri = png_data_uri(parity_figure(scored.points, scored.suite, parity_title(scored), dpi=REPORT_DPI))
    # The history of the campaign on these runs: the project's ledger (a train report records nothing, so it names
    # none), its entries that scored as many runs as this store holds in each split (another store's candidates,
    # e.g. the CPU captures', would draw a false jump on the same line).
    history_path = result.ledger_path
    if history_path is None:
        from hops_calib.loop.ledger import resolve

        try:
            history_path = resolve(None)
        except InputError:
            history_path = None
    ledger_uri = None
    if history_path is not None and Path(history_path).exists():
        from hops_calib.loop.suite import open_store

        store = open_store(fixtures)
        sizes = {"train": len(store.ids("train")), "test": len(store.ids("test"))}
        attempts, audits = read_history(entries_on(list(read_entries(history_path)), sizes))
        if attempts:
            from hops_calib.plot.images import shown_path

            ledger_uri = png_data_uri(
                ledger_figure(
                    attempts,
                    audits,
                    f"Ledger history on {sizes['train']} train / {sizes['test']} test runs — "
                    f"{shown_path(Path(history_path))}",
                    dpi=REPORT_DPI,
                )
            )
    meta = {
        "written": entry["time"],
        "model": f"{entry['model_path']} (sha256 {entry['model_sha256'][:12]})",
        "fixtures": f"{fixtures} ({result.suite.n_fixtures} {result.split} runs, set sha256 "
        f"{entry['fixture_set_sha256'][:12]})",
        "code revision": entry.get("code_revision", "unknown"),
        "ledger": (
            f"{result.ledger_path}, audit entry {entry['seq']} (sha256 {entry['entry_sha256'][:12]})"
            if result.audited
            else f"not recorded: the {result.split} split is not held out"
        ),
    }
    train = getattr(result, "train", None)
    if train is not None:
        meta["the same model on train"] = (
            f"throughput MAPE {train.throughput_mape_pct:.2f} % (stall-noise floor "
            f"{train.stall_noise_mape_pct:.2f} %); {result.split} minus train "
            f"{result.gap_to_train_pp:+.2f} pp"
        )
    if getattr(result, "intervals", None) is not None:
        meta["spread over configurations"] = result.interval_sentence()
    outside = getattr(result, "outside_train", None)
    if outside is not None:
        from hops_calib.model.coverage import outside_sentence

        meta["outside the train runs"] = outside_sentence(outside)
    page = render(
        split=result.split,
        suite=result.suite,
        points=scored.points,
        model_label=model_label(scored.model),
        meta=meta,
        parity_uri=parity_uri,
        ledger_uri=ledger_uri,
    )
    atomic_write(out, page)
    return Path(out)
