import sys, os, json
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parent)); sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[3]))
os.environ.setdefault('NOKERNELS', '1')
import fit
from hops_calib.loop.suite import score_model
from hops_calib.research.decompose import Sample, decompose, layer_bound
def dec(model, suite=None):
    suite = suite or fit.SUITE
    r = score_model(suite, model, origin='x')
    out = []
    for run, spec in zip(r.runs, suite.specs):
        m = spec.microbatches
        out.append(Sample(run.run_id, spec, m * 1e3 / run.real_throughput_per_s, m * 1e3 / run.predicted_throughput_per_s))
    dev = model.device('a100')
    return r, decompose(out, bound=lambda s: layer_bound(s, dev))
if __name__ == '__main__':
    over = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    model = fit.W.variant({tuple(k.split(':')): v for k, v in over.items()})
    r, d = dec(model)
    print('MAPE', round(r.suite.throughput_mape_pct, 2), 'not identified', d.not_identified)
    errs = []
    for f in d.families:
        print(f.label, f.runs, 'recompute' if f.recomputes else 'no recompute', f'resid {f.residual_max_pct:.3f}% / pred {f.predicted_residual_max_pct:.3f}%')
        for row in f.rows:
            errs += [abs(row.layer_error_pct)] * row.runs
            print(f'   mb{row.micro_batch} n{row.runs:3d} x {row.layer_ms:6.2f} pred {row.predicted_layer_ms:6.2f} ({row.layer_error_pct:+5.1f}%)  c {row.microbatch_ms:6.2f} pred {row.predicted_microbatch_ms:6.2f}  bound {row.bound_without_recompute_ms:6.2f}/{row.bound_with_recompute_ms:6.2f} x/bound_rc {row.over_recompute_bound:.2f}')
    import numpy as np; print('layer MAPE (runs-weighted)', round(float(np.mean(errs)), 2))
