"""plan and predict split by mode into sub-verbs (`plan job|layouts|abstract`, `predict run|all|job`); the old
spellings (`plan --job DIR`, `plan --job DIR --parallel`, `plan --stages ...`, `predict ID`, `predict --all`,
`predict --job DIR`) are aliases that give the same output, on the shipped CPU captures and their store."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.cli.reference import reference

RUN = "cpu_1f1b_l4_h512_s256_m4_run1"  # a train run of the shipped store


def _cli(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture
def shipped(repo_root, monkeypatch):
    monkeypatch.chdir(repo_root)  # --fixtures defaults to ./fixtures: the shipped store
    return repo_root


@pytest.mark.parametrize(("old", "new"), [
    (("predict", RUN, "--json"), ("predict", "run", RUN, "--json")),
    (("predict", "--all", "--json"), ("predict", "all", "--json")),
    (("predict", "--job", f"traces/{RUN}", "--json"), ("predict", "job", f"traces/{RUN}", "--json")),
    (("plan", "--job", f"traces/{RUN}", "--json"), ("plan", "job", f"traces/{RUN}", "--json")),
    (("plan", "--job", f"traces/{RUN}", "--parallel", "--json"), ("plan", "layouts", f"traces/{RUN}", "--json")),
    (("plan", "--stages", "4", "--microbatches", "8", "--memory-budget", "4", "--json"),
     ("plan", "abstract", "--stages", "4", "--microbatches", "8", "--memory-budget", "4", "--json")),
])
def test_an_old_spelling_gives_what_its_sub_verb_gives(shipped, old, new):
    before, after = _cli(*old), _cli(*new)
    assert before.exit_code == after.exit_code == 0, (before.output[-400:], after.output[-400:])
    assert before.stdout == after.stdout and before.stdout.lstrip().startswith("{")


def test_a_sub_verb_takes_only_its_own_options(shipped):
    refused = _cli("plan", "layouts", f"traces/{RUN}", "--schedule", "1f1b")
    assert refused.exit_code == 2 and "No such option" in refused.output
    old = _cli("plan", "--job", f"traces/{RUN}", "--parallel", "--schedule", "1f1b")
    assert old.exit_code == 2 and "Drop --schedule" in " ".join(old.output.split())


def test_the_old_spelling_is_named_as_typed_and_kept_out_of_the_reference(shipped):
    bad = _cli("plan", "--bogus")
    assert bad.exit_code == 2 and "plan [OPTIONS]" in bad.output and "legacy" not in bad.output
    page = reference()
    for verb in ("plan job", "plan layouts", "plan abstract", "predict run", "predict all", "predict job"):
        assert f"## `hops-calib {verb}`" in page
    assert "legacy" not in page
