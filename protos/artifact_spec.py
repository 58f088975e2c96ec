"""One artifact of a bundle: an ONNX file (:class:`Artifact`) and its tensors (:class:`TensorSpec`).

Artifact graphs take the embedding (or image) as their first input and, when they use it,
the side-info as their second; every tensor's first axis is the dynamic batch. A text graph's
sequence axes may be dynamic too (``None``); the manifest's preprocessing section says what
feeds them. A ``tokenizer`` artifact is a file, not a graph: no inputs, no outputs. ``fctkit.export``
names them ``image``/``old``/``new`` and ``side``, outputs ``embedding``/``side_info``/``sigma``;
the manifest records the exact names and dims, which ``fctkit bundle verify`` checks
against the graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fctkit.errors import BundleFormatError

from .bundle_vocabulary import (
    DTYPES,
    FILE_ROLES,
    HEX64,
    PRECISIONS,
    RESERVED_FILES,
    ROLES,
    SAFE_NAME,
    TRANSFORM_ROLES,
    Role,
)
from .strict_json import exact_keys, is_int, optional_int, typed


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output; ``None`` in ``shape`` marks a dynamic axis (the first always is:
    the batch)."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str

    def __post_init__(self) -> None:
        where = f"tensor {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise BundleFormatError(f"{where}: the name must be a non-empty string")
        if not isinstance(self.shape, tuple) or not self.shape:
            raise BundleFormatError(f"{where}: the shape must be a non-empty tuple, got {self.shape!r}")
        if self.shape[0] is not None:
            raise BundleFormatError(
                f"{where}: the first axis must be the dynamic batch axis (None), got {self.shape!r}"
            )
        if not all(d is None or (is_int(d) and d > 0) for d in self.shape[1:]):
            raise BundleFormatError(
                f"{where}: every axis after the batch must be a positive integer or dynamic, got {self.shape!r}"
            )
        if self.dtype not in DTYPES:
            raise BundleFormatError(f"{where}: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")

    @property
    def feature_dim(self) -> int:
        """The size of the last axis (the embedding / side-info dimension for 2-D tensors)."""
        if len(self.shape) <= 1:
            return 1
        last = self.shape[-1]
        if last is None:
            raise BundleFormatError(f"tensor {self.name!r}: its last axis is dynamic, so it has no feature dim")
        return int(last)

    @property
    def dynamic(self) -> bool:
        """Whether an axis after the batch is dynamic."""
        return any(d is None for d in self.shape[1:])

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: Any, where: str) -> TensorSpec:
        data = exact_keys(data, ("name", "shape", "dtype"), where)
        shape = typed(data["shape"], list, f"{where}.shape")
        for i, dim in enumerate(shape):
            if dim is not None and not is_int(dim):
                raise BundleFormatError(f"{where}.shape[{i}]: expected an integer or null, got {dim!r}")
        return cls(
            name=typed(data["name"], str, f"{where}.name"),
            shape=tuple(shape),
            dtype=typed(data["dtype"], str, f"{where}.dtype"),
        )


@dataclass(frozen=True)
class Artifact:
    """One ONNX file of a bundle and what it computes."""

    name: str
    role: Role
    file: str
    sha256: str
    size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    source_version: int | None
    target_version: int | None
    precision: str = "fp32"

    def __post_init__(self) -> None:
        where = f"artifact {self.name!r}"
        if not isinstance(self.name, str) or not SAFE_NAME.fullmatch(self.name):
            raise BundleFormatError(f"{where}: names use letters, digits, '.', '_' and '-' (at most 100)")
        if self.role not in ROLES:
            raise BundleFormatError(f"{where}: role {self.role!r} is not one of {', '.join(ROLES)}")
        if not isinstance(self.file, str) or not SAFE_NAME.fullmatch(self.file) or self.file in RESERVED_FILES:
            raise BundleFormatError(
                f"{where}: file {self.file!r} must be a plain file name inside the bundle "
                f"(no folders, no '..', not {' or '.join(RESERVED_FILES)})"
            )
        if not isinstance(self.sha256, str) or not HEX64.fullmatch(self.sha256):
            raise BundleFormatError(f"{where}: sha256 must be 64 lowercase hex digits")
        if not is_int(self.size) or self.size <= 0:
            raise BundleFormatError(f"{where}: size must be a positive integer, got {self.size!r}")
        for kind, specs in (("inputs", self.inputs), ("outputs", self.outputs)):
            if self.is_file and specs != ():
                raise BundleFormatError(f"{where}: a {self.role} artifact is a file, not a graph: it has no {kind}")
            if not self.is_file and (
                not isinstance(specs, tuple) or not specs or not all(isinstance(s, TensorSpec) for s in specs)
            ):
                raise BundleFormatError(f"{where}: {kind} must be a non-empty tuple of TensorSpec")
            names = [s.name for s in specs]
            if len(set(names)) != len(names):
                raise BundleFormatError(f"{where}: duplicate {kind} names {names}")
        if self.precision not in PRECISIONS or (self.is_file and self.precision != PRECISIONS[0]):
            allowed = PRECISIONS[:1] if self.is_file else PRECISIONS  # a file keeps the default: one canonical form
            raise BundleFormatError(f"{where}: precision {self.precision!r} is not one of {', '.join(allowed)}")
        for field in ("source_version", "target_version"):
            value = getattr(self, field)
            if self.role in TRANSFORM_ROLES:
                if not is_int(value) or value <= 0:
                    raise BundleFormatError(f"{where}: a {self.role} artifact needs a positive integer {field}")
            elif value is not None:
                raise BundleFormatError(f"{where}: a {self.role} artifact has no {field} (got {value!r})")
        if self.role in TRANSFORM_ROLES and self.source_version == self.target_version:
            raise BundleFormatError(f"{where}: source_version and target_version are both {self.source_version}")

    @property
    def is_file(self) -> bool:
        """A file the preprocessing reads (a tokenizer), not an ONNX graph."""
        return self.role in FILE_ROLES

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "role": self.role,
            "file": self.file,
            "sha256": self.sha256,
            "size": self.size,
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [s.to_json() for s in self.outputs],
            "source_version": self.source_version,
            "target_version": self.target_version,
            "precision": self.precision,
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> Artifact:
        keys = (
            "name",
            "role",
            "file",
            "sha256",
            "size",
            "inputs",
            "outputs",
            "source_version",
            "target_version",
            "precision",
        )
        data = exact_keys(data, keys, where)
        return cls(
            name=typed(data["name"], str, f"{where}.name"),
            role=typed(data["role"], str, f"{where}.role"),
            file=typed(data["file"], str, f"{where}.file"),
            sha256=typed(data["sha256"], str, f"{where}.sha256"),
            size=typed(data["size"], int, f"{where}.size"),
            inputs=tuple(
                TensorSpec.from_json(s, f"{where}.inputs[{i}]")
                for i, s in enumerate(typed(data["inputs"], list, f"{where}.inputs"))
            ),
            outputs=tuple(
                TensorSpec.from_json(s, f"{where}.outputs[{i}]")
                for i, s in enumerate(typed(data["outputs"], list, f"{where}.outputs"))
            ),
            source_version=optional_int(data["source_version"], f"{where}.source_version"),
            target_version=optional_int(data["target_version"], f"{where}.target_version"),
            precision=typed(data["precision"], str, f"{where}.precision"),
        )
