"""Prometheus metrics of one server replica (``fctkit serve --metrics-port PORT``).

Each replica serves its own metrics over HTTP at ``http://HOST:PORT/metrics`` (the Prometheus
text format, from ``prometheus-client``: ``pip install 'fctkit[metrics]'``). ``--metrics-host``
is 127.0.0.1 by default; give the address Prometheus reaches (e.g. 0.0.0.0) and keep the port
off the public network: the metrics need no token. ``--metrics-port 0`` picks a free port; the
log's ``metrics listening`` event names it. Without ``--metrics-port`` nothing more listens and
``prometheus-client`` is not imported. A scrape configuration for three replicas, each started
with ``fctkit serve --metrics-port 9464 --metrics-host 0.0.0.0`` (and its storage options)::

    scrape_configs:
      - job_name: fctkit
        scrape_interval: 15s
        static_configs:
          - targets: ["replica-1:9464", "replica-2:9464", "replica-3:9464"]

The metrics (every replica counts what it served; sum them across replicas):

- ``fctkit_rpc_total{method, code}`` (counter): fctkit RPCs by method (``/fctkit.v1.Vault/Upload``)
  and final gRPC status (``OK``, ``NOT_FOUND``, ``UNAUTHENTICATED``, ...). A streaming call
  counts once, when it ends. Health checks and reflection are not counted.
- ``fctkit_rpc_seconds{method}`` (histogram, buckets 1 ms to 30 s): how long each call took, from
  its start to its status (a stream's whole life; ``WatchVersions`` streams stay open for long,
  so they fall in the ``+Inf`` bucket).
- ``fctkit_transfer_bytes_total{kind, direction}`` (counter): protobuf message bytes the server
  received or sent (``direction``) for ``kind``: ``vault_blob`` (Vault Upload received, Download
  sent), ``replica_records`` (PushRecords received, PullRecords sent), ``artifact``
  (DownloadArtifact sent) and ``bundle`` (PublishBundle received). The payload plus a few bytes
  of framing per message, counted as it arrives, also for calls that fail later.
- ``fctkit_storage_errors_total{kind, error}`` (counter): storage exceptions the server met while
  serving a call or sweeping unfinished uploads, as it logs them: ``kind`` is ``unreachable``
  (database or object store cannot be reached: the call got UNAVAILABLE), ``database`` (an SQLite
  or PostgreSQL error) or ``object_store`` (an S3 error); ``error`` is the exception's class.
- ``fctkit_rollout_percent{version, state}`` (gauge): each rollout under way's share of the fleet
  and its state (``staged``, ``paused``, ``halted``, ``complete``, ``withdrawn``); a complete
  rollout drops out of the rollout gauges once its version is confirmed.
- ``fctkit_rollout_devices{version, stage, status}`` (gauge): a rollout's devices by the stage
  they entered it in (``0``: the cohort, then ``1``, ``2``, ... one per widening) and by
  ``status``: ``offered``, ``downloaded``, ``upgraded``, ``failed``, ``reverted``.
- ``fctkit_rollout_health_median{version, stage}`` (gauge): the median health signal (sampled
  fidelity) the stage's devices reported; absent while none reported.
- ``fctkit_build_info{version, backend}`` (gauge, always 1): the fctkit version and the storage
  backend (``sqlite`` or ``postgres``).
- ``process_*`` (prometheus-client's process collector): CPU seconds, resident memory, open file
  descriptors, start time.

Only ``/metrics`` is answered (every other path is 404), from a thread of the metrics port's own
(:mod:`.metrics_http`), never on the gRPC event loop. The rendered page is kept for
``cache_s`` seconds (``fctkit serve --metrics-cache``, 2 s by default; Prometheus scrapes every
15 s or so): scrapes within that time get the same text, and scrapes that find it older share one
new render; responses leave at most one per ``min_interval_s``, so nonstop scraping cannot crowd
out the RPCs.

Rollout gauges come from a provider: ``ServerMetrics.set_rollout_source(source)`` takes a
callable that returns the current rollouts as :class:`RolloutGauges` (version, state, percent,
devices by stage; :func:`gauges_of` turns a ``RolloutStatus`` message into them). The server
connects it to ``RegistryService.rollout_statuses``: what ``GetRollout`` answers, for every
rollout. It is called once per render, on the render's thread, and the server's source hands the
read to :class:`~.status_reads.StatusReads` (its worker thread and read connection; the render
waits at most :data:`ROLLOUT_READ_TIMEOUT_S`), never the event loop. It reads every device's last
report and each rollout's health reports, so its cost grows with the fleet; the cache bounds how
often it runs, whoever scrapes. A render whose call fails shows no rollout gauges (the failure is
logged, and counted as a storage error when it is one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fctkit import __version__
from fctkit.errors import ConfigError, require

from .database import storage_unreachable
from .jsonlog import log_event
from .metrics_http import CachedPage, MetricsHttpServer

RPC_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

#: Which RPCs carry which bytes (request bytes received, response bytes sent).
TRANSFER_KINDS: dict[str, str] = {
    "/fctkit.v1.Vault/Upload": "vault_blob",
    "/fctkit.v1.Vault/Download": "vault_blob",
    "/fctkit.v1.Vault/PushRecords": "replica_records",
    "/fctkit.v1.Vault/PullRecords": "replica_records",
    "/fctkit.v1.Registry/DownloadArtifact": "artifact",
    "/fctkit.v1.Registry/PublishBundle": "bundle",
}

_STORAGE_MODULES = {
    "sqlite3": "database",
    "psycopg": "database",
    "psycopg_pool": "database",
    "botocore": "object_store",
    "boto3": "object_store",
}


@dataclass(frozen=True)
class StageGauges:
    """One stage of a rollout: ``devices`` maps a status (offered, downloaded, upgraded, failed,
    reverted) to a number of devices; ``health_median`` None: no device reported."""

    stage: int
    devices: Mapping[str, int] = field(default_factory=dict)
    health_median: float | None = None


@dataclass(frozen=True)
class RolloutGauges:
    """One rollout as the gauges show it."""

    version: int
    state: str
    percent: float
    stages: Sequence[StageGauges] = ()


RolloutSource = Callable[[], Iterable[RolloutGauges]]
STAGE_STATUSES = ("offered", "downloaded", "upgraded", "failed", "reverted")


def gauges_of(status: Any) -> RolloutGauges:
    """The gauges of a ``fctkit.v1.RolloutStatus`` (what ``GetRollout`` answers)."""
    stages = [
        StageGauges(
            stage.stage,
            {name: getattr(stage, name) for name in STAGE_STATUSES},
            stage.health.median if stage.health.devices else None,
        )
        for stage in status.stages
    ]
    return RolloutGauges(status.version, status.state, status.percent, stages)


ROLLOUT_READ_TIMEOUT_S = 5.0
CACHE_S = 2.0  # a rendered page serves the scrapes of this long (`fctkit serve --metrics-cache`)
MIN_INTERVAL_S = 0.02  # at most one response per this long: 50 scrapes a second


def storage_error_kind(exc: BaseException) -> str | None:
    """``unreachable``, ``database`` or ``object_store`` for a storage exception, else None."""
    if storage_unreachable(exc):
        return "unreachable"
    return _STORAGE_MODULES.get(type(exc).__module__.split(".")[0])


class ServerMetrics:
    """The metrics of one replica, in a registry of its own (several servers in one process
    keep apart); :meth:`listen` serves them. It is the :class:`fctkit.server.rpc.RpcMeter`
    of the replica's :class:`~fctkit.server.rpc.MeteringInterceptor`."""

    def __init__(
        self,
        backend: Literal["sqlite", "postgres"],
        *,
        cache_s: float = CACHE_S,
        min_interval_s: float = MIN_INTERVAL_S,
    ) -> None:
        prometheus = require("prometheus_client", "metrics")
        self._prometheus = prometheus
        self._cache_s, self._min_interval_s = cache_s, min_interval_s
        self.registry = prometheus.CollectorRegistry()
        # first: a storage error met while reading the rollouts shows in the same scrape's counter
        self._rollouts = _RolloutCollector(prometheus.metrics_core.GaugeMetricFamily, self.storage_error)
        self.registry.register(self._rollouts)
        self._rpcs = prometheus.Counter(
            "fctkit_rpc",
            "fctkit RPCs by method and final gRPC status (a stream counts once, at its end)",
            ["method", "code"],
            registry=self.registry,
        )
        self._seconds = prometheus.Histogram(
            "fctkit_rpc_seconds",
            "Duration of fctkit RPCs, from start to status",
            ["method"],
            buckets=RPC_BUCKETS_S,
            registry=self.registry,
        )
        self._bytes = prometheus.Counter(
            "fctkit_transfer_bytes",
            "Message bytes received or sent, by what they carry",
            ["kind", "direction"],
            registry=self.registry,
        )
        self._storage_errors = prometheus.Counter(
            "fctkit_storage_errors",
            "Storage exceptions met, by kind and class",
            ["kind", "error"],
            registry=self.registry,
        )
        build = prometheus.Gauge(
            "fctkit_build_info",
            "The fctkit version and storage backend of this replica",
            ["version", "backend"],
            registry=self.registry,
        )
        build.labels(__version__, backend).set(1)
        prometheus.ProcessCollector(registry=self.registry)
        self._http: MetricsHttpServer | None = None

    def finished(self, method: str, code: str, seconds: float) -> None:
        self._rpcs.labels(method, code).inc()
        self._seconds.labels(method).observe(seconds)

    def transferred(self, method: str, direction: Literal["received", "sent"], size: int) -> None:
        if (kind := TRANSFER_KINDS.get(method)) is not None:
            self._bytes.labels(kind, direction).inc(size)

    def storage_error(self, exc: BaseException) -> None:
        """Count ``exc`` if it is a storage exception (others are not counted here)."""
        if (kind := storage_error_kind(exc)) is not None:
            self._storage_errors.labels(kind, type(exc).__name__).inc()

    def set_rollout_source(self, source: RolloutSource | None) -> None:
        """Where the rollout gauges come from (called at every scrape); None: no rollout gauges."""
        self._rollouts.source = source

    def listen(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) from a thread of its own; the port.
        The rollout source runs on the render's thread at each render."""
        page = CachedPage(lambda: self._prometheus.generate_latest(self.registry), self._cache_s)
        http = MetricsHttpServer(page, self._prometheus.exposition.CONTENT_TYPE_LATEST, self._min_interval_s)
        try:
            bound = http.start(host, port)
        except OSError as exc:
            http.close()
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; choose another "
                "--metrics-port (0 picks a free one) or stop what listens there"
            ) from exc
        self._http = http
        log_event("metrics listening", host=host, port=bound, path="/metrics")
        return bound

    def close(self) -> None:
        """Stop serving (scrapes in flight finish first, for a moment)."""
        if self._http is not None:
            self._http.close()
            self._http = None


class _RolloutCollector:
    """The rollout gauges, read from :attr:`source` at each scrape."""

    def __init__(self, gauge_family: type, storage_error: Callable[[BaseException], None]) -> None:
        self._family, self._storage_error = gauge_family, storage_error
        self.source: RolloutSource | None = None

    def describe(self) -> list:
        return []  # the families depend on the source; nothing to check at registration

    def collect(self) -> Iterator[Any]:
        if self.source is None:
            return
        try:
            rollouts = list(self.source())  # on the render thread, never the event loop
        except Exception as exc:  # one failed read must not fail the whole scrape
            log_event("rollout metrics unavailable", logging.WARNING, error=f"{type(exc).__name__}: {exc}")
            self._storage_error(exc)
            return
        percent = self._family(
            "fctkit_rollout_percent", "Share of the fleet a rollout offers its version to", labels=["version", "state"]
        )
        devices = self._family(
            "fctkit_rollout_devices",
            "Devices of a rollout by the stage they entered in and status",
            labels=["version", "stage", "status"],
        )
        health = self._family(
            "fctkit_rollout_health_median",
            "Median health signal the stage's devices reported",
            labels=["version", "stage"],
        )
        for rollout in rollouts:
            version = str(rollout.version)
            percent.add_metric([version, rollout.state], rollout.percent)
            for stage in rollout.stages:
                for status, count in stage.devices.items():
                    devices.add_metric([version, str(stage.stage), status], count)
                if stage.health_median is not None:
                    health.add_metric([version, str(stage.stage)], stage.health_median)
        yield from (percent, devices, health)
