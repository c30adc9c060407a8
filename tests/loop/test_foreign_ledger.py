"""A checkout's model and its ledger never part (issue #31): `evaluate --commit` / `compare --commit` into a
checkout's model file with another ledger (a --ledger copy) is refused before anything is scored, and `evaluate`
warns when the model file was written by a commit its ledger does not record as its last one."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from conftest import PLAIN_MODEL_TOML
from test_loop import IMPROVING

from hops_calib.errors import InputError
from hops_calib.loop import ledger as ledger_room
from hops_calib.loop.commits import ledger_disagrees
from hops_calib.loop.compare import compare
from hops_calib.loop.evaluate import evaluate
from hops_calib.loop.model_files import committed_by

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))
from test_docs import checkout_copy


@pytest.fixture()
def checkout(tmp_path: Path) -> Path:
    return checkout_copy(tmp_path / "checkout")


def test_a_commit_into_the_checkouts_model_with_a_ledger_copy_is_refused(checkout, tmp_path, shared_fixtures,
                                                                          monkeypatch):
    monkeypatch.chdir(checkout)
    model = checkout / "hops_calib" / "model" / "models" / "baseline.toml"
    copy = tmp_path / "ledger-copy.jsonl"
    shutil.copy(checkout / "ledger" / "ledger.jsonl", copy)
    candidate = tmp_path / "iteration-host-overhead.toml"
    candidate.write_text(IMPROVING)
    model_bytes, copy_bytes = model.read_bytes(), copy.read_bytes()
    with pytest.raises(InputError) as refused:
        evaluate(shared_fixtures, candidate_path=candidate, ledger_path=copy, commit=True)
    error = refused.value
    assert type(error) is InputError and error.field == "ledger"  # (exit 2)
    assert f"--commit would write {model}, the model of the checkout {checkout.resolve()}" in str(error)
    assert f"not that checkout's ledger {checkout.resolve() / 'ledger' / 'ledger.jsonl'}" in str(error)
    assert "--model COPY" in error.hint and "leave out --commit" in error.hint
    plain = tmp_path / "plain.toml"
    plain.write_text(PLAIN_MODEL_TOML)
    with pytest.raises(InputError, match="the model and its ledger would disagree"):
        compare(shared_fixtures, plain, after_path=model, ledger_path=copy, commit_into=model)
    assert model.read_bytes() == model_bytes and copy.read_bytes() == copy_bytes  # nothing written or recorded


def test_a_model_written_through_another_ledger_draws_a_warning(checkout, tmp_path, shared_fixtures, monkeypatch):
    monkeypatch.chdir(checkout)
    shipped = checkout / "hops_calib" / "model" / "models" / "baseline.toml"
    real = checkout / "ledger" / "ledger.jsonl"
    assert ledger_disagrees(shipped, real) == []  # the shipped model names no commit: no warning on it
    # A model copy outside the checkout may be committed with any ledger: its header names the entry that wrote it.
    outside, copy = tmp_path / "model.toml", tmp_path / "ledger-copy.jsonl"
    outside.write_text(PLAIN_MODEL_TOML)
    shutil.copy(real, copy)
    candidate = tmp_path / "iteration-host-overhead.toml"
    candidate.write_text(IMPROVING)
    judged = evaluate(shared_fixtures, model_path=outside, candidate_path=candidate, ledger_path=copy, commit=True,
                      off_record=True)
    assert judged.committed
    entry = list(ledger_room.read_entries(copy))[-1]
    assert committed_by(outside) == (entry["seq"], entry["entry_sha256"])
    assert not [w for w in judged.warnings if "disagree" in w]
    assert not [w for w in evaluate(shared_fixtures, model_path=outside, ledger_path=copy).warnings
                if "disagree" in w]
    # A copy of that file made for a trial (`--model /tmp/m.toml`, as docs/loop.md says): no commit wrote into the
    # copy's path, but the entry that wrote its content is in the ledger: they agree, no warning
    again = tmp_path / "trial-copy.toml"
    shutil.copy(outside, again)
    assert ledger_disagrees(again, copy) == []
    # the same copy judged with a ledger that never held that entry: they disagree
    assert ledger_disagrees(again, real) and "written by the commit of ledger entry" in ledger_disagrees(again, real)[0]
    # That file put in the checkout: its ledger never recorded that commit.
    shutil.copy(outside, shipped)
    warned = [w for w in evaluate(shared_fixtures, ledger_path=real).warnings if "disagree" in w]
    last = [e for e in ledger_room.read_entries(real) if e.get("committed")][-1]
    assert len(warned) == 1 and f"written by the commit of ledger entry {entry['seq']}" in warned[0]
    assert f"its last commit into it is entry {last['seq']}" in warned[0]
    # `ledger verify` says so too: the chain is intact (exit 0), the pair of model and ledger disagrees (a warning)
    import json

    from typer.testing import CliRunner

    from hops_calib.cli import app

    verified = CliRunner().invoke(app, ["ledger", "verify", "--ledger", str(real), "--json"])
    record = json.loads(verified.stdout)
    assert verified.exit_code == 0 and record["status"] == "ok"
    assert [w for w in record["warnings"] if f"written by the commit of ledger entry {entry['seq']}" in w]
