"""Exploration only: refit several terms' parameters together on the TRAIN split, to find where a move should go.

The product lands one term per candidate (`hops-calib tune` + `evaluate`); when the model sits in a basin of
compensating errors no single term can leave, this finds the joint optimum the move heads for (candidates
029-035 took their values from it). Objective: throughput MAPE + W_BUBBLE x bubble MAE + W_RHO x (1 - rho)
+ W_COMP x mispriced component time (hops_calib.research.components: the stage, optimizer and between-iteration times
the traces measure), minimized with Powell inside each parameter's plausible range.

Usage: python experiments/scripts/joint_fit.py FIXTURES TERM:PARAM [TERM:PARAM ...] [--model M] [--out M2]
       [--w-bubble 0.3] [--w-rho 5] [--w-comp 1.0] [--evaluations 4000]
The move 029-035 came from: the shipped model of commit 0df0849 with link_transfer measured_weight = 1, and
  output_layer_loss:host_ms output_layer_loss:logit_passes_forward output_layer_loss:logit_passes_backward
  input_embedding:forward_ms layer_dispatch_floor:step_ms layer_dispatch_floor:forward_ms_per_layer
  layer_dispatch_floor:backward_ms_per_layer layer_launch_floor:{forward,backward}_ms_per_layer@{h100,a10g,l4}
  attention_score_traffic:passes_forward attention_score_traffic:passes_backward
  decoder_roofline:compute_efficiency@a10g decoder_roofline:compute_efficiency@l4 decoder_roofline:backward_factor
with --w-comp 1.0 (mispriced time 9.1 % -> 6.2 %, MAPE 3.19 -> 2.45 %); values rounded to 3 digits in the candidates.
"""

import argparse

from scipy.optimize import minimize

from hops_calib.loop.model_files import load_model, write_model
from hops_calib.loop.suite import load_suite, open_store, score_model
from hops_calib.model.model import resolve_params
from hops_calib.model.terms import TERMS
from hops_calib.research.components import mispriced_time_pct, predicted_components, real_components

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("fixtures")
parser.add_argument("params", nargs="+", help="TERM:PARAM (PARAM may be NAME@DEVICE)")
parser.add_argument("--model")
parser.add_argument("--out")
parser.add_argument("--w-bubble", type=float, default=0.3)
parser.add_argument("--w-rho", type=float, default=5.0)
parser.add_argument("--w-comp", type=float, default=1.0)
parser.add_argument("--evaluations", type=int, default=4000)
args = parser.parse_args()

suite = load_suite(args.fixtures, "train")  # never the test split
store = open_store(args.fixtures)
# the traced components (stage, optimizer, between-iteration times) where the runs have events; iteration-level
# runs (a table's, a training log's) have none: fit them with --w-comp 0 (and --w-bubble 0 --w-rho 0)
reals = [real_components(store.load(fixture_id)) for fixture_id in suite.ids] if args.w_comp else []
base = load_model(args.model)
names = [tuple(p.split(":", 1)) for p in args.params]
bounds, start = [], []
for term, param in names:
    declared = TERMS[term].param(param)
    values = base.active(term).params()
    bounds.append((declared.low, declared.high))
    start.append(values.get(param, values.get(param.partition("@")[0], declared.default)))


def model_at(x):
    model, by_term = base, {}
    for (term, param), value in zip(names, x):
        by_term.setdefault(term, {})[param] = float(value)
    for term, values in by_term.items():
        merged = {**model.active(term).params(), **values}
        model = model.with_term(resolve_params(term, merged, origin="joint_fit"))
    return model


def objective(x, show=False):
    model = model_at(x)
    suite_score = score_model(suite, model, origin="joint_fit").suite
    mispriced = mispriced_time_pct(reals, [predicted_components(model.pipeline(s)) for s in suite.specs],
                                   [s.microbatches for s in suite.specs], [s.pp for s in suite.specs]) if reals else 0.0
    bubble, rho = suite_score.bubble_mae_pp or 0.0, suite_score.util_spearman_mean or 1.0  # None without events
    value = (suite_score.throughput_mape_pct + args.w_bubble * bubble + args.w_rho * (1 - rho) + args.w_comp * mispriced)
    if show:
        print(f"MAPE {suite_score.throughput_mape_pct:.3f} %, bubble MAE {bubble:.3f} pp, "
              f"rho {rho:.3f}, mispriced {mispriced:.2f} %, objective {value:.3f}")
    return value


objective(start, show=True)
result = minimize(objective, start, method="Powell", bounds=bounds,
                  options={"maxfev": args.evaluations, "xtol": 1e-3, "ftol": 1e-4})
objective(result.x, show=True)
for (term, param), value in zip(names, result.x):
    print(f"{term}:{param} = {value:.4f}")
if args.out:
    write_model(args.out, model_at(result.x))
