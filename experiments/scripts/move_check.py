"""Judge a multi-step move as a whole: the model after its last step against the model before its first, on TRAIN.

Superseded by `hops-calib compare BEFORE --model AFTER`, which applies the same gate and records the judgement in
the ledger; kept because candidates 029-035 cite it (their text is in the ledger).

A move is a run of one-term candidates that only make sense together (each recorded in the ledger with the relaxed
tolerances it needed); this applies the product's gate (hops_calib.loop.gate) to the two end models with the
refinement tolerances of experiments/CAMPAIGN.md: the suite must hold or improve, no run's |throughput error| may
grow by more than 3 pp nor its |bubble error| by more than 2 pp.

Usage: python experiments/scripts/move_check.py MODEL_BEFORE MODEL_AFTER [FIXTURES]
  e.g. git show <commit before the move>:hops_calib/model/models/baseline.toml > /tmp/before.toml
       python experiments/scripts/move_check.py /tmp/before.toml hops_calib/model/models/baseline.toml /tmp/fx
"""

import sys

from hops_calib.loop.gate import Tolerances, gate
from hops_calib.loop.model_files import load_model
from hops_calib.loop.suite import load_suite, score_model

before_path, after_path = sys.argv[1], sys.argv[2]
suite = load_suite(sys.argv[3] if len(sys.argv) > 3 else "fixtures", "train")
before = score_model(suite, load_model(before_path), origin=before_path)
after = score_model(suite, load_model(after_path), origin=after_path)
verdict = gate(before.runs, after.runs, before.suite, after.suite,
               Tolerances(run_throughput_pp=3.0, run_bubble_pp=2.0))
for label, attribute in (("throughput MAPE %", "throughput_mape_pct"), ("bubble MAE pp", "bubble_mae_pp"),
                         ("mean utilization rho", "util_spearman_mean"),
                         ("steady throughput MAPE %", "steady_throughput_mape_pct")):
    print(f"{label:26s} {getattr(before.suite, attribute):8.3f} -> {getattr(after.suite, attribute):8.3f}")
worst = sorted(((abs(a.throughput_error_pct) - abs(b.throughput_error_pct), a.run_id)
                for b, a in zip(before.runs, after.runs)), reverse=True)[:3]
print("largest |throughput error| growth: " + ", ".join(f"{run} {growth:+.2f} pp" for growth, run in worst))
print("move " + verdict.decision.upper() + " as a whole")
for reason in verdict.reasons:
    print("  - " + reason)
sys.exit(0 if verdict.accepted else 1)
