"""The rollout acceptance run (issue 36): staged releases, the devices' health signal, the halt
guard, a signed withdrawal and the devices' revert, on a real server and a fleet of devices; and
its instance-level scenario (issue 48), where the server's default guard halts a bad release on
its own and lets the good one through.

    python benchmarks/rollout.py                         # 100 devices
    python benchmarks/rollout.py --devices 12 --queries 20 --v3-percent 50 --halt-min-devices 1   # a smoke run
    python benchmarks/rollout.py --scenario instance --devices 10 --queries 20     # instance level, default guard
    python benchmarks/rollout.py --database postgresql://USER@HOST/DB --object-store s3://BUCKET/PREFIX \
        [--s3-endpoint-url URL]                          # on PostgreSQL + S3 (credentials: the AWS_* variables)

Class level (``--scenario class``, the default):

1. v1 and v2 trained on digits the demo's way (old backbone + SimCLR ψ; new backbone + FCT h)
   and exported with ``build_release`` (rollback window 7 days); v3 is deliberately broken: v2's
   own embed and ψ graphs with a random orthogonal map as its 2 -> 3 adapter (h keeps every
   inner product of the v2 space but points nowhere near φ_v3), exported with the gate overridden
   on the record (its ECC fails, as it should);
2. a real `fctkit serve` with a root of trust on loopback; v1 published to everyone; N devices
   enrol by the root's fingerprint, install v1 and add their share of the digits evaluation
   images: ``--rows-per-device`` (64) drawn at random per device, devices overlapping, since the
   split has 719 images (originals sealed in the vault, which the health check needs). A gallery
   no larger than the health sample (``--health-sample``, 32) would be re-embedded whole by the
   check, so that even a broken adapter never reached its answers;
3. v2 published at 5%, widened to 25% and 100%, every device syncing after each stage (each
   upgrade re-embeds up to ``--health-sample`` sampled rows from the vault and reports its health);
4. each device's top-10 answers to a fixed query set and its rows recorded; v3 published at
   5% (``--v3-percent``) with the guard (``--halt-below``, ``--halt-min-devices``); every device syncs;
5. v3 withdrawn by the publisher (a signed ``withdrawal.3.json``); every device syncs again.

Instance level (``--scenario instance``): the same server, fleet, phases and checks on the
synthetic instance-level task (examples/tasks/synthetic-instance.npz, a ``fctkit-task/1`` file
whose items are the rows ``[old | new]``), with no explicit guard anywhere:

1. a features-mode run trained on the task with fixed settings (the residual InfoNCE adapter with
   its defaults: no settings search, no query positives, transition or hubness), exported with
   ``build_release`` and the task's own embed graphs (real ONNX MatMuls selecting the old or the
   new model's columns of an item row): v1 (old model) and v2 (new model + the residual adapter;
   its manifest records the instance-level health expectation). v3 goes bad on the devices only:
   v2's embed graph with a random orthogonal 2 -> 3 adapter, signed with v2's gate cases and
   health expectation, as a release whose gate and expectation were measured with one adapter
   but which ships another would be. Not a release whose own gate fails: that one is exported
   only with the gate overridden, and its break-even (not upgrading's R@1 over its own, above
   1) halts it at the first 5 owners' reports unless the devices do better than the gate saw; this v3's
   break-even and expectation are a good release's, so only the devices' own measurements can
   halt it;
2. as above, each device holding ``--rows-per-device`` (64) items of the task's evaluation
   gallery (400 items; devices overlap), one owner per device;
3. v2 published at 5% with the server's default guard (each device's self-retrieval R@1 over
   what v2's manifest expects at its gallery size; halt when the median owner's falls under
   1 − the instance-level margin, or the break-even at its size when above 1, once 5 owners reported:
   ``default_guard``, ``HealthExpectation.bound``),
   widened to 25% and 100%;
4. v3 published at 5% under the default guard alone, with the first ``--v3-cohort`` (5, the
   guard's owners) devices as testers: a 5% stage of a small fleet draws fewer than the 5
   reporting owners the guard waits for, so the testers make the halt deterministic (at the 5th
   tester's report); every device syncs;
5. as above.

Printed and checked (the exit status is 1 when any check fails): the health of v2's and v3's
reporting devices (class level: count, min, median, max of mean cosine, the gap worst v2 − best
v3; instance level: median R@1, mean cosine and ratio to expected, the guard's bound, each
device's true R@1 on v1, v2 and v3 — the task's queries whose positive it holds, against its
gallery — v2 better and v3 worse than not upgrading) next to the server's stage summaries; v3
changing the answers of the devices that took it; v3's rollout halted at its first stage (at
instance level by the default guard, on R@1, and v2's not) and only devices of that stage (by
the server's own bucket of device id and version) got it; every device that took v3 back on v2
with every query's top-10 as before v3, and its revert method; every other device never saw v3
(its versions, its installed bundles, and ListVersions through its own client while v3 was
live); every device's rows before and after (count and item ids: none lost, none doubled); each
phase's seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _loopback import LoopbackServer
from edge_upgrade import _save
from upgrade_health_signal import random_isometry

from fctkit.edge_runtime import Device, DeviceSettings
from fctkit.edge_runtime.revert_records import last_revert
from fctkit.edge_runtime.upgrade_check import HealthRecord, stored_health
from fctkit.protos import registry_pb2
from fctkit.protos.bundle import pack_bundle
from fctkit.protos.health_expectation import HealthExpectation
from fctkit.protos.trust.withdrawal import write_withdrawal
from fctkit.server.rollout import bucket
from fctkit.server.rollout.changes import DEFAULT_GUARD_MARGIN, DEFAULT_GUARD_OWNERS
from fctkit.trainer.tasks import TaskSplit, load_task

if TYPE_CHECKING:
    from fctkit.export.features_release import UserGraphs

V2_STAGES = (5.0, 25.0, 100.0)
SYNTHETIC_TASK = Path(__file__).resolve().parents[1] / "examples" / "tasks" / "synthetic-instance.npz"
#: the instance scenario's training: the residual InfoNCE adapter with its default settings, nothing
#: searched or judged besides (~10 s on 2 cores); transition scoring and hubness off, so that devices
#: score plainly and a health check's re-embedded rows never reach the answers
INSTANCE_TRAINING = {
    "data.name": "task",
    "progress": False,
    "device": "cpu",
    "evaluation.distance": "cosine",
    "methods": ["residual"],
    "selection.enabled": False,
    "query_positives.enabled": False,
    "transition.enabled": False,
    "hubness.enabled": False,
}


@dataclass(frozen=True)
class Releases:
    """The three bundles of a scenario: v1 and v2 exported from a run, v3 the broken one."""

    v1: Path
    v2: Path
    v3: Path


@dataclass(frozen=True)
class Items:
    """What the devices hold and ask: the evaluation gallery's items (digits images, or task rows
    ``[old | new]``), their labels (class level), the fixed queries every device answers (top-10);
    at instance level also the task's queries and each one's positive gallery rows."""

    gallery: np.ndarray
    labels: list[str] | None
    queries: np.ndarray
    task_queries: np.ndarray | None = None
    positives: list[frozenset[int]] | None = None


@dataclass
class Member:
    """One device of the fleet and what was recorded of it."""

    name: str
    device: Device
    rows: np.ndarray  # the evaluation gallery's rows it holds
    item_ids: list[str]
    versions_seen: list[int] = field(default_factory=list)  # its query version after each sync
    answers_before_v3: list[list[str]] = field(default_factory=list)
    offered_while_v3_live: list[int] = field(default_factory=list)
    true_recall: dict[int, float] = field(default_factory=dict)  # instance level: version -> R@1 of its own queries

    @property
    def device_id(self) -> str:
        return self.device.settings.device_id or ""


class Checks:
    """Named pass/fail lines; the run's exit status is 1 when any failed."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.passed = 0

    def __call__(self, ok: bool, what: str) -> None:
        print(f"  [{'ok' if ok else 'FAILED'}] {what}")
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)


class Phases:
    """``with phases("name"):`` times a phase; ``seconds`` keeps them in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        print(f"-- {name}", flush=True)
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start


# --------------------------------------------------------------------------- bundles


def digits_releases(work: Path, key: Ed25519PrivateKey, args: argparse.Namespace) -> tuple[Releases, Items]:
    """v1 and v2 the demo's way (``fctkit demo``'s digits training), exported with a 7-day window;
    v3 forced through its failing gate; the digits evaluation images."""
    from fctkit.demo import DemoOptions, _train
    from fctkit.export.release import build_release
    from fctkit.export.trained_run import TrainedRun

    run_dir = work / "run"
    _train(DemoOptions(devices=1, seed=args.seed, progress=False), run_dir, lambda line: None)
    released = build_release(run_dir, work / "release", private_key=key, method="fct", rollback_window_days=7)
    v2 = released[1].bundle.root
    trained = TrainedRun.open(run_dir)
    images, labels = trained.eval_images, trained.eval_features["labels"]
    items = Items(images, [str(int(x)) for x in labels], fixed_queries(images, args))
    return Releases(released[0].bundle.root, v2, broken_v3(v2, work / "v3", key, args.seed)), items


def task_releases(work: Path, key: Ed25519PrivateKey, args: argparse.Namespace) -> tuple[Releases, Items]:
    """v1 and v2 from a features-mode run on the synthetic instance task, exported with the task's
    embed graphs and a 7-day window; v3 claiming v2's gate and expectation; the task's evaluation split."""
    from fctkit.export.release import build_release
    from fctkit.trainer.pipeline import run_pipeline
    from fctkit.trainer.pipeline_config import load_pipeline_config

    config = load_pipeline_config(None, {**INSTANCE_TRAINING, "seed": args.seed, "data.task": str(SYNTHETIC_TASK)})
    run_pipeline(config, work / "run", log=lambda line: None)
    split = load_task(SYNTHETIC_TASK).evaluation
    graphs = selection_graphs(work / "graphs", split)
    released = build_release(
        work / "run", work / "release", private_key=key, method="residual", graphs=graphs, rollback_window_days=7
    )
    v2 = released[1].bundle.root
    v3 = broken_v3(v2, work / "v3", key, args.seed, claims_v2s_health=True)
    return Releases(released[0].bundle.root, v2, v3), task_items(split, args)


def task_items(split: TaskSplit, args: argparse.Namespace) -> Items:
    """The split's gallery and queries as the rows ``[old | new]`` the embed graphs read."""
    if split.positives is None:
        raise ValueError(f"{SYNTHETIC_TASK} has no positives: the instance scenario needs an instance-level task")
    gallery = np.hstack([split.gallery.old, split.gallery.new]).astype(np.float32)
    asked = np.hstack([split.query.old, split.query.new]).astype(np.float32)
    indptr, indices = split.positives.indptr, split.positives.indices
    positives = [frozenset(indices[indptr[q] : indptr[q + 1]].tolist()) for q in range(len(asked))]
    return Items(gallery, None, fixed_queries(asked, args), asked, positives)


def fixed_queries(pool: np.ndarray, args: argparse.Namespace) -> np.ndarray:
    """``args.queries`` of ``pool``'s rows drawn at random: the queries every device answers (top-10)."""
    if args.queries > len(pool):
        raise ValueError(f"--queries {args.queries}: the {args.scenario} scenario has {len(pool)} queries to draw from")
    return pool[np.random.default_rng(args.seed + 1).choice(len(pool), args.queries, replace=False)]


def selection_graphs(out: Path, split: TaskSplit) -> UserGraphs:
    """The task's embed graphs, an item row ``[old | new]`` -> the old or the new model's columns
    (a MatMul by a 0/1 matrix: exactly the task's features), and the sample that checks them."""
    from onnx import helper

    from fctkit.export.features_release import UserGraphs

    out.mkdir(parents=True, exist_ok=True)
    old, new = split.gallery.old, split.gallery.new
    width = old.shape[1] + new.shape[1]
    paths = {}
    for name, picked in (("old", slice(0, old.shape[1])), ("new", slice(old.shape[1], width))):
        select = np.eye(width, dtype=np.float32)[:, picked]
        node = helper.make_node("MatMul", ["item", "select"], ["embedding"])
        paths[name] = _save(
            out / f"{name}.onnx", [node], {"item": width}, "embedding", select.shape[1], {"select": select}
        )
    np.savez(out / "sample.npz", input=np.hstack([old, new])[:64], old=old[:64], new=new[:64])
    return UserGraphs(paths["old"], paths["new"], out / "sample.npz")


def broken_v3(v2: Path, out: Path, key: Ed25519PrivateKey, seed: int, *, claims_v2s_health: bool = False) -> Path:
    """v3: v2's embed and ψ graphs, and a random orthogonal map as the 2 -> 3 adapter. Exported with
    the gate overridden on the record; ``claims_v2s_health``: signed with v2's gate cases and health
    expectation instead (what the gate judged of the intended adapter), so that nothing but the
    devices' own health reports can tell it is broken."""
    from onnx import helper

    from fctkit.export.bundle_builder import ArtifactSource, build_bundle
    from fctkit.protos.bundle import verify_bundle

    manifest = verify_bundle(v2, key.public_key()).manifest
    dim = manifest.embedding_dim
    out.mkdir(parents=True, exist_ok=True)
    weights = {"Q": random_isometry(dim, dim, seed), "zero": np.zeros(dim, dtype=np.float32)}
    h = _save(
        out / "forward_2_to_3.onnx",
        [helper.make_node("Gemm", ["old", "Q", "zero"], ["embedding"])],
        {"old": dim},
        "embedding",
        dim,
        weights,
    )
    artifacts = [ArtifactSource(v2 / a.file, a.role) for a in manifest.artifacts if a.role in ("embed", "side_info")]
    if claims_v2s_health:
        claims = {
            "gate": {"cases": manifest.gate["cases"], "ecc": {"forward_2_to_3": True}},
            "health_expectation": manifest.health_expectation,
        }
    else:
        claims = {
            "gate": {"cases": {}, "ecc": {"forward_2_to_3": False}},
            "force": True,
            "force_reason": "rollout benchmark: a deliberately broken adapter (random orthogonal map)",
        }
    return build_bundle(
        out / "v3",
        version=3,
        parents=(2,),
        mode=manifest.mode,
        distance=manifest.distance,
        normalize=manifest.normalize,
        artifacts=[*artifacts, ArtifactSource(h, "forward", 2, 3)],
        private_key=key,
        rollback_window_days=7,
        **claims,
    ).root


# --------------------------------------------------------------------------- the fleet


def enrol_fleet(server: LoopbackServer, items: Items, args: argparse.Namespace, work: Path) -> list[Member]:
    """``args.devices`` devices on v1, each holding ``args.rows_per_device`` gallery items drawn at
    random (without repeats on a device; devices overlap)."""
    total = len(items.gallery)
    rng = np.random.default_rng(args.seed)
    shares = [rng.choice(total, min(args.rows_per_device, total), replace=False) for _ in range(args.devices)]
    fleet = []
    for i, rows in enumerate(shares):
        name = f"device-{i + 1:03d}"
        device = Device.init(
            work / "devices" / name, settings=DeviceSettings(batch_size=256, health_sample=args.health_sample)
        )
        device.progress = False
        device.enrol(server.target, server.code(), device_name=name, root_fingerprint=server.fingerprint)
        device.sync()
        ids = [item_id(name, r) for r in rows]
        labels = [items.labels[r] for r in rows] if items.labels is not None else None
        device.add(items.gallery[rows], item_ids=ids, labels=labels)
        fleet.append(Member(name, device, rows, ids, [device.version]))
    return fleet


def sync_all(fleet: list[Member]) -> dict[str, list[str]]:
    """Every device syncs once, in fleet order; returns the notes of those that said something."""
    notes = {}
    for member in fleet:
        result = member.device.sync()
        member.versions_seen.append(member.device.version)
        if result.notes:
            notes[member.name] = result.notes
    return notes


def top10(device: Device, queries: np.ndarray) -> list[list[str]]:
    return [[m.item_id for m in matches] for matches in device.query(queries, k=10)]


def item_id(device_name: str, row: int) -> str:
    """The id a device gives the gallery row it holds."""
    return f"{device_name}-{int(row)}"


def own_recall(member: Member, task_queries: np.ndarray, positives: list[frozenset[int]]) -> float:
    """R@1 of the task's queries whose positive the device holds, against its gallery as it is now:
    the share whose first match is one of the query's positives."""
    held = {int(r) for r in member.rows}
    asked = [q for q, rows in enumerate(positives) if rows & held]
    if not asked:
        raise ValueError(f"{member.name} holds no positive of any query: give it more --rows-per-device")
    answers = member.device.query(task_queries[asked], k=1)
    hits = [
        bool(first) and first[0].item_id in {item_id(member.name, r) for r in positives[q]}
        for q, first in zip(asked, answers)
    ]
    return float(np.mean(hits))


def record_recall(members: list[Member], items: Items) -> None:
    """Each member's :func:`own_recall` on the version it runs now (instance level; else nothing)."""
    if items.task_queries is None or items.positives is None:
        return
    for m in members:
        m.true_recall[m.device.version] = own_recall(m, items.task_queries, items.positives)


def offered_versions(device: Device) -> list[int]:
    """What the server offers this device now: ListVersions through its own client."""
    with device.client() as client:
        return [v.version for v in client.list_versions()]


def rows_of(device: Device) -> tuple[int, list[str]]:
    return len(device.gallery), device.gallery.load().item_ids


def publish(server: LoopbackServer, bundle: Path, percent: float | None) -> None:
    archive = pack_bundle(bundle, server.work / f"{bundle.name}.tar")
    with server.admin() as admin:
        admin.publish_bundle(archive, rollout_percent=percent)


def sampled_health(members: list[Member], version: int) -> dict[str, HealthRecord]:
    """The health each member measured on a sample after upgrading to ``version`` (members without one: left out)."""
    records = {m.name: stored_health(m.device.gallery) for m in members}
    return {n: h for n, h in records.items() if h is not None and h.version == version and h.sample_size}


# --------------------------------------------------------------------------- figures


def distribution(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    return {"count": len(values), "min": min(values), "median": statistics.median(values), "max": max(values)}


def describe(name: str, values: list[float], samples: list[int]) -> str:
    d = distribution(values)
    if not d["count"]:
        return f"  {name}: no device reported"
    few = f"; each: {', '.join(f'{v:.4f}' for v in sorted(values))}" if len(values) <= 10 else ""
    return (
        f"  {name}: {d['count']} devices, mean cosine min {d['min']:.3f}, median {d['median']:.3f}, max {d['max']:.3f} "
        f"(rows sampled per device: {min(samples)} to {max(samples)}){few}"
    )


def stage_health(s: registry_pb2.RolloutStage) -> str:
    """A stage's health summaries: mean cosine, self-retrieval R@1 and, when the release records an
    expectation, the devices' measure as a fraction of it."""
    if not s.health.devices:
        return "no health yet"
    expected = f", vs expected median {s.expected_shortfall.median:.3f}" if s.expected_shortfall.devices else ""
    return (
        f"health {s.health.devices} devices, mean cosine median {s.health.median:.3f}, min {s.health.min:.3f}, "
        f"R@1 median {s.recall_at_1.median:.3f}{expected}"
    )


def print_status(status: registry_pb2.RolloutStatus) -> None:
    print(
        f"  server: v{status.version} state {status.state!r}, percent {status.percent:g}"
        + (f", halt reason: {status.halt_reason}" if status.halt_reason else "")
        + (
            f", withdrawn: {status.withdrawn_reason!r} (revert to v{status.revert_to})"
            if status.withdrawn_reason
            else ""
        )
    )
    for s in status.stages:
        methods = f", revert methods {dict(s.revert_methods)}" if s.revert_methods else ""
        print(
            f"    stage {s.stage} ({s.percent:g}%): offered {s.offered}, downloaded {s.downloaded}, upgraded {s.upgraded}, "
            f"failed {s.failed}, reverted {s.reverted}; {stage_health(s)}{methods}"
        )


# --------------------------------------------------------------------------- the run


@dataclass
class V3Outcome:
    """v3's first stage as it played out: its testers (device ids), the devices its stage holds (the
    testers and the server's bucket), those that took v3, how many of the fixed queries' top-10 each
    of them answered differently on v3, and the server's rollout status."""

    testers: set[str]
    in_stage: list[Member]
    took: list[Member]
    changed: list[int]
    status: registry_pb2.RolloutStatus


def storage_args(args: argparse.Namespace) -> list[str]:
    """`fctkit serve`'s storage arguments for ``--database``/``--object-store``; none: a data directory."""
    if not args.database:
        return []
    return [
        "--database",
        args.database,
        "--object-store",
        args.object_store,
        *(["--s3-endpoint-url", args.s3_endpoint_url] if args.s3_endpoint_url else []),
    ]


def roll_out_v2(
    server: LoopbackServer, fleet: list[Member], v2: Path, phases: Phases
) -> tuple[dict[str, HealthRecord], registry_pb2.RolloutStatus]:
    """v2 at each of :data:`V2_STAGES` (published staged: the server's default guard), every device
    syncing after each; returns the devices' sampled health and the server's rollout status."""
    for stage, percent in enumerate(V2_STAGES):
        with phases(f"v2 at {percent:g}%: every device syncs"):
            if stage == 0:
                publish(server, v2, percent)
            else:
                with server.admin() as admin:
                    admin.set_rollout(2, percent=percent)
            sync_all(fleet)
        print(f"  {sum(m.device.version == 2 for m in fleet)} of {len(fleet)} devices on v2")
    with server.admin() as admin:
        status = admin.rollout_status(2)
    print_status(status)
    return sampled_health(fleet, 2), status


def roll_out_v3(
    server: LoopbackServer, fleet: list[Member], v3: Path, queries: np.ndarray, args: argparse.Namespace, phases: Phases
) -> V3Outcome:
    """v3 at ``args.v3_percent`` with the first ``args.v3_cohort`` devices as testers, under the class
    scenario's explicit guard or the server's default one; every device syncs once."""
    guard = (
        {"halt_below": args.halt_below, "halt_min_devices": args.halt_min_devices} if args.scenario == "class" else {}
    )
    named = (
        f"the guard (halt below {args.halt_below}, at least {args.halt_min_devices} devices)"
        if guard
        else "the server's default guard alone"
    )
    with phases(f"v3 (broken) at {args.v3_percent:g}% with {named}: every device syncs"):
        publish(server, v3, args.v3_percent)
        testers = {m.device_id for m in fleet[: args.v3_cohort]}  # in v3's first stage whatever their bucket
        if guard or testers:
            with server.admin() as admin:
                admin.set_rollout(3, cohort=sorted(testers) if testers else None, **guard)
        sync_all(fleet)
    took = [m for m in fleet if m.device.version == 3]
    changed = [sum(a != b for a, b in zip(top10(m.device, queries), m.answers_before_v3)) for m in took]
    in_stage = [m for m in fleet if m.device_id in testers or bucket(m.device_id, 3) < args.v3_percent]
    for m in fleet:
        m.offered_while_v3_live = offered_versions(m.device)
    with server.admin() as admin:
        status = admin.rollout_status(3)
    print(
        f"  v3's first stage holds {len(in_stage)} devices (the server's bucket, {len(testers)} testers); "
        f"{len(took)} took v3, {len(in_stage) - len(took)} held back by the halt"
    )
    if took:
        print(
            f"  on v3, the devices that took it answered {sum(changed)} of {len(changed) * len(queries)} queries' "
            f"top-10 differently from before (per device: {min(changed)} to {max(changed)} of {len(queries)})"
        )
    print_status(status)
    return V3Outcome(testers, in_stage, took, changed, status)


def check_stage_size(v3: V3Outcome, args: argparse.Namespace, check: Checks) -> None:
    check(
        len(v3.in_stage) >= args.halt_min_devices,
        f"v3's {args.v3_percent:g}% stage holds {len(v3.in_stage)} devices, enough to trip the guard "
        f"(>= {args.halt_min_devices}; device ids are random: a small fleet can draw too few)",
    )


def class_health(
    v2_health: dict[str, HealthRecord], v3: V3Outcome, n_devices: int, check: Checks, args: argparse.Namespace
) -> None:
    """The mean cosine of v2's and v3's reporting devices, and whether it separates them at the guard's bound."""
    v3_health = sampled_health(v3.took, 3)
    print("\nhealth signal (mean cosine of h(old) vs φ_new on each device's sampled rows):")
    good_values, bad_values = [h.mean_cosine for h in v2_health.values()], [h.mean_cosine for h in v3_health.values()]
    good, bad = distribution(good_values), distribution(bad_values)
    print(describe("v2 (good FCT)", good_values, [h.sample_size for h in v2_health.values()]))
    print(describe("v3 (random orthogonal)", bad_values, [h.sample_size for h in v3_health.values()]))
    if good["count"] and bad["count"]:
        gap = good["min"] - bad["max"]
        print(f"  gap worst v2 - best v3: {gap:+.3f}")
        check(
            gap > 0 and bad["max"] < args.halt_below < good["min"],
            f"the signal separates v3 from v2 (worst v2 {good['min']:.3f} > halt {args.halt_below} > best v3 {bad['max']:.3f})",
        )
    check(good["count"] == n_devices, f"every device reported a sampled v2 health ({good['count']} of {n_devices})")
    check_stage_size(v3, args, check)


def expectation_of(status: registry_pb2.RolloutStatus) -> HealthExpectation:
    """The health expectation the server read from the release's signed manifest."""
    if not status.health_expectation_json:
        raise ValueError(f"v{status.version}'s manifest records no health expectation: the default guard needs one")
    return HealthExpectation.from_json(
        json.loads(status.health_expectation_json), f"v{status.version}'s rollout status"
    )


def ratios(health: dict[str, HealthRecord], expectation: HealthExpectation) -> list[float]:
    """Each device's measure (the release's level's) over what the release expects at its gallery
    size, as the server's default guard computes it."""
    measure = expectation.guard_measure
    return [expectation.ratio(measure, getattr(h, measure), h.gallery_rows or h.rows_upgraded) for h in health.values()]


def fleet_line(name: str, health: dict[str, HealthRecord], ratio: list[float]) -> str:
    if not health:
        return f"  {name}: no device reported"
    r1, cosine = distribution([h.recall_at_1 for h in health.values()]), [h.mean_cosine for h in health.values()]
    shown = distribution(ratio)
    return (
        f"  {name}: {r1['count']} devices, R@1 median {r1['median']:.3f} (min {r1['min']:.3f}, max {r1['max']:.3f}), "
        f"mean cosine median {statistics.median(cosine):.3f}, ratio to expected median {shown['median']:.3f} "
        f"(min {shown['min']:.3f}, max {shown['max']:.3f})"
    )


def default_guard_of(status: registry_pb2.RolloutStatus) -> tuple[str, float, int]:
    return status.guard_measure, status.halt_below, status.halt_min_devices


def instance_health(
    v2_health: dict[str, HealthRecord],
    v2_status: registry_pb2.RolloutStatus,
    v3: V3Outcome,
    fleet: list[Member],
    check: Checks,
    args: argparse.Namespace,
) -> None:
    """The default guard's signal on v2's and v3's reporting devices against its bound, the server's
    verdicts, and the devices' true R@1 on v1, v2 and v3."""
    expectation = expectation_of(v2_status)
    margin = DEFAULT_GUARD_MARGIN[expectation.level]
    bound = expectation.bound(margin, args.rows_per_device)  # every device holds as many rows
    v3_health = sampled_health(v3.took, 3)
    good, bad = ratios(v2_health, expectation), ratios(v3_health, expectation_of(v3.status))
    print(
        f"\nhealth signal (the default guard's: each device's self-retrieval {expectation.guard_measure} on its "
        f"{args.health_sample} sampled rows over what the release expects at its gallery size; halt under "
        f"{bound:.3f} (1 - {margin:g}, or the break-even at {args.rows_per_device} rows when above 1) once "
        f"{DEFAULT_GUARD_OWNERS} owners reported):"
    )
    print(fleet_line("v2 (residual InfoNCE)", v2_health, good))
    print(fleet_line("v3 (random orthogonal, v2's expectation)", v3_health, bad))
    check(len(v2_health) == len(fleet), f"every device reported a sampled v2 health ({len(v2_health)} of {len(fleet)})")
    check_stage_size(v3, args, check)
    default = ("expected", margin, DEFAULT_GUARD_OWNERS)
    check(
        default_guard_of(v2_status) == default_guard_of(v3.status) == default,
        f"v2 and v3 ran under the server's default guard (measure, margin, owners: {default_guard_of(v3.status)})",
    )
    good_median, bad_median = (statistics.median(r) if r else float("nan") for r in (good, bad))
    check(
        v2_status.state == "staged" and v2_status.percent == 100.0 and good_median >= bound,
        f"the default guard let v2 through: {v2_status.state!r} at {v2_status.percent:g}%, median ratio "
        f"{good_median:.3f} >= {bound:.3f}",
    )
    check(
        v3.status.state == "halted" and "recall_at_1" in v3.status.halt_reason and bad_median < bound,
        f"the default guard halted v3 on R@1: {v3.status.state!r}, median ratio {bad_median:.3f} < {bound:.3f}",
    )
    print_true_recall(fleet, v3, check)


def print_true_recall(fleet: list[Member], v3: V3Outcome, check: Checks) -> None:
    """The devices' true R@1 (their own queries) on v1 (not upgrading), v2 and v3, and the verdicts."""

    def mean(members: list[Member], version: int) -> float:
        return float(np.mean([m.true_recall[version] for m in members])) if members else float("nan")

    print("\ntrue R@1 on the devices (the task's queries whose positive a device holds, against its gallery; mean):")
    v1, v2 = mean(fleet, 1), mean(fleet, 2)
    print(f"  the fleet ({len(fleet)} devices): not upgrading (v1) {v1:.3f}, v2 {v2:.3f}")
    took = v3.took
    if took:
        print(
            f"  the {len(took)} devices that took v3: v1 {mean(took, 1):.3f}, v2 {mean(took, 2):.3f}, v3 {mean(took, 3):.3f}"
        )
    check(v2 > v1, f"v2 is better than not upgrading on the devices (true R@1 {v2:.3f} > {v1:.3f})")
    check(
        bool(took) and mean(took, 3) < mean(took, 1),
        f"v3 is worse than not upgrading on the devices that took it (true R@1 {mean(took, 3):.3f} < {mean(took, 1):.3f})",
    )


def guard_checks(v3: V3Outcome, fleet: list[Member], args: argparse.Namespace, check: Checks) -> None:
    """v3 halted at its first stage, taken only there, changing the answers of those that took it,
    never run nor offered outside."""
    print("\nthe guard:")
    check(v3.status.state == "halted", f"v3's rollout state is {v3.status.state!r} (halted by the guard)")
    expected_stages = [0.0, args.v3_percent] if v3.testers else [args.v3_percent]  # stage 0: the testers
    check(
        [s.percent for s in v3.status.stages] == expected_stages,
        f"v3's stages {[s.percent for s in v3.status.stages]}",
    )
    check(
        len(v3.took) >= args.halt_min_devices and all(m in v3.in_stage for m in v3.took),
        f"only devices of the first stage took v3 ({len(v3.took)}, all testers or with bucket < {args.v3_percent:g})",
    )
    check(
        bool(v3.took) and min(v3.changed) > 0,
        "v3 changed the answers of every device that took it (the revert has work to do)",
    )
    outside = [m for m in fleet if m not in v3.took]
    check(
        all(3 not in m.versions_seen and 3 not in m.device.installed_versions() for m in outside),
        f"the {len(outside)} other devices never ran v3 nor hold its bundle",
    )
    check(
        all(3 not in m.offered_while_v3_live for m in fleet if m not in v3.in_stage),
        "ListVersions through each outside device's own client did not offer v3 while it was live",
    )


def withdraw_v3(
    server: LoopbackServer,
    fleet: list[Member],
    v3: V3Outcome,
    queries: np.ndarray,
    work: Path,
    phases: Phases,
    check: Checks,
) -> None:
    """The publisher withdraws v3 (signed); every device syncs; every device back on v2 answering as before v3."""
    with phases("withdraw v3 (signed by the publisher); every device syncs"):
        signed = work / "withdrawal.3.json"
        write_withdrawal(signed, 3, 2, "rollout benchmark: the adapter is broken", server.key)
        with server.admin() as admin:
            admin.withdraw(signed.read_bytes())
        sync_all(fleet)
    with server.admin() as admin:
        withdrawn = admin.rollout_status(3)
    print_status(withdrawn)

    print("\nafter the withdrawal:")
    methods = {m.name: (r.method if (r := last_revert(m.device.gallery)) else None) for m in v3.took}
    print(
        f"  revert methods of the {len(v3.took)} devices that took v3: "
        f"{ {k: list(methods.values()).count(k) for k in sorted(set(methods.values()), key=str)} }"
    )
    check(all(m.device.version == 2 for m in fleet), "every device is on v2")
    check(
        all(top10(m.device, queries) == m.answers_before_v3 for m in v3.took),
        f"every device that took v3 answers every one of {len(queries)} queries' top-10 as before v3",
    )
    check(all(methods[m.name] == "exact" for m in v3.took), "every revert was exact (inside the rollback window)")
    check(
        all(top10(m.device, queries) == m.answers_before_v3 for m in fleet if m not in v3.took),
        "every other device's answers are unchanged too",
    )
    check(all(3 not in offered_versions(m.device) for m in fleet), "no device is offered v3 any more")
    check(
        withdrawn.state == "withdrawn"
        and sum(s.revert_methods.get("exact", 0) for s in withdrawn.stages) == len(v3.took),
        "the server's rollout status says withdrawn and counts the exact reverts",
    )


def rows_check(fleet: list[Member], recorded: dict[str, dict[str, tuple[int, list[str]]]], check: Checks) -> None:
    """Every device's rows now against ``recorded`` (label -> device -> rows then): none lost, none doubled."""
    print("\nrows:")
    rows_now = {m.name: rows_of(m.device) for m in fleet}
    for label, then in recorded.items():
        lost = sum(len(set(then[n][1]) - set(rows_now[n][1])) for n in then)
        doubled = sum(rows_now[n][0] - len(set(rows_now[n][1])) for n in rows_now)
        print(
            f"  against {label}: {sum(n for n, _ in then.values())} rows then, "
            f"{sum(n for n, _ in rows_now.values())} now; {lost} lost, {doubled} doubled"
        )
    at_start = recorded["at enrolment"]
    check(
        all(
            rows_now[m.name][0] == at_start[m.name][0] == len(set(rows_now[m.name][1]))
            and sorted(rows_now[m.name][1]) == sorted(at_start[m.name][1]) == sorted(m.item_ids)
            for m in fleet
        ),
        "0 rows lost or doubled on any device (counts and item ids)",
    )


SCENARIOS = {
    "class": ("train v1 and v2 on digits, export them (rollback window 7 days); build the broken v3", digits_releases),
    "instance": (
        "train v1 and v2 on the synthetic instance task, export them with its embed graphs (rollback window "
        "7 days); build the bad v3",
        task_releases,
    ),
}


def run(args: argparse.Namespace, work: Path, check: Checks, phases: Phases) -> None:
    storage = storage_args(args)
    if storage:
        print(f"server storage: PostgreSQL + S3 ({args.object_store})")
    title, releases_of = SCENARIOS[args.scenario]
    with LoopbackServer(work / "server", root_of_trust=True, storage=storage) as server:
        with phases(title):
            releases, items = releases_of(work / "train", server.key, args)
        with phases(f"publish v1 to everyone; enrol {args.devices} devices, install v1, add their shares"):
            publish(server, releases.v1, None)
            fleet = enrol_fleet(server, items, args, work)
        rows_at_start = {m.name: rows_of(m.device) for m in fleet}
        counts = [n for n, _ in rows_at_start.values()]
        print(f"  {sum(counts)} rows on {len(fleet)} devices ({min(counts)} to {max(counts)} each)")
        record_recall(fleet, items)

        v2_health, v2_status = roll_out_v2(server, fleet, releases.v2, phases)
        check(all(m.device.version == 2 for m in fleet), "v2 at 100%: every device upgraded to v2")
        check(
            [s.percent for s in v2_status.stages] == list(V2_STAGES),
            f"v2's stages {[s.percent for s in v2_status.stages]}",
        )
        for m in fleet:
            m.answers_before_v3 = top10(m.device, items.queries)
        rows_before_v3 = {m.name: rows_of(m.device) for m in fleet}
        record_recall(fleet, items)

        v3 = roll_out_v3(server, fleet, releases.v3, items.queries, args, phases)
        record_recall(v3.took, items)
        if args.scenario == "instance":
            instance_health(v2_health, v2_status, v3, fleet, check, args)
        else:
            class_health(v2_health, v3, len(fleet), check, args)
        guard_checks(v3, fleet, args, check)
        withdraw_v3(server, fleet, v3, items.queries, work, phases, check)
        rows_check(fleet, {"at enrolment": rows_at_start, "before v3": rows_before_v3}, check)
        for m in fleet:
            m.device.close()


def parsed(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default="class",
        help="class: digits, v3 halted by an explicit guard; instance: the synthetic instance task, v3 halted by "
        "the server's default guard",
    )
    parser.add_argument(
        "--devices", type=int, default=100, help="devices in the fleet (>= 50 for the acceptance figures)"
    )
    parser.add_argument(
        "--rows-per-device",
        type=int,
        default=64,
        help="evaluation items each device holds (more than --health-sample, the rows the "
        "health check re-embeds natively)",
    )
    parser.add_argument(
        "--health-sample",
        type=int,
        default=32,
        help="rows each device's health check re-embeds after an upgrade (its device.json health_sample)",
    )
    parser.add_argument("--queries", type=int, default=100, help="fixed queries every device answers (top-10)")
    parser.add_argument("--v3-percent", type=float, default=5.0, help="v3's first (and only) stage")
    parser.add_argument(
        "--v3-cohort",
        type=int,
        default=None,
        help="the first N devices are v3's testers (in its stage whatever the percent draws); default: 0 "
        f"(class), {DEFAULT_GUARD_OWNERS}, the owners the default guard waits for (instance)",
    )
    parser.add_argument(
        "--halt-below",
        type=float,
        default=None,
        help="v3's explicit guard (class scenario): halt when the median mean cosine is below this (default 0.65)",
    )
    parser.add_argument(
        "--halt-min-devices",
        type=int,
        default=None,
        help="v3's explicit guard (class scenario): once this many devices of it reported (default 2)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--database",
        default=None,
        help="serve on the scale-out backend: this PostgreSQL database (postgresql://...; with --object-store)",
    )
    parser.add_argument(
        "--object-store", default=None, help="with --database: s3://BUCKET/PREFIX (the bucket must exist)"
    )
    parser.add_argument(
        "--s3-endpoint-url",
        default=None,
        help="with --object-store: an S3-compatible endpoint (default: $AWS_ENDPOINT_URL, else AWS)",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="work in this new or empty folder and keep it (default: a temporary one)",
    )
    args = parser.parse_args(argv)
    if args.scenario == "instance":
        if args.halt_below is not None or args.halt_min_devices is not None:
            parser.error(
                "--halt-below and --halt-min-devices set the class scenario's explicit guard; "
                "the instance scenario runs v3 under the server's default guard"
            )
        args.halt_min_devices = DEFAULT_GUARD_OWNERS  # the reports the default guard waits for
    else:
        args.halt_below = 0.65 if args.halt_below is None else args.halt_below
        args.halt_min_devices = 2 if args.halt_min_devices is None else args.halt_min_devices
    if args.v3_cohort is None:
        args.v3_cohort = DEFAULT_GUARD_OWNERS if args.scenario == "instance" else 0
    if args.devices < 2 or min(args.queries, args.halt_min_devices, args.rows_per_device, args.health_sample) < 1:
        parser.error(
            "--devices must be >= 2; --rows-per-device, --health-sample, --queries and --halt-min-devices >= 1"
        )
    if (args.database is None) != (args.object_store is None) or (args.s3_endpoint_url and not args.object_store):
        parser.error("--database and --object-store go together (the scale-out backend); --s3-endpoint-url needs them")
    if args.keep and args.keep.exists() and any(args.keep.iterdir()):
        parser.error(f"--keep {args.keep} is not empty: give a new or empty folder")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parsed(argv)
    import logging

    import torch

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" at every export
    torch.set_num_threads(1)  # 8x8 images: one thread beats two on busy shared cores (as the demo does)
    check, phases = Checks(), Phases()
    start = time.perf_counter()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        run(args, args.keep, check, phases)
    else:
        with tempfile.TemporaryDirectory(prefix="fctkit-rollout-bench-") as tmp:
            run(args, Path(tmp), check, phases)
    print("\nphases (s):")
    for name, seconds in phases.seconds.items():
        print(f"  {seconds:7.1f}  {name}")
    print(f"  {time.perf_counter() - start:7.1f}  total")
    print(f"\nchecks: {check.passed} passed, {len(check.failed)} failed")
    for what in check.failed:
        print(f"  FAILED: {what}")
    return 1 if check.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
