"""Where the hops-calib checkout lives: the one enclosing the current directory (`default_checkout`), the one a file
lies in (`checkout_of`), the one this package runs from (PACKAGE_CHECKOUT). A leaf: the default ledger and the
default model both come from the checkout it finds."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE_CHECKOUT = Path(__file__).resolve().parents[2]  # the checkout this package runs from (if it is one)


def is_checkout(folder: Path) -> bool:
    """Whether `folder` is the root of a hops-calib checkout (its pyproject names the project, the package is there)."""
    try:
        project = (folder / "pyproject.toml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return (folder / "hops_calib").is_dir() and re.search(r'(?m)^name\s*=\s*"hops-calib"', project) is not None


def default_checkout(start: Path | None = None) -> Path | None:
    """The hops-calib checkout enclosing `start` (default: the current directory), else the one this package runs
    from, else None: the one checkout both the default ledger and the default model come from."""
    start = (start or Path.cwd()).resolve()
    for folder in (start, *start.parents, PACKAGE_CHECKOUT):
        if is_checkout(folder):
            return folder
    return None


def checkout_of(path: Path | str) -> Path | None:
    """The hops-calib checkout a file lies in, or None."""
    for folder in Path(path).resolve().parents:
        if is_checkout(folder):
            return folder
    return None
