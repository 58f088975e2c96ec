"""A device's root of trust (issue 35), on real device folders with real Ed25519 keys: the trust
files (atomic, private, damage refused with the file named and no fallback), `device init
--root`, the enrolment choices (--root / --root-fingerprint / --trust-on-first-use, checked
before anything is written, and refused against a real server on loopback that has no root),
the walk and the timestamp at each sync, the move of a device pinning publisher.pub to a root,
installed bundles under every accepted root, freshness with an injected clock, and the stale
exit code of `fctkit device status`.

The state-level tests hand the device what GetTrust answers (the client's own TrustUpdate) from
:class:`Offer`; the last ones run against a real `fctkit serve --root` on loopback."""

from __future__ import annotations

import json
import os
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from fctkit.edge_runtime import Device, DeviceSettings, device_trust
from fctkit.edge_runtime.cli import STALE_EXIT, device_command
from fctkit.edge_runtime.device_trust_sync import refresh_trust
from fctkit.errors import (
    DeviceError,
    ExpiredMetadataError,
    InputError,
    MetadataRollbackError,
    ReleaseSignatureError,
    RootChainError,
    RpcStatusError,
    ThresholdError,
    TrustError,
)
from fctkit.export.keys import save_private_key, save_public_key
from fctkit.protos.bundle import load_public_key, public_key_id
from fctkit.protos.client import FctkitClient, TrustUpdate
from fctkit.protos.trust import Root, Signed, Timestamp, root_fingerprint
from tests.edge.conftest import ADMIN_TOKEN, ServerProcess, enrolment_code, make_tiny_bundle, publish
from tests.security.conftest import NOW, build_root, key, signed, timestamp

ROOT_KEYS = ("r1", "r2", "r3")


def root_v(version: int, *, publishers=("alice",), ts=("ts",), root=ROOT_KEYS, signers=ROOT_KEYS) -> Signed[Root]:
    return signed(build_root(version, root=root, root_threshold=2, publishers=publishers, timestamp=ts), *signers)


class Offer:
    """What a server's GetTrust answers: its roots after the asked version and its timestamp, or
    FAILED_PRECONDITION when it has no root (``roots=None``)."""

    def __init__(self, roots: list[Signed[Root]] | None, stamp: Signed[Timestamp] | None = None) -> None:
        self.roots, self.stamp = roots, stamp

    def get_trust(self, after_root_version: int = 0) -> TrustUpdate:
        if self.roots is None:
            raise RpcStatusError("FAILED_PRECONDITION", "this server has no root of trust")
        return TrustUpdate(
            [r.to_bytes() for r in self.roots[after_root_version:]], self.stamp.to_bytes(), len(self.roots)
        )


def write(path: Path, document: Signed) -> Path:
    path.write_bytes(document.to_bytes())
    return path


@pytest.fixture
def root_file(tmp_path) -> Path:
    return write(tmp_path / "root.1.json", root_v(1))


@pytest.fixture
def rooted(tmp_path, root_file):
    """A device that pinned root v1 (`init --root`), its clock at NOW."""
    device = Device.init(tmp_path / "dev", trust_root=root_file)
    device.progress, device.trust.clock = False, lambda: NOW
    yield device
    device.close()


def folder_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".sqlite" not in p.name
    }


# -- the trust files ------------------------------------------------------------------------


def test_init_root_pins_the_root_privately_and_status_shows_it(rooted, root_file):
    trust = rooted.root / "trust"
    assert sorted(p.name for p in trust.iterdir()) == ["root.1.json", "state.json"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in trust.iterdir())
    assert stat.S_IMODE(trust.stat().st_mode) == 0o700
    status = rooted.status()["trust"]
    assert status["root_version"] == 1 and status["timestamp_version"] == 0 and not status["stale"]
    assert status["root_fingerprint"] == root_fingerprint(root_v(1))[:16]
    assert status["freshness"] == "no timestamp accepted yet: sync with the server"
    assert not (rooted.root / "publisher.pub").exists()


def test_init_refuses_a_root_below_its_own_threshold_and_both_pins_creating_nothing(tmp_path, publisher_pub):
    weak = write(tmp_path / "weak.json", root_v(1, signers=("r1",)))
    with pytest.raises(ThresholdError, match=r"the root v1 \(its own root keys\) has 1 valid signature"):
        Device.init(tmp_path / "a", trust_root=weak)
    with pytest.raises(DeviceError, match="not both"):
        Device.init(tmp_path / "b", trust_root=write(tmp_path / "r.json", root_v(1)), publisher_key=publisher_pub)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    result = CliRunner().invoke(
        device_command,
        [
            "init",
            "--dir",
            str(tmp_path / "c"),
            "--root",
            str(tmp_path / "r.json"),
            "--publisher-key",
            str(publisher_pub),
        ],
    )
    assert result.exit_code == 2 and "exclude each other" in result.output and not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "damage, named",
    [
        (
            lambda t: (t / "root.1.json").write_bytes(
                (t / "root.1.json").read_bytes().replace(b'"version":1', b'"version":2')
            ),
            "root.1.json is damaged or missing",
        ),
        (lambda t: (t / "root.1.json").unlink(), "root.1.json is damaged or missing"),
    ],
)
def test_damaged_trust_files_are_named_and_nothing_else_is_trusted(rooted, publisher_pub, damage, named):
    """A damaged root; a damaged state.json is derived again from the roots (test_device_trust_damage_edge)."""
    (rooted.root / "publisher.pub").write_bytes(publisher_pub.read_bytes())  # a key it could wrongly fall back to
    damage(rooted.root / "trust")
    reopened = Device.open(rooted.root)
    try:
        for attempt in (
            reopened.trust.release_trust,
            reopened.trust.accepted_trusts,
            lambda: refresh_trust(reopened.trust, Offer([root_v(1)], timestamp(1, {}))),
        ):
            with pytest.raises(TrustError, match=named) as error:
                attempt()
            assert "enrol again" in str(error.value)
        status = reopened.status()["trust"]
        assert named in status["damaged"] and device_trust.trust_alarm(status)
    finally:
        reopened.close()


def test_a_crash_between_the_roots_and_the_state_leaves_the_old_state(rooted, monkeypatch):
    offer = Offer([root_v(1), root_v(2, signers=("r1", "r2"))], timestamp(1, {}))
    real_write = device_trust.write_atomic

    def crash_on_state(path: Path, data: bytes, **options) -> Path:
        if path.name == "state.json":
            raise OSError("power lost")
        return real_write(path, data, **options)

    monkeypatch.setattr(device_trust, "write_atomic", crash_on_state)
    with pytest.raises(OSError, match="power lost"):
        refresh_trust(rooted.trust, offer)
    assert (rooted.root / "trust" / "root.2.json").exists()  # written first …
    assert rooted.trust.state().root_version == 1 and rooted.trust.current_root().body.version == 1  # … pointed at last
    monkeypatch.undo()
    refresh_trust(rooted.trust, offer)  # the next sync finishes the job
    assert rooted.trust.state().root_version == 2 and rooted.trust.state().timestamp_version == 1


# -- the walk and the timestamp at each sync -------------------------------------------------


def test_a_sync_walks_the_rotation_and_refuses_what_breaks_a_rule_changing_nothing(rooted):
    trust = rooted.trust
    refresh_trust(trust, Offer([root_v(1), root_v(2, signers=("r1", "r2"))], timestamp(5, {})))
    assert (trust.state().root_version, trust.state().timestamp_version, trust.state().fresh_at) == (2, 5, NOW)
    assert [r.body.version for r in trust.accepted_roots()] == [2, 1]
    before = folder_files(rooted.root / "trust")
    new_keys = root_v(3, root=("n1", "n2"), signers=("n1", "n2"))
    refusals = [
        (Offer([root_v(1), root_v(2, signers=("r1", "r2")), new_keys], timestamp(5, {})), ThresholdError, "trusted v2"),
        (
            Offer([root_v(1), root_v(2, signers=("r1", "r2")), root_v(4)], timestamp(5, {})),
            RootChainError,
            "skips a version",
        ),
        (
            Offer([root_v(1), root_v(2, signers=("r1", "r2"))], timestamp(4, {})),
            MetadataRollbackError,
            "older than the v5",
        ),
        (
            Offer([root_v(1), root_v(2, signers=("r1", "r2"))], timestamp(6, {}, signer="mallory")),
            ThresholdError,
            "timestamp v6",
        ),
        (Offer(None), RootChainError, "serves no root of trust"),
    ]
    for offer, error, message in refusals:
        with pytest.raises(error, match=message):
            refresh_trust(trust, offer)
        assert folder_files(rooted.root / "trust") == before
        assert message.split()[0] in trust.status()["last_refusal"]
    refresh_trust(trust, Offer([root_v(1), root_v(2, signers=("r1", "r2"))], timestamp(5, {})))  # the same again: fine
    assert "last_refusal" not in trust.status()


def test_a_timestamp_key_rotation_lets_the_version_start_again(rooted):
    refresh_trust(rooted.trust, Offer([root_v(1)], timestamp(900, {})))
    rotated = root_v(2, ts=("ts2",), signers=("r1", "r2"))
    refresh_trust(rooted.trust, Offer([root_v(1), rotated], timestamp(1, {}, signer="ts2")))
    assert rooted.trust.state().timestamp_version == 1


def test_the_same_timestamp_again_is_checked_for_expiry_and_its_freshness_written_now_and_then(rooted):
    """Most syncs get the timestamp already accepted: only its expiry is checked, and ``fresh_at``
    reaches state.json at most every thousandth of the freshness limit (604.8 s for 7 days)."""
    trust, clock = rooted.trust, [NOW]
    trust.clock = lambda: clock[0]
    offer = Offer([root_v(1)], timestamp(4, {}, expires=NOW + timedelta(days=2)))
    refresh_trust(trust, offer)
    state_file = rooted.root / "trust" / "state.json"
    written = state_file.read_bytes()
    clock[0] = NOW + timedelta(seconds=600)
    refresh_trust(trust, offer)
    assert state_file.read_bytes() == written and trust.state().fresh_at == clock[0]  # in memory only
    with Device.open(rooted.root) as reopened:  # a crash now: an older fresh_at, never a newer one
        assert reopened.trust.state().fresh_at == NOW
    clock[0] = NOW + timedelta(seconds=610)
    refresh_trust(trust, offer)
    assert device_trust.TrustState.from_bytes(state_file.read_bytes()).fresh_at == clock[0]
    clock[0] = NOW + timedelta(days=3)  # the same bytes, expired: refused like any expired timestamp
    with pytest.raises(ExpiredMetadataError, match="timestamp v4 expired"):
        refresh_trust(trust, offer)
    tampered = Offer([root_v(1)], Signed(timestamp(4, {}, expires=NOW + timedelta(days=9)).body))
    clock[0] = NOW + timedelta(seconds=620)
    with pytest.raises(ThresholdError):  # other bytes than those accepted: checked in full
        refresh_trust(trust, tampered)


# -- freshness, the clock, the fleet report --------------------------------------------------


def test_freshness_the_clock_and_the_report_follow_the_device_clock(rooted):
    trust = rooted.trust
    refresh_trust(trust, Offer([root_v(1)], timestamp(3, {}, expires=NOW + timedelta(days=30))))
    assert trust.report_fields() == {"root_version": 1, "trust_stale": False, "seconds_since_fresh": 0}
    trust.clock = lambda: NOW + timedelta(days=8)  # the root allows 7 days
    status = trust.status()
    assert status["stale"] and status["freshness"].startswith("stale: possible freeze")
    assert trust.report_fields() == {"root_version": 1, "trust_stale": True, "seconds_since_fresh": 8 * 86400}
    trust.clock = lambda: NOW - timedelta(days=1)  # the clock went back
    status = trust.status()
    assert not status["stale"] and "the clock may be wrong" in status["clock"] and device_trust.trust_alarm(status)
    trust.clock = lambda: NOW + timedelta(days=31)  # the timestamp expired: refused, and status says why it may be
    with pytest.raises(ExpiredMetadataError, match="if the clock is wrong, set it"):
        refresh_trust(trust, Offer([root_v(1)], timestamp(3, {}, expires=NOW + timedelta(days=30))))
    assert "device clock" in trust.status()["clock"] and trust.state().timestamp_version == 3


def test_status_exits_with_the_stale_code_and_still_answers(tmp_path, root_file):
    real_now = datetime.now(UTC).replace(microsecond=0)
    for name, accepted_at, code in (("fresh", real_now, 0), ("stale", real_now - timedelta(days=8), STALE_EXIT)):
        with Device.init(tmp_path / name, trust_root=root_file) as device:
            device.trust.clock = lambda at=accepted_at: at
            refresh_trust(device.trust, Offer([root_v(1)], timestamp(1, {}, expires=accepted_at + timedelta(days=1))))
        result = CliRunner().invoke(device_command, ["status", "--dir", str(tmp_path / name)])
        assert result.exit_code == code, result.output
        assert json.loads(result.output)["trust"]["stale"] is (code == STALE_EXIT)
    help_text = CliRunner().invoke(device_command, ["status", "--help"]).output
    assert "4 when the trust is" in " ".join(help_text.split()) and "300 s" in help_text


# -- migration from publisher.pub ------------------------------------------------------------


@pytest.fixture
def legacy(tmp_path):
    """A device from before roots: it pins the publisher key of "alice"."""
    pub = save_public_key(key("alice").public_key(), tmp_path / "alice.pub")
    device = Device.init(tmp_path / "legacy", publisher_key=pub)
    device.progress, device.trust.clock = False, lambda: NOW
    yield device
    device.close()


def test_a_device_pinning_publisher_pub_moves_to_the_root_once(legacy, tiny_keyed_bundles):
    legacy.upgrade([tiny_keyed_bundles["alice"][1]])  # a model installed under the pinned key
    refresh_trust(legacy.trust, Offer(None))  # a server without a root: nothing changes
    assert not legacy.trust.pins_root and legacy.trust.status()["root_version"] == 0
    unsigned_by_key = root_v(1)  # lists alice, but alice did not sign it
    with pytest.raises(ThresholdError, match=r"the publisher key .* this device pinned"):
        refresh_trust(legacy.trust, Offer([unsigned_by_key], timestamp(1, {})))
    other = root_v(1, publishers=("bob",), signers=(*ROOT_KEYS, "bob"))
    with pytest.raises(RootChainError, match="does not list this device's publisher key"):
        refresh_trust(legacy.trust, Offer([other], timestamp(1, {})))
    assert not legacy.trust.pins_root and "publisher key" in legacy.trust.status()["note"]
    first = signed(root_v(1).body, *ROOT_KEYS, "alice")
    refresh_trust(legacy.trust, Offer([first, root_v(2, signers=("r1", "r2"))], timestamp(2, {})))
    assert legacy.trust.state().root_version == 2 and (legacy.root / "publisher.pub").exists()
    legacy.bundles.unload(1)
    assert legacy.version == 1 and legacy.engine().manifest.version == 1  # the installed model stays


# -- installed bundles under the accepted roots ------------------------------------------------


@pytest.fixture(scope="module")
def tiny_keyed_bundles(tmp_path_factory) -> dict[str, dict[int, Path]]:
    """Tiny bundles v1 and v2 signed by "alice", and v2 by "bob"."""
    out = tmp_path_factory.mktemp("keyed-bundles")
    return {
        "alice": {
            v: make_tiny_bundle(out / f"alice-v{v}", key("alice"), v, ((1, 2),) if v == 2 else ()) for v in (1, 2)
        },
        "bob": {2: make_tiny_bundle(out / "bob-v2", key("bob"), 2, ((1, 2),))},
    }


def test_a_removed_publisher_keeps_the_model_in_use_but_installs_nothing_new(rooted, tiny_keyed_bundles, images):
    rooted.upgrade([tiny_keyed_bundles["alice"][1]])
    rooted.add(images(3), item_ids=["a", "b", "c"])
    with pytest.raises(ThresholdError):  # a refused sync …
        refresh_trust(rooted.trust, Offer([root_v(1)], timestamp(1, {}, signer="mallory")))
    assert [m[0].item_id for m in rooted.query(images(3), k=1)] == ["a", "b", "c"]  # … and queries still answer
    without_alice = root_v(2, publishers=("bob",), signers=("r1", "r2"))
    refresh_trust(rooted.trust, Offer([root_v(1), without_alice], timestamp(1, {})))
    rooted.bundles.unload(1)
    assert rooted.engine().manifest.version == 1 and rooted.check()["damaged"] == 0  # accepted under root v1
    with pytest.raises(ReleaseSignatureError, match="publisher role of root v2"):
        rooted.install_bundle(tiny_keyed_bundles["alice"][2])
    assert rooted.install_bundle(tiny_keyed_bundles["bob"][2]) == 2


# -- enrolment choices ------------------------------------------------------------------------


def enrol(root: Path, server: str, *flags: str, code: str = "AAAA-BBBB-CCCC"):
    return CliRunner().invoke(device_command, ["enrol", "--dir", str(root), "--server", server, "--code", code, *flags])


def test_enrol_needs_exactly_one_choice_before_it_contacts_anything(tmp_path, root_file):
    with Device.init(tmp_path / "new"):
        pass
    before = folder_files(tmp_path / "new")
    two = enrol(tmp_path / "new", "127.0.0.1:9", "--trust-on-first-use", "--root-fingerprint", "ab" * 32)
    assert two.exit_code == 2 and "exclude each other" in two.output
    none = enrol(tmp_path / "new", "127.0.0.1:9")
    assert isinstance(none.exception, InputError)
    assert all(
        flag in str(none.exception)
        for flag in (
            "--root ROOT.json",
            "--root-fingerprint",
            "--trust-on-first-use",
            "accept whatever root or publisher key",
        )
    )
    with Device.init(tmp_path / "pinned", trust_root=root_file):
        pass
    again = enrol(tmp_path / "pinned", "127.0.0.1:9", "--trust-on-first-use")
    assert isinstance(again.exception, InputError) and "already pins root v1" in str(again.exception)
    assert folder_files(tmp_path / "new") == before


def test_a_server_without_a_root_is_refused_unless_trust_on_first_use(edge_server, tmp_path, root_file, publisher_pub):
    pinned = Device.init(tmp_path / "pinned", trust_root=root_file)
    blank = Device.init(tmp_path / "blank")
    try:
        for device, choice in (
            (blank, {"root_fingerprint": root_fingerprint(root_v(1))}),
            (blank, {"trust_root": root_file}),
            (pinned, {}),
        ):
            before = folder_files(device.root)
            with pytest.raises(RootChainError, match="no root of trust"):
                device.enrol(edge_server.target, enrolment_code(edge_server), **choice)
            assert folder_files(device.root) == before and not (device.root / "token").exists()
        blank.enrol(edge_server.target, enrolment_code(edge_server), trust_on_first_use=True)
        assert public_key_id(blank.publisher_key) == public_key_id(load_public_key(publisher_pub))
        assert (blank.root / "token").exists() and not blank.trust.pins_root
        assert blank.sync().installed_after == 0  # the legacy server, the legacy way: nothing published here yet
    finally:
        pinned.close()
        blank.close()


def test_clock_tolerance_is_a_device_setting(tmp_path, root_file):
    with Device.init(tmp_path / "dev", trust_root=root_file, settings=DeviceSettings(clock_tolerance_s=60)) as device:
        assert device.trust.clock_tolerance_s == 60 and device.trust.status()["clock_tolerance_s"] == 60
    settings = json.loads((tmp_path / "dev" / "device.json").read_text())
    (tmp_path / "dev" / "device.json").write_text(json.dumps({**settings, "clock_tolerance_s": -1}))
    with pytest.raises(DeviceError, match="clock_tolerance_s must be"):
        Device.open(tmp_path / "dev")
    assert os.path.exists(tmp_path / "dev" / "trust" / "state.json")


# -- a real server with a root, on loopback ----------------------------------------------------


@pytest.fixture(scope="module")
def root_server(tmp_path_factory, publisher_pub, admin_token_file, tiny_keyed_bundles):
    """`fctkit serve --root root.1.json --timestamp-key ts.key` (root v1: publisher alice, also
    signed by alice so that devices pinning her key can move to it), v1 by alice published."""
    folder = tmp_path_factory.mktemp("root-server")
    first = write(folder / "root.1.json", signed(root_v(1).body, *ROOT_KEYS, "alice"))
    server = ServerProcess(
        folder / "data",
        publisher_pub,
        admin_token_file,
        "--root",
        str(first),
        "--timestamp-key",
        str(save_private_key(key("ts"), folder / "ts.key")),
    ).start()
    publish(server, tiny_keyed_bundles["alice"][1], folder)
    yield server
    server.stop()


def test_enrol_by_fingerprint_sync_rotate_and_report_on_loopback(root_server, tmp_path):
    with Device.init(tmp_path / "wrong") as wrong:
        with pytest.raises(RootChainError, match="none of the 1 root"):
            wrong.enrol(root_server.target, enrolment_code(root_server), root_fingerprint="ab" * 32)
        assert not (wrong.root / "token").exists() and not wrong.trust.pins_root
    Device.init(tmp_path / "dev").close()
    cli = CliRunner()
    enrolled = enrol(
        tmp_path / "dev",
        root_server.target,
        "--root-fingerprint",
        root_fingerprint(root_v(1)),
        code=enrolment_code(root_server),
    )
    assert enrolled.exit_code == 0, enrolled.output
    enrolled = json.loads(enrolled.output)
    assert enrolled["trust"]["root_version"] == 1 and enrolled["trust"]["timestamp_version"] >= 1
    synced = cli.invoke(device_command, ["sync", "--dir", str(tmp_path / "dev"), "--quiet"])
    assert synced.exit_code == 0 and json.loads(synced.output)["installed_after"] == 1, synced.output
    with FctkitClient(root_server.target, ADMIN_TOKEN) as admin:
        admin.publish_root(root_v(2, publishers=("alice", "bob"), signers=("r1", "r2")).to_bytes())
    assert cli.invoke(device_command, ["sync", "--dir", str(tmp_path / "dev"), "--quiet"]).exit_code == 0
    with Device.open(tmp_path / "dev") as device:
        assert [r.body.version for r in device.trust.accepted_roots()] == [2, 1]
        assert not (device.root / "publisher.pub").exists()
        with FctkitClient(root_server.target, ADMIN_TOKEN) as admin:
            listed = next(d for d in admin.list_devices() if d.device_id == device.settings.device_id)
    assert (listed.root_version, listed.trust_stale) == (2, False) and listed.seconds_since_fresh < 600
    status = cli.invoke(device_command, ["status", "--dir", str(tmp_path / "dev")])
    assert status.exit_code == 0, status.output
    trust = json.loads(status.output)["trust"]
    assert trust["root_version"] == 2 and trust["freshness"].startswith("fresh") and not trust["stale"]


def test_a_device_pinning_the_publisher_key_moves_to_the_servers_root_at_its_next_sync(
    tmp_path, admin_token_file, tiny_keyed_bundles
):
    """A fleet from before roots: the server restarts with a root (v1 signed by alice too)."""
    pub = save_public_key(key("alice").public_key(), tmp_path / "alice.pub")
    server = ServerProcess(tmp_path / "data", pub, admin_token_file).start()
    try:
        publish(server, tiny_keyed_bundles["alice"][1], tmp_path)
        with Device.init(tmp_path / "old", publisher_key=pub) as device:
            device.progress = False
            device.enrol(server.target, enrolment_code(server))
            assert device.sync().installed_after == 1 and not device.trust.pins_root
            server.stop()
            first = write(tmp_path / "root.1.json", signed(root_v(1).body, *ROOT_KEYS, "alice"))
            server.args = [
                "--root",
                str(first),
                "--timestamp-key",
                str(save_private_key(key("ts"), tmp_path / "ts.key")),
            ]
            server.start()
            device.sync()
            assert device.trust.state().root_version == 1 and device.trust.state().timestamp_version >= 1
            device.bundles.unload(1)
            assert (device.root / "publisher.pub").exists() and device.engine().manifest.version == 1
            assert device.status()["trust"]["freshness"].startswith("fresh")
    finally:
        server.stop()
