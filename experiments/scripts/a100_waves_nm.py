"""Session 18 scratch: Nelder-Mead of the A100 values under wave quantization on vTrain train MAPE (no additive
host time); extra TERM:PARAM arguments are fitted too. See a100_waves_fit.py."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from a100_waves_fit import score
from scipy.optimize import minimize
fixed = {("layer_dispatch_floor","forward_ms_per_layer@a100"):0.0, ("layer_dispatch_floor","backward_ms_per_layer@a100"):0.0,
         ("decoder_roofline","wave_quantization@a100"):1.0}
names = [("decoder_roofline","compute_efficiency@a100"),("layer_launch_floor","forward_ms_per_layer@a100"),("layer_launch_floor","backward_ms_per_layer@a100")]
extra = sys.argv[1:]  # more names term:param
names += [tuple(x.split(':')) for x in extra]
x0 = {"compute_efficiency@a100":0.8,"forward_ms_per_layer@a100":0.81,"backward_ms_per_layer@a100":1.24,"backward_factor@a100":2.0,"step_ms@a100":0.016}
best=[1e9,None]
def f(x):
    over = dict(fixed); over.update({n: round(float(v),4) for n, v in zip(names, x)})
    if any(v < 0 for v in x) or x[0] > 1: return 1e9
    r = score(over)['mape']
    if r < best[0]: best[:] = [r, dict((k[1],v) for k,v in over.items())]; print(r, best[1], flush=True)
    return r
res = minimize(f, [x0[n[1]] for n in names], method='Nelder-Mead', options=dict(maxfev=int(60+20*len(extra)), xatol=1e-3, fatol=1e-3, initial_simplex=None))
print('BEST', best)
