"""Moving a device that pinned one publisher key (``publisher.pub``) to a root (issue 35, part 4),
and the single check a bundle's signatures go through under either trust (a key or a root)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from fctkit.errors import BundleFormatError, ReleaseSignatureError, RootChainError, ThresholdError, TrustError
from fctkit.export.keys import save_private_key, sign_release
from fctkit.export.keys_cli import keys_command
from fctkit.protos.bundle import verify_bundle
from fctkit.protos.bundle_vocabulary import SIGNATURES_FILE
from fctkit.protos.trust import Signed, verify_migration
from tests.security.conftest import build_root, key, signed


def migration_root(*signers: str, publishers=("old-publisher",), version: int = 1) -> Signed:
    body = build_root(version, root=("r1", "r2"), root_threshold=2, publishers=publishers)
    return signed(body, *signers)


def test_a_root_v1_signed_by_the_pinned_key_and_its_own_root_keys_is_accepted():
    root = migration_root("r1", "r2", "old-publisher")
    assert verify_migration(key("old-publisher").public_key(), root) is root


@pytest.mark.parametrize(
    "case, signers, publishers, version, error, message",
    [
        ("not signed by the pinned key", ("r1", "r2"), ("old-publisher",), 1, ThresholdError, "publisher key"),
        (
            "signed by another publisher",
            ("r1", "r2", "mallory"),
            ("mallory",),
            1,
            RootChainError,
            "does not list this device",
        ),
        (
            "below its own root threshold",
            ("r1", "old-publisher"),
            ("old-publisher",),
            1,
            ThresholdError,
            "its own root keys",
        ),
        ("not root v1", ("r1", "r2", "old-publisher"), ("old-publisher",), 2, RootChainError, "root v1 first"),
    ],
)
def test_a_migration_root_is_refused(case, signers, publishers, version, error, message):
    root = migration_root(*signers, publishers=publishers, version=version)
    with pytest.raises(error, match=message):
        verify_migration(key("old-publisher").public_key(), root)


def test_the_publisher_adds_the_migration_signature_with_keys_sign(tmp_path):
    body = build_root(1, root=("r1", "r2"), root_threshold=2, publishers=("old-publisher",))
    root_file = tmp_path / "root.1.json"
    root_file.write_bytes(signed(body, "r1", "r2").to_bytes())
    publisher_key = save_private_key(key("old-publisher"), tmp_path / "publisher.key")
    result = CliRunner().invoke(
        keys_command, ["sign", str(root_file), "--key", str(publisher_key)], catch_exceptions=False
    )
    assert result.exit_code == 0 and "migration signature" in result.output
    from fctkit.export.keys import load_root_file

    verify_migration(key("old-publisher").public_key(), load_root_file(root_file))


def test_a_publisher_key_cannot_sign_a_later_root(tmp_path):
    body = build_root(2, root=("r1", "r2"), root_threshold=2, publishers=("old-publisher",))
    root_file = tmp_path / "root.2.json"
    root_file.write_bytes(signed(body, "r1", "r2").to_bytes())
    before = root_file.read_bytes()
    with pytest.raises(TrustError, match="not a root key"):
        CliRunner().invoke(
            keys_command,
            ["sign", str(root_file), "--key", str(save_private_key(key("old-publisher"), tmp_path / "publisher.key"))],
            catch_exceptions=False,
        )
    assert root_file.read_bytes() == before


def test_a_bundle_verifies_under_the_legacy_key_and_under_a_root_threshold(tmp_path, make_bundle):
    bundle = make_bundle(tmp_path / "v2", key("alice")).root
    assert verify_bundle(bundle, key("alice").public_key()).manifest.version == 2
    two_of_three = signed(
        build_root(1, root=("r1",), root_threshold=1, publishers=("alice", "bob", "carol"), publisher_threshold=2), "r1"
    )
    with pytest.raises(ReleaseSignatureError, match="1 valid signature"):
        verify_bundle(bundle, two_of_three)
    sign_release(bundle, key("bob"))
    assert verify_bundle(bundle, two_of_three).manifest.version == 2
    assert (
        verify_bundle(bundle, key("alice").public_key()).manifest.version == 2
    )  # co-signatures do not bother the legacy check


def test_manifest_sig_by_a_key_outside_the_root_counts_for_nothing(tmp_path, make_bundle):
    bundle = make_bundle(tmp_path / "v2", key("mallory")).root
    sign_release(bundle, key("bob"))
    root = signed(
        build_root(1, root=("r1",), root_threshold=1, publishers=("alice", "bob"), publisher_threshold=2), "r1"
    )
    with pytest.raises(ReleaseSignatureError, match="1 valid signature"):
        verify_bundle(bundle, root)


def test_an_oversized_co_signature_file_is_refused_before_it_is_parsed(tmp_path, make_bundle):
    bundle = make_bundle(tmp_path / "v2", key("alice")).root
    (bundle / SIGNATURES_FILE).write_bytes(b"{" + b" " * (70 << 10) + b"}")
    root = signed(build_root(1, root=("r1",), root_threshold=1, publishers=("alice",)), "r1")
    with pytest.raises(BundleFormatError, match="larger than the 65536 bytes allowed"):
        verify_bundle(bundle, root)
