"""The spec of a run measured at iteration level: its launch (Megatron's args) and hardware, nothing measured.

A run the cost model does not price (tensor or data parallelism, ...) gets no spec: the ValueError says why, and
the verbs that would predict it refuse it by name with that reason (`hops_calib.store.NotPriced`).
"""

from __future__ import annotations

from typing import Any

from hops_calib.spec import Spec, unmodelled

# Iterations simulated for an iteration-level run: enough for the simulator's steady state (its period repeats
# from the third), whose median period is the prediction of the measured iteration time.
SIMULATED_ITERATIONS = 4


def measured_spec(run_id: str, args: dict[str, Any], hardware: dict[str, Any]) -> Spec:
    """The Spec of a measured run; ValueError naming what the model does not price."""
    dp = int(args.get("data_parallel_size") or 1)
    tp = int(args.get("tensor_model_parallel_size") or 1)
    if tp != 1 or dp != 1:
        needs = " and ".join(f"{name} parallelism ({size})" for name, size in (("tensor", tp), ("data", dp))
                             if size != 1)
        raise ValueError(f"it needs {needs}, which the cost model does not price yet (it prices one GPU per "
                         "pipeline stage)")
    try:
        from hops_calib.spec import spec_from_args  # the A100 pricing's builder (issue 18, part B)
    except ImportError:
        found = unmodelled(args)
        raise ValueError("the cost model does not price " + ("; ".join(u.sentence() for u in found) if found
                         else f"device {hardware.get('gpu')!r} launched from a table") ) from None
    return spec_from_args(args, hardware, run_id=run_id, iterations=SIMULATED_ITERATIONS)
