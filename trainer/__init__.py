"""fctkit.trainer — server-side training and evaluation.

The evaluation core (:mod:`fctkit.trainer.evaluation`, :mod:`fctkit.trainer.report`) needs
numpy only; everything that trains needs the ``train`` extra (torch).
"""

from .evaluation import (
    BackfillCurve,
    CompatibilityMatrix,
    Distance,
    QueryRanks,
    RetrievalResult,
    backfill_curve,
    compatibility_matrix,
    ecc,
    evaluate_retrieval,
    metric_value,
    pairwise_distances,
    rank_queries,
    summarize,
)
from .report import Case, Report, Verdict

__all__ = [
    "BackfillCurve",
    "Case",
    "CompatibilityMatrix",
    "Distance",
    "QueryRanks",
    "Report",
    "RetrievalResult",
    "Verdict",
    "backfill_curve",
    "compatibility_matrix",
    "ecc",
    "evaluate_retrieval",
    "metric_value",
    "pairwise_distances",
    "rank_queries",
    "summarize",
]
