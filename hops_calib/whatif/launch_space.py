"""The launch search's space: a `Launch` (stage order, layer split, schedule, micro-batch size) and the `Space` of
launches a plan searches, as dimensions (never listed whole), with Megatron's layer splits. See
`hops_calib.whatif.job_plan`."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from hops_calib.errors import InputError

PLACED = "rank@"  # the stage "devices" of a launch whose ranks torchrun places: rank@K is pipeline rank K
SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "gpipe", "auto")
MEGATRON_SCHEDULES = ("1f1b", "interleaved_1f1b")  # what Megatron-LM's own schedules run
# --context-parallel-size values searched (where the sequence splits into 2 cp chunks and t x p x cp divides the GPUs)
CONTEXT_PARALLEL_SIZES = (1, 2, 4, 8)
# --precision: the precisions a pick may run in (None: the job's own only)
PRECISIONS = ("bf16", "fp8", "any")


@dataclass(frozen=True)
class Levers:
    """The launch's settings beside the pipeline's order, split, schedule and micro batch: tensor and pipeline
    parallel size (d is the rest of the world size), activation recomputation as Megatron spells it
    (--recompute-granularity selective, or full with --recompute-method uniform|block and --recompute-num-layers N;
    megatron/core/transformer/transformer_config.py `recompute_granularity`/`recompute_method`/
    `recompute_num_layers`, run by transformer_block.py `TransformerBlock._checkpointed_forward`), sequence
    parallelism, the distributed optimizer, context parallelism (--context-parallel-size: each sequence cut into
    2 cp chunks over cp GPUs, world = t x p x cp x d; megatron/core/parallel_state.py `initialize_model_parallel`,
    megatron/core/utils.py `get_batch_on_this_cp_rank`) and FP8 (Transformer Engine's FP8 GEMMs, --fp8-format and
    --fp8-recipe; megatron/core/transformer/transformer_config.py `fp8`, `fp8_recipe`). A mixture of experts adds
    expert parallelism: the experts split over ep GPUs (--expert-model-parallel-size, num_experts / ep each,
    megatron/core/transformer/moe/moe_layer.py `MoELayer.__init__`) and each expert's GEMMs over etp
    (--expert-tensor-parallel-size), the expert layers' own rank grid etp x ep x edp x p (megatron/core/
    parallel_state.py `initialize_model_parallel`: the world divisible by etp x ep x p, edp = world / (etp x ep x
    p)); a dense job's ep and etp are None."""

    tp: int
    pp: int
    recompute: tuple[str | None, str | None, int | None]  # (granularity, method, layers); (None, None, None): none
    sequence_parallel: bool
    distributed_optimizer: bool
    cp: int = 1
    fp8: bool = False  # the linear layers' GEMMs in FP8 through Transformer Engine (else the job's 16 bits)
    ep: int | None = None  # --expert-model-parallel-size (None: a dense MLP, no experts)
    etp: int | None = None  # --expert-tensor-parallel-size as it runs (Megatron's default t; None: no experts)

    @property
    def layout(self) -> tuple[int, int, int]:
        """(t, p, cp): what places the ranks (d is the rest of the GPUs)."""
        return (self.tp, self.pp, self.cp)

    @property
    def experts(self) -> tuple[int | None, int | None]:
        """(ep, etp): how the experts' layers lay out over the ranks t x p x cp places ((None, None): dense)."""
        return (self.ep, self.etp)

    def recompute_label(self) -> str:
        granularity, method, layers = self.recompute
        if granularity is None:
            return "none"
        return "selective" if granularity == "selective" else f"full {method} {layers}"

    def label(self) -> str:
        """The levers in words, precision aside (a plan's row prints `Outcome.precision` for every pick)."""
        return (
            f"t{self.tp} p{self.pp}"
            + (f" cp{self.cp}" if self.cp > 1 else "")
            + (f" ep{self.ep}" if self.ep is not None else "")
            + (f" etp{self.etp}" if self.etp is not None and self.etp != self.tp else "")
            + f", recompute {self.recompute_label()}"
            + (", SP" if self.sequence_parallel else "")
            + (", dist-opt" if self.distributed_optimizer else "")
        )


def recompute_options(layers_per_chunk: int) -> list[tuple[str | None, str | None, int | None]]:
    """What Megatron recomputes, cheapest first: nothing; selective (the attention core); full recomputation of
    the first k layers of each model chunk (--recompute-method block, k = 1 .. all but one, at most 4 evenly spread
    values); every layer (uniform groups of 1)."""
    blocks = list(range(1, layers_per_chunk))
    if len(blocks) > 4:
        blocks = sorted({blocks[round(i * (len(blocks) - 1) / 3)] for i in range(4)})
    return [
        (None, None, None),
        ("selective", None, None),
        *(("full", "block", k) for k in blocks),
        ("full", "uniform", 1),
    ]


@dataclass(frozen=True)
class Launch:
    order: tuple[str, ...]  # device id per stage
    first: int | None  # --decoder-first-pipeline-num-layers (None: not pinned)
    last: int | None  # --decoder-last-pipeline-num-layers
    schedule: str  # one of SCHEDULES
    chunks: int  # model chunks per rank (interleaved 1F1B); 1 otherwise
    micro_batch_size: int
    # (--account-for-embedding-in-pipeline-split, --account-for-loss-in-pipeline-split): the embedding and/or the loss
    # counted as a layer of the even split (never with first/last pinned: Megatron asserts so)
    accounted: tuple[bool, bool] = (False, False)
    levers: Levers | None = None  # None: the job's own (t, p, recomputation, SP, distributed optimizer)

    def label(self) -> str:
        pinned = [f"{end} stage {n} layers" for end, n in (("first", self.first), ("last", self.last)) if n is not None]
        pieces = [piece for piece, on in zip(("embedding", "loss"), self.accounted) if on]
        split = (
            " and ".join(pinned) + ", the rest even"
            if pinned
            else f"even with the {' and '.join(pieces)} as a layer"
            if pieces
            else "even"
        )
        schedule = f"{self.schedule} v={self.chunks}" if self.chunks > 1 else self.schedule
        where = "ranks placed by torchrun" if self.levers_placed else f"order {'-'.join(self.order)}"
        levers = f"{self.levers.label()}, " if self.levers is not None else ""
        return f"{levers}{schedule}, mbs {self.micro_batch_size}, split {split}, {where}"

    @property
    def levers_placed(self) -> bool:
        """Whether the ranks sit where torchrun places them (a layout of its own: no stage map to search)."""
        return bool(self.order) and self.order[0].startswith(PLACED)


def layer_splits(num_layers: int, pp: int) -> list[tuple[int | None, int | None]]:
    """Every split Megatron launches: even, or the first and/or last stage pinned with the rest spread evenly
    (each stage at least one layer)."""
    if num_layers > MAX_SPLIT_LAYERS:
        raise InputError(
            "plan",
            f"{num_layers} layers have about {num_layers**2} first/last settings to search",
            field="--keep-split",
            hint=f"keep the job's split (--keep-split) above {MAX_SPLIT_LAYERS} layers",
        )
    return list(_layer_splits(num_layers, pp))


@functools.lru_cache(maxsize=256)
def _layer_splits(num_layers: int, pp: int) -> tuple[tuple[int | None, int | None], ...]:
    from hops_calib.spec import split_layers

    splits: list[tuple[int | None, int | None]] = []
    options: list[int | None] = [None, *range(1, num_layers + 1)]
    for first, last in itertools.product(options, options):
        if pp == 1 and (first, last) != (None, None):
            continue
        try:
            counts = split_layers(num_layers, pp, first, last)
        except ValueError:
            continue
        if min(counts) >= 1 and (first is None or last is None or pp > 1):
            splits.append((first, last))
    # two settings giving the same split are one launch: keep the one with fewer pins
    seen: dict[tuple[int, ...], tuple[int | None, int | None]] = {}
    for first, last in sorted(splits, key=lambda s: (s[0] is not None) + (s[1] is not None)):
        seen.setdefault(split_layers(num_layers, pp, first, last), (first, last))
    return tuple(seen.values())


MAX_SPLIT_LAYERS = 512  # layer splits are searched up to this depth (the settings grow as its square)


ACCOUNTING_FLAGS = ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")


def accounted_splits(
    num_layers: int, pp: int, chunks: int = 1, taken: Iterable[tuple[int, ...]] = ()
) -> list[tuple[bool, bool]]:
    """The (embedding, loss) accounting Megatron runs on `num_layers` over `pp` ranks of `chunks` model chunks,
    besides none: the layers plus the pieces counted divide evenly over the virtual stages, and the first and last
    keep a layer to give up (`spec.stage_layers.layers_accounting`, Megatron's get_num_layers_to_build). One that
    builds the layers of a split in `taken` (decoder layers per rank, one chunk each), or the even split's, is that
    launch: left out."""
    from hops_calib.spec.stage_layers import LayoutError, layers_accounting

    if pp == 1:
        return []
    seen = set(taken) if chunks == 1 else set()
    if num_layers % (pp * chunks) == 0:
        seen.add((num_layers // (pp * chunks),) * (pp * chunks) if chunks > 1 else (num_layers // pp,) * pp)
    found = []
    for accounted in ((True, False), (False, True), (True, True)):
        try:
            split = layers_accounting(num_layers, pp, chunks, *accounted)
        except LayoutError:
            continue
        layers = split.per_virtual_stage or (
            split.per_rank if chunks == 1 else tuple(split.per_rank[k % pp] // chunks for k in range(pp * chunks))
        )
        if layers not in seen:
            seen.add(layers)
            found.append(accounted)
    return found


@functools.lru_cache(maxsize=256)
def _taken(num_layers: int, pp: int, splits: tuple[tuple[int | None, int | None], ...]) -> tuple[tuple[int, ...], ...]:
    """The layers per stage of each (first, last) setting."""
    from hops_calib.spec import split_layers

    return tuple(split_layers(num_layers, pp, first, last) for first, last in splits)


@functools.lru_cache(maxsize=1024)
def _accounted(
    num_layers: int, pp: int, chunks: int, taken: tuple[tuple[int, ...], ...] = ()
) -> tuple[tuple[bool, bool], ...]:
    return tuple(accounted_splits(num_layers, pp, chunks, taken))


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


@dataclass(frozen=True)
class Space:
    """The launches a plan searches, as dimensions: never listed whole (8 stages have 40320 orders alone).

    `devices` None: the job's own order only. Devices of one kind (`kinds`: an index per device of `devices`, equal
    for interchangeable devices, see `JobPlanner.kinds`) price alike wherever they sit, so only orders of kinds are
    distinct launches: each is searched once, by its canonical device order (the devices of a kind in the order the
    job's own launch has them, so the job's own order is its own canonical one). Interleaved 1F1B takes the even
    split only and v model chunks per rank where v divides the layers per rank and the microbatches are a multiple
    of the stages (Megatron's rule); with `accounting`, also the even splits that count the embedding and/or the
    loss as a layer (`accounted_splits`: on one chunk per rank they build what a first/last pin builds).
    """

    devices: tuple[str, ...] | None
    current_order: tuple[str, ...]
    splits: tuple[tuple[int | None, int | None], ...]
    sizes: tuple[int, ...]
    schedules: tuple[str, ...]
    layers: int
    pp: int
    batch: int
    kinds: tuple[int, ...] = ()  # () : every device a kind of its own
    accounting: bool = False  # also the even split with the embedding and/or loss counted (`accounted_splits`)
    levers: Levers | None = None  # the launches' levers (None: the job's own)

    def _kind(self) -> dict[str, int]:
        devices = self.devices if self.devices is not None else self.current_order
        return dict(zip(devices, self.kinds or range(len(devices))))

    def orders_count(self) -> int:
        """Distinct orders: n! / (n_1! n_2! ...) for n devices of kinds of n_k each."""
        if self.devices is None:
            return 1
        counts: dict[int, int] = {}
        for kind in self._kind().values():
            counts[kind] = counts.get(kind, 0) + 1
        return math.factorial(len(self.devices)) // math.prod(math.factorial(c) for c in counts.values())

    def by_kind(self) -> tuple[dict[str, int], dict[int, list[str]]]:
        """Each device's kind, and each kind's devices in the order the job's own launch has them."""
        kind = self._kind()
        by_kind: dict[int, list[str]] = {}
        for device in self.current_order:
            by_kind.setdefault(kind[device], []).append(device)
        return kind, by_kind

    @staticmethod
    def _deal(by_kind: dict[int, list[str]], kinds: Iterable[int]) -> tuple[str, ...]:
        """The canonical order of a sequence of kinds: at each stage the next device of its kind."""
        taken = {k: iter(devices) for k, devices in by_kind.items()}
        return tuple(next(taken[k]) for k in kinds)

    def canonical(self, order: Iterable[str]) -> tuple[str, ...]:
        """The device order that stands for every order with the same kinds at the same stages."""
        kind, by_kind = self.by_kind()
        return self._deal(by_kind, (kind[device] for device in order))

    def orders(self):
        """Every distinct order, canonical, in lexicographic order of kind sequences (with every device a kind of
        its own: itertools.permutations' order, the job's own first)."""
        if self.devices is None:
            yield self.current_order
            return
        kind, by_kind = self.by_kind()
        rank = {k: r for r, k in enumerate(by_kind)}  # kinds numbered as the job's own order meets them
        sequence = sorted(rank[kind[d]] for d in self.current_order)
        kinds = list(by_kind)
        while True:
            yield self._deal(by_kind, (kinds[r] for r in sequence))
            i = len(sequence) - 2  # the next permutation of the multiset (Narayana's algorithm)
            while i >= 0 and sequence[i] >= sequence[i + 1]:
                i -= 1
            if i < 0:
                return
            j = len(sequence) - 1
            while sequence[j] <= sequence[i]:
                j -= 1
            sequence[i], sequence[j] = sequence[j], sequence[i]
            sequence[i + 1 :] = reversed(sequence[i + 1 :])

    def shapes(self) -> list[tuple[int, int | None, int | None, str, int, tuple[bool, bool]]]:
        """(micro batch size, first, last, schedule, chunks, accounted) of every launch of one order."""
        return list(self._shapes)

    @functools.cached_property
    def _groups(self) -> tuple[tuple[int, str, int, bool, tuple[tuple[bool, bool], ...]], ...]:
        """The launches of one order by (micro batch size, schedule, chunks): whether the space's first/last splits
        apply to it (one chunk per rank) and its even splits by what they count as a layer (`accounted_splits`;
        (False, False): the plain even split). `shapes` lists them, `__len__` counts them and `runs_at` reads them,
        the last two without listing the splits (a plan sizes hundreds of settings' spaces, most never searched
        whole)."""
        out: list[tuple[int, str, int, bool, tuple[tuple[bool, bool], ...]]] = []
        none = (False, False)
        one_chunk = (
            _accounted(self.layers, self.pp, 1, _taken(self.layers, self.pp, self.splits)) if self.accounting else ()
        )
        for size in self.sizes:
            m = self.batch // size
            for schedule in self.schedules:
                if schedule != "interleaved_1f1b":
                    out.append((size, schedule, 1, True, one_chunk))
                    continue
                # megatron/core/parallel_state.py initialize_model_parallel asserts p > 1
                if self.pp < 2 or m % self.pp:
                    continue
                for v in range(2, (self.layers + 2 * self.accounting) // self.pp + 1):
                    plain = (none,) if self.layers % (self.pp * v) == 0 else ()
                    out.append(
                        (
                            size,
                            schedule,
                            v,
                            False,
                            plain + (_accounted(self.layers, self.pp, v) if self.accounting else ()),
                        )
                    )
        return tuple(out)

    @functools.cached_property
    def _shapes(self) -> tuple[tuple[int, int | None, int | None, str, int, tuple[bool, bool]], ...]:
        none = (False, False)
        out: list[tuple[int, int | None, int | None, str, int, tuple[bool, bool]]] = []
        for size, schedule, chunks, split, accounted in self._groups:
            if split:
                out += [(size, first, last, schedule, chunks, none) for first, last in self.splits]
            out += [(size, None, None, schedule, chunks, counted) for counted in accounted]
        return tuple(out)

    @functools.cached_property
    def _group_index(self) -> dict[tuple[int, str, int], tuple[bool, frozenset[tuple[bool, bool]]]]:
        return {
            (size, schedule, chunks): (split, frozenset(accounted))
            for size, schedule, chunks, split, accounted in self._groups
        }

    @functools.cached_property
    def _split_set(self) -> frozenset[tuple[int | None, int | None]]:
        return frozenset(self.splits)

    def holds(self, shape: tuple[int, int | None, int | None, str, int, tuple[bool, bool]]) -> bool:
        """Whether `shapes` holds `shape` (micro batch size, first, last, schedule, chunks, accounted), read from the
        groups without listing the shapes."""
        size, first, last, schedule, chunks, accounted = shape
        group = self._group_index.get((size, schedule, chunks))
        if group is None:
            return False
        split, counted = group
        if accounted == (False, False) and split and (first, last) in self._split_set:
            return True
        return (first, last) == (None, None) and accounted in counted

    def runs_at(self, size: int) -> set[tuple[str, int]]:
        """The (schedule, chunks) of the launches of micro batch `size`: those `shapes` holds at it."""
        return {
            (schedule, chunks)
            for at, schedule, chunks, split, accounted in self._groups
            if at == size and ((split and self.splits) or accounted)
        }

    @functools.cached_property
    def _shape_count(self) -> int:
        """len(shapes())."""
        return sum((len(self.splits) if split else 0) + len(accounted) for *_, split, accounted in self._groups)

    def __len__(self) -> int:
        return self.orders_count() * self._shape_count

    def __iter__(self):
        shapes = self.shapes()
        for order in self.orders():
            for size, first, last, schedule, chunks, accounted in shapes:
                yield Launch(tuple(order), first, last, schedule, chunks, size, accounted, self.levers)
