"""The planner's study on a shared storage (`plan job --storage URL --workers K`): several worker processes of one
study lose no trial, run none twice, and give the plan one worker gives with the same seed (`--sampler sobol`), on
SQLite (always) and on PostgreSQL (where $HOPS_CALIB_TEST_POSTGRES names one: .ci/run starts it and requires the
test). A worker asking to join a study that plans something else is refused."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.loop.model_files import load_model
from hops_calib.whatif.job_plan import plan_job
from hops_calib.whatif.launch_study import StudyRun

REPO = Path(__file__).resolve().parents[2]
# an interleaved capture: a space of micro-batch sizes, schedules (1F1B, interleaved at v 2 and 4) and splits
JOB = REPO / "traces" / "cpu_interleaved_v2_l8_h512_s256_m4_run1"
TRIALS = 16


def trials_of(url: str, study: str) -> list[tuple[int, str, tuple, float | None]]:
    import optuna

    loaded = optuna.load_study(study_name=study, storage=url)
    return sorted((t.number, t.state.name, tuple(sorted(t.params.items())), t.value)
                  for t in loaded.get_trials(deepcopy=False))


def planned(url: str, study: str, workers: int):
    # exhaustive_limit 1: the space (162 launches) is searched by the study and the ascent, not listed whole
    return plan_job(JOB, load_model(None), trials=TRIALS, study_trials=TRIALS, exhaustive_limit=1, seed=3,
                    study_run=StudyRun(url, study, workers, "sobol"))


def rows(plan) -> list[tuple]:
    return [(o.launch, round(o.samples_per_s, 12), o.peak_memory_bytes) for o in plan.best]


def check_equal_to_one_worker(url: str, workers: int) -> None:
    run = uuid.uuid4().hex[:8]
    one = planned(url, f"one-{run}", 1)
    many = planned(url, f"many-{run}", workers)
    single, shared = trials_of(url, f"one-{run}"), trials_of(url, f"many-{run}")
    # no trial lost, none run twice: numbers 0..N-1 once each, every one complete
    assert [t[0] for t in shared] == list(range(TRIALS)) and {t[1] for t in shared} == {"COMPLETE"}
    # the same trials (the same Sobol points, the same launches priced alike) and the same plan
    assert shared == single
    assert any(t[3] > 0 for t in shared), "the study priced no launch that fits"
    assert rows(many) == rows(one) and many.best and many.current == one.current
    assert many.study["workers"] == workers and many.study["trials_in_study"] == one.study["trials_in_study"] == TRIALS
    assert many.study["best_value_samples_per_s"] == one.study["best_value_samples_per_s"] > 0
    # the in-memory plan of the same job finds the same best launch
    alone = plan_job(JOB, load_model(None), trials=TRIALS, study_trials=TRIALS, exhaustive_limit=1, seed=3)
    assert alone.study is None and alone.best[0].launch == one.best[0].launch


def test_two_workers_on_sqlite_equal_one_worker(tmp_path):
    check_equal_to_one_worker(f"sqlite:///{tmp_path / 'plan.db'}", 2)


def test_four_workers_on_postgres_lose_no_trial_and_equal_one_worker(postgres_url):
    check_equal_to_one_worker(postgres_url, 4)


def test_a_study_of_another_plan_is_refused(tmp_path):
    url = f"sqlite:///{tmp_path / 'plan.db'}"
    common = ["plan", "job", str(JOB), "--trials", "4", "--exhaustive-limit", "1", "--storage", url,
              "--study", "shared", "--sampler", "sobol", "--json"]
    first = CliRunner().invoke(app, common)
    assert first.exit_code == 0, first.output
    assert json.loads(first.stdout)["study"]["trials_in_study"] == 4
    # the same study asked to plan with another memory headroom: another plan, refused naming what differs
    other = CliRunner().invoke(app, [*common, "--memory-headroom", "3"])
    assert other.exit_code == 2
    error = json.loads(other.stdout)["error"]
    assert error["field"] == "study" and "headroom_bytes" in error["message"]
    # another sampler on the same study: refused too
    tpe = CliRunner().invoke(app, [*common[:-3], "--sampler", "tpe", "--json"])
    assert tpe.exit_code == 2 and json.loads(tpe.stdout)["error"]["field"] == "sampler"
    # joining it as asked adds this run's trials to the study
    again = CliRunner().invoke(app, common)
    assert again.exit_code == 0 and json.loads(again.stdout)["study"]["trials_in_study"] == 8


def test_workers_without_a_storage_are_refused():
    done = CliRunner().invoke(app, ["plan", "job", str(JOB), "--workers", "2", "--json"],
                              env={"HOPS_CALIB_STORAGE": ""})
    assert done.exit_code == 2 and json.loads(done.stdout)["error"]["field"] == "--storage"
