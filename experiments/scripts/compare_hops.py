"""Side by side with the published simulator (HOPS) on the same runs and the same metric definitions.

Train split: per-run errors of this model (`evaluate`) against HOPS's rows for the same runs. Test split: this
model's numbers come only from an audited held-out report: the ledger's latest audit entry for this model and
fixture set (quoting it again is not a new look), or, with --new-audit only, a new `report --split test`, which
appends an audit entry (a look is never taken by default); HOPS's are averaged over the same test runs.

Usage: python experiments/scripts/compare_hops.py FIXTURES [REFERENCE_CSV] [--ledger FILE] [--new-audit]
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

from hops_calib.loop.evaluate import evaluate
from hops_calib.loop.report import recorded_report, report
from hops_calib.loop.suite import open_store
from hops_calib.shared import reference_csv

VARIANTS = ("no_lookahead", "lc_xbar_xopt", "link_calibrated", "trace_replay")
HONEST = {"no_lookahead": "yes", "lc_xbar_xopt": "yes", "link_calibrated": "no (copies idle + optimizer time from the scored trace)",
          "trace_replay": "no (stage times fitted on the scored trace)"}


def hops_rows(path: Path) -> dict[str, dict[str, dict[str, float]]]:
    rows: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            rows[row["variant"]][row["fixture"]] = {
                "tput": abs(float(row["tput_err_pct"])), "bubble": abs(float(row["bubble_delta_pp"])),
                "rho": float(row["util_spearman_rho"]) if row["util_spearman_rho"] not in ("", "nan") else float("nan")}
    return rows


def mean(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fixtures")
    parser.add_argument("reference", nargs="?", default=str(reference_csv()))
    parser.add_argument("--ledger", default=None, help="default: the project's ledger (hops_calib.loop.ledger.resolve)")
    parser.add_argument("--new-audit", action="store_true",
                        help="run a new audited test report even when the ledger has one for this model")
    args = parser.parse_args()
    store = open_store(args.fixtures)
    hops = hops_rows(Path(args.reference))
    train_ids, test_ids = store.ids("train"), store.ids("test")

    ours_train = evaluate(args.fixtures).current.suite  # train split only
    from hops_calib.loop.ledger import resolve

    ledger = resolve(args.ledger)  # the project's ledger unless named, wherever the script is started
    audited = None if args.new_audit else recorded_report(args.fixtures, split="test", ledger_path=ledger)
    if audited is None and not args.new_audit:
        sys.exit(f"{ledger} has no audited test report of this model on this fixture set: pass --new-audit to "
                 "take one (an audited look at the held-out split, counted in the ledger), or point --ledger at the "
                 "ledger that has it")
    if audited is None:  # a new audited look, asked for: taken even if it repeats an earlier look's predictions
        audited = report(args.fixtures, split="test", ledger_path=ledger, again=True)
    ours_test = audited.suite  # aggregates only
    print(f"test rows of this model: ledger entry {audited.ledger_entry.get('seq', '?')} "
          f"({audited.ledger_entry.get('time', '?')}, model {audited.model_sha256[:12]})")
    print("| model | honest? | split | runs | throughput MAPE % | bubble MAE pp | mean utilization rho |")
    print("|---|---|---|---|---|---|---|")
    for split, ids, ours in (("train", train_ids, ours_train), ("test", test_ids, ours_test)):
        print(f"| hops-calib baseline.toml | yes | {split} | {len(ids)} | {ours.throughput_mape_pct:.1f} | "
              f"{ours.bubble_mae_pp:.2f} | {ours.util_spearman_mean:.2f} |")
        for variant in VARIANTS:
            rows = [hops[variant][i] for i in ids if i in hops[variant]]
            if not rows:
                continue
            print(f"| HOPS {variant} | {HONEST[variant]} | {split} | {len(rows)} | "
                  f"{mean([r['tput'] for r in rows]):.1f} | {mean([r['bubble'] for r in rows]):.2f} | "
                  f"{mean([r['rho'] for r in rows]):.2f} |")


if __name__ == "__main__":
    main()
