"""Trace room: the one error type for bad cluster output, naming file, line, field and the fix."""

from __future__ import annotations

from pathlib import Path


class TraceError(ValueError):
    """A job directory that cannot be read as it is.

    The message always says where (file, and line when there is one), which
    field, what is wrong, and what the user should do about it.
    """

    def __init__(self, path: Path | str, problem: str, *, line: int | None = None, field: str | None = None,
                 hint: str = "") -> None:
        self.path = Path(path)
        self.line = line
        self.field = field
        self.problem = problem
        self.hint = hint
        where = str(self.path) + (f":{line}" if line is not None else "")
        what = f"field '{field}': {problem}" if field else problem
        super().__init__(f"{where}: {what}" + (f"; {hint}" if hint else ""))
