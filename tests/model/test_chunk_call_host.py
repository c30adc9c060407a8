"""The chunk_call_host term's CPU values, measured again from the profiled capture they cite.

experiments/scripts/chunk_call_host.py reads the Kineto traces in profiles/ and measures, for every forward_step and
backward_step call the capture traced, the host time before its first and after its last operator. The candidate
cpu-11 takes its pooled medians over both ranks of the 1F1B profile; these tests hold the script to the values the
shipped model prices with and
to what the measurement must look like (a per-call constant, well under a layer's work).
"""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "profiles" / "cpu_1f1b_l2_h256_s128_m4_prof_run1"


def script():
    spec = importlib.util.spec_from_file_location("chunk_call_host", ROOT / "experiments" / "scripts" / "chunk_call_host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_per_call_host_time_of_the_1f1b_profile_is_the_candidates_value():
    module = script()
    pooled = {"FORWARD": [], "BACKWARD": []}
    for path in sorted((PROFILE / "torch_profile").glob("rank-*.json.gz")):
        for phase, rows in module.call_overheads(path).items():
            assert len(rows) == 8  # 4 microbatches x 2 traced iterations, every call found
            pooled[phase] += [head_tail for head_tail, _ in rows]
    # the values the shipped model prices with (committed by cpu-11), read from it, not typed in
    from hops_calib.loop.model_files import load_model

    priced = load_model(None).active("chunk_call_host").params()
    assert round(statistics.median(pooled["FORWARD"]), 3) == priced["forward_ms_per_call@cpu"]
    assert round(statistics.median(pooled["BACKWARD"]), 3) == priced["backward_ms_per_call@cpu"]
    # A per-call constant of a few tenths of a ms: every call pays it, none pays a layer's worth (5-25 ms spans).
    assert all(0.05 < t < 1.0 for t in pooled["FORWARD"] + pooled["BACKWARD"])


def test_chunk_medians_read_every_rank_and_chunk_of_an_interleaved_capture():
    medians = script().chunk_medians(ROOT / "traces" / "cpu_interleaved_v2_l4_h384_s128_m6_run1")
    assert sorted({(r, c) for r, c, _ in medians}) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # the last chunk holds the output layer and loss: its forward is the longest
    assert max(medians, key=lambda k: medians[k] if k[2] == "FORWARD" else 0) == (1, 1, "FORWARD")
