"""Root rotation and pinning (issue 35): a root is accepted only exactly one version after the
trusted one, signed by a threshold of the trusted root's root keys AND of its own; only the last
root of a walk must not have expired; a device pins a root by its fingerprint; every root file
is size-limited and strictly parsed before anything is believed."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from fctkit.errors import ExpiredMetadataError, RootChainError, ThresholdError, TrustFormatError
from fctkit.protos.trust import (
    MAX_ROOT_BYTES,
    parse_root,
    pin_root,
    root_fingerprint,
    timestamp_version_floor,
    verify_root_update,
    walk_root_chain,
)
from tests.security.conftest import NOW, build_root, signed

OLD, NEW = ("r1", "r2", "r3"), ("n1", "n2", "n3")


@pytest.fixture
def v1():
    return signed(build_root(1, root=OLD, root_threshold=2), "r1", "r2", "r3")


def rotated(*signers: str, version: int = 2, **changes):
    return signed(build_root(version, root=NEW, root_threshold=2, **changes), *signers)


def test_a_root_signed_by_thresholds_of_the_old_and_the_new_keys_is_accepted(v1):
    new = rotated("r1", "r3", "n1", "n2")
    assert verify_root_update(v1, new) is new
    walk = walk_root_chain(v1, [new.to_bytes()], NOW)
    assert walk.root.body.version == 2 and not walk.timestamp_keys_rotated


def test_a_root_signed_by_the_old_keys_only_is_refused(v1):
    with pytest.raises(ThresholdError, match=r"root v2 \(its own root keys\) has 0 valid signature\(s\) of the 2"):
        verify_root_update(v1, rotated("r1", "r2", "r3"))


def test_a_root_signed_by_the_new_keys_only_is_refused(v1):
    with pytest.raises(ThresholdError, match=r"root keys of the trusted v1\) has 0 valid"):
        verify_root_update(v1, rotated("n1", "n2", "n3"))


def test_one_old_key_below_the_threshold_does_not_carry_a_rotation(v1):
    with pytest.raises(ThresholdError, match="1 valid signature"):
        verify_root_update(v1, rotated("r1", "n1", "n2"))


def test_a_skipped_root_version_is_refused(v1):
    with pytest.raises(RootChainError, match=r"root v3 skips a version after the trusted v1: .*fetch root v2 first"):
        verify_root_update(v1, rotated("r1", "r2", "n1", "n2", version=3))


def test_a_replayed_root_version_is_refused(v1):
    with pytest.raises(RootChainError, match="root v1 is not newer"):
        verify_root_update(v1, signed(build_root(1, root=OLD, root_threshold=2), "r1", "r2"))


def test_only_the_last_root_of_a_walk_must_not_have_expired(v1):
    expired_v2 = rotated("r1", "r2", "n1", "n2", expires=NOW - timedelta(days=30))
    v3 = signed(build_root(3, root=NEW, root_threshold=2), "n1", "n2")
    assert walk_root_chain(v1, [expired_v2.to_bytes(), v3.to_bytes()], NOW).root.body.version == 3
    with pytest.raises(
        ExpiredMetadataError, match=r"root v2 expired at .*this device's clock reads 2027-03-01T12:00:00Z"
    ):
        walk_root_chain(v1, [expired_v2.to_bytes()], NOW)


def test_the_clock_tolerance_is_applied_to_the_root_expiry(v1):
    v2 = rotated("r1", "r2", "n1", "n2", expires=NOW - timedelta(seconds=60))
    assert walk_root_chain(v1, [v2.to_bytes()], NOW, clock_tolerance_s=120).root.body.version == 2
    with pytest.raises(ExpiredMetadataError):
        walk_root_chain(v1, [v2.to_bytes()], NOW, clock_tolerance_s=30)


def test_a_rotated_timestamp_key_resets_the_remembered_timestamp_version(v1):
    """Fast-forward recovery (TUF 5.3.11): a leaked timestamp key may have signed version 10**9;
    once the root replaces it, the device must accept the new key's low versions again."""
    v2 = rotated("r1", "r2", "n1", "n2", timestamp=("ts-new",))
    walk = walk_root_chain(v1, [v2.to_bytes()], NOW)
    assert walk.timestamp_keys_rotated and timestamp_version_floor(walk, 10**9) == 0
    same = walk_root_chain(v1, [rotated("r1", "r2", "n1", "n2").to_bytes()], NOW)
    assert timestamp_version_floor(same, 41) == 41


def test_a_device_pins_the_root_its_fingerprint_names(v1):
    assert pin_root(v1.to_bytes(), root_fingerprint(v1)).body == v1.body
    other = signed(build_root(1, root=NEW, root_threshold=2), "n1", "n2")
    with pytest.raises(RootChainError, match=r"not the .* this device was given: refused"):
        pin_root(other.to_bytes(), root_fingerprint(v1))
    with pytest.raises(RootChainError, match="--root-fingerprint"):
        pin_root(v1.to_bytes(), None)
    assert pin_root(v1.to_bytes(), None, trust_on_first_use=True).body == v1.body


def test_a_pinned_root_must_carry_its_own_threshold(v1):
    with pytest.raises(ThresholdError, match="1 valid signature"):
        pin_root(signed(v1.body, "r1").to_bytes(), root_fingerprint(v1))


def test_the_fingerprint_does_not_change_as_signatures_are_added(v1):
    assert root_fingerprint(signed(v1.body, "r1")) == root_fingerprint(v1)


def test_an_oversized_root_is_refused_before_it_is_parsed():
    data = b"{" + b" " * MAX_ROOT_BYTES + b"}"
    with pytest.raises(TrustFormatError, match=rf"more than the {MAX_ROOT_BYTES} allowed: refused unread"):
        parse_root(data)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: d["signed"].update(extra=1), "unknown key"),
        (lambda d: d["signed"].update(version=True), "expected int"),
        (lambda d: d["signed"].update(_type="timestamp"), "not a 'root' one"),
        (lambda d: d["signed"]["roles"]["root"].update(threshold=4), "can never be met"),
        (lambda d: d["signed"].update(expires="2027-02-30T00:00:00Z"), "not a real date"),
    ],
)
def test_a_malformed_root_is_refused_with_what_is_wrong(v1, damage, message):
    document = json.loads(v1.to_bytes())
    damage(document)
    with pytest.raises(TrustFormatError, match=message):
        parse_root(json.dumps(document).encode())


def test_a_key_named_twice_in_one_object_is_refused(v1):
    data = v1.to_bytes().replace(b'{"signatures":', b'{"signatures":[],"signatures":', 1)
    with pytest.raises(TrustFormatError, match="a key appears twice"):
        parse_root(data)


def test_a_root_file_round_trips_to_the_same_bytes(v1):
    assert parse_root(v1.to_bytes()).to_bytes() == v1.to_bytes()
