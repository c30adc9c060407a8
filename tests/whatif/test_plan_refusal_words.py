"""What `plan job` says of a launch it leaves out: whose rule it is (Megatron's, naming the flag, or the model's,
which does not price it), checked on the errors the spec raises for real launches."""

from __future__ import annotations

import pytest

from hops_calib.spec import Hardware, spec_from_args
from hops_calib.trace import TraceError
from hops_calib.whatif.launch_pricing import refusal_text

BASE = {
    "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "world_size": 8, "num_layers": 4,
    "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 1024, "max_position_embeddings": 1024,
    "micro_batch_size": 1, "global_batch_size": 8, "bf16": True, "vocab_size": 32000,
}


def refused(args: dict) -> TraceError:
    with pytest.raises(TraceError) as caught:
        spec_from_args(args, "test", run_id="r", iterations=2, hardware=Hardware(gpu="h100_dgx", gpus_per_node=8))
    return caught.value


def test_what_the_model_does_not_price_is_not_called_megatrons_refusal() -> None:
    error = refused({**BASE, "multi_latent_attention": True})
    text = refusal_text(error)
    assert text.startswith("the model does not price the launch:") and "--multi-latent-attention" in text
    assert "Megatron refuses" not in text


def test_megatrons_own_rule_names_its_flag() -> None:
    error = refused({**BASE, "global_batch_size": 7})
    text = refusal_text(error)
    assert text.startswith("Megatron refuses the launch:") and "--global-batch-size" in text
