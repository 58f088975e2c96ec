"""Real photographs offline: the wallpapers Debian ships, cut into tiles, and edited copies of them.

No natural-photo data set ships in a registry package, but high-resolution photographs do: the
wallpaper packages :data:`PACKAGES` (installed with apt-get when missing and we are root). Each
wallpaper is one *source photo* (:func:`debian_photos`; a KDE wallpaper folder's largest light
image, once). :func:`photo_tiles` cuts a photo into square windows on a non-overlapping grid at
several scales (1/2 … 1/8 of its shorter side), each resized to ``side`` pixels: thousands of
natural images, and hard distractors — tiles of one photo at other scales overlap each other.
:func:`edited_copy` makes a near-duplicate of a tile the way a phone user does: a crop, a small
rotation, a rescale, a colour change and a JPEG re-compression, each drawn from the generator.

Training and evaluation must come from disjoint source photos (:func:`split_photos`), or an
adapter could learn the evaluation photos' content from their neighbouring tiles.
"""

from __future__ import annotations

import dataclasses
import io
import math
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from debian_data import BenchmarkSetupError, ensure_debian_package

PACKAGES = ("lomiri-wallpapers-16.04", "mate-backgrounds", "plasma-workspace-wallpapers")
LOMIRI, MATE, PLASMA = (
    Path("/usr/share/backgrounds"),
    Path("/usr/share/backgrounds/mate"),
    Path("/usr/share/wallpapers"),
)
PHOTO_SUFFIXES = (".jpg", ".jpeg", ".png")
FRACTIONS = (2, 3, 4, 5, 6, 8, 10, 12)  # tile side = the photo's shorter side / each of these
MIN_DETAIL = 3.0  # mean |grey-level step| between neighbouring pixels at 64×64: below it, sky, blur or flat colour
TILE_SIDE = 320
MIN_SHORT_SIDE = 900


@dataclasses.dataclass(frozen=True)
class Photo:
    """One source photograph: a stable name (no '/') and its file."""

    name: str
    path: Path


def _largest(files: Sequence[Path]) -> Path:
    from PIL import Image

    def pixels(path: Path) -> int:
        with Image.open(path) as image:
            return image.size[0] * image.size[1]

    return max(sorted(files), key=pixels)


def _photo_files() -> dict[str, Path]:
    found = {f"lomiri-{p.stem}": p for p in sorted(LOMIRI.glob("*")) if p.suffix.lower() in PHOTO_SUFFIXES}
    versions: dict[str, list[Path]] = {}  # one picture at several resolutions (Elephants_3840x2160) is one photo
    for path in sorted(MATE.glob("*/*")):
        if path.suffix.lower() in PHOTO_SUFFIXES:
            versions.setdefault(f"mate-{path.parent.name}-{re.sub(r'_[0-9]+x[0-9]+$', '', path.stem)}", []).append(path)
    found |= {name: _largest(files) for name, files in versions.items()}
    for folder in sorted(PLASMA.glob("*/contents/images")):
        files = [p for p in folder.iterdir() if p.suffix.lower() in PHOTO_SUFFIXES]
        if files:
            found[f"plasma-{folder.parents[1].name}"] = _largest(files)
    return found


def debian_photos() -> list[Photo]:
    """Every source photo whose shorter side is at least :data:`MIN_SHORT_SIDE`, sorted by name."""
    from PIL import Image

    for package, folder in zip(PACKAGES, (LOMIRI, MATE, PLASMA), strict=True):
        ensure_debian_package(
            package, lambda f=folder: any(f.rglob("*.jpg")) or any(f.rglob("*.png")), f"photos in {folder}"
        )
    photos = []
    for name, path in sorted(_photo_files().items()):
        with Image.open(path) as image:
            if min(image.size) >= MIN_SHORT_SIDE:
                photos.append(Photo(name.replace("/", "-"), path))
    if len(photos) < 20:
        raise BenchmarkSetupError(f"only {len(photos)} photos found in {', '.join(PACKAGES)}")
    return photos


def photo_tiles(
    photo: Photo,
    *,
    side: int = TILE_SIDE,
    fractions: Sequence[int] = FRACTIONS,
    per_photo: int | None = None,
    min_detail: float = MIN_DETAIL,
) -> Iterator[tuple[str, Any]]:
    """``(tile_id, image)`` for square windows of ``photo`` on a grid at each scale, resized to
    ``side`` px; ``tile_id`` is ``<photo>/s<fraction>-<row>-<column>``. Tiles with less than
    ``min_detail`` (:func:`detail`) are left out: nobody searches for a patch of clear sky, and no
    model can tell two of them apart. ``per_photo`` stops early."""
    from PIL import Image

    with Image.open(photo.path) as opened:
        image = opened.convert("RGB")
    width, height = image.size
    made = 0
    for fraction in fractions:
        window = min(width, height) // fraction
        rows, columns = height // window, width // window
        top0, left0 = (height - rows * window) // 2, (width - columns * window) // 2
        for row in range(rows):
            for column in range(columns):
                if per_photo is not None and made >= per_photo:
                    return
                box = (
                    left0 + column * window,
                    top0 + row * window,
                    left0 + (column + 1) * window,
                    top0 + (row + 1) * window,
                )
                tile = image.crop(box).resize((side, side), Image.Resampling.BILINEAR)
                if detail(tile) >= min_detail:
                    yield f"{photo.name}/s{fraction}-{row}-{column}", tile
                    made += 1


def detail(image: Any) -> float:
    """Mean absolute difference between neighbouring grey levels of ``image`` at 64×64."""
    grey = np.asarray(image.convert("L").resize((64, 64)), dtype=np.float32)
    return float(np.abs(np.diff(grey, axis=0)).mean() + np.abs(np.diff(grey, axis=1)).mean())


def split_photos(photos: Sequence[Photo], eval_fraction: float, seed: int) -> tuple[list[Photo], list[Photo]]:
    """(training photos, evaluation photos): a seeded split by source photo."""
    order = np.random.default_rng(seed).permutation(len(photos))
    n_eval = round(len(photos) * eval_fraction)
    if not 0 < n_eval < len(photos):
        raise BenchmarkSetupError(
            f"eval fraction {eval_fraction} leaves no training or no evaluation photo of {len(photos)}"
        )
    return [photos[i] for i in sorted(order[n_eval:])], [photos[i] for i in sorted(order[:n_eval])]


def jpeg_bytes(image: Any, quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=int(quality))
    return buffer.getvalue()


def edited_copy(image: Any, rng: np.random.Generator) -> bytes:
    """A near-duplicate of ``image`` as JPEG bytes: crop (70–95 % of each side), rotation (±6°,
    the corners cropped away), rescale (×0.5–1.0), brightness/contrast (×0.75–1.25), saturation
    (×0.6–1.4), re-compression at JPEG quality 30–75."""
    from PIL import Image, ImageEnhance

    width, height = image.size
    keep_w, keep_h = rng.uniform(0.7, 0.95, size=2)
    left, top = rng.uniform(0, 1 - keep_w) * width, rng.uniform(0, 1 - keep_h) * height
    image = image.crop((int(left), int(top), int(left + keep_w * width), int(top + keep_h * height)))
    angle = float(rng.uniform(-6, 6))
    rotated = image.rotate(angle, resample=Image.Resampling.BILINEAR)
    margin = math.ceil(math.tan(math.radians(abs(angle))) * max(image.size) / 2)
    image = rotated.crop((margin, margin, image.size[0] - margin, image.size[1] - margin))
    scale = rng.uniform(0.5, 1.0)
    image = image.resize(
        (max(32, int(image.size[0] * scale)), max(32, int(image.size[1] * scale))), Image.Resampling.BILINEAR
    )
    for enhancer, low, high in (
        (ImageEnhance.Brightness, 0.75, 1.25),
        (ImageEnhance.Contrast, 0.75, 1.25),
        (ImageEnhance.Color, 0.6, 1.4),
    ):
        image = enhancer(image).enhance(float(rng.uniform(low, high)))
    return jpeg_bytes(image, int(rng.integers(30, 76)))


def photo_group(item_id: str) -> str:
    """The source photo of a tile id (``<photo>/…``)."""
    return item_id.split("/", 1)[0]
