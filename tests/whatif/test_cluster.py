"""The cluster (hops_calib.cluster): built from the shared runs' job directories, written and read back, and hops
priced by the hosts at their ends: a reordered what-if gets the link the real reordered run measured."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from hops_calib.whatif.cluster import Cluster, Device, Link, Node, cluster_from_jobs, cluster_yaml, read_cluster
from hops_calib.whatif.link_book import relinked, unpriced_hint
from hops_calib.errors import InputError
from hops_calib.spec import build_spec
from hops_calib.trace.job import find_job_dirs

REPO = Path(__file__).resolve().parents[2]
# (a run, the real run whose stage order a what-if of it takes): pipelines recorded in both orders
REORDERED = (("exp2_9_g_only_pp4_run65", "exp2_26_g_only_l4_front_pp4_run173"),
             ("exp2_1_all_nodes_run51", "exp2_2_reverse_order_run69"))


@pytest.fixture(scope="module")
def shared_cluster(shared_runs) -> Cluster:
    return cluster_from_jobs([shared_runs])


def reordered_what_if(source: Path, order: list[str], into: Path) -> Path:
    """A what-if job directory: `source`'s configuration (no traces) with its stages put in `order` (the stage map
    and the template together, as the user edits them); the link benchmark files are copied unchanged."""
    job = into / source.name
    shutil.copytree(source, job, ignore=shutil.ignore_patterns("megatron_trace", "megatron_summary.json"))
    (job / "hops_trace_map.json").write_text(json.dumps({"stages": {str(k): d for k, d in enumerate(order)}}))
    template = yaml.safe_load((job / "hops.base.yaml").read_text())
    template["pipeline"]["stages"] = [dict(template["pipeline"]["stages"][0], device=d) for d in order]
    (job / "hops.base.yaml").write_text(yaml.safe_dump(template))
    return job


def test_the_shared_runs_make_one_cluster_that_reads_back(shared_runs, shared_cluster, tmp_path):
    devices = {d.id for node in shared_cluster.nodes for d in node.devices}
    stage_maps = {d for job in find_job_dirs(shared_runs)
                  for d in json.loads((job / "hops_trace_map.json").read_text())["stages"].values()}
    assert devices == stage_maps and not shared_cluster.notes
    # every host pair of every pair file is a link
    assert all(link.benchmarked for link in shared_cluster.links)
    path = tmp_path / "cluster.yaml"
    path.write_text(cluster_yaml(shared_cluster))
    back = read_cluster(path)
    assert back.nodes == shared_cluster.nodes and back.links == shared_cluster.links


@pytest.mark.parametrize("run, real", REORDERED)
def test_a_reordered_what_if_prices_each_hop_by_its_hosts(shared_runs, shared_cluster, tmp_path, run, real):
    real_spec = build_spec(shared_runs / real)
    job = reordered_what_if(shared_runs / run, list(real_spec.device_ids), tmp_path)
    spec = build_spec(job)  # the job's own pair files, by stage position: the old pricing
    priced, hops = relinked(spec, job, shared_cluster)
    moved = 0
    for hop in hops:
        measured = real_spec.link(hop.src_stage, hop.dst_stage)  # what the real reordered run benchmarked there
        assert hop.link is not None
        assert hop.link.bandwidth_gbit_s == pytest.approx(measured.bandwidth_gbit_s, rel=0.05), hop
        assert priced.link(hop.src_stage, hop.dst_stage) is hop.link
        positional = spec.link(hop.src_stage, hop.dst_stage).bandwidth_gbit_s
        moved += abs(positional / measured.bandwidth_gbit_s - 1) > 0.2
    assert moved >= 2  # the positional pricing had the fast and the slow hops the wrong way round


def test_recorded_runs_keep_their_own_benchmark(shared_runs, shared_cluster):
    for job in [*find_job_dirs(shared_runs), *find_job_dirs(REPO / "traces")]:
        spec = build_spec(job)
        for cluster in (None, shared_cluster):
            assert relinked(spec, job, cluster)[0].links == spec.links, job.name


def test_a_hop_with_no_link_is_named_and_a_declared_link_prices_it(shared_runs, shared_cluster, tmp_path):
    order = ["l4_node0_gpu0", "l4_node1_gpu0", "a10g_node0_gpu0", "a10g_node1_gpu0"]
    job = reordered_what_if(shared_runs / "exp2_9_g_only_pp4_run65", order, tmp_path)
    spec = build_spec(job)
    # a cluster that knows where the devices are but has no link g6b -> g5a (nor the reverse)
    hosts = {d.id: node.host for node in shared_cluster.nodes for d in node.devices}
    gap = (hosts["l4_node1_gpu0"], hosts["a10g_node0_gpu0"])
    partial = Cluster(shared_cluster.nodes, tuple(link for link in shared_cluster.links
                                                  if {link.src_host, link.dst_host} != set(gap)), origin="c.yaml")
    _, hops = relinked(spec, job, partial)
    assert [(h.src_stage, h.dst_stage) for h in hops if h.link is None] == [(1, 2)]
    hint = unpriced_hint(hops, partial)
    assert gap[0] in hint and gap[1] in hint and "c.yaml" in hint
    declared = Cluster(partial.nodes, (*partial.links, Link(gap[0], gap[1], 0.1, 5.0)), origin="c.yaml")
    priced, hops = relinked(spec, job, declared)
    assert priced.link(1, 2).bandwidth_gbit_s == pytest.approx(5.0) and "declared" in priced.link(1, 2).source


@pytest.mark.parametrize("text, field, line", [
    ("nodes: []", "nodes", 1),
    ("nodes:\n  - host: a\n    devices: [{id: x}]\n", "nodes[0].devices[0]", 3),
    ("nodes:\n  - host: a\n    devices: [{id: x, gpu: l4}]\nlinks:\n  - hosts: [a, b]\n    bandwidth_gbit_s: 1\n",
     "links[0].hosts", 5),
    ("nodes:\n  - host: a\n    devices: [{id: x, gpu: l4}]\nlinks:\n  - hosts: [a, a]\n    bandwidth_gbit_s: -1\n",
     "links[0].bandwidth_gbit_s", 6),
    ("nodes:\n  - host: a\n    devices: [{id: x, gpu: l4}]\nlinks:\n  - hosts: [a, a]\n    benchmark: [[1, 2]]\n"
     "    latency_ms: 1\n", "links[0].bandwidth_gbit_s", 5),
    ("nodes: [", None, 1),
])
def test_a_bad_cluster_file_is_named_with_its_field(tmp_path, text, field, line):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as caught:
        read_cluster(path)
    assert caught.value.origin == str(path) and caught.value.field == field
    assert caught.value.line == line  # the line of the offending entry or key


def test_a_hand_written_cluster_round_trips(tmp_path):
    cluster = Cluster((Node("h1", (Device("g0", "h100"), Device("g1", "h100"))), Node("h2", (Device("g2", "l4"),))),
                      (Link("h1", "h2", 0.02, 25.0),))
    path = tmp_path / "c.yaml"
    path.write_text(cluster_yaml(cluster))
    back = read_cluster(path)
    assert back.nodes == cluster.nodes and back.links == cluster.links and back.host_of("g2") == "h2"
    assert back.link("h2", "h1") == (cluster.links[0], True)  # the other direction prices it when alone


def test_the_ends_all_reduce_is_shown_and_explains_the_cluster_gap(shared_runs, shared_cluster, tmp_path):
    """Reversing exp2_9 moves its ends onto other hosts: with and without the cluster, the what-if names the
    all-reduce between the ends, the hosts and link estimate pricing it, and its time accounts for most of the
    iteration-time difference between the two (the pipeline part hardly moves)."""
    from hops_calib.loop.model_files import load_model
    from hops_calib.cli.render.predict import what_if_text
    from hops_calib.whatif.job import what_if

    run, real = REORDERED[0]
    job = reordered_what_if(shared_runs / run, list(build_spec(shared_runs / real).device_ids), tmp_path)
    model = load_model(None)
    with_cluster, without = what_if(job, model, cluster=shared_cluster), what_if(job, model)
    ends = [result.to_dict()["end_collective"] for result in (with_cluster, without)]
    assert all(end["bytes"] > 0 and end["ms"] > 0 and end["stages"] == [0, 3] for end in ends)
    # the ends' hosts as the cluster places the devices, and as the job's benchmark names them by position
    assert ends[0]["hosts"] == [shared_cluster.host_of(d) for d in ends[0]["devices"]]
    assert ends[0]["hosts"] != ends[1]["hosts"] and ends[0]["source"] != ends[1]["source"]
    gap = (with_cluster.predictions[0].metrics.iteration_time_ms - without.predictions[0].metrics.iteration_time_ms)
    assert abs(gap) > 0.1 * without.predictions[0].metrics.iteration_time_ms
    assert abs((ends[0]["ms"] - ends[1]["ms"]) - gap) < 0.25 * abs(gap)
    text = what_if_text(with_cluster)
    assert "between the ends, before the optimizer" in text and ends[0]["hosts"][0] in text
    assert with_cluster.to_dict()["cluster"] == shared_cluster.origin
