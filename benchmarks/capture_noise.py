"""How noisy are CPU captures? CV of per-stage forward/backward medians across iterations and across repeated runs.

Usage (from the repository root):

    python benchmarks/capture_noise.py [JOB_DIR_OR_FOLDER ...]      # default: traces/

For every job directory it reads `megatron_trace/rank<r>.jsonl` and, per
(virtual stage, phase) of FORWARD and BACKWARD compute, takes the median
duration over the microbatches of each traced iteration; the spread of those
medians over iterations is the within-run noise. Runs whose ids differ only in
the `_run<k>` suffix are repeats of one configuration; the spread of their
whole-run medians is the run-to-run noise. Both are printed as coefficients of
variation (sample std / mean), with the load average the manifest recorded.
Nothing is asserted: this prints figures.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import yaml

_REPEAT_SUFFIX = re.compile(r"_run\d+$")
PHASES = ("FORWARD", "BACKWARD")


def job_dirs(paths: list[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if (path / "megatron_trace").is_dir():
            found.append(path)
        else:
            found.extend(sorted(p for p in path.iterdir() if (p / "megatron_trace").is_dir()))
    return found


def cv(values: list[float]) -> float:
    return statistics.stdev(values) / statistics.fmean(values) if len(values) > 1 else float("nan")


def per_iteration_medians(job: Path) -> dict[tuple[int, str], dict[int, float]]:
    """(virtual stage, phase) -> iteration -> median compute duration (ms) over that iteration's microbatches."""
    pp = len(list((job / "megatron_trace").glob("rank*.jsonl")))
    durations: dict[tuple[int, str], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in (job / "megatron_trace").glob("rank*.jsonl"):
        for line in path.read_text(encoding="utf-8").splitlines():
            event = json.loads(line)
            if event["event_type"] != "compute" or event["phase"] not in PHASES:
                continue
            virtual_stage = event.get("model_chunk", 0) * pp + event["stage"]
            durations[(virtual_stage, event["phase"])][event["iteration"]].append(event["duration_ms"])
    return {key: {it: statistics.median(ms) for it, ms in by_iteration.items()}
            for key, by_iteration in sorted(durations.items())}


def main(argv: list[str]) -> None:
    roots = [Path(arg) for arg in argv] or [Path(__file__).resolve().parent.parent / "traces"]
    jobs = job_dirs(roots)
    if not jobs:
        sys.exit(f"no job directories under {', '.join(map(str, roots))}")
    within: list[float] = []
    run_medians: dict[str, dict[tuple[int, str], list[float]]] = defaultdict(lambda: defaultdict(list))
    print("within-run noise: CV over iterations of the per-iteration median, per virtual stage and phase")
    print(f"{'run':44} {'load 1m':>7} {'stage/phase':>14} {'median ms':>10} {'CV iters':>9}")
    for job in jobs:
        manifest = yaml.safe_load((job / "manifest.yaml").read_text()) if (job / "manifest.yaml").is_file() else {}
        load = (manifest.get("load_average_before") or [float("nan")])[0]
        for (stage, phase), by_iteration in per_iteration_medians(job).items():
            medians = list(by_iteration.values())
            within.append(cv(medians))
            run_medians[_REPEAT_SUFFIX.sub("", job.name)][(stage, phase)].append(statistics.median(medians))
            print(f"{job.name:44} {load:7.2f} {f'{stage}/{phase[0]}':>14} {statistics.median(medians):10.1f} "
                  f"{cv(medians):9.3f}")
    print(f"\nwithin-run CV over all (run, stage, phase): median {statistics.median(within):.3f}, "
          f"max {max(within):.3f}, n={len(within)}")

    across: list[float] = []
    print("\nrun-to-run noise: CV across repeats of the whole-run median, per configuration, virtual stage, phase")
    for config, by_key in sorted(run_medians.items()):
        for (stage, phase), medians in sorted(by_key.items()):
            if len(medians) < 2:
                continue
            across.append(cv(medians))
            print(f"{config:44} {f'{stage}/{phase[0]}':>14} repeats={len(medians)} "
                  f"medians={', '.join(f'{m:.1f}' for m in medians)} ms CV={cv(medians):.3f}")
    if across:
        print(f"\nrun-to-run CV over all (configuration, stage, phase): median {statistics.median(across):.3f}, "
              f"max {max(across):.3f}, n={len(across)}")
    else:
        print("no configuration was captured more than once (name repeats <config>_run<k>)")


if __name__ == "__main__":
    main(sys.argv[1:])
