"""Model room: the time of one kernel (`hops_calib.model.kernels`) on a device, from the machine's component tables
where it has them, else from the device's datasheet through a named default curve. Pure: device constants, tables
and the term's parameters in, milliseconds out.

GEMMs. A GEMM C[M, N] (x batch) is cut into output tiles, one thread block each; the device runs them in waves
of one tile per SM (NVIDIA, "Matrix Multiplication Background User's Guide", docs.nvidia.com/deeplearning/
performance/dl-performance-matrix-multiplication, sections "Tile quantization" and "Wave quantization"). A
GEMM whose tiles leave the last wave part-empty, or whose sides are not multiples of the tile, pays for whole
tiles and whole waves: its time is waves x SMs x 2 x tile_m x tile_n x K over the device's peak, at the
achieved fraction of that peak a full tile reaches (`core efficiency`). The tile is the one of the library's
tensor-core tiles that gives the fewest padded FLOPs: 256 x 128, 128 x 256 or 128 x 128 for 16-bit types (CUTLASS's
SM80/SM90 tensor-op GEMM tiles, `cutlass/gemm/device/default_gemm_configuration.h`: 128 x 256 x 64 for
16-bit tensor ops; cuBLAS's heuristics choose among such tiles per shape), 128 x 128, 128 x 64 or 64 x 128 for
fp32/tf32 (CUTLASS's SIMT and TF32 defaults). The core efficiency comes from the device's GEMM table where
it has one: each measured shape's time, its own quantization taken out, gives the efficiency of a full tile at
that shape, and a kernel takes the efficiency of the measured shapes nearest to it (log-distance weighted over
M, N, K; a measured shape gets its measured time back). Without a table the default curve
`DEFAULT_GEMM_CURVE`: gemm_efficiency x K / (K + gemm_k_half) (a tile's main loop over K against its fixed
prologue and epilogue; an FP8 GEMM's full tile at fp8_gemm_efficiency of the FP8 peak instead), and never faster than its bytes over the achieved memory bandwidth.

Memory-bound kernels. Bytes (read + written) over the achieved bandwidth at that size: the device's memory
table for that kernel (piecewise linear in bytes between measured sizes; a table's "copy" rows stand in for a
kernel it did not measure), else `DEFAULT_MEMORY_CURVE`: kernel_latency_us + bytes / (memory_efficiency x
datasheet bandwidth).

Fused attention (flash). Its executed FLOPs at flash_efficiency of the peak (forward and backward apart;
FlashAttention-2, Dao 2023, arXiv 2307.08691: 50-73 % of A100 peak forward, lower backward), its thread blocks
(one per 128 queries of a head) in waves over the SMs, and never faster than its bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from hops_calib.model.devices import DeviceSpec
from hops_calib.model.kernels import (
    ATTENTION,
    COLLECTIVE,
    DGRAD,
    FLASH_BLOCK,
    GEMM,
    MEMORY,
    Kernel,
)
from hops_calib.trace.component_tables import ComponentTables
from hops_calib.trace.link_bench import interpolate_ms

DEFAULT_GEMM_CURVE = (
    "datasheet-gemm-1: gemm_efficiency x K / (K + gemm_k_half) of the datasheet peak, tile and wave "
    "quantized, at least bytes / (memory_efficiency x datasheet bandwidth)"
)
DEFAULT_MEMORY_CURVE = "datasheet-memory-1: kernel_latency_us + bytes / (memory_efficiency x datasheet bandwidth)"

TILES_16BIT = ((256, 128), (128, 256), (128, 128))
TILES_32BIT = ((128, 128), (128, 64), (64, 128))
NEIGHBOURS = 4  # measured shapes a GEMM's efficiency is interpolated from

# SMs per GPU where the catalog gives none (`DeviceSpec.sm_count`, when the catalog has it): NVIDIA's datasheets
# list CUDA cores, 64 per SM on GA100, 128 on GA102, AD104 and GH100 (the architecture whitepapers).
SM_COUNT_FALLBACK: Mapping[str, tuple[int, str]] = {
    "a100": (108, "NVIDIA A100 datasheet: 6,912 CUDA cores, 64 per SM (A100 architecture whitepaper: 108 SMs)"),
    "a100_40gb": (108, "NVIDIA A100 datasheet: 6,912 CUDA cores, 64 per SM (A100 architecture whitepaper: 108 SMs)"),
    "h100": (132, "NVIDIA H100 architecture whitepaper: H100 SXM5 has 132 SMs (16,896 FP32 cores, 128 per SM)"),
    "h200": (132, "NVIDIA H200 is the H100 SXM's GH100 with HBM3e: 132 SMs (H100 architecture whitepaper)"),
    "l4": (58, "NVIDIA L4 datasheet: 7,424 CUDA cores, 128 per SM on AD104: 58 SMs"),
    "a10g": (72, "NVIDIA A10 datasheet: 9,216 CUDA cores, 128 per SM on GA102: 72 SMs (the A10G is AWS's A10)"),
}


def sm_count(device: DeviceSpec) -> int | None:
    """The device's SMs (the catalog's `sm_count` where it has one, else `SM_COUNT_FALLBACK`); None for a device
    without them (a CPU: its GEMMs are priced without tile and wave quantization)."""
    given = getattr(device, "sm_count", None)
    if given:
        return int(given)
    found = SM_COUNT_FALLBACK.get(device.type)
    return found[0] if found else None


# Dense FP8 tensor peaks where the catalog gives no `peak_fp8_flops_per_s`: twice the bf16 peak on the devices with
# FP8 tensor cores (the datasheets list both, with sparsity, at a ratio of 2). Devices not listed have no FP8 tensor
# cores (A100, A10G: Ampere) and an FP8 GEMM on them is refused.
FP8_PEAK_FALLBACK: Mapping[str, str] = {
    "h100": "NVIDIA H100 datasheet, SXM column: FP8 Tensor Core 3,958 TFLOPS with sparsity, BF16 1,979: 2 x bf16",
    "h200": "NVIDIA H200 datasheet: FP8 Tensor Core 3,958 TFLOPS with sparsity, BF16 1,979: 2 x bf16",
    "l4": "NVIDIA L4 datasheet: FP8 Tensor Core 485 TFLOPS with sparsity, BF16 242: 2 x bf16",
}


def peak_flops_per_s(device: DeviceSpec, dtype: str) -> float:
    """The dense peak for a GEMM's dtype: the catalog's `peak_<dtype>_flops_per_s` where it has one, else the
    bf16 peak (the fp16 and bf16 tensor peaks are equal on every GPU of the catalog; fp32 and tf32 runs are priced
    at it too until the catalog gives their own), and for fp8 twice the bf16 peak on a device of
    `FP8_PEAK_FALLBACK` (a ValueError on a device without FP8 tensor cores)."""
    given = getattr(device, f"peak_{dtype}_flops_per_s", None)
    if given:
        return float(given)
    if dtype == "fp8":
        if device.type not in FP8_PEAK_FALLBACK:
            raise ValueError(
                f"device {device.type!r} has no FP8 tensor cores (no peak_fp8_flops_per_s in the catalog "
                f"and not one of {', '.join(FP8_PEAK_FALLBACK)}): an FP8 launch cannot run on it"
            )
        return 2.0 * float(device.peak_bf16_flops_per_s)
    return float(device.peak_bf16_flops_per_s)


@dataclass(frozen=True)
class Rates:
    """The kernel term's parameters for one device (`terms.decoder_kernels`)."""

    gemm_efficiency: float = 0.8
    fp8_gemm_efficiency: float = 0.8
    gemm_k_half: float = 64.0
    memory_efficiency: float = 0.8
    kernel_latency_us: float = 3.0
    flash_forward_efficiency: float = 0.6
    flash_backward_efficiency: float = 0.45
    use_tables: bool = True


@dataclass(frozen=True)
class Priced:
    """A kernel's time on a device and what bounds it."""

    kernel: Kernel
    ms: float
    bound: str  # "compute", "memory", "latency", "gemm table", "memory table", "collective" (priced elsewhere)
    efficiency: float | None = None  # GEMM, attention: achieved fraction of peak; memory: of the datasheet bandwidth
    waves: int | None = None
    tile: tuple[int, int] | None = None
    source: str = ""  # the table or the default curve


def _tile_and_waves(
    m: int, n: int, k: int, batch: int, sms: int | None, tiles: tuple[tuple[int, int], ...]
) -> tuple[float, tuple[int, int] | None, int | None]:
    """(FLOPs the SMs spend, tile, waves): whole tiles in whole waves over the SMs, the tile with the fewest."""
    if not sms:
        return 2.0 * batch * m * n * k, None, None
    best: tuple[float, tuple[int, int], int] | None = None
    for tm, tn in tiles:
        count = batch * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(count / sms)
        spent = waves * sms * 2.0 * tm * tn * k
        if best is None or spent < best[0]:
            best = (spent, (tm, tn), waves)
    assert best is not None
    return best


class Pricer:
    """Prices kernels on one device: its component tables (when `rates.use_tables` and it has them), else its
    datasheet through the default curves."""

    def __init__(self, device: DeviceSpec, tables: ComponentTables | None, rates: Rates) -> None:
        self.device, self.rates = device, rates
        self.tables = tables if rates.use_tables else None
        self.sms = sm_count(device)
        self._efficiency: dict[tuple[str, int, int, int], float] = {}

    def _tiles(self, dtype: str) -> tuple[tuple[int, int], ...]:
        return TILES_32BIT if dtype in ("fp32", "tf32") else TILES_16BIT

    def _bandwidth_bytes_per_ms(self) -> float:
        return self.device.memory_bandwidth_bytes_per_s * self.rates.memory_efficiency / 1e3

    def _measured_efficiency(self, dtype: str, m: int, n: int, k: int) -> float | None:
        """A full tile's achieved fraction of peak at (m, n, k), from the GEMM table's nearest measured shapes."""
        rows = self.tables.gemm_rows(dtype) if self.tables else ()
        if not rows:
            return None
        key = (dtype, m, n, k)
        if key in self._efficiency:
            return self._efficiency[key]
        peak = peak_flops_per_s(self.device, dtype)
        scored = []
        for mm, nn, kk, seconds in rows:
            spent, _, _ = _tile_and_waves(mm, nn, kk, 1, self.sms, self._tiles(dtype))
            efficiency = spent / (peak * seconds)
            distance = math.dist((math.log(m), math.log(n), math.log(k)), (math.log(mm), math.log(nn), math.log(kk)))
            scored.append((distance, efficiency))
        scored.sort()
        if scored[0][0] == 0.0:
            value = scored[0][1]
        else:
            near = scored[:NEIGHBOURS]
            weights = [1.0 / d for d, _ in near]
            value = sum(w * e for w, (_, e) in zip(weights, near)) / sum(weights)
        self._efficiency[key] = value
        return value

    def gemm(self, kernel: Kernel) -> Priced:
        spent, tile, waves = _tile_and_waves(
            kernel.m, kernel.n, kernel.k, kernel.batch, self.sms, self._tiles(kernel.dtype)
        )
        peak_per_ms = peak_flops_per_s(self.device, kernel.dtype) / 1e3
        measured = self._measured_efficiency(kernel.dtype, kernel.m, kernel.n, kernel.k)
        if measured is not None:
            ms = spent / (peak_per_ms * measured)
            return Priced(
                kernel,
                ms,
                "gemm table",
                kernel.flops / (peak_per_ms * ms),
                waves,
                tile,
                f"GEMM table of {self.device.type} ({self.tables.source if self.tables else ''})",
            )
        full_tile = self.rates.fp8_gemm_efficiency if kernel.dtype == "fp8" else self.rates.gemm_efficiency
        efficiency = full_tile * kernel.k / (kernel.k + self.rates.gemm_k_half)
        compute_ms = spent / (peak_per_ms * efficiency)
        memory_ms = kernel.bytes / self._bandwidth_bytes_per_ms()
        ms, bound = (compute_ms, "compute") if compute_ms >= memory_ms else (memory_ms, "memory")
        return Priced(kernel, ms, bound, kernel.flops / (peak_per_ms * ms), waves, tile, DEFAULT_GEMM_CURVE)

    def attention(self, kernel: Kernel) -> Priced:
        efficiency = (
            self.rates.flash_backward_efficiency if kernel.phase == DGRAD else self.rates.flash_forward_efficiency
        )
        peak_per_ms = peak_flops_per_s(self.device, kernel.dtype) / 1e3
        waves = None
        share = 1.0
        if self.sms:
            blocks = kernel.batch * math.ceil(kernel.m / FLASH_BLOCK)
            waves = math.ceil(blocks / self.sms)
            share = blocks / (waves * self.sms)
        compute_ms = kernel.flops / (peak_per_ms * efficiency * share)
        memory_ms = kernel.bytes / self._bandwidth_bytes_per_ms()
        ms, bound = (compute_ms, "compute") if compute_ms >= memory_ms else (memory_ms, "memory")
        return Priced(
            kernel,
            ms,
            bound,
            kernel.flops / (peak_per_ms * ms),
            waves,
            None,
            "flash_forward_efficiency / flash_backward_efficiency of the datasheet peak",
        )

    def memory(self, kernel: Kernel) -> Priced:
        points: tuple[tuple[float, float], ...] = ()
        if self.tables:
            points = self.tables.memory_points(kernel.kind) or self.tables.memory_points("copy")
        datasheet = self.device.memory_bandwidth_bytes_per_s / 1e3
        if points:
            ms = points[0][1] if kernel.bytes <= points[0][0] else interpolate_ms(points, kernel.bytes)
            which = kernel.kind if self.tables and self.tables.memory_points(kernel.kind) else "copy"
            return Priced(
                kernel,
                ms,
                "memory table",
                kernel.bytes / (datasheet * ms) if ms > 0 else None,
                source=f"memory table of {self.device.type}, {which} rows",
            )
        latency_ms = self.rates.kernel_latency_us / 1e3
        stream_ms = kernel.bytes / self._bandwidth_bytes_per_ms()
        ms = latency_ms + stream_ms
        return Priced(
            kernel,
            ms,
            "memory" if stream_ms >= latency_ms else "latency",
            kernel.bytes / (datasheet * ms) if ms > 0 else None,
            source=DEFAULT_MEMORY_CURVE,
        )

    def price(self, kernel: Kernel) -> Priced:
        if kernel.op == GEMM:
            return self.gemm(kernel)
        if kernel.op == ATTENTION:
            return self.attention(kernel)
        if kernel.op == MEMORY:
            return self.memory(kernel)
        if kernel.op == COLLECTIVE:
            return Priced(kernel, 0.0, "collective", source="priced by tensor_parallel_comm")
        raise ValueError(f"unknown kernel op {kernel.op!r}")

    def sources(self) -> dict[str, str]:
        """Where this device's GEMM and memory-kernel prices come from: its tables or the default curves."""
        has_gemm = bool(self.tables and self.tables.gemm)
        has_memory = bool(self.tables and self.tables.memory)
        return {
            "gemm": f"GEMM table ({self.tables.source})" if has_gemm and self.tables else DEFAULT_GEMM_CURVE,
            "memory": f"memory table ({self.tables.source})" if has_memory and self.tables else DEFAULT_MEMORY_CURVE,
        }
