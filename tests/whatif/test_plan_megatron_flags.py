"""Every launch `plan job` prints is one Megatron runs: its flags applied to the job's command line build
megatron-core 0.16.1's TransformerConfig (its and ModelParallelConfig's __post_init__ validation) and pass the checks
Megatron makes before the first step (tests/whatif/megatron_accepts.py), and the launch they build is the one the
plan priced (t, p, cp, d, virtual stages, layers per rank by megatron-core's get_num_layers_to_build, recomputation,
sequence parallelism, FP8, and under a mixture of experts ep, etp and the experts' data-parallel size). On a
Llama-3-70B-shaped job on 64 H100 DGX GPUs, with FP8 allowed (the search then moves context parallelism, FP8 and the
uneven first and last stages), the same job in FP8 planned in BF16, the same job with its virtual stages spelt as a
count (--virtual-pipeline-model-parallel-size), and a Mixtral-8x7B-shaped job on 64 H100 DGX GPUs launched at EP 2
(the search then moves expert parallelism)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dgx_jobs import MIXTRAL, make_job  # noqa: E402
from megatron_accepts import (  # noqa: E402
    Refused,
    apply_changes,
    check_launch,
    expert_data_parallel,
    job_launch,
    layers_per_rank,
    read_launch,
)

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# A Llama-3-70B shape (80 layers, h 8192, FFN 28672, 64 heads in 8 query groups, s 8192; Meta's model card) on 8 DGX
# H100 nodes: t 4 x p 4 x d 4 with 4 virtual stages of 5 layers, BF16. The numbers are this test's own.
LLAMA70 = (
    "torchrun --nnodes 8 --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 4 "
    "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 5 --num-layers 80 --hidden-size 8192 "
    "--ffn-hidden-size 28672 --num-attention-heads 64 --group-query-attention --num-query-groups 8 "
    "--seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 128 "
    "--sequence-parallel --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --swiglu "
    "--normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights "
    "--disable-bias-linear --attention-dropout 0 --hidden-dropout 0 --bf16 --vocab-size 128256 --train-iters 100"
)


def plan(job: Path, *options: str) -> dict:
    from hops_calib.cli import app

    result = CliRunner().invoke(app, ["plan", "job", str(job), "--json", *options])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def verify_pick(job: Path, pick: dict) -> None:
    """The pick's flags applied to the job's launch are accepted by Megatron (Refused otherwise) and build the
    launch the plan priced (AssertionError otherwise)."""
    launch = job_launch(job)
    args = read_launch(apply_changes(launch.argv, pick["flags"], pick["remove_flags"]))
    config, dp = check_launch(args, launch.world_size)
    vp = config.virtual_pipeline_model_parallel_size or 1
    built = {
        "tp": config.tensor_model_parallel_size,
        "pp": config.pipeline_model_parallel_size,
        "cp": config.context_parallel_size,
        "dp": dp,
        "chunks": vp,
        "micro_batch_size": args["micro_batch_size"],
        "sequence_parallel": config.sequence_parallel,
        "fp8": config.fp8 is not None,
        "recompute_granularity": config.recompute_granularity,
        "recompute_method": config.recompute_method,
        "recompute_num_layers": config.recompute_num_layers,
        "layers_per_stage": layers_per_rank(config),
        "distributed_optimizer": bool(args.get("use_distributed_optimizer")),
        # the experts as megatron-core lays them out (None, None, None: a dense MLP)
        "ep": config.expert_model_parallel_size if config.num_moe_experts else None,
        "etp": config.expert_tensor_parallel_size if config.num_moe_experts else None,
        "edp": expert_data_parallel(config, launch.world_size) if config.num_moe_experts else None,
    }
    assert built == {key: pick[key] for key in built}, pick["changes"]


@pytest.fixture(scope="module")
def llama70(tmp_path_factory):
    return make_job(tmp_path_factory.mktemp("llama70") / "llama70", LLAMA70, 4)


def test_every_printed_launch_is_one_megatron_runs(llama70):
    """With --precision any the plan's ten best, the best Megatron runs as it is and the job's own launch all
    build in megatron-core and are the launches priced; the search moved context parallelism and FP8 (the picks
    run cp > 1 in FP8, written as --context-parallel-size and --fp8-format hybrid --fp8-recipe delayed) and the
    picks differ in their uneven first and last stages."""
    found = plan(llama70, "--precision", "any", "--top", "10")
    picks = [*found["best"], found["best_megatron"], found["current"]]
    for pick in picks:
        verify_pick(llama70, pick)
    best = found["best"]
    assert len(best) == 10 and all(pick["megatron_runnable"] for pick in best)
    assert any(pick["cp"] > 1 for pick in best) and any(pick["fp8"] for pick in best)
    fp8 = next(pick for pick in best if pick["fp8"])
    at = fp8["flags"].index("--fp8-format")
    assert fp8["flags"][at : at + 4] == ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
    assert len({(p["decoder_first_pipeline_num_layers"], p["decoder_last_pipeline_num_layers"]) for p in best}) > 1
    assert found["current"]["fp8"] is False and found["current"]["cp"] == 1 and found["current"]["flags"] == []
    # the shipped model's roofline charges cp no KV exchange: a cp > 1 pick says so
    assert any("priced without its KV exchange" in note for note in found["notes"])


def test_an_fp8_job_planned_in_bf16_removes_its_fp8_flags(tmp_path):
    """The job in FP8 (--fp8-format hybrid --fp8-recipe delayed) planned with --precision bf16: every pick runs
    16-bit GEMMs, takes both FP8 flags out, and builds in megatron-core with fp8 None."""
    job = make_job(tmp_path / "fp8", LLAMA70 + " --fp8-format hybrid --fp8-recipe delayed", 4)
    found = plan(job, "--precision", "bf16", "--top", "3")
    assert found["current"]["fp8"] is True
    for pick in found["best"]:
        assert pick["fp8"] is False and {"--fp8-format", "--fp8-recipe"} <= set(pick["remove_flags"])
        verify_pick(job, pick)


def test_fp8_on_a_device_without_an_fp8_peak_is_refused(tmp_path):
    """--precision fp8 on A100s (no FP8 peak in the catalog) is refused naming --precision (exit 2)."""
    from hops_calib.cli import app

    job = make_job(tmp_path / "a100", LLAMA70, 4)
    (job / "hops.base.yaml").write_text(
        "hardware:\n  devices:\n" + "".join(f"  - {{id: gpu{k}, gpu: a100}}\n" for k in range(4))
    )
    result = CliRunner().invoke(app, ["plan", "job", str(job), "--precision", "fp8"])
    assert result.exit_code == 2 and "--precision" in result.output and "no FP8 peak" in result.output
    assert "on a device with FP8 tensor cores" in " ".join(result.output.split())  # the hint: another device


@pytest.mark.parametrize(
    ("changes", "refusal"),
    [
        (["--tensor-model-parallel-size", "3"], "num_attention_heads (64) must be a multiple"),
        (["--tensor-model-parallel-size", "1"], "sequence parallelism without tensor parallelism"),
        (["--context-parallel-size", "3"], "not divisible by 48"),
        (["--num-layers-per-virtual-pipeline-stage", "3"], "not whole virtual stages"),
        (["--decoder-first-pipeline-num-layers", "9"], "must be divisible by virtual pipeline"),
        (["--global-batch-size", "102"], "global batch size (102) is not divisible"),
        (["--global-batch-size", "24"], "not a multiple of the 4 stages"),
        (["--recompute-granularity", "full"], "recompute_method must be"),
        (["--fp8-recipe", "delayed", "--fp8-format", "e5m2"], "invalid choice: 'e5m2'"),
        (["--fp8-param-gather"], "fp8_param must be used together with fp8 mode"),
        (["--context-parallel-size", "2", "--seq-length", "4094"], "not divisible by 2 x cp"),
        (["--frobnicate"], "unrecognized arguments"),
    ],
)
def test_a_bad_flag_set_is_caught(llama70, changes, refusal):
    """The check can fail: flags Megatron refuses, applied to the job's launch, are refused with the reason."""
    launch = job_launch(llama70)
    with pytest.raises(Refused) as caught:
        check_launch(read_launch(apply_changes(launch.argv, changes, [])), launch.world_size)
    assert refusal in str(caught.value)


def test_flags_that_build_another_launch_than_the_one_priced_are_caught(llama70):
    """A pick whose printed flags lost one (its --context-parallel-size) builds a launch Megatron runs, but not the
    one priced: the check says so."""
    pick = next(p for p in plan(llama70, "--precision", "any", "--top", "1")["best"] if p["cp"] > 1)
    at = pick["flags"].index("--context-parallel-size")
    broken = {**pick, "flags": pick["flags"][:at] + pick["flags"][at + 2 :]}
    with pytest.raises((AssertionError, Refused)):
        verify_pick(llama70, broken)


def test_a_llama_405b_launch_as_nvidia_runs_it_builds():
    """The 405B shape (126 layers, h 16384, 128 heads in 8 groups) at t 8 x p 8 x cp 2 x d 8 on 1,024 GPUs with 8
    virtual stages of 2 layers, the embedding and the loss counted as a layer, FP8: megatron-core builds it, 15 and
    16 layers per rank; without the accounting it is refused (126 layers over 8 stages)."""
    argv = (
        "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 --context-parallel-size 2 "
        "--num-layers-per-virtual-pipeline-stage 2 --account-for-embedding-in-pipeline-split "
        "--account-for-loss-in-pipeline-split --num-layers 126 --hidden-size 16384 --ffn-hidden-size 53248 "
        "--num-attention-heads 128 --group-query-attention --num-query-groups 8 --seq-length 8192 "
        "--micro-batch-size 1 --global-batch-size 512 --sequence-parallel --swiglu --normalization RMSNorm "
        "--disable-bias-linear --bf16 --fp8-format hybrid --fp8-recipe delayed"
    ).split()
    config, dp = check_launch(read_launch(argv), 1024)
    assert dp == 8 and config.fp8 == "hybrid" and layers_per_rank(config) == [15] + [16] * 6 + [15]
    unaccounted = [a for a in argv if not a.startswith("--account-for")]
    with pytest.raises(Refused, match="not whole virtual stages"):
        check_launch(read_launch(unaccounted), 1024)


def test_context_parallel_sizes_are_the_ones_megatron_splits(llama70, tmp_path):
    """cp is searched where the sequence cuts into 2 cp chunks: s 8192 takes 1, 2, 4 and 8; s 8196 (4 x 2049)
    only 2; every setting of the levers the plan searches keeps t x p x cp dividing the 64 GPUs."""
    from hops_calib.loop.model_files import load_model
    from hops_calib.whatif.job_plan import JobPlanner

    model = load_model()
    planner = JobPlanner(llama70, model)
    assert planner.context_parallel_sizes() == [1, 2, 4, 8]
    settings = planner.families()
    assert {s.cp for s in settings} == {1, 2, 4, 8} and all(64 % (s.tp * s.pp * s.cp) == 0 for s in settings)
    assert {s.experts for s in settings} == {(None, None)}, "a dense MLP has no expert lever"
    assert {s.fp8 for s in settings} == {False}, "FP8 only where --precision allows it"
    assert {s.fp8 for s in planner.families((False, True))} == {False, True}
    odd = make_job(tmp_path / "s8196", LLAMA70.replace("8192 --max-position-embeddings 8192", "8196 "
                                                       "--max-position-embeddings 8196"), 4)
    assert JobPlanner(odd, model).context_parallel_sizes() == [1, 2]


def test_keep_levers_still_takes_the_precision_allowed(llama70):
    """--keep-levers --precision fp8 keeps t 4 x p 4 x cp 1 and every other lever of the job, and turns FP8 on:
    every pick is the job's layout in FP8, its flags accepted by megatron-core."""
    found = plan(llama70, "--keep-levers", "--precision", "fp8", "--top", "3")
    for pick in found["best"]:
        assert (pick["tp"], pick["pp"], pick["cp"], pick["fp8"]) == (4, 4, 1, True)
        assert pick["sequence_parallel"] and pick["distributed_optimizer"] and pick["recompute"] == "none"
        verify_pick(llama70, pick)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return make_job(tmp_path_factory.mktemp("mixtral") / "mixtral", MIXTRAL, 4)


@pytest.fixture(scope="module")
def mixtral_plan(mixtral):
    return plan(mixtral, "--top", "5")


def test_every_printed_moe_launch_is_one_megatron_runs(mixtral, mixtral_plan):
    """The Mixtral job's five best, the best Megatron runs as it is and its own launch build in megatron-core
    (TransformerConfig with the experts, ep dividing the experts, etp x ep x p dividing the 64 GPUs) and are the
    launches priced, ep, etp and the experts' data-parallel size included; the search moved expert parallelism off
    the job's EP 2, written as --expert-model-parallel-size."""
    found = mixtral_plan
    for pick in [*found["best"], found["best_megatron"], found["current"]]:
        verify_pick(mixtral, pick)
    assert (found["current"]["ep"], found["current"]["etp"], found["current"]["edp"]) == (2, 1, 8)
    moved = [pick for pick in found["best"] if pick["ep"] != 2]
    assert moved, [pick["changes"] for pick in found["best"]]
    for pick in moved:
        at = pick["flags"].index("--expert-model-parallel-size")
        assert pick["flags"][at + 1] == str(pick["ep"])


def test_the_moe_launch_label_names_ep(mixtral, mixtral_plan):
    """The text names each pick's ep in its launch (t, p, then ep: `t1 p4 ep8`), and its experts' data-parallel
    size beside d."""
    from hops_calib.cli import app

    result = CliRunner().invoke(app, ["plan", "job", str(mixtral), "--top", "5"])
    assert result.exit_code == 0, result.output
    for pick in mixtral_plan["best"]:
        cp = f" cp{pick['cp']}" if pick["cp"] > 1 else ""
        assert f"t{pick['tp']} p{pick['pp']}{cp} ep{pick['ep']}" in result.output
        assert f"d {pick['dp']}, expert d {pick['edp']}" in result.output


def test_expert_layouts_are_the_ones_megatron_lays_out(mixtral):
    """ep runs over the divisors of the 8 experts and etp over t and 1, wherever etp x ep x p divides the 64 GPUs
    (initialize_model_parallel); tensor parallelism only with sequence parallelism under experts (MoELayer.forward);
    a layout with biases keeps etp 1 (TransformerConfig)."""
    from hops_calib.loop.model_files import load_model
    from hops_calib.whatif.job_plan import JobPlanner

    model = load_model()
    planner = JobPlanner(mixtral, model)
    settings = planner.families()
    assert settings[0].experts == (2, 1)
    assert {s.ep for s in settings} == {1, 2, 4, 8}
    assert all(8 % s.ep == 0 and 64 % (s.etp * s.ep * s.pp) == 0 and s.etp in (1, s.tp) for s in settings)
    assert any(s.etp == s.tp > 1 for s in settings) and any(s.tp > 1 and s.etp == 1 for s in settings)
    assert all(s.sequence_parallel for s in settings if s.tp > 1)
    # at t 2 x p 8, etp 2 leaves ep at most 4 (2 x 8 x 8 = 128 GPUs); etp 1 takes ep 8
    assert planner.expert_layouts(2, 8, 1) == [(1, 2), (1, 1), (2, 2), (2, 1), (4, 2), (4, 1), (8, 1)]
    biased = make_job(mixtral.parent / "biased", MIXTRAL.replace(" --disable-bias-linear", ""), 4)
    assert {etp for _, etp in JobPlanner(biased, model).expert_layouts(4, 2, 1)} == {1}


@pytest.mark.parametrize(
    ("changes", "refusal"),
    [
        (["--expert-model-parallel-size", "3"], "not divisible by expert parallel size (3)"),
        (["--expert-model-parallel-size", "16"], "not divisible by expert parallel size (16)"),
        (
            ["--expert-model-parallel-size", "8", "--pipeline-model-parallel-size", "8",
             "--tensor-model-parallel-size", "2", "--sequence-parallel"],
            "expert_tensor_model_pipeline_parallel size (128)",
        ),
        (["--expert-model-parallel-size", "8", "--pipeline-model-parallel-size", "16"], "parallel size (128)"),
        (["--tensor-model-parallel-size", "2"], "needs sequence parallelism"),
        (["--moe-token-dispatcher-type", "all2all"], "invalid choice: 'all2all'"),
        (["--expert-model-parallel-size", "2", "--num-experts", "0"], "num_moe_experts must be non None"),
    ],
)
def test_a_bad_expert_layout_is_caught(mixtral, changes, refusal):
    """The check can fail: expert layouts Megatron refuses, applied to the Mixtral launch, are refused with the
    reason."""
    launch = job_launch(mixtral)
    with pytest.raises(Refused) as caught:
        args = read_launch(apply_changes(launch.argv, changes, []))
        if args.get("num_experts") == 0:
            args["num_experts"] = None  # validate_args: --num-experts 0 is None
        check_launch(args, launch.world_size)
    assert refusal in str(caught.value)


def test_flags_that_lose_the_expert_layout_are_caught(mixtral, mixtral_plan):
    """A pick whose printed flags lost its --expert-model-parallel-size builds the job's EP 2, not the ep priced:
    the check says so."""
    pick = next(p for p in mixtral_plan["best"] if "--expert-model-parallel-size" in p["flags"])
    at = pick["flags"].index("--expert-model-parallel-size")
    broken = {**pick, "flags": pick["flags"][:at] + pick["flags"][at + 2 :]}
    with pytest.raises((AssertionError, Refused)):
        verify_pick(mixtral, broken)


def test_expert_tensor_parallel_flags_say_what_the_command_line_does_not(mixtral, tmp_path):
    """--expert-tensor-parallel-size is written where the etp priced is not what the job's command line gives at
    the new t (its own flag, else t): t 2 at etp 1 writes it, t 2 at etp 2 does not; the job launched with
    --expert-tensor-parallel-size 1 writes it at etp 2. Every such launch builds in megatron-core as priced."""
    from hops_calib.loop.model_files import load_model
    from hops_calib.whatif.job_plan import JobPlanner
    from hops_calib.whatif.launch_space import Launch, Levers

    model = load_model()
    explicit = make_job(tmp_path / "etp1", MIXTRAL + " --expert-tensor-parallel-size 1", 4)
    for job, etp, written in ((mixtral, 1, True), (mixtral, 2, False), (explicit, 2, True), (explicit, 1, False)):
        planner = JobPlanner(job, model)
        levers = Levers(2, 4, (None, None, None), True, True, 1, False, 4, etp)
        launch = Launch(planner.placed_order(4), None, None, "1f1b", 1, 1, (False, False), levers)
        pick = planner.evaluate(launch).to_dict()
        assert ("--expert-tensor-parallel-size" in pick["flags"]) is written, pick["flags"]
        assert (pick["tp"], pick["ep"], pick["etp"], pick["edp"]) == (2, 4, etp, 64 // (etp * 4 * 4))
        verify_pick(job, pick)


def test_keep_levers_keeps_the_expert_layout(mixtral):
    """--keep-levers keeps the job's EP 2 (and t, p, cp): no pick writes an expert flag."""
    found = plan(mixtral, "--keep-levers", "--top", "3")
    for pick in found["best"]:
        assert (pick["tp"], pick["pp"], pick["ep"], pick["etp"]) == (1, 4, 2, 1)
        assert "--expert-model-parallel-size" not in pick["flags"]
        verify_pick(mixtral, pick)


def test_fp8_on_a_mixture_of_experts_is_refused(mixtral):
    """--precision fp8 on the Mixtral job is refused naming --precision (exit 2): FP8 experts are not priced."""
    from hops_calib.cli import app

    result = CliRunner().invoke(app, ["plan", "job", str(mixtral), "--precision", "fp8"])
    assert result.exit_code == 2 and "--precision" in result.output and "mixture of experts" in result.output
    # the H100 has FP8 tensor cores: the hint does not send the user to another device
    assert "on a device with FP8 tensor cores" not in " ".join(result.output.split())


# The Llama-3-70B job with its 4 virtual stages spelt as a count (--virtual-pipeline-model-parallel-size 4, the
# spelling of megatron-core's ModelParallelConfig.virtual_pipeline_model_parallel_size and NeMo's) instead of 5
# layers per virtual stage: the same launch.
LLAMA70_VP = LLAMA70.replace("--num-layers-per-virtual-pipeline-stage 5", "--virtual-pipeline-model-parallel-size 4")
VP_SPELLINGS = ("--num-layers-per-virtual-pipeline-stage", "--virtual-pipeline-model-parallel-size")


@pytest.fixture(scope="module")
def llama70_vp(tmp_path_factory):
    return make_job(tmp_path_factory.mktemp("llama70vp") / "llama70vp", LLAMA70_VP, 4)


def test_a_job_spelling_v_as_a_count_gets_picks_megatron_runs(llama70_vp):
    """The job launched with --virtual-pipeline-model-parallel-size 4, planned on the interleaved schedule: every
    pick, the best Megatron runs and the job's own launch build in megatron-core as priced. A pick at another v
    (2 here) writes its --num-layers-per-virtual-pipeline-stage and removes the job's
    --virtual-pipeline-model-parallel-size (both together name two v); one at v 4, or at one model chunk, keeps or
    removes it and writes no layers per virtual stage."""
    found = plan(llama70_vp, "--schedule", "interleaved_1f1b", "--top", "10")
    assert found["current"]["chunks"] == 4 and found["current"]["flags"] == []
    for pick in [*found["best"], found["best_megatron"], found["current"]]:
        verify_pick(llama70_vp, pick)
        if pick["chunks"] == 4:
            assert not set(VP_SPELLINGS) & {*pick["flags"], *pick["remove_flags"]}, pick["changes"]
        else:
            assert "--virtual-pipeline-model-parallel-size" in pick["remove_flags"], pick["changes"]
            assert ("--num-layers-per-virtual-pipeline-stage" in pick["flags"]) is (pick["chunks"] > 1)
    assert any(pick["chunks"] not in (1, 4) for pick in found["best"]), [p["changes"] for p in found["best"]]


@pytest.mark.parametrize("command", [LLAMA70, LLAMA70_VP], ids=["layers-per-virtual-stage", "virtual-size"])
def test_every_v_and_p_a_pick_may_take_builds_as_priced(tmp_path, command):
    """Each spelling of the job's 4 virtual stages, at every (p, v) the planner may price (p 2, 4, 8; v 1 and the
    divisors of the layers per rank): the flags written build v chunks in megatron-core. The job's 5 layers per
    virtual stage gives another v at another p (p 2: 8 chunks; p 8: 2), so a pick that keeps v 4 at p 2 writes
    --num-layers-per-virtual-pipeline-stage 10; the count spelling keeps v at any p and so needs no flag there;
    a pick never writes a vp flag and removes it too."""
    from dataclasses import replace

    from hops_calib.loop.model_files import load_model
    from hops_calib.whatif.job_plan import JobPlanner
    from hops_calib.whatif.launch_space import Launch

    job = make_job(tmp_path / "job", command, 4)
    planner = JobPlanner(job, load_model())
    own = planner.own_levers()
    count = "--virtual-pipeline-model-parallel-size" in command
    for pp, chunks in ((4, 1), (4, 2), (4, 4), (4, 5), (2, 1), (2, 4), (2, 8), (8, 2), (8, 5)):
        levers = replace(own, pp=pp)
        schedule = "interleaved_1f1b" if chunks > 1 else "1f1b"
        launch = Launch(planner.placed_order(pp), None, None, schedule, chunks, 1, (False, False), levers)
        pick = planner.evaluate(launch).to_dict()
        assert pick["chunks"] == chunks and pick["pp"] == pp
        verify_pick(job, pick)
        implied = 4 if count else 80 // (pp * 5)
        written = [flag for flag in VP_SPELLINGS if flag in pick["flags"]]
        assert written == ([] if chunks in (1, implied) else ["--num-layers-per-virtual-pipeline-stage"]), pick
        assert not set(written) & set(pick["remove_flags"]), pick


def test_predict_says_when_context_parallelism_is_priced_without_its_exchange(tmp_path):
    """predict job on the Llama-3-70B job at cp 2 says the shipped model charges no KV exchange (it has no
    context_parallel_comm term); a model copy with the term prices the exchange and says nothing, its CP comm
    column the term's (hidden here: s 8192), and the cp 1 job says nothing either."""
    from hops_calib.cli import app
    from hops_calib.loop.model_files import default_model

    def notes(job: Path, *options: str) -> list[str]:
        result = CliRunner().invoke(app, ["predict", "job", str(job), "--json", *options])
        assert result.exit_code == 0, result.output
        return [n for n in json.loads(result.stdout)["notes"] if "KV exchange" in n]

    cp2 = make_job(tmp_path / "cp2", LLAMA70.replace("--sequence-parallel", "--context-parallel-size 2 --sequence-parallel"), 4)
    assert len(notes(cp2)) == 1 and "cp 2" in notes(cp2)[0]
    copy = tmp_path / "with-cp-term.toml"
    copy.write_text(default_model().read_text() + "\n[terms.context_parallel_comm]\n")
    assert notes(cp2, "--model", str(copy)) == []
    cp1 = make_job(tmp_path / "cp1", LLAMA70, 4)
    assert notes(cp1) == []
    # the header names the virtual stages the launch asks for (80 layers, p 4, 5 layers a virtual stage: v 4)
    text = CliRunner().invoke(app, ["predict", "job", str(cp1)]).output
    assert "configured schedule interleaved_1f1b v=4;" in text
