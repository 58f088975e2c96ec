"""The names of the adapter methods a `fctkit train` run can fit, how reports label them, and
which of them an instance-level task and a query map use (no torch, no fitting)."""

from __future__ import annotations

from typing import Literal

ForwardMethod = Literal["fct", "fct-no-side-info", "fastfill", "residual", "least-squares", "procrustes"]
UnifiedMethod = Literal["lambda-orth", "lambda-orth-relaxed"]

METHOD_LABELS = {
    "fct": "FCT, side-info ψ",
    "fct-no-side-info": "FCT, no side-info",
    "fastfill": "FastFill, side-info ψ",
    "residual": "residual adapter",
    "least-squares": "least squares",
    "procrustes": "Procrustes",
    "lambda-orth": "λ-orth, B⊥",
    "lambda-orth-relaxed": "λ-orth, B_λ",
}


# What `methods = []` (the default) means: every method for class-level data; for an
# instance-level task the one the README recommends (the residual adapter, InfoNCE) and the
# closed-form baseline for the report. FCT's BatchNorm MLP and λ-orth fail ECC there (README,
# "Instance-level search") and cost most of a run's time: they run only when named.
INSTANCE_METHODS = ("residual", "least-squares")


QUERY_MAP_METHODS = ("residual", "fct", "fct-no-side-info")

# A variant's further training on the task's (query, positive) pairs: with a learned query map,
# or with the new model's queries as they are.
JOINT_FITS = ("query-map", "query-positives")


def method_label(method: str) -> str:
    base, *extras = method.split("+")
    names = {
        "query-map": " + query map",
        "query-positives": " + query positives",
        "transition": " + transition scoring",
        "hubness": " + hubness offset",
    }
    return METHOD_LABELS[base] + "".join(names[e] for e in extras)


def joint_fit_of(variant: str) -> str | None:
    """The joint fit a variant key (``residual+query-map+hubness``) names, if any."""
    return next((part for part in variant.split("+")[1:] if part in JOINT_FITS), None)
