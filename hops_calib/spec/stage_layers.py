"""Which decoder layers each pipeline stage builds, as Megatron splits them (pure: no file, no Megatron import).

Megatron-core decides it in `get_num_layers_to_build` (megatron/core/transformer/transformer_block.py):

- `--pipeline-model-parallel-layout`: the layout string says it per virtual stage (`PipelineParallelLayerLayout`,
  megatron/core/transformer/pipeline_parallel_layer_layout.py): stages separated by `|`, virtual stage k is model
  chunk k // pp on rank k % pp, `E` the embedding, `t` a decoder layer, `L` the loss (output layer and loss),
  `m` a multi-token-prediction layer; `(...)*n` and `x*n` repeat, commas are cosmetic. The embedding must be the
  first piece and the loss the last (`validate_layer_layout`), exactly once each, with every decoder layer;
  the number of virtual stages per rank is the layout's stages / pp.
- `--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`: the first / last rank holds that
  many, the others split the rest evenly; Megatron asserts neither comes with the account-for flags.
- `--account-for-embedding-in-pipeline-split` / `--account-for-loss-in-pipeline-split`: the embedding (the loss)
  counts as one layer of the even split, so the first (last) virtual stage builds one decoder layer fewer.

With virtual stages, each rank's share is divided evenly over its model chunks (all but the layout must divide).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

EMBEDDING, DECODER, LOSS, MTP = "E", "t", "L", "m"
_REPEAT_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
_REPEAT_ONE = re.compile(r"(.)\*(\d+)")
MAX_LAYOUT_PIECES = 1 << 20  # a layout unrolls to at most this many characters (no input may exhaust memory)


class LayoutError(ValueError):
    """A split Megatron refuses, or one the cost model does not price; `flag` is the flag to fix."""

    def __init__(self, message: str, flag: str) -> None:
        super().__init__(message)
        self.flag = flag


@dataclass(frozen=True)
class StageLayers:
    """Decoder layers per rank (all its chunks) and, when uneven over a rank's chunks, per virtual stage."""

    vp: int
    per_rank: tuple[int, ...]
    per_virtual_stage: tuple[int, ...]  # () when each rank's layers split evenly over its chunks

    @property
    def even(self) -> bool:
        return not self.per_virtual_stage


def parse_layout(text: str) -> list[str]:
    """The pieces of each virtual stage of a layout string, as `PipelineParallelLayerLayout.parse_str_to_list`."""
    layout = str(text).replace(",", "").replace(" ", "")
    for pattern in (_REPEAT_GROUP, _REPEAT_ONE):

        def unroll(match: re.Match[str]) -> str:
            count = int(match.group(2))
            if len(match.group(1)) * count > MAX_LAYOUT_PIECES:
                raise LayoutError(
                    f"{text!r} repeats {match.group(0)!r} to more than {MAX_LAYOUT_PIECES} pieces",
                    "--pipeline-model-parallel-layout",
                )
            return match.group(1) * count

        layout = pattern.sub(unroll, layout)
        if len(layout) > MAX_LAYOUT_PIECES:
            raise LayoutError(
                f"{text!r} unrolls to more than {MAX_LAYOUT_PIECES} pieces", "--pipeline-model-parallel-layout"
            )
    stages = layout.split("|")
    for stage in stages:
        for char in stage:
            if char not in (EMBEDDING, DECODER, LOSS, MTP):
                raise LayoutError(
                    f"{text!r} has {char!r}; Megatron's layout knows E (embedding), t (decoder "
                    "layer), L (loss), m (MTP layer)",
                    "--pipeline-model-parallel-layout",
                )
    return stages


def layers_from_layout(text: str, num_layers: int, pp: int) -> StageLayers:
    """The split a `--pipeline-model-parallel-layout` string gives (LayoutError when Megatron or the model refuses)."""
    flag = "--pipeline-model-parallel-layout"
    stages = parse_layout(text)
    if len(stages) % pp:
        raise LayoutError(
            f"{text!r} has {len(stages)} stages, not a multiple of --pipeline-model-parallel-size "
            f"{pp} (Megatron: it must be divisible)",
            flag,
        )
    pieces = "".join(stages)
    if pieces.count(MTP):
        raise LayoutError(
            f"{text!r} places multi-token-prediction layers (m); the model prices decoder layers, "
            "the embedding and the loss only",
            flag,
        )
    if pieces[:1] != EMBEDDING or pieces[-1:] != LOSS or pieces.count(EMBEDDING) != 1 or pieces.count(LOSS) != 1:
        raise LayoutError(
            f"{text!r}: Megatron needs the embedding (E) first and the loss (L) last, exactly once each", flag
        )
    if pieces.count(DECODER) != num_layers:
        raise LayoutError(
            f"{text!r} places {pieces.count(DECODER)} decoder layers (t) but --num-layers is {num_layers}", flag
        )
    # Megatron builds the embedding on the first virtual stage and the output layer on the last (GPTModel's
    # pre_process / post_process): a layout that puts them elsewhere would price pieces Megatron does not build there.
    if EMBEDDING not in stages[0] or LOSS not in stages[-1]:
        raise LayoutError(
            f"{text!r}: the embedding must be in the first stage and the loss in the last, where Megatron builds them",
            flag,
        )
    vp = len(stages) // pp
    per_virtual = tuple(stage.count(DECODER) for stage in stages)
    per_rank = tuple(sum(per_virtual[rank::pp]) for rank in range(pp))
    even = vp == 1 or all(
        per_virtual[k] == per_rank[k % pp] // vp and per_rank[k % pp] % vp == 0 for k in range(len(per_virtual))
    )
    return StageLayers(vp=vp, per_rank=per_rank, per_virtual_stage=() if even else per_virtual)


def split_layers(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> tuple[int, ...]:
    """Decoder layers per pipeline rank, as Megatron splits them.

    `--decoder-first/last-pipeline-num-layers` pin the first/last rank; the
    remaining layers are spread evenly over the other ranks (they must divide).
    """
    if pp == 1:
        return (num_layers,)
    counts: list[int | None] = [None] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    pinned = [c for c in counts if c is not None]
    free = counts.count(None)
    rest = num_layers - sum(pinned)
    if rest < 0 or (free == 0 and rest != 0) or (free and rest % free):
        pins = [f"{label} stage {count}" for label, count in (("first", first), ("last", last)) if count is not None]
        raise ValueError(
            f"{num_layers} layers cannot be split evenly over {pp} stages"
            + (f" with {' and '.join(pins)} pinned: {rest} left for {free} stages" if pins else "")
        )
    return tuple(c if c is not None else rest // free for c in counts)


def layers_accounting(num_layers: int, pp: int, vp: int, embedding: bool, loss: bool) -> StageLayers:
    """The even split with the embedding and/or the loss counted as a layer each
    (`--account-for-embedding-in-pipeline-split`, `--account-for-loss-in-pipeline-split`)."""
    pieces = num_layers + embedding + loss
    flags = " and ".join(
        flag
        for flag, on in (
            ("--account-for-embedding-in-pipeline-split", embedding),
            ("--account-for-loss-in-pipeline-split", loss),
        )
        if on
    )
    if pieces % pp:
        raise LayoutError(
            f"{num_layers} layers plus the pieces {flags} counts ({pieces}) are not divisible by "
            f"--pipeline-model-parallel-size {pp} (Megatron asserts they are)",
            "--num-layers",
        )
    per_rank = pieces // pp
    if per_rank % vp:
        raise LayoutError(
            f"{per_rank} pieces per rank do not divide into {vp} model chunks (Megatron asserts they do)",
            "--num-layers",
        )
    per_virtual = [per_rank // vp] * (pp * vp)
    per_virtual[0] -= embedding
    per_virtual[-1] -= loss
    if min(per_virtual) < 0:
        raise LayoutError(
            f"the first or last virtual stage has no decoder layer to give up for {flags} "
            "(Megatron: not enough layers in the first/last virtual pipeline stage)",
            "--num-layers",
        )
    ranks = tuple(sum(per_virtual[rank::pp]) for rank in range(pp))
    even = vp == 1 or all(per_virtual[k] * vp == ranks[k % pp] for k in range(pp * vp))
    return StageLayers(vp=vp, per_rank=ranks, per_virtual_stage=() if even else tuple(per_virtual))
