"""Component tables (GEMM and memory-kernel times): the reader, the store's content-addressed copy, and the pricing
of kernels from them or from the datasheet (hops_calib/model/kernel_pricing.py), and the decoder_kernels term."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from hops_calib.loop.model_files import load_catalog
from hops_calib.model import TERMS
from hops_calib.model import kernels as K
from hops_calib.model.kernel_pricing import (
    DEFAULT_GEMM_CURVE,
    DEFAULT_MEMORY_CURVE,
    TILES_16BIT,
    Pricer,
    Rates,
    _tile_and_waves,
    sm_count,
)
from hops_calib.model.terms.base import Context, layout_of
from hops_calib.model.terms.decoder_kernels import kernel_settings
from hops_calib.spec import Hardware, Spec, spec_from_args
from hops_calib.store.components import load_components, store_components
from hops_calib.store.fixture_store import FixtureFileError
from hops_calib.trace import TraceError
from hops_calib.trace.component_tables import (
    read_component_tables,
    read_gemm_table,
    read_memory_table,
)

A100 = load_catalog()["a100"]
GEMM_CSV = """device,dtype,m,n,k,time_s
a100,bf16,4096,4096,4096,0.000520
a100,bf16,2048,4096,4096,0.000270
a100,bf16,1024,1024,1024,0.0000150
cpu,fp32,256,256,256,0.0021
"""
MEMORY_CSV = """device,kernel,bytes,time_s
a100,copy,1048576,0.0000060
a100,copy,1073741824,0.00058
a100,layernorm,1048576,0.0000080
a100,layernorm,1073741824,0.00070
"""


def write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def test_a_folder_gives_one_table_per_device(tmp_path: Path) -> None:
    write(tmp_path, "gemm.csv", GEMM_CSV)
    write(tmp_path, "memory.csv", MEMORY_CSV)
    write(tmp_path, "notes.txt", "not a table")
    tables = {t.device: t for t in read_component_tables(tmp_path)}
    assert sorted(tables) == ["a100", "cpu"]
    assert tables["a100"].gemm_rows("bf16")[0] == (1024, 1024, 1024, 1.5e-05)
    assert tables["a100"].memory_points("layernorm") == ((1048576.0, 0.008), (1073741824.0, 0.7))
    assert tables["cpu"].memory == () and "gemm.csv" in tables["cpu"].source
    assert read_component_tables(tmp_path / "absent") == ()


@pytest.mark.parametrize("edit,line,field", [
    (lambda text: text.replace("device,dtype", "device,type"), 1, "header"),
    (lambda text: text.replace("0.000270", "fast"), 3, "time_s"),
    (lambda text: text.replace("2048,4096,4096", "2048,-4,4096"), 3, "n"),
    (lambda text: text.replace("a100,bf16,1024", "a100,bf17,1024"), 4, "dtype"),
    (lambda text: text + "a100,bf16,4096,4096,4096,0.0006\n", 6, None),  # a repeated shape
    (lambda text: text.replace("cpu,fp32,256,256,256,0.0021", "cpu,fp32,256,256"), 5, None),
    (lambda text: text.replace("0.0021", "1e9"), 5, "time_s"),
])
def test_a_bad_gemm_row_is_refused_naming_file_line_and_field(tmp_path: Path, edit, line, field) -> None:
    path = write(tmp_path, "gemm.csv", edit(GEMM_CSV))
    with pytest.raises(TraceError) as err:
        read_gemm_table(path)
    assert err.value.line == line and err.value.field == field and "gemm.csv" in str(err.value)


def test_a_bad_memory_row_and_a_clash_across_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError) as err:
        read_memory_table(write(tmp_path / "a", "memory.csv", MEMORY_CSV.replace("a100,copy,1048576", ",copy,1048576")))
    assert (err.value.line, err.value.field) == (2, "device")
    write(tmp_path / "b", "gemm.csv", GEMM_CSV)
    write(tmp_path / "b", "gemm_more.csv", "device,dtype,m,n,k,time_s\na100,bf16,1024,1024,1024,0.00002\n")
    with pytest.raises(TraceError, match="again"):
        read_component_tables(tmp_path / "b")
    write(tmp_path / "c", "memory.csv", "device,kernel,bytes,time_s\n" + "x" * 70_000 + "\n")
    with pytest.raises(TraceError, match="longer than"):
        read_component_tables(tmp_path / "c")


def test_the_store_keeps_the_tables_by_digest_and_refuses_a_changed_file(tmp_path: Path) -> None:
    source = tmp_path / "bench"
    write(source, "gemm.csv", GEMM_CSV)
    write(source, "memory.csv", MEMORY_CSV)
    store = tmp_path / "store"
    digest = store_components(store, source)
    assert digest is not None and store_components(store, source) == digest  # once per content
    assert load_components(store, digest) == read_component_tables(source)
    assert store_components(store, tmp_path / "empty") is None
    path = store / ".components" / f"{digest}.json"
    path.write_text(path.read_text().replace("0.00058", "0.0001"))
    with pytest.raises(FixtureFileError, match="changed after ingest"):
        load_components(store, digest)
    path.unlink()
    with pytest.raises(FixtureFileError, match="missing"):
        load_components(store, digest)


def a100_spec(**args) -> Spec:
    launch = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "world_size": 8, "num_layers": 8,
              "hidden_size": 2048, "num_attention_heads": 16, "seq_length": 2048, "max_position_embeddings": 2048,
              "micro_batch_size": 2, "global_batch_size": 16, "vocab_size": 51200, "bf16": True, **args}
    return spec_from_args(launch, "test", run_id="a100", iterations=2, hardware=Hardware(gpu="a100", gpus_per_node=8))


def test_a_spec_carries_its_tables_through_json(tmp_path: Path) -> None:
    write(tmp_path, "gemm.csv", GEMM_CSV)
    spec = dataclasses.replace(a100_spec(), component_tables=read_component_tables(tmp_path))
    again = Spec.from_json(spec.to_json())
    assert again == spec and again.components("a100").gemm_rows("bf16")
    assert "component_tables" not in json.loads(a100_spec().to_json())  # written only when set


def gemm(m: int, n: int, k: int, batch: int = 1) -> K.Kernel:
    flops = 2.0 * batch * m * n * k
    return K.Kernel("g", K.GEMM, K.FORWARD, dtype="bf16", m=m, n=n, k=k, batch=batch, flops=flops, model_flops=flops,
                    bytes=2.0 * batch * (m * k + k * n + m * n))


def test_a_measured_gemm_takes_its_measured_time_and_a_neighbour_its_efficiency(tmp_path: Path) -> None:
    write(tmp_path, "gemm.csv", GEMM_CSV)
    tables = {t.device: t for t in read_component_tables(tmp_path)}
    pricer = Pricer(A100, tables["a100"], Rates())
    measured = pricer.price(gemm(2048, 4096, 4096))
    assert measured.ms == pytest.approx(0.270) and measured.bound == "gemm table"
    # a shape between the measured ones takes their efficiency with its own quantization
    between = pricer.price(gemm(3072, 4096, 4096))
    assert 0.270 < between.ms < 0.520
    assert Pricer(A100, tables["a100"], Rates(use_tables=False)).price(gemm(2048, 4096, 4096)).source \
        == DEFAULT_GEMM_CURVE
    # no table for a dtype: the default curve
    assert Pricer(A100, tables["a100"], Rates()).price(dataclasses.replace(gemm(64, 64, 64), dtype="fp16")).source \
        == DEFAULT_GEMM_CURVE


def test_the_default_gemm_curve_quantizes_tiles_and_waves() -> None:
    """108 SMs: 3072 x 1152 is 108 tiles of 256 x 128, one wave; 256 rows more make 117 such tiles, two waves, or
    234 tiles of 128 x 128 in three waves of half the work each: the fewer padded FLOPs."""
    assert sm_count(A100) == 108
    pricer = Pricer(A100, None, Rates(gemm_efficiency=0.8, gemm_k_half=0.0))
    full = pricer.price(gemm(3072, 1152, 8192))
    assert full.waves == 1 and full.tile == (256, 128) and full.bound == "compute"
    assert full.ms == pytest.approx(2 * 3072 * 1152 * 8192 / (0.8 * 312e12) * 1e3)
    over = pricer.price(gemm(3072 + 256, 1152, 8192))
    assert over.waves == 3 and over.tile == (128, 128)
    assert over.ms == pytest.approx(3 * 108 * 2 * 128 * 128 * 8192 / (0.8 * 312e12) * 1e3)
    assert over.efficiency == pytest.approx(0.8 * 3328 * 1152 / (3 * 108 * 128 * 128))
    # a batched GEMM's tiles count every batch
    assert _tile_and_waves(256, 128, 8192, 108, 108, TILES_16BIT) == (108 * 2 * 256 * 128 * 8192, (256, 128), 1)
    assert _tile_and_waves(256, 128, 8192, 109, 108, TILES_16BIT) == (3 * 108 * 2 * 128 * 128 * 8192, (128, 128), 3)
    # K / (K + k_half): a short K reaches less of the peak
    short = Pricer(A100, None, Rates(gemm_k_half=64.0)).price(gemm(256 * 108, 128, 64))
    assert short.efficiency == pytest.approx(0.8 * 0.5) or short.bound == "memory"
    # a memory-bound GEMM (a short K: its output dominates) is priced by its bytes
    skinny = pricer.price(gemm(8192, 8192, 16))
    assert skinny.bound == "memory" and skinny.ms == pytest.approx(skinny.kernel.bytes / (0.8 * 2.039e12) * 1e3)
    # a CPU has no SMs: no quantization
    cpu = load_catalog()["cpu"]
    assert sm_count(cpu) is None and Pricer(cpu, None, Rates()).price(gemm(100, 100, 100)).waves is None


def test_memory_kernels_from_the_table_else_the_default_curve(tmp_path: Path) -> None:
    write(tmp_path, "memory.csv", MEMORY_CSV)
    tables = read_component_tables(tmp_path)[0]
    pricer = Pricer(A100, tables, Rates())
    norm = K.Kernel("n", K.MEMORY, K.FORWARD, kind="layernorm", bytes=1073741824.0)
    assert pricer.price(norm).ms == pytest.approx(0.7) and pricer.price(norm).bound == "memory table"
    # a kernel the table did not measure takes the copy rows; below the smallest size, the smallest's time
    gelu = K.Kernel("g", K.MEMORY, K.FORWARD, kind="gelu", bytes=1073741824.0)
    assert pricer.price(gelu).ms == pytest.approx(0.58) and "copy" in pricer.price(gelu).source
    assert pricer.price(dataclasses.replace(gelu, bytes=1000.0)).ms == pytest.approx(0.006)
    plain = Pricer(A100, None, Rates(memory_efficiency=0.8, kernel_latency_us=3.0)).price(gelu)
    assert plain.source == DEFAULT_MEMORY_CURVE
    assert plain.ms == pytest.approx(0.003 + 1073741824.0 / (0.8 * 2.039e12) * 1e3)
    tiny = Pricer(A100, None, Rates()).price(dataclasses.replace(gelu, bytes=1000.0))
    assert tiny.bound == "latency"


def contribution(spec: Spec, **params):
    term = TERMS["decoder_kernels"]
    catalog = load_catalog()
    context = Context(spec=spec, layout=layout_of(spec), devices=tuple(catalog[d] for d in spec.devices))
    return term.contribute(context, {**term.defaults(), **params})


def test_the_term_sums_its_kernels_and_floors_the_layer_at_their_launches() -> None:
    spec = a100_spec()
    part = contribution(spec)
    layers = 4
    s = kernel_settings(spec)
    pricer = Pricer(A100, None, Rates())
    forward = list(K.layer_forward(spec.model, s))
    backward = list(K.layer_backward(spec.model, s))
    assert part.forward_ms[0] == pytest.approx(layers * sum(pricer.price(k).ms for k in forward))
    assert part.backward_ms[0] == pytest.approx(layers * sum(pricer.price(k).ms for k in backward))
    assert part.weight_grad_ms[0] == pytest.approx(layers * sum(pricer.price(k).ms for k in backward
                                                                if k.phase == K.WGRAD))
    assert part.forward_floor_ms[0] == pytest.approx(layers * len(forward) * 0.005)
    assert 0 < part.attention_core_ms[0] < part.forward_ms[0]
    # a per-device value moves only that device
    assert contribution(spec, **{"gemm_efficiency@a100": 0.4}).forward_ms[0] > part.forward_ms[0]
    assert contribution(spec, **{"gemm_efficiency@h100": 0.4}).forward_ms == part.forward_ms
    # selective recomputation launches the attention core again in the backward
    selective = contribution(a100_spec(recompute_granularity="selective"))
    assert selective.backward_floor_ms[0] == pytest.approx(part.backward_floor_ms[0] + layers * 0.005)


def test_the_term_prices_from_the_machines_tables_where_the_spec_has_them(tmp_path: Path) -> None:
    write(tmp_path, "memory.csv", MEMORY_CSV.replace("0.00058", "0.0058").replace("0.00070", "0.0070"))
    spec = a100_spec()
    slow = dataclasses.replace(spec, component_tables=read_component_tables(tmp_path))
    assert contribution(slow).forward_ms[0] > contribution(spec).forward_ms[0]
    assert contribution(slow, use_tables=0.0).forward_ms == contribution(spec).forward_ms
    assert math.isclose(contribution(slow, **{"use_tables@a100": 0.0}).forward_ms[0], contribution(spec).forward_ms[0])
