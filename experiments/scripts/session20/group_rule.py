"""Session 20 scratch: the per-run rule read by inverted group. Cells (t, h, micro batch; any p: the table composes
its pipelined layouts from the unpipelined layer times) joined by an inversion the shipped model does not follow
(decompose) form groups; a run in a group is judged by its group's mean |error| growth, every other run by its own.
Usage: python group_rule.py '{TERM:PARAM: VALUE}' (vTrain train, against the shipped model)."""
import sys, os, json, re, collections, statistics
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1] / 'session19'))
os.environ.setdefault('NOKERNELS', '1')
import fit
from hops_calib.loop.suite import score_model
from hops_calib.loop.model_files import load_model
from hops_calib.research.decompose import decompose_store
def cell_of(run_id):
    t, p, d, l, h, s, mb = map(int, re.match(r'vtrain_t(\d+)p(\d+)d(\d+)_l(\d+)_h(\d+)_s(\d+)_mb(\d+)', run_id).groups())
    return (t, h, mb)
def cell_of_label(label, mb):
    t, p, h = re.match(r't(\d+) p(\d+) h(\d+)', label).groups()
    return (int(t), int(h), mb)
d = decompose_store('/tmp/vt')
parent = {}
def find(x):
    parent.setdefault(x, x)
    while parent[x] != x: x = parent[x]
    return x
for inv in d.inversions:
    if not inv.followed:
        a, b = cell_of_label(inv.less.family, inv.less.micro_batch), cell_of_label(inv.more.family, inv.more.micro_batch)
        parent[find(a)] = find(b)
groups = collections.defaultdict(set)
for c in list(parent): groups[find(c)].add(c)
print('groups', [sorted(g) for g in groups.values()])
base = {r.run_id: abs(r.throughput_error_pct) for r in score_model(fit.SUITE, load_model(), origin='b').runs}
over = json.loads(sys.argv[1])
r = score_model(fit.SUITE, fit.W.variant({tuple(k.split(':')): v for k, v in over.items()}), origin='x')
new = {x.run_id: abs(x.throughput_error_pct) for x in r.runs}
members = collections.defaultdict(list)
solo = []
for run in new:
    c = cell_of(run)
    (members[find(c)] if c in parent else solo).append(run)
grow_solo = sorted((new[k] - base[k], k) for k in solo)
grow_group = {g: statistics.mean(new[k] - base[k] for k in ks) for g, ks in members.items()}
print('MAPE', round(r.suite.throughput_mape_pct, 3), 'median', round(statistics.median(x.throughput_error_pct for x in r.runs), 2))
print('runs outside groups growing past 2 / 4 pp:', sum(g > 2 for g, _ in grow_solo), sum(g > 4 for g, _ in grow_solo), 'worst', [(round(g, 1), k) for g, k in grow_solo[-3:]])
print('groups (runs, mean |error| growth pp):', {str(sorted(groups[g])): (len(ks), round(grow_group[g], 2)) for g, ks in members.items()})
