"""observe says which parameter to change (issue #31): within a contributor the parameters are ranked by the share
of its residual that moving each alone could remove (the pricing nudge, taken as linear), and the first is marked
suggested, with the value that removes it. On the shipped CPU store and model, what an agent starts from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hops_calib.loop.model_files import load_model, write_model
from hops_calib.model import resolve_params
from hops_calib.research.observe import observe

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def observation():
    return observe(REPO / "fixtures")


def _member_residuals(observation, contributor) -> np.ndarray:
    runs = {r.id: r for r in observation.runs}
    out = []
    for run_id, stage in contributor.members:
        run = runs[run_id]
        if stage is None:
            out.append(run.part_residual_ms(contributor.quantity))
        else:
            row = next(s for s in run.stages if s.stage == stage)
            out.append(row.predicted(contributor.quantity) - row.real(contributor.quantity))
    return np.array(out, dtype=float)


def test_each_contributors_parameters_are_ranked_and_the_first_is_suggested(observation):
    ranked = [c for c in observation.ranked if c.terms and c.level in ("run", "stage")]
    assert ranked
    for c in ranked:
        applying = [t for t in c.terms if t["applies"]]
        assert list(c.terms[:len(applying)]) == applying  # the applying parameters first, by the share they remove
        shares = [t["removable_share"] for t in applying]
        assert shares == sorted(shares, reverse=True) and all(0.0 <= s <= 1.0 + 1e-12 for s in shares)
        suggested = [t for t in c.terms if t["suggested"]]
        assert len(suggested) <= 1
        if suggested:
            first = suggested[0]
            assert first["applies"] and first["removable_share"] > 0
            # the first that does not run into a bound (else the first of all)
            assert first is next((t for t in applying if t["removable_share"] > 0 and not t["at_bound"]),
                                 applying[0])
            data = c.to_dict()
            assert data["suggested_parameter"] == f"{first['term']}.{first['param']}"
            assert f"suggested: {first['direction']} {first['term']}.{first['param']}" in data["sentence"]
        # the residuals the ranking is computed on are the members' own
        assert np.allclose(c.residuals, _member_residuals(observation, c))


def test_setting_the_suggested_value_removes_the_residual_it_says(observation, tmp_path):
    top = next(c for c in observation.ranked if c.suggested() is not None and c.level in ("run", "stage"))
    first = top.suggested()
    assert first["suggested_value"] is not None and first["removable_share"] > 0.05
    model = load_model(observation.model_path)
    active = next(t for t in model.terms if t.name == first["term"])
    changed = model.with_term(resolve_params(first["term"], {first["param"]: first["suggested_value"]},
                                             origin="test", base=active.params(),
                                             device_types={d.type for d in model.devices}))
    path = tmp_path / "suggested.toml"
    write_model(path, changed)
    after = observe(REPO / "fixtures", model_path=path, with_terms=False)
    before_r = np.array(top.residuals)
    after_r = _member_residuals(after, top)
    removed = 1.0 - float(after_r @ after_r) / float(before_r @ before_r)
    # the move is linear only near the nudge: the share removed is the suggestion's, give or take a third of it
    assert removed > 0 and removed == pytest.approx(first["removable_share"], rel=0.35), (first, removed)
