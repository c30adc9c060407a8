"""Trace room: the one error type for bad cluster output, naming file, line, field and the fix."""

from __future__ import annotations

from pathlib import Path

from hops_calib.errors import InputError


class TraceError(InputError):
    """A job directory that cannot be read as it is.

    The message always says where (file, and line when there is one), which
    field, what is wrong, and what the user should do about it (the format of
    every `InputError`).
    """

    def __init__(
        self, path: Path | str, problem: str, *, line: int | None = None, field: str | None = None, hint: str = ""
    ) -> None:
        self.path = Path(path)
        super().__init__(str(self.path), problem, line=line, field=field, hint=hint)
