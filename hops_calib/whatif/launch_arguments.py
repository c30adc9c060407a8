"""A launch as Megatron-LM arguments: the job's own launch read from its arguments, the arguments of a
candidate launch, and the changes to the job's command line that run it (flags to add, set or remove, and what no
flag says). `LaunchArguments` is a part of `launch_pricing.JobPlanner`, which sets the job's `spec`, `args` and link
`book` it reads."""

from __future__ import annotations

from typing import Any

from hops_calib.model.kernel_types import fp8_format
from hops_calib.spec import Spec
from hops_calib.whatif.launch_space import (
    ACCOUNTING_FLAGS,
    Launch,
    Levers,
)
from hops_calib.whatif.link_book import LinkBook

NO_MEGATRON_FLAG = (
    "has no Megatron-LM flag (Megatron runs 1F1B, or interleaved 1F1B with virtual stages): run it "
    "with a runtime that has it, e.g. torch.distributed.pipelining (`hops-calib capture --engine "
    "torch --schedule {schedule}` records one)"
)


# The FP8 a launch that turns it on runs: Transformer Engine's hybrid format (E4M3 forward, E5M2 gradients, as TE
# recommends for training) under Megatron's default recipe, delayed scaling (megatron/training/arguments.py
# --fp8-recipe default 'delayed'; megatron/core/transformer/transformer_config.py `fp8`, `fp8_recipe`).
FP8_FLAGS = ("--fp8-format", "hybrid", "--fp8-recipe", "delayed")
# A launch's FP8 settings (their args. keys and flags), all taken out when a launch turns FP8 off.
FP8_SETTINGS = (
    ("fp8_format", "--fp8-format"),
    ("fp8", "--fp8-format"),
    ("fp8_hybrid", "--fp8-hybrid"),
    ("fp8_e4m3", "--fp8-e4m3"),
    ("fp8_recipe", "--fp8-recipe"),
    ("fp8_param_gather", "--fp8-param-gather"),
    ("fp8_wgrad", "--no-fp8-wgrad"),
    ("no_fp8_wgrad", "--no-fp8-wgrad"),
    ("fp8_margin", "--fp8-margin"),
    ("fp8_interval", "--fp8-interval"),
    ("fp8_amax_history_len", "--fp8-amax-history-len"),
    ("fp8_amax_compute_algo", "--fp8-amax-compute-algo"),
)

# A launch's virtual-stage settings (their args. keys and flags): Megatron-LM's layers per virtual stage, and the
# count of model chunks per rank (megatron-core's ModelParallelConfig.virtual_pipeline_model_parallel_size).
VP_SETTINGS = (
    ("num_layers_per_virtual_pipeline_stage", "--num-layers-per-virtual-pipeline-stage"),
    ("virtual_pipeline_model_parallel_size", "--virtual-pipeline-model-parallel-size"),
)


def expert_levers(spec: Spec) -> tuple[int | None, int | None]:
    """(ep, etp) of a spec's launch: its expert-parallel and expert tensor-parallel sizes, (None, None) for a dense
    MLP (`Levers.ep`, `Levers.etp`)."""
    return (spec.ep, spec.etp) if spec.model.moe else (None, None)


def levers_of(spec: Spec, args: dict[str, Any]) -> Levers:
    """The levers a spec's launch runs with (`args`: its Megatron arguments, which say whether it runs FP8)."""
    shape = spec.model
    return Levers(
        spec.tp,
        spec.pp,
        (shape.recompute_granularity, shape.recompute_method, shape.recompute_num_layers),
        bool(shape.sequence_parallel),
        bool(spec.distributed_optimizer),
        spec.cp,
        runs_fp8(args),
        *expert_levers(spec),
    )


def runs_fp8(args: dict[str, Any]) -> bool:
    """Whether a launch's linear GEMMs run in FP8: --fp8-format (or the older switches) on Transformer Engine's
    layer (megatron-core `fp8_utils.py` `get_fp8_context`; the local layer has no FP8 path)."""
    return bool(fp8_format(args)) and str(args.get("transformer_impl", "transformer_engine")) == "transformer_engine"


class LaunchArguments:
    """The job's launch and a candidate's as Megatron-LM arguments (a part of `JobPlanner`, which sets these)."""

    spec: Spec
    args: dict[str, Any]
    book: LinkBook

    def current(self) -> Launch:
        spec, args = self.spec, self.args
        first = args.get("decoder_first_pipeline_num_layers")
        last = args.get("decoder_last_pipeline_num_layers")
        accounted = (
            bool(args.get("account_for_embedding_in_pipeline_split")),
            bool(args.get("account_for_loss_in_pipeline_split")),
        )
        return Launch(
            tuple(spec.device_ids), first, last, spec.schedule, spec.vp, spec.model.micro_batch_size, accounted
        )

    def own_levers(self) -> Levers:
        return levers_of(self.spec, self.args)

    def implied_etp(self, tp: int) -> int:
        """The expert tensor-parallel size the job's command line gives at tensor-parallel size `tp`: its
        --expert-tensor-parallel-size, else `tp` (megatron/core/model_parallel_config.py
        `ModelParallelConfig.__post_init__`: None takes the tensor-parallel size)."""
        given = self.args.get("expert_tensor_parallel_size")
        return tp if given is None else int(given)

    def launch_args(self, launch: Launch) -> dict[str, Any]:
        args = dict(self.args)
        args["micro_batch_size"] = launch.micro_batch_size
        levers = launch.levers
        if levers is not None:
            args.update(
                tensor_model_parallel_size=levers.tp,
                pipeline_model_parallel_size=levers.pp,
                world_size=self.spec.gpus,
                sequence_parallel=levers.sequence_parallel,
                use_distributed_optimizer=levers.distributed_optimizer,
                context_parallel_size=levers.cp,
            )
            if levers.ep is not None:
                args.update(expert_model_parallel_size=levers.ep, expert_tensor_parallel_size=levers.etp)
            if levers.fp8 != runs_fp8(self.args):
                for key, _ in FP8_SETTINGS:
                    args.pop(key, None)
                if levers.fp8:
                    args.update(fp8_format=FP8_FLAGS[1], fp8_recipe=FP8_FLAGS[3])
            for key in (
                "data_parallel_size",
                "recompute_granularity",
                "recompute_method",
                "recompute_num_layers",
                "recompute_activations",
                "checkpoint_activations",
                "checkpoint_num_layers",
                "zero_stage",
            ):
                args.pop(key, None)  # what followed from the old layout, and the older spellings of the levers
            granularity, method, number = levers.recompute
            if granularity is not None:
                args["recompute_granularity"] = granularity
            if method is not None:
                args.update(recompute_method=method, recompute_num_layers=number)
        for key, value in (
            ("decoder_first_pipeline_num_layers", launch.first),
            ("decoder_last_pipeline_num_layers", launch.last),
        ):
            if value is None:
                args.pop(key, None)
            else:
                args[key] = value
        for key, on in zip(
            ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"), launch.accounted
        ):
            if on:
                args[key] = True
            else:
                args.pop(key, None)
        # the job's own p2p setting stays: Megatron-LM overlaps an interleaved schedule's p2p unless told not to
        for key, _ in VP_SETTINGS:
            args.pop(key, None)
        if launch.chunks > 1:
            args["num_layers_per_virtual_pipeline_stage"] = self._per_chunk(launch)
        return args

    def _per_chunk(self, launch: Launch) -> int:
        """--num-layers-per-virtual-pipeline-stage of an interleaved launch (the embedding and loss count when the
        split accounts for them, as Megatron-LM counts them)."""
        pp = len(launch.order)
        return (self.spec.model.num_layers + sum(launch.accounted)) // (pp * launch.chunks)

    def implied_chunks(self, launch: Launch) -> int | None:
        """The model chunks per rank the job's own virtual-stage flag gives at `launch`'s p and layer accounting
        (None where it gives no whole number). A count (--virtual-pipeline-model-parallel-size, megatron-core's
        `ModelParallelConfig.virtual_pipeline_model_parallel_size`) is the same at every p; layers per virtual stage
        (--num-layers-per-virtual-pipeline-stage) give (layers + accounted embedding and loss) / (p x n), as
        Megatron-LM's `validate_args` (megatron/training/arguments.py) derives the count; neither: one chunk. The
        count is read first, as the spec reads it (`spec.arguments._chunks_of`); megatron-core builds the chunks
        the count gives (megatron/core/transformer/transformer_block.py `get_num_layers_to_build`: layers per rank
        / vp_size per chunk)."""
        count = self.args.get("virtual_pipeline_model_parallel_size")
        if count:
            return int(count)
        per_chunk = self.args.get("num_layers_per_virtual_pipeline_stage")
        if not per_chunk:
            return 1
        pieces, stages = self.spec.model.num_layers + sum(launch.accounted), len(launch.order) * int(per_chunk)
        return pieces // stages if pieces % stages == 0 else None

    def _chunk_changes(self, launch: Launch, argv: list[str], remove: list[str], words: list[str]) -> None:
        """The flags that give `launch.chunks` where the job's own virtual-stage flag gives another count at the
        launch's p and accounting (`implied_chunks`): its --num-layers-per-virtual-pipeline-stage, and every other
        spelling of v the job's command line gives removed (two of them name two v; Megatron-LM's `validate_args`
        takes only one); one chunk removes them all. Where the job's flag already gives `launch.chunks`, it stays
        as the job wrote it."""
        if launch.chunks == self.implied_chunks(launch):
            return
        written = "--num-layers-per-virtual-pipeline-stage" if launch.chunks > 1 else None
        given = [flag for key, flag in VP_SETTINGS if self.args.get(key) is not None and flag != written]
        remove += given
        if written is not None:
            per_chunk = self._per_chunk(launch)
            argv += [written, str(per_chunk)]
            words.append(f"{written} {per_chunk}" + (f" (remove {', '.join(given)})" if given else ""))
        elif given:
            words.append(f"remove {', '.join(given)}: no virtual stages")

    def _lever_changes(self, launch: Launch, argv: list[str], remove: list[str], words: list[str]) -> None:
        """The flags that set `launch.levers` where they differ from the job's own."""
        if launch.levers is None:
            return
        now, new = self.own_levers(), launch.levers
        for flag, old, value in (
            ("--tensor-model-parallel-size", now.tp, new.tp),
            ("--pipeline-model-parallel-size", now.pp, new.pp),
            ("--context-parallel-size", now.cp, new.cp),
        ):
            if value != old:
                argv += [flag, str(value)]
                words.append(f"{flag} {value}")
        # the experts' sizes: --expert-model-parallel-size where ep changes; --expert-tensor-parallel-size where the
        # etp priced is not the one the command line gives at the new t (its own flag, else t: `implied_etp`)
        if new.ep is not None and new.ep != now.ep:
            argv += ["--expert-model-parallel-size", str(new.ep)]
            words.append(f"--expert-model-parallel-size {new.ep}")
        if new.etp is not None and new.etp != self.implied_etp(new.tp):
            argv += ["--expert-tensor-parallel-size", str(new.etp)]
            words.append(f"--expert-tensor-parallel-size {new.etp}")
        if new.fp8 != now.fp8:
            if new.fp8:
                argv += FP8_FLAGS
                words.append(" ".join(FP8_FLAGS) + " (Transformer Engine's FP8 GEMMs)")
            else:
                gone = list(
                    dict.fromkeys(
                        flag
                        for key, flag in FP8_SETTINGS
                        if (
                            self.args.get(key) is False
                            if key == "fp8_wgrad"
                            else self.args.get(key) not in (None, False)
                        )
                    )
                )
                remove += gone
                words.append(f"remove {', '.join(gone)}: 16-bit GEMMs")
        if new.recompute != now.recompute:
            granularity, method, number = new.recompute
            remove += [
                f
                for f, v in zip(
                    ("--recompute-granularity", "--recompute-method", "--recompute-num-layers"), now.recompute
                )
                if v is not None and (granularity is None or f != "--recompute-granularity")
            ]
            if granularity is None:
                words.append(
                    "remove --recompute-granularity (and --recompute-method, --recompute-num-layers): no recomputation"
                )
            else:
                tokens = ["--recompute-granularity", granularity] + (
                    ["--recompute-method", method, "--recompute-num-layers", str(number)] if method else []
                )
                argv += tokens
                words.append(" ".join(tokens))
        for flag, old, value in (
            ("--sequence-parallel", now.sequence_parallel, new.sequence_parallel),
            ("--use-distributed-optimizer", now.distributed_optimizer, new.distributed_optimizer),
        ):
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
        for flag, old, new in (
            ("--decoder-first-pipeline-num-layers", now.first, launch.first),
            ("--decoder-last-pipeline-num-layers", now.last, launch.last),
        ):
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
        self._chunk_changes(launch, argv, remove, words)
        if launch.schedule in ("zb_h1", "gpipe"):
            notes.append(f"schedule {launch.schedule}: " + NO_MEGATRON_FLAG.format(schedule=launch.schedule))
            words.append(notes[-1])
        if launch.order != now.order and not launch.levers_placed:
            hosts = [self.book.device_hosts.get(d) or "" for d in launch.order]
            where = ", ".join(
                f"{k}: {d}" + (f" on {h}" if h else "") for k, (d, h) in enumerate(zip(launch.order, hosts))
            )
            notes.append(
                f"stage map {where}. Megatron gives pipeline rank k to global rank k (tensor and data "
                "parallel 1), so start the process of global rank k on the host of stage k's device: "
                "torchrun --node-rank k on that host (one GPU per node; with several, its GPU's "
                "CUDA_VISIBLE_DEVICES and local rank), or list the hosts in this order in the hostfile "
                "(mpirun/deepspeed) or the SLURM nodelist with --distribution=arbitrary; then write "
                "hops_trace_map.json and hops.base.yaml pipeline.stages in the same order"
            )
            words.append(notes[-1])
        return {"argv": tuple(argv), "remove": tuple(remove), "notes": tuple(notes), "words": tuple(words)}

    def flags(self, launch: Launch) -> dict[str, Any]:
        """`changes` as Outcome's fields."""
        changes = self.changes(launch)
        return {
            "flags": changes["words"],
            "argv": changes["argv"],
            "remove": changes["remove"],
            "launch_notes": changes["notes"],
        }
