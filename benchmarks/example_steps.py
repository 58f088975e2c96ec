"""The steps the end-to-end examples share (``examples/text-search``, ``examples/photo-library``).

- :func:`log`, :func:`clear_previous_run`: timestamped progress and a working folder emptied of
  an earlier run's outputs (its exported models and keys stay);
- :func:`train_task`: ``fctkit train``'s pipeline on a retrieval task with the method the README
  recommends for instance-level search (the residual adapter trained on query positives, with
  the hubness offset; settings fixed, not searched, for speed); :func:`gate_holds`: its verdict;
- :func:`export_bundles`: the real ``fctkit export`` command, forced (and said so) when asked;
- :func:`publish`, :func:`enrolled_device`: a bundle published on the loopback ``fctkit serve``
  (:class:`fctkit.demo.loopback_server.DemoServer`) and a device enrolled there with v1 installed;
- :func:`recall`, :func:`nearest_ids`: R@k of answers, exact search over unit vectors;
- :func:`pip_install`: the example's extra packages through the constraints file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fctkit.errors import FctkitError

REPO = Path(__file__).resolve().parents[1]
RUN_FILES = ("task.npz", "sample.jsonl", "summary.json", "server.log", "admin.token")
RUN_FOLDERS = ("run", "bundles", "archives", "server", "device")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def clear_previous_run(out: Path, files: Sequence[str] = (), folders: Sequence[str] = ()) -> None:
    """Remove what an earlier run left (its task, run, bundles, server and device, and ``files``
    and ``folders`` of the example's own); models and keys stay."""
    for name in (*RUN_FILES, *files):
        (out / name).unlink(missing_ok=True)
    for name in (*RUN_FOLDERS, *folders):
        shutil.rmtree(out / name, ignore_errors=True)


def pip_install(extras: str, *more: str) -> None:
    """``pip install -c constraints.txt -e '.[extras]'`` and, with ``--no-deps``, ``more``."""
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "-c", str(REPO / "constraints.txt"), "-e", f"{REPO}[{extras}]"], check=True)
    if more:
        subprocess.run([*pip, "--no-deps", *more], check=True)


def train_task(task: Path, run: Path, seed: int, settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The recommended instance-level method on the task (fixed settings, plus ``settings``); the run's gate.json."""
    from fctkit.trainer.pipeline import run_pipeline
    from fctkit.trainer.pipeline_config import load_pipeline_config

    config = load_pipeline_config(
        None,
        {
            "seed": seed,
            "data.name": "task",
            "data.task": str(task),
            "methods": ["residual"],
            "query_positives.enabled": True,
            "hubness.enabled": True,
            "selection.enabled": False,
            "progress": False,
            "device": "cpu",
            "evaluation.distance": "cosine",
            **(settings or {}),
        },
    )
    start = time.perf_counter()
    run_pipeline(config, run, log=lambda _: None)
    log(f"train: {time.perf_counter() - start:.0f} s")
    return json.loads((run / "gate.json").read_text())


def gate_holds(gate: Mapping[str, Any], method: str) -> bool:
    """Whether the run's gate says ECC holds for ``method`` on the task's primary metric."""
    if method not in gate.get("ecc", {}):
        raise FctkitError(f"the run's gate.json has no verdict for {method}: {sorted(gate.get('ecc', {}))}")
    return bool(gate["ecc"][method])


def export_bundles(
    run: Path,
    method: str,
    keys: Path,
    out: Path,
    graph_arguments: Sequence[str],
    sample: Path,
    tolerance: float,
    force_reason: str | None = None,
) -> None:
    """``fctkit export`` (the real command) of v1 and v2; ``graph_arguments``: the graphs, their
    declarations and tokenizers; ``force_reason``: publish although the gate fails, recorded."""
    command = [
        sys.executable,
        "-m",
        "fctkit.cli",
        "export",
        str(run),
        "--key",
        str(keys / "publisher.key"),
        "--out",
        str(out),
        "--method",
        method,
        *graph_arguments,
        "--sample",
        str(sample),
        "--parity-tolerance",
        str(tolerance),
        "--no-progress",
    ]
    if force_reason is not None:
        command += ["--force", "--reason", force_reason]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise FctkitError(f"fctkit export failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def publisher_keys(keys: Path) -> Path:
    """The example's publisher key pair in ``keys`` (made on the first run, kept after)."""
    from fctkit.export.keys import generate_keys

    if not (keys / "publisher.key").is_file():
        generate_keys(keys, None)
    return keys


def publish(server: Any, bundle: Path, archives: Path) -> None:
    from fctkit.protos.bundle import pack_bundle

    archives.mkdir(parents=True, exist_ok=True)
    with server.admin() as admin:
        admin.publish_bundle(pack_bundle(bundle, archives / f"{bundle.name}.tar"))


def enrolled_device(server: Any, root: Path, name: str, settings: Any = None) -> Any:
    """A new device at ``root`` (``settings``: its :class:`DeviceSettings`), enrolled on ``server``
    with a fresh code and synced (the published bundle installed); no progress bars."""
    from fctkit.edge_runtime import Device

    with server.admin() as admin:
        code = admin.create_enrolment_code(label=name).code
    device = Device.init(root, settings=settings)
    device.progress = False
    device.enrol(server.target, code, device_name=name, trust_on_first_use=True)
    device.sync()
    return device


def recall(answers: Sequence[Sequence[str]], wanted: Sequence[str], k: int) -> float:
    return float(np.mean([w in a[:k] for a, w in zip(answers, wanted, strict=True)]))


def nearest_ids(queries: np.ndarray, gallery: np.ndarray, ids: Sequence[str], k: int) -> list[list[str]]:
    order = np.argsort(-(queries @ gallery.T), axis=1)[:, :k]
    return [[ids[j] for j in row] for row in order]
