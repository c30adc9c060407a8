"""The vTrain train runs' iteration MAPE floor for any model whose per-layer time does not fall with micro batch
(everything else exact): per (t, h, p) the composed per-layer times x(mb) replaced by their isotonic fit."""
import csv, re, collections, numpy as np, sys
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[3]))
from hops_calib.store import FixtureStore
ids = FixtureStore('/tmp/vt').ids('train')
meas = {}
for r in csv.DictReader(open('../shared/public-runs/vtrain/ground_truth_single.csv')):
    key = 'vtrain_t%sp%sd%s_l%s_h%s_s%s_mb%s_gb%s' % (r['tensor parallelism'], r['pipeline parallelism'], r['data parallelism'], r['# layers'], r['hidden size'], r['sequence length'], r['micro batch'], r['global batch'])
    meas[key] = float(r['iteration time (ms)'])
groups = collections.defaultdict(list)
for rid in ids:
    t, p, d, L, h, s, mb, gb = map(int, re.match(r'vtrain_t(\d+)p(\d+)d(\d+)_l(\d+)_h(\d+)_s(\d+)_mb(\d+)_gb(\d+)', rid).groups())
    groups[(t, h, p)].append((d, L, gb // (mb * d), mb, rid))
def pava(y, w):
    y, w = list(y), list(w); blocks = [[v, wt, 1] for v, wt in zip(y, w)]
    i = 0
    while i < len(blocks) - 1:
        if blocks[i][0] > blocks[i + 1][0] + 1e-12:
            a, b = blocks[i], blocks[i + 1]
            blocks[i] = [(a[0] * a[1] + b[0] * b[1]) / (a[1] + b[1]), a[1] + b[1], a[2] + b[2]]; del blocks[i + 1]; i = max(i - 1, 0)
        else: i += 1
    out = []
    for v, wt, n in blocks: out += [v] * n
    return out
errs = []; worst = []
for k, rows in sorted(groups.items()):
    ds = sorted(set(r[0] for r in rows)); mbs = sorted(set(r[3] for r in rows))
    A, y = [], []
    for d, L, m, mb, rid in rows:
        row = []
        for dd in ds: row += [float(d == dd), L * float(d == dd)]
        for bb in mbs: row += [m * float(mb == bb), m * L * float(mb == bb)]
        A.append(row); y.append(meas[rid])
    A, y = np.array(A), np.array(y)
    coef = np.linalg.lstsq(A, y, rcond=None)[0]
    xs = [coef[2 * len(ds) + 2 * i + 1] for i in range(len(mbs))]
    cnt = [sum(1 for r in rows if r[3] == bb) for bb in mbs]
    iso = pava(xs, cnt)
    c2 = coef.copy()
    for i in range(len(mbs)): c2[2 * len(ds) + 2 * i + 1] = iso[i]
    e = np.abs(A @ c2 / y - 1) * 100
    errs += list(e)
    print(k, 'x', ' '.join(f'{v:.2f}' for v in xs), '-> iso', ' '.join(f'{v:.2f}' for v in iso), f' group MAPE {e.mean():.2f}')
print(f'floor MAPE over {len(errs)} train runs: {np.mean(errs):.2f} %')
