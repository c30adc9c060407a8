"""The `report` verb: the audited look at the held-out split (and the train split's report), as text, JSON or an
HTML page."""

from __future__ import annotations

from pathlib import Path

import typer

from hops_calib.cli.options import FIXTURES_OPTION, LEDGER_OPTION, MODEL_OPTION
from hops_calib.cli.output import EXIT_OK, guarded, held_out_guard, print_json
from hops_calib.cli.scores import print_left_out, print_suite
from hops_calib.errors import InputError


def report(
    split: str | None = typer.Option(
        None,
        "--split",
        help="test: an audited look at the held-out split (counted in the ledger); train. Required "
        "for a look, so that none is taken by default; --preview alone previews test.",
    ),
    fixtures: Path = FIXTURES_OPTION,
    model: Path | None = MODEL_OPTION,
    ledger: Path = LEDGER_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    html: Path | None = typer.Option(
        None,
        "--html",
        help="Also write a self-contained HTML page (aggregates, breakdowns; for train also the "
        "parity plot and one row per run).",
    ),
    again: bool = typer.Option(
        False,
        "--again",
        help="Look even when an earlier look's model predicted every held-out configuration as "
        "this one does (refused otherwise: its answer is in the ledger).",
    ),
    preview: bool = typer.Option(
        False,
        "--preview",
        help="Only say what a look would tell that the ledger does not: on how many held-out "
        "configurations the predictions changed since the last look, or which look it "
        "would repeat. Reads no result, appends nothing.",
    ),
    against: Path | None = typer.Option(
        None,
        "--against",
        help="With --preview: also count the held-out configurations this model predicts "
        "otherwise than the model file given (for a look made before digests were "
        "recorded: git show REV:hops_calib/model/models/baseline.toml > old.toml).",
    ),
) -> None:
    """Suite aggregates only on the held-out split, with an audit entry in the ledger for every look (train: none).

    A look that would repeat an earlier one (the same predictions on every
    held-out configuration) is refused with exit 2 before anything is scored,
    unless --again. Otherwise it says on how many configurations the
    predictions changed since the last look.
    """

    def run() -> int:
        from hops_calib.loop.report import preview_look
        from hops_calib.loop.report import report as audited_report
        from hops_calib.loop.suite import TEST, TRAIN
        from hops_calib.progress import progress_bar

        nonlocal split
        if split is None:
            if not preview:
                raise InputError(
                    "report",
                    "say which split to report",
                    field="split",
                    hint=f"--split {TEST} is an audited look at the held-out split (the ledger counts "
                    f"every one); --split {TRAIN} reports the train split; --preview says what a "
                    "held-out look would tell without taking it",
                )
            split = TEST
        if against is not None and not preview:
            raise InputError(
                "report",
                "--against compares predictions without looking; it goes with --preview",
                field="against",
                hint="hops-calib report --preview --against OLD_MODEL.toml",
            )
        if split == TRAIN:  # per-run errors of the train split (--html): none of a held-out run
            held_out_guard(fixtures, ledger, "report --split train", False)()
        if preview:
            seen = preview_look(fixtures, split=split, model_path=model, ledger_path=ledger, against=against)
            if as_json:
                print_json(seen)
                return EXIT_OK
            if seen["against"] is not None:
                print(
                    f"the model {seen['model_sha256'][:12]} predicts {seen['against']['changed']} of {seen['of']} "
                    f"{split} configurations otherwise than {against} ({seen['against']['model_sha256'][:12]})"
                )
            if seen["repeat_of"] is not None:
                print(
                    f"a look at the {split} split now would repeat entry {seen['repeat_of']}: the model "
                    f"{seen['model_sha256'][:12]} is that look's, or predicts all {seen['of']} configurations as "
                    "it did, on runs it scored; so `report` would refuse it (read its result with `hops-calib "
                    "ledger looks`)"
                )
            elif seen["changed_since"] is not None:
                since = seen["changed_since"]
                print(
                    f"a look at the {split} split now: the model {seen['model_sha256'][:12]} predicts "
                    f"{since['changed']} of {since['of']} configurations otherwise than the look of entry "
                    f"{since['seq']} (no result read, nothing appended)"
                )
            else:
                print(
                    f"a look at the {split} split now: no earlier look recorded its predictions, so the ledger has "
                    "nothing to compare with; --against OLD_MODEL compares with a model file (no result read, "
                    "nothing appended)"
                )
            return EXIT_OK

        if html is not None:
            from hops_calib.plot.html import check_html_path

            check_html_path(html)  # before the audit entry: a bad name must not cost one
        with progress_bar("report", quiet=as_json) as progress:
            result = audited_report(
                fixtures, split=split, model_path=model, ledger_path=ledger, progress=progress, again=again
            )
        if html is not None:
            from hops_calib.plot.html import write_report

            write_report(html, result, fixtures, model)
        if as_json:
            print_json(result.to_dict())
        else:
            what = "held-out report" if result.split == TEST else "report (not held out)"
            print_suite(f"{what}, {result.split} split, model {result.model_sha256[:12]}", result.suite)
            print_left_out(result.left_out)
            if result.train is not None:
                print(
                    f"the same model on train: throughput MAPE {result.train.throughput_mape_pct:.2f} % (stall-noise "
                    f"floor {result.train.stall_noise_mape_pct:.2f} %); {result.split} minus train: "
                    f"{result.gap_to_train_pp:+.2f} pp, of which the floors differ by "
                    f"{result.suite.stall_noise_mape_pct - result.train.stall_noise_mape_pct:+.2f} pp"
                )
            if result.intervals is not None:
                print(result.interval_sentence())
            if result.outside_train is not None:
                from hops_calib.model.coverage import outside_sentence

                print(
                    f"of the {result.split} split, {outside_sentence(result.outside_train)}: there the model "
                    "extrapolates (predict --job DIR --fixtures names the features of one configuration)"
                )
            if result.changed_since is not None:
                since = result.changed_since
                print(
                    f"predictions changed since the look of entry {since['seq']} on {since['changed']} of "
                    f"{since['of']} configurations"
                )
            if "repeat_of" in result.ledger_entry:
                print(
                    f"a repeat of entry {result.ledger_entry['repeat_of']} (--again): the same model or the same "
                    "predictions, on runs it scored"
                )
            if result.audited:
                print(f"audit entry {result.ledger_entry['seq']} appended to {result.ledger_path}")
            else:
                print(f"nothing appended to the ledger: the {result.split} split is not held out")
            if html is not None:
                print(f"wrote {html}")
        return EXIT_OK

    raise typer.Exit(guarded(run, as_json))
