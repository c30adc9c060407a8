"""`tune` on a real database: 4 workers of one study on PostgreSQL (optuna's RDB storage) lose no trial, run none
twice, and give the same study as one worker with the same seed (`--sampler sobol`).

The database: $HOPS_CALIB_TEST_POSTGRES (a URL, postgresql://USER:PASSWORD@HOST/DB, which .ci/run sets after
starting a local server). Without it, or unreachable, or without a PostgreSQL driver (the [db] extra), the test
skips saying why, and fails instead when HOPS_CALIB_REQUIRE_POSTGRES=1 (.ci/run sets it: CI must run it)."""

from __future__ import annotations

import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRIALS, WORKERS = 12, 4


def trials_of(url: str, study: str) -> list[tuple[int, str, tuple, tuple]]:
    import optuna

    loaded = optuna.load_study(study_name=study, storage=url)
    return sorted((t.number, t.state.name, tuple(sorted(t.params.items())), tuple(t.values or ()))
                  for t in loaded.get_trials(deepcopy=False))


def test_four_workers_on_postgres_lose_no_trial_and_equal_one_worker(postgres_url, tmp_path):
    from hops_calib.research.tune import tune

    run = uuid.uuid4().hex[:8]
    common = dict(model_path=None, trials=TRIALS, storage_url=postgres_url, seed=7, sampler="sobol",
                  ledger_path=tmp_path / "none.jsonl")
    one = tune("iteration_host_overhead", REPO / "fixtures", study_name=f"one-{run}", workers=1,
               out=tmp_path / "one.toml", **common)
    four = tune("iteration_host_overhead", REPO / "fixtures", study_name=f"four-{run}", workers=WORKERS,
                out=tmp_path / "four.toml", **common)
    single, many = trials_of(postgres_url, f"one-{run}"), trials_of(postgres_url, f"four-{run}")
    # no trial lost, none run twice: numbers 0..N-1 once each, every one complete, no parameter set repeated
    assert [t[0] for t in many] == list(range(TRIALS)) and {t[1] for t in many} == {"COMPLETE"}
    assert len({t[2] for t in many}) == TRIALS
    # the same study as one worker's: the same points, the same scores, the same candidate
    assert many == single
    assert four.trials_in_study == one.trials_in_study == TRIALS
    assert [p.number for p in four.front] == [p.number for p in one.front]
    assert (four.chosen.number if four.chosen else None) == (one.chosen.number if one.chosen else None)
    from sqlalchemy.engine import make_url

    password = make_url(postgres_url).password
    assert not password or f":{password}@" not in four.storage  # the password is not shown
