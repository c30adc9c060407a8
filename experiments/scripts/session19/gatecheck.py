"""Scratch: a variant against the shipped model on /tmp/vt train, as the gate's per-run rule sees it."""
import sys, os, json, statistics
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parent))
os.environ.setdefault('NOKERNELS', '1'); os.environ.setdefault('STORE', '/tmp/vt')
import fit
from hops_calib.loop.suite import score_model
from hops_calib.loop.model_files import load_model
bo = json.loads(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != '-p' else {}
bm = fit.W.variant({tuple(k.split(':')): v for k, v in bo.items()}, path='/tmp/s19_base.toml')
base = {r.run_id: abs(r.throughput_error_pct) for r in score_model(fit.SUITE, bm, origin='x').runs}
over = json.loads(sys.argv[1])
m = fit.W.variant({tuple(k.split(':')): v for k, v in over.items()})
r = score_model(fit.SUITE, m, origin='x')
grow = sorted(((abs(x.throughput_error_pct) - base[x.run_id]), x.run_id) for x in r.runs)
print('MAPE', round(r.suite.throughput_mape_pct, 3), 'median', round(statistics.median(x.throughput_error_pct for x in r.runs), 2),
      'regress>2', sum(g > 2 for g, _ in grow), '>4', sum(g > 4 for g, _ in grow), 'worst', [(round(g, 1), i) for g, i in grow[-3:]])
if '-p' in sys.argv: print('published', fit.published(m))
