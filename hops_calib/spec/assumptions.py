"""What the cost model assumes of a launch: the settings it prices (ASSUMPTIONS), the ones a launch sets that it
does not (`unmodelled`, refused by `require_modelled`), and flags it neither prices nor knows (`unknown_flags`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _flag(key: str) -> str:
    """The command-line flag of an argument's `args.` name: num_layers -> --num-layers."""
    return "--" + key.replace("_", "-")


@dataclass(frozen=True)
class Assumption:
    """One Megatron launch setting the cost model assumes: the model prices `modelled`, nothing else.

    `keys` are the setting's names in the parsed arguments (a command line's `--no-<key>` form counts as <key> =
    False); `default` is Megatron-LM's when the launch does not name it; `fits(value, args)` says whether the model
    prices the value. Settings not listed here (logging, seeds, paths, learning rate, ...) do not change what an
    iteration computes, or are priced (`--untie-embeddings-and-output-weights`, `--clip-grad`,
    `--no-gradient-accumulation-fusion`, the split of layers, the shape, the batch), and are not checked.
    """

    flag: str  # the command-line flag a user edits
    keys: tuple[str, ...]
    default: Any
    modelled: str  # what the model prices, in words
    fits: Any  # Callable[[value, args], bool]

    def value(self, args: dict[str, Any]) -> tuple[str | None, Any]:
        """(the key it was found under, or None when unset, and the value Megatron runs with)."""
        for key in self.keys:
            if key in args:
                return key, args[key]
            if f"no_{key}" in args:
                return f"no_{key}", not args[f"no_{key}"]
        return None, self.default


def _is(*values: Any):
    return lambda value, args: value in values


_off = _is(False, None)  # a switch left off (a rank log's block prints False; None where a version prints that)


def _interleaved(args: dict[str, Any]) -> bool:
    """Whether the launch configures virtual stages (a layout of more stages than ranks does too)."""
    layout = args.get("pipeline_model_parallel_layout")
    if layout:
        from hops_calib.spec.stage_layers import LayoutError, parse_layout

        try:
            return len(parse_layout(str(layout))) > (args.get("pipeline_model_parallel_size") or 1)
        except LayoutError:
            return False  # refused with its reason when the spec reads the split
    return (
        bool(args.get("num_layers_per_virtual_pipeline_stage"))
        or (args.get("virtual_pipeline_model_parallel_size") or 1) > 1
    )


# Megatron-FSDP's sharding strategies (src/megatron_fsdp/distributed_data_parallel_config.py
# data_parallel_sharding_strategy; MegatronFSDP's docstring): no_shard (ZeRO-0: DDP), optim (ZeRO-1: optimizer state
# and main weights), optim_grads (ZeRO-2: and gradients), optim_grads_params (ZeRO-3: and the weights).
FSDP_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def fsdp_strategy(args: dict[str, Any]) -> str:
    """The launch's Megatron-FSDP sharding strategy (one of FSDP_STRATEGIES; Megatron-LM's default no_shard), or ""
    without --use-megatron-fsdp (its deprecated spelling --use-custom-fsdp counts too): Megatron's own DDP then
    reads no --data-parallel-sharding-strategy."""
    if not (_on(args, "use_megatron_fsdp") or _on(args, "use_custom_fsdp")):
        return ""
    return str(args.get("data_parallel_sharding_strategy") or "no_shard")


def _on(args: dict[str, Any], key: str) -> bool:
    return bool(args.get(key)) or (f"no_{key}" in args and not args[f"no_{key}"])


def _fp8(args: dict[str, Any]) -> bool:
    """Whether the launch runs FP8 GEMMs (--fp8-format, or Megatron-LM's older --fp8-hybrid / --fp8-e4m3)."""
    return any(isinstance(args.get(key), str) and args.get(key) for key in ("fp8", "fp8_format")) or bool(
        args.get("fp8_hybrid") or args.get("fp8_e4m3")
    )


# The Megatron GPT the cost terms count (hops_calib/model/gpt.py and the terms' physics): tensor, sequence, data and
# pipeline parallelism; Megatron's local or Transformer Engine layer with LayerNorm or RMSNorm, multi-head or
# grouped-query attention with learned absolute or rotary positions, unfused or fused (flash) attention, a GeLU or
# SwiGLU MLP; activations stored or recomputed (`recomputation_of`); 16- or 32-bit arithmetic, FP8 GEMMs through TE;
# context parallelism; blocking, batched or (interleaved 1F1B) overlapped p2p calls.
# What it does not price is listed here, each with what it prices instead.
ASSUMPTIONS: tuple[Assumption, ...] = (
    # Context parallelism (`model/kernels.py` `_core_attention`: TE's attention with a cp group): only TE's
    # DotProductAttention has it (the local one asserts cp == 1)
    Assumption(
        "--context-parallel-size",
        ("context_parallel_size",),
        1,
        "context parallel size 1, or more with --transformer-impl transformer_engine",
        lambda value, args: (
            value in (None, 1)
            or (
                isinstance(value, int)
                and value > 1
                and args.get("transformer_impl", "transformer_engine") == "transformer_engine"
            )
        ),
    ),
    # a2a+p2p needs --hierarchical-context-parallel-sizes, a two-level exchange not priced
    Assumption(
        "--cp-comm-type",
        ("cp_comm_type",),
        "p2p",
        "--cp-comm-type p2p, a2a or allgather",
        lambda value, args: (
            (value[0] if isinstance(value, list) and len(set(value)) == 1 else value)
            in (None, "p2p", "a2a", "allgather")
        ),
    ),
    # DeepSpeed-Ulysses sequence parallelism (Megatron-DeepSpeed) splits the sequence over GPUs: context
    # parallelism by another name, with all-to-alls the model does not price.
    Assumption(
        "--ds-sequence-parallel-size",
        ("ds_sequence_parallel_size",),
        1,
        "no DeepSpeed-Ulysses sequence parallelism (its all-to-alls are not priced)",
        _is(1, None),
    ),
    # A mixture of experts (`hops_calib.spec.arguments.moe_settings_of`, `hops_calib.model.moe`): the alltoall
    # and allgather token dispatchers, an MoE MLP in every layer, dropless or with a capacity factor, a shared expert.
    # What megatron-core runs otherwise is refused by name.
    Assumption(
        "--moe-token-dispatcher-type",
        ("moe_token_dispatcher_type",),
        "allgather",
        "the alltoall or allgather token dispatcher (flex's DeepEP / HybridEP fused all-to-all is not priced)",
        lambda value, args: not _moe(args) or value in (None, "alltoall", "allgather"),
    ),
    Assumption(
        "--moe-layer-freq",
        ("moe_layer_freq",),
        1,
        "an MoE MLP in every layer (--moe-layer-freq 1; a pattern of dense and MoE layers is not priced)",
        lambda value, args: not _moe(args) or _every_layer(value),
    ),
    Assumption(
        "--moe-shared-expert-overlap",
        ("moe_shared_expert_overlap",),
        False,
        "the shared expert run in turn with the routed ones (its overlap with the dispatch is not priced)",
        lambda value, args: not _moe(args) or not value,
    ),
    Assumption(
        "--moe-layer-recompute",
        ("moe_layer_recompute",),
        False,
        "the MoE layer's activations stored (its recomputation is not priced; --recompute-granularity is)",
        lambda value, args: not _moe(args) or not value,
    ),
    Assumption(
        "--moe-router-dtype",
        ("moe_router_dtype",),
        None,
        "the router in the training precision or fp32 (--moe-router-dtype fp32)",
        lambda value, args: value in (None, "fp32"),
    ),
    Assumption(
        "--num-experts",
        ("num_experts",),
        None,
        "a dense MLP, or a whole number of experts",
        lambda value, args: value in (None, 0, 1) or isinstance(value, int),
    ),
    # What experts do not run with, each refused by the flag that the launch adds to a priced mixture of experts
    # (and the sentence names --num-experts): FP8 experts run TE's grouped FP8 GEMMs with padded token counts
    # (--moe-router-padding-for-quantization), the overlapped userbuffers are the dense MLP's, Megatron-FSDP shards
    # experts over the expert data-parallel group: none priced under experts
    *(
        Assumption(
            flag,
            keys,
            None,
            "FP8 GEMMs with a dense MLP only, not with --num-experts: FP8 experts run Transformer Engine's grouped "
            "FP8 GEMMs on padded token counts, not priced",
            lambda value, args: not _moe(args) or not _fp8(args) or value in (None, False),
        )
        for flag, keys in (
            ("--fp8-format", ("fp8_format", "fp8")),
            ("--fp8-hybrid", ("fp8_hybrid",)),
            ("--fp8-e4m3", ("fp8_e4m3",)),
        )
    ),
    Assumption(
        "--tp-comm-overlap",
        ("tp_comm_overlap",),
        False,
        "--tp-comm-overlap with a dense MLP only, not with --num-experts: the overlapped userbuffers priced are "
        "the dense MLP's",
        lambda value, args: not _moe(args) or not value,
    ),
    Assumption(
        "--use-megatron-fsdp",
        ("use_megatron_fsdp", "use_custom_fsdp"),
        False,
        "Megatron-FSDP with a dense MLP only, not with --num-experts: its sharding of the experts over the "
        "expert data-parallel group is not priced",
        lambda value, args: not _moe(args) or not fsdp_strategy(args),
    ),
    Assumption(
        "--multi-latent-attention",
        ("multi_latent_attention",),
        False,
        "multi-head or grouped-query attention, no multi-latent attention",
        _off,
    ),
    Assumption(
        "--normalization",
        ("normalization",),
        "LayerNorm",
        "LayerNorm or RMSNorm",
        lambda value, args: str(value).lower() in ("layernorm", "rmsnorm"),
    ),
    Assumption(
        "--position-embedding-type",
        ("position_embedding_type",),
        "learned_absolute",
        "learned absolute or rotary (rope) position embeddings",
        _is("learned_absolute", "rope"),
    ),
    Assumption(
        "--transformer-impl",
        ("transformer_impl",),
        "transformer_engine",
        "Megatron's local layer or Transformer Engine's (--transformer-impl local|transformer_engine)",
        _is("local", "transformer_engine"),
    ),
    # FP8 through Transformer Engine: the linear layers' GEMMs in FP8 with their casts (`model/kernels.py`
    # `_linear`, priced by `decoder_kernels`), on the TE layer only (the local layer has no FP8 path).
    Assumption(
        "--fp8-format",
        ("fp8_format", "fp8"),
        None,
        "no FP8, or --fp8-format hybrid|e4m3 with --transformer-impl transformer_engine",
        lambda value, args: (
            value in (None, False)
            or (
                value in ("hybrid", "e4m3")
                and args.get("transformer_impl", "transformer_engine") == "transformer_engine"
            )
        ),
    ),
    # Megatron-LM's older FP8 switches (before --fp8-format): the same FP8 arithmetic
    Assumption(
        "--fp8-hybrid",
        ("fp8_hybrid",),
        False,
        "the FP8 of --fp8-format hybrid, on the TE layer",
        lambda value, args: not value or args.get("transformer_impl", "transformer_engine") == "transformer_engine",
    ),
    Assumption(
        "--fp8-e4m3",
        ("fp8_e4m3",),
        False,
        "the FP8 of --fp8-format e4m3, on the TE layer",
        lambda value, args: not value or args.get("transformer_impl", "transformer_engine") == "transformer_engine",
    ),
    # mxfp8 is Blackwell's (no Blackwell device in the catalog); custom is a quantizer factory's code
    Assumption(
        "--fp8-recipe",
        ("fp8_recipe",),
        "delayed",
        "FP8 recipe delayed, tensorwise or blockwise",
        _is(None, "delayed", "tensorwise", "blockwise"),
    ),
    Assumption(
        "--fp8-dot-product-attention",
        ("fp8_dot_product_attention",),
        False,
        "the attention core in 16 bits under FP8 (no --fp8-dot-product-attention)",
        _off,
    ),
    Assumption(
        "--fp8-multi-head-attention",
        ("fp8_multi_head_attention",),
        False,
        "the attention block in 16 bits under FP8 (no --fp8-multi-head-attention)",
        _off,
    ),
    # keeping the first and last layers in bf16 makes a stage's layers differ; the kernels are one layer's list
    Assumption(
        "--first-last-layers-bf16",
        ("first_last_layers_bf16",),
        False,
        "every layer in the launch's precision (no --first-last-layers-bf16)",
        _off,
    ),
    Assumption(
        "--hybrid-override-pattern",
        ("hybrid_override_pattern",),
        None,
        "transformer layers only, no hybrid (Mamba) layer pattern",
        _is(None),
    ),
    # Transformer Engine's userbuffers overlap hides TP communication behind GEMMs (`model/terms/parallel.py`
    # `tp_overlap_pairs`); Megatron allows it only with sequence parallelism (and TE's layer)
    Assumption(
        "--tp-comm-overlap",
        ("tp_comm_overlap",),
        False,
        "no --tp-comm-overlap, or it with --sequence-parallel and the TE layer",
        lambda value, args: (
            not value
            or (
                bool(args.get("sequence_parallel"))
                and args.get("transformer_impl", "transformer_engine") == "transformer_engine"
            )
        ),
    ),
    # the input gradient's reduce-scatter pipelined with its GEMM instead of the bulk overlap: not priced
    Assumption(
        "--tp-comm-overlap-rs-dgrad",
        ("tp_comm_overlap_rs_dgrad",),
        False,
        "the bulk reduce-scatter of the input gradient (no --tp-comm-overlap-rs-dgrad)",
        _off,
    ),
    # ZeRO stage 1 and 2 shard what Megatron's distributed optimizer shards (optimizer state; gradients
    # reduce-scattered); stage 3 also shards the weights, gathering them per layer.
    Assumption(
        "--zero-stage",
        ("zero_stage",),
        0,
        "ZeRO stage 0, 1 or 2 (priced as the distributed optimizer)",
        _is(None, 0, 1, 2),
    ),
    # Megatron-FSDP (--use-megatron-fsdp: megatron/core/distributed/fsdp/mcore_fsdp_adapter.py FullyShardedDataParallel
    # over src/megatron_fsdp/megatron_fsdp.py MegatronFSDP) shards over the data x context-parallel group by
    # --data-parallel-sharding-strategy (`fsdp_strategy`; priced by `model/fsdp.py`). Its FP8 parameter buffers and
    # transpose caches (keep_fp8_transpose_cache, fp8_create_transpose_cache) are not priced.
    Assumption(
        "--use-megatron-fsdp",
        ("use_megatron_fsdp", "use_custom_fsdp"),
        False,
        "Megatron-FSDP in 16 or 32 bits (no FP8 with --use-megatron-fsdp)",
        lambda value, args: not value or not _fp8(args),
    ),
    Assumption(
        "--data-parallel-sharding-strategy",
        ("data_parallel_sharding_strategy",),
        "no_shard",
        "--data-parallel-sharding-strategy " + "|".join(FSDP_STRATEGIES),
        lambda value, args: value is None or value in FSDP_STRATEGIES,
    ),
    # hybrid sharding (HSDP: an outer data-parallel group over several optimizer instances) is not priced
    Assumption(
        "--num-distributed-optimizer-instances",
        ("num_distributed_optimizer_instances",),
        1,
        "one optimizer instance sharded over the whole data-parallel group (no hybrid / partial sharding)",
        _is(None, 1),
    ),
    Assumption(
        "--outer-dp-sharding-strategy",
        ("outer_dp_sharding_strategy",),
        "no_shard",
        "no outer data-parallel sharding (no hybrid FSDP)",
        _is(None, "no_shard"),
    ),
    # NCCL user buffers make Megatron-FSDP keep persistent double buffers (fsdp_double_buffer) and run SM-lean
    # collectives (distributed_data_parallel_config.py nccl_ub): neither is priced
    Assumption(
        "--use-nccl-ub",
        ("use_nccl_ub", "nccl_ub"),
        False,
        "NCCL's own collective buffers (no --use-nccl-ub)",
        _off,
    ),
    Assumption(
        "--fsdp-double-buffer",
        ("fsdp_double_buffer",),
        False,
        "Megatron-FSDP's temporary gather and reduce buckets (no --fsdp-double-buffer)",
        _off,
    ),
    # PyTorch's FSDP2 (megatron/core/distributed/torch_fully_sharded_data_parallel.py) is another implementation
    Assumption(
        "--use-torch-fsdp2",
        ("use_torch_fsdp2",),
        False,
        "Megatron's DDP or Megatron-FSDP (no --use-torch-fsdp2)",
        _off,
    ),
    # Megatron's interleaved schedule posts the warm-up's p2p calls ahead too with this switch
    # (forward_backward_pipelining_with_interleaving, overlap_p2p_comm_warmup_flush); the simulator posts only the
    # steady state's (hops_calib.sim.schedules).
    Assumption(
        "--overlap-p2p-communication-warmup-flush",
        ("overlap_p2p_comm_warmup_flush", "overlap_p2p_communication_warmup_flush"),
        False,
        "blocking warm-up and cool-down p2p calls (overlapped ones only in the steady state)",
        _off,
    ),
    # Megatron refuses both at once ("Can not use both overlap_p2p_comm and batch_p2p_comm", schedules.py)
    Assumption(
        "--batch-p2p-comm",
        ("batch_p2p_comm",),
        None,
        "batched p2p calls only with blocking ones (--no-overlap-p2p-communication), as Megatron requires",
        lambda value, args: not value or not overlapped_p2p(args),
    ),
)


def _moe(args: dict[str, Any]) -> bool:
    """Whether a launch's MLPs are a mixture of experts (--num-experts above 1)."""
    value = args.get("num_experts")
    return isinstance(value, int) and not isinstance(value, bool) and value > 1


def _every_layer(value: Any) -> bool:
    """--moe-layer-freq as every layer MoE: 1, or a pattern of ones (Megatron-LM's `moe_freq_type` evaluates a
    "([1]*N)" string to the list)."""
    if value in (None, 1):
        return True
    try:
        pattern = layer_pattern(value)
    except ValueError:
        return False
    return isinstance(pattern, list) and bool(pattern) and all(v == 1 for v in pattern)


def layer_pattern(value: Any) -> int | list[int]:
    """--moe-layer-freq as Megatron-LM reads it (`moe_freq_type`): an integer, or a list of 0 / 1 per layer,
    written as a list or as an expression of lists joined by + and repeated by * ("([1]*3+[0])*2"); a
    ValueError for anything else."""
    import ast

    if isinstance(value, bool):
        raise ValueError(f"--moe-layer-freq {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    text = str(value).strip()
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as error:
        raise ValueError(f"--moe-layer-freq {text!r}") from error

    def evaluate(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [evaluate(item) for item in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = evaluate(node.left), evaluate(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(f"--moe-layer-freq {text!r}")

    found = evaluate(tree)
    if isinstance(found, int):
        return found
    if not isinstance(found, list) or not all(type(v) is int for v in found):
        raise ValueError(f"--moe-layer-freq {text!r}")
    return found


def overlapped_p2p(args: dict[str, Any], interleaved: bool | None = None) -> bool:
    """Whether a launch's interleaved schedule overlaps its p2p calls with compute: Megatron-LM's
    --overlap-p2p-communication is on by default (off with --no-overlap-p2p-communication) and applies only with
    virtual pipeline stages (Megatron-core refuses overlap_p2p_comm without them:
    forward_backward_pipelining_without_interleaving in megatron/core/pipeline_parallel/schedules.py).
    `interleaved`: whether the launch runs virtual stages (None: from its virtual-pipeline flags)."""
    if not (_interleaved(args) if interleaved is None else interleaved):
        return False
    for key in ("overlap_p2p_comm", "overlap_p2p_communication"):
        if key in args:
            return bool(args[key])
    return not args.get("no_overlap_p2p_communication")


@dataclass(frozen=True)
class Unmodelled:
    """A launch setting the cost model does not price: the flag, the value the launch runs with, what is priced."""

    flag: str
    key: str | None  # the name it was found under in the arguments (None: unset, Megatron's default applies)
    value: Any
    modelled: str
    setting: str = ""  # Megatron's name of the setting (the arguments block's)

    def sentence(self) -> str:
        if self.key is None:
            return (
                f"no {self.flag}, so Megatron's default {self.setting} = {self.value!r} applies (the model "
                f"prices {self.modelled})"
            )
        if not self.names_flag:  # found under a name of its own (a block's key for a --no-... flag)
            return f"{self.key} = {self.value!r} (the model prices {self.modelled}; the flag for it is {self.flag})"
        shown = "" if self.value is True else f" {self.value}"
        return f"{self.flag}{shown} (the model prices {self.modelled})"

    @property
    def names_flag(self) -> bool:
        """Whether the setting was found under the flag's own name (`--swiglu` / `swiglu`)."""
        return self.key is None or _flag(self.key) == self.flag

    @property
    def field(self) -> str:
        """What the launch file calls it: the flag, or the arguments block's key."""
        return self.flag if self.names_flag else str(self.key)


# How `require_modelled` begins its problem: what tells a launch the model does not price from one Megatron refuses
UNMODELLED = "configures what the simulator does not model"


def unmodelled(args: dict[str, Any]) -> list[Unmodelled]:
    """The settings of a launch's parsed arguments (`megatron_args.txt` or a rank log's block) that the cost model
    does not price, in the order of ASSUMPTIONS; empty when it prices them all."""
    found = []
    for assumption in ASSUMPTIONS:
        key, value = assumption.value(args)
        if not assumption.fits(value, args):
            found.append(Unmodelled(assumption.flag, key, value, assumption.modelled, assumption.keys[0]))
    return found


def _line_naming(source: Path, key: str | None) -> int | None:
    """1-based line of `source` that names the setting `key` (a command line's flag, a block's key); None if none
    does."""
    if key is None:
        return None
    flag = _flag(key)
    from hops_calib.trace import TraceError
    from hops_calib.trace.reading import text_lines

    try:
        for number, line in text_lines(Path(source)):
            line = line.rstrip("\r\n")
            if f"{flag} " in f"{line} " or f"{flag}=" in line or f" {key} ." in line:
                return number
    except TraceError:
        return None
    return None


# A command line's flag spelt within a letter or two of an argument the project knows (`trace.measured.KNOWN_ARGS`:
# what the spec reads, what ASSUMPTIONS refuse, common settings) may be a typo that silently prices another launch
# (`--sequence-paralel` prices no sequence parallelism): its note names the flag it nearly spells.
TYPO_SIMILARITY = 0.92  # difflib ratio: one or two letters in a long flag name


def _unread_virtual_stages(value: Any) -> str:
    """What --num-virtual-stages-per-pipeline-rank N (a count of virtual stages by another name) is priced as.

    megatron-core 0.16.1 has no setting of that name: `num_virtual_stages_per_pipeline_rank` appears nowhere in
    megatron/core (the installed tree, and the 0.16.1 sdist, which holds megatron/core only); the count of model
    chunks per rank megatron-core builds is `ModelParallelConfig.virtual_pipeline_model_parallel_size`
    (megatron/core/model_parallel_config.py; `transformer_block.py` `get_num_layers_to_build` divides each rank's
    layers by it). Whether a Megatron-LM reads the flag is its argument list's (megatron/training/arguments.py),
    which is not installed, so the project does not read it as v: the note says so and names the spellings that
    count."""
    count = value if type(value) is int and value > 0 else "N"
    return (
        f"{_flag('num_virtual_stages_per_pipeline_rank')} {value} names virtual pipeline stages, but megatron-core "
        "0.16.1 has no setting of that name (none in megatron/core; its model chunks per rank are "
        "ModelParallelConfig.virtual_pipeline_model_parallel_size), so this launch is priced without virtual "
        "stages, as non-interleaved 1F1B on one model chunk per rank; if your Megatron-LM runs "
        f"{count} model chunks per rank from it, give --virtual-pipeline-model-parallel-size {count} (or "
        f"--num-layers-per-virtual-pipeline-stage, the layers / (p x {count})) instead, so that the prediction "
        "prices them"
    )


# Arguments that name a setting the model prices by a spelling megatron-core does not have (what each is priced as,
# and the spelling that counts, from its value): noted in full beside the "ignored" note (`unknown_flags_note`).
UNREAD_SPELLINGS = {"num_virtual_stages_per_pipeline_rank": _unread_virtual_stages}


def unknown_flags(args: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(given, meant or None) for each argument the project neither prices nor knows (`KNOWN_ARGS`, ASSUMPTIONS'
    keys, a known `--no-<key>`), with the known one it nearly spells, if any. Not refused: the list of known
    arguments need not hold every Megatron flag; `unknown_flags_note` tells the user."""
    from difflib import get_close_matches

    from hops_calib.trace.measured import KNOWN_ARGS

    known = KNOWN_ARGS | {key for assumption in ASSUMPTIONS for key in assumption.keys}
    found: list[tuple[str, str | None]] = []
    for given in args:
        if given in known or given.removeprefix("no_") in known:
            continue
        meant = get_close_matches(given, known, n=1, cutoff=TYPO_SIMILARITY) if len(given) >= 6 else []
        found.append((given, meant[0] if meant else None))
    return found


def unknown_flags_note(args: dict[str, Any], source: Path | str) -> str | None:
    """The note for a command line's flags the model neither prices nor knows (`unknown_flags`), or None: "ignored:
    --frobnicate" with the file and line, and the flag a near-miss may mean; it says why it is not refused, and, for a
    spelling of a priced setting megatron-core does not have (`UNREAD_SPELLINGS`), what the launch is priced as and
    the spelling that counts."""
    found = unknown_flags(args)
    if not found:
        return None
    lines = {given: _line_naming(Path(source), given) for given, _ in found}
    one_line = len(set(lines.values())) == 1
    named = ", ".join(
        _flag(given)
        + ("" if one_line or lines[given] is None else f" (line {lines[given]})")
        + (f" (did you mean {_flag(meant)}?)" if meant else "")
        for given, meant in found
    )
    where = Path(source).name + (f":{lines[found[0][0]]}" if one_line and lines[found[0][0]] is not None else "")
    return (
        f"ignored: {named} ({where}): flags the model neither prices nor knows, so the prediction is the "
        "launch's without them (spell a flag as Megatron does for it to count); noted, not refused: Megatron-LM's "
        "own argument list (megatron/training/arguments.py) is not installed, only megatron-core, so a flag "
        "Megatron-LM would refuse as unrecognized cannot be told from a real one this project does not list"
        + "".join(f"; {UNREAD_SPELLINGS[given](args[given])}" for given, _ in found if given in UNREAD_SPELLINGS)
    )


def require_modelled(args: dict[str, Any], source: Path | str) -> None:
    """Refuse a launch (`args` read from `source`) with a setting the cost model does not price: a TraceError
    naming the file, the line and flag of the first such setting, every one of them, and what is priced.

    `build_spec` calls it, so ingest and `predict --job` (what-if) refuse the same launches.
    """
    from hops_calib.trace.errors import TraceError
    from hops_calib.trace.megatron_args import ARGS_FILE

    # A near-miss of a flag the project knows is a typo Megatron would refuse, and a prediction would price another
    # launch (`--sequence-paralel`: no sequence parallelism); refused, on a command line as a user writes it (a rank
    # log's arguments block holds the names Megatron itself parsed). A flag near nothing known is only noted.
    typos = [(given, meant) for given, meant in unknown_flags(args) if meant] if Path(source).name == ARGS_FILE else []
    if typos:
        given, meant = typos[0]
        raise TraceError(
            source,
            "has flags the model does not know but that nearly spell ones it knows: "
            + "; ".join(f"{_flag(g)} ({_flag(m)}?)" for g, m in typos),
            line=_line_naming(Path(source), given),
            field=_flag(given),
            hint=f"did you mean {_flag(meant)}? Megatron would refuse the unknown flag; spell it as "
            "Megatron does, so that the prediction prices what the launch runs",
        )
    found = unmodelled(args)
    if not found:
        return

    first = found[0]
    raise TraceError(
        source,
        f"{UNMODELLED}: " + "; ".join(u.sentence() for u in found),
        line=_line_naming(Path(source), first.key),
        field=first.field,
        hint="a prediction would price another configuration than this launch; change the launch to "
        "what the model prices, or extend the model (hops_calib/model) and hops_calib.spec."
        "ASSUMPTIONS together",
    )
