"""Publisher Ed25519 keys: generate, save (private key 0600, optionally passphrase-encrypted
PKCS#8 PEM), load. Devices pin the public key; only the publisher holds the private one."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fctkit.errors import PublisherKeyError
from fctkit.protos.bundle import load_public_key, public_key_id

PRIVATE_KEY_FILE = "publisher.key"
PUBLIC_KEY_FILE = "publisher.pub"
PASSPHRASE_ENV = "FCTKIT_KEY_PASSPHRASE"


def generate_keys(out_dir: str | os.PathLike, passphrase: bytes | None = None) -> tuple[Path, Path]:
    """Create ``publisher.key`` (mode 0600) and ``publisher.pub`` in ``out_dir``; refuses to
    overwrite an existing key. Returns (private key path, public key path)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    private_path, public_path = out_dir / PRIVATE_KEY_FILE, out_dir / PUBLIC_KEY_FILE
    for path in (private_path, public_path):
        if path.exists():
            raise PublisherKeyError(f"{path} already exists: keys are never overwritten; choose another --out")
    key = Ed25519PrivateKey.generate()
    save_private_key(key, private_path, passphrase)
    save_public_key(key.public_key(), public_path)
    return private_path, public_path


def save_private_key(key: Ed25519PrivateKey, path: str | os.PathLike, passphrase: bytes | None = None) -> Path:
    """Write the private key as PKCS#8 PEM, created with mode 0600 (never world-readable, not
    even briefly), encrypted with ``passphrase`` when one is given."""
    if passphrase is not None and not passphrase:
        raise PublisherKeyError("the passphrase is empty: give a real one or none")
    encryption = (
        serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption()
    )
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as exc:
        raise PublisherKeyError(f"{path} already exists: keys are never overwritten") from exc
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
        fh.flush()
        os.fsync(fh.fileno())
    return path


def save_public_key(key: Ed25519PublicKey, path: str | os.PathLike) -> Path:
    """Write the public key as SubjectPublicKeyInfo PEM (what devices pin)."""
    path = Path(path)
    pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    with open(path, "xb") as fh:
        fh.write(pem)
    return path


def load_private_key(path: str | os.PathLike, passphrase: bytes | None = None) -> Ed25519PrivateKey:
    """Load the publisher's private key; refuses a file readable by group or others."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as exc:
        raise PublisherKeyError(f"cannot read the publisher private key {path}: {exc.strerror}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PublisherKeyError(f"{path} is accessible by group or others (mode {mode & 0o777:o}): run chmod 600 {path}")
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


def read_passphrase(passphrase_file: str | os.PathLike | None = None) -> bytes | None:
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


__all__ = [
    "PRIVATE_KEY_FILE", "PUBLIC_KEY_FILE", "PASSPHRASE_ENV", "generate_keys", "save_private_key",
    "save_public_key", "load_private_key", "load_public_key", "public_key_id", "read_passphrase",
]
