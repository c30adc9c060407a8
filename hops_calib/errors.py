"""Errors about user input (model files, candidates, ledgers): where, which field, what is wrong, what to do."""

from __future__ import annotations

import os


class InputError(ValueError):
    """Input that cannot be used as it is.

    The message always says where (a file or other origin, and the line when
    known), which field, what is wrong, and what the user should do about it.
    The CLI turns it into exit code 2.
    """

    def __init__(
        self,
        origin: str | os.PathLike[str],
        problem: str,
        *,
        line: int | None = None,
        field: str | None = None,
        hint: str = "",
    ) -> None:
        self.origin = str(origin)
        self.line = line
        self.field = field
        self.problem = problem
        self.hint = hint
        where = self.origin + (f":{line}" if line is not None else "")
        what = f"field '{field}': {problem}" if field else problem
        super().__init__(f"{where}: {what}" + (f"; {hint}" if hint else ""))


def given_together(choices: dict[str, bool]) -> str:
    """The start of a 'give one of ...' message saying which of the exclusive `choices` (what the user typed: a
    label per choice, True where given) were given together; empty when none was."""
    given = [label for label, on in choices.items() if on]
    if len(given) < 2:
        return ""
    return f"{' and '.join(given)} were both given: " if len(given) == 2 else f"{', '.join(given)} were all given: "


def line_of(text: str, table: str | None, key: str | None = None) -> int | None:
    """1-based line of `key` inside TOML table `[table]` (top level when None), or of the header itself.

    TOML parsers report lines only for syntax errors; this finds where a
    semantically wrong field sits, so a message can point at it.
    """
    found = _line_in_table(text, table, key)
    if found is None and table is not None and "." in table:
        # An inline table (`params = { a = 1 }`): point at the line that holds it.
        parent, inline_key = table.rsplit(".", 1)
        found = _line_in_table(text, parent, inline_key)
    return found


def _line_in_table(text: str, table: str | None, key: str | None) -> int | None:
    in_table = table is None
    for number, raw in enumerate(text.splitlines(), start=1):
        code = raw.split("#", 1)[0].strip()
        if code.startswith("["):
            in_table = code.strip("[]").strip() == table
            if in_table and key is None:
                return number
            continue
        if in_table and key is not None and "=" in code and code.split("=", 1)[0].strip().strip('"') == key:
            return number
    return None


def parse_toml(text: str, origin: str, allowed_keys: set[str] | None = None) -> dict:
    """Decode TOML text, refusing syntax errors and (when `allowed_keys` is given) unknown top-level keys."""
    import tomllib

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        import re

        # tomllib puts the place in its message only ("... (at line 3, column 5)"): lift it into file:line:
        at = re.search(r"\s*\(at line (\d+), column (\d+)\)$", str(error))
        problem = str(error)[: at.start()] + f" (column {at.group(2)})" if at else str(error)
        raise InputError(
            origin,
            f"not valid TOML: {problem}",
            line=int(at.group(1)) if at else None,
            hint="fix the syntax at the line named",
        ) from None
    unknown = sorted(set(data) - allowed_keys) if allowed_keys is not None else []
    if unknown and allowed_keys is not None:
        raise InputError(
            origin,
            f"unknown top-level key(s) {unknown}",
            line=line_of(text, None, unknown[0]) or line_of(text, unknown[0]),
            field=unknown[0],
            hint=f"expected only {sorted(allowed_keys)}",
        )
    return data


NO_SPACE_ERRNOS = frozenset({28, 122, 27})  # ENOSPC, EDQUOT, EFBIG: the disk (or the quota, or a file limit) is full


class DiskFull(InputError):
    """A write that found no space left (exit 2): it names the path, the free space there and what the write
    needed; what was half-written has been removed by the writer."""

    def __init__(self, path: object, needed: int | None = None) -> None:
        import shutil
        from pathlib import Path

        where = Path(str(path))
        probe = next((p for p in (where, *where.parents) if p.exists()), Path("."))
        try:
            free = shutil.disk_usage(probe).free
        except OSError:
            free = None
        have = f"{free / 2**20:.1f} MiB free there" if free is not None else "the free space there unknown"
        need = f", and this write needed about {needed / 2**20:.1f} MiB more" if needed else ""
        super().__init__(
            str(path),
            f"no space left on the device to write it ({have}{need}); what was half-written has been removed",
            field="disk",
            hint=f"free at least {max(needed or 0, 1 << 20) / 2**20:.1f} MiB on that file system (or "
            "write elsewhere) and run the command again",
        )


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in NO_SPACE_ERRNOS
