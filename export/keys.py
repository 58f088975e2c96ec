"""Publisher Ed25519 keys: generate, save (private key 0600, optionally passphrase-encrypted
PKCS#8 PEM), load. Devices pin the public key; only the publisher holds the private one.

And the offline root of trust (:mod:`fctkit.protos.trust`): create ``root.1.json``
with k-of-n root keys, write each next root version (publishers added or removed, root keys
rotated), and add one signature at a time to a root file or a release, so k of n key holders
can co-sign without ever sharing a private key."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fctkit.errors import PublisherKeyError, TrustError
from fctkit.protos.bundle import SIGNATURE_FILE, load_public_key, pack_bundle, public_key_id, unpack_bundle
from fctkit.protos.bundle_vocabulary import SIGNATURES_FILE
from fctkit.protos.durable_files import read_regular_file, write_atomic
from fctkit.protos.manifest_signature import PASSPHRASE_ENV, load_private_key, read_passphrase
from fctkit.protos.trust import (
    DEFAULT_FRESHNESS_LIMIT_S,
    MAX_ROOT_BYTES,
    MAX_WITHDRAWAL_BYTES,
    RoleKeys,
    Root,
    Signature,
    Signed,
    Withdrawal,
    parse_root,
    parse_withdrawal,
    read_release_signatures,
    release_signatures_bytes,
    sign_bytes,
)
from fctkit.protos.trust.withdrawal import withdrawal_file_name, write_withdrawal

PRIVATE_KEY_FILE = "publisher.key"
PUBLIC_KEY_FILE = "publisher.pub"


def generate_keys(out_dir: str | os.PathLike[str], passphrase: bytes | None = None) -> tuple[Path, Path]:
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


def save_private_key(key: Ed25519PrivateKey, path: str | os.PathLike[str], passphrase: bytes | None = None) -> Path:
    """Write the private key as PKCS#8 PEM, created with mode 0600 (never world-readable, not
    even briefly), encrypted with ``passphrase`` when one is given."""
    if passphrase is not None and not passphrase:
        raise PublisherKeyError("the passphrase is empty: give a real one or none")
    encryption = serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption()
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


def save_public_key(key: Ed25519PublicKey, path: str | os.PathLike[str]) -> Path:
    """Write the public key as SubjectPublicKeyInfo PEM (what devices pin)."""
    path = Path(path)
    pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    with open(path, "xb") as fh:
        fh.write(pem)
    return path


DEFAULT_ROOT_EXPIRY_DAYS = 365


def root_file_name(version: int) -> str:
    return f"root.{version}.json"


def init_root(
    out_dir: str | os.PathLike[str],
    *,
    root_keys: int,
    root_threshold: int,
    publisher_keys: Sequence[Ed25519PublicKey] = (),
    publisher_threshold: int = 1,
    timestamp_keys: Sequence[Ed25519PublicKey] = (),
    expires_days: int = DEFAULT_ROOT_EXPIRY_DAYS,
    freshness_s: int = DEFAULT_FRESHNESS_LIMIT_S,
    passphrase: bytes | None = None,
    now: datetime | None = None,
) -> tuple[Path, Signed[Root], list[Path]]:
    """Generate ``root_keys`` root keys (``root-<i>.key``, 0600, passphrase-wrapped, and
    ``root-<i>.pub``) and ``root.1.json`` signed by all of them, in ``out_dir``. The root is
    checked before any file is written. Returns (root file, signed root, private key files)."""
    if not 1 <= root_keys <= 16:
        raise TrustError(f"--root-keys {root_keys}: between 1 and 16 root keys")
    private = [Ed25519PrivateKey.generate() for _ in range(root_keys)]
    root_ids = [public_key_id(k.public_key()) for k in private]
    root = Root(
        1,
        _expiry(now, expires_days),
        _key_map([k.public_key() for k in private], publisher_keys, timestamp_keys),
        {
            "root": RoleKeys(tuple(root_ids), root_threshold),
            "publisher": RoleKeys(_ids(publisher_keys), publisher_threshold),
            "timestamp": RoleKeys(_ids(timestamp_keys), 1),
        },
        freshness_s,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    root_path = out_dir / root_file_name(1)
    if root_path.exists():
        raise TrustError(f"{root_path} already exists: a root is never overwritten; choose another --out")
    signed = Signed(root)
    for key in private:
        signed = signed.signed_by(key)
    key_paths = []
    for i, key in enumerate(private, start=1):
        key_paths.append(save_private_key(key, out_dir / f"root-{i}.key", passphrase))
        save_public_key(key.public_key(), out_dir / f"root-{i}.pub")
    write_root(root_path, signed)
    return root_path, signed, key_paths


def next_root(
    current: Root,
    *,
    add_publishers: Sequence[Ed25519PublicKey] = (),
    remove_publishers: Sequence[str] = (),
    publisher_threshold: int | None = None,
    add_root_keys: Sequence[Ed25519PublicKey] = (),
    remove_root_keys: Sequence[str] = (),
    root_threshold: int | None = None,
    timestamp_keys: Sequence[Ed25519PublicKey] | None = None,
    expires_days: int = DEFAULT_ROOT_EXPIRY_DAYS,
    now: datetime | None = None,
) -> Root:
    """The next root version: the changes applied, unsigned. Keys are removed by key id."""
    keys = dict(current.keys) | {
        public_key_id(k): k for k in (*add_publishers, *add_root_keys, *(timestamp_keys or ()))
    }
    roles = {
        "root": _changed(current.role("root"), _ids(add_root_keys), remove_root_keys, root_threshold, "root"),
        "publisher": _changed(
            current.role("publisher"), _ids(add_publishers), remove_publishers, publisher_threshold, "publisher"
        ),
        "timestamp": current.role("timestamp") if timestamp_keys is None else RoleKeys(_ids(timestamp_keys), 1),
    }
    used = {k for role in roles.values() for k in role.keyids}
    return Root(
        current.version + 1,
        _expiry(now, expires_days),
        {k: v for k, v in keys.items() if k in used},
        roles,
        current.freshness_limit_s,
    )


def _changed(
    role: RoleKeys, added: tuple[str, ...], removed: Sequence[str], threshold: int | None, name: str
) -> RoleKeys:
    for keyid in removed:
        if keyid not in role.keyids:
            raise TrustError(
                f"key {keyid[:16]}… is not a {name} key of this root: nothing to remove (`fctkit keys show` lists them)"
            )
    for keyid in added:
        if keyid in role.keyids:
            raise TrustError(f"key {keyid[:16]}… is already a {name} key of this root")
    keyids = tuple(k for k in role.keyids if k not in removed) + added
    return RoleKeys(keyids, role.threshold if threshold is None else threshold)


def _ids(keys: Sequence[Ed25519PublicKey]) -> tuple[str, ...]:
    return tuple(public_key_id(k) for k in keys)


def _key_map(*groups: Sequence[Ed25519PublicKey]) -> dict[str, Ed25519PublicKey]:
    return {public_key_id(k): k for group in groups for k in group}


def _expiry(now: datetime | None, days: int) -> datetime:
    if days < 1:
        raise TrustError(f"an expiry of {days} day(s): give at least 1")
    return (now or datetime.now(UTC)).replace(microsecond=0) + timedelta(days=days)


def load_root_file(path: str | os.PathLike[str]) -> Signed[Root]:
    path = Path(path)
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_ROOT_BYTES + 1)  # parse_root refuses anything longer, unparsed
    except OSError as exc:
        raise TrustError(f"cannot read the root file {path}: {exc.strerror}") from exc
    return parse_root(data, str(path))


def write_root(path: str | os.PathLike[str], signed: Signed[Root], *, replace: bool = False) -> Path:
    """Write a root file atomically; a new one never replaces an existing file."""
    path = Path(path)
    if not replace and path.exists():
        raise TrustError(f"{path} already exists: roots are never overwritten; give another --out")
    return write_atomic(path, signed.to_bytes())


def sign_root_file(path: str | os.PathLike[str], private_key: Ed25519PrivateKey) -> Signed[Root]:
    """Add this key's signature to a root file in place."""
    signed = load_root_file(path).signed_by(private_key)
    write_root(path, signed, replace=True)
    return signed


def sign_withdrawal_file(path: str | os.PathLike[str], private_key: Ed25519PrivateKey) -> Signed[Withdrawal]:
    """Add this key's signature to a withdrawal file in place."""
    path = Path(path)
    signed = parse_withdrawal(read_regular_file(path, MAX_WITHDRAWAL_BYTES), str(path)).signed_by(private_key)
    write_atomic(path, signed.to_bytes())
    return signed


def sign_release(bundle: str | os.PathLike[str], private_key: Ed25519PrivateKey) -> Signature:
    """Add this key's signature over the manifest to a bundle folder's ``manifest.sigs.json``,
    or to a ``.tar`` archive (unpacked, signed and packed again in place)."""
    bundle = Path(bundle)
    if bundle.is_file():
        with tempfile.TemporaryDirectory(prefix="fctkit-sign-", dir=bundle.parent) as scratch:
            signature = sign_release(unpack_bundle(bundle, Path(scratch) / "bundle"), private_key)
            pack_bundle(Path(scratch) / "bundle", bundle)
        return signature
    if not (bundle / SIGNATURE_FILE).exists():
        raise TrustError(
            f"{bundle} is not a bundle folder or archive (no {SIGNATURE_FILE}): give a release's v<N>/ or v<N>.tar"
        )
    manifest_bytes, signatures = read_release_signatures(bundle)
    signature = sign_bytes(manifest_bytes, private_key)
    if any(s.keyid == signature.keyid for s in signatures):
        raise TrustError(f"{bundle} is already signed by key {signature.keyid[:16]}…: another publisher must co-sign")
    co_signers = (*signatures[1:], signature)  # signatures[0] is manifest.sig's
    write_atomic(bundle / SIGNATURES_FILE, release_signatures_bytes(co_signers))
    return signature


__all__ = [
    "DEFAULT_ROOT_EXPIRY_DAYS",
    "PASSPHRASE_ENV",
    "PRIVATE_KEY_FILE",
    "PUBLIC_KEY_FILE",
    "generate_keys",
    "init_root",
    "load_private_key",
    "load_public_key",
    "load_root_file",
    "next_root",
    "public_key_id",
    "read_passphrase",
    "root_file_name",
    "save_private_key",
    "save_public_key",
    "sign_release",
    "sign_root_file",
    "sign_withdrawal_file",
    "withdrawal_file_name",
    "write_root",
    "write_withdrawal",
]
