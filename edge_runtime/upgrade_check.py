"""The health check after each upgrade: what the upgrade did, and how well its adapter matches
the new model (fleet health from the devices, without labels).

Once an upgrade of the gallery has finished (:meth:`~.upgrade.DeviceUpgrade.finish`: a sync, or
`fctkit device upgrade` online or from local bundles, or one resumed after a crash), the device:

1. draws ``health_sample`` rows (``device.json``, default 32; 0 turns the check off, and so does
   ``--no-health-check`` for one command) among the rows the upgrade adapted whose sealed
   originals are in the vault, seeded by the device id and the version
   (:func:`~.upgrade_health.sample_rows`, :func:`health_seed`);
2. downloads and opens those originals and embeds them with the new model, exactly as backfill
   does (:func:`~.backfill.vault_originals`, :func:`~.backfill.gallery_vectors`);
3. measures :func:`~.upgrade_health.streamed_health` against the adapted gallery as the upgrade
   left it: the cosine between each sampled row's adapted vector and its new embedding, and the
   rank of the row's own adapted vector when its new embedding queries the whole adapted gallery
   (self-retrieval), the gallery read :data:`BLOCK_ROWS` rows at a time (never all at once);
4. keeps the sampled rows as backfilled (the new model's own vectors, tagged native), so the
   downloads are not wasted — but only where native and adapted rows rank fairly together
   (:func:`keeps_sample`): not for an instance-level bundle without a hubness offset, nor during
   transition scoring, where a few native rows would take the first place of most answers
   (measured on the photo example: 94 of 500 with 32 native rows among 5,000);
5. stores the result in the gallery's authenticated settings (``upgrade_health``, HMAC'd like every
   setting) and sends it in every Fleet.Report from then on until the next upgrade replaces it
   (:func:`send_report`): a device offline at upgrade time sends it at its next sync.
   `fctkit device status` shows it.

No sample (the check turned off, no adapted row with its original in the vault, the vault out of
reach): ``sample_size`` 0 and the reason. A check that fails is recorded as such. Neither ever
fails or undoes the upgrade, which has committed before the check begins.

What leaves the device (``fleet_pb2.UpgradeHealth`` in Fleet.Report), and nothing more: the version
upgraded to, the rows upgraded, the rows the upgrade could not move, the seconds it took, the sample
size, and four aggregates over the sample: mean and 10th-percentile cosine, R@1 and mean reciprocal
rank. What does not: no vector (adapted or new), no row or item id, no label, no sampled position,
no per-row cosine or rank, no original, and not the reason text (kept on the device). The server does
see which sealed originals the device downloads, as for any backfill.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from fctkit.errors import DeviceError, RpcStatusError
from fctkit.protos.health_expectation import gate_level
from fctkit.upgrade_health import sample_rows, streamed_health

from .backfill import gallery_vectors, reembedded_rows, vault_originals
from .gallery import Gallery
from .gallery.rows import take_rows

if TYPE_CHECKING:
    from fctkit.protos import fleet_pb2

    from .device_parts import DeviceParts

HEALTH_KEY = "upgrade_health"
BLOCK_ROWS = 4096  # adapted rows decrypted and scored at a time (one gallery block's worth)


@dataclass(frozen=True)
class UpgradeRun:
    """What one upgrade did: its target, the rows it rewrote, the rows left outside the target's
    space, and the seconds it ran (a resumed upgrade: since it resumed)."""

    version: int
    rows_upgraded: int
    failures: int
    seconds: float


@dataclass(frozen=True)
class HealthRecord:
    """What the device keeps of its last upgrade; every field but ``reason`` is reported."""

    version: int
    rows_upgraded: int
    failures: int
    seconds: float
    sample_size: int = 0
    mean_cosine: float = 0.0
    p10_cosine: float = 0.0
    recall_at_1: float = 0.0
    mean_reciprocal_rank: float = 0.0
    median_rank: float = 0.0
    gallery_rows: int = 0
    reason: str = ""  # why nothing was measured ("" when the sample was)

    def message(self) -> fleet_pb2.UpgradeHealth:
        from fctkit.protos import fleet_pb2

        return fleet_pb2.UpgradeHealth(**{k: v for k, v in asdict(self).items() if k != "reason"})


class HealthCheck:
    """The check :class:`~.upgrade.DeviceUpgrade` runs once an upgrade finished (module docstring);
    ``sample``: rows to re-embed (0: off); ``device_id`` seeds the sample (None: the gallery id)."""

    def __init__(self, parts: DeviceParts, device_id: str | None, sample: int) -> None:
        self.parts, self.device_id, self.sample = parts, device_id, sample

    def __call__(self, run: UpgradeRun) -> HealthRecord:
        done = HealthRecord(run.version, run.rows_upgraded, run.failures, round(run.seconds, 3))
        try:
            record = self._measured(done)
        except Exception as exc:
            record = replace(done, reason=f"the health check failed ({type(exc).__name__}: {exc}); the upgrade stands")
        try:
            self.parts.gallery.set_meta({HEALTH_KEY: json.dumps(asdict(record))})
        except Exception as exc:
            record = replace(record, reason=f"{record.reason or 'measured'}; not stored ({exc})")
        return record

    def _measured(self, done: HealthRecord) -> HealthRecord:
        if self.sample <= 0:
            return replace(
                done, reason="the health check is turned off (health_sample 0 in device.json, or --no-health-check)"
            )
        gallery, version = self.parts.gallery, done.version
        adapted = gallery.adapted_rows(version, in_vault=True)
        if not adapted:
            return replace(
                done, reason=_no_originals(bool(gallery.adapted_rows(version, in_vault=False, limit=1)), version)
            )
        picked = sample_rows(
            [item for _, item in adapted],
            min(self.sample, len(adapted)),
            health_seed(self.device_id, gallery.gallery_id, version),
        )
        rows = gallery.space_rows(version, 0, len(picked), only=[adapted[i][0] for i in picked])
        if not len(rows):
            return replace(
                done, reason="the sampled rows cannot be read (damaged): run `fctkit device check --dir DIR`"
            )
        engine = self.parts.engine(version)
        try:
            with self.parts.connect(attempts=2) as client:
                images, _ = vault_originals(self.parts, client, rows.item_ids, engine)
        except (DeviceError, RpcStatusError) as exc:
            return replace(done, reason=f"the sampled originals could not be downloaded from the vault ({exc})")
        vectors = gallery_vectors(engine, images)
        health = streamed_health(
            self._adapted_blocks(version),
            rows.row_ids,
            take_rows(rows.embeddings, range(len(rows))),
            vectors[0],
            engine.manifest.distance,
        )
        if keeps_sample(engine.manifest):
            gallery.write_upgrades(reembedded_rows(rows, range(len(rows)), vectors, version), staged=False)
        return replace(done, **asdict(health))

    def _adapted_blocks(self, version: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(row ids, vectors) of the live rows in ``version``'s space, :data:`BLOCK_ROWS` at a
        time by row id; rows that fail to open are left out, as searches leave them out."""
        after = 0
        while True:
            page = self.parts.gallery.space_rows(version, after, BLOCK_ROWS)
            read = [*page.row_ids.tolist(), *(row_id for row_id, _, _ in page.corrupt)]
            if not read:
                return
            after = max(read)
            if len(page):
                yield page.row_ids, take_rows(page.embeddings, range(len(page)))


def keeps_sample(manifest: Any) -> bool:
    """Whether the check's re-embedded rows may replace their adapted ones: a bundle with a hubness
    offset (which puts both kinds of row on one scale), or one judged at class level (a gate without
    recall@k: its adapter is fitted to the new model's geometry) outside a transition. An
    instance-level adapter (InfoNCE) keeps identity, not the new model's scale of similarities, and
    transition scoring fuses a previous embedding the native rows no longer have."""
    if manifest.hubness is not None:
        return True
    return manifest.transition is None and release_level(manifest) == "class"


def release_level(manifest: Any) -> str:
    """``class`` or ``instance``: as the manifest records it, else as its gate's cases show."""
    if manifest.health_expectation is not None:
        return str(manifest.health_expectation.level)
    return gate_level(manifest.gate.get("cases", {}) if isinstance(manifest.gate, dict) else {})


def _no_originals(any_adapted: bool, version: int) -> str:
    if not any_adapted:
        return f"no row was adapted by the upgrade to v{version}: nothing to measure"
    return (
        "none of the adapted rows has its original in the vault (a device without a server, or originals not "
        "uploaded yet): nothing to re-embed"
    )


def health_seed(device_id: str | None, gallery_id: bytes, version: int) -> int:
    """The sample's seed: a hash of the device id (the gallery id on a device never enrolled)
    and the version, so each device samples its own rows and each upgrade new ones."""
    name = device_id.encode() if device_id else gallery_id
    digest = hashlib.blake2b(name + b"|%d" % version, digest_size=8, person=b"fctkit-health").digest()
    return int.from_bytes(digest, "little")


def stored_health(gallery: Gallery) -> HealthRecord | None:
    """The last upgrade's health record (None before the first upgrade that recorded one)."""
    text = gallery.meta(HEALTH_KEY)
    return None if text is None else HealthRecord(**json.loads(text))


def health_message(gallery: Gallery) -> fleet_pb2.UpgradeHealth | None:
    """What every Fleet.Report carries after an upgrade (None before the first one)."""
    record = stored_health(gallery)
    return None if record is None else record.message()


def send_report(client, gallery: Gallery, version: int, state: int, **fields: Any) -> None:
    """Fleet.Report: the device's ``version``, gallery size and upgrade ``state`` (``fields``: the
    rest of :meth:`~fctkit.protos.client.FctkitClient.report`'s), with the last upgrade's health.
    Best effort: a server away or limiting reports is skipped until the next report, and a health
    record the server refuses (INVALID_ARGUMENT) is left out rather than stopping every sync."""
    health = health_message(gallery)
    try:
        _best_effort_report(client, gallery, version, state, health, fields)
    except RpcStatusError as exc:
        if exc.code != "INVALID_ARGUMENT" or health is None:
            raise
        _best_effort_report(client, gallery, version, state, None, fields)


def _best_effort_report(
    client, gallery: Gallery, version: int, state: int, health: fleet_pb2.UpgradeHealth | None, fields: dict[str, Any]
) -> None:
    try:
        client.report(version, len(gallery), state, health=health, **fields)
    except RpcStatusError as exc:
        if exc.code not in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"):
            raise
