"""Command lines of tests that start their own ledgers: `--new-ledger` beside a `--ledger` that does not exist yet
(a verb refuses a ledger path that names no file without it; tests/loop/test_heldout_and_limits.py checks the refusal)."""

from __future__ import annotations

from pathlib import Path


def with_new_ledger(args) -> list[str]:
    args = [str(a) for a in args]
    if "--ledger" in args and "--new-ledger" not in args:
        at = args.index("--ledger") + 1
        if at < len(args) and not Path(args[at]).exists():
            return [*args, "--new-ledger"]
    return args
