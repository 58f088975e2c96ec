"""A device: its key, its encrypted gallery, its installed bundles and its link to the server.

Directory layout (everything private to the device user)::

    device.json      settings: server address, device id, owner id, engine choices (no secrets)
    device.key       the 256-bit device key, 0600, optionally passphrase-wrapped
    owner.key        the owner's 256-bit key (shared by the owner's devices: export-key / init
                     --import-key), 0600, wrapped by the same passphrase as device.key
    token            the device's bearer token from enrolment, 0600
    publisher.pub    the publisher's Ed25519 key pinned at enrolment (or at init)
    gallery.sqlite   the encrypted gallery (see fctkit.edge_runtime.gallery)
    bundles/vN/      verified bundles; downloads/vN/ while downloading (resumable)

Typical use::

    device = Device.open("dev1")
    device.sync()                      # install or upgrade to the latest published version,
                                       # then pull and push the owner's gallery replica
    device.add(images, labels=labels)  # embed locally, store sealed rows, upload sealed originals
    matches = device.query(images, k=5)

Offline (no server): ``device.upgrade([v2_dir, v3_dir])`` installs the bundles and upgrades
along the cheapest path they offer, as the server would plan it (:mod:`fctkit.protos.planner`).
Either way the plan starts from every version the rows are in: after a "compatible" upgrade
rows keep their older tag, and a later adapter takes them through the identity hop.

Restoring a lost device: ``Device.init(new_dir, owner_key_file=exported, owner_key_passphrase=...)``,
enrol with a code made for the same owner, ``sync()``: the gallery comes back from the replica.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from fctkit.config import from_mapping, to_mapping
from fctkit.errors import BundleError, ConfigError, DeviceError, InputError, RpcStatusError
from fctkit.private_files import make_private

from .crypto import Sealer, new_key, owner_key_id, read_key_file, write_key_file
from .backfill import BackfillResult, gallery_vectors, record_uncertainty, run_backfill
from .replication import ReplicationResult, apply_pending, replicate
from .compatible import comparable_dims, compatible_rows
from .engine import PREFERENCE, Engine, EngineConfig
from .gallery import Gallery, LoadedRows, NewRow, VersionTag, take_rows
from .repair import damage_report, repair_gallery
from .scoring import (
    Scoring,
    TransitionState,
    prepared_queries,
    scoring_of,
    searched_rows,
    store_hubness_offsets,
    transition_for,
)
from .search import ExactIndex
from .upgrade import Hop, UpgradePlan, check_plan_dims, hop_list, run_upgrade
from .vault_blob import open_image, seal_image

REPORT_EVERY_S = 2.0  # upgrade progress reports to the fleet service, at most this often
SETTINGS_FILE, KEY_FILE, TOKEN_FILE, PUBLISHER_FILE, GALLERY_FILE = "device.json", "device.key", "token", "publisher.pub", "gallery.sqlite"
OWNER_KEY_FILE = "owner.key"


@dataclass(frozen=True)
class DeviceSettings:
    """What ``device.json`` holds (unknown keys are errors)."""

    server: str | None = None
    device_id: str | None = None
    owner_id: str | None = None
    device_name: str = ""
    tls_root_certificates: str | None = None
    tls_client_cert: str | None = None
    tls_client_key: str | None = None
    providers: tuple[str, ...] = PREFERENCE
    batch_size: int = 1024
    threads: int = 0
    search_backend: str = "auto"

    @property
    def engine(self) -> EngineConfig:
        return EngineConfig(providers=tuple(self.providers), batch_size=self.batch_size, threads=self.threads)


@dataclass(frozen=True)
class Match:
    item_id: str
    distance: float
    label: str | None
    tag: str


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


class Device:
    """One device directory; open with :meth:`init` (new) or :meth:`open` (existing)."""

    def __init__(self, root: Path, key: bytes, settings: DeviceSettings, owner_key: bytes) -> None:
        self.root = root
        make_private(root)  # owner-only: directories 0700, files 0600, whatever the umask or earlier modes
        self.settings = settings
        self._key = key
        self._sealer = Sealer(key)
        self.owner_sealer = Sealer(owner_key)  # vault originals and replica records
        self._owner_key = owner_key
        self.gallery = Gallery.open(root / GALLERY_FILE, key)
        self._engines: dict[int, Engine] = {}
        self._index_cache: tuple[tuple, ExactIndex, LoadedRows, Scoring] | None = None
        self.progress = True

    # -- creation ---------------------------------------------------------------------------

    @classmethod
    def init(cls, root: str | os.PathLike, *, passphrase: str | None = None, publisher_key: str | os.PathLike | None = None,
             settings: DeviceSettings | None = None, owner_key_file: str | os.PathLike | None = None,
             owner_key_passphrase: str | None = None) -> Device:
        """Create a device directory: a new device key, an empty gallery, optionally a pinned
        publisher key; the owner key is imported from ``owner_key_file`` (written by
        :meth:`export_owner_key` on another device of the owner) or, without one, made new."""
        root = Path(root)
        if (root / SETTINGS_FILE).exists():
            raise DeviceError(f"{root} is already a device: open it (nothing was changed)")
        owner_key = new_key() if owner_key_file is None else read_key_file(owner_key_file, owner_key_passphrase, kind="owner")
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = new_key()
        write_key_file(root / KEY_FILE, key, passphrase)
        write_key_file(root / OWNER_KEY_FILE, owner_key, passphrase, kind="owner")
        Gallery.create(root / GALLERY_FILE, key).close()
        if publisher_key is not None:
            from fctkit.protos.bundle import load_public_key

            load_public_key(publisher_key)  # refuse a bad key file now
            shutil.copyfile(publisher_key, root / PUBLISHER_FILE)
        settings = settings or DeviceSettings()
        _write_private(root / SETTINGS_FILE, json.dumps(to_mapping(settings), indent=2).encode())
        return cls(root, key, settings, owner_key)

    @classmethod
    def open(cls, root: str | os.PathLike, *, passphrase: str | None = None) -> Device:
        root = Path(root)
        if not (root / SETTINGS_FILE).is_file():
            raise DeviceError(f"{root} is not a device directory: run `fctkit device init --dir {root}` first")
        settings = _read_settings(root / SETTINGS_FILE)
        key = read_key_file(root / KEY_FILE, passphrase)
        if not (root / OWNER_KEY_FILE).exists():  # a device from before owners: it starts an owner key of its own
            write_key_file(root / OWNER_KEY_FILE, new_key(), passphrase, kind="owner")
        return cls(root, key, settings, read_key_file(root / OWNER_KEY_FILE, passphrase, kind="owner"))

    def export_owner_key(self, path: str | os.PathLike, passphrase: str) -> Path:
        """Write the owner key to a new 0600 file, wrapped by ``passphrase`` (scrypt), for
        ``init(owner_key_file=...)`` on the owner's other or replacement devices."""
        if not passphrase:
            raise DeviceError("an exported owner key must be passphrase-wrapped: give a passphrase")
        return write_key_file(path, self._owner_key, passphrase, kind="owner")

    def close(self) -> None:
        self.gallery.close()

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _save_settings(self, settings: DeviceSettings) -> None:
        _write_private(self.root / SETTINGS_FILE, json.dumps(to_mapping(settings), indent=2).encode())
        self.settings = settings

    # -- server link ------------------------------------------------------------------------

    @property
    def publisher_key(self):
        from fctkit.protos.bundle import load_public_key

        path = self.root / PUBLISHER_FILE
        if not path.exists():
            raise DeviceError("no publisher key is pinned: enrol with a server, or init with --publisher-key")
        return load_public_key(path)

    def enrol(self, server: str, code: str, *, device_name: str = "", tls_ca: str | None = None,
              tls_cert: str | None = None, tls_key: str | None = None) -> str:
        """Trade an enrolment code for a device token and pin the publisher's key; returns the device id.
        A device that already pins another publisher key refuses the server; the server refuses
        (FAILED_PRECONDITION) a device whose owner key is not its owner's other devices' key.
        ``tls_ca`` (the CA to trust) and ``tls_cert``/``tls_key`` (this device's certificate, for a
        server that requires one) are paths kept in the settings for later connections."""
        from fctkit.protos.bundle import load_public_key, public_key_id
        from fctkit.protos.client import ClientTls, FctkitClient

        tls_ca, tls_cert, tls_key = (None if path is None else str(Path(path).resolve()) for path in (tls_ca, tls_cert, tls_key))
        with FctkitClient(server, tls=ClientTls.from_files(tls_ca, tls_cert, tls_key)) as client:
            enrolment = client.enrol(code, device_name, owner_key_id=owner_key_id(self._owner_key))
        offered = load_public_key(enrolment.publisher_public_key)
        if (self.root / PUBLISHER_FILE).exists() and public_key_id(self.publisher_key) != public_key_id(offered):
            raise DeviceError("the server's publisher key differs from the one this device pins: refusing to enrol")
        if not (self.root / PUBLISHER_FILE).exists():
            _write_private(self.root / PUBLISHER_FILE, enrolment.publisher_public_key)
        _write_private(self.root / TOKEN_FILE, enrolment.token.encode(), replace_existing=True)
        if self.settings.owner_id and self.settings.owner_id != enrolment.owner_id:
            self.gallery.reset_replication()  # a new owner: its replica starts from this gallery
        self._save_settings(replace(self.settings, server=server, device_id=enrolment.device_id, device_name=device_name,
                                    tls_root_certificates=tls_ca, tls_client_cert=tls_cert, tls_client_key=tls_key,
                                    owner_id=enrolment.owner_id or None))
        return enrolment.device_id

    def client(self, *, attempts: int = 6):
        from fctkit.protos.client import ClientTls, FctkitClient, RetryPolicy

        if not self.settings.server or not (self.root / TOKEN_FILE).exists():
            raise DeviceError("this device is not enrolled: run `fctkit device enrol --server HOST:PORT --code CODE`")
        settings = self.settings
        tls = ClientTls.from_files(settings.tls_root_certificates, settings.tls_client_cert, settings.tls_client_key)
        token = (self.root / TOKEN_FILE).read_text().strip()
        return FctkitClient(settings.server, token, tls=tls, retry=RetryPolicy(attempts=attempts))

    # -- bundles and engines ----------------------------------------------------------------

    @property
    def version(self) -> int:
        """The installed version (the one answering queries; 0: none yet)."""
        return self.gallery.query_version

    def _bundle_dir(self, version: int) -> Path:
        return self.root / "bundles" / f"v{version}"

    def engine(self, version: int | None = None) -> Engine:
        """The engine of an installed bundle (default: the query version), verified on first use."""
        from fctkit.protos.bundle import verify_bundle

        version = self.version if version is None else version
        if version == 0:
            raise DeviceError("no model is installed yet: run `fctkit device sync` (or `upgrade --bundle DIR`)")
        if version not in self._engines:
            path = self._bundle_dir(version)
            if not path.is_dir():
                raise DeviceError(f"bundle v{version} is not installed on this device; sync again")
            bundle = verify_bundle(path, self.publisher_key)
            if bundle.manifest.version != version:
                raise BundleError(f"{path} holds bundle v{bundle.manifest.version}, not v{version}")
            self._engines[version] = Engine(bundle, self.settings.engine)
        return self._engines[version]

    def install_bundle(self, source: str | os.PathLike) -> int:
        """Verify a local bundle directory under the pinned key (signature, hashes, newer than
        the installed version) and copy it in; returns its version. The gallery is not touched.
        The very bundle already installed (the same signed manifest) of the current or a pending
        version is accepted again as it is, so repeating a command after a crash finishes the job
        instead of refusing a replay; an older version stays a rollback."""
        from fctkit.protos.bundle import check_version_is_newer, verify_bundle

        verified = verify_bundle(source, self.publisher_key)
        version = verified.manifest.version
        dest = self._bundle_dir(version)
        if version >= self.version and self._installed_manifest_bytes(version) == verified.manifest_bytes:
            return version  # the installed one again (a repeated command), never an older one
        check_version_is_newer(version, self.version or None)
        if not dest.exists():
            staging = dest.with_name(dest.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(verified.root, staging)
            make_private(staging)
            verify_bundle(staging, self.publisher_key)
            os.rename(staging, dest)
        return version

    def _installed_manifest_bytes(self, version: int) -> bytes | None:
        path = self._bundle_dir(version) / "manifest.json"
        return path.read_bytes() if path.is_file() else None

    def pending_versions(self) -> list[int]:
        """Installed versions newer than the one answering queries and no upgrade under way: a
        bundle installed by an upgrade that stopped before it began (`fctkit device upgrade` applies it)."""
        if self.gallery.upgrade_state is not None:
            return []
        return [v for v in self.installed_versions() if v > self.version]

    def _download(self, client, version: int) -> None:
        from fctkit.protos.bundle import verify_bundle

        dest = self._bundle_dir(version)
        if dest.is_dir():
            verify_bundle(dest, self.publisher_key, installed_version=self.version or None)
            return
        staging = self.root / "downloads" / f"v{version}"
        client.download_bundle(version, staging, self.publisher_key, installed_version=self.version or None)
        make_private(staging)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staging, dest)

    # -- adding and querying ----------------------------------------------------------------

    def add(self, images: np.ndarray | Sequence[np.ndarray], *, item_ids: Sequence[str] | None = None,
            labels: Sequence[str | None] | None = None, upload: bool = True) -> list[str]:
        """Embed ``images`` locally (φ and ψ of the installed bundle), store them as sealed rows,
        and queue each image, sealed under a fresh data key, for the vault (in the same
        transaction); then try to upload the queue. Returns the item ids."""
        images = np.asarray(images)
        if images.ndim < 2 or len(images) == 0:
            raise InputError(f"images must be an array of at least one image, got shape {images.shape}")
        item_ids = list(item_ids) if item_ids is not None else [uuid.uuid4().hex for _ in range(len(images))]
        labels = list(labels) if labels is not None else [None] * len(images)
        if len(item_ids) != len(images) or len(labels) != len(images):
            raise InputError(f"{len(images)} images but {len(item_ids)} item ids and {len(labels)} labels")
        if len(set(item_ids)) != len(item_ids) or not all(isinstance(i, str) and i for i in item_ids):
            raise InputError("item ids must be unique non-empty strings")
        engine = self.engine()
        embeddings, side_infos, via = gallery_vectors(engine, images)
        tag = VersionTag(self.version, self.version, via)
        rows = [NewRow(i, e, s, None if lab is None else str(lab)) for i, e, s, lab in zip(item_ids, embeddings, side_infos, labels, strict=True)]
        outbox = [(i, seal_image(self.owner_sealer, i, image)) for i, image in zip(item_ids, images, strict=True)]
        transition = self.transition
        previous = None
        if transition is not None and transition.version == self.version:  # kept for transition scoring
            u = transition.previous_version
            previous = (VersionTag(u, u, "native"), self.engine(u).embed(images))
        self.gallery.add_rows(rows, tag, outbox, query_version=engine.manifest.version, previous=previous)
        store_hubness_offsets(self.gallery, engine)
        if upload and self.settings.server:
            self.flush_outbox()
        return item_ids

    def remove(self, item_ids: Sequence[str]) -> int:
        """Remove items from the gallery (and their queued uploads); returns how many were
        removed. The removal replicates as tombstones (the ids are never used again); once the
        server acknowledged them, the next sync deletes the items' originals from the vault."""
        return self.gallery.delete_rows(list(item_ids))

    def flush_outbox(self, *, attempts: int = 2) -> tuple[int, int]:
        """Upload queued sealed originals to the vault; returns (uploaded, still queued).
        When the server cannot be reached the queue is kept for the next try."""
        queued = self.gallery.outbox()
        uploaded = 0
        if not queued:
            return 0, 0
        with self.client(attempts=attempts) as client:
            for item_id, blob in queued:
                try:
                    transfer = client.upload_blob(blob, item_id)
                except RpcStatusError as exc:
                    if exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED"):
                        break
                    raise
                self.gallery.mark_uploaded(item_id, transfer.sha256)
                uploaded += 1
        return uploaded, self.gallery.outbox_size()

    def fetch_original(self, item_id: str) -> np.ndarray:
        """Download an item's sealed original from the vault and open it."""
        sha256 = self.gallery.vault_sha256(item_id)
        if sha256 is None:
            raise DeviceError(f"item {item_id!r} has not been uploaded yet: sync first")
        with self.client() as client:
            return self.open_original(item_id, client.read_blob(sha256))

    def open_original(self, item_id: str, blob: bytes) -> np.ndarray:
        """Open a sealed original from the vault (sealed by any device of the owner)."""
        return open_image(self.owner_sealer, item_id, blob, device=self._sealer, gallery_id=self.gallery.gallery_id)

    def query_vectors(self, images: np.ndarray, version: int | None = None) -> np.ndarray:
        """Query images in the query space of ``version`` (default: installed): φ_v, Q(φ_v) when the
        bundle has a query map, or B(φ_v) in unified mode."""
        engine = self.engine(version)
        vectors = engine.embed(np.asarray(images))
        mapping = engine.unified_backward() or engine.query_map()
        return vectors if mapping is None else engine.run(mapping, vectors)

    def searchable(self) -> tuple[ExactIndex, LoadedRows]:
        """The decrypted rows comparable with queries (cached until the gallery changes); with
        transition scoring or hubness offsets the index holds the prepared vectors (:mod:`.scoring`)."""
        return self._searchable()[1:3]

    def _searchable(self) -> tuple[int, ExactIndex, LoadedRows, Scoring]:
        """The installed version, its searchable rows and how they are scored, loaded again if
        an upgrade switched versions between reading the version and loading the rows."""
        while True:
            version = self.version
            transition = self.transition
            if transition is not None and transition.expired():
                self.end_transition()  # the manifest's time limit
                continue
            key = (version, *self.gallery.change_marker())
            if self._index_cache is not None and self._index_cache[0] == key:
                return (version, *self._index_cache[1:])
            loaded = self.gallery.load()
            if self.version != version:
                continue
            manifest = self.engine(version).manifest
            if manifest.mode == "compatible":  # older versions' rows as stored, on the common prefix
                keep, vectors = compatible_rows([t.version for t in loaded.tags], loaded.embeddings,
                                                comparable_dims(self._installed_manifest, version))
                loaded = _subset(loaded, keep) if len(keep) != len(loaded) else loaded
                self._index_cache = (key, ExactIndex(vectors, manifest.distance, self.settings.search_backend), loaded, Scoring())
                continue
            if manifest.mode != "unified":
                keep = [i for i, t in enumerate(loaded.tags) if t.version == version]
                if len(keep) != len(loaded):
                    loaded = _subset(loaded, keep)
            scoring = scoring_of(manifest, transition)
            if scoring.kind != "plain" and len(loaded):
                previous_dim = self.engine(scoring.previous_version).manifest.embedding_dim if scoring.previous_version else 0
                vectors, distance = searched_rows(self.gallery, loaded, scoring, self.engine(version), previous_dim), "inner"
            else:
                vectors = take_rows(loaded.embeddings, range(len(loaded))) if len(loaded) else np.zeros((0, 1), np.float32)
                distance = manifest.distance
            self._index_cache = (key, ExactIndex(vectors, distance, self.settings.search_backend), loaded, scoring)

    def query(self, images: np.ndarray, k: int = 5) -> list[list[Match]]:
        """The ``k`` nearest gallery items of each query image (exact search; during a transition
        the query is embedded by both versions' models and scored as :mod:`.scoring` says)."""
        version, index, rows, scoring = self._searchable()
        vectors = self.query_vectors(images, version)
        if scoring.kind == "transition" and len(index):
            vectors = prepared_queries(scoring, vectors, self.query_vectors(images, scoring.previous_version))
        elif scoring.kind == "hubness" and len(index):
            vectors = prepared_queries(scoring, vectors)
        if len(index) and vectors.shape[1] > index.vectors.shape[1] and self.engine(version).manifest.mode == "compatible":
            vectors = vectors[:, : index.vectors.shape[1]]  # the prefix older rows are compared on (BT²)
        found = index.search(vectors, k)
        return [
            [Match(rows.item_ids[j], float(d), rows.labels[j], str(rows.tags[j])) for j, d in zip(idx, dist, strict=True)]
            for idx, dist in zip(found.indices, found.distances, strict=True)
        ]

    # -- sync and upgrade -------------------------------------------------------------------

    def sync(self, *, upgrade: bool = True, replicate: bool = True) -> SyncResult:
        """Upload queued originals, install (first time) or upgrade to the latest version, then
        (``replicate``, on a device of an owner) pull and push the owner's gallery replica."""
        from fctkit.protos import fleet_pb2

        self._refuse_damaged_settings()
        result = SyncResult(self.version, self.version)
        with self.client() as client:
            result.uploaded, result.still_queued = self.flush_outbox()
            state = self.gallery.upgrade_state
            if state is not None:
                result.rows_upgraded += self._run(UpgradePlan.from_state(state), client)
            latest = client.list_versions(after_version=self.version)
            if not latest:
                result.installed_after = self.version
                self._replicate(client, result, replicate)
                self._report(client, fleet_pb2.UPGRADE_STATE_IDLE)
                return result
            target = latest[-1].version
            self._report(client, fleet_pb2.UPGRADE_STATE_DOWNLOADING, target)
            if self.version == 0:
                self._download(client, target)
                self.gallery.set_meta({"query_version": str(target)})
            else:
                plan = self._plan(client, target)
                result.hops = hop_list(plan.hops)
                if upgrade:
                    result.rows_upgraded += self.upgrade_with(plan, client)
            result.installed_after = self.version
            self._replicate(client, result, replicate)
            self._report(client, fleet_pb2.UPGRADE_STATE_IDLE)
        return result

    def _replicate(self, client, result: SyncResult, wanted: bool) -> None:
        if not wanted:
            return
        if not self.settings.owner_id:
            result.notes.append("not replicated: enrolled before owners existed; enrol again to join an owner")
            return
        result.replication = replicate(self, client)
        self._rows_arrived()

    def replicate(self, *, on_batch=None) -> ReplicationResult:
        """Pull and push the owner's gallery replica (see :mod:`fctkit.edge_runtime.replication`)."""
        with self.client() as client:
            result = replicate(self, client, on_batch=on_batch)
        self._rows_arrived()
        return result

    def _rows_arrived(self) -> None:
        """Rows came from the owner's replica: searches reload, and they get their hubness offsets."""
        self._index_cache = None
        if self.version:
            store_hubness_offsets(self.gallery, self.engine())

    def _installed_manifest(self, version: int):
        return self.engine(version).manifest if version in self.installed_versions() else None

    def installed_versions(self) -> list[int]:
        """The versions whose verified bundles are installed on this device."""
        folder = self.root / "bundles"
        names = [p.name for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else []
        return sorted(int(n[1:]) for n in names if n.startswith("v") and n[1:].isdigit())

    def watch(self, *, max_versions: int | None = None, upgrade: bool = True):
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

    def _plan(self, client, target: int) -> UpgradePlan:
        """The server's plan to ``target`` from every version the gallery's rows are in."""
        self._download(client, target)

        def server_hops(source: int) -> list[Hop] | None:
            try:
                planned = client.plan_upgrade(source, target)
            except RpcStatusError as exc:
                if exc.code in ("NOT_FOUND", "FAILED_PRECONDITION"):
                    return None
                raise
            return [Hop(h.source_version, h.target_version, h.bundle_version, None if h.identity else h.forward.name,
                        h.side_forward.name if h.HasField("side_forward") else None) for h in planned.hops]

        def download(bundles: set[int]) -> None:
            for bundle in sorted(bundles):
                self._download(client, bundle)

        return self._plan_from_rows(target, server_hops, "the server publishes no adapter path", fetch=download)

    def installed_hops(self, source: int, target: int) -> list[Hop] | None:
        """The cheapest hops from ``source`` to ``target`` over the installed bundles, planned as
        the server plans (:func:`fctkit.protos.planner.plan_upgrade`); None when none connects."""
        from fctkit.protos.planner import plan_upgrade

        planned = plan_upgrade([self.engine(v).manifest for v in self.installed_versions()], source, target)
        return None if planned is None else [
            Hop(h.source_version, h.target_version, h.bundle_version, h.forward.name if h.forward else None,
                h.side_forward.name if h.side_forward else None) for h in planned]

    def _local_plan(self, target: int) -> UpgradePlan:
        """The plan to ``target`` over the installed bundles only (offline)."""
        installed = ", ".join(f"v{v}" for v in self.installed_versions())
        return self._plan_from_rows(target, lambda source: self.installed_hops(source, target),
                                    f"the installed bundles ({installed}) hold no adapter path")

    def _row_sources(self, target: int) -> list[int]:
        """The versions an upgrade to ``target`` starts from: those of the rows not yet in its
        space (after a "compatible" upgrade rows keep their older tag) and the installed
        version (rows added while the upgrade runs)."""
        return sorted(set(self.gallery.row_versions(target)) | {self.version})

    def _plan_from_rows(self, target: int, find_hops, missing: str, fetch=None) -> UpgradePlan:
        """One plan with a path from every source version (hops shared where paths meet),
        checked by :func:`check_plan_dims` once ``fetch(bundles)`` has brought the hops' bundles.
        In unified mode a source without a path keeps its rows (they stay comparable)."""
        mode = self.engine(target).manifest.mode
        sources = self._row_sources(target)
        by_source: dict[int, Hop] = {}
        for source in sources:
            if source == target or source in by_source:
                continue
            hops = find_hops(source)
            if hops is None:
                if mode == "unified":
                    continue
                raise DeviceError(f"no upgrade from v{source} to v{target}: {missing} from v{source} "
                                  f"({self.gallery.remaining(target)} row(s) wait); publish or install one, or back-fill those rows")
            for hop in hops:
                by_source.setdefault(hop.source, hop)
        plan = UpgradePlan(target, mode, tuple(sorted(by_source.values(), key=lambda h: (h.source, h.target))))
        if fetch is not None:
            fetch({h.bundle for h in plan.hops})
        check_plan_dims(plan, sources, self._installed_manifest)
        return plan

    def upgrade(self, bundle_dirs: str | os.PathLike | Sequence[str | os.PathLike] | None = None) -> int:
        """Offline: resume an interrupted upgrade, or install ``bundle_dirs`` (each verified, in
        version order) and upgrade to the newest along the cheapest path the installed bundles
        offer from every version the gallery's rows are in (direct adapters, hop by hop,
        "compatible" identity hops). A device with no model yet just installs them. Returns the
        rows upgraded."""
        self._refuse_damaged_settings()
        state = self.gallery.upgrade_state
        done = self._run(UpgradePlan.from_state(state), None) if state is not None else 0
        if bundle_dirs is None:
            targets = self.pending_versions()  # installed, never applied (a crash between the two)
        else:
            if isinstance(bundle_dirs, (str, os.PathLike)):
                bundle_dirs = [bundle_dirs]
            with _unpacked(bundle_dirs) as folders:
                targets = [self.install_bundle(d) for d in _by_version(folders, self.publisher_key)]
        if not targets or max(targets) <= self.version:
            return done  # nothing newer: already applied (the same command run again after a crash)
        target = max(targets)
        if self.version == 0:
            self.gallery.set_meta({"query_version": str(target)})
            return done
        return done + self.upgrade_with(self._local_plan(target), None)

    def upgrade_with(self, plan: UpgradePlan, client) -> int:
        """Record ``plan`` in the gallery and run it (resuming is the same call with the stored plan)."""
        if self.gallery.upgrade_state is not None:
            raise DeviceError("another upgrade is in progress: run `fctkit device upgrade` to finish it first")
        from fctkit.protos.bundle import check_version_is_newer

        check_version_is_newer(plan.target, self.version or None)
        record_uncertainty(self, self.engine(plan.target))  # FastFill σ needs φ_old, ψ: before they are rewritten
        meta = {"upgrade": plan.to_json()}
        if plan.mode != "forward":
            meta["query_version"] = str(plan.target)  # unified/compatible: queries switch first
        self.gallery.set_meta(meta)
        return self._run(plan, client)

    def _run(self, plan: UpgradePlan, client) -> int:
        from tqdm import tqdm

        from fctkit.protos import fleet_pb2

        engines = {b: self.engine(b) for b in {h.bundle for h in plan.hops if h.forward is not None}}
        rewrite = any(h.forward is not None for h in plan.hops)  # identity hops only (compatible): rows stay untouched
        left = self.gallery.remaining(plan.target) if rewrite else 0
        if client is not None:
            self._report(client, fleet_pb2.UPGRADE_STATE_UPGRADING, plan.target)
        last_report = [time.monotonic()]

        def on_batch(rows: int) -> None:
            bar.update(rows)
            if client is not None and time.monotonic() - last_report[0] > REPORT_EVERY_S:
                self._report(client, fleet_pb2.UPGRADE_STATE_UPGRADING, plan.target, progress=bar.n / max(left, 1))
                last_report[0] = time.monotonic()

        with tqdm(total=left, desc=f"upgrade {hop_list(plan.hops)}", unit="row", disable=not self.progress or left == 0) as bar:
            done = run_upgrade(self.gallery, plan, engines, batch_size=self.settings.batch_size,
                               on_batch=on_batch) if rewrite else 0
        if plan.mode == "forward":
            transition = transition_for(self.engine(plan.target).manifest, self._installed_manifest(self.version), self.version)
            self.gallery.switch_to(plan.target, {"upgrade": None, "transition": transition and transition.to_json()},
                                   keep_previous=transition and transition.previous_version)
        else:
            self.gallery.drop_extras("previous_embedding", {"upgrade": None, "query_version": str(plan.target), "transition": None})
        apply_pending(self)  # replicated records that waited for this version
        store_hubness_offsets(self.gallery, self.engine())
        self._index_cache = None
        return done

    def _report(self, client, state: int, target: int = 0, progress: float = 0.0) -> None:
        """Tell the fleet service where this device stands; best effort while the server is away."""
        try:
            client.report(self.version, len(self.gallery), state, target_version=target, progress=min(progress, 1.0))
        except RpcStatusError as exc:
            if exc.code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                raise

    # -- backfill ---------------------------------------------------------------------------

    def backfill(self, budget: int | None = None, *, budget_bytes: int | None = None, order: str | None = None,
                 seed: int = 0, batch_size: int = 64, on_batch=None) -> BackfillResult:
        """Re-embed the rows most worth it from their vault originals (see
        :mod:`fctkit.edge_runtime.backfill`): ``order`` one of random, uncertainty,
        class-mean-l2, class-mean-cosine, kmeans (default: uncertainty when the bundle has
        σ, else class-mean-l2), within ``budget`` rows and/or ``budget_bytes`` of vault
        downloads. Resumes an interrupted backfill first."""
        result = run_backfill(self, budget=budget, budget_bytes=budget_bytes, order=order, seed=seed,
                              batch_size=batch_size, on_batch=on_batch)
        store_hubness_offsets(self.gallery, self.engine())
        if self.transition is not None and self.gallery.not_native(self.version) == 0:
            self.end_transition()  # every row is the new model's own now: nothing left to bridge
        return result

    # -- transition scoring ------------------------------------------------------------------

    @property
    def transition(self) -> TransitionState | None:
        """The transition in progress (see :mod:`.scoring`), or None."""
        return TransitionState.from_json(self.gallery.meta("transition"))

    def end_transition(self) -> bool:
        """End transition scoring: the rows' previous embeddings are deleted from the gallery (one
        transaction) and the previous version's graph is unloaded; queries then use the adapted
        rows alone. The previous bundle stays installed (older replicated rows may need its
        adapters). Returns whether a transition was in progress."""
        transition = self.transition
        if transition is None:
            return False
        self.gallery.drop_extras("previous_embedding", {"transition": None})
        if transition.previous_version != self.version:
            self._engines.pop(transition.previous_version, None)
        self._index_cache = None
        return True

    # -- damage ----------------------------------------------------------------------------

    def damaged_rows(self) -> list[tuple[int, str, str]]:
        """(row id, item id, reason) of the rows left out of searches because they fail to open."""
        return list(self._searchable()[2].corrupt)

    def _refuse_damaged_settings(self) -> None:
        """Before installing or upgrading anything: a gallery with damaged settings is repaired first."""
        damaged = self.gallery.settings.damaged()
        if damaged:
            raise self.gallery.settings.error(damaged)

    def missing_rows(self) -> int:
        """Rows the gallery's authenticated row count has but its file no longer holds."""
        return self._searchable()[2].missing

    def check(self) -> dict[str, Any]:
        """Open everything the device keeps and report what is damaged, all at once
        (:func:`~fctkit.edge_runtime.repair.damage_report`); ``damaged`` is the total (0: clean)."""
        return damage_report(self.gallery, self.open_original)

    def repair(self) -> dict[str, Any]:
        """Repair the gallery (:func:`~fctkit.edge_runtime.repair.repair_gallery`: derivable settings,
        damaged rows, extras and queued originals, in one transaction); then, on a device of an
        owner with a server, pull the owner's replica again, which brings back every forgotten or
        missing row it holds. Rows it does not hold stay removed and are listed."""
        result = repair_gallery(self.gallery, self.open_original, self.installed_versions())
        report: dict[str, Any] = asdict(result)
        lost = result.rows_forgotten
        if (lost or result.rows_missing) and not (self.settings.owner_id and self.settings.server):
            report["replication"] = None
            report["next"] = "this device has no owner's replica (not enrolled): the damaged rows are removed here"
        elif (lost or result.rows_missing) and self.gallery.upgrade_state is not None:
            report["replication"] = None  # replication waits for the upgrade; the replica cursor is already back at 0
            report["next"] = "finish the upgrade (`fctkit device upgrade --dir DIR`); the next sync brings the rows back"
        elif lost or result.rows_missing:
            report["replication"] = asdict(self.replicate())  # which reloads searches and stores missing offsets
        if not report.get("replication"):
            self._rows_arrived()  # searches reload; dropped hubness offsets are computed again
        back = set(self.gallery.load_items(lost)[0].item_ids) if lost else set()
        report["rows_restored"] = [i for i in lost if i in back]
        report["rows_removed"] = [i for i in lost if i not in back]
        report["damaged_after"] = self.check()["damaged"]
        return report

    # -- status -----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What the device holds and does; damage is reported (``damaged_settings`` alone when
        settings are damaged, else ``damaged_rows`` / ``missing_rows`` when rows are)."""
        damaged_settings = self.gallery.settings.damaged()
        if damaged_settings:
            return {"device": str(self.root), "device_id": self.settings.device_id, "damaged_settings": damaged_settings,
                    "next": "run `fctkit device repair --dir DIR`"}
        state = self.gallery.upgrade_state
        result: dict[str, Any] = {
            "device": str(self.root), "device_id": self.settings.device_id, "server": self.settings.server,
            "installed_version": self.version, "rows": len(self.gallery), "rows_by_space": self.gallery.tag_counts(),
            "queued_uploads": self.gallery.outbox_size(), "publisher_key_pinned": (self.root / PUBLISHER_FILE).exists(),
            "owner_id": self.settings.owner_id, "owner_key_id": owner_key_id(self._owner_key),
            "replica": self.gallery.replication_counts(),
        }
        if state is not None:
            result["upgrade"] = {"target": state["target"], "mode": state["mode"],
                                 "rows_left": self.gallery.remaining(state["target"]) if state["hops"] else 0}
        pending = self.pending_versions()
        if pending:
            result["installed_not_applied"] = {"versions": pending, "next": "run `fctkit device upgrade --dir DIR` to apply"}
        if self.version:
            engine = self.engine()
            result.update(mode=engine.manifest.mode, distance=engine.manifest.distance, provider=engine.provider,
                          scoring=scoring_of(engine.manifest, self.transition).kind)
        if self.version:
            damaged, missing = len(self.damaged_rows()), self.missing_rows()
            if damaged or missing:
                result.update(damaged_rows=damaged, missing_rows=missing, next="run `fctkit device check --dir DIR`, "
                              "then `fctkit device repair --dir DIR`")
        transition = self.transition
        if transition is not None:
            result["transition"] = {"from_version": transition.previous_version, "weight": transition.weight,
                                    "rows_with_previous": self.gallery.count_extras("previous_embedding"),
                                    "max_days": transition.max_days}
        return result


@contextlib.contextmanager
def _unpacked(bundles: Sequence[str | os.PathLike]):
    """The bundles as folders: a ``.tar`` archive (as `fctkit export` writes and the server
    serves) is unpacked, safely, into a temporary folder that goes afterwards."""
    from fctkit.protos.bundle import unpack_bundle

    with tempfile.TemporaryDirectory(prefix="fctkit-bundles-") as scratch:
        yield [unpack_bundle(b, Path(scratch) / f"{i}") if Path(b).is_file() else Path(b) for i, b in enumerate(bundles)]


def _by_version(bundle_dirs: Sequence[str | os.PathLike], publisher_key) -> list[Path]:
    """``bundle_dirs`` in version order (each verified under ``publisher_key`` to read it)."""
    from fctkit.protos.bundle import verify_bundle

    versions = {Path(d): verify_bundle(d, publisher_key).manifest.version for d in bundle_dirs}
    return sorted(versions, key=versions.__getitem__)


def _subset(rows: LoadedRows, keep: list[int]) -> LoadedRows:
    return LoadedRows(
        row_ids=rows.row_ids[keep], item_ids=[rows.item_ids[i] for i in keep], tags=[rows.tags[i] for i in keep],
        embeddings=take_rows(rows.embeddings, keep), side_infos=rows.side_infos[keep], labels=[rows.labels[i] for i in keep],
        corrupt=rows.corrupt, missing=rows.missing,
    )


def _read_settings(path: Path) -> DeviceSettings:
    """``device.json``, validated; a damaged file is a :class:`DeviceError` that says what to do."""
    try:
        settings = from_mapping(DeviceSettings, json.loads(path.read_bytes().decode("utf-8")), SETTINGS_FILE)
        EngineConfig(tuple(settings.providers), settings.batch_size, settings.threads)  # checks providers and sizes
        if not isinstance(settings.providers, (list, tuple)) or not all(isinstance(p, str) for p in settings.providers):
            raise ConfigError("providers must be a list of names")
        for name in ("server", "device_id", "owner_id", "tls_root_certificates", "tls_client_cert", "tls_client_key"):
            if not isinstance(getattr(settings, name), (str, type(None))):
                raise ConfigError(f"{name} must be a string or null")
        if not isinstance(settings.device_name, str) or settings.search_backend not in ("auto", "numpy", "faiss"):
            raise ConfigError("device_name must be a string and search_backend one of auto, numpy, faiss")
    except (ValueError, TypeError, ConfigError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise DeviceError(f"{path} is damaged ({exc}); restore it, or edit it back to valid settings "
                          f"(the keys and the gallery were not touched)") from None
    return settings


def _write_private(path: Path, data: bytes, *, replace_existing: bool = True) -> None:
    """Write ``data`` to ``path`` with mode 0600 through a temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    if not replace_existing and path.exists():
        tmp.unlink()
        raise DeviceError(f"{path} already exists")
    os.replace(tmp, path)
