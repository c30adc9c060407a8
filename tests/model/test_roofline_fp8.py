"""The roofline's FP8 linear GEMMs (`decoder_roofline.fp8_linear_gemms`): under Transformer Engine's FP8 the four
linear layers' forward, input-gradient and weight-gradient GEMMs run at the device's FP8 peak, the attention core at
the bf16 peak; checked against the closed form of a Llama 3 70B layer on the DGX H100 (datasheet peaks 989.5 and
1,979 TFLOP/s dense)."""

from __future__ import annotations

import pytest

from hops_calib.loop.model_files import load_model
from hops_calib.model import TERMS, Context
from hops_calib.model.terms.base import layout_of
from hops_calib.model.terms.roofline import fp8_linear_gemms
from hops_calib.spec import Hardware, spec_from_args

# Llama 3 70B as the dgxc runs launch it: t 8, p 4, s 8192, GQA 8 of 64 heads, SwiGLU
LLAMA_70B = {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 4, "world_size": 64, "num_layers": 80,
             "hidden_size": 8192, "ffn_hidden_size": 28672, "num_attention_heads": 64, "group_query_attention": True,
             "num_query_groups": 8, "seq_length": 8192, "max_position_embeddings": 8192, "micro_batch_size": 1,
             "global_batch_size": 128, "vocab_size": 128256, "bf16": True, "swiglu": True, "normalization": "RMSNorm",
             "position_embedding_type": "rope", "disable_bias_linear": True, "untie_embeddings_and_output_weights":
             True, "sequence_parallel": True, "transformer_impl": "transformer_engine"}
FP8 = {**LLAMA_70B, "fp8_format": "hybrid"}
EFFICIENCY, BACKWARD = 0.7, 2.5


def dgx_spec(args: dict):
    return spec_from_args(args, "test", run_id="fp8", iterations=2, hardware=Hardware(gpu="h100_dgx",
                                                                                     gpus_per_node=8))


def priced(args: dict, switch: float):
    model = load_model()
    spec = dgx_spec(args)
    term = TERMS["decoder_roofline"]
    values = {**term.defaults(), "compute_efficiency": EFFICIENCY, "backward_factor": BACKWARD,
              "fp8_linear_gemms": switch}
    device = model.device("h100_dgx")
    return term.contribute(Context(spec, layout_of(spec), (device,) * spec.pp), values), spec


def closed_form() -> tuple[float, float]:
    """(linear, core) FLOPs of one layer's forward on one GPU of the 8: QKV 2sh(h + 2hg/a), projection 2sh^2, the
    SwiGLU MLP 3 x 2shf, all over t; the score and context products 4s^2h over t."""
    s, h, f, t = 8192, 8192, 28672, 8
    linear = (2 * s * h * (h + 2 * h * 8 / 64) + 2 * s * h * h + 3 * 2 * s * h * f) / t
    return linear, 4 * s * s * h / t


def test_fp8_linear_gemms_run_at_the_fp8_peak_and_the_attention_core_at_the_bf16_peak() -> None:
    linear, core = closed_form()
    bf16_flops_per_ms, fp8_flops_per_ms = 989.5e12 * EFFICIENCY / 1e3, 1979e12 * EFFICIENCY / 1e3
    layers = 80 // 4
    costs, spec = priced(FP8, 1.0)
    assert fp8_linear_gemms(spec) == (True, True)
    forward = linear / fp8_flops_per_ms + core / bf16_flops_per_ms
    assert costs.forward_ms[0] == pytest.approx(layers * forward, rel=1e-12)
    assert costs.backward_ms[0] == pytest.approx(layers * BACKWARD * forward, rel=1e-12)
    assert costs.weight_grad_ms[0] == pytest.approx(layers * linear / fp8_flops_per_ms, rel=1e-12)
    assert costs.attention_core_ms[0] == pytest.approx(layers * core / bf16_flops_per_ms, rel=1e-12)
    # against the same launch in bf16: the layer's forward takes (W/2 + C) / (W + C) of its time
    bf16, _ = priced(LLAMA_70B, 1.0)
    assert costs.forward_ms[0] / bf16.forward_ms[0] == pytest.approx((linear / 2 + core) / (linear + core), rel=1e-12)


def test_no_fp8_wgrad_keeps_the_weight_gradient_at_the_bf16_peak() -> None:
    linear, core = closed_form()
    bf16_flops_per_ms, fp8_flops_per_ms = 989.5e12 * EFFICIENCY / 1e3, 1979e12 * EFFICIENCY / 1e3
    costs, spec = priced({**FP8, "fp8_wgrad": False}, 1.0)
    assert fp8_linear_gemms(spec) == (True, False)
    forward = linear / fp8_flops_per_ms + core / bf16_flops_per_ms
    wgrad_extra = linear / bf16_flops_per_ms - linear / fp8_flops_per_ms
    assert costs.weight_grad_ms[0] == pytest.approx(20 * linear / bf16_flops_per_ms, rel=1e-12)
    assert costs.backward_ms[0] == pytest.approx(20 * (BACKWARD * forward + wgrad_extra), rel=1e-12)


def test_the_switch_off_or_a_bf16_launch_prices_every_gemm_at_the_bf16_peak() -> None:
    linear, core = closed_form()
    bf16_flops_per_ms = 989.5e12 * EFFICIENCY / 1e3
    off, _ = priced(FP8, 0.0)
    bf16, spec = priced(LLAMA_70B, 1.0)
    assert fp8_linear_gemms(spec) == (False, False)
    assert off == bf16
    assert off.forward_ms[0] == pytest.approx(20 * (linear + core) / bf16_flops_per_ms, rel=1e-12)
