"""Model files on disk: the shipped device catalog and model TOMLs, read and written atomically.

The model room itself is pure; this is where its text comes from and goes to.
"""

from __future__ import annotations

import re
from pathlib import Path

from hops_calib.errors import InputError
from hops_calib.files import atomic_write
from hops_calib.loop.checkout import PACKAGE_CHECKOUT, default_checkout
from hops_calib.model import DeviceSpec, Model, parse_catalog, parse_model

MODEL_DIR = Path(__file__).resolve().parent.parent / "model"
CATALOG_PATH = MODEL_DIR / "devices.toml"
SHIPPED_MODELS = MODEL_DIR / "models"
DEFAULT_MODEL = SHIPPED_MODELS / "baseline.toml"


def read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(path, f"{what} not found", hint="check the path") from None
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(path, f"cannot read {what}: {error}") from None


def load_catalog(path: Path = CATALOG_PATH) -> dict[str, DeviceSpec]:
    return parse_catalog(read_text(path, "device catalog"), origin=str(path))


def device_types() -> frozenset[str]:
    """The device types of the shipped catalog, which every model knows (a model file may add, never remove)."""
    return frozenset(load_catalog())


def default_model() -> Path:
    """The model the verbs use without --model: the shipped baseline of the checkout whose ledger they use
    (`hops_calib.loop.checkout.default_checkout`: the one enclosing the current directory, else the package's), so
    model and ledger always come from the same checkout; the package's own when there is no checkout."""
    checkout = default_checkout()
    if checkout is not None and checkout != PACKAGE_CHECKOUT:
        inside = checkout / DEFAULT_MODEL.relative_to(MODEL_DIR.parent.parent)
        if inside.is_file():
            return inside
    return DEFAULT_MODEL


def load_model(path: Path | str | None = None) -> Model:
    """The model in `path`, or the default one (`default_model`)."""
    path = Path(path) if path is not None else default_model()
    return parse_model(read_text(path, "model file"), origin=str(path), catalog=load_catalog())


def write_model(path: Path | str, model: Model, entry: dict | None = None) -> None:
    """Write `model` to `path` atomically (temporary file, then rename). `entry`: the ledger entry committing it,
    named in the header (`COMMITTED_HEADER`) so that `ledger_disagrees` can tell a file some other ledger wrote."""
    text = model.to_toml(load_catalog())
    if entry is not None:
        found = WRITTEN_HEADER.search(text)
        line = f"\n# committed by ledger entry {entry['seq']}, entry sha256 {entry['entry_sha256']}"
        text = text[: found.end()] + line + text[found.end() :] if found else text
    atomic_write(path, text)


WRITTEN_HEADER = re.compile(r"(?m)^# model sha256 when written: ([0-9a-f]{64})[ \t]*$")
COMMITTED_HEADER = re.compile(r"(?m)^# committed by ledger entry (\d+), entry sha256 ([0-9a-f]{64})[ \t]*$")


def committed_by(path: Path | str) -> tuple[int, str] | None:
    """(seq, entry sha256) of the ledger entry the model file's header names as having written it, or None."""
    try:
        found = COMMITTED_HEADER.search(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return None
    return (int(found.group(1)), found.group(2)) if found else None


def edited_since_written(path: Path | str, model: Model) -> str | None:
    """A warning when the model file's header (written with it by `evaluate --commit` / `compare --commit`) names
    another model than the file now holds: it was edited by hand since it last went through the gate. None when
    they agree, or when the file has no such header (never written by the tools)."""
    try:
        found = WRITTEN_HEADER.search(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return None
    if found is None or found.group(1) == model.sha256:
        return None
    return (
        f"{path}: the model (sha256 {model.sha256[:12]}) differs from the one last written through the gate "
        f"({found.group(1)[:12]}, its '# model sha256 when written' header): it was edited by hand since, and "
        "the ledger holds no judgement of that edit; undo it, or propose the change as a candidate"
    )
