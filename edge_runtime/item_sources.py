"""What `fctkit device add` and `fctkit device query` read, by the paths given:

- ``.npy`` (an array of items), or ``.npz`` with ``images`` and optional ``labels`` / ``ids``:
  arrays, for bundles without preprocessing (one such file per call);
- ``.jpg`` / ``.jpeg`` / ``.png`` files and folders of them (searched recursively, in name
  order; other files in a folder are left alone): image files, id = the path relative to the
  folder given (a file given itself: its name);
- ``.jsonl``: JSON Lines, one item a line, ``{"id": ..., "text": ...}`` or ``{"id": ...,
  "image": path}`` (relative to the JSONL file), optionally ``"label"``.

Files are read here; whether an item can be embedded (a corrupt image, an empty text) is the
bundle's preprocessing's to say, item by item.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fctkit.errors import InputError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
ARRAY_SUFFIXES = (".npy", ".npz")


@dataclass(frozen=True)
class ItemSource:
    """Items read from the paths given: ``kind`` 'arrays' (``items`` an array) or 'raw'
    (``items`` a list of image file bytes and texts); ids and labels when the files give them."""

    kind: str
    items: Any
    ids: list[str] | None
    labels: list[str | None] | None


def read_items(paths: Sequence[Path]) -> ItemSource:
    """The items of ``paths`` (see the module docstring); one kind per call."""
    paths = [Path(p) for p in paths]
    missing = [str(p) for p in paths if not p.exists()]
    if missing or not paths:
        raise InputError(f"{', '.join(missing)} does not exist" if missing else "give at least one file or folder")
    arrays = [p for p in paths if p.suffix in ARRAY_SUFFIXES]
    if arrays:
        if len(paths) != 1:
            raise InputError(f"{arrays[0]}: an .npy/.npz file of arrays is given alone, not with other files")
        return _arrays(arrays[0])
    records: list[tuple[str, Any, str | None]] = []
    for path in paths:
        records += _jsonl(path) if path.suffix == ".jsonl" else _image_files(path)
    ids = [item_id for item_id, _, _ in records]
    repeated = sorted(i for i, n in Counter(ids).items() if n > 1)
    if repeated:
        raise InputError(f"item ids must be unique; repeated: {', '.join(repeated[:5])}")
    if not records:
        raise InputError(f"no items in {', '.join(map(str, paths))} (image files are {', '.join(IMAGE_SUFFIXES)})")
    return ItemSource("raw", [item for _, item, _ in records], ids, [label for _, _, label in records])


def _arrays(path: Path) -> ItemSource:
    try:
        data = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise InputError(f"{path} is not a .npy/.npz file ({exc})") from exc
    if isinstance(data, np.ndarray):
        return ItemSource("arrays", data, None, None)
    with data:
        if "images" not in data:
            raise InputError(f"{path} has no 'images' array (it has: {', '.join(data.files)})")
        labels: list[str | None] | None = [str(x) for x in data["labels"]] if "labels" in data else None
        ids = [str(x) for x in data["ids"]] if "ids" in data else None
        return ItemSource("arrays", data["images"], ids, labels)


def _image_files(path: Path) -> list[tuple[str, bytes, None]]:
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix.lower() in IMAGE_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        return [(p.relative_to(path).as_posix(), _read(p), None) for p in files]
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise InputError(
            f"{path}: give image files ({', '.join(IMAGE_SUFFIXES)}), folders of them, a .jsonl of texts or "
            "images, or an .npy/.npz of arrays"
        )
    return [(path.name, _read(path), None)]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc}") from exc


def _jsonl(path: Path) -> list[tuple[str, Any, str | None]]:
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {path} (JSON Lines, UTF-8): {exc}") from exc
    for number, line in enumerate(lines, 1):
        if line.strip():
            records.append(_record(line, path, number))
    return records


def _record(line: str, path: Path, number: int) -> tuple[str, Any, str | None]:
    where = f"{path} line {number}"
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise InputError(f"{where}: not JSON ({exc})") from exc
    kinds = [k for k in ("text", "image") if isinstance(record, dict) and k in record]
    if not isinstance(record, dict) or len(kinds) != 1 or set(record) - {"id", "label", *kinds}:
        raise InputError(
            f'{where}: expected {{"id": ..., "text": ...}} or {{"id": ..., "image": path}}, optionally '
            f'"label"; got {line[:80]!r}'
        )
    item_id, label = record.get("id"), record.get("label")
    if not isinstance(item_id, str) or not item_id:
        raise InputError(f"{where}: 'id' must be a non-empty string, got {item_id!r}")
    if label is not None and not isinstance(label, str):
        raise InputError(f"{where}: 'label' must be a string, got {label!r}")
    value = record[kinds[0]]
    if not isinstance(value, str):
        raise InputError(f"{where}: {kinds[0]!r} must be a string, got {type(value).__name__}")
    return item_id, value if kinds[0] == "text" else _read(path.parent / value), label
