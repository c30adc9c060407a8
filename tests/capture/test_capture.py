"""Capture room: configuration checks, the event log schema, and tiny real 2-rank captures validated end to end."""

from __future__ import annotations

import json
import shlex
from collections import Counter, defaultdict
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml

from hops_calib.capture import CaptureConfig, CaptureConfigError, CaptureError, capture
from hops_calib.capture.events import EventLog
from hops_calib.capture.jobdir import cpu_model_name
from hops_calib.spec import TRACE_FIRST_ITERATION

# The fields of a cluster event (docs/megatron-trace-format.md) and their types.
EVENT_FIELDS = {"rank": int, "stage": int, "iteration": int, "microbatch": int, "event_type": str, "phase": str,
                "start_wall_ns": int, "end_wall_ns": int, "duration_ms": float, "device_id": str, "hostname": str}
LINK_BENCH_FIELDS = {"label", "mode", "rank", "world_size", "hostname", "size_mb", "dtype", "local_rank", "warmup",
                     "iters", "mean_ms", "p50_ms", "p99_ms", "min_ms", "max_ms", "std_ms"}


def parse_args(text: str) -> dict[str, str | None]:
    tokens = shlex.split(text)
    args: dict[str, str | None] = {}
    for k, token in enumerate(tokens):
        if token.startswith("--"):
            value = tokens[k + 1] if k + 1 < len(tokens) and not tokens[k + 1].startswith("--") else None
            args[token] = value
    return args


# ---- the host CPU (no torch needed) ----

XEON_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Processor
stepping\t: 8
cpu MHz\t\t: 2100.000
flags\t\t: fpu vme sse2 avx avx2 avx512f avx512bw amx_bf16 amx_tile avx512_bf16

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
cpu MHz\t\t: 1800.000
flags\t\t: fpu sse2
"""


def test_the_manifest_names_the_core_not_only_its_brand(tmp_path):
    """A model name may say only "AMD EPYC": the manifest records vendor, family and model numbers, clock and the
    widest vector instructions (what sets a core's FLOP rate), from the first processor's block."""
    from hops_calib.capture.jobdir import cpu_identity

    info = tmp_path / "cpuinfo"
    info.write_text(XEON_CPUINFO)
    assert cpu_identity(info) == {"vendor": "GenuineIntel", "family": 6, "model": 143, "stepping": 8,
                                  "mhz": 2100.0, "vector": "avx512f", "bf16": True, "amx": True}
    info.write_text(XEON_CPUINFO.replace(" avx512f avx512bw amx_bf16 amx_tile avx512_bf16", ""))
    assert cpu_identity(info)["vector"] == "avx2" and cpu_identity(info)["amx"] is False
    assert cpu_identity(tmp_path / "missing") == {}


# ---- configuration (no torch needed) ----

@pytest.mark.parametrize("changes, option", [
    ({"pp": 1}, "--pp"),
    ({"vp": 2, "microbatches": 3}, "--microbatches"),  # interleaved needs a multiple of pp
    ({"layers": 6, "vp": 2}, "--layers"),  # 6 layers over 4 chunks
    ({"hidden": 100, "heads": 8}, "--heads"),
    ({"engine": "jax"}, "--engine"),
    ({"schedule": "gpipe"}, "--schedule"),  # Megatron-core has no GPipe schedule function
    ({"schedule": "1f1b", "vp": 2}, "--vp"),
    ({"microbatches": 1}, "--microbatches"),
])
def test_config_rejects_what_cannot_run_naming_the_option(changes: dict, option: str) -> None:
    with pytest.raises(CaptureConfigError, match=option):
        CaptureConfig(**changes).validate()


def test_megatron_args_state_the_configuration_that_ran() -> None:
    config = CaptureConfig(pp=2, vp=2, microbatches=6, iterations=3, layers=8, hidden=256, seq=128, heads=4)
    args = parse_args(config.megatron_args())
    assert args["--pipeline-model-parallel-size"] == "2"
    assert args["--num-layers-per-virtual-pipeline-stage"] == "2"  # 8 layers / (2 ranks * 2 chunks)
    assert args["--global-batch-size"] == "6" and args["--micro-batch-size"] == "1"
    assert int(args["--train-iters"]) == 3 + TRACE_FIRST_ITERATION - 1
    assert args["--ffn-hidden-size"] == "1024"
    assert "--bf16" not in args and "--fp16" not in args  # the CPU run is fp32
    plain = parse_args(CaptureConfig(vp=1).megatron_args())
    assert "--num-layers-per-virtual-pipeline-stage" not in plain


def test_default_schedule_follows_chunks_per_rank() -> None:
    assert CaptureConfig(vp=1).resolved().schedule == "1f1b"
    assert CaptureConfig(vp=2, layers=4).resolved().schedule == "interleaved_1f1b"


def test_event_log_records_only_traced_iterations_and_chunks_when_interleaved(tmp_path: Path) -> None:
    log = EventLog(rank=1, device_ids=("cpu_a", "cpu_b"), hostname="h", with_chunks=True)
    log.compute("FORWARD", 0, 1, 10, 20)  # warm-up: not recorded
    log.begin_iteration(3)
    log.compute("FORWARD", 0, 1, 100, 2_100_000)
    log.transfer("BACKWARD", 0, 1, 0, 2_200_000, 2_300_000)
    log.compute("OPTIMIZER", 3, 0, 3_000_000, 4_000_000)
    with pytest.raises(ValueError, match="phase"):
        log.compute("FWD", 0, 0, 1, 2)
    log.write(tmp_path / "rank1.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "rank1.jsonl").read_text().splitlines()]
    assert [row["phase"] for row in rows] == ["FORWARD", "BACKWARD", "OPTIMIZER"]
    assert rows[0]["model_chunk"] == 1 and rows[1]["model_chunk"] == 1 and "model_chunk" not in rows[2]
    assert rows[1]["src_device"] == "cpu_b" and rows[1]["dst_device"] == "cpu_a"
    assert rows[0]["duration_ms"] == pytest.approx((2_100_000 - 100) / 1e6)


def test_capture_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    existing = tmp_path / "cpu_run1"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(CaptureError, match="--force"):
        capture(CaptureConfig(), existing)
    assert (existing / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("where", ["project", "store", "job", "file"])
def test_force_replaces_only_an_earlier_capture_and_never_lands_in_a_store(tmp_path: Path, repo_root: Path,
                                                                          where: str) -> None:
    """Refused before any rank starts (no torch needed), and nothing is touched."""
    import shutil

    if where == "project":  # a mistyped --out ... --force must not wipe a folder of the user's
        out = tmp_path / "project"
        (out / "src").mkdir(parents=True)
        (out / "notes.txt").write_text("mine")
        words = "holds something other than a hops-calib capture"
    elif where == "store":  # the shipped fixture store, copied
        shutil.copytree(repo_root / "fixtures", tmp_path / "fixtures")
        out = tmp_path / "fixtures" / "cpu_1f1b_l4_h512_s256_m4_run1"
        words = "inside the fixture store"
    elif where == "job":
        shutil.copytree(repo_root / "traces" / "cpu_1f1b_l4_h512_s256_m4_run1", tmp_path / "job")
        out = tmp_path / "job" / "nested_run1"
        words = "inside the job directory"
    else:
        (tmp_path / "a_file").write_text("x")
        out = tmp_path / "a_file" / "run1"
        words = "is a file, not a folder"
    before = sorted((p.relative_to(tmp_path), p.read_bytes() if p.is_file() else b"") for p in tmp_path.rglob("*"))
    with pytest.raises(CaptureError, match=words):
        capture(CaptureConfig(), out, force=True)
    assert sorted((p.relative_to(tmp_path), p.read_bytes() if p.is_file() else b"")
                  for p in tmp_path.rglob("*")) == before


def test_shapes_a_machine_cannot_hold_are_refused_naming_an_option() -> None:
    with pytest.raises(CaptureConfigError, match="--ffn-hidden: is -5"):
        CaptureConfig(ffn_hidden=-5).validate()
    with pytest.raises(CaptureConfigError, match="--hidden: this shape needs about .* GiB"):
        CaptureConfig(hidden=65536, heads=8).validate()


# ---- real captures (the [capture] extra) ----

def need_capture_extra() -> None:
    missing = [name for name in ("torch", "megatron") if find_spec(name) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not importable: install the capture extra "
                    "(pip install -e '.[capture]') to run real CPU captures")


TINY = dict(pp=2, microbatches=4, iterations=2, layers=4, hidden=64, seq=32, heads=4, vocab=512)


@pytest.fixture(scope="module")
def captured_1f1b(tmp_path_factory: pytest.TempPathFactory) -> tuple[CaptureConfig, Path]:
    need_capture_extra()
    config = CaptureConfig(vp=1, link_bench_iters=5, **TINY).resolved()
    return config, capture(config, tmp_path_factory.mktemp("capture") / "cpu_tiny_1f1b_run1")


@pytest.fixture(scope="module")
def captured_interleaved(tmp_path_factory: pytest.TempPathFactory) -> tuple[CaptureConfig, Path]:
    need_capture_extra()
    config = CaptureConfig(vp=2, link_bench=False, **TINY).resolved()
    return config, capture(config, tmp_path_factory.mktemp("capture") / "cpu_tiny_interleaved_run1")


def read_events(job: Path, rank: int) -> list[dict]:
    lines = (job / "megatron_trace" / f"rank{rank}.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda e: e["start_wall_ns"])


def backward_phases(config: CaptureConfig) -> tuple[str, ...]:
    """Zero-bubble splits each backward into its input-gradient (B) and weight-gradient (W) halves."""
    return ("BACKWARD_B", "BACKWARD_W") if config.schedule == "zb_h1" else ("BACKWARD",)


def check_job_dir(config: CaptureConfig, job: Path) -> dict[int, list[dict]]:
    """Everything a cluster job directory promises, checked on a capture; returns the events by rank."""
    stage_map = json.loads((job / "hops_trace_map.json").read_text())["stages"]
    assert sorted(stage_map) == [str(r) for r in range(config.pp)]
    template = yaml.safe_load((job / "hops.base.yaml").read_text())
    assert template["pipeline"]["schedule"] == config.schedule
    devices = {d["id"]: d for d in template["hardware"]["devices"]}
    assert set(devices) == set(stage_map.values())
    assert all(d["gpu"] == "cpu" and d["name"] == cpu_model_name() for d in devices.values())
    args = parse_args((job / "megatron_args.txt").read_text())
    assert int(args["--global-batch-size"]) == config.microbatches
    assert int(args["--train-iters"]) - (TRACE_FIRST_ITERATION - 1) == config.iterations
    assert int(args["--pipeline-model-parallel-size"]) == config.pp
    manifest = yaml.safe_load((job / "manifest.yaml").read_text())
    assert manifest["job_id"] == job.name and manifest["versions"]["torch"].startswith("2.13.0")
    assert manifest["threads_per_rank"] == [1] * config.pp
    from hops_calib.capture.jobdir import cpu_identity
    assert manifest["cpu"] == cpu_identity() and manifest["cpu"].get("vector")  # which core, not only its brand
    assert [len(cores) for cores in manifest["affinity_per_rank"]] == [1] * config.pp  # each rank pinned

    chunks = config.vp
    virtual_stages = config.pp * chunks
    events = {rank: read_events(job, rank) for rank in range(config.pp)}
    for rank, rank_events in events.items():
        assert rank_events, f"rank {rank} logged nothing"
        for event in rank_events:
            for name, kind in EVENT_FIELDS.items():
                assert isinstance(event[name], kind), (rank, name, event)
            assert event["rank"] == event["stage"] == rank
            assert event["device_id"] == stage_map[str(rank)]
            assert event["end_wall_ns"] >= event["start_wall_ns"]
            assert ("model_chunk" in event) == (chunks > 1 and event["phase"] != "OPTIMIZER")
            if event["event_type"] == "transfer":
                assert event["src_device"] == event["device_id"]
                step = 1 if event["phase"] == "FORWARD" else -1
                assert event["dst_device"] == stage_map[str((rank + step) % config.pp)]
        iterations = sorted({e["iteration"] for e in rank_events})
        assert iterations == list(range(TRACE_FIRST_ITERATION, TRACE_FIRST_ITERATION + config.iterations))
        for iteration in iterations:
            these = [e for e in rank_events if e["iteration"] == iteration]
            computes = Counter((e["phase"], e.get("model_chunk", 0), e["microbatch"])
                               for e in these if e["event_type"] == "compute")
            expected = Counter({(phase, chunk, mb): 1 for phase in ("FORWARD", *backward_phases(config))
                                for chunk in range(chunks) for mb in range(config.microbatches)})
            expected[("OPTIMIZER", 0, config.microbatches - 1)] = 1
            assert computes == expected, (rank, iteration)
            # A virtual stage k = chunk * pp + rank sends activations unless last, gradients unless first.
            sends = Counter((e["phase"], e.get("model_chunk", 0)) for e in these if e["event_type"] == "transfer")
            expected_sends = Counter()
            for chunk in range(chunks):
                k = chunk * config.pp + rank
                if k < virtual_stages - 1:
                    expected_sends[("FORWARD", chunk)] = config.microbatches
                if k > 0:
                    expected_sends[("BACKWARD", chunk)] = config.microbatches
            assert sends == expected_sends, (rank, iteration)
    check_causality(config, events)
    return events


def check_causality(config: CaptureConfig, events: dict[int, list[dict]]) -> None:
    """On one host clock: a virtual stage's forward of a microbatch starts after the previous stage's ends."""
    ends: dict[tuple, int] = {}
    starts: dict[tuple, int] = {}
    for rank, rank_events in events.items():
        for e in rank_events:
            if e["event_type"] == "compute" and e["phase"] != "OPTIMIZER":
                k = e.get("model_chunk", 0) * config.pp + rank
                ends[(e["iteration"], e["phase"], k, e["microbatch"])] = e["end_wall_ns"]
                starts[(e["iteration"], e["phase"], k, e["microbatch"])] = e["start_wall_ns"]
    last = config.pp * config.vp - 1
    input_gradient = backward_phases(config)[0]  # the half of the backward that the previous stage waits for
    for (iteration, phase, k, mb), start in starts.items():
        if phase == "FORWARD" and k > 0:
            assert start >= ends[(iteration, "FORWARD", k - 1, mb)]
        if phase == input_gradient and k < last:
            assert start >= ends[(iteration, input_gradient, k + 1, mb)]
        if phase == input_gradient:
            assert start >= ends[(iteration, "FORWARD", k, mb)]
        if phase == "BACKWARD_W":
            assert start >= ends[(iteration, "BACKWARD_B", k, mb)]


def one_f_one_b_order(pp: int, rank: int, microbatches: int) -> list[str]:
    """Textbook non-interleaved 1F1B on one rank: pp-rank-1 warm-up forwards, then one forward one backward."""
    warmup = min(pp - rank - 1, microbatches)
    order = [f"F{m}" for m in range(warmup)]
    for m in range(microbatches - warmup):
        order += [f"F{warmup + m}", f"B{m}"]
    return order + [f"B{m}" for m in range(microbatches - warmup, microbatches)]


@pytest.mark.capture
def test_1f1b_capture_writes_a_cluster_style_job_dir(captured_1f1b: tuple[CaptureConfig, Path]) -> None:
    config, job = captured_1f1b
    events = check_job_dir(config, job)
    for rank, rank_events in events.items():
        by_iteration = defaultdict(list)
        for e in rank_events:
            if e["event_type"] == "compute" and e["phase"] != "OPTIMIZER":
                by_iteration[e["iteration"]].append(f"{e['phase'][0]}{e['microbatch']}")
        for order in by_iteration.values():
            assert order == one_f_one_b_order(config.pp, rank, config.microbatches)
    bench = (job / "calibration" / "link_bench" / "pair_0_1.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in bench if line.startswith("{")]
    assert rows and all(set(row) == LINK_BENCH_FIELDS for row in rows)
    assert Counter(row["rank"] for row in rows) == {0: 5, 1: 5}
    assert all(row["min_ms"] <= row["p50_ms"] <= row["max_ms"] and row["p50_ms"] > 0 for row in rows)


@pytest.mark.capture
def test_interleaved_capture_labels_model_chunks(captured_interleaved: tuple[CaptureConfig, Path]) -> None:
    config, job = captured_interleaved
    events = check_job_dir(config, job)
    args = parse_args((job / "megatron_args.txt").read_text())
    assert int(args["--num-layers-per-virtual-pipeline-stage"]) * config.pp * config.vp == config.layers
    assert not (job / "calibration").exists()  # --no-link-bench
    manifest = yaml.safe_load((job / "manifest.yaml").read_text())
    assert manifest["schedule_function"] == "forward_backward_pipelining_with_interleaving"
    # What ran is what the arguments say: no p2p overlap (Megatron-LM's default for interleaving is overlap).
    assert manifest["overlap_p2p_comm"] is False and "--no-overlap-p2p-communication" in args
    # Interleaving: rank 0 starts chunk 1's forwards before it has run any backward.
    rank0 = [e for e in events[0] if e["iteration"] == TRACE_FIRST_ITERATION and e["event_type"] == "compute"]
    first_backward = next(k for k, e in enumerate(rank0) if e["phase"] == "BACKWARD")
    assert any(e.get("model_chunk") == 1 for e in rank0[:first_backward])


@pytest.mark.capture
def test_torch_engine_zero_bubble_splits_backward_into_input_and_weight_halves(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    need_capture_extra()
    config = CaptureConfig(engine="torch", schedule="zb_h1", link_bench=False, **TINY).resolved()
    job = capture(config, tmp_path_factory.mktemp("capture") / "cpu_tiny_zb_h1_run1")
    events = check_job_dir(config, job)
    # Zero bubble's point: the last stage runs some weight-gradient halves later than their input-gradient
    # halves, after other work, instead of right away as a plain backward would.
    last = [e for e in events[config.pp - 1] if e["iteration"] == TRACE_FIRST_ITERATION and e["event_type"] == "compute"]
    order = [(e["phase"], e["microbatch"]) for e in last]
    deferred = [mb for phase, mb in order if phase == "BACKWARD_W"
                and order.index(("BACKWARD_W", mb)) > order.index(("BACKWARD_B", mb)) + 1]
    assert deferred
    manifest = yaml.safe_load((job / "manifest.yaml").read_text())
    assert manifest["schedule_function"].endswith("ScheduleInterleavedZeroBubble")
    fixture, outcome = ingest_one(job, tmp_path_factory.mktemp("fixtures"))
    assert fixture.truth.observed_schedule == "zb_h1"
    # No Megatron flag names zero bubble: the spec takes the schedule the capture configured from its manifest.
    assert fixture.spec.schedule == "zb_h1"
    assert not [w for w in outcome.warnings if "schedule" in w]


# ---- the captures through ingest ----

def ingest_one(job: Path, store_root: Path):
    from hops_calib.store.fixture_store import FixtureStore
    from hops_calib.store.ingest import ingest

    store = FixtureStore(store_root)
    report = ingest([job], store)
    assert report.ok, [outcome.error for outcome in report.rejected]
    return store.load(job.name), report.outcomes[0]


@pytest.mark.capture
@pytest.mark.parametrize("which, schedule, vp", [("captured_1f1b", "1f1b", 1),
                                                 ("captured_interleaved", "interleaved_1f1b", 2)])
def test_ingest_reads_a_capture_and_observes_its_schedule(which: str, schedule: str, vp: int, tmp_path: Path,
                                                          request: pytest.FixtureRequest) -> None:
    config, job = request.getfixturevalue(which)
    fixture, outcome = ingest_one(job, tmp_path / "fixtures")
    assert fixture.truth.observed_schedule == schedule
    assert fixture.spec.schedule == schedule and fixture.spec.vp == vp
    assert fixture.spec.pp == config.pp and fixture.spec.microbatches == config.microbatches
    assert fixture.spec.iterations == config.iterations
    assert fixture.spec.devices == ("cpu",) * config.pp
    assert fixture.spec.device_names == (cpu_model_name(),) * config.pp
    assert fixture.spec.model.precision == "fp32"
    assert not [w for w in outcome.warnings if "schedule" in w]
    if config.link_bench:
        assert [(link.src_stage, link.dst_stage) for link in fixture.spec.links] == [(0, 1)]
    events = fixture.events
    assert set(events["chunk"].unique()) == set(range(vp))


def test_cli_capture_reports_a_bad_configuration_and_writes_nothing(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from hops_calib.cli import app

    out = tmp_path / "cpu_bad_run1"
    result = CliRunner().invoke(app, ["capture", "--out", str(out), "--vp", "2", "--microbatches", "3"])
    assert result.exit_code == 2
    assert "--microbatches" in result.output and "multiple of --pp 2" in result.output
    assert not out.exists() and not list(tmp_path.iterdir())


SHIPPED = Path(__file__).resolve().parents[2] / "traces"


@pytest.mark.parametrize("value, message", [("zigzag", "zigzag"), ("interleaved_1f1b", "model chunk")])
def test_a_bad_configured_schedule_in_the_manifest_is_refused_by_name(value: str, message: str,
                                                                      tmp_path: Path) -> None:
    import shutil

    from hops_calib.spec import build_spec
    from hops_calib.trace import TraceError

    job = tmp_path / "cpu_1f1b_l4_h512_s256_m4_run1"
    shutil.copytree(SHIPPED / job.name, job)
    assert build_spec(job).schedule == "1f1b"
    manifest = yaml.safe_load((job / "manifest.yaml").read_text())
    manifest["configured_schedule"] = value
    (job / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    with pytest.raises(TraceError, match=message) as raised:
        build_spec(job)
    assert "configured_schedule" in str(raised.value) and "manifest.yaml" in str(raised.value)


def test_shipped_traces_ingest_with_the_schedules_they_ran(tmp_path: Path) -> None:
    from hops_calib.store.fixture_store import FixtureStore
    from hops_calib.store.ingest import ingest

    store = FixtureStore(tmp_path / "fixtures")
    report = ingest([SHIPPED], store)
    assert report.ok and len(report.outcomes) >= 2
    for fixture in store.load_all():
        expected = "interleaved_1f1b" if "_interleaved_" in fixture.id else "1f1b"
        assert fixture.truth.observed_schedule == fixture.spec.schedule == expected, fixture.id
        assert fixture.spec.devices == ("cpu",) * fixture.spec.pp
        # every hop has its link fit; a one-stage run (the MoE captures, --no-link-bench) has no hop
        assert bool(fixture.spec.links) == (fixture.spec.pp > 1), fixture.id
    groups = {}
    for fixture in store.load_all():
        groups.setdefault(fixture.group, set()).add(fixture.split)
    assert all(len(splits) == 1 for splits in groups.values())  # repeats never straddle the split
