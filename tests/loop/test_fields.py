"""The numbers the tools print are defined: model and hardware FLOPs (MFU, HFU) of `predict --job`, the signs of
the errors in `fields`, and why a bubble error is absent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hops_calib.cli import app

REPO = Path(__file__).resolve().parents[2]
# The README's 175B job (64 nodes of 8 A100s, t 8 x p 8 x d 8, full recomputation of every layer).
GPT175B = ("torchrun --nnodes 64 --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 8 "
           "--pipeline-model-parallel-size 8 --num-layers 96 --hidden-size 12288 --num-attention-heads 96 "
           "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 1536 "
           "--sequence-parallel --use-distributed-optimizer --recompute-granularity full --recompute-method uniform "
           "--recompute-num-layers 1 --bf16 --use-flash-attn --vocab-size 50257 --train-iters 100")


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def job(folder: Path, args: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "megatron_args.txt").write_text(args + "\n")
    (folder / "hops_trace_map.json").write_text(json.dumps({"stages": {str(k): f"gpu{k}" for k in range(8)}}))
    (folder / "hops.base.yaml").write_text("hardware:\n  devices:\n"
                                           + "".join(f"  - {{id: gpu{k}, gpu: a100}}\n" for k in range(8)))
    return folder


def test_predict_job_gives_model_and_hardware_flops_as_megatron_and_the_papers_count_them(tmp_path):
    full = cli("predict", "--job", job(tmp_path / "full", GPT175B), "--no-cluster", "--json")
    assert full.exit_code == 0, full.output
    first = json.loads(full.stdout)["predictions"][0]
    # Narayanan et al. (SC'21) eq. 3 counts the recomputed forward: 96 B s l h^2 (1 + s/6h + V/16lh) per iteration;
    # without it (Megatron-LM's logged TFLOP/s/GPU): 72 B s l h^2 (1 + s/6h + V/12lh). B s l h as the job's, V the
    # vocabulary padded to a multiple of 128 x t (Megatron's --make-vocab-size-divisible-by 128).
    s, l, h, v = 2048, 96, 12288, 50257 + (-50257) % (128 * 8)
    ratio = (96 * (1 + s / (6 * h) + v / (16 * l * h))) / (72 * (1 + s / (6 * h) + v / (12 * l * h)))
    assert first["hardware_tflops_per_gpu"] / first["model_tflops_per_gpu"] == pytest.approx(ratio, rel=1e-9)
    assert first["hfu"] / first["mfu"] == pytest.approx(ratio, rel=1e-9)
    text = cli("predict", "--job", tmp_path / "full", "--no-cluster").stdout
    assert "TFLOP/s/GPU model (MFU)" in text and "TFLOP/s/GPU hardware (HFU)" in text
    assert "recomputation not counted, as Megatron-LM logs" in text and "HFU > MFU" in text
    # no recomputation: the two counts agree
    plain = job(tmp_path / "plain", GPT175B.replace(
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 ", ""))
    none = json.loads(cli("predict", "--job", plain, "--no-cluster", "--json").stdout)["predictions"][0]
    assert none["hardware_tflops_per_gpu"] == pytest.approx(none["model_tflops_per_gpu"])
    # selective recomputation: the attention core (4 b s^2 h per layer) once more, nothing else
    selective = job(tmp_path / "selective", GPT175B.replace(
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
        "--recompute-granularity selective"))
    sel = json.loads(cli("predict", "--job", selective, "--no-cluster", "--json").stdout)["predictions"][0]
    extra = (4 * s * s * h * l) / (3 * (l * (24 * s * h * h + 4 * s * s * h) + 2 * s * h * v))
    assert sel["hardware_tflops_per_gpu"] / sel["model_tflops_per_gpu"] == pytest.approx(1 + extra, rel=1e-9)


def test_the_error_signs_are_defined_in_fields():
    from hops_calib.loop.evaluate import JUDGEMENT_FIELDS
    from hops_calib.research.observe import CONTRIBUTOR_FIELDS

    assert "opposite" in CONTRIBUTOR_FIELDS["mean_error_pct"] and "bias_ms" in CONTRIBUTOR_FIELDS["mean_error_pct"]
    assert "predicted minus real" in CONTRIBUTOR_FIELDS["bias_ms"]
    assert "opposite" in JUDGEMENT_FIELDS["throughput_error_pct"]


def test_the_rule_of_which_stores_a_judgement_covers_is_stated_once_in_agents_md_and_the_calibration_block():
    from hops_calib.loop.calibration import COVERAGE_RULE

    agents = " ".join((REPO / "AGENTS.md").read_text().split())
    assert " ".join(COVERAGE_RULE.split()) in agents
