"""A device type that is `calibrated_as` another (the H200 as the H100 DGX: the same GH100 tensor cores, SMs and
clocks, in the same NVLink 4 node) takes that type's fitted per-device values where it has none of its own; a value
of its own wins; the catalog says so in the uncalibrated note predict prints; and only the catalog may say it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hops_calib.errors import InputError
from hops_calib.loop.model_files import load_model


def test_the_h200_takes_the_h100_dgx_fitted_values_and_its_own_win():
    model = load_model(None)
    assert model.device("h200").calibrated_as == "h100_dgx"
    roofline = model.active("decoder_roofline")
    own = roofline.params()
    assert "compute_efficiency@h100_dgx" in own and "compute_efficiency@h200" not in own
    seen = model.term_params(roofline)
    assert seen["compute_efficiency@h200"] == own["compute_efficiency@h100_dgx"] != own["compute_efficiency"]
    # every h100_dgx value of every term, and nothing for a device that is calibrated as no other
    for active in model.terms:
        params = model.term_params(active)
        for name, value in active.params().items():
            if name.endswith("@h100_dgx"):
                assert params[name.replace("@h100_dgx", "@h200")] == value
        assert not any(name.endswith("@b200") for name in params if name not in active.params())
    # a value of the H200's own is kept
    mine = model.with_term(type(roofline)(roofline.term, (*roofline.values, ("compute_efficiency@h200", 0.61))))
    assert mine.term_params(mine.active("decoder_roofline"))["compute_efficiency@h200"] == 0.61


def test_calibrated_as_needs_the_catalog_and_a_reason(tmp_path):
    model_file = tmp_path / "model.toml"
    model_file.write_text('[model]\nname = "m"\n\n[devices.h200]\ncalibrated_as = "h100_dgx"\n')
    with pytest.raises(InputError) as refused:
        load_model(model_file)
    assert refused.value.field == "devices.h200.calibrated_as"


def test_a_model_file_may_override_a_constant_of_an_uncalibrated_device(tmp_path):
    model_file = tmp_path / "model.toml"
    shipped = Path(__file__).resolve().parents[2] / "hops_calib" / "model" / "models" / "baseline.toml"
    model_file.write_text(shipped.read_text() + '\n[devices.h200]\n'
                          'memory_bytes = { value = 140e9, source = "test: a smaller usable memory" }\n')
    device = load_model(model_file).device("h200")
    assert device.memory_bytes == 140e9 and device.calibrated_as == "h100_dgx" and device.uncalibrated


def test_predict_says_how_to_calibrate_an_uncalibrated_device(tmp_path):
    """`predict --job` on an H200 job: the uncalibrated note is followed by one that says how to calibrate the
    device (ingest its runs into a store, then pass that store); an H100 DGX job, calibrated, has neither."""
    import json

    from typer.testing import CliRunner

    from hops_calib.cli import app

    def notes(gpu: str) -> list[str]:
        job = tmp_path / gpu
        job.mkdir()
        (job / "megatron_args.txt").write_text(
            "pretrain_gpt.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --num-layers 4 "
            "--hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 --seq-length 1024 "
            "--max-position-embeddings 1024 --micro-batch-size 1 --global-batch-size 8 --bf16 --vocab-size 32000 "
            "--train-iters 10 --world-size 2\n"
        )
        (job / "hops_trace_map.json").write_text('{"stages": {"0": "gpu0"}}')
        (job / "hops.base.yaml").write_text(f"hardware:\n  devices:\n  - {{id: gpu0, gpu: {gpu}}}\n")
        result = CliRunner().invoke(app, ["predict", "--job", str(job), "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["notes"]

    h200 = notes("h200")
    said = next(k for k, note in enumerate(h200) if note.startswith("h200 is uncalibrated"))
    hint = h200[said + 1]
    assert hint.startswith("to calibrate h200:") and "hops-calib ingest SRC --fixtures DIR" in hint
    assert "pass `--fixtures DIR`" in hint
    assert not [note for note in notes("h100_dgx") if "uncalibrated" in note or "to calibrate" in note]
