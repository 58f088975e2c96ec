"""The encrypted original of an item, as uploaded to the server's vault.

``FCTB1 | len(wrapped key) (2 bytes) | wrapped data key | sealed image``: the image (an
``.npy`` serialisation, dtype and shape kept) is sealed under a fresh 256-bit data key, and
the data key is sealed under the device key with the gallery and item id as authenticated
data. The server stores these bytes and can decrypt none of them.
"""

from __future__ import annotations

import io

import numpy as np

from fctkit.errors import CorruptRecordError

from .crypto import Sealer, new_key

MAGIC = b"FCTB1"


def _key_aad(gallery_id: bytes, item_id: str) -> bytes:
    return b"fctkit-blob-key|" + gallery_id + b"|" + item_id.encode("utf-8")


def seal_image(device: Sealer, gallery_id: bytes, item_id: str, image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(image), allow_pickle=False)
    data_key = new_key()
    wrapped = device.seal(data_key, _key_aad(gallery_id, item_id))
    body = Sealer(data_key).seal(buffer.getvalue(), b"fctkit-blob|" + item_id.encode("utf-8"))
    return MAGIC + len(wrapped).to_bytes(2, "big") + wrapped + body


def open_image(device: Sealer, gallery_id: bytes, item_id: str, blob: bytes) -> np.ndarray:
    """The image sealed by :func:`seal_image`; :class:`CorruptRecordError` if anything was altered."""
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 2:
        raise CorruptRecordError(f"vault blob of item {item_id!r} is not an fctkit image envelope")
    start = len(MAGIC) + 2
    size = int.from_bytes(blob[len(MAGIC):start], "big")
    data_key = device.open(blob[start:start + size], _key_aad(gallery_id, item_id), f"item {item_id!r} data key")
    raw = Sealer(data_key).open(blob[start + size:], b"fctkit-blob|" + item_id.encode("utf-8"), f"item {item_id!r} image")
    return np.load(io.BytesIO(raw), allow_pickle=False)
