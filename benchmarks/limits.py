"""Benchmark: the cases of issue #32 (held-out guard, input bounds), each in a fresh process: exit, time, peak RSS.

    python benchmarks/limits.py [--out TABLE.txt] [--log-mb 64]

Builds its inputs in a temporary folder from copies of the shared runs and the published vTrain table (as
tests/loop/test_heldout_and_limits.py does), then runs `python -m hops_calib ...` per case and prints the child's exit
code, wall time and peak RSS (ru_maxrss from wait4, as benchmarks/hostile.py). The ingest rate of a training log is
measured on a log of --log-mb MB written with Megatron's own format strings (tests/megatron_log_text.py). Prints
figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from hostile import _PROBE, TIMEOUT_S  # noqa: E402

from hops_calib.shared import shared_root, shared_runs_dir  # noqa: E402


def run(args: list, cwd: Path | None = None) -> tuple[object, float, float]:
    """(exit code, wall s, peak RSS MB) of `python -m hops_calib ARGS` in a fresh process."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HOPS_CALIB_PROGRESS="")
    done = subprocess.run([sys.executable, "-c", _PROBE, str(TIMEOUT_S), sys.executable, "-m", "hops_calib",
                           *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd)
    wall, rss_kb, code = done.stdout.split()[-3:]
    return (int(code) if float(wall) <= TIMEOUT_S else "killed"), float(wall), int(rss_kb) / 1024


def vtrain(folder: Path, rows: int = 40) -> Path:
    source = shared_root() / "public-runs" / "vtrain" / "ground_truth_single.csv"
    folder.mkdir(parents=True, exist_ok=True)
    with source.open(newline="") as handle:
        table = list(csv.reader(handle))[:rows + 1]
    path = folder / "ground_truth_single.csv"
    with path.open("w", newline="") as handle:
        csv.writer(handle).writerows(table)
    shutil.copytree(source.parent / "allreduce-a100", folder / "allreduce-a100")
    return path


def megatron_log(folder: Path, megabytes: float) -> tuple[Path, int]:
    """A Megatron-LM log of about `megabytes` MB (arguments block, an iteration line and a timer block per logged
    iteration); returns it and its line count."""
    from megatron_log_text import arguments_block, megatron_lm_iteration, padded_vocab_line, timers_block
    from test_iteration_level import ARGS, _timer_values

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hops.base.yaml").write_text("hardware: {gpu: a100, gpus_per_node: 8}\n")
    args = {**ARGS, "log_interval": 1, "train_iters": 10**9}
    path = folder / "big_run1.log"
    lines = 0
    with path.open("w") as handle:
        for line in ["using world size: 2", *arguments_block(args), padded_vocab_line(50257, 50304)]:
            handle.write(line + "\n")
        k = 0
        while handle.tell() < megabytes * 1e6:
            k += 1
            block = [megatron_lm_iteration(k, args["train_iters"], k * 16, 0.4 + (k % 7) * 1e-3, throughput=171.3,
                                           batch_size=16, when=datetime(2025, 3, 2, 10, 14, 7)),
                     *timers_block("max", _timer_values(k % 5))]
            handle.write("\n".join(block) + "\n")
            lines += len(block)
    return path, lines


def shipped_path() -> Path:
    return REPO / "ledger" / "ledger.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--log-mb", type=float, default=64.0)
    options = parser.parse_args()
    shared = shared_runs_dir()
    rows = []

    def case(name: str, args: list, note: str = "") -> None:
        code, wall, rss = run(args)
        rows.append((name, code, wall, rss, note))
        print(f"{name:58s} exit {code!s:>3} {wall:7.2f} s {rss:7.1f} MB {note}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        held = tmp / "held"
        case("ingest the shared runs", ["ingest", shared, "--fixtures", held])
        ledger = tmp / "ledger.jsonl"
        case("ledger hold-out (configurations only)", ["ledger", "hold-out", "--fixtures", held, "--ledger", ledger,
                                                       "--new-ledger"])
        test_id = sorted(p.name for p in (held).iterdir() if (p / "fixture.json").is_file()
                         and '"split": "test"' in (p / "fixture.json").read_text())[0]
        forced = tmp / "forced"
        run(["ingest", shared / test_id, "--fixtures", forced, "--split", "train"])
        for name, verb in (("1-2 fixtures list (held-out run withheld)", ["fixtures", "list", "--json"]),
                           ("2 fixtures show (held-out run withheld)", ["fixtures", "show", test_id, "--json"]),
                           ("2 plot timeline --chrome (refused)", ["plot", "timeline", test_id, "--out",
                                                                  tmp / "t.png", "--chrome", tmp / "t.json"]),
                           ("2 plot parity (refused)", ["plot", "parity", "--out", tmp / "p.png"]),
                           ("2 report --split train --html (refused)", ["report", "--split", "train", "--html",
                                                                         tmp / "r.html"]),
                           ("2 evaluate (refused)", ["evaluate"])):
            case(name, [*verb, "--fixtures", forced, "--ledger", ledger])
        case("4 evaluate --ledger that does not exist (refused)", ["evaluate", "--fixtures", forced, "--ledger",
                                                                    tmp / "typo.jsonl"])
        src = tmp / "src"
        table = vtrain(src)
        case("5 ingest 40 vTrain rows", ["ingest", table, "--fixtures", tmp / "vt"])
        log, lines = megatron_log(tmp / "log", options.log_mb)
        size = log.stat().st_size / 1e6
        code, wall, rss = run(["ingest", log, "--fixtures", tmp / "logstore"])
        rows.append((f"8 ingest a {size:.0f} MB log ({lines:,} lines)", code, wall, rss,
                     f"{size / wall:.1f} MB/s, {lines / wall:,.0f} lines/s"))
        print(rows[-1], flush=True)
        crlf = tmp / "crlf"
        shutil.copytree(tmp / "log", crlf)
        (crlf / log.name).write_bytes((crlf / log.name).read_bytes().replace(b"\n", b"\r\n"))
        case(f"6 ingest the same log with CRLF line ends", ["ingest", crlf / log.name, "--fixtures", tmp / "crlfs"])
        over = tmp / "over"
        over.mkdir()
        shutil.copy(log, over / log.name)
        shutil.copy(tmp / "log" / "hops.base.yaml", over)
        with (over / log.name).open("r+b") as handle:
            handle.truncate(300 << 20)
        case("8 ingest a 300 MiB log (sparse; refused by size)", ["ingest", over / log.name, "--fixtures", tmp / "o"])
        big = tmp / "bigtable"
        shutil.copytree(src, big)
        with (big / "allreduce-a100" / "AR_GPU2_1M_1024M_LUT").open("r+b") as handle:
            handle.truncate(241 << 20)
        case("8 ingest with a 241 MB all-reduce table (refused)", ["ingest", big / table.name, "--fixtures",
                                                                   tmp / "b"])
        secret = tmp / "secret.txt"
        secret.write_text("not to be echoed\n")
        link = tmp / "linked"
        link.mkdir()
        (link / "runs.csv").symlink_to(secret)
        case("7 ingest a table linked to a password file (refused)", ["ingest", link / "runs.csv", "--fixtures",
                                                                      tmp / "l"])
        semi = tmp / "semi"
        semi.mkdir()
        (semi / "sweep.csv").write_text(table.read_text().replace(",", ";"))
        case("9 ingest a semicolon CSV (hint)", ["ingest", semi / "sweep.csv", "--fixtures", tmp / "s"])
        tiny = tmp / "tiny"
        tiny.mkdir()
        rows_ = list(csv.reader(table.open(newline="")))
        rows_[1][-1] = "1e-300"
        with (tiny / table.name).open("w", newline="") as handle:
            csv.writer(handle).writerows(rows_)
        shutil.copytree(src / "allreduce-a100", tiny / "allreduce-a100")
        case("9 ingest a vTrain row of 1e-300 ms (that row refused)", ["ingest", tiny / table.name, "--fixtures",
                                                                        tmp / "tiny_fx"])
        near = tmp / "near"
        near.mkdir()
        shutil.copy(table, near / table.name)
        shutil.copytree(src / "allreduce-a100", near / "allreduce-a100")
        near_rows = list(csv.reader((near / table.name).open(newline="")))
        for row in near_rows[1:]:
            row[-1] = repr(float(row[-1]) * 1.001)
        with (near / table.name).open("w", newline="") as handle:
            csv.writer(handle).writerows(near_rows)
        vt_ledger = tmp / "vt.jsonl"
        run(["ledger", "hold-out", "--fixtures", tmp / "vt", "--ledger", vt_ledger, "--new-ledger"])
        run(["ingest", near / table.name, "--fixtures", tmp / "near_fx", "--split", "train"])
        case("5 evaluate vTrain rows x 1.001 in train (refused)", ["evaluate", "--fixtures", tmp / "near_fx",
                                                                   "--ledger", vt_ledger])
        model = tmp / "model.toml"
        model.write_text((REPO / "hops_calib" / "model" / "models" / "baseline.toml").read_text()
                         + '\n[devices.h100]\npeak_bf16_flops_per_s = { value = 1e300, source = "typo" }\n')
        case("9 evaluate a model with a 1e300 FLOP/s device (refused)", ["evaluate", "--model", model, "--fixtures",
                                                                         REPO / "fixtures", "--ledger", shipped_path()])
        proc = tmp / "proc"
        shutil.copytree(tmp / "log", proc)
        (proc / "hops.base.yaml").write_text("hardware: {gpu: a100, gpus_per_node: 8, collective_tables: /proc}\n")
        case("9 ingest a log whose collective_tables is /proc (refused)", ["ingest", proc / log.name, "--fixtures",
                                                                           tmp / "proc_fx"])
        ansi = tmp / "ansi"
        shutil.copytree(tmp / "log", ansi)
        data = (ansi / log.name).read_bytes()
        (ansi / log.name).write_bytes(b"".join(b"\x1b[32m" + line.rstrip(b"\n") + b"\x1b[0m\n"
                                               for line in data.splitlines(keepends=True)))
        case("6 ingest the same log with ANSI colour codes", ["ingest", ansi / log.name, "--fixtures", tmp / "ansi_fx"])
        candidate = tmp / "big.toml"
        candidate.write_text('id = "big"\nhypothesis = "' + "x" * (10 << 20) + '"\ngrounding = "g"\n')
        shipped = tmp / "shipped.jsonl"
        shutil.copy(REPO / "ledger" / "ledger.jsonl", shipped)
        case("8 ledger plan with a 10 MB candidate (refused)", ["ledger", "plan", "--note", "n", "--candidate",
                                                                candidate, "--ledger", shipped])
        case("9 ledger export of the shipped ledger", ["ledger", "export", tmp / "l.parquet", "--ledger", shipped])
        case("ledger verify of the shipped ledger", ["ledger", "verify", "--ledger", shipped])
        case("9 ledger repair --json", ["ledger", "repair", "--ledger", shipped, "--json"])
    header = f"{'case (issue #32 number)':58s}  {'exit':>4}  {'time s':>7}  {'peak RSS MB':>11}  note"
    lines = [header, "-" * len(header)]
    lines += [f"{name:58s}  {code!s:>4}  {wall:7.2f}  {rss:11.1f}  {note}" for name, code, wall, rss, note in rows]
    table_text = "\n".join(lines)
    print()
    print(table_text)
    if options.out:
        options.out.write_text(table_text + "\n")


if __name__ == "__main__":
    main()
