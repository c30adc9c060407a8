"""Uneven pipeline stages: the layers each stage builds are Megatron's, and the model and simulator price them."""

import dataclasses
import warnings

import pytest

from hops_calib.loop.model_files import load_model
from hops_calib.model import layout_of
from hops_calib.model.predict import predict
from hops_calib.spec import Hardware, stage_layers_of
from hops_calib.spec.arguments import spec_from_args
from hops_calib.spec.stage_layers import LayoutError, layers_from_layout, parse_layout
from hops_calib.trace import TraceError

BASE = {"pipeline_model_parallel_size": 4, "num_layers": 14, "hidden_size": 256, "num_attention_heads": 4,
        "seq_length": 128, "max_position_embeddings": 128, "vocab_size": 8192, "micro_batch_size": 1,
        "global_batch_size": 8, "train_iters": 4, "transformer_impl": "local", "bf16": True}

SPLITS = [  # (arguments beyond BASE, num_layers)
    ({"account_for_embedding_in_pipeline_split": True}, 15),
    ({"account_for_loss_in_pipeline_split": True}, 11),
    ({"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}, 14),
    ({"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True,
      "virtual_pipeline_model_parallel_size": 2}, 14),
    ({"account_for_embedding_in_pipeline_split": True, "num_layers_per_virtual_pipeline_stage": 2}, 15),
    ({"decoder_first_pipeline_num_layers": 2, "decoder_last_pipeline_num_layers": 6}, 14),
    ({"decoder_first_pipeline_num_layers": 2, "decoder_last_pipeline_num_layers": 4,
      "virtual_pipeline_model_parallel_size": 2}, 14),
    ({"decoder_last_pipeline_num_layers": 5}, 14),
]


def megatron_split(args, num_layers):
    """[rank][chunk] decoder layers from Megatron-core's own get_num_layers_to_build (transformer_block.py)."""
    pytest.importorskip("megatron.core")
    torch = pytest.importorskip("torch")
    warnings.filterwarnings("ignore")
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    pp = args["pipeline_model_parallel_size"]
    vp = args.get("virtual_pipeline_model_parallel_size")
    if args.get("num_layers_per_virtual_pipeline_stage"):
        pieces = num_layers + bool(args.get("account_for_embedding_in_pipeline_split"))
        vp = pieces // (pp * args["num_layers_per_virtual_pipeline_stage"])
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=64, num_attention_heads=4, pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
        num_layers_in_first_pipeline_stage=args.get("decoder_first_pipeline_num_layers"),
        num_layers_in_last_pipeline_stage=args.get("decoder_last_pipeline_num_layers"),
        account_for_embedding_in_pipeline_split=bool(args.get("account_for_embedding_in_pipeline_split")),
        account_for_loss_in_pipeline_split=bool(args.get("account_for_loss_in_pipeline_split")))
    return [[get_num_layers_to_build(config, vp_stage=c if vp else None, pp_rank=r) for c in range(vp or 1)]
            for r in range(pp)]


def spec_of(extra, num_layers=14):
    return spec_from_args({**BASE, **extra, "num_layers": num_layers}, "megatron_args.txt", run_id="uneven",
                          hardware=Hardware(gpu="h100", gpus_per_node=8, source="megatron_args.txt", field="gpu"))


@pytest.mark.parametrize("extra,num_layers", SPLITS)
def test_each_virtual_stage_builds_the_layers_megatron_builds(extra, num_layers):
    spec = spec_of(extra, num_layers)
    expected = megatron_split({**BASE, **extra}, num_layers)
    layout = layout_of(spec)
    assert [[layout.layers[chunk * spec.pp + rank] for chunk in range(spec.vp)] for rank in range(spec.pp)] == expected
    assert spec.layers_per_stage == tuple(sum(chunks) for chunks in expected)


@pytest.mark.parametrize("text,pp", [("Et|tt|tt|tt|tt|tt|tt|tL", 4), ("E|(tt|)*6,L", 4), ("Ettt|tttL", 2),
                                     ("Et*3|t*4|t*4|t*3L", 4), ("E|t*14|L", 3)])
def test_a_layout_string_reads_as_megatrons_parser_reads_it(text, pp):
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    theirs = PipelineParallelLayerLayout(text, pp)
    ours = layers_from_layout(text, sum(stage.count("t") for stage in parse_layout(text)), pp)
    assert ours.vp == theirs.virtual_pipeline_model_parallel_size
    per_virtual = ours.per_virtual_stage or tuple(ours.per_rank[k % pp] // ours.vp for k in range(pp * ours.vp))
    assert [[per_virtual[c * pp + r] for c in range(ours.vp)] for r in range(pp)] == \
        [[theirs.layout[r][c].count(LayerType.decoder) for c in range(ours.vp)] for r in range(pp)]


def test_embedding_and_loss_as_stages_of_their_own_are_priced_there():
    # "E|t*14|L" on 3 ranks: rank 0 holds only the embedding, rank 2 only the output layer and loss.
    spec = spec_of({"pipeline_model_parallel_layout": "E|t*14|L", "pipeline_model_parallel_size": 3})
    assert spec.layers_per_stage == (0, 14, 0) and spec.vp == 1
    model = load_model(None)
    result = predict(spec, model)
    stages = model.pipeline(spec).stages
    assert stages[1].forward_ms > 10 * max(stages[0].forward_ms, stages[2].forward_ms) > 0
    assert result.result.makespan_ms > 0


def test_accounting_for_the_embedding_moves_a_layer_off_the_first_stage():
    model = load_model(None)
    even, accounted = spec_of({}, 16), spec_of({"account_for_embedding_in_pipeline_split": True}, 15)
    assert even.layers_per_stage == (4, 4, 4, 4) and accounted.layers_per_stage == (3, 4, 4, 4)
    plain, moved = model.pipeline(even).stages, model.pipeline(accounted).stages
    assert moved[0].forward_ms < plain[0].forward_ms and moved[1].forward_ms == pytest.approx(plain[1].forward_ms)


def test_uneven_chunks_of_one_rank_are_priced_per_virtual_stage():
    spec = spec_of({"pipeline_model_parallel_layout": "Et|tt|tt|tt|tt|tt|tt|tL"})
    assert spec.vp == 2 and spec.schedule == "interleaved_1f1b" and spec.overlap_p2p
    assert spec.layers_per_virtual_stage == (1, 2, 2, 2, 2, 2, 2, 1)
    stages = load_model(None).pipeline(spec).stages
    assert stages[1].forward_ms == pytest.approx(stages[5].forward_ms)  # two layers each, no end piece
    assert stages[0].forward_ms != pytest.approx(stages[4].forward_ms)
    again = type(spec).from_json(spec.to_json())
    assert again == spec
    assert "layers_per_virtual_stage" not in spec_of({}, 16).to_dict()  # even splits keep the spec's text as it was


@pytest.mark.parametrize("extra,field,words", [
    ({"pipeline_model_parallel_layout": "tE|tt|tt|tt|tt|tt|tt|tL"}, "--pipeline-model-parallel-layout", "first"),
    ({"pipeline_model_parallel_layout": "Et|tt|tt|tt|tt|tt|tt|t"}, "--pipeline-model-parallel-layout", "loss"),
    ({"pipeline_model_parallel_layout": "Et|tt|tt|tt|tt|tt|tt|ttL"}, "--pipeline-model-parallel-layout", "15"),
    ({"pipeline_model_parallel_layout": "Et|tt|tt|tt|tt|tt|tL"}, "--pipeline-model-parallel-layout", "multiple"),
    ({"pipeline_model_parallel_layout": "Et|tt|tt|tt|tt|tt|tt|tmL"}, "--pipeline-model-parallel-layout", "multi-token"),
    ({"pipeline_model_parallel_layout": "Ex|tt|tt|tt|tt|tt|tt|tL"}, "--pipeline-model-parallel-layout", "'x'"),
    ({"pipeline_model_parallel_layout": "|Ett|tt|tt|tt|tt|tt|ttL"}, "--pipeline-model-parallel-layout", "first stage"),
    ({"pipeline_model_parallel_layout": "Et|tt|tt|tt|tt|tt|tt|tL", "decoder_first_pipeline_num_layers": 2},
     "--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers"),
    ({"account_for_embedding_in_pipeline_split": True, "decoder_last_pipeline_num_layers": 2},
     "--account-for-embedding-in-pipeline-split", "uneven"),
    ({"account_for_embedding_in_pipeline_split": True}, "--num-layers", "divisible"),
    ({"pipeline_model_parallel_layout": "E(t|)*9999999999L"}, "--pipeline-model-parallel-layout", "more than"),
])
def test_splits_megatron_refuses_are_refused_naming_the_flag(extra, field, words):
    with pytest.raises(TraceError) as error:
        spec_of(extra)
    assert error.value.field == field and words in str(error.value)


def test_layout_errors_name_their_flag():
    with pytest.raises(LayoutError) as error:
        layers_from_layout("Et|tL", 14, 2)
    assert error.value.flag == "--pipeline-model-parallel-layout"
    assert stage_layers_of({**BASE}, "a", 14, 2).per_rank == (7, 7)
    assert dataclasses.is_dataclass(stage_layers_of({**BASE}, "a", 14, 2))


def test_the_planner_searches_the_interleaved_splits_that_account_for_embedding_and_loss():
    # 4 layers on 2 ranks: with the embedding and the loss counted, 6 pieces make 3 chunks of one per rank, the
    # first and last virtual stages holding no decoder layer (0, 1, 1, 1, 1, 0): a launch no other split builds.
    from pathlib import Path

    from hops_calib.whatif.job_plan import JobPlanner, Launch, accounted_splits

    job = Path(__file__).resolve().parents[2] / "traces" / "cpu_interleaved_v2_l4_h640_s384_m6_run1"
    planner = JobPlanner(job, load_model(None))
    space = planner.space(schedules=("interleaved_1f1b",), orders=False, micro_batch_sizes=False)
    accounted = [launch for launch in space if launch.accounted != (False, False)]
    assert [(launch.chunks, launch.accounted) for launch in accounted] == [(3, (True, True))]
    assert accounted_splits(4, 2, 1, [(2, 2), (1, 3), (3, 1)]) == []  # on one chunk it is a first/last pin
    outcome = planner.evaluate(accounted[0])
    spec = planner.candidate_spec(accounted[0])
    assert spec.layers_per_virtual_stage == (0, 1, 1, 1, 1, 0) and spec.vp == 3
    assert outcome.samples_per_s > 0
    # the job's own --num-layers-per-virtual-pipeline-stage 1 already makes the 6 pieces 3 chunks per rank: kept
    assert set(outcome.argv) == {"--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"}
    assert "even with the embedding and loss as a layer" in accounted[0].label()
    # the job's own launch keeps its blocking p2p; an interleaved candidate of a job without the flag overlaps
    assert not spec.overlap_p2p
    plain = Launch(planner.current().order, None, None, "interleaved_1f1b", 2, 1)
    args = {key: value for key, value in planner.launch_args(plain).items() if "overlap_p2p" not in key}
    assert spec_from_args(args, planner.args_source, run_id="x", hardware=Hardware(
        devices=planner.spec.devices, device_ids=planner.spec.device_ids, source="x")).overlap_p2p
