"""Session 18 scratch (experiments/CAMPAIGN.md): score a variant of the shipped model on the vTrain train split,
with residuals by (t, pipelined, h, micro batch). Apply a100-wave-quantization.patch first for the
`wave_quantization` switch. Usage: python experiments/scripts/a100_waves_fit.py '{"TERM:PARAM": VALUE, ...}'
(the vTrain store from `hops-calib ingest ../shared/public-runs/vtrain/ground_truth_single.csv --split auto
--fixtures /tmp/vt`; VTRAIN_STORE overrides the path)."""
import collections
import json
import os
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from hops_calib.loop.suite import load_suite, score_model
from hops_calib.loop.model_files import load_model

BASE = (REPO / 'hops_calib/model/models/baseline.toml').read_text()
SUITE = load_suite(os.environ.get('VTRAIN_STORE', '/tmp/vt'), 'train')

def variant(over: dict, path='/tmp/a100_waves_model.toml'):
    text = BASE
    for (term, key), value in over.items():
        sect = f'[terms.{term}]'
        i = text.index(sect)
        j = text.find('\n[', i + 1); j = len(text) if j < 0 else j
        body = text[i:j]
        qkey = f'"{key}"' if '@' in key else key
        pat = re.compile(rf'^{re.escape(qkey)} = .*$', re.M)
        if pat.search(body):
            body = pat.sub(f'{qkey} = {value}', body)
        else:
            body = body.rstrip('\n') + f'\n{qkey} = {value}\n'
        text = text[:i] + body + text[j:]
    open(path, 'w').write(text)
    return load_model(path)

def score(over, table=False):
    m = variant(over)
    r = score_model(SUITE, m, origin='x')
    errs = [x.throughput_error_pct for x in r.runs]
    out = dict(mape=round(r.suite.throughput_mape_pct, 3), median=round(statistics.median(errs), 2))
    if table:
        tab = collections.defaultdict(list)
        for x in r.runs:
            g = re.match(r'vtrain_t(\d+)p(\d+)d(\d+)_l(\d+)_h(\d+)_s(\d+)_mb(\d+)', x.run_id).groups()
            t, p, d, l, h, s, mb = map(int, g)
            tab[(t, p > 1, h, mb)].append(x.throughput_error_pct)
        out['table'] = {k: (round(statistics.median(v), 1), len(v)) for k, v in sorted(tab.items())}
    return out

if __name__ == '__main__':
    over = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    over = {tuple(k.split(':')): v for k, v in over.items()}
    res = score(over, table=True)
    print(res['mape'], res['median'])
    for k, v in res['table'].items():
        print(k, v)
