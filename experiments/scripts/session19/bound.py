"""Per-layer lower bound (every kernel at the datasheet's peak FLOP/s or bandwidth, no launch gaps, collectives free)
against the per-layer time the vTrain train runs compose to (decomp.py's x), with and without the recomputed forward."""
import sys, re, collections, numpy as np
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[3]))
from hops_calib.store import FixtureStore
from hops_calib.loop.suite import load_suite
from hops_calib.model.terms.decoder_kernels import kernel_settings
from hops_calib.model.kernels import layer_forward, layer_backward, COLLECTIVE, GEMM, ATTENTION
PEAK, BW = 312e12, 2.039e12
store = FixtureStore('/tmp/vt')
suite_ids = store.ids('train')
groups = collections.defaultdict(list)
for rid in suite_ids:
    t, p, d, L, h, s, mb, gb = map(int, re.match(r'vtrain_t(\d+)p(\d+)d(\d+)_l(\d+)_h(\d+)_s(\d+)_mb(\d+)_gb(\d+)', rid).groups())
    if p != 1: continue
    groups[(t, h)].append((d, L, gb // (mb * d), rid, mb))
import csv
meas = {}
for r in csv.DictReader(open('../shared/public-runs/vtrain/ground_truth_single.csv')):
    key = 'vtrain_t%sp%sd%s_l%s_h%s_s%s_mb%s_gb%s' % (r['tensor parallelism'], r['pipeline parallelism'], r['data parallelism'], r['# layers'], r['hidden size'], r['sequence length'], r['micro batch'], r['global batch'])
    meas[key] = float(r['iteration time (ms)'])
print(" t    h mb |  x meas | bound fwd  bwd | recompute: bound  meas/bound | none: bound meas/bound")
for k in sorted(groups):
    rows = groups[k]
    ds = sorted(set(r[0] for r in rows)); mbs = sorted(set(r[4] for r in rows))
    A, y = [], []
    for d, L, m, rid, mb in rows:
        row = []
        for dd in ds: row += [float(d == dd), L * float(d == dd)]
        for bb in mbs: row += [m * float(mb == bb), m * L * float(mb == bb)]
        A.append(row); y.append(meas[rid])
    A, y = np.array(A), np.array(y)
    assert np.linalg.matrix_rank(A) == A.shape[1]
    coef = np.linalg.lstsq(A, y, rcond=None)[0]
    resid = np.abs(A @ coef - y).max()
    for i, bb in enumerate(mbs):
      x = coef[2 * len(ds) + 2 * i + 1]
      rid = next(r[3] for r in rows if r[4] == bb)
      spec = store.load(rid).spec
      st = kernel_settings(spec)
      def lb(ks):
        tot = 0.0
        for kk in ks:
            if kk.op == COLLECTIVE: continue
            tot += max(kk.flops / PEAK if kk.op in (GEMM, ATTENTION) else 0.0, kk.bytes / BW)
        return tot * 1e3
      f, b = lb(layer_forward(spec.model, st)), lb(layer_backward(spec.model, st))
      print(f"{k[0]:2d} {k[1]:4d} {bb:2d} | {x:7.3f} | {f:6.3f} {b:6.3f} | {2*f+b:8.3f} {x/(2*f+b):6.2f} | {f+b:8.3f} {x/(f+b):6.2f}   (fit resid {resid:.3f} ms, {len(rows)} runs)")
