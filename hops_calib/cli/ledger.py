"""The `ledger` verbs over the append-only, hash-chained experiment ledger (`hops_calib.loop.ledger`): show, plan,
looks, verify, hold-out, export, repair."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from hops_calib.cli.evaluate import tolerance_limits
from hops_calib.cli.options import FIXTURES_OPTION, LEDGER_OPTION, with_tolerances
from hops_calib.cli.output import EXIT_BROKEN_LEDGER, EXIT_OK, guarded, print_json
from hops_calib.cli.scores import resolve_ledger

app = typer.Typer(help="The append-only, hash-chained experiment ledger.", no_args_is_help=True)


@app.command("show")
def ledger_show(
    ledger: Path = LEDGER_OPTION,
    last: int | None = typer.Option(None, "--last", min=1, help="Only the last N entries (N >= 1)."),
    as_json: bool = typer.Option(False, "--json", help="Print the entries as JSON."),
) -> None:
    """One line per entry: time, decision, candidate and change, MAPE before -> after."""
    raise typer.Exit(ledger_show_command(ledger, last, as_json))


@app.command("plan")
@with_tolerances
def ledger_plan(
    note: str = typer.Option(..., "--note", help="What will be tried, and why these tolerances."),
    candidate: list[Path] | None = typer.Option(
        None,
        "--candidate",
        help="A candidate file the plan is for (repeatable): pinned by its text's sha256, so "
        "evaluate --plan N refuses any other candidate, an edited one included.",
    ),
    rejudge: int | None = typer.Option(
        None,
        "--rejudge",
        help="The ledger entry (seq) of an earlier judgement of the same change, judged again under "
        "this plan's rules; required to judge a change the ledger already judged on that "
        "model and store.",
    ),
    fixtures: list[Path] | None = typer.Option(
        None,
        "--fixtures",
        help="The store(s) its judgements will be made on (repeatable): their train runs' fixture "
        "set is recorded, evaluate/compare --plan N refuse others, and a candidate judged "
        "before only on other runs needs no --rejudge.",
    ),
    ledger: Path = LEDGER_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print the entry as JSON."),
    tolerances: dict | None = None,  # the tolerance options, added by with_tolerances
) -> None:
    """Record, before any of its evaluations, what will be tried and the tolerances it will be judged under (the only
    way to judge under tolerances other than the defaults)."""
    raise typer.Exit(
        ledger_plan_command(
            ledger, note, tolerances or {}, as_json, tuple(candidate or ()), rejudge, tuple(fixtures or ())
        )
    )


@app.command("looks")
def ledger_looks(
    ledger: Path = LEDGER_OPTION,
    split: str = typer.Option("test", "--split", help="The held-out split whose reports are listed."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Every look at the held-out split: its model, result, the work since the look before, repeats."""
    raise typer.Exit(ledger_looks_command(ledger, split, as_json))


@app.command("verify")
def ledger_verify(
    ledger: Path = LEDGER_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Check every line and the hash chain; name each damaged, edited or truncated line. Exit 1 on any problem."""
    raise typer.Exit(ledger_verify_command(ledger, as_json))


@app.command("hold-out")
def ledger_hold_out(
    fixtures: Path = FIXTURES_OPTION,
    ledger: Path = LEDGER_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Record a store's test groups (names and events digests) in the ledger without looking at them, so every verb
    refuses them in a train split from then on (a report or a judgement records them too)."""
    raise typer.Exit(ledger_hold_out_command(fixtures, ledger, as_json))


@app.command("export")
def ledger_export(
    out: Path = typer.Argument(..., help="Parquet file to write."),
    ledger: Path = LEDGER_OPTION,
) -> None:
    """Write the ledger as a Parquet table, one row per entry."""
    raise typer.Exit(ledger_export_command(ledger, out))


@app.command("repair")
def ledger_repair(
    ledger: Path = LEDGER_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Set aside an incomplete last line left by an interrupted append (complete entries are never touched)."""
    raise typer.Exit(ledger_repair_command(ledger, as_json))


def ledger_show_command(ledger_path: Path | None, last: int | None, as_json: bool) -> int:
    def run() -> int:
        from hops_calib.loop.score import or_nan

        nonlocal ledger_path
        ledger_path = resolve_ledger(ledger_path)
        from hops_calib.loop.ledger import read_entries, warn_if_broken

        warn_if_broken(ledger_path)
        entries = list(read_entries(ledger_path))
        if last is not None:
            entries = entries[-last:] if last > 0 else []
        from hops_calib.loop.gate import describe_looser, looser_rules
        from hops_calib.loop.heldout import HELD_OUT_KEY, OVERRIDE_KEY, OVERRIDE_KIND, RECORD_KIND
        from hops_calib.loop.plans import judgement_notes

        notes = judgement_notes(list(read_entries(ledger_path)))
        if as_json:
            print_json(
                {
                    "ledger": str(ledger_path),
                    "entries": entries,
                    "judgements": {
                        str(seq): note for seq, note in notes.items() if seq in {e.get("seq") for e in entries}
                    },
                    # plans stating rules looser than the defaults, each with its default and cap
                    "looser_plans": {
                        str(e["seq"]): looser_rules(e["tolerances"])
                        for e in entries
                        if e.get("kind") == "plan"
                        and isinstance(e.get("tolerances"), dict)
                        and looser_rules(e["tolerances"])
                    },
                }
            )
            return EXIT_OK
        if not entries:
            print(f"{ledger_path}: no entries")
        for e in entries:
            aggregates_before, aggregates_after = e.get("aggregates_before") or {}, e.get("aggregates_after") or {}
            if e.get("kind") == "plan":
                what = f"plan: {e.get('note', '')}" + "".join(f" [pins {c.get('id')}]" for c in e.get("candidates", []))
                what += (
                    f" [{describe_looser(looser_rules(e['tolerances']))}]"
                    if isinstance(e.get("tolerances"), dict) and looser_rules(e["tolerances"])
                    else ""
                )
                what += f" [rejudges entry {e['rejudges']}]" if e.get("rejudges") is not None else ""
            elif e.get("kind") == "report":
                aggregates = e.get("aggregates", {})
                what = (
                    f"report {e.get('split')}: MAPE {aggregates.get('throughput_mape_pct', float('nan')):.2f} %, "
                    f"bubble MAE {or_nan(aggregates.get('bubble_mae_pp')):.2f} pp"
                )
            elif e.get("kind") == "compare":
                what = (
                    f"compare {e.get('before_model_path')} -> {e.get('model_path')}: MAPE "
                    f"{aggregates_before.get('throughput_mape_pct', float('nan')):.2f} -> "
                    f"{aggregates_after.get('throughput_mape_pct', float('nan')):.2f} %"
                    + (f" ({e['note']})" if e.get("note") else "")
                    + (
                        (", kept" if e.get("decision") == "accepted" else ", undone") + f" in {e['committed_into']}"
                        if e.get("committed")
                        else ""
                    )
                )
            elif e.get("kind") == OVERRIDE_KIND:
                groups = [leak.get("group") for leak in e.get(OVERRIDE_KEY) or []]
                what = (
                    f"{e.get('verb')} on {e.get('fixtures')} went on over held-out group(s) "
                    f"{', '.join(map(str, groups))} (--allow-held-out)"
                )
            elif e.get("kind") == RECORD_KIND:
                what = (
                    f"held out the {len(e.get(HELD_OUT_KEY) or {})} test group(s) of {e.get('fixtures')} "
                    "(ledger hold-out; nothing scored)"
                )
            else:
                candidate = e.get("candidate") or {}
                what = (
                    f"{candidate.get('id')} ({candidate.get('change')}): MAPE "
                    f"{aggregates_before.get('throughput_mape_pct', float('nan')):.2f} -> "
                    f"{aggregates_after.get('throughput_mape_pct', float('nan')):.2f} %"
                    + (", committed" if e.get("committed") else "")
                )
            seq = e.get("seq")
            note = notes.get(seq) if isinstance(seq, int) else None
            if note is not None:
                what += _judgement_note(note)
            if e.get("kind") != OVERRIDE_KIND and e.get(OVERRIDE_KEY):
                what += " [over held-out groups: --allow-held-out]"
            print(f"{e.get('seq'):>4} {e.get('time', '')[:19]} {e.get('decision', e.get('kind', '')):9} {what}")
        return EXIT_OK

    return guarded(run, as_json)


def _judgement_note(note: dict[str, Any]) -> str:
    """`ledger show`'s words on a judgement's rules, earlier judgements of its change and the model file written."""
    from hops_calib.loop.gate import Tolerances, describe_looser

    text = (
        " (default rules)"
        if note["rules"] == "defaults"
        else f" (under {note['rules']})"
        if note["rules"].startswith("plan ")
        else f" ({note['rules']})"
    )
    if note["tolerances"]:
        text += f" [tolerances: {Tolerances(**note['tolerances']).describe()}]"
    if note.get("looser_rules"):
        text += f" [{describe_looser(note['looser_rules'])}]"
    if note["rejudges"] is not None:
        text += f"; judges again the change of entry {note['rejudges']}"
    elif note["earlier_judgements"]:
        text += "; the same change was judged in entry " + ", ".join(map(str, note["earlier_judgements"]))
    if note["model_written"]:
        text += f"; wrote {note['model_written']}"
        if note["model_outside_checkout"]:
            text += " (WARNING: not a checkout's model file)"
    return text


def ledger_plan_command(
    ledger_path: Path | None,
    note: str,
    tolerances: dict[str, float | str | None],
    as_json: bool,
    candidates: tuple[Path, ...] = (),
    rejudges: int | None = None,
    fixtures: tuple[Path, ...] = (),
) -> int:
    def run() -> int:
        nonlocal ledger_path
        ledger_path = resolve_ledger(ledger_path)
        from hops_calib.loop.plans import record_plan

        limits = tolerance_limits(tolerances, "ledger plan")
        entry = record_plan(ledger_path, note, limits, candidates, rejudges, fixtures)
        from hops_calib.loop.gate import describe_looser, looser_rules

        if as_json:
            print_json({**entry, "looser_rules": looser_rules(limits)})
        else:
            print(f"plan entry {entry['seq']} appended to {ledger_path}: {note}")
            print(f"tolerances stated: {limits.describe()}")
            if looser_rules(limits):
                print(describe_looser(looser_rules(limits)) + ": every judgement under this plan is marked so")
            if entry.get("rejudges") is not None:
                print(f"judges again the change of ledger entry {entry['rejudges']} (the new entry links to it)")
            if entry.get("fixtures"):
                print(f"stores: {', '.join(entry['fixtures'])} (fixture set {entry['fixture_set_sha256'][:12]})")
            for pinned in entry.get("candidates", []):
                print(f"candidate pinned: {pinned['id']} ({pinned['path']}, text sha256 {pinned['text_sha256'][:12]})")
            print(
                f"judge under it with: hops-calib evaluate CANDIDATE --plan {entry['seq']} | "
                f"hops-calib compare BEFORE --model AFTER --plan {entry['seq']}"
            )
        return EXIT_OK

    return guarded(run, as_json)


def ledger_looks_command(ledger_path: Path | None, split: str, as_json: bool) -> int:
    def run() -> int:
        from hops_calib.loop.score import or_nan

        nonlocal ledger_path
        ledger_path = resolve_ledger(ledger_path)
        from hops_calib.cli.render.tables import text_table
        from hops_calib.loop.ledger import held_out_looks, read_entries, warn_if_broken

        warn_if_broken(ledger_path)
        looks = held_out_looks(read_entries(ledger_path), split)
        models = {look.model_sha256 for look in looks}
        repeats = sum(look.repeat_of is not None for look in looks)
        if as_json:
            print_json(
                {
                    "ledger": str(ledger_path),
                    "split": split,
                    "looks": [look.to_dict() for look in looks],
                    "distinct_models": len(models),
                    "repeated_looks": repeats,
                }
            )
            return EXIT_OK
        print(
            f"{ledger_path}: {len(looks)} look(s) at the {split} split, at {len(models)} distinct model(s); "
            f"{repeats} repeated an earlier look (the same runs, and the same model or the same predictions)"
        )
        if looks:
            rows = [
                [
                    str(look.seq),
                    look.time[:16],
                    look.model_sha256[:12],
                    f"{look.throughput_mape_pct:.2f}",
                    f"{or_nan(look.bubble_mae_pp):.2f}",
                    (f"{look.gap_to_train_pp:+.2f}" if look.gap_to_train_pp is not None else "")
                    + (
                        f" ({look.gap_interval_pp[0]:+.2f} to {look.gap_interval_pp[1]:+.2f})"
                        if look.gap_interval_pp is not None
                        else ""
                    ),
                    str(look.evaluations_since),
                    str(look.changes_since),
                    str(look.predictions_moved) if look.predictions_moved is not None else "",
                    f"of {look.repeat_of}" if look.repeat_of is not None else "",
                ]
                for look in looks
            ]
            print(
                text_table(
                    [
                        "seq",
                        "time",
                        "model",
                        "MAPE %",
                        "bubble pp",
                        "gap to train pp",
                        "evaluated since",
                        "model changes since",
                        "predictions moved",
                        "repeat",
                    ],
                    rows,
                    right={0, 3, 4, 5, 6, 7, 8},
                )
            )
        return EXIT_OK

    return guarded(run, as_json)


def ledger_verify_command(ledger_path: Path | None, as_json: bool) -> int:
    def run() -> int:
        nonlocal ledger_path
        ledger_path = resolve_ledger(ledger_path)
        from hops_calib.loop.commits import disagreeing_models, unwritten_problems
        from hops_calib.loop.ledger import verify

        result = verify(ledger_path)
        # a commit whose model write did not happen (a crash between the append and the write)
        result.problems += unwritten_problems(ledger_path)
        # a model file a commit of another ledger (a --ledger copy) wrote: the chain holds, the pair disagrees
        warnings = disagreeing_models(ledger_path) if result.ok else []
        if as_json:
            print_json({**result.to_dict(), "warnings": warnings}, "ok" if result.ok else "broken_ledger")
        elif result.ok:
            print(
                f"{ledger_path}: {result.entries} entries, chain intact; head sha256 {result.head_sha256}; "
                f"{result.committed_prefix_note}"
            )
            for warning in warnings:
                print(f"warning: {warning}", file=sys.stderr)
        else:
            for problem in result.problems:
                print(
                    f"{ledger_path}:{problem.line}: {problem.message}"
                    if problem.line is not None
                    else f"{ledger_path}: {problem.message}",
                    file=sys.stderr,
                )
            print(
                f"{ledger_path}: {len(result.problems)} problem(s) in {result.entries} entries"
                + (f"; {result.committed_prefix_note}" if result.committed_prefix_note else ""),
                file=sys.stderr,
            )
        return EXIT_OK if result.ok else EXIT_BROKEN_LEDGER

    return guarded(run, as_json)


def ledger_export_command(ledger_path: Path | None, out: Path) -> int:
    def run() -> int:
        nonlocal ledger_path
        ledger_path = resolve_ledger(ledger_path)
        from hops_calib.loop.ledger import export_parquet, warn_if_broken

        warn_if_broken(ledger_path)
        rows = export_parquet(ledger_path, out)
        print(f"wrote {rows} entries to {out}")
        return EXIT_OK

    return guarded(run)


def ledger_hold_out_command(fixtures: Path, ledger_path: Path | None, as_json: bool) -> int:
    def run() -> int:
        nonlocal ledger_path
        ledger_path = resolve_ledger(ledger_path)
        from hops_calib.loop.heldout import HELD_OUT_KEY, record_store

        entry = record_store(fixtures, ledger_path)
        if as_json:
            print_json(
                {
                    "ledger": str(ledger_path),
                    "fixtures": str(fixtures),
                    "appended": entry["seq"] if entry else None,
                    "groups": sorted(entry[HELD_OUT_KEY]) if entry else [],
                },
                "ok",
            )
        elif entry:
            print(
                f"{ledger_path}: entry {entry['seq']} holds out the {len(entry[HELD_OUT_KEY])} test group(s) of "
                f"{fixtures}; every verb refuses them in a train split from now on"
            )
        else:
            print(
                f"{ledger_path}: nothing appended: {fixtures} has no test split, or the ledger already holds out "
                "every group of it, by name and by every run's digest and fingerprint"
            )
        return EXIT_OK

    return guarded(run, as_json)


def ledger_repair_command(ledger_path: Path | None, as_json: bool = False) -> int:
    def run() -> int:
        nonlocal ledger_path
        ledger_path = resolve_ledger(ledger_path)
        from hops_calib.loop import commits
        from hops_calib.loop.ledger import repair

        aside = repair(ledger_path)
        written = commits.repair(ledger_path)
        if as_json:
            print_json(
                {
                    "ledger": str(ledger_path),
                    "set_aside": str(aside) if aside else None,
                    "repaired": bool(aside),
                    "commits": list(written),
                }
            )
            return EXIT_OK
        print(
            f"{ledger_path}: incomplete last line moved to {aside}"
            if aside
            else f"{ledger_path}: nothing to repair (last line complete)"
        )
        for line in written:
            print(line)
        return EXIT_OK

    return guarded(run, as_json)
