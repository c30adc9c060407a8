"""The `job` verbs: job directories made from other sources (`job from-log`: a Megatron training log), computed by
`hops_calib.whatif.job_from_log` and printed here."""

from __future__ import annotations

from pathlib import Path

import typer

from hops_calib.cli.output import EXIT_OK, guarded, print_json
from hops_calib.errors import InputError

app = typer.Typer(
    help="Job directories (what predict --job and plan --job read) from other sources.", no_args_is_help=True
)


@app.command("from-log")
def from_log(
    log: Path = typer.Argument(
        ...,
        help="A Megatron training log (its arguments block, tokenizer line and "
        "iterations; hardware from hops.base.yaml beside it or --gpu).",
    ),
    job_dir: Path = typer.Argument(
        ..., metavar="DIR", help="The job directory to write: new or empty (nothing is overwritten)."
    ),
    gpu: str | None = typer.Option(
        None,
        "--gpu",
        help="Device type of the log's run (of the model's catalog, e.g. a100) when no hops.base.yaml beside it says.",
    ),
    gpus_per_node: int | None = typer.Option(None, "--gpus-per-node", min=1, help="GPUs per node, with --gpu."),
    model: Path | None = typer.Option(
        None, "--model", help="The model both are priced with (default: the checkout's)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Convert a Megatron training log into a job directory (megatron_args.txt, the stage map, hops.base.yaml, the
    node's all-reduce tables, a manifest; no measurement), then price both: the same prediction, or the output
    names what differs (link benchmark, collective tables, transport, placement). Exit 2 on a bad log or a DIR that
    is not empty; nothing half-written is left."""

    def run() -> int:
        from hops_calib.loop.model_files import load_model
        from hops_calib.trace.measured import RunHardware
        from hops_calib.whatif.job_from_log import job_from_log

        if (gpu is None) != (gpus_per_node is None):
            raise InputError(
                "job from-log",
                "--gpu and --gpus-per-node go together",
                field="--gpu",
                hint="give both, or put hops.base.yaml (hardware: {gpu: TYPE, gpus_per_node: N}) beside the log",
            )
        hardware = RunHardware(gpu=gpu.lower(), gpus_per_node=gpus_per_node) if gpu and gpus_per_node else None
        result = job_from_log(log, job_dir, load_model(model), hardware=hardware)
        if as_json:
            print_json(result.to_dict())
            return EXIT_OK
        agreement = result.agreement
        times = agreement["iteration_time_ms"]
        print(f"{result.job_dir}: job directory of {result.log} (run {result.run_id}): {', '.join(result.files)}")
        if result.left_out:
            print(
                f"left out {len(result.left_out)} argument(s) the model neither reads nor knows: "
                + ", ".join(result.left_out)
            )
        print(
            f"priced: the log's run {times['log']:.2f} ms per iteration, the job directory {times['job']:.2f} ms"
            + (
                "; the same prediction"
                if agreement["same_prediction"]
                else "; they differ"
                + (f" in {', '.join(agreement['differs'])}" if agreement["differs"] else "")
                + ("" if agreement["same_breakdown"] else " (the breakdown too)")
            )
        )
        for note in result.notes:
            print(f"note: {note}")
        print(f"next: hops-calib predict --job {result.job_dir}, hops-calib plan --job {result.job_dir}")
        return EXIT_OK

    raise typer.Exit(guarded(run, as_json))
