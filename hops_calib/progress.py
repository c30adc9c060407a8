"""CLI helper: a progress bar on a terminal's stderr, and nothing at all when output goes to a file or a pipe."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def terminal_progress(description: str) -> Iterator[Callable[[int, int], None]]:
    """Yield a callback `(done, total)`; it draws a rich progress bar only when stderr is a terminal."""
    if not sys.stderr.isatty():
        yield lambda done, total: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update
