"""Model room: the host's kernel-launch floor under every decoder layer and every pipeline step."""

from __future__ import annotations

from collections.abc import Mapping

from hops_calib.model.terms.base import Context, Contribution, Param, Term


class LayerDispatchFloor(Term):
    """Each decoder layer costs a fixed host launch time per forward and backward, on top of its GPU work.

    Physics: with `--transformer-impl local` and the fusions switched off
    (--no-masked-softmax-fusion, --no-persist-layer-norm,
    --no-gradient-accumulation-fusion), a GPT layer's forward is some thirty
    small CUDA kernels (LayerNorms, bias adds, GeLU, scale/mask/softmax, dropout,
    residual adds) around its four GEMMs, and its backward about twice as many.
    Each launch costs host time in PyTorch's dispatcher whether or not the GPU is
    busy; at these shapes (h = 768-2048) the small kernels finish faster than the
    host can launch them, so a layer costs a per-layer host floor plus the GEMM
    work that outlasts its own launch. The same software stack runs on every
    node, so the floor is one number per direction. A machine with another
    host CPU and software stack takes its own value ("forward_ms_per_layer@a100":
    the public A100 runs' DGX host and Megatron-DeepSpeed, whose fused softmax
    and bias-GeLU launch fewer kernels per layer); the cluster's device types
    share the one stack's value. The GPU-side timer of a
    step (the traced compute event) sees that floor, since the GPU waits on the
    host between kernels. A pipeline step (one microbatch's forward or backward
    on a stage) also needs host work before its first kernel: the schedule's
    bookkeeping, the p2p calls' Python, autograd set-up. That happens between
    two traced compute events, so it holds the rank without showing as compute
    (`step_ms`, the simulator's host time).

    It holds the rank only where the host has caught up with the GPU. Megatron's
    p2p calls end in torch.cuda.synchronize() (batch_p2p_sync, on by default), so
    after a step that received its input over a link the host starts the step's
    work with the GPU idle. Between two steps with no p2p call in between (stage
    0's forward after its backward in the steady state, the last stage's backward
    after its forward) the host dispatches the next step while the GPU still runs
    the previous one, and the traces show no gap there: 0.1-0.2 ms from the last
    stage's forward to its backward on every device type against 0.6-1.3 ms from
    its backward to the next forward, which follows a receive (train split,
    median over ~7,000 pairs). With `step_after_receive_only` = 1 only steps
    whose input crossed a link pay `step_ms` (`Pipeline.host_after_receive_only`).
    """

    name = "layer_dispatch_floor"
    category = "host"
    scope = "layers"
    params = (
        Param(
            "forward_ms_per_layer",
            1.0,
            0.0,
            10.0,
            "ms",
            "host launch floor of one decoder layer's forward",
            per_device=True,
        ),
        Param(
            "backward_ms_per_layer",
            1.5,
            0.0,
            20.0,
            "ms",
            "host launch floor of one decoder layer's backward",
            per_device=True,
        ),
        Param(
            "step_ms",
            0.0,
            0.0,
            10.0,
            "ms",
            "untraced host work before each microbatch step on a stage (forward or backward)",
            per_device=True,
        ),
        Param(
            "step_after_receive_only",
            0.0,
            0.0,
            1.0,
            "switch",
            "1: only steps whose input arrives over a link (after a synchronizing p2p call) pay step_ms; 0: every "
            "step does",
            choices=(0.0, 1.0),
        ),
    )

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        layers = context.layout.layers
        types = [context.device_of(k).type for k in range(len(layers))]
        return Contribution(
            forward_ms=tuple(n * self.value(params, "forward_ms_per_layer", t) for n, t in zip(layers, types)),
            backward_ms=tuple(n * self.value(params, "backward_ms_per_layer", t) for n, t in zip(layers, types)),
            host_ms=tuple(self.value(params, "step_ms", context.device_of(k).type) for k in range(len(layers))),
            host_after_receive_only=True if params["step_after_receive_only"] == 1.0 else None,
        )


class LayerLaunchFloor(Term):
    """The host's launch time per decoder layer is a floor under the layer's GPU time: a layer takes the longer of the two.

    Physics: PyTorch launches a layer's kernels asynchronously. When the GPU
    work of a layer (its GEMMs, attention traffic: the "layers" terms) is
    shorter than the host time to launch its ~30 forward (~60 backward) kernels,
    the GPU waits on the host and the traced step lasts the launch time; when it
    is longer, the launches hide behind it. So the decoder layers of a stage take
    max(GPU work, layers x launch floor), not their sum: an H100, whose GEMMs at
    these shapes take 0.06 ms a layer, and an L4 at 0.5 ms both show the ~1.5 ms
    floor, while a 2048-hidden or 4096-token layer on an L4 is GPU-bound. The
    launch time is host CPU time, a property of the instance's host CPU, not of
    its GPU: the p5 (H100) and g6 (L4) hosts have the same AMD EPYC 7R13, the g5
    (A10G) an older EPYC 7R32 (AWS instance pages). So the shared value is the
    floor of the common host, and a device type takes its own value
    ("forward_ms_per_layer@a10g") only where its host CPU differs (candidate 057:
    launch-bound L4 stages measure the H100's floor, 1.50 / 1.78 ms at h1024 s256).
    """

    name = "layer_launch_floor"
    category = "host"
    params = (
        Param(
            "forward_ms_per_layer",
            1.3,
            0.0,
            10.0,
            "ms",
            "host launch time of one decoder layer's forward",
            per_device=True,
        ),
        Param(
            "backward_ms_per_layer",
            1.5,
            0.0,
            20.0,
            "ms",
            "host launch time of one decoder layer's backward",
            per_device=True,
        ),
    )

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        forward, backward = [], []
        for k, layers in enumerate(context.layout.layers):
            device = context.device_of(k).type
            forward.append(layers * self.value(params, "forward_ms_per_layer", device))
            backward.append(layers * self.value(params, "backward_ms_per_layer", device))
        return Contribution(forward_floor_ms=tuple(forward), backward_floor_ms=tuple(backward))


class ChunkCallHost(Term):
    """Each forward and backward call of a model chunk costs a fixed host time inside its span, whatever its layers.

    Physics: Megatron's schedules call `forward_step` and `backward_step`
    (megatron/core/pipeline_parallel/schedules.py) once per microbatch and model
    chunk, and the traced compute event brackets the call. Around the chunk's
    modules each call runs Python that does not grow with the chunk's layers:
    forward_step's `set_input_tensor`, the context managers and the call into
    the training script's forward_step_func, GPTModel.forward and
    TransformerBlock.forward's per-call set-up (the layer loop's entry,
    `make_viewless_tensor`), and forward_step_calc_loss's bookkeeping;
    backward_step's gradient checks and the autograd engine's start and end
    (torch.autograd.backward: building the graph task, the first and last node's
    scheduling). On a CPU rank this time is the core's own, in the span (no
    device runs asynchronously under it), so a chunk of n layers takes
    n x (one layer) + this per call: chunks of one layer pay it once per layer,
    a stage of three once per three. Measured on the profiled CPU captures
    (profiles/, Kineto): the span's head and tail outside every aten op,
    0.25-0.34 ms per forward and 0.31-0.44 ms per backward (rank medians of
    cpu_1f1b_l2_h256_s128_m4_prof_run1), under a profiler that records every
    Python call (an upper bound). A GPU rank launches asynchronously: the
    same Python runs while the device works, or before its first kernel, where
    the GPU runs' fitted step and dispatch times already price it, so the shared
    value is 0 and a device type takes its own ("forward_ms_per_call@cpu").
    """

    name = "chunk_call_host"
    category = "host"
    params = (
        Param(
            "forward_ms_per_call",
            0.0,
            0.0,
            5.0,
            "ms",
            "host time of one forward_step call of a model chunk outside its modules' work, in the traced span",
            per_device=True,
        ),
        Param(
            "backward_ms_per_call",
            0.0,
            0.0,
            5.0,
            "ms",
            "host time of one backward_step call of a model chunk outside its autograd nodes, in the traced span",
            per_device=True,
        ),
    )

    def contribute(self, context: Context, params: Mapping[str, float]) -> Contribution:
        stages = range(context.layout.virtual_stages)
        types = [context.device_of(k).type for k in stages]
        return Contribution(
            forward_ms=tuple(self.value(params, "forward_ms_per_call", t) for t in types),
            backward_ms=tuple(self.value(params, "backward_ms_per_call", t) for t in types),
        )
