"""The trust a device keeps: the root of trust it holds now, every root it has
accepted, and the last timestamp it accepted with when (its own clock); or, on a device from
before roots, the one publisher key it pins (``publisher.pub``). :class:`DeviceTrust` reads and
writes these files, tells the installed bundles what a release must be signed by, and says how
fresh the device is (``fctkit device status`` and the fleet report).

Files, private and written atomically::

    trust/root.<N>.json   every root accepted, in canonical form (N: its version)
    trust/state.json      the pointer: {"root_version", "timestamp_version", "timestamp" (the
                          accepted timestamp.json, base64, or null), "fresh_at" (UTC, or null)}
    trust_refusal.json    the last trust refusal of a sync (for status); gone after a good sync

A first pin creates ``trust/`` whole (staged, then renamed); an update writes the new roots first
and ``state.json`` last, so a crash leaves the old state or the new one, never a mix. A device
with ``trust/`` trusts its roots alone: a damaged root file is a :class:`TrustError` naming the
file, never a fallback to the publisher key or to whatever a server offers. A damaged or missing
``state.json`` holds nothing the roots cannot give again: it is derived from the intact chain of
root files (keeping the timestamp it held when that still verifies), reported by ``status``, and
written back by ``repair``; so is a damaged ``publisher.pub`` next to a root (from root v1, which
that key signed), skipped meanwhile.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fctkit.errors import BundleError, DeviceError, ExpiredMetadataError, TrustError
from fctkit.private_files import make_private
from fctkit.protos.bundle import load_public_key
from fctkit.protos.durable_files import read_regular_file, staged_directory, write_atomic
from fctkit.protos.trust import (
    DEFAULT_CLOCK_TOLERANCE_S,
    MAX_ROOT_BYTES,
    MAX_TIMESTAMP_BYTES,
    ReleaseTrust,
    Root,
    Signed,
    Timestamp,
    format_time,
    freshness,
    parse_root,
    parse_timestamp,
    root_fingerprint,
    verify_root_update,
    verify_self_signed,
)
from fctkit.protos.trust.trust_format import parse_time, valid_signers

from .device_files import PUBLISHER_FILE
from .sqlite_file import is_no_space, no_space

TRUST_DIR, STATE_FILE, REFUSAL_FILE = "trust", "state.json", "trust_refusal.json"
MAX_STATE_BYTES = 2 * MAX_TIMESTAMP_BYTES  # the timestamp in base64, and a few small fields
RESTORE = (
    "restore the device folder's trust/ from a backup; or move trust/ aside and enrol again with a new code and "
    "--root-fingerprint (this device trusts nothing else meanwhile)"
)
DERIVED = (
    "derived again from the intact root files for now (root v{version}; the last timestamp {stamp}): "
    "`fctkit device repair --dir DIR` writes it back, and the next sync checks the server's timestamp in full"
)
KEY_RESTORE = (
    "put the publisher key this device pinned back (the same publisher.pub, from the publisher or another device "
    "pinning it); the installed bundles are not damaged"
)


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class TrustState:
    """What ``trust/state.json`` holds: the root trusted now and the last accepted timestamp."""

    root_version: int
    timestamp_version: int = 0
    timestamp: bytes | None = None
    fresh_at: datetime | None = None

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "root_version": self.root_version,
                "timestamp_version": self.timestamp_version,
                "timestamp": None if self.timestamp is None else base64.b64encode(self.timestamp).decode(),
                "fresh_at": None if self.fresh_at is None else format_time(self.fresh_at),
            },
            indent=2,
            sort_keys=True,
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> TrustState:
        item = json.loads(data.decode("utf-8"))
        if not isinstance(item, dict) or set(item) != {"root_version", "timestamp_version", "timestamp", "fresh_at"}:
            raise ValueError("expected exactly root_version, timestamp_version, timestamp and fresh_at")
        versions = item["root_version"], item["timestamp_version"]
        if not all(type(v) is int for v in versions) or versions[0] < 1 or versions[1] < 0:
            raise ValueError("root_version must be an integer ≥ 1 and timestamp_version one ≥ 0")
        stamp, fresh = item["timestamp"], item["fresh_at"]
        return cls(
            versions[0],
            versions[1],
            None if stamp is None else base64.b64decode(stamp, validate=True),
            None if fresh is None else parse_time(fresh, "fresh_at"),
        )


class DeviceTrust:
    """The trust files of the device folder ``root``; ``clock()`` is the device clock (UTC),
    replaceable in tests; ``clock_tolerance_s`` how far past expiry metadata is still accepted."""

    def __init__(
        self,
        root: Path,
        clock_tolerance_s: int = DEFAULT_CLOCK_TOLERANCE_S,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        self.root = root
        self.folder = root / TRUST_DIR
        self.clock = clock if clock is not None else utc_now
        self.clock_tolerance_s = clock_tolerance_s
        self._loaded: tuple[TrustState, Signed[Root]] | None = None
        self._accepted: list[Signed[Root]] | None = None
        self._fresh_written: datetime | None = None  # the fresh_at last written to state.json
        self._state_damage: str | None = None  # why state.json was derived again from the roots (not yet rewritten)

    # -- what the device pins ---------------------------------------------------------------

    @property
    def pins_root(self) -> bool:
        return self.folder.exists()

    @property
    def pins_key(self) -> bool:
        """A publisher key is pinned (a device from before roots, or one enrolled with a server that has none)."""
        return (self.root / PUBLISHER_FILE).exists()

    def describe_pin(self) -> str:
        if self.pins_root:
            return (
                f"root v{self.current_root().body.version} (fingerprint {root_fingerprint(self.current_root())[:16]}…)"
            )
        return "a publisher key (publisher.pub)" if self.pins_key else "nothing"

    def publisher_key(self) -> Ed25519PublicKey:
        path = self.root / PUBLISHER_FILE
        if not path.exists():
            raise DeviceError("no publisher key is pinned: enrol with a server, or init with --publisher-key or --root")
        try:
            return load_public_key(path)
        except BundleError as exc:
            raise TrustError(f"{path}, the publisher key this device pins, is damaged ({exc}); {KEY_RESTORE}") from None

    def _kept_key(self) -> list[ReleaseTrust]:
        """The key pinned before the device's roots, when it still reads (a damaged one is
        reported by :meth:`damage`: root v1 lists it, so the roots verify what it signed)."""
        if not self.pins_key:
            return []
        try:
            return [self.publisher_key()]
        except TrustError:
            return []

    def state(self) -> TrustState:
        return self._load()[0]

    def current_root(self) -> Signed[Root]:
        return self._load()[1]

    def accepted_roots(self) -> list[Signed[Root]]:
        """Every root this device accepted, newest first (the current one first)."""
        if self._accepted is None:
            current = self.current_root()
            self._accepted = [
                current,
                *(
                    self._read_root(v)
                    for v in range(current.body.version - 1, 0, -1)
                    if (self.folder / f"root.{v}.json").exists()
                ),
            ]
        return self._accepted

    def snapshot(self) -> Timestamp | None:
        """The accepted timestamp (what a download from the server must match), None on a legacy device."""
        if not self.pins_root:
            return None
        stamp = self.state().timestamp
        return None if stamp is None else parse_timestamp(stamp).body

    # -- what a release must be signed by (:class:`~.bundle_store.InstalledBundles`) ---------

    def release_trust(self) -> ReleaseTrust:
        """What installing a bundle needs: the current root's publisher threshold (or the pinned key)."""
        return self.current_root() if self.pins_root else self.publisher_key()

    def accepted_trusts(self) -> list[ReleaseTrust]:
        """What an installed bundle may satisfy: any root accepted, or the key pinned before them
        (a rotation that drops a key does not break the model in use)."""
        if not self.pins_root:
            return [self.publisher_key()]
        return [*self.accepted_roots(), *self._kept_key()]

    def on_offer(self, versions: Sequence[Any]) -> list[Any]:
        """The published versions (``.version``) the accepted timestamp lists: the only ones installed."""
        snapshot = self.snapshot()
        return list(versions) if snapshot is None else [v for v in versions if snapshot.entry(v.version) is not None]

    # -- writing ----------------------------------------------------------------------------

    def pin(self, root: Signed[Root]) -> None:
        """``device init --root``: start from this root (see :func:`read_root_file`), no timestamp yet."""
        self.save([root], TrustState(root.body.version))

    def save(self, new_roots: Sequence[Signed[Root]], state: TrustState) -> None:
        """Write the newly accepted roots, then the state pointing at them (see the module doc).
        A state that only moves ``fresh_at`` (the same timestamp accepted again: most syncs) is
        written without fsync, and not at all while the file's ``fresh_at`` is younger than a
        thousandth of the root's freshness limit (kept in memory meanwhile): a crash can only
        leave an older ``fresh_at``, which errs towards stale."""
        known = self.state() if self.pins_root else None
        durable = (
            bool(new_roots)
            or known is None
            or self._state_damage is not None
            or replace(known, fresh_at=state.fresh_at) != state
        )
        if not durable and self._fresh_on_disk(state):
            self._loaded = (state, self.current_root())
            return
        try:
            if not self.pins_root:
                with staged_directory(self.folder) as staging:
                    self._write(staging, new_roots, state, durable)
            else:
                self._write(self.folder, new_roots, state, durable)
        except OSError as exc:
            if is_no_space(exc):  # the old state stands (the module doc's order)
                raise no_space(self.root, "saving the trust metadata just accepted") from None
            raise
        if durable:
            make_private(self.folder)
            self._loaded = self._accepted = self._state_damage = None
        else:
            self._loaded = (state, self.current_root())
        self._fresh_written = state.fresh_at

    def _fresh_on_disk(self, state: TrustState) -> bool:
        """Whether the file's ``fresh_at`` is within a thousandth of the freshness limit of ``state``'s."""
        written = self._fresh_written
        if written is None or state.fresh_at is None:
            return False
        lag = (state.fresh_at - written).total_seconds()
        return 0 <= lag < self.current_root().body.freshness_limit_s / 1000

    @staticmethod
    def _write(folder: Path, roots: Sequence[Signed[Root]], state: TrustState, durable: bool) -> None:
        for root in roots:
            write_atomic(folder / f"root.{root.body.version}.json", root.to_bytes())
        write_atomic(folder / STATE_FILE, state.to_bytes(), durable=durable)

    def record_refusal(self, error: TrustError) -> None:
        """Keep a sync's trust refusal for ``status`` (the trust files themselves stay as they were)."""
        record = {"at": format_time(self.clock()), "error": type(error).__name__, "message": str(error)}
        # a record for status only: a full disk must not hide the refusal itself
        with contextlib.suppress(OSError):
            write_atomic(self.root / REFUSAL_FILE, json.dumps(record, indent=2).encode())

    def clear_refusal(self) -> None:
        (self.root / REFUSAL_FILE).unlink(missing_ok=True)

    # -- reading ----------------------------------------------------------------------------

    def _load(self) -> tuple[TrustState, Signed[Root]]:
        if self._loaded is None:
            try:
                state = self._read_state()
            except TrustError as exc:  # the roots are what the device trusts: the pointer is derived from them
                state = self._derived_state(exc)
            self._loaded = state, self._read_root(state.root_version)
            self._fresh_written = state.fresh_at
        return self._loaded

    def _read_state(self) -> TrustState:
        path = self.folder / STATE_FILE
        if not path.is_file():
            raise TrustError(f"{path} is missing: this device no longer knows which root it trusts; {RESTORE}")
        try:
            state = TrustState.from_bytes(read_regular_file(path, MAX_STATE_BYTES))
            if state.timestamp is not None and parse_timestamp(state.timestamp).body.version != state.timestamp_version:
                raise ValueError("the timestamp it holds is not the version it names")
        except (OSError, ValueError, TypeError, binascii.Error, BundleError, TrustError) as exc:
            raise TrustError(f"{path} is damaged ({exc}); {RESTORE}") from None
        return state

    def _derived_state(self, error: TrustError) -> TrustState:
        """``state.json`` derived again after ``error``: the newest root the intact chain of root
        files reaches (each checked against the one before), and the timestamp the damaged file
        still holds when a threshold of that root's timestamp keys signed it (else none: the next
        sync checks the server's in full). Raises ``error`` when no root file reads."""
        versions = sorted(int(p.name.split(".")[1]) for p in self.folder.glob("root.*.json") if _root_number(p.name))
        try:
            current = self._read_root(versions[0])
        except (IndexError, TrustError):
            raise error from None
        for version in versions[1:]:
            try:
                current = verify_root_update(current, self._read_root(version))
            except TrustError:
                break
        stamp = _salvaged_timestamp(self.folder / STATE_FILE, current)
        self._state_damage = f"{str(error).split('; ')[0]}; " + DERIVED.format(
            version=current.body.version,
            stamp="was kept" if stamp is not None else "is not known (trust/state.json lost it)",
        )
        if stamp is None:
            return TrustState(current.body.version)
        return TrustState(current.body.version, parse_timestamp(stamp).body.version, stamp)

    def damage(self) -> list[str]:
        """What is damaged of the trust files the device can do without: ``state.json`` (derived
        again from the roots) and, next to a root, the publisher key pinned before it."""
        if not self.pins_root:
            return []
        self._load()
        found = [] if self._state_damage is None else [self._state_damage]
        return found + list(self._key_damage().values())

    def repair(self) -> dict[str, str]:
        """``fctkit device repair``: write back ``state.json`` derived from the roots, and a damaged
        publisher key pinned before them from root v1 (which that key signed: the move to roots);
        file -> what was done."""
        if not self.pins_root or not self.damage():
            return {}
        done: dict[str, str] = {}
        if self._state_damage is not None:
            state = self.state()
            self._write(self.folder, [], state, True)
            self._state_damage, self._fresh_written = None, None
            done[STATE_FILE] = f"derived again from root v{state.root_version} (timestamp v{state.timestamp_version})"
        key = self._key_from_first_root() if self.pins_key and self._kept_key() == [] else None
        if key is not None:
            write_atomic(self.root / PUBLISHER_FILE, key.public_bytes_raw())
            done[PUBLISHER_FILE] = "derived again from root v1 (the publisher key that signed it)"
        make_private(self.root)
        return done

    def _key_from_first_root(self) -> Ed25519PublicKey | None:
        """The publisher key that signed root v1 (the pinned key it moved from), when exactly one did."""
        if not (self.folder / "root.1.json").is_file():
            return None
        first = self._read_root(1)
        signers = valid_signers(
            first.signed_bytes, first.signatures, first.body.keys, first.body.role("publisher").keyids
        )
        return first.body.keys[next(iter(signers))] if len(signers) == 1 else None

    def _read_root(self, version: int) -> Signed[Root]:
        path = self.folder / f"root.{version}.json"
        try:
            root = verify_self_signed(parse_root(read_regular_file(path, MAX_ROOT_BYTES), str(path)))
        except (OSError, BundleError, TrustError) as exc:
            raise TrustError(f"the trusted root {path} is damaged or missing ({exc}); {RESTORE}") from None
        if root.body.version != version:
            raise TrustError(f"{path} holds root v{root.body.version}, not v{version}; {RESTORE}")
        return root

    # -- freshness --------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What ``device status`` shows of the trust: the root, the timestamp, freshness, the clock."""
        if not self.pins_root:
            return {
                "root_version": 0,
                "publisher_key_pinned": self.pins_key,
                "note": "no root of trust: this device pins one publisher key, and moves to the server's root at "
                "its next sync"
                if self.pins_key
                else "nothing pinned yet: enrol, or init with --root",
                **self._key_damage(),
            }
        try:
            state, root, now, damage = self.state(), self.current_root(), self.clock(), self.damage()
        except TrustError as exc:
            return {"root_version": None, "damaged": str(exc)}
        result: dict[str, Any] = {
            **({"damaged": " ".join(damage)} if damage else {}),
            "root_version": root.body.version,
            "root_fingerprint": root_fingerprint(root)[:16],
            "timestamp_version": state.timestamp_version,
            "stale": False,
            "clock_tolerance_s": self.clock_tolerance_s,
        }
        if state.fresh_at is None:
            result["freshness"] = "no timestamp accepted yet: sync with the server"
        elif self.clock_went_back(now):
            result.update(
                freshness="unknown",
                clock=(
                    f"the device clock reads {format_time(now)}, earlier than when the last timestamp was accepted "
                    f"({format_time(state.fresh_at)}): the clock may be wrong; set it, then sync"
                ),
            )
        else:
            fresh = freshness(root.body, state.fresh_at, now)
            result.update(freshness=fresh.describe(), stale=fresh.stale, seconds_since_fresh=int(fresh.age_s))
        refusal = self._refusal()
        if refusal is not None:
            result["last_refusal"] = refusal["message"]
            if refusal["error"] == ExpiredMetadataError.__name__:
                result.setdefault(
                    "clock",
                    "the last sync refused metadata as expired: either the server serves stale "
                    f"metadata or the device clock (now {format_time(now)}) may be wrong; check it",
                )
        return result

    def trusted_time(self) -> float | None:
        """The device clock (epoch seconds) when the root's metadata vouches for it: not behind the
        last time a timestamp was accepted (beyond the tolerance), nor ahead of it by more than the
        root's freshness limit; None otherwise, and on a device with a root that has accepted no
        timestamp. On a device without a root, the clock (nothing to check it against)."""
        if not self.pins_root:
            return time.time()
        now = self.clock()
        try:
            fresh_at, limit = self.state().fresh_at, self.current_root().body.freshness_limit_s
        except TrustError:
            return None
        if fresh_at is None or self.clock_went_back(now) or (now - fresh_at).total_seconds() > limit:
            return None
        return now.timestamp()

    def clock_went_back(self, now: datetime) -> bool:
        fresh_at = self.state().fresh_at
        return fresh_at is not None and (now - fresh_at).total_seconds() < -self.clock_tolerance_s

    def report_fields(self) -> dict[str, Any]:
        """``root_version``, ``trust_stale`` and ``seconds_since_fresh`` for the fleet report."""
        if not self.pins_root:
            return {"root_version": 0, "trust_stale": False, "seconds_since_fresh": 0}
        state, now = self.state(), self.clock()
        if state.fresh_at is None or self.clock_went_back(now):
            return {"root_version": self.current_root().body.version, "trust_stale": False, "seconds_since_fresh": 0}
        fresh = freshness(self.current_root().body, state.fresh_at, now)
        return {
            "root_version": self.current_root().body.version,
            "trust_stale": fresh.stale,
            "seconds_since_fresh": max(int(fresh.age_s), 0),
        }

    def _key_damage(self) -> dict[str, str]:
        """``{"damaged": why}`` when the pinned publisher key no longer reads, else nothing."""
        try:
            if self.pins_key:
                self.publisher_key()
        except TrustError as exc:
            return {"damaged": str(exc)}
        return {}

    def _refusal(self) -> dict[str, str] | None:
        path = self.root / REFUSAL_FILE
        try:
            record = json.loads(path.read_bytes()) if path.is_file() else None
        except (OSError, ValueError):
            return {"error": "", "message": f"{path} is unreadable (a record only: remove it)"}
        return record if isinstance(record, dict) and {"error", "message"} <= set(record) else None


def _root_number(name: str) -> bool:
    """Whether ``name`` is ``root.<N>.json``."""
    parts = name.split(".")
    return len(parts) == 3 and parts[1].isdigit() and parts[1] == str(int(parts[1]))


def _salvaged_timestamp(path: Path, root: Signed[Root]) -> bytes | None:
    """The timestamp a damaged ``state.json`` still holds, when ``root``'s timestamp keys signed it."""
    try:
        item = json.loads(read_regular_file(path, MAX_STATE_BYTES))
        data = base64.b64decode(item["timestamp"], validate=True)
        stamp = parse_timestamp(data)
    except (OSError, ValueError, TypeError, KeyError, binascii.Error, BundleError, TrustError):
        return None
    role = root.body.role("timestamp")
    signers = valid_signers(stamp.signed_bytes, stamp.signatures, root.body.keys, role.keyids)
    return data if len(signers) >= role.threshold else None


def read_root_file(path: str | os.PathLike) -> Signed[Root]:
    """A root file given on the command line, signed by a threshold of its own root keys."""
    try:
        data = read_regular_file(Path(path), MAX_ROOT_BYTES)
    except (OSError, BundleError) as exc:
        raise TrustError(f"cannot read the root file {path}: {exc}") from None
    return verify_self_signed(parse_root(data, str(path)))


def initial_pin(
    trust_root: str | os.PathLike[str] | None, publisher_key: str | os.PathLike[str] | None
) -> Callable[[Path], object]:
    """``device init``: check the root file (or the publisher key file) now; the returned
    function pins it in a new device folder."""
    if trust_root is not None and publisher_key is not None:
        raise DeviceError(
            "pin a root of trust (--root) or a publisher key (--publisher-key), not both; nothing was created"
        )
    if trust_root is not None:
        root = read_root_file(trust_root)
        return lambda folder: DeviceTrust(folder).pin(root)
    if publisher_key is not None:
        load_public_key(publisher_key)  # refuse a bad key file now
        return lambda folder: shutil.copyfile(publisher_key, folder / PUBLISHER_FILE)
    return lambda folder: None


def trust_alarm(status: dict[str, Any]) -> bool:
    """Whether a device's trust status calls for attention: stale (possible freeze), a clock that
    may be wrong, or damaged trust files."""
    return bool(status.get("stale") or status.get("clock") or status.get("damaged"))
