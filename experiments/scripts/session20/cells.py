"""Session 20 scratch: per (t, pipelined, h, micro batch) cell, the median signed error of the shipped model and a
variant on the vTrain train split, and the variant's runs whose |error| grows past 2 pp."""
import sys, os, json, re, statistics, collections
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1] / 'session19'))
os.environ.setdefault('NOKERNELS', '1')
import fit
from hops_calib.loop.suite import score_model
from hops_calib.loop.model_files import load_model
base = {r.run_id: r.throughput_error_pct for r in score_model(fit.SUITE, load_model(), origin='b').runs}
over = json.loads(sys.argv[1])
m = fit.W.variant({tuple(k.split(':')): v for k, v in over.items()})
r = score_model(fit.SUITE, m, origin='x')
cells = collections.defaultdict(list)
for x in r.runs:
    t, p, d, l, h, s, mb = map(int, re.match(r'vtrain_t(\d+)p(\d+)d(\d+)_l(\d+)_h(\d+)_s(\d+)_mb(\d+)', x.run_id).groups())
    cells[(t, p > 1, h, mb)].append((base[x.run_id], x.throughput_error_pct))
print('MAPE', round(r.suite.throughput_mape_pct, 3), 'median', round(statistics.median(x.throughput_error_pct for x in r.runs), 2))
for k, v in sorted(cells.items()):
    grow = sum(abs(b) + 2 < abs(a) for b, a in v)
    print(k, len(v), 'base', round(statistics.median(b for b, _ in v), 1), 'new', round(statistics.median(a for _, a in v), 1), 'grow>2', grow)
