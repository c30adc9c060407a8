"""Simulator room: schedules as programs, the ordered operations each rank runs in one iteration.

A schedule is, per rank, an ordered list of operations; a program depends only on
the shape of the pipeline (ranks, chunks, microbatches, schedule), never on costs,
so it is built once and reused for every cost the calibration loop tries.

Three kinds of operation:

- compute ``(COMPUTE, phase, virtual_stage, microbatch, input_transfer, output_transfer)``:
  `phase` indexes `hops_calib.timeline.PHASES`; `input_transfer` is the transfer
  whose data the task needs (-1: none), `output_transfer` the one it produces (-1: none);
- exchange ``(EXCHANGE, sends, receives)``: one blocking Megatron p2p call, a
  batch of sends and receives (transfer ids) that the rank posts together and
  waits on together (`_communicate` in megatron/core/pipeline_parallel/p2p_communication.py);
- post ``(POST, sends, receives)``: the same call posted without waiting (isend/irecv);
  the rank computes on and a later EXCHANGE of the same transfers waits for them.

Transfer ids: ``(direction * virtual_stages + from_stage) * microbatches + microbatch``,
direction 0 for the activation virtual stage k -> k+1, 1 for the gradient k -> k-1.
Virtual stage k is model chunk k // p on rank k % p (Megatron's layout), so activations
leave rank r for rank (r+1) % p and gradients for rank (r-1) % p.

Schedules (the exchanges are Megatron's; GPipe and ZB-H1 reuse the same calls):

- ``1f1b``: `forward_backward_pipelining_without_interleaving`. Rank s runs
  min(p-s-1, m) warm-up forwards (recv_forward, F, send_forward), then one forward
  and one backward per step (F, send_forward_recv_backward, B, send_backward_recv_forward;
  the last step ends with send_backward), then the cool-down backwards
  (recv_backward, B, send_backward).
- ``interleaved_1f1b``: `forward_backward_pipelining_with_interleaving` (megatron/core/
  pipeline_parallel/schedules.py). Forward number i runs chunk (i mod pv) // p on microbatch
  (i // pv) * p + i mod p (microbatches go through the chunks in groups of p; backwards
  take the chunks in reverse); rank r warms up with (p-r-1)*2 + (v-1)*p forwards (all of
  them when m == p), capped at m*v; a steady step is F, B, then one
  send_forward_backward_recv_forward_backward. Megatron refuses m % p != 0 (schedules.py);
  so do we. (Older Megatron-LM `arguments.py` also refused p <= 2 without p2p overlap, but
  Megatron-core's schedule runs p = 2: the shipped CPU captures are p = 2, v = 2.)
  With ``overlap_p2p`` (`config.overlap_p2p_comm`, Megatron-LM's default with virtual stages)
  the same tasks run in the same order, but the steady state's calls are posted without
  waiting, as that function's `pp_post_forward` / `pp_post_backward` do: after each forward,
  send_forward_recv_forward is posted (isend/irecv, `_communicate(wait_on_reqs=False)` in
  p2p_communication.py) and the previous forward's send is waited on; before the next
  forward the oldest posted receive of an activation is waited on (`pp_pre_forward`), and
  likewise for the backward's send_backward_recv_backward (`pp_pre_backward`). The warm-up's
  forward calls stay blocking, its last one receives only the activation and posts the
  first gradient's receive; the cool-down's calls block, each backward first waiting on the
  oldest posted gradient receive; the last posted gradient send is waited on at the end.
  (`overlap_p2p_comm_warmup_flush`, which posts the warm-up's calls too, is not modelled.)
  Batched p2p (`batch_p2p_comm`, `torch.distributed.batch_isend_irecv`) posts a call's
  sends and receives together and waits on all of them, as the unbatched calls do
  (`_communicate` waits on every request before returning): the blocking programs.
- ``gpipe``: in flushes of k microbatches, all forwards then all backwards (microbatch
  order) per flush; blocking calls recv before a task and send after it.
- ``zb_h1``: Megatron's 1F1B order with the backward split into B (input gradient, sent
  upstream at once) and W (weight gradient). Rank s holds up to s W's back and runs
  each after a later B, the rest at the end of the iteration: late ranks fill their
  cool-down bubble with W's, and every rank keeps at most p microbatches in flight,
  the 1F1B peak (ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism", 2023). The
  W's run while the p2p call that follows B is in flight (posted, then waited on), as
  the zero-bubble implementation overlaps them; otherwise a blocking send would hold
  the rank idle where W belongs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from hops_calib.spec.schedules import SCHEDULES
from hops_calib.timeline import BACKWARD, BACKWARD_B, BACKWARD_W, FORWARD, PHASES

COMPUTE = 0
EXCHANGE = 1  # post, then wait for completion
POST = 2  # post only; a later EXCHANGE with the same transfers waits

F = PHASES.index(FORWARD)
B = PHASES.index(BACKWARD)
BB = PHASES.index(BACKWARD_B)
BW = PHASES.index(BACKWARD_W)

AUTO = "auto"
SCHEDULE_CHOICES = (*SCHEDULES, AUTO)


@dataclass(frozen=True)
class Programs:
    """The operations of every rank for one iteration, and what they imply for memory."""

    schedule: str
    ranks: int
    chunks: int
    microbatches: int
    per_rank: tuple[tuple[tuple, ...], ...]  # with exchanges (blocking p2p)
    per_rank_compute: tuple[tuple[tuple, ...], ...]  # compute only (fire-and-forget sends)
    # Most microbatches whose activations a rank holds at once (forward done, weight
    # gradient not yet), counted per model chunk: for interleaved 1F1B one unit is a chunk.
    peak_activations: tuple[int, ...]

    @property
    def virtual_stages(self) -> int:
        return self.ranks * self.chunks


class _Builder:
    """Collects one rank's operations; names the transfers of each task."""

    def __init__(self, rank: int, ranks: int, chunks: int, microbatches: int, split_backward: bool = False):
        self.rank, self.ranks, self.chunks, self.microbatches = rank, ranks, chunks, microbatches
        self.last = ranks * chunks - 1
        self.split_backward = split_backward
        self.ops: list[tuple] = []
        # Transfers this rank will receive, in the order its tasks need them; a receive
        # takes the next one (Megatron's receives are matched to sends in order).
        self.pending_inputs: deque[int] = deque()
        self.pending_grads: deque[int] = deque()

    def transfer(self, direction: int, from_stage: int, microbatch: int) -> int:
        return (direction * (self.last + 1) + from_stage) * self.microbatches + microbatch

    def expect(self, forwards: list[tuple[int, int]], backwards: list[tuple[int, int]]) -> None:
        """Queue the transfers this rank receives, given its (virtual stage, microbatch) tasks in order."""
        self.pending_inputs.extend(self.transfer(0, k - 1, mb) for k, mb in forwards if k > 0)
        self.pending_grads.extend(self.transfer(1, k + 1, mb) for k, mb in backwards if k < self.last)

    def forward(self, k: int, mb: int) -> int:
        """Append the forward; return the transfer of its output (-1 on the last virtual stage)."""
        tin = self.transfer(0, k - 1, mb) if k > 0 else -1
        tout = self.transfer(0, k, mb) if k < self.last else -1
        self.ops.append((COMPUTE, F, k, mb, tin, tout))
        return tout

    def backward(self, k: int, mb: int) -> int:
        """Append the backward (B of a split backward); return the transfer of its gradient (-1 on stage 0)."""
        tin = self.transfer(1, k + 1, mb) if k < self.last else -1
        tout = self.transfer(1, k, mb) if k > 0 else -1
        self.ops.append((COMPUTE, BB if self.split_backward else B, k, mb, tin, tout))
        return tout

    def weight_grad(self, k: int, mb: int) -> None:
        self.ops.append((COMPUTE, BW, k, mb, -1, -1))

    def exchange(
        self,
        sends: tuple[int, ...] = (),
        recv_prev: bool = False,
        recv_next: bool = False,
        overlap: Callable[[], None] | None = None,
    ) -> None:
        """One blocking p2p call: send the given transfers, receive the next input and/or gradient.

        With `overlap`, the call is posted, `overlap()` appends the compute that runs while
        the transfers are in flight, and then the rank waits (isend/irecv, work, wait).
        """
        sends = tuple(t for t in sends if t >= 0)
        receives = []
        if recv_prev:
            receives.append(self.pending_inputs.popleft())
        if recv_next:
            receives.append(self.pending_grads.popleft())
        if (sends or receives) and overlap is not None:
            self.ops.append((POST, sends, tuple(receives)))
        if overlap is not None:
            overlap()
        if sends or receives:
            self.ops.append((EXCHANGE, sends, tuple(receives)))

    def post(
        self, sends: tuple[int, ...] = (), recv_prev: bool = False, recv_next: bool = False
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One p2p call posted without waiting (Megatron's `overlap_p2p_comm`); (its sends, its receives)."""
        sends = tuple(t for t in sends if t >= 0)
        receives = ((self.pending_inputs.popleft(),) if recv_prev else ()) + (
            (self.pending_grads.popleft(),) if recv_next else ()
        )
        if sends or receives:
            self.ops.append((POST, sends, receives))
        return sends, receives

    def wait(self, transfer: int, sent: bool) -> None:
        """Wait on one transfer posted before (a request's `wait()`): an EXCHANGE that posts nothing new."""
        self.ops.append((EXCHANGE, (transfer,), ()) if sent else (EXCHANGE, (), (transfer,)))

    def finish(self) -> tuple[tuple, ...]:
        if self.pending_inputs or self.pending_grads:  # a bug in a builder, never a user error
            raise AssertionError(
                f"rank {self.rank}: {len(self.pending_inputs)} inputs and "
                f"{len(self.pending_grads)} gradients never received"
            )
        return tuple(self.ops)


def _one_f_one_b(rank: int, ranks: int, microbatches: int, *, split_backward: bool = False) -> tuple[tuple, ...]:
    """Megatron's non-interleaved 1F1B on one rank; with `split_backward`, ZB-H1 (W held back by `rank`)."""
    p, m, s = ranks, microbatches, rank
    build = _Builder(s, p, 1, m, split_backward)
    build.expect([(s, j) for j in range(m)], [(s, j) for j in range(m)])
    first, last = s == 0, s == p - 1
    warmup = min(p - s - 1, m)
    held: deque[int] = deque()

    def weight_grads(limit: int) -> None:
        if split_backward:
            while len(held) > limit:
                build.weight_grad(s, held.popleft())

    def backward(j: int) -> int:
        tout = build.backward(s, j)
        held.append(j)
        return tout

    # ZB-H1 runs the weight gradients while its gradient send (and next receive) are in flight.
    overlap = (lambda: weight_grads(s)) if split_backward else None

    for j in range(warmup):
        build.exchange(recv_prev=not first)
        build.exchange((build.forward(s, j),))
    remaining = m - warmup
    if remaining:
        build.exchange(recv_prev=not first)
    for i in range(remaining):
        build.exchange((build.forward(s, warmup + i),), recv_next=not last)
        grad = backward(i)
        build.exchange((grad,), recv_prev=not first and i < remaining - 1, overlap=overlap)
    for j in range(remaining, m):
        build.exchange(recv_next=not last)
        build.exchange((backward(j),), overlap=overlap)
    weight_grads(0)
    return build.finish()


def _gpipe(rank: int, ranks: int, microbatches: int, flush: int) -> tuple[tuple, ...]:
    p, m, s = ranks, microbatches, rank
    build = _Builder(s, p, 1, m)
    first, last = s == 0, s == p - 1
    for lo in range(0, m, flush):
        batch = range(lo, min(lo + flush, m))
        build.expect([(s, j) for j in batch], [(s, j) for j in batch])
        for j in batch:
            build.exchange(recv_prev=not first)
            build.exchange((build.forward(s, j),))
        for j in batch:
            build.exchange(recv_next=not last)
            build.exchange((build.backward(s, j),))
    return build.finish()


def interleaved_chunk(i: int, ranks: int, chunks: int, forward: bool) -> int:
    """Model chunk of the i-th forward (or backward) on a rank: Megatron's `get_model_chunk_id`."""
    chunk = (i % (ranks * chunks)) // ranks
    return chunk if forward else chunks - chunk - 1


def interleaved_microbatch(i: int, ranks: int, chunks: int) -> int:
    """Microbatch of the i-th forward (or backward) on a rank: groups of p microbatches per chunk."""
    return (i // (ranks * chunks)) * ranks + i % ranks


def interleaved_warmup(rank: int, ranks: int, chunks: int, microbatches: int) -> int:
    """Megatron's warm-up forwards on `rank` for interleaved 1F1B."""
    total = microbatches * chunks
    if microbatches == ranks:
        return total
    return min((ranks - rank - 1) * 2 + (chunks - 1) * ranks, total)


def _interleaved(rank: int, ranks: int, chunks: int, microbatches: int, overlap: bool = False) -> tuple[tuple, ...]:
    """Megatron's interleaved 1F1B on one rank, with blocking p2p calls or (`overlap`) the steady state's posted
    ahead and waited on later (`forward_backward_pipelining_with_interleaving` with `overlap_p2p_comm`)."""
    p, v, m, r = ranks, chunks, microbatches, rank
    total = m * v
    build = _Builder(r, p, v, m)

    def task(i: int, forward: bool) -> tuple[int, int]:
        return interleaved_chunk(i, p, v, forward) * p + r, interleaved_microbatch(i, p, v)

    build.expect([task(i, True) for i in range(total)], [task(i, False) for i in range(total)])
    first_rank, last_rank = r == 0, r == p - 1
    all_warmup = m == p
    warmup = interleaved_warmup(r, p, v, m)
    remaining = total - warmup
    # Overlap: the requests posted and not yet waited on, as the schedule's recv_prev_wait_handles and
    # recv_next_wait_handles (FIFO) and send_next_wait_handle / send_prev_wait_handle (the latest send) hold them.
    recv_prev_handles: deque[int] = deque()
    recv_next_handles: deque[int] = deque()
    send_handles: list[int | None] = [None, None]  # [send_next, send_prev]

    def post(sends: tuple[int, ...], recv_prev: bool, recv_next: bool, direction: int) -> None:
        sent, received = build.post(sends, recv_prev=recv_prev, recv_next=recv_next)
        (recv_prev_handles if direction == 0 else recv_next_handles).extend(received)
        previous = send_handles[direction]
        if previous is not None:
            build.wait(previous, sent=True)
        send_handles[direction] = sent[0] if sent else None

    def wait_received(handles: deque[int], needed: bool) -> None:
        if needed and handles:
            build.wait(handles.popleft(), sent=False)

    build.exchange(recv_prev=not first_rank)  # input of chunk 0's first forward
    for i in range(warmup):
        sent = build.forward(*task(i, True))
        recv_prev = not (first_rank and interleaved_chunk(i + 1, p, v, True) == 0) and i != total - 1
        if i == warmup - 1 and not all_warmup:
            if overlap:  # the activation blocks; the first gradient's receive is posted
                build.exchange((sent,), recv_prev=recv_prev)
                post((), False, not last_rank, 1)
            else:
                build.exchange((sent,), recv_prev=recv_prev, recv_next=not last_rank)
        else:
            build.exchange((sent,), recv_prev=recv_prev)
    for k in range(remaining):
        forward_k = k + warmup
        recv_prev = True
        if first_rank:  # rank 0 runs p-1 forwards ahead of the last rank
            recv_prev = interleaved_chunk(forward_k - (p - 1), p, v, True) != v - 1
        recv_next = True
        if last_rank:  # the last rank runs p-1 backwards ahead of rank 0
            recv_next = interleaved_chunk(k - (p - 1), p, v, False) != 0
        if k == remaining - 1:
            recv_prev = False
        if overlap:
            forward_task, backward_task = task(forward_k, True), task(k, False)
            wait_received(recv_prev_handles, forward_task[0] != 0)  # pp_pre_forward
            post((build.forward(*forward_task),), recv_prev, False, 0)  # pp_post_forward
            wait_received(recv_next_handles, backward_task[0] != p * v - 1)  # pp_pre_backward
            post((build.backward(*backward_task),), False, recv_next, 1)  # pp_post_backward
            continue
        sent_forward = build.forward(*task(forward_k, True))
        sent_backward = build.backward(*task(k, False))
        build.exchange((sent_forward, sent_backward), recv_prev=recv_prev, recv_next=recv_next)
    if all_warmup:
        build.exchange(recv_next=not last_rank)
    for k in range(remaining, total):
        backward_task = task(k, False)
        if overlap:
            wait_received(recv_next_handles, backward_task[0] != p * v - 1 and k != 0)
        sent = build.backward(*backward_task)
        recv_next = not (last_rank and interleaved_chunk(k + 1, p, v, False) == v - 1) and k != total - 1
        build.exchange((sent,), recv_next=recv_next)
    if send_handles[1] is not None:
        build.wait(send_handles[1], sent=True)
    if recv_prev_handles or recv_next_handles:  # Megatron asserts both are cleared at the end of a step
        raise AssertionError(f"rank {r}: posted receives never waited on: {recv_prev_handles} {recv_next_handles}")
    return build.finish()


def _peak_activations(ops: tuple[tuple, ...], releasing_phase: int) -> int:
    held = peak = 0
    for op in ops:
        if op[0] == COMPUTE:
            if op[1] == F:
                held += 1
                peak = max(peak, held)
            elif op[1] == releasing_phase:
                held -= 1
    return peak


def check_shape(
    schedule: str, ranks: int, chunks: int, microbatches: int, gpipe_flush: int | None = None, overlap_p2p: bool = False
) -> None:
    """Raise ValueError when the schedule cannot run this pipeline shape (naming the rule)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULE_CHOICES}")
    if overlap_p2p and schedule != "interleaved_1f1b":
        raise ValueError(
            f"overlapped p2p runs only under interleaved_1f1b, not {schedule!r}: Megatron's "
            "non-interleaved schedule refuses overlap_p2p_comm (schedules.py, "
            "forward_backward_pipelining_without_interleaving)"
        )
    if gpipe_flush is not None:
        if schedule != "gpipe":
            raise ValueError(f"gpipe_flush={gpipe_flush} only applies to the gpipe schedule, not {schedule!r}")
        if gpipe_flush < 1:
            raise ValueError(f"gpipe_flush must be at least 1 microbatch (got {gpipe_flush})")
    if schedule == "interleaved_1f1b":
        if chunks < 2:
            raise ValueError(
                f"interleaved_1f1b needs at least 2 model chunks per rank (got chunks={chunks}); use 1f1b for one chunk"
            )
        if microbatches % ranks:
            raise ValueError(
                f"Megatron refuses the interleaved schedule when the number of microbatches "
                f"({microbatches}) is not divisible by the pipeline-model-parallel size ({ranks}) "
                "(schedules.py); use a multiple of the number of ranks"
            )
    elif chunks != 1:
        raise ValueError(
            f"schedule {schedule!r} runs one model chunk per rank; the pipeline has chunks={chunks} "
            "(use interleaved_1f1b)"
        )


@lru_cache(maxsize=256)
def build_programs(
    schedule: str, ranks: int, chunks: int, microbatches: int, gpipe_flush: int | None = None, overlap_p2p: bool = False
) -> Programs:
    """Every rank's operations for one iteration of `schedule` (cached: they depend on the shape only); with
    `overlap_p2p`, interleaved 1F1B's calls posted ahead and waited on later (Megatron's overlap_p2p_comm)."""
    check_shape(schedule, ranks, chunks, microbatches, gpipe_flush, overlap_p2p)
    if schedule == "1f1b":
        per_rank = [_one_f_one_b(r, ranks, microbatches) for r in range(ranks)]
    elif schedule == "zb_h1":
        per_rank = [_one_f_one_b(r, ranks, microbatches, split_backward=True) for r in range(ranks)]
    elif schedule == "gpipe":
        per_rank = [_gpipe(r, ranks, microbatches, gpipe_flush or microbatches) for r in range(ranks)]
    else:
        per_rank = [_interleaved(r, ranks, chunks, microbatches, overlap_p2p) for r in range(ranks)]
    releasing = BW if schedule == "zb_h1" else B
    return Programs(
        schedule=schedule,
        ranks=ranks,
        chunks=chunks,
        microbatches=microbatches,
        per_rank=tuple(per_rank),
        per_rank_compute=tuple(tuple(op for op in ops if op[0] == COMPUTE) for ops in per_rank),
        peak_activations=tuple(_peak_activations(ops, releasing) for ops in per_rank),
    )
