"""The verbs of issue #20 through the command line: cluster, plan --job, predict/plot --job with stragglers and
failures, --chrome, and the default store and cluster set once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from hops_calib.cli import app

REPO = Path(__file__).resolve().parent.parent
CPU_JOB = REPO / "traces" / "cpu_1f1b_l4_h512_s256_m4_run1"


def cli(*args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def test_cluster_writes_a_file_predict_and_plan_read(shared_runs, tmp_path):
    out = tmp_path / "cluster.yaml"
    result = cli("cluster", shared_runs, "--out", out)
    assert result.exit_code == 0, result.output
    assert out.is_file() and "6 hosts, 6 devices" in result.stdout
    bad = cli("cluster", tmp_path / "nothing-here", "--out", tmp_path / "c.yaml", "--json")
    assert bad.exit_code == 2 and json.loads(bad.stdout)["error"]["problem"] == "does not exist"
    assert not (tmp_path / "c.yaml").exists()
    plan = cli("plan", "--job", shared_runs / "exp2_9_g_only_pp4_run65", "--cluster", out, "--schedule", "1f1b",
               "--keep-split", "--keep-micro-batch", "--top", "2", "--json")
    assert plan.exit_code == 0, plan.output
    data = json.loads(plan.stdout)
    assert data["search"] == "exhaustive" and data["space"] == 24 and len(data["best"]) == 2
    assert data["best"][0]["throughput_samples_per_s"] >= data["current"]["throughput_samples_per_s"]
    assert all(isinstance(flag, str) for flag in data["best"][0]["flags"])


def test_plan_job_text_and_its_bad_options(tmp_path):
    result = cli("plan", "--job", CPU_JOB, "--top", "2")
    assert result.exit_code == 0, result.output
    assert "search exhaustive" in result.stdout and "now" in result.stdout and "sched. bubble %" in result.stdout
    mixed = cli("plan", "--job", CPU_JOB, "--stages", "4")
    assert mixed.exit_code == 2 and "--stages" in mixed.output
    abstract = cli("plan", "--stages", "4", "--microbatches", "8")
    assert abstract.exit_code == 2 and "--memory-budget" in abstract.output
    slow = cli("plan", "--job", CPU_JOB, "--slow-device", "cpu_node0_core9:1.1")
    assert slow.exit_code == 2 and "cpu_node0_core9" in slow.output
    memory = cli("plan", "--job", CPU_JOB, "--device-memory", "cpu:-1")
    assert memory.exit_code == 2 and "--device-memory" in memory.output


def test_predict_job_under_a_slow_device_and_failures(tmp_path):
    nominal = json.loads(cli("predict", "--job", CPU_JOB, "--json").stdout)["predictions"][0]
    slowed = cli("predict", "--job", CPU_JOB, "--slow-device", "1:1.2", "--failure-rate", "2", "--recovery-s", "30",
                 "--samples", "8", "--json")
    assert slowed.exit_code == 0, slowed.output
    data = json.loads(slowed.stdout)
    drawn = data["predictions"][0]["perturbed_throughput_per_s"]
    assert drawn["draws"] == 8 and drawn["p5"] <= drawn["mean"] < nominal["throughput_per_s"]
    assert "1.2x slower" in data["perturbations"] and "fails 2/h" in data["perturbations"]
    refused = cli("predict", "--job", CPU_JOB, "--stragglers", "2:1:1")
    assert refused.exit_code == 2 and "probability" in refused.output
    on_fixture = cli("predict", "cpu_1f1b_l4_h512_s256_m4_run1", "--fixtures", REPO / "fixtures",
                     "--slow-device", "0:1.1")
    assert on_fixture.exit_code == 2 and "applies to --job" in on_fixture.output


def test_plot_timeline_writes_a_chrome_trace_beside_the_picture(tmp_path):
    picture, trace = tmp_path / "t.png", tmp_path / "t.json"
    result = cli("plot", "timeline", "cpu_1f1b_l4_h512_s256_m4_run1", "--fixtures", REPO / "fixtures", "--out",
                 picture, "--chrome", trace)
    assert result.exit_code == 0, result.output
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"Real run (trace)", next(n for n in names if n.startswith("Predicted by model"))}
    what_if = cli("plot", "timeline", "--job", CPU_JOB, "--slow-device", "1:1.3", "--out", tmp_path / "w.png",
                  "--chrome", tmp_path / "w.json")
    assert what_if.exit_code == 0, what_if.output
    panels = [e["args"]["name"] for e in json.loads((tmp_path / "w.json").read_text())["traceEvents"]
              if e["ph"] == "M" and e["name"] == "process_name"]
    assert len(panels) == 2 and "slowed" in panels[1]
    wrong = cli("plot", "timeline", "--job", CPU_JOB, "--out", tmp_path / "x.png", "--chrome", tmp_path / "x.txt")
    assert wrong.exit_code == 2 and not (tmp_path / "x.png").exists()


def test_the_default_store_is_set_once(tmp_path, monkeypatch):
    store = tmp_path / "store"
    shutil.copytree(REPO / "fixtures", store)
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("HOPS_CALIB_FIXTURES", raising=False)
    missing = cli("evaluate", "--json")  # ./fixtures of an empty folder: no store
    assert missing.exit_code == 2
    (elsewhere / "hops-calib.toml").write_text(f'[defaults]\nfixtures = "{store}"\n')
    found = cli("evaluate", "--json")
    assert found.exit_code == 0, found.output
    assert json.loads(found.stdout)["runs"] and len(json.loads(found.stdout)["runs"]) == 6
    (elsewhere / "hops-calib.toml").write_text('[defaults]\nfixture = "x"\n')
    bad = cli("evaluate")
    assert bad.exit_code == 2 and "'defaults.fixture'" in bad.output  # the project file's line, named
    monkeypatch.setenv("HOPS_CALIB_FIXTURES", str(store))
    (elsewhere / "hops-calib.toml").unlink()
    assert cli("observe", "--json").exit_code == 0
