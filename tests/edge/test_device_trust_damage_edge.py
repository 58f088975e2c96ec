"""Damaged trust files the device can do without (issue 50, item 1): a damaged or missing
``trust/state.json`` is derived again from the intact root files, offline, and a damaged
``publisher.pub`` next to a root from root v1; queries keep answering, ``status`` exits 4 as its
help says, ``repair`` writes the files back. A device that pins only a publisher key, whose key
is damaged, is refused with the key named, never told to put its bundle back."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fctkit.edge_runtime import Device
from fctkit.edge_runtime.device_trust_sync import refresh_trust
from fctkit.export.keys import save_public_key
from fctkit.protos.bundle import load_public_key, public_key_id
from tests.edge.conftest import make_tiny_bundle
from tests.edge.test_device_trust_edge import ROOT_KEYS, Offer, root_v, write
from tests.security.conftest import key, signed, timestamp
from tests.support.device_damage import fctkit

STALE_EXIT, ERROR_EXIT = 4, 2


@pytest.fixture(scope="module")
def alice_v1(tmp_path_factory) -> Path:
    return make_tiny_bundle(tmp_path_factory.mktemp("alice") / "alice-v1", key("alice"), 1, ())


def _filled(root: Path, bundle: Path, images, **pin) -> tuple[Path, str]:
    """A device with ``pin``, ``bundle`` installed and 6 rows; the .npy of 3 queries and the answers to them."""
    with Device.init(root, **pin) as device:
        device.progress = False
        if device.trust.pins_root:  # root v2 walked to, timestamp v5 accepted
            refresh_trust(device.trust, Offer([root_v(1), root_v(2, signers=("r1", "r2"))], timestamp(5, {})))
        device.upgrade([bundle])
        device.add(images(6, seed=3), item_ids=[f"i{n}" for n in range(6)], upload=False)
    np.save(root.parent / "q.npy", images(3, seed=4))
    asked = fctkit("device", "query", "--dir", str(root), str(root.parent / "q.npy"))
    assert asked.code == 0, asked
    return root.parent / "q.npy", asked.stdout


def _status(root: Path) -> tuple[int, dict]:
    run = fctkit("device", "status", "--dir", str(root))
    return run.code, json.loads(run.stdout)


def _flip_key_name(state: Path) -> None:
    state.write_bytes(state.read_bytes().replace(b'"fresh_at"', b'"fresh_au"'))  # one bit: t (0x74) -> u (0x75)


def _flip_first_byte(state: Path) -> None:
    data = bytearray(state.read_bytes())
    data[0] ^= 1
    state.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, timestamp_kept",
    [(_flip_key_name, True), (_flip_first_byte, False), (Path.unlink, False)],
    ids=["key-name", "first-byte", "missing"],
)
def test_a_damaged_trust_state_is_derived_again_offline(
    tmp_path, alice_v1, images, damage: Callable[[Path], None], timestamp_kept: bool
):
    root = tmp_path / "dev"
    queries, answers = _filled(root, alice_v1, images, trust_root=write(tmp_path / "root.1.json", root_v(1)))
    damage(root / "trust" / "state.json")
    asked = fctkit("device", "query", "--dir", str(root), str(queries))
    assert (asked.code, asked.stdout) == (0, answers), asked  # queries keep answering, the same
    code, status = _status(root)
    assert code == STALE_EXIT and "derived again from the intact root files" in status["trust"]["damaged"]
    assert status["trust"]["root_version"] == 2 and "put the published bundle back" not in json.dumps(status)
    repaired = fctkit("device", "repair", "--dir", str(root))
    assert repaired.code == 0, repaired
    assert "derived again from root v2" in json.loads(repaired.stdout)["trust_restored"]["state.json"]
    code, status = _status(root)
    assert code == 0 and "damaged" not in status["trust"]
    assert (status["trust"]["root_version"], status["trust"]["timestamp_version"]) == (2, 5 if timestamp_kept else 0)
    assert fctkit("device", "query", "--dir", str(root), str(queries)).stdout == answers


def test_the_derived_state_walks_only_the_chain_of_intact_roots(tmp_path):
    with Device.init(tmp_path / "dev", trust_root=write(tmp_path / "root.1.json", root_v(1))) as device:
        refresh_trust(device.trust, Offer([root_v(1), root_v(2, signers=("r1", "r2"))], timestamp(5, {})))
    trust = tmp_path / "dev" / "trust"
    write(trust / "root.3.json", root_v(3, root=("m1", "m2"), signers=("m1", "m2")))  # not signed by v2's root keys
    write(trust / "root.5.json", root_v(5))  # skips a version
    (trust / "state.json").unlink()
    with Device.open(tmp_path / "dev") as device:
        assert device.trust.current_root().body.version == 2
        assert [r.body.version for r in device.trust.accepted_roots()] == [2, 1]


def test_a_damaged_publisher_key_next_to_a_root_is_skipped_and_derived_from_root_v1(tmp_path, alice_v1, images):
    moved = write(tmp_path / "root.1.json", signed(root_v(1).body, *ROOT_KEYS, "alice"))  # the move from alice's key
    root = tmp_path / "dev"
    queries, answers = _filled(root, alice_v1, images, trust_root=moved)
    save_public_key(key("alice").public_key(), root / "publisher.pub")
    _flip_first_byte(root / "publisher.pub")
    asked = fctkit("device", "query", "--dir", str(root), str(queries))
    assert (asked.code, asked.stdout) == (0, answers), asked
    code, status = _status(root)
    assert code == STALE_EXIT and "publisher key this device pins, is damaged" in status["trust"]["damaged"]
    assert "put the published bundle back" not in status["trust"]["damaged"]
    repaired = fctkit("device", "repair", "--dir", str(root))
    assert repaired.code == 0 and "publisher.pub" in json.loads(repaired.stdout)["trust_restored"], repaired
    assert public_key_id(load_public_key(root / "publisher.pub")) == public_key_id(key("alice").public_key())
    code, status = _status(root)
    assert code == 0, status["trust"]


def test_a_damaged_pinned_key_without_a_root_is_named_not_blamed_on_the_bundle(tmp_path, alice_v1, images):
    root = tmp_path / "dev"
    pub = save_public_key(key("alice").public_key(), tmp_path / "alice.pub")
    queries, _ = _filled(root, alice_v1, images, publisher_key=pub)
    _flip_first_byte(root / "publisher.pub")
    asked = fctkit("device", "query", "--dir", str(root), str(queries))
    assert asked.code == ERROR_EXIT and "put the publisher key this device pinned back" in asked.stderr, asked
    assert "put the published bundle back" not in asked.stderr
    code, status = _status(root)
    assert code == STALE_EXIT and "publisher.pub" in status["trust"]["damaged"]
