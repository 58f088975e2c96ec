"""Crash safety of a revert: a subprocess taking a signed withdrawal of v2 on a 6,000-row gallery
(upgraded v1 -> v2 inside its rollback window) is SIGKILLed at ≥ 30 moments (120 in `make robustness`) (random times,
after the kept vectors were read, mid-commit). After every kill the gallery is wholly at v2 (every
row adapted, its kept vectors all there, no revert recorded) or wholly back at v1 (every row as
before the upgrade, nothing kept, the revert recorded): never a mix. Restarts finish the revert,
and the result equals the gallery before the upgrade bit for bit, with every query's top-10."""

from __future__ import annotations

import os
import queue
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from fctkit.edge_runtime import Device, Gallery
from fctkit.edge_runtime.crypto import read_key_file
from fctkit.edge_runtime.revert_records import last_revert, rollback_window
from fctkit.export.keys import write_withdrawal
from tests.edge.conftest import start_worker
from tests.edge.test_revert_edge import top10, windowed_bundle

ROWS = 6_000
KILLS = int(os.environ.get("FCTKIT_REVERT_KILLS", "30"))  # make robustness: 120

# A device app's sync, as far as the withdrawal goes: "loaded" once the kept vectors are read,
# "commit" just before each COMMIT is sent.
WORKER = """
import sys
from pathlib import Path
from fctkit.edge_runtime import Device, revert, sqlite_file
original_exit, original_kept = sqlite_file.transaction.__exit__, revert._kept_rows
def exit_hook(self, exc_type, exc, tb):
    if exc_type is None:
        print("commit", flush=True)
    return original_exit(self, exc_type, exc, tb)
def kept_hook(parts):
    kept = original_kept(parts)
    print("loaded", flush=True)
    return kept
sqlite_file.transaction.__exit__ = exit_hook
revert._kept_rows = kept_hook
device = Device.open(sys.argv[1])
device.progress = False
print("notes", revert.take_withdrawals(device.parts, device.trust, [Path(sys.argv[2]).read_bytes()], None), flush=True)
print("done", device.version, flush=True)
"""


def _wait_for(lines: queue.Queue, word: str) -> bool:
    while True:
        line = lines.get(timeout=120)
        if line is None:
            return False
        if line == word:
            return True


def _kill_somewhere(root: Path, document: Path, rng: random.Random, strategy: str) -> bool:
    """Start a worker and SIGKILL it per ``strategy``; True if it was killed before finishing."""
    process, lines = start_worker(WORKER, str(root), str(document))
    if strategy == "random-time":
        time.sleep(rng.uniform(0.2, 1.6))  # start-up, reading the kept vectors, writing, committing
    elif strategy == "after-loading":
        _wait_for(lines, "loaded")
        time.sleep(rng.uniform(0.0, 0.3))
    else:  # mid-commit: right after the COMMIT is issued, while SQLite writes and syncs
        _wait_for(lines, "commit")
        time.sleep(rng.uniform(0.0, 0.003))
    process.send_signal(signal.SIGKILL)
    process.wait()
    return process.returncode == -signal.SIGKILL


def _check_whole(root: Path, key: bytes, before) -> int:
    """Every row at v2 with its kept vectors, or every row back as before: returns the version."""
    with Gallery.open(root / "gallery.sqlite", key) as gallery:
        rows = gallery.load()
        assert not rows.corrupt and len(rows) == ROWS == len(gallery) and rows.item_ids == before.item_ids
        for vector_set in ("vectors_0", "vectors_1"):
            assert gallery._vectors.audit(vector_set) == {"rows_without_block": 0, "block_rows_without_pointer": 0}
        if gallery.query_version == 2:
            assert {str(t) for t in rows.tags} == {"v1->v2 (forward)"} and last_revert(gallery) is None
            assert gallery.extras.count("rollback_embedding") == gallery.extras.count("rollback_side_info") == ROWS
            assert rollback_window(gallery) is not None
        else:
            assert gallery.query_version == 1 and rows.tags == before.tags
            assert np.array_equal(np.stack(rows.embeddings), np.stack(before.embeddings))
            assert np.array_equal(np.stack(rows.side_infos), np.stack(before.side_infos))
            assert gallery.extras.count("rollback_embedding") == 0 and last_revert(gallery).method == "exact"
        return gallery.query_version


@pytest.mark.slow
def test_sigkill_anywhere_in_a_revert_loses_nothing_and_doubles_nothing(tmp_path, make_device, publisher_key):
    v1, v2 = (windowed_bundle(tmp_path / f"v{v}", publisher_key, v, 7) for v in (1, 2))
    source = make_device("source", health_sample=0)
    source.upgrade(v1)
    rng_images = np.random.default_rng(11)
    source.add(
        rng_images.standard_normal((ROWS, 16)).astype(np.float32),
        item_ids=[f"r{i:05d}" for i in range(ROWS)],
        labels=[f"c{i % 10}" for i in range(ROWS)],
        upload=False,
    )
    queries = rng_images.standard_normal((50, 16)).astype(np.float32)
    answers, before = top10(source, queries), source.gallery.load()
    source.upgrade(v2)
    source.close()
    key = read_key_file(source.root / "device.key")
    document = tmp_path / "withdrawal.2.json"
    write_withdrawal(document, 2, 1, "recall fell on the fleet", publisher_key)

    rng = random.Random(2026)
    strategies = ["random-time", "after-loading", "mid-commit"]
    kills = attempts = rounds = reverted_at_kill = 0
    while kills < KILLS and attempts < 4 * KILLS:  # a finished copy is checked; a fresh copy takes the next kills
        root = tmp_path / f"crash{rounds}"
        shutil.copytree(source.root, root)
        rounds += 1
        while kills < KILLS and attempts < 4 * KILLS:
            killed = _kill_somewhere(root, document, rng, strategies[attempts % 3])
            attempts += 1
            version = _check_whole(root, key, before)
            kills += killed
            reverted_at_kill += killed and version == 1
            if not killed or version == 1:  # finished, or reverted before the kill: the next kills go to a fresh copy
                break
        process, _ = start_worker(WORKER, str(root), str(document))
        assert process.wait() == 0, process.stderr.read()
        assert _check_whole(root, key, before) == 1
        with Device.open(root) as device:
            device.progress = False
            assert top10(device, queries) == answers
    print(
        f"\n{kills} SIGKILLs in {attempts} attempts over {rounds} galleries of {ROWS} rows ({reverted_at_kill} landed "
        "after the commit): every kill left v2 whole or v1 whole, every finished revert equal to before the upgrade"
    )
    assert kills >= KILLS and 0 < reverted_at_kill < kills  # kills landed both before and after the revert's commit
