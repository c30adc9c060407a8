"""The research verbs: observe, tune and crossval, computed by `hops_calib.research` and printed here as text or
JSON (a progress bar on a terminal's stderr meanwhile)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hops_calib.cli.output import held_out_guard, run_and_print


def observe_command(fixtures: Path, model_path: Path | None, split: str, as_json: bool, top: int,
                    ledger_path: Path | None = None, allow_held_out: bool = False) -> int:
    """The `observe` verb: text (or JSON) on stdout, a progress bar on a terminal's stderr."""
    from hops_calib.cli.render.observe import observation_text
    from hops_calib.research.observe import observe

    return run_and_print("observe", as_json,
                         lambda bar: observe(fixtures, model_path=model_path, split=split, progress=bar),
                         lambda observation: observation_text(observation, top=top),
                         held_out_guard=held_out_guard(fixtures, ledger_path, "observe", allow_held_out))


def tune_command(term: str, fixtures: Path | Sequence[Path], model_path: Path | None, trials: int, storage: str | None,
                 study: str | None, workers: int, seed: int, out: Path | None, as_json: bool,
                 objective: str = "suite", only: tuple[str, ...] = (), ledger: Path | None = None,
                 off_record: bool = False, split: str = "train", allow_held_out: bool = False,
                 sampler: str = "tpe") -> int:
    """Exit 0 a candidate written, 1 none (status no_candidate: no trial beats the model), 4 off the record."""
    from hops_calib.cli.render.research import tune_text
    from hops_calib.cli.settings import default_storage
    from hops_calib.research.tune import tune

    # without --storage: $HOPS_CALIB_STORAGE, else the nearest hops-calib.toml's [defaults] storage, else memory
    return run_and_print(f"tune {term}", as_json,
                         lambda bar: tune(term, fixtures, model_path=model_path, trials=trials,
                                          storage_url=storage if storage is not None else default_storage()[0],
                                          study_name=study, workers=workers, seed=seed, out=out,
                                          progress=bar.update, objective=objective, only=only, ledger_path=ledger,
                                          off_record=off_record, split=split, sampler=sampler),
                         tune_text, held_out_guard=held_out_guard(fixtures, ledger, "tune", allow_held_out))


def crossval_command(term: str, fixtures: Path, model_path: Path | None, folds: int, evaluations: int, seed: int,
                     as_json: bool, objective: str = "suite", only: tuple[str, ...] = (), shared: bool = False,
                     also: tuple[str, ...] = (), split: str = "train", ledger_path: Path | None = None,
                     allow_held_out: bool = False) -> int:
    from hops_calib.cli.render.research import crossval_text
    from hops_calib.research.crossval import crossval

    return run_and_print(f"crossval {term}", as_json,
                         lambda bar: crossval(term, fixtures, model_path=model_path, folds=folds,
                                              evaluations=evaluations, seed=seed, objective=objective, only=only,
                                              shared=shared, also=also, progress=bar.update, split=split),
                         crossval_text,
                         held_out_guard=held_out_guard(fixtures, ledger_path, "crossval", allow_held_out))
