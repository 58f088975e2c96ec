"""The server's pure parts: upgrade planning, storage, the content store, retry backoff."""

from __future__ import annotations

import hashlib
import sqlite3
from dataclasses import replace

import pytest

from fctkit.errors import ConfigError, InputError
from fctkit.protos.bundle import MANIFEST_FILE, Manifest
from fctkit.protos.client import RetryPolicy
from fctkit.protos.planner import plan_upgrade
from fctkit.server.content_store import ContentStore
from fctkit.server.storage import BlobRecord, DeviceReport, SqliteStorage, VersionRecord


@pytest.fixture(scope="module")
def template(bundles) -> Manifest:
    """A real v2 manifest (embed, side_info, forward and side_forward 1->2, backward 2->1)."""
    return Manifest.from_bytes((bundles[2] / MANIFEST_FILE).read_bytes())


def _manifest(
    template: Manifest, version: int, hops: dict[tuple[int, int], int], *, mode: str = "forward", parents=()
) -> Manifest:
    forward, side = template.artifact("forward"), template.artifact("side_forward")
    artifacts = [template.artifact("embed"), template.artifact("side_info")]
    for (source, target), size in hops.items():
        artifacts.append(
            replace(
                forward,
                name=f"forward_{source}_to_{target}",
                file=f"h{source}.onnx",
                source_version=source,
                target_version=target,
                size=size,
            )
        )
        artifacts.append(
            replace(
                side,
                name=f"side_forward_{source}_to_{target}",
                file=f"g{source}.onnx",
                source_version=source,
                target_version=target,
            )
        )
    ecc = {f"forward_{s}_to_{t}": True for s, t in hops} | ({"embed": True} if mode == "compatible" and parents else {})
    gate = {"cases": {}, "ecc": ecc, "forced": False, "force_reason": None}
    return replace(template, version=version, parents=tuple(parents), mode=mode, artifacts=tuple(artifacts), gate=gate)


def _route(hops) -> list[tuple[int, int]]:
    return [(h.source_version, h.target_version) for h in hops]


def test_plans_prefer_fewer_hops_then_fewer_bytes(template):
    m1 = _manifest(template, 1, {})
    m2 = _manifest(template, 2, {(1, 2): 100}, parents=(1,))
    m3 = _manifest(template, 3, {(2, 3): 100}, parents=(2,))
    assert _route(plan_upgrade([m1, m2, m3], 1, 3)) == [(1, 2), (2, 3)]
    m4 = _manifest(template, 4, {(3, 4): 10, (1, 4): 10**9}, parents=(3,))
    direct = plan_upgrade([m1, m2, m3, m4], 1, 4)
    assert (
        _route(direct) == [(1, 4)] and direct[0].side_forward.name == "side_forward_1_to_4"
    )  # fewer hops win over bytes
    assert plan_upgrade([m1, m2, m3, m4], 2, 2) == []
    assert plan_upgrade([m1, m2, m3, m4], 4, 1) is None
    assert plan_upgrade([m1, m3], 1, 3) is None  # the 1->2 adapter was never published

    def diamond(size_via_2: int, size_via_3: int):
        bundles = [
            _manifest(template, 2, {(1, 2): 100}, parents=(1,)),
            _manifest(template, 3, {(1, 3): 100}, parents=(1,)),
            _manifest(template, 4, {(2, 4): size_via_2, (3, 4): size_via_3}, parents=(2, 3)),
        ]
        return _route(plan_upgrade(bundles, 1, 4))

    assert diamond(50, 70) == [(1, 2), (2, 4)]
    assert diamond(70, 50) == [(1, 3), (3, 4)]
    assert diamond(60, 60) == [(1, 2), (2, 4)]  # a tie goes through the lower version


def test_compatible_bundles_plan_identity_hops(template):
    m2 = _manifest(template, 2, {}, parents=(1,), mode="compatible")
    m3 = _manifest(template, 3, {(2, 3): 100}, parents=(2,))
    hops = plan_upgrade([_manifest(template, 1, {}), m2, m3], 1, 3)
    assert _route(hops) == [(1, 2), (2, 3)]
    assert hops[0].identity and hops[0].forward is None and not hops[1].identity


def _storage(tmp_path) -> SqliteStorage:
    return SqliteStorage(tmp_path / "data")


def test_enrolment_codes_expire_and_work_once(tmp_path, open_storage):
    storage = open_storage(tmp_path / "data")
    storage.add_enrolment_code("h-old", "", "2026-01-01T00:00:00.000000Z", "2026-01-02T00:00:00.000000Z")
    storage.add_enrolment_code("h-new", "rack 4", "2026-01-01T00:00:00.000000Z", "2026-03-01T00:00:00.000000Z")
    now = "2026-02-01T00:00:00.000000Z"
    assert storage.enrol("h-old", now, "dev-1", "a", "t1") is None  # expired
    record = storage.enrol("h-new", now, "dev-2", "b", "t2")
    assert (record.device_id, record.label, record.enrolled_at) == ("dev-2", "rack 4", now)
    assert storage.enrol("h-new", now, "dev-3", "c", "t3") is None  # used
    assert storage.device_for_token("t2") == "dev-2" and storage.device_for_token("t3") is None
    storage.record_report("dev-2", DeviceReport(3, 10, 1, 0, 1.0, "ok"), now)
    assert storage.list_devices(0, 10)[0].report == DeviceReport(3, 10, 1, 0, 1.0, "ok")
    assert storage.counts() == {"versions": 0, "devices": 1, "blobs": 0, "enrolment_codes": 2}


def _object(tmp_path, data: bytes):
    path = tmp_path / hashlib.sha256(data).hexdigest()[:8]
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


def test_shared_blob_files_stay_until_the_last_holder_deletes(tmp_path, open_storage):
    storage = open_storage(tmp_path / "data")
    for n in (1, 2):
        storage.add_enrolment_code(f"c{n}", "", "2026-01-01T00:00:00.000000Z", "2099-01-01T00:00:00.000000Z")
        storage.enrol(f"c{n}", "2026-01-01T00:00:00.000000Z", f"dev-{n}", "x", f"t{n}")
    for n in (1, 2):
        path, sha256 = _object(tmp_path, b"same ciphertext")
        storage.add_blob(BlobRecord(f"dev-{n}", sha256, 15, "", "now"), path)
    assert storage.blob_held_by_other_device("dev-1", sha256)
    assert storage.delete_blob("dev-1", sha256) and storage.blobs.has(sha256)
    assert not storage.delete_blob("dev-1", sha256)
    assert storage.delete_blob("dev-2", sha256) and not storage.blobs.has(sha256)
    assert storage.vault_usage("dev-2") == (0, 0)


def test_versions_need_their_artifacts_and_garbage_is_collected(tmp_path):
    storage = _storage(tmp_path)
    kept, kept_sha = _object(tmp_path, b"artifact bytes")
    with pytest.raises(FileNotFoundError):
        storage.add_version(VersionRecord(1, b"{}", b"sig", "now"), [kept_sha])
    storage.artifacts.put(kept, kept_sha)
    storage.add_version(VersionRecord(1, b"{}", b"sig", "now"), [kept_sha])
    orphan, orphan_sha = _object(tmp_path, b"left over")
    storage.artifacts.put(orphan, orphan_sha)
    (storage.tmp_dir / "publish-x").mkdir()
    (storage.tmp_dir / "uploads").mkdir()
    assert storage.collect_garbage() == {"artifacts": 1, "blobs": 0, "staging": 1}
    assert list(storage.artifacts) == [kept_sha] and (storage.tmp_dir / "uploads").exists()
    assert storage.versions() == [VersionRecord(1, b"{}", b"sig", "now")]


def test_one_server_per_data_directory_and_unusable_databases_are_refused(tmp_path):
    storage = _storage(tmp_path)
    with pytest.raises(ConfigError, match="in use by another fctkit server"):
        _storage(tmp_path)
    storage.close()
    with sqlite3.connect(tmp_path / "data" / "meta.sqlite3") as db:
        db.execute("PRAGMA user_version=99")
    with pytest.raises(ConfigError, match="schema 99"):
        _storage(tmp_path)
    with sqlite3.connect(tmp_path / "data" / "meta.sqlite3") as db:
        db.execute("PRAGMA user_version=1")
    _storage(tmp_path).close()  # the refusal released the lock
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "meta.sqlite3").write_bytes(b"this is not a database" * 100)
    with pytest.raises(ConfigError, match="not a usable"):
        SqliteStorage(broken)


def test_content_store_names_objects_by_digest(tmp_path):
    store = ContentStore(tmp_path / "store")
    path, sha256 = _object(tmp_path, b"payload")
    stored = store.put(path, sha256)
    assert stored.read_bytes() == b"payload" and not path.exists() and list(store) == [sha256]
    again, _ = _object(tmp_path, b"payload")
    store.put(again, sha256)  # already stored: the new copy is dropped
    assert not again.exists() and store.size(sha256) == 7
    with pytest.raises(ValueError):
        store.path("../../etc/passwd")
    store.delete(sha256)
    assert not store.has(sha256)


def test_retry_backoff_is_seeded_growing_and_capped():
    policy = RetryPolicy(attempts=6, initial_backoff_s=0.1, max_backoff_s=1.0, multiplier=3.0, jitter=0.5, seed=7)
    delays = list(policy.delays())
    assert delays == list(policy.delays()) and len(delays) == 5
    bases = [0.1, 0.3, 0.9, 1.0, 1.0]
    assert all(base <= d <= base * 1.5 for base, d in zip(bases, delays))
    assert list(RetryPolicy(attempts=1).delays()) == []
    with pytest.raises(InputError):
        RetryPolicy(attempts=0)
