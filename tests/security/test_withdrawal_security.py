"""Signed withdrawals (issue 36, section 3; the document and its offline commands): a release is
withdrawn only by what a threshold of the root's publisher keys signed (or the one key a device
from before roots pins), so a server on its own cannot send devices back."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from click.testing import CliRunner

from fctkit.errors import ThresholdError, TrustError, TrustFormatError
from fctkit.export.keys import save_private_key
from fctkit.export.keys_cli import keys_command
from fctkit.protos.trust import MAX_WITHDRAWAL_BYTES, Signed, Withdrawal, parse_withdrawal, verify_withdrawal
from tests.security.conftest import build_root, key, signed

TWO_OF_THREE = signed(
    build_root(1, root=("r1",), root_threshold=1, publishers=("alice", "bob", "carol"), publisher_threshold=2), "r1"
)
MOMENT = datetime(2027, 3, 1, tzinfo=UTC)


def keys(*args) -> str:
    result = CliRunner().invoke(keys_command, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_a_withdrawal_needs_the_publisher_threshold_and_keys_sign_adds_one(tmp_path):
    alice, bob = (save_private_key(key(n), tmp_path / f"{n}.key") for n in ("alice", "bob"))
    path = tmp_path / "withdrawal.3.json"
    assert "devices go back to v2" in keys(
        "withdraw", 3, "--reason", "bad adapter for the fleet", "--key", alice, "--out", path
    )
    with pytest.raises(ThresholdError, match="1 valid signature"):
        verify_withdrawal(TWO_OF_THREE, parse_withdrawal(path.read_bytes()))
    assert "2 signature(s)" in keys("sign", path, "--key", bob)
    withdrawal = verify_withdrawal(TWO_OF_THREE, parse_withdrawal(path.read_bytes()))
    assert (withdrawal.body.version, withdrawal.body.revert_to, withdrawal.body.reason) == (
        3,
        2,
        "bad adapter for the fleet",
    )
    assert verify_withdrawal(key("alice").public_key(), withdrawal) is withdrawal  # a device pinning alice's key
    with pytest.raises(TrustError, match="already exists"):
        keys("withdraw", 3, "--reason", "again", "--key", alice, "--out", path)


def test_keys_outside_the_role_a_changed_field_or_a_legacy_other_key_count_for_nothing():
    body = Withdrawal(3, 2, "bad adapter", MOMENT)
    with pytest.raises(ThresholdError, match="outside the role"):
        verify_withdrawal(TWO_OF_THREE, signed(body, "alice", "mallory"))
    document = json.loads(signed(body, "alice", "bob").to_bytes())
    document["signed"]["revert_to"] = 1  # the server picks another version to go back to
    with pytest.raises(ThresholdError, match="0 valid signature"):
        verify_withdrawal(TWO_OF_THREE, parse_withdrawal(json.dumps(document).encode()))
    with pytest.raises(ThresholdError, match="pinned publisher key"):
        verify_withdrawal(key("alice").public_key(), signed(body, "bob"))


@pytest.mark.parametrize(
    "version, revert_to, reason, message",
    [
        (3, 3, "x", "earlier version"),
        (3, 4, "x", "earlier version"),
        (0, 0, "x", "start at 1"),
        (3, 2, "  ", "reason"),
        (3, 2, "r" * 1025, "reason"),
    ],
)
def test_a_malformed_withdrawal_is_refused(version, revert_to, reason, message):
    with pytest.raises(TrustFormatError, match=message):
        Withdrawal(version, revert_to, reason, MOMENT)


def test_an_oversized_or_foreign_document_is_refused_unread():
    with pytest.raises(TrustFormatError, match="refused unread"):
        parse_withdrawal(b"{" + b" " * MAX_WITHDRAWAL_BYTES + b"}")
    root_bytes = TWO_OF_THREE.to_bytes()
    with pytest.raises(TrustError, match="not a 'withdrawal'"):
        parse_withdrawal(root_bytes)
    assert isinstance(parse_withdrawal(Signed(Withdrawal(2, 1, "r", MOMENT)).to_bytes()).body, Withdrawal)
