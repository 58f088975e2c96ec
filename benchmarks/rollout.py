"""The rollout acceptance run (issue 36): staged releases, the devices' health signal, the halt
guard, a signed withdrawal and the devices' revert, on a real server and a fleet of devices.

    python benchmarks/rollout.py                         # 100 devices
    python benchmarks/rollout.py --devices 12 --queries 20 --v3-percent 50 --halt-min-devices 1   # a smoke run
    python benchmarks/rollout.py --database postgresql://USER@HOST/DB --object-store s3://BUCKET/PREFIX \
        [--s3-endpoint-url URL]                          # on PostgreSQL + S3 (credentials: the AWS_* variables)

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

Printed and checked (the exit status is 1 when any check fails): the health of v2's and v3's
reporting devices (count, min, median, max of mean cosine; the gap worst v2 − best v3) next to
the server's stage summaries; v3 changing the answers of the devices that took it; v3's rollout
halted at its first stage and only devices of that stage (by the server's own bucket of device
id and version) got it; every device that took v3 back
on v2 with every query's top-10 as before v3, and its revert method; every other device never
saw v3 (its versions, its installed bundles, and ListVersions through its own client while v3
was live); every device's rows before and after (count and item ids: none lost, none doubled);
each phase's seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _loopback import LoopbackServer
from edge_upgrade import _save
from upgrade_health_signal import random_isometry

from fctkit.edge_runtime import Device, DeviceSettings
from fctkit.edge_runtime.revert_records import last_revert
from fctkit.edge_runtime.upgrade_check import stored_health
from fctkit.protos.bundle import pack_bundle
from fctkit.protos.trust.withdrawal import write_withdrawal
from fctkit.server.rollout import bucket

V2_STAGES = (5.0, 25.0, 100.0)


@dataclass
class Member:
    """One device of the fleet and what was recorded of it."""

    name: str
    device: Device
    item_ids: list[str]
    versions_seen: list[int] = field(default_factory=list)  # its query version after each sync
    answers_before_v3: list[list[str]] = field(default_factory=list)
    offered_while_v3_live: list[int] = field(default_factory=list)

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


def train_and_release(work: Path, key, seed: int) -> tuple[Path, Path, Path]:
    """v1 and v2 the demo's way (``fctkit demo``'s digits training), exported with a 7-day window."""
    from fctkit.demo import DemoOptions, _train
    from fctkit.export.release import build_release

    _train(DemoOptions(devices=1, seed=seed, progress=False), work / "run", lambda line: None)
    released = build_release(work / "run", work / "release", private_key=key, method="fct", rollback_window_days=7)
    return work / "run", released[0].bundle.root, released[1].bundle.root


def broken_v3(v2: Path, out: Path, key, seed: int) -> Path:
    """v3: v2's embed and ψ graphs, and a random orthogonal map as the 2 -> 3 adapter."""
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
    return build_bundle(
        out / "v3",
        version=3,
        parents=(2,),
        mode=manifest.mode,
        distance=manifest.distance,
        normalize=manifest.normalize,
        artifacts=[*artifacts, ArtifactSource(h, "forward", 2, 3)],
        gate={"cases": {}, "ecc": {"forward_2_to_3": False}},
        private_key=key,
        force=True,
        force_reason="rollout benchmark: a deliberately broken adapter (random orthogonal map)",
        rollback_window_days=7,
    ).root


# --------------------------------------------------------------------------- the fleet


def enrol_fleet(
    server: LoopbackServer, run_dir: Path, args: argparse.Namespace, work: Path
) -> tuple[list[Member], np.ndarray]:
    """``args.devices`` devices on v1, each holding ``args.rows_per_device`` evaluation images
    drawn at random (without repeats on a device; devices overlap)."""
    from fctkit.export.trained_run import TrainedRun

    trained = TrainedRun.open(run_dir)
    images, labels = trained.eval_images, trained.eval_features["labels"]
    rng = np.random.default_rng(args.seed)
    shares = [
        rng.choice(len(labels), min(args.rows_per_device, len(labels)), replace=False) for _ in range(args.devices)
    ]
    fleet = []
    for i, rows in enumerate(shares):
        name = f"device-{i + 1:03d}"
        device = Device.init(
            work / "devices" / name, settings=DeviceSettings(batch_size=256, health_sample=args.health_sample)
        )
        device.progress = False
        device.enrol(server.target, server.code(), device_name=name, root_fingerprint=server.fingerprint)
        device.sync()
        ids = [f"{name}-{int(r)}" for r in rows]
        device.add(images[rows], item_ids=ids, labels=[str(int(x)) for x in labels[rows]])
        fleet.append(Member(name, device, ids, [device.version]))
    return fleet, images


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


def print_status(status) -> None:
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
        health = (
            f"health {s.health.devices} devices, median {s.health.median:.3f}, min {s.health.min:.3f}"
            if s.health.devices
            else "no health yet"
        )
        methods = f", revert methods {dict(s.revert_methods)}" if s.revert_methods else ""
        print(
            f"    stage {s.stage} ({s.percent:g}%): offered {s.offered}, downloaded {s.downloaded}, upgraded {s.upgraded}, "
            f"failed {s.failed}, reverted {s.reverted}; {health}{methods}"
        )


# --------------------------------------------------------------------------- the run


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


def run(args: argparse.Namespace, work: Path, check: Checks, phases: Phases) -> None:
    storage = storage_args(args)
    if storage:
        print(f"server storage: PostgreSQL + S3 ({args.object_store})")
    with LoopbackServer(work / "server", root_of_trust=True, storage=storage) as server:
        with phases("train v1 and v2 on digits, export them (rollback window 7 days); build the broken v3"):
            run_dir, v1, v2 = train_and_release(work / "train", server.key, args.seed)
            v3 = broken_v3(v2, work / "v3", server.key, args.seed)
        with phases(f"publish v1 to everyone; enrol {args.devices} devices, install v1, add their shares"):
            publish(server, v1, None)
            fleet, images = enrol_fleet(server, run_dir, args, work)
        rows_at_start = {m.name: rows_of(m.device) for m in fleet}
        print(
            f"  {sum(n for n, _ in rows_at_start.values())} rows on {len(fleet)} devices "
            f"({min(n for n, _ in rows_at_start.values())} to {max(n for n, _ in rows_at_start.values())} each)"
        )
        queries = images[np.random.default_rng(args.seed + 1).choice(len(images), args.queries, replace=False)]

        v2_health: dict[str, tuple[float, int]] = {}
        for stage, percent in enumerate(V2_STAGES):
            with phases(f"v2 at {percent:g}%: every device syncs"):
                if stage == 0:
                    publish(server, v2, percent)
                else:
                    with server.admin() as admin:
                        admin.set_rollout(2, percent=percent)
                sync_all(fleet)
            on_v2 = [m for m in fleet if m.device.version == 2]
            for m in on_v2:
                health = stored_health(m.device.gallery)
                if m.name not in v2_health and health is not None and health.version == 2 and health.sample_size:
                    v2_health[m.name] = health.mean_cosine, health.sample_size
            print(f"  {len(on_v2)} of {len(fleet)} devices on v2")
        with server.admin() as admin:
            v2_status = admin.rollout_status(2)
        print_status(v2_status)
        check(all(m.device.version == 2 for m in fleet), "v2 at 100%: every device upgraded to v2")
        check(
            [s.percent for s in v2_status.stages] == list(V2_STAGES),
            f"v2's stages {[s.percent for s in v2_status.stages]}",
        )

        for m in fleet:
            m.answers_before_v3 = top10(m.device, queries)
        rows_before_v3 = {m.name: rows_of(m.device) for m in fleet}

        with phases(
            f"v3 (broken) at {args.v3_percent:g}% with the guard (halt below {args.halt_below}, "
            f"at least {args.halt_min_devices} devices): every device syncs"
        ):
            publish(server, v3, args.v3_percent)
            testers = {m.device_id for m in fleet[: args.v3_cohort]}  # in v3's first stage whatever their bucket
            with server.admin() as admin:
                admin.set_rollout(
                    3,
                    halt_below=args.halt_below,
                    halt_min_devices=args.halt_min_devices,
                    cohort=sorted(testers) if testers else None,
                )
            sync_all(fleet)
        took_v3 = [m for m in fleet if m.device.version == 3]
        v3_health = {
            m.name: (h.mean_cosine, h.sample_size)
            for m in took_v3
            if (h := stored_health(m.device.gallery)) and h.version == 3 and h.sample_size
        }
        changed = [sum(a != b for a, b in zip(top10(m.device, queries), m.answers_before_v3)) for m in took_v3]
        in_stage = [m for m in fleet if m.device_id in testers or bucket(m.device_id, 3) < args.v3_percent]
        for m in fleet:
            m.offered_while_v3_live = offered_versions(m.device)
        with server.admin() as admin:
            v3_status = admin.rollout_status(3)
        print(
            f"  v3's first stage holds {len(in_stage)} devices (the server's bucket, {len(testers)} testers); "
            f"{len(took_v3)} took v3, "
            f"{len(in_stage) - len(took_v3)} held back by the halt"
        )
        if took_v3:
            print(
                f"  on v3, the devices that took it answered {sum(changed)} of {len(changed) * args.queries} queries' "
                f"top-10 differently from before (per device: {min(changed)} to {max(changed)} of {args.queries})"
            )
        print_status(v3_status)

        print("\nhealth signal (mean cosine of h(old) vs φ_new on each device's sampled rows):")
        good, bad = distribution([c for c, _ in v2_health.values()]), distribution([c for c, _ in v3_health.values()])
        print(describe("v2 (good FCT)", [c for c, _ in v2_health.values()], [k for _, k in v2_health.values()]))
        print(
            describe("v3 (random orthogonal)", [c for c, _ in v3_health.values()], [k for _, k in v3_health.values()])
        )
        if good["count"] and bad["count"]:
            gap = good["min"] - bad["max"]
            print(f"  gap worst v2 - best v3: {gap:+.3f}")
            check(
                gap > 0 and bad["max"] < args.halt_below < good["min"],
                f"the signal separates v3 from v2 (worst v2 {good['min']:.3f} > halt {args.halt_below} > best v3 {bad['max']:.3f})",
            )
        check(
            good["count"] == len(fleet), f"every device reported a sampled v2 health ({good['count']} of {len(fleet)})"
        )
        check(
            len(in_stage) >= args.halt_min_devices,
            f"v3's {args.v3_percent:g}% stage holds {len(in_stage)} devices, enough to trip the guard (>= {args.halt_min_devices}; "
            "device ids are random: a small fleet can draw too few)",
        )

        print("\nthe guard:")
        check(v3_status.state == "halted", f"v3's rollout state is {v3_status.state!r} (halted by the guard)")
        expected_stages = [0.0, args.v3_percent] if testers else [args.v3_percent]  # stage 0: the testers
        check(
            [s.percent for s in v3_status.stages] == expected_stages,
            f"v3's stages {[s.percent for s in v3_status.stages]}",
        )
        check(
            len(took_v3) >= args.halt_min_devices and all(m in in_stage for m in took_v3),
            f"only devices of the first stage took v3 ({len(took_v3)}, all testers or with bucket < {args.v3_percent:g})",
        )
        check(
            bool(took_v3) and min(changed) > 0,
            "v3 changed the answers of every device that took it (the revert has work to do)",
        )
        outside = [m for m in fleet if m not in took_v3]
        check(
            all(3 not in m.versions_seen and 3 not in m.device.installed_versions() for m in outside),
            f"the {len(outside)} other devices never ran v3 nor hold its bundle",
        )
        check(
            all(3 not in m.offered_while_v3_live for m in fleet if m not in in_stage),
            "ListVersions through each outside device's own client did not offer v3 while it was live",
        )

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
        methods = {m.name: (r.method if (r := last_revert(m.device.gallery)) else None) for m in took_v3}
        print(
            f"  revert methods of the {len(took_v3)} devices that took v3: "
            f"{ {k: list(methods.values()).count(k) for k in sorted(set(methods.values()), key=str)} }"
        )
        check(all(m.device.version == 2 for m in fleet), "every device is on v2")
        check(
            all(top10(m.device, queries) == m.answers_before_v3 for m in took_v3),
            f"every device that took v3 answers every one of {args.queries} queries' top-10 as before v3",
        )
        check(all(methods[m.name] == "exact" for m in took_v3), "every revert was exact (inside the rollback window)")
        check(
            all(top10(m.device, queries) == m.answers_before_v3 for m in outside),
            "every other device's answers are unchanged too",
        )
        check(all(3 not in offered_versions(m.device) for m in fleet), "no device is offered v3 any more")
        check(
            withdrawn.state == "withdrawn"
            and sum(s.revert_methods.get("exact", 0) for s in withdrawn.stages) == len(took_v3),
            "the server's rollout status says withdrawn and counts the exact reverts",
        )

        print("\nrows:")
        rows_now = {m.name: rows_of(m.device) for m in fleet}
        for label, recorded in (("at enrolment", rows_at_start), ("before v3", rows_before_v3)):
            lost = sum(len(set(recorded[n][1]) - set(rows_now[n][1])) for n in recorded)
            doubled = sum(rows_now[n][0] - len(set(rows_now[n][1])) for n in rows_now)
            print(
                f"  against {label}: {sum(n for n, _ in recorded.values())} rows then, "
                f"{sum(n for n, _ in rows_now.values())} now; {lost} lost, {doubled} doubled"
            )
        check(
            all(
                rows_now[n][0] == rows_at_start[n][0] == len(set(rows_now[n][1]))
                and sorted(rows_now[n][1]) == sorted(rows_at_start[n][1]) == sorted(m.item_ids)
                for m in fleet
                for n in [m.name]
            ),
            "0 rows lost or doubled on any device (counts and item ids)",
        )
        for m in fleet:
            m.device.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--devices", type=int, default=100, help="devices in the fleet (>= 50 for the acceptance figures)"
    )
    parser.add_argument(
        "--rows-per-device",
        type=int,
        default=64,
        help="evaluation images each device holds (more than --health-sample, the rows the "
        "health check re-embeds natively)",
    )
    parser.add_argument(
        "--health-sample",
        type=int,
        default=32,
        help="rows each device's health check re-embeds after an upgrade (its device.json health_sample)",
    )
    parser.add_argument("--queries", type=int, default=100, help="fixed query images every device answers (top-10)")
    parser.add_argument("--v3-percent", type=float, default=5.0, help="v3's first (and only) stage")
    parser.add_argument(
        "--v3-cohort",
        type=int,
        default=0,
        help="the first N devices are v3's testers (in its stage whatever the percent draws)",
    )
    parser.add_argument(
        "--halt-below", type=float, default=0.65, help="v3's guard: halt when the median mean cosine is below this"
    )
    parser.add_argument(
        "--halt-min-devices", type=int, default=2, help="v3's guard: once this many devices of it reported"
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
    if args.devices < 2 or min(args.queries, args.halt_min_devices, args.rows_per_device, args.health_sample) < 1:
        parser.error(
            "--devices must be >= 2; --rows-per-device, --health-sample, --queries and --halt-min-devices >= 1"
        )
    if (args.database is None) != (args.object_store is None) or (args.s3_endpoint_url and not args.object_store):
        parser.error("--database and --object-store go together (the scale-out backend); --s3-endpoint-url needs them")
    if args.keep and args.keep.exists() and any(args.keep.iterdir()):
        parser.error(f"--keep {args.keep} is not empty: give a new or empty folder")
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
