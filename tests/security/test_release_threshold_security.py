"""Releases co-signed by k of n publishers (issue 35): only distinct keys of the root's
publisher role count; a key the root dropped, a stranger's key or a second signature by one
key adds nothing; the co-signatures travel in manifest.sigs.json beside the single
manifest.sig, which stays valid for devices that pin one publisher key."""

from __future__ import annotations

import pytest

from fctkit.errors import ReleaseSignatureError, SignatureError, TrustError, TrustFormatError
from fctkit.export.keys import sign_release
from fctkit.protos.bundle import SIGNATURE_FILE, pack_bundle, unpack_bundle, verify_bundle
from fctkit.protos.bundle_vocabulary import SIGNATURES_FILE
from fctkit.protos.trust import MAX_SIGNATURES_BYTES, Signature, read_release_signatures, sign_bytes, verify_release
from tests.security.conftest import build_root, key, kid, signed

PUBLISHERS = ("alice", "bob", "carol")


def root_with(publishers=PUBLISHERS, threshold=2, version=1):
    return signed(
        build_root(version, root=("r1",), root_threshold=1, publishers=publishers, publisher_threshold=threshold), "r1"
    )


@pytest.fixture
def release(tmp_path, make_bundle):
    """A real v2 bundle built and signed (manifest.sig) by alice."""
    return make_bundle(tmp_path / "v2", key("alice")).root


def test_two_of_three_publishers_are_accepted_and_one_is_not(release):
    manifest, alone = read_release_signatures(release)
    with pytest.raises(ReleaseSignatureError, match=r"1 valid signature\(s\) of the 2 needed from its 3") as caught:
        verify_release(root_with(), manifest, alone)
    assert isinstance(caught.value, SignatureError)  # what devices already catch for a bad bundle
    sign_release(release, key("bob"))
    manifest, both = read_release_signatures(release)
    assert verify_release(root_with(), manifest, both) == {kid("alice"), kid("bob")}


def test_a_co_signed_bundle_still_verifies_under_its_single_pinned_key_and_packs_whole(release, tmp_path):
    sign_release(release, key("bob"))
    assert verify_bundle(release, key("alice").public_key()).manifest.version == 2
    archive = pack_bundle(release, tmp_path / "v2.tar")
    unpacked = unpack_bundle(archive, tmp_path / "unpacked")
    assert (unpacked / SIGNATURES_FILE).read_bytes() == (release / SIGNATURES_FILE).read_bytes()
    assert verify_bundle(unpacked, key("alice").public_key()).manifest.version == 2


def test_an_archive_is_co_signed_in_place(release, tmp_path):
    archive = pack_bundle(release, tmp_path / "v2.tar")
    sign_release(archive, key("carol"))
    manifest, signatures = read_release_signatures(unpack_bundle(archive, tmp_path / "unpacked"))
    assert verify_release(root_with(), manifest, signatures) == {kid("alice"), kid("carol")}


def test_a_removed_publisher_key_does_not_count(release):
    sign_release(release, key("bob"))
    manifest, signatures = read_release_signatures(release)
    without_bob = root_with(publishers=("alice", "carol"), version=2)
    with pytest.raises(ReleaseSignatureError, match=r"1 valid .* outside the role do not count"):
        verify_release(without_bob, manifest, signatures)


def test_a_root_or_timestamp_key_cannot_stand_in_for_a_publisher(release):
    """The server holds the timestamp key: it must not be able to make up a publisher's signature."""
    manifest, signatures = read_release_signatures(release)
    root = signed(
        build_root(1, root=("r1",), root_threshold=1, publishers=PUBLISHERS, publisher_threshold=2, timestamp=("ts",)),
        "r1",
    )
    for other in ("r1", "ts"):
        with pytest.raises(ReleaseSignatureError, match="1 valid signature"):
            verify_release(root, manifest, (*signatures, sign_bytes(manifest, key(other))))


def test_duplicate_signatures_by_one_key_count_once(release):
    manifest, signatures = read_release_signatures(release)
    again = sign_bytes(manifest, key("alice"))
    with pytest.raises(ReleaseSignatureError, match="1 valid signature"):
        verify_release(root_with(), manifest, (*signatures, again, again))
    with pytest.raises(TrustError, match="already signed by key"):
        sign_release(release, key("alice"))


def test_a_signature_claiming_a_publisher_it_is_not_does_not_count(release):
    manifest, signatures = read_release_signatures(release)
    forged = Signature(kid("bob"), key("mallory").sign(manifest))
    with pytest.raises(ReleaseSignatureError, match="1 valid signature"):
        verify_release(root_with(), manifest, (*signatures, forged))


def test_an_oversized_signature_list_is_refused_before_it_is_parsed(release):
    (release / SIGNATURES_FILE).write_bytes(b'{"signatures":[' + b" " * MAX_SIGNATURES_BYTES + b"]}")
    with pytest.raises(TrustFormatError, match=f"larger than the {MAX_SIGNATURES_BYTES} bytes allowed"):
        read_release_signatures(release)


def test_a_bundle_without_its_manifest_signature_is_not_co_signed(release):
    (release / SIGNATURE_FILE).unlink()
    with pytest.raises(TrustError, match="not a bundle folder or archive"):
        sign_release(release, key("bob"))
