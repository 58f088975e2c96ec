"""The Registry service: published model versions, upgrade plans, artifact streaming with
resume, version watching, bundle publishing, the root of trust (GetTrust, PublishRoot), staged
rollouts (SetRollout, GetRollout, ConfirmVersion: :mod:`.rollout.service`) and withdrawals (Withdraw:
:mod:`.rollout.withdraw_service`). A device is listed, planned, watched and sent (manifests and
artifacts) only the versions its rollouts offer it (:mod:`.rollout.offers`) and never a withdrawn one
(a device on it may still fetch it; upgrade plans never route through a withdrawn bundle's
adapters); a PlanUpgrade from a version never offered to the device is refused. Every ListVersions
page carries every published withdrawal and the confirmed versions. The admin sees every version.

Publishing receives the bundle archive into ``tmp/publish-*``, checks its size and SHA-256,
unpacks it safely, verifies it exactly as a device would (signatures under the publisher key
the server was started with, or a threshold of the latest root's publisher keys; every
artifact's size and hash; version newer than every published one), moves the artifacts into
the content store and only then commits the version row with the bundle's co-signatures
(``manifest.sigs.json``): a half-uploaded or tampered bundle is never listed.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fctkit.errors import BundleError, ConfigError, RpcStatusError, TrustError
from fctkit.protos import limits, registry_pb2, registry_pb2_grpc
from fctkit.protos.bundle import Artifact, Manifest, VerifiedBundle, unpack_bundle, verify_bundle
from fctkit.protos.bundle_vocabulary import MANIFEST_FILE, SIGNATURES_FILE
from fctkit.protos.planner import PlannedHop, plan_upgrade
from fctkit.protos.trust import (
    MAX_SIGNATURES_BYTES,
    ReleaseEntry,
    ReleaseTrust,
    Signed,
    parse_release_signatures,
    release_entry,
    root_fingerprint,
)

from .auth import current_principal
from .jsonlog import log_event
from .rollout.changes import check_percent, new_rollout
from .rollout.offers import Rollouts
from .rollout.service import RolloutRpcs
from .rollout.withdraw_service import WithdrawRpcs
from .root_of_trust import ReleaseRules, RootOfTrust
from .status_reads import StatusReads
from .storage import StaleVersion, Storage, VersionRecord
from .streams import FileSink, check_offset, file_chunks, open_stored, read_header, receive_chunks
from .validation import chunk_size, invalid, page_size, quoted, sha256_field, text_field, timestamp, version_field


def artifact_info(artifact: Artifact) -> registry_pb2.ArtifactInfo:
    return registry_pb2.ArtifactInfo(
        name=artifact.name,
        role=artifact.role,
        file=artifact.file,
        sha256=artifact.sha256,
        size=artifact.size,
        source_version=artifact.source_version,
        target_version=artifact.target_version,
        precision=artifact.precision,
    )


@dataclass(frozen=True)
class PublishedVersion:
    record: VersionRecord
    manifest: Manifest

    @property
    def version(self) -> int:
        return self.record.version

    def info(self) -> registry_pb2.VersionInfo:
        m = self.manifest
        return registry_pb2.VersionInfo(
            version=m.version,
            parents=m.parents,
            mode=m.mode,
            distance=m.distance,
            normalize=m.normalize,
            embedding_dim=m.embedding_dim,
            side_info_dim=m.side_info_dim,
            artifacts=[artifact_info(a) for a in m.artifacts],
            created_at=m.created_at,
            published_at=self.record.published_at,
            publisher_key_id=m.publisher_key_id,
            manifest_sha256=hashlib.sha256(self.record.manifest).hexdigest(),
            gate_forced=bool(m.gate.get("forced")),
        )

    def artifact(self, name: str) -> Artifact:
        for artifact in self.manifest.artifacts:
            if artifact.name == name:
                return artifact
        names = ", ".join(a.name for a in self.manifest.artifacts)
        raise RpcStatusError("NOT_FOUND", f"version {self.version} has no artifact {quoted(name)} (it has: {names})")


class Catalog:
    """The published versions in memory, and a change signal for watchers."""

    def __init__(self, versions: list[PublishedVersion]) -> None:
        self._versions = {v.version: v for v in versions}
        self._entries: tuple[ReleaseEntry, ...] | None = None
        self._order: list[int] | None = None
        self._changed = asyncio.Event()
        self.closed = False

    @classmethod
    def load(cls, storage: Storage, rules: ReleaseRules) -> Catalog:
        """Every stored version, re-verified under ``rules``; refuses a damaged data directory."""
        return cls(cls._verified(storage.versions(), storage, rules))

    def refresh(self, storage: Storage, rules: ReleaseRules) -> int:
        """Add the versions another replica published since; returns how many (watchers wake up)."""
        versions = self._verified([r for r in storage.versions() if r.version not in self._versions], storage, rules)
        for published in versions:
            self.add(published)
        return len(versions)

    @staticmethod
    def _verified(records: list[VersionRecord], storage: Storage, rules: ReleaseRules) -> list[PublishedVersion]:
        versions = []
        for record in records:
            try:
                manifest = rules.verify_stored(record)
            except (BundleError, TrustError) as exc:
                raise ConfigError(
                    f"stored version {record.version} does not verify under {rules.description} ({exc}); "
                    "start the server with the key or root that published it"
                ) from exc
            missing = [a.name for a in manifest.artifacts if not storage.artifacts.has(a.sha256)]
            if missing:
                raise ConfigError(
                    f"stored version {record.version} lacks artifact files {missing}: the data directory is damaged"
                )
            versions.append(PublishedVersion(record, manifest))
        return versions

    @property
    def latest(self) -> int:
        return max(self._versions, default=0)

    @property
    def changed(self) -> asyncio.Event:
        """Set at the next publish or at shutdown; take it *before* reading the versions."""
        return self._changed

    def has(self, version: int) -> bool:
        return version in self._versions

    def get(self, version: int) -> PublishedVersion:
        try:
            return self._versions[version]
        except KeyError:
            raise RpcStatusError("NOT_FOUND", f"version {version} is not published (latest: {self.latest})") from None

    def after(
        self, version: int, limit: int | None = None, before: int | None = None, skip: frozenset[int] = frozenset()
    ) -> list[PublishedVersion]:
        """The versions after ``version`` (and before ``before``, when given), but those in ``skip``, in order."""
        ordered = self._ordered()
        found: list[PublishedVersion] = []
        for v in ordered[bisect.bisect_right(ordered, version) :]:
            if (before is not None and v >= before) or (limit is not None and len(found) >= limit):
                break
            if v not in skip:
                found.append(self._versions[v])
        return found

    def latest_before(self, cap: int | None, skip: frozenset[int] = frozenset()) -> int:
        """The latest version before ``cap`` (None: any), but those in ``skip``; 0 when none."""
        return max((v for v in self._versions if (cap is None or v < cap) and v not in skip), default=0)

    def wake(self) -> None:
        """Wake the watchers (what they are offered changed)."""
        self._notify()

    def add(self, published: PublishedVersion) -> None:
        self._versions[published.version] = published
        self._entries, self._order = None, None
        self._notify()

    def manifests(self) -> list[Manifest]:
        return [v.manifest for _, v in sorted(self._versions.items())]

    def release_entries(self) -> tuple[ReleaseEntry, ...]:
        """What a timestamp names of each version on offer (hashed once per version, kept until one is added)."""
        if self._entries is None:
            self._entries = tuple(release_entry(v, self._versions[v].record.manifest) for v in self._ordered())
        return self._entries

    def _ordered(self) -> list[int]:
        """The versions in order (sorted once per version added)."""
        if self._order is None:
            self._order = sorted(self._versions)
        return self._order

    def close(self) -> None:
        self.closed = True
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


class RegistryService(RolloutRpcs, WithdrawRpcs, registry_pb2_grpc.RegistryServicer):
    def __init__(
        self,
        storage: Storage,
        catalog: Catalog,
        rules: ReleaseRules,
        *,
        max_bundle_bytes: int,
        keepalive_s: float,
        rollouts: Rollouts | None = None,
        status_reads: StatusReads | None = None,
    ) -> None:
        self._storage = storage
        self._catalog = catalog
        self._rollouts = rollouts or Rollouts(storage, catalog.wake)
        self._status_reads = status_reads or StatusReads(storage)
        self._rules = rules
        self._max_bundle = max_bundle_bytes
        self._keepalive_s = keepalive_s
        self._publishing = asyncio.Lock()

    async def ListVersions(self, request, context):
        limit = page_size(request.page_size, limits.MAX_VERSIONS_PAGE)
        trust: dict[str, Any] = {}
        if isinstance(self._rules, RootOfTrust):  # the timestamp rides along: one round trip per sync
            self._catch_up()
            current = self._rules.timestamp(self._catalog.release_entries())
            unchanged = request.known_timestamp_version == current.version
            trust = {
                "timestamp": b"" if unchanged else current.data,
                "timestamp_unchanged": unchanged,
                "latest_root_version": self._rules.latest_root_version(),
            }
        cap, hidden = self._cap(), self._hidden()
        found = self._catalog.after(request.after_version, limit + 1, cap, hidden)
        return registry_pb2.ListVersionsResponse(
            versions=[v.info() for v in found[:limit]],
            more=len(found) > limit,
            latest_version=self._catalog.latest_before(cap, hidden),
            withdrawals=self._rollouts.withdrawals.documents(),
            confirmed_versions=self._rollouts.confirmed_versions(),
            **trust,
        )

    async def GetManifest(self, request, context):
        version = self._catalog.get(version_field(request.version, "version")).version
        record = self._catalog.get(self._offered(version, self._cap(), kept_by_its_devices=True)).record
        return registry_pb2.GetManifestResponse(
            version=record.version,
            manifest=record.manifest,
            signature=record.signature,
            co_signatures=record.co_signatures,
        )

    async def GetTrust(self, request, context):
        root = self._root_of_trust()
        self._catch_up()
        roots, latest = root.roots_after(request.after_root_version)
        return registry_pb2.GetTrustResponse(
            roots=roots, latest_root_version=latest, timestamp=root.timestamp(self._catalog.release_entries()).data
        )

    async def PublishRoot(self, request, context):
        new = self._root_of_trust().publish_root(request.root)
        return registry_pb2.PublishRootResponse(root_version=new.body.version, fingerprint=root_fingerprint(new))

    def _cap(self, claimed_version: int = 0) -> int | None:
        """The first version not offered to the calling device (None: all are; the admin sees every one)."""
        principal = current_principal()
        if principal is None or principal.device_id is None:
            return None
        return self._rollouts.cap(principal.device_id, self._catalog.latest, claimed_version)

    def _hidden(self) -> frozenset[int]:
        """The versions the caller is never offered: the withdrawn ones for a device, none for the admin."""
        principal = current_principal()
        return frozenset() if principal is None or principal.device_id is None else self._rollouts.withdrawals.versions

    def _claimed(self, version: int, field: str) -> int:
        """``version``, which the calling device says it runs: PERMISSION_DENIED when it was never
        offered to the device (the admin may name any)."""
        principal = current_principal()
        if principal is not None and principal.device_id is not None:
            self._rollouts.check_claim(principal.device_id, version, field)
        return version

    def published(self, version: int) -> bool:
        """Whether ``version`` is published (here, or on another replica a moment ago)."""
        if not self._catalog.has(version):
            self._catch_up()
        return self._catalog.has(version)

    def _runs(self, version: int) -> bool:
        """Whether the calling device last reported running ``version``."""
        principal = current_principal()
        if principal is None or principal.device_id is None:
            return False
        return self._storage.device_version(principal.device_id) == version

    def latest_offered(self, device_id: str) -> int:
        """The latest version offered to ``device_id`` (what its report's answer names)."""
        return self._catalog.latest_before(
            self._rollouts.cap(device_id, self._catalog.latest), self._rollouts.withdrawals.versions
        )

    def _offered(self, version: int, cap: int | None, *, kept_by_its_devices: bool = False) -> int:
        """``version``, when it is offered to the calling device (``kept_by_its_devices``: a device
        that runs a withdrawn version may still fetch it); FAILED_PRECONDITION says why not."""
        if version in self._hidden() and not (kept_by_its_devices and self._runs(version)):
            withdrawal = self._rollouts.withdrawals.get(version)
            raise RpcStatusError(
                "FAILED_PRECONDITION",
                f"version {version} was withdrawn by its publishers "
                f"({withdrawal.reason if withdrawal else 'see ListVersions'}): it is offered to no device; "
                f"the latest offered to this device is {self._catalog.latest_before(cap, self._hidden())}",
            )
        if cap is not None and version >= cap:
            raise RpcStatusError(
                "FAILED_PRECONDITION",
                f"version {version} is not offered to this device yet: "
                f"version {cap} is in a staged rollout that does not include it (versions from {cap} on "
                f"wait for it); the latest offered to it is {self._catalog.latest_before(cap)}",
            )
        return version

    def _catch_up(self) -> None:
        """Take in releases published on another replica and not yet notified here: a timestamp names them all."""
        if self._storage.latest_version() > self._catalog.latest:
            try:
                self._catalog.refresh(self._storage, self._rules)
            except (
                ConfigError
            ) as exc:  # a stored version that does not verify stays off the timestamp; the log says why
                log_event("catalog refresh failed", logging.ERROR, error=str(exc))

    def _root_of_trust(self) -> RootOfTrust:
        if not isinstance(self._rules, RootOfTrust):
            raise RpcStatusError(
                "FAILED_PRECONDITION",
                "this server was started without a root (with --publisher-key): "
                "it serves no root of trust; restart it with --root root.1.json --timestamp-key KEY",
            )
        return self._rules

    async def PlanUpgrade(self, request, context):
        source = self._claimed(
            self._catalog.get(version_field(request.from_version, "from_version")).version, "from_version"
        )
        cap, hidden = self._cap(source), self._hidden()
        target = self._offered(
            self._catalog.get(request.to_version or self._catalog.latest_before(cap, hidden)).version, cap
        )
        withdrawn = self._rollouts.withdrawals.versions
        hops = plan_upgrade([m for m in self._catalog.manifests() if m.version not in withdrawn], source, target)
        if hops is None and plan_upgrade(self._catalog.manifests(), source, target) is not None:
            raise RpcStatusError(
                "FAILED_PRECONDITION",
                f"every chain of adapters from version {source} to {target} passes through a "
                f"withdrawn version ({', '.join(f'v{v}' for v in sorted(withdrawn))}), whose adapters are no longer "
                f"used: publish a release with a direct {source}->{target} adapter, or backfill the device",
            )
        if hops is None:
            raise RpcStatusError(
                "NOT_FOUND",
                f"no chain of published adapters leads from version {source} to {target} "
                "(versions only move forward); the device needs a backfill",
            )
        return registry_pb2.PlanUpgradeResponse(from_version=source, to_version=target, hops=[_hop(h) for h in hops])

    async def DownloadArtifact(self, request, context):
        name = text_field(request.artifact_name, "artifact_name")
        version = version_field(request.version, "version")
        published = self._catalog.get(self._offered(version, self._cap(), kept_by_its_devices=True))
        artifact = published.artifact(name)
        size = chunk_size(request.chunk_size)
        offset = check_offset(request.offset, artifact.size)
        missing = RpcStatusError(
            "DATA_LOSS", f"artifact {artifact.name} of v{published.version} is missing from the server's data directory"
        )
        stored = open_stored(lambda: self._storage.artifacts.open(artifact.sha256, offset), missing)
        try:
            yield registry_pb2.DownloadArtifactResponse(
                header=registry_pb2.ArtifactHeader(
                    version=published.version, artifact=artifact_info(artifact), offset=offset
                )
            )
            async for response in file_chunks(
                stored, offset, artifact.size, size, registry_pb2.DownloadArtifactResponse
            ):
                yield response
        finally:
            stored.close()

    async def WatchVersions(self, request, context):
        sent = request.after_version
        while not self._catalog.closed:
            changed = self._catalog.changed
            cap, hidden = self._cap(), self._hidden()
            for published in self._catalog.after(sent, before=cap, skip=hidden):
                yield registry_pb2.WatchVersionsResponse(published=published.info())
                sent = published.version
            try:
                await asyncio.wait_for(changed.wait(), self._keepalive_s)
            except TimeoutError:
                keepalive = registry_pb2.KeepAlive(
                    server_time=timestamp(), latest_version=self._catalog.latest_before(cap, hidden)
                )
                yield registry_pb2.WatchVersionsResponse(keepalive=keepalive)

    async def PublishBundle(self, requests, context):
        header = await read_header(requests)
        if not 0 < header.archive_size <= self._max_bundle:
            raise invalid(f"header.archive_size is {header.archive_size}; bundles hold 1 to {self._max_bundle} bytes")
        expected_sha256 = sha256_field(header.archive_sha256, "header.archive_sha256")
        percent = check_percent(header.rollout_percent) if header.HasField("rollout_percent") else None
        if header.rollout_no_guard and percent is None:
            raise invalid("rollout_no_guard without rollout_percent: only a staged rollout has a guard")
        staging = Path(tempfile.mkdtemp(prefix="publish-", dir=self._storage.tmp_dir))
        try:
            archive = staging / "bundle.tar"
            digest = hashlib.sha256()
            with archive.open("wb") as sink:
                end = await receive_chunks(
                    requests, FileSink(sink), position=0, total=header.archive_size, digest=digest
                )
            if end != header.archive_size:
                raise invalid(f"the stream ended after {end} of {header.archive_size} bytes; publish again")
            if digest.hexdigest() != expected_sha256:
                raise invalid("the archive's SHA-256 differs from header.archive_sha256; publish again")
            published = await self._verify_and_store(
                archive, staging / "bundle", percent, guarded=not header.rollout_no_guard
            )
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return registry_pb2.PublishBundleResponse(version=published.info())

    async def _verify_and_store(
        self, archive: Path, unpack_to: Path, percent: float | None = None, *, guarded: bool = True
    ) -> PublishedVersion:
        trust = self._rules.release_trust()  # read here: the storage belongs to the event loop's thread
        verified, co_signatures = await asyncio.to_thread(self._verify, archive, unpack_to, self._catalog.latest, trust)
        async with self._publishing:
            manifest = verified.manifest
            _check_newer(manifest.version, self._catalog.latest)  # another publish may have won meanwhile
            store = self._storage.artifacts
            await asyncio.to_thread(
                lambda: [
                    store.put(verified.root / a.file, a.sha256) for a in manifest.artifacts if not store.has(a.sha256)
                ]
            )
            record = VersionRecord(
                manifest.version, verified.manifest_bytes, verified.signature, timestamp(), co_signatures
            )
            rollout = (
                None
                if percent is None
                else new_rollout(
                    manifest.version, percent, record.published_at, manifest.health_expectation, guarded=guarded
                )
            )
            try:
                self._storage.add_version(record, [a.sha256 for a in manifest.artifacts], rollout)
            except StaleVersion as stale:  # another replica published this version or a later one meanwhile
                _check_newer(stale.version, stale.latest)
                raise
            published = PublishedVersion(record, manifest)
            if rollout is not None:
                self._rollouts.published(rollout)
            self._catalog.add(published)
        return published

    def _verify(self, archive: Path, unpack_to: Path, latest: int, trust: ReleaseTrust) -> tuple[VerifiedBundle, bytes]:
        try:
            verified = verify_bundle(unpack_bundle(archive, unpack_to), trust)
        except (BundleError, TrustError) as exc:
            raise invalid(f"bundle refused: {exc}{_publisher_note(unpack_to, trust)}") from exc
        _check_newer(verified.manifest.version, latest)
        if len(verified.manifest.artifacts) > limits.MAX_ARTIFACTS_PER_BUNDLE:
            raise invalid(
                f"the bundle has {len(verified.manifest.artifacts)} artifacts; at most {limits.MAX_ARTIFACTS_PER_BUNDLE}"
            )
        return verified, _co_signatures(verified.root)


def _co_signatures(bundle: Path) -> bytes:
    """The bundle's ``manifest.sigs.json`` as published (checked: well-formed, size-limited), or b"" when none."""
    path = bundle / SIGNATURES_FILE
    if not path.exists():
        return b""
    data = path.read_bytes()[: MAX_SIGNATURES_BYTES + 1]
    try:
        parse_release_signatures(data)
    except TrustError as exc:
        raise invalid(f"bundle refused: {exc}") from exc
    return data


def _publisher_note(bundle: Path, trust: ReleaseTrust) -> str:
    """Why a root refused the bundle's own publisher, when its key is not a publisher of the latest root."""
    if not isinstance(trust, Signed):
        return ""
    try:
        keyid = Manifest.from_bytes((bundle / MANIFEST_FILE).read_bytes()).publisher_key_id
    except (BundleError, OSError):
        return ""
    if keyid in trust.body.role("publisher").keyids:
        return ""
    return (
        f" (the bundle's publisher key {keyid[:16]}… is not a publisher key of root v{trust.body.version}: "
        "it was removed, or never added)"
    )


def _check_newer(version: int, latest: int) -> None:
    if version == latest:
        raise RpcStatusError("ALREADY_EXISTS", f"version {version} is already published; build the next version")
    if version < latest:
        raise RpcStatusError(
            "FAILED_PRECONDITION",
            f"version {version} is older than the latest published {latest}; versions only move forward",
        )


def _hop(hop: PlannedHop) -> registry_pb2.UpgradeHop:
    return registry_pb2.UpgradeHop(
        source_version=hop.source_version,
        target_version=hop.target_version,
        bundle_version=hop.bundle_version,
        identity=hop.identity,
        forward=artifact_info(hop.forward) if hop.forward else None,
        side_forward=artifact_info(hop.side_forward) if hop.side_forward else None,
    )
