"""Model room: what a kernel is (`Kernel`: what one kernel a training step launches computes and moves), the launch
settings that decide which kernels run (`KernelSettings`, read from Megatron's arguments by `settings_from_args`),
and the builder the kernel lists (`layer_kernels`, `stage_kernels`) are written with. Pure, as `kernels` is."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hops_calib.model import gpt
from hops_calib.spec import ModelShape

FORWARD, DGRAD, WGRAD, RECOMPUTE = "forward", "dgrad", "wgrad", "recompute"
PHASES = (FORWARD, DGRAD, WGRAD, RECOMPUTE)
GEMM, ATTENTION, MEMORY, COLLECTIVE = "gemm", "attention", "memory", "collective"
FP32 = 4
FP8_BYTES = 1  # an FP8 element (E4M3 or E5M2)
MASK_BYTES = 1  # a dropout or attention mask element (torch.bool / uint8)
INDEX_BYTES = 8  # token ids and positions (int64)
# Flash attention's rows per thread block: the causal kernel runs the diagonal blocks whole, so it executes
# (1 + FLASH_BLOCK / s) times the causal half of the score and context products (FlashAttention-2, Dao 2023,
# sec. 3.1: blocks of 128 queries on A100/H100).
FLASH_BLOCK = 128
# Flash attention's backward runs five products to the forward's two (it recomputes the scores; FlashAttention-2,
# Dao 2023, sec. 3.1.2, Algorithm 2): 2.5 x the forward's FLOPs, where Megatron counts 2 x.
FLASH_BACKWARD_PRODUCTS = 2.5


@dataclass(frozen=True)
class Kernel:
    """One kernel (or one collective) a training step launches: what it computes and moves."""

    name: str  # module and operation, e.g. "attention.linear_qkv" or "mlp.bias_gelu"
    op: str  # GEMM, ATTENTION (a fused flash kernel), MEMORY (a memory-bound kernel) or COLLECTIVE
    phase: str  # FORWARD, DGRAD (the input gradient), WGRAD (the weight gradient) or RECOMPUTE
    kind: str = ""  # MEMORY: the memory table's kernel (copy, add, layernorm, softmax, gelu...); COLLECTIVE: its op
    dtype: str = ""
    m: int = 0
    n: int = 0
    k: int = 0
    batch: int = 1
    flops: float = 0.0
    model_flops: float = 0.0
    bytes: float = 0.0  # read + written; a collective's: the whole buffer (an all-gather's output)
    group: str = ""  # COLLECTIVE: "tp"
    core_attention: bool = False  # part of the attention core (`--recompute-granularity selective` redoes it)
    overlapped: bool = False  # COLLECTIVE: asynchronous, under the weight-gradient GEMM launched after it
    source: str = ""  # the megatron-core file and function that launches it

    @property
    def shape(self) -> str:
        if self.op in (GEMM, ATTENTION):
            return (f"{self.batch} x " if self.batch > 1 else "") + f"{self.m} x {self.n} x {self.k}"
        return ""


@dataclass(frozen=True)
class KernelSettings:
    """The launch settings that decide which kernels a layer launches (Megatron-LM's argument defaults)."""

    transformer_engine: bool = True  # --transformer-impl transformer_engine (default) or local
    softmax_fused: bool = True  # the fused scale-mask-softmax kernel runs (asked for and the shape fits it)
    bias: bool = True  # --disable-bias-linear turns the linear layers' biases off
    bias_activation_fusion: bool = True  # --no-bias-gelu-fusion / --no-bias-swiglu-fusion
    bias_dropout_fusion: bool = True  # --no-bias-dropout-fusion
    rope_fusion: bool = True  # --no-rope-fusion
    gradient_accumulation_fusion: bool = True  # --no-gradient-accumulation-fusion
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    softmax_in_fp32: bool = False  # --attention-softmax-in-fp32
    # FP8 through Transformer Engine (`transformer/transformer_config.py` fp8, fp8_recipe, fp8_param, fp8_wgrad):
    # "" (16-bit GEMMs), "hybrid" (E4M3 forward, E5M2 gradients) or "e4m3"; the recipe: "delayed" (Megatron's
    # default), "tensorwise" (current scaling) or "blockwise"
    fp8: str = ""
    fp8_recipe: str = "delayed"
    fp8_param_gather: bool = False  # --fp8-param-gather: the model's weights kept in FP8, all-gathered in FP8
    fp8_wgrad: bool = True  # --no-fp8-wgrad: the weight gradient in 16 bits
    cp_comm_type: str = "p2p"  # --cp-comm-type p2p|a2a|allgather (context parallelism's exchange)
    # A model parameter, not a launch setting: the tokens the busiest local expert computes against its balanced
    # share (`gpt.expert_token_scale`); the layer terms set it from their `expert_load_imbalance`
    expert_load_imbalance: float = 1.0

    def dropout(self, which: str) -> bool:
        return (self.hidden_dropout if which == "hidden" else self.attention_dropout) > 0


def _flag(args: Mapping[str, Any], name: str, default: bool) -> bool:
    """A switch under its own name (a rank log's arguments block) or as --no-NAME (a command line)."""
    if name in args and args[name] is not None:
        return bool(args[name])
    if f"no_{name}" in args:
        return not bool(args[f"no_{name}"])
    return default


def _probability(args: Mapping[str, Any], name: str) -> float:
    """--hidden-dropout / --attention-dropout of a launch, Megatron-LM's default 0.1 when not given."""
    value = args.get(name, 0.1)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.1


def dropout_probability(args: Mapping[str, Any], which: str) -> float:
    """The launch's dropout probability of `which` ("hidden" or "attention"), Megatron-LM's 0.1 when not given."""
    return _probability(args, f"{which}_dropout")


FP8_RECIPES = ("delayed", "tensorwise", "blockwise")  # the recipes priced (mxfp8 is Blackwell's; custom is code)


def fp8_format(args: Mapping[str, Any]) -> str:
    """The launch's FP8 format: `--fp8-format hybrid|e4m3` (`args.fp8`), Megatron-LM's older `--fp8-hybrid` /
    `--fp8-e4m3`, else "" (no FP8)."""
    for key in ("fp8", "fp8_format"):
        value = args.get(key)
        if isinstance(value, str) and value:
            return value
    if args.get("fp8_hybrid"):
        return "hybrid"
    if args.get("fp8_e4m3"):
        return "e4m3"
    return ""


def settings_from_args(
    args: Mapping[str, Any], *, softmax_fused: bool, gradient_accumulation_fusion: bool
) -> KernelSettings:
    """The kernel settings of a launch's arguments (Megatron's `args.` spelling), Megatron-LM's defaults where a
    setting is absent (`megatron/training/arguments.py`: --transformer-impl transformer_engine, the bias, bias-GeLU,
    bias-SwiGLU, bias-dropout and RoPE fusions on, dropouts 0.1). Whether the fused softmax runs and whether weight
    gradients accumulate in the GEMM are decided by the attention and elementwise terms' readers
    (`terms.attention.softmax_fused`, `terms.elementwise.gradient_accumulation_fused`), passed in."""
    return KernelSettings(
        transformer_engine=str(args.get("transformer_impl", "transformer_engine")) == "transformer_engine",
        softmax_fused=softmax_fused,
        bias=not bool(args.get("disable_bias_linear")) and _flag(args, "add_bias_linear", True),
        bias_activation_fusion=_flag(args, "bias_swiglu_fusion" if args.get("swiglu") else "bias_gelu_fusion", True),
        bias_dropout_fusion=_flag(args, "bias_dropout_fusion", True),
        rope_fusion=_flag(args, "apply_rope_fusion", True) and not bool(args.get("no_rope_fusion")),
        gradient_accumulation_fusion=gradient_accumulation_fusion,
        hidden_dropout=_probability(args, "hidden_dropout"),
        attention_dropout=_probability(args, "attention_dropout"),
        softmax_in_fp32=bool(args.get("attention_softmax_in_fp32")),
        fp8=fp8_format(args),
        fp8_recipe=str(args.get("fp8_recipe") or "delayed"),
        fp8_param_gather=bool(args.get("fp8_param_gather")),
        fp8_wgrad=_flag(args, "fp8_wgrad", True),
        cp_comm_type=_cp_comm_type(args),
    )


def _cp_comm_type(args: Mapping[str, Any]) -> str:
    """--cp-comm-type (a list, one per layer, in Megatron-LM; one value for all layers is what is priced)."""
    value = args.get("cp_comm_type") or "p2p"
    return str(value[0] if isinstance(value, list) and value else value)


class _Builder:
    """Collects the kernels of one phase with the shape's element size and dtype."""

    def __init__(self, shape: ModelShape, phase: str) -> None:
        self.shape, self.phase = shape, phase
        self.e = gpt.bytes_per_element(shape)
        self.dtype = shape.precision
        self.kernels: list[Kernel] = []

    def gemm(
        self,
        name: str,
        m: int,
        n: int,
        k: int,
        *,
        batch: int = 1,
        source: str,
        accumulate_fp32: bool = False,
        core: bool = False,
        model_share: float = 1.0,
        phase: str | None = None,
        fp8: bool = False,
        dtype: str | None = None,
        model_flops: float | None = None,
    ) -> None:
        """A GEMM of (m x k) by (k x n): 2mnk FLOPs (x batch); reads A and B, writes C (with `accumulate_fp32`,
        reads and writes the fp32 main gradient instead: `wgrad_gemm_accum_fp32`). `model_share`: the part of
        its FLOPs Megatron's count credits (1/2 for the causal score and context products); `model_flops` that
        count itself where it is no share of the executed one (an expert's balanced tokens against the busiest
        expert's). `fp8`: A and B in FP8 (one byte each), C in the training precision (TE's FP8 GEMM,
        `te.cpp_extensions.general_gemm`); `dtype` another precision than the training one (the fp32 router)."""
        flops = 2.0 * batch * m * n * k
        element = FP32 if dtype == "fp32" else self.e
        out = 2 * FP32 if accumulate_fp32 else element
        operand = FP8_BYTES if fp8 else element
        self.kernels.append(
            Kernel(
                name,
                GEMM,
                phase or self.phase,
                dtype="fp8" if fp8 else dtype or self.dtype,
                m=m,
                n=n,
                k=k,
                batch=batch,
                flops=flops,
                model_flops=flops * model_share if model_flops is None else model_flops,
                bytes=float(batch * (m * k + k * n) * operand + batch * m * n * out),
                core_attention=core,
                source=source,
            )
        )

    def memory(
        self, name: str, kind: str, nbytes: float, *, source: str, core: bool = False, phase: str | None = None
    ) -> None:
        self.kernels.append(
            Kernel(
                name,
                MEMORY,
                phase or self.phase,
                kind=kind,
                dtype=self.dtype,
                bytes=float(nbytes),
                core_attention=core,
                source=source,
            )
        )

    def collective(
        self,
        name: str,
        op: str,
        nbytes: float,
        *,
        source: str,
        overlapped: bool = False,
        phase: str | None = None,
        group: str = "tp",
        dtype: str = "",
    ) -> None:
        if group != "tp" or max(1, self.shape.tensor_parallel) > 1:
            self.kernels.append(
                Kernel(
                    name,
                    COLLECTIVE,
                    phase or self.phase,
                    kind=op,
                    dtype=dtype or self.dtype,
                    bytes=float(nbytes),
                    group=group,
                    overlapped=overlapped,
                    source=source,
                )
            )


@dataclass(frozen=True)
class _Dims:
    """A layer's sizes on one GPU of its tensor-parallel group."""

    t: int
    tokens: int  # s x b: the tokens a GEMM sees (whole sequences, gathered under sequence parallelism)
    local: int  # the tokens the norms, dropouts and residuals see (s x b / t under sequence parallelism)
    h: int
    head: int  # kv_channels: h / a
    heads: int  # a / t
    groups: int  # g / t
    ffn: int  # f / t
    s: int  # the whole sequence (the keys a query attends to)
    b: int
    cp: int = 1  # context-parallel GPUs: each holds s / cp of every sequence's tokens

    @property
    def q(self) -> int:
        return self.heads * self.head

    @property
    def kv(self) -> int:
        return self.groups * self.head

    @property
    def qkv(self) -> int:
        return self.q + 2 * self.kv


def _dims(shape: ModelShape) -> _Dims:
    t = max(1, int(shape.tensor_parallel))
    tokens = gpt.local_tokens(shape)  # s / cp x b under context parallelism
    return _Dims(
        t=t,
        tokens=tokens,
        local=tokens // t if shape.sequence_parallel else tokens,
        h=shape.hidden_size,
        head=shape.hidden_size // shape.num_attention_heads,
        heads=shape.num_attention_heads // t,
        groups=shape.kv_heads // t,
        ffn=shape.ffn_hidden_size // t,
        s=shape.seq_length,
        b=shape.micro_batch_size,
        cp=max(1, int(shape.context_parallel)),
    )


_LINEAR = "tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication"
_TE_LINEAR = "extensions/transformer_engine.py TELayerNormColumnParallelLinear / TERowParallelLinear (TE GEMM)"
_LAYER = "transformer/transformer_layer.py TransformerLayer"
_CORE = "transformer/dot_product_attention.py DotProductAttention.forward"
_SOFTMAX = "fusions/fused_softmax.py FusedScaleMaskSoftmax"
_BDA = "fusions/fused_bias_dropout.py _bias_dropout_add_func"
_ROPE = "models/common/embeddings/rope_utils.py apply_rotary_pos_emb"
_MAPPINGS = "tensor_parallel/mappings.py"
_LAYER_TRAFFIC = "experiments/scripts/layer_traffic.py (ATen ops of the local layer, counted)"

_TE_FP8 = (
    "transformer_engine/pytorch/module (TE's quantizers under fp8_autocast; megatron-core fp8_utils.py get_fp8_context)"
)


def _fp8(s: KernelSettings) -> bool:
    """The linear layers' GEMMs run in FP8: --fp8-format with the Transformer Engine layer (`fp8_utils.py`
    `get_fp8_context` wraps the TE modules in `fp8_autocast`; the local layer has no FP8 path)."""
    return bool(s.fp8) and s.transformer_engine
