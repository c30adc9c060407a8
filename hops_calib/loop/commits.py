"""Committed ledger entries against the model files they wrote.

`evaluate --commit` and `compare --commit` append their entry first and write
the model file after it (so a model never changes unrecorded). A crash between
the two leaves an entry saying `committed` over a file that still holds the
model the entry was judged against. `unwritten` finds such an entry (the latest
commit into each model file, when the file holds the model before it and was
last written before the entry: a file put back by hand afterwards is newer);
`ledger verify` reports it and `ledger repair` writes the committed model when
the entry rebuilds it exactly (the candidate's text applied to the model the
file holds, or the compared model file), and otherwise says what to do.
`check_appendable`, the guard every judgement passes before it is scored,
refuses a ledger that fails `verify` or holds such an entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hops_calib.errors import InputError
from hops_calib.loop.candidate import parse_candidate
from hops_calib.loop.checkout import checkout_of, is_checkout
from hops_calib.loop.ledger import LEDGER_IN_CHECKOUT, LOCK_TIMEOUT_S, BrokenLedger, Problem, read_entries, verify
from hops_calib.loop.model_files import committed_by, load_model, write_model

if TYPE_CHECKING:
    from hops_calib.model.model import Model


@dataclass(frozen=True)
class UnwrittenCommit:
    seq: int  # the entry (and its line)
    model_file: Path
    committed_sha256: str
    held_sha256: str  # what the file holds: the model the entry was judged against
    entry: dict[str, Any]

    def message(self) -> str:
        return (
            f"entry {self.seq} committed model {self.committed_sha256[:12]} into {self.model_file}, but the file "
            f"holds {self.held_sha256[:12]}, the model the entry was judged against, and has not been written "
            "since: the write after the ledger append did not happen (interrupted); `hops-calib ledger repair` "
            "writes the committed model"
        )


def model_file(recorded: str, ledger_path: Path) -> Path:
    """The model file an entry names, in the checkout of this ledger: a relative path from the checkout's root, an
    absolute one inside another checkout (a worktree, a moved clone) at the same place in this one."""
    path = Path(recorded)
    root = ledger_path.resolve().parent.parent
    here = root if is_checkout(root) else Path.cwd()
    if not path.is_absolute():
        return here / path
    for folder in path.parents:
        if is_checkout(folder):
            return here / path.relative_to(folder)
    return path


def _commit_of(entry: dict[str, Any]) -> tuple[str | None, str | None, str | None] | None:
    """(model file as recorded, committed sha256, the other end's sha256) of a committed entry, else None."""
    if not entry.get("committed"):
        return None
    if entry.get("kind") == "evaluate":
        return entry.get("model_path"), entry.get("model_sha256_after"), entry.get("model_sha256_before")
    if entry.get("kind") == "compare":
        kept = entry.get("model_sha256_committed")
        ends = {entry.get("model_sha256_before"), entry.get("model_sha256_after")} - {kept}
        return entry.get("committed_into"), kept, next(iter(ends), None)
    return None


def unwritten(ledger_path: Path | str) -> list[UnwrittenCommit]:
    """The latest commit into each model file, when that file holds the model the commit was judged against."""
    ledger_path = Path(ledger_path)
    latest: dict[Path, tuple[dict[str, Any], str, str]] = {}
    for entry in read_entries(ledger_path):
        recorded, committed, before = _commit_of(entry) or (None, None, None)
        if recorded and committed and before:
            latest[model_file(recorded, ledger_path).resolve()] = (entry, committed, before)
    found = []
    for path, (entry, committed, before) in latest.items():
        try:
            held = load_model(path).sha256
            written_after = path.stat().st_mtime >= datetime.fromisoformat(entry["time"]).timestamp()
        except (InputError, OSError, KeyError, TypeError, ValueError):  # a file gone or broken, an entry without a
            continue  # time: nothing to tell (a broken file is named by whatever reads it)
        if held != committed and held == before and not written_after:
            found.append(UnwrittenCommit(int(entry.get("seq", 0)), path, committed, held, entry))
    return found


def unwritten_problems(ledger_path: Path | str) -> list[Any]:
    """`unwritten` as `ledger verify` problems (at the entry's line; `ledger repair` writes them)."""
    return [Problem(commit.seq, commit.message(), repairable=True) for commit in unwritten(ledger_path)]


def _rebuild(commit: UnwrittenCommit, ledger_path: Path) -> Model | None:
    """The committed model, rebuilt from the entry, or None when it cannot be rebuilt exactly."""
    entry = commit.entry
    model: Model | None
    try:
        if entry.get("kind") == "evaluate":
            text = (entry.get("candidate") or {}).get("text")
            if not isinstance(text, str):
                return None
            model = parse_candidate(text, origin=f"ledger entry {commit.seq}").apply(load_model(commit.model_file))
        else:
            ends = [entry.get("model_path"), entry.get("before_model_path")]
            model = next(
                (
                    m
                    for m in (load_model(model_file(p, ledger_path)) for p in ends if p)
                    if m.sha256 == commit.committed_sha256
                ),
                None,
            )
    except (InputError, TypeError, ValueError):
        return None
    return model if model is not None and model.sha256 == commit.committed_sha256 else None


def repair(ledger_path: Path | str) -> list[str]:
    """Write the committed model into each file an interrupted commit left unwritten (under the model file's lock,
    only if the file still holds the model before); what was done, or what to do, one line each."""
    from filelock import FileLock

    ledger_path = Path(ledger_path)
    lines = []
    for commit in unwritten(ledger_path):
        model = _rebuild(commit, ledger_path)
        if model is None:
            lines.append(
                f"{commit.message()}; it cannot be rebuilt from the entry (the compared model files "
                f"changed): restore {commit.model_file} to model {commit.committed_sha256[:12]} from a "
                "copy, or judge the change again with --commit"
            )
            continue
        with FileLock(str(commit.model_file) + ".lock", timeout=LOCK_TIMEOUT_S):
            if load_model(commit.model_file).sha256 != commit.held_sha256:
                lines.append(f"{commit.model_file} changed meanwhile: left as it is")
                continue
            write_model(commit.model_file, model, commit.entry)
        lines.append(
            f"{commit.model_file}: wrote model {commit.committed_sha256[:12]}, which ledger entry "
            f"{commit.seq} committed (the write had not happened)"
        )
    return lines


def check_appendable(path: Path | str) -> None:
    """Refuse (BrokenLedger) a ledger that fails `verify`, or whose latest commit into a model file was never
    written (`unwritten`), before a judgement is scored for it; `ledger.append` checks the chain again under its
    lock."""
    path = Path(path)
    if path.is_file() and path.stat().st_size:
        result = verify(path)
        if result.ok:
            result.problems += unwritten_problems(path)
        if not result.ok:
            raise BrokenLedger(result)


def refuse_foreign_ledger(model_path: Path | str, ledger_path: Path | str, verb: str) -> None:
    """Refuse (exit 2) a commit into a checkout's model file recorded in another ledger than that checkout's own:
    the model would change while its ledger holds no judgement of the change. A model file outside every checkout
    (a copy: --model COPY) may be committed with any ledger."""
    home = checkout_of(model_path)
    if home is None:
        return
    own = home / LEDGER_IN_CHECKOUT
    if Path(ledger_path).resolve() == own.resolve():
        return
    raise InputError(
        verb,
        f"--commit would write {model_path}, the model of the checkout {home}, but record the "
        f"judgement in {ledger_path}, not that checkout's ledger {own}: the model and its ledger would "
        "disagree",
        field="ledger",
        hint=f"commit with the checkout's own ledger (leave out --ledger, or --ledger {own}); for a "
        "trial that records nothing leave out --commit, or copy the model file out of the checkout "
        "as well and pass --model COPY",
    )


def last_commit_into(model_path: Path | str, ledger_path: Path | str) -> dict[str, Any] | None:
    """The latest committed entry of the ledger that wrote `model_path` (by the model file each entry names)."""
    ledger_path, target = Path(ledger_path), Path(model_path).resolve()
    last = None
    for entry in read_entries(ledger_path):
        recorded = (_commit_of(entry) or (None,))[0]
        if recorded and model_file(recorded, ledger_path).resolve() == target:
            last = entry
    return last


def disagreeing_models(ledger_path: Path | str) -> list[str]:
    """`ledger_disagrees` for every model file the ledger's commits wrote that is still there: what `ledger verify`
    adds as warnings (the chain can be intact while a model file was written by a commit another ledger holds)."""
    ledger_path = Path(ledger_path)
    targets: dict[Path, None] = {}
    for entry in read_entries(ledger_path):
        recorded = (_commit_of(entry) or (None,))[0]
        if recorded:
            targets[model_file(recorded, ledger_path).resolve()] = None
    return [warning for target in targets if target.is_file() for warning in ledger_disagrees(target, ledger_path)]


def ledger_disagrees(model_path: Path | str, ledger_path: Path | str | None) -> list[str]:
    """A warning when the model file was last written by a commit that is not the ledger's last commit into it
    (its header names the entry that wrote it: `model_files.committed_by`): a commit recorded in another ledger (a
    copy), or the file put back from elsewhere. The model's sha256 alone cannot tell: it hashes the whole device
    catalog, so the same model gets another sha256 when the catalog grows. Nothing for a file no commit stamped."""
    stamp = committed_by(model_path)
    if stamp is None or ledger_path is None or not Path(ledger_path).is_file():
        return []
    try:
        last = last_commit_into(model_path, ledger_path)
    except (InputError, BrokenLedger):
        return []
    seq, sha = stamp
    if last is not None and last.get("seq") == seq and last.get("entry_sha256") == sha:
        return []
    if last is None and any(e.get("seq") == seq and e.get("entry_sha256") == sha for e in read_entries(ledger_path)):
        return []  # a copy of the file that commit wrote (`--model /tmp/m.toml`), not written since: they agree
    committed = (_commit_of(last) or (None, None, None))[1] if last is not None else None
    where = (
        f"its last commit into it is entry {last.get('seq')} (model {str(committed)[:12]})"
        if last is not None
        else "it records no commit into it"
    )
    return [
        f"{model_path} was written by the commit of ledger entry {seq} (entry sha256 {sha[:12]}), which is not "
        f"the last commit into it that the ledger {ledger_path} records ({where}): the model and this ledger "
        "disagree (a commit recorded in another ledger, e.g. a --ledger copy); put the model file back (git "
        "checkout -- FILE) and judge the change with this ledger, or use the ledger that wrote it"
    ]
