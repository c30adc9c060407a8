"""Store room: what may be said of a test run without giving its measurement away.

A test run's truth is the held-out answer. What the tool prints about a test
run, and what it writes about one into the ledger, comes from its
configuration alone (`configuration_digest`: the launch and the devices, never
a timing), so no printed or ledgered field can be checked against a guessed
measurement. The store's own content hashes of its test runs (fixture.json,
runs.parquet and index.parquet: how ingest tells a changed source from an
unchanged one) are keyed with a secret of the store (`SECRET_FILE`, written
once, never printed, never in the ledger): without it no guess can be tested
against one.

Which runs are held out is read from each fixture's own record (fixture.json,
or the table folder's runs.parquet, both digested) as well as from the index:
an index edited to move a run to train does not move it (`held_out_ids`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any

CONFIG_KEY = "config:"  # a configuration digest among a group's digests (the ledger's held_out_groups)
KEYED_KEY = "keyed:"  # a store's keyed content hash of a test run
SECRET_FILE = ".secret"
# Arguments of a launch that say how it was logged or how long it ran, not what it runs: left out of the
# configuration, so a copy that changes only these is the same configuration.
_NOT_CONFIGURATION = frozenset(
    {
        "train_iters",
        "eval_interval",
        "eval_iters",
        "log_interval",
        "log_throughput",
        "save",
        "load",
        "save_interval",
        "tensorboard_dir",
        "wandb_project",
        "wandb_exp_name",
        "exit_interval",
        "exit_duration_in_mins",
        "seed",
        "data_path",
    }
)
# Spec fields that are measured or name the run, not its configuration (the links are the job's own link
# benchmark; the schedule is the one observed, the configured one is declared_schedule).
_SPEC_NOT_CONFIGURATION = frozenset(
    {"run_id", "iterations", "device_ids", "device_names", "links", "schedule", "megatron_args"}
)


def _launch(args: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in sorted((args or {}).items()) if k not in _NOT_CONFIGURATION}


def configuration(fixture: Any) -> dict[str, Any]:
    """What a run was configured to do, as a dict of its fixture (a run with events, or a table's run): its launch
    (Megatron's arguments, less how it was logged) and devices; nothing it measured."""
    if getattr(fixture, "kind", None) == "iteration":
        return {
            "kind": "iteration",
            "launch": _launch(fixture.launch),
            "hardware": dict(sorted(fixture.hardware.items())),
        }
    spec = fixture.spec.to_dict()
    kept = {k: v for k, v in sorted(spec.items()) if k not in _SPEC_NOT_CONFIGURATION}
    kept["schedule"] = spec.get("declared_schedule") or spec.get("schedule")
    return {"kind": "events", "spec": kept, "launch": _launch(spec.get("megatron_args"))}


def configuration_digest(fixture: Any) -> str:
    """`CONFIG_KEY` + the sha256 of `configuration(fixture)`: the same for every run of one configuration (a copy,
    a near-copy, a repeat), whatever it measured."""
    text = json.dumps(configuration(fixture), sort_keys=True, default=str, separators=(",", ":"))
    return CONFIG_KEY + hashlib.sha256(b"hops-calib configuration v1\n" + text.encode()).hexdigest()


def store_secret(root: Path | str, create: bool = False) -> bytes | None:
    """The store's secret (32 random bytes in `SECRET_FILE`, readable by its owner only); written when `create` and
    absent, else None when absent."""
    path = Path(root) / SECRET_FILE
    try:
        return bytes.fromhex(path.read_text(encoding="ascii").strip())
    except FileNotFoundError:
        if not create:
            return None
    except ValueError:
        from hops_calib.store.digests import StoreError

        raise StoreError(
            f"{path} is not a store secret (64 hex digits); delete it and ingest the store's test runs again"
        ) from None
    Path(root).mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(key.hex() + "\n")
    return key


def stored_content_hash(root: Path | str, digest: str, split: str, create: bool = True) -> str | None:
    """The content hash a store records for a run: `digest` itself for a train run, keyed with the store's secret
    (HMAC-SHA256, `KEYED_KEY` + hex) for a test run; None for a test run when the store has no secret yet and
    `create` is false (no recorded hash can be it)."""
    if split != "test":
        return digest
    key = store_secret(root, create=create)
    if key is None:
        return None
    return KEYED_KEY + hmac.new(key, digest.encode(), hashlib.sha256).hexdigest()


def held_out_ids(store: Any) -> set[str]:
    """The store's test runs: those the index lists in test, and those whose own record (fixture.json, a table
    folder's runs.parquet) says test whatever the index says."""
    from hops_calib.store.digests import ITERATION_KIND, StoreError

    held = set()
    tables: dict[str, dict[str, str]] = {}
    for row in store.rows():
        if row["split"] == "test":
            held.add(row["id"])
            continue
        try:
            if row["kind"] == ITERATION_KIND:
                container = str(row["container"])
                if container not in tables:
                    _, runs = store.table(container)
                    tables[container] = dict(zip(runs["id"], runs["split"]))
                own = tables[container].get(row["id"])
            else:
                own = store.meta(row["id"]).get("split")
        except StoreError:
            continue  # a damaged fixture: the verbs that read it refuse it themselves
        if own == "test":
            held.add(row["id"])
    return held
