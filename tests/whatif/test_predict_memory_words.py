"""What `predict job DIR` and `plan job DIR` say of a DGX H100 job's memory and launch: each device's capacity in GB
and GiB, a stage that fits the raw capacity but not plan's default headroom named in predict's text and JSON, and
the parallel, expert and precision settings in predict's header and JSON `configuration`."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.loop.model_files import load_model, write_model
from hops_calib.model.memory import DEFAULT_HEADROOM_BYTES

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dgx_jobs import MIXTRAL, make_job  # noqa: E402  (the Mixtral launch of test_plan_megatron_flags)

# A dense 1.3B GPT on 2 DGX H100 nodes (docs/whatif.md's gpt16 shape), t 2 x p 4 x d 2, its linear GEMMs in FP8.
DENSE_FP8 = (
    "torchrun --nnodes 2 --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 "
    "--pipeline-model-parallel-size 4 --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
    "--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 64 --bf16 --use-flash-attn "
    "--transformer-impl transformer_engine --fp8-format hybrid --fp8-recipe delayed --vocab-size 50257 "
    "--train-iters 100"
)


def run(*args) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.stdout


def gb_gib(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB ({nbytes / 2**30:.2f} GiB)"


def test_a_stage_within_the_capacity_but_not_plans_headroom_is_named_and_capacities_read_in_gib(tmp_path):
    """The shipped model's DGX H100 holds 80 GiB (85.90 GB): predict's memory table states it in both units. With
    its memory set to stage 0's peak plus half the default headroom, stage 0 fits the raw capacity (JSON `fits`) but
    not with the headroom plan leaves (`fits_with_headroom` false, closed form: total <= device - headroom), and the
    text names the GB it has to spare; plan states the capacity in GiB too and, at a capacity below the peak, says
    which device's capacity less its headroom the own launch does not fit."""
    job = make_job(tmp_path / "mixtral", MIXTRAL)
    model = load_model()
    capacity = model.device("h100_dgx").memory_bytes
    shipped = json.loads(run("predict", "job", job, "--json"))
    text = run("predict", "job", job)
    assert f"h100_dgx {gb_gib(capacity)}" in text and "GB: 10^9 bytes; GiB: 2^30 bytes" in text
    assert shipped["memory_headroom_bytes"] == {"h100_dgx": DEFAULT_HEADROOM_BYTES}
    peak = shipped["memory"][0]["total_bytes"]
    assert peak == max(stage["total_bytes"] for stage in shipped["memory"])

    tight_model = tmp_path / "tight.toml"
    tight = peak + DEFAULT_HEADROOM_BYTES / 2
    write_model(tight_model, model.with_device_constant("h100_dgx", "memory_bytes", tight, "test: a tight GPU"))
    out = json.loads(run("predict", "job", job, "--model", tight_model, "--json"))
    for stage in out["memory"]:
        assert stage["device_bytes"] == tight
        assert stage["fits"] == (stage["total_bytes"] <= tight)
        assert stage["fits_with_headroom"] == (stage["total_bytes"] <= tight - DEFAULT_HEADROOM_BYTES)
    assert out["fits"] and not out["memory"][0]["fits_with_headroom"]
    assert all(stage["fits_with_headroom"] for stage in out["memory"][1:])  # the others hold less than stage 0
    said = run("predict", "job", job, "--model", tight_model)
    spare = (tight - peak) / 1e9
    assert (
        f"note: stage 0 fits with {spare:.2f} GB to spare, less than the {DEFAULT_HEADROOM_BYTES / 1e9:g} GB plan "
        "leaves for the CUDA context and NCCL's buffers (plan --memory-headroom)"
    ) in said
    assert "would not fit" not in said and f"h100_dgx {gb_gib(tight)}" in said
    assert "note: stage 0 fits" not in text  # the shipped 80 GiB leaves it more than the headroom

    small_model = tmp_path / "small.toml"
    small = peak - 1e9
    write_model(small_model, model.with_device_constant("h100_dgx", "memory_bytes", small, "test: a small GPU"))
    over = run("predict", "job", job, "--model", small_model)
    assert f"this launch would not fit: stage 0 needs {peak / 1e9:.1f} GB of {gb_gib(small)}" in over
    planned = run("plan", "job", job, "--model", small_model, "--top", "1")
    usable = small - DEFAULT_HEADROOM_BYTES
    assert (
        f"memory per GPU: h100_dgx {gb_gib(small)} less {DEFAULT_HEADROOM_BYTES / 1e9:.2f} GB headroom = "
        f"{usable / 1e9:.2f} GB for every pick"
    ) in planned
    assert re.search(
        rf"DOES NOT FIT in memory: stage 0 {peak / 1e9:.2f} > {usable / 1e9:.2f} GB, h100_dgx's "
        rf"{re.escape(gb_gib(small))} less {DEFAULT_HEADROOM_BYTES / 1e9:.2f} GB headroom",
        planned,
    )


def test_predicts_header_and_configuration_state_the_experts_and_the_gemms_precision(tmp_path):
    """The MoE launch's configuration names cp 1, ep 2, etp 1 (Megatron's default: the tensor-parallel size), the
    expert data-parallel size world / (etp x ep x pp) = 64 / (1 x 2 x 4) = 8, 8 experts and top-2, bf16 GEMMs, and
    the header says so; the dense FP8 launch's says fp8 with no expert settings, and its calibration coverage names
    the precision fp8 (not the bf16 its weights are kept in)."""
    moe = make_job(tmp_path / "mixtral", MIXTRAL)
    config = json.loads(run("predict", "job", moe, "--json"))["configuration"]
    assert {k: config[k] for k in ("tp", "cp", "dp", "ep", "etp", "edp", "num_experts", "moe_router_topk")} == {
        "tp": 1,
        "cp": 1,
        "dp": 16,
        "ep": 2,
        "etp": 1,
        "edp": 64 // (1 * 2 * 4),
        "num_experts": 8,
        "moe_router_topk": 2,
    }
    assert config["precision"] == "bf16"
    header = run("predict", "job", moe).splitlines()[0]
    assert "4 stages x tp 1 x dp 16 = 64 GPUs; 8 experts, top-2, over ep 2, expert dp 8" in header
    assert "linear GEMMs in BF16" in header and " cp " not in header and "etp" not in header

    dense = make_job(tmp_path / "gpt16", DENSE_FP8)
    out = json.loads(run("predict", "job", dense, "--fixtures", REPO / "fixtures", "--json"))
    config = out["configuration"]
    assert (config["tp"], config["cp"], config["dp"], config["ep"], config["precision"]) == (2, 1, 2, 1, "fp8")
    assert config["etp"] is config["edp"] is config["num_experts"] is config["moe_router_topk"] is None
    header = run("predict", "job", dense, "--fixtures", REPO / "fixtures").splitlines()[0]
    assert "4 stages x tp 2 x dp 2 = 16 GPUs (" in header and "linear GEMMs in FP8" in header
    assert "experts" not in header
    precision = [e for e in out["extrapolations"] if e["feature"] == "precision"]
    assert [e["value"] for e in precision] == ["fp8"]  # the shipped CPU store's runs are fp32
