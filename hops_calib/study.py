"""The study room: optuna's storages (in memory, sqlite, or any RDB URL such as PostgreSQL), its samplers (TPE, or a
scrambled Sobol sequence that gives trial k the same point whatever process asks, so that any number of workers on
one RDB storage run the same trials as one), and the sharing of trials among workers. `tune`
(`hops_calib.research.tune_study`) and the planner's study (`hops_calib.whatif.launch_study`) run on it."""

from __future__ import annotations

import time
from typing import Any

from hops_calib.errors import InputError

SQLITE_TIMEOUT_S = 60  # concurrent workers wait for sqlite's write lock instead of failing
SAMPLERS = ("tpe", "sobol")


def make_storage(url: str | None):
    """An optuna storage: in memory for None, else an RDB storage (sqlite waits for its write lock)."""
    import optuna

    if url is None:
        return optuna.storages.InMemoryStorage()
    from sqlalchemy.exc import DBAPIError

    engine_kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}} if url.startswith("sqlite") else {}
    last_error: Exception | None = None
    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
        except DBAPIError as error:  # processes starting together on a new sqlite file race to create its tables
            last_error = error
            time.sleep(0.2 * (attempt + 1))
        except Exception as error:  # noqa: BLE001 - a malformed URL or a missing driver: retrying cannot help
            last_error = error
            break
    raise InputError(
        "--storage",
        f"cannot open optuna storage {url!r}: {last_error}",
        field="storage",
        hint="use sqlite:///path/to/study.db locally, or an optuna RDB URL such as "
        "postgresql://user@host/db (its driver must be installed)",
    )


def shown_storage(url: str | None) -> str:
    """A storage URL as output and candidate files show it: its password hidden; "memory" for none."""
    if url is None:
        return "memory"
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL sqlalchemy parses: make_storage refuses it, naming it
        return url


def make_sampler(kind: str, seed: int, dimensions: int = 8):
    """The optuna sampler of `kind` (`SAMPLERS`) seeded with `seed`."""
    import optuna

    if kind not in SAMPLERS:
        raise InputError(
            "--sampler", f"unknown sampler {kind!r}", field="sampler", hint=f"one of {', '.join(SAMPLERS)}"
        )
    return optuna.samplers.TPESampler(seed=seed) if kind == "tpe" else sobol_sampler(seed, dimensions)


def sobol_sampler(seed: int, dimensions: int = 8):
    """A sampler that gives trial number k the k-th point of one scrambled Sobol sequence over the study's
    parameters (in the order the trial asks for them; a log-scaled parameter uniform in its log), whatever process
    asks: so any number of workers sharing an RDB storage run the same trials as one does."""
    import math

    import optuna
    from scipy.stats import qmc  # type: ignore[import-untyped]  # (scipy ships no stubs)

    class SobolSampler(optuna.samplers.BaseSampler):
        def __init__(self) -> None:
            self._points: dict[int, list[list[float]]] = {}  # dimension -> the sequence's points so far
            self._engines: dict[int, Any] = {}
            self.dimensions = dimensions  # at least the parameters a trial asks for

        def infer_relative_search_space(self, study, trial):
            return {}

        def sample_relative(self, study, trial, search_space):
            return {}

        def _point(self, number: int) -> list[float]:
            engine = self._engines.setdefault(self.dimensions, qmc.Sobol(d=self.dimensions, scramble=True, seed=seed))
            points = self._points.setdefault(self.dimensions, [])
            if number >= len(points):
                import warnings

                with warnings.catch_warnings():  # balance properties want powers of 2; any prefix is still fixed
                    warnings.simplefilter("ignore")
                    points.extend(engine.random(number + 1 - len(points)).tolist())
            return points[number]

        def sample_independent(self, study, trial, param_name, param_distribution):
            index = len(trial.distributions)  # the parameters in the order the trial asks for them
            if index >= self.dimensions:
                raise ValueError(f"the Sobol sampler draws at most {self.dimensions} parameters")
            u = self._point(trial.number)[index]
            if isinstance(param_distribution, optuna.distributions.CategoricalDistribution):
                choices = param_distribution.choices
                return choices[min(int(u * len(choices)), len(choices) - 1)]
            low, high = param_distribution.low, param_distribution.high
            if getattr(param_distribution, "log", False):
                return min(high, max(low, math.exp(math.log(low) + u * (math.log(high) - math.log(low)))))
            return min(high, max(low, low + u * (high - low)))

    return SobolSampler()


def quiet_optuna() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)


def shares(trials: int, workers: int) -> list[int]:
    """Trials per worker, adding up to `trials`."""
    return [trials // workers + (1 if k < trials % workers else 0) for k in range(workers)]


def finished(study) -> int:
    import optuna

    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.PRUNED)
    return len(study.get_trials(deepcopy=False, states=states))


def run_processes(processes: list, poll, what: str) -> None:
    """Start worker `processes`, call `poll()` (progress) while any runs, and stop them all if this one is
    interrupted; a worker that failed is an error naming how many (their messages went to stderr)."""
    for process in processes:
        process.start()
    try:
        while any(p.is_alive() for p in processes):
            poll()
            for process in processes:
                process.join(timeout=0.5)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
    failed = [p.exitcode for p in processes if p.exitcode != 0]
    if failed:
        raise InputError(
            what,
            f"{len(failed)} of {len(processes)} worker processes failed (exit codes {failed}); their messages "
            "are above",
            field="workers",
        )


JOIN_WAIT_S = 30.0  # how long a joining process waits for the creating one to write the study's record


def joined_record(study, attr: str, study_name: str, verb: str) -> dict[str, Any]:
    """The record (user attribute `attr`) of a study this process joins, waiting a moment for the process that
    created it to write it; refused naming the study when it has none (another verb's, or no hops-calib study)."""
    deadline = time.monotonic() + JOIN_WAIT_S
    while attr not in study.user_attrs and time.monotonic() < deadline:
        time.sleep(0.1)  # created a moment ago by a process that has not written its record yet
    recorded = study.user_attrs.get(attr)
    if recorded is None:
        raise InputError(
            "--study",
            f"study {study_name!r} has no hops-calib {verb} record (user attribute {attr!r}); it was not created "
            f"by `hops-calib {verb}`",
            field="study",
            hint="choose another --study name",
        )
    return recorded
