"""Plot room: pictures of runs and of the loop (timelines, parity plots, ledger history) and the HTML report.

Figures are built by pure functions over tables and scores (`timeline`,
`parity`, `ledger`); `commands` loads what they draw and writes the files;
`html` assembles the self-contained report. matplotlib is imported lazily
(`style.pyplot`), so importing this package costs nothing.
"""
