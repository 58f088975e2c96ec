"""Fixtures for the trust tests (issue 35): deterministic Ed25519 keys by name, a fixed "now",
roots and timestamps built and signed with real keys, and real signed bundles (the export
tests' tiny ONNX graphs)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fctkit.protos.bundle import public_key_id
from fctkit.protos.trust import RoleKeys, Root, Signed, Timestamp, make_timestamp
from tests.export.conftest import _make_bundle

NOW = datetime(2027, 3, 1, 12, 0, 0, tzinfo=UTC)


def key(name: str) -> Ed25519PrivateKey:
    """The same private key for the same name, in every test."""
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(name.encode()).digest())


def kid(name: str) -> str:
    return public_key_id(key(name).public_key())


def build_root(
    version: int,
    *,
    root: Sequence[str],
    root_threshold: int,
    publishers: Sequence[str] = (),
    publisher_threshold: int = 1,
    timestamp: Sequence[str] = ("ts",),
    expires: datetime = NOW + timedelta(days=365),
    freshness_s: int = 7 * 86400,
) -> Root:
    names = {*root, *publishers, *timestamp}
    return Root(
        version,
        expires,
        {kid(n): key(n).public_key() for n in names},
        {
            "root": RoleKeys(tuple(kid(n) for n in root), root_threshold),
            "publisher": RoleKeys(tuple(kid(n) for n in publishers), publisher_threshold),
            "timestamp": RoleKeys(tuple(kid(n) for n in timestamp), 1),
        },
        freshness_s,
    )


def signed(body: Root | Timestamp, *signers: str) -> Signed:
    document = Signed(body)
    for name in signers:
        document = document.signed_by(key(name))
    return document


def timestamp(
    version: int, manifests: dict[int, bytes], *, expires: datetime = NOW + timedelta(days=1), signer: str = "ts"
) -> Signed[Timestamp]:
    return signed(make_timestamp(version, expires, manifests), signer)


@pytest.fixture
def make_bundle():
    """``make_bundle(out_dir, private_key, *, version=2, seed=0)``: a real signed bundle of tiny ONNX graphs."""
    return _make_bundle
