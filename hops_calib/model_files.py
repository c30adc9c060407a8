"""Model files on disk: the shipped device catalog and model TOMLs, read and written atomically.

The model room itself is pure; this is where its text comes from and goes to.
"""

from __future__ import annotations

from pathlib import Path

from hops_calib.errors import InputError
from hops_calib.files import atomic_write
from hops_calib.model import DeviceSpec, Model, parse_catalog, parse_model

MODEL_DIR = Path(__file__).resolve().parent / "model"
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


def load_model(path: Path | str | None = None) -> Model:
    """The model in `path`, or the shipped baseline."""
    path = Path(path) if path is not None else DEFAULT_MODEL
    return parse_model(read_text(path, "model file"), origin=str(path), catalog=load_catalog())


def write_model(path: Path | str, model: Model) -> None:
    """Write `model` to `path` atomically (temporary file, then rename)."""
    atomic_write(path, model.to_toml(load_catalog()))
