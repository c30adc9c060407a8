"""`hops-calib bench`: the component tables it measures on this machine's CPU (tiny grids, a few seconds)."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hops_calib.capture.bench import (
    GEMM_COLUMNS,
    MEMORY_COLUMNS,
    MEMORY_KERNELS,
    BenchPlan,
    job_gemm_shapes,
    run_bench,
)
from hops_calib.trace.collective_bench import (
    read_allreduce_table,
    read_collective_tables,
)

pytestmark = pytest.mark.capture
TRACES = Path(__file__).resolve().parents[2] / "traces"
SHAPES = ((32, 48, 16), (64, 32, 128))


def _rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        return list(reader.fieldnames or []), list(reader)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    plan = BenchPlan(device="cpu", dtypes=("fp32", "bf16"), gemm_shapes=SHAPES, memory_bytes=(1 << 14, 1 << 18),
                     message_bytes=(1 << 12, 1 << 14), group_sizes=(2,), row=256, repeats=2, budget_s=120)
    out = tmp_path_factory.mktemp("bench")
    seen: list[str] = []
    return plan, run_bench(plan, out, advance=seen.append), seen


def test_gemm_and_memory_tables_have_their_columns_positive_times_and_the_shapes_asked(measured):
    plan, result, seen = measured
    columns, rows = _rows(result.out / "gemm.csv")
    assert tuple(columns) == GEMM_COLUMNS
    assert {(r["dtype"], int(r["m"]), int(r["n"]), int(r["k"])) for r in rows} == {
        (d, *shape) for d in plan.dtypes for shape in SHAPES}
    assert all(r["device"] == "cpu" and float(r["time_s"]) > 0 for r in rows)
    columns, rows = _rows(result.out / "memory.csv")
    assert tuple(columns) == MEMORY_COLUMNS and {r["kernel"] for r in rows} == set(MEMORY_KERNELS)
    for row in rows:
        # bytes read + written: copy and the norms read one buffer and write one, add reads two
        moved, factor = int(row["bytes"]), 3 if row["kernel"] == "add" else 2
        assert float(row["time_s"]) > 0 and moved % (factor * plan.row * 4) == 0 and moved <= 1 << 18
    assert result.skipped == 0 and result.measured == plan.items() == len(seen)


def test_collective_tables_read_with_the_stores_reader(measured, tmp_path):
    plan, result, _ = measured
    folder = result.out / "collectives"
    tables = read_collective_tables(folder)  # the all-reduce table, as a job's calibration/allreduce/ holds it
    assert [t.gpus for t in tables] == [2] and tables[0].op == "all_reduce"
    assert [size for size, _ in tables[0].points] == [float(b) for b in plan.message_bytes]
    assert all(ms > 0 for _, ms in tables[0].points)
    # the other collectives are in the same nccl-tests format: the reader takes each under an all-reduce's name
    for prefix in ("AG", "RS", "A2A", "SR"):
        copy = tmp_path / f"AR_GPU2_{prefix}"
        shutil.copy(folder / f"{prefix}_GPU2_bench", copy)
        table = read_allreduce_table(copy)
        assert len(table.points) == len(plan.message_bytes) and all(ms > 0 for _, ms in table.points)


def test_job_shapes_are_the_layers_gemms_under_its_launch():
    job = TRACES / "cpu_1f1b_d2_l4_h256_s128_m4_run1"
    if not job.is_dir():
        pytest.skip(f"{job} is not there")
    from hops_calib.spec import build_spec

    shape = build_spec(job).model
    (row, shapes), words = job_gemm_shapes(job)
    tokens, h, t = shape.seq_length * shape.micro_batch_size, shape.hidden_size, shape.tensor_parallel
    assert row == h and f"h {h}" in words
    qkv = (tokens, 3 * h // t, h)  # multi-head attention: q, k and v of h each, split over t
    fc1 = (tokens, shape.ffn_hidden_size // t, h)
    assert qkv in shapes and fc1 in shapes
    assert (tokens, h, 3 * h // t) in shapes and (3 * h // t, h, tokens) in shapes  # its dgrad and wgrad
    assert len(shapes) == len(set(shapes))


def test_a_spent_budget_leaves_items_out_and_says_so(tmp_path):
    plan = BenchPlan(device="cpu", dtypes=("fp32",), gemm_shapes=SHAPES, memory_bytes=(1 << 14,),
                     message_bytes=(1 << 12,), group_sizes=(2,), repeats=1, budget_s=1e-9)
    result = run_bench(plan, tmp_path / "out")
    assert result.measured == 0 and result.skipped == plan.items() and "budget" in result.notes[0]
    assert not (tmp_path / "out" / "gemm.csv").exists()
