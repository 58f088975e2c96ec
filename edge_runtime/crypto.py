"""Device and owner keys and sealed records: AES-256-GCM with authenticated data.

Two 256-bit keys live in key files readable by their user only (0600), stored either as is
or wrapped by a passphrase (scrypt → AES-256-GCM), in one format (:func:`write_key_file`,
:func:`read_key_file`; ``kind`` names which key a file holds and is bound into the wrapping):

* the **device key** seals every on-device gallery record; it never leaves the device;
* the **owner key** is shared by all devices of one owner (exported passphrase-wrapped with
  ``fctkit device export-key``, imported with ``init --import-key``): it seals the data keys of
  the vault originals and the replicated gallery records, so any device of the owner can read
  them and the server none.

Every record is sealed with a fresh 96-bit nonce; the authenticated data names what the
record is (gallery, row, version tag, field; or owner, item, version), so a record moved to
another row, another gallery or another field, or replayed from an older version, fails to open.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, hmac
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from fctkit.errors import CorruptRecordError, DeviceKeyError

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
KEY_FILE_FORMAT = 1
#: every field a key file may hold: another name is a damaged one (e.g. "check", whose absence is allowed)
KEY_FILE_FIELDS = frozenset({"format", "wrapping", "key", "n", "r", "p", "salt", "wrapped_key", "kind", "check"})
#: scrypt cost (n = 2**15, r = 8, p = 1: ~32 MiB, ~0.1 s): the interactive setting of RFC 7914.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 1 << 15, 8, 1


class Sealer:
    """Seal and open records under one 256-bit key."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise DeviceKeyError(f"a device key is {KEY_BYTES} bytes, got {len(key)}")
        self._aead = AESGCM(key)
        # a separate key for MACs: the same key is never used by two algorithms
        self._mac_key = HKDF(hashes.SHA256(), KEY_BYTES, salt=None, info=b"fctkit-mac/1").derive(key)

    def mac(self, data: bytes) -> bytes:
        """HMAC-SHA256 of ``data`` under a key derived from this one (for plaintext that must
        stay readable but be authenticated, e.g. the gallery's settings)."""
        h = hmac.HMAC(self._mac_key, hashes.SHA256())
        h.update(data)
        return h.finalize()

    def seal(self, plaintext: bytes, aad: bytes) -> bytes:
        """``nonce || ciphertext || tag`` with a fresh random nonce."""
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, plaintext, aad)

    def seal_many(self, plaintexts: Sequence[bytes], aads: Sequence[bytes]) -> list[bytes]:
        """:meth:`seal` for many records, drawing all nonces in one call to the OS."""
        nonces = os.urandom(NONCE_BYTES * len(plaintexts))
        encrypt = self._aead.encrypt
        return [
            nonces[i * NONCE_BYTES : (i + 1) * NONCE_BYTES]
            + encrypt(nonces[i * NONCE_BYTES : (i + 1) * NONCE_BYTES], p, a)
            for i, (p, a) in enumerate(zip(plaintexts, aads, strict=True))
        ]

    def open(self, record: bytes, aad: bytes, what: str = "record") -> bytes:
        """The plaintext of ``record``; :class:`CorruptRecordError` when it was modified,
        truncated, sealed under another key, or belongs to other authenticated data."""
        if len(record) < NONCE_BYTES + TAG_BYTES:
            raise CorruptRecordError(f"{what}: {len(record)} bytes is shorter than any sealed record (truncated)")
        try:
            view = memoryview(record)  # no copy of the ciphertext
            return self._aead.decrypt(view[:NONCE_BYTES], view[NONCE_BYTES:], aad)
        except InvalidTag:
            raise _authentication_failed(what) from None

    def open_into(self, record: bytes, aad: bytes, out: memoryview, what: str = "record") -> None:
        """:meth:`open` straight into ``out`` (a writable buffer of exactly the plaintext's
        length): no intermediate copy. When authentication fails ``out`` holds garbage: the
        caller must not use it."""
        if len(record) != NONCE_BYTES + TAG_BYTES + out.nbytes:
            raise CorruptRecordError(
                f"{what}: {len(record)} bytes do not hold {out.nbytes} bytes of plaintext (truncated or resized)"
            )
        try:
            view = memoryview(record)  # no copy of the ciphertext
            self._aead.decrypt_into(view[:NONCE_BYTES], view[NONCE_BYTES:], aad, out)
        except InvalidTag:
            raise _authentication_failed(what) from None


def _authentication_failed(what: str) -> CorruptRecordError:
    return CorruptRecordError(
        f"{what}: authentication failed (modified, swapped with another record, or sealed under another key)"
    )


def new_key() -> bytes:
    return AESGCM.generate_key(bit_length=256)


def owner_key_id(key: bytes) -> str:
    """The owner key's public fingerprint: SHA-256 of a domain tag and the key (reveals nothing
    of a random 256-bit key). The server compares it at enrolment, so a device holding another
    key than its owner's other devices is refused before it seals anything for them."""
    return hashlib.sha256(b"fctkit-owner-key-id/1" + key).hexdigest()


def _scrypt(passphrase: str, salt: bytes) -> bytes:
    return Scrypt(salt=salt, length=KEY_BYTES, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P).derive(passphrase.encode("utf-8"))


KEY_KINDS = ("device", "owner")


def _wrapping_aad(kind: str) -> bytes:
    if kind not in KEY_KINDS:
        raise DeviceKeyError(f"unknown key kind {kind!r}; one of {', '.join(KEY_KINDS)}")
    return b"fctkit-%s-key" % kind.encode()


def write_key_file(path: str | os.PathLike, key: bytes, passphrase: str | None = None, *, kind: str = "device") -> Path:
    """Write ``key`` to a new 0600 file (refusing to overwrite one), wrapped when a passphrase
    is given; ``kind`` ('device' or 'owner') is recorded and bound into the wrapping."""
    path = Path(path)
    aad = _wrapping_aad(kind)
    if passphrase is None:
        body = {"format": KEY_FILE_FORMAT, "wrapping": "none", "key": base64.b64encode(key).decode()}
    else:
        if not passphrase:
            raise DeviceKeyError("the passphrase is empty: give a real one, or none to store the key unwrapped")
        salt = os.urandom(16)
        wrapped = Sealer(_scrypt(passphrase, salt)).seal(key, aad)
        body = {
            "format": KEY_FILE_FORMAT,
            "wrapping": "scrypt-aes256gcm",
            "n": SCRYPT_N,
            "r": SCRYPT_R,
            "p": SCRYPT_P,
            "salt": base64.b64encode(salt).decode(),
            "wrapped_key": base64.b64encode(wrapped).decode(),
        }
    if kind != "device":
        body["kind"] = kind  # device key files predate the field: absent means device
    body["check"] = _key_check(kind, key)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise DeviceKeyError(f"{path} already exists: a key file is never overwritten (move it away first)") from None
    with os.fdopen(fd, "w") as fh:
        json.dump(body, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return path


def key_file_wrapped(path: str | os.PathLike) -> bool:
    """Whether the key file at ``path`` asks for a passphrase (one that cannot be read is left to
    :func:`read_key_file` to refuse: it says why)."""
    try:
        body = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return not isinstance(body, dict) or body.get("wrapping") != "none"


def read_key_file(path: str | os.PathLike, passphrase: str | None = None, *, kind: str = "device") -> bytes:
    """The ``kind`` key from its file; refuses files others can read, files holding another
    kind of key, and wrong passphrases."""
    path = Path(path)
    aad = _wrapping_aad(kind)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise DeviceKeyError(f"{kind} key file {path} does not exist: run `fctkit device init` first") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise DeviceKeyError(f"{path} is readable by others (mode {stat.S_IMODE(mode):o}): chmod 600 {path}")
    try:
        body = json.loads(path.read_text())
        if not isinstance(body, dict):
            raise ValueError("not a JSON object")
        if not set(body) <= KEY_FILE_FIELDS:
            raise DeviceKeyError(
                f"{path} is damaged: it names field(s) no key file has ({', '.join(sorted(set(body) - KEY_FILE_FIELDS))}); "
                "restore the file from a backup or an exported key (nothing was changed)"
            )
        if body.get("format") != KEY_FILE_FORMAT:
            raise DeviceKeyError(f"{path}: unsupported key file format {body.get('format')!r}")
        if body.get("kind", "device") != kind:
            raise DeviceKeyError(f"{path} holds a {body.get('kind', 'device')} key, not the {kind} key asked for")
        if body["wrapping"] == "none":
            key = base64.b64decode(body["key"], validate=True)
        elif body["wrapping"] == "scrypt-aes256gcm":
            if passphrase is None:
                raise DeviceKeyError(f"{path} is passphrase-protected: give the passphrase (--passphrase-env VAR)")
            salt = base64.b64decode(body["salt"], validate=True)
            kdf = Scrypt(salt=salt, length=KEY_BYTES, n=body["n"], r=body["r"], p=body["p"])
            wrapping_key = kdf.derive(passphrase.encode("utf-8"))
            try:
                key = Sealer(wrapping_key).open(base64.b64decode(body["wrapped_key"], validate=True), aad)
            except CorruptRecordError:
                raise DeviceKeyError(f"{path}: wrong passphrase (or the key file was modified)") from None
        else:
            raise DeviceKeyError(f"{path}: unknown key wrapping {body['wrapping']!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise DeviceKeyError(f"{path} is not a valid fctkit key file ({exc})") from exc
    if len(key) != KEY_BYTES:
        raise DeviceKeyError(f"{path}: the key is {len(key)} bytes, expected {KEY_BYTES}")
    if "check" in body and body["check"] != _key_check(kind, key):  # files from before the check have none
        raise DeviceKeyError(
            f"{path} is damaged: its {kind} key fails the file's checksum (a changed character?); "
            f"restore the file from a backup or an exported key (nothing was changed)"
        )
    return key


class UnusableKey(Sealer):
    """A key whose file failed to read (``error``): the device answers queries without it, and
    everything that needs it raises ``error`` rather than guess (nothing is sealed or dropped)."""

    def __init__(self, error: DeviceKeyError) -> None:
        self.error = error

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise self.error

    mac = seal = seal_many = open = open_into = _refuse

    def refusal(self, command: str, queued: int) -> DeviceKeyError:
        """Why ``command``, which needs the key to tell damaged queued originals from a damaged key, changes nothing."""
        return DeviceKeyError(
            f"{self.error} The {command} needs the owner key to tell damaged queued originals from a damaged key: "
            f"refused, nothing was changed (the {queued} queued original(s) stay queued); put owner.key back (a backup, "
            "or `fctkit device export-key` on another device of the owner and `init --import-key`), then run it again"
        )


def _key_check(kind: str, key: bytes) -> str:
    """A checksum of a key file's key: a damaged file is told apart from another key."""
    return hashlib.sha256(b"fctkit-key-file-check/1|" + kind.encode() + b"|" + key).hexdigest()[:16]
