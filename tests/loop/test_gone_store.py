"""A store the ledger names but this machine lacks (issue #31): the messages say how to build it again from its
source, never only the dead path recorded on another machine or in another session."""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

from hops_calib.loop.calibration import read_record

REPO = Path(__file__).resolve().parents[2]


def _sets_by_device(tmp_path):
    sets = [s for s in read_record(REPO / "ledger" / "ledger.jsonl").sets.values() if s.runs]
    gone = str(tmp_path / "a-store-of-another-session")
    return {s.devices: replace(s, path=gone) for s in sets}


def test_a_gone_cluster_store_is_rebuilt_by_the_command_the_message_gives(tmp_path, shared_store, shared_runs,
                                                                          monkeypatch):
    monkeypatch.chdir(REPO)
    by_device = _sets_by_device(tmp_path)
    cluster = next(s for devices, s in by_device.items() if "h100" in devices and "cpu" not in devices)
    text = cluster.describe()
    assert ("(no longer there: rebuild it with `hops-calib ingest ../shared/megatron-traces/hops --split auto "
            "--fixtures DIR`)") in text
    assert cluster.store_option() == "--fixtures DIR"
    assert cluster.rebuild_note() == (f"{cluster.path} is gone, build it again: `hops-calib ingest "
                                      "../shared/megatron-traces/hops --split auto --fixtures DIR`")
    # a store outside a checkout (/tmp) that is here now may be gone next session: the command comes with it
    here = replace(cluster, path=str(tmp_path))
    assert here.store_option() == f"--fixtures {tmp_path}"
    assert here.rebuild_note() == (f"where {tmp_path} is gone, build it again: `hops-calib ingest "
                                   "../shared/megatron-traces/hops --split auto --fixtures DIR`")
    assert cluster.to_dict()["rebuild"].startswith("hops-calib ingest ../shared/megatron-traces/hops ")
    # the command, run from the repository root, reads the shared runs, and its store holds the recorded runs
    source = shlex.split(cluster.to_dict()["rebuild"])[2]
    assert (REPO / source).resolve() == shared_runs.resolve()
    assert set(cluster.runs) <= set(shared_store.ids("train"))


def test_a_gone_vtrain_store_names_the_table_and_a_gone_cpu_store_the_checkouts(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    by_device = _sets_by_device(tmp_path)
    vtrain = by_device[("a100",)]
    assert ("rebuild it with `hops-calib ingest ../shared/public-runs/vtrain/ground_truth_single.csv --split auto "
            "--fixtures DIR`") in vtrain.describe()
    assert (REPO / "../shared/public-runs/vtrain/ground_truth_single.csv").is_file()
    cpu = by_device[("cpu",)]
    assert cpu.store_option() == f"--fixtures {REPO / 'fixtures'}"
    assert cpu.rebuild_note() == f"{cpu.path} is gone: the checkout's store of its CPU captures holds its runs"
    assert "hops-calib ingest traces --split auto" in cpu.describe()
    # a store that is there, in a checkout, is named as it is
    there = replace(cpu, path=str(REPO / "fixtures"))
    assert there.store_option() == f"--fixtures {REPO / 'fixtures'}" and "no longer there" not in there.describe()
    assert there.rebuild_note() == ""
