"""The launch search against reality: whether the planner orders launches as measurements do (configurations of the
train runs that differ only in what it searches), and whether the `auto` schedule rule picked the faster of 1F1B
and ZB-H1. See `hops_calib.whatif.job_plan`."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from hops_calib.model import Model
from hops_calib.whatif.cluster import Cluster
from hops_calib.whatif.launch_pricing import JobPlanner, Outcome
from hops_calib.whatif.launch_space import Launch


def auto_rule_agreement(outcomes: Sequence[Outcome]) -> tuple[int, int]:
    """Of the launches evaluated under `auto` whose 1f1b and zb_h1 twins were also evaluated: how many times auto's
    pick (the HopsHetero rule) was the faster of the two in the simulation, and how many were compared."""
    by_launch = {o.launch: o for o in outcomes}
    agree = compared = 0
    for o in outcomes:
        if o.launch.schedule != "auto":
            continue
        one, other = (by_launch.get(replace(o.launch, schedule=s)) for s in ("1f1b", "zb_h1"))
        if one is None or other is None:
            continue
        compared += 1
        faster = max((one, other), key=lambda t: t.samples_per_s)
        agree += faster.resolved == o.resolved or math.isclose(one.samples_per_s, other.samples_per_s, rel_tol=1e-9)
    return agree, compared


# --- against reality: the planner's ranking of configurations that really ran ------------------------------------


@dataclass(frozen=True)
class GroupAgreement:
    """Runs of one model, global batch and set of devices that differ only in what the planner searches; per
    configuration (repeats pooled) the predicted and the mean measured samples per second."""

    key: str
    configurations: tuple[tuple[str, float, float], ...]  # (run ids, predicted, measured)
    agreeing: int
    pairs: int


def pairwise_agreement(configurations: Sequence[tuple[str, float, float]]) -> tuple[int, int]:
    """Pairs of configurations the prediction orders as the measurement does, and pairs compared."""
    agree = pairs = 0
    for (_, p1, m1), (_, p2, m2) in itertools.combinations(configurations, 2):
        pairs += 1
        agree += (p1 - p2) * (m1 - m2) > 0
    return agree, pairs


def train_group_agreement(
    store: Any, runs_dir: Path, model: Model, cluster: Cluster | None = None
) -> list[GroupAgreement]:
    """For every group of the store's train runs with the same devices, model and global batch and more than one
    configuration of what the planner searches (stage order, layer split, schedule, micro-batch size): each
    configuration as the planner prices it (from the run's job directory in `runs_dir`, its own launch) against
    its measured throughput."""
    from collections import defaultdict

    groups: dict[tuple, dict[Launch, list[tuple[str, float, float]]]] = defaultdict(lambda: defaultdict(list))
    for fixture_id in store.ids("train"):
        fixture = store.load(fixture_id)
        job = runs_dir / fixture_id
        if not job.is_dir():
            continue
        spec, shape = fixture.spec, fixture.spec.model
        key = (
            tuple(sorted(spec.device_ids)),
            shape.num_layers,
            shape.hidden_size,
            shape.ffn_hidden_size,
            shape.num_attention_heads,
            shape.seq_length,
            shape.vocab_size,
            shape.global_batch_size,
            shape.precision,
        )
        planner = JobPlanner(job, model, cluster)
        launch = planner.current()
        predicted = planner.evaluate(launch).samples_per_s
        measured = fixture.truth.metrics.throughput_per_s * shape.micro_batch_size
        groups[key][launch].append((fixture_id, predicted, measured))
    out = []
    for key, by_launch in groups.items():
        if len(by_launch) < 2:
            continue
        configurations = tuple(
            (" + ".join(r[0] for r in runs), float(np.mean([r[1] for r in runs])), float(np.mean([r[2] for r in runs])))
            for runs in by_launch.values()
        )
        agree, pairs = pairwise_agreement(configurations)
        label = (
            f"{len(key[0])} GPUs ({', '.join(key[0])}), {key[1]} layers, hidden {key[2]}, seq {key[5]}, "
            f"global batch {key[7]}"
        )
        out.append(GroupAgreement(label, configurations, agree, pairs))
    return out
