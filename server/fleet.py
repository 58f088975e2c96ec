"""The Fleet service: one-time enrolment codes, device enrolment, device reports, fleet listing,
device revocation.

Codes and device tokens are random (>= 120 bits) and kept only as SHA-256 hashes; a code
works once and until it expires. Each code names the owner its device joins (the admin's
``owner``, or a new owner of its own); enrolment hands the device its owner id and the
publisher's public key to pin (under a root: the root's first publisher key, for clients that
pin one key; root-mode devices take the root from GetTrust instead). Reports carry the device's
trust state (its root version, and whether its timestamp went stale: a possible freeze) and,
after an upgrade, its health (checked by :mod:`.rollout.report_checks`, kept per device and version; a
rollout's guard may halt it at the report that tips it) and, after a withdrawal, the version it
went back from and how (kept per device and withdrawn version); reports are limited per device and
minute over all replicas. Every version a report names must be published and offered to the
device at some time (:meth:`~.rollout.offers.Rollouts.check_claim`): a report never widens what the
device is offered.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import math
import secrets
from collections.abc import Callable
from typing import Any, cast

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fctkit.errors import RpcStatusError
from fctkit.protos import fleet_pb2, fleet_pb2_grpc, limits
from fctkit.protos.bundle import public_key_id

from .auth import current_device_id, hash_secret, new_device_token
from .jsonlog import log_event
from .revocation import OpenStreams
from .rollout.changes import guard_verdict
from .rollout.offers import Rollouts
from .rollout.report_checks import (
    DEFAULT_REPORTS_PER_MINUTE,
    ReportLimiter,
    claimed_versions,
    health_report,
    revert_report,
)
from .rollout_store import HALTED, DeviceState, Rollout
from .storage import DeviceFilter, DeviceRecord, DeviceReport, OwnerKeyMismatch, Storage
from .validation import counter_field, invalid, page_size, sha256_field, text_field, timestamp

COMPACTION_PAGE_ITEMS = 2000  # item ids per replica compaction transaction (~50 ms on the reference box)
MAX_ROOT_VERSION = 1_000_000  # a root rotated daily reaches this in 2,700 years
MAX_SECONDS_SINCE_FRESH = 100 * 366 * 86400


def new_enrolment_code() -> str:
    """24 base32 characters (120 bits) in groups of four: easy to read out and type."""
    raw = base64.b32encode(secrets.token_bytes(15)).decode()
    return "-".join(raw[i : i + 4] for i in range(0, len(raw), 4))


def normalise_code(code: str) -> str:
    return "".join(code.split()).replace("-", "").upper()


def device_info(record: DeviceRecord) -> fleet_pb2.DeviceInfo:
    report = record.report
    return fleet_pb2.DeviceInfo(
        device_id=record.device_id,
        name=record.name,
        label=record.label,
        enrolled_at=record.enrolled_at,
        last_report_at=record.last_report_at or "",
        version=report.version,
        gallery_size=report.gallery_size,
        upgrade_state=cast(fleet_pb2.UpgradeState, report.upgrade_state),  # the stored enum number
        target_version=report.target_version,
        progress=report.progress,
        detail=report.detail,
        vault_bytes=record.vault_bytes,
        vault_blobs=record.vault_blobs,
        owner_id=record.owner_id,
        revoked_at=record.revoked_at or "",
        root_version=report.root_version,
        trust_stale=report.trust_stale,
        seconds_since_fresh=report.seconds_since_fresh,
    )


def device_filter(request: fleet_pb2.ListDevicesRequest) -> DeviceFilter:
    """The devices a ListDevices request keeps, checked (INVALID_ARGUMENT for a value out of range)."""
    state = request.upgrade_state
    if state not in fleet_pb2.UpgradeState.values():
        raise invalid(f"upgrade_state {state} is not one of IDLE, DOWNLOADING, UPGRADING, BACKFILLING, FAILED")
    if request.stale_seconds > MAX_SECONDS_SINCE_FRESH:
        raise invalid(f"stale_seconds is {request.stale_seconds}; at most {MAX_SECONDS_SINCE_FRESH} (100 years)")
    owner_id = text_field(request.owner_id, "owner_id")
    return DeviceFilter(
        version=request.version if request.HasField("version") else None,
        upgrade_state=state or None,
        reported_before=timestamp(after_s=-request.stale_seconds) if request.stale_seconds else None,
        owner_id=owner_id or None,
    )


def _trust_fields(request: fleet_pb2.ReportRequest) -> dict[str, Any]:
    """A report's trust state, checked: a root version in range, freshness only with a root."""
    if request.root_version > MAX_ROOT_VERSION:
        raise invalid(f"root_version is {request.root_version}; at most {MAX_ROOT_VERSION}")
    if request.seconds_since_fresh > MAX_SECONDS_SINCE_FRESH:
        raise invalid(
            f"seconds_since_fresh is {request.seconds_since_fresh}; at most {MAX_SECONDS_SINCE_FRESH} (100 years)"
        )
    if request.root_version == 0 and (request.trust_stale or request.seconds_since_fresh):
        raise invalid(
            "trust_stale and seconds_since_fresh describe a device's timestamps, which need a root: "
            "with root_version 0 (no root) both must be unset"
        )
    return {
        "root_version": request.root_version,
        "trust_stale": request.trust_stale,
        "seconds_since_fresh": request.seconds_since_fresh,
    }


class FleetService(fleet_pb2_grpc.FleetServicer):
    def __init__(
        self,
        storage: Storage,
        *,
        enrolment_key: Callable[[], Ed25519PublicKey | None],
        latest_version: Callable[[str], int],
        published: Callable[[int], bool],
        open_streams: OpenStreams | None = None,
        rollouts: Rollouts | None = None,
        reports_per_minute: int = DEFAULT_REPORTS_PER_MINUTE,
    ) -> None:
        """``latest_version(device_id)``: the latest version offered to the device;
        ``published(version)``: whether the version is published."""
        self._storage = storage
        self._rollouts = rollouts or Rollouts(storage)
        self._limiter = ReportLimiter(storage, reports_per_minute)
        self._published = published
        self._open_streams = open_streams or OpenStreams()
        self._enrolment_key = enrolment_key
        self._latest_version = latest_version
        self._compactions: dict[str, asyncio.Task] = {}

    async def CreateEnrolmentCode(self, request, context):
        ttl = request.ttl_seconds or limits.DEFAULT_ENROLMENT_TTL_S
        if ttl > limits.MAX_ENROLMENT_TTL_S:
            raise invalid(f"ttl_seconds is {ttl}; at most {limits.MAX_ENROLMENT_TTL_S} (30 days)")
        label = text_field(request.label, "label")
        owner_id = text_field(request.owner, "owner").strip() or "own-" + secrets.token_hex(8)
        code = new_enrolment_code()
        expires_at = timestamp(after_s=ttl)
        self._storage.add_enrolment_code(hash_secret(normalise_code(code)), label, timestamp(), expires_at, owner_id)
        return fleet_pb2.CreateEnrolmentCodeResponse(code=code, expires_at=expires_at, owner_id=owner_id)

    async def Enrol(self, request, context):
        code = normalise_code(text_field(request.code, "code", 64))
        if not code:
            raise invalid("code is empty: ask an admin for an enrolment code (fctkit admin enrol-code)")
        name = text_field(request.device_name, "device_name") or "device"
        token = new_device_token()
        device_id = "dev-" + secrets.token_hex(8)
        key_id = sha256_field(request.owner_key_id, "owner_key_id") if request.owner_key_id else ""
        try:
            record = self._storage.enrol(hash_secret(code), timestamp(), device_id, name, hash_secret(token), key_id)
        except OwnerKeyMismatch as mismatch:
            raise RpcStatusError(
                "FAILED_PRECONDITION",
                f"this device holds another owner key than owner {mismatch}'s "
                "devices: initialise it with their key (`fctkit device init --import-key`); "
                "the code is still unused",
            ) from None
        if record is None:
            raise RpcStatusError(
                "PERMISSION_DENIED", "unknown, used or expired enrolment code: ask an admin for a new one"
            )
        key = self._enrolment_key()
        raw = b"" if key is None else key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return fleet_pb2.EnrolResponse(
            device_id=device_id,
            token=token,
            publisher_public_key=raw,
            publisher_key_id="" if key is None else public_key_id(key),
            owner_id=record.owner_id,
        )

    async def Report(self, request, context):
        device_id = current_device_id()
        self._limiter.admit(device_id)
        if (
            request.upgrade_state not in fleet_pb2.UpgradeState.values()
            or request.upgrade_state == fleet_pb2.UPGRADE_STATE_UNSPECIFIED
        ):
            raise invalid(
                f"upgrade_state {request.upgrade_state} is not one of IDLE, DOWNLOADING, UPGRADING, BACKFILLING, FAILED"
            )
        if not (math.isfinite(request.progress) and 0.0 <= request.progress <= 1.0):
            raise invalid(f"progress is {request.progress}; a fraction from 0 to 1")
        report = DeviceReport(
            version=request.version,
            gallery_size=counter_field(request.gallery_size, "gallery_size"),
            upgrade_state=request.upgrade_state,
            target_version=request.target_version,
            progress=request.progress,
            detail=text_field(request.detail, "detail", limits.MAX_DETAIL_CHARS),
            **_trust_fields(request),
        )
        health = health_report(request)
        revert = revert_report(request, self._rollouts.withdrawals.withdrawn)
        self._check_claims(device_id, request)
        now = timestamp()
        watched = self._rollouts.failure_watched(device_id)
        before = self._storage.device_state(device_id) if watched else None
        if owner_id := self._storage.record_report(device_id, report, now):
            self._compact_replica(owner_id)
        if health is not None:
            self._storage.record_health(device_id, health, now)
            self._guard(health.version, device_id, now)
        if watched and before != DeviceState(device_id, *_state(report)):
            # a new state may move the device's download or failure for each (a health report's own
            # version was recounted with it)
            for version in watched:
                self._storage.refresh_failures(version, device_id)
                self._guard(version, device_id, now)
        if revert is not None:
            self._storage.record_revert(device_id, *revert, now)
        return fleet_pb2.ReportResponse(recorded_at=now, latest_version=self._latest_version(device_id))

    def _check_claims(self, device_id: str, request: fleet_pb2.ReportRequest) -> None:
        """NOT_FOUND when a version the report names is not published, PERMISSION_DENIED when it was
        never offered to the device (both logged): nothing of the report is stored then."""
        for field, version in claimed_versions(request).items():
            if not self._published(version):
                log_event("version claim refused", logging.WARNING, device_id=device_id, field=field, version=version)
                raise RpcStatusError(
                    "NOT_FOUND",
                    f"{field} is {version}, a version that was never published: report the versions "
                    "the device runs and upgrades to, as ListVersions names them; nothing was recorded",
                )
            self._rollouts.check_claim(device_id, version, field)

    def _guard(self, version: int, device_id: str, now: str) -> None:
        """Halt ``version``'s rollout when its guard trips at this report (on one replica at a time)."""

        def halted(current: Rollout | None) -> Rollout | None:
            reason = None if current is None else self._guard_verdict(current, device_id)
            return (
                current
                if current is None or reason is None
                else dataclasses.replace(current, state=HALTED, halt_reason=reason, updated_at=now)
            )

        if (rollout := self._rollouts.get(version)) is None or rollout.halt_min_devices == 0:
            return  # no guard here; a guard set on another replica arrives with its notification, within a second
        after = self._rollouts.change(version, halted)
        if after is not None and after.state == HALTED and rollout.state != HALTED:
            log_event("rollout halted", logging.WARNING, version=version, reason=after.halt_reason)

    def _guard_verdict(self, rollout: Rollout, device_id: str) -> str | None:
        """The guard's verdict on ``rollout`` from its running tally of owners' votes."""
        confirmed = self._rollouts.is_confirmed(rollout.version)
        return guard_verdict(rollout, self._storage.guard_tally(rollout.version), device_id, confirmed=confirmed)

    async def RevokeDevice(self, request, context):
        device_id = text_field(request.device_id, "device_id").strip()
        if not device_id:
            raise invalid("device_id is empty: name the device to revoke (fctkit admin list-devices)")
        outcome = self._storage.revoke_device(device_id, timestamp())
        if outcome is None:
            raise RpcStatusError("NOT_FOUND", f"no device {device_id!r}: see fctkit admin list-devices")
        revoked_at, owner_id = outcome
        ended = self._open_streams.end(device_id)  # its Watch, downloads and uploads end now
        if ended:
            log_event("revoked device's streams ended", device_id=device_id, streams=ended)
        if owner_id:
            self._compact_replica(owner_id)
        return fleet_pb2.RevokeDeviceResponse(revoked_at=revoked_at)

    def _compact_replica(self, owner_id: str) -> None:
        """Sweep the owner's replica for records every device has outgrown: the first page now (a
        small owner's whole replica), the rest in the background, yielding between pages so one
        large owner never stalls the server; on one replica at a time (a replica finding another
        one sweeping this owner skips: compaction only frees space, and what the skipped sweep
        would have freed goes at the owner's next one). A sweep cut short (shutdown) loses nothing: it only
        frees space, and the owner's next common version sweeps again."""
        last = self._storage.compact_replica_page(owner_id, "", COMPACTION_PAGE_ITEMS)
        if last is None:
            return
        previous = self._compactions.get(owner_id)

        async def rest(after: str) -> None:
            if previous is not None:
                await previous
            try:
                with self._storage.single_flight(f"compact-replica:{owner_id}") as mine:
                    page: str | None = after
                    while (
                        mine
                        and page is not None
                        and (page := self._storage.compact_replica_page(owner_id, page, COMPACTION_PAGE_ITEMS))
                        is not None
                    ):
                        await asyncio.sleep(0)
            except Exception as exc:  # nothing is lost: the records stay as they are
                log_event("replica compaction failed", logging.ERROR, exc_info=True, owner_id=owner_id, error=str(exc))

        def forget(done: asyncio.Task) -> None:
            if self._compactions.get(owner_id) is done:
                del self._compactions[owner_id]

        task = asyncio.get_running_loop().create_task(rest(last))
        self._compactions[owner_id] = task
        task.add_done_callback(forget)

    async def ListDevices(self, request, context):
        limit = page_size(request.page_size, limits.MAX_DEVICES_PAGE)
        try:
            after = int(request.page_token) if request.page_token else 0
        except ValueError:
            raise invalid("page_token must come from a previous ListDevices response") from None
        if not 0 <= after <= limits.MAX_UINT63:
            raise invalid("page_token must come from a previous ListDevices response")
        records = self._storage.list_devices(after, limit + 1, device_filter(request))
        page = records[:limit]
        return fleet_pb2.ListDevicesResponse(
            devices=[device_info(r) for r in page],
            next_page_token=str(page[-1].seq) if len(records) > limit else "",
        )


def _state(report: DeviceReport) -> tuple[int, int, int]:
    """What of a report the failure votes read: the version it runs, its target and its upgrade state."""
    return report.version, report.target_version, report.upgrade_state
