"""Plain-text tables, the one layout every verb's tables share: columns as wide as their widest cell, two spaces
apart, a rule under the header."""

from __future__ import annotations

from collections.abc import Collection


def text_table(headers: list[str], rows: list[list[str]], right: Collection[int] = frozenset()) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])
