"""The ledger: hash chain, tamper and truncation detection, concurrent appends and a killed writer (real processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

from hops_calib.loop import ledger
from hops_calib.loop.ledger import GENESIS, LedgerError

REPO = Path(__file__).resolve().parents[2]


def entry(i: int) -> dict:
    return {"kind": "evaluate", "candidate": {"id": f"c{i}", "text": f'id = "c{i}"\n'}, "decision": "rejected",
            "aggregates_before": {"throughput_mape_pct": 10.0 + i}, "aggregates_after": {"throughput_mape_pct": 9.0},
            "reasons": ["a", "b"]}


def write_entries(path: Path, n: int) -> list[dict]:
    return [ledger.append(path, entry(i)) for i in range(n)]


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")[:-1]


def test_entries_chain_and_verify(tmp_path):
    path = tmp_path / "ledger" / "ledger.jsonl"
    written = write_entries(path, 3)
    assert [e["seq"] for e in written] == [1, 2, 3]
    assert written[0]["prev_sha256"] == GENESIS
    raw = lines(path)
    assert written[1]["prev_sha256"] == ledger.sha256_hex(raw[0])
    assert json.loads(raw[2]) == written[2]
    result = ledger.verify(path)
    assert result.ok and result.entries == 3 and result.head_sha256 == ledger.sha256_hex(raw[2])
    assert list(ledger.read_entries(path)) == written


def rewrite_line(path: Path, number: int, change) -> None:
    raw = lines(path)
    data = json.loads(raw[number - 1])
    change(data)
    raw[number - 1] = ledger.canonical_json(data)
    path.write_bytes(b"\n".join(raw) + b"\n")


def test_an_edited_entry_is_named(tmp_path):
    path = tmp_path / "ledger.jsonl"
    write_entries(path, 4)
    rewrite_line(path, 2, lambda d: d.update(decision="accepted"))
    result = ledger.verify(path)
    assert not result.ok
    assert [(p.line, "edited" in p.message) for p in result.problems] == [(2, True), (3, False)]
    assert "line 2 was changed" in result.problems[1].message


def test_an_edit_with_its_own_hash_recomputed_is_caught_by_the_chain(tmp_path):
    path = tmp_path / "ledger.jsonl"
    write_entries(path, 4)

    def forge(data):
        data["decision"] = "accepted"
        data["entry_sha256"] = ledger.entry_hash(data)

    rewrite_line(path, 3, forge)
    problems = ledger.verify(path).problems
    assert [p.line for p in problems] == [4] and "line 3 was changed" in problems[0].message


def test_a_removed_line_is_caught(tmp_path):
    path = tmp_path / "ledger.jsonl"
    write_entries(path, 4)
    raw = lines(path)
    path.write_bytes(b"\n".join(raw[:1] + raw[2:]) + b"\n")
    problems = ledger.verify(path).problems
    assert [p.line for p in problems] == [2]
    path.write_bytes(b"\n".join(raw[1:]) + b"\n")
    assert "genesis" in ledger.verify(path).problems[0].message


def test_a_truncated_last_line_is_named_blocks_appends_and_can_be_set_aside(tmp_path):
    path = tmp_path / "ledger.jsonl"
    write_entries(path, 2)
    whole = path.read_bytes()
    path.write_bytes(whole + ledger.canonical_json(entry(9))[:40])
    result = ledger.verify(path)
    assert [p.line for p in result.problems] == [3] and "interrupted" in result.problems[0].message
    assert result.entries == 2
    with pytest.raises(LedgerError, match=r"ledger.jsonl:3: .*interrupted.*ledger repair"):
        ledger.append(path, entry(3))
    aside = ledger.repair(path)
    assert aside is not None and aside.read_bytes() == ledger.canonical_json(entry(9))[:40]
    assert path.read_bytes() == whole and ledger.verify(path).ok
    assert ledger.repair(path) is None
    assert ledger.append(path, entry(3))["seq"] == 3 and ledger.verify(path).ok


def test_a_damaged_line_is_named(tmp_path):
    path = tmp_path / "ledger.jsonl"
    write_entries(path, 3)
    raw = lines(path)
    raw[1] = raw[1][:-5]
    path.write_bytes(b"\n".join(raw) + b"\n")
    assert [p.line for p in ledger.verify(path).problems][:1] == [2]
    with pytest.raises(LedgerError, match=":2:"):
        list(ledger.read_entries(path))


APPENDER = textwrap.dedent("""
    import sys
    from hops_calib.loop import ledger
    path, worker, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for i in range(count):
        ledger.append(path, {"kind": "evaluate", "worker": worker, "i": i, "padding": "x" * (4096 * (i % 3))})
""")


def run_python(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, cwd=REPO, stderr=subprocess.PIPE)


def test_concurrent_appends_from_several_processes_keep_the_chain(tmp_path):
    path = tmp_path / "ledger.jsonl"
    workers, count = 4, 15
    procs = [run_python(APPENDER, str(path), str(w), str(count)) for w in range(workers)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
    result = ledger.verify(path)
    assert result.ok, result.problems
    entries = list(ledger.read_entries(path))
    assert [e["seq"] for e in entries] == list(range(1, workers * count + 1))
    assert sorted((e["worker"], e["i"]) for e in entries) == [(w, i) for w in range(workers) for i in range(count)]


KILLED_WRITER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from hops_calib.loop import ledger
    path, ready = sys.argv[1], Path(sys.argv[2])

    def write_half_then_hang(fd, data):
        os.write(fd, data[: len(data) // 2])
        ready.write_text("half written")
        time.sleep(600)

    ledger._write_all = write_half_then_hang
    ledger.append(path, {"kind": "evaluate", "note": "this append is killed halfway"})
""")


def test_a_writer_killed_mid_append_is_detected_and_releases_the_lock(tmp_path):
    path = tmp_path / "ledger.jsonl"
    write_entries(path, 2)
    ready = tmp_path / "ready"
    proc = run_python(KILLED_WRITER, str(path), str(ready))
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the writer never reached its write"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    result = ledger.verify(path)
    assert [p.line for p in result.problems] == [3] and "incomplete last line" in result.problems[0].message
    # The dead writer's lock is gone: the next append gets it at once, and refuses to chain onto the partial line.
    with pytest.raises(LedgerError, match="interrupted"):
        ledger.append(path, entry(3))
    ledger.repair(path)
    assert ledger.append(path, entry(3))["seq"] == 3 and ledger.verify(path).ok


def test_export_writes_one_parquet_row_per_entry(tmp_path):
    path = tmp_path / "ledger.jsonl"
    write_entries(path, 3)
    out = tmp_path / "out" / "ledger.parquet"
    assert ledger.export_parquet(path, out) == 3
    frame = pd.read_parquet(out)
    assert list(frame["seq"]) == [1, 2, 3]
    assert list(frame["aggregates_before_throughput_mape_pct"]) == [10.0, 11.0, 12.0]
    assert json.loads(frame["reasons"][0]) == ["a", "b"]
    assert not list(out.parent.glob("*.tmp"))


def test_code_revision_is_a_commit_or_unknown():
    revision = ledger.code_revision()
    assert revision == "unknown" or len(revision.removesuffix("-dirty")) == 40


def test_held_out_looks_count_the_work_between_looks_and_name_repeats(tmp_path):
    path = tmp_path / "ledger.jsonl"

    def scores(mape):
        return {"throughput_mape_pct": mape, "bubble_mae_pp": 1.0}

    def evaluate(decision, committed):
        ledger.append(path, {"kind": "evaluate", "decision": decision, "committed": committed,
                             "aggregates_before": scores(3.0), "aggregates_after": scores(2.9)})

    def look(model, split="test", train=None, digests=None):
        ledger.append(path, {"kind": "report", "split": split, "model_sha256": model, "fixture_set_sha256": "f",
                             "aggregates": scores(4.0), **({"train_aggregates": scores(train)} if train else {}),
                             **({"prediction_digests": digests} if digests else {}), "decision": "audit"})

    evaluate("accepted", True)
    evaluate("rejected", False)
    evaluate("accepted", False)  # accepted but not written into a model: no change
    look("A")
    look("A", split="train")  # a train report is no look at the held-out split
    ledger.append(path, {"kind": "compare", "decision": "rejected", "committed": True})  # an undo changes the file
    look("B", train=2.5)
    look("B", train=2.5)
    # Another model that predicts every run as an earlier one did is a repeat too; one differing on a run is not.
    look("C", digests=["d1", "d2"])
    look("D", digests=["d1", "d2"])
    look("E", digests=["d1", "d3"])
    # The same model predicting otherwise (the code changed) is no repeat; one matching a look without digests is.
    look("E", digests=["d4", "d3"])
    look("B", digests=["d5", "d6"])
    ledger.append(path, {"kind": "report", "split": "test", "model_sha256": "F", "fixture_set_sha256": "f",
                         "aggregates": scores(4.0), "train_aggregates": scores(2.5),
                         "intervals": {"gap_to_train_pp": [0.4, 2.6]}, "decision": "audit"})
    looks = ledger.held_out_looks(ledger.read_entries(path))
    assert [(x.evaluations_since, x.changes_since, x.repeat_of) for x in looks] == [
        (3, 1, None), (1, 1, None), (0, 0, looks[1].seq), (0, 0, None), (0, 0, looks[3].seq), (0, 0, None),
        (0, 0, None), (0, 0, looks[1].seq), (0, 0, None)]
    assert [x.model_sha256 for x in looks] == ["A", "B", "B", "C", "D", "E", "E", "B", "F"]
    assert [x.predictions_moved for x in looks] == [None, None, None, None, 0, 1, 1, 2, None]
    assert looks[-1].gap_interval_pp == (0.4, 2.6) and looks[1].gap_interval_pp is None
    assert looks[0].gap_to_train_pp is None and looks[1].gap_to_train_pp == pytest.approx(1.5)
    assert ledger.held_out_looks(ledger.read_entries(path), split="train")[0].seq == 5


def test_ledger_looks_cli_on_the_committed_ledger():
    from typer.testing import CliRunner

    from hops_calib.cli import app

    committed = Path(__file__).resolve().parents[2] / "ledger" / "ledger.jsonl"
    reports = [e for e in ledger.read_entries(committed) if e.get("kind") == "report" and e.get("split") == "test"]
    result = CliRunner().invoke(app, ["ledger", "looks", "--ledger", str(committed), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [x["seq"] for x in data["looks"]] == [e["seq"] for e in reports]
    assert data["distinct_models"] == len({e["model_sha256"] for e in reports})
    assert data["repeated_looks"] == len(reports) - len({(e["model_sha256"], e["fixture_set_sha256"]) for e in reports})
    text = CliRunner().invoke(app, ["ledger", "looks", "--ledger", str(committed)])
    assert text.exit_code == 0 and f"{len(reports)} look(s) at the test split" in text.stdout


def _git(folder: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=folder, check=True,
                   capture_output=True)


def test_verify_sees_entries_cut_off_the_end_against_the_copy_committed_at_git_head(tmp_path):
    repo = tmp_path / "repo"
    (repo / "ledger").mkdir(parents=True)
    path = repo / "ledger" / "ledger.jsonl"
    write_entries(path, 4)
    _git(repo, "init", "-q")
    _git(repo, "add", "ledger/ledger.jsonl")
    _git(repo, "commit", "-q", "-m", "ledger")
    result = ledger.verify(path)
    assert result.ok and result.committed_prefix_checked and "prefix" in result.committed_prefix_note
    ledger.append(path, entry(4))  # growing past the committed copy is what a ledger does
    assert ledger.verify(path).ok
    whole = path.read_bytes()
    path.write_bytes(b"".join(whole.splitlines(keepends=True)[:2]))  # entries 3.. cut off: the chain is intact
    result = ledger.verify(path)
    assert not result.ok and [p.line for p in result.problems] == [3]
    assert "line 3 of the copy committed at git HEAD is missing" in result.problems[0].message
    with pytest.raises(ledger.BrokenLedger, match="git HEAD"):
        ledger.append(path, entry(9))  # and nothing is chained to the shortened history
    # Outside a work tree the limit is stated, not hidden.
    loose = tmp_path / "loose.jsonl"
    write_entries(loose, 2)
    result = ledger.verify(loose)
    assert result.ok and not result.committed_prefix_checked and "cannot be seen" in result.committed_prefix_note


def test_verify_of_a_missing_file_says_so_without_a_line(tmp_path):
    result = ledger.verify(tmp_path / "none.jsonl")
    assert not result.ok and result.problems[0].line is None and "missing" in str(result.problems[0])
    assert "line" not in str(result.problems[0])


def test_a_look_on_another_fixture_set_repeats_one_whose_runs_it_shares():
    """`look_repeats` across fixture sets: runs in common by id key or by what they measured (a renamed copy), with
    the same model, or with every run predicted as that look did; a look before run keys were recorded counts as
    the same runs only when it predicted as many configurations exactly alike."""
    earlier = {"fixture_set_sha256": "f1", "model_sha256": "A", "prediction_digests": ["p1", "p2", "p3"],
               "run_keys": [["i1", "m1"], ["i2", "m2"], ["i3", "m3"]]}
    older = {k: v for k, v in earlier.items() if k != "run_keys"}
    new_runs = [["i9", "m9"]]
    assert ledger.look_repeats(earlier, "f2", "A", ["p2", "x"], [["i2", "m2"], ["i9", "m9"]])  # same model, overlap
    assert ledger.look_repeats(earlier, "f2", "A", ["p1"], [["renamed", "m1"]])  # a renamed copy of run 1
    assert not ledger.look_repeats(earlier, "f2", "A", ["p9"], new_runs)  # other runs: a new look
    assert ledger.look_repeats(earlier, "f2", "B", ["p1", "p3"], [["i1", "m1"], ["i3", "x"]])  # predicted alike
    assert not ledger.look_repeats(earlier, "f2", "B", ["p1", "p9"], [["i1", "m1"], ["i9", "m9"]])  # one run new
    assert not ledger.look_repeats(earlier, "f2", "B", ["p1", "q"], [["i1", "m1"], ["i2", "m2"]])  # one moved
    assert ledger.look_repeats(older, "f2", "B", ["p1", "p2", "p3"], new_runs * 3)
    assert not ledger.look_repeats(older, "f2", "A", ["p1", "p2"], new_runs * 2)
    assert ledger.look_repeats(earlier, "f1", "A", ["q1", "q2", "q3"], None) is False  # same set: `repeats`
