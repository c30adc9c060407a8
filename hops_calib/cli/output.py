"""What every verb shares: JSON on stdout (every object with a `status`), errors as one clear message (and one
JSON object under --json), and the exit codes, the same for every verb (README, "Exit codes"):

    0 ok / accepted          1 rejected (the gate said no; tune: no trial beats the model, no candidate written)
    2 invalid input/usage    3 internal error (a bug: a short message, HOPS_CALIB_TRACEBACK=1 for the traceback)
    4 refused off the record (a judgement on a store the model was not calibrated on, or of a change that moves
      no run there; --off-record judges it anyway)
    5 broken ledger (fails `ledger verify`: nothing is appended to it)
    6 partial (ingest: some runs rejected, the others stored)

Bad input is reported on stderr in one message that names the file, line and field; with --json, stdout also gets
one object {"status", "error": {...}} (`error_record`).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from hops_calib.errors import InputError

EXIT_OK, EXIT_REJECTED, EXIT_INVALID, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_OFF_RECORD, EXIT_BROKEN_LEDGER, EXIT_PARTIAL = 4, 5, 6
# The `status` of each exit code's JSON (a verb's own result may say more: "accepted", "no_candidate", ...).
STATUS = {
    EXIT_OK: "ok",
    EXIT_REJECTED: "rejected",
    EXIT_INVALID: "invalid",
    EXIT_INTERNAL: "internal_error",
    EXIT_OFF_RECORD: "off_record",
    EXIT_BROKEN_LEDGER: "broken_ledger",
    EXIT_PARTIAL: "partial",
}
TRACEBACK_ENV = "HOPS_CALIB_TRACEBACK"
BUG_HINT = (
    "this is a bug in hops-calib, not in your input: please report it with the command line and this "
    f"message ({TRACEBACK_ENV}=1 prints the traceback)"
)


def print_json(data: dict[str, Any], status: str = "ok") -> None:
    """One JSON object on stdout, `status` first (the object's own `status` when it has one)."""
    from hops_calib.store.digests import json_safe

    if not isinstance(data, dict):
        raise TypeError("--json prints one object")
    print(json.dumps(json_safe({"status": data.get("status", status), **data}), indent=1, allow_nan=False))


def exit_code_of(error: BaseException) -> int:
    """The exit code of an error a verb raised: its own (`OffRecord`: 4, `BrokenLedger`: 5), 2 for other bad input
    (InputError, StoreError), 3 for anything else (a bug)."""
    # A StoreError (unknown fixture id, ...) can only come from a verb that imported the store; importing it
    # here would cost the ledger verbs a pandas import.
    store = sys.modules.get("hops_calib.store.digests")
    if isinstance(error, InputError):
        return getattr(error, "exit_code", EXIT_INVALID)
    if store is not None and isinstance(error, store.StoreError):
        return EXIT_INVALID
    return EXIT_INTERNAL


def error_record(error: BaseException, exit_code: int) -> dict[str, Any]:
    """What `--json` prints on stdout for an error: {"error": {"message", "file", "line", "field", "problem", "hint",
    "exit_code", "kind"}} (kind: "input" for bad input, "internal" for a bug); the fields an InputError carries,
    None where the error has none."""
    internal = exit_code == EXIT_INTERNAL
    message = f"internal error: {type(error).__name__}: {error}" if internal else str(error)
    return {
        "status": STATUS.get(exit_code, "invalid"),
        "error": {
            "message": message,
            "file": getattr(error, "origin", None),
            "line": getattr(error, "line", None),
            "field": getattr(error, "field", None),
            "problem": getattr(error, "problem", str(error)),
            "hint": BUG_HINT if internal else (getattr(error, "hint", "") or None),
            "exit_code": exit_code,
            "kind": "internal" if internal else getattr(error, "kind", "input"),
        },
    }


def internal_error(error: BaseException) -> int:
    """Report an unexpected error (a bug) in short on stderr, with the traceback only under HOPS_CALIB_TRACEBACK=1;
    returns EXIT_INTERNAL."""
    if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
        traceback.print_exception(error)
    print(f"internal error: {type(error).__name__}: {error}\n{BUG_HINT}", file=sys.stderr)
    return EXIT_INTERNAL


def guarded(action: Callable[[], int], as_json: bool = False) -> int:
    """Run a command: bad input becomes one clear stderr line and exit code 2, anything else (a bug) a short
    message asking for a report and exit code 3, never a traceback that exits 1 (which reads as "rejected").
    With `as_json`, the error is also one JSON object on stdout (`error_record`)."""
    try:
        return action()
    except BrokenPipeError:
        raise  # the reader of stdout went away (`| head`): not an error of the verb (cli.main ends quietly)
    except Exception as error:  # noqa: BLE001 - every error leaves with a documented exit code
        from hops_calib.errors import DiskFull, is_disk_full

        if is_disk_full(error):  # a write the verb did not name: its file, else the folder it ran in
            error = DiskFull(getattr(error, "filename", None) or os.getcwd())
        code = exit_code_of(error)
        if code != EXIT_INTERNAL:
            print(f"Error: {error}", file=sys.stderr)  # as click words its usage errors: one prefix
        else:
            internal_error(error)
        if as_json:
            print(json.dumps(error_record(error, code), indent=1, default=str))
        return code


def held_out_guard(fixtures: Any, ledger_path: Any, verb: str, allow: bool) -> Callable[[], None]:
    """The held-out guard of a verb that records nothing else (`hops_calib.loop.heldout.guard_store`): it refuses a
    store holding in train a group the ledger remembers as held out, or prints the override it recorded."""

    def check() -> None:
        from hops_calib.loop.heldout import guard_store

        for warning in guard_store(fixtures, ledger_path, verb, allow):
            print(f"warning: {warning}", file=sys.stderr)

    return check


def run_and_print(
    label: str,
    as_json: bool,
    compute: Callable[[Any], Any],
    text: Callable[[Any], str],
    held_out_guard: Callable[[], None] | None = None,
) -> int:
    """A verb that computes one result and prints it: `compute(bar)` under a progress bar on a terminal's stderr,
    then the result's JSON (`to_dict`) or `text(result)` on stdout; input errors as `guarded` reports them.
    `held_out_guard` runs first (see `held_out_guard`)."""
    from hops_calib.progress import progress_bar

    def run() -> int:
        if held_out_guard is not None:
            held_out_guard()
        with progress_bar(label, quiet=as_json) as bar:
            result = compute(bar)
        if as_json:
            print_json(result.to_dict(), getattr(result, "status", "ok"))
        else:
            print(text(result))
        return getattr(result, "exit_code", EXIT_OK)

    return guarded(run, as_json)


def refuse_job_dir_as_id(fixture_id: str | None, fixtures: Any, instead: str) -> None:
    """InputError (exit 2) when `fixture_id` is no fixture of the store `fixtures` but an existing job directory
    (megatron_args.txt, hops_trace_map.json or megatron_trace/ inside): a forgotten --job, or a run not ingested.
    `instead` says the command line meant, with DIR where the directory goes."""
    from pathlib import Path

    from hops_calib.store.digests import StoreError
    from hops_calib.store.fixture import check_fixture_id
    from hops_calib.trace.job import is_job_dir

    if fixture_id is None or not Path(fixture_id).is_dir() or not is_job_dir(Path(fixture_id)):
        return
    try:
        if check_fixture_id(Path(fixtures), fixture_id).is_dir():
            return  # a fixture of the store that is also a folder here (its run's job directory): the id is meant
    except StoreError:
        pass
    raise InputError(
        fixture_id,
        "is a job directory, not a fixture id",
        field="ID",
        hint=f"did you mean {instead.replace('DIR', fixture_id)}?",
    )


def refuse_missing_ledger(ledger: Any, new_ledger: bool, as_json: bool) -> int:
    """EXIT_INVALID, said on stderr (and as JSON), when --ledger names no file and --new-ledger was not given: a
    ledger that does not exist remembers nothing held out, so a verb using it would guard nothing. 0 otherwise."""
    from pathlib import Path

    if ledger is None or new_ledger or Path(ledger).exists():
        return 0
    error = InputError(
        str(ledger),
        "no ledger there: a new ledger remembers no held-out run, so nothing the "
        "project's ledger holds out would be guarded",
        field="ledger",
        hint=f"name an existing ledger (the project's is ledger/ledger.jsonl), or start a new one "
        f"on purpose: --ledger {ledger} --new-ledger",
    )
    print(f"Error: {error}", file=sys.stderr)
    if as_json:
        print(json.dumps(error_record(error, EXIT_INVALID), indent=1, default=str))
    return EXIT_INVALID
