"""A device: its key, its encrypted gallery, its installed bundles and its link to the server.

Directory layout (everything private to the device user)::

    device.json      settings: server address, device id, owner id, engine choices (no secrets)
    device.key       the 256-bit device key, 0600, optionally passphrase-wrapped
    owner.key        the owner's 256-bit key (shared by the owner's devices: export-key / init
                     --import-key), 0600, wrapped by the same passphrase as device.key
    token            the device's bearer token from enrolment, 0600
    publisher.pub    a device from before roots: the publisher's Ed25519 key pinned at enrolment (or init)
    trust/           the root of trust it holds, every root accepted, the last timestamp (:mod:`.device_trust`)
    gallery.sqlite   the encrypted gallery (see fctkit.edge_runtime.gallery)
    bundles/vN/      verified bundles; downloads/vN/ while downloading (resumable)

Typical use::

    device = Device.open("dev1")
    device.sync()                      # install or upgrade to the latest published version,
                                       # then pull and push the owner's gallery replica
    device.add(images, labels=labels)  # embed locally, store sealed rows, upload sealed originals
    matches = device.query(images, k=5)

Offline (no server): ``device.upgrade([v2_dir, v3_dir])`` installs the bundles and upgrades
along the cheapest path they offer (:mod:`.upgrade`, planned as the server plans).

Restoring a lost device: ``Device.init(new_dir, owner_key_file=exported, owner_key_passphrase=...)``,
enrol with a code made for the same owner, ``sync()``: the gallery comes back from the replica.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fctkit.errors import DeviceError, DeviceKeyError
from fctkit.private_files import make_private
from fctkit.protos.client import ClientTls, FctkitClient
from fctkit.protos.retry_policy import RetryPolicy

from .adding import AddedItems, OnBadItem, add_items, restore_from_vault, side_infos_again, usable_queries
from .backfill import BackfillResult, run_backfill
from .bundle_store import InstalledBundles
from .crypto import Sealer, UnusableKey, new_key, owner_key_id, read_key_file, write_key_file
from .device_files import (
    GALLERY_FILE,
    KEY_FILE,
    OWNER_KEY_FILE,
    SETTINGS_FILE,
    TOKEN_FILE,
    DeviceSettings,
    read_settings,
    write_settings,
)
from .device_parts import DeviceParts
from .device_status import device_status
from .device_sync import SyncResult, sync_device
from .device_trust import DeviceTrust, initial_pin
from .device_trust_sync import TrustChoice, enrol_device, trusted_client
from .engine import Engine, Items
from .gallery import Gallery
from .gallery.rows import LoadedRows
from .queries import GallerySearch, Match
from .repair import damage_report, repair_gallery, valid_names
from .replication import OnBatch, ReplicationResult, apply_pending, replicate
from .revert_records import expire_rollback, revert_report_fields, withdrawal_status
from .scoring import TransitionState, store_hubness_offsets
from .search import ExactIndex
from .upgrade import DeviceUpgrade
from .upgrade_check import HealthCheck, send_report
from .upgrade_plan import UpgradePlan
from .work_window import Window

__all__ = ["AddedItems", "Device", "DeviceSettings", "Match", "SyncResult"]
BundleDirs = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]  # bundle folders or .tar archives


class Device:
    """One device directory; open with :meth:`init` (new) or :meth:`open` (existing). A facade:
    the work is done by the gallery, the installed bundles (:mod:`.bundle_store`), the search
    (:mod:`.queries`) and the operations in :mod:`.upgrade`, :mod:`.backfill`,
    :mod:`.replication` and :mod:`.repair`, each handed what it needs."""

    def __init__(self, root: Path, key: bytes, settings: DeviceSettings, owner_key: bytes | DeviceKeyError) -> None:
        self.root = root
        make_private(root)  # owner-only: directories 0700, files 0600, whatever the umask or earlier modes
        self.settings = settings
        self._key = key
        self._sealer = Sealer(key)
        # vault originals and replica records; a damaged owner key refuses them, queries go on without it
        self.owner_sealer = UnusableKey(owner_key) if isinstance(owner_key, DeviceKeyError) else Sealer(owner_key)
        self._owner_key = owner_key
        self.gallery = Gallery.open(root / GALLERY_FILE, key)
        self.trust = DeviceTrust(root, settings.clock_tolerance_s)  # its .clock is replaceable (tests)
        self.bundles = InstalledBundles(root, self.trust, settings.engine)
        self.search = GallerySearch(self.gallery, self.bundles, settings.search_backend)
        if not self.gallery.settings.damaged():  # a closed rollback window's kept vectors go at an open or a sync
            self.expire_rollback()
        self.progress = True

    # -- creation ---------------------------------------------------------------------------

    @classmethod
    def init(
        cls,
        root: str | os.PathLike[str],
        *,
        passphrase: str | None = None,
        publisher_key: str | os.PathLike[str] | None = None,
        settings: DeviceSettings | None = None,
        owner_key_file: str | os.PathLike[str] | None = None,
        owner_key_passphrase: str | None = None,
        trust_root: str | os.PathLike[str] | None = None,
    ) -> Device:
        """Create a device directory: a new device key, an empty gallery, optionally a pinned
        root of trust (``trust_root``, a root file signed by a threshold of its own root keys) or
        publisher key; the owner key is imported from ``owner_key_file`` (written by
        :meth:`export_owner_key` on another device of the owner) or, without one, made new."""
        root = Path(root)
        if (root / SETTINGS_FILE).exists():
            raise DeviceError(f"{root} is already a device: open it (nothing was changed)")
        pin = initial_pin(trust_root, publisher_key)  # a bad root or key file is refused before anything is written
        owner_key = (
            new_key() if owner_key_file is None else read_key_file(owner_key_file, owner_key_passphrase, kind="owner")
        )
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = new_key()
        write_key_file(root / KEY_FILE, key, passphrase)
        write_key_file(root / OWNER_KEY_FILE, owner_key, passphrase, kind="owner")
        Gallery.create(root / GALLERY_FILE, key).close()
        pin(root)
        settings = settings or DeviceSettings()
        write_settings(root / SETTINGS_FILE, settings)
        return cls(root, key, settings, owner_key)

    @classmethod
    def open(cls, root: str | os.PathLike[str], *, passphrase: str | None = None) -> Device:
        root = Path(root)
        if not (root / SETTINGS_FILE).is_file():
            raise DeviceError(f"{root} is not a device directory: run `fctkit device init --dir {root}` first")
        settings = read_settings(root / SETTINGS_FILE)
        key = read_key_file(root / KEY_FILE, passphrase)
        if not (root / OWNER_KEY_FILE).exists():  # a device from before owners: it starts an owner key of its own
            write_key_file(root / OWNER_KEY_FILE, new_key(), passphrase, kind="owner")
        try:
            owner_key: bytes | DeviceKeyError = read_key_file(root / OWNER_KEY_FILE, passphrase, kind="owner")
        except DeviceKeyError as exc:  # kept for what needs the owner key: queries do not
            owner_key = exc
        return cls(root, key, settings, owner_key)

    def owner_key(self) -> bytes:
        """The owner key; its file's error when it failed to read."""
        if isinstance(self._owner_key, DeviceKeyError):
            raise self._owner_key
        return self._owner_key

    def expire_rollback(self, now: float | None = None) -> bool:
        """Drop the rollback window's kept vectors once it closed, by the device clock where the trust
        metadata vouches for it (``now``: :meth:`DeviceTrust.trusted_time`, taken by a sync before it
        accepts new metadata); a clock it does not vouch for keeps them. Returns whether they went."""
        now = self.trust.trusted_time() if now is None else now
        return now is not None and expire_rollback(self.gallery, now)

    def export_owner_key(self, path: str | os.PathLike[str], passphrase: str) -> Path:
        """Write the owner key to a new 0600 file, wrapped by ``passphrase`` (scrypt), for
        ``init(owner_key_file=...)`` on the owner's other or replacement devices."""
        if not passphrase:
            raise DeviceError("an exported owner key must be passphrase-wrapped: give a passphrase")
        return write_key_file(path, self.owner_key(), passphrase, kind="owner")

    def close(self) -> None:
        self.gallery.close()

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def parts(self) -> DeviceParts:
        """What the device's operations are handed (built anew: settings can change)."""
        return DeviceParts(
            self.gallery,
            self.bundles,
            self._sealer,
            self.owner_sealer,
            self.settings.owner_id,
            self.client,
            self.progress,
        )

    # -- server link ------------------------------------------------------------------------

    @property
    def publisher_key(self) -> Ed25519PublicKey:
        """The pinned publisher key of a device from before roots."""
        return self.trust.publisher_key()

    def enrol(
        self,
        server: str,
        code: str,
        *,
        device_name: str = "",
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        trust_root: str | os.PathLike[str] | None = None,
        root_fingerprint: str | None = None,
        trust_on_first_use: bool = False,
    ) -> str:
        """Trade an enrolment code for a device token and take the server's root of trust; returns
        the device id. A device that pins nothing yet needs exactly one of ``trust_root`` (a root
        file), ``root_fingerprint`` or ``trust_on_first_use`` (:mod:`.device_trust_sync`); one that
        pins a root walks from it, one that pins a publisher key refuses another. The server refuses
        (FAILED_PRECONDITION) a device whose owner key is not its owner's other devices' key.
        ``tls_ca`` (the CA to trust) and ``tls_cert``/``tls_key`` (this device's certificate, for a
        server that requires one) are paths kept in the settings for later connections."""
        tls_ca, tls_cert, tls_key = (
            None if path is None else str(Path(path).resolve()) for path in (tls_ca, tls_cert, tls_key)
        )
        enrolment = enrol_device(
            self.trust,
            owner_key_id(self.owner_key()),
            server,
            code,
            device_name,
            ClientTls.from_files(tls_ca, tls_cert, tls_key),
            TrustChoice(trust_root, root_fingerprint, trust_on_first_use),
        )
        if self.settings.owner_id and self.settings.owner_id != enrolment.owner_id:
            self.gallery.replica_log.reset_replication()  # a new owner: its replica starts from this gallery
        self.settings = replace(
            self.settings,
            server=server,
            device_id=enrolment.device_id,
            device_name=device_name,
            tls_root_certificates=tls_ca,
            tls_client_cert=tls_cert,
            tls_client_key=tls_key,
            owner_id=enrolment.owner_id or None,
        )
        write_settings(self.root / SETTINGS_FILE, self.settings)
        return enrolment.device_id

    def use_servers(self, server: str) -> None:
        """Reach the server at ``server`` from now on (another address, or every replica's: ``a:port,b:port``); the token stays."""
        self.settings = replace(self.settings, server=server)
        write_settings(self.root / SETTINGS_FILE, self.settings)

    def client(self, *, attempts: int = 6) -> FctkitClient:
        settings = self.settings
        if not settings.server or not (self.root / TOKEN_FILE).exists():
            raise DeviceError("this device is not enrolled: run `fctkit device enrol --server HOST:PORT --code CODE`")
        tls = ClientTls.from_files(settings.tls_root_certificates, settings.tls_client_cert, settings.tls_client_key)
        token = (self.root / TOKEN_FILE).read_text().strip()
        return FctkitClient(settings.server, token, tls=tls, retry=RetryPolicy(attempts=attempts))

    # -- bundles ----------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The installed version (the one answering queries; 0: none yet)."""
        return self.gallery.query_version

    def engine(self, version: int | None = None) -> Engine:
        """The engine of an installed bundle (default: the query version), verified on first use."""
        return self.bundles.engine(self.version if version is None else version)

    def install_bundle(self, source: str | os.PathLike[str]) -> int:
        """Verify a local bundle directory and copy it in (:meth:`InstalledBundles.install`); the
        gallery is not touched. Returns its version."""
        return self.bundles.install(source, self.version)

    def installed_versions(self) -> list[int]:
        """The versions whose verified bundles are installed on this device."""
        return self.bundles.versions()

    def pending_versions(self) -> list[int]:
        """Installed versions not yet applied (:meth:`DeviceParts.pending_versions`)."""
        return self.parts.pending_versions()

    # -- adding and querying ----------------------------------------------------------------

    def add(
        self,
        images: Items,
        *,
        item_ids: Sequence[str] | None = None,
        labels: Sequence[str | None] | None = None,
        upload: bool = True,
    ) -> list[str]:
        """Embed ``images`` locally (φ and ψ of the installed bundle: arrays, or raw items — image
        file bytes, texts — when it declares preprocessing), store them as sealed rows, and queue
        each original, sealed under a fresh data key, for the vault (in the same transaction);
        then try to upload the queue. Returns the item ids; a bad raw item refuses the call
        (:class:`~fctkit.errors.ItemError`, nothing stored)."""
        return self.add_items(images, item_ids=item_ids, labels=labels, upload=upload).item_ids

    def add_items(
        self,
        items: Items,
        *,
        item_ids: Sequence[str] | None = None,
        labels: Sequence[str | None] | None = None,
        upload: bool = True,
        on_bad_item: OnBadItem = "refuse",
    ) -> AddedItems:
        """:meth:`add`, with the choice of refusing the call or skipping the items the bundle's
        preprocessing cannot take (``on_bad_item``); says which were skipped and why."""
        added = add_items(self.parts, items, item_ids, labels, on_bad_item)
        if upload and self.settings.server:
            self.flush_outbox()
        return added

    def remove(self, item_ids: Sequence[str]) -> int:
        """Remove items from the gallery (and their queued uploads); returns how many were
        removed. The removal replicates as tombstones (the ids are never used again); once the
        server acknowledged them, the next sync deletes the items' originals from the vault."""
        return self.gallery.delete_rows(list(item_ids))

    def flush_outbox(self, *, attempts: int = 2) -> tuple[int, int]:
        """Upload queued sealed originals (:meth:`DeviceParts.flush_outbox`); returns (uploaded, still queued)."""
        return self.parts.flush_outbox(attempts=attempts)

    def fetch_original(self, item_id: str) -> np.ndarray:
        """Download an item's sealed original from the vault and open it."""
        sha256 = self.gallery.replica_log.vault_sha256(item_id)
        if sha256 is None:
            raise DeviceError(f"item {item_id!r} has not been uploaded yet: sync first")
        with self.client() as client:
            return self.open_original(item_id, client.read_blob(sha256))

    def open_original(self, item_id: str, blob: bytes) -> np.ndarray:
        """Open a sealed original from the vault (sealed by any device of the owner)."""
        return self.parts.open_original(item_id, blob)

    def query_vectors(self, images: np.ndarray, version: int | None = None) -> np.ndarray:
        """Query images in the query space of ``version`` (default: installed): φ_v, Q(φ_v) when the
        bundle has a query map, or B(φ_v) in unified mode."""
        return self.search.query_vectors(images, self.version if version is None else version)

    def searchable(self) -> tuple[ExactIndex, LoadedRows]:
        """The decrypted rows comparable with queries (cached until the gallery changes); with
        transition scoring or hubness offsets the index holds the prepared vectors (:mod:`.scoring`)."""
        return self.search.searchable()[1:3]

    def query(self, images: Items, k: int = 5) -> list[list[Match]]:
        """The ``k`` nearest gallery items of each query (an array row, or a raw item when the
        bundle declares preprocessing; exact search; during a transition the query is embedded by
        both versions' models and scored as :mod:`.scoring` says)."""
        return self.search.query(images, k)

    def query_items(
        self, items: Items, query_ids: Sequence[str], k: int = 5, on_bad_item: OnBadItem = "refuse"
    ) -> tuple[list[tuple[str, list[Match]]], list[tuple[str, str]]]:
        """:meth:`query` with ids: (query id, matches) of each query answered, and (query id,
        reason) of each the bundle's preprocessing cannot take (refused unless ``on_bad_item`` is 'skip')."""
        version = self.version
        transition = self.transition
        engines = [self.engine()] + (
            [self.engine(transition.previous_version)]
            if transition is not None and transition.version == version
            else []
        )
        usable, ids, skipped = usable_queries(engines, items, query_ids, on_bad_item)
        answers = self.search.query(usable, k) if len(ids) else []
        return list(zip(ids, answers, strict=True)), skipped

    # -- sync and upgrade -------------------------------------------------------------------

    def sync(self, *, upgrade: bool = True, replicate: bool = True) -> SyncResult:
        """Upload queued originals, take the listing's signed withdrawals (going back from a withdrawn
        version, :mod:`.revert`), install (first time) or upgrade to the latest version not withdrawn,
        then (``replicate``, on a device of an owner) pull and push the owner's gallery replica."""
        return sync_device(self, upgrade=upgrade, replicate=replicate)

    def _replicate(self, client: FctkitClient, result: SyncResult, wanted: bool) -> None:
        if not wanted:
            return
        if not self.settings.owner_id:
            result.notes.append("not replicated: enrolled before owners existed; enrol again to join an owner")
            return
        result.replication = replicate(self.parts, client)
        self._rows_arrived()

    def replicate(self, *, on_batch: OnBatch | None = None) -> ReplicationResult:
        """Pull and push the owner's gallery replica (see :mod:`fctkit.edge_runtime.replication`)."""
        with self.client() as client:
            result = replicate(self.parts, client, on_batch=on_batch)
        self._rows_arrived()
        return result

    def _rows_arrived(self) -> None:
        """Rows came from the owner's replica: searches reload, and they get their hubness offsets."""
        self.search.reset()
        if self.version:
            store_hubness_offsets(self.gallery, self.engine())

    def watch(self, *, max_versions: int | None = None, upgrade: bool = True) -> Iterator[SyncResult]:
        """Follow the server's version stream and sync on each new version (blocking; ends when
        the server shuts down, or after ``max_versions`` versions). Yields each :class:`SyncResult`."""
        seen = 0
        with self.client() as client:
            for published in client.watch_versions(after_version=self.version):
                if published.version <= self.version:
                    continue
                yield self.sync(upgrade=upgrade)
                seen += 1
                if max_versions is not None and seen >= max_versions:
                    return

    def upgrade(self, bundle_dirs: BundleDirs | None = None, *, window: Window | None = None) -> int:
        """Offline: resume an interrupted upgrade, or install ``bundle_dirs`` (folders or ``.tar`` archives, each
        verified, in version order) and upgrade to the newest along the cheapest path the installed bundles offer from
        every version the gallery's rows are in (direct adapters, hop by hop, "compatible" identity hops). A device
        with no model yet just installs them. ``window`` (:mod:`.work_window`) bounds this call: once spent the
        upgrade pauses (``gallery.upgrade_state`` stays set) and the next call resumes it. Returns the rows upgraded."""
        self._refuse_damaged_settings()
        if isinstance(bundle_dirs, (str, os.PathLike)):
            bundle_dirs = [bundle_dirs]
        return self._upgrades(window=window).offline(bundle_dirs)

    def upgrade_with(self, plan: UpgradePlan, client: FctkitClient | None = None) -> int:
        """Record ``plan`` in the gallery and run it."""
        return self._upgrades(client).start(plan)

    def _upgrades(self, client: FctkitClient | None = None, window: Window | None = None) -> DeviceUpgrade:
        """This device's upgrades (:class:`~.upgrade.DeviceUpgrade`), reporting progress to the
        fleet service through ``client`` when given."""
        from fctkit.protos import fleet_pb2

        def report(to: FctkitClient, target: int, progress: float) -> None:
            self._report(to, fleet_pb2.UPGRADE_STATE_UPGRADING, target, progress=progress)

        return DeviceUpgrade(
            self.parts,
            batch_size=self.settings.batch_size,
            after=self._upgraded,
            report=functools.partial(report, client) if client is not None else None,
            check=HealthCheck(self.parts, self.settings.device_id, self.settings.health_sample),
            window=window,
        )

    def _upgraded(self) -> None:
        """After an upgrade: replica records that waited for its version land, every row gets its
        hubness offset, searches reload."""
        apply_pending(self.parts)
        store_hubness_offsets(self.gallery, self.engine())
        self.search.reset()

    def _report(self, client: FctkitClient, state: int, target: int = 0, progress: float = 0.0) -> None:
        """Tell the fleet service where this device stands, with the last upgrade's health (best effort:
        :func:`~.upgrade_check.send_report`)."""
        send_report(
            client,
            self.gallery,
            self.version,
            state,
            target_version=target,
            progress=min(progress, 1.0),
            **self.trust.report_fields(),
            **revert_report_fields(self.gallery),
        )

    # -- backfill and transition scoring ----------------------------------------------------

    def backfill(
        self,
        budget: int | None = None,
        *,
        budget_bytes: int | None = None,
        order: str | None = None,
        seed: int = 0,
        batch_size: int = 64,
        on_batch: Callable[[int], object] | None = None,
        window: Window | None = None,
    ) -> BackfillResult:
        """Re-embed the rows most worth it from their vault originals (see :mod:`fctkit.edge_runtime.backfill`):
        ``order`` one of random, uncertainty, class-mean-l2, class-mean-cosine, kmeans (default: uncertainty when
        the bundle has σ, else class-mean-l2), within ``budget`` rows and/or ``budget_bytes`` of vault downloads.
        Resumes an interrupted or paused backfill first; ``window`` bounds this call (:mod:`.work_window`)."""
        result = run_backfill(
            self.parts,
            lambda: self.searchable()[1],
            budget=budget,
            budget_bytes=budget_bytes,
            order=order,
            seed=seed,
            batch_size=batch_size,
            on_batch=on_batch,
            window=window,
        )
        self.search.reset()
        store_hubness_offsets(self.gallery, self.engine())
        if self.transition is not None and self.gallery.not_native(self.version) == 0:
            self.end_transition()  # every row is the new model's own now: nothing left to bridge
        return result

    @property
    def transition(self) -> TransitionState | None:
        """The transition in progress (see :mod:`.scoring`), or None."""
        return self.search.transition

    def end_transition(self) -> bool:
        """End transition scoring: the rows' previous embeddings are deleted from the gallery (one
        transaction) and the previous version's graph is unloaded; queries then use the adapted
        rows alone. The previous bundle stays installed (older replicated rows may need its
        adapters). Returns whether a transition was in progress."""
        return self.search.end_transition()

    # -- damage ----------------------------------------------------------------------------

    def damaged_rows(self) -> list[tuple[int, str, str]]:
        """(row id, item id, reason) of the rows left out of searches because they fail to open, and
        of the last query's matches whose label failed to open."""
        return list(self.search.searchable()[2].corrupt) + self.search.damaged_labels

    def _refuse_damaged_settings(self) -> None:
        """Before installing or upgrading anything: a gallery with damaged settings is repaired first."""
        damaged = self.gallery.settings.damaged()
        if damaged:
            raise self.gallery.settings.error(damaged)

    def missing_rows(self) -> int:
        """Rows the gallery's authenticated row count has but its file no longer holds."""
        return self.search.searchable()[2].missing

    def check(self) -> dict[str, Any]:
        """Open everything the device keeps and report what is damaged, all at once
        (:func:`~fctkit.edge_runtime.repair.damage_report`); ``damaged`` is the total (0: clean)."""
        return damage_report(self.gallery, self.open_original, lambda: self.bundles.damaged(lambda: [self.version]))

    def repair(self) -> dict[str, Any]:
        """Repair the installed bundles (with a server, damaged ones are downloaded again) and the gallery
        (:func:`~.repair.repair_gallery`: derivable settings, damaged rows, extras and queued originals; a row
        whose side-info alone fails is kept); then, on a device of an owner with a server, pull the owner's
        replica again, which brings back every forgotten or missing row it holds; a row it does not hold whose
        original is in the vault is embedded again with the installed version. The rest stay removed, listed."""
        if isinstance(self.owner_sealer, UnusableKey):  # it would take every queued original for damaged
            raise self.owner_sealer.refusal("repair", self.gallery.replica_log.outbox_size())
        online, needed = bool(self.settings.server), lambda: [self.version]
        trust = self.trust.repair()  # first: a download below checks against it
        connect = lambda: trusted_client(self.trust, self.client)  # noqa: E731
        bundles = self.bundles.fetch_again(connect, needed) if online else self.bundles.damaged(needed)
        result = repair_gallery(
            self.gallery,
            self.open_original,
            self.installed_versions(),
            lambda rows: side_infos_again(self.parts, rows, online=online),
        )
        report: dict[str, Any] = {
            **asdict(result),
            "damaged_bundles": {f"v{v}": reason for v, reason in bundles.items()},
            "trust_restored": trust,
        }
        del report["vault_originals"]  # labels and hashes: the device's business, not the report's
        lost, gone = result.rows_forgotten, result.rows_forgotten or result.rows_missing
        if gone and not (self.settings.owner_id and self.settings.server):
            report.update(
                replication=None,
                next="this device has no owner's replica (not enrolled): the damaged rows are removed here",
            )
        elif gone and self.gallery.upgrade_state is not None:  # replication waits for the upgrade
            report.update(
                replication=None,
                next="finish the upgrade (`fctkit device upgrade --dir DIR`); the next sync brings the rows back",
            )
        elif gone:
            report["replication"] = asdict(self.replicate())  # which reloads searches and stores missing offsets
        if not report.get("replication") and self.version not in bundles:
            self._rows_arrived()  # searches reload; dropped hubness offsets are computed again
        back = set(self.gallery.replica_log.load_items(valid_names(lost))[0].item_ids) if lost else set()
        from_vault = {i: result.vault_originals[i] for i in lost if i not in back and i in result.vault_originals}
        if from_vault and online and self.gallery.upgrade_state is None and self.version not in bundles:
            back |= set(restore_from_vault(self.parts, from_vault))  # the replica lacked them
            self._rows_arrived()
        report["rows_restored"] = [i for i in lost if i in back]
        report["rows_restored_from_vault"] = [i for i in from_vault if i in back]
        report["rows_removed"] = [i for i in lost if i not in back]
        report["damaged_after"] = self.check()["damaged"]
        return report

    # -- status -----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What the device holds and does (:func:`~.device_status.device_status`)."""
        key = self._owner_key
        owner = f"damaged: {key}" if isinstance(key, DeviceKeyError) else owner_key_id(key)
        status = device_status(self.root, self.settings, self.parts, self.search, owner, self.check)
        withdrawals = {} if "damaged_settings" in status else {"withdrawals": withdrawal_status(self.gallery)}
        return {**status, "trust": self.trust.status(), **withdrawals}
