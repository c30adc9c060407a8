"""Scratch: vTrain without recomputation (/tmp/vt, re-ingested), A100 layers' GPU work from decoder_kernels, host terms kept
(decoder_kernels made to supersede only the GPU-work terms). Prints vTrain train MAPE / median and the published
scaling medians."""
import sys, os, json, re, statistics, collections
_R = __import__('pathlib').Path(__file__).resolve().parents[3]; sys.path[:0] = [str(_R), str(_R / 'experiments/scripts'), str(_R / 'benchmarks')]
import a100_waves_fit as W
from hops_calib.loop.suite import load_suite, score_model
from hops_calib.model.terms.decoder_kernels import DecoderKernels
import published_scaling as ps
from hops_calib.model.predict import predict
from hops_calib.spec import Hardware, spec_from_args
KEEP_FLOORS = os.environ.get('KEEP_FLOORS', '1') == '1'
if KEEP_FLOORS:
    DecoderKernels.supersedes = ("decoder_roofline", "attention_score_traffic", "elementwise_traffic")
if os.environ.get('KEEP_DISPATCH') == '1':
    KEEP_FLOORS = False
    DecoderKernels.supersedes = ("decoder_roofline", "attention_score_traffic", "elementwise_traffic", "layer_launch_floor")
if os.environ.get('NOKERNELS') != '1': W.BASE = W.BASE + '\n[terms.decoder_kernels]\nenabled = 0.0\n"enabled@a100" = 1.0\n' + ('"launch_us@a100" = 0.0\n"backward_launch_us@a100" = 0.0\n' if KEEP_FLOORS else '')
SUITE = load_suite(os.environ.get('STORE', '/tmp/vt'), 'train')
def published(model, mbs=(1, 2, 4)):
    out = {}
    for mb in mbs:
        rs = []
        for name, heads, hidden, layers, tp, pp, gpus, batch, pub in ps.TABLE_1:
            spec = spec_from_args(ps.launch(heads, hidden, layers, tp, pp, gpus, batch, mb), "benchmark", run_id="x", iterations=2, hardware=Hardware(gpu="a100", gpus_per_node=8))
            it = predict(spec, model).metrics.iteration_time_ms
            rs.append(ps.hardware_flops(batch, layers, hidden) / (it / 1e3) / gpus / 1e12 / pub)
        out[mb] = (round(sorted(rs)[len(rs) // 2], 3), round(min(rs), 2), round(max(rs), 2))
    return out
def run(over, table=False, pub=True):
    model = W.variant({tuple(k.split(':')): v for k, v in over.items()})
    r = score_model(SUITE, model, origin='x')
    errs = [x.throughput_error_pct for x in r.runs]
    res = dict(mape=round(r.suite.throughput_mape_pct, 3), median=round(statistics.median(errs), 2))
    if pub: res['published'] = published(model)
    if table:
        tab = collections.defaultdict(list)
        for x in r.runs:
            t, p, d, l, h, s, mb = map(int, re.match(r'vtrain_t(\d+)p(\d+)d(\d+)_l(\d+)_h(\d+)_s(\d+)_mb(\d+)', x.run_id).groups())
            tab[(t, p > 1, h, mb)].append(x.throughput_error_pct)
        res['table'] = {k: round(statistics.median(v), 1) for k, v in sorted(tab.items())}
    return res
if __name__ == '__main__':
    over = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    res = run(over, table='-t' in sys.argv)
    tab = res.pop('table', None)
    print(res)
    if tab:
        for k, v in tab.items(): print(k, v)
