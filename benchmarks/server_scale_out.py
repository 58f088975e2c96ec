"""Server scale-out: throughput of 1, 2, 3 `fctkit serve` replicas over one PostgreSQL database
and one S3 bucket, under many concurrent devices, with the database and object-store work each
operation costs.

    python benchmarks/server_scale_out.py                                    # 200 clients, 20 s, 1,2,3 replicas
    python benchmarks/server_scale_out.py --clients 20 --seconds 5 --replicas 1,2   # a quick run

Needs PostgreSQL's initdb/pg_ctl (``make services``) and moto[server] (the ``scale`` extra): the
benchmark starts a throwaway PostgreSQL cluster and moto's S3 server on loopback with the test
helpers (tests/support/scale_services.py, tests/server/conftest.py) and stops them at the end,
also on Ctrl-C or an error.

Each round (one per ``--replicas`` entry) gets a fresh database and bucket prefix. A setup
replica publishes one signed bundle (its embed graph ``--artifact-mib`` MiB, built like the
server tests' bundles) and enrols ``--clients`` devices, ``--devices-per-owner`` per owner (the
per-owner vault quota is ``--quota-bytes``, large by default, so quotas do not bite); it is then
stopped, so the publish and the enrolments are not in the round's counters. Then N replicas
start over the same database and prefix and every device runs at once, each in a thread with a
FctkitClient of its own whose target lists all N replicas (gRPC round_robin spreads the calls),
spread over ``--workers`` client processes. For ``--seconds`` (or ``--ops-per-client``
operations) each device repeats a random mix: with probability ``--upload-fraction`` it uploads a
fresh ``--blob-kib`` KiB random blob to its vault (Stat + Upload), else it downloads the bundle's
embed artifact (DownloadArtifact, SHA-256 checked, into a sink that discards the bytes).

Measured per operation kind: operations/s and MB/s (10^6 bytes) of the operations that finished
within the load window (``--seconds`` from the first start; operations still running then
finish, and count in latency and failures only), p50/p99 latency of whole operations, failures
(count and the first error). When the round ends
the replicas get SIGTERM and log their ``stopped`` event; its database round trips and
object-store requests, summed over the replicas and divided by the operations of the round, give
the per-operation cost of the mix (what an operator sizes PostgreSQL and S3 by). Before the first
round's load, each kind also runs alone (``--calibration-ops`` in a row, one replica, one client,
the counters of a replica that only starts and stops subtracted) for its own per-operation cost
and its uncontended latency. Calls served per
replica, non-OK codes and warning/error log lines come from the replicas' logs. CPU seconds of
the client processes, the replicas, PostgreSQL and moto over the load window show where the
machine's cores went.

The baseline is the round with the fewest replicas (1 by default), measured in the same run: the
printed ratios are each round's operations/s over it. Every process (clients, replicas,
PostgreSQL, moto) shares this machine's cores, so the gain from more replicas is capped by the
cores, and the Python client threads are themselves CPU-bound. The results go to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import queue
import random
import shlex
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # tests.support / tests.server helpers

DOWNLOAD, UPLOAD = "download", "upload"
KINDS = (DOWNLOAD, UPLOAD)
READY_TIMEOUT_S = 120.0
HANG_GRACE_S = 180.0  # the load may overrun --seconds (or 5 s per op) by this much before it counts as a hang
PUBLISHER_SEED = bytes(range(100, 132))


# -- plan and outcomes -------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadPlan:
    """What every client of a round does (pickled into the client processes)."""

    target: str  # every replica of the round, comma-separated
    version: int
    artifact: str
    artifact_sha256: str
    artifact_size: int
    blob_bytes: int
    upload_fraction: float
    seconds: float
    ops_per_client: int  # > 0: this many operations per client instead of --seconds
    tag: str  # makes item ids unique across rounds


@dataclass(frozen=True)
class Outcome:
    kind: str
    began: float  # time.monotonic(), comparable across processes of this machine
    seconds: float
    ok: bool
    error: str = ""


class _Discard:
    """A write-only sink: the client library hashes the bytes, nothing is kept."""

    def write(self, data: bytes) -> int:
        return len(data)


# -- client processes --------------------------------------------------------------------------


def _one_operation(client: Any, plan: LoadPlan, kind: str, item_id: str) -> None:
    if kind == DOWNLOAD:
        transfer = client.fetch_artifact(plan.version, plan.artifact, _Discard())  # raises on a SHA-256 mismatch
        if (transfer.sha256, transfer.size) != (plan.artifact_sha256, plan.artifact_size):
            raise RuntimeError(
                f"downloaded {transfer.size} bytes, sha256 {transfer.sha256}: not the published artifact"
            )
    else:
        client.upload_blob(os.urandom(plan.blob_bytes), item_id)


def _client_loop(client: Any, plan: LoadPlan, index: int, deadline: float) -> list[Outcome]:
    rng = random.Random(index)
    outcomes: list[Outcome] = []
    while (len(outcomes) < plan.ops_per_client) if plan.ops_per_client > 0 else (time.monotonic() < deadline):
        kind = UPLOAD if rng.random() < plan.upload_fraction else DOWNLOAD
        began = time.monotonic()
        try:
            _one_operation(client, plan, kind, f"{plan.tag}-c{index}-{len(outcomes)}")
            outcomes.append(Outcome(kind, began, time.monotonic() - began, True))
        except Exception as exc:  # counted and reported, never hidden
            outcomes.append(Outcome(kind, began, time.monotonic() - began, False, f"{type(exc).__name__}: {exc}"))
    return outcomes


def _client_worker(plan: LoadPlan, clients: list[tuple[int, str]], start: Any, results: Any) -> None:
    """``len(clients)`` devices in threads, one FctkitClient each; released with the other processes."""
    import grpc

    from fctkit.protos.client import FctkitClient

    collected: list[Outcome] = []
    lock, go, deadline = threading.Lock(), threading.Event(), [0.0]
    ready = threading.Barrier(len(clients) + 1)

    def device(index: int, token: str) -> None:
        with FctkitClient(plan.target, token) as client:
            grpc.channel_ready_future(client._channel).result(timeout=READY_TIMEOUT_S)
            ready.wait()
            go.wait()
            outcomes = _client_loop(client, plan, index, deadline[0])
        with lock:
            collected.extend(outcomes)

    try:
        threads = [threading.Thread(target=device, args=client, daemon=True) for client in clients]
        for thread in threads:
            thread.start()
        ready.wait(timeout=READY_TIMEOUT_S)
        start.wait(timeout=READY_TIMEOUT_S)
        cpu_before = time.process_time()
        deadline[0] = time.monotonic() + plan.seconds
        go.set()
        for thread in threads:
            thread.join()
    except KeyboardInterrupt:  # Ctrl-C: the main process reports it and cleans up
        return
    except Exception as exc:  # e.g. a client that never connected broke the barriers
        results.put(f"client process {os.getpid()} failed before the load: {type(exc).__name__}: {exc}")
        return
    results.put(([asdict(o) for o in collected], time.process_time() - cpu_before))


def run_load(plan: LoadPlan, tokens: list[str], workers: int) -> tuple[list[Outcome], float]:
    """Every token's device at once, in ``workers`` processes; (outcomes, client CPU seconds)."""
    ctx = multiprocessing.get_context("spawn")
    workers = max(1, min(workers, len(tokens)))
    start, results = ctx.Barrier(workers), ctx.Queue()
    shares = [list(enumerate(tokens))[k::workers] for k in range(workers)]
    processes = [
        ctx.Process(target=_client_worker, args=(plan, share, start, results), daemon=True) for share in shares
    ]
    for process in processes:
        process.start()
    limit = READY_TIMEOUT_S + HANG_GRACE_S + (plan.seconds if plan.ops_per_client <= 0 else 5.0 * plan.ops_per_client)
    outcomes: list[Outcome] = []
    cpu_s = 0.0
    try:
        for _ in processes:
            item = results.get(timeout=limit)
            if isinstance(item, str):
                raise RuntimeError(item)
            found, spent = item
            outcomes += [Outcome(**o) for o in found]
            cpu_s += spent
        for process in processes:
            process.join(30)
    except queue.Empty:  # a client process died, or the calls hang
        raise RuntimeError(
            f"the clients did not finish within {limit:.0f} s: a hang, or a client process died; see the replicas' logs"
        ) from None
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(10)
    return outcomes, cpu_s


# -- services, bundle, devices -----------------------------------------------------------------


@dataclass
class Services:
    work: Path
    cluster: Any  # PostgresCluster
    s3: Any  # S3Endpoint
    publisher_pub: Path
    admin_token_file: Path
    archive: Path


def start_services(work: Path, stack: ExitStack, artifact_mib: float) -> Services:
    """PostgreSQL, moto S3 (with the tests' bucket), the publisher key, the admin token and the bundle."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from fctkit.export.keys import save_public_key
    from tests.server.conftest import ADMIN_TOKEN, BUCKET
    from tests.support.scale_services import start_postgres, start_s3

    cluster = start_postgres(work / "postgres")
    stack.callback(cluster.stop)
    s3 = start_s3(work / "moto.log")
    stack.callback(s3.stop)
    s3.create_bucket(BUCKET)
    key = Ed25519PrivateKey.from_private_bytes(PUBLISHER_SEED)
    publisher_pub = save_public_key(key.public_key(), work / "publisher.pub")
    token_file = work / "admin.token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    token_file.chmod(0o600)
    return Services(work, cluster, s3, publisher_pub, token_file, build_archive(work / "bundle", artifact_mib, key))


def build_archive(folder: Path, artifact_mib: float, key: Any) -> Path:
    """Bundle v1 as the server tests build it, its embed graph holding ``artifact_mib`` MiB of weights."""
    from fctkit.export.bundle_builder import build_bundle
    from fctkit.protos.bundle import pack_bundle
    from tests.server.conftest import CHAIN, EMBED_DIM, IMAGE_DIM, _sources

    image_dim = max(IMAGE_DIM, int(artifact_mib * (1 << 20) / (4 * EMBED_DIM)))
    sources = _sources(folder / "src", 1, CHAIN[1], image_dim)
    bundle = build_bundle(
        folder / "v1",
        version=1,
        parents=(),
        mode="forward",
        distance="cosine",
        normalize=True,
        artifacts=sources,
        gate={"cases": {}, "ecc": {}},
        private_key=key,
    )
    return pack_bundle(bundle.root, folder / "v1.tar")


def server_args(args: argparse.Namespace) -> list[str]:
    return ["--quota-bytes", str(args.quota_bytes), "--database-connections", str(args.database_connections)]


def replica(services: Services, data_dir: Path, args: argparse.Namespace, name: str) -> Any:
    from tests.server.conftest import Backend, ServerProcess

    backend = Backend("postgres", services.cluster, services.s3)
    return ServerProcess(
        data_dir, services.publisher_pub, services.admin_token_file, *server_args(args), backend=backend, log_name=name
    )


def set_up_round(services: Services, data_dir: Path, args: argparse.Namespace) -> tuple[LoadPlan, list[str], dict]:
    """On a setup replica of its own: publish the bundle and enrol the devices; (plan, tokens, its counters)."""
    from fctkit.protos.bundle import Manifest
    from fctkit.protos.client import FctkitClient
    from tests.server.conftest import ADMIN_TOKEN

    setup = replica(services, data_dir, args, "setup").start()
    try:
        with FctkitClient(setup.target, ADMIN_TOKEN) as admin:
            version = admin.publish_bundle(services.archive).version
            embed = Manifest.from_bytes(admin.get_manifest(version)[0]).artifact("embed")
            tokens = enrol_devices(admin, setup.target, args.clients, args.devices_per_owner)
    finally:
        stop_replicas([setup])
    plan = LoadPlan(
        target="",
        version=version,
        artifact=embed.name,
        artifact_sha256=embed.sha256,
        artifact_size=embed.size,
        blob_bytes=args.blob_kib * 1024,
        upload_fraction=args.upload_fraction,
        seconds=args.seconds,
        ops_per_client=args.ops_per_client,
        tag=data_dir.parent.name,
    )
    return plan, tokens, stopped_counters([setup])


def enrol_devices(admin: Any, target: str, count: int, per_owner: int) -> list[str]:
    """``count`` device tokens, ``per_owner`` devices in each owner."""
    from fctkit.protos.client import FctkitClient

    tokens: list[str] = []
    owner = ""
    with FctkitClient(target) as anonymous:
        for index in range(count):
            if index % per_owner == 0:
                owner = ""  # a new owner
            code = admin.create_enrolment_code(label=f"scale-out bench {index}", owner=owner)
            owner = code.owner_id
            tokens.append(anonymous.enrol(code.code, f"bench-{index}").token)
    return tokens


def calibrate(services: Services, data_dir: Path, args: argparse.Namespace, plan: LoadPlan, token: str) -> dict:
    """Each kind alone, uncontended: one replica, one client, ``--calibration-ops`` operations in a
    row; its counters less those of a replica that only starts and stops, per operation."""
    from fctkit.protos.client import FctkitClient

    keys = ("database_round_trips", "object_store_requests")

    def session(kind: str, count: int) -> tuple[dict, list[float]]:
        server = replica(services, data_dir, args, f"calibrate-{kind}").start()
        seconds: list[float] = []
        try:
            with FctkitClient(server.target, token) as client:
                for k in range(count):
                    began = time.monotonic()
                    _one_operation(client, plan, kind, f"calibrate-{kind}-{k}")
                    seconds.append(time.monotonic() - began)
        finally:
            stop_replicas([server])
        return stopped_counters([server]), seconds

    idle, _ = session("idle", 0)
    result: dict[str, Any] = {"operations_each": args.calibration_ops, "idle_replica": {k: idle[k] for k in keys}}
    for kind in KINDS:
        counters, seconds = session(kind, args.calibration_ops)
        result[kind] = {
            **{f"{k}_per_op": (counters[k] - idle[k]) / args.calibration_ops for k in keys},
            "p50_ms": _percentile_ms(seconds, 50),
        }
    return result


def stop_replicas(replicas: list[Any]) -> list[int | None]:
    """SIGTERM each (all at once), wait for it; kill one that does not stop. Exit codes."""
    for server in replicas:
        if server.alive():
            server.process.send_signal(signal.SIGTERM)
    codes: list[int | None] = []
    for server in replicas:
        if server.process is None:
            codes.append(None)
            continue
        try:
            codes.append(server.process.wait(60))
        except Exception:  # subprocess.TimeoutExpired: reported as a kill
            server.process.kill()
            server.process.wait()
            codes.append(None)
    return codes


def stopped_counters(replicas: list[Any]) -> dict:
    """The ``stopped`` events' counters, summed (and each replica's)."""
    each = [next((e for e in reversed(r.events()) if e.get("event") == "stopped"), {}) for r in replicas]
    keys = ("database_round_trips", "object_store_requests")
    return {
        **{k: sum(int(e.get(k, 0)) for e in each) for k in keys},
        "per_replica": [{k: e.get(k) for k in keys} for e in each],
        "missing_stopped_event": sum(1 for e in each if not e),
    }


# -- CPU accounting (Linux /proc) ---------------------------------------------------------------


def _process_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _postgres_pids(cluster: Any) -> list[int]:
    try:
        postmaster = int((Path(cluster.data_dir) / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return []
    return [postmaster, *_children(postmaster)]


def _machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores so far."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


def cpu_snapshot(services: Services, replicas: list[Any]) -> dict[str, Any]:
    return {
        "replicas": sum(_process_cpu_s(r.process.pid) for r in replicas),
        "postgres": {pid: _process_cpu_s(pid) for pid in _postgres_pids(services.cluster)},
        "moto": _process_cpu_s(services.s3.process.pid),
        "machine": _machine_busy(),
    }


def cpu_used(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """CPU seconds spent between two snapshots (PostgreSQL backends that came or went count partly)."""
    postgres = sum(s - before["postgres"].get(pid, 0.0) for pid, s in after["postgres"].items())
    busy = after["machine"][0] - before["machine"][0]
    total = after["machine"][1] - before["machine"][1]
    return {
        "replicas_s": after["replicas"] - before["replicas"],
        "postgres_s": postgres,
        "moto_s": after["moto"] - before["moto"],
        "machine_busy_fraction": busy / total if total else 0.0,
    }


# -- a round ------------------------------------------------------------------------------------


def run_round(count: int, services: Services, args: argparse.Namespace, with_calibration: bool) -> dict:
    """Set up, (calibrate,) start ``count`` replicas, run the load, stop them; the round's figures."""
    data_dir = services.work / f"round-{count}-replicas" / "data"
    data_dir.mkdir(parents=True)  # the replicas' logs go next to it
    plan, tokens, setup = set_up_round(services, data_dir, args)
    calibration = calibrate(services, data_dir, args, plan, tokens[0]) if with_calibration else None
    replicas = [replica(services, data_dir, args, f"replica{k}") for k in range(count)]
    try:
        for server in replicas:
            server.launch()
        for server in replicas:
            server.wait_listening()
        plan = replace(plan, target=",".join(r.target for r in replicas))
        before = cpu_snapshot(services, replicas)
        outcomes, client_cpu_s = run_load(plan, tokens, args.workers)
        cpu = {**cpu_used(before, cpu_snapshot(services, replicas)), "clients_s": client_cpu_s}
    except Exception:
        print_replica_logs(replicas)  # before they stop and the temporary folder goes
        raise
    finally:
        exit_codes = stop_replicas(replicas)
    summary = summarise_round(
        count, plan, outcomes, stopped_counters(replicas), setup, cpu, replica_logs(replicas), exit_codes
    )
    return {**summary, "calibration": calibration} if calibration else summary


def print_replica_logs(replicas: list[Any], tail: int = 5) -> None:
    """On a failed round: what the replicas logged (warnings, errors, each log's last lines), on stderr."""
    for k, server in enumerate(replicas):
        lines = server.log_text(server.log_offset).splitlines() if server.process is not None else []
        problems = [line for line in lines if '"level": "warning"' in line or '"level": "error"' in line]
        print(
            f"replica {k} (alive: {server.alive()}): {len(lines)} log lines, {len(problems)} warnings/errors",
            file=sys.stderr,
        )
        for line in problems[:10] + lines[-tail:]:
            print(f"  {line}", file=sys.stderr)


def replica_logs(replicas: list[Any]) -> dict:
    """Calls served per replica, non-OK codes, and the warning/error lines (verbatim, the first 10)."""
    served, codes, problems = [], Counter(), []
    for server in replicas:
        events = server.events()
        calls = [e for e in events if e.get("event") == "rpc"]
        served.append(len(calls))
        codes.update(f"{e.get('method')} {e.get('code')}" for e in calls if e.get("code") != "OK")
        problems += [json.dumps(e) for e in events if e.get("level") in ("warning", "error", "critical")]
    return {
        "calls_per_replica": served,
        "non_ok_calls": dict(codes),
        "warning_or_error_lines": problems[:10],
        "warning_or_error_count": len(problems),
    }


def _percentile_ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    import numpy as np

    return float(np.percentile(np.asarray(values) * 1000.0, q))


def summarise_kind(outcomes: list[Outcome], kind: str, window: tuple[float, float], size: int) -> dict:
    """Throughput: operations that succeeded within ``window`` (monotonic start, end) over its length;
    latency and failures: every operation of the kind (those still running at the window's end too)."""
    mine = [o for o in outcomes if o.kind == kind]
    ok = [o for o in mine if o.ok]
    counted = sum(1 for o in ok if o.began + o.seconds <= window[1])
    length = window[1] - window[0]
    failed = [o for o in mine if not o.ok]
    return {
        "ok": len(ok),
        "ok_within_window": counted,
        "failed": len(failed),
        "first_error": failed[0].error if failed else "",
        "ops_per_s": counted / length,
        "mb_per_s": counted * size / 1e6 / length,
        "bytes_per_op": size,
        "p50_ms": _percentile_ms([o.seconds for o in ok], 50),
        "p99_ms": _percentile_ms([o.seconds for o in ok], 99),
    }


def measurement_window(plan: LoadPlan, outcomes: list[Outcome]) -> tuple[float, float]:
    """From the first operation's start to ``--seconds`` later (with ``--ops-per-client``: to the last end).
    Operations still running at the end finish, but their work is not counted in the throughput."""
    began = min((o.began for o in outcomes), default=0.0)
    last = max((o.began + o.seconds for o in outcomes), default=began + 1e-9)
    return began, (last if plan.ops_per_client > 0 else began + plan.seconds)


def summarise_round(
    count: int,
    plan: LoadPlan,
    outcomes: list[Outcome],
    counters: dict,
    setup: dict,
    cpu: dict,
    logs: dict,
    exit_codes: list[int | None],
) -> dict:
    window = measurement_window(plan, outcomes)
    drained = max((o.began + o.seconds for o in outcomes), default=window[1]) - window[1]
    kinds = {
        DOWNLOAD: summarise_kind(outcomes, DOWNLOAD, window, plan.artifact_size),
        UPLOAD: summarise_kind(outcomes, UPLOAD, window, plan.blob_bytes),
    }
    operations = len(outcomes)
    return {
        "replicas": count,
        "window_s": window[1] - window[0],
        "drain_after_window_s": drained,
        "operations": operations,
        **kinds,
        "failures": sum(k["failed"] for k in kinds.values()),
        "database_round_trips": counters["database_round_trips"],
        "object_store_requests": counters["object_store_requests"],
        "database_round_trips_per_op": counters["database_round_trips"] / operations if operations else None,
        "object_store_requests_per_op": counters["object_store_requests"] / operations if operations else None,
        "counters_per_replica": counters["per_replica"],
        "replicas_without_stopped_event": counters["missing_stopped_event"],
        "replica_exit_codes": exit_codes,
        "setup_counters": {k: setup[k] for k in ("database_round_trips", "object_store_requests")},
        "cpu": cpu,
        **logs,
    }


# -- report ---------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table(rounds: list[dict]) -> str:
    base = rounds[0]
    lines = [
        f"| replicas | downloads/s | ratio to {base['replicas']} replica{'s' if base['replicas'] > 1 else ''} | p99 ms "
        "| uploads/s | ratio | p99 ms | failures | DB round trips/op | S3 requests/op |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rounds:
        d, u = r[DOWNLOAD], r[UPLOAD]
        d_ratio = d["ops_per_s"] / base[DOWNLOAD]["ops_per_s"] if base[DOWNLOAD]["ops_per_s"] else None
        u_ratio = u["ops_per_s"] / base[UPLOAD]["ops_per_s"] if base[UPLOAD]["ops_per_s"] else None
        lines.append(
            f"| {r['replicas']} | {d['ops_per_s']:.1f} | {_fmt(d_ratio, '.2f')} | {_fmt(d['p99_ms'], '.0f')} "
            f"| {u['ops_per_s']:.1f} | {_fmt(u_ratio, '.2f')} | {_fmt(u['p99_ms'], '.0f')} | {r['failures']} "
            f"| {_fmt(r['database_round_trips_per_op'], '.2f')} | {_fmt(r['object_store_requests_per_op'], '.2f')} |"
        )
    return "\n".join(lines)


def details(rounds: list[dict]) -> str:
    lines = []
    for r in rounds:
        d, u, cpu = r[DOWNLOAD], r[UPLOAD], r["cpu"]
        lines.append(
            f"{r['replicas']} replica(s): {r['operations']} ops ({d['ok_within_window'] + u['ok_within_window']} done "
            f"within the {r['window_s']:.1f} s window, the rest in {r['drain_after_window_s']:.1f} s after it); downloads {d['ok']} ok "
            f"{d['mb_per_s']:.1f} MB/s p50 {_fmt(d['p50_ms'], '.0f')} ms; uploads {u['ok']} ok {u['mb_per_s']:.2f} MB/s "
            f"p50 {_fmt(u['p50_ms'], '.0f')} ms; calls per replica {r['calls_per_replica']}; CPU s: clients "
            f"{cpu['clients_s']:.1f}, replicas {cpu['replicas_s']:.1f}, PostgreSQL {cpu['postgres_s']:.1f}, "
            f"moto {cpu['moto_s']:.1f}; machine busy {cpu['machine_busy_fraction']:.0%}"
        )
        for kind in KINDS:
            if r[kind]["failed"]:
                lines.append(f"  {kind} failures: {r[kind]['failed']}, first: {r[kind]['first_error']}")
        if r["non_ok_calls"]:
            lines.append(f"  non-OK calls on the replicas: {r['non_ok_calls']}")
        for line in r["warning_or_error_lines"]:
            lines.append(f"  replica log: {line}")
        if r["replicas_without_stopped_event"] or any(c != 0 for c in r["replica_exit_codes"]):
            lines.append(
                f"  replica exit codes {r['replica_exit_codes']}; "
                f"{r['replicas_without_stopped_event']} without a 'stopped' event"
            )
    return "\n".join(lines)


def calibration_note(calibration: dict) -> str:
    parts = [
        f"{kind} {c['database_round_trips_per_op']:.1f} DB round trips, {c['object_store_requests_per_op']:.1f} "
        f"S3 requests, p50 {_fmt(c['p50_ms'], '.0f')} ms"
        for kind, c in ((k, calibration[k]) for k in KINDS)
    ]
    idle = calibration["idle_replica"]
    return (
        f"Each kind alone ({calibration['operations_each']} in a row, 1 replica, 1 client, counters less an idle "
        f"replica's): {'; '.join(parts)}. A replica that starts and stops: {idle['database_round_trips']} DB round "
        f"trips, {idle['object_store_requests']} S3 requests (included in the per-op figures of the table)."
    )


def machine_note(args: argparse.Namespace) -> str:
    cores = os.cpu_count() or 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    return (
        f"{platform.machine()}, {cores} CPU cores ({usable} usable by this process). The {args.clients} client "
        f"threads ({args.workers} Python processes), every replica, PostgreSQL and moto share these cores: the "
        f"client threads are themselves CPU-bound, and the gain from more replicas is capped by the cores: a "
        f"replica is one Python process using about one core, so beyond {usable} replicas no gain is to be "
        f"expected here (on a real cluster each replica has cores of its own)."
    )


def write_results(path: Path, args: argparse.Namespace, rounds: list[dict], extra: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "server_scale_out",
        "command": "python benchmarks/server_scale_out.py " + shlex.join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **extra,
        "baseline": f"the {rounds[0]['replicas']}-replica round of the same run",
        "rounds": rounds,
    }
    path.write_text(json.dumps(result, indent=2) + "\n")


# -- main -------------------------------------------------------------------------------------------


def _replica_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of replica counts >= 1, e.g. 1,2,3")
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--replicas",
        type=_replica_counts,
        default=[1, 2, 3],
        help="replica counts, one round each (default 1,2,3); the first is the baseline",
    )
    parser.add_argument("--clients", type=int, default=200, help="concurrent devices (threads), enrolled per round")
    parser.add_argument(
        "--workers",
        type=int,
        default=max(1, min(4, os.cpu_count() or 1)),
        help="client processes the threads are spread over",
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="load duration per round")
    parser.add_argument(
        "--ops-per-client",
        type=int,
        default=0,
        help="> 0: a fixed number of operations per client instead of --seconds",
    )
    parser.add_argument(
        "--upload-fraction",
        type=float,
        default=0.5,
        help="share of operations that are vault uploads (the rest: artifact downloads)",
    )
    parser.add_argument("--artifact-mib", type=float, default=1.5, help="size of the downloaded embed artifact")
    parser.add_argument(
        "--blob-kib", type=int, default=64, help="size of each uploaded vault blob (random, distinct per upload)"
    )
    parser.add_argument("--devices-per-owner", type=int, default=10, help="devices enrolled into each owner")
    parser.add_argument(
        "--quota-bytes",
        type=int,
        default=1 << 40,
        help="per-owner vault quota of the replicas (large: quotas must not bite)",
    )
    parser.add_argument(
        "--database-connections",
        type=int,
        default=20,
        help="PostgreSQL pool size of each replica (the server's default)",
    )
    parser.add_argument(
        "--calibration-ops",
        type=int,
        default=20,
        help="operations of each kind run alone (one replica, one client) to give per-kind counters; 0: skip",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("runs/bench/server_scale_out.json"), help="where to write the results (JSON)"
    )
    args = parser.parse_args(argv)
    if args.clients < 1 or args.devices_per_owner < 1 or not 0.0 <= args.upload_fraction <= 1.0:
        parser.error("--clients and --devices-per-owner must be >= 1, --upload-fraction within 0..1")
    return args


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the cleanup below


def run_rounds(args: argparse.Namespace) -> list[dict]:
    """Every round, between the services' start and their stop (also on Ctrl-C, SIGTERM or an error)."""
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="fctkit-scale-out-bench-") as tmp, ExitStack() as stack:
        services = start_services(Path(tmp), stack, args.artifact_mib)
        for count in args.replicas:
            print(f"round: {count} replica(s), {args.clients} clients ...", flush=True)
            rounds.append(run_round(count, services, args, with_calibration=not rounds and args.calibration_ops > 0))
            print(details(rounds[-1:]), flush=True)
    return rounds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    print(machine_note(args), flush=True)
    try:
        rounds = run_rounds(args)
    except KeyboardInterrupt:
        print("interrupted: replicas, moto and PostgreSQL stopped", file=sys.stderr)
        return 130
    mix = {
        "mix": f"{args.upload_fraction:.0%} vault uploads of {args.blob_kib} KiB, the rest downloads of "
        f"the {rounds[0][DOWNLOAD]['bytes_per_op'] / (1 << 20):.2f} MiB embed artifact"
    }
    print(
        f"\nMix: {mix['mix']}; {args.clients} clients over {args.workers} processes; "
        + (f"{args.ops_per_client} ops per client." if args.ops_per_client > 0 else f"{args.seconds:g} s per round.")
    )
    print(table(rounds))
    print(
        f"Operations/s: those done within the window (ops still running at its end finish and count in p99 and "
        f"failures only). Ratios: operations/s over the {rounds[0]['replicas']}-replica round of this run. DB round trips and S3 "
        "requests per op: the replicas' 'stopped' counters over every operation of the round (publish and "
        "enrolment ran on a separate setup replica, not counted)."
    )
    calibration = rounds[0].pop("calibration", None)
    if calibration:
        print(calibration_note(calibration))
    print(machine_note(args))
    write_results(args.out, args, rounds, {**mix, "calibration": calibration})
    print(f"wrote {args.out}")
    return 0 if all(r["failures"] == 0 for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
