"""What ``fctkit device status`` reports: what a device holds and does, and any damage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fctkit.errors import TrustError

from .device_files import PUBLISHER_FILE, DeviceSettings
from .device_parts import DeviceParts
from .engine import Engine
from .queries import GallerySearch
from .repair import side_info_lost
from .revert_records import not_withdrawn
from .scoring import scoring_of
from .upgrade_check import stored_health


def device_status(
    root: Path,
    settings: DeviceSettings,
    parts: DeviceParts,
    search: GallerySearch,
    owner_key_id: str,
    check: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """What the device holds and does; damage is reported (``damaged_settings`` alone when
    settings are damaged, else ``damaged_rows`` / ``missing_rows`` when rows are, and ``damaged``:
    how much ``check()`` (``fctkit device check``) finds, so status and check agree)."""
    damaged_settings = parts.gallery.settings.damaged()
    if damaged_settings:
        return {
            "device": str(root),
            "device_id": settings.device_id,
            "damaged_settings": damaged_settings,
            "next": "run `fctkit device repair --dir DIR`",
        }
    gallery, version, state = parts.gallery, parts.version, parts.gallery.upgrade_state
    result: dict[str, Any] = {
        "device": str(root),
        "device_id": settings.device_id,
        "server": settings.server,
        "installed_version": version,
        "rows": len(gallery),
        "rows_by_space": gallery.tag_counts(),
        "queued_uploads": gallery.replica_log.outbox_size(),
        "publisher_key_pinned": (root / PUBLISHER_FILE).exists(),
        "owner_id": settings.owner_id,
        "owner_key_id": owner_key_id,
        "replica": gallery.replica_log.replication_counts(),
    }
    if state is not None:
        result["upgrade"] = {
            "target": state["target"],
            "mode": state["mode"],
            "rows_left": gallery.remaining(state["target"]) if state["hops"] else 0,
        }
    pending = not_withdrawn(gallery, parts.pending_versions())
    if pending:
        result["installed_not_applied"] = {
            "versions": pending,
            "next": "run `fctkit device upgrade --dir DIR` to apply",
        }
    engine = _engine(parts) if version else None
    if engine is not None:
        result.update(
            mode=engine.manifest.mode,
            distance=engine.manifest.distance,
            provider=engine.provider,
            scoring=scoring_of(engine.manifest, search.transition).name,
        )
        searchable = search.searchable()[2]
        damaged, missing = len(searchable.corrupt), searchable.missing
        if damaged or missing:
            result.update(
                damaged_rows=damaged,
                missing_rows=missing,
                next="run `fctkit device check --dir DIR`, then `fctkit device repair --dir DIR`",
            )
    transition = search.transition
    if transition is not None:
        result["transition"] = {
            "from_version": transition.previous_version,
            "weight": transition.weight,
            "rows_with_previous": gallery.extras.count("previous_embedding"),
            "max_days": transition.max_days,
        }
    health = stored_health(gallery)
    if health is not None:  # the last upgrade's health check (reason: why nothing was measured)
        result["upgrade_health"] = asdict(health)
    lost = side_info_lost(gallery) if version else []
    if lost:
        result["side_info_lost"] = {
            "rows": len(lost),
            "items": lost[:10],
            "next": "an upgrade whose adapters take side-info "
            "refuses these rows: remove them and add their originals again (see `fctkit device repair`)",
        }
    damage = check()["damaged"]
    if damage:
        result.update(
            damaged=damage,
            next="run `fctkit device check --dir DIR` for the list, then `fctkit device repair --dir DIR`",
        )
    return result


def _engine(parts: DeviceParts) -> Engine | None:
    """The installed version's engine; None when the trust files it is checked against are damaged
    (``status["trust"]`` says which and what to do)."""
    try:
        return parts.engine()
    except TrustError:
        return None
