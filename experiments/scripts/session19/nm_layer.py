import sys, os, json
os.environ['NOKERNELS'] = os.environ.get('NOKERNELS', '0')
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parent))
import fit, dec2
import numpy as np
from scipy.optimize import minimize
names = json.loads(sys.argv[1]); x0 = json.loads(sys.argv[2]); fixed = json.loads(sys.argv[3]); maxfev = int(sys.argv[4])
best = [1e9, None]
def layer_mape(over):
    model = fit.W.variant({tuple(k.split(':')): v for k, v in over.items()})
    r, d = dec2.dec(model)
    errs = [abs(row.layer_error_pct) for f in d.families if f.label.split()[1] == 'p1' for row in f.rows for _ in range(row.runs)]
    return float(np.mean(errs)), r.suite.throughput_mape_pct
def f(x):
    over = dict(fixed); over.update({n: max(0.0, float(v)) for n, v in zip(names, x)})
    lm, it = layer_mape(over)
    if lm < best[0]:
        best[:] = [lm, over]; print(round(lm, 3), 'iteration MAPE', round(it, 3), {k: round(v, 4) for k, v in over.items()}, flush=True)
    return lm
minimize(f, x0, method='Nelder-Mead', options=dict(maxfev=maxfev, xatol=1e-3, fatol=1e-3))
print('BEST', best)
print('published', fit.published(fit.W.variant({tuple(k.split(':')): v for k, v in best[1].items()})))
