"""What `decompose` prints for people, from a `Decomposition` (`hops_calib.research.decompose`)."""

from __future__ import annotations

from hops_calib.cli.render.tables import text_table
from hops_calib.research.decompose import FORM_TOLERANCE_PCT, Decomposition


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def decomposition_text(result: Decomposition) -> str:
    out = [
        f"decompose (model {result.model_sha256[:12]}): per family of runs alike but for layers L, global batch, d "
        "and micro batch, T = a(d) + b(d) L + (m + p - 1) (c + x L / p) (1F1B: m microbatches, p stages); x is one "
        "layer's forward and backward per microbatch "
        "(its recomputed forward where the launch recomputes), c a microbatch's work outside the layers; ms"
    ]
    if not result.iteration_runs:
        out.append(
            "the store's train split has no runs measured at iteration level (runs with events: `observe` compares "
            "their stages and iteration parts directly)"
        )
    elif not result.families:
        out.append("no family of runs measured at iteration level has the runs to identify its terms")
    else:
        parts = result.error_by_part()
        out.append(
            f"the model's iteration-time error by part, over the {result.decomposed_runs} decomposed runs (mean of "
            "predicted minus measured, % of the measured iteration; negative: too fast there): "
            + ", ".join(f"{part} {parts[part]:+.1f} %" for part in ("layers", "microbatch", "iteration"))
            + f"; together {sum(parts.values()):+.1f} %; what the form misses averages out, "
            f"{result.outside_form_abs_pct():.1f} % of a run in absolute value"
        )
    for family in result.families:
        out += [
            "",
            f"{family.label}: {family.runs} runs, {'recomputes' if family.recomputes else 'no recomputation'}; "
            f"measured runs depart from the form by at most {family.residual_max_pct:.3f} % (predicted "
            f"{family.predicted_residual_max_pct:.3f} %)"
            + (
                ""
                if family.form_holds
                else f": more than {FORM_TOLERANCE_PCT:g} %, so the form does not hold here "
                "and its layer and microbatch times are not those of one layer and one microbatch"
            ),
        ]
        rows = [
            [
                str(row.micro_batch) + ("" if row.physical else " !"),
                str(row.runs),
                f"{row.layer_ms:.2f}",
                f"{row.predicted_layer_ms:.2f}",
                f"{row.layer_error_pct:+.1f}",
                f"{row.microbatch_ms:.2f}",
                f"{row.predicted_microbatch_ms:.2f}",
                _ms(row.bound_without_recompute_ms),
                _ms(row.bound_with_recompute_ms),
                "-" if row.over_recompute_bound is None else f"{row.over_recompute_bound:.2f}",
            ]
            for row in family.rows
        ]
        out.append(
            text_table(
                [
                    "mb",
                    "runs",
                    "layer",
                    "predicted",
                    "error %",
                    "microbatch",
                    "predicted",
                    "bound",
                    "bound+rc",
                    "layer/bound+rc",
                ],
                rows,
                right=set(range(10)),
            )
        )
    if result.inversions:
        out += [
            "",
            f"inversions: {len(result.inversions)} pairs of cells where the measured layer takes more than "
            f"{FORM_TOLERANCE_PCT:g} % less time with more work (a larger micro batch, or a larger hidden size at the "
            "same micro batch). The same kernels with more FLOPs and bytes cannot, unless the work takes another "
            "path (the fused softmax's fallback, a cuBLAS kernel chosen by shape). followed: the model's predicted "
            f"layers invert there too, by more than {FORM_TOLERANCE_PCT:g} %: it has such a path. "
            f"{result.inverted_runs()} of the {result.iteration_runs} runs lie in a cell of an inversion, "
            f"{result.inverted_runs(followed=False)} in a cell of one the model does not follow (a cell in both "
            "kinds counts in both): there the source is noisy or the model lacks a mechanism, and a model without "
            "one errs on one cell of the pair by about the gap",
            text_table(
                ["less work", "layer ms", "more work", "layer ms", "what grows", "faster %", "model %", "followed"],
                [
                    [
                        f"{i.less.family} mb{i.less.micro_batch}",
                        f"{i.less.layer_ms:.2f}",
                        f"{i.more.family} mb{i.more.micro_batch}",
                        f"{i.more.layer_ms:.2f}",
                        i.why,
                        f"{i.shortfall_pct:.1f}",
                        f"{i.predicted_shortfall_pct:+.1f}",
                        "yes" if i.followed else "no",
                    ]
                    for i in result.inversions
                ],
                right={1, 3, 5, 6},
            ),
            "faster %: how much less time the cell with more work takes, measured; model %: the same of the "
            "predicted layers (negative: the model has it slower, as the work would)",
        ]
    if any(not row.physical for family in result.families for row in family.rows):
        out += ["", "!: a fitted time below zero: the family's runs of that micro batch do not pin it (read neither)"]
    if result.not_identified:
        out += ["", "not identified (the runs do not separate the form's terms): " + "; ".join(result.not_identified)]
    out += [
        "",
        "layer, microbatch: fitted ms, measured and predicted; error %: predicted minus measured over measured, of a "
        "time (negative: the model too fast; evaluate's throughput error has the other sign); aN in a family's name: "
        "N attention heads. "
        "bound: the layer's kernels each at the datasheet's peak FLOP/s or bandwidth, no launch gap, collectives "
        "free (without / with a recomputed forward); a measured layer at or under bound+rc (layer/bound+rc <= 1) "
        "cannot have recomputed. A family whose measured runs fit the form to within hundredths of a percent was "
        "composed from per-component timings (repeats of a real run differ by about a percent).",
    ]
    return "\n".join(out)
