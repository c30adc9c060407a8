"""Issue #32: no printed or ledgered field of a test run lets its truth be computed, every verb that shows a run's
measurement goes through the held-out guard, and the inputs that were misread or unbounded are read as meant or
refused: each case on copies of the shared runs and tables, damaged in a temporary folder, asserting the exit code,
the message, and that nothing else changed."""

from __future__ import annotations

import csv
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hops_calib.store import FixtureStore
from job_copies import copy_job, scaled_copy, shifted_copy
from ledger_args import with_new_ledger

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
VTRAIN_ROWS = 40  # rows of the published vTrain table copied (its header and the first rows)


def cli(*args, new_ledger: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("HOPS_CALIB_PROGRESS", None)
    args = with_new_ledger(args) if new_ledger else [str(a) for a in args]
    return subprocess.run([sys.executable, "-m", "hops_calib", *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env)


def flat(text: str) -> str:
    return " ".join(text.split())


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` and its bytes (what "nothing else changed" compares)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()} \
        if root.exists() else {}


def vtrain_copy(folder: Path, scale_row: int | None = None, factor: float = 1.0, rows: int = VTRAIN_ROWS) -> Path:
    """The published vTrain table's header and first `rows` rows in `folder` (its all-reduce tables beside it), the
    iteration time of row `scale_row` times `factor`."""
    from conftest import need_public_runs

    source = need_public_runs("vtrain", "ground_truth_single.csv")
    folder.mkdir(parents=True, exist_ok=True)
    with source.open(newline="") as handle:
        table = list(csv.reader(handle))[:rows + 1]
    if scale_row is not None:
        table[scale_row + 1][-1] = repr(float(table[scale_row + 1][-1]) * factor)
    path = folder / "ground_truth_single.csv"
    with path.open("w", newline="") as handle:
        csv.writer(handle).writerows(table)
    shutil.copytree(source.parent / "allreduce-a100", folder / "allreduce-a100")
    return path


def without_paths(data, *roots: Path):
    """`data` with the temporary folders in its strings replaced by ROOT (two stores differ by their path)."""
    text = json.dumps(data, sort_keys=True)
    for root in roots:
        text = text.replace(str(root), "ROOT")
    return json.loads(text)


def entries(ledger: Path) -> list[dict]:
    return [json.loads(line) for line in ledger.read_text().splitlines()]


# --- held-out truth -------------------------------------------------------------------------------------------

def test_no_printed_or_ledgered_field_of_a_test_run_depends_on_its_measurement(tmp_path: Path):
    """Two stores of the same vTrain rows, one test row's iteration time x 1.001 in the second: what `fixtures list`
    and `fixtures show` print, what `ledger hold-out` and a test report write into the ledger (fixture set, run keys,
    held-out groups) are the same for both; the stores' own content hash of the row is keyed (no sha256 of the row)."""
    a_store, b_store = tmp_path / "a" / "fixtures", tmp_path / "b" / "fixtures"
    a_csv = vtrain_copy(tmp_path / "a" / "src")
    assert cli("ingest", a_csv, "--fixtures", a_store, "--split", "auto").returncode == 0
    store = FixtureStore(a_store)
    test_id = store.ids("test")[0]
    row = next(k for k, r in enumerate(store.rows()) if r["id"] == test_id)
    from hops_calib.trace.vtrain import read_vtrain_table

    order = [run.run_id for run in read_vtrain_table(a_csv).runs]
    b_csv = vtrain_copy(tmp_path / "b" / "src", order.index(test_id), 1.001)
    assert a_csv.read_text() != b_csv.read_text()
    assert cli("ingest", b_csv, "--fixtures", b_store, "--split", "auto").returncode == 0

    def printed(root: Path) -> dict:
        listing = json.loads(cli("fixtures", "list", "--fixtures", root, "--json").stdout)["fixtures"]
        shown = json.loads(cli("fixtures", "show", test_id, "--fixtures", root, "--json").stdout)
        ledger = root.parent / "ledger.jsonl"
        assert cli("ledger", "hold-out", "--fixtures", root, "--ledger", ledger).returncode == 0
        looked = cli("report", "--split", "test", "--fixtures", root, "--ledger", ledger, "--json")
        assert looked.returncode == 0, looked.stderr
        hold, look = entries(ledger)
        return {"list": [r for r in listing if r["id"] == test_id], "show": shown,
                "hold_out": hold["held_out_groups"],
                "look": {k: look[k] for k in ("fixture_set_sha256", "run_keys", "held_out_groups")},
                "report_fixture_set": json.loads(looked.stdout).get("fixture_set_sha256")}

    a, b = printed(a_store), printed(b_store)
    assert without_paths(a, tmp_path / "a") == without_paths(b, tmp_path / "b")
    assert a["list"][0]["held_out"] is True and a["list"][0]["content_hash"] is None
    assert all(d.startswith("config:") for ds in a["hold_out"].values() for d in ds)
    keyed = {FixtureStore(r).rows()[row]["content_hash"] for r in (a_store, b_store)}
    assert all(h.startswith("keyed:") for h in keyed) and len(keyed) == 2


def test_the_same_holds_for_a_run_with_events(shared_runs: Path, tmp_path: Path):
    """A test run with events and a copy of it with every timestamp scaled x 1.001, each the test run of its own
    store: `fixtures show` and the ledger's hold-out record print the same for both."""
    from hops_calib.store.split import group_of, hashed_split

    job = next(p for p in sorted(shared_runs.iterdir()) if hashed_split(group_of(p.name)) == "test")
    shown, held = [], []
    for name, make in (("a", lambda t: copy_job(job, t)), ("b", lambda t: scaled_copy(job, t, 1.001))):
        source = make(tmp_path / name / "src" / job.name)
        store, ledger = tmp_path / name / "fixtures", tmp_path / name / "ledger.jsonl"
        assert cli("ingest", source, "--fixtures", store, "--split", "test").returncode == 0
        shown.append(without_paths(json.loads(cli("fixtures", "show", job.name, "--fixtures", store,
                                                  "--json").stdout), tmp_path / name))
        assert cli("ledger", "hold-out", "--fixtures", store, "--ledger", ledger).returncode == 0
        held.append(entries(ledger)[0]["held_out_groups"])
    assert shown[0] == shown[1] and held[0] == held[1]
    assert "throughput_per_s" not in shown[0] and "content_hash" not in shown[0]


@pytest.fixture(scope="module")
def held_out(shared_fixtures: Path, tmp_path_factory) -> tuple[Path, str]:
    """A ledger whose one entry holds out the shared store's test split (`ledger hold-out`), and a test run of it."""
    ledger = tmp_path_factory.mktemp("held") / "ledger.jsonl"
    assert cli("ledger", "hold-out", "--fixtures", shared_fixtures, "--ledger", ledger).returncode == 0
    return ledger, FixtureStore(shared_fixtures).ids("test")[0]


def test_a_test_job_forced_into_a_new_train_store_is_withheld_by_every_verb(held_out, shared_runs: Path,
                                                                            tmp_path: Path):
    """Issue #32 case 2: the job of a held-out run ingested with --split train into a new store. `fixtures list`
    and `show` withhold its measurement (saying why), and plot timeline (and its Chrome trace), plot parity and
    report --split train --html refuse it (exit 2) and write nothing; the ledger is unchanged."""
    ledger, test_id = held_out
    store = tmp_path / "fixtures"
    assert cli("ingest", shared_runs / test_id, "--fixtures", store, "--split", "train").returncode == 0
    before, ledger_before = tree(store), ledger.read_bytes()
    listing = json.loads(cli("fixtures", "list", "--fixtures", store, "--ledger", ledger, "--json").stdout)
    (row,) = listing["fixtures"]
    assert row["held_out"] is True and row["throughput_per_s"] is None and row["content_hash"] is None
    assert "by ledger entry 1" in row["held_out_by"]
    text = cli("fixtures", "list", "--fixtures", store, "--ledger", ledger).stdout
    assert "train fixture(s) held out are withheld" in flat(text)
    shown = json.loads(cli("fixtures", "show", test_id, "--fixtures", store, "--ledger", ledger, "--json").stdout)
    assert "throughput_per_s" not in shown and "iteration_periods_ms" not in shown
    assert shown["held_out"].startswith("held out by ledger entry 1")
    out = tmp_path / "out"
    out.mkdir()
    for verb in (["plot", "timeline", test_id, "--out", out / "t.png", "--chrome", out / "t.json"],
                 ["plot", "parity", "--out", out / "p.png"],
                 ["report", "--split", "train", "--html", out / "r.html"],
                 ["evaluate"]):
        done = cli(*verb, "--fixtures", store, "--ledger", ledger)
        assert done.returncode == 2, (verb, done.stdout, done.stderr)
        assert "held out" in done.stderr and "by ledger entry 1" in flat(done.stderr), (verb, done.stderr)
    assert list(out.iterdir()) == []
    assert tree(store) == before and ledger.read_bytes() == ledger_before


def test_a_split_edited_in_the_index_does_not_move_a_test_run(shared_runs: Path, tmp_path: Path):
    """Issue #32 case 3: index.parquet edited to list a test run in train. `fixtures list` still withholds its
    measurement (its own fixture.json says test), evaluate refuses the store (exit 2)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hops_calib.store.split import group_of, hashed_split

    runs = sorted(shared_runs.iterdir())
    test_job = next(p for p in runs if hashed_split(group_of(p.name)) == "test")
    train_job = next(p for p in runs if hashed_split(group_of(p.name)) == "train")
    store = tmp_path / "fixtures"
    assert cli("ingest", test_job, train_job, "--fixtures", store, "--split", "auto").returncode == 0
    index = store / "index.parquet"
    table = pq.read_table(index).to_pylist()
    for row in table:
        row["split"] = "train"
    pq.write_table(pa.Table.from_pylist(table, schema=pq.read_schema(index)), index)
    before = tree(store)
    listing = json.loads(cli("fixtures", "list", "--fixtures", store, "--json").stdout)["fixtures"]
    edited = next(r for r in listing if r["id"] == test_job.name)
    assert edited["held_out"] is True and edited["throughput_per_s"] is None
    assert "its own fixture record" in edited["held_out_by"]
    assert next(r for r in listing if r["id"] == train_job.name)["throughput_per_s"] is not None
    done = cli("evaluate", "--fixtures", store, "--ledger", tmp_path / "ledger.jsonl")
    assert done.returncode == 2 and test_job.name in done.stderr, done.stderr
    assert tree(store) == before


def test_a_ledger_that_does_not_exist_is_refused_unless_new_on_purpose(held_out, shared_runs: Path, tmp_path: Path):
    """Issue #32 case 4: --ledger naming no file is refused (exit 2, nothing created) by every verb that takes
    one; --new-ledger starts one."""
    _, test_id = held_out
    store = tmp_path / "fixtures"
    assert cli("ingest", shared_runs / test_id, "--fixtures", store, "--split", "train").returncode == 0
    missing = tmp_path / "typo.jsonl"
    for verb in (["evaluate", "--fixtures", store], ["fixtures", "list", "--fixtures", store],
                 ["report", "--split", "test", "--fixtures", REPO / "fixtures"], ["ledger", "verify"]):
        done = cli(*verb, "--ledger", missing, "--json", new_ledger=False)
        assert done.returncode == 2, (verb, done.stderr)
        assert "no ledger there: a new ledger remembers no held-out run" in flat(done.stderr)
        assert f"--ledger {missing} --new-ledger" in flat(done.stderr)
        assert json.loads(done.stdout)["error"]["field"] == "ledger"
        assert not missing.exists()
    done = cli("evaluate", "--fixtures", store, "--ledger", missing, "--new-ledger", new_ledger=False)
    assert done.returncode == 0, done.stderr


def test_a_near_copy_of_a_held_out_table_row_is_refused(tmp_path: Path):
    """Issue #32 case 5: a vTrain test row x 1.001 ingested into train in another store is refused by the ledger
    that held the first store's test split out (a vTrain run's id is its configuration: the copy is refused by its
    group's name; a renamed copy of a run with events by its configuration, tests/loop/test_heldout.py)."""
    first, second = tmp_path / "first", tmp_path / "second"
    assert cli("ingest", vtrain_copy(tmp_path / "src1"), "--fixtures", first, "--split", "auto").returncode == 0
    ledger = tmp_path / "ledger.jsonl"
    assert cli("ledger", "hold-out", "--fixtures", first, "--ledger", ledger).returncode == 0
    test_id = FixtureStore(first).ids("test")[0]
    from hops_calib.trace.vtrain import read_vtrain_table

    order = [run.run_id for run in read_vtrain_table(tmp_path / "src1" / "ground_truth_single.csv").runs]
    near = vtrain_copy(tmp_path / "src2", order.index(test_id), 1.001)
    assert cli("ingest", near, "--fixtures", second, "--split", "train").returncode == 0
    before = ledger.read_bytes()
    done = cli("evaluate", "--fixtures", second, "--ledger", ledger)
    assert done.returncode == 2, done.stderr
    group = next(r["group"] for r in FixtureStore(first).rows() if r["id"] == test_id)
    assert f"{group} ({test_id})" in flat(done.stderr) and "by ledger entry 1" in flat(done.stderr)
    assert ledger.read_bytes() == before


def test_the_repositorys_ledger_still_verifies_and_reports(repo_root: Path, tmp_path: Path):
    """The shipped ledger holds measured digests of test runs (entry 143): it still verifies, its looks are listed,
    a held-out preview works on it, and `ledger export` writes it (runs_moved: a count, later the ids)."""
    ledger = tmp_path / "ledger.jsonl"
    shutil.copy(repo_root / "ledger" / "ledger.jsonl", ledger)
    before = ledger.read_bytes()
    assert cli("ledger", "verify", "--ledger", ledger, "--json").returncode == 0
    assert cli("ledger", "looks", "--ledger", ledger, "--json").returncode == 0
    done = cli("report", "--preview", "--fixtures", repo_root / "fixtures", "--ledger", ledger, "--json")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "ledger.parquet"
    done = cli("ledger", "export", out, "--ledger", ledger)
    assert done.returncode == 0, done.stderr
    import pyarrow.parquet as pq

    table = pq.read_table(out)
    assert table.num_rows == len(before.splitlines())
    moved = table.column("runs_moved").to_pylist()
    assert any(isinstance(v, str) and v.startswith("[") for v in moved) and any(v == "32" for v in moved)
    assert ledger.read_bytes() == before


# --- inputs ---------------------------------------------------------------------------------------------------

def _log(folder: Path) -> Path:
    from tests.trace.test_iteration_level import _lm_log

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "gpt_run1.log"
    _lm_log(path)
    (folder / "hops.base.yaml").write_text("hardware: {gpu: a100, gpus_per_node: 8}\n")
    return path


def test_crlf_and_colour_codes_read_as_the_same_log(tmp_path: Path):
    """Issue #32 case 6: the same Megatron log with Windows line ends, and with ANSI colour codes around every line,
    ingests as the plain log does: the same launch (fp16, its vocabulary), the same timers and iteration times."""
    shown = []
    for name, damage in (("plain", lambda b: b), ("crlf", lambda b: b.replace(b"\n", b"\r\n")),
                         ("ansi", lambda b: b"".join(b"\x1b[32m" + line.rstrip(b"\n") + b"\x1b[0m\n"
                                                     for line in b.splitlines(keepends=True)))):
        log = _log(tmp_path / name / "src")
        log.write_bytes(damage(log.read_bytes()))
        store = tmp_path / name / "fixtures"
        done = cli("ingest", log, "--fixtures", store, "--split", "train", "--json")
        assert done.returncode == 0, done.stdout
        data = json.loads(cli("fixtures", "show", "gpt_run1", "--fixtures", store, "--json").stdout)
        shown.append(without_paths({**data, "ingest_warnings": json.loads(done.stdout)["warnings"]},
                                   tmp_path / name))
    assert shown[0]["configuration"]["precision"] == "fp16" and shown[0]["timers_ms"]
    assert shown[1] == shown[0] and shown[2] == shown[0]


SECRET = "rootpassword:$6$hash-that-must-not-be-echoed:19000:0:99999:7:::"


def test_links_out_of_the_source_folder_are_refused_without_echoing_content(tmp_path: Path):
    """Issue #32 case 7: an all-reduce table that is a link to a file elsewhere is refused, naming the link and its
    target, never the file's content; a table named on the command line that leads to a file that is no table (a
    link to a password file) is refused quoting at most 16 characters of it, as is an all-reduce table file that
    is not nccl-tests' output."""
    secret = tmp_path / "elsewhere" / "shadow"
    secret.parent.mkdir()
    secret.write_text(SECRET + "\n" + SECRET + "\n")
    src = tmp_path / "src"
    table = vtrain_copy(src)
    link = src / "runs.csv"
    link.symlink_to(secret)
    done = cli("ingest", link, "--fixtures", tmp_path / "s1")
    assert done.returncode == 2 and "has unknown columns: 'rootpassword:$6$...'" in flat(done.stderr), done.stderr
    assert "hash-that-must" not in done.stdout + done.stderr
    ar = src / "allreduce-a100" / "AR_GPU2_1M_1024M_LUT"
    ar.unlink()
    ar.symlink_to(secret)
    done = cli("ingest", table, "--fixtures", tmp_path / "s2")
    assert done.returncode == 2 and "is a symbolic link out of" in flat(done.stderr), done.stderr
    ar.unlink()
    ar.write_text(SECRET + "\n")
    done = cli("ingest", table, "--fixtures", tmp_path / "s3")
    assert done.returncode == 2 and "does not start with nccl-tests' header (it starts 'rootpassword:$6$...')" in \
        flat(done.stderr), done.stderr
    assert "hash-that-must" not in done.stdout + done.stderr
    assert not any((tmp_path / s).exists() for s in ("s1", "s2", "s3"))


def test_size_bounds_refuse_before_reading(tmp_path: Path, repo_root: Path):
    """Issue #32 case 8: an all-reduce table over 4 MiB, a training log over 64 MiB (sparse files: refused by their
    size, before a byte is read) and a candidate file of 10 MB (refused before the append-only ledger)."""
    src = tmp_path / "src"
    table = vtrain_copy(src)
    with (src / "allreduce-a100" / "AR_GPU2_1M_1024M_LUT").open("r+b") as handle:
        handle.truncate(241 << 20)
    done = cli("ingest", table, "--fixtures", tmp_path / "s1")
    assert done.returncode == 2 and "is 241.0 MiB, more than the 4 MiB an all-reduce table may be" in \
        flat(done.stderr), done.stderr
    log = _log(tmp_path / "log")
    with log.open("r+b") as handle:
        handle.truncate(300 << 20)
    done = cli("ingest", log, "--fixtures", tmp_path / "s2")
    assert done.returncode == 2 and "is 300.0 MiB, more than the 64 MiB a training log may be" in flat(done.stderr)
    ledger = tmp_path / "ledger.jsonl"
    shutil.copy(repo_root / "ledger" / "ledger.jsonl", ledger)
    before = ledger.read_bytes()
    big = tmp_path / "big.toml"
    big.write_text('id = "big"\nhypothesis = "' + "x" * (10 << 20) + '"\ngrounding = "g"\n\n[change]\n'
                   'term = "decoder_roofline"\nset = { compute_efficiency = 0.4 }\n')
    done = cli("ledger", "plan", "--note", "n", "--candidate", big, "--ledger", ledger)
    assert done.returncode == 2 and "is 10.0 MiB, more than the 64 KiB a candidate file may be" in flat(done.stderr)
    assert ledger.read_bytes() == before


def test_a_full_disk_exits_2_naming_the_path_and_leaves_nothing_half_written(shared_runs: Path, tmp_path: Path,
                                                                             monkeypatch):
    """Issue #32 case 9: ENOSPC while a fixture is written (simulated: the writer fails part way) and while the
    ledger is appended (os.write fails after half the line): exit 2 naming the path and the free space, the
    half-written fixture folder and the new store removed, the ledger as it was."""
    from typer.testing import CliRunner

    from hops_calib.cli import app
    from hops_calib.loop import ledger as ledger_module
    from hops_calib.store import fixture_store

    def full(folder, **_):
        (folder / "spec.json").write_text("{")  # part of the fixture written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fixture_store.FixtureStore, "write_summary", staticmethod(full))
    store = tmp_path / "fixtures"
    job = shared_runs / "exp2_13_a10g_pair_pp2_run135"
    done = CliRunner().invoke(app, ["ingest", str(job), "--fixtures", str(store)])
    assert done.exit_code == 2, done.output
    assert f"{store / job.name}: field 'disk': no space left on the device to write it (" in flat(done.output)
    assert "MiB free there" in done.output and not store.exists()
    monkeypatch.undo()

    ledger = tmp_path / "ledger.jsonl"
    ledger_module.append(ledger, {"kind": "note", "time": "t"})
    before = ledger.read_bytes()
    real_write = os.write

    def half(fd, data):
        real_write(fd, bytes(data)[:len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ledger_module.os, "write", half)
    done = CliRunner().invoke(app, ["ledger", "hold-out", "--fixtures", str(REPO / "fixtures"), "--ledger",
                                    str(ledger)])
    monkeypatch.undo()
    assert done.exit_code == 2, done.output
    assert f"{ledger}: field 'disk': no space left on the device to write it" in flat(done.output)
    assert ledger.read_bytes() == before


def test_values_outside_physical_bounds_are_refused(tmp_path: Path, repo_root: Path):
    """Issue #32 case 9: a table row of 1e-300 ms (its other rows stored: exit 6) and a device constant of 1e300
    FLOP/s in a model file (exit 2, naming the field)."""
    src = tmp_path / "src"
    table = vtrain_copy(src, 0, 1e-300 / 372.160408)
    done = cli("ingest", table, "--fixtures", tmp_path / "s")
    assert done.returncode == 6, done.stderr
    assert "less than 1 microsecond (no kernel launches that fast)" in flat(done.stderr)
    assert len(FixtureStore(tmp_path / "s").ids()) == VTRAIN_ROWS - 1
    model = tmp_path / "model.toml"
    model.write_text((repo_root / "hops_calib" / "model" / "models" / "baseline.toml").read_text()
                     + '\n[devices.h100]\npeak_bf16_flops_per_s = { value = 1e300, source = "typo" }\n')
    done = cli("evaluate", "--model", model, "--fixtures", repo_root / "fixtures", "--ledger", tmp_path / "l.jsonl")
    assert done.returncode == 2, done.stderr
    assert "peak_bf16_flops_per_s': value 1e+300 is outside the physical bounds" in flat(done.stderr)
    assert not (tmp_path / "l.jsonl").exists()


def test_a_semicolon_csv_gets_a_delimiter_hint(tmp_path: Path):
    src = tmp_path / "src"
    table = vtrain_copy(src)
    semi = src / "sweep.csv"
    semi.write_text(table.read_text().replace(",", ";"))
    done = cli("ingest", semi, "--fixtures", tmp_path / "s")
    assert done.returncode == 2
    assert "has one column: its header is split by ';', not by commas" in flat(done.stderr)
    assert "read_csv(path, sep=';')" in done.stderr and not (tmp_path / "s").exists()


def test_collective_tables_naming_a_system_folder_says_what_is_wrong(tmp_path: Path):
    log = _log(tmp_path / "src")
    (log.parent / "hops.base.yaml").write_text("hardware: {gpu: a100, gpus_per_node: 8, collective_tables: /proc}\n")
    done = cli("ingest", log, "--fixtures", tmp_path / "s")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "names '/proc', a folder of" in flat(done.stderr)
    assert "none of which is an all-reduce table (a regular file named AR_GPU<n>_...)" in flat(done.stderr)
    assert not (tmp_path / "s").exists()


def test_ledger_repair_says_what_it_did_in_json(repo_root: Path, tmp_path: Path):
    ledger = tmp_path / "ledger.jsonl"
    shutil.copy(repo_root / "ledger" / "ledger.jsonl", ledger)
    whole = ledger.read_bytes()
    ledger.write_bytes(whole + b'{"kind": "evaluate", "cut')
    done = cli("ledger", "repair", "--ledger", ledger, "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["status"] == "ok" and data["repaired"] is True and Path(data["set_aside"]).is_file()
    assert ledger.read_bytes() == whole
    again = json.loads(cli("ledger", "repair", "--ledger", ledger, "--json").stdout)
    assert again["repaired"] is False and again["set_aside"] is None
