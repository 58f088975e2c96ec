"""The publisher's signature over a manifest: loading the pinned Ed25519 public key, the key id
manifests name their publisher by, and checking ``manifest.sig`` over ``manifest.json``; and
loading an Ed25519 private key file (publisher, root or the server's timestamp key) with its
passphrase, for the offline tools and the server alike."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fctkit.errors import PublisherKeyError, SignatureError

from .bundle_vocabulary import MANIFEST_FILE, SIGNATURE_FILE, SIGNATURE_SIZE
from .manifest import Manifest

PASSPHRASE_ENV = "FCTKIT_KEY_PASSPHRASE"


def load_public_key(path_or_bytes: str | os.PathLike[str] | bytes | Ed25519PublicKey) -> Ed25519PublicKey:
    """The publisher's Ed25519 public key from a PEM file, PEM bytes, or the raw 32 bytes."""
    if isinstance(path_or_bytes, Ed25519PublicKey):
        return path_or_bytes
    if isinstance(path_or_bytes, (bytes, bytearray)):
        data, where = bytes(path_or_bytes), "the given public key bytes"
    else:
        path = Path(path_or_bytes)
        where = str(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise PublisherKeyError(f"cannot read the publisher public key {path}: {exc.strerror}") from exc
    if len(data) == 32:
        return Ed25519PublicKey.from_public_bytes(data)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:  # a damaged PEM may name another algorithm
        raise PublisherKeyError(
            f"{where} is not an Ed25519 public key (PEM or raw 32 bytes); use the publisher.pub written by "
            "`fctkit keys generate`"
        ) from exc
    if not isinstance(key, Ed25519PublicKey):
        raise PublisherKeyError(f"{where} holds a {type(key).__name__}, not an Ed25519 public key")
    return key


def load_private_key(path: str | os.PathLike[str], passphrase: bytes | None = None) -> Ed25519PrivateKey:
    """Load the publisher's private key; refuses a file readable by group or others."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as exc:
        raise PublisherKeyError(f"cannot read the publisher private key {path}: {exc.strerror}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PublisherKeyError(
            f"{path} is accessible by group or others (mode {mode & 0o777:o}): run chmod 600 {path}"
        )
    encrypted = b"ENCRYPTED" in data.split(b"\n", 1)[0]
    if encrypted and not passphrase:
        raise PublisherKeyError(
            f"{path} is passphrase-encrypted: give the passphrase with --passphrase-file or ${PASSPHRASE_ENV}"
        )
    try:
        key = serialization.load_pem_private_key(data, password=passphrase if encrypted else None)
    except ValueError as exc:
        hint = "the passphrase is wrong" if encrypted else "it is not a PEM private key"
        raise PublisherKeyError(f"cannot load {path}: {hint}") from exc
    except TypeError as exc:
        raise PublisherKeyError(f"{path} is not encrypted: do not pass a passphrase for it") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise PublisherKeyError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key")
    return key


def read_passphrase(passphrase_file: str | os.PathLike[str] | None = None) -> bytes | None:
    """The key passphrase from a file (one trailing newline dropped) or ``$FCTKIT_KEY_PASSPHRASE``;
    ``None`` when neither is given. Never taken from a command-line argument, which other
    users could read from the process list."""
    if passphrase_file is not None:
        try:
            data = Path(passphrase_file).read_bytes()
        except OSError as exc:
            raise PublisherKeyError(f"cannot read the passphrase file {passphrase_file}: {exc.strerror}") from exc
        data = data[:-2] if data.endswith(b"\r\n") else data[:-1] if data.endswith(b"\n") else data
    elif os.environ.get(PASSPHRASE_ENV):
        data = os.environ[PASSPHRASE_ENV].encode()
    else:
        return None
    if not data:
        raise PublisherKeyError("the passphrase is empty")
    return data


def public_key_id(public_key: Ed25519PublicKey) -> str:
    """SHA-256 hex of the raw 32-byte public key: what manifests name as their publisher."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def verify_manifest(manifest_bytes: bytes, signature: bytes, public_key: Any) -> Manifest:
    """Check the Ed25519 signature over the manifest bytes, then parse and validate them."""
    key = load_public_key(public_key)
    if len(signature) != SIGNATURE_SIZE:
        raise SignatureError(
            f"{SIGNATURE_FILE} is {len(signature)} bytes, an Ed25519 signature is {SIGNATURE_SIZE}: "
            "the signature is truncated or corrupt; fetch the bundle again"
        )
    pinned = public_key_id(key)
    try:
        key.verify(signature, manifest_bytes)
    except InvalidSignature:
        claimed = _claimed_key_id(manifest_bytes)
        # a claimed id one byte off the pinned one is a damaged manifest, not another publisher
        foreign = (
            claimed is not None and sum(a != b for a, b in zip(claimed, pinned)) + abs(len(claimed) - len(pinned)) > 2
        )
        if foreign:
            raise SignatureError(
                f"the bundle is signed by publisher key {claimed}, but this device pins {pinned}: "
                "it comes from another publisher (or the pinned key is wrong); refuse it"
            ) from None
        raise SignatureError(
            f"{SIGNATURE_FILE} does not verify {MANIFEST_FILE} under the pinned publisher key: the manifest or "
            "the signature was modified; fetch the bundle again from the registry"
        ) from None
    manifest = Manifest.from_bytes(manifest_bytes)
    if manifest.publisher_key_id != pinned:
        raise SignatureError(
            f"{MANIFEST_FILE} names publisher key {manifest.publisher_key_id[:16]}… but was signed by {pinned[:16]}…: "
            "rebuild the bundle with the publisher's own key"
        )
    return manifest


def _claimed_key_id(manifest_bytes: bytes) -> str | None:
    try:
        claimed = json.loads(manifest_bytes).get("publisher_key_id")
    except (ValueError, AttributeError, UnicodeDecodeError, RecursionError):
        return None
    return claimed if isinstance(claimed, str) else None
