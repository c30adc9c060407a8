"""Job directories for tests: copies of one as someone slipping a run past the held-out guard would make them (under
another name, writable, every event's timestamps shifted), and the what-if page's GPU job recipe as written."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def readme_gpu_job(folder: Path) -> tuple[Path, str]:
    """docs/whatif.md's GPU job recipe (its shell block "A job on GPU nodes, before it runs") run as written in `folder`: the
    job directory it makes (gpt175b: 512 A100s, t 8 x p 8 x d 8 on 64 nodes) and the hops-calib calls it ends with."""
    return whatif_recipe_job(folder, "gpt175b")


def whatif_recipe_job(folder: Path, name: str) -> tuple[Path, str]:
    """docs/whatif.md's shell block that makes job `name` (gpt175b, gpt16) run as written in `folder`: the job
    directory it makes and the hops-calib calls it ends with."""
    text = (REPO / "docs" / "whatif.md").read_text(encoding="utf-8")
    start = text.index(f"mkdir -p {name} ")
    setup, _, calls = text[start:text.index("```", start)].rpartition("cd .. && ")
    subprocess.run(["bash", "-c", setup], cwd=folder, check=True)
    return folder / name, calls.strip()


def copy_job(job: Path, target: Path) -> Path:
    """`job` copied to `target` (another name), every file writable (the shared runs are read-only)."""
    shutil.copytree(job, target)
    for path in [target, *target.rglob("*")]:
        path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return target


def shifted_copy(job: Path, target: Path, shift_ns: int) -> Path:
    """`copy_job`, with every event's timestamps shifted: rank r's by shift_ns + 7 r ns (each rank's clock its own
    offset; a microsecond and a few ns, far inside ingest's clock-skew allowance)."""
    copy_job(job, target)
    for log in sorted((target / "megatron_trace").glob("rank*.jsonl")):
        lines = []
        for line in log.read_text().splitlines():
            event = json.loads(line)
            for key in ("start_wall_ns", "end_wall_ns"):
                if key in event:
                    event[key] += shift_ns + 7 * int(event["rank"])
            lines.append(json.dumps(event))
        log.write_text("\n".join(lines) + "\n")
    return target


def scaled_copy(job: Path, target: Path, factor: float) -> Path:
    """`copy_job`, with every event's time since the job's first event scaled by `factor` (1.001: a near-copy whose
    every duration is 0.1 % longer)."""
    copy_job(job, target)
    logs = sorted((target / "megatron_trace").glob("rank*.jsonl"))
    events = {log: [json.loads(line) for line in log.read_text().splitlines()] for log in logs}
    first = min(e[k] for es in events.values() for e in es for k in ("start_wall_ns",) if k in e)
    for log, es in events.items():
        for event in es:
            for key in ("start_wall_ns", "end_wall_ns"):
                if key in event:
                    event[key] = first + round((event[key] - first) * factor)
        log.write_text("\n".join(json.dumps(e) for e in es) + "\n")
    return target
