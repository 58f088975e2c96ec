"""fctkit.export — ONNX export with parity checks, TensorRT engines, signed model bundles.

Importing this package needs neither torch nor onnx: the names below load their modules on
first use. Bundles: :func:`build_bundle` (the publishing gate), :func:`check_graphs_load`;
keys: :func:`generate_keys`, :func:`load_private_key`; ONNX: :func:`export_onnx`,
:func:`check_parity` (torch); the hubness-offset graph of a bundle: :func:`hubness_onnx` (onnx); TensorRT: :func:`build_engine`,
:func:`tensorrt_unavailable_reason`; every bundle role from trainer objects:
:func:`export_role` (torch); a whole `fctkit train` run as signed, versioned bundles:
:func:`export_release` / :func:`build_release` (torch), :func:`plan_release`; a
`fctkit train-compatible` run's BCT/BT²/CoReS models as "compatible" bundles:
:func:`export_compatible_release` (torch); an ONNX graph in int8 or fp16 (what
``fctkit export --quantize`` ships): :func:`quantize_graph` (onnx, onnxruntime).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ArtifactSource": "bundle_builder",
    "ArtifactSpec": "bundle_builder",
    "BundleSpec": "bundle_builder",
    "gate_from_report": "bundle_builder",
    "build_bundle": "bundle_builder",
    "check_graphs_load": "bundle_builder",
    "load_bundle_spec": "bundle_builder",
    "hubness_onnx": "hubness_graph",
    "generate_keys": "keys",
    "load_private_key": "keys",
    "save_private_key": "keys",
    "save_public_key": "keys",
    "read_passphrase": "keys",
    "ExportResult": "onnx_export",
    "InputSpec": "onnx_export",
    "ParityReport": "onnx_export",
    "export_onnx": "onnx_export",
    "check_parity": "onnx_export",
    "run_onnx": "onnx_export",
    "quantize_graph": "quantize",
    "EngineResult": "tensorrt",
    "TensorRTRunner": "tensorrt",
    "RoleExport": "roles",
    "export_role": "roles",
    "role_module": "roles",
    "write_role_table": "roles",
    "TrainedRun": "trained_run",
    "RolePlan": "release_plan",
    "VersionPlan": "release_plan",
    "ReleasedBundle": "release",
    "plan_release": "release_plan",
    "build_release": "release",
    "export_release": "release",
    "export_compatible_release": "compatible_release",
    "build_engine": "tensorrt",
    "check_engine_parity": "tensorrt",
    "tensorrt_unavailable_reason": "tensorrt",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
