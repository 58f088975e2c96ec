"""Applying a bundle's preprocessing declaration (:mod:`fctkit.protos.preprocessing_spec`): raw
items in, the role's vectors out. The one code path the exporter's parity check and the device
both run, so a graph is checked at export exactly as devices will feed it.

Raw items are ``bytes`` (a JPEG/PNG file's contents) or ``str`` (a text). Pillow and
``tokenizers`` are imported when first needed (extras ``images`` and ``text``); the graph runs
through a callable the caller gives (an ONNX Runtime session's ``run``), so this module
needs neither torch nor onnxruntime.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from fctkit.errors import BundleFormatError, require

from .artifact_spec import Artifact
from .preprocessing_spec import Declaration, ImagePreprocessing, TextPreprocessing, vector_output

Purpose = Literal["passage", "query"]
#: ``run(output_names, feed)`` -> the outputs: ONNX Runtime's ``InferenceSession.run``
Run = Callable[[list[str], dict[str, np.ndarray]], list[np.ndarray]]
_RESAMPLING = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3}  # PIL.Image.Resampling values


class ItemProblem(Exception):
    """Why one raw item cannot be embedded (turned into an :class:`~fctkit.errors.ItemError` by callers)."""


@dataclass
class Embedded:
    """What :meth:`Preprocessor.embed` made of a list of items: the vectors of the good ones
    (``good``: their positions; None when a bad item stopped the graph runs) and, per bad
    item, its position and the reason."""

    vectors: np.ndarray | None
    good: list[int]
    bad: list[tuple[int, str]]


class Preprocessor:
    """One role's declaration bound to its graph (and tokenizer)."""

    def __init__(self, declaration: Declaration, artifact: Artifact, tokenizer_json: bytes | None = None) -> None:
        self.declaration = declaration
        self.artifact = artifact
        self.output = vector_output(declaration, artifact)[0].name
        self._dtypes = {s.name: np.dtype(s.dtype) for s in artifact.inputs}
        self._tokenizer = (
            _load_tokenizer(tokenizer_json, declaration) if isinstance(declaration, TextPreprocessing) else None
        )

    @property
    def kind(self) -> str:
        return self.declaration.kind

    def prepare(self, item: Any, purpose: Purpose = "passage") -> np.ndarray:
        """One item as the graph's per-item array (a decoded image, or token ids); raises :class:`ItemProblem`."""
        if isinstance(self.declaration, ImagePreprocessing):
            return decode_image(item, self.declaration)
        return tokenize(self._tokenizer, item, self.declaration, purpose)

    def embed(
        self,
        items: Sequence[Any],
        run: Run,
        *,
        purpose: Purpose = "passage",
        batch_size: int = 256,
        keep_going: bool = True,
        progress: Callable[[int], object] | None = None,
    ) -> Embedded:
        """Prepare and embed ``items`` batch by batch. A bad item is recorded and left out; when
        ``keep_going`` is false, the first bad item stops the graph runs (the rest are still
        prepared, so every bad item is reported) and ``vectors`` is None."""
        vectors, good, bad = [], [], []
        for start in range(0, len(items), batch_size):
            prepared = []
            for index in range(start, min(start + batch_size, len(items))):
                try:
                    prepared.append(self.prepare(items[index], purpose))
                    good.append(index)
                except ItemProblem as problem:
                    bad.append((index, str(problem)))
            if prepared and (keep_going or not bad):
                vectors.append(self.run_batch(prepared, run))
            if progress is not None:
                progress(min(batch_size, len(items) - start))
        if bad and not keep_going:
            return Embedded(None, good, bad)
        dim = vector_output(self.declaration, self.artifact)[1]
        return Embedded(np.concatenate(vectors) if vectors else np.zeros((0, dim), np.float32), good, bad)

    def run_batch(self, prepared: Sequence[np.ndarray], run: Run) -> np.ndarray:
        """The vectors of prepared items (float32, one row each)."""
        if isinstance(self.declaration, ImagePreprocessing):
            feed = {self.declaration.input: np.stack(prepared).astype(self._dtypes[self.declaration.input])}
            return np.asarray(run([self.output], feed)[0], dtype=np.float32)
        ids, mask, types = pad_tokens(prepared, self.declaration)
        arrays = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        feed = {name: arrays[what].astype(self._dtypes[name]) for what, name in self.declaration.fed_inputs.items()}
        return pool(np.asarray(run([self.output], feed)[0], dtype=np.float32), mask, self.declaration)


# -- images ----------------------------------------------------------------------------------


def decode_image(data: Any, declaration: ImagePreprocessing) -> np.ndarray:
    """A JPEG/PNG file's bytes as the graph's float image: mode, resize, crop, scale, mean/std, layout."""
    image_module = require("PIL.Image", "images")
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise ItemProblem(
            "is empty" if isinstance(data, (bytes, bytearray)) else f"is a {type(data).__name__}, not image bytes"
        )
    try:
        with image_module.open(io.BytesIO(data)) as image:
            if image.format not in ("JPEG", "PNG"):
                raise ItemProblem(f"is a {image.format} image; JPEG and PNG are read")
            image.load()  # decodes the whole file: a truncated or damaged one fails here
            image = image.convert("L" if declaration.mode == "L" else "RGB")
    except (OSError, SyntaxError, ValueError, image_module.DecompressionBombError) as exc:
        raise ItemProblem(f"is not a readable JPEG/PNG image ({exc})") from exc
    image = _resized(image, declaration)
    pixels = _cropped(np.asarray(image, dtype=np.float32), declaration.crop)
    pixels = pixels[..., None] if pixels.ndim == 2 else pixels[..., ::-1] if declaration.mode == "BGR" else pixels
    pixels = (pixels * np.float32(declaration.scale) - np.asarray(declaration.mean, np.float32)) / np.asarray(
        declaration.std, np.float32
    )
    return np.ascontiguousarray(pixels.transpose(2, 0, 1) if declaration.layout == "NCHW" else pixels)


def _resized(image: Any, declaration: ImagePreprocessing) -> Any:
    """The shorter side resized to ``resize`` (the longer one in proportion, rounded down, as
    torchvision's ``Resize(int)`` does)."""
    if not declaration.resize:
        return image
    width, height = image.size
    short, long = sorted((width, height))
    size = (declaration.resize, int(declaration.resize * long / short))
    target = size if width <= height else size[::-1]
    return image.resize(target, resample=_RESAMPLING[declaration.resample])


def _cropped(pixels: np.ndarray, crop: tuple[int, int]) -> np.ndarray:
    height, width = pixels.shape[:2]
    if height < crop[0] or width < crop[1]:
        raise ItemProblem(f"is {width}x{height} pixels after resizing, smaller than the {crop[1]}x{crop[0]} crop")
    top, left = round((height - crop[0]) / 2.0), round((width - crop[1]) / 2.0)
    return pixels[top : top + crop[0], left : left + crop[1]]


# -- texts -----------------------------------------------------------------------------------


def _load_tokenizer(data: bytes | None, declaration: TextPreprocessing) -> Any:
    tokenizers = require("tokenizers", "text")
    if data is None:
        raise BundleFormatError(f"the text preprocessing needs its tokenizer artifact {declaration.tokenizer!r}")
    try:
        tokenizer = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # tokenizers raises its own exception types for a bad file
        raise BundleFormatError(f"tokenizer {declaration.tokenizer!r} is not a readable tokenizer.json: {exc}") from exc
    # What the file itself may say about padding and truncation is replaced by the declaration.
    tokenizer.no_padding()
    tokenizer.no_truncation()
    if declaration.overflow == "truncate":
        tokenizer.enable_truncation(declaration.max_length)
    return tokenizer


def tokenize(tokenizer: Any, text: Any, declaration: TextPreprocessing, purpose: Purpose) -> np.ndarray:
    """A text's token ids and type ids, shape (2, tokens); raises :class:`ItemProblem` for an
    empty text or, with overflow 'refuse', one over ``max_length`` tokens."""
    if not isinstance(text, str):
        raise ItemProblem(f"is a {type(text).__name__}, not a text")
    if not text.strip():
        raise ItemProblem("is an empty text")
    prefix = declaration.query_prefix if purpose == "query" else declaration.passage_prefix
    encoding = tokenizer.encode(prefix + text, add_special_tokens=declaration.add_special_tokens)
    if not encoding.ids:
        raise ItemProblem("gives no tokens")
    if len(encoding.ids) > declaration.max_length:
        raise ItemProblem(
            f"has {len(encoding.ids)} tokens, more than the max_length {declaration.max_length} "
            "(the bundle refuses longer texts rather than truncating them)"
        )
    return np.array([encoding.ids, encoding.type_ids], dtype=np.int64)


def pad_tokens(
    prepared: Sequence[np.ndarray], declaration: TextPreprocessing
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """input_ids, attention_mask, token_type_ids of a batch, padded on the right."""
    length = declaration.max_length if declaration.padding == "max_length" else max(p.shape[1] for p in prepared)
    ids = np.full((len(prepared), length), declaration.pad_id, dtype=np.int64)
    mask = np.zeros((len(prepared), length), dtype=np.int64)
    types = np.zeros((len(prepared), length), dtype=np.int64)
    for row, tokens in enumerate(prepared):
        n = tokens.shape[1]
        ids[row, :n], types[row, :n], mask[row, :n] = tokens[0], tokens[1], 1
    return ids, mask, types


def pool(output: np.ndarray, mask: np.ndarray, declaration: TextPreprocessing) -> np.ndarray:
    """The declared pooling of the graph's output, L2-normalised when declared."""
    if declaration.pooling == "mean":
        weights = mask[..., None].astype(np.float32)
        vectors = (output * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1.0)
    elif declaration.pooling == "cls":
        vectors = output[:, 0]
    else:
        vectors = output
    if declaration.normalize:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.where(norms > 0, norms, 1.0)
    return np.ascontiguousarray(vectors, dtype=np.float32)
