"""Fit the embedding-gradient all-reduce's stall-free price to the TRAIN runs' median silent stretch.

Evidence for a candidate of the `embedding_grad_allreduce` term that does not go through the window
throughput, which random retransmission stalls make noise-bound (the stall-noise floor is 1.9 % of the
train MAPE's 2.0 %). The median iteration of a run has no stall, so its silent stretch (last backward ->
first optimizer step) is the all-reduce's own time plus whatever the barrier waits for; the simulation's
median iteration has the same part (`SimResult.iteration_parts`). This script compares the two per run,
grouped by the devices at the pipeline's two ends (which set the all-reduce's link: a NIC-paced A10G end,
a flow at the TCP ceiling between an H100 and an L4, or two H100s whose 100 Gbit/s NICs overrun it), and
with PARAM names fits those parameters (least squares on the relative error of the median silent stretch,
inside their plausible ranges). Nothing here reads the test split.

Usage: python experiments/scripts/allreduce_fit.py FIXTURES [PARAM ...] [--model M] [--out M2]
  e.g. ... /tmp/hops-fixtures collective_efficiency nic_efficiency overrun_loss
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np
from scipy.optimize import least_squares

from hops_calib.loop.model_files import load_model, write_model
from hops_calib.loop.suite import load_suite, open_store
from hops_calib.metrics import timeline_iteration_part_series
from hops_calib.model.model import resolve_params
from hops_calib.model.predict import predict
from hops_calib.model.terms import TERMS

TERM = "embedding_grad_allreduce"

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("fixtures")
parser.add_argument("params", nargs="*", help=f"parameters of {TERM} to fit (none: only show the residuals)")
parser.add_argument("--model", help="model file (default: the shipped baseline)")
parser.add_argument("--out", help="write the model with the fitted values here")
args = parser.parse_args()

suite = load_suite(args.fixtures, "train")  # never the test split
store = open_store(args.fixtures)
base = load_model(args.model)
runs = []  # (spec, ends, real median silent ms)
for fixture_id, spec in zip(suite.ids, suite.specs):
    series = timeline_iteration_part_series(store.load(fixture_id).timeline())
    if series is None or not series.optimizer_traced.any():
        continue  # no optimizer events: no silent stretch to read
    runs.append((spec, f"{spec.devices[0]}..{spec.devices[-1]}",
                 float(np.median(series.silent_ms[series.optimizer_traced]))))


def model_at(values):
    merged = {**base.active(TERM).params(), **dict(zip(args.params, map(float, values)))}
    return base.with_term(resolve_params(TERM, merged, origin="allreduce_fit"))


def predicted_silent(model) -> np.ndarray:
    return np.array([predict(spec, model).result.iteration_parts().silent_ms for spec, _, _ in runs])


def show(model, title):
    predicted = predicted_silent(model)
    groups = defaultdict(list)
    for (spec, ends, real), pred in zip(runs, predicted):
        groups[ends].append((real, pred))
    print(f"{title}: median silent stretch, predicted - real (ms), by the devices at the pipeline's ends")
    for ends, pairs in sorted(groups.items()):
        real, pred = np.array(pairs).T
        print(f"  {ends:11s} {len(pairs):2d} runs  real median {np.median(real):6.1f}  predicted "
              f"{np.median(pred):6.1f}  mean residual {np.mean(pred - real):+6.1f} ms "
              f"({np.mean(pred / real - 1) * 100:+5.1f} %)")
    real = np.array([r for _, _, r in runs])
    print(f"  all         {len(runs):2d} runs  mean |residual| {np.mean(np.abs(predicted / real - 1)) * 100:.2f} %")


show(base, f"model {base.name}")
if args.params:
    declared = [TERMS[TERM].param(name) for name in args.params]
    start = [base.active(TERM).params()[name] for name in args.params]
    real = np.array([r for _, _, r in runs])
    fit = least_squares(lambda x: predicted_silent(model_at(x)) / real - 1.0, start,
                        bounds=([p.low for p in declared], [p.high for p in declared]), diff_step=1e-3)
    fitted = model_at(fit.x)
    show(fitted, "fitted")
    for name, value in zip(args.params, fit.x):
        print(f"{TERM}:{name} = {value:.4f}")
    if args.out:
        write_model(args.out, fitted)
