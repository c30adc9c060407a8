"""Benchmark: one tune trial (all train runs predicted and scored), one observe pass, one crossval. Prints figures only.

    python benchmarks/observe_tune.py [--fixtures DIR] [--term TERM] [--trials 20] [--model FILE]

Without --fixtures the 56 shared runs are ingested into a temporary store first.
Tune: the time per trial of an in-memory study (sampling, building the candidate
model, predicting and scoring every train fixture), and the same for the scoring
alone. Observe: the whole observation (events read for the real parts, the
counterfactual re-simulations), in one process. Crossval: --folds refits of --term and one on
every train run, --evaluations model evaluations each, and the scoring of every fold.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, help="an existing fixture store (default: ingest the shared runs)")
    parser.add_argument("--term", default="decoder_roofline")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--model", type=Path, help="model file (default: the shipped baseline)")
    parser.add_argument("--folds", type=int, default=5, help="crossval folds")
    parser.add_argument("--evaluations", type=int, default=150, help="crossval evaluations per refit")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fixtures = args.fixtures
        if fixtures is None:
            from hops_calib.shared import shared_runs_dir
            from hops_calib.store import FixtureStore
            from hops_calib.store.ingest import ingest

            fixtures = Path(tmp) / "fixtures"
            if not ingest([shared_runs_dir()], FixtureStore(fixtures)).ok:
                sys.exit("ingest of the shared runs failed")
        import optuna

        from hops_calib.research.observe import observe
        from hops_calib.research.tune import load_problem, objective, open_study

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        problem = load_problem(args.term, fixtures, args.model)
        scoring = []
        for _ in range(5):
            start = time.perf_counter()
            problem.score(problem.model)
            scoring.append(time.perf_counter() - start)
        study = open_study(problem, optuna.storages.InMemoryStorage(), "benchmark", seed=0)
        start = time.perf_counter()
        study.optimize(objective(problem), n_trials=args.trials)
        per_trial = (time.perf_counter() - start) / args.trials
        n = len(problem.suite.ids)
        print(f"tune {args.term}, {n} train fixtures, {args.trials} trials in memory:")
        print(f"  per trial                 {per_trial * 1e3:8.1f} ms")
        print(f"  scoring alone (median)    {statistics.median(scoring) * 1e3:8.1f} ms "
              f"({statistics.median(scoring) / n * 1e3:.2f} ms per fixture)")
        start = time.perf_counter()
        observation = observe(fixtures, model_path=args.model)
        print(f"observe, {len(observation.runs)} train fixtures, {len(observation.ranked)} contributors: "
              f"{time.perf_counter() - start:.2f} s")
        from hops_calib.research.crossval import crossval

        start = time.perf_counter()
        result = crossval(args.term, fixtures, model_path=args.model, folds=args.folds, evaluations=args.evaluations)
        print(f"crossval {args.term}, {len(result.folds)} folds + 1 full refit x {args.evaluations} evaluations: "
              f"{time.perf_counter() - start:.2f} s (cross-validated MAPE {result.held_out.throughput_mape_pct:.2f} %)")


if __name__ == "__main__":
    main()
