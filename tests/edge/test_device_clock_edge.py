"""A wrong device clock (issue 50, item 4): a clock gone back keeps being reported after a sync
(the time a timestamp was last accepted never moves back), and the rollback window's kept
vectors never go on a clock the trust metadata does not vouch for (behind the last accepted
time, or ahead of it by more than the root's freshness limit). The device clock is shifted by
replacing :func:`~fctkit.edge_runtime.device_trust.utc_now` (and ``time`` for the old expiry)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from fctkit.edge_runtime import Device, device_trust, revert_records
from fctkit.edge_runtime.device_trust_sync import refresh_trust
from tests.edge.test_device_trust_edge import Offer, root_v, write
from tests.edge.test_revert_edge import windowed_bundle
from tests.security.conftest import key, timestamp
from tests.support.device_damage import fctkit

STALE_EXIT, ROWS = 4, 40
REAL_NOW = datetime.now(UTC).replace(microsecond=0)


def _shift_clock(monkeypatch, by: timedelta) -> datetime:
    """The device clock reads ``REAL_NOW + by`` (both the trust's clock and the plain time)."""
    moment = REAL_NOW + by
    monkeypatch.setattr(device_trust, "utc_now", lambda: moment)
    monkeypatch.setattr(revert_records, "time", SimpleNamespace(time=moment.timestamp))
    return moment


def _offer() -> Offer:
    return Offer([root_v(1)], timestamp(1, {}, expires=REAL_NOW + timedelta(days=500)))


def _status(root: Path) -> tuple[int, dict]:
    run = fctkit("device", "status", "--dir", str(root))
    return run.code, json.loads(run.stdout)


def test_a_clock_gone_back_is_still_reported_after_a_sync(tmp_path, monkeypatch):
    with Device.init(tmp_path / "dev", trust_root=write(tmp_path / "root.1.json", root_v(1))) as device:
        refresh_trust(device.trust, _offer())  # accepted at the real time
    _shift_clock(monkeypatch, -timedelta(days=400))
    code, status = _status(tmp_path / "dev")
    assert code == STALE_EXIT and "the clock may be wrong" in status["trust"]["clock"]
    with Device.open(tmp_path / "dev") as device:  # a sync on the wrong clock: accepted ...
        refresh_trust(device.trust, _offer())
    code, status = _status(tmp_path / "dev")  # ... and the clock is still reported
    assert code == STALE_EXIT and "the clock may be wrong" in status["trust"]["clock"], status["trust"]
    monkeypatch.undo()
    assert _status(tmp_path / "dev")[0] == 0  # the clock set right: fresh


@pytest.fixture
def windowed(tmp_path) -> Path:
    """A device pinning root v1 (publisher alice), a timestamp accepted now, 40 rows upgraded v1 -> v2
    in forward mode with a 7-day rollback window (every row's v1 vectors kept)."""
    bundles = {v: windowed_bundle(tmp_path / f"v{v}", key("alice"), v, 7) for v in (1, 2)}
    with Device.init(tmp_path / "dev", trust_root=write(tmp_path / "root.1.json", root_v(1))) as device:
        device.progress = False
        refresh_trust(device.trust, _offer())
        device.upgrade(bundles[1])
        device.add(
            np.random.default_rng(1).standard_normal((ROWS, 16)).astype("float32"),
            item_ids=[f"r{i}" for i in range(ROWS)],
            upload=False,
        )
        device.upgrade(bundles[2])
        assert device.gallery.extras.count("rollback_embedding") == ROWS
    return tmp_path / "dev"


def test_a_clock_ahead_keeps_the_rollback_windows_vectors(windowed, monkeypatch):
    _shift_clock(monkeypatch, timedelta(days=8))  # past the 7-day window, and past the freshness limit
    code, status = _status(windowed)
    assert status["withdrawals"]["rollback_window"]["rows_kept"] == ROWS and code == STALE_EXIT
    synced = _shift_clock(monkeypatch, timedelta(days=7, hours=12))  # a sync at that time vouches for the clock
    with Device.open(windowed) as device:
        refresh_trust(device.trust, _offer())
        assert device.trust.state().fresh_at == synced
    _shift_clock(monkeypatch, timedelta(days=7, hours=13))
    code, status = _status(windowed)
    assert code == 0 and status["withdrawals"]["rollback_window"] is None  # the window closed: its vectors went


def test_a_clock_behind_the_last_accepted_time_keeps_them_too(windowed, monkeypatch):
    with Device.open(windowed) as device:
        device.trust.clock = lambda: REAL_NOW - timedelta(days=30)
        assert device.trust.trusted_time() is None and not device.expire_rollback()
        assert device.gallery.extras.count("rollback_embedding") == ROWS
