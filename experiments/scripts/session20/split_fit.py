"""Session 20 scratch: fit the A100 layer host terms to the decomposed layer times x and the A100 outside-layer
terms to the decomposed microbatch times c (vTrain train, p = 1 families, runs-weighted mean |error|), each
term's parameters to the quantity it prices. Usage: python split_fit.py x|c '[PARAMS]' '[X0]' '{FIXED}' MAXFEV"""
import sys, os, json
os.environ.setdefault('NOKERNELS', '1')
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1] / 'session19'))
import fit, dec2
import numpy as np
from scipy.optimize import minimize
which, names, x0, fixed, maxfev = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
best = [1e9, None]
def errors(over, pipelined=False):
    model = fit.W.variant({tuple(k.split(':')): v for k, v in over.items()})
    r, d = dec2.dec(model)
    xs, cs = [], []
    for f in d.families:
        if (f.label.split()[1] != 'p1') and not pipelined:
            continue
        for row in f.rows:
            xs += [abs(row.layer_error_pct)] * row.runs
            cs += [abs(row.predicted_microbatch_ms - row.microbatch_ms) / row.microbatch_ms * 100] * row.runs
    return float(np.mean(xs)), float(np.mean(cs)), r.suite.throughput_mape_pct
def f(x):
    over = dict(fixed); over.update({n: max(1e-4, float(v)) for n, v in zip(names, x)})
    try:
        ex, ec, it = errors(over)
    except Exception:
        return 1e9
    obj = ex if which == 'x' else ec
    if obj < best[0]:
        best[:] = [obj, over]; print(round(obj, 3), 'x', round(ex, 2), 'c', round(ec, 2), 'iteration MAPE', round(it, 3), {k: round(v, 4) for k, v in over.items()}, flush=True)
    return obj
if maxfev:
    minimize(f, x0, method='Nelder-Mead', options=dict(maxfev=maxfev, xatol=1e-3, fatol=1e-3))
else:
    f(x0)
print('BEST', json.dumps(best[1]))
