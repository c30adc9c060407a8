"""The ledger after a crash (issue #21, smaller items): a commit whose model write did not happen is found by
`ledger verify` and written by `ledger repair`; a line being appended is not damage; a torn line points at repair."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from filelock import FileLock

from conftest import PLAIN_MODEL_TOML
from hops_calib.loop import ledger as ledger_room
from hops_calib.loop.evaluate import evaluate
from hops_calib.loop.model_files import load_model
from test_loop import IMPROVING, cli  # (the loop's tests' improving candidate and CLI runner)


def test_a_commit_interrupted_before_the_model_write_is_found_and_repaired(shared_fixtures, tmp_path, monkeypatch):
    model, candidate, ledger = tmp_path / "model.toml", tmp_path / "improving.toml", tmp_path / "ledger.jsonl"
    model.write_text(PLAIN_MODEL_TOML)
    candidate.write_text(IMPROVING)
    before = load_model(model).sha256

    def crash(path, written, entry=None):  # the process dies between the ledger append and the model write
        raise KeyboardInterrupt

    monkeypatch.setattr("hops_calib.loop.model_files.write_model", crash)
    with pytest.raises(KeyboardInterrupt):
        evaluate(shared_fixtures, model_path=model, candidate_path=candidate, ledger_path=ledger, commit=True)
    monkeypatch.undo()
    [entry] = list(ledger_room.read_entries(ledger))
    assert entry["committed"] and load_model(model).sha256 == before != entry["model_sha256_after"]

    verified = cli("ledger", "verify", "--ledger", ledger)
    message = " ".join(verified.stderr.split())
    assert verified.exit_code == 5  # a ledger that fails verify
    assert (f"{ledger}:1: entry 1 committed model {entry['model_sha256_after'][:12]} into {model.resolve()}, but the "
            f"file holds {before[:12]}, the model the entry was judged against") in message
    assert "`hops-calib ledger repair` writes the committed model" in message

    refused = cli("ledger", "plan", "--note", "next", "--ledger", ledger)  # nothing appended over it
    assert refused.exit_code == 5 and "run `hops-calib ledger repair" in " ".join(refused.stderr.split())

    repaired = cli("ledger", "repair", "--ledger", ledger)
    assert repaired.exit_code == 0, repaired.output
    assert f"wrote model {entry['model_sha256_after'][:12]}, which ledger entry 1 committed" in repaired.stdout
    assert load_model(model).sha256 == entry["model_sha256_after"]
    assert cli("ledger", "verify", "--ledger", ledger).exit_code == 0


def _two_plans(tmp_path: Path) -> tuple[Path, bytes]:
    """A ledger of one plan entry, and the bytes of the second entry an append would add to it."""
    ledger, longer = tmp_path / "ledger.jsonl", tmp_path / "longer.jsonl"
    assert cli("ledger", "plan", "--note", "one", "--ledger", ledger).exit_code == 0
    longer.write_bytes(ledger.read_bytes())
    assert cli("ledger", "plan", "--note", "two", "--ledger", longer).exit_code == 0
    return ledger, longer.read_bytes()[len(ledger.read_bytes()):]


def test_a_line_being_appended_is_not_reported_as_damage(tmp_path):
    ledger, line = _two_plans(tmp_path)
    seen = {}
    lock = FileLock(str(ledger) + ".lock")
    with lock:  # an append in flight: half its line written, the lock held
        with ledger.open("ab") as handle:
            handle.write(line[:20])
            handle.flush()
            reader = threading.Thread(target=lambda: seen.update(result=ledger_room.verify(ledger)))
            reader.start()
            reader.join(0.5)
            handle.write(line[20:])
    reader.join(30)
    assert seen["result"].ok, seen["result"].problems
    assert seen["result"].entries == 2


def test_a_torn_last_line_points_at_repair_not_at_git_checkout(tmp_path):
    ledger, line = _two_plans(tmp_path)
    with ledger.open("ab") as handle:  # an append that was interrupted: nobody holds the lock
        handle.write(line[:20])
    refused = cli("ledger", "plan", "--note", "three", "--ledger", ledger)
    message = " ".join(refused.stderr.split())
    assert refused.exit_code == 5  # a broken ledger
    assert f"run `hops-calib ledger repair --ledger {ledger}`" in message and "git checkout" not in message
    assert cli("ledger", "repair", "--ledger", ledger).exit_code == 0
    assert cli("ledger", "plan", "--note", "three", "--ledger", ledger).exit_code == 0
