"""The attention pass counts the model's score-traffic term cites, counted again from megatron-core's own layer.

experiments/scripts/layer_traffic.py runs one megatron-core GPT layer with the cluster runs' flags under a
dispatch mode and adds up each ATen op's reads and writes of the a x s x s score matrix. These tests hold it to
what the unfused code path must do, op by op, so that a megatron-core or PyTorch upgrade that changes the
traffic (or a counting slip) shows here rather than silently in a calibrated constant.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "scripts" / "layer_traffic.py"


def count(*args: str) -> dict:
    missing = [name for name in ("torch", "megatron") if find_spec(name) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not importable: install the capture extra (pip install -e '.[capture]')")
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("hidden,seq,heads", [(192, 320, 3), (256, 160, 8), (256, 256, 4)])
def test_unfused_attention_score_passes_follow_the_code_path(hidden: int, seq: int, heads: int) -> None:
    out = count("--hidden", str(hidden), "--seq", str(seq), "--heads", str(heads))
    mask = 1 / (2 * heads)  # the s x s boolean mask (1 byte) read against a x s x s 16-bit scores
    forward = out["forward"]["score_passes_by_op"]
    # Forward: the score GEMM writes (beta = 0: no read), the in-place mask reads and writes, softmax reads and
    # writes, the context GEMM reads.
    assert forward == pytest.approx({"baddbmm": 1.0, "masked_fill_": 2.0 + mask, "_softmax": 2.0, "bmm": 1.0})
    backward = out["backward"]
    # Backward: both GEMMs' gradients (write dP, read P for dV, read dS twice for dQ and dK), softmax backward (read
    # grad and output, write), the mask's backward, and autograd's handling of the in-place mask on a view of the
    # score buffer, which zero-fills, clones and copies the gradient: three times the forward's passes.
    assert backward["score_passes"] == pytest.approx(18.0 + mask)
    assert backward["score_passes_by_op"]["_softmax_backward_data"] == pytest.approx(3.0)
    assert backward["score_passes_by_op"]["bmm"] == pytest.approx(4.0)
    # The GEMM FLOPs are Megatron's formula, forward, and twice it, backward.
    assert out["forward"]["gemm_flops"] == out["formula_forward_flops"]
    assert backward["gemm_flops"] == 2 * out["formula_forward_flops"]


def test_softmax_in_fp32_adds_the_casts() -> None:
    out = count("--softmax-in-fp32")
    # Up-cast (read 2 bytes, write 4) and down-cast (read 4, write 2): 6 passes, and the mask and softmax on fp32.
    assert out["forward"]["score_passes_by_op"]["_to_copy"] == pytest.approx(6.0)
    assert out["forward"]["score_passes"] > count()["forward"]["score_passes"] + 6.0


def test_cross_entropy_logit_passes_follow_the_code_path() -> None:
    out = count("--part", "output", "--vocab", "1024")
    # Forward, in fp32 passes over the s x b x V logits: the output GEMM writes bf16 logits (0.5), the cast to fp32
    # (read 0.5, write 1), max (1), in-place subtract (2), exp into a buffer (2), sum (1), in-place divide (2): 10.
    assert out["forward"]["logit_passes_by_op"] == pytest.approx(
        {"mm": 0.5, "_to_copy": 1.5, "max": 1.0, "sub_": 2.0, "exp": 2.0, "sum": 1.0, "div_": 2.0})
    # Backward: the softmax gradient scaled in place (2), the cast back to bf16 (1.5), both GEMMs read it (1).
    assert out["backward"]["logit_passes"] == pytest.approx(4.5)
    assert out["forward"]["gemm_flops"] == out["formula_forward_flops"]


@pytest.mark.parametrize("hidden,seq,heads,ffn", [(192, 320, 3, 0), (128, 448, 2, 1024), (256, 256, 4, 0)])
def test_elementwise_passes_follow_the_code_path(hidden: int, seq: int, heads: int, ffn: int) -> None:
    """The passes the elementwise_traffic term cites: every kernel of the layer that is neither a GEMM nor touches
    the scores, in 16-bit passes over the s x b x h activations plus over the s x b x f MLP activations."""
    out = count("--hidden", str(hidden), "--seq", str(seq), "--heads", str(heads), "--ffn", str(ffn))
    f = (ffn or 4 * hidden) / hidden  # the MLP width in units of h
    forward, backward = out["forward"], out["backward"]
    # Forward: the QKV bias add (read 3h, write 3h), the MLP's first bias add (read f, write f) and its GeLU (read f,
    # write f), two LayerNorms (read h, write h, plus their statistics), two residual adds (read 2h, write h) and the
    # two bias adds before them (read h, write h), the clone of q for the score GEMM's layout.
    assert forward["elementwise_ffn_passes"] == pytest.approx(4.0)
    assert forward["elementwise_hidden_passes"] == pytest.approx(22.0, abs=0.15)
    assert forward["elementwise_passes_by_op"]["gelu"] == pytest.approx(2 * f)
    assert forward["elementwise_passes_by_op"]["add"] == pytest.approx(16 + 2 * f, abs=0.05)
    # Backward: GeLU's gradient (read grad and input, write: 3 f), the bias gradients' reductions over the tokens
    # (QKV 3h, MLP f, the two h-wide ones), LayerNorms' gradients, the residual branches' sums, the QKV gradient's
    # concatenation, the softmax scale applied to q's and k's gradients.
    assert backward["elementwise_ffn_passes"] == pytest.approx(4.0)
    assert backward["elementwise_hidden_passes"] == pytest.approx(27.0, abs=0.15)
    assert backward["elementwise_passes_by_op"]["gelu_backward"] == pytest.approx(3 * f)
    assert backward["elementwise_passes_by_op"]["mul"] == pytest.approx(4.0)
    assert backward["elementwise_passes_by_op"]["sum"] == pytest.approx(5 + f, abs=0.05)
    # the fill autograd zero-initialises the score gradient's buffer with is score traffic, not elementwise
    assert "new_zeros" not in backward["elementwise_passes_by_op"]
    assert backward["score_passes_by_op"]["new_zeros"] == pytest.approx(1.0)
