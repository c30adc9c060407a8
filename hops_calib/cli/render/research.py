"""What `tune` and `crossval` print for people, from a `TuneResult` (`hops_calib.research.tune`) and a
`CrossValidation` (`hops_calib.research.crossval`)."""

from __future__ import annotations

from hops_calib.cli.render.tables import text_table
from hops_calib.loop.score import or_nan
from hops_calib.research.crossval import CrossValidation
from hops_calib.research.tune import CHOICE_RULE, PLACEHOLDER, TuneResult, _number, evaluate_command


def tune_text(result: TuneResult) -> str:
    names = list(result.front[0].params) if result.front else []
    current = result.current
    out = [
        f"tune {result.term}: study {result.study_name!r} ({result.storage}); {result.trials_here} trials here "
        f"with {result.workers} worker(s), {result.trials_in_study} in the study",
        f"current model: throughput MAPE {current.throughput_mape_pct:.2f} %, bubble MAE "
        f"{_number(current.bubble_mae_pp, 2)} pp, mean rho {_number(current.util_spearman_mean, 3)}, steady "
        "throughput MAPE "
        f"{current.steady_throughput_mape_pct:.2f} %",
        f"{'best trials' if result.objective == 'components' else 'Pareto front'} ({len(result.front)} trials; "
        f"objectives {', '.join(result.objectives)}):",
    ]
    if result.left_out and result.left_out["count"]:
        out.insert(
            2,
            f"left out {result.left_out['count']} train run(s) the model does not price: "
            + "; ".join(f"{r['count']} {r['reason']}" for r in result.left_out["reasons"]),
        )
    components = result.objective == "components"
    rows = [
        [("* " if p is result.chosen else "  ") + str(p.number)]
        + [f"{p.params[n]:.6g}" for n in names]
        + ([f"{p.score['component_mape_pct']:.2f}"] if components else [])
        + [
            f"{p.score['throughput_mape_pct']:.2f}",
            _number(p.score["bubble_mae_pp"], 2),
            _number(p.score["util_spearman_mean"], 3),
            f"{p.score['steady_throughput_mape_pct']:.2f}",
        ]
        for p in result.front
    ]
    headers = (
        ["trial"]
        + names
        + (["mispriced %"] if components else [])
        + ["MAPE %", "bubble MAE pp", "rho", "steady MAPE %"]
    )
    out.append(text_table(headers, rows, right=set(range(len(headers)))))
    if result.chosen is None or result.candidate_path is None:  # (a chosen point's candidate is always written)
        out.append(f"no candidate written: {result.no_candidate_reason}")
        if result.verdict is not None:
            out.append("the gate against the current model, on the lowest-MAPE point that changes it:")
            out += [f"  - {reason}" for reason in result.verdict.reasons]
        return "\n".join(out)
    out.append(f"chosen (*): trial {result.chosen.number}, {CHOICE_RULE}")
    out.append("the gate accepts it against the current model on the train split")
    out.append(f"wrote {result.candidate_path}: replace its {PLACEHOLDER} hypothesis and grounding, then run")
    out.append(
        f"  {evaluate_command(result.candidate_path, result.fixtures_dirs or result.fixtures_dir, result.model_path)}"
    )
    return "\n".join(out)


def crossval_text(result: CrossValidation) -> str:
    names = list(result.current_params)
    cv = result.held_out
    out = [
        f"crossval {result.term}: {len(result.folds)} folds of the train split's configurations (seed "
        f"{result.seed}); each refit searched from the term's defaults (TPE, then CMA-ES), at most "
        f"{result.evaluations} evaluations, objective "
        f"{result.objective}; model "
        f"{result.model_sha256[:12]}",
        f"current model on train: throughput MAPE {result.current.throughput_mape_pct:.2f} %, bubble MAE "
        f"{or_nan(result.current.bubble_mae_pp):.2f} pp, rho {or_nan(result.current.util_spearman_mean):.3f}",
        f"refit without the fold, on the fold (cross-validated): throughput MAPE {cv.throughput_mape_pct:.2f} %, "
        f"bubble MAE {or_nan(cv.bubble_mae_pp):.2f} pp, rho {or_nan(cv.util_spearman_mean):.3f}; on its own fitting "
        "runs "
        f"{result.in_sample_mape_pct:.2f} % (optimism {result.optimism_pp:+.2f} pp)",
    ]
    if result.left_out and result.left_out["count"]:
        out.append(
            f"left out {result.left_out['count']} train run(s) the model does not price: "
            + "; ".join(f"{r['count']} {r['reason']}" for r in result.left_out["reasons"])
        )
    rows = []
    for fold in result.folds:
        rows.append(
            [
                str(fold.index) + (" !" if fold.fell_short else ""),
                str(len(fold.ids)),
                _short_groups(fold.groups),
                f"{fold.current.throughput_mape_pct:.2f}",
                f"{fold.held_out.throughput_mape_pct:.2f}",
                f"{fold.in_sample.throughput_mape_pct:.2f}",
            ]
            + [f"{fold.params[n]:.4g}" for n in names]
        )
    rows.append(
        [
            "all",
            str(result.full.n_fixtures),
            "none: the same refit on every train run",
            "",
            "",
            f"{result.full.throughput_mape_pct:.2f}",
        ]
        + [f"{result.full_params[n]:.4g}" for n in names]
    )
    rows.append(
        ["now", "", "the current model's values", f"{result.current.throughput_mape_pct:.2f}", "", ""]
        + [f"{result.current_params[n]:.4g}" for n in names]
    )
    headers = ["fold", "runs", "configurations held out", "current %", "held out %", "in sample %"] + names
    out.append(text_table(headers, rows, right={0, 1, 3, 4, 5, *range(6, 6 + len(names))}))
    if result.also:
        out.append("refit together with the term: " + ", ".join(result.also))
    if result.dropped:
        out.append("per-device values taken out, one value refit for every device: " + ", ".join(result.dropped))
    if result.objective == "components":
        out.append(
            f"mispriced share of the measured times (the refits' objective): cross-validated "
            f"{result.held_out_component_pct:.2f} %, in sample {result.in_sample_component_pct:.2f} %, the "
            f"refit on every train run {result.full_component_pct:.2f} %, the current values "
            f"{result.current_component_pct:.2f} %"
        )
    out += [f"warning: {w}" for w in result.warnings()]
    out += result.verdicts()
    worst = sorted(
        ((abs(h) - abs(c), run, c, h) for f in result.folds for run, (c, h) in f.errors.items()), reverse=True
    )[:3]
    if worst and worst[0][0] > 0:
        out.append(
            "runs the refit predicts worst when their configuration is held out (throughput error %, "
            "current -> held out): " + "; ".join(f"{run} {c:+.1f} -> {h:+.1f}" for _, run, c, h in worst)
        )
    return "\n".join(out)


def _short_groups(groups: tuple[str, ...], width: int = 60) -> str:
    text = ", ".join(groups)
    return text if len(text) <= width else text[: width - 1] + "\u2026"
