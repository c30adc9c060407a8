"""Session 20 scratch: a variant's per-run |error| on the re-read vTrain train split against the shipped model's
before the re-read (the old reading's store and model: /tmp/old_errors.json, from a worktree at dd983c5^)."""
import sys, os, json, statistics
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1] / 'session19'))
os.environ.setdefault('NOKERNELS', '1')
import fit
from hops_calib.loop.suite import score_model
old = {k: abs(v) for k, v in json.load(open(os.environ.get('OLD', '/tmp/old_errors.json'))).items()}
over = json.loads(sys.argv[1])
m = fit.W.variant({tuple(k.split(':')): v for k, v in over.items()})
r = score_model(fit.SUITE, m, origin='x')
grow = sorted(((abs(x.throughput_error_pct) - old[x.run_id]), x.run_id) for x in r.runs)
print('MAPE', round(r.suite.throughput_mape_pct, 3), 'median', round(statistics.median(x.throughput_error_pct for x in r.runs), 2),
      'regress>2', sum(g > 2 for g, _ in grow), '>3', sum(g > 3 for g, _ in grow), '>4', sum(g > 4 for g, _ in grow), 'worst', [(round(g, 1), i) for g, i in grow[-4:]])
if '-p' in sys.argv: print('published', fit.published(m))
