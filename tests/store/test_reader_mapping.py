"""A published table ingested again after its mapping changed is read again, though its bytes are the same
(`measured_ingest.reader_digest`): a store never keeps runs read under a mapping the code no longer has."""

from __future__ import annotations

from hops_calib.store import FixtureStore
from hops_calib.store import measured_ingest
from hops_calib.store.ingest import ingest
from hops_calib.trace import vtrain
from tests.conftest import need_public_runs


def test_a_changed_mapping_reads_an_unchanged_table_again(tmp_path, monkeypatch):
    table = need_public_runs("vtrain", "ground_truth_single.csv")
    rows = table.read_text(encoding="utf-8").splitlines()
    subset = tmp_path / "ground_truth_single.csv"  # the header and 24 of its rows, in the test's own folder
    subset.write_text("\n".join(rows[:25]) + "\n", encoding="utf-8")
    (tmp_path / "allreduce-a100").symlink_to(table.parent / "allreduce-a100")
    store = FixtureStore(tmp_path / "fixtures")
    first = ingest([subset], store, split="auto")
    assert first.ok and first.count("new") == 24
    run = store.ids()[0]
    assert store.load(run).spec.megatron_args["recompute_granularity"] is None  # vtrain.MEASURED
    assert ingest([subset], store, split="auto").count("unchanged") == 24

    # the mapping as it was before the table's own times ruled recomputation out
    stated = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    monkeypatch.setattr(vtrain, "MEASURED", stated)
    monkeypatch.setattr(measured_ingest, "reader_digest", lambda kind: "another mapping")
    again = ingest([subset], store, split="auto")
    assert again.ok and again.count("updated") == 24
    assert store.load(run).spec.megatron_args["recompute_granularity"] == "full"
    assert {store.load(i).split for i in store.ids()} == {f.split for f in first.outcomes if f.run_id} - {None}
