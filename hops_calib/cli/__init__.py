"""The command layer: the typer app and `main` (the entry point), built from one module per verb group, the only
layer that prints: `ingest`, `fixtures` (list, show), `evaluate` (evaluate, compare), `report`, `ledger`,
`candidate` (terms, candidate new), `research` (observe, decompose, tune, crossval), `plan` (job, layouts, abstract),
`predict` (run, all, job), `job` (from-log), `cluster`, `plot`, `capture`, `bench`, `version`. `verbs` lets a verb
split into sub-verbs keep its old spelling (`plan --job DIR`, `predict ID`). `options`
holds the options the verbs share, `output` what they print with (JSON, error objects, exit codes), `render` their
text for people. The order of registration is the order of `hops-calib --help`."""

from __future__ import annotations

from typing import Protocol, TypeGuard

import typer

from hops_calib.cli import (
    bench,
    candidate,
    capture,
    cluster,
    evaluate,
    fixtures,
    ingest,
    job,
    ledger,
    plan,
    plot,
    predict,
    report,
    research,
    version,
)
from hops_calib.cli.options import TOLERANCE_OPTIONS, add_new_ledger

__all__ = ["TOLERANCE_OPTIONS", "app", "main"]

app = typer.Typer(
    name="hops-calib",
    help="Calibrate and validate a pipeline-parallel training simulator against real Megatron-LM traces.",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(fixtures.app, name="fixtures")
for verb in (bench.bench, version.version, capture.capture, ingest.ingest, cluster.cluster):
    app.command()(verb)


app.add_typer(plan.app, name="plan")
app.add_typer(predict.app, name="predict")

for verb in (evaluate.evaluate, evaluate.compare, report.report, candidate.terms):
    app.command()(verb)


for verb in (research.observe, research.decompose, research.tune, research.crossval):
    app.command()(verb)
app.add_typer(ledger.app, name="ledger")
app.add_typer(candidate.app, name="candidate")
app.add_typer(plot.app, name="plot")
app.add_typer(job.app, name="job")
add_new_ledger(app)


class _UsageError(Protocol):
    """A usage error as typer raises it (click's ClickException, which typer vendors in its recent versions)."""

    exit_code: int

    def show(self) -> None: ...

    def format_message(self) -> str: ...


def _is_usage_error(error: Exception) -> TypeGuard[_UsageError]:
    return hasattr(error, "show") and isinstance(getattr(error, "exit_code", None), int)


def main() -> None:
    """The entry point. Exit codes (hops_calib.cli.output; README, "Exit codes"): 0 ok / accepted, 1 rejected, 2 bad
    input or usage, 4 refused off the record, 5 a broken ledger, 6 a partial ingest, 3 an internal error (a bug;
    the verbs report their own, this catches the rest).
    A usage error (an option's value, an unknown verb) under --json is also one {"error": ...} object on stdout,
    as the verbs' own errors are."""
    import sys

    from hops_calib.cli.output import error_record, internal_error

    try:
        code = app(standalone_mode=False)
    except typer.Abort:
        print("Aborted!", file=sys.stderr)
        sys.exit(1)
    except BrokenPipeError:  # stdout's reader went away (`| head`): end quietly, as a process killed by SIGPIPE
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except Exception as error:  # noqa: BLE001 - a crash must not exit 1, which reads as "rejected"
        usage = error if _is_usage_error(error) else None
        if usage is not None:
            usage.show()
            if "--json" in sys.argv[1:] and usage.exit_code != 0:
                import json

                record = error_record(error, usage.exit_code)
                record["error"]["message"] = record["error"]["problem"] = usage.format_message()
                param = getattr(error, "param", None)
                record["error"]["field"] = "/".join(getattr(param, "opts", None) or []) or None
                print(json.dumps(record, indent=1, default=str))
            sys.exit(usage.exit_code)
        sys.exit(internal_error(error))
    sys.exit(code if isinstance(code, int) else 0)
