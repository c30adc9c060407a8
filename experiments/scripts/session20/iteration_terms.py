"""Session 20 scratch: the per-iteration coefficients a(d), b(d) of decompose's form per family, measured and predicted
(vTrain train, the shipped model or a variant: '{TERM:PARAM: VALUE}')."""
import sys, os, json
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1] / 'session19'))
os.environ.setdefault('NOKERNELS', '1')
import fit
import numpy as np
from hops_calib.loop.suite import score_model
from hops_calib.research.decompose import Sample, family_key, family_label, _design, _fit
over = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
model = fit.W.variant({tuple(k.split(':')): v for k, v in over.items()})
r = score_model(fit.SUITE, model, origin='x')
fam = {}
for run, spec in zip(r.runs, fit.SUITE.specs):
    m = spec.microbatches
    fam.setdefault(family_key(spec), []).append(Sample(run.run_id, spec, m * 1e3 / run.real_throughput_per_s, m * 1e3 / run.predicted_throughput_per_s))
for members in sorted(fam.values(), key=lambda ms: family_label(ms[0].spec)):
    design, dps, mbs = _design(members)
    if design.shape[0] <= design.shape[1] or np.linalg.matrix_rank(design) < design.shape[1]:
        continue
    real, _ = _fit(design, np.array([s.real_ms for s in members]))
    pred, _ = _fit(design, np.array([s.predicted_ms for s in members]))
    label = family_label(members[0].spec)
    if ' p1 ' not in label: continue
    print(label, ' '.join(f'd{d}: a {real[2*i]:7.1f}/{pred[2*i]:7.1f} b {real[2*i+1]:6.2f}/{pred[2*i+1]:6.2f}' for i, d in enumerate(dps)))
