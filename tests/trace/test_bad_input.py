"""Bad job directories: each is refused with file, line, field and a fix; good runs still land; --lenient drops lines.

Every case copies ONE real run into tmp_path and corrupts the copy.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.store import FixtureStore
from hops_calib.store.ingest import ingest


@pytest.fixture(scope="module")
def smallest_run(shared_runs) -> Path:
    """The real run with the fewest bytes (quick to copy and ingest)."""
    return min((d for d in shared_runs.iterdir() if d.is_dir()),
               key=lambda d: sum(f.stat().st_size for f in d.rglob("*") if f.is_file()))


@pytest.fixture
def run_copy(smallest_run, tmp_path) -> Path:
    target = tmp_path / "runs" / smallest_run.name
    shutil.copytree(smallest_run, target)
    for path in [target, *target.rglob("*")]:  # the shared copy is read-only
        path.chmod(0o755 if path.is_dir() else 0o644)
    return target


def _rank_log(job_dir: Path, rank: int = 1) -> Path:
    return job_dir / "megatron_trace" / f"rank{rank}.jsonl"


def _edit_line(path: Path, number: int, edit) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines[number - 1] = edit(lines[number - 1])
    path.write_text("".join(lines))


def _edit_event(path: Path, number: int, **changes) -> None:
    def edit(line: str) -> str:
        event = json.loads(line)
        event.update(changes)
        return json.dumps(event) + "\n"

    _edit_line(path, number, edit)


def _refused(job_dir: Path, tmp_path: Path, **kwargs) -> str:
    store = FixtureStore(tmp_path / "fixtures")
    report = ingest([job_dir], store, **kwargs)
    assert not report.ok and len(report.rejected) == 1
    # Nothing half-written: no fixture folder, no temporary leftovers.
    leftovers = [p.name for p in store.root.iterdir() if p.name not in (".lock",)] if store.root.exists() else []
    assert leftovers == []
    return report.rejected[0].error


def _names(message: str, path: Path, line: int | None, field: str | None) -> None:
    location = f"{path}:{line}" if line is not None else str(path)
    assert location in message, message
    if line is not None:
        assert not re.search(rf"{re.escape(str(path))}:{line}\d", message), message
    if field is not None:
        assert f"field '{field}'" in message, message
    assert "; " in message, f"no advice in: {message}"


def test_malformed_json_line(run_copy, tmp_path):
    log = _rank_log(run_copy)
    _edit_line(log, 5, lambda line: line[: len(line) // 2] + "\n")
    message = _refused(run_copy, tmp_path)
    _names(message, log, 5, None)
    assert "not valid JSON" in message and "--lenient" in message


def test_truncated_last_line(run_copy, tmp_path):
    log = _rank_log(run_copy, 0)
    text = log.read_text()
    log.write_text(text[: len(text) - 40])  # cut the last record (and its newline)
    message = _refused(run_copy, tmp_path)
    _names(message, log, len(text.splitlines()), None)
    assert "truncated last line" in message


@pytest.mark.parametrize("changes,field,words", [
    ({"phase": "SIDEWAYS"}, "phase", "unknown value 'SIDEWAYS'"),
    ({"event_type": "memcpy"}, "event_type", "unknown value 'memcpy'"),
    ({"start_wall_ns": 2_000_000_000_000_000_000, "end_wall_ns": 1_000_000_000_000_000_000}, "end_wall_ns",
     "before start_wall_ns"),
    ({"stage": 7}, "stage", "pipeline stages"),
    ({"iteration": "three"}, "iteration", "non-negative integer"),
])
def test_bad_field_names_the_line_and_field(run_copy, tmp_path, changes, field, words):
    log = _rank_log(run_copy)
    _edit_event(log, 9, **changes)
    message = _refused(run_copy, tmp_path)
    _names(message, log, 9, field)
    assert words in message


def test_missing_field(run_copy, tmp_path):
    log = _rank_log(run_copy)

    def drop_phase(line: str) -> str:
        event = json.loads(line)
        del event["phase"]
        return json.dumps(event) + "\n"

    _edit_line(log, 3, drop_phase)
    message = _refused(run_copy, tmp_path)
    _names(message, log, 3, "phase")
    assert "is missing" in message


def test_rank_with_no_events(run_copy, tmp_path):
    log = _rank_log(run_copy, 0)
    log.write_text("")
    message = _refused(run_copy, tmp_path)
    _names(message, log, None, None)
    assert "has no events" in message


@pytest.mark.parametrize("name,field", [("hops_trace_map.json", "stages"), ("megatron_args.txt", "megatron arguments"),
                                        ("hops.base.yaml", "hardware.devices")])
def test_missing_map_configuration_or_device_types(run_copy, tmp_path, name, field):
    (run_copy / name).unlink()
    message = _refused(run_copy, tmp_path)
    _names(message, run_copy / name, None, field)
    assert "missing" in message


def test_stage_counts_disagree_between_configuration_and_map(run_copy, tmp_path):
    args = run_copy / "megatron_args.txt"
    pp = int(re.search(r"--pipeline-model-parallel-size (\d+)", args.read_text()).group(1))
    args.write_text(args.read_text().replace(f"--pipeline-model-parallel-size {pp}",
                                             f"--pipeline-model-parallel-size {pp + 1}"))
    message = _refused(run_copy, tmp_path)
    _names(message, run_copy / "hops_trace_map.json", None, "stages")
    assert "must agree" in message


@pytest.mark.parametrize("flag, value, needle", [
    ("--global-batch-size", "0", "is 0, expected a whole number of at least 1"),
    ("--pipeline-model-parallel-size", "two", "is 'two', expected a whole number of at least 1"),
    ("--num-layers", "7", "cannot be split evenly over"),
    ("--micro-batch-size", "0", "is 0, expected a whole number of at least 1"),
    ("--hidden-size", "0", "is 0, expected a whole number of at least 1"),
    ("--seq-length", "0", "is 0, expected a whole number of at least 1"),
    ("--vocab-size", "0", "is 0, expected a whole number of at least 1"),
    ("--ffn-hidden-size", "0", "is 0, expected a whole number of at least 1"),
    ("--num-attention-heads", "7", "does not divide --hidden-size"),
    ("--seq-length", "999999", "is more than --max-position-embeddings"),
])
def test_impossible_launch_values_name_the_flag(run_copy, tmp_path, flag, value, needle):
    args = run_copy / "megatron_args.txt"
    text = args.read_text()
    args.write_text(re.sub(rf"{flag} \S+", f"{flag} {value}", text, count=1))
    message = _refused(run_copy, tmp_path)
    _names(message, args, None, "--num-layers" if flag == "--num-layers" else flag)
    assert needle in message and "first=None" not in message


@pytest.mark.parametrize("value, needle", [("two", "is 'two', expected a non-negative integer"),
                                           ("-2", "is -2, expected a non-negative integer")])
def test_a_pinned_first_stage_must_be_a_layer_count(run_copy, tmp_path, value, needle):
    args = run_copy / "megatron_args.txt"
    args.write_text(args.read_text().rstrip("\n") + f" --decoder-first-pipeline-num-layers {value}\n")
    message = _refused(run_copy, tmp_path)
    _names(message, args, None, "--decoder-first-pipeline-num-layers")
    assert needle in message


def test_stage_counts_disagree_between_configuration_and_trace(run_copy, tmp_path):
    _rank_log(run_copy, 1).unlink()
    message = _refused(run_copy, tmp_path)
    _names(message, run_copy / "megatron_trace", None, "rank<r>.jsonl")
    assert "disagree" in message


def test_run_id_that_would_escape_the_store(run_copy, tmp_path):
    manifest = run_copy / "manifest.yaml"
    manifest.write_text(manifest.read_text() + "run_id: ../../escaped\n")
    message = _refused(run_copy, tmp_path)
    assert "'../../escaped'" in message and "escape" in message
    assert not (tmp_path / "escaped").exists() and not (tmp_path.parent / "escaped").exists()


def test_one_bad_run_is_rejected_the_others_land_and_the_exit_code_says_so(run_copy, smallest_run, shared_runs,
                                                                         tmp_path):
    other = next(d for d in sorted(shared_runs.iterdir()) if d.name != smallest_run.name)
    shutil.copytree(other, run_copy.parent / other.name)
    log = _rank_log(run_copy, 0)
    log.write_text(log.read_text()[:-40])
    store_dir = tmp_path / "fixtures"
    result = CliRunner().invoke(app, ["ingest", str(run_copy.parent), "--fixtures", str(store_dir)])
    assert result.exit_code == 6  # partial: its own exit code (#22), not 1 (rejected)
    assert f"{log}:" in result.stderr and "truncated last line" in result.stderr
    assert FixtureStore(store_dir).ids() == [other.name]
    assert "1 new" in result.stdout and "1 rejected" in result.stdout
    # --json: one object with the status, every run's outcome and the warnings (not only on stderr)
    again = CliRunner().invoke(app, ["ingest", str(run_copy.parent), "--fixtures", str(store_dir), "--json"])
    assert again.exit_code == 6
    data = json.loads(again.stdout)
    assert data["status"] == "partial" and data["rejected"] == 1 and data["unchanged"] == 1
    [bad] = [r for r in data["runs"] if r["status"] == "rejected"]
    assert f"{log}:" in bad["error"] and "truncated last line" in bad["error"]
    assert all(isinstance(w, str) for w in data["warnings"])


def test_lenient_drops_bad_lines_and_counts_them(run_copy, tmp_path):
    log = _rank_log(run_copy)
    _edit_line(log, 5, lambda line: line[:20] + "\n")
    _edit_event(log, 9, phase="SIDEWAYS")
    _edit_event(log, 11, start_wall_ns=2_000_000_000_000_000_000)
    last = _rank_log(run_copy, 0)
    last.write_text(last.read_text()[:-40])
    store = FixtureStore(tmp_path / "fixtures")
    report = ingest([run_copy], store, lenient=True)
    assert report.ok, report.rejected
    fixture = store.load(run_copy.name)
    quality = fixture.quality
    assert quality["lenient"] is True and quality["dropped_lines"] == 4
    assert quality["dropped"][log.name] == {"malformed JSON": 1, "bad phase": 1, "bad end_wall_ns": 1}
    assert quality["dropped"][last.name] == {"truncated last line": 1}
    # the lines dropped from rank 1 leave early iterations incomplete between complete ones: kept, and flagged;
    # rank 0's cut last line was its last OPTIMIZER: that last iteration is incomplete at the end, and dropped
    early = {json.loads(_rank_log(run_copy).read_text().splitlines()[n - 1])["iteration"] for n in (9, 11)}
    assert early <= set(quality["incomplete_iterations"])
    whole_lines = [json.loads(line) for p in sorted((run_copy / "megatron_trace").iterdir())
                   for line in p.read_text().splitlines() if line.endswith("}")]
    last = max(e["iteration"] for e in whole_lines)
    assert quality["dropped_iterations"] == [last] and last not in set(fixture.events["iteration"])
    total_lines = sum(len(p.read_text().splitlines()) for p in (run_copy / "megatron_trace").iterdir())
    assert len(fixture.events) == total_lines - 4 - sum(e["iteration"] == last for e in whole_lines)
    assert store.index().set_index("id").loc[run_copy.name, "dropped_lines"] == 4


def test_a_log_cut_at_a_line_boundary_is_refused_or_trimmed_to_complete_iterations(run_copy, tmp_path):
    log = _rank_log(run_copy)
    lines = log.read_text().splitlines(keepends=True)
    keep = len(lines) * 3 // 4
    log.write_text("".join(lines[:keep]))  # every line whole: only the counts show what is missing
    cut_at = json.loads(lines[keep - 1])["iteration"]
    message = _refused(run_copy, tmp_path)
    _names(message, log, None, "iteration")
    assert "cut short" in message and "--lenient" in message
    store = FixtureStore(tmp_path / "lenient")
    report = ingest([run_copy], store, lenient=True)
    assert report.ok, report.rejected
    fixture = store.load(run_copy.name)
    dropped = fixture.quality["dropped_iterations"]
    all_iterations = {json.loads(line)["iteration"] for line in _rank_log(run_copy, 0).read_text().splitlines()}
    assert dropped and min(dropped) <= cut_at + 1 and max(dropped) == max(all_iterations)
    assert set(fixture.events["iteration"]) == all_iterations - set(dropped)
    assert any("dropped iteration" in w for w in report.outcomes[0].warnings)


@pytest.mark.parametrize("case", ["repeat", "microbatch", "chunk", "clock", "backwards"])
def test_events_that_do_not_add_up_are_refused_with_the_line(run_copy, tmp_path, case):
    log = _rank_log(run_copy)
    lines = log.read_text().splitlines(keepends=True)
    events = [json.loads(line) for line in lines]
    first_forward = next(n for n, e in enumerate(events, 1) if e["phase"] == "FORWARD" and e["event_type"] == "compute")
    if case == "repeat":
        log.write_text("".join(lines) + lines[first_forward - 1])
        line, field, words = len(lines) + 1, "phase", f"first on line {first_forward}"
    elif case == "microbatch":
        _edit_event(log, first_forward, microbatch=99)
        line, field, words = first_forward, "microbatch", "is 99 but there are"
    elif case == "chunk":
        _edit_event(log, first_forward, model_chunk=1)
        line, field, words = first_forward, "model_chunk", "virtual-pipeline"
    elif case == "clock":  # rank 1 (stage 1) 50 ms early: it would start forwards before stage 0 finished them
        shift = 50_000_000
        log.write_text("".join(json.dumps({**e, "start_wall_ns": e["start_wall_ns"] - shift,
                                           "end_wall_ns": e["end_wall_ns"] - shift}) + "\n" for e in events))
        line, field, words = first_forward, "start_wall_ns", "--clock-skew-ms"
    else:  # the last iteration of rank 1 moved a minute back in time
        last = max(e["iteration"] for e in events)
        back = 60_000_000_000
        log.write_text("".join(json.dumps({**e, "start_wall_ns": e["start_wall_ns"] - back,
                                           "end_wall_ns": e["end_wall_ns"] - back} if e["iteration"] == last else e)
                               + "\n" for e in events))
        line = next(n for n, e in enumerate(events, 1) if e["iteration"] == last and e["event_type"] == "compute")
        field, words = "start_wall_ns", "go backwards"
    message = _refused(run_copy, tmp_path)
    _names(message, log, line, field)
    assert words in message, message
    if case == "clock":  # the allowance is the user's to widen, and the run then lands
        store = FixtureStore(tmp_path / "skewed")
        assert ingest([run_copy], store, skew_ms=60.0).ok


def test_a_run_rejected_now_says_the_store_keeps_its_earlier_fixture(run_copy, tmp_path):
    log = _rank_log(run_copy)
    _edit_event(log, 9, phase="SIDEWAYS")
    store = FixtureStore(tmp_path / "fixtures")
    assert ingest([run_copy], store, lenient=True).ok  # the bad line dropped: a fixture lands
    again = ingest([run_copy], store)  # without --lenient the same files are refused
    [outcome] = again.rejected
    assert "bad phase" in outcome.error or "SIDEWAYS" in outcome.error
    assert "the store keeps the fixture an earlier ingest made" in outcome.error
    assert str(store.root / run_copy.name) in outcome.error and store.ids() == [run_copy.name]
    # doing what it says: the folder deleted, the same bad files ingested again, the index follows the folders
    shutil.rmtree(store.root / run_copy.name)
    third = ingest([run_copy], store)
    assert len(third.rejected) == 1 and "earlier ingest" not in third.rejected[0].error
    assert store.ids() == [] and store.fixture_folders() == []


def test_lenient_still_refuses_structural_problems(run_copy, tmp_path):
    _rank_log(run_copy, 0).write_text("not json at all\n")
    message = _refused(run_copy, tmp_path, lenient=True)
    assert "has no events after dropping 1 bad lines" in message


@pytest.mark.parametrize("name", ["hops.base.yaml", "manifest.yaml"])
def test_malformed_yaml_names_file_and_line(run_copy, tmp_path, name):
    path = run_copy / name
    lines = path.read_text().splitlines()
    lines.insert(2, "  bad: [unclosed")
    path.write_text("\n".join(lines) + "\n")
    message = _refused(run_copy, tmp_path)
    assert str(path) in message and "not valid YAML" in message and "fix the YAML syntax" in message
    assert re.search(rf"{re.escape(str(path))}:\d+", message)  # the line the parser stopped at


@pytest.mark.parametrize("name,empty_ok", [("hops.base.yaml", False), ("manifest.yaml", True)])
def test_an_empty_template_is_refused_an_empty_manifest_is_no_provenance(run_copy, tmp_path, name, empty_ok):
    (run_copy / name).write_text("")
    if empty_ok:
        store_dir = tmp_path / "fixtures"
        result = CliRunner().invoke(app, ["ingest", str(run_copy), "--fixtures", str(store_dir)])
        assert result.exit_code == 0, result.output
    else:
        message = _refused(run_copy, tmp_path)
        assert str(run_copy / name) in message and "is not a YAML mapping" in message


@pytest.mark.parametrize("name, words", [("pair_0_5.jsonl", "names stage 5"), ("pair_1_3.jsonl", "names stage 3")])
def test_a_link_benchmark_of_stages_the_pipeline_lacks_is_refused(run_copy, tmp_path, name, words):
    bench = run_copy / "calibration" / "link_bench"
    shutil.copy(bench / "pair_0_1.jsonl", bench / name)
    message = _refused(run_copy, tmp_path)
    _names(message, bench / name, None, "pair_<i>_<j>")
    assert words in message


def test_misnamed_and_missing_link_files_are_named(run_copy, tmp_path):
    bench = run_copy / "calibration" / "link_bench"
    (bench / "pair_0_1.jsonl").rename(bench / "pair01.jsonl")
    report = ingest([run_copy], FixtureStore(tmp_path / "fixtures"), split="train")
    assert report.ok
    warnings = " ".join(report.outcomes[0].warnings)
    assert "ignored pair01.jsonl" in warnings and "no link fits" in warnings
    # such a run lands (its truth is sound) but is not predicted with a made-up link: one clear refusal
    # (an empty ledger of its own: the smallest shared run may be one the project's ledger holds out, and this test
    # is about the link, not the held-out guard)
    result = CliRunner().invoke(app, ["evaluate", "--fixtures", str(tmp_path / "fixtures"),
                                      "--ledger", str(tmp_path / "ledger.jsonl"), "--new-ledger"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "has no link benchmark" in " ".join(result.output.split())


def test_a_template_for_another_pipeline_is_refused(run_copy, tmp_path):
    import yaml

    path = run_copy / "hops.base.yaml"
    template = yaml.safe_load(path.read_text())
    template["pipeline"]["stages"].append(dict(template["pipeline"]["stages"][-1]))
    path.write_text(yaml.safe_dump(template))
    message = _refused(run_copy, tmp_path)
    _names(message, path, None, "pipeline.stages")


def test_a_launch_the_cost_model_does_not_price_is_refused_at_ingest(run_copy, tmp_path):
    args = run_copy / "megatron_args.txt"
    args.write_text(args.read_text().rstrip("\n") + " --num-experts 8 --moe-token-dispatcher-type flex\n")
    message = _refused(run_copy, tmp_path)
    _names(message, args, 1, "--moe-token-dispatcher-type")


def test_a_launcher_that_starts_replicas_needs_their_logs(run_copy, tmp_path):
    args = run_copy / "megatron_args.txt"
    pp = int(re.search(r"--pipeline-model-parallel-size (\d+)", args.read_text()).group(1))
    args.write_text(f"torchrun --nnodes 2 --nproc-per-node {pp} " + args.read_text())
    message = _refused(run_copy, tmp_path)
    _names(message, run_copy / "megatron_trace", None, "rank<r>.jsonl")
    assert f"{2 * pp} ranks ({pp} pipeline stages x tp 1 x dp 2: 0..{2 * pp - 1})" in message
