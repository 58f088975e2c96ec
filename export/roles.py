"""Export every bundle role from the trainer's objects, each with its parity check.

=============  ==========================================  ==================  ============
role           trainer object                              graph inputs        output
=============  ==========================================  ==================  ============
embed          ``Backbone`` (any embedding ``nn.Module``)  ``image``           ``embedding``
side_info      ``SideInfoModel``                           ``image``           ``side_info``
forward        ``FCTAdapter``/``FastFillAdapter`` h,        ``old`` [, ``side``] ``embedding``
               ``ResidualAdapter``, ``ClosedFormAdapter``,
               ``LambdaOrthAdapter`` F
side_forward   ``FCTAdapter`` g (``d_out`` = new ψ dim)     ``old`` [, ``side``] ``side_info``
backward       ``LambdaOrthAdapter`` B (materialised)       ``new``             ``embedding``
uncertainty    ``FastFillAdapter`` σ                       ``old`` [, ``side``] ``sigma`` (N,)
query_map      ``QueryMap`` Q (the version's own queries)  ``new``             ``embedding``
=============  ==========================================  ==================  ============

Inputs come first the embedding (or image), then the side-info; the manifest records the
exact names and dims. λ-orth's B⊥ = expm(U − Uᵀ) is materialised into one plain matrix
(``matrix_exp`` does not export); every module is exported in eval mode with BatchNorm folded.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fctkit.errors import InputError, require
from fctkit.protos.bundle import ROLES, TRANSFORM_ROLES, Role

from .bundle_builder import ArtifactSource
from .onnx_export import ExportResult, InputSpec, ParityReport, check_parity, export_onnx

OUTPUT_NAMES: dict[str, str] = {
    "embed": "embedding",
    "side_info": "side_info",
    "forward": "embedding",
    "side_forward": "side_info",
    "backward": "embedding",
    "uncertainty": "sigma",
    "query_map": "embedding",
}


@dataclass(frozen=True)
class RoleExport:
    """One exported role: the ONNX file, its parity report, and its bundle entry."""

    role: Role
    export: ExportResult
    parity: ParityReport
    source_version: int | None = None
    target_version: int | None = None
    #: a team's graph fed raw items: its preprocessing declaration (fctkit.protos.preprocessing_spec)
    #: and, for text, its tokenizer.json
    declaration: Any = None
    tokenizer: Path | None = None

    @property
    def artifact(self) -> ArtifactSource:
        """The :class:`ArtifactSource` to hand to :func:`~fctkit.export.bundle_builder.build_bundle`."""
        return ArtifactSource(self.export.path, self.role, self.source_version, self.target_version)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly row for reports: file, opset, size, export time, parity."""
        return {
            "role": self.role,
            "file": self.export.path.name,
            "source_version": self.source_version,
            "target_version": self.target_version,
            "precision": self.export.precision,
            "opset": self.export.opset,
            "inputs": {s.name: list(s.shape) for s in self.export.inputs},
            "outputs": {s.name: list(s.shape) for s in self.export.outputs},
            "size_bytes": self.export.size_bytes,
            "export_seconds": round(self.export.export_seconds, 3),
            "parity_max_abs_error": self.parity.max_abs_error,
            "parity_tolerance": self.parity.tolerance,
            "parity_per_batch": dict(self.parity.per_batch),
        }


def role_module(role: str, trained: Any) -> tuple[Any, tuple[str, ...]]:
    """The exportable ``nn.Module`` for ``role`` from a trainer object, and its input names."""
    if role not in ROLES:
        raise InputError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    kind = getattr(trained, "kind", None)
    if role in ("embed", "side_info"):
        return trained, ("image",)
    if role in ("forward", "side_forward") and kind in ("fct", "fastfill"):
        return trained, tuple(trained.input_names)
    if role == "forward" and kind == "residual":
        return trained, tuple(trained.input_names)
    if role == "forward" and kind == "closed_form":
        return trained.as_linear(), ("old",)
    if role == "forward" and kind == "lambda_orth":
        return trained.forward_module(), ("old",)
    if role == "backward" and kind == "lambda_orth":
        return trained.materialized_backward(), ("new",)
    if role == "uncertainty" and kind == "fastfill":
        return trained.uncertainty_module(), tuple(trained.input_names)
    if role == "query_map" and kind == "query_map":
        return trained, ("new",)
    raise InputError(
        f"a {type(trained).__name__} (kind {kind!r}) cannot be exported as role {role!r}: forward takes FCT/FastFill/residual/"
        "closed-form/λ-orth adapters, side_forward FCT/FastFill, backward λ-orth, uncertainty FastFill, query_map QueryMap"
    )


def export_role(
    role: Role,
    trained: Any,
    path: str | os.PathLike[str],
    real_inputs: Sequence[np.ndarray],
    *,
    source_version: int | None = None,
    target_version: int | None = None,
    fp16: bool = False,
    opset: int | None = None,
) -> RoleExport:
    """Export ``trained`` as ``role`` to ``path`` and check parity on the held-out real batch
    ``real_inputs`` (one array per graph input: images for embed/side_info, embeddings and
    side-info for adapters) plus random batches of 1, 7 and 1000 rows.

    Transformation roles need ``source_version`` and ``target_version`` (the hop they map).
    Raises :class:`~fctkit.errors.ExportError` when export or parity fails."""
    module, input_names = role_module(role, trained)
    if role in TRANSFORM_ROLES and (source_version is None or target_version is None):
        raise InputError(f"role {role!r} maps one version to another: pass source_version= and target_version=")
    if role not in TRANSFORM_ROLES and (source_version is not None or target_version is not None):
        raise InputError(f"role {role!r} belongs to one version: it takes no source_version/target_version")
    real = [np.asarray(a, dtype=np.float32) for a in real_inputs]
    if len(real) != len(input_names):
        raise InputError(
            f"role {role!r} of this {type(trained).__name__} takes {len(input_names)} input(s) {input_names}, "
            f"got {len(real)} real array(s)"
        )
    module = _on_cpu(module)
    specs = [InputSpec(name, tuple(int(d) for d in array.shape[1:])) for name, array in zip(input_names, real)]
    result = export_onnx(module, specs, [OUTPUT_NAMES[role]], path, opset=opset, fp16=fp16)
    parity = check_parity(module, result.path, real)
    return RoleExport(role, result, parity, source_version, target_version)


def _on_cpu(module: Any) -> Any:
    """The module itself when it lives on the CPU, else a CPU copy (export traces on CPU)."""
    torch = require("torch", "train")
    if all(p.device.type == "cpu" for p in module.parameters()):
        return module
    return copy.deepcopy(module).to(torch.device("cpu"))


def write_role_table(exports: Sequence[RoleExport], path: str | os.PathLike[str]) -> Path:
    """A markdown table of the exports (role, opset, size, export time, parity) for reports."""
    path = Path(path)
    lines = [
        "| role | hop | precision | opset | size (KiB) | export (s) | parity max abs err | tolerance |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for e in exports:
        hop = f"v{e.source_version}→v{e.target_version}" if e.source_version is not None else ""
        lines.append(
            f"| {e.role} | {hop} | {e.export.precision} | {e.export.opset} | {e.export.size_bytes / 1024:.1f} | "
            f"{e.export.export_seconds:.2f} | {e.parity.max_abs_error:.2e} | {e.parity.tolerance:.1e} |"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


__all__ = ["OUTPUT_NAMES", "RoleExport", "export_role", "role_module", "write_role_table"]
