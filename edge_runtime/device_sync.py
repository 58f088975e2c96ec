"""A device's sync (:meth:`~.device.Device.sync`): upload queued originals, take the listing's
withdrawals (:mod:`.revert`; an interrupted upgrade heading to a withdrawn version is not finished),
resume an interrupted upgrade, drop the vectors kept for a revert when the listing names the
version confirmed, install or upgrade to the latest version on offer that is not withdrawn, give
rows a valid origin version where an earlier revert left one above their version
(:meth:`~.gallery.upgrades.GalleryUpgrades.heal_origins`), replicate, report. :class:`SyncResult`
is what it says it did."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from .bundle_store import InstalledBundles
from .device_parts import DeviceParts
from .device_trust import DeviceTrust
from .device_trust_sync import trusted_listing
from .gallery import Gallery
from .replication import ReplicationResult
from .revert import take_withdrawals
from .revert_records import confirm_rollback, withdrawal_log
from .upgrade import DeviceUpgrade
from .upgrade_plan import hop_list


@dataclass
class SyncResult:
    installed_before: int
    installed_after: int
    hops: str = "(none)"
    rows_upgraded: int = 0
    uploaded: int = 0
    still_queued: int = 0
    notes: list[str] = field(default_factory=list)
    replication: ReplicationResult | None = None


class SyncingDevice(Protocol):
    """What a sync uses of :class:`~.device.Device` (which calls :func:`sync_device` with itself)."""

    gallery: Gallery
    bundles: InstalledBundles
    trust: DeviceTrust

    @property
    def version(self) -> int: ...
    @property
    def parts(self) -> DeviceParts: ...
    def client(self, *, attempts: int = 6) -> Any: ...
    def flush_outbox(self, *, attempts: int = 2) -> tuple[int, int]: ...
    def _refuse_damaged_settings(self) -> None: ...
    def expire_rollback(self, now: float | None = None) -> bool: ...
    def _upgrades(self, client: Any = None) -> DeviceUpgrade: ...
    def _upgraded(self) -> None: ...
    def _report(self, client: Any, state: int, target: int = 0, progress: float = 0.0) -> None: ...
    def _replicate(self, client: Any, result: SyncResult, wanted: bool) -> None: ...


def sync_device(device: SyncingDevice, *, upgrade: bool, replicate: bool) -> SyncResult:
    """One sync of ``device`` (see the module docstring)."""
    from fctkit.protos import fleet_pb2

    device._refuse_damaged_settings()
    result = SyncResult(device.version, device.version)
    with device.client() as client:
        result.uploaded, result.still_queued = device.flush_outbox()
        upgrades = device._upgrades(client)
        trusted = device.trust.trusted_time()  # before the new metadata moves fresh_at to this clock
        listing = trusted_listing(device.trust, client, device.version)  # a trust refusal stops here
        if trusted is not None and device.expire_rollback(trusted):
            result.notes.append(
                "the rollback window closed: the vectors kept from before the last upgrade were dropped"
            )
        reverted_from = device.version
        # before an interrupted upgrade resumes: one heading to a withdrawn version is not finished
        result.notes += take_withdrawals(device.parts, device.trust, listing.withdrawals, client)
        if device.version != reverted_from:
            device._upgraded()  # searches reload; the rows back in the earlier space get their offsets
        result.rows_upgraded += upgrades.resume()
        if confirmed := confirm_rollback(device.gallery, listing.confirmed_versions):  # after a revert: it wins
            result.notes.append(
                f"v{confirmed.version} was confirmed: the vectors kept of v{confirmed.previous_version} "
                "for a revert were dropped (a later withdrawal reverts through backward or the vault)"
            )
        withdrawn = withdrawal_log(device.gallery)
        latest = [v for v in listing.versions if v.version > device.version and not withdrawn.withdrawn(v.version)]
        if latest:
            target = latest[-1].version
            device._report(client, fleet_pb2.UPGRADE_STATE_DOWNLOADING, target)
            if device.version == 0:
                device.bundles.download(client, target, 0)
                device.gallery.set_meta({"query_version": str(target)})
            else:
                plan = upgrades.server_plan(client, target)
                result.hops = hop_list(plan.hops)
                if upgrade:
                    result.rows_upgraded += upgrades.start(plan)
        result.installed_after = device.version
        if healed := device.gallery.heal_origins():  # left by reverts before origins were checked
            result.notes.append(
                f"{healed} row(s) had an origin version above their version (left by an earlier revert): "
                "their origin is now their version, and their records are pushed again"
            )
            device._upgraded()
        device._replicate(client, result, replicate)
        device._report(client, fleet_pb2.UPGRADE_STATE_IDLE)
    return result
