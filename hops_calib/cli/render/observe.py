"""What `observe` prints for people: the suite's errors, the contributors ranked, the hops, the slowest stages
and the worst runs, from an `Observation` (`hops_calib.research.observe`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from hops_calib.cli.render.evaluate import timers_text
from hops_calib.cli.render.tables import text_table
from hops_calib.research.observe import Observation
from hops_calib.research.observe_contributors import Contributor, _signed
from hops_calib.research.observe_rows import BOTTLENECK_MARGIN, LABELS, PART_QUANTITIES, RunRow


def _ms(value: float | None) -> str:
    return f"{round(value, 1) + 0.0:.1f}" if value is not None and math.isfinite(value) else "-"


def observation_text(observation: Observation, top: int = 12) -> str:
    suite = observation.suite
    out = [
        f"observe: model {observation.model_name} ({observation.model_sha256[:12]}) on {suite.n_fixtures} "
        f"{observation.split} fixtures in {observation.fixtures_dir}",
        f"throughput MAPE {suite.throughput_mape_pct:.2f} % (window; the gate's), steady throughput MAPE "
        f"{suite.steady_throughput_mape_pct:.2f} %, "
        + (
            f"bubble MAE {suite.bubble_mae_pp:.2f} pp, mean utilization rho {suite.util_spearman_mean:.3f}"
            if suite.bubble_mae_pp is not None
            else "no bubble or utilization (no run has events)"
        )
        + (
            f" (on the {suite.count('bubble')} runs with events)"
            if suite.bubble_mae_pp is not None and suite.count("bubble") < suite.n_fixtures
            else ""
        ),
        f"stall-noise floor: {suite.stall_noise_mape_pct:.2f} % of throughput MAPE is what random retransmission "
        "stalls alone cost an otherwise exact model on these runs (Prediction.stall_noise_ape_pct)",
    ]
    if suite.timers:
        out.append(timers_text(suite.timers))
    if observation.left_out["count"]:
        out.append(
            f"left out {observation.left_out['count']} run(s) the model does not price: "
            + "; ".join(f"{r['count']} {r['reason']}" for r in observation.left_out["reasons"])
        )
    if observation.iteration_level_runs:
        events = suite.n_fixtures - observation.iteration_level_runs
        out.append(
            f"{observation.iteration_level_runs} run(s) measured at iteration level (no events): scored on "
            "throughput and grouped by configuration below"
            + (f"; the parts, stages, hops and bottlenecks cover the {events} run(s) with events" if events else "")
        )
        groups = [
            [
                r["dimension"],
                r["group"],
                str(r["n_runs"]),
                f"{r['throughput_mape_pct']:.2f}",
                f"{r['mean_error_pct']:+.2f}",
                f"{r['contribution_pp']:.2f}",
            ]
            for r in observation.by_configuration[:top]
        ]
        if groups:
            out += [
                "",
                "throughput error by configuration group (pp: the suite MAPE its runs carry)",
                text_table(["dimension", "group", "runs", "MAPE %", "mean err %", "pp"], groups, right={2, 3, 4, 5}),
                "",
            ]
    replay = observation.measured_replay
    if replay is not None:
        out.append(
            f"measured replay ({replay['n_runs']} runs fed every part their trace measures): throughput MAPE "
            f"{replay['throughput_mape_pct']:.2f} %, mean error {replay['mean_error_pct']:+.2f} % - what the "
            "model's hops, untraced host time and schedule leave"
        )
    free = observation.stall_free
    if free is not None:
        out.append(
            f"stall-free ({free['n_runs']} runs, the retransmission stalls taken out of the real and the "
            f"simulated window): throughput MAPE {free['throughput_mape_pct']:.2f} %, mean error "
            f"{free['mean_error_pct']:+.2f} % - the model's own error, without the stalls' random count"
        )
    out.append("")

    def rows(contributors: Iterable[Contributor], first: Callable[[int, Contributor], list[str]]) -> list[list[str]]:
        return [
            first(i, c)
            + [
                str(c.n_runs),
                "-" if c.n_stages is None else str(c.n_stages),
                _ms(c.real_ms_mean),
                _ms(c.predicted_ms_mean),
                _ms(c.residual_ms_mean),
                _signed(c.residual_pct, "%"),
                f"{c.contribution_pp:.2f}",
                f"{c.steady_contribution_pp:.2f}",
            ]
            for i, c in enumerate(contributors, start=1)
        ]

    if observation.iteration_level_runs == suite.n_fixtures:  # no events: no parts, stages, hops or bottlenecks
        out.append(
            "No run has events, so no iteration part, stage time, hop or slowest stage is measured: each term "
            "of the predicted iteration (the model's breakdown on the busiest rank, and the bubble) is fitted "
            "to the runs' iteration residuals within each configuration group. Runs with events (job "
            "directories) add the measured parts."
        )
        out.append("")
        shown = observation.ranked[:top]
        if shown:
            out.append(
                f"Largest contributors (a term within one group), {len(shown)} of {len(observation.ranked)}; "
                "scale: the term's share the residuals imply (positive: predicted too long); fixable pp: the "
                "throughput MAPE taking it out saves; at most pp: were each run's whole error in it:"
            )
            out.append(
                text_table(
                    ["#", "term", "group", "runs", "pred ms", "scale", "bias ms", "fixable pp", "at most pp"],
                    [
                        [
                            str(i),
                            LABELS[c.quantity],
                            c.where,
                            str(c.n_runs),
                            _ms(c.predicted_ms_mean),
                            _signed(100 * c.scale, "%"),
                            _ms(c.residual_ms_mean),
                            f"{c.fixable_mape_pp:.2f}",
                            f"{c.contribution_pp:.2f}",
                        ]
                        for i, c in enumerate(shown, start=1)
                    ],
                    right={0} | set(range(3, 9)),
                )
            )
            out.append("")
            out.append("Findings:")
            out += [f"{i}. {c.sentence()}" for i, c in enumerate(shown[:3], start=1)]
            out.append("")
        worst = sorted(observation.runs, key=lambda r: -abs(r.score.throughput_error_pct))[:top]
        out.append(f"Runs by |throughput error| ({len(worst)} of {len(observation.runs)}):")
        out.append(
            text_table(
                ["run", "tput err %", "steady err %", "real iter ms", "pred iter ms"],
                [
                    [
                        r.id,
                        f"{r.score.throughput_error_pct:+.1f}",
                        f"{r.score.steady_throughput_error_pct:+.1f}",
                        _ms(r.real_metrics.iteration_time_ms),
                        _ms(r.predicted_parts.iteration_ms if r.predicted_parts else None),
                    ]
                    for r in worst
                ],
                right={1, 2, 3, 4},
            )
        )
        return "\n".join(out)
    numbers = ["runs", "stages", "real ms", "pred ms", "resid ms", "resid", "MAPE pp", "steady pp"]
    out.append(
        "Over all runs: parts of the median iteration (ms, mean over runs) and per-microbatch stage times "
        "(mean over stages). MAPE pp = throughput MAPE removed if predicted exactly."
    )
    out.append(
        text_table(
            ["quantity"] + numbers, rows(observation.overall, lambda i, c: [LABELS[c.quantity]]), right=set(range(1, 9))
        )
    )
    out.append("")
    shown = observation.ranked[:top]
    out.append(f"Largest contributors (a quantity within one group), {len(shown)} of {len(observation.ranked)}:")
    out.append(
        text_table(
            ["#", "quantity", "group"] + numbers,
            rows(shown, lambda i, c: [str(i), LABELS[c.quantity], c.where]),
            right={0} | set(range(3, 11)),
        )
    )
    out.append("")
    out.append("Findings:")
    out += [f"{i}. {c.sentence()}" for i, c in enumerate(shown[:3], start=1)]
    out.append("")
    hops = observation.hops
    if hops:
        out.append(
            "Hops whose consumer waited (median ms): the gap from the producer's end to the consumer's start, "
            "in the traces and in the simulated timelines (the hop, the host work after the receive, waits)"
        )
        out.append(
            text_table(
                ["devices", "MiB", "hops", "runs", "real ms", "pred ms", "resid ms"],
                [
                    [
                        h.devices,
                        f"{h.mib:.2f}",
                        str(h.n_hops),
                        str(h.n_runs),
                        f"{h.real_ms:.2f}",
                        f"{h.predicted_ms:.2f}",
                        f"{h.residual_ms:+.2f}",
                    ]
                    for h in hops
                ],
                right=set(range(1, 7)),
            )
        )
        out.append("")
    slowest = observation.bottlenecks
    flagged = [b for b in slowest if b.misplaced or b.mispriced]
    out.append(
        f"Slowest stage (forward + backward per microbatch, which paces the steady state), {len(slowest)} runs: "
        f"put at another stage in {sum(b.misplaced for b in slowest)}, priced more than "
        f"{100 * BOTTLENECK_MARGIN:.0f} % off in {sum(b.mispriced for b in slowest)}"
    )
    if flagged:
        out.append(
            "(misplaced: the stage the model calls slowest is really more than "
            f"{100 * BOTTLENECK_MARGIN:.0f} % faster. A right throughput on these runs rests on errors that "
            "make up for each other; a what-if about those stages' devices inherits them)"
        )
    if flagged:
        out.append(
            text_table(
                ["run", "tput err %", "real slowest", "real ms", "its pred ms", "off", "pred slowest", "its real ms"],
                [
                    [
                        b.run_id,
                        f"{b.throughput_error_pct:+.1f}",
                        f"{b.real_stage} {b.real_device}",
                        _ms(b.real_ms),
                        _ms(b.predicted_ms_of_real),
                        _signed((b.predicted_ms_of_real / b.real_ms - 1) * 100, "%"),
                        f"{b.predicted_stage} {b.predicted_device}" + (" (misplaced)" if b.misplaced else ""),
                        _ms(b.real_ms_of_predicted),
                    ]
                    for b in flagged[:top]
                ],
                right={1, 3, 4, 5, 7},
            )
        )
    out.append("")
    worst = sorted(observation.runs, key=lambda r: -abs(r.score.throughput_error_pct))[:top]
    out.append(
        f"Runs by |throughput error| ({len(worst)} of {len(observation.runs)}); part residuals predicted - real in ms:"
    )

    def residual(run: RunRow, part: str) -> str:
        value = run.part_residual_ms(part)
        return f"{value:+.1f}" if value is not None else "-"

    out.append(
        text_table(
            ["run", "tput err %", "stalls +- %", "stall-free err %", "steady err %", "real iter ms", "pred iter ms"]
            + [LABELS[p] for p in PART_QUANTITIES],
            [
                [
                    r.id,
                    f"{r.score.throughput_error_pct:+.1f}",
                    f"{r.score.stall_noise_ape_pct:.1f}",
                    f"{r.stall_free_error_pct:+.1f}" if r.stall_free_error_pct is not None else "-",
                    f"{r.score.steady_throughput_error_pct:+.1f}",
                    _ms(
                        r.real_parts.iteration_ms
                        if r.real_parts
                        else None
                        if r.real_metrics.has_events
                        else r.real_metrics.iteration_time_ms
                    ),
                    _ms(r.predicted_parts.iteration_ms if r.predicted_parts else None),
                ]
                + [residual(r, p) for p in PART_QUANTITIES]
                for r in worst
            ],
            right=set(range(1, 11)),
        )
    )
    return "\n".join(out)
