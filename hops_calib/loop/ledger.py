"""The ledger: an append-only, hash-chained JSON-lines record of every evaluation and held-out report.

One entry per line, canonical JSON (sorted keys, no spaces), ending in a newline.
Each entry carries
- `prev_sha256`: the sha256 of the previous line's bytes (64 zeros for the first), and
- `entry_sha256`: the sha256 of its own canonical JSON without this field,
so `verify` finds an edited line (its own hash no longer matches), a line
removed, inserted or re-hashed (the next line's `prev_sha256` no longer
matches) and an interrupted append (a last line without its newline). A
rewrite of the last line with both hashes recomputed is the one change a chain
cannot see; `verify` prints the head hash so it can be anchored elsewhere (a
commit message, a review).

Appends hold a file lock (`<ledger>.lock`) and write the whole line with one
O_APPEND write, so concurrent evaluations never interleave; an append refuses
to go on after an incomplete last line (see `repair`) and on a ledger that fails
`verify` (a new entry must not be chained to a broken history).

Entries cut off the end leave a shorter chain that is intact: inside a git work
tree `verify` therefore also checks that the copy committed at git HEAD is a
prefix of the file (outside one, or for a file git does not track, it says that
it cannot see a cut end).

The default ledger (`default_ledger`) is `ledger/ledger.jsonl` of the hops-calib
checkout enclosing the current directory, else of the checkout this package runs
from, never a path relative to wherever the command was started; it must exist
(a new ledger is started only at a path named explicitly).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hops_calib.errors import DiskFull, InputError, is_disk_full

# the checkout's helpers are read from here as well as from loop.checkout
from hops_calib.loop.checkout import PACKAGE_CHECKOUT, checkout_of, default_checkout, is_checkout  # noqa: F401
from hops_calib.loop.score import or_nan

GENESIS = "0" * 64
LEDGER_IN_CHECKOUT = Path("ledger") / "ledger.jsonl"
LOCK_TIMEOUT_S = 120.0


class LedgerError(InputError):
    """A ledger that cannot be appended to or read as it is."""


def default_ledger(start: Path | None = None) -> Path:
    """The project's ledger: `ledger/ledger.jsonl` of the hops-calib checkout enclosing `start` (default: the current
    directory), else of the checkout this package runs from; LedgerError when neither is a checkout."""
    checkout = default_checkout(start)
    if checkout is not None:
        return checkout / LEDGER_IN_CHECKOUT
    start = (start or Path.cwd()).resolve()
    raise LedgerError(
        "--ledger",
        f"no hops-calib checkout encloses {start}, and the package runs from none "
        f"({PACKAGE_CHECKOUT}), so there is no default ledger",
        field="ledger",
        hint="run from inside the checkout, or name the ledger: --ledger PATH",
    )


def resolve(path: Path | str | None) -> Path:
    """The ledger to use: `path` as given (it may be new: an append starts it), or the project's ledger
    (`default_ledger`), which must exist: a missing default is refused, never created somewhere unexpected."""
    if path is not None:
        return Path(path)
    found = default_ledger()
    if not found.is_file():
        raise LedgerError(
            found,
            "the project's ledger is missing",
            field="ledger",
            hint="restore it (git checkout -- ledger/ledger.jsonl), or start a new ledger by naming it: --ledger PATH",
        )
    return found


def canonical_json(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def entry_hash(entry: dict[str, Any]) -> str:
    return sha256_hex(canonical_json({k: v for k, v in entry.items() if k != "entry_sha256"}))


def code_revision() -> str:
    """`git rev-parse HEAD` of the checkout this package runs from (+ '-dirty' with local changes), else 'unknown'."""
    here = Path(__file__).resolve().parents[1]  # the package folder
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
            cwd=here.parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def _lock(path: Path):
    from filelock import FileLock

    return FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S)


def _write_all(fd: int, data: bytes) -> None:
    # One write for the whole line; the loop only continues after a short write.
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _last_line(data: bytes, path: Path) -> bytes | None:
    """The last complete line of the ledger's bytes; LedgerError when the file ends mid-line."""
    if not data:
        return None
    if not data.endswith(b"\n"):
        line = data.count(b"\n") + 1
        raise LedgerError(
            path,
            "the last line is incomplete: an append was interrupted before its newline",
            line=line,
            hint=f"run `hops-calib ledger repair --ledger {path}` to set the partial line aside, then append again",
        )
    return data[:-1].rsplit(b"\n", 1)[-1]


def append(path: Path | str, entry: dict[str, Any]) -> dict[str, Any]:
    """Append `entry` (a JSON-able dict) to the ledger at `path`, chained to the last line; returns what was written.

    Adds `seq` (1-based line number), `prev_sha256` and `entry_sha256`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock(path):
        data = path.read_bytes() if path.exists() else b""
        last = _last_line(data, path)
        check = _verify_bytes(data, path) if data else Verification(path)
        if not check.ok:
            raise BrokenLedger(check)
        written = dict(entry)
        written["seq"] = data.count(b"\n") + 1
        written["prev_sha256"] = sha256_hex(last) if last is not None else GENESIS
        written["entry_sha256"] = entry_hash(written)
        line = canonical_json(written) + b"\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            _write_all(fd, line)
            os.fsync(fd)
        except OSError as error:  # nothing half-appended: the ledger is cut back to its last whole entry
            os.ftruncate(fd, len(data))
            if is_disk_full(error):
                raise DiskFull(path, len(line)) from None
            raise
        finally:
            os.close(fd)
    return written


def now_utc() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class Problem:
    line: int | None  # None: the file as a whole
    message: str
    # `ledger repair` puts it right: an incomplete last line (an interrupted append) it sets aside, a commit whose
    # model write was interrupted it writes (`hops_calib.loop.commits`)
    repairable: bool = False

    def __str__(self) -> str:
        return self.message if self.line is None else f"line {self.line}: {self.message}"


@dataclass
class Verification:
    path: Path
    entries: int = 0
    problems: list[Problem] = field(default_factory=list)
    head_sha256: str = GENESIS
    # Whether the copy committed at git HEAD was checked to be a prefix of the file (entries cut off the end leave
    # an intact shorter chain, which only such a copy shows), and if not, why not.
    committed_prefix_checked: bool = False
    committed_prefix_note: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "ledger": str(self.path),
            "ok": self.ok,
            "entries": self.entries,
            "head_sha256": self.head_sha256,
            "problems": [{"line": p.line, "message": p.message} for p in self.problems],
            "committed_prefix_checked": self.committed_prefix_checked,
            "committed_prefix_note": self.committed_prefix_note,
        }


class BrokenLedger(LedgerError):
    """A ledger that fails `verify`: nothing is appended to it."""

    kind = "broken_ledger"
    exit_code = 5  # hops_calib.cli.output.EXIT_BROKEN_LEDGER

    def __init__(self, result: Verification) -> None:
        self.verification = result
        first = result.problems[0]
        if all(problem.repairable for problem in result.problems):
            advice = (
                f"run `hops-calib ledger repair --ledger {result.path}`: it sets an incomplete last line (an "
                "interrupted append) aside, keeping every complete entry, and writes a committed model whose "
                "write was interrupted"
            )
        else:
            advice = (
                f"`hops-calib ledger verify --ledger {result.path}` lists every problem; restore the file from "
                "a copy before appending to it (`git checkout -- FILE` also discards every entry appended "
                "since the last commit)"
            )
        super().__init__(
            result.path,
            f"fails verification ({len(result.problems)} problem(s)), first: {first.message}",
            line=first.line,
            field="ledger",
            hint=f"nothing was appended; {advice}",
        )


def _committed_copy(path: Path) -> tuple[bytes | None, str]:
    """The ledger's bytes as committed at git HEAD, or None and why there is none to compare with."""
    folder = path.resolve().parent
    try:
        inside = subprocess.run(
            ["git", "rev-parse", "--is-inside-work-tree"], cwd=folder, capture_output=True, text=True, timeout=10
        )
        if inside.returncode != 0 or inside.stdout.strip() != "true":
            return None, "not inside a git work tree: entries cut off the end cannot be seen"
        shown = subprocess.run(["git", "show", f"HEAD:./{path.name}"], cwd=folder, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"git could not be run ({error}): entries cut off the end cannot be seen"
    if shown.returncode != 0:
        return None, "git HEAD holds no copy of this file: entries cut off the end cannot be seen"
    return shown.stdout, "the copy committed at git HEAD is a prefix of the file"


def _check_committed_prefix(data: bytes, path: Path, result: Verification) -> None:
    committed, note = _committed_copy(path)
    result.committed_prefix_note = note
    if committed is None:
        return
    result.committed_prefix_checked = True
    if data.startswith(committed):
        return
    theirs, ours = committed.split(b"\n"), data.split(b"\n")
    number = next(i for i, line in enumerate(theirs, start=1) if i > len(ours) or ours[i - 1] != line)
    if number > len(ours) or (number == len(ours) and not ours[-1]):
        what = "is missing: entries were cut off the end"
    else:
        what = "differs from this line: the file was changed or cut"
    result.problems.append(
        Problem(
            number,
            f"line {number} of the copy committed at git HEAD {what} (git show "
            f"HEAD:{path.name} has the committed version)",
        )
    )


def _verify_bytes(data: bytes, path: Path, committed: bool = True) -> Verification:
    """`verify` of the ledger's bytes: every line, the chain, and (`committed`) the copy committed at git HEAD."""
    result = Verification(path)
    lines = data.split(b"\n")
    complete, tail = lines[:-1], lines[-1]
    prev = GENESIS
    for number, line in enumerate(complete, start=1):
        try:
            entry = json.loads(line)
            if not isinstance(entry, dict):
                raise ValueError("not an object")
        except ValueError as error:
            result.problems.append(Problem(number, f"not a JSON object ({error}); the line was damaged"))
            prev = sha256_hex(line)
            continue
        result.entries += 1
        if entry.get("entry_sha256") != entry_hash(entry):
            result.problems.append(
                Problem(number, "content does not match its entry_sha256: the entry was edited after it was written")
            )
        if entry.get("prev_sha256") != prev:
            if number == 1:
                message = "prev_sha256 is not the genesis value (64 zeros): lines were removed from the start"
            else:
                message = (
                    f"prev_sha256 does not match the sha256 of line {number - 1}: line {number - 1} was "
                    "changed, or lines were removed or inserted before this one"
                )
            result.problems.append(Problem(number, message))
        prev = sha256_hex(line)
    if tail:
        result.problems.append(
            Problem(
                len(complete) + 1,
                f"incomplete last line ({len(tail)} bytes, no newline): an "
                "append was interrupted; it is not an entry (`hops-calib "
                "ledger repair` sets it aside)",
                repairable=True,
            )
        )
    result.head_sha256 = prev
    if committed:
        _check_committed_prefix(data, path, result)
    return result


def verify(path: Path | str) -> Verification:
    """Check every line: complete, valid JSON, its own hash, and the chain to the line before; inside a git work
    tree, also that the copy committed at HEAD is a prefix of the file (nothing cut off the end)."""
    path = Path(path)
    if not path.is_file():
        result = Verification(path)
        result.problems.append(Problem(None, "the ledger file is missing" if not path.exists() else "is not a file"))
        return result
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):  # an append in flight, or one that was interrupted: ask its lock
        with _lock(path):
            data = path.read_bytes()
    return _verify_bytes(data, path)


def warn_if_broken(path: Path | str) -> Verification:
    """A reader's check: when the ledger fails `verify`, say so on stderr (what it shows may not be the recorded
    history); returns the verification."""
    from hops_calib.progress import warn

    result = verify(path)
    if not result.ok and Path(path).exists():
        warn(
            f"warning: {path}: the ledger fails verification ({len(result.problems)} problem(s), first: "
            f"{result.problems[0]}); what is read from it may not be the recorded history (`hops-calib ledger "
            f"verify --ledger {path}` lists the problems)"
        )
    return result


def read_entries(path: Path | str) -> Iterator[dict[str, Any]]:
    """The complete entries of a ledger, in order (an incomplete last line is skipped; `verify` reports it)."""
    path = Path(path)
    if not path.exists():
        return
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.endswith(b"\n"):
                return
            try:
                yield json.loads(line)
            except ValueError:
                raise LedgerError(
                    path, "not valid JSON", line=number, hint="run `hops-calib ledger verify` to see what is damaged"
                ) from None


@dataclass(frozen=True)
class Look:
    """One held-out report in the ledger, and what the campaign did between it and the look before."""

    seq: int
    time: str
    split: str
    model_sha256: str
    throughput_mape_pct: float
    bubble_mae_pp: float
    gap_to_train_pp: float | None  # held-out minus train MAPE of the same model, when the entry carries train's
    evaluations_since: int  # candidate evaluations and comparisons since the previous look (any decision)
    changes_since: int  # of those, the ones that changed a model file (accepted and committed; committed compares)
    # the seq of an earlier look it repeats (`look_repeats`: the same fixture set, or runs in common, with the same
    # model or the same predictions), if any
    repeat_of: int | None
    # configurations predicted otherwise than at the last earlier look on the same fixture set that recorded its
    # predictions' digests (report since session 6); None when either look has none
    predictions_moved: int | None = None
    # the gap's 95 % interval over configurations (report since session 6), when the entry carries it
    gap_interval_pp: tuple[float, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _gap_interval(entry: dict[str, Any]) -> tuple[float, float] | None:
    bounds = (entry.get("intervals") or {}).get("gap_to_train_pp")
    return (float(bounds[0]), float(bounds[1])) if bounds else None


def predictions_moved(before: list[str] | None, after: list[str] | None) -> int | None:
    """How many configurations two looks' prediction digests (same fixture set, suite order) tell apart; None when
    either has none or they cover different runs."""
    if not before or not after or len(before) != len(after):
        return None
    return sum(a != b for a, b in zip(before, after))


def repeats(earlier: dict[str, Any], model_sha256: str, digests: list[str] | None) -> bool:
    """Whether a look with this model and these prediction digests repeats the `earlier` look (same fixture set):
    the same predictions where both recorded digests, else the same model."""
    if digests and earlier.get("prediction_digests"):
        return earlier["prediction_digests"] == digests
    return earlier.get("model_sha256") == model_sha256


RUN_KEYS = "run_keys"  # a report's runs, in suite order, without their names: [sha of the id, what it measured]


def look_repeats(
    earlier: dict[str, Any],
    fixture_set: str,
    model_sha256: str,
    digests: list[str] | None,
    run_keys: list[list[str]] | None,
) -> bool:
    """Whether a look (its fixture set, model, prediction digests and `run_keys`, in suite order) repeats the
    `earlier` look of the same split. On the same fixture set: `repeats`. On another (the store re-ingested, its
    runs moved, runs added or dropped): when some of its runs are the earlier look's (the same id, or the same
    measurement under another id) and the model is the same, or every run it scores is one of the earlier look's
    predicted alike. An earlier look that recorded no run keys counts as the same runs when it predicted as many
    configurations exactly alike, in order."""
    if earlier.get("fixture_set_sha256") == fixture_set:
        return repeats(earlier, model_sha256, digests)
    theirs, their_digests = earlier.get(RUN_KEYS), earlier.get("prediction_digests")
    if not theirs:
        return bool(digests) and their_digests == digests
    if not run_keys:
        return False
    where = {key: i for i, keys in enumerate(theirs) for key in keys}
    matched = [(j, next((where[key] for key in keys if key in where), None)) for j, keys in enumerate(run_keys)]
    shared = [(j, i) for j, i in matched if i is not None]
    if not shared:
        return False
    if earlier.get("model_sha256") == model_sha256:
        return True
    if not digests or not their_digests:
        return False
    return len(shared) == len(run_keys) and all(digests[j] == their_digests[i] for j, i in shared)


def held_out_looks(entries: Iterator[dict[str, Any]] | list[dict[str, Any]], split: str = "test") -> list[Look]:
    """Every report on `split` (the held-out split), in order, with the work between it and the look before: how
    adaptively the held-out split was used, at a glance."""
    looks: list[Look] = []
    earlier: dict[str, list[dict[str, Any]]] = {}  # fixture set -> its looks so far, in order
    every: list[dict[str, Any]] = []  # every look so far, in order
    evaluations = changes = 0
    for entry in entries:
        kind = entry.get("kind")
        if kind in ("evaluate", "compare"):
            evaluations += 1
            changes += bool(entry.get("committed")) and (kind == "compare" or entry.get("decision") == "accepted")
        elif kind == "report" and entry.get("split") == split:
            aggregates, train = entry.get("aggregates") or {}, entry.get("train_aggregates")
            model, digests = entry.get("model_sha256", ""), entry.get("prediction_digests")
            fixture_set = entry.get("fixture_set_sha256", "")
            before = earlier.setdefault(fixture_set, [])
            repeated = next(
                (e for e in every if look_repeats(e, fixture_set, model, digests, entry.get(RUN_KEYS))), None
            )
            recorded = next((e for e in reversed(before) if e.get("prediction_digests")), None)
            mape = float(aggregates.get("throughput_mape_pct", float("nan")))
            looks.append(
                Look(
                    seq=int(entry["seq"]),
                    time=str(entry.get("time", "")),
                    split=split,
                    model_sha256=model,
                    throughput_mape_pct=mape,
                    bubble_mae_pp=float(or_nan(aggregates.get("bubble_mae_pp"))),
                    gap_to_train_pp=mape - float(train["throughput_mape_pct"]) if train else None,
                    evaluations_since=evaluations,
                    changes_since=changes,
                    repeat_of=int(repeated["seq"]) if repeated is not None else None,
                    predictions_moved=predictions_moved(recorded["prediction_digests"] if recorded else None, digests),
                    gap_interval_pp=_gap_interval(entry),
                )
            )
            before.append(entry)
            every.append(entry)
            evaluations = changes = 0
    return looks


def repair(path: Path | str) -> Path | None:
    """Set an incomplete last line (an interrupted append) aside into `<ledger>.partial-<time>`; return that file.

    Complete lines are never touched; returns None when there was nothing to repair.
    """
    path = Path(path)
    with _lock(path):
        data = path.read_bytes() if path.exists() else b""
        if not data or data.endswith(b"\n"):
            return None
        keep = data.rfind(b"\n") + 1
        aside = path.with_name(f"{path.name}.partial-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S%fZ}")
        from hops_calib.files import atomic_write

        atomic_write(aside, data[keep:])
        with path.open("r+b") as handle:
            handle.truncate(keep)
            os.fsync(handle.fileno())
    return aside


def export_parquet(path: Path | str, out: Path | str) -> int:
    """Write the ledger as a Parquet table (one row per entry, aggregates flattened); returns the row count."""
    import pandas as pd

    rows = []
    for entry in read_entries(path):
        row: dict[str, Any] = {}
        for key, value in entry.items():
            if isinstance(value, dict) and key.startswith("aggregates"):
                for name, number in value.items():
                    row[f"{key}_{name}"] = number
            elif isinstance(value, (dict, list)):
                row[key] = json.dumps(value, sort_keys=True)
            else:
                row[key] = value
        rows.append(row)
    # a field whose type changed between entries (runs_moved: a count, later the ids, as JSON text) is written as
    # JSON text in every row: one Parquet column holds one type
    kinds: dict[str, set[type]] = {}
    for row in rows:
        for key, value in row.items():
            if value is not None:
                kinds.setdefault(key, set()).add(float if type(value) is int else type(value))
    mixed = {key for key, types in kinds.items() if len(types) > 1}
    for row in rows:
        for key in mixed & set(row):
            if row[key] is not None and not isinstance(row[key], str):
                row[key] = json.dumps(row[key])
    frame = pd.DataFrame(rows)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return len(frame)
