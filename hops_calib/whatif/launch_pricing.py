"""The launch search's pricing: `JobPlanner` turns a `Launch` of one job into the launch's arguments and a spec,
simulates it with the calibrated model, checks it against each device's memory and says what changes in the
launch (`Outcome`); a launch that cannot run or be priced is a `Refusal`. See `hops_calib.whatif.job_plan`.

The names live by concept: `launch_outcome` (`Outcome`, `Refusal`), `launch_arguments` (a launch as Megatron-LM
arguments and the changes to the job's launch), `launch_bounds` (the closed-form bounds before simulating) and this
module (the job, its space of launches and the simulated price), which gathers them under one name."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import product
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.model import Model
from hops_calib.model.memory import (  # the headroom left out of each GPU's memory lives with the count
    CUDA_CONTEXT_BYTES,
    DEFAULT_HEADROOM_BYTES,
    NCCL_BUFFER_BYTES,
    default_headroom_bytes,
    stage_memory,
)
from hops_calib.model.terms.embedding import transport_note
from hops_calib.model.terms.roofline import linear_gemm_precision
from hops_calib.sim import simulate
from hops_calib.sim.simulate import auto_schedule
from hops_calib.sim.theory import pipeline_schedule_bubble
from hops_calib.spec import Spec, expert_data_parallel_size, fsdp_strategy
from hops_calib.spec.assumptions import UNMODELLED
from hops_calib.whatif.cluster import Cluster
from hops_calib.whatif.launch_arguments import NO_MEGATRON_FLAG, LaunchArguments, levers_of
from hops_calib.whatif.launch_bounds import LaunchBounds
from hops_calib.whatif.launch_outcome import MAX_TASKS, Outcome, Refusal, _step_samples, _tasks_of
from hops_calib.whatif.launch_space import (
    PLACED,
    SCHEDULES,
    Launch,
    Levers,
    Space,
    divisors,
    layer_splits,
)
from hops_calib.whatif.link_book import LinkBook
from hops_calib.whatif.perturbations import Perturbations

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "DEFAULT_HEADROOM_BYTES",
    "MAX_TASKS",
    "NCCL_BUFFER_BYTES",
    "NO_MEGATRON_FLAG",
    "JobPlanner",
    "Outcome",
    "Refusal",
    "default_headroom_bytes",
]


def refusal_text(error: Exception) -> str:
    """Why a launch is left out, saying whose rule it is: what the model does not price (a `spec.ASSUMPTIONS`
    refusal, `spec.assumptions.UNMODELLED`) is not something Megatron refuses; a rule Megatron's own checks hold
    names the flag it is about."""
    problem = str(getattr(error, "problem", None) or error)
    field = getattr(error, "field", None)
    if problem.startswith(UNMODELLED):  # `spec.require_modelled`'s refusal
        return f"the model does not price the launch: {problem}"
    where = f"{field}: " if field and str(field) not in problem else ""
    return f"Megatron refuses the launch: {where}{problem}"


class JobPlanner(LaunchArguments, LaunchBounds):
    """Prices launches of one job's model and global batch on its devices (see the module's docstring)."""

    def __init__(
        self,
        job_dir: Path | str,
        model: Model,
        cluster: Cluster | None = None,
        memory_bytes: dict[str, float] | None = None,
        headroom_bytes: float | None = None,
    ):
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
                raise InputError(
                    str(self.job_dir),
                    f"runs device type {device_type!r}, which model {model.name!r} does not know",
                    field="hardware.devices",
                    hint="add it to hops_calib/model/devices.toml or the model file's [devices]",
                ) from None
        self._cache: dict[Launch, Outcome | Refusal] = {}
        self._priced: dict[Launch, tuple[Spec, Any] | Refusal] = {}
        self._specs: dict[Launch, Spec | Refusal] = {}
        self.band = 0.0  # the relative uncertainty each Outcome carries (plan_job sets the model's train MAPE)
        # each GPU's memory: the catalog's, or what the user gives per device type (headroom for the CUDA context)
        capacity = {t: (memory_bytes or {}).get(t, model.device(t).memory_bytes) for t in set(self.types.values())}
        # less the headroom for the CUDA context and NCCL's buffers (`default_headroom_bytes`, or --memory-headroom)
        self.headroom_bytes = {
            t: default_headroom_bytes(t) if headroom_bytes is None else headroom_bytes for t in capacity
        }
        self.capacity_bytes = capacity
        self.memory_bytes = {t: capacity[t] - self.headroom_bytes[t] for t in capacity}
        unknown = sorted(set(memory_bytes or {}) - set(self.types.values()))
        if unknown:
            raise InputError(
                "plan",
                f"device type {unknown[0]!r} runs no stage of {self.job_dir}",
                field="--device-memory",
                hint=f"the job's devices are {sorted(set(self.types.values()))}",
            )

    # --- the job's own launch -----------------------------------------------------------------------------------
    # (what its arguments say it is: `LaunchArguments.current`, `own_levers`)

    def relayout(self) -> str:
        """ "" when the job's tensor and pipeline parallel sizes may change (its ranks placed as torchrun places
        them, priced from that placement), else why they stay."""
        if len(set(self.types.values())) != 1:
            return "its stages run on several device types"
        hosts = {self.book.device_hosts.get(device, "") for device in self.spec.device_ids}
        if (self.spec.links or self.cluster is not None) and not (len(hosts) == 1 and "" not in hosts):
            # on one host every hop of any layout runs between the same pair of hosts, the one the benchmark prices
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
            if (
                (self.types[a], self.nodes[a] if self.spec.nodes else "")
                != (self.types[b], self.nodes[b] if self.spec.nodes else "")
                or a in distinct
                or b in distinct
            ):
                return False
            return links(a, b) == links(b, a) and all(
                links(a, c) == links(b, c) and links(c, a) == links(c, b) for c in ids if c not in (a, b)
            )

        kind = list(range(len(ids)))
        for j, b in enumerate(ids):
            kind[j] = next((kind[i] for i, a in enumerate(ids[:j]) if swappable(a, b)), j)
        return tuple(kind)

    def space(
        self,
        schedules: Sequence[str] = SCHEDULES,
        orders: bool = True,
        splits: bool = True,
        micro_batch_sizes: bool = True,
        distinct: Sequence[str] = (),
    ) -> Space:
        """The launches to search; devices named in `distinct` (slowed by a perturbation) are of a kind of their
        own."""
        spec = self.spec
        current = self.current()
        return Space(
            devices=tuple(spec.device_ids) if orders else None,
            current_order=current.order,
            kinds=self.kinds(distinct) if orders else (),
            splits=tuple(layer_splits(spec.model.num_layers, spec.pp)) if splits else ((current.first, current.last),),
            sizes=tuple(divisors(spec.model.global_batch_size)) if micro_batch_sizes else (current.micro_batch_size,),
            schedules=tuple(schedules),
            layers=spec.model.num_layers,
            pp=spec.pp,
            batch=spec.model.global_batch_size,
            accounting=splits,
        )

    def family_space(
        self, levers: Levers, schedules: Sequence[str], splits: bool, micro_batch_sizes: bool
    ) -> Space | None:
        """The launches of one setting of the levers: its layer splits and micro-batch sizes (those dividing the
        batch of a replica), the schedules, at the job's own stage order when t, p and cp are the job's, else with
        ranks placed as torchrun places them. None when no micro-batch size divides the batch."""
        spec, own = self.spec, self.own_levers()
        gpus, layers = spec.gpus, spec.model.num_layers
        if gpus % (levers.tp * levers.pp * levers.cp):
            return None
        dp = gpus // (levers.tp * levers.pp * levers.cp)
        batch = spec.model.global_batch_size
        if batch % dp:
            return None
        current = self.current()
        placed = levers.layout != own.layout
        order = self.placed_order(levers.pp) if placed else current.order
        sizes = (
            tuple(divisors(batch // dp))
            if micro_batch_sizes
            else (current.micro_batch_size,)
            if (batch // dp) % current.micro_batch_size == 0
            else ()
        )
        if not sizes:
            return None
        return Space(
            devices=None,
            current_order=order,
            splits=tuple(layer_splits(layers, levers.pp)) if splits else ((None, None),),
            sizes=sizes,
            schedules=tuple(schedules),
            layers=layers,
            pp=levers.pp,
            batch=batch // dp,
            accounting=splits,
            levers=levers,
        )

    def context_parallel_sizes(self) -> list[int]:
        """The --context-parallel-size values Megatron runs on the job's model (`CONTEXT_PARALLEL_SIZES`): the
        sequence cut into 2 cp chunks (megatron/core/utils.py `get_batch_on_this_cp_rank`: s divisible by 2 cp), on
        TE's flash/fused attention (the only attention with a cp group, `spec.arguments`), and with --cp-comm-type
        a2a the heads of a tensor-parallel rank split over cp (TE's `AttnFuncWithCPAndQKVOA2A`); the job's own
        first."""
        from hops_calib.whatif.launch_space import CONTEXT_PARALLEL_SIZES

        shape, own = self.spec.model, self.spec.cp
        a2a = "a2a" in str(self.args.get("cp_comm_type") or "")
        found = [own]
        for cp in CONTEXT_PARALLEL_SIZES:
            if cp == own or self.spec.gpus % cp:
                continue
            if cp > 1 and (shape.seq_length % (2 * cp) or shape.attention_kernel != "flash"):
                continue
            if cp > 1 and a2a and shape.num_attention_heads % cp:
                continue
            found.append(cp)
        return found

    def fp8_refusal(self) -> str:
        """ "" where the job's launch can turn Transformer Engine's FP8 on, else why not: every device type's
        catalog entry has a dense FP8 peak (`peak_fp8_flops_per_s`, hops_calib/model/devices.toml), the layer is
        TE's (--transformer-impl transformer_engine: the local layer has no FP8 path), the weights are 16-bit
        (TE runs FP8 GEMMs under bf16 or fp16 autocast) and the MLP is dense (FP8 experts, TE's grouped FP8 GEMMs
        on padded token counts, are not priced: `spec.ASSUMPTIONS` --num-experts)."""
        without = sorted({t for t in self.types.values() if not self.model.device(t).peak_fp8_flops_per_s})
        if without:
            return f"device type {', '.join(without)} has no FP8 peak in the catalog (no FP8 tensor cores)"
        if str(self.args.get("transformer_impl", "transformer_engine")) != "transformer_engine":
            return "--transformer-impl local has no FP8 path (Transformer Engine's layer runs FP8)"
        if self.spec.model.precision not in ("bf16", "fp16"):
            return f"the launch runs {self.spec.model.precision} weights (FP8 GEMMs run under --bf16 or --fp16)"
        if self.spec.model.moe:
            return "its MLP is a mixture of experts (FP8 experts are not priced)"
        return ""

    def expert_layouts(self, tp: int, pp: int, cp: int) -> list[tuple[int | None, int | None]]:
        """The (ep, etp) Megatron lays a mixture of experts out in at t x p x cp, the job's own first where it is
        one: ep a divisor of the experts (megatron/core/transformer/moe/moe_layer.py `MoELayer.__init__` asserts
        num_experts % ep == 0), etp t (Megatron's default) or 1, the world divisible by etp x ep x p
        (megatron/core/parallel_state.py `initialize_model_parallel`; edp = world / (etp x ep x p)), the expert
        FFN divisible by etp, etp 1 under the linear layers' biases (transformer_config.py
        `TransformerConfig.__post_init__`: "Bias in Moe is only supported when ETP==1") and, under a rank order
        not ending in pp at p > 1, edp equal to the attention's d x cp (`initialize_model_parallel`'s assertion).
        [(None, None)] for a dense MLP. `spec.arguments.moe_settings_of` refuses whatever else Megatron does."""
        spec, own = self.spec, self.own_levers()
        shape = spec.model
        if not shape.moe or shape.num_experts is None:
            return [(None, None)]
        world = spec.gpus
        bias = not bool(self.args.get("disable_bias_linear")) and self.args.get("add_bias_linear", True) is not False
        found = [own.experts] if (tp, pp, cp) == own.layout else []
        for ep in divisors(shape.num_experts):
            for etp in dict.fromkeys((tp, 1)):
                if world % (etp * ep * pp) or shape.expert_ffn % etp or (bias and etp > 1):
                    continue
                if (
                    pp > 1
                    and not spec.rank_order.endswith("pp")
                    and expert_data_parallel_size(world, etp, ep, pp) != world // (tp * pp * cp)
                ):
                    continue
                if (ep, etp) not in found:
                    found.append((ep, etp))
        return found

    def families(self, precisions: Sequence[bool] | None = None, levers: bool = True) -> list[Levers]:
        """Every setting of the levers Megatron takes for the job's model on its GPUs, the job's own first: t
        dividing the heads (and the query groups) and the GPUs, at most a node's GPUs (tensor parallelism stays on
        NVLink); cp of `context_parallel_sizes`; p dividing the layers (or the layers with the embedding and/or the
        loss counted as one, which Megatron splits with --account-for-*-in-pipeline-split) and the GPUs over t x cp
        (`relayout`: else the job's t, p and cp); each recomputation (`recompute_options`); sequence parallelism on
        and off at t > 1 (on only under experts: megatron-core's MoELayer.forward refuses tensor parallelism without
        it); the distributed optimizer on and off at d x cp > 1 (it shards over the data- and context-parallel
        ranks) or, under experts, an expert data-parallel size above 1 (it shards the experts' state over those);
        FP8 on or off as `precisions` allow (default: the job's own); under a mixture of experts each (ep, etp) of
        `expert_layouts`. Without `levers`, only the job's own setting in each precision allowed. What Megatron
        refuses besides is refused when priced."""
        from hops_calib.whatif.launch_space import recompute_options

        spec, own = self.spec, self.own_levers()
        shape = spec.model
        precisions = list(dict.fromkeys(precisions if precisions is not None else (own.fp8,)))
        if not levers:
            return [own, *(replace(own, fp8=fp8) for fp8 in precisions if fp8 != own.fp8)]
        layouts = [own.layout]
        if not self.relayout():
            per_node = spec.gpus_per_node or spec.gpus
            groups = shape.num_query_groups or shape.num_attention_heads
            depths = sorted(
                {*divisors(shape.num_layers), *divisors(shape.num_layers + 1), *divisors(shape.num_layers + 2)}
            )
            layouts += [
                (t, p, cp)
                for t in divisors(min(spec.gpus, per_node))
                if not (shape.num_attention_heads % t or groups % t or spec.gpus % t)
                for cp in self.context_parallel_sizes()
                if spec.gpus % (t * cp) == 0
                for p in depths
                if p <= shape.num_layers and (spec.gpus // (t * cp)) % p == 0 and (t, p, cp) != layouts[0]
            ]
        found: list[Levers] = [own]
        fsdp = fsdp_strategy(spec.megatron_args)
        for t, p, cp in layouts:
            recomputes = list(dict.fromkeys([*recompute_options(max(shape.num_layers // p, 1)), own.recompute]))
            for ep, etp in self.expert_layouts(t, p, cp):
                # d x cp, and the experts' data-parallel size: what the distributed optimizer shards over
                replicas = max(
                    spec.gpus // (t * p), expert_data_parallel_size(spec.gpus, etp, ep, p) if ep and etp else 1
                )
                sps = (True,) if t > 1 and shape.moe else (False, True) if t > 1 else (False,)
                # under Megatron-FSDP its sharding strategy, not --use-distributed-optimizer, shards the optimizer
                # state (`spec_from_args`): the lever is left as the launch has it
                dists = (False, True) if replicas > 1 and not fsdp else (own.distributed_optimizer,)
                for fp8, recompute, sp, dist in product(precisions, recomputes, sps, dists):
                    setting = Levers(t, p, recompute, sp, dist, cp, fp8, ep, etp)
                    if setting != own:
                        found.append(setting)
        return found

    # --- one candidate ------------------------------------------------------------------------------------------

    def candidate_spec(self, launch: Launch) -> Spec:
        from hops_calib.spec import Hardware, spec_from_args
        from hops_calib.trace import TraceError

        if launch.levers_placed:
            return self._placed_spec(launch)
        hops = self.book.hops(launch.order)
        hardware = Hardware(
            devices=tuple(self.types[d] for d in launch.order),
            device_ids=launch.order,
            device_names=tuple(self.names[d] for d in launch.order) if any(self.names.values()) else (),
            nodes=tuple(self.nodes[d] for d in launch.order),
            source=self.job_dir,
        )
        try:
            spec = spec_from_args(
                self.launch_args(launch),
                self.args_source,
                run_id=self.spec.run_id,
                hardware=hardware,
                links=tuple(h.link for h in hops if h.link),
                collectives=self.spec.collectives,
                iterations=self.spec.iterations,
                ranks_per_device=self.spec.ranks_per_device,
            )
        except (TraceError, ValueError) as error:
            raise Refusal(refusal_text(error)) from None
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
            raise Refusal(
                f"no link for host pair {missing[0].src_host or '?'} -> {missing[0].dst_host or '?'} "
                f"({missing[0].src_device} -> {missing[0].dst_device})"
            )
        return spec

    def _placed_spec(self, launch: Launch) -> Spec:
        """The spec of a launch of a layout of its own: one GPU type, ranks on nodes as torchrun places them, hops
        and collectives priced from that placement (the node's collective tables where the job has them)."""
        from hops_calib.spec import Hardware, spec_from_args
        from hops_calib.trace import TraceError

        own = self.spec
        hardware = Hardware(gpu=next(iter(self.types.values())), gpus_per_node=own.gpus_per_node or own.gpus)
        try:
            spec = spec_from_args(
                self.launch_args(launch),
                self.args_source,
                run_id=own.run_id,
                hardware=hardware,
                collectives=own.collectives,
                iterations=own.iterations,
            )
        except (TraceError, ValueError) as error:
            raise Refusal(refusal_text(error)) from None
        return replace(spec, transport=own.transport)

    def placed_order(self, pp: int) -> tuple[str, ...]:
        """The stage "devices" of a launch whose ranks torchrun places (`Launch.levers_placed`)."""
        return tuple(f"{PLACED}{k}" for k in range(pp))

    def spec_of(self, launch: Launch) -> Spec:
        key = replace(launch, schedule="")
        found = self._specs.get(key)
        if found is None:
            try:
                found = self.candidate_spec(launch)
                if _tasks_of(found) > MAX_TASKS:
                    found = Refusal(
                        f"more than {MAX_TASKS} tasks per iteration to simulate; a larger micro-batch size has fewer"
                    )
            except Refusal as refusal:
                found = refusal
            self._specs[key] = found
        if isinstance(found, Refusal):
            raise found
        return found

    # --- the simulation -----------------------------------------------------------------------------------------

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
            launch=launch,
            resolved=resolved,
            microbatches=spec.microbatches,
            layers_per_stage=spec.layers_per_stage,
            samples_per_s=metrics.throughput_per_s * size,
            steady_samples_per_s=metrics.steady_throughput_per_s * size,
            iteration_ms=metrics.iteration_time_ms,
            idle_share=metrics.bubble_ratio,
            schedule_bubble=pipeline_schedule_bubble(pipeline, resolved),
            peak_memory_bytes=peaks,
            memory_bytes=caps,
            **self.flags(launch),
            stage_map={} if launch.levers_placed else {str(k): d for k, d in enumerate(launch.order)},
            settings=levers_of(spec, spec.megatron_args),
            precision=linear_gemm_precision(spec),
            dp=spec.dp,
            edp=spec.edp if spec.model.moe else None,
            band=self.band,
        )

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
        return replace(
            outcome,
            expected_samples_per_s=estimate.expected,
            p5_samples_per_s=estimate.p5,
            expected_ci95=(estimate.low, estimate.high),
        )
