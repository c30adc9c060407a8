"""hops-calib: calibrate and validate a pipeline-parallel training simulator against real Megatron-LM traces.

The public Python API, eight names, each imported from its room on first use (module `__getattr__`), so that
`import hops_calib` loads no numeric library:

- `open_store(path)`: a fixture store (`hops_calib.store.FixtureStore`); `.ids("train")`, `.load(run_id)`;
- `build_spec(job_dir)`: what a prediction may see of a job directory (`hops_calib.spec.Spec`);
- `load_model(path=None)`: a cost model (`hops_calib.model.Model`; default: the shipped `baseline.toml`);
- `predict(spec, model, schedule=None)`: a spec simulated under a model (`hops_calib.model.predict.Prediction`);
- `simulate(pipeline, schedule)`: the pure simulator on a `hops_calib.sim.Pipeline` of costs (`SimResult`);
- `predict_job(job_dir, model, schedules=())`: a job directory before it runs (`hops_calib.whatif.job.WhatIf`);
- `plan_job(job_dir, model, top=5, ...)`: the best launches of a job (`hops_calib.whatif.job_plan.JobPlan`);
- `evaluate(fixtures, candidate_path=None, ...)`: the model scored on a store's train split, and a candidate
  gated and recorded in the ledger (`hops_calib.loop.evaluate.Evaluation`).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> (module, attribute): where each public name lives.
_PUBLIC = {
    "open_store": ("hops_calib.loop.suite", "open_store"),
    "build_spec": ("hops_calib.spec", "build_spec"),
    "load_model": ("hops_calib.loop.model_files", "load_model"),
    "predict": ("hops_calib.model.predict", "predict"),
    "simulate": ("hops_calib.sim", "simulate"),
    "predict_job": ("hops_calib.whatif.job", "what_if"),
    "plan_job": ("hops_calib.whatif.job_plan", "plan_job"),
    "evaluate": ("hops_calib.loop.evaluate", "evaluate"),
}

__all__ = [
    "__version__",
    "build_spec",
    "evaluate",
    "load_model",
    "open_store",
    "plan_job",
    "predict",
    "predict_job",
    "simulate",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its room when first asked for, then kept in the package's namespace."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'hops_calib' has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
