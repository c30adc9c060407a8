import sys, json
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parent))
import fit
from scipy.optimize import minimize
names = json.loads(sys.argv[1]); x0 = json.loads(sys.argv[2]); fixed = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
best = [1e9, None]
def f(x):
    over = dict(fixed); over.update({n: max(0.0, float(v)) for n, v in zip(names, x)})
    r = fit.run(over, pub=False)
    if r['mape'] < best[0]: best[:] = [r['mape'], over]; print(r, {k: round(v, 4) for k, v in over.items()}, flush=True)
    return r['mape']
res = minimize(f, x0, method='Nelder-Mead', options=dict(maxfev=int(sys.argv[4]) if len(sys.argv) > 4 else 80, xatol=1e-3, fatol=1e-3, initial_simplex=None))
print('BEST', best)
print('published', fit.published(fit.W.variant({tuple(k.split(':')): v for k, v in best[1].items()})))
