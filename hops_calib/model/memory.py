"""Model room: the peak memory of one pipeline rank in bytes (weights, gradients, optimizer state, activations).

What a planner checks against each device's memory (`DeviceSpec.memory_bytes`). Counts, not fits:

- Model and optimizer state per parameter: Megatron's mixed-precision Adam without the distributed optimizer keeps
  the 16-bit weight (2 B), an fp32 gradient buffer (4 B: bf16 runs accumulate gradients in fp32), the fp32 master
  weight and the two fp32 Adam moments (12 B): 18 B (ZeRO, Rajbhandari et al. 2020, sec. 3.1: 2 + 2 + 12 = 16 B with
  16-bit gradients). fp32 training: weight, gradient and two moments, 16 B.
- Activations: the rank's peak microbatches in flight (the schedule's, in stage microbatches) times its decoder
  layers' stored activations (`gpt.layer_activation_bytes`, Korthikanti et al. 2022), plus, on the last stage, one
  microbatch's fp32 logits for the loss (s b V 4 B). Under activation recomputation (Korthikanti et al. sec. 4-5):
  a fully recomputed layer stores only its input (2 s b h B) and, while its backward redoes the forward, one
  layer's activations are live at once; selective recomputation stores none of the attention core (5 a s^2 b B).

Not counted: the CUDA context and allocator fragmentation (a few hundred MB to a GB): leave headroom.
"""

from __future__ import annotations

from hops_calib.model import gpt
from hops_calib.spec import ModelShape

STATE_BYTES_PER_PARAMETER = {"bf16": 18.0, "fp16": 18.0, "fp32": 16.0}
LOGIT_BYTES = 4  # the loss reads fp32 logits


def rank_memory_bytes(shape: ModelShape, layers: int, rank: int, ranks: int, peak_stage_microbatches: float) -> float:
    """Peak bytes on pipeline rank `rank` of `ranks` holding `layers` decoder layers, with at most
    `peak_stage_microbatches` microbatches' activations of its whole stage in flight."""
    parameters = gpt.stage_parameters(shape, layers, rank == 0, rank == ranks - 1, ranks)
    state = parameters * STATE_BYTES_PER_PARAMETER[shape.precision]
    per_layer = gpt.layer_activation_bytes(shape)
    if shape.recompute_granularity == "selective":
        per_layer -= 5.0 * shape.num_attention_heads * shape.seq_length ** 2 * shape.micro_batch_size
    recomputed = shape.recomputed_layers(layers)
    activations = peak_stage_microbatches * ((layers - recomputed) * per_layer
                                             + recomputed * gpt.boundary_activation_bytes(shape))
    if recomputed:
        activations += per_layer  # the layer whose forward a backward is redoing
    if rank == ranks - 1:
        activations += shape.seq_length * shape.micro_batch_size * gpt.padded_vocab(shape) * LOGIT_BYTES
    return float(state + activations)
