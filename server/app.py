"""The fctkit gRPC server (grpc.aio): Registry, Vault (blobs and gallery replica) and Fleet behind bearer-token auth, with
standard health checking and server reflection, optional TLS, JSON-lines logging and graceful
shutdown (SIGINT/SIGTERM: health turns NOT_SERVING, watch streams end with OK, in-flight calls
get ``shutdown_grace_s`` to finish)."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fctkit.config import read_setting_file
from fctkit.errors import ConfigError
from fctkit.private_files import make_private, private_umask
from fctkit.protos import fleet_pb2_grpc, limits, registry_pb2_grpc, vault_pb2_grpc
from fctkit.protos.bundle import load_public_key, public_key_id
from fctkit.protos.manifest_signature import load_private_key, read_passphrase
from fctkit.protos.trust import format_time, root_fingerprint

from .auth import SERVICE_MODULES, Authenticator, AuthInterceptor, load_or_create_admin_token, protocol_methods
from .fleet import FleetService
from .jsonlog import configure_logging, log_event
from .metrics import CACHE_S, ROLLOUT_READ_TIMEOUT_S, ServerMetrics, gauges_of
from .registry import Catalog, RegistryService
from .revocation import OpenStreams
from .rollout.offers import Rollouts
from .root_of_trust import PublisherKeyRules, ReleaseRules, RootOfTrust
from .rpc import MeteringInterceptor
from .status_reads import StatusReads
from .storage import SqliteStorage, Storage
from .storage_schema import redacted_dsn
from .vault import VaultService


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``fctkit serve`` takes (build it with :func:`fctkit.config.from_mapping`).

    Storage is either ``data_dir`` (SQLite + files: one server) or ``database`` plus
    ``object_store`` (PostgreSQL + an S3 bucket: any number of replicas). Releases are checked
    against either ``publisher_key`` (one key) or ``root`` (a root of trust, with the online
    ``timestamp_keys`` this server signs timestamps with)."""

    publisher_key: Path | None = None
    root: Path | None = None
    timestamp_keys: tuple[Path, ...] = ()
    timestamp_passphrase_file: Path | None = None
    timestamp_expiry_hours: float = 24.0
    data_dir: Path | None = None
    database: str | None = None
    object_store: str | None = None
    s3_endpoint_url: str | None = None
    database_connections: int = 20
    host: str = "127.0.0.1"
    port: int = 50051
    admin_token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    quota_bytes: int = 1 << 30
    replica_quota_bytes: int = 1 << 30
    max_blob_bytes: int = 64 << 20
    max_bundle_bytes: int = 4 << 30
    partial_upload_ttl_s: float = 86400.0
    watch_keepalive_s: float = 15.0
    shutdown_grace_s: float = 10.0
    reports_per_minute: int = 120
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_cache_s: float = CACHE_S
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    def __post_init__(self) -> None:
        self._check_trust()
        scale_out = (self.database is not None, self.object_store is not None)
        if self.data_dir is not None and any(scale_out):
            raise ConfigError(
                "choose one storage: --data DIR (embedded), or --database with --object-store (scale-out)"
            )
        if self.data_dir is None and not all(scale_out):
            raise ConfigError(
                "no storage: pass --data DIR, or both --database postgresql://... and --object-store s3://BUCKET/PREFIX"
            )
        if self.data_dir is None and self.admin_token_file is None:
            raise ConfigError(
                "the scale-out backend has no data directory to keep the admin token in: pass "
                "--admin-token-file (the same file, or its content, on every replica)"
            )
        if self.database_connections < 2:
            raise ConfigError("database_connections must be at least 2")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port} is not 0..65535 (0 picks a free port)")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics port {self.metrics_port} is not 0..65535 (0 picks a free port)")
        if not 0 <= self.metrics_cache_s <= 300:
            raise ConfigError(f"metrics cache {self.metrics_cache_s} s is not 0..300 seconds")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ConfigError("--tls-ca (require client certificates) needs TLS: pass --tls-cert and --tls-key too")
        for name in (
            "quota_bytes",
            "replica_quota_bytes",
            "max_blob_bytes",
            "max_bundle_bytes",
            "partial_upload_ttl_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if not 1 <= self.reports_per_minute <= 100_000:
            raise ConfigError(
                f"reports_per_minute is {self.reports_per_minute}; from 1 to 100000 reports per device and minute"
            )
        if self.watch_keepalive_s <= 0 or self.shutdown_grace_s < 0:
            raise ConfigError("watch_keepalive_s must be positive and shutdown_grace_s not negative")

    def _check_trust(self) -> None:
        if (self.publisher_key is None) == (self.root is None):
            raise ConfigError(
                "releases are checked against one of: --publisher-key publisher.pub (one key), or "
                "--root root.json with --timestamp-key (a root of trust); give exactly one"
            )
        if self.root is not None and not self.timestamp_keys:
            raise ConfigError(
                "--root needs --timestamp-key KEY: the online key this server signs timestamps with "
                "(one the root's timestamp role lists)"
            )
        if self.root is None and (self.timestamp_keys or self.timestamp_passphrase_file is not None):
            raise ConfigError("--timestamp-key goes with --root: a server with --publisher-key signs no timestamps")
        if not MIN_TIMESTAMP_EXPIRY_H <= self.timestamp_expiry_hours <= MAX_TIMESTAMP_EXPIRY_H:
            raise ConfigError(
                f"timestamp_expiry_hours is {self.timestamp_expiry_hours}; from {MIN_TIMESTAMP_EXPIRY_H:.3f} "
                f"(one minute) to {MAX_TIMESTAMP_EXPIRY_H} (31 days): devices must see a fresh one "
                "well within their root's freshness limit"
            )

    def release_rules(self, storage: Storage) -> ReleaseRules:
        """What releases must be signed by: the publisher key, or the root (reconciled with storage)."""
        if self.root is None:
            return PublisherKeyRules(load_public_key(cast(Path, self.publisher_key)))  # a root or a publisher key
        passphrase = read_passphrase(self.timestamp_passphrase_file)
        keys = [load_private_key(path, passphrase) for path in self.timestamp_keys]
        return RootOfTrust.open(storage, self.root, keys, self.timestamp_expiry_hours * 3600)


MIN_TIMESTAMP_EXPIRY_H, MAX_TIMESTAMP_EXPIRY_H = 1 / 60, 31 * 24


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _enable_reflection(service_names: list[str], server: grpc.aio.Server) -> None:
    """Server reflection as grpc.reflection.v1alpha (grpcio-reflection) and as v1, which current
    tools (grpcurl, Postman) ask for first. The v1 messages are the v1alpha ones under a new
    package name, identical on the wire, so the same servicer answers both. Only v1alpha is listed:
    grpcio-reflection ships no v1 descriptor to describe v1 with."""
    from grpc_reflection.v1alpha import reflection_pb2

    reflection.enable_server_reflection(service_names, server)
    servicer = reflection.aio.ReflectionServicer(service_names)
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": method}),)
    )


class FctkitServer:
    """One server over one data directory. ``await start()``, then ``await stop()``."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._metrics = (
            None
            if config.metrics_port is None
            else ServerMetrics("sqlite" if config.data_dir else "postgres", cache_s=config.metrics_cache_s)
        )
        self._storage = open_storage(config)
        try:
            self._rules = rules = config.release_rules(self._storage)
        except BaseException:
            self._storage.close()
            raise
        removed = self._storage.collect_garbage()
        self._catalog = Catalog.load(self._storage, rules)
        if isinstance(rules, RootOfTrust):
            latest = rules.latest()
            log_event(
                "root of trust",
                root_version=latest.body.version,
                fingerprint=root_fingerprint(latest),
                expires=format_time(latest.body.expires),
                timestamp_keys=[public_key_id(k.public_key()) for k in rules.signing_keys(latest)],
            )
        admin_token, self.admin_token_path = load_or_create_admin_token(config.admin_token_file, config.data_dir)
        authenticator = Authenticator(admin_token, self._storage.device_for_token, self._storage.device_owner)
        self._open_streams = open_streams = OpenStreams()  # a revoked device's open streams end at once
        self._listener: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # health changes in flight (kept referenced until done)
        self._stopping = False
        self._health = health.aio.HealthServicer()
        metering = [] if self._metrics is None else [MeteringInterceptor(self._metrics, protocol_methods())]
        self._server = grpc.aio.server(
            interceptors=[*metering, AuthInterceptor(authenticator, open_streams)],
            options=[
                ("grpc.max_receive_message_length", limits.MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", limits.MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        self._rollouts = Rollouts(self._storage, self._catalog.wake)  # what each device is offered
        self._status_reads = StatusReads(self._storage)  # rollout status counts, off the event loop
        registry = RegistryService(
            self._storage,
            self._catalog,
            rules,
            max_bundle_bytes=config.max_bundle_bytes,
            keepalive_s=config.watch_keepalive_s,
            rollouts=self._rollouts,
            status_reads=self._status_reads,
        )
        registry_pb2_grpc.add_RegistryServicer_to_server(registry, self._server)
        if self._metrics is not None:  # the rollout gauges: what GetRollout answers for each rollout
            statuses = functools.partial(self._status_reads.call, registry.rollout_statuses, ROLLOUT_READ_TIMEOUT_S)
            self._metrics.set_rollout_source(lambda: map(gauges_of, statuses()))
        self._vault = VaultService(
            self._storage,
            quota_bytes=config.quota_bytes,
            max_blob_bytes=config.max_blob_bytes,
            partial_upload_ttl_s=config.partial_upload_ttl_s,
            replica_quota_bytes=config.replica_quota_bytes,
        )
        vault_pb2_grpc.add_VaultServicer_to_server(self._vault, self._server)
        self._sweeper: asyncio.Task[None] | None = None
        fleet_pb2_grpc.add_FleetServicer_to_server(
            FleetService(
                self._storage,
                enrolment_key=rules.enrolment_key,
                latest_version=registry.latest_offered,
                published=registry.published,
                open_streams=open_streams,
                rollouts=self._rollouts,
                reports_per_minute=config.reports_per_minute,
            ),
            self._server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        _enable_reflection([*self.service_names(), health.SERVICE_NAME, reflection.SERVICE_NAME], self._server)
        opened: dict[str, Any] = {**_storage_fields(config), "garbage_removed": removed, **self._storage.counts()}
        log_event("storage opened", **opened)

    @staticmethod
    def service_names() -> list[str]:
        return [s.full_name for m in SERVICE_MODULES for s in m.DESCRIPTOR.services_by_name.values()]

    def _bind(self) -> int:
        address = f"{self.config.host}:{self.config.port}"
        if self.config.tls_cert is None:
            port = self._server.add_insecure_port(address)
        else:
            client_ca = self.config.tls_ca
            credentials = grpc.ssl_server_credentials(
                [
                    (
                        read_setting_file(cast(Path, self.config.tls_key), "TLS key"),  # given with the cert
                        read_setting_file(self.config.tls_cert, "TLS certificate"),
                    )
                ],
                root_certificates=None
                if client_ca is None
                else read_setting_file(client_ca, "TLS client CA certificate"),
                require_client_auth=client_ca is not None,
            )
            port = self._server.add_secure_port(address, credentials)
        if port == 0:
            raise ConfigError(f"cannot listen on {address}: the port is taken or the address is not local")
        return port

    async def start(self) -> int:
        try:
            self.port = self._bind()
        except RuntimeError as exc:  # grpc raises RuntimeError when binding fails
            raise ConfigError(f"cannot listen on {self.config.host}:{self.config.port}: {exc}") from exc
        if self._metrics is not None:
            self.metrics_port = self._metrics.listen(self.config.metrics_host, self.config.metrics_port or 0)
        await self._server.start()
        self._sweeper = asyncio.create_task(self._sweep_uploads())
        events = self._storage.listen(self._on_event, self._catch_up, self._database_lost)
        if events is not None:
            self._listener = asyncio.create_task(events)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log_event(
            "listening",
            host=self.config.host,
            port=self.port,
            tls=self.config.tls_cert is not None,
            client_certificates=self.config.tls_ca is not None,
            latest_version=self._catalog.latest,
            admin_token_file=str(self.admin_token_path),
        )
        return self.port

    async def _set_health(self, status: int) -> None:
        for name in ["", *self.service_names()]:
            await self._health.set(name, status)

    def _database_lost(self) -> None:
        """Health turns NOT_SERVING (a load balancer sends calls elsewhere) until the events connection is back."""
        if not self._stopping:
            self._background(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        log_event("shutting down", grace_s=self.config.shutdown_grace_s)
        self._stopping = True
        await self._health.enter_graceful_shutdown()
        for task in (self._sweeper, self._listener):
            if task is not None:
                task.cancel()
        self._catalog.close()
        await self._server.stop(self.config.shutdown_grace_s)
        if self._metrics is not None:
            self._metrics.close()
        self._status_reads.close()
        round_trips: dict[str, Any] = self._storage.round_trips()
        self._storage.close()
        log_event("stopped", **round_trips)

    def _on_event(self, payload: str) -> None:
        """What another replica did: a publish (watchers here get it), a rollout change or a withdrawal
        (what devices here are offered changes), or a revocation (its streams here end)."""
        kind, _, subject = payload.partition(":")
        if kind == "version":
            self._refresh_catalog()
        elif kind == "rollout":  # a rollout changed there: what devices here are offered changes with it
            self._rollouts.reload()
        elif kind == "withdrawal":  # a withdrawal stored there: the version is offered to no device here either
            self._rollouts.withdrawals.reload()
        elif kind == "revoked" and self._open_streams.end(subject):
            log_event("revoked device's streams ended", device_id=subject, by="another replica")

    def _catch_up(self) -> None:
        """After (re)connecting to the other replicas' events: what was published or revoked
        meanwhile; health is SERVING again."""
        self._refresh_catalog()
        self._rollouts.reload()
        self._rollouts.withdrawals.reload()
        for device_id in self._storage.revoked_among(self._open_streams.devices()):
            self._open_streams.end(device_id)
        if not self._stopping:
            self._background(self._set_health(health_pb2.HealthCheckResponse.SERVING))

    def _refresh_catalog(self) -> None:
        try:
            if added := self._catalog.refresh(self._storage, self._rules):
                log_event("versions published elsewhere", added=added, latest_version=self._catalog.latest)
        except Exception as exc:  # a version that does not verify stays unlisted here; the log says why
            log_event("catalog refresh failed", logging.ERROR, error=str(exc))

    async def _sweep_uploads(self) -> None:
        """Expire idle unfinished uploads, at start and then every TTL/4 (at most every minute)."""
        interval = min(self.config.partial_upload_ttl_s / 4, 60.0)
        while True:
            try:
                if removed := self._vault.sweep_uploads():
                    log_event("unfinished uploads removed", files=removed)
            except Exception as exc:  # storage unreachable now: the next round tries again
                log_event("upload sweep failed", logging.WARNING, error=f"{type(exc).__name__}: {exc}")
                if self._metrics is not None:
                    self._metrics.storage_error(exc)
            await asyncio.sleep(interval)

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()


def open_storage(config: ServerConfig) -> Storage:
    if config.data_dir is not None:
        return SqliteStorage(config.data_dir)
    from .scale_out import ScaleOutStorage

    return ScaleOutStorage(
        cast(str, config.database),  # ServerConfig: a data dir, or a database and an object store
        cast(str, config.object_store),
        s3_endpoint_url=config.s3_endpoint_url,
        max_connections=config.database_connections,
    )


def _storage_fields(config: ServerConfig) -> dict[str, str]:
    if config.data_dir is not None:
        return {"data_dir": str(config.data_dir)}
    return {"database": redacted_dsn(config.database or ""), "object_store": config.object_store or ""}


async def serve(config: ServerConfig) -> None:
    """Run until SIGINT or SIGTERM, then shut down gracefully. The process runs under umask
    077 and the data directory (if any) is made owner-only first (directories 0700, files 0600)."""
    configure_logging(config.log_level)
    private_umask()
    if config.data_dir is not None:
        config.data_dir.mkdir(parents=True, exist_ok=True)
        fixed = make_private(config.data_dir)
        if fixed:
            log_event("data directory made owner-only", data_dir=str(config.data_dir), modes_changed=fixed)
    server = FctkitServer(config)
    await server.start()
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_requested.set)
    await stop_requested.wait()
    await server.stop()
