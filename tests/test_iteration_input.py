"""What a new user's own iteration-level sources get wrong, and what ingest says about it: a log cut inside a
value, a log without its vocabulary, a device type the catalog does not know, misspelled table columns, a bad row
ingested again, one configuration from two sources, and what ingest says of each new run (split, priced).

Log text is written with Megatron's format strings (tests/megatron_log_text.py cites each).
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from hops_calib.store import FixtureStore
from hops_calib.store.ingest import ingest
from hops_calib.trace.megatron_log import read_megatron_log
from tests.megatron_log_text import arguments_block, megatron_lm_iteration
from tests.test_iteration_level import A100, ARGS, _lm_log, _series


def _cut_log(path, cut_at: str) -> list[float]:
    """A Megatron-LM log of 6 intervals whose last iteration line is cut inside its elapsed time at `cut_at`
    characters after the field's colon (no newline after it: the file ends there)."""
    args = {**ARGS, "log_interval": 1, "padded_vocab_size": 50304}
    series = _series(6, seed=7)
    lines = arguments_block(args) + [megatron_lm_iteration(k + 1, 100, (k + 1) * 16, s) for k, s in enumerate(series)]
    last = lines[-1]
    lines[-1] = last[:last.index(cut_at) + len(cut_at)]
    path.write_text("\n".join(lines), encoding="utf-8")  # the file ends inside the line
    return [round(s * 1000, 1) for s in series]


def test_a_log_cut_inside_a_number_drops_its_last_line_with_a_warning(tmp_path):
    path = tmp_path / "cut_run1.log"
    full = _cut_log(path, "elapsed time per iteration (ms): 1")  # '1' of e.g. '1843.2'
    run = read_megatron_log(path, hardware=A100)
    assert run.iteration_times_ms == pytest.approx(tuple(full[2:5]))  # warm-up 1-2 dropped, and the cut line 6
    warned = [w for w in run.warnings if f"{path}:" in w and "cut" in w]
    assert warned and f"{path}:{len(arguments_block(ARGS)) + 6}:" in warned[0]


def test_a_line_without_its_closing_bar_loses_only_its_cut_field(tmp_path):
    path = tmp_path / "bar.log"
    args = {**ARGS, "log_interval": 1, "padded_vocab_size": 50304}
    series = _series(5, seed=2)
    lines = arguments_block(args)
    for k, seconds in enumerate(series):
        line = megatron_lm_iteration(k + 1, 100, (k + 1) * 16, seconds, throughput=150.0 + k)
        if k == 3:  # cut inside the throughput value, the next line goes on (two writers interleaved)
            line = line[:line.index("(TFLOP/s/GPU): ") + len("(TFLOP/s/GPU): ") + 1]
        lines.append(line)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    run = read_megatron_log(path, hardware=A100)
    assert run.iteration_times_ms == pytest.approx(tuple(round(s * 1000, 1) for s in series[2:]))
    # the cut figure ('1' of 153.0) is not among the printed throughputs: the median of 152.0 and 154.0
    assert run.reported["tflops_per_gpu"] == pytest.approx(153.0)
    assert any(f"{path}:{len(arguments_block(args)) + 4}:" in w and "last field" in w for w in run.warnings)
