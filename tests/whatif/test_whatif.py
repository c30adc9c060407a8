"""What-if: `predict --job DIR` and `plot timeline --job DIR` on configurations that have not run.

The repository's own CPU captures stand in for a configuration: copied without their event logs, they must
predict exactly what the ingested fixture predicts (the configuration is all a prediction sees), and an edited
copy must move the prediction the way the edit says.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.loop.model_files import load_model
from hops_calib.loop.suite import open_store
from hops_calib.model.predict import predict
from hops_calib.plot.timeline import figure_size

REPO = Path(__file__).resolve().parents[2]
RUN = "cpu_1f1b_l4_h512_s256_m4_run1"  # train split of the shipped CPU captures
INTERLEAVED = "cpu_interleaved_v2_l8_h512_s256_m4_run1"


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def configuration_only(tmp_path: Path, run: str = RUN) -> Path:
    """A copy of a shipped capture's job directory without its event logs: a run that has not happened."""
    job = tmp_path / run
    shutil.copytree(REPO / "traces" / run, job, ignore=shutil.ignore_patterns("megatron_trace"))
    assert not (job / "megatron_trace").exists()
    return job


def predict_job(*args) -> dict:
    result = cli("predict", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_a_configuration_without_traces_predicts_what_its_fixture_predicts(tmp_path):
    out = predict_job("--job", configuration_only(tmp_path))
    fixture = open_store(REPO / "fixtures").load(RUN)
    expected = predict(fixture.spec, load_model(None))
    [got] = out["predictions"]
    assert got["asked"] == got["schedule"] == fixture.spec.schedule
    assert got["throughput_per_s"] == pytest.approx(expected.metrics.throughput_per_s, rel=1e-12)
    assert got["bubble_ratio"] == pytest.approx(expected.metrics.bubble_ratio, rel=1e-12)
    assert [s["forward_ms"] for s in got["stages"]] == pytest.approx(
        [row.forward_ms for row in expected.stage_phase_ms(fixture.spec)])
    assert out["configuration"]["devices"] == list(fixture.spec.devices)
    # the CPU captures meet no random stall: the range is the prediction itself
    assert got["stall_throughput_range"] == pytest.approx(
        {"low_per_s": expected.metrics.throughput_per_s, "high_per_s": expected.metrics.throughput_per_s, "share": 1.0})


def test_an_edited_configuration_moves_the_prediction_as_the_edit_says(tmp_path):
    job = configuration_only(tmp_path)
    before = predict_job("--job", job)["predictions"][0]
    args = job / "megatron_args.txt"
    text = args.read_text()
    assert "--global-batch-size 4" in text
    args.write_text(text.replace("--global-batch-size 4", "--global-batch-size 16"))
    after = predict_job("--job", job)
    assert after["configuration"]["microbatches"] == 16
    # Four times the microbatches between two flushes: the pipeline's fill and drain weigh less.
    assert after["predictions"][0]["bubble_ratio"] < before["bubble_ratio"]
    assert after["predictions"][0]["throughput_per_s"] > before["throughput_per_s"]


def test_the_stall_rows_show_where_a_random_stall_is_priced(shared_runs):
    """A cluster run whose ends' all-reduce risks TCP retransmission stalls prints the stall rows; one that risks
    none prints none (their +- 0.0 % said nothing)."""
    seen = set()
    for run in sorted(d for d in shared_runs.iterdir() if d.name.startswith(("exp1_1", "exp2_6"))):
        out = predict_job("--job", run)
        stalls = any(p["stall_noise_ape_pct"] > 0 for p in out["predictions"])
        text = cli("predict", "--job", run).output
        assert ("random stalls: +-" in text) == stalls and ("share of runs in it" in text) == stalls, run.name
        seen.add(stalls)
    assert seen == {True, False}


def test_a_what_if_prices_each_hop_by_the_hosts_at_its_ends(shared_runs, tmp_path):
    run = next(d for d in sorted(shared_runs.iterdir()) if d.name.startswith("exp2_15"))  # an H100 and an A10G
    job = tmp_path / run.name
    shutil.copytree(run, job, ignore=shutil.ignore_patterns("megatron_trace"))
    for path in [job, *job.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    before = predict_job("--job", job)["links"]
    assert [(link["src_stage"], link["dst_stage"], link["source"].split(":")[0]) for link in before] == \
        [(0, 1, "pair_0_1.jsonl")]
    stage_map = job / "hops_trace_map.json"
    stages = json.loads(stage_map.read_text())["stages"]
    stage_map.write_text(json.dumps({"stages": {"0": stages["1"], "1": stages["0"]}}))  # the devices swapped
    refused = cli("predict", "--job", job)  # the template still has the old order: the two must agree
    assert refused.exit_code == 2 and "field 'pipeline.stages'" in refused.output
    assert "--cluster" in " ".join(refused.output.split())
    import yaml

    template_file = job / "hops.base.yaml"
    template = yaml.safe_load(template_file.read_text())
    template["pipeline"]["stages"].reverse()
    template_file.write_text(yaml.safe_dump(template))
    # without a cluster, the hosts can only come from the benchmark's positions: said so
    alone = cli("predict", "--job", job, "--cluster", tmp_path / "none.yaml")
    assert alone.exit_code == 2 and "none.yaml" in alone.output
    after = cli("predict", "--job", job)
    assert after.exit_code == 0 and "no cluster given" in " ".join(after.output.split())
    # with the cluster of the shared runs, the hop runs from the A10G's host to the H100's: the pair the
    # benchmark measured the other way round (H100 -> A10G) is not what prices it
    cluster = tmp_path / "cluster.yaml"
    assert cli("cluster", shared_runs, "--out", cluster).exit_code == 0
    hop = predict_job("--job", job, "--cluster", cluster)["links"][0]
    assert hop["hosts"] == list(reversed(before[0]["hosts"]))
    assert hop["devices"] == list(reversed(before[0]["devices"]))
    assert "cluster benchmark" in hop["source"] and hop["source"].startswith("cluster benchmark " + hop["hosts"][0])


def test_schedules_side_by_side_and_what_they_hold_in_flight(tmp_path):
    job = configuration_only(tmp_path)
    out = predict_job("--job", job, "--schedule", "1f1b", "--schedule", "gpipe", "--schedule", "zb_h1",
                      "--schedule", "auto")
    by = {p["asked"]: p for p in out["predictions"]}
    assert list(by) == ["1f1b", "gpipe", "zb_h1", "auto"]
    microbatches, pp = out["configuration"]["microbatches"], out["configuration"]["pp"]
    peak = "peak_activations_stage_microbatches"
    assert max(by["gpipe"][peak]) == microbatches  # all forwards before any backward
    assert max(by["1f1b"][peak]) == min(pp, microbatches)
    assert by["auto"]["schedule"] in ("1f1b", "gpipe", "zb_h1")
    text = cli("predict", "--job", job, "--schedule", "1f1b", "--schedule", "auto").output
    assert f"auto: {by['auto']['schedule']}" in text
    # the stall rows show where a random stall is priced, and only there
    stalls = any(p["stall_noise_ape_pct"] > 0 for p in out["predictions"])
    assert ("random stalls: +-" in text) == stalls and ("range from stalls" in text) == stalls


@pytest.mark.parametrize("args,field", [
    (["--schedule", "pipedream"], "--schedule"),
    (["--schedule", "interleaved_1f1b"], "--schedule"),
])
def test_a_schedule_the_configuration_cannot_run_is_refused_by_name(tmp_path, args, field):
    result = cli("predict", "--job", configuration_only(tmp_path), *args)
    assert result.exit_code == 2 and field in result.output


def test_interleaved_configurations_predict_under_their_own_schedule(tmp_path):
    out = predict_job("--job", configuration_only(tmp_path, INTERLEAVED), "--schedule", "interleaved_1f1b")
    assert out["configuration"]["vp"] == 2 and out["predictions"][0]["schedule"] == "interleaved_1f1b"


def test_what_if_refuses_ambiguous_or_incomplete_requests(tmp_path):
    job = configuration_only(tmp_path)
    assert cli("predict", RUN, "--job", job, "--fixtures", REPO / "fixtures").exit_code == 2
    assert "--schedule applies to --job" in cli("predict", RUN, "--schedule", "gpipe", "--fixtures",
                                                REPO / "fixtures").output
    assert cli("predict", "--job", tmp_path / "nowhere").exit_code == 2
    shutil.rmtree(job / "calibration")
    result = cli("predict", "--job", job)
    assert result.exit_code == 2 and "configuration" in result.output and "link_bench" in result.output
    (job / "megatron_args.txt").unlink()
    result = cli("predict", "--job", job)
    assert result.exit_code == 2 and "megatron_args.txt" in result.output


def test_what_if_timeline_draws_one_predicted_panel_per_schedule(tmp_path):
    job = configuration_only(tmp_path)
    out = tmp_path / "whatif.png"
    result = cli("plot", "timeline", "--job", job, "--schedule", "1f1b", "--schedule", "gpipe", "--schedule", "zb_h1",
                 "--out", out, "--dpi", 50)
    assert result.exit_code == 0, result.output
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width_in, height_in = figure_size(2, panels=3)
    assert struct.unpack(">II", data[16:24]) == (int(round(width_in * 50)), int(round(height_in * 50)))
    assert cli("plot", "timeline", "--out", out).exit_code == 2  # neither a fixture nor a job


def test_a_what_if_says_where_it_leaves_the_calibration_runs(tmp_path):
    store = open_store(REPO / "fixtures")
    train = [store.load(i).spec for i in store.ids("train")]
    job = configuration_only(tmp_path)
    inside = predict_job("--job", job, "--fixtures", REPO / "fixtures")
    assert inside["extrapolations"] == [] and f"{len(train)} runs" in inside["calibration"]
    assert "within the calibration runs' coverage" in cli("predict", "--job", job, "--fixtures",
                                                          REPO / "fixtures").stdout
    # More microbatches than any calibration run had: named, with the range the runs had.
    args = job / "megatron_args.txt"
    args.write_text(args.read_text().replace("--global-batch-size 4", "--global-batch-size 64"))
    low, high = min(s.microbatches for s in train), max(s.microbatches for s in train)
    assert high < 64
    out = predict_job("--job", job, "--fixtures", REPO / "fixtures")
    flagged = {e["feature"]: e for e in out["extrapolations"]}
    assert flagged["microbatches"]["value"] == "64"
    assert flagged["microbatches"]["calibrated"] == (f"{low}" if low == high else f"{low}-{high}")
    text = cli("predict", "--job", job, "--fixtures", REPO / "fixtures").stdout
    assert "outside the calibration runs" in text and "microbatches 64" in text
    # No store to compare with: the prediction still comes, and says the coverage was not checked.
    unchecked = predict_job("--job", job, "--fixtures", tmp_path / "nowhere")
    assert unchecked["extrapolations"] is None and "no fixture store" in unchecked["calibration"]


# --- launch settings the cost model does not price -------------------------------------------------------------------

def _add_flags(job: Path, old: str, new: str) -> None:
    args = job / "megatron_args.txt"
    text = args.read_text()
    assert old in text
    args.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize("old,new,flags,modelled", [
    ("--micro-batch-size 1", "--micro-batch-size 1 --context-parallel-size 2", ["--context-parallel-size 2"],
     "context parallel size 1"),
    ("--micro-batch-size 1", "--micro-batch-size 1 --num-experts 8 --moe-token-dispatcher-type flex "
     "--multi-latent-attention", ["--moe-token-dispatcher-type flex", "--multi-latent-attention"],
     "the alltoall or allgather token dispatcher"),
    ("--micro-batch-size 1", "--micro-batch-size 1 --normalization Foo --position-embedding-type none",
     ["--normalization Foo", "--position-embedding-type none"], "LayerNorm or RMSNorm"),
    ("--transformer-impl local", "--transformer-impl inference_optimized",
     ["--transformer-impl inference_optimized"], "--transformer-impl local|transformer_engine"),
    ("--micro-batch-size 1", "--micro-batch-size 1 --fp8-format hybrid --tp-comm-overlap",
     ["--fp8-format hybrid", "--tp-comm-overlap"], "with --transformer-impl transformer_engine"),
])
def test_a_launch_with_settings_the_model_does_not_price_is_refused_naming_file_line_and_flag(
        tmp_path, old, new, flags, modelled):
    job = configuration_only(tmp_path)
    _add_flags(job, old, new)
    result = cli("predict", "--job", job, "--fixtures", REPO / "fixtures")
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    field = flags[0].split()[-1] if flags[0].startswith("no ") else flags[0].split()[0]
    # the line naming the flag; a flag the launch lacks has none: the file and the flag are named
    where = f"{job / 'megatron_args.txt'}" + ("" if flags[0].startswith("no ") else ":1")
    assert f"{where}: field '{field}'" in message
    assert "does not model" in message and all(flag in message for flag in flags) and modelled in message
    assert "within the calibration runs' coverage" not in message and "throughput" not in message
    # plot timeline reads the same launch and refuses it the same way, before drawing anything
    out = tmp_path / "refused.png"
    assert cli("plot", "timeline", "--job", job, "--out", out).exit_code == 2 and not out.exists()


def test_the_walkthroughs_cluster_run_with_context_parallelism_is_refused(shared_runs, tmp_path):
    job = tmp_path / "j"
    shutil.copytree(shared_runs / "exp2_7_batch12_run127", job, ignore=shutil.ignore_patterns("megatron_trace"))
    for path in [job, *job.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)
    assert predict_job("--job", job)["predictions"]
    _add_flags(job, "--tensor-model-parallel-size 1", "--tensor-model-parallel-size 1 --context-parallel-size 2")
    result = cli("predict", "--job", job)
    assert result.exit_code == 2 and "field '--context-parallel-size'" in result.output


def test_interleaved_launches_price_megatrons_default_overlapped_p2p(tmp_path):
    # Without --no-overlap-p2p-communication Megatron-LM overlaps the interleaved schedule's p2p calls with compute:
    # priced as such (the steady state's transfers run under the next task), never slower on this CPU capture
    # whose hops cost little next to its tasks.
    job = configuration_only(tmp_path, INTERLEAVED)
    [blocking] = predict_job("--job", job)["predictions"]
    _add_flags(job, "--no-overlap-p2p-communication ", "")
    [overlapped] = predict_job("--job", job)["predictions"]
    assert overlapped["schedule"] == blocking["schedule"] == "interleaved_1f1b"
    assert overlapped["throughput_per_s"] >= blocking["throughput_per_s"]
    assert overlapped["throughput_per_s"] != blocking["throughput_per_s"]


@pytest.mark.parametrize("flags,field", [
    ("--overlap-p2p-communication-warmup-flush", "--overlap-p2p-communication-warmup-flush"),
    ("--batch-p2p-comm", "--batch-p2p-comm"),  # with overlap on: Megatron refuses both at once
])
def test_what_stays_refused_of_the_p2p_settings_names_its_flag(tmp_path, flags, field):
    job = configuration_only(tmp_path, INTERLEAVED)
    _add_flags(job, "--no-overlap-p2p-communication ", flags + " ")
    result = cli("predict", "--job", job)
    assert result.exit_code == 2 and f"field '{field}'" in result.output


def test_batched_blocking_p2p_is_priced_as_blocking(tmp_path):
    # batch_isend_irecv posts a call's sends and receives together and waits on all, as the unbatched calls do.
    job = configuration_only(tmp_path, INTERLEAVED)
    before = predict_job("--job", job)["predictions"]
    _add_flags(job, "--no-overlap-p2p-communication ", "--no-overlap-p2p-communication --batch-p2p-comm ")
    assert predict_job("--job", job)["predictions"] == before


def test_settings_that_do_not_change_the_cost_are_accepted_and_change_nothing(tmp_path):
    job = configuration_only(tmp_path)
    before = predict_job("--job", job)["predictions"]
    _add_flags(job, "--seed 1234", "--seed 7 --save /ckpt/run --load /ckpt/run --tensorboard-dir /tb "
                                   "--log-timers-to-tensorboard --exit-interval 100 --wandb-project p "
                                   "--num-query-groups 8 --tensor-model-parallel-size 1")
    assert predict_job("--job", job)["predictions"] == before


def test_every_shipped_and_shared_launch_is_one_the_model_prices(shared_runs):
    from hops_calib.spec import unmodelled
    from hops_calib.trace import find_arguments
    from hops_calib.trace.job import find_job_dirs

    jobs = [*find_job_dirs(REPO / "traces"), *find_job_dirs(shared_runs)]
    assert len(jobs) >= 8 + 56
    for job in jobs:
        args, _ = find_arguments(job)
        assert unmodelled(args) == [], job
    store = open_store(REPO / "fixtures")
    assert all(unmodelled(store.load(i).spec.megatron_args) == [] for i in store.ids())


def _block(args: dict) -> str:
    lines = ["[rank0]: using world size: 2", "------------------------ arguments ------------------------"]
    lines += [f"  {key} {'.' * max(2, 48 - len(key))} {value}" for key, value in sorted(args.items())]
    return "\n".join(lines + ["-------------------- end of arguments ---------------------"]) + "\n"


def test_a_rank_logs_arguments_block_prints_every_default_and_only_real_changes_are_refused(tmp_path):
    from hops_calib.trace import parse_command_line

    job = configuration_only(tmp_path)
    args = parse_command_line((job / "megatron_args.txt").read_text())
    # Megatron-LM prints every argument, the switches it reads only in some cases too (num_query_groups is read
    # only with group_query_attention; overlap_p2p_comm only when interleaved).
    printed = {key: value for key, value in args.items() if not key.startswith("no_")}
    printed.update(tensor_model_parallel_size=1, context_parallel_size=1, data_parallel_size=1,
                   sequence_parallel=False, num_experts=None, expert_model_parallel_size=1,
                   recompute_granularity=None, recompute_method=None, recompute_num_layers=None, swiglu=False,
                   group_query_attention=False, num_query_groups=1, multi_latent_attention=False,
                   normalization="LayerNorm", position_embedding_type="learned_absolute", use_flash_attn=False,
                   masked_softmax_fusion=False, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
                   persist_layer_norm=False, fp8=None, overlap_p2p_comm=True, world_size=2)
    (job / "megatron_args.txt").unlink()
    (job / "logs").mkdir()
    log = job / "logs" / "rank0.out"
    log.write_text(_block(printed))
    assert predict_job("--job", job)["predictions"]
    log.write_text(_block({**printed, "num_experts": 8, "moe_token_dispatcher_type": "flex"}))
    result = cli("predict", "--job", job)
    lines = log.read_text().splitlines()
    number = next(n for n, line in enumerate(lines, 1) if line.lstrip().startswith("moe_token_dispatcher_type "))
    assert result.exit_code == 2 and f"rank0.out:{number}: field '--moe-token-dispatcher-type'" in result.output
    # p2p overlap (the block's overlap_p2p_comm True) is priced (test above); its warm-up flush is refused, at the
    # line of the block's own key, named by its flag
    log.write_text(_block({**printed, "num_layers_per_virtual_pipeline_stage": 1,
                           "overlap_p2p_comm_warmup_flush": True}))
    flushed = " ".join(cli("predict", "--job", job).output.split())
    number = next(n for n, line in enumerate(log.read_text().splitlines(), 1)
                  if line.lstrip().startswith("overlap_p2p_comm_warmup_flush "))
    assert f"rank0.out:{number}: field 'overlap_p2p_comm_warmup_flush'" in flushed
    assert "the flag for it is --overlap-p2p-communication-warmup-flush" in flushed


# --- schedules a configuration cannot run: named beside the ones that can, with the launch change that lets them -----

def _following(job: Path, how: str) -> None:
    """Carry out a refusal's advice on the job's megatron_args.txt, as a user would read it."""
    import re

    args = job / "megatron_args.txt"
    text = args.read_text()
    if how.startswith("remove "):
        for flag in re.findall(r"--[\w-]+", how.split(" from ")[0]):
            text = re.sub(rf" {flag} \S+", "", text)
    for n in re.findall(r"--num-layers-per-virtual-pipeline-stage N \(decoder layers per model chunk; N = (\d+)", how):
        text = text.replace("--num-layers ", f"--num-layers-per-virtual-pipeline-stage {n} "
                                             "--no-overlap-p2p-communication --num-layers ", 1)
    for batch in re.findall(r"; (\d+) gives \d+ microbatches", how):
        text = re.sub(r"--global-batch-size \d+", f"--global-batch-size {batch}", text)
    args.write_text(text)
    manifest = job / "manifest.yaml"
    for schedule in re.findall(r"set configured_schedule to (\w+) in manifest.yaml", how):
        manifest.write_text(re.sub(r"configured_schedule: \w+", f"configured_schedule: {schedule}",
                                   manifest.read_text()))


def test_a_schedule_that_cannot_run_is_named_beside_those_that_can_and_the_advice_makes_it_run(tmp_path):
    job = configuration_only(tmp_path)
    out = predict_job("--job", job, "--schedule", "1f1b", "--schedule", "zb_h1", "--schedule", "interleaved_1f1b")
    assert [p["asked"] for p in out["predictions"]] == ["1f1b", "zb_h1"]
    [refused] = out["refused"]
    assert refused["asked"] == "interleaved_1f1b" and "model chunks per rank" in refused["reason"]
    assert "--num-layers-per-virtual-pipeline-stage" in refused["how"] and "megatron_args.txt" in refused["how"]
    text = cli("predict", "--job", job, "--schedule", "1f1b", "--schedule", "interleaved_1f1b").stdout
    assert "not predicted: interleaved_1f1b cannot run this configuration" in " ".join(text.split())
    _following(job, refused["how"])
    after = predict_job("--job", job, "--schedule", "interleaved_1f1b", "--schedule", "gpipe")
    assert after["configuration"]["vp"] == 2 and [p["asked"] for p in after["predictions"]] == ["interleaved_1f1b"]
    assert [r["asked"] for r in after["refused"]] == ["gpipe"]


@pytest.mark.parametrize("edit,asked,refused", [
    ({}, ["gpipe", "auto", "interleaved_1f1b"], ["gpipe", "auto"]),  # one model chunk per rank only
    ({"--global-batch-size 4": "--global-batch-size 5"}, ["interleaved_1f1b", "1f1b"], ["interleaved_1f1b", "1f1b"]),
])
def test_an_interleaved_configuration_names_what_it_cannot_run_and_how(tmp_path, edit, asked, refused):
    job = configuration_only(tmp_path, INTERLEAVED)
    for old, new in edit.items():
        _add_flags(job, old, new)
    result = cli("predict", "--json", "--job", job, *[a for s in asked for a in ("--schedule", s)])
    if len(refused) == len(asked):  # none can run: exit 2, every schedule named with its remedy
        assert result.exit_code == 2 and all(f"{s} cannot run" in result.output for s in asked)
        hows = [part.split("; to run it, ")[1] for part in " ".join(result.output.split()).split(" | ")]
    else:
        assert result.exit_code == 0, result.output
        out = json.loads(result.output)
        assert [r["asked"] for r in out["refused"]] == refused
        hows = [r["how"] for r in out["refused"]]
    for schedule, how in zip(refused, hows):
        fixed = configuration_only(tmp_path / schedule, INTERLEAVED)
        for old, new in edit.items():
            _add_flags(fixed, old, new)
        _following(fixed, how.split("; change the launch")[0])
        assert predict_job("--job", fixed, "--schedule", schedule)["predictions"][0]["asked"] == schedule


def test_a_what_if_timeline_draws_the_schedules_that_run_and_names_the_others(tmp_path):
    job = configuration_only(tmp_path)
    out = tmp_path / "whatif.png"
    result = cli("plot", "timeline", "--job", job, "--schedule", "1f1b", "--schedule", "interleaved_1f1b",
                 "--out", out, "--dpi", 50)
    assert result.exit_code == 0, result.output
    assert "not drawn: interleaved_1f1b cannot run" in " ".join(result.output.split())
    width_in, height_in = figure_size(2, panels=1)
    assert struct.unpack(">II", out.read_bytes()[16:24]) == (int(round(width_in * 50)), int(round(height_in * 50)))
    result = cli("plot", "timeline", "--job", job, "--schedule", "interleaved_1f1b", "--out", tmp_path / "no.png")
    assert result.exit_code == 2 and not (tmp_path / "no.png").exists()


# --- peak activations: one unit, the planner's and the what-if's ------------------------------------------------------

def test_interleaved_peak_activations_count_a_model_chunk_as_a_fraction_of_a_stage_as_the_planner_does(tmp_path):
    from hops_calib.whatif.plan import plan

    job = configuration_only(tmp_path, INTERLEAVED)
    out = predict_job("--job", job, "--schedule", "interleaved_1f1b")
    pp, vp, m = (out["configuration"][k] for k in ("pp", "vp", "microbatches"))
    peaks = out["predictions"][0]["peak_activations_stage_microbatches"]
    planned = {c.schedule: c for c in plan(stages=pp, microbatches=m, memory_budget=100, chunks=vp).candidates}
    assert max(peaks) == planned["interleaved_1f1b"].peak_activations
    # Megatron's warm-up on rank 0, (p-1)*2 + (v-1)*p forwards of one chunk, plus the first steady one: more than
    # 1F1B's p stage microbatches, fewer than GPipe's m
    assert peaks[0] == ((pp - 1) * 2 + (vp - 1) * pp + 1) / vp
    assert pp < max(peaks) < m * vp
    # With as many microbatches as stages every forward runs before any backward: all layers of every microbatch
    # are held at once, GPipe's m stage microbatches, whatever the chunks
    _add_flags(job, "--global-batch-size 4", f"--global-batch-size {pp}")
    held = predict_job("--job", job, "--schedule", "interleaved_1f1b")["predictions"][0]
    assert held["peak_activations_stage_microbatches"] == [pp] * pp
    text = cli("predict", "--job", job, "--schedule", "interleaved_1f1b").stdout
    assert "peak activations (stage mb)" in text and "microbatches of a whole stage" in " ".join(text.split())


def test_the_walkthroughs_six_stage_interleaved_case_reads_the_same_in_plan_and_predict(shared_runs, tmp_path):
    from hops_calib.whatif.plan import plan

    job = tmp_path / "j"
    shutil.copytree(shared_runs / "exp2_7_batch12_run127", job, ignore=shutil.ignore_patterns("megatron_trace"))
    for path in [job, *job.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)
    _add_flags(job, "--num-layers ", "--num-layers-per-virtual-pipeline-stage 1 --no-overlap-p2p-communication "
                                     "--num-layers ")
    out = predict_job("--job", job, "--schedule", "interleaved_1f1b")
    pp, vp, m = (out["configuration"][k] for k in ("pp", "vp", "microbatches"))
    assert (pp, vp) == (6, 2)
    planned = plan(stages=pp, microbatches=m, memory_budget=100, chunks=vp)
    [interleaved] = [c for c in planned.candidates if c.schedule == "interleaved_1f1b"]
    assert max(out["predictions"][0]["peak_activations_stage_microbatches"]) == interleaved.peak_activations
    assert interleaved.to_dict()["peak_activations_stage_microbatches"] == interleaved.peak_activations


# --- defaults said out loud: the store coverage is checked against, where a picture goes -----------------------------

def _flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())  # rich boxes and wraps --help


def test_coverage_names_the_store_it_read_and_whether_it_was_the_default(tmp_path, monkeypatch):
    job = configuration_only(tmp_path)
    monkeypatch.chdir(REPO)
    defaulted = predict_job("--job", job)["calibration"]
    runs = len(open_store(REPO / "fixtures").ids("train"))
    assert defaulted == (f"train split of {REPO / 'fixtures'}, {runs} runs; --fixtures not given: the default, "
                         "./fixtures in the current directory")
    assert f"train split of {REPO / 'fixtures'}" in cli("predict", "--job", job).stdout
    given = predict_job("--job", job, "--fixtures", REPO / "fixtures")["calibration"]
    assert given == f"train split of {REPO / 'fixtures'}, {runs} runs"
    monkeypatch.chdir(tmp_path)  # no store here: not checked, and the line says which store was looked for
    unchecked = predict_job("--job", job)
    assert unchecked["extrapolations"] is None
    assert f"store {tmp_path / 'fixtures'}; --fixtures not given" in unchecked["calibration"]
    assert "./fixtures" in _flat(cli("predict", "job", "--help").output) and "coverage" in _flat(cli("predict", "job", "--help").output)


def test_a_timeline_without_out_goes_to_the_current_directory_as_help_says(tmp_path, monkeypatch):
    job = configuration_only(tmp_path)
    assert ("(default: timeline-ID.png, with --job timeline-<job folder name>.png, in the current directory; with "
            "--chrome, no image unless --out asks for one)") in _flat(cli("plot", "timeline", "--help").output)
    where = tmp_path / "cwd"
    where.mkdir()
    monkeypatch.chdir(where)
    result = cli("plot", "timeline", "--job", job, "--dpi", 30)
    assert result.exit_code == 0, result.output
    written = where / f"timeline-{job.name}.png"
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {written} " in result.stdout


def test_the_tcp_ceiling_and_stalls_apply_only_over_sockets(shared_runs, tmp_path):
    """The ends' all-reduce is priced as one NCCL TCP flow (its ceiling, its retransmission stalls) where the launch or
    the link benchmark says sockets, and, as on the cluster runs, where nothing says, with a note; over InfiniBand or
    RoCE (NCCL_NET=IB in the launch's environment, or NCCL's 'Using network IB' line in the pair files) neither."""
    from job_copies import copy_job

    def what_if(name: str, environment: str = "", network: str = "") -> dict:
        job = copy_job(shared_runs / "exp2_1_all_nodes_run51", tmp_path / name)  # h100 .. l4 ends: at the ceiling
        shutil.rmtree(job / "megatron_trace")
        args = job / "megatron_args.txt"
        args.write_text(environment + args.read_text())
        if network:  # NCCL_DEBUG=INFO's own line, between the rows as NCCL writes it
            for pair in (job / "calibration" / "link_bench").glob("pair_*.jsonl"):
                lines = pair.read_text().splitlines()
                pair.write_text("\n".join([lines[0], f"g-hetero-st-p5-1:2741:2741 [0] NCCL INFO Using network "
                                           f"{network}", *lines[1:]]) + "\n")
        out = cli("predict", "--job", job, "--json")
        assert out.exit_code == 0, out.output
        return json.loads(out.stdout)

    unsaid, sockets, disabled = what_if("unsaid"), what_if("socket", "NCCL_NET=Socket "), what_if(
        "disabled", "NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=ens32 ")
    for tcp in (unsaid, sockets, disabled):  # today's pricing, whether said or not
        assert tcp["end_collective"] == unsaid["end_collective"] and tcp["predictions"] == unsaid["predictions"]
    assert unsaid["end_collective"]["capped_at_one_tcp_flow"] and unsaid["end_collective"]["stall_probability"] > 0
    said = [any("transport is not said" in note for note in d["notes"]) for d in (unsaid, sockets, disabled)]
    assert said == [True, False, False]
    for verbs in (what_if("ib", "NCCL_NET=IB "), what_if("logged", network="IB")):
        end = verbs["end_collective"]
        assert not end["capped_at_one_tcp_flow"] and end["stall_probability"] == 0
        assert end["bandwidth_gbit_s"] > unsaid["end_collective"]["bandwidth_gbit_s"]
        assert end["ms"] < unsaid["end_collective"]["ms"]
        assert verbs["predictions"][0]["throughput_per_s"] > unsaid["predictions"][0]["throughput_per_s"]
        assert not any("transport is not said" in note for note in verbs["notes"])
    # a socket interface alone says nothing (InfiniBand runs name their bootstrap interface too)
    assert what_if("ifname", "NCCL_SOCKET_IFNAME=ens32 ")["end_collective"] == unsaid["end_collective"]


def test_a_job_directory_given_as_a_fixture_id_is_answered_with_the_command_meant(tmp_path, monkeypatch):
    job = configuration_only(tmp_path)
    store = REPO / "fixtures"
    for verb, meant in ((["predict"], f"did you mean `hops-calib predict --job {job}`"),
                        (["plot", "timeline"], f"did you mean `hops-calib plot timeline --job {job}`"),
                        (["fixtures", "show"], f"did you mean `hops-calib ingest {job} --fixtures {store}`")):
        result = cli(*verb, job, "--fixtures", store)
        assert result.exit_code == 2 and meant in result.output, result.output
    # with no store where --fixtures points, the same answer (not "no fixture store here")
    result = cli("predict", job, "--fixtures", tmp_path / "no_store")
    assert result.exit_code == 2 and "--job" in result.output and "no fixture store" not in result.output
    # a folder that is no job directory stays a fixture id, and a fixture id that is also its run's folder here
    # (the shipped traces/ beside fixtures/) is the fixture
    assert "did you mean" not in cli("predict", tmp_path, "--fixtures", store).output
    monkeypatch.chdir(REPO / "traces")
    result = cli("predict", RUN, "--fixtures", store)
    assert result.exit_code == 0 and RUN in result.output


def test_predict_and_plan_say_alike_what_a_job_directory_holds(tmp_path):
    """One message for a --job that is no directory, and it names the link benchmark as optional, as docs/whatif.md's
    GPU recipe (torchrun places ranks on nodes, no calibration/ folder) has it."""
    messages = set()
    for args in (["predict"], ["plan"], ["plan", "--parallel"], ["plot", "timeline"]):
        result = cli(*args, "--job", tmp_path / "nowhere")
        assert result.exit_code == 2, result.output
        messages.add(" ".join(result.output.split()))
    [message] = messages
    assert "megatron_args.txt" in message and "hops_trace_map.json" in message and "hops.base.yaml" in message
    assert "calibration/link_bench/ only where" in message


# Megatron-LM's common flags (megatron/training/arguments.py) a real launch line carries and that price nothing.
COMMON_FLAGS = ("--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 "
                "--adam-beta2 0.95 --init-method-std 0.02 --attention-dropout 0.0 --hidden-dropout 0.0 "
                "--log-interval 1 --save ckpt --load ckpt --data-path data/my_text_document "
                "--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt --split 949,50,1 "
                "--eval-interval 1000 --eval-iters 10 --seed 1234 --distributed-backend gloo --use-mcore-models "
                "--no-masked-softmax-fusion --tensorboard-dir tb --wandb-project p --lr-warmup-iters 10 "
                "--weight-decay-incr-style constant --save-interval 1000 --log-throughput --num-workers 2")


def test_flags_the_model_neither_prices_nor_knows_are_noted_in_predict_plan_and_ingest(tmp_path):
    """--frobnicate is not refused (the project's list of Megatron flags may lack a real one) but every verb that
    reads the launch names it (a near-miss of a known flag is refused instead: tests/spec/test_threed.py). Common flags
    get no note."""
    job = configuration_only(tmp_path)
    args = job / "megatron_args.txt"
    args.write_text(args.read_text().rstrip("\n") + " " + COMMON_FLAGS + "\n")
    plain = predict_job("--job", job)
    assert not [n for n in plain["notes"] if "ignored" in n]
    args.write_text(args.read_text().rstrip("\n") + " --frobnicate 3 --unheard-of-flag\n")
    noted = predict_job("--job", job)
    [note] = [n for n in noted["notes"] if n.startswith("ignored: ")]
    assert "--frobnicate" in note and "--unheard-of-flag" in note and "did you mean" not in note
    assert "megatron_args.txt:1" in note
    # priced as without them
    assert noted["predictions"][0]["throughput_per_s"] == plain["predictions"][0]["throughput_per_s"]
    text = cli("predict", "--job", job)
    assert text.exit_code == 0 and "note: ignored: --frobnicate" in text.output
    for plan in (["plan", "--job", job, "--trials", "3"], ["plan", "--job", job, "--parallel"]):
        result = cli(*plan)
        assert result.exit_code == 0 and "ignored: --frobnicate" in result.output, (plan, result.output)
    run = tmp_path / "captured" / RUN  # the capture itself, traces and all, with the same launch line
    shutil.copytree(REPO / "traces" / RUN, run)
    shutil.copyfile(args, run / "megatron_args.txt")
    result = cli("ingest", run, "--fixtures", tmp_path / "fx")
    assert result.exit_code == 0 and "ignored: --frobnicate" in result.stderr, result.output


def test_real_launch_lines_get_no_ignored_note(shared_runs):
    """The 56 cluster runs, the shipped captures, docs/whatif.md's GPU recipe and the vTrain rows (their stated and
    assumed Megatron settings) hold no flag the project does not know."""
    import re

    from hops_calib.spec import unknown_flags
    from hops_calib.trace import find_arguments, parse_command_line
    from hops_calib.trace.job import find_job_dirs
    from hops_calib.trace.vtrain import read_vtrain_table

    jobs = find_job_dirs(shared_runs) + find_job_dirs(REPO / "traces")
    assert len(jobs) >= 56
    for job in jobs:
        assert unknown_flags(find_arguments(job)[0]) == [], job
    recipes = re.findall(r'echo "(torchrun [^"]*)" > megatron_args.txt', (REPO / "docs" / "whatif.md").read_text())
    assert len(recipes) == 2  # the 512-GPU and the 16-GPU job
    for recipe in recipes:
        assert unknown_flags(parse_command_line(recipe.replace("\\\n", " "))) == []
    assert unknown_flags(parse_command_line("pretrain_gpt.py " + COMMON_FLAGS)) == []
    from conftest import need_public_runs

    table = read_vtrain_table(need_public_runs("vtrain", "ground_truth_single.csv"))
    assert table.runs and all(unknown_flags(run.args) == [] for run in table.runs)


def test_predict_job_text_gives_tokens_and_says_shared_core_phases_are_served_times(tmp_path):
    """The job's tokens/s is printed beside its samples/s (micro batch x sequence per sample), and on ranks sharing
    a CPU core the legend says the per-stage phases are what the simulation served, not the breakdown's work."""
    run = "cpu_1f1b_d2_l4_h384_s128_m4_run1"  # 4 ranks on the 2 cores
    job = configuration_only(tmp_path, run)
    out = predict_job("--job", job)
    [got] = out["predictions"]
    text = cli("predict", "--job", job)
    assert text.exit_code == 0, text.output
    [line] = [line for line in text.output.splitlines() if line.startswith("tokens /s (all replicas)")]
    assert float(line.split()[-1]) == pytest.approx(got["tokens_per_s"], abs=0.5)
    assert got["tokens_per_s"] == pytest.approx(got["samples_per_s"] * out["configuration"]["seq_length"])
    assert "as the simulation served them to ranks sharing a core" in text.output
    served = [s["optimizer_ms"] for s in got["stages"]]
    work = [row["optimizer"] for row in out["breakdown_ms_per_iteration"]]
    assert all(s > w for s, w in zip(served, work))
    plain = cli("predict", "--job", configuration_only(tmp_path / "own", RUN))
    assert "sharing a core" not in plain.output
