"""Collectives at scale: the data-parallel reduction across nodes as NCCL runs it (a flat ring whose steps across
nodes pay the network's latency, or two levels: NVLink inside the node, each GPU's NIC share across the nodes) and
Megatron-core's bucketing rules, each against its closed form."""

from __future__ import annotations

import pytest

from hops_calib.loop.model_files import load_model
from hops_calib.model.collectives import collective_ms, two_level_ms
from hops_calib.model.model import resolve_params
from hops_calib.model.terms.optimizer import rank_parameters
from hops_calib.model.terms.parallel import BUCKET_PARAMETERS, dp_buckets
from hops_calib.sim.simulate import simulate
from hops_calib.spec import Hardware, spec_from_args
from hops_calib.trace.collective_bench import CollectiveTable

A100 = Hardware(gpu="a100", gpus_per_node=8)
SIZE = 2.0**28  # a 256 MiB gradient buffer


def _spec(collectives=(), **changes):
    args = {"pipeline_model_parallel_size": 1, "tensor_model_parallel_size": 1, "world_size": 32, "num_layers": 8,
            "hidden_size": 2048, "num_attention_heads": 16, "seq_length": 1024, "max_position_embeddings": 1024,
            "micro_batch_size": 2, "global_batch_size": 256, "vocab_size": 50257, "bf16": True,
            "transformer_impl": "local"}
    args.update(changes)
    return spec_from_args(args, "launch.txt", run_id="r", iterations=3, hardware=A100, collectives=collectives)


@pytest.fixture(scope="module")
def a100():
    return load_model().device("a100")


def test_a_ring_across_nodes_takes_its_bus_bandwidth_and_a_network_latency_per_step(a100):
    spec = _spec()  # d = 32 on 4 nodes of 8: the ring crosses each node once, over its 8 GPUs' NIC shares
    assert spec.group_nodes("dp") == (4, 8)
    n, lat, net = 32, 0.005, 0.009
    bus = min(a100.intra_node_bandwidth_bytes_per_s, 8 * a100.network_bandwidth_bytes_per_s) / 1e3
    assert bus == pytest.approx(8 * 25e9 / 1e3)  # DGX A100: 8 HDR NICs of 25 GB/s, below NVLink's 300 GB/s
    ring = collective_ms(spec, a100, "all_reduce", SIZE, "dp", step_latency_ms=lat, net_step_latency_ms=net)
    assert ring == pytest.approx(2 * (n - 1) / n * SIZE / bus + 2 * (n - 1) * (lat + net))
    # reduce-scatter and all-gather: half of both
    for op in ("reduce_scatter", "all_gather"):
        assert collective_ms(spec, a100, op, SIZE, "dp", step_latency_ms=lat, net_step_latency_ms=net) == (
            pytest.approx(ring / 2))
    # a group inside one node pays no network latency
    inside = _spec(world_size=8)
    assert collective_ms(inside, a100, "all_reduce", SIZE, "dp", step_latency_ms=lat, net_step_latency_ms=net) == (
        pytest.approx(2 * 7 / 8 * SIZE / (a100.intra_node_bandwidth_bytes_per_s / 1e3) + 14 * lat))


def test_two_levels_reduce_inside_the_node_then_across_at_each_gpus_nic_share(a100):
    spec = _spec()
    nodes, g, lat, net = 4, 8, 0.005, 0.009
    nvlink, share = a100.intra_node_bandwidth_bytes_per_s / 1e3, a100.network_bandwidth_bytes_per_s / 1e3
    inside = (g - 1) / g * SIZE / nvlink + (g - 1) * lat  # reduce-scatter (and all-gather) over NVLink
    across = 2 * (nodes - 1) / nodes * (SIZE / g) / share + 2 * (nodes - 1) * (lat + net)
    two = collective_ms(spec, a100, "all_reduce", SIZE, "dp", step_latency_ms=lat, net_step_latency_ms=net,
                        algorithm="two_level")
    assert two == pytest.approx(2 * inside + across)
    assert collective_ms(spec, a100, "reduce_scatter", SIZE, "dp", step_latency_ms=lat, net_step_latency_ms=net,
                         algorithm="two_level") == pytest.approx(inside + across / 2)
    # a large buffer: the flat ring's network time is the same and it hides the NVLink passes, so it wins; a small
    # one: 2(g-1) + 2(N-1) = 20 steps against the ring's 62, so the two levels win; "fastest" takes the faster
    ring = collective_ms(spec, a100, "all_reduce", SIZE, "dp", step_latency_ms=lat, net_step_latency_ms=net)
    assert ring < two
    assert collective_ms(spec, a100, "all_reduce", SIZE, "dp", step_latency_ms=lat, net_step_latency_ms=net,
                         algorithm="fastest") == pytest.approx(ring)
    small = 2.0**16
    ring_small, two_small = (collective_ms(spec, a100, "all_reduce", small, "dp", step_latency_ms=lat,
                                           net_step_latency_ms=net, algorithm=a) for a in ("ring", "two_level"))
    assert two_small < ring_small
    assert collective_ms(spec, a100, "all_reduce", small, "dp", step_latency_ms=lat, net_step_latency_ms=net,
                         algorithm="fastest") == pytest.approx(two_small)
    # the node's 8-GPU table, where the spec has one, prices the level inside the node (half its time each way)
    table = CollectiveTable("all_reduce", 8, ((2**20, 0.05), (2**30, 6.0)))
    measured = two_level_ms(_spec(collectives=(table,)), a100, "all_reduce", SIZE, (nodes, g), step_latency_ms=lat,
                            net_step_latency_ms=net)
    assert measured == pytest.approx(table.measured_ms(SIZE) + across)
    # one GPU of the group per node (t = 8 fills it): nothing to reduce inside, the two levels are the ring
    spread = _spec(tensor_model_parallel_size=8, world_size=64)
    assert spread.group_nodes("dp") == (8, 1)
    assert collective_ms(spread, a100, "all_reduce", SIZE, "dp", algorithm="two_level") == pytest.approx(
        collective_ms(spread, a100, "all_reduce", SIZE, "dp"))
    with pytest.raises(ValueError, match="algorithm"):
        collective_ms(spec, a100, "all_reduce", SIZE, "dp", algorithm="tree")


def _model(**params):
    model = load_model()
    return model.with_term(resolve_params("data_parallel_grad_reduce", params, origin="test"))


def test_megatron_core_buckets_only_on_the_first_pipeline_rank():
    spec = _spec(pipeline_model_parallel_size=2, world_size=32, overlap_grad_reduce=True)  # d = 16
    every, first = _model(), _model(first_rank_buckets=1.0)
    parameters = rank_parameters(every.context(spec), 1)
    assert parameters > BUCKET_PARAMETERS  # more than one bucket's worth on each rank
    assert dp_buckets(spec, parameters, 1) > 1 and dp_buckets(spec, parameters, 1, first_rank_only=True) == 1
    pipeline = first.pipeline(spec)
    assert pipeline.grad_reduce_tail_ms[1] == pytest.approx(pipeline.grad_reduce_ms[1])  # one bucket: all exposed
    assert pipeline.grad_reduce_tail_ms[0] < pipeline.grad_reduce_ms[0]
    assert pipeline.grad_reduce_tail_ms[0] == pytest.approx(every.pipeline(spec).grad_reduce_tail_ms[0])
    assert every.pipeline(spec).grad_reduce_tail_ms[1] < every.pipeline(spec).grad_reduce_ms[1]
    # --ddp-bucket-size sets the bucket (in parameters); without --overlap-grad-reduce there is one bucket
    sized = _spec(pipeline_model_parallel_size=2, world_size=32, overlap_grad_reduce=True, ddp_bucket_size=10**7)
    assert dp_buckets(sized, parameters, 0) == -(-parameters // 10**7)
    assert dp_buckets(_spec(pipeline_model_parallel_size=2, world_size=32), parameters, 0) == 1


def test_with_overlap_and_enough_backward_only_the_last_bucket_is_exposed():
    model = _model()
    plain, overlapped = _spec(), _spec(overlap_grad_reduce=True)
    reduce_plain, reduce_overlapped = model.pipeline(plain), model.pipeline(overlapped)
    tail, whole = reduce_overlapped.grad_reduce_tail_ms[0], reduce_overlapped.grad_reduce_ms[0]
    buckets = dp_buckets(overlapped, rank_parameters(model.context(overlapped), 0))
    assert buckets > 1 and whole == pytest.approx(buckets * tail)
    backward = reduce_overlapped.stages[0].backward_ms
    assert whole - tail <= backward  # the backward outlasts all buckets but the last

    def iteration_ms(pipeline):
        """The second iteration's start from the first's: one whole iteration, its reduction included."""
        columns = simulate(pipeline, "1f1b").columns
        return float(columns["start_ms"][columns["iteration"] == 2].min()
                     - columns["start_ms"][columns["iteration"] == 1].min())

    # the iteration grows by the whole reduction without overlap, by the last bucket's with it
    span_base = load_model().without_term("data_parallel_grad_reduce").pipeline(plain)
    unreduced = iteration_ms(span_base)
    assert iteration_ms(reduce_plain) == pytest.approx(unreduced + reduce_plain.grad_reduce_ms[0], rel=1e-9)
    assert iteration_ms(reduce_overlapped) == pytest.approx(unreduced + tail, rel=1e-9)


@pytest.mark.parametrize("given", ["lots", 0, -5, float("inf")])
def test_a_bad_ddp_bucket_size_is_named(given):
    from hops_calib.errors import InputError

    spec = _spec(overlap_grad_reduce=True, ddp_bucket_size=given)
    with pytest.raises(InputError, match="ddp-bucket-size"):
        dp_buckets(spec, 1e9)


def test_the_new_switches_at_their_defaults_leave_the_shipped_models_identity():
    from hops_calib.loop.model_files import WRITTEN_HEADER, default_model

    model = load_model()
    written = WRITTEN_HEADER.search(default_model().read_text(encoding="utf-8"))
    assert written is not None and model.sha256 == written.group(1)  # the header the gate last wrote
    assert _model().sha256 == model.sha256  # the term resolved afresh, its inert switches at their defaults
    assert _model(first_rank_buckets=1.0).sha256 != model.sha256  # switched on: another model
