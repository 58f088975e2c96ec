"""Client library for the fctkit server (used by the device runtime and ``fctkit admin``).

Synchronous, on one gRPC channel; torch-free. Every call that the server answers with a
status other than OK raises :class:`~fctkit.errors.RpcStatusError` (``.code`` is the status
name). Calls are retried with seeded, jittered exponential backoff while the server is
UNAVAILABLE (restarting, network blip); downloads resume from the last byte received, across
reconnects and (for :meth:`FctkitClient.download_artifact`) across process restarts via a
``.part`` file, and are SHA-256 checked; uploads to the vault resume from what the server
already holds. Listings that page are bounded in all as their pages arrive (endless data,
:mod:`fctkit.protos.paging`). The backoff lives in :mod:`fctkit.protos.retry_policy`, the
resumable streams in :mod:`fctkit.protos.resumable_transfer` and the trust calls in
:mod:`fctkit.protos.trust_client`; ``RetryPolicy``, ``Transfer``, ``status_error``,
``TrustUpdate`` and ``VersionListing`` are importable from here too.

Example (a device)::

    with FctkitClient("server:50051", token) as client:
        plan = client.plan_upgrade(from_version=1)
        bundle = client.download_bundle(plan.to_version, Path("bundles/v3"), public_key=pinned_key)
"""

from __future__ import annotations

import hashlib
import io
import ipaddress
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

import grpc

from fctkit.config import read_setting_file
from fctkit.errors import ConfigError, InputError, RpcStatusError

from . import fleet_pb2, fleet_pb2_grpc, limits, registry_pb2, registry_pb2_grpc, vault_pb2, vault_pb2_grpc
from .bundle import MANIFEST_FILE, SIGNATURE_FILE, VerifiedBundle, check_version_is_newer, file_sha256, verify_bundle
from .bundle_vocabulary import SIGNATURES_FILE
from .paging import PagingBound, gather_pages, stream_pages
from .resumable_transfer import Transfer, chunks_of, download_to_file, stream_download
from .retry_policy import RetryPolicy, sleep_before_retry, status_error
from .rollout_client import RolloutCalls
from .trust import Timestamp, verify_release_manifest, verify_snapshot_manifest
from .trust_client import TrustCalls
from .trust_client import TrustUpdate as TrustUpdate
from .trust_client import VersionListing as VersionListing

_Response = TypeVar("_Response")  # what an RPC answers


@dataclass(frozen=True)
class ClientTls:
    """The TLS a client connects with: the CA certificate it trusts (``None``: the system's roots)
    and, for a server that asks every client for a certificate (``fctkit serve --tls-ca``), the
    client's own certificate chain and private key. All PEM bytes."""

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ConfigError("a client certificate needs its private key: pass --tls-cert with --tls-key")

    @classmethod
    def from_files(
        cls, ca: str | Path | None = None, cert: str | Path | None = None, key: str | Path | None = None
    ) -> ClientTls | None:
        """The TLS settings in these PEM files, or ``None`` (plaintext) when no file is given."""
        if ca is None and cert is None and key is None:
            return None
        return cls(
            *(
                None if path is None else read_setting_file(path, what)
                for path, what in (
                    (ca, "TLS CA certificate"),
                    (cert, "TLS client certificate"),
                    (key, "TLS client key"),
                )
            )
        )

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


@dataclass(frozen=True)
class Enrolment:
    device_id: str
    token: str
    publisher_public_key: bytes
    publisher_key_id: str
    owner_id: str = ""


# Several server replicas behind one channel: gRPC's own client-side balancing spreads calls over
# every address that answers (round_robin); gRPC's retry policy sends a unary call that found a
# replica gone (UNAVAILABLE) to another one. Streaming calls are not in the policy: gRPC cannot
# resume a stream that already delivered data, and with retries on, a server stream cut by a
# killed replica could wait forever (seen with grpcio 1.85); the kit resumes those itself
# (transfers from their offset, pushes by change id). Reconnection backs off to at most 3 s, so a
# restarted replica takes calls again within seconds.
def _unary_methods() -> list[dict[str, str]]:
    return [
        {"service": service.full_name, "method": method.name}
        for module in (registry_pb2, vault_pb2, fleet_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
        if not (method.client_streaming or method.server_streaming)
    ]


_SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [
        {
            "name": _unary_methods(),
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.1s",
                "maxBackoff": "2s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ],
}
FAILOVER_OPTIONS = (
    ("grpc.service_config", json.dumps(_SERVICE_CONFIG)),
    ("grpc.enable_retries", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 3000),
)


_TARGET_SCHEMES = ("ipv4:", "ipv6:", "dns:", "unix:", "unix-abstract:", "vsock:")


def channel_target(servers: str) -> str:
    """A gRPC target for ``servers``: one ``host:port``, a gRPC target URI (``dns:///name:port``,
    ``ipv4:a:p,b:p``...), or several comma-separated IPv4 ``address:port`` (-> ``ipv4:`` list).
    Several host names are refused: give them to a DNS name (``dns:///``) or list addresses."""
    servers = servers.strip()
    if "," not in servers or servers.startswith(_TARGET_SCHEMES):
        return servers
    addresses = [part.strip() for part in servers.split(",")]
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise InputError(
                f"server list {servers!r}: {address!r} is not an IPv4 address:port; list addresses, or "
                "give one DNS name that resolves to every replica (dns:///name:port)"
            ) from None
        if not port.isdigit():
            raise InputError(f"server list {servers!r}: {address!r} has no port")
    return "ipv4:" + ",".join(addresses)


class FctkitClient(RolloutCalls, TrustCalls):
    """One connection to an fctkit server, authenticated with a device or admin token. ``target``
    may name several replicas (``10.0.0.1:50051,10.0.0.2:50051`` or any gRPC target URI): calls
    are spread over them and fail over when one goes away."""

    def __init__(
        self,
        target: str,
        token: str | None = None,
        *,
        tls: ClientTls | None = None,
        retry: RetryPolicy | None = None,
        timeout_s: float = 60.0,
        chunk_size: int = limits.MAX_CHUNK_BYTES,
    ) -> None:
        if not 0 < chunk_size <= limits.MAX_CHUNK_BYTES:
            raise InputError(f"chunk_size must be 1..{limits.MAX_CHUNK_BYTES}")
        target = channel_target(target)
        options = [("grpc.max_receive_message_length", limits.MAX_MESSAGE_BYTES), *FAILOVER_OPTIONS]
        if tls is None:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            self._channel = grpc.secure_channel(target, tls.credentials(), options=options)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.retry = retry or RetryPolicy()
        self.timeout_s = timeout_s
        self.chunk_size = chunk_size
        self.registry = registry_pb2_grpc.RegistryStub(self._channel)
        self.vault = vault_pb2_grpc.VaultStub(self._channel)
        self.fleet = fleet_pb2_grpc.FleetStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> FctkitClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------------

    def _retrying(
        self, attempt: Callable[[], _Response], retry_on: tuple[grpc.StatusCode, ...] = (grpc.StatusCode.UNAVAILABLE,)
    ) -> _Response:
        delays = self.retry.delays()
        while True:
            try:
                return attempt()
            except grpc.RpcError as error:
                sleep_before_retry(error, delays, retry_on)

    def _unary(self, method: Callable[..., _Response], request: Any, *, retry: bool = True) -> _Response:
        def attempt() -> _Response:
            return method(request, metadata=self._metadata, timeout=self.timeout_s)

        return self._retrying(attempt, (grpc.StatusCode.UNAVAILABLE,) if retry else ())

    # -- registry ---------------------------------------------------------------------------

    def get_manifest(self, version: int) -> tuple[bytes, bytes]:
        """The signed manifest bytes and signature of ``version``, exactly as published."""
        response = self.get_signed_manifest(version)
        return response.manifest, response.signature

    def get_signed_manifest(self, version: int) -> registry_pb2.GetManifestResponse:
        """``version``'s manifest, its signature and co-signatures (``manifest.sigs.json``) as published."""
        return cast(
            registry_pb2.GetManifestResponse,
            self._unary(self.registry.GetManifest, registry_pb2.GetManifestRequest(version=version)),
        )

    def plan_upgrade(self, from_version: int, to_version: int = 0) -> registry_pb2.PlanUpgradeResponse:
        """The hops from ``from_version`` to ``to_version`` (0: the latest)."""
        request = registry_pb2.PlanUpgradeRequest(from_version=from_version, to_version=to_version)
        return cast(registry_pb2.PlanUpgradeResponse, self._unary(self.registry.PlanUpgrade, request))

    def _artifact_stream(self, version: int, name: str) -> Callable[[int], Any]:
        def open_stream(offset: int) -> Any:
            request = registry_pb2.DownloadArtifactRequest(
                version=version, artifact_name=name, offset=offset, chunk_size=self.chunk_size
            )
            return self.registry.DownloadArtifact(request, metadata=self._metadata)

        return open_stream

    def fetch_artifact(self, version: int, name: str, sink: BinaryIO) -> Transfer:
        """Stream an artifact into ``sink`` (any writable binary file), SHA-256 checked."""
        return stream_download(
            self._artifact_stream(version, name), _artifact_digest, sink, 0, hashlib.sha256(), self.retry
        )

    def download_artifact(self, version: int, name: str, dest: Path, known: tuple[str, int] | None = None) -> Transfer:
        """Download an artifact to ``dest``, resuming a ``dest.part`` left by an interrupted try;
        ``known``: its (SHA-256, size) from the verified manifest, which the server must announce."""
        return download_to_file(self._artifact_stream(version, name), _artifact_digest, dest, self.retry, known)

    def download_bundle(
        self,
        version: int,
        dest: Path,
        trust: Any,
        *,
        installed_version: int | None = None,
        timestamp: Timestamp | None = None,
    ) -> VerifiedBundle:
        """Fetch bundle ``version`` into the directory ``dest`` (manifest, signatures, every
        artifact; files already complete are kept, partial ones resumed) and verify it as a
        device must: the manifest is the one ``timestamp`` names (when given: no mix-and-match),
        its signatures satisfy ``trust`` (the pinned publisher key or the device's root; checked
        before any artifact is fetched), hashes, and version newer than ``installed_version``.
        Returns :class:`fctkit.protos.bundle.VerifiedBundle`."""
        signed = self.get_signed_manifest(version)
        if timestamp is not None:
            verify_snapshot_manifest(timestamp, version, signed.manifest)
        manifest = verify_release_manifest(signed.manifest, signed.signature, signed.co_signatures or None, trust)
        check_version_is_newer(manifest.version, installed_version)
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / MANIFEST_FILE).write_bytes(signed.manifest)
        (dest / SIGNATURE_FILE).write_bytes(signed.signature)
        if signed.co_signatures:
            (dest / SIGNATURES_FILE).write_bytes(signed.co_signatures)
        else:
            (dest / SIGNATURES_FILE).unlink(missing_ok=True)
        for artifact in manifest.artifacts:
            target = dest / artifact.file
            if (
                target.is_file()
                and target.stat().st_size == artifact.size
                and file_sha256(target)[0] == artifact.sha256
            ):
                continue
            target.unlink(missing_ok=True)
            self.download_artifact(version, artifact.name, target, (artifact.sha256, artifact.size))
        return verify_bundle(dest, trust, installed_version=installed_version)

    def watch_versions(self, after_version: int = 0) -> Iterator[registry_pb2.VersionInfo]:
        """Published versions after ``after_version``, then new ones as they appear; ends when
        the server shuts down. Reconnects (from the last version seen) while UNAVAILABLE."""
        delays = self.retry.delays()
        while True:
            call = self.registry.WatchVersions(
                registry_pb2.WatchVersionsRequest(after_version=after_version), metadata=self._metadata
            )
            try:
                for event in call:
                    delays = self.retry.delays()
                    if event.WhichOneof("event") == "published":
                        after_version = event.published.version
                        yield event.published
                return
            except grpc.RpcError as error:
                sleep_before_retry(error, delays)
            finally:
                call.cancel()

    def publish_bundle(
        self, archive: Path, *, rollout_percent: float | None = None, no_guard: bool = False
    ) -> registry_pb2.VersionInfo:
        """Admin: publish a bundle archive (from ``fctkit.protos.bundle.pack_bundle``); ``rollout_percent``:
        staged, guarded against the release's expectation unless ``no_guard``."""
        archive = Path(archive)
        sha256, size = file_sha256(archive)

        def requests() -> Iterator[registry_pb2.PublishBundleRequest]:
            yield registry_pb2.PublishBundleRequest(
                header=registry_pb2.PublishHeader(
                    archive_size=size,
                    archive_sha256=sha256,
                    rollout_percent=rollout_percent,
                    rollout_no_guard=no_guard,
                )
            )
            with archive.open("rb") as fh:
                for chunk in chunks_of(fh, 0, self.chunk_size):
                    yield registry_pb2.PublishBundleRequest(chunk=chunk)

        try:
            published = self.registry.PublishBundle(requests(), metadata=self._metadata)
            return cast(registry_pb2.PublishBundleResponse, published).version
        except grpc.RpcError as error:
            raise status_error(error) from None

    # -- vault ------------------------------------------------------------------------------

    def upload_blob(self, data: bytes, item_id: str = "") -> Transfer:
        """Store ``data`` (ciphertext: encrypt before calling) in this device's vault.

        Resumes from what the server already holds (an earlier interrupted upload); while the
        server is UNAVAILABLE, or still busy with the interrupted stream (ABORTED), waits and
        resumes. ``Transfer.header`` is the stored :class:`BlobInfo`."""
        sha256 = hashlib.sha256(data).hexdigest()

        def attempt() -> Transfer:
            state = self.vault.Stat(
                vault_pb2.StatBlobRequest(sha256=sha256), metadata=self._metadata, timeout=self.timeout_s
            )
            if state.state == vault_pb2.BLOB_STATE_STORED:
                return Transfer(sha256, len(data), len(data), state.blob)
            offset = (
                state.received if state.state == vault_pb2.BLOB_STATE_PARTIAL and state.received <= len(data) else 0
            )

            def requests() -> Iterator[vault_pb2.UploadBlobRequest]:
                header = vault_pb2.UploadHeader(sha256=sha256, size=len(data), item_id=item_id, offset=offset)
                yield vault_pb2.UploadBlobRequest(header=header)
                for chunk in chunks_of(io.BytesIO(data), offset, self.chunk_size):
                    yield vault_pb2.UploadBlobRequest(chunk=chunk)

            response = self.vault.Upload(requests(), metadata=self._metadata)
            return Transfer(sha256, len(data), offset, response.blob)

        return self._retrying(attempt, (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED))

    def _blob_stream(self, sha256: str) -> Callable[[int], Any]:
        def open_stream(offset: int) -> Any:
            request = vault_pb2.DownloadBlobRequest(sha256=sha256, offset=offset, chunk_size=self.chunk_size)
            return self.vault.Download(request, metadata=self._metadata)

        return open_stream

    def read_blob(self, sha256: str) -> bytes:
        """A blob of this device's vault, in memory, SHA-256 checked."""
        buffer = io.BytesIO()
        stream_download(self._blob_stream(sha256), _blob_digest, buffer, 0, hashlib.sha256(), self.retry)
        return buffer.getvalue()

    def download_blob(self, sha256: str, dest: Path) -> Transfer:
        """A blob of this device's vault to ``dest``, resuming a ``dest.part`` left by an interrupted try."""
        return download_to_file(self._blob_stream(sha256), _blob_digest, dest, self.retry)

    def stat_blob(self, sha256: str) -> vault_pb2.StatBlobResponse:
        return cast(vault_pb2.StatBlobResponse, self._unary(self.vault.Stat, vault_pb2.StatBlobRequest(sha256=sha256)))

    def list_blobs(self, owner_id: str = "") -> list[vault_pb2.BlobInfo]:
        """Every blob of this device's owner (all pages); naming another owner is PERMISSION_DENIED."""
        return self._all_pages(
            self.vault.List,
            lambda page_token: vault_pb2.ListBlobsRequest(page_token=page_token, owner_id=owner_id),
            "blobs",
        )

    # -- replica ----------------------------------------------------------------------------

    def push_records(self, records: Sequence[vault_pb2.SealedRecord]) -> vault_pb2.PushRecordsResponse:
        """Push sealed gallery records in messages within the wire limits; retried while the
        server is UNAVAILABLE (safe: each record's change id makes a retry idempotent). The
        response lists each record's sequence number."""
        rows = sum(len(r.item_ids) or 1 for r in records)
        if rows > limits.MAX_RECORDS_PER_PUSH:
            raise InputError(f"{rows} rows in one push; at most {limits.MAX_RECORDS_PER_PUSH} (push in parts)")
        messages = list(_record_batches(records))

        def attempt() -> vault_pb2.PushRecordsResponse:
            requests = (vault_pb2.PushRecordsRequest(records=batch) for batch in messages)
            return cast(
                vault_pb2.PushRecordsResponse,
                self.vault.PushRecords(requests, metadata=self._metadata, timeout=self.timeout_s),
            )

        return self._retrying(attempt)

    def pull_records(self, after_sequence: int = 0, owner_id: str = "") -> Iterator[vault_pb2.PullRecordsResponse]:
        """The owner's records after ``after_sequence``, batch by batch; reconnects from the last
        record received while the server is UNAVAILABLE."""
        delays = self.retry.delays()
        while True:
            call = self.vault.PullRecords(
                vault_pb2.PullRecordsRequest(after_sequence=after_sequence, owner_id=owner_id), metadata=self._metadata
            )
            try:
                for batch in call:
                    delays = self.retry.delays()
                    if batch.records:
                        after_sequence = batch.records[-1].sequence
                    yield batch
                return
            except grpc.RpcError as error:
                sleep_before_retry(error, delays)
            finally:
                call.cancel()

    def delete_blob(self, sha256: str) -> int:
        """Delete a blob; returns the bytes its owner still stores."""
        deleted = self._unary(self.vault.Delete, vault_pb2.DeleteBlobRequest(sha256=sha256))
        return cast(vault_pb2.DeleteBlobResponse, deleted).used_bytes

    # -- fleet ------------------------------------------------------------------------------

    def create_enrolment_code(
        self, ttl_seconds: int = 0, label: str = "", *, owner: str = ""
    ) -> fleet_pb2.CreateEnrolmentCodeResponse:
        """Admin: a one-time enrolment code (``ttl_seconds`` 0: one day) for a device of
        ``owner`` (empty: a new owner of its own; the response names it)."""
        request = fleet_pb2.CreateEnrolmentCodeRequest(ttl_seconds=ttl_seconds, label=label, owner=owner)
        return cast(fleet_pb2.CreateEnrolmentCodeResponse, self._unary(self.fleet.CreateEnrolmentCode, request))

    def enrol(self, code: str, device_name: str = "", owner_key_id: str = "") -> Enrolment:
        """Trade an enrolment code for a device id and token (not retried: a code works once);
        ``owner_key_id`` lets the server refuse a device whose owner key is not the owner's."""
        request = fleet_pb2.EnrolRequest(code=code, device_name=device_name, owner_key_id=owner_key_id)
        response = self._unary(self.fleet.Enrol, request, retry=False)
        return Enrolment(
            response.device_id,
            response.token,
            response.publisher_public_key,
            response.publisher_key_id,
            response.owner_id,
        )

    def report(
        self, version: int, gallery_size: int, upgrade_state: fleet_pb2.UpgradeState, **fields: Any
    ) -> fleet_pb2.ReportResponse:
        """Device: report the installed version, gallery size and upgrade state
        (``fleet_pb2.UPGRADE_STATE_IDLE`` …); ``fields`` are the other ``ReportRequest`` fields:
        ``target_version``, ``progress``, ``detail``, the trust (``root_version``, ``trust_stale``,
        ``seconds_since_fresh``), after an upgrade its ``health``, after a withdrawal
        ``reverted_from`` and ``revert_method``."""
        request = fleet_pb2.ReportRequest(
            version=version, gallery_size=gallery_size, upgrade_state=upgrade_state, **fields
        )
        return cast(fleet_pb2.ReportResponse, self._unary(self.fleet.Report, request))

    def list_devices(self, **filters: Any) -> list[fleet_pb2.DeviceInfo]:
        """Admin: every enrolled device (all pages) matching ``filters``: ListDevicesRequest's
        ``version``, ``upgrade_state``, ``stale_seconds`` and ``owner_id``."""
        return self._all_pages(self.fleet.ListDevices, _devices_request(filters), "devices")

    def device_pages(self, **filters: Any) -> Iterator[list[fleet_pb2.DeviceInfo]]:
        """Admin: the devices matching ``filters`` (as :meth:`list_devices`), one page at a time as
        each arrives; none is kept here."""
        ask = self._page_asker(self.fleet.ListDevices, _devices_request(filters))
        for page in stream_pages(ask, lambda page: page.devices, _listing_bound("devices")):
            yield list(page.devices)

    def revoke_device(self, device_id: str) -> fleet_pb2.RevokeDeviceResponse:
        """Admin: revoke a device; its token stops working at once (see the Fleet service)."""
        return cast(
            fleet_pb2.RevokeDeviceResponse,
            self._unary(self.fleet.RevokeDevice, fleet_pb2.RevokeDeviceRequest(device_id=device_id)),
        )

    def _all_pages(self, method: Any, request_type: Any, items: str) -> list[Any]:
        """Follow ``next_page_token`` until the last page; return every page's ``items``
        (within :data:`fctkit.protos.limits.MAX_LISTED_ITEMS` and ``MAX_LISTED_BYTES``)."""

        ask = self._page_asker(method, request_type)
        return gather_pages(ask, lambda page: getattr(page, items), _listing_bound(items)).items

    def _page_asker(self, method: Any, request_type: Any) -> Callable[[Any, int], Any]:
        """Asks ``method`` for the page after the previous one (None: the first; None back: no more)."""

        def ask(previous: Any, kept: int) -> Any:
            if previous is not None and not previous.next_page_token:
                return None
            return self._unary(method, request_type(page_token="" if previous is None else previous.next_page_token))

        return ask


def _listing_bound(items: str) -> PagingBound:
    """What one listing may bring in all (:data:`fctkit.protos.limits.MAX_LISTED_ITEMS` and ``MAX_LISTED_BYTES``)."""
    return PagingBound(items, limits.MAX_LISTED_ITEMS, limits.MAX_LISTED_BYTES, _listing_too_long)


def _devices_request(filters: dict[str, Any]) -> Callable[..., fleet_pb2.ListDevicesRequest]:
    """ListDevicesRequest for one page, with ``filters`` on every page."""
    return lambda page_token: fleet_pb2.ListDevicesRequest(page_token=page_token, **filters)


def _listing_too_long(message: str) -> RpcStatusError:
    return RpcStatusError("RESOURCE_EXHAUSTED", message)


def _artifact_digest(header: registry_pb2.ArtifactHeader) -> tuple[str, int]:
    return header.artifact.sha256, header.artifact.size


def _blob_digest(header: vault_pb2.BlobInfo) -> tuple[str, int]:
    return header.sha256, header.size


def _record_batches(records: Sequence[vault_pb2.SealedRecord]) -> Iterator[list[vault_pb2.SealedRecord]]:
    """``records`` cut into messages within the wire limits: MAX_RECORDS_PER_MESSAGE rows (a
    block counts its rows), MAX_RECORD_BATCH_BYTES sealed bytes, MAX_ITEM_ID_BATCH_BYTES of item ids."""
    batch: list[vault_pb2.SealedRecord] = []
    rows = sealed = ids = 0
    for record in records:
        item_ids = list(record.item_ids) or [record.item_id]
        more_rows, more_sealed, more_ids = len(item_ids), len(record.sealed), len("".join(item_ids).encode("utf-8"))
        if batch and (
            rows + more_rows > limits.MAX_RECORDS_PER_MESSAGE
            or sealed + more_sealed > limits.MAX_RECORD_BATCH_BYTES
            or ids + more_ids > limits.MAX_ITEM_ID_BATCH_BYTES
        ):
            yield batch
            batch, rows, sealed, ids = [], 0, 0, 0
        batch.append(record)
        rows, sealed, ids = rows + more_rows, sealed + more_sealed, ids + more_ids
    if batch:
        yield batch
