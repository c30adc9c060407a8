"""Store room: the spec of a run measured at iteration level, from its launch (Megatron's args) and hardware, nothing
measured (a run with events gets its spec at ingest, `spec.build_spec`; this one when it is loaded, so that a model
that learns to price more runs needs no new ingest).

A run the cost model does not price (multi-latent attention, a flex MoE dispatcher, ...) gets no spec: the ValueError (a TraceError
for a launch setting) says why, and the verbs that would predict it refuse it by name with that reason
(`hops_calib.store.fixture.NotPriced`).
"""

from __future__ import annotations

from typing import Any

from hops_calib.spec import CollectiveTable, Hardware, Spec, spec_from_args

# Iterations simulated for an iteration-level run: enough for the simulator's steady state (its period repeats
# from the third), whose median period is the prediction of the measured iteration time.
SIMULATED_ITERATIONS = 4


def measured_spec(
    run_id: str,
    args: dict[str, Any],
    hardware: dict[str, Any],
    origin: str = "",
    collectives: tuple[CollectiveTable, ...] = (),
) -> Spec:
    """The Spec of a measured run (`hardware`: gpu, gpus_per_node; `collectives`: the machine's collective
    benchmark tables, which the store keeps, when its source had them); ValueError naming what the model does not
    price."""
    if "collective_tables" in hardware:  # an ingest before the store kept the tables named their source folder
        raise ValueError(
            f"an older ingest left its all-reduce tables at {hardware['collective_tables']} instead of "
            "keeping them in the store: ingest its source again"
        )
    spec = spec_from_args(
        args,
        origin or run_id,
        run_id=run_id,
        hardware=Hardware(gpu=hardware["gpu"], gpus_per_node=int(hardware["gpus_per_node"])),
        collectives=collectives,
        iterations=SIMULATED_ITERATIONS,
    )
    hops = [(r, r + 1) for r in range(spec.pp - 1)] + ([(spec.pp - 1, 0)] if spec.vp > 1 and spec.pp > 1 else [])
    # A hop between nodes is priced over the sending GPU's share of its node's NICs (`LinkTransfer`); one inside a
    # node wants the node's measured all-reduce tables (their ring gives its link), not a datasheet's NVLink rate.
    missing = [hop for hop in hops if spec.link(*hop) is None and (spec.gpus_per_node is None or spec.same_node(*hop))]
    if missing:
        raise ValueError(
            f"nothing prices the hop between stages {missing[0][0]} and {missing[0][1]}: no collective "
            "benchmark of the node (give its all-reduce tables: calibration/allreduce/ beside the log "
            "or table, or hardware.collective_tables in hops.base.yaml or the table's sidecar, and "
            "ingest it again)"
        )
    return spec


def reason_of(err: Exception) -> str:
    """Why a run is not priced, from the error `measured_spec` raised (a TraceError names the setting)."""
    problem, name = getattr(err, "problem", None), getattr(err, "field", None)
    return f"{name}: {problem}" if problem and name else problem or str(err)


def not_priced(
    run_id: str,
    args: dict[str, Any],
    hardware: dict[str, Any],
    origin: str = "",
    collectives: tuple[CollectiveTable, ...] = (),
) -> str | None:
    """Why the cost model cannot price the run (what `fixtures show` says), or None when it can."""
    try:
        measured_spec(run_id, args, hardware, origin, collectives)
    except (ValueError, KeyError, TypeError) as err:
        return reason_of(err)
    return None
