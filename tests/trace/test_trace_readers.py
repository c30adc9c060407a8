"""Trace readers on small hand-made inputs: arguments block, link benchmark fit, event log fields."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from hops_calib.spec import LinkFit, build_spec, declared_schedule_of
from hops_calib.trace import TraceError, fit_link, parse_arguments_block, parse_command_line, read_rank_events
from hops_calib.trace.job import find_job_dirs
from hops_calib.trace.link_bench import BYTES_PER_MB


def _arguments_block(args: dict) -> str:
    """A rank log as Megatron prints it: launcher noise, then the arguments between two rulers."""
    lines = ["[rank0]: using world size: 2", "------------------------ arguments ------------------------"]
    for key, value in sorted(args.items()):
        lines.append(f"  {key} {'.' * max(2, 48 - len(key))} {value}")
    lines += ["-------------------- end of arguments ---------------------", "[rank0]: building GPT model ..."]
    return "\n".join(lines) + "\n"


def test_command_line_and_arguments_block_give_the_same_spec(shared_runs, tmp_path):
    source = sorted(shared_runs.iterdir())[-1]
    job_dir = tmp_path / source.name
    shutil.copytree(source, job_dir)
    args = parse_command_line((job_dir / "megatron_args.txt").read_text())
    spec = build_spec(job_dir)
    (job_dir / "megatron_args.txt").chmod(0o644)
    (job_dir / "megatron_args.txt").unlink()
    (job_dir / "logs").mkdir()
    (job_dir / "logs" / "rank0.out").write_text(_arguments_block(args))
    again = build_spec(job_dir)
    assert again == spec


def test_arguments_block_values_are_typed():
    args = parse_arguments_block(_arguments_block(
        {"num_layers": 12, "lr": 0.0001, "bf16": True, "fp16": False, "data_path": None, "tokenizer_type":
         "NullTokenizer", "num_layers_per_virtual_pipeline_stage": 2}).splitlines())
    assert args == {"num_layers": 12, "lr": 0.0001, "bf16": True, "fp16": False, "data_path": None,
                    "tokenizer_type": "NullTokenizer", "num_layers_per_virtual_pipeline_stage": 2}
    assert parse_arguments_block(["no block here"]) is None


def test_command_line_flags_values_and_lists():
    args = parse_command_line("torchrun --nproc 2 pretrain_gpt.py --num-layers 8 --bf16 --data-path 1 a 2 b "
                              "--lr=3e-4 --virtual-pipeline-model-parallel-size 2")
    assert args == {"num_layers": 8, "bf16": True, "data_path": [1, "a", 2, "b"], "lr": 3e-4,
                    "virtual_pipeline_model_parallel_size": 2}


def test_declared_schedule_reads_template_then_name_and_ignores_interleaved_device_order():
    assert declared_schedule_of({"pipeline": {"schedule": "zero_bubble"}}, []) == "zb_h1"
    assert declared_schedule_of({}, ["exp2_10_all_nodes_gpipe_run55"]) == "gpipe"
    assert declared_schedule_of({}, ["exp2_3_interleaved_run73"]) is None


def test_link_fit_recovers_latency_and_bandwidth_and_skips_log_lines(tmp_path):
    latency_ms, bytes_per_ms = 0.05, 2.5e6
    lines = ["NCCL version 2.28.9+cuda13.0"]
    for size in (1, 2, 4, 16, 64):
        for rank, slower in ((0, 1.0), (1, 1.3)):  # the receiver's rows must not enter the fit
            p50 = (latency_ms + size * BYTES_PER_MB / bytes_per_ms) * slower
            lines.append(json.dumps({"label": "pair_0_1", "mode": "p2p", "rank": rank, "size_mb": size,
                                     "p50_ms": p50}))
        lines.append("{not json: NCCL INFO ...}")
    path = tmp_path / "pair_0_1.jsonl"
    path.write_text("\n".join(lines) + "\n")
    fit = fit_link(path, 0, 1)
    assert fit.latency_ms == pytest.approx(latency_ms) and fit.bytes_per_ms == pytest.approx(bytes_per_ms)
    path.write_text(lines[0] + "\n" + lines[1] + "\n")
    with pytest.raises(TraceError, match="1 distinct message sizes"):
        fit_link(path, 0, 1)
    # a measurement row cut short (or mangled) is not a log line: the run is refused, naming the line
    assert lines[4].startswith('{"')  # the sender's 2 MiB row
    path.write_text("\n".join(lines[:4] + [lines[4][:25]] + lines[5:]) + "\n")
    with pytest.raises(TraceError, match="not valid JSON") as caught:
        fit_link(path, 0, 1)
    assert caught.value.line == 5 and "pair_0_1.jsonl" in str(caught.value) and "re-run the link benchmark" in str(
        caught.value)


def test_link_fit_keeps_the_medians_and_reads_them_at_any_size(tmp_path):
    # Convex, as the cluster benchmarks are: small messages ride socket buffers and cost less per byte,
    # so the least-squares line has a negative intercept and, held at zero latency, over-prices them.
    p50_by_mb = {1: 0.3, 2: 1.5, 4: 3.3, 16: 13.0, 64: 52.0}  # made up, with the buffered small-message shape
    lines = [json.dumps({"mode": "p2p", "rank": 0, "size_mb": size, "p50_ms": ms}) for size, ms in p50_by_mb.items()]
    path = tmp_path / "pair_2_3.jsonl"
    path.write_text("\n".join(lines) + "\n")
    fit = fit_link(path, 2, 3)
    assert fit.latency_ms == 0.0 and "latency held at 0" in fit.source
    assert fit.points == tuple((size * BYTES_PER_MB, ms) for size, ms in sorted(p50_by_mb.items()))
    for size, ms in p50_by_mb.items():  # at a measured size: the measurement itself
        assert fit.measured_ms(size * BYTES_PER_MB) == pytest.approx(ms)
    assert fit.transfer_ms(2 * BYTES_PER_MB) > fit.measured_ms(2 * BYTES_PER_MB)  # the clamped line over-prices
    assert fit.measured_ms(3 * BYTES_PER_MB) == pytest.approx((p50_by_mb[2] + p50_by_mb[4]) / 2)  # between: linear
    assert fit.measured_ms(0.5 * BYTES_PER_MB) == pytest.approx(p50_by_mb[1] / 2)  # below: scaled, never negative
    last_slope = (p50_by_mb[64] - p50_by_mb[16]) / 48
    assert fit.measured_ms(128 * BYTES_PER_MB) == pytest.approx(p50_by_mb[64] + 64 * last_slope)  # above: last slope
    # A spec written to JSON and read back keeps the points (and equals the original).
    assert LinkFit(**json.loads(json.dumps(dataclasses.asdict(fit)))) == fit
    assert LinkFit(0, 1, 0.1, 1.0e6).measured_ms(2.0e6) == pytest.approx(2.1)  # no points: the fit


def test_burst_reading_sends_a_short_message_at_the_small_message_rate_and_the_rest_at_the_stream_rate(tmp_path):
    # A shaped link: 1 MiB passes within the allowance (0.5 ms per MiB), 2 MiB and up at the stream rate (1 ms per
    # MiB). Made-up round numbers with that shape.
    p50_by_mb = {1: 0.5, 2: 2.0, 4: 4.0, 16: 16.0, 64: 64.0}
    lines = [json.dumps({"mode": "p2p", "rank": 0, "size_mb": size, "p50_ms": ms}) for size, ms in p50_by_mb.items()]
    path = tmp_path / "pair_0_1.jsonl"
    path.write_text("\n".join(lines) + "\n")
    fit = fit_link(path, 0, 1)
    burst, stream = p50_by_mb[1], (p50_by_mb[64] - p50_by_mb[16]) / 48  # ms per MiB
    mib = BYTES_PER_MB
    assert fit.burst_ms(2 * mib, 2.5 * mib) == pytest.approx(2 * burst)  # all of it within the burst
    assert fit.burst_ms(6 * mib, 2.5 * mib) == pytest.approx(2.5 * burst + 3.5 * stream)
    assert fit.burst_ms(2 * mib, 2.5 * mib) < fit.measured_ms(2 * mib)  # cheaper than the back-to-back median
    assert fit.burst_ms(6 * mib, 0.0) == pytest.approx(6 * stream)  # no burst: the stream throughout
    # An unshaped link whose large messages run faster per byte than its smallest: never below the burst rate.
    flat = LinkFit(0, 1, 0.0, 1.0, points=((1 * mib, 0.3), (16 * mib, 3.0), (64 * mib, 12.0)))
    assert flat.burst_ms(8 * mib, 2.5 * mib) == pytest.approx(8 * 0.3)
    assert LinkFit(0, 1, 0.1, 1.0e6).burst_ms(2.0e6, 1.0e6) == pytest.approx(2.1)  # no points: the fit


def _event(**overrides):
    event = {"rank": 0, "stage": 0, "iteration": 3, "microbatch": 0, "event_type": "compute", "phase": "FORWARD",
             "start_wall_ns": 1_000_000, "end_wall_ns": 2_000_000, "duration_ms": 1.0, "device_id": "cpu0",
             "hostname": "h"}
    event.update(overrides)
    return json.dumps(event)


def test_event_reader_keeps_model_chunk_peer_stage_and_optimizer_microbatch(tmp_path):
    path = tmp_path / "rank0.jsonl"
    path.write_text("\n".join([
        _event(),
        _event(model_chunk=1, microbatch=1, start_wall_ns=3_000_000, end_wall_ns=4_000_000),
        _event(event_type="transfer", dst_device="cpu1", src_device="cpu0"),
        _event(phase="OPTIMIZER", microbatch=None, start_wall_ns=5_000_000, end_wall_ns=6_000_000),
        "",
    ]) + "\n")
    columns, report = read_rank_events(path, rank=0, pp=2, device_stage={"cpu0": 0, "cpu1": 1})
    assert report.events == 4 and report.hostname == "h" and not report.dropped
    assert columns["chunk"].tolist() == [0, 1, 0, 0]
    assert columns["peer_stage"].tolist() == [-1, -1, 1, -1]
    assert columns["microbatch"].tolist() == [0, 1, 0, -1]
    assert columns["start_ns"].dtype == np.int64


def test_job_dirs_are_found_recursively(shared_runs, tmp_path):
    runs = sorted(shared_runs.iterdir())[:2]
    for k, run in enumerate(runs):
        shutil.copytree(run, tmp_path / f"batch{k}" / "nested" / run.name)
    assert [d.name for d in find_job_dirs(tmp_path)] == [r.name for r in runs]
    assert find_job_dirs(tmp_path / "batch0" / "nested" / runs[0].name) == [
        tmp_path / "batch0" / "nested" / runs[0].name]
    with pytest.raises(TraceError, match="does not exist"):
        find_job_dirs(tmp_path / "missing")


@pytest.mark.parametrize("text, says", [
    ("a: &a [1, *a]\n", "stands inside the value it names"),
    ("a: &a [x, x]\nb: &b [*a, *a]\nc: &c [*b, *b]\nd: [*c, *c, *c]\n", None),  # a few aliases: fine
    ("x: " + "[" * 40 + "]" * 40 + "\n", "nests mappings or lists too deeply"),
])
def test_yaml_is_read_with_its_aliases_counted_and_its_depth_bounded(tmp_path, text, says):
    from hops_calib.trace.reading import load_yaml

    path = tmp_path / "manifest.yaml"
    path.write_text(text)
    if says is None:
        assert len(load_yaml(path)["d"]) == 3
        return
    with pytest.raises(TraceError, match=says) as error:
        load_yaml(path)
    assert error.value.line == 1


def test_a_pair_file_says_its_transport_by_a_field_or_nccls_own_line(tmp_path):
    """`transport` rows or NCCL's `Using network NAME` line (NCCL_DEBUG=INFO) give the link's transport, spelled as
    NCCL_NET spells it; a file naming two is refused at the line of the second; a file naming none says ''."""
    from hops_calib.trace.link_bench import fit_link, transport_name

    rows = [json.dumps({"label": "pair_0_1", "mode": "p2p", "rank": 0, "world_size": 2, "hostname": "a",
                        "size_mb": size, "p50_ms": 0.1 + size / 2.5}) for size in (1, 2, 4, 16, 64)]
    pair = tmp_path / "pair_0_1.jsonl"
    pair.write_text("NCCL version 2.28.9+cuda13.0\n" + "\n".join(rows) + "\n")
    assert fit_link(pair, 0, 1).transport == ""
    pair.write_text("\n".join(["node1:77:77 [0] NCCL INFO Using network Socket", *rows]) + "\n")
    assert fit_link(pair, 0, 1).transport == "socket"
    pair.write_text("\n".join([rows[0].replace('"mode"', '"transport": "InfiniBand", "mode"'), *rows[1:]]) + "\n")
    assert fit_link(pair, 0, 1).transport == "ib"
    pair.write_text("\n".join([*rows, "node1:77:77 [0] NCCL INFO Using network IB",
                               "node1:78:78 [0] NCCL INFO Using network Socket"]) + "\n")
    with pytest.raises(TraceError) as refused:
        fit_link(pair, 0, 1)
    assert "pair_0_1.jsonl:7" in str(refused.value) and "'socket'" in str(refused.value)
    assert [transport_name(n) for n in ("Socket", "IB", "RoCE", "AWS  Libfabric")] == ["socket", "ib", "ib",
                                                                                     "aws libfabric"]
