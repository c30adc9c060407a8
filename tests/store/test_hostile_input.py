"""No run can crash, hang or overwrite another (issue #21): real shared runs, copied and damaged in tmp folders.

Every case runs the CLI in a fresh process with a generous timeout, so a regression that hangs fails instead of
stalling the suite, and checks the exit code, the message, that the intact run beside the damaged one was
ingested, and that nothing outside the store was written.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hops_calib.store import FixtureStore
from hostile_cases import CASES, DAMAGED, INTACT, Case, build, copy_runs

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120  # each case takes about a second; a hang fails here instead of stalling the suite


def cli(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("HOPS_CALIB_PROGRESS", None)
    return subprocess.run([sys.executable, "-m", "hops_calib", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def outside(root: Path, store: Path) -> dict[str, tuple]:
    """Every entry under `root` but the store (links not followed): kind, size, mtime."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            if path == store or store in path.parents:
                continue
            info = path.lstat()
            found[str(path.relative_to(root))] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return found


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_hostile_input_is_that_runs_rejection_only(case: Case, shared_runs: Path, tmp_path: Path):
    source = build(case, shared_runs, tmp_path)
    store = tmp_path / "fixtures"
    before = outside(tmp_path, store)
    done = cli("ingest", str(source), "--fixtures", str(store), *(["--lenient"] if case.lenient else []))
    message = flat(done.stderr)
    assert done.returncode == case.exit_code, done.stderr
    for words in case.says:
        assert words in message, message
    assert "internal error" not in message
    ids = FixtureStore(store).ids()
    assert ids == sorted([INTACT] + ([DAMAGED] if case.damaged_ingested else [])), ids
    assert outside(tmp_path, store) == before  # the sources (and anything beside them) untouched
    if case.name == "job directory named index.parquet":  # it wedged the store: every later ingest exited 3
        again = cli("ingest", str(source / INTACT), "--fixtures", str(store))
        assert again.returncode == 0 and "1 unchanged" in again.stdout, again.stderr


def _store_of_two(shared_runs: Path, tmp_path: Path) -> tuple[Path, Path]:
    source = copy_runs(shared_runs, tmp_path / "src")
    store = tmp_path / "fixtures"
    assert cli("ingest", str(source), "--fixtures", str(store)).returncode == 0
    return source, store


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_clashing_run_id_never_replaces_another_jobs_fixture(shared_runs: Path, tmp_path: Path):
    source, store = _store_of_two(shared_runs, tmp_path)
    kept = _files(store / INTACT)
    other = tmp_path / "c" / "other"
    shutil.copytree(source / DAMAGED, other)
    with (other / "manifest.yaml").open("a") as manifest:
        manifest.write(f"run_id: {INTACT}\n")
    done = cli("ingest", str(other.parent), "--fixtures", str(store))
    message = flat(done.stderr)
    assert done.returncode == 2, done.stderr  # its only run rejected: nothing of the source stored (exit 2)
    assert f"run id '{INTACT}' of {other} is already in the store for another job" in message
    assert str(source / INTACT) in message and "the stored run is kept" in message
    assert _files(store / INTACT) == kept
    assert "0 updated" in done.stdout and "1 rejected" in done.stdout


def test_the_same_job_reingested_after_a_fix_updates_its_fixture(shared_runs: Path, tmp_path: Path):
    source, store = _store_of_two(shared_runs, tmp_path)
    events = source / INTACT / "megatron_trace" / "rank1.jsonl"
    lines = events.read_text().splitlines(keepends=True)
    event = json.loads(lines[-1])
    event["end_wall_ns"] += 1000  # a re-copied log: the same job, its measurements changed a little
    events.write_text("".join(lines[:-1]) + json.dumps(event) + "\n")
    done = cli("ingest", str(source / INTACT), "--fixtures", str(store))
    assert done.returncode == 0 and "1 updated" in done.stdout, done.stderr
    moved = tmp_path / "moved" / INTACT  # the same measurements from another folder (a moved copy)
    shutil.copytree(source / INTACT, moved)
    (moved / "megatron_args.txt").write_text((moved / "megatron_args.txt").read_text() + "\n")
    done = cli("ingest", str(moved), "--fixtures", str(store))
    assert done.returncode == 0 and "1 updated" in done.stdout, done.stderr


def test_an_ingest_killed_part_way_is_named_to_readers_and_finished_by_the_next(shared_runs: Path, tmp_path: Path):
    source, store = _store_of_two(shared_runs, tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen([sys.executable, "-m", "hops_calib", "ingest", str(shared_runs), "--fixtures",
                              str(store)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len([p for p in store.iterdir() if (p / "fixture.json").is_file()]) < 6:
            assert child.poll() is None, "the ingest finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    listed = cli("fixtures", "list", "--fixtures", str(store))
    message = flat(listed.stderr)
    assert listed.returncode == 2, listed.stdout
    assert "stopped before it finished" in message
    assert f"run `hops-calib ingest {shared_runs} --fixtures {store}`" in message
    evaluated = cli("evaluate", "--fixtures", str(store))
    assert evaluated.returncode == 2 and "stopped before it finished" in flat(evaluated.stderr)
    done = cli("ingest", str(shared_runs), "--fixtures", str(store))
    assert done.returncode == 0, done.stderr
    listed = cli("fixtures", "list", "--fixtures", str(store), "--json")
    assert listed.returncode == 0
    assert len(json.loads(listed.stdout)["fixtures"]) == len(list(shared_runs.iterdir()))


def test_a_running_ingest_is_waited_for_and_not_called_stopped(shared_runs: Path, tmp_path: Path):
    source, store = _store_of_two(shared_runs, tmp_path)
    holder = FixtureStore(store)
    with holder.lock(sources=[source]):
        holder.begin_writing()  # an ingest that is changing the store right now
        waited = cli("ingest", str(source / INTACT), "--fixtures", str(store), "--lock-timeout", "1")
        listed = cli("fixtures", "list", "--fixtures", str(store))
        evaluated = cli("evaluate", "--fixtures", str(store))
    message = flat(waited.stderr)
    assert waited.returncode == 2, waited.stderr
    assert f"waiting for the store lock held by the ingest of {source} (PID {os.getpid()}" in message
    assert "still held" in message and "--lock-timeout" in message
    assert listed.returncode == 0 and INTACT in listed.stdout
    assert "stopped before it finished" not in evaluated.stderr
    assert "is writing into this store" in flat(evaluated.stderr)
    done = cli("ingest", str(source / INTACT), "--fixtures", str(store))  # the lock is free again
    assert done.returncode == 0 and "1 unchanged" in done.stdout, done.stderr


def test_a_damaged_fixture_does_not_wedge_later_ingests(shared_runs: Path, tmp_path: Path):
    source, store = _store_of_two(shared_runs, tmp_path)
    (store / DAMAGED / "fixture.json").write_text('{"torn')
    third = copy_runs(shared_runs, tmp_path / "more", ("exp1_1_all_nodes_run15",))
    done = cli("ingest", str(third), "--fixtures", str(store))
    assert done.returncode == 0, done.stderr
    assert FixtureStore(store).ids() == sorted([DAMAGED, INTACT, "exp1_1_all_nodes_run15"])
    shown = cli("fixtures", "show", DAMAGED, "--fixtures", str(store))  # still met, and named with the way out
    assert shown.returncode == 2 and "fixture.json:1" in shown.stderr and "ingest the run's job again" in shown.stderr
    done = cli("ingest", str(source), "--fixtures", str(store))
    assert done.returncode == 0 and "1 updated" in done.stdout, done.stderr


def test_what_if_and_plan_refuse_pipelines_they_would_time_for_hours(shared_runs: Path, tmp_path: Path):
    job = copy_runs(shared_runs, tmp_path / "src", (DAMAGED,)) / DAMAGED
    args = job / "megatron_args.txt"
    args.write_text(args.read_text().replace("--global-batch-size 2 ", "--global-batch-size 100000000 "))
    predicted = cli("predict", "--job", str(job))
    assert predicted.returncode == 2, predicted.stderr
    assert "field '--global-batch-size': gives 100000000 microbatches per iteration" in flat(predicted.stderr)
    huge = ("plan", "--stages", "1000", "--microbatches", "100000000", "--memory-budget", "1000")
    assert cli(*huge).returncode == 0  # the closed forms answer where they hold
    planned = cli(*huge, "--weight-grad-cost", "1.5")  # ZB-H1's does not (W > F): it would be simulated
    assert planned.returncode == 2, planned.stderr
    assert "has 300000000000 tasks, and its closed form does not hold there" in flat(planned.stderr)


def test_iteration_level_sources_are_read_within_the_same_bounds(tmp_path: Path):
    """A training log with a 2 MB line (skipped: no line Megatron prints), a run table whose sidecar is an alias
    bomb (refused naming it), beside each other: the log's run lands, the table is that source's rejection."""
    from hops_calib.store.ingest import ingest
    from hops_calib.trace.run_table import read_run_table
    from hostile_cases import ALIAS_BOMB
    from tests.trace.test_iteration_level import A100, _lm_log, _table

    log = tmp_path / "gpt_run1.log"
    _lm_log(log)
    text = log.read_text()
    cut = text.index("\n", len(text) // 2) + 1
    log.write_text(text[:cut] + "x" * 2_000_000 + "\n" + text[cut:])
    table = tmp_path / "t.parquet"
    _table([{"pipeline_model_parallel_size": 2, "iteration_time_ms": 100.0}]).to_parquet(table)
    (tmp_path / "t.yaml").write_text(ALIAS_BOMB + "args: *h\n")
    with pytest.raises(Exception, match="expands to more than 10000 values"):
        read_run_table(table)
    store = FixtureStore(tmp_path / "fx")
    report = ingest([log, table], store, hardware=A100)
    assert [o.run_id for o in report.outcomes if o.status == "new"] == ["gpt_run1"]
    assert any("t.yaml" in (o.error or "") and "expands to more than" in o.error for o in report.rejected)


def test_a_run_table_cell_too_large_for_a_float_is_that_rows_rejection(tmp_path: Path):
    """An iteration_time_ms cell of 400 digits parses as an integer no float holds: the positivity check named the
    row and field for a damaged number but crashed on this one (OverflowError, the whole ingest an internal error).
    It is the row's rejection, as a link benchmark's size of 400 digits is that file's; the row beside it lands."""
    from hops_calib.store.ingest import ingest
    from tests.trace.test_iteration_level import _table

    path = tmp_path / "sweep.csv"
    _table([{"pipeline_model_parallel_size": 2, "iteration_time_ms": 120.5},
            {"pipeline_model_parallel_size": 4, "iteration_time_ms": 7}]).to_csv(path, index=False)
    text = path.read_text()
    huge = "9" * 400
    path.write_text(text[:text.rindex(",7")] + f",{huge}\n")
    report = ingest([path], FixtureStore(tmp_path / "fx"))
    assert [o.status for o in report.outcomes].count("new") == 1
    (rejected,) = report.rejected
    assert "sweep.csv:3" in rejected.error and "field 'iteration_time_ms'" in rejected.error
    assert "expected a positive number" in rejected.error
