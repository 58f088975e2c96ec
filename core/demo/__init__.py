"""`fctkit demo`: the whole story of a model update on a small fleet, end to end.

1. a publisher key, the server's timestamp key and a root of trust naming both; 2. train v1
(old backbone + SimCLR side-info ψ) and v2 (new backbone + the FCT adapter h) — one `fctkit
train` run — and export both as signed bundles; 3. start `fctkit serve --root` in a subprocess
on a free loopback port; 4. publish v1; N devices enrol by the root's fingerprint, install v1 and add their share of the evaluation images (embedded locally, originals uploaded
sealed); 5. publish v2; every device syncs and upgrades its gallery in place with h;
6. one device backfills a fraction of its rows from the vault; 7. a before/after table per
device and overall, bytes moved and time per phase versus a full re-embed, written to
``report.{md,json,png}``.

The server runs in its own process group and is stopped on success, on error, on Ctrl-C
and on SIGTERM: nothing is left running.

This module runs the phases in order; the pieces live beside it: :mod:`.options` (what a
run is asked for), :mod:`.phases` (timing and interrupts), :mod:`.loopback_server` (the
server subprocess), :mod:`.fleet_story` (phases 4 to 6 and the figures) and :mod:`.results` (the
table and the report files).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fctkit.errors import InputError, require

from .fleet_story import fleet_story
from .loopback_server import DemoServer
from .options import DEMO_CONFIGS, DEMO_METHODS, DemoOptions
from .phases import Phases
from .results import CASES, render_table, write_report

if TYPE_CHECKING:
    import click

    from fctkit.trainer.pipeline import PipelineResult

MARKER = ".fctkit-demo"


@dataclass
class DemoResult:
    report: dict[str, Any]
    files: dict[str, Path]
    server_pid: int | None
    seconds: float


def run_demo(options: DemoOptions, log: Callable[[str], None] = print) -> DemoResult:
    """Run the demo (see the module docstring); returns the report and the files written."""
    start = time.perf_counter()
    out = _fresh_out(options.out)
    phases = Phases(log)
    server: DemoServer | None = None
    with phases.interrupts.installed():
        try:
            with phases("keys: a publisher key, the server's timestamp key, a root of trust naming both"):
                trust = _root_of_trust(out / "keys")
            with phases(
                f"train v1 (old backbone + SimCLR ψ) and v2 (new backbone + {options.method} adapter) on {options.data}"
            ):
                _train(options, out / "run", log)
            with phases("export and sign bundles v1, v2"):
                from fctkit.export.keys import load_private_key
                from fctkit.export.release import build_release

                released = build_release(
                    out / "run",
                    out / "release",
                    private_key=load_private_key(trust.publisher_key),
                    method=options.method,
                    progress=options.progress,
                )
            with phases("start `fctkit serve` on a free loopback port"):
                server = DemoServer(
                    out / "server" / "data",
                    None,
                    ("--root", str(trust.root), "--timestamp-key", str(trust.timestamp_key)),
                )
                server.data_dir.parent.mkdir(parents=True)
                server.start()
                assert server.process is not None  # started
                log(f"    server pid {server.process.pid} listening on {server.target}")
            report = fleet_story(options, out, server, [r.archive for r in released], phases, log, trust.fingerprint)
        finally:
            if server is not None:
                server.stop()
        phases.step()
    report["phases_s"] = {k: round(v, 3) for k, v in phases.seconds.items()}
    report["seconds"] = round(time.perf_counter() - start, 2)
    files = write_report(report, out)
    log(render_table(report))
    log(f"demo done in {report['seconds']:.1f} s; report: {files['markdown']}, {files['json']}, {files['png']}")
    return DemoResult(report, files, server.process.pid if server and server.process else None, report["seconds"])


@dataclass(frozen=True)
class DemoTrust:
    publisher_key: Path
    timestamp_key: Path
    root: Path
    fingerprint: str


def _root_of_trust(folder: Path) -> DemoTrust:
    """One publisher key, the server's online timestamp key and root.1.json (one root key, kept
    beside them: a demo; a fleet keeps k of n root keys offline, README "Keys and trust")."""
    from fctkit.export.keys import generate_keys, init_root, load_public_key
    from fctkit.protos.trust import root_fingerprint

    publisher_key, publisher_pub = generate_keys(folder / "publisher")
    timestamp_key, timestamp_pub = generate_keys(folder / "timestamp")
    root_file, signed, _ = init_root(
        folder / "root",
        root_keys=1,
        root_threshold=1,
        publisher_keys=[load_public_key(publisher_pub)],
        timestamp_keys=[load_public_key(timestamp_pub)],
    )
    return DemoTrust(publisher_key, timestamp_key, root_file, root_fingerprint(signed))


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


def _train(options: DemoOptions, run_dir: Path, log: Callable[[str], None]) -> PipelineResult:
    torch = require("torch", "train")
    from fctkit.trainer.pipeline import run_pipeline
    from fctkit.trainer.pipeline_config import load_pipeline_config

    overrides = {
        "seed": options.seed,
        "progress": options.progress,
        "methods": [options.method],
        "chain.enabled": False,
        "backfill.orderings": ["random", "class-mean-l2"],
    }
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


# --------------------------------------------------------------------------- the command


def _command() -> click.Command:
    import click

    @click.command("demo")
    @click.option("--data", type=click.Choice(sorted(DEMO_CONFIGS)), default="digits", show_default=True)
    @click.option("--devices", type=int, default=3, show_default=True, help="Simulated devices in the fleet.")
    @click.option(
        "--out",
        type=click.Path(path_type=Path),
        default=Path("runs/demo"),
        show_default=True,
        help="Output folder (emptied when it holds an earlier demo).",
    )
    @click.option(
        "--method", type=click.Choice(DEMO_METHODS), default="fct", show_default=True, help="The adapter method of v2."
    )
    @click.option(
        "--backfill-fraction",
        type=float,
        default=0.3,
        show_default=True,
        help="Share of one device's rows to backfill.",
    )
    @click.option(
        "--backfill-order",
        type=click.Choice(["random", "uncertainty", "class-mean-l2", "class-mean-cosine", "kmeans"]),
        default="class-mean-l2",
        show_default=True,
    )
    @click.option("--seed", type=int, default=0, show_default=True)
    @click.option("--quiet", is_flag=True, help="No progress bars.")
    def demo_command(
        data: str,
        devices: int,
        out: Path,
        method: str,
        backfill_fraction: float,
        backfill_order: str,
        seed: int,
        quiet: bool,
    ) -> None:
        """Train v1 and v2, serve them, upgrade a fleet of devices in place, backfill one; print the table."""
        run_demo(
            DemoOptions(data, devices, out, method, backfill_fraction, backfill_order, seed, not quiet), log=click.echo
        )

    return demo_command


demo_command = _command()

__all__ = [
    "CASES",
    "DEMO_CONFIGS",
    "DEMO_METHODS",
    "DemoOptions",
    "DemoResult",
    "DemoServer",
    "demo_command",
    "render_table",
    "run_demo",
]
