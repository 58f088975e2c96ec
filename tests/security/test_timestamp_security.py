"""The timestamp (issue 35): signed by the root's timestamp role, never older than the last one
accepted (replay, rollback), expired beyond the clock tolerance refused, a device without a
fresh one for longer than the root's limit stale ("possible freeze"), and every manifest checked
against the snapshot it names (mix-and-match)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from fctkit.errors import (
    ExpiredMetadataError,
    HashMismatchError,
    MetadataRollbackError,
    SnapshotMismatchError,
    ThresholdError,
    TrustFormatError,
)
from fctkit.protos.trust import (
    MAX_TIMESTAMP_BYTES,
    freshness,
    parse_timestamp,
    verify_snapshot_manifest,
    verify_timestamp,
)
from tests.security.conftest import NOW, build_root, signed, timestamp

MANIFEST_V2 = b'{"version":2,"snapshot":"a"}'
MANIFEST_V3 = b'{"version":3,"snapshot":"b"}'


@pytest.fixture
def root():
    return signed(build_root(1, root=("r1",), root_threshold=1, freshness_s=7 * 86400), "r1")


def received(document):
    """What a device holds after downloading: the parsed bytes, not the object the server built."""
    return parse_timestamp(document.to_bytes())


def test_a_fresh_timestamp_by_the_timestamp_key_is_accepted(root):
    ts = received(timestamp(5, {2: MANIFEST_V2}))
    assert verify_timestamp(root, ts, last_accepted_version=4, now=NOW).body.version == 5
    assert verify_timestamp(root, ts, last_accepted_version=5, now=NOW).body.version == 5  # the same one again


def test_a_replayed_older_timestamp_is_refused(root):
    with pytest.raises(MetadataRollbackError, match="timestamp v4 is older than the v5 this device already accepted"):
        verify_timestamp(root, received(timestamp(4, {2: MANIFEST_V2})), last_accepted_version=5, now=NOW)


def test_an_expired_timestamp_is_refused_beyond_the_tolerance(root):
    ts = received(timestamp(6, {2: MANIFEST_V2}, expires=NOW - timedelta(seconds=100)))
    assert verify_timestamp(root, ts, 5, NOW, clock_tolerance_s=300).body.version == 6
    with pytest.raises(ExpiredMetadataError, match="if the clock is wrong, set it"):
        verify_timestamp(root, ts, 5, NOW, clock_tolerance_s=60)


def test_a_timestamp_signed_by_another_key_is_refused(root):
    """The publisher's or a root key cannot stand in for the timestamp role, nor can a stranger's."""
    for signer in ("r1", "mallory"):
        with pytest.raises(ThresholdError, match="timestamp keys of root v1"):
            verify_timestamp(root, received(timestamp(6, {}, signer=signer)), 5, NOW)


def test_a_device_without_a_fresh_timestamp_past_the_limit_is_stale(root):
    fresh = freshness(root.body, last_fresh_at=NOW - timedelta(days=6), now=NOW)
    assert not fresh.stale and fresh.describe().startswith("fresh")
    frozen = freshness(root.body, last_fresh_at=NOW - timedelta(days=8), now=NOW)
    assert frozen.stale and frozen.describe().startswith("stale: possible freeze")


def test_a_manifest_from_another_snapshot_is_refused(root):
    """Mix-and-match: the v3 manifest the server hands over is not the one this timestamp names."""
    ts = received(timestamp(7, {2: MANIFEST_V2, 3: MANIFEST_V3})).body
    verify_snapshot_manifest(ts, 3, MANIFEST_V3)
    other_snapshot = b'{"version":3,"snapshot":"c"}'
    with pytest.raises(SnapshotMismatchError, match="is not the one timestamp v7 names") as caught:
        verify_snapshot_manifest(ts, 3, other_snapshot)
    assert isinstance(caught.value, HashMismatchError)  # what a device catching bundle damage catches
    with pytest.raises(SnapshotMismatchError, match="v4 is not in the snapshot"):
        verify_snapshot_manifest(ts, 4, MANIFEST_V3)


def test_an_oversized_timestamp_is_refused_before_it_is_parsed():
    with pytest.raises(TrustFormatError, match="refused unread"):
        parse_timestamp(b"[" + b"1," * MAX_TIMESTAMP_BYTES + b"1]")


def test_releases_out_of_order_are_refused():
    document = json.loads(timestamp(1, {2: MANIFEST_V2, 3: MANIFEST_V3}).to_bytes())
    document["signed"]["releases"].reverse()
    with pytest.raises(TrustFormatError, match="once each, by increasing version"):
        parse_timestamp(json.dumps(document).encode())
