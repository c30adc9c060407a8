"""Progress bars for long commands: a rich bar on a terminal, silence everywhere else.

A command that loops over many runs (ingest, evaluate, tuning) takes a
`Progress` and calls `start(total)` once it knows how much work there is and
`advance(what)` after each unit; a loop that polls a count instead (worker
processes of a study) calls `update(completed, total)`. `progress_bar(...)` gives the real bar when
stdout is a terminal (and --json was not asked for), else `QUIET`, which does
nothing: piped or captured output never carries bar characters. The bar draws
on stderr, so even on a terminal it never mixes with what a command prints.

A program driving the tool (an agent, a CI job) sees no terminal; with
`HOPS_CALIB_PROGRESS=lines` in its environment it gets plain lines on stderr
instead, `LABEL: K/N (T s) WHAT`, at most one every `LINE_EVERY_S` seconds, and
`LABEL: K/N (T s) done` when the work is done (K may stop short of N: a search
can end early), with or without --json (stdout stays the result's).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rich.progress import TaskID


def warn(line: str) -> None:
    """A line for the person running a command, on stderr like the bars (a warning, a worker's error): the rooms
    below the command layer never print, but what they notice on the way must still reach someone."""
    print(line, file=sys.stderr)


class Progress(Protocol):
    def start(self, total: int) -> None:
        """The number of units of work; call once, before the first `advance`."""

    def advance(self, what: str = "") -> None:
        """One unit done; `what` names it (a run id)."""

    def update(self, completed: int, total: int, what: str = "") -> None:
        """`completed` of `total` units are done (for loops that count rather than step); `what` names the
        stage ("": as before)."""


class _Quiet:
    def start(self, total: int) -> None:
        pass

    def advance(self, what: str = "") -> None:
        pass

    def update(self, completed: int, total: int, what: str = "") -> None:
        pass


QUIET: Progress = _Quiet()


class _RichBar:
    """A transient rich bar: it disappears when the command ends, leaving only the command's own output."""

    def __init__(self, label: str, console: Any = None) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn(label),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            transient=True,
            console=console,
        )
        self._task: TaskID | None = None

    def start(self, total: int) -> None:
        # One unit is over before a bar could be read: it would only flicker.
        if self._task is None and total > 1:
            self._bar.start()
            self._task = self._bar.add_task("", total=total)

    def advance(self, what: str = "") -> None:
        if self._task is not None:
            self._bar.update(self._task, advance=1, description=what)

    def update(self, completed: int, total: int, what: str = "") -> None:
        self.start(total)
        if self._task is not None:
            if what:
                self._bar.update(self._task, completed=completed, total=total, description=what)
            else:
                self._bar.update(self._task, completed=completed, total=total)

    def stop(self) -> None:
        if self._task is not None:
            self._bar.stop()


PROGRESS_ENV = "HOPS_CALIB_PROGRESS"
LINE_EVERY_S = 5.0


class _Lines:
    """Progress as plain stderr lines, for a reader that is a program: rate-limited, and a last line when done."""

    def __init__(self, label: str, stream: Any = None, every_s: float = LINE_EVERY_S) -> None:
        import time

        self._clock = time.monotonic
        self._label, self._stream, self._every = label, stream, every_s
        self._t0 = self._last = self._clock()
        self._done, self._total, self._what = 0, 0, ""

    def _emit(self, force: bool = False, last: bool = False) -> None:
        now = self._clock()
        if force or now - self._last >= self._every:
            self._last = now
            what = "done" if last else self._what  # the last line says so: a search may stop short of its total
            print(
                f"{self._label}: {self._done}/{self._total} ({now - self._t0:.0f} s) {what}".rstrip(),
                file=self._stream or sys.stderr,
                flush=True,
            )

    def start(self, total: int) -> None:
        self._total = total

    def advance(self, what: str = "") -> None:
        self._done, self._what = self._done + 1, what
        self._emit()

    def update(self, completed: int, total: int, what: str = "") -> None:
        self._done, self._total = completed, total
        self._what = what or self._what
        self._emit()

    def stop(self) -> None:
        if self._total > 1:
            self._emit(force=True, last=True)


def on_terminal() -> bool:
    """Whether a bar would be seen: stdout (what the user watches) and stderr (where it draws) are terminals."""
    return _isatty(sys.stdout) and _isatty(sys.stderr)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


@contextmanager
def progress_bar(
    label: str, *, total: int | None = None, quiet: bool = False, console: Any = None
) -> Iterator[Progress]:
    """A bar labelled `label` while the block runs; `QUIET` when `quiet` (--json) or stdout is not a terminal.

    `console` (a rich Console) forces a bar onto it, whatever the streams are;
    tests use it to see the bar.
    """
    if console is None and not on_terminal() and os.environ.get(PROGRESS_ENV, "") == "lines":
        lines = _Lines(label)
        try:
            if total is not None:
                lines.start(total)
            yield lines
        finally:
            lines.stop()
        return
    if quiet or (console is None and not on_terminal()):
        yield QUIET
        return
    if console is None:
        from rich.console import Console

        console = Console(stderr=True)
    bar = _RichBar(label, console)
    try:
        if total is not None:
            bar.start(total)
        yield bar
    finally:
        bar.stop()
