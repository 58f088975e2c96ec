"""fctkit.trainer — server-side training and evaluation.

The evaluation core (:mod:`fctkit.trainer.evaluation` and its parts beside it: relevance,
ranking, retrieval_result, compatibility, backfill_curves; :mod:`fctkit.trainer.report`) needs
numpy only; everything that trains needs the ``train`` extra (torch).
"""

from typing import Any

from fctkit.backfill_order import ORDERING_KINDS, backfill_order

from .backfill_curves import BackfillCurve, backfill_curve
from .cka import linear_cka
from .compatibility import CompatibilityMatrix, compatibility_matrix, ecc
from .datasets import (
    FeatureSet,
    ImageDataset,
    Splits,
    class_subset,
    load_dataset,
    load_feature_versions,
    load_features,
    make_splits,
    old_class_subset,
    save_features,
)
from .evaluation import QueryRanks, evaluate_retrieval, rank_queries, summarize
from .evaluation_inputs import Distance
from .ranking import pairwise_distances
from .relevance import Positives
from .report import Case, Report, Verdict
from .retrieval_result import RetrievalResult, metric_value
from .synthetic import synthetic_instance_task
from .tasks import RetrievalTask, TaskSet, TaskSplit, load_task, save_task

# Names that need torch, imported on first access so `import fctkit.trainer` stays torch-free.
_LAZY: dict[str, str] = {
    "BackboneConfig": "backbones",
    "Backbone": "backbones",
    "CosineClassifier": "backbones",
    "train_backbone": "backbones",
    "extract_features": "backbones",
    "save_backbone": "backbones",
    "load_backbone": "backbones",
    "SideInfoConfig": "side_info",
    "SideInfoModel": "side_info",
    "train_side_info": "side_info",
    "extract_side_info": "side_info",
    "save_side_info": "side_info",
    "load_side_info": "side_info",
    "Adapter": "adapter_base",
    "adapter_kinds": "adapter_base",
    "load_adapter": "adapter_base",
    "FCTAdapter": "adapters",
    "FCTConfig": "adapters",
    "FastFillAdapter": "adapters",
    "FastFillConfig": "adapters",
    "LambdaOrthAdapter": "lambda_orth",
    "LambdaOrthConfig": "lambda_orth",
    "ClosedFormAdapter": "closed_form",
    "ClosedFormConfig": "closed_form",
    "ResidualAdapter": "residual",
    "ResidualConfig": "residual",
    "ObjectiveConfig": "losses",
    "QueryMap": "query_map",
    "QueryMapConfig": "query_map",
    "QueryPositivesConfig": "query_map",
    "fit_jointly": "query_map",
    "CompatibleConfig": "compatible_config",
    "BCTConfig": "compatible_config",
    "BT2Config": "compatible_config",
    "CoReSConfig": "compatible_config",
    "BT2Backbone": "compatible_models",
    "simplex_vertices": "compatible_models",
    "cores_backbone": "compatible_models",
    "load_compatible_config": "compatible_config",
    "load_compatible_model": "compatible_models",
    "save_compatible_model": "compatible_models",
    "run_compatible": "compatible_comparison",
    "resolve_device": "torch_utils",
    "set_seed": "torch_utils",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    *_LAZY,
    "FeatureSet",
    "ImageDataset",
    "Positives",
    "RetrievalTask",
    "TaskSet",
    "TaskSplit",
    "load_task",
    "save_task",
    "synthetic_instance_task",
    "Splits",
    "class_subset",
    "load_dataset",
    "load_feature_versions",
    "load_features",
    "make_splits",
    "old_class_subset",
    "save_features",
    "linear_cka",
    "ORDERING_KINDS",
    "backfill_order",
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
