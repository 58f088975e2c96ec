"""A gate where only transition scoring holds says why in one line, in the report and at export."""

from __future__ import annotations

import pytest

from fctkit.errors import GateError
from fctkit.trainer.gate_advice import transition_only_advice


def gate(residual: float, transition: float, old: float = 0.27, new: float = 0.30) -> dict:
    cases = {
        "old/old": {"recall@1": old},
        "new/new": {"recall@1": new},
        "residual": {"recall@1": residual},
        "residual+hubness": {"recall@1": residual - 0.01},
        "residual+transition": {"recall@1": transition},
    }
    ecc = {name: cases[name]["recall@1"] > old for name in cases if name not in ("old/old", "new/new")}
    return {"metric": "recall@1", "cases": cases, "ecc": ecc}


def test_it_names_the_best_failing_variant_the_holding_one_and_the_likely_causes():
    line = transition_only_advice(gate(0.2325, 0.3075), train_pairs=2000, input_dims=2560)
    assert line is not None and "\n" not in line
    assert "every gallery-side variant fails ECC (best: residual, R@1 0.2325 vs old/old 0.2700)" in line
    assert "transition scoring holds (residual+transition, 0.3075)" in line
    assert "too few training pairs for the input size (2,000 pairs for 2,560 input dims)" in line
    assert "a new model little or no better than the old one on this task (new/new 0.3000 vs old/old 0.2700)" in line
    assert "Try: more training pairs" in line and "publish 'residual+transition'" in line


def test_causes_it_cannot_see_are_not_claimed():
    line = transition_only_advice(gate(0.25, 0.6, old=0.27, new=0.8), train_pairs=20000, input_dims=768)
    assert line is not None
    assert "too few training pairs" not in line and "better than the old one" not in line
    assert "an old model whose rows hold too little" in line


@pytest.mark.parametrize(
    "case",
    [gate(0.28, 0.31), gate(0.2, 0.26)],  # a gallery-side variant holds; nothing holds
)
def test_no_advice_when_a_gallery_side_variant_holds_or_nothing_does(case):
    assert transition_only_advice(case, train_pairs=2000, input_dims=2560) is None


def test_the_export_refusal_carries_the_runs_advice():
    from fctkit.export.release import _check_gates
    from fctkit.export.release_plan import RolePlan, VersionPlan

    forward = RolePlan("forward", "adapters/residual.pt", ("old", "side"), source_version=1, target_version=2)
    plan = VersionPlan(2, (1,), "forward", (forward,), gate={"ecc": {forward.name: False}})
    with pytest.raises(GateError, match=r"Why: every gallery-side variant fails ECC"):
        _check_gates([plan], force=False, advice="every gallery-side variant fails ECC (…)")
    _check_gates([plan], force=True, advice="every gallery-side variant fails ECC (…)")  # overridden on the record
