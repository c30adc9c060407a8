"""The planner for a real job (hops_calib.whatif.job_plan): launches of a job's model and batch on its devices,
priced as
predict prices them, checked against memory, ranked; and its ranking of real configurations against their
measured throughput."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from hops_calib.whatif.cluster import cluster_from_jobs
from hops_calib.errors import InputError
from hops_calib.whatif.job_plan import (
    SCHEDULES, JobPlanner, layer_splits, pairwise_agreement, plan_job, train_group_agreement,
)
from hops_calib.cli.render.plan import format_job_plan
from hops_calib.loop.model_files import load_model
from hops_calib.model.predict import predict
from hops_calib.sim.perturb import Failure, RandomStragglers
from hops_calib.whatif.perturbations import Perturbations
from hops_calib.spec import build_spec, split_layers
from hops_calib.trace.job import find_job_dirs

REPO = Path(__file__).resolve().parents[2]
CPU_JOB = REPO / "traces" / "cpu_1f1b_l4_h512_s256_m4_run1"


@pytest.fixture(scope="module")
def model():
    return load_model()


def test_every_split_megatron_launches_is_searched_once():
    for layers, pp in ((12, 4), (18, 6), (8, 2), (10, 5)):
        splits = layer_splits(layers, pp)
        counts = [split_layers(layers, pp, first, last) for first, last in splits]
        assert len(set(counts)) == len(counts) and (None, None) in splits
        assert all(sum(c) == layers and min(c) >= 1 for c in counts)
    assert split_layers(18, 6, 8, 2) in [split_layers(18, 6, *s) for s in layer_splits(18, 6)]  # exp2_35's


def test_a_jobs_own_launch_is_priced_as_predict_prices_it(model):
    for job in find_job_dirs(REPO / "traces"):
        planner = JobPlanner(job, model)
        spec = build_spec(job)
        # samples of every data-parallel replica (the d = 2 captures count both)
        expected = predict(spec, model).metrics.throughput_per_s * spec.model.micro_batch_size * spec.dp
        assert planner.evaluate(planner.current()).samples_per_s == pytest.approx(expected, rel=1e-12)
        assert planner.changes(planner.current())["words"] == ()


def test_plan_on_a_cpu_capture_is_exhaustive_ranked_and_fits_memory(model):
    plan = plan_job(CPU_JOB, model, top=4)
    assert plan.search == "exhaustive" and plan.evaluated == plan.space and len(plan.best) == 4
    rates = [o.samples_per_s for o in plan.best]
    assert rates == sorted(rates, reverse=True) and all(o.fits for o in plan.best)
    assert plan.best[0].samples_per_s >= plan.current.samples_per_s  # the job's own launch is in the space
    for outcome in plan.best:
        assert sum(outcome.layers_per_stage) == 4
        # every replica's microbatches make the global batch (a layout of d 2 halves each replica's)
        assert (outcome.microbatches * outcome.launch.micro_batch_size * outcome.to_dict()["dp"]
                == build_spec(CPU_JOB).model.global_batch_size)
    text = format_job_plan(plan)
    assert "idle %" in text and "sched. bubble %" in text and "now" in text


def test_a_device_too_small_leaves_every_launch_out(model, tmp_path):
    small = model.with_device_constant("cpu", "memory_bytes", 1e6, "test: a 1 MB device")
    plan = plan_job(CPU_JOB, small, top=3)
    assert plan.best == () and plan.over_memory > 0


def _two_hosts(path: Path, there: float, back: float) -> Path:
    """A cluster file putting the CPU capture's two cores on two hosts, the link between them declared at `there`
    Gbit/s one way and `back` the other."""
    path.write_text("nodes:\n" + "".join(f"  - {{host: h{k}, devices: [{{id: cpu_node0_core{k}, gpu: cpu}}]}}\n"
                                         for k in (0, 1))
                    + f"links:\n  - {{hosts: [h0, h1], latency_ms: 0.05, bandwidth_gbit_s: {there}}}\n"
                    + f"  - {{hosts: [h1, h0], latency_ms: 0.05, bandwidth_gbit_s: {back}}}\n")
    return path


def test_a_large_space_is_searched_by_a_seeded_study(model, tmp_path):
    from hops_calib.whatif.cluster import read_cluster

    # the two cores on hosts whose link is slower one way: the two orders differ (else one order is searched)
    cluster = read_cluster(_two_hosts(tmp_path / "cluster.yaml", 8, 2))
    first = plan_job(CPU_JOB, model, cluster=cluster, top=3, trials=25, seed=7, exhaustive_limit=10)
    again = plan_job(CPU_JOB, model, cluster=cluster, top=3, trials=25, seed=7, exhaustive_limit=10)
    assert "optuna TPE, seed 7, 25 trials" in first.search and first.orders == 2
    assert [o.launch for o in first.best] == [o.launch for o in again.best]
    exhaustive = plan_job(CPU_JOB, model, cluster=cluster, top=3)
    assert first.best[0].samples_per_s == pytest.approx(exhaustive.best[0].samples_per_s, rel=1e-12)
    assert first.evaluated < exhaustive.evaluated


def test_auto_is_the_hopshetero_rule(model):
    plan = plan_job(CPU_JOB, model, top=50, schedules=("1f1b", "zb_h1", "auto"))
    _, compared = plan.auto_agreement
    assert compared > 0
    planner = JobPlanner(CPU_JOB, model)
    for outcome in plan.best:
        if outcome.launch.schedule == "auto":
            from hops_calib.sim.simulate import auto_schedule

            pipeline = model.pipeline(planner.candidate_spec(outcome.launch))
            assert outcome.resolved == auto_schedule(pipeline)


def test_stragglers_and_failures_lower_the_expected_and_the_p5_throughput(model):
    device = build_spec(CPU_JOB).device_ids[1]
    perturbations = Perturbations(slow_devices=((device, 1.1),), stragglers=RandomStragglers(0.2, 1.05, 1.3),
                                  failures=(Failure("any device", 2.0, 30.0),), run_iterations=200, samples=12)
    plan = plan_job(CPU_JOB, model, top=3, perturbations=perturbations, rank_by="p5")
    for outcome in plan.best:
        assert outcome.p5_samples_per_s <= outcome.expected_samples_per_s < outcome.samples_per_s
    p5 = [o.p5_samples_per_s for o in plan.best]
    assert p5 == sorted(p5, reverse=True)
    with pytest.raises(InputError, match="--rank-by"):
        plan_job(CPU_JOB, model, rank_by="p5")


def test_expected_and_p5_count_every_data_parallel_replica_as_the_nominal_throughput_does(model):
    """On a job with two data-parallel replicas the expected and 5th-percentile samples/s under mild stragglers
    sit just below the nominal samples/s, which counts both replicas: not near half of it (one replica's)."""
    job = REPO / "traces" / "cpu_1f1b_d2_l4_h384_s128_m4_run1"
    assert build_spec(job).dp == 2
    perturbations = Perturbations(stragglers=RandomStragglers(0.05, 1.01, 1.02), run_iterations=200, samples=8)
    plan = plan_job(job, model, top=2, perturbations=perturbations, orders=False)
    for outcome in plan.best:
        assert 0.9 * outcome.samples_per_s < outcome.p5_samples_per_s <= outcome.expected_samples_per_s
        assert outcome.expected_samples_per_s <= outcome.samples_per_s


def test_pairwise_agreement_counts_orderings():
    assert pairwise_agreement([("a", 1.0, 10.0), ("b", 2.0, 20.0), ("c", 3.0, 5.0)]) == (1, 3)


def test_plan_job_on_a_shared_run_with_its_cluster(shared_runs, model):
    cluster = cluster_from_jobs([shared_runs])
    job = shared_runs / "exp2_9_g_only_pp4_run65"
    plan = plan_job(job, model, cluster=cluster, top=3, schedules=("1f1b",), splits=False, micro_batch_sizes=False,
                    levers=False)
    assert plan.search == "exhaustive" and plan.space == 24 and not plan.refused  # every order priced by host
    best = plan.best[0]
    assert best.samples_per_s >= plan.current.samples_per_s
    assert any(flag.startswith("stage map") for flag in best.flags) or best.launch == plan.current.launch
    # without a cluster, orders with a host pair the job never benchmarked are named, not priced by position
    alone = plan_job(job, model, top=3, schedules=("1f1b",), splits=False, micro_batch_sizes=False)
    assert any(reason.startswith("no link") for reason in alone.refused)


def test_the_planner_ranks_real_train_configurations_mostly_as_measured(shared_runs, shared_store, model):
    groups = train_group_agreement(shared_store, shared_runs, model)
    agree = sum(g.agreeing for g in groups)
    pairs = sum(g.pairs for g in groups)
    assert len(groups) >= 3 and pairs >= 6
    assert agree / pairs > 0.5  # better than a coin: the planner's ranking follows the measured one


def test_a_large_space_is_counted_not_listed():
    from hops_calib.whatif.job_plan import SCHEDULES, Space

    space = Space(devices=tuple(f"gpu{k}" for k in range(12)), current_order=tuple(f"gpu{k}" for k in range(12)),
                  splits=tuple(layer_splits(96, 12)), sizes=(1, 2, 4), schedules=SCHEDULES, layers=96, pp=12,
                  batch=48)
    shapes = space.shapes()
    assert len(space) == 479001600 * len(shapes)  # 12! orders, counted in no time
    first = next(iter(space))
    assert first.order == space.current_order and (first.micro_batch_size, first.first, first.last, first.schedule,
                                                   first.chunks, first.accounted) == shapes[0]


def test_a_huge_global_batch_neither_hangs_nor_simulates_millions_of_microbatches(model, tmp_path):
    import shutil

    job = tmp_path / CPU_JOB.name
    shutil.copytree(CPU_JOB, job, ignore=shutil.ignore_patterns("megatron_trace"))
    args = job / "megatron_args.txt"
    args.write_text(args.read_text().replace("--global-batch-size 4", "--global-batch-size 1048576"))
    plan = plan_job(job, model, top=2, schedules=("1f1b",), splits=False)
    assert any("tasks per iteration" in reason for reason in plan.refused)
    assert plan.best and all(2 * o.microbatches * 2 <= 200_000 for o in plan.best)  # what ran stayed small
    assert plan.over_memory > 0  # and the largest micro batches do not fit the device


def _apply(job: Path, argv: list[str], remove: list[str], into: Path) -> Path:
    """A copy of `job` whose megatron_args.txt takes the plan's argv tokens and removals, as a user would."""
    import shlex
    import shutil

    copy = into / job.name
    shutil.copytree(job, copy, ignore=shutil.ignore_patterns("megatron_trace", "megatron_summary.json"))
    path = copy / "megatron_args.txt"
    tokens = shlex.split(path.read_text())
    out, k = [], 0
    setting = {argv[i]: argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
               for i in range(len(argv)) if argv[i].startswith("--")}
    while k < len(tokens):  # drop every flag the plan sets or removes, with its value
        token = tokens[k]
        has_value = k + 1 < len(tokens) and not tokens[k + 1].startswith("--")
        if token in setting or token in remove:
            k += 2 if has_value else 1
            continue
        out.append(token)
        k += 1
    path.write_text(" ".join(out + argv) + "\n")
    return copy


def test_the_plans_flags_are_argv_that_launch_what_it_priced(model, tmp_path):
    """JSON flags are argv tokens: put into the job's own launch they give the layer split and microbatches the
    planner priced; prose (a schedule with no Megatron-LM flag) goes to notes; each schedule's bubble is its own
    closed form (ZB-H1 below 1F1B's (p-1)/(m+p-1) on the same launch); fits is said for the job's own launch."""
    import json

    from hops_calib.metrics import schedule_bubble

    job = REPO / "traces" / "cpu_1f1b_l6_h384_s256_m4_run1"
    # the layout kept (a new layout needs its own stage map, not only flags: `levers=False`)
    plan = plan_job(job, model, top=40, schedules=("1f1b", "zb_h1"), orders=False, levers=False)
    data = json.loads(json.dumps(plan.to_dict()))
    changed = [o for o in data["best"] if o["flags"]]
    assert changed and all(isinstance(t, str) and " " not in t for o in changed for t in o["flags"])
    for outcome in changed[:3]:
        spec = build_spec(_apply(job, outcome["flags"], outcome["remove_flags"], tmp_path / str(id(outcome))))
        assert list(spec.layers_per_stage) == outcome["layers_per_stage"]
        assert spec.microbatches == outcome["microbatches"]
    zb = [o for o in data["best"] if o["schedule"] == "zb_h1"]
    assert zb and all(any("zb_h1" in note for note in o["notes"]) for o in zb)
    assert all(not any(flag.startswith("schedule") for flag in o["flags"]) for o in zb)
    for o in data["best"]:
        balanced = schedule_bubble(len(o["layers_per_stage"]), o["microbatches"])
        if o["schedule"] == "1f1b":
            assert o["schedule_bubble"] == pytest.approx(balanced)
        else:
            assert 0 < o["schedule_bubble"] < balanced
    assert data["current"]["fits"] is True
    tight = plan_job(job, model, top=1, orders=False,
                     memory_bytes={"cpu": 0.999 * max(plan.current.peak_memory_bytes)})
    assert tight.to_dict()["current"]["fits"] is False and "DOES NOT FIT" in format_job_plan(tight)


def test_interchangeable_devices_price_alike_so_one_order_of_their_kinds_is_searched(model, tmp_path):
    """Devices nothing tells apart (one type, the same links to every other device at every position) price a launch
    the same wherever they sit: the planner searches one order per sequence of kinds (n! / n_1! n_2! ...), each by
    the order the job's own launch gives its devices, so the job's own order stands for itself. A slowed device is
    a kind of its own."""
    from hops_calib.whatif.cluster import read_cluster
    from hops_calib.whatif.job_plan import Launch, SCHEDULES, Space

    # the CPU capture's two cores on one host: one kind; swapping them changes no price
    planner = JobPlanner(CPU_JOB, model)
    own = planner.current()
    swapped = Launch(own.order[::-1], own.first, own.last, own.schedule, own.chunks, own.micro_batch_size)
    assert planner.kinds() == (0, 0) and planner.space().orders_count() == 1
    assert planner.evaluate(swapped).samples_per_s == planner.evaluate(own).samples_per_s
    assert planner.kinds(distinct=("cpu_node0_core1",)) == (0, 1)
    # on two hosts whose link is slower one way they are two kinds, and the swap prices otherwise
    apart = JobPlanner(CPU_JOB, model, read_cluster(_two_hosts(tmp_path / "cluster.yaml", 8, 2)))
    assert apart.kinds() == (0, 1) and apart.space().orders_count() == 2
    assert apart.evaluate(swapped).samples_per_s != apart.evaluate(apart.current()).samples_per_s
    # the same rate both ways: alike again
    alike = JobPlanner(CPU_JOB, model, read_cluster(_two_hosts(tmp_path / "same.yaml", 8, 8)))
    assert alike.kinds() == (0, 0)
    # the orders of kinds: each once, canonical, counted without listing
    devices = ("a0", "b0", "a1", "c0", "b1", "a2")
    space = Space(devices=devices, current_order=devices, splits=((None, None),), sizes=(1,), schedules=SCHEDULES,
                  layers=6, pp=6, batch=6, kinds=(0, 1, 0, 2, 1, 0))
    orders = list(space.orders())
    assert len(orders) == len(set(orders)) == space.orders_count() == 720 // (6 * 2)
    kinds = {"a": 0, "b": 1, "c": 2}
    assert len({tuple(kinds[d[0]] for d in order) for order in orders}) == 60
    assert all(space.canonical(order) == order for order in orders) and space.canonical(devices) == devices
    assert space.canonical(("a2", "b1", "a1", "c0", "b0", "a0")) == ("a0", "b0", "a1", "c0", "b1", "a2")
    alone = Space(devices=devices, current_order=devices, splits=((None, None),), sizes=(1,), schedules=SCHEDULES,
                  layers=6, pp=6, batch=6)
    assert list(alone.orders()) == list(itertools.permutations(devices))  # every device its own kind: as before


def test_plan_on_readmes_512_gpu_job_prices_its_launches_and_stays_bounded(model, tmp_path):
    """docs/whatif.md's 512-A100 job (8 stage devices, 40,320 orders; no link benchmark): its launches are priced from
    torchrun's placement as predict --job prices them (the planner had refused every one: 'no link'), its 8
    devices are one kind (one order searched), and the coordinate ascent after the study stops at its budget of
    launches priced, said in a note, instead of running for hours over 56,470 shapes a step."""
    from job_copies import readme_gpu_job
    from typer.testing import CliRunner

    from hops_calib.cli import app

    job, _ = readme_gpu_job(tmp_path)
    planner = JobPlanner(job, model)
    own = planner.evaluate(planner.current())
    predicted = json.loads(CliRunner().invoke(app, ["predict", "--job", str(job), "--json"]).stdout)
    assert own.samples_per_s == pytest.approx(predicted["predictions"][0]["samples_per_s"], rel=1e-12)
    assert planner.kinds() == (0,) * 8
    plan = plan_job(job, model, top=2, trials=20, ascent_tasks=40 * 3072, levers=False,  # 40 of its own size
                    schedules=SCHEDULES, study_trials=20)
    assert plan.orders == 1 and plan.space == len(planner.space().shapes())
    assert plan.evaluated <= 20 + 40 + 1 and plan.best and plan.current is not None
    assert any("interchangeable devices" in note and "1 distinct stage order(s) searched of 40320" in note
               for note in plan.notes)
    # what happened, not "0 step(s) ... stopped at its budget": the budget ran out inside a neighbourhood scan; and
    # the counts add up (the walkthrough's "724 of 56,471 neighbours" against a budget of 651 and a space of 56,470)
    found = re.search(r"^optuna TPE, seed 0, 20 trials over ([\d,]+) candidates \(([\d,]+) distinct launches priced: "
                      r"the others repeated one or fell outside the space\), the job's own launch \((priced before"
                      r"|1 more)\), then coordinate ascent .*: (\d+) move\(s\) to a faster neighbour, ([\d,]+) new "
                      r"launches priced; its budget of 40 new launches ran out inside step (\d+)'s neighbourhood scan "
                      r"\(ascending from (the study's best|the job's own launch)\): ([\d,]+) of its ([\d,]+) neighbours "
                      r"looked at \(([\d,]+) priced new, ([\d,]+) priced before\)$", plan.search)
    assert found, plan.search
    space, studied, steps, new, step, scanned, neighbours, fresh, before = (
        int(found.group(k).replace(",", "")) for k in (1, 2, 4, 5, 6, 8, 9, 10, 11))
    assert space == plan.space and studied <= 20 and steps >= 0 and step >= 1
    assert plan.evaluated == studied + (found.group(3) == "1 more") + new and fresh <= new == 40
    assert scanned == fresh + before < neighbours == plan.space - 1  # one order: every other shape, not itself
    assert f"{plan.evaluated:,} distinct launches priced of {plan.space:,} candidates" in format_job_plan(plan)
    assert any("coordinate ascent stopped: its budget of 40 new launches ran out" in note and "--trials" in note
               for note in plan.notes)


def test_memory_is_in_gb_in_every_plan_and_bytes_in_json(tmp_path):
    """plan --job and plan --job --parallel show memory in GB (10^9 bytes), as predict --job does; --json in bytes.
    A device's capacity alone is also given in GiB (2^30 bytes), beside its GB: "24.00 GB (22.35 GiB)"."""
    import re

    from typer.testing import CliRunner

    from hops_calib.cli import app

    def run(*args):
        result = CliRunner().invoke(app, [*args])
        assert result.exit_code == 0, result.output
        return result.stdout

    planned = json.loads(run("plan", "--job", str(CPU_JOB), "--trials", "3", "--top", "1", "--json"))
    text = run("plan", "--job", str(CPU_JOB), "--trials", "3", "--top", "1")
    assert "peak GB/GPU" in text and "GB: 10^9 bytes; GiB: 2^30 bytes" in text
    capacities = re.findall(r"([\d.]+) GB \(([\d.]+) GiB\)", text)
    assert text.count("GiB") == len(capacities) + 1  # each capacity, and the legend
    capacity = planned["memory_capacity_bytes"]["cpu"]
    assert capacities == [(f"{capacity / 1e9:.2f}", f"{capacity / 2**30:.2f}")]
    peak = max(planned["best"][0]["peak_memory_bytes_per_gpu"])
    first = next(following for line, following in zip(text.splitlines(), text.splitlines()[1:])
                 if "peak GB/GPU" in line)
    # the row: #, samples/s, steady, idle %, sched. bubble %, peak GB/GPU, launch
    assert float(first.split()[5]) == pytest.approx(peak / 1e9, abs=0.005)
    layouts = run("plan", "--job", str(CPU_JOB), "--parallel")
    assert "GiB" not in layouts and "GB/GPU (GB: 10^9 bytes)" in layouts
    assert "GB (weights" in run("predict", "--job", str(CPU_JOB))
