"""Per-device calls read no whole table (issue 49), on both storage backends, pinned by query plans
rather than timings: every statement that real Enrol, Report, ListVersions, PlanUpgrade and
RevokeDevice calls run, and filtered ListDevices pages, (recorded in an in-process server, called over gRPC on loopback) is planned
on an index by SQLite's ``EXPLAIN QUERY PLAN`` and PostgreSQL's ``EXPLAIN`` (with sequential scans
off, so that a missing index shows even on small tables); a schema-12 database gets the devices'
owner index."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fctkit.protos import fleet_pb2
from fctkit.protos.client import FctkitClient
from fctkit.server.app import FctkitServer, ServerConfig
from fctkit.server.database import PostgresDatabase, SqliteDatabase, psycopg_sql
from fctkit.server.storage_schema import SCHEMA_VERSION
from tests.server.conftest import ADMIN_TOKEN, Backend, enrolled_client

#: Tables that grow with the fleet: no per-device statement may read one whole.
FLEET_TABLES = frozenset(
    {
        "devices",
        "enrolment_codes",
        "owner_keys",
        "report_counts",
        "device_health",
        "device_reverts",
        "blobs",
        "uploads",
        "replica_owners",
        "replica_blocks",
        "replica_items",
        "rollout_cohort",
    }
)
Statement = tuple[str, Any]


@pytest.fixture
def recorded(monkeypatch) -> list[Statement]:
    """Every statement the metadata database runs in this process from now on, with its parameters."""
    statements: list[Statement] = []
    for cls in (SqliteDatabase, PostgresDatabase):
        execute, executemany = cls.execute, cls.executemany
        monkeypatch.setattr(cls, "execute", _recording(execute, statements))
        monkeypatch.setattr(cls, "executemany", _recording(executemany, statements, many=True))
    return statements


def _recording(method: Callable, statements: list[Statement], *, many: bool = False) -> Callable:
    def recorded(self, sql: str, params: Any = ()) -> Any:
        statements.extend((sql, p) for p in (params if many else [params]))
        return method(self, sql, params)

    return recorded


async def _started(config: ServerConfig) -> FctkitServer:
    server = FctkitServer(config)
    await server.start()
    return server


@contextlib.contextmanager
def in_process_server(config: ServerConfig) -> Iterator[str]:
    """A server running on an event loop of its own thread; yields its loopback address."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(_started(config), loop).result(60)
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def server_config(backend: Backend, data_dir: Path, publisher_pub: Path, admin_token_file: Path) -> ServerConfig:
    storage: dict[str, Any] = {"data_dir": data_dir}
    if backend.name == "postgres":
        _, database, _, object_store = backend.server_args(data_dir)
        storage = {"database": database, "object_store": object_store, "s3_endpoint_url": backend.s3.url}
    return ServerConfig(publisher_key=publisher_pub, admin_token_file=admin_token_file, port=0, **storage)


class _Target:
    def __init__(self, target: str) -> None:
        self.target = target


def per_device_calls(target: str, archives: dict[int, Path], recorded: list[Statement]) -> list[Statement]:
    """The statements of an Enrol, two Reports, a ListVersions, a PlanUpgrade, a Report with a health
    the guard judges and two RevokeDevice (v1 and v2 published, v3 staged at 0% with a guard and a
    cohort; other devices of the same owner enrolled before)."""
    server = _Target(target)
    with FctkitClient(target, ADMIN_TOKEN) as admin:
        admin.publish_bundle(archives[1])
        admin.publish_bundle(archives[2])
        admin.publish_bundle(archives[3], rollout_percent=0.0)
    first, _ = enrolled_client(server, owner="own-shared", name="first")
    first.report(1, 0, fleet_pb2.UPGRADE_STATE_IDLE)
    canary, canary_enrolment = enrolled_client(server, owner="own-shared", name="canary")
    with FctkitClient(target, ADMIN_TOKEN) as admin:
        admin.set_rollout(3, cohort=[canary_enrolment.device_id], halt_below=0.5, halt_min_devices=1)
    recorded.clear()
    client, enrolment = enrolled_client(server, owner="own-shared", name="second")
    with client, first, canary:
        client.report(1, 10, fleet_pb2.UPGRADE_STATE_IDLE)
        client.report(1, 10, fleet_pb2.UPGRADE_STATE_UPGRADING, target_version=2, progress=0.5)
        client.list_versions()
        client.plan_upgrade(1, 2)
        health = fleet_pb2.UpgradeHealth(version=3, rows_upgraded=10, sample_size=4, mean_cosine=0.9, p10_cosine=0.8)
        canary.report(3, 10, fleet_pb2.UPGRADE_STATE_IDLE, health=health)
        with FctkitClient(target, ADMIN_TOKEN) as admin:
            admin.revoke_device(enrolment.device_id)
            admin.revoke_device(canary_enrolment.device_id)
    return [(sql, params) for sql, params in recorded if _plannable(sql)]


def _plannable(sql: str) -> bool:
    """A query or change of rows (not a statement on the temporary table of one compaction)."""
    return sql.lstrip().split(None, 1)[0].upper() in {"SELECT", "INSERT", "UPDATE", "DELETE"} and (
        "compacting" not in sql
    )


def _aliases(sql: str) -> dict[str, str]:
    """Each name a table goes by in ``sql`` (itself and its aliases) -> the table."""
    found = re.findall(r"\b(?:FROM|JOIN|UPDATE|INTO)\s+(\w+)(?:\s+(?:AS\s+)?(\w+))?", sql, re.IGNORECASE)
    names = {table: table for table, _ in found}
    names |= {alias: table for table, alias in found if alias and alias.upper() not in _KEYWORDS}
    return names


_KEYWORDS = {"WHERE", "SET", "VALUES", "ON", "JOIN", "USING", "ORDER", "GROUP", "LIMIT", "LEFT", "INNER", "AS"}


def sqlite_scans(data_dir: Path, statements: list[Statement]) -> dict[str, list[str]]:
    """Statement -> the fleet tables its SQLite plan reads whole (:func:`_scanned`)."""
    scans: dict[str, list[str]] = {}
    with contextlib.closing(sqlite3.connect(data_dir / "meta.sqlite3")) as db:
        for sql, params in statements:
            names = _aliases(sql)
            plan = [row[3] for row in db.execute("EXPLAIN QUERY PLAN " + sql, params)]
            tables = [names.get(m, m) for line in plan if (m := _scanned(line))]
            scans[sql] = [t for t in tables if t in FLEET_TABLES]
    return scans


def _scanned(line: str) -> str | None:
    """The table a plan line reads whole: ``SCAN t`` (with or without an index), ``SEARCH t``
    without an index (what SQLite shows for a scan that may stop early) or with an automatic one."""
    match = re.match(r"(SCAN|SEARCH) (\w+)(.*)", line)
    if match is None or line == "SCAN CONSTANT ROW":
        return None
    kind, table, how = match.groups()
    return table if kind == "SCAN" or " USING " not in how or "AUTOMATIC" in how else None


def postgres_scans(dsn: str, statements: list[Statement]) -> dict[str, list[str]]:
    """Statement -> the fleet tables its PostgreSQL plan reads whole (a sequential scan, or an
    index scan without an index condition), planned with sequential scans off."""
    import psycopg

    scans: dict[str, list[str]] = {}
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute("SET enable_seqscan = off")
        for sql, params in statements:
            plan = connection.execute("EXPLAIN (FORMAT JSON) " + psycopg_sql(sql), params or None).fetchone()[0]
            plan = json.loads(plan) if isinstance(plan, str) else plan
            scans[sql] = [t for t in _whole_reads(plan[0]["Plan"]) if t in FLEET_TABLES]
    return scans


def _whole_reads(node: dict) -> list[str]:
    kind, table = node.get("Node Type", ""), node.get("Relation Name")
    whole = table and (kind == "Seq Scan" or (kind in ("Index Scan", "Index Only Scan") and "Index Cond" not in node))
    return ([table] if whole else []) + [t for child in node.get("Plans", ()) for t in _whole_reads(child)]


def test_per_device_calls_read_no_whole_table(
    tmp_path, backend, archives, publisher_pub, admin_token_file, recorded
) -> None:
    data_dir = tmp_path / "data"
    config = server_config(backend, data_dir, publisher_pub, admin_token_file)
    with in_process_server(config) as target:
        statements = per_device_calls(target, archives, recorded)
    assert any("devices" in sql and "MIN(version)" in sql for sql, _ in statements)  # the owner's common version
    assert any("guard_votes" in sql for sql, _ in statements)  # the health report moved the guard's tally
    assert len(statements) > 20
    if backend.name == "sqlite":
        scans = sqlite_scans(data_dir, statements)
        # an index on the version alone walks every device that reported it: per-device calls never use it
        by_version = {
            sql for sql, plan in sqlite_plans(data_dir, statements).items() if "_by_version (version=?)" in plan
        }
        assert by_version == set()
    else:
        scans = postgres_scans(str(config.database), statements)
    assert {sql: tables for sql, tables in scans.items() if tables} == {}


def filtered_listings(target: str, recorded: list[Statement]) -> list[Statement]:
    """The statements of ListDevices pages filtered by version, state, staleness and owner (two devices enrolled)."""
    server = _Target(target)
    for name in ("first", "second"):
        enrolled_client(server, owner="own-shared", name=name)[0].close()
    recorded.clear()
    with FctkitClient(target, ADMIN_TOKEN) as admin:
        for filters in LISTING_FILTERS:
            list(admin.device_pages(page_size=1, **filters))
    return [(sql, params) for sql, params in recorded if _plannable(sql)]


LISTING_FILTERS: tuple[dict[str, Any], ...] = (
    {"version": 0},
    {"upgrade_state": fleet_pb2.UPGRADE_STATE_IDLE},
    {"stale_seconds": 60},
    {"owner_id": "own-shared"},
)


def test_filtered_device_listings_page_on_an_index(
    tmp_path, backend, publisher_pub, admin_token_file, recorded
) -> None:
    data_dir = tmp_path / "data"
    config = server_config(backend, data_dir, publisher_pub, admin_token_file)
    with in_process_server(config) as target:
        statements = filtered_listings(target, recorded)
    for condition in ("d.version=?", "d.upgrade_state=?", "COALESCE(d.last_report_at", "d.owner_id=?"):
        assert any(f"WHERE d.seq>? AND {condition}" in sql for sql, _ in statements), condition
    if backend.name == "sqlite":
        scans = sqlite_scans(data_dir, statements)
        plans = sqlite_plans(data_dir, statements)
        assert any("devices_by_version" in plan for sql, plan in plans.items() if "d.version=?" in sql)
        assert any("devices_by_state" in plan for sql, plan in plans.items() if "d.upgrade_state=?" in sql)
    else:
        scans = postgres_scans(str(config.database), statements)
    assert {sql: tables for sql, tables in scans.items() if tables} == {}


def sqlite_plans(data_dir: Path, statements: list[Statement]) -> dict[str, str]:
    """Statement -> its SQLite query plan, one line per step."""
    with contextlib.closing(sqlite3.connect(data_dir / "meta.sqlite3")) as db:
        return {
            sql: "\n".join(row[3] for row in db.execute("EXPLAIN QUERY PLAN " + sql, params))
            for sql, params in statements
        }


def test_a_schema_12_database_gets_the_devices_owner_index(tmp_path, open_storage, backend) -> None:
    data_dir = tmp_path / "data"
    storage = backend.aged(data_dir, open_storage, 12, "DROP INDEX devices_by_owner", versions=(1,))
    storage.close()
    if backend.name == "sqlite":
        found = backend.query(data_dir, "SELECT name FROM sqlite_master WHERE name = 'devices_by_owner'")
        assert backend.query(data_dir, "PRAGMA user_version") == [(SCHEMA_VERSION,)]
    else:
        found = backend.query(data_dir, "SELECT indexname FROM pg_indexes WHERE indexname = 'devices_by_owner'")
        assert backend.query(data_dir, "SELECT MAX(version) FROM fctkit_schema") == [(SCHEMA_VERSION,)]
    assert found == [("devices_by_owner",)]
