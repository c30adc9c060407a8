"""Start-up: a verb imports only what it uses. Each case runs the command in a fresh interpreter, on the shipped CPU
store, and reads which libraries ended up in `sys.modules` when it exits (behaviour, not timing: the figures are
benchmarks/evaluate.py's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hops_calib.store import FixtureStore

REPO = Path(__file__).resolve().parents[2]
# Imported by the verbs that read events, tune, cross-validate, draw or capture; never by the ones below.
HEAVY = {"pandas", "scipy", "optuna", "matplotlib", "torch", "megatron", "sklearn"}
# What the command layer alone needs: no array library either.
NUMERIC = {"numpy", "pyarrow", *HEAVY}

# Run the CLI as `python -m hops_calib` does and, at exit, write the top-level packages it imported.
PROBE = """
import atexit, json, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(sorted({name.split(".")[0] for name in sys.modules}))))
sys.argv[0] = "hops-calib"
from hops_calib.cli import main
main()
"""


def run_verb(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    out = tmp_path / "modules.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", PROBE, str(out), *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)
    return done, set(json.loads(out.read_text()))


def train_ids() -> list[str]:
    return FixtureStore(REPO / "fixtures").ids("train")


@pytest.mark.parametrize("args", [("--help",), ("version",), ("ledger", "--help"), ("evaluate", "--help")])
def test_help_and_version_import_no_numeric_library(tmp_path: Path, args: tuple[str, ...]):
    done, loaded = run_verb(tmp_path, *args)
    assert done.returncode == 0, done.stderr
    assert "hops_calib" in loaded and (args == ("version",) or "Usage" in done.stdout)
    assert not loaded & NUMERIC, f"{' '.join(args)} imported {sorted(loaded & NUMERIC)}"


def test_evaluate_scores_the_store_without_pandas(tmp_path: Path):
    done, loaded = run_verb(tmp_path, "evaluate", "--fixtures", "fixtures", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["n_fixtures"] == len(train_ids())
    assert "numpy" in loaded  # the simulator ran
    assert not loaded & HEAVY, f"evaluate imported {sorted(loaded & HEAVY)}"


@pytest.mark.parametrize("verb", ["predict", "predict --job", "terms", "plan", "ledger verify", "fixtures list",
                                  "fixtures show"])
def test_light_verbs_import_no_heavy_library(tmp_path: Path, verb: str):
    fixture_id = train_ids()[0]
    args = {"predict": ("predict", fixture_id, "--fixtures", "fixtures", "--json"),
            "predict --job": ("predict", "--job", f"traces/{fixture_id}", "--fixtures", "fixtures", "--json"),
            "terms": ("terms",),
            "plan": ("plan", "--stages", "4", "--microbatches", "8", "--memory-budget", "4", "--json"),
            "ledger verify": ("ledger", "verify"),
            "fixtures list": ("fixtures", "list", "--fixtures", "fixtures", "--json"),
            "fixtures show": ("fixtures", "show", fixture_id, "--fixtures", "fixtures", "--json")}[verb]
    done, loaded = run_verb(tmp_path, *args)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert not loaded & HEAVY, f"{verb} imported {sorted(loaded & HEAVY)}"
