"""The launch search's pricing: `JobPlanner` turns a `Launch` of one job into the launch's arguments and a spec,
simulates it with the calibrated model, checks it against each device's memory and says what changes in the
launch (`Outcome`); a launch that cannot run or be priced is a `Refusal`. See `hops_calib.whatif.job_plan`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.model import Model
from hops_calib.model.memory import stage_memory
from hops_calib.model.terms.embedding import transport_note
from hops_calib.sim import simulate
from hops_calib.sim.simulate import auto_schedule
from hops_calib.sim.theory import pipeline_schedule_bubble
from hops_calib.spec import Spec
from hops_calib.whatif.cluster import Cluster, LinkBook
from hops_calib.whatif.launch_space import (
    ACCOUNTING_FLAGS,
    PLACED,
    SCHEDULES,
    Launch,
    Levers,
    Space,
    divisors,
    layer_splits,
)
from hops_calib.whatif.perturbations import Perturbations

NO_MEGATRON_FLAG = ("has no Megatron-LM flag (Megatron runs 1F1B, or interleaved 1F1B with virtual stages): run it "
                    "with a runtime that has it, e.g. torch.distributed.pipelining (`hops-calib capture --engine "
                    "torch --schedule {schedule}` records one)")


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
    settings: Levers | None = None  # t, p, recomputation, SP, distributed optimizer as simulated
    dp: int = 1  # data-parallel replicas
    band: float = 0.0  # the relative uncertainty of samples_per_s (the model's train MAPE; 0: not given)

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
            **({"tp": self.settings.tp, "pp": self.settings.pp, "dp": self.dp,
                "recompute": self.settings.recompute_label(),
                "recompute_granularity": self.settings.recompute[0], "recompute_method": self.settings.recompute[1],
                "recompute_num_layers": self.settings.recompute[2],
                "sequence_parallel": self.settings.sequence_parallel,
                "distributed_optimizer": self.settings.distributed_optimizer,
                "megatron_runnable": self.resolved in ("1f1b", "interleaved_1f1b")}
               if self.settings is not None else {}),
            "throughput_band_samples_per_s": ([self.samples_per_s * (1 - self.band), self.samples_per_s * (1 + self.band)]
                                              if self.band else None),
        }


# Memory a GPU holds besides what `model.memory` counts, left out of every pick by default:
# - the CUDA context: about 0.5 GB with lazy module loading (CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2
#   and in PyTorch 2.x wheels), up to about 1 GB with every kernel module loaded eagerly (NVIDIA, CUDA C++
#   Programming Guide, "Lazy Loading"); 1 GB is taken;
# - NCCL's buffers: NCCL_BUFFSIZE, 4 MiB by default (NCCL docs, Environment Variables: NCCL_BUFFSIZE "4194304"),
#   for each peer of each channel of each communicator; a rank of a Megatron launch keeps a tensor-, a data-, a
#   pipeline-parallel and an embedding communicator, each of up to 16 channels with 2 peers (a ring's previous and
#   next rank): 4 x 16 x 2 x 4 MiB = 0.54 GB;
# 1.5 GB in all (1.0 + 0.54, rounded down: the channels NCCL opens are fewer on small groups). A CPU device runs
# no CUDA context and gloo keeps no such buffers: nothing.
CUDA_CONTEXT_BYTES = 1.0e9
NCCL_BUFFER_BYTES = 4 * 16 * 2 * 4 * 2 ** 20
DEFAULT_HEADROOM_BYTES = 1.5e9


def default_headroom_bytes(device_type: str) -> float:
    """The memory left out of a GPU of `device_type` for what the count leaves out (see DEFAULT_HEADROOM_BYTES)."""
    return 0.0 if device_type.startswith("cpu") else DEFAULT_HEADROOM_BYTES


class Refusal(Exception):
    """A candidate that cannot run (Megatron refuses the launch, a schedule cannot run the shape) or cannot be
    priced (a hop with no link); the reason is counted."""


# A launch with more compute tasks per iteration than this is not simulated (a microbatch count in the millions would
# take minutes per candidate): the planner counts it as refused and says to raise the micro-batch size.
MAX_TASKS = 200_000


def _tasks_of(spec: Spec) -> int:
    """The compute tasks of one iteration of `spec` (a forward and a backward per microbatch and virtual stage)."""
    return 2 * spec.microbatches * spec.pp * spec.vp


def _step_samples(launch: Launch, spec: Spec) -> int:
    """Samples per microbatch step of the pipeline, every data-parallel replica's: what turns its throughput
    (microbatches per second) into the job's samples per second, nominal or under perturbations alike."""
    return launch.micro_batch_size * spec.dp


class JobPlanner:
    """Prices launches of one job's model and global batch on its devices (see the module's docstring)."""

    def __init__(self, job_dir: Path | str, model: Model, cluster: Cluster | None = None,
                 memory_bytes: dict[str, float] | None = None, headroom_bytes: float | None = None):
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
        self._specs: dict[Launch, Spec | Refusal] = {}
        self.band = 0.0  # the relative uncertainty each Outcome carries (plan_job sets the model's train MAPE)
        # each GPU's memory: the catalog's, or what the user gives per device type (headroom for the CUDA context)
        capacity = {t: (memory_bytes or {}).get(t, model.device(t).memory_bytes) for t in set(self.types.values())}
        # less the headroom for the CUDA context and NCCL's buffers (`default_headroom_bytes`, or --memory-headroom)
        self.headroom_bytes = {t: default_headroom_bytes(t) if headroom_bytes is None else headroom_bytes
                               for t in capacity}
        self.capacity_bytes = capacity
        self.memory_bytes = {t: capacity[t] - self.headroom_bytes[t] for t in capacity}
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

    def own_levers(self) -> Levers:
        shape = self.spec.model
        return Levers(self.spec.tp, self.spec.pp, (shape.recompute_granularity, shape.recompute_method,
                                                   shape.recompute_num_layers),
                      bool(shape.sequence_parallel), bool(self.spec.distributed_optimizer))

    def relayout(self) -> str:
        """"" when the job's tensor and pipeline parallel sizes may change (its ranks placed as torchrun places
        them, priced from that placement), else why they stay."""
        if len(set(self.types.values())) != 1:
            return "its stages run on several device types"
        if self.spec.links or self.cluster is not None:
            return "its hops are priced from a link benchmark by device (a layout moves ranks between devices)"
        if self.spec.cores or self.spec.ranks_per_device != 1:
            return "its ranks share the capture's cores as launched"
        return ""

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

    def family_space(self, levers: Levers, schedules: Sequence[str], splits: bool, micro_batch_sizes: bool
                     ) -> Space | None:
        """The launches of one setting of the levers: its layer splits and micro-batch sizes (those dividing the
        batch of a replica), the schedules, at the job's own stage order when t and p are the job's, else with
        ranks placed as torchrun places them. None when no micro-batch size divides the batch."""
        spec, own = self.spec, self.own_levers()
        gpus, layers = spec.gpus, spec.model.num_layers
        if gpus % (levers.tp * levers.pp):
            return None
        dp = gpus // (levers.tp * levers.pp)
        batch = spec.model.global_batch_size
        if batch % dp:
            return None
        current = self.current()
        placed = (levers.tp, levers.pp) != (own.tp, own.pp)
        order = self.placed_order(levers.pp) if placed else current.order
        sizes = (tuple(divisors(batch // dp)) if micro_batch_sizes else
                 (current.micro_batch_size,) if (batch // dp) % current.micro_batch_size == 0 else ())
        if not sizes:
            return None
        return Space(devices=None, current_order=order,
                     splits=tuple(layer_splits(layers, levers.pp)) if splits else ((None, None),),
                     sizes=sizes, schedules=tuple(schedules), layers=layers, pp=levers.pp, batch=batch // dp,
                     accounting=splits, levers=levers)

    def families(self) -> list[Levers]:
        """Every setting of the levers Megatron takes for the job's model on its GPUs, the job's own first: t
        dividing the heads (and the query groups) and the GPUs, at most a node's GPUs (tensor parallelism stays on
        NVLink); p dividing the layers and the GPUs over t (`relayout`: else the job's t and p); each
        recomputation (`recompute_options`); sequence parallelism on and off at t > 1; the distributed optimizer on
        and off at d > 1. What Megatron refuses besides is refused when priced."""
        from hops_calib.whatif.launch_space import recompute_options

        spec, own = self.spec, self.own_levers()
        shape = spec.model
        layouts = [(own.tp, own.pp)]
        if not self.relayout():
            per_node = spec.gpus_per_node or spec.gpus
            groups = shape.num_query_groups or shape.num_attention_heads
            layouts += [(t, p) for t in divisors(min(spec.gpus, per_node))
                        if not (shape.num_attention_heads % t or groups % t or spec.gpus % t)
                        for p in divisors(shape.num_layers) if (spec.gpus // t) % p == 0 and (t, p) != layouts[0]]
        found: list[Levers] = [own]
        for t, p in layouts:
            dp = spec.gpus // (t * p)
            recomputes = list(dict.fromkeys([*recompute_options(shape.num_layers // p), own.recompute]))
            for recompute in recomputes:
                for sp in ((False, True) if t > 1 else (False,)):
                    for dist in ((False, True) if dp > 1 else (own.distributed_optimizer,)):
                        levers = Levers(t, p, recompute, sp, dist)
                        if levers != own:
                            found.append(levers)
        return found

    # --- one candidate ------------------------------------------------------------------------------------------

    def launch_args(self, launch: Launch) -> dict[str, Any]:
        args = dict(self.args)
        args["micro_batch_size"] = launch.micro_batch_size
        levers = launch.levers
        if levers is not None:
            args.update(tensor_model_parallel_size=levers.tp, pipeline_model_parallel_size=levers.pp,
                        world_size=self.spec.gpus, sequence_parallel=levers.sequence_parallel,
                        use_distributed_optimizer=levers.distributed_optimizer)
            for key in ("data_parallel_size", "recompute_granularity", "recompute_method", "recompute_num_layers",
                        "recompute_activations", "checkpoint_activations", "checkpoint_num_layers", "zero_stage"):
                args.pop(key, None)  # what followed from the old layout, and the older spellings of the levers
            granularity, method, number = levers.recompute
            if granularity is not None:
                args["recompute_granularity"] = granularity
            if method is not None:
                args.update(recompute_method=method, recompute_num_layers=number)
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
        pp = len(launch.order)
        return (self.spec.model.num_layers + sum(launch.accounted)) // (pp * launch.chunks)

    def _lever_changes(self, launch: Launch, argv: list[str], remove: list[str], words: list[str]) -> None:
        """The flags that set `launch.levers` where they differ from the job's own."""
        if launch.levers is None:
            return
        now, new = self.own_levers(), launch.levers
        for flag, old, value in (("--tensor-model-parallel-size", now.tp, new.tp),
                                 ("--pipeline-model-parallel-size", now.pp, new.pp)):
            if value != old:
                argv += [flag, str(value)]
                words.append(f"{flag} {value}")
        if new.recompute != now.recompute:
            granularity, method, number = new.recompute
            remove += [f for f, v in zip(("--recompute-granularity", "--recompute-method", "--recompute-num-layers"),
                                         now.recompute) if v is not None and (granularity is None or f !=
                                                                              "--recompute-granularity")]
            if granularity is None:
                words.append("remove --recompute-granularity (and --recompute-method, --recompute-num-layers): "
                             "no recomputation")
            else:
                tokens = ["--recompute-granularity", granularity] + (
                    ["--recompute-method", method, "--recompute-num-layers", str(number)] if method else [])
                argv += tokens
                words.append(" ".join(tokens))
        for flag, old, value in (("--sequence-parallel", now.sequence_parallel, new.sequence_parallel),
                                 ("--use-distributed-optimizer", now.distributed_optimizer, new.distributed_optimizer)):
            if value != old:
                (argv.append if value else remove.append)(flag)
                words.append(flag if value else f"remove {flag}")

    def changes(self, launch: Launch) -> dict[str, tuple[str, ...]]:
        """The changes to the job's launch that run `launch`: `argv` (tokens to add or set), `remove` (flags to
        take out), `notes` (what no flag says), and `words` (each change in one line, for text)."""
        now = self.current()
        argv: list[str] = []
        remove: list[str] = []
        notes: list[str] = []
        words: list[str] = []
        self._lever_changes(launch, argv, remove, words)
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
        if launch.order != now.order and not launch.levers_placed:
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

        if launch.levers_placed:
            return self._placed_spec(launch)
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

    def _placed_spec(self, launch: Launch) -> Spec:
        """The spec of a launch of a layout of its own: one GPU type, ranks on nodes as torchrun places them, hops
        and collectives priced from that placement (the node's collective tables where the job has them)."""
        from hops_calib.spec import Hardware, spec_from_args
        from hops_calib.trace import TraceError

        own = self.spec
        hardware = Hardware(gpu=next(iter(self.types.values())), gpus_per_node=own.gpus_per_node or own.gpus)
        try:
            spec = spec_from_args(self.launch_args(launch), self.args_source, run_id=own.run_id, hardware=hardware,
                                  collectives=own.collectives, iterations=own.iterations)
        except (TraceError, ValueError) as error:
            raise Refusal(f"Megatron refuses the launch: {getattr(error, 'problem', None) or error}") from None
        return replace(spec, transport=own.transport)

    def placed_order(self, pp: int) -> tuple[str, ...]:
        """The stage "devices" of a launch whose ranks torchrun places (`Launch.levers_placed`)."""
        return tuple(f"{PLACED}{k}" for k in range(pp))

    # --- closed-form bounds, before simulating -------------------------------------------------------------------

    def memory_fits(self, launch: Launch) -> bool:
        """Whether `launch` fits each GPU's memory (less the headroom) by the schedule's closed form of the
        activations it holds (`sim.theory.peak_activations`, in stage microbatches), without simulating it.
        Refusal when it cannot run or be priced."""
        from hops_calib.sim.theory import peak_activations

        spec = self.spec_of(launch)
        schedule = "1f1b" if launch.schedule == "auto" else launch.schedule
        try:
            peaks = peak_activations(schedule, spec.pp, spec.microbatches, spec.vp)
        except ValueError:
            return True  # no closed form: the simulation says
        caps = tuple(self.memory_bytes[t] for t in spec.devices)
        memory = stage_memory(spec, caps, tuple(p / spec.vp for p in peaks))
        return all(stage.total_bytes <= cap for stage, cap in zip(memory, caps))

    def spec_of(self, launch: Launch) -> Spec:
        key = replace(launch, schedule="")
        found = self._specs.get(key)
        if found is None:
            try:
                found = self.candidate_spec(launch)
                if _tasks_of(found) > MAX_TASKS:
                    found = Refusal(f"more than {MAX_TASKS} tasks per iteration to simulate; a larger micro-batch "
                                    "size has fewer")
            except Refusal as refusal:
                found = refusal
            self._specs[key] = found
        if isinstance(found, Refusal):
            raise found
        return found

    def bound_samples_per_s(self, launch: Launch, tight: bool = False) -> float:
        """An upper bound on `launch`'s simulated samples per second from its priced stage costs: in each
        iteration every rank runs each microbatch's forward and backward of its model chunks, one after another,
        then (`tight`) its gradient reduction's tail or the pre-optimizer work, its optimizer step and the host
        time after it, all within the window the throughput is measured over (from the first task to stage 0's
        last backward of the last iteration, so the last iteration's optimizer falls outside it); and (`tight`,
        with a barrier before the optimizer) rank r starts only after the first microbatch's forwards through the
        ranks before it and its last backward (chunk 0's) still runs back through them (1F1B, GPipe, interleaved
        1F1B). No schedule beats that (`tests/whatif/test_plan_levers.py` checks it on three captures' launches).
        Without `tight`, an interleaved launch at the even split is bounded by its one-chunk launch (its rank runs
        the same layers as v chunks, with more tasks' host time and hops: no less work), which prices in a tenth
        of the time; with full recomputation by blocks (k layers per chunk) not, as the chunks recompute more."""
        spec = None
        if not tight and launch.chunks > 1 and (launch.first, launch.last, launch.accounted) == (
                None, None, (False, False)) and (launch.levers is None or launch.levers.recompute[1] != "block") \
                and self.spec_of(launch).model.recompute_method != "block":
            try:
                spec, pipeline = self.priced(replace(launch, schedule="1f1b", chunks=1))
            except Refusal:
                spec = None
        if spec is None:
            spec, pipeline = self.priced(launch)
        p, v, m, n = spec.pp, spec.vp, spec.microbatches, max(pipeline.iterations, 1)
        stages = pipeline.stages
        work = [sum(stages[c * p + r].forward_ms + stages[c * p + r].backward_ms for c in range(v)) for r in range(p)]
        # under ZB-H1 (or auto) the last iteration's weight gradients may be deferred past the window's end
        deferred = launch.schedule in ("zb_h1", "auto")
        last = [w - (sum(stages[c * p + r].weight_grad_ms for c in range(v)) if deferred else 0.0)
                for r, w in enumerate(work)]
        optimizer = list(pipeline.optimizer_ms) or [0.0] * p
        tails = list(pipeline.grad_reduce_tail_ms) or [0.0] * p
        after = [o + (max(t, pipeline.pre_optimizer_ms) + pipeline.post_ms(r) if tight else 0.0)
                 for r, (o, t) in enumerate(zip(optimizer, tails))]
        window = max((n - 1) * (m * w + a) + m * t for w, a, t in zip(work, after, last))
        if tight and pipeline.optimizer_barrier and launch.schedule in ("1f1b", "gpipe", "interleaved_1f1b"):
            forward = [stage.forward_ms for stage in stages[:p]]  # chunk 0's virtual stages, rank by rank
            backward = [stage.backward_ms for stage in stages[:p]]
            through = max(sum(forward[:r]) + m * work[r] + sum(backward[:r]) for r in range(p))
            window = max(window, (n - 1) * (through + after[0]) + through)
        return n * m * _step_samples(launch, spec) / window * 1e3 if window > 0 else float("inf")

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
                spec = self.spec_of(launch)
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
            memory_bytes=caps, **self.flags(launch),
            stage_map={} if launch.levers_placed else {str(k): d for k, d in enumerate(launch.order)},
            settings=Levers(spec.tp, spec.pp, (spec.model.recompute_granularity, spec.model.recompute_method,
                                               spec.model.recompute_num_layers),
                            bool(spec.model.sequence_parallel), bool(spec.distributed_optimizer)),
            dp=spec.dp, band=self.band)

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
