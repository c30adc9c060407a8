"""The hops-calib tracer on an unmodified Megatron-core run (tests/plugin_run.py: 2 gloo CPU ranks, the user's own
training loop, `plugin.install` before the traced block): the documented event logs come out, per rank, and ingest."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _megatron_digest() -> str:
    import importlib.util

    spec = importlib.util.find_spec("megatron.core")
    assert spec is not None and spec.origin
    root = Path(spec.origin).parent / "pipeline_parallel"
    digest = hashlib.sha256()
    for path in sorted(root.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.mark.capture
def test_the_plugin_traces_an_unmodified_megatron_core_run(tmp_path):
    pytest.importorskip("megatron.core")
    from hops_calib.store import FixtureStore
    from hops_calib.store.ingest import ingest
    from hops_calib.trace.events import read_rank_events

    before = _megatron_digest()
    job = tmp_path / "runs" / "cpu_plugin_l2_h128_s64_m4_run1"
    iterations = 4  # 2 warm-up (untraced), 2 traced
    done = subprocess.run([sys.executable, str(REPO / "tests" / "plugin_run.py"), str(job), str(iterations)],
                          capture_output=True, text=True, timeout=900, env={"PYTHONPATH": str(REPO),
                                                                            "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert _megatron_digest() == before  # nothing of Megatron was changed on disk
    stages = json.loads((job / "hops_trace_map.json").read_text())["stages"]
    device_stage = {device: int(stage) for stage, device in stages.items()}
    for rank in (0, 1):
        columns, report = read_rank_events(job / "megatron_trace" / f"rank{rank}.jsonl", rank=rank, pp=2,
                                           device_stage=device_stage, stage=rank)
        assert not report.dropped and sorted(set(columns["iteration"].tolist())) == [3, 4]
        compute = columns["kind"] == 0
        assert compute.sum() == 2 * (2 * 4 + 1)  # per iteration: F and B of each microbatch, one optimizer step
        assert (~compute).sum() == 2 * 4  # one send per microbatch: activations from 0, gradients from 1
        cost = json.loads((job / "megatron_trace" / f"tracer.rank{rank}.json").read_text())
        assert cost["events"] == len(columns["start_ns"]) and cost["overhead_ms"] > 0
        timing = json.loads((job / f"overhead.rank{rank}.json").read_text())
        assert len(timing["plain_ms"]) == len(timing["traced_ms"]) == iterations
    store = FixtureStore(tmp_path / "fixtures")
    report = ingest([job], store, split="train")
    assert report.ok, [o.error for o in report.rejected]
    truth = store.load(job.name).truth
    assert truth.observed_schedule == "1f1b" and truth.schedule_agreement == 1.0 and truth.iterations == (3, 4)


def test_the_plugin_command_says_how_to_use_it():
    """`python -m hops_calib.capture.plugin --help` prints what it does and exits 0; bad usage exits 2 with the
    usage, what is wrong and where the help is; the script's own arguments pass through unchanged."""
    def plugin(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hops_calib.capture.plugin", *args], capture_output=True,
                              text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)

    shown = plugin("--help")
    assert shown.returncode == 0 and "--out JOB_DIR" in shown.stdout and "--trace-from N" in shown.stdout
    assert "megatron_trace/rank<r>.jsonl" in shown.stdout and "torchrun" in shown.stdout
    for args, said in ((), "required: --out"), (("--out", "x", "--", "no_such_script.py"), "is not a file"), \
            (("--out", "x", "--trace-from", "0", "s.py"), "--trace-from: '0'"), \
            (("--out", "x", "--num-layers", "2", "s.py"), "unknown option --num-layers"):
        bad = plugin(*args)
        assert bad.returncode == 2, (args, bad.stderr)
        assert bad.stderr.startswith("usage: python -m hops_calib.capture.plugin --out JOB_DIR") and said in bad.stderr
        assert "--help says more" in bad.stderr


def test_the_plugin_command_passes_the_scripts_arguments_through(tmp_path):
    """Whatever follows SCRIPT (or `--`) is the script's: its own --help and --out reach it unchanged."""
    script = tmp_path / "train.py"
    script.write_text("import json, sys\nopen(sys.argv[-1], 'w').write(json.dumps(sys.argv))\n")
    seen = tmp_path / "argv.json"
    for args in (["--out", str(tmp_path / "job"), "--", str(script), "--help", "--out", "z", str(seen)],
                 [f"--out={tmp_path / 'job'}", "--trace-from", "4", str(script), "--help", "--out", "z", str(seen)]):
        done = subprocess.run([sys.executable, "-m", "hops_calib.capture.plugin", *args], capture_output=True,
                              text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
        assert done.returncode == 0, done.stderr
        assert json.loads(seen.read_text()) == [str(script), "--help", "--out", "z", str(seen)]
        seen.unlink()
