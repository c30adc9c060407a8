"""What-if: a Megatron training log as a job directory (`hops-calib job from-log LOG DIR`), the form `predict --job`
and `plan --job` read, so that a run someone trained can be edited (another micro batch, more GPUs) and priced.

What is written (the layout `spec.build_spec` reads; the log's measurements are not copied: a job directory is a
question, never its answer):

    DIR/megatron_args.txt        the launch: torchrun (--nnodes N when the run spans nodes) --nproc-per-node G
                                 pretrain_gpt.py and every argument of the log's block the model reads or knows
                                 (`trace.measured.KNOWN_ARGS`), True as a bare flag, False and None left out; the
                                 vocabulary Megatron allocated as --padded-vocab-size (from the tokenizer's line)
    DIR/hops_trace_map.json      one device per pipeline stage, the stage's first GPU (`Spec.rank`)
    DIR/hops.base.yaml           those devices, their GPU type and node (global rank r on node r // G)
    DIR/calibration/allreduce/   the node's all-reduce tables the log was priced with, copied (none: none)
    DIR/manifest.yaml            provenance: the log (path and sha256) and how it was converted

The directory is written beside DIR under a temporary name, priced, and renamed into place, so an error leaves
nothing half-written; a DIR that exists and is not empty is refused. Both are priced (`agreement`): the log's run as
`predict ID` prices it and the directory as `predict --job` does; the same iteration time and breakdown, or the
output names what differs (`whatif.job.pricing_inputs`: link benchmark, collective tables, transport, which hops
stay within a node).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.model import Model
from hops_calib.trace.measured import KNOWN_ARGS, MeasuredRun, RunHardware, world_size

# Set by the launcher or computed by Megatron from it, never a flag of pretrain_gpt.py: the torchrun line says them.
LAUNCHER_ARGS = frozenset({"world_size", "data_parallel_size", "rank", "local_rank"})


def _flag(name: str, value: Any) -> list[str]:
    """`--name value` tokens of one argument: a bare flag for True, nothing for False or None, a list as its
    Python literal (one token, read back whole by `trace.megatron_args.parse_value`)."""
    flag = "--" + name.replace("_", "-")
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, (list, tuple)):
        return [flag, repr(list(value))]
    return [flag, str(value)]


def launch_line(args: dict[str, Any], gpus: int, gpus_per_node: int, source: Path) -> str:
    """The torchrun command line of the log's launch (`megatron_args.txt`); InputError when the world does not fill
    whole nodes, or an argument would not read back as it is."""
    from hops_calib.trace.megatron_args import parse_command_line

    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise InputError(
            source,
            f"the launch's {gpus} GPUs do not fill whole nodes of {gpus_per_node}",
            field="world_size",
            hint="give the run's --gpus-per-node (or hops.base.yaml beside the log)",
        )
    launcher = (
        ["torchrun", "--nnodes", str(gpus // gpus_per_node), "--nproc-per-node", str(gpus_per_node)]
        if gpus > gpus_per_node
        else ["torchrun", "--nproc-per-node", str(gpus)]
    )
    kept = {
        name: value
        for name, value in sorted(args.items())
        if name in KNOWN_ARGS and name not in LAUNCHER_ARGS and value is not None and value is not False
    }
    tokens = [token for name, value in kept.items() for token in _flag(name, value)]
    line = " ".join(shlex.quote(t) for t in [*launcher, "pretrain_gpt.py", *tokens])
    read = parse_command_line(line, source)
    for name, value in kept.items():
        back = read.get(name)
        if (list(back) if isinstance(back, (list, tuple)) else back) != (
            list(value) if isinstance(value, (list, tuple)) else value
        ):
            raise InputError(
                source,
                f"argument {name} = {value!r} would read back from a command line as {back!r}",
                field=name,
                hint="the log's value has no command-line form; convert by hand (write megatron_args.txt)",
            )
    return line + "\n"


@dataclass(frozen=True)
class JobFromLog:
    """A converted log: where the job directory is, what was written, and how its price compares with the log's."""

    log: Path
    job_dir: Path
    run_id: str
    files: tuple[str, ...]
    left_out: tuple[str, ...]  # the log's arguments the model neither reads nor knows, not written
    agreement: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "log": str(self.log),
            "job": str(self.job_dir),
            "run_id": self.run_id,
            "files": list(self.files),
            "left_out_arguments": list(self.left_out),
            "agreement": self.agreement,
            "notes": list(self.notes),
        }


def _device_ids(run: MeasuredRun, spec) -> tuple[list[str], list[str]]:
    """Each stage's device (its first GPU, tp and dp coordinates 0) and node, named as global rank r on node
    r // gpus per node."""
    per_node = run.hardware.gpus_per_node
    ranks = [spec.rank(0, 0, stage) for stage in range(spec.pp)]
    nodes = [f"node{r // per_node}" for r in ranks]
    return [f"{run.hardware.gpu}_{node}_gpu{r % per_node}" for r, node in zip(ranks, nodes)], nodes


def measured_spec_of(run: MeasuredRun):
    """The spec of a log's run, as the store prices it (`store.measured_spec`: its collective tables with it)."""
    from hops_calib.store.measured_spec import measured_spec
    from hops_calib.trace.collective_bench import read_collective_tables

    tables = read_collective_tables(Path(run.hardware.collective_tables)) if run.hardware.collective_tables else ()
    try:
        return measured_spec(
            run.run_id,
            run.args,
            {"gpu": run.hardware.gpu, "gpus_per_node": run.hardware.gpus_per_node},
            run.origin,
            collectives=tables,
        )
    except (ValueError, KeyError, TypeError) as error:
        from hops_calib.store.measured_spec import reason_of

        raise InputError(
            run.origin or run.run_id,
            f"the model does not price this launch: {reason_of(error)}",
            field="launch",
            hint="a job directory is for launches the model prices",
        ) from None


def job_files(log: Path, run: MeasuredRun, spec) -> dict[str, str]:
    """The text files of the job directory (relative path -> text)."""
    import yaml

    ids, nodes = _device_ids(run, spec)
    digest = hashlib.sha256(log.read_bytes()).hexdigest()
    manifest = {
        "source_scenario": "hops-calib job from-log",
        "job_id": run.run_id,
        "description": (
            f"the launch of the Megatron training log {log.name}, converted by hops-calib job "
            "from-log: its arguments, hardware and all-reduce tables; no measurement of it"
        ),
        "converted_from": {"log": str(log.resolve()), "sha256": digest},
        "padded_vocab_size": (
            "the vocabulary Megatron allocated, from the log (the tokenizer pads the "
            "tokenizer's vocabulary itself when launched: give --vocab-size or the "
            "tokenizer's files instead to launch it)"
        ),
    }
    template = {"hardware": {"devices": [{"id": d, "gpu": run.hardware.gpu, "node": n} for d, n in zip(ids, nodes)]}}
    return {
        "megatron_args.txt": launch_line(run.args, world_size(run.args), run.hardware.gpus_per_node, log),
        "hops_trace_map.json": json.dumps({"stages": {str(k): d for k, d in enumerate(ids)}}, indent=2) + "\n",
        "hops.base.yaml": "# Written by hops-calib job from-log: one device per pipeline stage (its first GPU).\n"
        + yaml.safe_dump(template, sort_keys=False),
        "manifest.yaml": yaml.safe_dump(manifest, sort_keys=False),
    }


def _stage(job_dir: Path, files: dict[str, str], tables: Path | None) -> tuple[Path, tuple[str, ...]]:
    """The directory written under a temporary name beside `job_dir` (removed again on any error), and its files."""
    from hops_calib.files import _umask
    from hops_calib.trace.collective_bench import ALLREDUCE_DIR, gpus_of

    job_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{job_dir.name}.", dir=job_dir.parent))
    written = []
    try:
        for name, text in files.items():
            (staging / name).write_text(text, encoding="utf-8")
            written.append(name)
        if tables is not None:
            target = staging / ALLREDUCE_DIR
            target.mkdir(parents=True)
            for entry in sorted(tables.iterdir()):
                if gpus_of(entry) is not None and entry.is_file():
                    shutil.copyfile(entry, target / entry.name)
                    written.append(f"{ALLREDUCE_DIR}/{entry.name}")
        os.chmod(staging, 0o777 & ~_umask())
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging, tuple(written)


def agreement(run: MeasuredRun, spec, job_dir: Path, model: Model) -> dict[str, Any]:
    """The log's run priced as `predict ID` prices it against the job directory priced as `predict --job` does:
    their iteration times, whether the breakdown is the same, and the pricing inputs that differ."""
    from hops_calib.model.predict import predict
    from hops_calib.whatif.job import pricing_differences, pricing_inputs, what_if

    from_log = predict(spec, model)
    job = what_if(job_dir, model)
    log_inputs, job_inputs = pricing_inputs(spec), pricing_inputs(job.spec)
    same_breakdown = _close(model.breakdown(spec), list(job.breakdown))
    log_ms, job_ms = from_log.metrics.iteration_time_ms, job.predictions[0].metrics.iteration_time_ms
    same = abs(log_ms - job_ms) <= 1e-9 * max(abs(log_ms), 1.0) and same_breakdown
    return {
        "same_prediction": same,
        "iteration_time_ms": {"log": log_ms, "job": job_ms},
        "same_breakdown": same_breakdown,
        "differs": pricing_differences(log_inputs, job_inputs),
        "pricing_inputs": {"log": log_inputs, "job": job_inputs},
        "job_notes": list(job.notes),
    }


def _close(a: list[dict[str, float]], b: list[dict[str, float]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(abs(x[k] - y[k]) <= 1e-9 * max(abs(x[k]), 1.0) for k in x) for x, y in zip(a, b)
    )


def job_from_log(
    log: Path | str,
    job_dir: Path | str,
    model: Model,
    *,
    hardware: RunHardware | None = None,
) -> JobFromLog:
    """Convert `log` into the job directory `job_dir` (refused when it exists and is not empty) and compare the two
    prices; InputError (a TraceError for the log) naming file, line and field."""
    from hops_calib.trace.megatron_log import read_megatron_log

    log, job_dir = Path(log), Path(job_dir)
    if job_dir.exists() and (not job_dir.is_dir() or any(job_dir.iterdir())):
        raise InputError(
            job_dir,
            "exists and is not an empty directory: nothing is overwritten",
            field="DIR",
            hint="name a new directory (or an empty one)",
        )
    run = read_megatron_log(log, hardware=hardware)
    spec = measured_spec_of(run)
    files = job_files(log, run, spec)
    tables = Path(run.hardware.collective_tables) if run.hardware.collective_tables else None
    staging, written = _stage(job_dir, files, tables)
    try:
        agrees = agreement(run, spec, staging, model)
        if job_dir.is_dir():
            job_dir.rmdir()  # empty (checked above): the rename takes its place
        os.rename(staging, job_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    left_out = tuple(
        sorted(
            name
            for name, value in run.args.items()
            if name not in KNOWN_ARGS and value is not None and value is not False
        )
    )
    notes = list(run.warnings)
    if tables is None and spec.pp > 1:
        notes.append(
            "the log has no all-reduce tables beside it: the job's hops are priced as the log's are, without them"
        )
    return JobFromLog(
        log=log,
        job_dir=job_dir,
        run_id=run.run_id,
        files=written,
        left_out=left_out,
        agreement=agrees,
        notes=tuple(notes),
    )
