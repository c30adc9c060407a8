"""The verbs of issue #20 through the command line: cluster, plan --job, predict/plot --job with stragglers and
failures, --chrome, and the default store and cluster set once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from hops_calib.cli import app

REPO = Path(__file__).resolve().parents[2]
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
               "--keep-split", "--keep-micro-batch", "--keep-levers", "--top", "2", "--json")
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
    # a long run (the launch's own --train-iters is a few iterations, which a failure at 2/h seldom strikes: its
    # draws' 5th percentile then lies above the expectation, which counts the rare failure's whole cost)
    slowed = cli("predict", "--job", CPU_JOB, "--slow-device", "1:1.2", "--failure-rate", "2", "--recovery-s", "30",
                 "--samples", "8", "--run-iterations", "1000", "--json")
    assert slowed.exit_code == 0, slowed.output
    data = json.loads(slowed.stdout)
    drawn = data["predictions"][0]["perturbed_throughput_per_s"]
    assert drawn["draws"] == 8 and drawn["p5"] <= drawn["expected"] < nominal["throughput_per_s"]
    low, high = drawn["expected_ci95"]
    assert low <= drawn["expected"] <= high
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
    # iterations numbered alike in the real run, its prediction and a what-if (a trace's first iteration)
    firsts = [min(e["args"]["iteration"] for e in json.loads(path.read_text())["traceEvents"]
                  if e["ph"] == "X" and e["pid"] == pid) for path, pid in ((trace, 1), (trace, 2),
                                                                           (tmp_path / "w.json", 1))]
    assert len(set(firsts)) == 1
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
    from hops_calib.store import FixtureStore

    assert {r["run_id"] for r in json.loads(found.stdout)["runs"]} == set(FixtureStore(store).ids("train"))
    (elsewhere / "hops-calib.toml").write_text('[defaults]\nfixture = "x"\n')
    bad = cli("evaluate")
    assert bad.exit_code == 2 and "'defaults.fixture'" in bad.output  # the project file's line, named
    monkeypatch.setenv("HOPS_CALIB_FIXTURES", str(store))
    (elsewhere / "hops-calib.toml").unlink()
    assert cli("observe", "--json").exit_code == 0


def _line_of(text: str, needle: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), start=1) if needle in line)


def test_cluster_check_names_the_line_of_the_bad_entry(shared_runs, tmp_path):
    built = tmp_path / "cluster.yaml"
    assert cli("cluster", shared_runs, "--out", built).exit_code == 0
    good = cli("cluster", "--check", built, "--json")
    assert good.exit_code == 0, good.output
    assert len(json.loads(good.stdout)["links"]) == 21
    text = built.read_text()
    hosts = [node["host"] for node in json.loads(good.stdout)["nodes"]]
    # a hand-written node and a link whose key is misspelt, at the end of the file (after every nodes line)
    hand = text.replace("links:\n", f"- host: g-new-1\n  devices: [{{id: new_gpu0, gpu: a10g}}]\nlinks:\n", 1)
    hand += f"- hosts: [g-new-1, {hosts[0]}]\n  bandwith_gbit_s: 5\n"
    (tmp_path / "typo.yaml").write_text(hand)
    typo = cli("cluster", "--check", tmp_path / "typo.yaml", "--json")
    error = json.loads(typo.stdout)["error"]
    assert typo.exit_code == 2 and error["field"] == "links[21].bandwith_gbit_s"
    assert error["line"] == _line_of(hand, "bandwith_gbit_s")
    negative = hand.replace("bandwith_gbit_s: 5", "bandwidth_gbit_s: -5")
    (tmp_path / "negative.yaml").write_text(negative)
    error = json.loads(cli("cluster", "--check", tmp_path / "negative.yaml", "--json").stdout)["error"]
    assert error["field"] == "links[21].bandwidth_gbit_s" and error["line"] == _line_of(negative, "-5")
    twice = text.replace(f"- host: {hosts[1]}", f"- host: {hosts[0]}", 1)
    (tmp_path / "twice.yaml").write_text(twice)
    error = json.loads(cli("cluster", "--check", tmp_path / "twice.yaml", "--json").stdout)["error"]
    assert error["field"] == "nodes[1].host" and error["line"] == [
        n for n, line in enumerate(twice.splitlines(), start=1) if f"host: {hosts[0]}" in line][1]
    assert cli("cluster", "--check", built, shared_runs).exit_code == 2


def test_a_default_cluster_is_named_turned_off_and_not_applied_to_other_machines(shared_runs, tmp_path,
                                                                                  monkeypatch):
    built = tmp_path / "cluster.yaml"
    assert cli("cluster", shared_runs, "--out", built).exit_code == 0
    job = shared_runs / "exp2_9_g_only_pp4_run65"
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HOPS_CALIB_CLUSTER", raising=False)
    (tmp_path / "hops-calib.toml").write_text(f'[defaults]\ncluster = "{built}"\n')
    used = json.loads(cli("predict", "--job", job, "--json").stdout)
    assert used["cluster"].startswith(str(built)) and "hops-calib.toml" in used["cluster"]
    off = json.loads(cli("predict", "--job", job, "--no-cluster", "--json").stdout)
    empty = json.loads(cli("predict", "--job", job, "--json", env={"HOPS_CALIB_CLUSTER": ""}).stdout)
    assert off["cluster"] is None and empty["cluster"] is None
    assert any("no cluster given" in note for note in off["notes"])
    # the shared cluster lists no CPU core: as a default it is not applied to the CPU capture, and says so
    cpu = json.loads(cli("predict", "--job", CPU_JOB, "--json").stdout)
    assert cpu["cluster"] is None and any("not applied" in note for note in cpu["notes"])
    plan = json.loads(cli("plan", "--job", CPU_JOB, "--top", "1", "--keep-order", "--keep-split", "--json").stdout)
    assert plan["cluster"] is None and any("not applied" in note for note in plan["notes"])
    assert str(tmp_path / "fixtures") in plan["fixtures"]  # the store it looked for is named, even when absent
    # --slow-link on a pair that is no hop (here the pipeline's ends) is refused, not silently ignored
    ends = cli("predict", "--job", job, "--slow-link", "0-3:2")
    assert ends.exit_code == 2 and "ends" in ends.output
    hop = json.loads(cli("predict", "--job", job, "--slow-link", "1-2:3", "--json").stdout)
    assert hop["predictions"][0]["perturbed_throughput_per_s"]["expected"] < used["predictions"][0]["throughput_per_s"]


def test_usage_and_input_errors_share_one_prefix(tmp_path):
    usage = cli("plan", "--stages", "4", "--microbatches", "8")  # click's usage error
    bad = cli("cluster", "--check", tmp_path / "missing.yaml")  # the project's input error
    assert usage.exit_code == bad.exit_code == 2
    assert "Error" in usage.output and bad.stderr.startswith("Error: ")
    assert "required there" in cli("plan", "abstract", "--help").stdout  # the abstract plan's required options say so
    memory = cli("plan", "--job", CPU_JOB, "--device-memory", "cpu:512GiB", "--top", "1", "--keep-order",
                 "--keep-split", "--json")
    assert memory.exit_code == 0 and json.loads(memory.stdout)["current"]["memory_bytes_per_gpu"][0] == 512 * 2 ** 30


def test_plan_refuses_an_option_its_way_of_planning_does_not_read():
    """plan has three ways (abstract; --job's order/split/schedule search; --job --parallel's layout search): an
    option given to a way that ignores it is refused naming it, the way that reads it and what to do, instead of a
    plan that silently searched without it (--parallel --keep-order ran the full layout search)."""
    abstract = ("--stages", "4", "--microbatches", "8", "--memory-budget", "4")
    for way, option, reads in (
            (("--job", CPU_JOB, "--parallel"), ("--keep-order",), "without --parallel"),
            (("--job", CPU_JOB, "--parallel"), ("--schedule", "1f1b"), "without --parallel"),
            (("--job", CPU_JOB, "--parallel"), ("--trials", "5"), "without --parallel"),
            (("--job", CPU_JOB, "--parallel"), ("--device-memory", "cpu:1GiB"), "without --parallel"),
            (("--job", CPU_JOB, "--parallel"), ("--slow-device", "cpu_node0_core0:1.1"), "without --parallel"),
            (("--job", CPU_JOB, "--parallel"), ("--fixtures", REPO / "fixtures"), "without --parallel"),
            (("--job", CPU_JOB, "--parallel"), ("--chunks", "2"), "abstract plan"),
            (abstract, ("--parallel",), "--job DIR --parallel"),
            (abstract, ("--keep-order",), "without --parallel"),
            (abstract, ("--top", "3"), "--job DIR"),
            (("--job", CPU_JOB), ("--chunks", "2"), "abstract plan"),
            (("--job", CPU_JOB), ("--target-bubble", "0.1"), "abstract plan")):
        result = cli("plan", *way, *option)
        assert result.exit_code == 2, (way, option, result.output)
        said = " ".join(result.output.replace("│", " ").split())  # rich boxes the message on a terminal
        assert option[0] in said and reads in said and f"Drop {option[0]}" in said, said
    # every option of plan is read by some way (a new one must be listed where it is read, else it is refused)
    from typer.main import get_command

    from hops_calib.cli.plan import _PLAN_WAYS
    from hops_calib.cli.verbs import LEGACY

    params = {p.name for p in get_command(app).commands["plan"].commands[LEGACY].params}  # the old spelling's
    assert params == set().union(*(reads for _, reads in _PLAN_WAYS.values()))
    # each way still takes its own options
    assert cli("plan", *abstract, "--chunks", "2", "--json").exit_code == 0
    assert cli("plan", "--job", CPU_JOB, "--parallel", "--top", "1", "--json").exit_code == 0


def test_a_device_outside_the_job_is_refused_with_the_stages_and_ids_it_has(tmp_path):
    """--slow-device 9:1.1 on docs/whatif.md's 8-stage GPU job: the refusal says stage 9 is outside its stages 0-7 and
    names the device ids too (it had said only "'9' is no device of the job"); a wrong id and a wrong link end
    say the same range."""
    from job_copies import readme_gpu_job

    from hops_calib.trace import read_stage_map

    job, _ = readme_gpu_job(tmp_path)
    ids = read_stage_map(job)
    last = len(ids) - 1
    valid = f"a stage number 0-{last} ({len(ids)} stages) or a device id of the stage map ({', '.join(ids)})"
    stage = cli("predict", "--job", job, "--slow-device", f"{len(ids) + 1}:1.1")
    assert stage.exit_code == 2
    assert f"stage {len(ids) + 1} is outside the job's stages 0-{last}; name {valid}" in stage.stderr
    planned = cli("plan", "--job", job, "--slow-device", "1:1.1")  # a plan reorders the stages: ids only
    assert planned.exit_code == 2 and "a stage number names none); name a device id of the stage map" in planned.stderr
    named = cli("predict", "--job", job, "--slow-device", "gpu99:1.1")
    assert named.exit_code == 2 and f"'gpu99' is no device of the job; name {valid}" in named.stderr
    link = cli("predict", "--job", job, "--slow-link", f"{last}-{last + 2}:2")
    assert link.exit_code == 2 and f"each end {valid}" in link.stderr
    inside = cli("predict", "--job", job, "--slow-device", f"{last}:1.1", "--json")
    assert inside.exit_code == 0, inside.output


def test_failures_strike_the_launchs_own_run_length(tmp_path):
    """--failure-rate on docs/whatif.md's GPU job (--train-iters 100) priced failures over 1000 iterations: now over the
    launch's --train-iters, said so, unless --run-iterations says otherwise (and then that is said)."""
    from job_copies import readme_gpu_job

    from hops_calib.trace.megatron_args import find_launch

    job, _ = readme_gpu_job(tmp_path)
    train_iters = find_launch(job).args["train_iters"]
    assert train_iters != 1000  # the old default: this job tells them apart

    def perturbed(*extra):
        result = cli("predict", "--job", job, "--failure-rate", "0.5", "--recovery-s", "300", "--json", *extra)
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        return data["perturbations"], data["predictions"][0]["perturbed_throughput_per_s"]

    said, own = perturbed()
    assert f"over {train_iters} iterations (the launch's --train-iters, megatron_args.txt)" in said
    said_given, given = perturbed("--run-iterations", train_iters)
    assert f"over {train_iters} iterations (--run-iterations)" in said_given and given == own
    said_long, longer = perturbed("--run-iterations", 1000)
    assert "over 1000 iterations (--run-iterations)" in said_long and longer["p5"] != own["p5"]
    text = cli("predict", "--job", job, "--failure-rate", "0.5")
    assert text.exit_code == 0 and f"over {train_iters} iterations (the launch's --train-iters" in text.stdout
