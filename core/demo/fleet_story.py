"""The demo's fleet: publish v1, enrol the devices (each adds its share of the evaluation
images), publish v2, upgrade every gallery in place, replicate, backfill one device from the
vault; every device's vectors are measured at each step and scored into the report's figures."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .loopback_server import DemoServer
from .options import DemoOptions
from .phases import Phases
from .results import CASES

if TYPE_CHECKING:
    from fctkit.edge_runtime import BackfillResult, Device
    from fctkit.export.trained_run import TrainedRun

#: (queries, gallery rows) of one device's items, aligned item by item.
_Pair = tuple[np.ndarray, np.ndarray]


@dataclass
class _Member:
    name: str
    device: Device
    rows: np.ndarray  # indices into the evaluation split
    ids: list[str]


def fleet_story(
    options: DemoOptions,
    out: Path,
    server: DemoServer,
    archives: list[Path],
    phases: Phases,
    log: Callable[[str], None],
    root_fingerprint: str,
) -> dict[str, Any]:
    """Phases 4 to 6 of the demo on the trained run in ``out / "run"``; devices enrol by the
    root's fingerprint; returns the report."""
    from fctkit.edge_runtime import Device, DeviceSettings
    from fctkit.export.trained_run import TrainedRun

    trained = TrainedRun.open(out / "run")
    images, labels = trained.eval_images, trained.eval_features["labels"]
    shares = np.array_split(np.random.default_rng(options.seed).permutation(len(labels)), options.devices)
    fleet: list[_Member] = []
    measures: dict[str, dict[str, Any]] = {}
    with phases("publish v1"), server.admin() as admin:
        admin.publish_bundle(archives[0])
    with phases(f"enrol {options.devices} devices; each installs v1 and adds its share (sealed uploads)"):
        for i, rows in enumerate(shares):
            phases.step()
            name = f"device-{i + 1}"
            # no per-upgrade health check: it would backfill its sample, and the demo scores h(old) on every row
            device = Device.init(out / "devices" / name, settings=DeviceSettings(batch_size=256, health_sample=0))
            device.progress = options.progress
            with server.admin() as admin:
                code = admin.create_enrolment_code(label=name).code
            device.enrol(server.target, code, device_name=name, root_fingerprint=root_fingerprint)
            device.sync()
            ids = [f"{name}-{int(r)}" for r in rows]
            device.add(images[rows], item_ids=ids, labels=[str(int(x)) for x in labels[rows]])
            fleet.append(_Member(name, device, rows, ids))
            measures[name] = {
                "rows": len(rows),
                "bundle_bytes": {"v1": _dir_bytes(device.root / "bundles" / "v1")},
                "vault_upload_bytes": _vault_bytes(device),
                "cases": {},
            }
            log(
                f"    {name}: {len(rows)} rows at v1, {measures[name]['vault_upload_bytes']:,} sealed bytes in the vault"
            )
    distance = trained.distance
    for member in fleet:
        measures[member.name]["cases"]["old/old"] = _vectors(member, images, lambda d, x: d.query_vectors(x))
    with phases("publish v2"), server.admin() as admin:
        admin.publish_bundle(archives[1])
    upgrade_rows = 0
    with phases("devices sync v2 and upgrade their galleries in place (adapter h on device)"):
        for member in fleet:
            phases.step()
            result = member.device.sync(upgrade=False)  # download + verify; the upgrade is timed on its own
            measures[member.name]["cases"]["new/old"] = _vectors(member, images, lambda d, x: d.engine(2).embed(x))
            started = time.perf_counter()
            upgraded = member.device.sync(replicate=False).rows_upgraded  # the upgrade alone; replication next
            measures[member.name]["upgrade_s"] = time.perf_counter() - started
            measures[member.name]["bundle_bytes"]["v2"] = _dir_bytes(member.device.root / "bundles" / "v2")
            measures[member.name]["rows_by_space_after_upgrade"] = member.device.status()["rows_by_space"]
            upgrade_rows += upgraded
            log(f"    {member.name}: {result.hops} planned, {upgraded} rows upgraded, now v{member.device.version}")
    with phases("devices push their upgraded rows to their owner's sealed replica"):
        for member in fleet:
            phases.step()
            member.device.sync()
    for member in fleet:
        measures[member.name]["cases"]["new/h(old)"] = _vectors(member, images, lambda d, x: d.query_vectors(x))
        measures[member.name]["cases"]["new/new"] = _native_new(member, images)
    backfiller = fleet[0]
    budget = max(1, round(options.backfill_fraction * len(backfiller.rows)))
    with phases(
        f"{backfiller.name} backfills {budget} rows ({options.backfill_fraction:.0%}, {options.backfill_order}) from the vault"
    ):
        started = time.perf_counter()
        backfill = backfiller.device.backfill(budget, order=options.backfill_order)
        backfill_s = time.perf_counter() - started
    for member in fleet:
        measures[member.name]["cases"]["after backfill"] = _vectors(member, images, lambda d, x: d.query_vectors(x))
    report = _assemble(options, trained, fleet, measures, labels, distance, backfill, backfill_s, upgrade_rows, images)
    for member in fleet:
        member.device.close()
    return report


def _vectors(member: _Member, images: np.ndarray, query: Callable[[Device, np.ndarray], np.ndarray]) -> _Pair:
    """(queries, gallery rows) of a device's own items, aligned item by item."""
    device = member.device
    loaded = device.gallery.load(with_labels=False)
    position = {item: i for i, item in enumerate(loaded.item_ids)}
    from fctkit.edge_runtime.gallery.rows import take_rows

    gallery = take_rows(loaded.embeddings, [position[i] for i in member.ids])
    return query(device, images[member.rows]), gallery


def _native_new(member: _Member, images: np.ndarray) -> _Pair:
    vectors = member.device.engine(2).embed(images[member.rows])
    return vectors, vectors


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _vault_bytes(device: Device) -> int:
    with device.client() as client:
        return sum(b.size for b in client.list_blobs())


def _evaluate(pairs: list[_Pair], labels: list[np.ndarray], distance: Literal["l2", "cosine"]) -> dict[str, float]:
    from fctkit.trainer.evaluation import evaluate_retrieval

    query = np.concatenate([q for q, _ in pairs])
    gallery = np.concatenate([g for _, g in pairs])
    n = min(query.shape[1], gallery.shape[1])  # new/old without adapter: compare the first n dims
    y = np.concatenate(labels)
    result = evaluate_retrieval(query[:, :n], y, gallery[:, :n], y, distance=distance, topk=(1, 5), leave_one_out=True)
    return {"top1": round(result.top1, 4), "top5": round(result.cmc[5], 4), "mAP": round(result.mean_ap, 4)}


def _assemble(
    options: DemoOptions,
    trained: TrainedRun,
    fleet: list[_Member],
    measures: dict[str, dict[str, Any]],
    labels: np.ndarray,
    distance: Literal["l2", "cosine"],
    backfill: BackfillResult,
    backfill_s: float,
    upgrade_rows: int,
    images: np.ndarray,
) -> dict[str, Any]:
    per_device: dict[str, Any] = {}
    for member in fleet:
        m = measures[member.name]
        y = labels[member.rows]
        per_device[member.name] = {
            "rows": m["rows"],
            "cases": {case: _evaluate([m["cases"][case]], [y], distance) for case in CASES},
            "bundle_bytes": m["bundle_bytes"],
            "vault_upload_bytes": m["vault_upload_bytes"],
            "upgrade_s": round(m["upgrade_s"], 3),
            "rows_by_space_after_upgrade": m["rows_by_space_after_upgrade"],
            "rows_by_space": member.device.status()["rows_by_space"],
            "version": member.device.version,
        }
    ys = [labels[m.rows] for m in fleet]
    overall = {case: _evaluate([measures[m.name]["cases"][case] for m in fleet], ys, distance) for case in CASES}
    total_rows = sum(len(m.rows) for m in fleet)
    vault_bytes = sum(d["vault_upload_bytes"] for d in per_device.values())
    per_row_backfill_s = backfill_s / max(backfill.backfilled, 1)
    per_row_embed_s = _per_row_embed_seconds(fleet[0].device, images[fleet[0].rows])
    upgrade_s = sum(d["upgrade_s"] for d in per_device.values())
    return {
        "data": options.data,
        "method": options.method,
        "devices": options.devices,
        "distance": distance,
        "rows": total_rows,
        "seed": options.seed,
        "per_device": per_device,
        "overall": overall,
        "ecc": {
            "holds": overall["new/h(old)"]["top1"] > overall["old/old"]["top1"],
            "rule": "M(new, h(old)) > M(old, old), top-1 over the fleet",
        },
        "trainer_figures": trained.gate["cases"],
        "backfill": {
            "device": fleet[0].name,
            "order": backfill.order,
            "rows": backfill.backfilled,
            "fraction": options.backfill_fraction,
            "bytes_downloaded": backfill.bytes_downloaded,
            "seconds": round(backfill_s, 3),
        },
        "bytes": {
            "bundle_v1": per_device[fleet[0].name]["bundle_bytes"]["v1"],
            "bundle_v2": per_device[fleet[0].name]["bundle_bytes"]["v2"],
            "bundles_to_fleet": sum(sum(d["bundle_bytes"].values()) for d in per_device.values()),
            "vault_uploads": vault_bytes,
            "backfill_downloads": backfill.bytes_downloaded,
            "full_reembed_downloads": vault_bytes,
        },
        "cost": {
            "upgrade_s": round(upgrade_s, 3),
            "upgrade_rows": upgrade_rows,
            "upgrade_per_row_ms": round(1000 * upgrade_s / max(upgrade_rows, 1), 4),
            "backfill_per_row_ms": round(1000 * per_row_backfill_s, 4),
            "embed_per_row_ms": round(1000 * per_row_embed_s, 4),
            "full_reembed_estimate_s": round(per_row_backfill_s * total_rows, 3),
            "backfill_row_over_upgrade_row": round(
                per_row_backfill_s / max(upgrade_s / max(upgrade_rows, 1), 1e-12), 2
            ),
            "note": "full re-embed = every device downloads and opens every original and re-embeds it: "
            "rows x the per-row cost measured by this run's backfill (download + decrypt + embed + write)",
        },
    }


def _per_row_embed_seconds(device: Device, images: np.ndarray) -> float:
    engine = device.engine()
    started = time.perf_counter()
    engine.embed(images)
    engine.side_info(images)
    return (time.perf_counter() - started) / len(images)


__all__ = ["fleet_story"]
