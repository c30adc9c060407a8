"""Capture room: real Megatron-core pipeline runs on the CPU, written as cluster-style job directories.

`capture(CaptureConfig(...), out)` launches one gloo process per pipeline rank,
each pinned to its own core with one thread, runs Megatron-core's own schedule
(or torch.distributed.pipelining's, with `engine="torch"`), and writes
`megatron_trace/rank<r>.jsonl`, the stage map, `hops.base.yaml`,
`megatron_args.txt`, `manifest.yaml` and the gloo link benchmark, exactly as the
cluster job directories are laid out, so `ingest` reads them unchanged.

torch and megatron-core come with the optional `[capture]` extra; they are
imported only inside the rank processes, so the rest of hops-calib never needs them.
"""

from hops_calib.capture.config import CaptureConfig, CaptureConfigError
from hops_calib.capture.launch import CaptureError, capture

__all__ = ["CaptureConfig", "CaptureConfigError", "CaptureError", "capture"]
