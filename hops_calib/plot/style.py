"""Plot room: the look every figure shares (colour-blind-safe palette, fonts) and saving to PNG or SVG.

matplotlib is imported here, on first use, with the Agg backend: a CLI start
never pays for it, and no figure ever needs a display.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from hops_calib.errors import InputError
from hops_calib.timeline import BACKWARD, BACKWARD_B, BACKWARD_W, FORWARD, OPTIMIZER

# Okabe & Ito (2008), "Color Universal Design": distinguishable under the common colour-vision deficiencies.
OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
PHASE_COLOURS = {
    FORWARD: "#0072B2",  # blue
    BACKWARD: "#E69F00",  # orange
    BACKWARD_B: "#D55E00",  # vermillion: the input-gradient half of a split backward
    BACKWARD_W: "#CC79A7",  # reddish purple: the deferred weight-gradient half
    OPTIMIZER: "#009E73",  # bluish green
}
PHASE_LABELS = {
    FORWARD: "forward",
    BACKWARD: "backward",
    BACKWARD_B: "backward B (input grad)",
    BACKWARD_W: "backward W (weight grad)",
    OPTIMIZER: "optimizer step",
}
# Kernel classes (trace.profile.KERNEL_CLASSES) under the timeline's bars: Paul Tol's "muted" qualitative scheme
# (Tol 2021, "Colour Schemes", SRON/EPS/TN/09-002, fig. 4), also colour-blind safe, distinct from the phases'.
KERNEL_COLOURS = {
    "gemm": "#332288",
    "attention": "#88CCEE",
    "elementwise": "#44AA99",
    "norm": "#DDCC77",
    "softmax": "#CC6677",
    "communication": "#882255",
    "memcpy": "#117733",
    "optimizer": "#999933",
    "reduction": "#AA4499",
    "embedding": "#6699CC",
}
OTHER_KERNELS, OTHER_KERNEL_COLOUR = "other", "#BBBBBB"


def kernel_colour(kernel_class: str) -> str:
    return KERNEL_COLOURS.get(kernel_class, OTHER_KERNEL_COLOUR)


TRANSFER_COLOUR = "#000000"
IDLE_COLOUR = "#E4E4E4"
GUIDE_COLOUR = "#555555"
# Marker shapes repeat the colour's information, so a group stays identifiable in grey print.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")

FORMATS = {".png": "png", ".svg": "svg"}
DEFAULT_DPI = 150


def pyplot():
    """matplotlib.pyplot on the Agg backend, with the shared style applied."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "font.size": 10,
            "axes.titlesize": 11,
            "axes.labelsize": 10,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "legend.frameon": False,
            "figure.facecolor": "white",
            "savefig.facecolor": "white",
            "hatch.linewidth": 0.6,  # hatching marks a bar without hiding its number
            "svg.fonttype": "none",  # text stays text in SVG: searchable, and sharp at any zoom
            "svg.hashsalt": "hops-calib",  # stable ids: the same figure gives the same SVG bytes
        }
    )
    return plt


def image_format(out: Path | str) -> str:
    """'png' or 'svg', from the suffix of `out`; InputError naming the file otherwise."""
    suffix = Path(out).suffix.lower()
    if suffix not in FORMATS:
        raise InputError(
            out,
            f"cannot tell the image format from the suffix {suffix or '(none)'!r}",
            field="--out",
            hint="name the file *.png or *.svg",
        )
    return FORMATS[suffix]


def figure_bytes(figure: Any, fmt: str, dpi: float = DEFAULT_DPI) -> bytes:
    """The figure encoded as `fmt` ('png' or 'svg'), at its own size (no tight cropping: the size is the figure's)."""
    buffer = io.BytesIO()
    metadata = {"Software": None} if fmt == "png" else {"Date": None}  # no version or date: reproducible bytes
    figure.savefig(buffer, format=fmt, dpi=dpi, metadata=metadata)
    return buffer.getvalue()


def save_figure(figure: Any, out: Path | str, dpi: float = DEFAULT_DPI) -> Path:
    """Write the figure to `out` (PNG or SVG by suffix) atomically, close it, and return the path."""
    from hops_calib.files import atomic_write

    fmt = image_format(out)
    try:
        data = figure_bytes(figure, fmt, dpi)
    finally:
        close(figure)
    atomic_write(out, data)
    return Path(out)


def close(figure: Any) -> None:
    pyplot().close(figure)


def pixel_size(figure: Any, dpi: float = DEFAULT_DPI) -> tuple[int, int]:
    """Width and height in pixels of the PNG `figure_bytes` writes at `dpi`."""
    width, height = figure.get_size_inches()
    return round(float(width) * dpi), round(float(height) * dpi)
