"""What a device accepts of the trust a server offers: at enrolment, the root to start
from (``--root``, ``--root-fingerprint`` or, explicitly, ``--trust-on-first-use``), and before
every download from the server (:func:`trusted_client`), the roots after its own, walked one
version at a time, and a fresh timestamp. A device pinning only ``publisher.pub`` moves to the
server's root once (:func:`~fctkit.protos.trust.verify_migration`). Everything is checked before
anything is written; a refusal leaves the trust files as they were.

A server without a root (``fctkit serve --publisher-key``, or one from before roots) answers
GetTrust with FAILED_PRECONDITION (UNIMPLEMENTED before the RPC existed): a legacy device goes on
with its pinned key; a device that holds a root refuses it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from fctkit.errors import DeviceError, InputError, RootChainError, RpcStatusError, TrustError
from fctkit.protos.bundle import load_public_key, public_key_id
from fctkit.protos.client import ClientTls, Enrolment, FctkitClient, TrustUpdate, VersionListing
from fctkit.protos.trust import (
    Root,
    Signed,
    check_not_expired,
    parse_root,
    parse_timestamp,
    pin_root,
    root_fingerprint,
    timestamp_version_floor,
    verify_migration,
    verify_timestamp,
    walk_root_chain,
)

from .device_files import PUBLISHER_FILE, TOKEN_FILE, write_private
from .device_trust import DeviceTrust, TrustState, read_root_file

NO_ROOT = ("FAILED_PRECONDITION", "UNIMPLEMENTED")
CHOOSE = (
    "this device pins no root of trust yet: give exactly one of --root ROOT.json (the root file, from the "
    "publisher, offline), --root-fingerprint SHA256 (the fingerprint `fctkit keys init-root` printed: the server's "
    "root is checked against it), or --trust-on-first-use (accept whatever root or publisher key this server offers, "
    "unchecked: a server or network that is not honest at this moment owns the device for good)"
)


@dataclass(frozen=True)
class TrustChoice:
    """How a device that pins nothing yet picks the root it starts from at enrolment."""

    root_file: str | os.PathLike | None = None
    fingerprint: str | None = None
    trust_on_first_use: bool = False

    def check(self, trust: DeviceTrust) -> None:
        """Exactly one choice for a device that pins nothing; none for one that already pins."""
        given = sum((self.root_file is not None, self.fingerprint is not None, self.trust_on_first_use))
        if given > 1:
            raise InputError(
                "--root, --root-fingerprint and --trust-on-first-use exclude each other: give one. " + CHOOSE
            )
        pinned = trust.pins_root or trust.pins_key
        if pinned and given:
            raise InputError(
                f"this device already pins {trust.describe_pin()}: enrol without --root, --root-fingerprint "
                "or --trust-on-first-use (it checks the server against what it pins)"
            )
        if not pinned and not given:
            raise InputError(CHOOSE)


@dataclass(frozen=True)
class Accepted:
    """Roots and a timestamp that passed every rule, not yet written."""

    new_roots: list[Signed[Root]]
    state: TrustState


def fetch_trust(client: Any, after_root_version: int) -> TrustUpdate | None:
    """The server's roots after ``after_root_version`` and its timestamp; None: it has no root."""
    try:
        return client.get_trust(after_root_version)
    except RpcStatusError as exc:
        if exc.code in NO_ROOT:
            return None
        raise


def accept(
    trust: DeviceTrust,
    start: Signed[Root],
    chain: Sequence[bytes],
    timestamp: bytes,
    last_version: int,
    *,
    start_is_new: bool,
) -> Accepted:
    """Walk from ``start`` over ``chain``, then check ``timestamp`` against the last root reached.
    The very timestamp already accepted under the same root (most syncs) is only checked for expiry."""
    now: datetime = trust.clock()
    if not chain and not start_is_new and timestamp == trust.state().timestamp:
        known = parse_timestamp(timestamp).body
        check_not_expired(known.expires, now, trust.clock_tolerance_s, f"timestamp v{known.version}")
        return Accepted([], replace(trust.state(), fresh_at=_fresh_at(trust, now)))
    walk = walk_root_chain(start, chain, now, trust.clock_tolerance_s)
    floor = timestamp_version_floor(walk, last_version)
    stamp = verify_timestamp(walk.root, parse_timestamp(timestamp), floor, now, trust.clock_tolerance_s)
    roots = [parse_root(data) for data in chain]  # each verified by the walk
    state = TrustState(walk.root.body.version, stamp.body.version, timestamp, _fresh_at(trust, now))
    return Accepted([start, *roots] if start_is_new else roots, state)


def _fresh_at(trust: DeviceTrust, now: datetime) -> datetime:
    """When the timestamp just accepted counts as accepted: ``now``, never earlier than the last
    time (a clock gone back keeps being reported, at every sync, until it is set right)."""
    last = trust.state().fresh_at if trust.pins_root else None
    return now if last is None or now >= last else last


def offered_update(trust: DeviceTrust, client: Any, listing: VersionListing | None = None) -> Accepted | None:
    """What a device that pins a root, or only a publisher key, accepts of the server's trust
    now; None: a legacy device and a server without a root (nothing changes). The timestamp a
    version ``listing`` carries is enough while the server's latest root is the device's own."""
    if trust.pins_root:
        current, state = trust.current_root(), trust.state()
        if listing is not None and listing.latest_root_version == current.body.version:
            # "unchanged": the server's timestamp is the very one this device holds (it asked with its
            # version); timestamp bytes sent all the same are checked as always
            timestamp = listing.timestamp or (state.timestamp if listing.timestamp_unchanged else b"")
            if timestamp:
                return accept(trust, current, [], timestamp, state.timestamp_version, start_is_new=False)
        update = fetch_trust(client, current.body.version)
        if update is None:
            raise RootChainError(
                f"this device trusts root v{current.body.version}, but the server serves no root of trust: "
                "refused (a server that lost its root, or not the device's server); nothing was installed"
            )
        return accept(trust, current, update.roots, update.timestamp, state.timestamp_version, start_is_new=False)
    update = fetch_trust(client, 0)
    if update is None:
        return None
    if not update.roots:
        raise RootChainError("the server has a timestamp but offers no root v1: refused (the server is misconfigured)")
    first = verify_migration(trust.publisher_key(), parse_root(update.roots[0], "root.1.json"))
    return accept(trust, first, update.roots[1:], update.timestamp, 0, start_is_new=True)


def refresh_trust(trust: DeviceTrust, client: Any, listing: VersionListing | None = None) -> None:
    """Before a download from the server: accept its newer roots and a fresh timestamp (from
    ``listing`` when it carries one for the device's root, else GetTrust), and write them; a
    refusal is kept for ``status`` and raised (nothing else changes)."""
    if not (trust.pins_root or trust.pins_key):
        raise DeviceError("this device pins no root of trust and no publisher key: enrol it first")
    with refusal_recorded(trust):
        accepted = offered_update(trust, client, listing)
    if accepted is not None:
        trust.save(accepted.new_roots, accepted.state)
    trust.clear_refusal()


@contextlib.contextmanager
def refusal_recorded(trust: DeviceTrust) -> Iterator[None]:
    """A trust refusal raised inside is kept for ``status``, then raised (the trust files stay as they were)."""
    try:
        yield
    except TrustError as exc:
        trust.record_refusal(exc)
        raise


def trusted_versions(trust: DeviceTrust, client: Any, after_version: int) -> list[Any]:
    """The versions after ``after_version`` that the freshly refreshed timestamp offers: one
    ListVersions (its answer carries the timestamp), and GetTrust only when the root changed."""
    return trusted_listing(trust, client, after_version).versions


def trusted_listing(trust: DeviceTrust, client: Any, after_version: int) -> VersionListing:
    """:func:`trusted_versions`' listing: its ``versions`` cut to those the timestamp offers, its
    ``withdrawals`` as the server sent them (each verified by the device before use, :mod:`.revert`)."""
    held = trust.state() if trust.pins_root else None
    known = held.timestamp_version if held is not None and held.timestamp is not None else 0
    with refusal_recorded(trust):  # a listing past the release limit (endless data)
        listing = client.version_listing(after_version, known_timestamp_version=known)
    refresh_trust(trust, client, listing)
    return replace(listing, versions=trust.on_offer(listing.versions))


@contextlib.contextmanager
def trusted_client(trust: DeviceTrust, connect: Callable[[], Any]) -> Iterator[Any]:
    """A client to the server whose trust was refreshed first (:func:`refresh_trust`)."""
    with connect() as client:
        refresh_trust(trust, client)
        yield client


def enrol_device(
    trust: DeviceTrust,
    owner_key_id: str,
    server: str,
    code: str,
    device_name: str,
    tls: ClientTls | None,
    choice: TrustChoice,
) -> Enrolment:
    """Trade the code for a token, take the server's trust as ``choice`` says, then write the
    trust and the token; a refusal writes nothing (the code is spent: ask for a new one)."""
    choice.check(trust)
    start = read_root_file(choice.root_file) if choice.root_file is not None else None
    with FctkitClient(server, tls=tls) as client:
        enrolment = client.enrol(code, device_name, owner_key_id=owner_key_id)
    with FctkitClient(server, enrolment.token, tls=tls) as client:
        write = _trust_to_write(trust, client, choice, start, enrolment.publisher_public_key)
    write()
    write_private(trust.root / TOKEN_FILE, enrolment.token.encode())
    return enrolment


def _trust_to_write(
    trust: DeviceTrust, client: Any, choice: TrustChoice, start: Signed[Root] | None, offered_key: bytes
) -> Callable[[], None]:
    """What to write once everything was checked (nothing is written here)."""
    if trust.pins_root or trust.pins_key:
        accepted = offered_update(trust, client)
        if accepted is None:
            return _legacy_key(trust, offered_key, pinned=True)
        new_roots, state = accepted.new_roots, accepted.state
        return lambda: trust.save(new_roots, state)
    update = fetch_trust(client, 0 if start is None else start.body.version)
    if update is None:
        if choice.trust_on_first_use:
            return _legacy_key(trust, offered_key, pinned=False)
        raise RootChainError(
            "this server has no root of trust (it was started with --publisher-key only): refused, "
            "as --root and --root-fingerprint ask for one; enrol with --trust-on-first-use to pin its "
            "publisher key as offered, or ask its admin to serve a root"
        )
    chain: Sequence[bytes] = update.roots
    if start is None:
        index = _starting_root(update.roots, choice.fingerprint)
        start = pin_root(update.roots[index], choice.fingerprint, trust_on_first_use=choice.fingerprint is None)
        chain = update.roots[index + 1 :]
    accepted = accept(trust, start, chain, update.timestamp, 0, start_is_new=True)
    return lambda: trust.save(accepted.new_roots, accepted.state)


def _starting_root(roots: Sequence[bytes], fingerprint: str | None) -> int:
    """The offered root to pin: the one with ``fingerprint``, or (trust on first use) root v1."""
    if not roots:
        raise RootChainError("the server offers no root: refused (its root chain is empty)")
    if fingerprint is None:
        return 0
    for index, data in enumerate(roots):
        if root_fingerprint(parse_root(data, f"root.{index + 1}.json")) == fingerprint.lower():
            return index
    raise RootChainError(
        f"none of the {len(roots)} root(s) the server offers has the fingerprint {fingerprint[:16]}… "
        "this device was given: refused (a wrong or forged root, or not your server); nothing was saved"
    )


def _legacy_key(trust: DeviceTrust, offered: bytes, *, pinned: bool) -> Callable[[], None]:
    """A server without a root: the publisher key it offers, pinned (or checked against the pinned one)."""
    key = load_public_key(offered)
    if pinned:
        if public_key_id(trust.publisher_key()) != public_key_id(key):
            raise DeviceError("the server's publisher key differs from the one this device pins: refusing to enrol")
        return lambda: None
    return lambda: write_private(trust.root / PUBLISHER_FILE, offered)
