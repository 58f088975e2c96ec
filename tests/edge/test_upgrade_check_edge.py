"""The health check after an upgrade (issue 36, section 2) on real devices against a real server
on loopback, with the tiny signed bundles: after a sync's upgrade every Fleet.Report carries the
health, the sampled rows are kept as backfilled (φ_new), the numbers are those of
``upgrade_health`` computed by hand on the same rows of the adapted gallery; a device without
originals in the vault reports sample_size 0 with the reason (the CLI, torch blocked), health_sample
0 or --no-health-check turns it off, a device offline at upgrade time sends its record at the next
sync, and a failing check leaves the upgrade standing."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from fctkit.edge_runtime import Device, upgrade_check
from fctkit.edge_runtime.upgrade_check import HealthRecord, health_seed, stored_health
from fctkit.errors import InputError
from fctkit.protos.client import FctkitClient
from fctkit.upgrade_health import sample_rows, streamed_health, upgrade_health
from tests.edge.conftest import ServerProcess, device_cli_steps, enrolment_code, publish

ROWS, SAMPLE = 40, 8


@pytest.fixture
def server(tmp_path, publisher_pub, admin_token_file, tiny_bundles):
    process = ServerProcess(tmp_path / "server-data", publisher_pub, admin_token_file).start()
    publish(process, tiny_bundles[1], tmp_path)
    yield process
    process.stop()


@pytest.fixture
def reports(monkeypatch) -> list:
    """The health of every Fleet.Report sent (the call goes on to the real server)."""
    sent: list = []
    report = FctkitClient.report

    def spy(self, *args, **kwargs):
        sent.append(kwargs.get("health"))
        return report(self, *args, **kwargs)

    monkeypatch.setattr(FctkitClient, "report", spy)
    return sent


def _enrolled(make_device, server, name: str, images, **settings) -> Device:
    device = make_device(name, batch_size=16, **settings)
    device.enrol(server.target, enrolment_code(server), device_name=name)
    device.sync()
    device.add(images(ROWS, seed=len(name)), item_ids=[f"{name}-{i}" for i in range(ROWS)])
    assert device.gallery.replica_log.outbox_size() == 0  # every original is in the vault
    return device


def _vectors_by_row(device: Device) -> tuple[np.ndarray, list[str], np.ndarray, list]:
    rows = device.gallery.load(with_labels=False)
    order = np.argsort(rows.row_ids)
    return (
        rows.row_ids[order],
        [rows.item_ids[i] for i in order],
        np.stack(rows.embeddings[order]),
        [rows.tags[i] for i in order],
    )


def test_a_sync_upgrade_reports_the_sampled_fidelity_and_keeps_the_sample_backfilled(
    server, tiny_bundles, make_device, images, reports, tmp_path, monkeypatch
):
    monkeypatch.setattr(upgrade_check, "BLOCK_ROWS", 7)  # the adapted gallery is read in 6 pages
    device = _enrolled(make_device, server, "health", images, health_sample=SAMPLE)
    device.close()  # a copy of the device as it is at v1, to upgrade without the check: the adapted gallery by hand
    shutil.copytree(device.root, tmp_path / "copy")
    device = Device.open(device.root)
    device.progress = False
    publish(server, tiny_bundles[2], tmp_path)
    reports.clear()

    assert device.sync().installed_after == 2
    record = stored_health(device.gallery)
    assert (record.version, record.rows_upgraded, record.failures, record.sample_size, record.reason) == (
        2,
        ROWS,
        0,
        SAMPLE,
        "",
    )
    assert record.seconds > 0
    assert device.status()["rows_by_space"] == {"v1->v2 (forward)": ROWS - SAMPLE, "v2": SAMPLE}
    # the reports during the upgrade came before the check; the last one, after it, carries the record
    assert reports[-1] == record.message() and reports[0] is None
    assert device.status()["upgrade_health"] == dataclasses.asdict(record)

    row_ids, item_ids, vectors, tags = _vectors_by_row(device)
    seed = health_seed(device.settings.device_id, device.gallery.gallery_id, 2)
    sampled = sample_rows(item_ids, SAMPLE, seed)  # every row is adapted and in the vault: drawn among all
    assert [str(tags[i]) for i in sampled] == ["v2"] * SAMPLE

    copy = Device.open(tmp_path / "copy")
    copy.progress = False
    copy.settings = dataclasses.replace(copy.settings, health_sample=0)
    copy.sync(replicate=False)
    assert copy.status()["rows_by_space"] == {"v1->v2 (forward)": ROWS}
    off = stored_health(copy.gallery)
    assert (off.version, off.rows_upgraded, off.sample_size) == (2, ROWS, 0) and "turned off" in off.reason
    copy_ids, _, adapted, _ = _vectors_by_row(copy)
    copy.close()
    np.testing.assert_array_equal(copy_ids, row_ids)
    by_hand = upgrade_health(adapted, sampled, vectors[sampled], "cosine")
    assert by_hand.sample_size == SAMPLE
    for name in ("mean_cosine", "p10_cosine", "recall_at_1", "mean_reciprocal_rank"):
        assert getattr(record, name) == pytest.approx(getattr(by_hand, name), abs=1e-9), name
    assert not np.allclose(by_hand.mean_cosine, 1.0)  # the tiny adapter is not the new model: a real measurement

    reports.clear()
    device.sync()  # no new version: every later report still carries the last upgrade's health
    assert reports and all(h == record.message() for h in reports)


def test_a_failing_check_leaves_the_upgrade_standing(server, tiny_bundles, make_device, images, monkeypatch, tmp_path):
    device = _enrolled(make_device, server, "failing", images)

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(upgrade_check, "streamed_health", broken)
    publish(server, tiny_bundles[2], tmp_path)
    assert device.sync().installed_after == 2
    record = stored_health(device.gallery)
    assert (record.version, record.rows_upgraded, record.sample_size) == (2, ROWS, 0)
    assert "health check failed" in record.reason and "injected failure" in record.reason
    assert device.status()["rows_by_space"] == {"v1->v2 (forward)": ROWS}  # nothing half-written
    assert len(device.query(images(1, seed=99), k=3)[0]) == 3  # queries answer in the new space


def test_a_device_offline_at_upgrade_time_sends_its_record_at_the_next_sync(
    server, tiny_bundles, make_device, images, reports, tmp_path
):
    device = _enrolled(make_device, server, "offline", images)
    device.use_servers("127.0.0.1:9")  # nothing listens there
    assert device.upgrade(tiny_bundles[2]) == ROWS
    record = stored_health(device.gallery)
    assert (record.version, record.sample_size) == (2, 0) and "could not be downloaded from the vault" in record.reason
    publish(server, tiny_bundles[2], tmp_path)  # the server reports only versions it published (and offered)
    device.use_servers(server.target)
    reports.clear()
    device.sync()
    assert reports[-1] == record.message()
    assert reports[-1].version == 2 and reports[-1].rows_upgraded == ROWS and reports[-1].sample_size == 0


@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_the_streamed_measure_over_row_id_pages_equals_the_measure_over_the_array(metric):
    rng = np.random.default_rng(5)
    adapted = rng.standard_normal((50, 6)).astype(np.float32)
    adapted[31] = adapted[12]  # a tie: the earlier row wins, by row id as by position
    row_ids = np.sort(rng.choice(np.arange(1, 500), size=50, replace=False))  # gaps, as removed rows leave
    sample = np.array([3, 12, 31, 40, 49])
    reembedded = (adapted[sample] + 0.7 * rng.standard_normal((5, 6))).astype(np.float32)
    pages = [(row_ids[i : i + 8], adapted[i : i + 8]) for i in range(0, 50, 8)]
    streamed = streamed_health(iter(pages), row_ids[sample], adapted[sample], reembedded, metric)
    assert streamed == upgrade_health(adapted, sample, reembedded, metric)
    with pytest.raises(InputError, match="5 sampled keys do not match 4"):
        streamed_health(iter(pages), row_ids[sample], adapted[sample[:4]], reembedded, metric)
    with pytest.raises(InputError, match="does not match the sampled rows' dimension 6"):
        streamed_health(iter([(row_ids[:8], adapted[:8, :5])]), row_ids[sample], adapted[sample], reembedded, metric)


def test_a_health_record_the_server_refuses_is_left_out_and_the_sync_goes_on(
    server, tiny_bundles, make_device, images, reports, tmp_path
):
    device = _enrolled(make_device, server, "refused", images)
    publish(server, tiny_bundles[2], tmp_path)
    device.sync()
    bad = dataclasses.replace(stored_health(device.gallery), mean_cosine=2.0)  # outside [-1, 1]: INVALID_ARGUMENT
    device.gallery.set_meta({upgrade_check.HEALTH_KEY: json.dumps(dataclasses.asdict(bad))})
    reports.clear()
    assert device.sync().installed_after == 2
    assert reports == [bad.message(), None]  # refused with the record, accepted without it


def test_health_messages_hold_aggregates_only():
    record = HealthRecord(3, 10, 1, 2.5, 4, 0.9, 0.8, 0.75, 0.8, reason="")
    message = record.message()
    assert [f.name for f in message.DESCRIPTOR.fields] == [
        "version",
        "rows_upgraded",
        "failures",
        "seconds",
        "sample_size",
        "mean_cosine",
        "p10_cosine",
        "recall_at_1",
        "mean_reciprocal_rank",
        "median_rank",
        "gallery_rows",
    ]
    assert (message.version, message.failures, message.sample_size, message.recall_at_1) == (3, 1, 4, 0.75)


def test_without_vault_originals_the_cli_reports_sample_size_zero_and_why(
    tiny_bundles, publisher_pub, tmp_path, images
):
    root = tmp_path / "local"
    np.savez(
        tmp_path / "add.npz",
        images=images(6, seed=3),
        labels=np.array(list("abcdef")),
        ids=np.array([f"l{i}" for i in range(6)]),
    )
    outputs = device_cli_steps(
        [
            ("init", "--dir", str(root), "--publisher-key", str(publisher_pub), "--batch-size", "4"),
            ("upgrade", "--dir", str(root), "--bundle", str(tiny_bundles[1]), "--quiet"),
            ("add", "--dir", str(root), str(tmp_path / "add.npz")),
            ("upgrade", "--dir", str(root), "--bundle", str(tiny_bundles[2]), "--quiet"),
            ("status", "--dir", str(root)),
            ("upgrade", "--dir", str(root), "--bundle", str(tiny_bundles[3]), "--quiet", "--no-health-check"),
        ]
    )
    upgraded, status, unchecked = (json.loads(outputs[i]) for i in (3, 4, 5))
    assert upgraded["rows_upgraded"] == 6 and upgraded["installed_version"] == 2
    health = upgraded["upgrade_health"]
    assert (health["version"], health["rows_upgraded"], health["failures"], health["sample_size"]) == (2, 6, 0, 0)
    assert "none of the adapted rows has its original in the vault" in health["reason"]
    assert status["upgrade_health"] == health
    assert unchecked["upgrade_health"]["version"] == 3 and "turned off" in unchecked["upgrade_health"]["reason"]


def test_the_sample_is_kept_backfilled_only_where_native_and_adapted_rows_rank_fairly_together(tiny_bundles):
    from types import SimpleNamespace

    from fctkit.protos.manifest import Manifest
    from fctkit.protos.search_policy import HubnessPolicy, TransitionPolicy

    manifest = Manifest.from_bytes((tiny_bundles[2] / "manifest.json").read_bytes())
    assert upgrade_check.keeps_sample(manifest)  # the tiny bundles: class level (top-1 only), no transition
    instance = {"cases": {"new/new": {"recall@1": 0.4, "top1": 0.4}, "old/old": {"recall@1": 0.5, "top1": 0.5}}}

    def bundle(gate=manifest.gate, hubness=None, transition=None, level=None):  # the fields the rule reads
        expectation = None if level is None else SimpleNamespace(level=level)
        return SimpleNamespace(gate=gate, hubness=hubness, transition=transition, health_expectation=expectation)

    assert not upgrade_check.keeps_sample(bundle(instance))
    # the level the manifest records wins over the gate's metrics
    assert not upgrade_check.keeps_sample(bundle(level="instance"))
    assert upgrade_check.keeps_sample(bundle(instance, level="class"))
    assert upgrade_check.keeps_sample(bundle(instance, hubness=HubnessPolicy(0.5)))
    assert not upgrade_check.keeps_sample(bundle(transition=TransitionPolicy(1, 0.5, 30.0)))


def test_an_instance_level_upgrade_is_measured_but_its_rows_stay_adapted(
    server, tiny_bundles, make_device, images, monkeypatch, tmp_path
):
    monkeypatch.setattr(
        upgrade_check, "keeps_sample", lambda manifest: False
    )  # as for an InfoNCE bundle without hubness
    device = _enrolled(make_device, server, "instance", images, health_sample=SAMPLE)
    publish(server, tiny_bundles[2], tmp_path)
    assert device.sync().installed_after == 2
    record = stored_health(device.gallery)
    assert (record.version, record.sample_size, record.reason) == (2, SAMPLE, "")
    assert device.status()["rows_by_space"] == {"v1->v2 (forward)": ROWS}
