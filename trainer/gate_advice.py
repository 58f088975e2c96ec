"""One line that says why a run's gate failed where only transition scoring holds, and what to try.

A gallery-side adapter must beat not upgrading (ECC) on its own; transition scoring also keeps
the old model's scores. When every gallery-side variant fails and a transition variant holds, the
adapters could not carry the old rows into the new space well enough, and the likely causes are
ones the run can see: too few training pairs for the adapter's input size, or a new model that is
no better than the old one on this task.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .retrieval_result import metric_label

# Fewer training pairs than this many per input dimension: the least-squares start (and the MLP
# on top of it) is fitted on too little data for its inputs (measured: 2,000 photo pairs for
# Lite0 + Lite1's 2,560 input dims failed ECC at batch 1,024).
PAIRS_PER_INPUT_DIM = 2.0
# A new model within this factor of the old one on the task leaves an adapter little to gain
# (the photo case above: new/new 0.30 against old/old 0.27).
LITTLE_BETTER = 1.15


def transition_only_advice(gate: Mapping[str, Any], train_pairs: int, input_dims: int) -> str | None:
    """The line, or None when a gallery-side variant holds ECC or no transition variant does."""
    verdicts: Mapping[str, bool] = gate["ecc"]
    gallery_side = {k: ok for k, ok in verdicts.items() if "transition" not in k.split("+")}
    transition = {k: ok for k, ok in verdicts.items() if "transition" in k.split("+")}
    if not gallery_side or any(gallery_side.values()) or not any(transition.values()):
        return None
    metric, cases = gate["metric"], gate["cases"]
    label = metric_label(metric)
    best = max(gallery_side, key=lambda k: cases[k][metric])
    held = max((k for k, ok in transition.items() if ok), key=lambda k: cases[k][metric])
    old, new = cases["old/old"][metric], cases["new/new"][metric]
    causes = []
    if train_pairs < PAIRS_PER_INPUT_DIM * input_dims:
        causes.append(
            f"too few training pairs for the input size ({train_pairs:,} pairs for {input_dims:,} input dims)"
        )
    if new <= old * LITTLE_BETTER:
        causes.append(
            f"a new model little or no better than the old one on this task (new/new {new:.4f} vs old/old {old:.4f})"
        )
    if not causes:
        causes.append("an old model whose rows hold too little of what the new model ranks by")
    return (
        f"every gallery-side variant fails ECC (best: {best}, {label} {cases[best][metric]:.4f} vs old/old "
        f"{old:.4f}) while transition scoring holds ({held}, {cases[held][metric]:.4f}); likely cause: "
        f"{'; or '.join(causes)}. Try: more training pairs, selection.ridges = [0.001, 0.1, 1.0] (a stronger "
        f"least-squares start), or publish '{held}' while devices keep the old model"
    )
