"""Megatron's arguments read into a spec (`spec_from_args`, pure: reads no file): the layer split, the schedule,
activation recomputation, the layer's settings, the rank order, and the limits a simulable launch keeps."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hops_calib.spec.assumptions import _flag, fsdp_strategy, overlapped_p2p, require_modelled
from hops_calib.spec.schedules import SCHEDULES
from hops_calib.spec.stage_layers import (
    LayoutError,
    StageLayers,
    layers_accounting,
    layers_from_layout,
    split_layers,
)
from hops_calib.spec.types import Hardware, ModelShape, Spec, expert_data_parallel_size, global_rank
from hops_calib.trace.collective_bench import CollectiveTable  # the machine's collective benchmark
from hops_calib.trace.events import MAX_INDEX  # the largest microbatch and model chunk a trace numbers
from hops_calib.trace.link_bench import LinkFit  # the link benchmark's fit; a Spec carries one per hop

# The HOPS tracing fork of Megatron starts tracing at iteration 3: iterations
# 1-2 are warm-up and absent from the event logs. CPU captures follow the same
# convention, so the traced iteration count is derivable from --train-iters.
TRACE_FIRST_ITERATION = 3


def _require_int(args: dict[str, Any], name: str, source: Any, default: int | None = None, minimum: int = 0) -> int:
    from hops_calib.trace.errors import TraceError

    flag = _flag(name)
    value = args.get(name, default)
    if type(value) is not int or value < minimum:
        expected = "a non-negative integer" if minimum == 0 else f"a whole number of at least {minimum}"
        raise TraceError(
            source,
            f"is {value!r}, expected {expected}" if name in args else "is missing",
            field=flag,
            hint=f"give {flag} {expected}" if name in args else f"the spec needs it; add {flag} to the launch command",
        )
    return value


def configured_schedule(configured: Any, vp: int, source: Path | str = "manifest.yaml") -> str:
    """The schedule the launch configured: Megatron's from its flags, or the launcher's own when it records one.

    Megatron runs non-interleaved 1F1B unless virtual pipeline stages are configured. A launcher whose
    schedules have no Megatron flag (`hops-calib capture --engine torch`: GPipe, ZB-H1) writes the schedule it
    configured as `configured_schedule` in manifest.yaml (`source`); cluster manifests have no such key (None).
    """
    from hops_calib.trace import TraceError

    from_flags = "interleaved_1f1b" if vp > 1 else "1f1b"
    if configured is None:
        return from_flags
    if configured not in SCHEDULES:
        raise TraceError(
            source,
            f"is {configured!r}",
            field="configured_schedule",
            hint=f"expected one of {', '.join(SCHEDULES)}, or remove the key",
        )
    if (configured == "interleaved_1f1b") != (vp > 1):
        raise TraceError(
            source,
            f"is {configured!r} but the arguments configure {vp} model chunk(s) per stage",
            field="configured_schedule",
            hint="interleaved 1F1B needs virtual pipeline stages, and only it uses them",
        )
    return configured


# Microbatches per iteration, and model chunks per stage, a configuration may have to be ingested or predicted as
# it is: as many as a trace numbers; predict --job times 32768 microbatches in about 2 s. (plan --job searches
# other micro-batch sizes instead: it bounds its own tasks.)
MAX_PER_ITERATION = MAX_INDEX + 1


def check_simulable(spec: Spec, source: Path | str) -> None:
    """TraceError naming `source` (the launch's arguments) when the spec has more microbatches per iteration or
    model chunks per stage than MAX_PER_ITERATION: no trace numbers them, and simulating them would run for hours."""
    from hops_calib.trace.errors import TraceError

    for count, what, flag in (
        (spec.microbatches, "microbatches per iteration", "--global-batch-size"),
        (spec.vp, "model chunks per stage", "--virtual-pipeline-model-parallel-size"),
    ):
        if count > MAX_PER_ITERATION:
            raise TraceError(
                source,
                f"gives {count} {what}, more than the {MAX_PER_ITERATION} a trace can number and the simulator times",
                field=flag,
                hint=f"give a configuration of at most {MAX_PER_ITERATION} {what}",
            )


RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


def recomputation_of(args: dict[str, Any], source: Path | str) -> tuple[str | None, str | None, int | None]:
    """(granularity, method, number of layers) of a launch's activation recomputation, as Megatron reads them.

    `--recompute-granularity full|selective` with `--recompute-method uniform|block` and `--recompute-num-layers N`
    (Megatron-LM); `--recompute-activations` is selective; the older `--checkpoint-activations` (Megatron-LM before
    2022 and Megatron-DeepSpeed) is full and uniform, in groups of `--checkpoint-num-layers` (default 1). Full
    recomputation needs a method (Megatron has no default for it), and block a number of layers. Selective
    recomputation takes no method. (None, None, None) when nothing is recomputed.
    """
    from hops_calib.trace import TraceError

    granularity = args.get("recompute_granularity")
    method = args.get("recompute_method")
    number = args.get("recompute_num_layers")
    if granularity is None and args.get("recompute_activations"):
        granularity = "selective"
    if granularity is None and args.get("checkpoint_activations"):
        granularity, method = "full", method or "uniform"
        if number is None:
            number = args.get("checkpoint_num_layers", 1)
    if granularity is None:
        return None, None, None
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise TraceError(
            source,
            f"is {granularity!r}",
            field="--recompute-granularity",
            hint=f"Megatron takes {' or '.join(RECOMPUTE_GRANULARITIES)}",
        )
    if granularity == "selective":
        if method is not None:
            raise TraceError(
                source,
                f"is {method!r} with --recompute-granularity selective",
                field="--recompute-method",
                hint="Megatron takes a recompute method only for full recomputation: drop it",
            )
        return granularity, None, None
    if method not in RECOMPUTE_METHODS:
        raise TraceError(
            source,
            f"is {method!r} with --recompute-granularity full",
            field="--recompute-method",
            hint=f"full recomputation needs --recompute-method {' or '.join(RECOMPUTE_METHODS)}",
        )
    if number is None and method == "uniform":
        number = 1
    if type(number) is not int or number < 1:
        raise TraceError(
            source,
            f"is {number!r} with --recompute-method {method}",
            field="--recompute-num-layers",
            hint="give the number of layers per recomputed group (uniform) or per model chunk (block), at least 1",
        )
    return granularity, method, number


def spec_from_args(
    args: dict[str, Any],
    source: Path | str,
    *,
    run_id: str,
    hardware: Hardware,
    links: Sequence[LinkFit] = (),
    collectives: Sequence[CollectiveTable] = (),
    configured: str | None = None,
    schedule_source: Path | str = "manifest.yaml",
    declared_schedule: str | None = None,
    iterations: int | None = None,
    notes: list[str] | None = None,
    ranks_per_device: float = 1.0,
) -> Spec:
    """The spec of a Megatron launch, from its arguments alone (pure: reads no file).

    `args` are Megatron's arguments in their `args.` spelling (as `trace.megatron_args` parses a command line or a
    log's arguments block), read from `source` (named in errors). `hardware` places the stages; `links` are the
    link benchmark's fits and `collectives` the collective benchmark's tables of the machine (both measured apart
    from the run). `configured` is a schedule a launcher recorded (manifest.yaml's `configured_schedule`, named
    by `schedule_source`), else Megatron's from the flags. `iterations` is the window to simulate; None takes
    the traced window of --train-iters (the tracing fork traces from iteration TRACE_FIRST_ITERATION). A launch
    the cost model does not price is refused (`require_modelled`), as is any inconsistent setting: TraceError
    naming the source, the flag and what to do.
    """
    from hops_calib.trace import TraceError

    notes = [] if notes is None else notes
    require_modelled(args, source)  # a run the cost model cannot price is refused, in ingest and what-if alike

    pp = _require_int(args, "pipeline_model_parallel_size", source, default=1, minimum=1)
    tp = _require_int(args, "tensor_model_parallel_size", source, default=1, minimum=1)
    num_layers = _require_int(args, "num_layers", source, minimum=1)

    stage_layers = stage_layers_of(args, source, num_layers, pp)
    vp = stage_layers.vp

    cp = _require_int(args, "context_parallel_size", source, default=1, minimum=1)
    world = args.get("world_size")
    if type(world) is int and world > 0:
        named = f"tp*pp*cp = {tp * pp * cp}" if cp > 1 else f"tp*pp = {tp * pp}"
        if world % (tp * pp * cp):
            raise TraceError(
                source,
                f"{world} is not a multiple of {named}",
                field="world_size",
                hint="launch tp x pp x cp x dp GPUs",
            )
        dp = world // (tp * pp * cp)
        given = args.get("data_parallel_size")
        if type(given) is int and given > 0 and given != dp:
            where = f"tp {tp} x pp {pp}" + (f" x cp {cp}" if cp > 1 else "")
            raise TraceError(
                source,
                f"{given}, but world size {world} / ({where}) = {dp}",
                field="--data-parallel-size",
                hint="make the parallel sizes multiply to the GPUs",
            )
    else:
        dp = _require_int(args, "data_parallel_size", source, default=1) or 1
    micro_batch = _require_int(args, "micro_batch_size", source, default=1, minimum=1)
    global_batch = _require_int(args, "global_batch_size", source, default=micro_batch * dp, minimum=1)
    if global_batch % (micro_batch * dp):
        raise TraceError(
            source,
            f"{global_batch} is not a multiple of micro batch {micro_batch} x dp {dp}",
            field="--global-batch-size",
            hint="Megatron requires it to divide",
        )
    microbatches = global_batch // (micro_batch * dp)
    if iterations is None:
        train_iters = _require_int(args, "train_iters", source)
        iterations = train_iters - TRACE_FIRST_ITERATION + 1
        if iterations < 1:
            raise TraceError(
                source,
                f"is {train_iters}: the trace starts at iteration {TRACE_FIRST_ITERATION}",
                field="--train-iters",
                hint=f"a traced run needs at least {TRACE_FIRST_ITERATION} iterations",
            )
    elif type(iterations) is not int or iterations < 1:
        raise ValueError(f"spec {run_id}: iterations must be a whole number of at least 1, got {iterations!r}")

    layers = stage_layers.per_rank
    rank_order = rank_order_of(args, source)
    sizes = {"tp": (0, tp), "dp": (0, dp), "pp": (0, pp), "cp": (0, cp)}
    first_ranks = [global_rank(rank_order, {**sizes, "pp": (k, pp)}) for k in range(pp)]
    devices, device_ids, names = hardware.stages(pp, first_ranks)
    if len(devices) != pp:
        raise TraceError(
            hardware.source,
            f"maps {len(devices)} stages but {Path(source).name} says --pipeline-model-parallel-size {pp}",
            field=hardware.field,
            hint="the stage counts of the configuration and the stage map must agree",
        )

    links = tuple(links) + _intra_node_links(pp, vp, hardware, links, collectives, first_ranks)
    schedule = configured_schedule(configured, vp, schedule_source)
    precision = "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "fp32"
    granularity, method, recompute_layers = recomputation_of(args, source)
    hidden = _require_int(args, "hidden_size", source, minimum=1)
    heads = _require_int(args, "num_attention_heads", source, minimum=1)
    seq = _require_int(args, "seq_length", source, minimum=1)
    if hidden % heads:
        raise TraceError(
            source,
            f"{heads} does not divide --hidden-size {hidden}",
            field="--num-attention-heads",
            hint="Megatron splits the hidden size evenly over the attention heads",
        )
    positions = args.get("max_position_embeddings")
    if type(positions) is int and positions < seq:
        raise TraceError(
            source,
            f"{seq} is more than --max-position-embeddings {positions}",
            field="--seq-length",
            hint="learned absolute positions cover at most "
            "--max-position-embeddings tokens: Megatron refuses a longer sequence",
        )
    # Megatron's args.padded_vocab_size (a log's arguments block, a run table) is the vocabulary it allocated, already
    # a multiple of --make-vocab-size-divisible-by x t; the cost model pads vocab_size to a multiple of 128, which
    # leaves it as it is.
    vocab_key = "padded_vocab_size" if args.get("padded_vocab_size") is not None else "vocab_size"
    vocab = _require_int(args, vocab_key, source, default=0, minimum=1 if vocab_key in args else 0)
    ffn = _require_int(args, "ffn_hidden_size", source, default=4 * hidden, minimum=1)
    if cp > 1 and seq % (2 * cp):
        raise TraceError(
            source,
            f"{seq} is not divisible by 2 x --context-parallel-size {cp}",
            field="--seq-length",
            hint="context parallelism cuts each sequence into 2 cp chunks (megatron/core/utils.py "
            "get_batch_on_this_cp_rank)",
        )
    model = ModelShape(
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        seq_length=seq,
        vocab_size=vocab,
        micro_batch_size=micro_batch,
        global_batch_size=global_batch,
        precision=precision,
        untie_embeddings=bool(args.get("untie_embeddings_and_output_weights", False)),
        clip_grad=float(args.get("clip_grad", 1.0)),
        recompute_granularity=granularity,
        recompute_method=method,
        recompute_num_layers=recompute_layers,
        **layer_settings_of(args, source, tp, heads, ffn),
        context_parallel=cp,
        **moe_settings_of(args, source, tp=tp, pp=pp, cp=cp, dp=dp, ffn=ffn, rank_order=rank_order),
    )
    if cp > 1 and model.attention_kernel != "flash":
        raise TraceError(
            source,
            f"{cp} with unfused attention",
            field="--context-parallel-size",
            hint="context parallelism runs in TE's flash / cuDNN fused attention (TE's "
            "AttnFuncWithCPAndKVP2P); drop --attention-backend unfused|local",
        )
    zero = args.get("zero_stage") or 0
    # Megatron-FSDP's strategy decides what it shards (its optimizer state from optim on), and it turns the gradient
    # reduce-scatter's overlap on when it shards gradients and the parameter gather's when it shards them
    # (src/megatron_fsdp/megatron_fsdp.py MegatronFSDP.__init__)
    fsdp = fsdp_strategy(args)
    distributed_optimizer = (
        fsdp not in ("", "no_shard") if fsdp else bool(args.get("use_distributed_optimizer")) or zero in (1, 2)
    )
    return Spec(
        run_id=run_id,
        pp=pp,
        vp=vp,
        microbatches=microbatches,
        iterations=iterations,
        layers_per_stage=layers,
        devices=tuple(devices),
        device_ids=tuple(device_ids),
        links=tuple(links),
        schedule=schedule,
        model=model,
        declared_schedule=declared_schedule,
        device_names=tuple(names) if any(names) else (),
        megatron_args=args,
        gpus_per_node=hardware.gpus_per_node,
        collectives=tuple(collectives),
        dp=dp,
        distributed_optimizer=distributed_optimizer,
        overlap_grad_reduce=bool(args.get("overlap_grad_reduce")) or fsdp in ("optim_grads", "optim_grads_params"),
        overlap_param_gather=bool(args.get("overlap_param_gather")) or fsdp == "optim_grads_params",
        rank_order=rank_order,
        ranks_per_device=ranks_per_device,
        overlap_p2p=overlapped_p2p(args, interleaved=schedule == "interleaved_1f1b"),
        layers_per_virtual_stage=stage_layers.per_virtual_stage,
        nodes=tuple(hardware.nodes) if collectives and hardware.gpu is None and any(hardware.nodes) else (),
    )


_SPLIT_FLAGS = (
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


def stage_layers_of(args: dict[str, Any], source: Path | str, num_layers: int, pp: int) -> StageLayers:
    """The model chunks per rank and the decoder layers of each rank (and virtual stage) a launch builds, as
    Megatron's get_num_layers_to_build does (`hops_calib.spec.stage_layers`); TraceError naming the flag for a split
    Megatron refuses."""
    from hops_calib.trace import TraceError

    layout = args.get("pipeline_model_parallel_layout")
    given = [
        name
        for name in _SPLIT_FLAGS + ("num_layers_per_virtual_pipeline_stage", "virtual_pipeline_model_parallel_size")
        if args.get(name)
    ]
    try:
        if layout:
            if given:  # Megatron-LM's arguments.py: a layout replaces every other way of splitting
                raise LayoutError(
                    f"is given with {_flag(given[0])}; the layout alone splits the layers",
                    "--pipeline-model-parallel-layout",
                )
            return layers_from_layout(str(layout), num_layers, pp)
        embedding, loss = (bool(args.get(name)) for name in _SPLIT_FLAGS[2:])
        pins = [name for name in _SPLIT_FLAGS[:2] if args.get(name) is not None]
        if pins and (embedding or loss):  # asserted in get_num_layers_to_build
            raise LayoutError(
                f"is given with {_flag(pins[0])}: Megatron does not support a standalone embedding or "
                "loss stage with uneven first/last stages",
                _flag(_SPLIT_FLAGS[2] if embedding else _SPLIT_FLAGS[3]),
            )
        vp = _chunks_of(args, source, num_layers + embedding + loss, pp)
        if embedding or loss:
            return layers_accounting(num_layers, pp, vp, embedding, loss)
        first, last = (_require_int(args, name, source) if name in pins else None for name in _SPLIT_FLAGS[:2])
        try:
            per_rank = split_layers(num_layers, pp, first, last)
        except ValueError as err:
            raise LayoutError(str(err), "--num-layers") from err
        return StageLayers(vp=vp, per_rank=per_rank, per_virtual_stage=())
    except LayoutError as err:
        hint = (
            "write the layout as Megatron reads it (E first, L last, |-separated stages, pp x vp of them)"
            if err.flag == "--pipeline-model-parallel-layout"
            else "make the layers divide evenly, or fix --decoder-first/last-pipeline-num-layers or the "
            "--account-for-embedding/loss-in-pipeline-split flags"
        )
        raise TraceError(source, str(err), field=err.flag, hint=hint) from err


def _chunks_of(args: dict[str, Any], source: Path | str, pieces: int, pp: int) -> int:
    """Model chunks per rank from --virtual-pipeline-model-parallel-size or --num-layers-per-virtual-pipeline-stage
    (`pieces`: the decoder layers, plus the embedding and loss when the split accounts for them)."""
    from hops_calib.trace import TraceError

    if args.get("virtual_pipeline_model_parallel_size"):
        return _require_int(args, "virtual_pipeline_model_parallel_size", source)
    if args.get("num_layers_per_virtual_pipeline_stage"):
        per_virtual = _require_int(args, "num_layers_per_virtual_pipeline_stage", source)
        if per_virtual == 0 or pieces % (pp * per_virtual):
            raise TraceError(
                source,
                f"{per_virtual} does not divide {pieces} layers over {pp} stages",
                field="--num-layers-per-virtual-pipeline-stage",
                hint="num_layers must be a multiple of pp * layers per virtual stage",
            )
        return pieces // (pp * per_virtual)
    return 1


def _intra_node_links(
    pp: int,
    vp: int,
    hardware: Hardware,
    links: Sequence[LinkFit],
    collectives: Sequence[CollectiveTable],
    first_ranks: Sequence[int],
) -> tuple[LinkFit, ...]:
    """Links for the hops within one node that the link benchmark did not measure, from the node's smallest
    all-reduce table (`trace.collective_bench.ring_link`: the ring formula; a 2-GPU table is a pair)."""
    tables = sorted((t for t in collectives if t.op == "all_reduce"), key=lambda t: t.gpus)
    if not tables:
        return ()
    from hops_calib.trace.collective_bench import ring_link

    pairs = [(k, k + 1) for k in range(pp - 1)] + ([(pp - 1, 0)] if vp > 1 and pp > 2 else [])
    have = {frozenset((fit.src_stage, fit.dst_stage)) for fit in links}
    return tuple(
        ring_link(tables[0], a, b)
        for a, b in pairs
        if frozenset((a, b)) not in have
        and hardware.node_of(a, first_ranks) is not None
        and hardware.node_of(a, first_ranks) == hardware.node_of(b, first_ranks)
    )


def attention_kernel_of(args: dict[str, Any]) -> str:
    """Whether a launch's attention writes the score matrix ("unfused") or runs a fused kernel that keeps it on
    chip ("flash"). Megatron's local layer is unfused unless --use-flash-attn (Megatron-DeepSpeed also spells it
    --use-flash-attn-v1/-v2/-triton/-builder); Transformer Engine's layer picks its flash or cuDNN fused attention
    (TE's default) unless --attention-backend unfused|local asks otherwise."""
    backend = str(args.get("attention_backend") or "auto").lower().rsplit(".", 1)[-1]
    if backend in ("unfused", "local"):
        return "unfused"
    if backend in ("flash", "fused"):
        return "flash"
    if any(
        args.get(name)
        for name in (
            "use_flash_attn",
            "use_flash_attn_v1",
            "use_flash_attn_v2",
            "use_flash_attn_triton",
            "use_flash_attn_builder",
        )
    ):
        return "flash"
    return "flash" if args.get("transformer_impl", "transformer_engine") == "transformer_engine" else "unfused"


def layer_settings_of(args: dict[str, Any], source: Path | str, tp: int, heads: int, ffn: int) -> dict[str, Any]:
    """The ModelShape fields of a launch's layer besides its sizes: tensor and sequence parallelism, SwiGLU, grouped
    query attention, the norm, the positions and the attention kernel, in Megatron-LM's spelling or
    Megatron-DeepSpeed's older one (--num-key-value-heads, --use-rotary-position-embeddings, --normalization
    rmsnorm). TraceError for a setting Megatron itself refuses (heads or groups that t does not divide)."""
    from hops_calib.trace import TraceError

    groups = None
    if args.get("group_query_attention") or args.get("num_key_value_heads"):
        key = "num_query_groups" if args.get("group_query_attention") else "num_key_value_heads"
        groups = _require_int(args, key, source, minimum=1)
        if heads % groups:
            raise TraceError(
                source,
                f"{groups} does not divide --num-attention-heads {heads}",
                field=_flag(key),
                hint="each query group takes a whole number of heads",
            )
        if groups == heads:
            groups = None  # as many groups as heads is multi-head attention
    for name, size in (
        ("--num-attention-heads", heads),
        ("--num-query-groups", groups or heads),
        ("--ffn-hidden-size", ffn),
    ):
        if size % tp:
            raise TraceError(
                source,
                f"{size} is not divisible by --tensor-model-parallel-size {tp}",
                field=name,
                hint="Megatron splits heads, query groups and the MLP over the tensor-parallel group: "
                "pick a size they divide by",
            )
    rope = args.get("position_embedding_type", "learned_absolute") == "rope" or bool(
        args.get("use_rotary_position_embeddings")
    )
    return {
        "tensor_parallel": tp,
        # Megatron turns sequence parallelism off at tensor parallel size 1: it splits along the TP group
        "sequence_parallel": bool(args.get("sequence_parallel")) and tp > 1,
        "swiglu": bool(args.get("swiglu")),
        "num_query_groups": groups,
        "normalization": "RMSNorm" if str(args.get("normalization", "LayerNorm")).lower() == "rmsnorm" else "LayerNorm",
        "position_embedding": "rope" if rope else "learned_absolute",
        "attention_kernel": attention_kernel_of(args),
    }


MOE_DISPATCHERS = ("alltoall", "allgather")


def moe_settings_of(
    args: dict[str, Any], source: Path | str, *, tp: int, pp: int, cp: int, dp: int, ffn: int, rank_order: str
) -> dict[str, Any]:
    """The ModelShape fields of a launch's mixture of experts ({} for a dense MLP), checked as Megatron checks them:
    --expert-model-parallel-size above 1 needs --num-experts (`transformer/transformer_config.py`
    TransformerConfig.__post_init__); the experts divide over the expert-parallel GPUs (`transformer/moe/
    moe_layer.py` MoELayer.__init__ asserts num_experts % ep == 0); the world divides by etp x ep x pp, whose
    quotient is the expert data-parallel size (`parallel_state.py` initialize_model_parallel, beside its tp x pp x cp
    check), and under a rank order that does not end in pp the attention's and the experts' data-parallel sizes
    agree (the same function's assertion); an expert-parallel size needs ep in the rank order (its RankGenerator);
    --expert-tensor-parallel-size defaults to the tensor-parallel size (`model_parallel_config.py`), and a bias
    only at 1 (TransformerConfig); tensor parallelism needs sequence parallelism (MoELayer.forward raises
    otherwise); --moe-pad-expert-input-to-capacity needs a capacity factor (TransformerConfig)."""
    from hops_calib.trace import TraceError

    def given(name: str, default: int, minimum: int = 1) -> int:
        # a rank log's arguments block prints None for a setting left at Megatron's default
        return default if args.get(name) is None else _require_int(args, name, source, minimum=minimum)

    experts = args.get("num_experts")
    ep = given("expert_model_parallel_size", 1)
    if experts in (None, 0, 1):
        if ep > 1:
            raise TraceError(
                source,
                f"{ep} without --num-experts",
                field="--expert-model-parallel-size",
                hint="Megatron refuses expert parallelism without experts (num_moe_experts must be non None to "
                "use expert-parallel): give --num-experts, or drop the flag",
            )
        return {}
    experts = _require_int(args, "num_experts", source, minimum=2)
    etp = given("expert_tensor_parallel_size", tp)
    topk = given("moe_router_topk", 2)
    expert_ffn = given("moe_ffn_hidden_size", ffn)
    shared = given("moe_shared_expert_intermediate_size", 0)
    dispatcher = str(args.get("moe_token_dispatcher_type") or "allgather")
    world = tp * pp * cp * dp

    def refuse(field: str, problem: str, hint: str) -> TraceError:
        return TraceError(source, problem, field=field, hint=hint)

    if topk > experts:
        raise refuse(
            "--moe-router-topk",
            f"{topk} is more than --num-experts {experts}",
            "each token is routed to top-k of the experts: k at most their number",
        )
    if experts % ep:
        raise refuse(
            "--expert-model-parallel-size",
            f"{ep} does not divide --num-experts {experts}",
            "each expert-parallel GPU holds num_experts / ep experts (MoELayer.__init__)",
        )
    if world % (etp * ep * pp):
        raise refuse(
            "--expert-model-parallel-size",
            f"etp {etp} x ep {ep} x pp {pp} = {etp * ep * pp} does not divide the {world} GPUs",
            "megatron-core's initialize_model_parallel needs the world divisible by etp x ep x pp",
        )
    if ep > 1 and "ep" not in rank_order.split("-"):
        raise refuse(
            "--rank-order",
            f"{rank_order!r} has no ep with --expert-model-parallel-size {ep}",
            "name ep in the order (Megatron's default tp-cp-ep-dp-pp)",
        )
    edp = expert_data_parallel_size(world, etp, ep, pp)
    if pp > 1 and not rank_order.endswith("pp") and edp != dp:
        raise refuse(
            "--rank-order",
            f"{rank_order!r} with an expert data-parallel size {edp} against dp {dp}",
            "Megatron needs the attention's and the experts' data-parallel sizes equal unless the order ends in pp",
        )
    for name, size, over, by in (
        ("--moe-ffn-hidden-size", expert_ffn, "--expert-tensor-parallel-size", etp),
        ("--moe-shared-expert-intermediate-size", shared, "--tensor-model-parallel-size", tp),
    ):
        if size % by:
            raise refuse(
                name,
                f"{size} is not divisible by {over} {by}",
                "an expert's (the shared expert's) MLP splits over that group: pick a size it divides",
            )
    if tp > 1 and not args.get("sequence_parallel"):
        raise refuse(
            "--sequence-parallel",
            f"is off with experts at --tensor-model-parallel-size {tp}",
            "megatron-core's MoELayer.forward refuses MoE with tensor parallelism in training without "
            "sequence parallelism: add --sequence-parallel",
        )
    bias = not bool(args.get("disable_bias_linear")) and args.get("add_bias_linear", True) is not False
    if etp > 1 and bias:
        raise refuse(
            "--expert-tensor-parallel-size",
            f"{etp} with the linear layers' biases",
            "megatron-core supports a bias in MoE only at ETP 1: add --disable-bias-linear, or ETP 1",
        )
    capacity = args.get("moe_expert_capacity_factor")
    if capacity is not None and (
        isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or not capacity > 0
    ):
        raise refuse(
            "--moe-expert-capacity-factor",
            f"is {capacity!r}",
            "give a positive factor, or leave the flag out for dropless routing",
        )
    pad = bool(args.get("moe_pad_expert_input_to_capacity"))
    if pad and capacity is None:
        raise refuse(
            "--moe-pad-expert-input-to-capacity",
            "is set without --moe-expert-capacity-factor",
            "Megatron pads to a capacity only when a capacity factor gives one",
        )
    if dispatcher not in MOE_DISPATCHERS:  # refused by ASSUMPTIONS before this; kept for a direct call
        raise refuse("--moe-token-dispatcher-type", f"is {dispatcher!r}", "alltoall or allgather are priced")
    return {
        "num_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": expert_ffn,
        "moe_shared_expert_ffn": shared,
        "expert_parallel": ep,
        "expert_tensor_parallel": etp,
        "moe_dispatcher": dispatcher,
        "moe_grouped_gemm": bool(args.get("moe_grouped_gemm")),
        "moe_capacity_factor": float(capacity) if capacity is not None else None,
        "moe_pad_to_capacity": pad,
        "moe_router_fp32": args.get("moe_router_dtype") == "fp32",
        "moe_aux_loss": _positive(args.get("moe_aux_loss_coeff"))
        and bool(set(_listed(args.get("moe_router_load_balancing_type") or "aux_loss")) & AUX_LOSS_TYPES),
        "moe_z_loss": _positive(args.get("moe_z_loss_coeff")),
    }


# The load-balancing types that add an auxiliary loss (`transformer/moe/router.py` TopKRouter.routing:
# _apply_aux_loss, _apply_seq_aux_loss, _apply_global_aux_loss); "sinkhorn" and "none" add none
AUX_LOSS_TYPES = {"aux_loss", "seq_aux_loss", "global_aux_loss"}


def _listed(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _positive(value: Any) -> bool:
    """A coefficient (or a list of them, Megatron-LM's per-type --moe-aux-loss-coeff) above 0."""
    return any(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in _listed(value))


RANK_ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-dp", "tp-dp-pp")


def rank_order_of(args: dict[str, Any], source: Path | str) -> str:
    """Megatron's rank order of a launch: --rank-order when given, tp-pp-dp under --use-tp-pp-dp-mapping, else
    its default tp-cp-ep-dp-pp (tensor-parallel ranks adjacent, then data-parallel, then pipeline)."""
    from hops_calib.trace import TraceError

    order = args.get("rank_order")
    if order is None:
        return "tp-cp-ep-pp-dp" if args.get("use_tp_pp_dp_mapping") else "tp-cp-ep-dp-pp"
    dims = str(order).lower().split("-")
    if sorted(d for d in dims if d in ("tp", "dp", "pp")) != ["dp", "pp", "tp"] or set(dims) - {
        "tp",
        "cp",
        "ep",
        "dp",
        "pp",
    }:
        raise TraceError(
            source,
            f"is {order!r}",
            field="--rank-order",
            hint="name each of tp, dp and pp once (cp and ep optional), fastest first, joined by '-': "
            "e.g. tp-cp-ep-dp-pp (Megatron's default)",
        )
    return "-".join(dims)
