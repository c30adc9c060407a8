"""The `capture` verb: record a real pipeline run on this machine's CPU cores (`hops_calib.capture`) and print the
job directory written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer


def capture_command(out: Path, force: bool, **settings: Any) -> int:
    """Capture into `out` with the CaptureConfig `settings`; 0 and the folder written, 2 on a refused configuration
    or a failed run, 130 when interrupted (nothing written)."""
    from hops_calib.capture import CaptureConfig, CaptureConfigError, CaptureError
    from hops_calib.capture import capture as run_capture

    config = CaptureConfig(**settings)
    try:
        written = run_capture(config, out, force=force)
    except (CaptureConfigError, CaptureError) as err:
        typer.echo(f"capture: {err}", err=True)
        return 2
    except KeyboardInterrupt:
        typer.echo(f"capture: interrupted; nothing was written at {out} (the ranks and their staging folder are "
                   "gone), run the same command again to capture", err=True)
        return 130
    typer.echo(str(written))
    return 0
