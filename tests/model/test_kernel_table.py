"""`predict --job DIR --kernels`: the kernel table of a stage, priced as the decoder_kernels term prices the layers,
from the job's component tables where it has them (calibration/components/), else from the datasheet (said in a
note)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from tests.whatif.test_whatif import cli, configuration_only

from hops_calib.loop.model_files import load_catalog, load_model
from hops_calib.model.model import resolve_params
from hops_calib.model.terms.base import layout_of
from hops_calib.spec import build_spec

RUN = "cpu_1f1b_t2_l4_h256_s128_m4_run1"  # tensor parallel: the table lists collectives too


def kernels_model(tmp_path: Path) -> Path:
    """The shipped model with decoder_kernels active (its defaults) beside its own terms."""
    model = load_model()
    model = dataclasses.replace(model, terms=model.terms + (resolve_params("decoder_kernels", {}, origin="test"),))
    path = tmp_path / "kernels.toml"
    path.write_text(model.to_toml(load_catalog()))
    return path


def table(*args) -> dict:
    result = cli("predict", "--json", "--kernels", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_the_table_lists_the_stages_kernels_as_the_term_prices_them(tmp_path: Path) -> None:
    job = configuration_only(tmp_path, RUN)
    path = kernels_model(tmp_path)
    out = table("--job", job, "--model", path, "--kernel-stage", "1")
    kernels = out["kernels"]
    assert (kernels["stage"], kernels["device"], kernels["layers"]) == (1, "cpu", 2)
    rows = kernels["kernels"]
    layer_rows = [r for r in rows if r["kernel"].split(".")[0] in ("attention", "mlp")]
    assert {r["count"] for r in layer_rows} == {2}
    assert any(r["kernel"] == "output.logits" and r["count"] == 1 for r in rows)  # the last stage's output layer
    # the layers' forward kernels add up to what the term gives the stage's forward
    model = load_model(path)
    spec = build_spec(job, [])
    part = model.active("decoder_kernels").term.contribute(model.context(spec), model.active("decoder_kernels").params())
    forward = sum(r["total_ms"] for r in layer_rows if r["phase"] == "forward" and r["op"] != "collective")
    assert forward == pytest.approx(part.forward_ms[1], rel=1e-9)
    assert {r["kind"] for r in rows if r["op"] == "collective"} == {"all_reduce"}
    assert any("no component tables" in note for note in kernels["notes"] + out["notes"])
    assert kernels["launches"] == sum(r["count"] for r in rows)


def test_the_default_stage_is_the_slowest_and_the_shipped_model_says_it_prices_with_defaults(tmp_path: Path) -> None:
    job = configuration_only(tmp_path, RUN)
    out = table("--job", job)
    slowest = max(out["predictions"][0]["stages"], key=lambda s: s["forward_ms"] + s["backward_ms"])["stage"]
    assert out["kernels"]["stage"] == slowest
    assert any("does not activate decoder_kernels" in note for note in out["kernels"]["notes"])
    text = cli("predict", "--job", job, "--kernels").output
    assert "kernels of virtual stage" in text and "attention.linear_qkv" in text and "M x N x K" in text


def test_a_jobs_component_tables_price_its_kernels(tmp_path: Path) -> None:
    job = configuration_only(tmp_path, RUN)
    folder = job / "calibration" / "components"
    folder.mkdir(parents=True)
    # the QKV GEMM of this job (128 tokens, 3 x 256 / 2 wide, 256 deep) measured at 0.5 ms
    (folder / "gemm.csv").write_text("device,dtype,m,n,k,time_s\ncpu,fp32,128,384,256,0.0005\n")
    (folder / "memory.csv").write_text("device,kernel,bytes,time_s\ncpu,copy,1000,0.00001\ncpu,copy,1000000000,0.1\n")
    out = table("--job", job, "--model", kernels_model(tmp_path), "--kernel-stage", "0")
    rows = {r["kernel"]: r for r in out["kernels"]["kernels"]}
    assert rows["attention.linear_qkv"]["bound"] == "gemm table"
    assert rows["attention.linear_qkv"]["ms"] == pytest.approx(0.5)
    assert rows["attention.input_norm"]["bound"] == "memory table"
    assert any("GEMMs priced from the GEMM table" in note for note in out["notes"])
    spec = build_spec(job, [])
    assert spec.components("cpu") is not None and layout_of(spec).virtual_stages == 2


def test_kernels_needs_a_job_and_a_stage_of_it(tmp_path: Path) -> None:
    assert cli("predict", "--kernels").exit_code == 2
    job = configuration_only(tmp_path, RUN)
    result = cli("predict", "--job", job, "--kernels", "--kernel-stage", "7")
    assert result.exit_code == 2 and "--kernel-stage" in result.output
    assert cli("predict", "--job", job, "--kernel-stage", "0").exit_code == 2
