"""predict's memory table as text (`cli.render.predict.memory_lines`), on stages built by hand: each device's capacity
in GB and GiB once, and the stages that fit with less to spare than plan's default headroom (none on a CPU)."""

from __future__ import annotations

from hops_calib.cli.render.predict import memory_lines
from hops_calib.model.memory import DEFAULT_HEADROOM_BYTES, StageMemory


def stage(k: int, device: str, total: float, capacity: float) -> StageMemory:
    return StageMemory(k, device, total / 4, total / 4, total / 4, total / 4, capacity)


def test_tight_stages_are_named_together_and_a_cpu_keeps_no_headroom():
    gib80 = 80 * 2**30
    spare = (0.5e9, 1.0e9)
    stages = [stage(0, "h100_dgx", gib80 - spare[0], gib80), stage(1, "h100_dgx", gib80 - spare[1], gib80),
              stage(2, "h100_dgx", 40e9, gib80)]
    text = "\n".join(memory_lines(stages))
    assert text.count("85.90 GB (80.00 GiB)") == 1 and "GB: 10^9 bytes; GiB: 2^30 bytes" in text
    assert (f"note: stages 0 (0.50 GB), 1 (1.00 GB) fit with that much to spare, less than the "
            f"{DEFAULT_HEADROOM_BYTES / 1e9:g} GB plan leaves") in text
    assert [s.fits_with_headroom for s in stages] == [False, False, True] and all(s.fits for s in stages)
    cpu = [stage(0, "cpu", 23.9e9, 24e9)]
    assert cpu[0].reserved_bytes == 0 and cpu[0].fits_with_headroom
    assert "note:" not in "\n".join(memory_lines(cpu)) and "cpu 24.00 GB (22.35 GiB)" in "\n".join(memory_lines(cpu))
