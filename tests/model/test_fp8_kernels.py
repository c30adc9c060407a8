"""FP8 through Transformer Engine (issue #28, section 1): which GEMMs run in FP8 and at which peak, the casts and
their bytes, the stored activations and weights, checked against closed forms on Llama-shaped launches."""

from __future__ import annotations

import pytest
from test_kernels import LLAMA_70B, iteration_model_flops

from hops_calib.loop.model_files import load_model
from hops_calib.model import kernels as K
from hops_calib.model import memory
from hops_calib.model.kernel_pricing import Pricer, Rates, peak_flops_per_s
from hops_calib.model.terms.decoder_kernels import kernel_settings
from hops_calib.spec import Hardware, spec_from_args
from hops_calib.trace import TraceError

FP8 = {**LLAMA_70B, "fp8": "hybrid"}


def h100_spec(args: dict):
    return spec_from_args(args, "test", run_id="fp8", iterations=2, hardware=Hardware(gpu="h100", gpus_per_node=8))


def layer(spec) -> tuple[K.Kernel, ...]:
    settings = kernel_settings(spec)
    return K.layer_forward(spec.model, settings) + K.layer_backward(spec.model, settings)


def test_an_fp8_launch_is_priced_with_its_linear_gemms_in_fp8_and_the_rest_in_bf16() -> None:
    spec = h100_spec(FP8)
    settings = kernel_settings(spec)
    assert (settings.fp8, settings.fp8_recipe, settings.fp8_param_gather) == ("hybrid", "delayed", False)
    # FP8 changes no FLOP: the kernels still add up to Megatron's count
    assert iteration_model_flops(spec) == pytest.approx(K.megatron_flops(FP8, 128), rel=1e-12)
    gemms = [k for k in layer(spec) if k.op == K.GEMM]
    fp8 = {k.name for k in gemms if k.dtype == "fp8"}
    linears = ("attention.linear_qkv", "attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    assert fp8 == {f"{n}{p}" for n in linears for p in ("", ".dgrad", ".wgrad")}
    assert all(k.dtype == "bf16" for k in layer(spec) if k.op == K.ATTENTION)  # the core stays 16-bit
    ends = K.output_kernels(spec.model, settings)
    assert next(k for k in ends if k.name == "output.logits").dtype == "bf16"  # ColumnParallelLinear, not TE
    # an FP8 GEMM reads one byte per operand element
    qkv = next(k for k in gemms if k.name == "attention.linear_qkv")
    assert qkv.bytes == qkv.m * qkv.k + qkv.k * qkv.n + 2 * qkv.m * qkv.n
    # --no-fp8-wgrad keeps the weight gradients in bf16
    wgrad16 = kernel_settings(h100_spec({**FP8, "fp8_wgrad": False}))
    assert {k.dtype for k in K.layer_backward(spec.model, wgrad16) if k.op == K.GEMM and k.phase == K.WGRAD} == \
        {"bf16"}
    # the local layer has no FP8 path: the launch is refused naming the flag
    with pytest.raises(TraceError) as caught:
        h100_spec({**FP8, "transformer_impl": "local"})
    assert caught.value.field == "fp8" and "--fp8-format" in str(caught.value)  # the block's key, and the flag


def test_fp8_gemms_run_at_the_fp8_peak() -> None:
    """H100 without a catalog FP8 peak: twice the bf16 peak (the datasheet's ratio); a compute-bound GEMM then
    takes half its bf16 time on the default curve, the same tiles and waves. A100 has no FP8 tensor cores."""
    model = load_model()
    h100 = model.device("h100")
    assert peak_flops_per_s(h100, "fp8") == 2 * h100.peak_bf16_flops_per_s
    with pytest.raises(ValueError, match="no FP8 tensor cores"):
        peak_flops_per_s(model.device("a100"), "fp8")
    pricer = Pricer(h100, None, Rates())
    spec = h100_spec(FP8)
    bf16 = {k.name: k for k in layer(h100_spec(LLAMA_70B)) if k.op == K.GEMM}
    for kernel in (k for k in layer(spec) if k.op == K.GEMM and k.dtype == "fp8"):
        fast, slow = pricer.price(kernel), pricer.price(bf16[kernel.name])
        assert fast.bound == slow.bound == "compute" and fast.waves == slow.waves
        assert fast.ms == pytest.approx(slow.ms / 2, rel=1e-12)
    # an FP8 full tile reaching less of its doubled peak (fp8_gemm_efficiency) slows the FP8 GEMMs alone, by the
    # ratio of the two efficiencies; the 16-bit GEMMs keep gemm_efficiency's time
    lower = Pricer(h100, None, Rates(fp8_gemm_efficiency=0.6))
    for kernel in (k for k in layer(spec) if k.op == K.GEMM):
        before, after = pricer.price(kernel), lower.price(kernel)
        if kernel.dtype == "fp8":
            assert after.ms == pytest.approx(before.ms * 0.8 / 0.6, rel=1e-12)
        else:
            assert after.ms == before.ms


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise"])
def test_the_fp8_casts_move_their_closed_form_bytes(recipe: str) -> None:
    """Per layer and microbatch (T tokens, widths per GPU, 2-byte activations): each linear's input quantized
    with its transpose (4 B an element; under delayed scaling the norms write FP8 and the QKV and fc1 inputs need
    only their transpose, 2 B) and its output gradient (4 B); tensorwise scaling first reads each for its amax
    (2 B); the norms' writes shrink to 1 B under delayed scaling."""
    spec = h100_spec({**FP8, "fp8_recipe": recipe})
    d = K._dims(spec.model)
    T, h, q, fc1, f = d.tokens, d.h, d.q, 2 * d.ffn, d.ffn
    inputs = {"qkv": T * h, "proj": T * q, "fc1": T * h, "fc2": T * f}
    outputs = {"qkv": T * d.qkv, "proj": T * h, "fc1": T * fc1, "fc2": T * h}
    kernels = layer(spec)
    casts = sum(k.bytes for k in kernels if k.kind in ("cast_transpose", "transpose"))
    if recipe == "delayed":
        expected_in = 2 * (inputs["qkv"] + inputs["fc1"]) + 4 * (inputs["proj"] + inputs["fc2"])
    else:
        expected_in = 4 * sum(inputs.values())
    assert casts == expected_in + 4 * sum(outputs.values())
    amax = sum(k.bytes for k in kernels if k.kind == "amax")
    assert amax == (2 * (sum(inputs.values()) + sum(outputs.values())) if recipe == "tensorwise" else 0)
    norms = {k.name: k.bytes for k in kernels if k.kind == "rmsnorm" and k.phase == K.FORWARD}
    plain = {k.name: k.bytes for k in layer(h100_spec(LLAMA_70B)) if k.kind == "rmsnorm" and k.phase == K.FORWARD}
    shrink = d.local * h if recipe == "delayed" else 0
    assert all(norms[n] == plain[n] - shrink for n in plain)
    # delayed scaling's amax bookkeeping: once per chunk and microbatch, none for the others
    scaling = K.fp8_scaling_kernels(spec.model, kernel_settings(spec), 20)
    assert bool(scaling) == (recipe == "delayed")
    # the weights: cast with their transpose once per iteration (4 B a weight), only transposed under param gather
    weights = sum(out * inp for _, out, inp in K.linear_weights(spec.model))
    assert sum(k.bytes for k in K.fp8_weight_kernels(spec.model, kernel_settings(spec))) == 4 * weights
    gathered = h100_spec({**FP8, "fp8_recipe": recipe, "fp8_param_gather": True})
    assert sum(k.bytes for k in K.fp8_weight_kernels(gathered.model, kernel_settings(gathered))) == 2 * weights


def test_fp8_memory_per_gpu() -> None:
    """Activations shrink by the linear inputs' second byte (s b h for QKV and fc1, s b h + s b f for the
    projection and fc2, all split t ways under sequence parallelism); weights grow by the FP8 copy and transpose
    of the linear weights (2 B each), which --fp8-param-gather trades for the 16-bit weight (net zero)."""
    plain, fp8, gathered = (h100_spec(a) for a in (LLAMA_70B, FP8, {**FP8, "fp8_param_gather": True}))
    devices, peak = [80e9] * plain.pp, [4.0] * plain.pp
    base, low, param = (memory.stage_memory(s, devices, peak) for s in (plain, fp8, gathered))
    shape = plain.model
    s, b, h, f, t = shape.seq_length, shape.micro_batch_size, shape.hidden_size, shape.ffn_hidden_size, 8
    saving = (3 * s * b * h + s * b * f) / t
    assert memory.fp8_activation_saving(shape) == saving
    for rank in range(plain.pp):
        layers = plain.layers_per_stage[rank]
        linear = layers * (h * (h + 2 * h // 8) + h * h + 2 * h * f + f * h) / t  # GQA 8 of 64 heads, SwiGLU
        assert base[rank].activations_bytes - low[rank].activations_bytes == pytest.approx(4 * layers * saving)
        assert low[rank].weights_bytes - base[rank].weights_bytes == pytest.approx(2 * linear)
        assert param[rank].weights_bytes == pytest.approx(base[rank].weights_bytes)
        assert low[rank].optimizer_bytes == base[rank].optimizer_bytes
        # the distributed optimizer's all-gather moves the linear weights in FP8 under --fp8-param-gather
        parameters = base[rank].weights_bytes / 2
        assert memory.parameter_gather_bytes(plain, parameters, layers) == 2 * parameters
        assert memory.parameter_gather_bytes(fp8, parameters, layers) == 2 * parameters
        assert memory.parameter_gather_bytes(gathered, parameters, layers) == pytest.approx(2 * parameters - linear)
