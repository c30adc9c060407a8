"""The planner's search over every lever together (hops_calib.whatif.job_plan): recomputation, the layout,
sequence parallelism, the distributed optimizer, the schedule; Megatron-runnable launches first; each pick within
its GPUs' memory less the headroom; and the launches that once crashed it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hops_calib.loop.model_files import load_model
from hops_calib.sim.perturb import RandomStragglers
from hops_calib.whatif.job_plan import JobPlanner, Launch, plan_job
from hops_calib.whatif.perturbations import Perturbations

REPO = Path(__file__).resolve().parents[2]
TP2_JOB = REPO / "traces" / "cpu_1f1b_t2d2_l4_h256_s128_m4_run1"


@pytest.fixture(scope="module")
def model():
    return load_model()


def test_a_virtual_stage_without_decoder_layers_prices_under_tensor_parallelism(model):
    """Interleaved v=3 with the embedding and the loss counted as layers leaves the first and last virtual stages
    with no decoder layer: its tensor-parallel collectives are the embedding's and the loss's alone (this launch
    raised KeyError('all_reduce', ...) in the pricing of the backward's overlapped collectives)."""
    planner = JobPlanner(TP2_JOB, model)
    own = planner.current()
    launch = Launch(own.order, None, None, "interleaved_1f1b", 3, own.micro_batch_size, (True, True))
    spec, pipeline = planner.priced(launch)
    assert spec.tp == 2 and 0 in spec.layers_per_virtual_stage
    assert all(stage.forward_ms > 0 and stage.backward_ms > 0 for stage in pipeline.stages)
    assert planner.evaluate(launch).samples_per_s > 0


def test_plan_with_stragglers_on_a_tensor_parallel_capture(model):
    """`plan --job traces/cpu_1f1b_t2d2_... --stragglers 0.05:1.05:1.3` ranks by draws instead of crashing."""
    perturbations = Perturbations(stragglers=RandomStragglers(0.05, 1.05, 1.3), samples=8, seed=0)
    plan = plan_job(TP2_JOB, model, top=3, perturbations=perturbations, rank_by="expected")
    assert plan.status == "ok" and len(plan.best) == 3
    expected = [o.expected_samples_per_s for o in plan.best]
    assert expected == sorted(expected, reverse=True)
    assert all(o.expected_samples_per_s <= o.samples_per_s for o in plan.best)


CPU_JOB = REPO / "traces" / "cpu_1f1b_l4_h512_s256_m4_run1"
CAPTURES = [REPO / "traces" / name for name in ("cpu_1f1b_l4_h512_s256_m4_run1", "cpu_1f1b_t2d2_l4_h256_s128_m4_run1",
                                                "cpu_interleaved_v2_l8_h512_s256_m4_run1")]


@pytest.fixture(scope="module")
def gpu_job(tmp_path_factory):
    """docs/whatif.md's 512-A100 job (t 8 x p 8 x d 8, full recomputation), made by its own recipe."""
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from job_copies import readme_gpu_job

    job, _ = readme_gpu_job(tmp_path_factory.mktemp("gpu"))
    return job


def test_the_throughput_bound_never_undercuts_the_simulation(model):
    """What the planner leaves unsimulated is left out by a bound no launch beats: on launches of three captures
    (1F1B, t 2 x d 2, interleaved), of every schedule and setting of the levers, the simulated window throughput is
    at most the tight closed-form bound, and that at most the quick one."""
    from hops_calib.whatif.job_plan import SCHEDULES, Refusal

    checked = 0
    for job in CAPTURES:
        planner = JobPlanner(job, model)
        spaces = [planner.space(SCHEDULES)] + [planner.family_space(f, SCHEDULES, True, True)
                                               for f in planner.families()[1:]]
        for space in (s for s in spaces if s is not None):
            for launch in list(space)[::7]:  # every 7th: all schedules, splits and sizes are met
                try:
                    bound, tight = planner.bound_samples_per_s(launch), planner.bound_samples_per_s(launch, tight=True)
                    outcome = planner.evaluate(launch)
                except Refusal:
                    continue
                checked += 1
                assert outcome.samples_per_s <= tight * (1 + 1e-9) and tight <= bound * (1 + 1e-9), launch.label()
    assert checked > 100


def test_the_search_varies_recomputation_and_keeps_to_memory_less_the_headroom(model, gpu_job):
    """On the 512-A100 job every lever moves: the plan prices launches without, with selective and with full
    recomputation and other t x p layouts; with 50 GB of its 80 left out, every pick fits 30 GB and one that fitted
    before does not, and no pick is a schedule Megatron-LM lacks."""
    free = plan_job(gpu_job, model, top=5)
    tight = plan_job(gpu_job, model, top=5, headroom_bytes=50e9)
    assert free.headroom_bytes == {"a100": 1.5e9} and tight.headroom_bytes == {"a100": 50e9}
    for plan, cap in ((free, 78.5e9), (tight, 30e9)):
        assert plan.best and all(max(o.peak_memory_bytes) <= cap and o.memory_bytes == (cap,) * len(o.memory_bytes)
                                 for o in plan.best)
        assert all(o.resolved in ("1f1b", "interleaved_1f1b") for o in plan.best)
    assert max(max(o.peak_memory_bytes) for o in free.best) > 30e9
    assert tight.best[0].samples_per_s < free.best[0].samples_per_s
    picks = [o.to_dict() for o in (*free.best, *tight.best)]
    assert {p["recompute"] for p in picks} - {"none"}, "a tight memory takes recomputation or a wider layout"
    assert len({(p["tp"], p["pp"]) for p in picks}) > 1
    planner = JobPlanner(gpu_job, model)
    kinds = {f.recompute_label().split()[0] for f in planner.families()}
    assert kinds == {"none", "selective", "full"}


def test_megatron_runnable_launches_only_unless_any_runtime(model):
    """By default every launch the plan prices runs under Megatron-LM's own schedules; --any-runtime adds ZB-H1,
    GPipe and auto, which on this capture rank among the best five (behind interleaved 1F1B v=3)."""
    megatron = plan_job(CPU_JOB, model, top=5)
    anything = plan_job(CPU_JOB, model, top=5, any_runtime=True)
    assert all(o.resolved in ("1f1b", "interleaved_1f1b") for o in megatron.best)
    assert megatron.best_megatron == megatron.best[0]
    assert anything.space > megatron.space
    assert any(o.resolved not in ("1f1b", "interleaved_1f1b") for o in anything.best)
    assert anything.best_megatron.samples_per_s == pytest.approx(megatron.best[0].samples_per_s)


def test_plan_cli_refuses_other_runtimes_schedules_and_keeps_parallel(tmp_path):
    """`plan --job --schedule zb_h1` needs --any-runtime (exit 2, naming it); `--parallel` still runs its layout
    table, with a note that plan --job alone searches the layouts with every other lever; --memory-headroom is
    stated in the output."""
    import json

    from typer.testing import CliRunner

    from hops_calib.cli import app

    runner = CliRunner()
    refused = runner.invoke(app, ["plan", "--job", str(CPU_JOB), "--schedule", "zb_h1"])
    assert refused.exit_code == 2 and "--any-runtime" in refused.output
    allowed = runner.invoke(app, ["plan", "--job", str(CPU_JOB), "--schedule", "zb_h1", "--any-runtime", "--json"])
    assert allowed.exit_code == 0, allowed.output
    assert {b["resolved_schedule"] for b in json.loads(allowed.stdout)["best"]} == {"zb_h1"}
    layouts = runner.invoke(app, ["plan", "--job", str(CPU_JOB), "--parallel", "--json"])
    assert layouts.exit_code == 0, layouts.output
    assert any("--parallel is no longer needed" in note for note in json.loads(layouts.stdout)["notes"])
    text = runner.invoke(app, ["plan", "--job", str(CPU_JOB), "--memory-headroom", "0.1", "--top", "1"])
    assert text.exit_code == 0 and "less 0.10 GB headroom" in text.output


def test_a_tight_memory_still_finds_the_launches_that_fit(model, gpu_job):
    """With 62 GB of the 80 left out (18 GB per GPU), neither the 512-A100 job's own launch (21.9 GB) nor its
    t 8 x p 8 at another recomputation fits; the search starts from each setting's most memory-saving launch the
    closed-form bound says fits and finds fitting launches (a deeper pipeline with full recomputation), instead of
    answering that nothing fits."""
    plan = plan_job(gpu_job, model, top=3, headroom_bytes=62e9)
    assert plan.current is not None and not plan.current.fits
    assert plan.status == "ok" and plan.best
    assert all(max(o.peak_memory_bytes) <= 18e9 for o in plan.best)
    assert any(o.to_dict()["recompute"].startswith("full") and o.to_dict()["pp"] > 8 for o in plan.best)


@pytest.fixture(scope="module")
def gpt16_job(tmp_path_factory):
    """docs/whatif.md's 16-A100 job (1.3B GPT, t 2 x p 4 x d 2), made by its own recipe."""
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from job_copies import whatif_recipe_job

    job, _ = whatif_recipe_job(tmp_path_factory.mktemp("gpt16"), "gpt16")
    return job


def speeds_of(plan) -> list[float]:
    return [round(o.samples_per_s, 6) for o in plan.best]


def test_the_best_five_are_the_first_five_of_a_longer_list(model, gpt16_job):
    """On the 16-A100 job the best five are the first five of the best twelve, ties aside (a longer list keeps more
    settings of the levers and ascends from each: it finds nothing faster than the fifth that the five lack, but for
    a launch tying one of them), and the job's
    own layout at its best (t 2 x p 4 with every other lever searched, --keep-levers) ranks where it should: in the
    five, or slower than all of them."""
    five = plan_job(gpt16_job, model, top=5)
    twelve = plan_job(gpt16_job, model, top=12)
    own_layout = plan_job(gpt16_job, model, top=1, levers=False).best[0]
    floor = five.best[-1].samples_per_s
    # every launch of the twelve faster than the fifth is one of the five, or ties one of them (t 1 x p 1 at micro
    # batch 4, 8 and 16 price alike: which of a tie the shorter list keeps is its tie-break, not a launch it missed)
    speeds = {round(o.samples_per_s, 6) for o in five.best}
    faster = [o for o in twelve.best if o.samples_per_s > floor]
    assert faster and all(o.launch in [f.launch for f in five.best] or round(o.samples_per_s, 6) in speeds
                          for o in faster)
    # and the twelve hold every one of the five's speeds at least as often (the longer list loses nothing)
    from collections import Counter

    held, listed = Counter(round(o.samples_per_s, 6) for o in twelve.best), Counter(speeds_of(five))
    assert all(held[speed] >= n for speed, n in listed.items())
    assert own_layout.samples_per_s < floor or own_layout.launch in [o.launch for o in five.best]
    assert len({o.launch.levers for o in five.best}) > 1, "other recomputations rank as launches of their own"


def test_progress_counts_the_launches_looked_at_of_the_candidates(model, gpt16_job):
    """The progress a plan reports (as HOPS_CALIB_PROGRESS=lines prints it) counts one quantity through every
    stage of the search: K of N with N the plan's candidates, K never above N nor falling, and the last K the
    launches the plan says it looked at (it showed 1107/8067 while the plan said 1,107 of 59,168)."""
    import io
    import re

    from hops_calib.progress import _Lines

    stream = io.StringIO()
    lines = _Lines("plan", stream=stream, every_s=0.0)
    plan = plan_job(gpt16_job, model, top=5, progress=lines)
    lines.stop()
    counts = [tuple(map(int, m.groups())) for m in re.finditer(r"^plan: (\d+)/(\d+) ", stream.getvalue(), re.M)]
    assert len(counts) > 10 and {n for _, n in counts} == {plan.space}
    done = [k for k, _ in counts]
    assert done == sorted(done) and done[-1] == plan.evaluated < plan.space
    stages = set(re.findall(r"\(\d+ s\) (.+)$", stream.getvalue(), re.M))
    assert {"ascent over the levers", "coordinate ascent", "done"} <= stages


def test_the_band_says_when_the_store_has_no_run_of_the_jobs_device(gpt16_job):
    """Planned against the repository's CPU store, an A100 job's band says plainly that no train run of a100 is
    in it (the band is the CPU runs' error) and which store to pass; a CPU capture's band against it does not."""
    import json

    from typer.testing import CliRunner

    from hops_calib.cli import app

    runner = CliRunner()
    store = str(REPO / "fixtures")
    gpu = runner.invoke(app, ["plan", "--job", str(gpt16_job), "--fixtures", store, "--top", "1", "--json"])
    cpu = runner.invoke(app, ["plan", "--job", str(CPU_JOB), "--fixtures", store, "--top", "1", "--json"])
    assert gpu.exit_code == 0 and cpu.exit_code == 0, gpu.output + cpu.output
    gpu_band, cpu_band = (json.loads(r.stdout)["throughput_band_source"] for r in (gpu, cpu))
    assert "MAPE" in gpu_band and "no train run of a100" in gpu_band and "pass --fixtures" in gpu_band
    assert "MAPE" in cpu_band and "no train run" not in cpu_band


def test_one_stage_schedules_that_run_alike_are_one_row(model, gpt16_job):
    """With --any-runtime the 16-A100 job's best launches are on one stage (p 1), where 1F1B, GPipe and ZB-H1
    price alike: each shows once, as the 1F1B Megatron runs, not three identical rows."""
    plan = plan_job(gpt16_job, model, top=8, any_runtime=True)
    one_stage = [o for o in plan.best if len(o.layers_per_stage) == 1]
    assert one_stage and all(o.resolved == "1f1b" for o in one_stage)
    rows = [(o.launch.levers, o.launch.micro_batch_size, round(o.samples_per_s, 6)) for o in plan.best]
    assert len(rows) == len(set(rows)) == 8


def test_refusals_are_grouped_by_kind(model, gpu_job):
    """The 512-A100 plan's refusals of one kind (the global batch not a multiple of micro batch x dp, at several
    micro batches) show as one line with their count, how many cases and one example, not one line each."""
    from hops_calib.cli.render.plan import format_job_plan

    plan = plan_job(gpu_job, model, top=5)
    kinds = plan.refusal_kinds()
    assert sum(count for count, _, _ in kinds) == sum(plan.refused.values())
    assert len(kinds) < len(plan.refused), plan.refused
    k, (count, cases, example) = next(
        (k, kind) for k, kind in enumerate(kinds) if "is not a multiple of micro batch" in kind[2]
    )
    assert cases > 1 and example in plan.refused
    lines = [line for line in format_job_plan(plan).splitlines() if "cannot run" in line]
    assert lines[k] == f"{count} launch(es) cannot run, {cases} cases of one reason, e.g.: {example}"


def test_each_pick_says_its_precision_in_text_and_json(tmp_path):
    """`plan job --precision any` on an 8-H100 job in BF16 (t 2 x p 2 x d 2): every pick, in the text and in
    --json, says whether its GEMMs run in FP8 or BF16, as its flags do (--fp8-format added, or not)."""
    import json
    import re

    from typer.testing import CliRunner

    from hops_calib.cli import app

    job = tmp_path / "h100"
    job.mkdir()
    (job / "megatron_args.txt").write_text(
        "torchrun --nnodes 1 --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 "
        "--pipeline-model-parallel-size 2 --num-layers 8 --hidden-size 2048 --ffn-hidden-size 8192 "
        "--num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 "
        "--global-batch-size 16 --sequence-parallel --use-distributed-optimizer --bf16 --vocab-size 32000 "
        "--train-iters 10 --transformer-impl transformer_engine\n"
    )
    (job / "hops_trace_map.json").write_text('{"stages": {"0": "gpu0", "1": "gpu1"}}')
    (job / "hops.base.yaml").write_text(
        "hardware:\n  devices:\n  - {id: gpu0, gpu: h100_dgx}\n  - {id: gpu1, gpu: h100_dgx}\n"
    )
    runner = CliRunner()
    found = runner.invoke(app, ["plan", "job", str(job), "--precision", "any", "--top", "6", "--json"])
    text = runner.invoke(app, ["plan", "job", str(job), "--precision", "any", "--top", "6"])
    assert found.exit_code == 0 and text.exit_code == 0, found.output + text.output
    picks = json.loads(found.stdout)["best"]
    assert {p["precision"] for p in picks} == {"fp8", "bf16"}
    for pick in picks:
        assert pick["precision"] == ("fp8" if pick["fp8"] else "bf16")
        assert ("--fp8-format" in pick["flags"]) == pick["fp8"]
    rows = re.findall(r"^ *\d+ .*; (FP8|BF16)[;\n]", text.stdout + "\n", re.M)
    assert rows == [p["precision"].upper() for p in picks]
