"""Plot room: pictures of runs and of the loop (timelines, parity plots, ledger history) and the HTML report.

Figures are built by pure functions over tables and scores (`timeline`,
`parity`, `ledger`); `images` loads what the plot verbs draw and writes the
files (the verbs themselves, which print, are `hops_calib.cli.plot`); `html` assembles the self-contained report; `chrome` writes timelines as Chrome trace JSON (Perfetto). matplotlib is imported lazily
(`style.pyplot`), so importing this package costs nothing.
"""
