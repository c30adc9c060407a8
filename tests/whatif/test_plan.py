"""hops-calib plan: the schedule with the lowest bubble within an activation budget."""

import json

import pytest
from typer.testing import CliRunner

from hops_calib.cli import app
from hops_calib.sim.theory import balanced_makespan, bubble_fraction
from hops_calib.whatif.plan import plan

runner = CliRunner()


def run_plan(*args):
    result = runner.invoke(app, ["plan", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_pipebubble_case_chooses_1f1b_over_flushed_gpipe():
    output = run_plan("--stages", "8", "--microbatches", "64", "--memory-budget", "8",
                      "--forward-cost", "1", "--backward-cost", "2", "--json")
    report = json.loads(output)
    assert set(report) >= {"chosen", "candidates"}
    chosen = report["chosen"]
    assert chosen["schedule"] == "1f1b"
    by_schedule = {c["schedule"]: c for c in report["candidates"]}
    for candidate in report["candidates"]:
        assert set(candidate) >= {"schedule", "flushes", "peak_activations_stage_microbatches", "makespan", "bubble",
                                  "utilization"}
        assert candidate["peak_activations_stage_microbatches"] <= 8
    assert by_schedule["gpipe"]["flushes"] == 8
    assert by_schedule["gpipe"]["makespan"] == pytest.approx(360.0)
    assert round(by_schedule["gpipe"]["utilization"], 3) == 0.533
    assert by_schedule["1f1b"]["makespan"] == pytest.approx(213.0)
    assert round(by_schedule["1f1b"]["utilization"], 3) == 0.901
    assert chosen == by_schedule["1f1b"]


def test_a_budget_below_p_leaves_only_flushed_gpipe():
    result = plan(stages=8, microbatches=64, memory_budget=5)
    assert [c.schedule for c in result.candidates] == ["gpipe"]
    gpipe = result.chosen
    # 64 microbatches in flushes of at most 5: 13 flushes, split evenly as 5s (the last one 4)
    assert gpipe.flushes == 13 and gpipe.flush_size == 5 and gpipe.peak_activations == 5
    assert gpipe.makespan == pytest.approx(balanced_makespan("gpipe", 8, 64, gpipe_flush=5))
    assert {r.schedule for r in result.rejected} == {"1f1b", "gpipe (flush 64)"}


def test_an_ample_budget_ties_gpipe_and_1f1b_and_prefers_less_memory():
    result = plan(stages=4, microbatches=8, memory_budget=100)
    assert result.chosen.schedule == "1f1b"
    assert [c.schedule for c in result.candidates] == ["1f1b", "gpipe"]
    assert result.candidates[0].bubble == pytest.approx(result.candidates[1].bubble)
    assert result.chosen.bubble == pytest.approx(bubble_fraction(4, 8))


def test_weight_gradient_split_makes_zb_h1_the_choice():
    result = plan(stages=4, microbatches=8, memory_budget=4, forward_cost=1, backward_cost=2, weight_grad_cost=1)
    assert result.chosen.schedule == "zb_h1"
    assert result.chosen.makespan == pytest.approx(balanced_makespan("zb_h1", 4, 8, 1, 2, 1))


def test_interleaving_is_weighed_by_its_extra_memory_and_megatrons_rules():
    roomy = plan(stages=4, microbatches=8, memory_budget=8, chunks=2)
    assert roomy.chosen.schedule == "interleaved_1f1b"
    assert roomy.chosen.peak_activations == pytest.approx(11 / 2)  # (4-0-1)*2 + 4 + 1 chunks of half a stage
    tight = plan(stages=4, microbatches=8, memory_budget=4, chunks=2)
    assert tight.chosen.schedule == "1f1b"
    refused = plan(stages=4, microbatches=6, memory_budget=8, chunks=2)
    assert any(r.schedule == "interleaved_1f1b" and "not divisible" in r.reason for r in refused.rejected)


def test_text_output_and_target_bubble():
    output = run_plan("--stages", "8", "--microbatches", "64", "--memory-budget", "8", "--target-bubble", "0.1")
    assert "chosen: 1f1b (utilization 0.901)" in output
    assert "gpipe" in output and "with 63 microbatches" in output
    assert "peak act.: activations on the fullest device, in microbatches of a whole stage" in output


@pytest.mark.parametrize("args,message", [
    (["--stages", "0", "--microbatches", "4", "--memory-budget", "4"], "--stages must be at least 1"),
    (["--stages", "4", "--microbatches", "4", "--memory-budget", "0.5"], "--memory-budget must be a finite number"),
    (["--stages", "4", "--microbatches", "4", "--memory-budget", "inf"], "--memory-budget must be a finite number"),
    (["--stages", "4", "--microbatches", "4", "--memory-budget", "nan"], "--memory-budget must be a finite number"),
    (["--stages", "4", "--microbatches", "4", "--memory-budget", "4", "--weight-grad-cost", "3"],
     "must not exceed --backward-cost"),
    (["--stages", "4", "--microbatches", "4", "--memory-budget", "4", "--forward-cost", "0", "--backward-cost", "0"],
     "forward + backward > 0"),
])
def test_bad_input_names_the_option(args, message):
    result = runner.invoke(app, ["plan", *args])
    assert result.exit_code != 0
    assert message in " ".join(result.output.replace("│", " ").split())  # rich wraps errors in a box
