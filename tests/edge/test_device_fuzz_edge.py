"""Everything the device reads from disk, attacked from outside (issue 19 part 3).

* **Random bit flips in every file of a device directory** (gallery, settings, keys, the pinned
  publisher key, the installed bundle's files). After each flip a user's session runs on a copy
  (open, query, status, check) and its outcome is classed: *refused* (a kit error that says
  what is wrong), *reported* (answers given, the damage reported by query/status/check),
  *unaffected* (the same answers, nothing to report: the flip hit unused bytes), *silent wrong*
  (other answers, nothing reported) or *traceback* (any other exception). Goal: 0 of the last two.
* **Mutated bundles** (bit flips, truncation, removed, added and swapped files, unsigned
  manifest edits, a foreign signer, an older version replayed): every one is refused and the
  gallery's bytes stay as they were.

CI runs a sample; the issue's counts (≥ 200 flips per file, ≥ 1,000 bundle mutations) are

    FCTKIT_FUZZ_FLIPS=200 FCTKIT_FUZZ_BUNDLES=1000 .venv/bin/python -m pytest -s tests/edge/test_device_fuzz_edge.py

(``-s`` prints the counts). SIGKILLs during upgrades: ``tests/edge/test_upgrade_crash_edge.py``; the
same damage as a user meets it through the CLI, on plain and enrolled devices, with repair,
targeted value flips and a full disk: ``tests/edge/test_device_damage_fuzz_edge.py`` (issue 34).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fctkit.edge_runtime import Device
from fctkit.errors import FctkitError
from tests.edge.conftest import make_tiny_bundle

FLIPS_PER_FILE = int(os.environ.get("FCTKIT_FUZZ_FLIPS", "30"))
BUNDLE_MUTATIONS = int(os.environ.get("FCTKIT_FUZZ_BUNDLES", "200"))


def _session(root: Path, queries: np.ndarray) -> tuple[list, bool]:
    """What a user sees: the answers, and whether any damage was reported."""
    with Device.open(root) as device:
        device.progress = False
        answers = [[(m.item_id, round(m.distance, 5), m.label) for m in found] for found in device.query(queries, k=5)]
        answers.append(list(device.searchable()[1].item_ids))  # a row silently gone from searches is a wrong answer too
        reported = bool(device.damaged_rows() or device.missing_rows())
        status = device.status()
        reported |= bool(status.get("damaged_settings") or status.get("damaged_rows") or status.get("missing_rows"))
        reported |= bool(device.check()["damaged"])
    return answers, reported


def _outcome(root: Path, queries: np.ndarray, baseline: list) -> tuple[str, str]:
    try:
        answers, reported = _session(root, queries)
    except FctkitError as exc:
        return "refused", str(exc)
    except Exception as exc:
        return "traceback", f"{type(exc).__name__}: {exc}"
    if reported:
        return "reported", ""
    return ("unaffected", "") if answers == baseline else ("silent wrong", json.dumps(answers)[:200])


@pytest.fixture
def pristine(make_device, tiny_bundles, images) -> Path:
    device = make_device("pristine", device_name="kitchen", server="127.0.0.1:1")
    device.upgrade(tiny_bundles[1])
    device.add(
        images(1000, seed=3),
        item_ids=[f"it{i:04d}" for i in range(1000)],
        labels=[f"L{i}" for i in range(1000)],
        upload=False,
    )
    root = device.root
    device.close()  # the WAL is checkpointed into gallery.sqlite
    return root


def test_random_flips_in_every_device_file_are_refused_or_reported_never_silent(pristine, images, tmp_path):
    queries = images(4, seed=8)
    baseline, reported = _session(pristine, queries)
    assert not reported
    files = sorted(p.relative_to(pristine) for p in pristine.rglob("*") if p.is_file())
    assert {"gallery.sqlite", "device.json", "device.key", "owner.key", "publisher.pub"} <= {str(f) for f in files}
    rng = random.Random(19)
    counts: dict[str, Counter] = {}
    bad: list[str] = []
    for name in files:
        counts[str(name)] = Counter()
        for trial in range(FLIPS_PER_FILE):
            root = tmp_path / f"flip-{trial}"
            shutil.copytree(pristine, root)
            target = root / name
            data = bytearray(target.read_bytes())
            offset = rng.randrange(len(data))
            data[offset] ^= 1 << rng.randrange(8)
            target.write_bytes(bytes(data))
            outcome, detail = _outcome(root, queries, baseline)
            counts[str(name)][outcome] += 1
            if outcome in ("traceback", "silent wrong"):
                bad.append(f"{name} @ {offset}: {outcome}: {detail}")
            shutil.rmtree(root)
    print(f"\n{FLIPS_PER_FILE} random bit flips per file:")
    for name, counted in counts.items():
        print(f"  {name:40s} " + ", ".join(f"{k} {v}" for k, v in sorted(counted.items())))
    total = sum(counts.values(), Counter())
    print("  total " + ", ".join(f"{k} {v}" for k, v in sorted(total.items())))
    assert not bad, "\n".join(bad[:20])


def _mutations(v2: Path, foreign: Path, v1: Path):
    """(kind, how to make the mutated bundle folder from a copy of v2)."""

    def flip(d: Path, rng: random.Random) -> None:
        target = rng.choice(sorted(p for p in d.iterdir() if p.is_file()))
        data = bytearray(target.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(data))

    def truncate(d: Path, rng: random.Random) -> None:
        target = rng.choice(sorted(p for p in d.iterdir() if p.is_file()))
        data = target.read_bytes()
        target.write_bytes(data[: rng.randrange(len(data))])

    def remove(d: Path, rng: random.Random) -> None:
        rng.choice(sorted(p for p in d.iterdir() if p.is_file())).unlink()

    def add(d: Path, rng: random.Random) -> None:
        (d / rng.choice(["extra.onnx", "notes.txt", "manifest.json.bak"])).write_bytes(os.urandom(rng.randrange(1, 64)))

    def swap(d: Path, rng: random.Random) -> None:
        a, b = rng.sample(sorted(p for p in d.iterdir() if p.is_file()), 2)
        data_a, data_b = a.read_bytes(), b.read_bytes()
        a.write_bytes(data_b)
        b.write_bytes(data_a)

    def edit_manifest(d: Path, rng: random.Random) -> None:  # valid JSON, not re-signed
        manifest = json.loads((d / "manifest.json").read_text())
        key = rng.choice(sorted(manifest))
        value = manifest[key]
        manifest[key] = (
            value + 1 if isinstance(value, int) and not isinstance(value, bool) else ("x" if value != "x" else "y")
        )
        (d / "manifest.json").write_text(json.dumps(manifest, indent=2))

    def foreign_signer(d: Path, rng: random.Random) -> None:
        shutil.rmtree(d)
        shutil.copytree(foreign, d)

    def replay_older(d: Path, rng: random.Random) -> None:
        shutil.rmtree(d)
        shutil.copytree(v1, d)

    return [flip, flip, flip, truncate, remove, add, swap, edit_manifest, foreign_signer, replay_older]


def _fingerprint(device: Device) -> str:
    digest = hashlib.sha256()
    for suffix in ("", "-wal"):
        path = Path(str(device.gallery.path) + suffix)
        if path.exists():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def test_every_mutated_bundle_is_refused_and_the_gallery_bytes_stay(make_device, tiny_bundles, images, tmp_path):
    device = make_device("target")
    device.upgrade(tiny_bundles[1])
    device.add(images(30, seed=4), item_ids=[f"it{i:02d}" for i in range(30)], upload=False)
    device.upgrade(tiny_bundles[2])  # at v2: the v2 bundle mutated is a v2 → v3 update attempt below
    foreign = make_tiny_bundle(tmp_path / "foreign-v3", Ed25519PrivateKey.generate(), 3, ((2, 3),))
    before, answers = _fingerprint(device), device.query(images(3, seed=2))
    mutations = _mutations(tiny_bundles[3], foreign, tiny_bundles[1])
    rng = random.Random(1500)
    counts: Counter = Counter()
    accepted = []
    for trial in range(BUNDLE_MUTATIONS):
        mutate = mutations[trial % len(mutations)]
        folder = tmp_path / "mutated"
        shutil.copytree(tiny_bundles[3], folder)
        mutate(folder, rng)
        try:
            device.upgrade(folder)
            accepted.append(mutate.__name__)
        except FctkitError as exc:
            counts[f"{mutate.__name__}: {type(exc).__name__}"] += 1
        except Exception as exc:
            accepted.append(f"{mutate.__name__}: traceback {type(exc).__name__}: {exc}")
        shutil.rmtree(folder)
        assert _fingerprint(device) == before and device.installed_versions() == [1, 2] and device.version == 2
    print(f"\n{BUNDLE_MUTATIONS} mutated bundles, all refused:")
    for kind, n in sorted(counts.items()):
        print(f"  {kind:60s} {n}")
    assert not accepted, accepted[:10]
    assert device.query(images(3, seed=2)) == answers
