"""What-if room: the planner for a real job, which device runs which stage, how many layers each holds, which
schedule, which micro-batch size - for a job directory's model and global batch, on its devices, priced by a
calibrated model.

A candidate is a `Launch`: a stage order (device id per stage), Megatron's layer split (even, or the first and/or
last stage pinned with --decoder-first/last-pipeline-num-layers, the rest even, or even with the embedding and/or the
loss counted as a layer, --account-for-embedding/loss-in-pipeline-split), a schedule (1F1B, interleaved 1F1B
with v model chunks per rank, ZB-H1, GPipe, or `auto`, the HopsHetero rule choosing 1F1B or ZB-H1) and a micro-batch
size (the microbatch count follows from the global batch). Each is turned into the launch's arguments and built
into a spec exactly as a job directory's would be (`spec_from_args`: a split or shape Megatron refuses is refused
here too), its hops priced by the hosts at their ends (`cluster.LinkBook`: the job's own benchmark of a host pair,
else the cluster's), simulated, and checked against each device's memory (`model.memory`). Ranked by predicted
samples per second over the traced window.

Small spaces are searched exhaustively; larger ones by a seeded optuna (TPE) study of `trials` candidates. Under
stragglers and failures (`Perturbations`), the nominal best `rerank` candidates are simulated again `samples`
times with drawn stragglers and failures, and ranked by the mean or the 5th percentile of their throughput.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from hops_calib.errors import InputError
from hops_calib.model import Model
from hops_calib.model.memory import stage_memory
from hops_calib.model.terms.embedding import transport_note
from hops_calib.progress import QUIET, Progress
from hops_calib.sim import simulate
from hops_calib.sim.simulate import auto_schedule
from hops_calib.sim.theory import pipeline_schedule_bubble
from hops_calib.spec import Spec
from hops_calib.whatif.cluster import Cluster, LinkBook
from hops_calib.whatif.perturbations import Perturbations

SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "gpipe", "auto")
MEGATRON_SCHEDULES = ("1f1b", "interleaved_1f1b")  # what Megatron-LM's own schedules run
# Launches searched one by one (about 1 ms each); more, and a seeded optuna study samples them.
EXHAUSTIVE_LIMIT = 10000
NO_MEGATRON_FLAG = ("has no Megatron-LM flag (Megatron runs 1F1B, or interleaved 1F1B with virtual stages): run it "
                    "with a runtime that has it, e.g. torch.distributed.pipelining (`hops-calib capture --engine "
                    "torch --schedule {schedule}` records one)")


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

    def label(self) -> str:
        pinned = [f"{end} stage {n} layers" for end, n in (("first", self.first), ("last", self.last)) if n is not None]
        pieces = [piece for piece, on in zip(("embedding", "loss"), self.accounted) if on]
        split = (" and ".join(pinned) + ", the rest even" if pinned
                 else f"even with the {' and '.join(pieces)} as a layer" if pieces else "even")
        schedule = f"{self.schedule} v={self.chunks}" if self.chunks > 1 else self.schedule
        return f"{schedule}, mbs {self.micro_batch_size}, split {split}, order {'-'.join(self.order)}"


@dataclass(frozen=True)
class Outcome:
    launch: Launch
    resolved: str  # the schedule simulated (auto resolved)
    microbatches: int
    layers_per_stage: tuple[int, ...]
    samples_per_s: float  # window throughput in samples (microbatches x micro batch size x replicas) per second
    steady_samples_per_s: float
    iteration_ms: float
    idle_share: float  # the simulated timeline's idle share (HOPS's bubble definition: what a trace would measure)
    schedule_bubble: float  # the schedule's own bubble on balanced stages, (p-1)/(v m + p-1)
    peak_memory_bytes: tuple[float, ...]  # per GPU
    memory_bytes: tuple[float, ...]  # per GPU, the device's capacity
    flags: tuple[str, ...]  # changes to the job's launch, in words (one per change)
    stage_map: dict[str, str]
    expected_samples_per_s: float | None = None  # under Perturbations: the run's work over its expected wall time
    p5_samples_per_s: float | None = None  # and the draws' 5th percentile
    argv: tuple[str, ...] = ()  # Megatron-LM arguments to add or set, as argv tokens (flag, value, flag, ...)
    remove: tuple[str, ...] = ()  # Megatron-LM arguments to remove from the launch
    launch_notes: tuple[str, ...] = ()  # what no flag says: a schedule Megatron-LM lacks, moving ranks between hosts
    expected_ci95: tuple[float, float] | None = None  # the expected throughput's 95 % Monte-Carlo interval
    outside: tuple[str, ...] | None = None  # features outside the calibration runs (None: not checked)

    @property
    def fits(self) -> bool:
        return all(peak <= cap for peak, cap in zip(self.peak_memory_bytes, self.memory_bytes))

    def to_dict(self) -> dict[str, Any]:
        launch = self.launch
        return {
            "schedule": launch.schedule, "resolved_schedule": self.resolved, "chunks": launch.chunks,
            "micro_batch_size": launch.micro_batch_size, "microbatches": self.microbatches,
            "decoder_first_pipeline_num_layers": launch.first, "decoder_last_pipeline_num_layers": launch.last,
            "account_for_embedding_in_pipeline_split": launch.accounted[0],
            "account_for_loss_in_pipeline_split": launch.accounted[1],
            "layers_per_stage": list(self.layers_per_stage), "order": list(launch.order),
            "throughput_samples_per_s": self.samples_per_s,
            "steady_throughput_samples_per_s": self.steady_samples_per_s,
            "iteration_time_ms": self.iteration_ms, "idle_share": self.idle_share,
            "schedule_bubble": self.schedule_bubble, "peak_memory_bytes_per_gpu": list(self.peak_memory_bytes),
            "memory_bytes_per_gpu": list(self.memory_bytes), "fits": self.fits,
            "flags": list(self.argv), "remove_flags": list(self.remove), "notes": list(self.launch_notes),
            "changes": list(self.flags), "stage_map": self.stage_map,
            "expected_throughput_samples_per_s": self.expected_samples_per_s,
            "expected_throughput_ci95": list(self.expected_ci95) if self.expected_ci95 is not None else None,
            "p5_throughput_samples_per_s": self.p5_samples_per_s,
            "outside_calibration": list(self.outside) if self.outside is not None else None,
        }


@dataclass(frozen=True)
class JobPlan:
    job: str
    model: str
    search: str  # "exhaustive" or "optuna TPE, seed S, N trials"
    space: int  # candidates in the space
    evaluated: int
    best: tuple[Outcome, ...]  # the best K that fit, best first
    current: Outcome | None  # the job's own launch, for comparison
    refused: dict[str, int]  # why candidates could not run or be priced, counted
    over_memory: int
    rank_by: str
    notes: tuple[str, ...] = ()
    auto_agreement: tuple[int, int] = (0, 0)  # (auto's pick was the faster of 1f1b/zb_h1, pairs compared)
    best_megatron: Outcome | None = None  # the best launch Megatron-LM runs as it is (1F1B or interleaved 1F1B)
    cluster: str = ""  # the cluster file used and where it was set ("": none)
    store: str = ""  # the fixture store whose train split the launches were checked against ("": not checked)
    orders: int = 1  # distinct stage orders in the space (orders of kinds of interchangeable devices)

    @property
    def status(self) -> str:
        """"ok", or "no_candidate" when no launch runs, is priced and fits in memory (exit 1, as a rejection)."""
        return "ok" if self.best else "no_candidate"

    @property
    def exit_code(self) -> int:
        return 0 if self.best else 1

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "job": self.job, "model": self.model, "cluster": self.cluster or None,
                "fixtures": self.store or None, "search": self.search, "space": self.space, "orders": self.orders,
                "evaluated": self.evaluated, "rank_by": self.rank_by,
                "best": [o.to_dict() for o in self.best],
                "current": self.current.to_dict() if self.current else None,
                "refused": self.refused, "over_memory": self.over_memory, "notes": list(self.notes),
                "auto_rule_agreement": {"faster_picked": self.auto_agreement[0], "compared": self.auto_agreement[1]},
                "best_megatron": self.best_megatron.to_dict() if self.best_megatron else None}


class Refusal(Exception):
    """A candidate that cannot run (Megatron refuses the launch, a schedule cannot run the shape) or cannot be
    priced (a hop with no link); the reason is counted."""


def layer_splits(num_layers: int, pp: int) -> list[tuple[int | None, int | None]]:
    """Every split Megatron launches: even, or the first and/or last stage pinned with the rest spread evenly
    (each stage at least one layer)."""
    from hops_calib.spec import split_layers

    if num_layers > MAX_SPLIT_LAYERS:
        raise InputError("plan", f"{num_layers} layers have about {num_layers ** 2} first/last settings to search",
                         field="--keep-split", hint=f"keep the job's split (--keep-split) above {MAX_SPLIT_LAYERS} "
                                                    "layers")
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
    return list(seen.values())


ACCOUNTING_FLAGS = ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")


def accounted_splits(num_layers: int, pp: int, chunks: int = 1, taken: Iterable[tuple[int, ...]] = ()
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
        layers = split.per_virtual_stage or (split.per_rank if chunks == 1 else tuple(
            split.per_rank[k % pp] // chunks for k in range(pp * chunks)))
        if layers not in seen:
            seen.add(layers)
            found.append(accounted)
    return found


MAX_SPLIT_LAYERS = 512  # layer splits are searched up to this depth (the settings grow as its square)
# A launch with more compute tasks per iteration than this is not simulated (a microbatch count in the millions would
# take minutes per candidate): the planner counts it as refused and says to raise the micro-batch size.
MAX_TASKS = 200_000


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
            sequence[i + 1:] = reversed(sequence[i + 1:])

    def shapes(self) -> list[tuple[int, int | None, int | None, str, int, tuple[bool, bool]]]:
        """(micro batch size, first, last, schedule, chunks, accounted) of every launch of one order."""
        out: list[tuple[int, int | None, int | None, str, int, tuple[bool, bool]]] = []
        none = (False, False)
        if self.accounting:
            from hops_calib.spec import split_layers

            taken = [split_layers(self.layers, self.pp, first, last) for first, last in self.splits]
        for size in self.sizes:
            m = self.batch // size
            for schedule in self.schedules:
                if schedule == "interleaved_1f1b":
                    for v in range(2, (self.layers + 2 * self.accounting) // self.pp + 1):
                        if m % self.pp == 0:
                            out += [(size, None, None, schedule, v, none)] if self.layers % (self.pp * v) == 0 else []
                            out += [(size, None, None, schedule, v, accounted) for accounted
                                    in (accounted_splits(self.layers, self.pp, v) if self.accounting else ())]
                else:
                    out += [(size, first, last, schedule, 1, none) for first, last in self.splits]
                    out += [(size, None, None, schedule, 1, accounted) for accounted
                            in (accounted_splits(self.layers, self.pp, 1, taken) if self.accounting else ())]
        return out

    def __len__(self) -> int:
        return self.orders_count() * len(self.shapes())

    def __iter__(self):
        shapes = self.shapes()
        for order in self.orders():
            for size, first, last, schedule, chunks, accounted in shapes:
                yield Launch(tuple(order), first, last, schedule, chunks, size, accounted)


def _step_samples(launch: Launch, spec: Spec) -> int:
    """Samples per microbatch step of the pipeline, every data-parallel replica's: what turns its throughput
    (microbatches per second) into the job's samples per second, nominal or under perturbations alike."""
    return launch.micro_batch_size * spec.dp


class JobPlanner:
    """Prices launches of one job's model and global batch on its devices (see the module's docstring)."""

    def __init__(self, job_dir: Path | str, model: Model, cluster: Cluster | None = None,
                 memory_bytes: dict[str, float] | None = None):
        from hops_calib.spec import build_spec
        from hops_calib.trace import find_arguments, read_device_types

        self.job_dir = Path(job_dir)
        self.notes: list[str] = []
        self.spec = build_spec(self.job_dir, self.notes)
        self.args, self.args_source = find_arguments(self.job_dir)
        note = transport_note(self.spec)
        if note:
            self.notes.append(note)
        self.model = model
        self.cluster = cluster = cluster.for_job(self.spec.device_ids, self.notes) if cluster is not None else None
        self.book = LinkBook(self.job_dir, self.spec.device_ids, self.spec.links, cluster, self.notes)
        types = read_device_types(self.job_dir)
        self.types = {d: types[d].type for d in self.spec.device_ids}
        self.names = {d: types[d].name for d in self.spec.device_ids}
        self.nodes = {d: types[d].node for d in self.spec.device_ids}
        for device_type in set(self.types.values()):
            try:
                model.device(device_type)
            except KeyError:
                raise InputError(str(self.job_dir), f"runs device type {device_type!r}, which model {model.name!r} "
                                 "does not know", field="hardware.devices",
                                 hint="add it to hops_calib/model/devices.toml or the model file's [devices]") from None
        self._cache: dict[Launch, Outcome | Refusal] = {}
        self._priced: dict[Launch, tuple[Spec, Any] | Refusal] = {}
        # each GPU's memory: the catalog's, or what the user gives per device type (headroom for the CUDA context)
        self.memory_bytes = {t: (memory_bytes or {}).get(t, model.device(t).memory_bytes)
                             for t in set(self.types.values())}
        unknown = sorted(set(memory_bytes or {}) - set(self.types.values()))
        if unknown:
            raise InputError("plan", f"device type {unknown[0]!r} runs no stage of {self.job_dir}",
                             field="--device-memory", hint=f"the job's devices are {sorted(set(self.types.values()))}")

    # --- the job's own launch -----------------------------------------------------------------------------------

    def current(self) -> Launch:
        spec, args = self.spec, self.args
        first = args.get("decoder_first_pipeline_num_layers")
        last = args.get("decoder_last_pipeline_num_layers")
        accounted = (bool(args.get("account_for_embedding_in_pipeline_split")),
                     bool(args.get("account_for_loss_in_pipeline_split")))
        return Launch(tuple(spec.device_ids), first, last, spec.schedule, spec.vp, spec.model.micro_batch_size,
                      accounted)

    # --- the space ----------------------------------------------------------------------------------------------

    def kinds(self, distinct: Sequence[str] = ()) -> tuple[int, ...]:
        """Each device's kind (an index per device of the job's stage map; equal: interchangeable). Two devices are
        interchangeable when a launch prices the same with them swapped: the same type; the same node where the spec
        prices hops within a node from it (a collective benchmark and named nodes); neither named in `distinct` (a
        slowed device or link); and every link the book prices from or to either of them, at every hop position, the
        same either way (the hosts' links to each other device's host, and between the two). Swaps that keep every
        price compose, so the kinds are classes: only orders of kinds need pricing."""
        ids = tuple(self.spec.device_ids)
        hosts = self.book.device_hosts
        positions = [(hop.src_stage, hop.dst_stage) for hop in self.book.hops(ids)]
        priced: dict[tuple[str, str], int] = {}
        alike: dict[tuple, int] = {}  # each distinct way of pricing a host pair, numbered: compared as numbers

        def links(a: str, b: str) -> int:
            """The links from a's host to b's host at every hop position, without the names they carry."""
            pair = (hosts.get(a, ""), hosts.get(b, ""))
            if pair not in priced:
                fits = (self.book.link(i, j, pair) for i, j in positions)
                key = tuple(None if fit is None else replace(fit, src_stage=0, dst_stage=0, source="") for fit in fits)
                priced[pair] = alike.setdefault(key, len(alike))
            return priced[pair]

        def swappable(a: str, b: str) -> bool:
            if (self.types[a], self.nodes[a] if self.spec.nodes else "") != (
                    self.types[b], self.nodes[b] if self.spec.nodes else "") or a in distinct or b in distinct:
                return False
            return links(a, b) == links(b, a) and all(links(a, c) == links(b, c) and links(c, a) == links(c, b)
                                                      for c in ids if c not in (a, b))

        kind = list(range(len(ids)))
        for j, b in enumerate(ids):
            kind[j] = next((kind[i] for i, a in enumerate(ids[:j]) if swappable(a, b)), j)
        return tuple(kind)

    def space(self, schedules: Sequence[str] = SCHEDULES, orders: bool = True, splits: bool = True,
              micro_batch_sizes: bool = True, distinct: Sequence[str] = ()) -> Space:
        """The launches to search; devices named in `distinct` (slowed by a perturbation) are of a kind of their
        own."""
        spec = self.spec
        current = self.current()
        return Space(devices=tuple(spec.device_ids) if orders else None, current_order=current.order,
                     kinds=self.kinds(distinct) if orders else (),
                     splits=tuple(layer_splits(spec.model.num_layers, spec.pp)) if splits
                     else ((current.first, current.last),),
                     sizes=tuple(divisors(spec.model.global_batch_size)) if micro_batch_sizes
                     else (current.micro_batch_size,),
                     schedules=tuple(schedules), layers=spec.model.num_layers, pp=spec.pp,
                     batch=spec.model.global_batch_size, accounting=splits)

    # --- one candidate ------------------------------------------------------------------------------------------

    def launch_args(self, launch: Launch) -> dict[str, Any]:
        args = dict(self.args)
        args["micro_batch_size"] = launch.micro_batch_size
        for key, value in (("decoder_first_pipeline_num_layers", launch.first),
                           ("decoder_last_pipeline_num_layers", launch.last)):
            if value is None:
                args.pop(key, None)
            else:
                args[key] = value
        for key, on in zip(("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"),
                           launch.accounted):
            if on:
                args[key] = True
            else:
                args.pop(key, None)
        # the job's own p2p setting stays: Megatron-LM overlaps an interleaved schedule's p2p unless told not to
        for key in ("virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage"):
            args.pop(key, None)
        if launch.chunks > 1:
            args["num_layers_per_virtual_pipeline_stage"] = self._per_chunk(launch)
        return args

    def _per_chunk(self, launch: Launch) -> int:
        """--num-layers-per-virtual-pipeline-stage of an interleaved launch (the embedding and loss count when the
        split accounts for them, as Megatron-LM counts them)."""
        return (self.spec.model.num_layers + sum(launch.accounted)) // (self.spec.pp * launch.chunks)

    def changes(self, launch: Launch) -> dict[str, tuple[str, ...]]:
        """The changes to the job's launch that run `launch`: `argv` (tokens to add or set), `remove` (flags to
        take out), `notes` (what no flag says), and `words` (each change in one line, for text)."""
        now, argv, remove, notes, words = self.current(), [], [], [], []
        if launch.micro_batch_size != now.micro_batch_size:
            argv += ["--micro-batch-size", str(launch.micro_batch_size)]
            words.append(f"--micro-batch-size {launch.micro_batch_size}")
        for flag, old, new in (("--decoder-first-pipeline-num-layers", now.first, launch.first),
                               ("--decoder-last-pipeline-num-layers", now.last, launch.last)):
            if new != old:
                if new is not None:
                    argv += [flag, str(new)]
                    words.append(f"{flag} {new}")
                else:
                    remove.append(flag)
                    words.append(f"remove {flag}")
        for flag, old, new in zip(ACCOUNTING_FLAGS, now.accounted, launch.accounted):
            if new != old:
                (argv.append if new else remove.append)(flag)
                words.append(flag if new else f"remove {flag}")
        if launch.chunks > 1 and (launch.chunks != now.chunks or now.schedule != "interleaved_1f1b"
                                  or launch.accounted != now.accounted):
            per_chunk = self._per_chunk(launch)
            argv += ["--num-layers-per-virtual-pipeline-stage", str(per_chunk)]
            words.append(f"--num-layers-per-virtual-pipeline-stage {per_chunk}")
        if launch.chunks == 1 and now.chunks > 1:
            remove += ["--num-layers-per-virtual-pipeline-stage", "--virtual-pipeline-model-parallel-size"]
            words.append("remove --num-layers-per-virtual-pipeline-stage (and --virtual-pipeline-model-parallel-size)")
        if launch.schedule in ("zb_h1", "gpipe"):
            notes.append(f"schedule {launch.schedule}: " + NO_MEGATRON_FLAG.format(schedule=launch.schedule))
            words.append(notes[-1])
        if launch.order != now.order:
            hosts = [self.book.device_hosts.get(d) or "" for d in launch.order]
            where = ", ".join(f"{k}: {d}" + (f" on {h}" if h else "") for k, (d, h) in enumerate(zip(launch.order,
                                                                                                   hosts)))
            notes.append(f"stage map {where}. Megatron gives pipeline rank k to global rank k (tensor and data "
                         "parallel 1), so start the process of global rank k on the host of stage k's device: "
                         "torchrun --node-rank k on that host (one GPU per node; with several, its GPU's "
                         "CUDA_VISIBLE_DEVICES and local rank), or list the hosts in this order in the hostfile "
                         "(mpirun/deepspeed) or the SLURM nodelist with --distribution=arbitrary; then write "
                         "hops_trace_map.json and hops.base.yaml pipeline.stages in the same order")
            words.append(notes[-1])
        return {"argv": tuple(argv), "remove": tuple(remove), "notes": tuple(notes), "words": tuple(words)}

    def flags(self, launch: Launch) -> dict[str, Any]:
        """`changes` as Outcome's fields."""
        changes = self.changes(launch)
        return {"flags": changes["words"], "argv": changes["argv"], "remove": changes["remove"],
                "launch_notes": changes["notes"]}

    def candidate_spec(self, launch: Launch) -> Spec:
        from hops_calib.spec import Hardware, spec_from_args
        from hops_calib.trace import TraceError

        hops = self.book.hops(launch.order)
        hardware = Hardware(devices=tuple(self.types[d] for d in launch.order), device_ids=launch.order,
                            device_names=tuple(self.names[d] for d in launch.order) if any(self.names.values())
                            else (), nodes=tuple(self.nodes[d] for d in launch.order), source=self.job_dir)
        try:
            spec = spec_from_args(self.launch_args(launch), self.args_source, run_id=self.spec.run_id,
                                  hardware=hardware, links=tuple(h.link for h in hops if h.link),
                                  collectives=self.spec.collectives, iterations=self.spec.iterations,
                                  ranks_per_device=self.spec.ranks_per_device)
        except (TraceError, ValueError) as error:
            raise Refusal(f"Megatron refuses the launch: {getattr(error, 'problem', None) or error}") from None
        if self.spec.cores and len(self.spec.cores) == spec.gpus:  # the capture's ranks on its cores, as launched
            spec = replace(spec, cores=self.spec.cores)
        # what the launch's command line says besides Megatron's arguments (build_spec's): its environment's transport
        spec = replace(spec, transport=self.spec.transport)
        if spec.gpus_per_node is None and self.spec.gpus_per_node:
            # and torchrun's placement: without a link benchmark it prices every hop the cluster does not, by
            # NVLink within a node and the NICs across nodes, as predict --job does
            spec = replace(spec, gpus_per_node=self.spec.gpus_per_node)
            if not self.spec.links:
                return spec
        # a hop no benchmark prices may lie within one node: the spec prices it from the node's all-reduce tables
        missing = [h for h in hops if h.link is None and spec.link(h.src_stage, h.dst_stage) is None]
        if missing:
            raise Refusal(f"no link for host pair {missing[0].src_host or '?'} -> {missing[0].dst_host or '?'} "
                          f"({missing[0].src_device} -> {missing[0].dst_device})")
        return spec

    def evaluate(self, launch: Launch) -> Outcome:
        """Simulate `launch`; Refusal when it cannot run or be priced."""
        cached = self._cache.get(launch)
        if isinstance(cached, Refusal):
            raise cached
        if cached is not None:
            return cached
        try:
            outcome = self._evaluate(launch)
        except Refusal as refusal:
            self._cache[launch] = refusal
            raise
        self._cache[launch] = outcome
        return outcome

    def priced(self, launch: Launch) -> tuple[Spec, Any]:
        """The spec and the model's pipeline of `launch` (shared by the schedules of one order, split and size)."""
        key = replace(launch, schedule="")
        if key not in self._priced:
            try:
                spec = self.candidate_spec(launch)
                self._priced[key] = (spec, self.pipeline(spec))
            except Refusal as refusal:
                self._priced[key] = refusal
        found = self._priced[key]
        if isinstance(found, Refusal):
            raise found
        return found

    def _evaluate(self, launch: Launch) -> Outcome:
        from hops_calib.sim.schedules import check_shape

        spec, pipeline = self.priced(launch)
        schedule = launch.schedule
        if 2 * spec.microbatches * spec.pp * spec.vp > MAX_TASKS:
            raise Refusal(f"more than {MAX_TASKS} tasks per iteration to simulate; a larger micro-batch size has fewer")
        try:
            check_shape("1f1b" if schedule == "auto" else schedule, spec.pp, spec.vp, spec.microbatches)
            resolved = auto_schedule(pipeline) if schedule == "auto" else schedule
            twin = self._cache.get(replace(launch, schedule=resolved)) if schedule == "auto" else None
            if isinstance(twin, Outcome):  # auto runs exactly the launch of the schedule it picks
                return replace(twin, launch=launch, **self.flags(launch))
            result = simulate(pipeline, resolved)
        except ValueError as error:
            raise Refusal(f"{schedule} cannot run it: {str(error).split(';')[0]}") from None
        metrics = result.metrics()
        size = _step_samples(launch, spec)
        caps = tuple(self.memory_bytes[t] for t in spec.devices)
        peaks = tuple(stage.total_bytes for stage in stage_memory(spec, caps, result.peak_stage_activations))
        return Outcome(
            launch=launch, resolved=resolved, microbatches=spec.microbatches, layers_per_stage=spec.layers_per_stage,
            samples_per_s=metrics.throughput_per_s * size, steady_samples_per_s=metrics.steady_throughput_per_s * size,
            iteration_ms=metrics.iteration_time_ms, idle_share=metrics.bubble_ratio,
            schedule_bubble=pipeline_schedule_bubble(pipeline, resolved), peak_memory_bytes=peaks,
            memory_bytes=caps, **self.flags(launch), stage_map={str(k): d for k, d in enumerate(launch.order)})

    def pipeline(self, spec: Spec):
        try:
            return self.model.pipeline(spec)
        except ValueError as error:
            raise Refusal(f"the model cannot price it: {error}") from None

    # --- under stragglers and failures --------------------------------------------------------------------------

    def perturbed_outcome(self, outcome: Outcome, perturbations: Perturbations) -> Outcome:
        """`outcome` with its expected and 5th-percentile throughput under `perturbations` (seeded draws)."""
        launch = outcome.launch
        spec, pipeline = self.priced(launch)
        estimate = perturbations.estimate(pipeline, outcome.resolved, launch.order).scaled(_step_samples(launch, spec))
        return replace(outcome, expected_samples_per_s=estimate.expected, p5_samples_per_s=estimate.p5,
                       expected_ci95=(estimate.low, estimate.high))


def plan_job(job_dir: Path | str, model: Model, *, cluster: Cluster | None = None, top: int = 5,
             memory_bytes: dict[str, float] | None = None,
             schedules: Sequence[str] = SCHEDULES, orders: bool = True, splits: bool = True,
             micro_batch_sizes: bool = True, trials: int = 400, seed: int = 0,
             exhaustive_limit: int = EXHAUSTIVE_LIMIT, perturbations: Perturbations | None = None,
             rank_by: str = "throughput", rerank: int = 20, progress: Progress = QUIET,
             calibration: Any = None, store: str = "", ascent_tasks: int | None = None) -> JobPlan:
    """The best `top` launches of the job's model and global batch (see the module's docstring)."""
    if rank_by not in ("throughput", "expected", "p5"):
        raise InputError("plan", f"unknown ranking {rank_by!r}", field="--rank-by",
                         hint="throughput (nominal), expected or p5 (under --slow-device/--stragglers/--failure)")
    if rank_by != "throughput" and perturbations is None:
        raise InputError("plan", f"--rank-by {rank_by} ranks under stragglers or failures, and none were given",
                         field="--rank-by", hint="add --slow-device, --stragglers or --failure-rate")
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise InputError("plan", f"unknown schedule {unknown[0]!r}", field="--schedule",
                         hint=f"expected one of {', '.join(SCHEDULES)}")
    for flag, value, most in (("--top", top, 1000), ("--trials", trials, 100_000), ("--exhaustive-limit",
                                                                                   exhaustive_limit, 10_000_000)):
        if not 1 <= value <= most:
            raise InputError("plan", f"{flag} {value} is outside 1..{most}", field=flag)
    planner = JobPlanner(job_dir, model, cluster, memory_bytes)
    slowed = () if perturbations is None else (*(d for d, _ in perturbations.slow_devices),
                                               *(d for a, b, _ in perturbations.slow_links for d in (a, b)))
    space = planner.space(schedules, orders, splits, micro_batch_sizes, distinct=slowed)
    if space.devices is not None and space.orders_count() < math.factorial(len(space.devices)):
        planner.notes.append(_interchangeable(space))
    if not len(space):
        raise InputError(str(job_dir), "no launch to search: the schedules asked for cannot run any split",
                         field="--schedule", hint="allow more schedules, or the layer split")
    outcomes: dict[Launch, Outcome] = {}
    refusals: dict[Launch, str] = {}

    def score(launch: Launch) -> Outcome | None:
        if launch in refusals:
            return None
        try:
            outcome = planner.evaluate(launch)
        except Refusal as refusal:
            refusals[launch] = str(refusal)
            return None
        outcomes[launch] = outcome
        return outcome

    if len(space) <= exhaustive_limit:
        search = "exhaustive"
        progress.start(len(space))
        for launch in space:
            score(launch)
            progress.advance(launch.schedule)
    else:
        _optuna_search(space, score, trials, seed, progress)
        studied = len(outcomes) + len(refusals)
        found = sorted((o for o in outcomes.values() if o.fits), key=lambda o: -o.samples_per_s)[:1]
        own_known = planner.current() in outcomes or planner.current() in refusals
        own = score(planner.current())
        budget = ascent_budget(planner.spec, trials, ascent_tasks or ASCENT_TASKS)
        starts = found + ([own] if own is not None else [])
        steps, stopped = _local_search(space, score, starts,
                                       lambda launch: launch in outcomes or launch in refusals, budget, progress,
                                       done=trials)
        # every count says what it counts: the study's trials repeat launches and fall outside the space, the job's
        # own launch is priced once, and the ascent's budget counts only launches not priced before
        search = (f"optuna TPE, seed {seed}, {trials} trials over {len(space):,} candidates ({studied:,} distinct "
                  "launches priced: the others repeated one or fell outside the space), the job's own launch ("
                  f"{'priced by the study' if own_known else '1 more'}), then coordinate ascent (nearest launches "
                  "first: schedule, micro-batch size, order, split) from the study's best and from the job's own "
                  f"launch: {steps} move(s) to a faster neighbour, "
                  f"{len(outcomes) + len(refusals) - studied - (not own_known):,} new launches priced")
        if stopped is not None:
            start = ("the job's own launch" if own is not None and stopped.start == len(starts) - 1
                     else "the study's best")
            ran_out = (f"its budget of {budget:,} new launches ran out inside step {stopped.step}'s neighbourhood "
                       f"scan (ascending from {start}): {stopped.scanned:,} of its {stopped.neighbours:,} "
                       f"neighbours looked at ({stopped.scanned - stopped.known:,} priced new, {stopped.known:,} "
                       "priced before)")
            search += f"; {ran_out}"
            planner.notes.append(
                f"the coordinate ascent stopped: {ran_out} "
                f"(budget: {ascent_tasks or ASCENT_TASKS:,} simulated tasks at the job's own launch's "
                f"{_tasks(planner.spec):,} per iteration, or --trials if more): the best found, not "
                "proven best; give more --trials, or keep a dimension (--keep-order, --keep-split, "
                "--keep-micro-batch, --schedule)")
    fitting = [o for o in outcomes.values() if o.fits]
    over_memory = len(outcomes) - len(fitting)
    # best first; of launches that run the same (auto and the schedule it picks), the one naming the schedule
    fitting.sort(key=lambda o: (-o.samples_per_s, o.launch.schedule == "auto", len(o.flags)))
    seen: set[tuple] = set()
    unique = []
    for outcome in fitting:
        same = (outcome.launch.order, outcome.layers_per_stage, outcome.resolved, outcome.launch.chunks,
                outcome.launch.micro_batch_size)
        if same not in seen:
            seen.add(same)
            unique.append(outcome)
    if perturbations is not None:
        head = [planner.perturbed_outcome(o, perturbations) for o in unique[:max(rerank, top)]]
        key = {"throughput": lambda o: -o.samples_per_s, "expected": lambda o: -o.expected_samples_per_s,
               "p5": lambda o: -o.p5_samples_per_s}[rank_by]
        head.sort(key=lambda o: (key(o), len(o.flags)))
        unique = head
    if calibration is not None:  # where each shown launch lies outside the calibration runs (model.coverage)
        from hops_calib.model.coverage import extrapolations

        def checked(o: Outcome) -> Outcome:
            return replace(o, outside=tuple(e.sentence() for e in extrapolations(planner.priced(o.launch)[0],
                                                                                  calibration)))

        unique = [checked(o) for o in unique[:top]] + unique[top:]
        megatron = next((o for o in unique if o.resolved in MEGATRON_SCHEDULES), None)
        megatron = checked(megatron) if megatron is not None else None
    else:
        megatron = next((o for o in unique if o.resolved in MEGATRON_SCHEDULES), None)
    try:
        current = planner.evaluate(planner.current())
        if perturbations is not None:
            current = planner.perturbed_outcome(current, perturbations)
    except Refusal:
        current = None
    notes = list(planner.notes)
    refused: dict[str, int] = {}
    for reason in refusals.values():
        refused[reason] = refused.get(reason, 0) + 1
    if any(reason.startswith("no link") for reason in refused):
        notes.append("orders with a hop no benchmark or declared link prices were left out (unpriced, not "
                     "impossible): " + (f"declare the missing links in {planner.cluster.origin}"
                                        if planner.cluster is not None else
                                        "give --cluster (`hops-calib cluster` builds one from job directories) or "
                                        "declare the links"))
    return JobPlan(job=str(job_dir), model=model.name, search=search, space=len(space),
                   evaluated=len(outcomes) + len(refusals), best=tuple(unique[:top]),
                   current=current, refused=refused, over_memory=over_memory, rank_by=rank_by, notes=tuple(notes),
                   auto_agreement=auto_rule_agreement(list(outcomes.values())),
                   best_megatron=megatron, cluster=planner.cluster.named() if planner.cluster is not None else "",
                   store=store, orders=space.orders_count())


def _interchangeable(space: Space) -> str:
    """The note naming the devices a plan took as interchangeable, and the orders that left to price."""
    alike = [", ".join(devices) for devices in space.by_kind()[1].values() if len(devices) > 1]
    return (f"interchangeable devices (same type, same links at every position: a launch prices the same with any "
            f"two swapped): {'; '.join(alike)}. {space.orders_count()} distinct stage order(s) searched of "
            f"{math.factorial(len(space.devices or space.current_order))}")


def auto_rule_agreement(outcomes: Sequence[Outcome]) -> tuple[int, int]:
    """Of the launches evaluated under `auto` whose 1f1b and zb_h1 twins were also evaluated: how many times auto's
    pick (the HopsHetero rule) was the faster of the two in the simulation, and how many were compared."""
    by_launch = {o.launch: o for o in outcomes}
    agree = compared = 0
    for o in outcomes:
        if o.launch.schedule != "auto":
            continue
        one, other = (by_launch.get(replace(o.launch, schedule=s)) for s in ("1f1b", "zb_h1"))
        if one is None or other is None:
            continue
        compared += 1
        faster = max((one, other), key=lambda t: t.samples_per_s)
        agree += faster.resolved == o.resolved or math.isclose(one.samples_per_s, other.samples_per_s, rel_tol=1e-9)
    return agree, compared


def _optuna_search(space: Space, score: Callable[[Launch], Outcome | None], trials: int, seed: int,
                   progress: Progress) -> None:
    """A seeded TPE study over the space's dimensions: the stage order as a random key per device (sorting the keys
    gives the order, so TPE can learn that a device belongs early or late), the micro-batch size, the schedule (with
    its chunks) and the split. A combination outside the space (an interleaved launch Megatron refuses), a candidate
    that cannot run and one that does not fit memory score nothing."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    shapes = set(space.shapes())
    schedules = sorted({(schedule, chunks) for _, _, _, schedule, chunks, _ in shapes})
    # the split as one dimension: the space's first/last settings, then the even split's accounted variants
    splits = [(first, last, (False, False)) for first, last in space.splits] + [
        (None, None, accounted) for accounted in ((True, False), (False, True), (True, True)) if space.accounting]
    devices = space.devices if space.devices is not None else space.current_order
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    progress.start(trials)

    def objective(trial: Any) -> float:
        if space.orders_count() > 1:
            keys = [trial.suggest_float(f"key {device}", 0.0, 1.0) for device in devices]
            order = space.canonical(devices[k] for k in sorted(range(len(keys)), key=keys.__getitem__))
        else:
            order = space.current_order
        size = trial.suggest_categorical("micro_batch_size", list(space.sizes))
        schedule, chunks = schedules[trial.suggest_categorical("schedule", list(range(len(schedules))))]
        first, last, accounted = splits[trial.suggest_categorical("split", list(range(len(splits))))]
        if chunks > 1:
            first = last = None
        progress.advance(schedule)
        if (size, first, last, schedule, chunks, accounted) not in shapes:
            return 0.0
        outcome = score(Launch(order, first, last, schedule, chunks, size, accounted))
        return outcome.samples_per_s if outcome is not None and outcome.fits else 0.0

    study.optimize(objective, n_trials=trials)


def _local_search(space: Space, score: Callable[[Launch], Outcome | None], starts: Sequence[Outcome],
                  known: Callable[[Launch], bool], budget: int, progress: Progress = QUIET, done: int = 0,
                  max_steps: int = 50) -> tuple[int, AscentStop | None]:
    """Coordinate ascent from each start that fits: evaluate every launch that differs from the current one in the
    order only (every distinct order up to `ALL_ORDERS` of them, else every swap of two stages) or in the shape only
    (every split, schedule and micro-batch size of the space), nearest first (the fewest of schedule, micro-batch
    size, order and split changed, in that order), and move to the fastest while it is faster. At most `budget`
    launches not priced before (`known`) are priced, shown on `progress` after `done` units. Returns the steps taken
    (moves to a faster neighbour) and, when the budget stopped the ascent, where (`AscentStop`)."""
    shapes = space.shapes()
    every_order = space.devices is not None and space.orders_count() <= ALL_ORDERS
    steps = spent = 0

    def nearness(a: Launch, b: Launch) -> tuple[int, tuple[bool, ...]]:
        """How many of the schedule, the micro-batch size, the order and the split differ, then which: the
        schedule's changes first, the split's last."""
        changed = ((a.schedule, a.chunks) != (b.schedule, b.chunks), a.micro_batch_size != b.micro_batch_size,
                   a.order != b.order, (a.first, a.last, a.accounted) != (b.first, b.last, b.accounted))
        return sum(changed), tuple(not flag for flag in changed)

    for index, start in enumerate(starts):
        if not start.fits:
            continue
        current = start
        for step in range(1, max_steps + 1):
            launch = current.launch
            if every_order:
                orders = [tuple(o) for o in space.orders()]
            elif space.devices is not None:
                orders = []
                for i, j in itertools.combinations(range(len(launch.order)), 2):
                    order = list(launch.order)
                    order[i], order[j] = order[j], order[i]
                    orders.append(space.canonical(order))  # a swap of two devices of one kind changes nothing
                orders = list(dict.fromkeys(orders))
            else:
                orders = []
            neighbours = [replace(launch, order=order) for order in orders]
            neighbours += [Launch(launch.order, first, last, schedule, chunks, size, accounted)
                           for size, first, last, schedule, chunks, accounted in shapes]
            # each once, the launch itself not its own neighbour (its order and its shape are among the candidates)
            neighbours = [n for n in dict.fromkeys(neighbours) if n != launch]
            # nearest first (one change: the schedule, the micro-batch size, the order, the split; then two, ...):
            # what a budget leaves unpriced is the farthest
            neighbours.sort(key=lambda n: nearness(n, launch))
            better = current
            already = 0  # neighbours scanned that were priced before (the study's, an earlier step's)
            for scanned, neighbour in enumerate(neighbours):
                if known(neighbour):
                    already += 1
                else:
                    if spent >= budget:
                        return steps, AscentStop(index, step, scanned, len(neighbours), already)
                    spent += 1
                    progress.update(done + spent, done + budget)
                outcome = score(neighbour)
                if outcome is not None and outcome.fits and outcome.samples_per_s > better.samples_per_s:
                    better = outcome
            if better is current:
                break
            current = better
            steps += 1
    return steps, None


@dataclass(frozen=True)
class AscentStop:
    """Where the coordinate ascent's budget ran out: scanning the neighbours of step `step` (1: the start's own
    neighbourhood) from start `start` (an index of the starts), `scanned` of its `neighbours` looked at, `known` of
    them priced before (the rest priced new, against the budget)."""

    start: int
    step: int
    scanned: int
    neighbours: int
    known: int = 0


# The coordinate ascent after a study prices at most this many simulated tasks' worth of launches, counted at the
# job's own launch's size: a 512-GPU launch of 192 microbatches on 8 stages (3072 tasks, about 60 ms to price) gets
# 651 launches, a 6-stage cluster run's thousands (about 1 ms each).
ASCENT_TASKS = 2_000_000


def _tasks(spec: Spec) -> int:
    """The compute tasks of one iteration of `spec` (a forward and a backward per microbatch, stage and chunk)."""
    return 2 * spec.microbatches * spec.pp * spec.vp


def ascent_budget(spec: Spec, trials: int, tasks: int = ASCENT_TASKS) -> int:
    """The launches the coordinate ascent may price on the job of `spec` (its own launch): `tasks` simulated tasks'
    worth at its size, and at least `trials`."""
    return max(trials, tasks // max(_tasks(spec), 1))


ALL_ORDERS = 5040  # up to 7 stages, a step of local search tries every order


# --- against reality: the planner's ranking of configurations that really ran ------------------------------------

@dataclass(frozen=True)
class GroupAgreement:
    """Runs of one model, global batch and set of devices that differ only in what the planner searches; per
    configuration (repeats pooled) the predicted and the mean measured samples per second."""

    key: str
    configurations: tuple[tuple[str, float, float], ...]  # (run ids, predicted, measured)
    agreeing: int
    pairs: int


def pairwise_agreement(configurations: Sequence[tuple[str, float, float]]) -> tuple[int, int]:
    """Pairs of configurations the prediction orders as the measurement does, and pairs compared."""
    agree = pairs = 0
    for (_, p1, m1), (_, p2, m2) in itertools.combinations(configurations, 2):
        pairs += 1
        agree += (p1 - p2) * (m1 - m2) > 0
    return agree, pairs


def train_group_agreement(store: Any, runs_dir: Path, model: Model, cluster: Cluster | None = None
                          ) -> list[GroupAgreement]:
    """For every group of the store's train runs with the same devices, model and global batch and more than one
    configuration of what the planner searches (stage order, layer split, schedule, micro-batch size): each
    configuration as the planner prices it (from the run's job directory in `runs_dir`, its own launch) against
    its measured throughput."""
    from collections import defaultdict

    groups: dict[tuple, dict[Launch, list[tuple[str, float, float]]]] = defaultdict(lambda: defaultdict(list))
    for fixture_id in store.ids("train"):
        fixture = store.load(fixture_id)
        job = runs_dir / fixture_id
        if not job.is_dir():
            continue
        spec, shape = fixture.spec, fixture.spec.model
        key = (tuple(sorted(spec.device_ids)), shape.num_layers, shape.hidden_size, shape.ffn_hidden_size,
               shape.num_attention_heads, shape.seq_length, shape.vocab_size, shape.global_batch_size,
               shape.precision)
        planner = JobPlanner(job, model, cluster)
        launch = planner.current()
        predicted = planner.evaluate(launch).samples_per_s
        measured = fixture.truth.metrics.throughput_per_s * shape.micro_batch_size
        groups[key][launch].append((fixture_id, predicted, measured))
    out = []
    for key, by_launch in groups.items():
        if len(by_launch) < 2:
            continue
        configurations = tuple((" + ".join(r[0] for r in runs), float(np.mean([r[1] for r in runs])),
                                float(np.mean([r[2] for r in runs]))) for runs in by_launch.values())
        agree, pairs = pairwise_agreement(configurations)
        label = (f"{len(key[0])} GPUs ({', '.join(key[0])}), {key[1]} layers, hidden {key[2]}, seq {key[5]}, "
                 f"global batch {key[7]}")
        out.append(GroupAgreement(label, configurations, agree, pairs))
    return out
