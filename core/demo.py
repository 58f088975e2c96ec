"""`fctkit demo`: the whole story of a model update on a small fleet, end to end.

1. a publisher key; 2. train v1 (old backbone + SimCLR side-info ψ) and v2 (new backbone +
the FCT adapter h) — one `fctkit train` run — and export both as signed bundles; 3. start
`fctkit serve` in a subprocess on a free loopback port; 4. publish v1; N devices enrol, install
v1 and add their share of the evaluation images (embedded locally, originals uploaded
sealed); 5. publish v2; every device syncs and upgrades its gallery in place with h;
6. one device backfills a fraction of its rows from the vault; 7. a before/after table per
device and overall, bytes moved and time per phase versus a full re-embed, written to
``report.{md,json,png}``.

The server runs in its own process group and is stopped on success, on error, on Ctrl-C
and on SIGTERM: nothing is left running.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fctkit.errors import FctkitError, InputError, require

MARKER = ".fctkit-demo"
CASES = ("old/old", "new/old", "new/h(old)", "after backfill", "new/new")
CASE_NOTES = {"new/old": "no adapter", "new/new": "bound: every image re-embedded"}

_ADAPTER_TRAINING = {"epochs": 40, "batch_size": 128, "lr": 2e-3, "warmup_epochs": 3}
#: Demo-sized training runs (small widths: seconds per stage on 2 cores).
DEMO_CONFIGS: dict[str, dict[str, Any]] = {
    "digits": {
        "data": {"name": "digits"},
        "old_backbone": {"architecture": "small", "embedding_dim": 32, "width": 8, "epochs": 20},
        "new_backbone": {"architecture": "wide", "embedding_dim": 64, "width": 8, "epochs": 20},
        "side_info": {"kind": "simclr", "dim": 16, "width": 8, "epochs": 25},
        "fct": {"branch_width": 64, "mixer_width": 256, "train": _ADAPTER_TRAINING},
        "fastfill": {"branch_width": 64, "mixer_width": 256, "train": _ADAPTER_TRAINING},
    },
    "fashion-mnist": {
        "data": {"name": "fashion-mnist", "max_items": 6000},
        "old_backbone": {"architecture": "small", "embedding_dim": 64, "width": 16, "epochs": 8},
        "new_backbone": {"architecture": "wide", "embedding_dim": 128, "width": 16, "epochs": 8},
        "side_info": {"kind": "simclr", "dim": 32, "width": 16, "epochs": 10},
        "fct": {"branch_width": 128, "mixer_width": 512, "train": {**_ADAPTER_TRAINING, "epochs": 30}},
        "fastfill": {"branch_width": 128, "mixer_width": 512, "train": {**_ADAPTER_TRAINING, "epochs": 30}},
    },
}
DEMO_METHODS = ("fct", "fastfill", "least-squares", "procrustes")


@dataclass
class DemoOptions:
    data: str = "digits"
    devices: int = 3
    out: Path = Path("runs/demo")
    method: str = "fct"
    backfill_fraction: float = 0.3
    backfill_order: str = "class-mean-l2"
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.data not in DEMO_CONFIGS:
            raise InputError(f"--data {self.data!r}: choose one of {', '.join(DEMO_CONFIGS)}")
        if self.method not in DEMO_METHODS:
            raise InputError(f"--method {self.method!r}: the demo runs forward-mode methods: {', '.join(DEMO_METHODS)}")
        if not 1 <= self.devices <= 32:
            raise InputError(f"--devices must be between 1 and 32, got {self.devices}")
        if not 0 < self.backfill_fraction <= 1:
            raise InputError(f"--backfill-fraction must be in (0, 1], got {self.backfill_fraction}")
        self.out = Path(self.out)


@dataclass
class DemoResult:
    report: dict[str, Any]
    files: dict[str, Path]
    server_pid: int | None
    seconds: float


class _Interrupts:
    """SIGINT (Ctrl-C) and SIGTERM raise KeyboardInterrupt, so ``finally`` stops the server,
    and are remembered: :meth:`check` raises again. A signal that lands while a library's
    finalizer runs (gRPC channels have ``__del__``) only prints "Exception ignored" and the
    run would go on; every phase boundary and every device's step checks, so the demo stops
    at the latest there and exits 130 whatever phase the signal hit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None

    def _handle(self, signum, frame) -> None:
        self.received = signum
        raise KeyboardInterrupt(f"signal {signum}")

    def check(self) -> None:
        if self.received is not None:
            raise KeyboardInterrupt(f"signal {self.received}")

    @contextmanager
    def installed(self) -> Iterator[_Interrupts]:
        """The handlers for the duration (outside the main thread: signals are left alone)."""
        try:
            previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        except ValueError:
            yield self
            return
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@dataclass
class _Phases:
    """Wall time of each phase, printed as it ends; a remembered interrupt stops the run at
    each phase's start and end (and at each :meth:`step`)."""

    log: Callable[[str], None]
    interrupts: _Interrupts = field(default_factory=_Interrupts)
    seconds: dict[str, float] = field(default_factory=dict)
    count: int = 0

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.step()
        self.count += 1
        self.log(f"[{self.count}] {name} ...")
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start
        self.log(f"[{self.count}] {name}: {self.seconds[name]:.1f} s")
        self.step()

    def step(self) -> None:
        self.interrupts.check()


# --------------------------------------------------------------------------- the server


class DemoServer:
    """`fctkit serve` in its own process group on a free loopback port (``extra_args`` are
    appended to its command line, e.g. ``("--replica-quota-bytes", "1099511627776")``)."""

    def __init__(self, data_dir: Path, publisher_pub: Path, extra_args: Sequence[str] = ()) -> None:
        self.data_dir = data_dir
        self.extra_args = tuple(extra_args)
        self.token_file = data_dir.parent / "admin.token"
        self.log_path = data_dir.parent / "server.log"
        self.publisher_pub = publisher_pub
        self.process: subprocess.Popen | None = None
        self.port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def admin_token(self) -> str:
        return self.token_file.read_text().strip()

    def start(self, timeout_s: float = 120.0) -> DemoServer:
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
        command = [sys.executable, "-m", "fctkit.cli", "serve", "--data", str(self.data_dir), "--port", "0",
                   "--publisher-key", str(self.publisher_pub), "--admin-token-file", str(self.token_file),
                   "--shutdown-grace", "2", *self.extra_args]
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL,
                                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith("{") and '"listening"' in line:
                    event = json.loads(line)
                    if event.get("event") == "listening":
                        self.port = int(event["port"])
                        return self
            if self.process.poll() is not None:
                raise FctkitError(f"the server exited with {self.process.returncode}; see {self.log_path}")
            time.sleep(0.05)
        raise FctkitError(f"the server did not start within {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it if it lingers."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def admin(self):
        from fctkit.protos.client import FctkitClient

        return FctkitClient(self.target, self.admin_token)


# --------------------------------------------------------------------------- the run


def run_demo(options: DemoOptions, log: Callable[[str], None] = print) -> DemoResult:
    """Run the demo (see the module docstring); returns the report and the files written."""
    start = time.perf_counter()
    out = _fresh_out(options.out)
    phases = _Phases(log)
    server: DemoServer | None = None
    with phases.interrupts.installed():
        try:
            with phases("publisher key"):
                from fctkit.export.keys import generate_keys, load_private_key

                private_path, public_path = generate_keys(out / "keys")
            with phases(f"train v1 (old backbone + SimCLR ψ) and v2 (new backbone + {options.method} adapter) on {options.data}"):
                _train(options, out / "run", log)
            with phases("export and sign bundles v1, v2"):
                from fctkit.export.release import build_release

                released = build_release(out / "run", out / "release", private_key=load_private_key(private_path),
                                         method=options.method, progress=options.progress)
            with phases("start `fctkit serve` on a free loopback port"):
                server = DemoServer(out / "server" / "data", public_path)
                server.data_dir.parent.mkdir(parents=True)
                server.start()
                log(f"    server pid {server.process.pid} listening on {server.target}")
            report = _fleet_story(options, out, server, [r.archive for r in released], phases, log)
        finally:
            if server is not None:
                server.stop()
        phases.step()
    report["phases_s"] = {k: round(v, 3) for k, v in phases.seconds.items()}
    report["seconds"] = round(time.perf_counter() - start, 2)
    files = _write_report(report, out)
    log(render_table(report))
    log(f"demo done in {report['seconds']:.1f} s; report: {files['markdown']}, {files['json']}, {files['png']}")
    return DemoResult(report, files, server.process.pid if server and server.process else None, report["seconds"])


def _fresh_out(out: Path) -> Path:
    """``out``, emptied when it holds an earlier demo; an unrelated non-empty folder is refused."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file: give a folder")
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).exists():
            raise InputError(f"{out} is not empty and was not written by `fctkit demo`: choose another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by `fctkit demo`; emptied by the next run\n")
    return out


def _train(options: DemoOptions, run_dir: Path, log: Callable[[str], None]):
    torch = require("torch", "train")
    from fctkit.trainer.pipeline import run_pipeline
    from fctkit.trainer.pipeline_config import load_pipeline_config

    overrides = {"seed": options.seed, "progress": options.progress, "methods": [options.method], "chain.enabled": False,
                 "backfill.orderings": ["random", "class-mean-l2"]}
    config_file = Path("configs") / f"{options.data}.toml"
    if options.data != "digits" and config_file.is_file():
        config = load_pipeline_config(config_file, overrides)
    else:
        from fctkit.config import from_mapping
        from fctkit.trainer.pipeline_config import PipelineConfig

        mapping = json.loads(json.dumps(DEMO_CONFIGS[options.data]))
        for dotted, value in overrides.items():
            node = mapping
            *parents, leaf = dotted.split(".")
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = value
        config = from_mapping(PipelineConfig, mapping)
    threads = torch.get_num_threads()
    if options.data == "digits":
        torch.set_num_threads(1)  # 8x8 images: one thread beats two on busy shared cores
    try:
        return run_pipeline(config, run_dir, log=lambda line: log(f"    {line}"))
    finally:
        torch.set_num_threads(threads)


@dataclass
class _Member:
    name: str
    device: Any
    rows: np.ndarray  # indices into the evaluation split
    ids: list[str]


def _fleet_story(options: DemoOptions, out: Path, server: DemoServer, archives: list[Path],
                 phases: _Phases, log: Callable[[str], None]) -> dict[str, Any]:
    from fctkit.edge_runtime import Device, DeviceSettings
    from fctkit.export.trained_run import TrainedRun

    trained = TrainedRun.open(out / "run")
    images, labels = trained.eval_images, trained.eval_features["labels"]
    shares = np.array_split(np.random.default_rng(options.seed).permutation(len(labels)), options.devices)
    fleet: list[_Member] = []
    measures: dict[str, dict[str, Any]] = {}
    with phases("publish v1"):
        with server.admin() as admin:
            admin.publish_bundle(archives[0])
    with phases(f"enrol {options.devices} devices; each installs v1 and adds its share (sealed uploads)"):
        for i, rows in enumerate(shares):
            phases.step()
            name = f"device-{i + 1}"
            device = Device.init(out / "devices" / name, settings=DeviceSettings(batch_size=256))
            device.progress = options.progress
            with server.admin() as admin:
                code = admin.create_enrolment_code(label=name).code
            device.enrol(server.target, code, device_name=name)
            device.sync()
            ids = [f"{name}-{int(r)}" for r in rows]
            device.add(images[rows], item_ids=ids, labels=[str(int(x)) for x in labels[rows]])
            fleet.append(_Member(name, device, rows, ids))
            measures[name] = {"rows": len(rows), "bundle_bytes": {"v1": _dir_bytes(device.root / "bundles" / "v1")},
                              "vault_upload_bytes": _vault_bytes(device), "cases": {}}
            log(f"    {name}: {len(rows)} rows at v1, {measures[name]['vault_upload_bytes']:,} sealed bytes in the vault")
    distance = trained.distance
    for member in fleet:
        measures[member.name]["cases"]["old/old"] = _vectors(member, images, lambda d, x: d.query_vectors(x))
    with phases("publish v2"):
        with server.admin() as admin:
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
    with phases(f"{backfiller.name} backfills {budget} rows ({options.backfill_fraction:.0%}, {options.backfill_order}) from the vault"):
        started = time.perf_counter()
        backfill = backfiller.device.backfill(budget, order=options.backfill_order)
        backfill_s = time.perf_counter() - started
    for member in fleet:
        measures[member.name]["cases"]["after backfill"] = _vectors(member, images, lambda d, x: d.query_vectors(x))
    report = _assemble(options, trained, fleet, measures, labels, distance, backfill, backfill_s, upgrade_rows, images)
    for member in fleet:
        member.device.close()
    return report


def _vectors(member: _Member, images: np.ndarray, query: Callable) -> tuple[np.ndarray, np.ndarray]:
    """(queries, gallery rows) of a device's own items, aligned item by item."""
    device = member.device
    loaded = device.gallery.load(with_labels=False)
    position = {item: i for i, item in enumerate(loaded.item_ids)}
    from fctkit.edge_runtime.gallery import take_rows

    gallery = take_rows(loaded.embeddings, [position[i] for i in member.ids])
    return query(device, images[member.rows]), gallery


def _native_new(member: _Member, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    vectors = member.device.engine(2).embed(images[member.rows])
    return vectors, vectors


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _vault_bytes(device) -> int:
    with device.client() as client:
        return sum(b.size for b in client.list_blobs())


def _evaluate(pairs: list[tuple[np.ndarray, np.ndarray]], labels: list[np.ndarray], distance: str) -> dict[str, float]:
    from fctkit.trainer.evaluation import evaluate_retrieval

    query = np.concatenate([q for q, _ in pairs])
    gallery = np.concatenate([g for _, g in pairs])
    n = min(query.shape[1], gallery.shape[1])  # new/old without adapter: compare the first n dims
    y = np.concatenate(labels)
    result = evaluate_retrieval(query[:, :n], y, gallery[:, :n], y, distance=distance, topk=(1, 5), leave_one_out=True)
    return {"top1": round(result.top1, 4), "top5": round(result.cmc[5], 4), "mAP": round(result.mean_ap, 4)}


def _assemble(options, trained, fleet, measures, labels, distance, backfill, backfill_s, upgrade_rows, images) -> dict[str, Any]:
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
        "data": options.data, "method": options.method, "devices": options.devices, "distance": distance,
        "rows": total_rows, "seed": options.seed,
        "per_device": per_device, "overall": overall,
        "ecc": {"holds": overall["new/h(old)"]["top1"] > overall["old/old"]["top1"],
                "rule": "M(new, h(old)) > M(old, old), top-1 over the fleet"},
        "trainer_figures": trained.gate["cases"],
        "backfill": {"device": fleet[0].name, "order": backfill.order, "rows": backfill.backfilled,
                     "fraction": options.backfill_fraction, "bytes_downloaded": backfill.bytes_downloaded,
                     "seconds": round(backfill_s, 3)},
        "bytes": {
            "bundle_v1": per_device[fleet[0].name]["bundle_bytes"]["v1"],
            "bundle_v2": per_device[fleet[0].name]["bundle_bytes"]["v2"],
            "bundles_to_fleet": sum(sum(d["bundle_bytes"].values()) for d in per_device.values()),
            "vault_uploads": vault_bytes,
            "backfill_downloads": backfill.bytes_downloaded,
            "full_reembed_downloads": vault_bytes,
        },
        "cost": {
            "upgrade_s": round(upgrade_s, 3), "upgrade_rows": upgrade_rows,
            "upgrade_per_row_ms": round(1000 * upgrade_s / max(upgrade_rows, 1), 4),
            "backfill_per_row_ms": round(1000 * per_row_backfill_s, 4),
            "embed_per_row_ms": round(1000 * per_row_embed_s, 4),
            "full_reembed_estimate_s": round(per_row_backfill_s * total_rows, 3),
            "backfill_row_over_upgrade_row": round(per_row_backfill_s / max(upgrade_s / max(upgrade_rows, 1), 1e-12), 2),
            "note": "full re-embed = every device downloads and opens every original and re-embeds it: "
                    "rows x the per-row cost measured by this run's backfill (download + decrypt + embed + write)",
        },
    }


def _per_row_embed_seconds(device, images: np.ndarray) -> float:
    engine = device.engine()
    started = time.perf_counter()
    engine.embed(images)
    engine.side_info(images)
    return (time.perf_counter() - started) / len(images)


# --------------------------------------------------------------------------- the report


def render_table(report: dict[str, Any]) -> str:
    """The before/after table (top-1 / mAP per device and overall), bytes and costs, as markdown."""
    names = list(report["per_device"])
    header = "| case | " + " | ".join(names) + " | overall |"
    lines = [f"## fctkit demo: {report['data']}, {report['devices']} devices, {report['rows']} rows, method {report['method']}",
             "", "top-1 / mAP, leave-one-out (each device: its own items as queries and gallery)", "",
             header, "|" + "---|" * (len(names) + 2)]
    for case in CASES:
        label = case + (f" ({CASE_NOTES[case]})" if case in CASE_NOTES else "")
        if case == "after backfill":
            label += f" ({report['backfill']['device']}: {report['backfill']['rows']} rows, {report['backfill']['order']})"
        cells = [_cell(report["per_device"][n]["cases"][case]) for n in names] + [_cell(report["overall"][case])]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    b, c = report["bytes"], report["cost"]
    lines += [
        "", f"ECC (new/h(old) > old/old): {'holds' if report['ecc']['holds'] else 'FAILS'}", "",
        "| transfer | bytes |", "|---|---|",
        f"| bundle v1 / v2 (per device) | {b['bundle_v1']:,} / {b['bundle_v2']:,} |",
        f"| bundles to the fleet | {b['bundles_to_fleet']:,} |",
        f"| sealed originals uploaded to the vault | {b['vault_uploads']:,} |",
        f"| partial backfill downloads | {b['backfill_downloads']:,} |",
        f"| a full re-embed would download | {b['full_reembed_downloads']:,} |",
        "", "| cost | value |", "|---|---|",
        f"| in-place upgrade, all devices | {c['upgrade_s']:.2f} s for {c['upgrade_rows']} rows ({c['upgrade_per_row_ms']:.3f} ms/row) |",
        f"| backfill per row (download + decrypt + embed + write) | {c['backfill_per_row_ms']:.3f} ms |",
        f"| embed + side-info per row alone | {c['embed_per_row_ms']:.3f} ms |",
        f"| full re-embed of the fleet (estimate) | {c['full_reembed_estimate_s']:.2f} s |",
        f"| a backfilled row costs (same run) | {c['backfill_row_over_upgrade_row']:.1f}x an upgraded row |",
        "", "| phase | seconds |", "|---|---|",
        *(f"| {name} | {s:.1f} |" for name, s in report.get("phases_s", {}).items()),
    ]
    return "\n".join(lines)


def _cell(metrics: dict[str, float]) -> str:
    return f"{metrics['top1']:.3f} / {metrics['mAP']:.3f}"


def _write_report(report: dict[str, Any], out: Path) -> dict[str, Path]:
    files = {"json": out / "report.json", "markdown": out / "report.md", "png": out / "report.png"}
    files["json"].write_text(json.dumps(report, indent=2, sort_keys=True, default=float) + "\n")
    files["markdown"].write_text(render_table(report) + "\n")
    _plot(report, files["png"])
    return files


def _plot(report: dict[str, Any], path: Path) -> None:
    figure = _figure(report)
    figure.savefig(path, dpi=110)


def _figure(report: dict[str, Any]) -> Any:
    from matplotlib.figure import Figure

    columns = [*report["per_device"], "overall"]
    figure = Figure(figsize=(13, 4.5))
    left, right = figure.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / len(CASES)
    for k, case in enumerate(CASES):
        values = [report["per_device"][c]["cases"][case]["top1"] for c in columns[:-1]] + [report["overall"][case]["top1"]]
        left.bar(np.arange(len(columns)) + (k - (len(CASES) - 1) / 2) * width, values, width, label=case)
    left.set_xticks(np.arange(len(columns)), columns)
    left.set_ylabel("top-1 (leave-one-out)")
    left.set_ylim(0, 1.05)
    left.set_title(f"model update v1 -> v2 on {report['data']} ({report['method']})")
    # below the axes, in one row: inside, it covered the bars of the last group
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(CASES), frameon=False)
    c = report["cost"]
    bars = {"in-place upgrade\n(all devices)": c["upgrade_s"],
            f"partial backfill\n({report['backfill']['rows']} rows)": report["backfill"]["seconds"],
            "full re-embed\n(estimate)": c["full_reembed_estimate_s"]}
    right.bar(list(bars), list(bars.values()), color=["tab:green", "tab:orange", "tab:red"])
    right.set_ylabel("seconds")
    right.set_title("device-side cost")
    figure.tight_layout()
    return figure


# --------------------------------------------------------------------------- the command


def _command():
    import click

    @click.command("demo")
    @click.option("--data", type=click.Choice(sorted(DEMO_CONFIGS)), default="digits", show_default=True)
    @click.option("--devices", type=int, default=3, show_default=True, help="Simulated devices in the fleet.")
    @click.option("--out", type=click.Path(path_type=Path), default=Path("runs/demo"), show_default=True,
                  help="Output folder (emptied when it holds an earlier demo).")
    @click.option("--method", type=click.Choice(DEMO_METHODS), default="fct", show_default=True, help="The adapter method of v2.")
    @click.option("--backfill-fraction", type=float, default=0.3, show_default=True, help="Share of one device's rows to backfill.")
    @click.option("--backfill-order", type=click.Choice(["random", "uncertainty", "class-mean-l2", "class-mean-cosine", "kmeans"]),
                  default="class-mean-l2", show_default=True)
    @click.option("--seed", type=int, default=0, show_default=True)
    @click.option("--quiet", is_flag=True, help="No progress bars.")
    def demo_command(data, devices, out, method, backfill_fraction, backfill_order, seed, quiet) -> None:
        """Train v1 and v2, serve them, upgrade a fleet of devices in place, backfill one; print the table."""
        run_demo(DemoOptions(data, devices, out, method, backfill_fraction, backfill_order, seed, not quiet),
                 log=click.echo)

    return demo_command


demo_command = _command()

__all__ = ["DemoOptions", "DemoResult", "DemoServer", "run_demo", "render_table", "demo_command"]
