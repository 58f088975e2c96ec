"""The encrypted original of an item, as uploaded to the server's vault.

``FCTB2 | len(wrapped key) (2 bytes) | wrapped data key | sealed image``: the image (an
``.npy`` serialisation, dtype and shape kept; a raw item is kept as it came, a file's bytes as
a uint8 vector and a text as a 0-d string array, see :func:`stored_original`) is sealed under a fresh 256-bit data key, and
the data key is sealed under the **owner key** with the item id as authenticated data, so
every device of the owner (backfill on another device, a restored device) can open it and
the server, which stores these bytes, none of them.

Galleries from before owners uploaded ``FCTB1`` envelopes, whose data key is sealed under the
device key with the gallery and item id as authenticated data; :func:`open_image` still
opens them on the device that made them.
"""

from __future__ import annotations

import io

import numpy as np

from fctkit.errors import CorruptRecordError

from .crypto import Sealer, new_key

MAGIC = b"FCTB2"
LEGACY_MAGIC = b"FCTB1"


def _owner_key_aad(item_id: str) -> bytes:
    return b"fctkit-owner-blob-key|" + item_id.encode("utf-8")


def _legacy_key_aad(gallery_id: bytes, item_id: str) -> bytes:
    return b"fctkit-blob-key|" + gallery_id + b"|" + item_id.encode("utf-8")


def _image_aad(item_id: str) -> bytes:
    return b"fctkit-blob|" + item_id.encode("utf-8")


def seal_image(owner: Sealer, item_id: str, image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(image), allow_pickle=False)
    data_key = new_key()
    wrapped = owner.seal(data_key, _owner_key_aad(item_id))
    body = Sealer(data_key).seal(buffer.getvalue(), _image_aad(item_id))
    return MAGIC + len(wrapped).to_bytes(2, "big") + wrapped + body


def open_image(
    owner: Sealer, item_id: str, blob: bytes, *, device: Sealer | None = None, gallery_id: bytes = b""
) -> np.ndarray:
    """The image sealed by :func:`seal_image` (or, with ``device`` and ``gallery_id``, a legacy
    FCTB1 envelope); :class:`CorruptRecordError` if anything was altered or the key is not the owner's."""
    magic = blob[: len(MAGIC)]
    if magic not in (MAGIC, LEGACY_MAGIC) or len(blob) < len(MAGIC) + 2:
        raise CorruptRecordError(f"vault blob of item {item_id!r} is not an fctkit image envelope")
    if magic == LEGACY_MAGIC:
        if device is None:
            raise CorruptRecordError(
                f"item {item_id!r} was sealed under another device's key (before owners); only that device can open it"
            )
        wrapping, aad = device, _legacy_key_aad(gallery_id, item_id)
    else:
        wrapping, aad = owner, _owner_key_aad(item_id)
    start = len(MAGIC) + 2
    size = int.from_bytes(blob[len(MAGIC) : start], "big")
    data_key = wrapping.open(blob[start : start + size], aad, f"item {item_id!r} data key")
    raw = Sealer(data_key).open(blob[start + size :], _image_aad(item_id), f"item {item_id!r} image")
    return np.load(io.BytesIO(raw), allow_pickle=False)


def stored_original(item) -> np.ndarray:
    """The array a raw item (image file bytes, a text) is sealed as; an array stays as it is."""
    if isinstance(item, (bytes, bytearray)):
        return np.frombuffer(bytes(item), dtype=np.uint8)
    if isinstance(item, str):
        return np.array(item)
    return np.asarray(item)


def original_items(originals: list[np.ndarray], *, raw: bool) -> np.ndarray | list:
    """Opened originals as an engine takes them: raw items (bytes, texts) for a bundle that
    declares preprocessing, else one stacked array."""
    if not raw:
        return np.stack(originals)
    return [str(a[()]) if a.dtype.kind == "U" else a.tobytes() for a in originals]
