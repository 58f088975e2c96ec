"""fctkit — on-device deployment kit for forward compatible training (FCT).

Parts (each its own subpackage with a small public API):

- ``fctkit.trainer``      datasets, backbones, side-info models, adapters, evaluation, reports
- ``fctkit.export``       ONNX export with parity checks, TensorRT engines, signed bundles
- ``fctkit.protos``       wire formats: gRPC messages and services, the bundle manifest
- ``fctkit.server``       the gRPC server: registry, artifact streaming, encrypted vault, fleet
- ``fctkit.edge_runtime`` the on-device library (no torch): engines, encrypted gallery, sync, upgrade

This root module offers the exception hierarchy (:mod:`fctkit.errors`) and the version.
"""

from __future__ import annotations

from fctkit._environment import warn_on_conflicting_onnxruntime
from fctkit.errors import FctkitError

__version__ = "0.1.0"
__all__ = ["FctkitError", "__version__"]

warn_on_conflicting_onnxruntime()
