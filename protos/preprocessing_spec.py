"""The preprocessing a bundle declares for its ``embed`` and ``side_info`` graphs: how a device
turns a raw item (an image file, a text) into the graph's inputs and the graph's output into
the item's vector. A section of the signed manifest, versioned by its ``format``; a bundle
without it takes arrays as they are (the kit's own graphs).

- :class:`ImagePreprocessing` — decode a JPEG/PNG, convert to ``mode`` (RGB, BGR: RGB with the
  channels reversed, L: grey), resize the shorter side to ``resize`` (0: keep), centre-crop to
  ``crop`` (H, W), multiply by ``scale``, subtract ``mean`` and divide by ``std`` per channel,
  lay out as NCHW or NHWC.
- :class:`TextPreprocessing` — tokenise with the bundle's ``tokenizer`` artifact (a
  ``tokenizer.json``), ``query_prefix`` / ``passage_prefix`` first; at most ``max_length``
  tokens (``overflow``: truncate or refuse the text); pad to the longest text of a batch or to
  ``max_length``; feed the named graph inputs; pool the named ``output`` over the attention
  mask (``mean``), take its first token (``cls``) or take it as it is (``none``); L2-normalise.

The rules here check a declaration against the artifacts it feeds (:func:`check_preprocessing`);
:mod:`fctkit.protos.preprocessing` applies it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, Literal

from fctkit.errors import BundleFormatError

from .artifact_spec import Artifact, TensorSpec
from .strict_json import exact_keys, is_int, is_number, typed

FORMAT = "fctkit-preprocessing/1"
PREPROCESSED_ROLES = ("embed", "side_info")
IMAGE_MODES = {"RGB": 3, "BGR": 3, "L": 1}
LAYOUTS = ("NCHW", "NHWC")
RESAMPLING = ("nearest", "bilinear", "bicubic", "lanczos")
OVERFLOWS = ("truncate", "refuse")
PADDINGS = ("longest", "max_length")
POOLINGS = ("mean", "cls", "none")
ID_DTYPES = ("int64", "int32")


def _fail(where: str, message: str) -> BundleFormatError:
    return BundleFormatError(f"{where}: {message}")


def _choice(value: Any, allowed: tuple[str, ...] | Mapping[str, int], where: str) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise _fail(where, f"{value!r} is not one of {', '.join(allowed)}")
    return value


def _floats(value: Any, where: str) -> tuple[float, ...]:
    items = typed(value, list, where)
    if not items or not all(is_number(v) for v in items):
        raise _fail(where, f"expected a non-empty list of finite numbers, got {value!r:.80}")
    return tuple(float(v) for v in items)


@dataclass(frozen=True)
class ImagePreprocessing:
    input: str
    crop: tuple[int, int]
    mode: Literal["RGB", "BGR", "L"] = "RGB"
    resize: int = 0
    resample: str = "bilinear"
    scale: float = 1 / 255
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    kind: Literal["image"] = "image"

    def __post_init__(self) -> None:
        where = "preprocessing (image)"
        typed(self.input, str, f"{where}.input")
        if not (isinstance(self.crop, tuple) and len(self.crop) == 2 and all(is_int(d) and d > 0 for d in self.crop)):
            raise _fail(f"{where}.crop", f"expected [height, width] in pixels, got {self.crop!r}")
        _choice(self.mode, IMAGE_MODES, f"{where}.mode")
        _choice(self.layout, LAYOUTS, f"{where}.layout")
        _choice(self.resample, RESAMPLING, f"{where}.resample")
        if not is_int(self.resize) or self.resize < 0:
            raise _fail(
                f"{where}.resize", f"expected the shorter side in pixels (0: keep the size), got {self.resize!r}"
            )
        if not is_number(self.scale) or self.scale <= 0:
            raise _fail(f"{where}.scale", f"expected a number > 0, got {self.scale!r}")
        for name in ("mean", "std"):
            values = getattr(self, name)
            if len(values) != self.channels:
                raise _fail(
                    f"{where}.{name}", f"expected {self.channels} value(s) (mode {self.mode}), got {list(values)}"
                )
        if any(s <= 0 for s in self.std):
            raise _fail(f"{where}.std", f"every value must be > 0, got {list(self.std)}")

    @property
    def channels(self) -> int:
        return IMAGE_MODES[self.mode]

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The graph input's shape after the batch axis."""
        height, width = self.crop
        return (self.channels, height, width) if self.layout == "NCHW" else (height, width, self.channels)

    @classmethod
    def parse(cls, data: Mapping[str, Any], where: str, *, strict: bool) -> ImagePreprocessing:
        values = _values(cls, data, where, strict)
        values["crop"] = tuple(typed(values["crop"], list, f"{where}.crop"))
        mode = values.get("mode", "RGB")
        for name, default in (("mean", 0.0), ("std", 1.0)):
            given = values.get(name)
            values[name] = (
                _floats(given, f"{where}.{name}") if given is not None else (default,) * IMAGE_MODES.get(mode, 3)
            )
        if "scale" in values and is_number(values["scale"]):
            values["scale"] = float(values["scale"])
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "input": self.input,
            "crop": list(self.crop),
            "mode": self.mode,
            "resize": self.resize,
            "resample": self.resample,
            "scale": float(self.scale),
            "mean": list(self.mean),
            "std": list(self.std),
            "layout": self.layout,
        }


@dataclass(frozen=True)
class TextPreprocessing:
    output: str
    tokenizer: str = "tokenizer"  # the tokenizer artifact's name
    max_length: int = 128
    overflow: Literal["truncate", "refuse"] = "truncate"
    padding: Literal["longest", "max_length"] = "longest"
    pad_id: int = 0
    add_special_tokens: bool = True
    input_ids: str = "input_ids"
    attention_mask: str | None = "attention_mask"
    token_type_ids: str | None = None
    pooling: Literal["mean", "cls", "none"] = "mean"
    normalize: bool = True
    query_prefix: str = ""
    passage_prefix: str = ""
    kind: Literal["text"] = "text"

    def __post_init__(self) -> None:
        where = "preprocessing (text)"
        for name in ("output", "tokenizer", "input_ids", "query_prefix", "passage_prefix"):
            typed(getattr(self, name), str, f"{where}.{name}")
        for name in ("attention_mask", "token_type_ids"):
            if getattr(self, name) is not None:
                typed(getattr(self, name), str, f"{where}.{name}")
        if not is_int(self.max_length) or self.max_length < 1:
            raise _fail(f"{where}.max_length", f"expected a positive integer, got {self.max_length!r}")
        if not is_int(self.pad_id) or self.pad_id < 0:
            raise _fail(f"{where}.pad_id", f"expected a token id >= 0, got {self.pad_id!r}")
        typed(self.add_special_tokens, bool, f"{where}.add_special_tokens")
        typed(self.normalize, bool, f"{where}.normalize")
        _choice(self.overflow, OVERFLOWS, f"{where}.overflow")
        _choice(self.padding, PADDINGS, f"{where}.padding")
        _choice(self.pooling, POOLINGS, f"{where}.pooling")
        fed = list(self.fed_inputs.values())
        if len(set(fed)) != len(fed):
            raise _fail(where, f"input_ids, attention_mask and token_type_ids name the same graph input: {fed}")

    @property
    def fed_inputs(self) -> dict[str, str]:
        """What the device computes -> the graph input it feeds."""
        return {
            k: v
            for k, v in (
                ("input_ids", self.input_ids),
                ("attention_mask", self.attention_mask),
                ("token_type_ids", self.token_type_ids),
            )
            if v is not None
        }

    @classmethod
    def parse(cls, data: Mapping[str, Any], where: str, *, strict: bool) -> TextPreprocessing:
        return cls(**_values(cls, data, where, strict))

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


Declaration = ImagePreprocessing | TextPreprocessing
_KINDS: dict[str, type[ImagePreprocessing] | type[TextPreprocessing]] = {
    "image": ImagePreprocessing,
    "text": TextPreprocessing,
}


def _values(cls: type, data: Mapping[str, Any], where: str, strict: bool) -> dict[str, Any]:
    """``data``'s keys, checked against ``cls``'s fields: all of them when ``strict`` (the signed
    form), the required ones otherwise (a team's declaration file: the rest take their defaults)."""
    names = [f.name for f in fields(cls)]
    required = [f.name for f in fields(cls) if f.default is MISSING]
    keys = names if strict else [k for k in names if k in data or k in required]
    return dict(exact_keys(dict(data), keys, where))


def parse_declaration(data: Any, where: str, *, strict: bool = True) -> Declaration:
    """One role's declaration; ``strict``: every key present (the manifest's form)."""
    data = typed(data, dict, where)
    kind = _choice(data.get("kind"), tuple(_KINDS), f"{where}.kind")
    return _KINDS[kind].parse(data, where, strict=strict)


@dataclass(frozen=True)
class Preprocessing:
    """The manifest's ``preprocessing`` section: a declaration per preprocessed role."""

    roles: tuple[tuple[str, Declaration], ...]

    def __post_init__(self) -> None:
        names = [role for role, _ in self.roles]
        unknown = [r for r in names if r not in PREPROCESSED_ROLES]
        if unknown or len(set(names)) != len(names) or "embed" not in names:
            raise _fail(
                "manifest preprocessing",
                f"declares roles {names}: give 'embed' (and 'side_info' when the bundle "
                f"has one), each once, among {', '.join(PREPROCESSED_ROLES)}",
            )
        kinds = {d.kind for _, d in self.roles}
        if len(kinds) != 1:
            raise _fail(
                "manifest preprocessing",
                f"roles take different kinds of items {sorted(kinds)}: a device adds "
                "one kind of item, which every graph of the bundle embeds",
            )

    @property
    def kind(self) -> str:
        return self.roles[0][1].kind

    def of(self, role: str) -> Declaration | None:
        return dict(self.roles).get(role)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **{role: d.to_json() for role, d in self.roles}}

    @classmethod
    def from_json(cls, data: Any, where: str) -> Preprocessing:
        data = typed(data, dict, where)
        exact_keys(data, ("format", *[r for r in PREPROCESSED_ROLES if r in data]), where)
        if data["format"] != FORMAT:
            raise _fail(
                f"{where}.format", f"{data['format']!r} is not supported (this fctkit reads {FORMAT!r}); upgrade fctkit"
            )
        return cls(
            tuple(
                (role, parse_declaration(data[role], f"{where}.{role}")) for role in PREPROCESSED_ROLES if role in data
            )
        )


def vector_output(declaration: Declaration | None, artifact: Artifact) -> tuple[TensorSpec, int]:
    """The output holding the role's vectors and their dim (after pooling)."""
    if not isinstance(declaration, TextPreprocessing):
        spec = artifact.outputs[0]
        if len(spec.shape) != 2 or spec.dynamic:
            raise _fail(
                f"{artifact.role} artifact {artifact.name!r}",
                f"output {spec.name!r} has shape {spec.shape}; expected (batch, dim)",
            )
        return spec, spec.feature_dim
    spec = _named(artifact.outputs, declaration.output, artifact, "output")
    rank = 2 if declaration.pooling == "none" else 3
    if len(spec.shape) != rank or spec.shape[-1] is None:
        what = "(batch, dim)" if rank == 2 else "(batch, tokens, dim) token embeddings"
        raise _fail(
            f"{artifact.role} artifact {artifact.name!r}",
            f"pooling {declaration.pooling!r} needs output {spec.name!r} to be {what}; it has shape {spec.shape}",
        )
    return spec, int(spec.shape[-1])


def _named(specs: tuple[TensorSpec, ...], name: str, artifact: Artifact, kind: str) -> TensorSpec:
    for spec in specs:
        if spec.name == name:
            return spec
    raise _fail(
        f"{artifact.role} artifact {artifact.name!r}",
        f"the preprocessing names {kind} {name!r}, which the graph "
        f"does not have (it has: {', '.join(s.name for s in specs)})",
    )


def check_preprocessing(preprocessing: Preprocessing | None, artifacts: tuple[Artifact, ...]) -> None:
    """Each declaration against the graph it feeds, the tokenizers against the artifacts, and
    dynamic axes only where a text declaration feeds them."""
    declared = {} if preprocessing is None else dict(preprocessing.roles)
    for artifact in artifacts:
        if artifact.is_file:
            continue
        declaration = declared.pop(artifact.role, None) if artifact.role in PREPROCESSED_ROLES else None
        if preprocessing is not None and artifact.role in PREPROCESSED_ROLES and declaration is None:
            raise _fail(
                f"{artifact.role} artifact {artifact.name!r}",
                "has no preprocessing declaration, but the bundle's other graphs take raw items",
            )
        if declaration is not None:
            check_declared_graph(declaration, artifact, artifacts)
        elif any(s.dynamic for s in artifact.inputs + artifact.outputs):
            raise _fail(
                f"{artifact.role} artifact {artifact.name!r}",
                "has dynamic axes after the batch; only a graph a text preprocessing declaration feeds may",
            )
    if declared:
        raise _fail("manifest preprocessing", f"declares {', '.join(declared)}, which the bundle has no artifact for")
    used = {d.tokenizer for _, d in (preprocessing.roles if preprocessing else ()) if isinstance(d, TextPreprocessing)}
    unused = [a.name for a in artifacts if a.role == "tokenizer" and a.name not in used]
    if unused:
        raise _fail("manifest preprocessing", f"tokenizer artifact(s) {unused} are not named by any declaration")


def check_declared_graph(declaration: Declaration, artifact: Artifact, artifacts: tuple[Artifact, ...]) -> None:
    """One graph against the declaration that feeds it (a text graph's tokenizer among ``artifacts``)."""
    if isinstance(declaration, ImagePreprocessing):
        _check_image(declaration, artifact)
    else:
        _check_text(declaration, artifact, artifacts)


def _check_image(declaration: ImagePreprocessing, artifact: Artifact) -> None:
    where = f"{artifact.role} artifact {artifact.name!r}"
    names = [s.name for s in artifact.inputs]
    if names != [declaration.input]:
        raise _fail(where, f"takes inputs {names}; the image preprocessing feeds exactly one, {declaration.input!r}")
    spec = artifact.inputs[0]
    if not spec.dtype.startswith("float") or spec.shape[1:] != declaration.input_shape:
        raise _fail(
            where,
            f"input {spec.name!r} is {spec.dtype} {spec.shape}; the preprocessing makes float images of "
            f"{declaration.input_shape} ({declaration.layout}, mode {declaration.mode}, crop {declaration.crop})",
        )
    vector_output(declaration, artifact)


def _check_text(declaration: TextPreprocessing, artifact: Artifact, artifacts: tuple[Artifact, ...]) -> None:
    where = f"{artifact.role} artifact {artifact.name!r}"
    fed = set(declaration.fed_inputs.values())
    names = {s.name for s in artifact.inputs}
    if names != fed:
        raise _fail(
            where,
            f"takes inputs {sorted(names)}; the text preprocessing feeds {sorted(fed)} (graph inputs it does "
            "not feed, or feeds that are not graph inputs)",
        )
    for spec in artifact.inputs:
        length = spec.shape[1] if len(spec.shape) == 2 else -1
        if spec.dtype not in ID_DTYPES or length == -1:
            raise _fail(
                where,
                f"input {spec.name!r} is {spec.dtype} {spec.shape}; token inputs are (batch, tokens) of "
                f"{' or '.join(ID_DTYPES)}",
            )
        if length is not None and (declaration.padding != "max_length" or length != declaration.max_length):
            raise _fail(
                where,
                f"input {spec.name!r} has a fixed length {length}: declare padding 'max_length' with "
                f"max_length {length}",
            )
    tokenizers = [a for a in artifacts if a.name == declaration.tokenizer and a.role == "tokenizer"]
    if not tokenizers:
        raise _fail(
            where,
            f"its preprocessing names tokenizer {declaration.tokenizer!r}, which is no tokenizer artifact "
            "of this bundle",
        )
    vector_output(declaration, artifact)
