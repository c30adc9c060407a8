"""Small file helpers for the rooms that do I/O: nothing half-written (rule 5)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: Path | str, data: bytes | str) -> None:
    """Write `data` to `path` through a temporary file in the same folder, then rename over it.

    A reader sees the old content or the new, never a mix; a crash leaves at
    most a stray `*.tmp` file beside it.
    """
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file private (0600); the result is an ordinary file, readable as the umask allows.
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        Path(tmp).unlink(missing_ok=True)
        from hops_calib.errors import DiskFull, is_disk_full

        if is_disk_full(error):
            raise DiskFull(path, len(payload)) from None
        raise
