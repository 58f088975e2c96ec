"""What releases must be signed by on this server, and the root of trust it serves.

Two modes, one interface (:class:`ReleaseRules`):

- :class:`PublisherKeyRules` (``fctkit serve --publisher-key``): one pinned publisher key, as before.
- :class:`RootOfTrust` (``fctkit serve --root ROOT.json --timestamp-key KEY``): the chain of roots
  kept in storage (every replica reads it from there, so a root published on one is in force on
  all at their next call), releases checked against the publisher threshold of the latest root,
  and the current timestamp, signed here with the online timestamp key(s): the only private keys
  the server holds. A timestamp names the releases on offer; it cannot make a device install what
  the publisher threshold did not sign, it can only withhold (which devices notice once it expires).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fctkit.config import read_setting_file
from fctkit.errors import BundleError, ConfigError, RpcStatusError, TrustError
from fctkit.protos.bundle import Manifest, public_key_id
from fctkit.protos.trust import (
    MAX_ROOT_BYTES,
    ReleaseEntry,
    ReleaseTrust,
    Root,
    Signed,
    Timestamp,
    parse_root,
    parse_timestamp,
    root_fingerprint,
    verify_release_manifest,
    verify_root_update,
    verify_self_signed,
    verify_timestamp,
)

from .storage import Storage, StoredTimestamp, VersionRecord

ROOTS_PER_PAGE = 32
TIMESTAMP_WRITE_TRIES = 8  # replicas racing for one version: each loser reads the winner's and checks it again


class ReleaseRules(Protocol):
    """What a release must be signed by: for a publish (:meth:`release_trust`), for a release
    already stored (:meth:`verify_stored`), and the key an enrolling device is offered."""

    @property
    def description(self) -> str: ...

    def release_trust(self) -> ReleaseTrust: ...
    def verify_stored(self, record: VersionRecord) -> Manifest: ...
    def enrolment_key(self) -> Ed25519PublicKey | None: ...


@dataclass(frozen=True)
class PublisherKeyRules:
    """A server started with ``--publisher-key``: every release verifies under that one key."""

    key: Ed25519PublicKey
    description: str = "the given publisher key"

    def release_trust(self) -> ReleaseTrust:
        return self.key

    def verify_stored(self, record: VersionRecord) -> Manifest:
        return verify_release_manifest(record.manifest, record.signature, None, self.key)

    def enrolment_key(self) -> Ed25519PublicKey | None:
        return self.key


class RootOfTrust:
    """The chain of roots in storage, the releases it allows, and the timestamp this replica signs."""

    description = "any root of the stored chain"

    def __init__(
        self,
        storage: Storage,
        timestamp_keys: Sequence[Ed25519PrivateKey],
        expiry_s: float,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._storage = storage
        self._keys = {public_key_id(k.public_key()): k for k in timestamp_keys}
        self._expiry = timedelta(seconds=expiry_s)
        self._clock = clock
        self._parsed: dict[int, Signed[Root]] = {}  # a stored root version never changes
        self._checked: tuple[tuple[bytes, int], Signed[Timestamp]] | None = None

    @classmethod
    def open(
        cls,
        storage: Storage,
        root_file: Path,
        timestamp_keys: Sequence[Ed25519PrivateKey],
        expiry_s: float,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> RootOfTrust:
        """Start-up: the stored chain is checked, ``root_file`` is stored (the first root, or the
        one after the latest stored) or must equal the stored root of its version, and the
        timestamp keys must be able to sign for the latest root."""
        trust = cls(storage, timestamp_keys, expiry_s, clock)
        given = parse_root(read_setting_file(root_file, "root file")[: MAX_ROOT_BYTES + 1], str(root_file))
        trust._check_chain()
        for _ in range(2):  # a second look when another replica stored this very version meanwhile
            if trust._adopt(given, root_file):
                break
        else:
            raise ConfigError(f"the chain of roots kept changing while {root_file} was being stored; start again")
        trust.require_timestamp_keys(trust.latest(), ConfigError)
        return trust

    def _check_chain(self) -> None:
        chain = self.chain()
        try:
            if chain:
                verify_self_signed(chain[0], "stored root")
            for before, after in itertools.pairwise(chain):
                verify_root_update(before, after)
        except TrustError as exc:
            raise ConfigError(f"the stored chain of roots is damaged: {exc}; restore the metadata database") from exc

    def _adopt(self, given: Signed[Root], path: Path) -> bool:
        """Whether ``given`` is in the stored chain now (False: lost a race to store its version)."""
        version, stored = given.body.version, self.chain()
        try:
            if not stored:
                if version != 1:
                    raise ConfigError(
                        f"{path} is root v{version}, but this server's storage holds no root yet: "
                        "start it with root.1.json, then add each next root (`fctkit admin publish-root`)"
                    )
                verify_self_signed(given, str(path))
            elif version <= len(stored):
                if root_fingerprint(given) != root_fingerprint(stored[version - 1]):
                    raise ConfigError(
                        f"{path} (root v{version}, fingerprint {root_fingerprint(given)[:16]}…) differs from "
                        f"the stored root v{version} ({root_fingerprint(stored[version - 1])[:16]}…): "
                        "pass the root file this server's chain holds, or the next one"
                    )
                return True
            else:
                verify_root_update(stored[-1], given)
        except TrustError as exc:
            raise ConfigError(
                f"{path} does not continue the stored chain of roots (v1..v{len(stored)}): {exc}"
            ) from exc
        return self._storage.add_root(version, given.to_bytes())

    def chain(self) -> list[Signed[Root]]:
        """Every stored root, v1 first."""
        return [self._root(v, data) for v, data in self._storage.roots()]

    def latest(self) -> Signed[Root]:
        found = self._storage.latest_root()
        if found is None:
            raise ConfigError("the server's storage holds no root: restart it with --root root.1.json")
        return self._root(*found)

    def _root(self, version: int, data: bytes) -> Signed[Root]:
        if version not in self._parsed:
            self._parsed[version] = parse_root(data, f"stored root.{version}.json")
        return self._parsed[version]

    def roots_after(self, version: int) -> tuple[list[bytes], int]:
        """The stored root files after ``version`` (at most :data:`ROOTS_PER_PAGE`: a root's
        key and signature limits keep each under 32 KiB, so a page fits one message) and the latest version."""
        page = self._storage.roots(version, ROOTS_PER_PAGE)
        return [data for _, data in page], self.latest_root_version()

    def latest_root_version(self) -> int:
        latest = self._storage.latest_root()
        return 0 if latest is None else latest[0]

    def signing_keys(self, root: Signed[Root]) -> list[Ed25519PrivateKey]:
        return [key for keyid, key in sorted(self._keys.items()) if keyid in root.body.role("timestamp").keyids]

    def require_timestamp_keys(self, root: Signed[Root], error: Callable[[str], Exception]) -> None:
        """``error`` unless this replica holds a threshold of ``root``'s timestamp keys."""
        role = root.body.role("timestamp")
        if len(self.signing_keys(root)) >= role.threshold:
            return
        held = ", ".join(k[:16] + "…" for k in sorted(self._keys)) or "none"
        listed = ", ".join(k[:16] + "…" for k in role.keyids) or "none"
        raise error(
            f"root v{root.body.version} lists the timestamp key(s) {listed} (threshold {role.threshold}), but this "
            f"server holds {held}: restart the replicas with --timestamp-key NEW.key as well, first"
        )

    # -- releases ---------------------------------------------------------------------------

    def release_trust(self) -> ReleaseTrust:
        return self.latest()

    def verify_stored(self, record: VersionRecord) -> Manifest:
        """The release verifies under some root of the chain: one published before a rotation
        stays on offer (a device holding the newer root decides for itself)."""
        failure: Exception | None = None
        for root in reversed(self.chain()):
            try:
                return verify_release_manifest(record.manifest, record.signature, record.co_signatures or None, root)
            except (BundleError, TrustError) as exc:
                failure = failure or exc
        raise failure or ConfigError("the server's storage holds no root")

    def enrolment_key(self) -> Ed25519PublicKey | None:
        """The first publisher key of the latest root, for clients that pin one key (root-mode devices use GetTrust)."""
        root = self.latest().body
        keyids = root.role("publisher").keyids
        return root.keys[keyids[0]] if keyids else None

    # -- roots and timestamps ------------------------------------------------------------------

    def publish_root(self, data: bytes) -> Signed[Root]:
        """Add the next root after the latest stored one, or an RpcStatusError saying why not."""
        if len(data) > MAX_ROOT_BYTES:
            raise RpcStatusError("INVALID_ARGUMENT", f"root is {len(data)} bytes; at most {MAX_ROOT_BYTES}")
        latest = self.latest()
        try:
            new = verify_root_update(latest, parse_root(data, "root"))
        except TrustError as exc:
            raise RpcStatusError("INVALID_ARGUMENT", f"root refused: {exc}") from exc
        self.require_timestamp_keys(new, lambda message: RpcStatusError("FAILED_PRECONDITION", message))
        if not self._storage.add_root(new.body.version, new.to_bytes()):
            raise RpcStatusError(
                "FAILED_PRECONDITION",
                f"root v{new.body.version} was published meanwhile (by another "
                "admin or replica); fetch the chain and build the next root on the latest one",
            )
        return new

    def timestamp(self, releases: tuple[ReleaseEntry, ...]) -> StoredTimestamp:
        """The current signed timestamp naming ``releases`` (those on offer) and its version: the
        stored one while it names exactly these, is signed for the latest root and has more than
        half its lifetime left; else a new one, one version higher, stored once for all replicas."""
        root = self.latest()
        for _ in range(TIMESTAMP_WRITE_TRIES):
            now = self._clock()
            stored = self._storage.timestamp()
            if stored is not None and self._reusable(stored, root, releases, now):
                return stored
            self.require_timestamp_keys(root, lambda message: RpcStatusError("FAILED_PRECONDITION", message))
            version = 1 if stored is None else stored.version + 1
            document = Signed(Timestamp(version, now + self._expiry, releases))
            for key in self.signing_keys(root):
                document = document.signed_by(key)
            data = document.to_bytes()
            if self._storage.put_timestamp(version, data):
                return StoredTimestamp(version, data)
        raise RpcStatusError(
            "UNAVAILABLE", "the timestamp kept changing under this replica (replicas racing); try again"
        )

    def _reusable(
        self, stored: StoredTimestamp, root: Signed[Root], releases: tuple[ReleaseEntry, ...], now: datetime
    ) -> bool:
        timestamp = self._checked_timestamp(stored, root, now)
        if timestamp is None:
            return False
        return timestamp.body.releases == releases and timestamp.body.expires - now > self._expiry / 2

    def _checked_timestamp(
        self, stored: StoredTimestamp, root: Signed[Root], now: datetime
    ) -> Signed[Timestamp] | None:
        """The stored timestamp once it verified under ``root`` (parsed and checked once per
        timestamp and root: most calls reuse it), or None: signed for an earlier root's keys, or expired."""
        key = (stored.data, root.body.version)
        if self._checked is not None and self._checked[0] == key:
            return self._checked[1]
        try:
            timestamp = verify_timestamp(root, parse_timestamp(stored.data), 0, now, 0)
        except TrustError:
            return None
        self._checked = (key, timestamp)
        return timestamp
