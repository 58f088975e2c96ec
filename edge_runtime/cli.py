"""`fctkit device …`: the device command line (torch-free)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import click

from fctkit.errors import GalleryDamagedError, InputError

from .adding import ON_BAD_ITEM
from .crypto import key_file_wrapped
from .device import Device, DeviceSettings
from .device_trust import trust_alarm
from .device_trust_sync import CHOOSE
from .engine import PREFERENCE
from .item_sources import read_items
from .rebuild import REBUILD_LEAD, rebuild_advice
from .sqlite_file import RECOVERY
from .upgrade_check import stored_health
from .work_window import PAUSED_EXIT, Window, paused_report

DAMAGED_EXIT = 3  # answers were given, but damaged rows were left out (see `fctkit device check`)
STALE_EXIT = (
    4  # `status`: no fresh timestamp for longer than the root allows (possible freeze), or a clock that may be wrong
)

_DIR = click.option(
    "--dir",
    "root",
    type=click.Path(path_type=Path),
    default=lambda: os.environ.get("FCTKIT_DEVICE", "device"),
    show_default="$FCTKIT_DEVICE or ./device",
    help="The device directory.",
)
_PASSPHRASE = click.option(
    "--passphrase-env", metavar="VAR", default=None, help="Environment variable holding the key file's passphrase."
)
_NO_HEALTH = click.option(
    "--no-health-check",
    is_flag=True,
    help="After an upgrade, do not re-embed a sample of rows from the vault to measure its health "
    "(health_sample 0 in device.json turns it off for good).",
)
_MAX_SECONDS = click.option(
    "--max-seconds",
    type=click.FloatRange(min=0),
    default=None,
    help="A background window: pause after the committed batch that ends past this many seconds (exit 5).",
)
_MAX_ROWS = click.option(
    "--max-rows",
    type=click.IntRange(min=1),
    default=None,
    help="A background window: pause after the committed batch that reaches this many rows (exit 5; batches "
    "are never cut, so it may go up to one batch over).",
)
_KEY_PASSPHRASE = click.option(
    "--key-passphrase-env",
    metavar="VAR",
    default=None,
    help="Environment variable holding the exported owner key's passphrase (else prompted).",
)


def _passphrase(var: str | None) -> str | None:
    if var is None:
        return None
    if var not in os.environ:
        raise InputError(f"environment variable {var} is not set (it should hold the passphrase)")
    return os.environ[var]


def _key_passphrase(var: str | None, *, confirm: bool) -> str:
    """The exported owner key's passphrase: from the environment variable, else prompted."""
    passphrase = _passphrase(var)
    if passphrase is not None:  # var was given (an unset one raised)
        return passphrase
    return click.prompt("Owner key passphrase", hide_input=True, confirmation_prompt=confirm)


def _open(root: Path, passphrase_env: str | None, quiet: bool = False, no_health_check: bool = False) -> Device:
    device = Device.open(root, passphrase=_passphrase(passphrase_env))
    device.progress = not quiet
    if no_health_check:  # for this command only: device.json is not rewritten
        device.settings = dataclasses.replace(device.settings, health_sample=0)
    return device


def _with_health(device: Device, result: dict) -> dict:
    """A sync's or upgrade's output with the last upgrade's health check (None before any)."""
    record = stored_health(device.gallery)
    return {**result, "upgrade_health": None if record is None else dataclasses.asdict(record)}


def _echo(data) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def _window_flags(window: Window) -> str:
    """The window's own flags, for the command that continues."""
    seconds = "" if window.max_seconds is None else f" --max-seconds {window.max_seconds:g}"
    return seconds + ("" if window.max_rows is None else f" --max-rows {window.max_rows}")


def _echo_paused(result: dict, rows_left: int, rows_total: int, command: str) -> None:
    """Print a paused call's result with how far it is, say so on stderr and exit 5 (PAUSED_EXIT)."""
    report = paused_report(rows_left, rows_total, command)
    _echo({**result, **report})
    click.echo(
        f"paused: the window was spent; {report['rows_done']} of {rows_total} row(s) done, {rows_left} left; "
        f"continue with `{command}`",
        err=True,
    )
    sys.exit(PAUSED_EXIT)


def _echo_report(report: dict, *, damaged: bool) -> None:
    """Print a JSON report; exit 3 (DAMAGED_EXIT) when it reports damage."""
    _echo(report)
    if damaged:
        sys.exit(DAMAGED_EXIT)


@click.group("device")
def device_command() -> None:
    """The on-device runtime: encrypted gallery, local embedding, signed sync, upgrades.

    \b
    Exit codes:
      0    done
      2    a usage error, or refused: the kit's error message on stderr says why and what to do
      3    damage reported: `query` answered without damaged rows or labels, `status`/`check`
           found damage, or `repair` left damage it cannot fix on the device
      4    `status` only, when there is no damage: trust is stale ("stale: possible freeze", no
           fresh timestamp for longer than the root allows), the device clock may be wrong, or
           the trust files are damaged
      5    `upgrade`/`backfill` only: paused, more to do. The window (--max-seconds, --max-rows)
           was spent after a committed batch; the gallery is consistent and the output says how
           many rows are left and the command that continues (the same command again)
      130  interrupted
    """


@device_command.command("init")
@_DIR
@_PASSPHRASE
@click.option(
    "--root",
    "trust_root",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Pin this root of trust (root.N.json from the publisher, signed by a threshold of its own root keys); "
    "excludes --publisher-key.",
)
@click.option(
    "--publisher-key",
    type=click.Path(exists=True, dir_okay=False),
    help="Pin this publisher key now (offline devices, before roots of trust); excludes --root.",
)
@click.option(
    "--providers",
    default=",".join(PREFERENCE),
    show_default=True,
    help="Execution providers allowed, in preference order.",
)
@click.option(
    "--batch-size", type=int, default=1024, show_default=True, help="Rows per ONNX Runtime call and per upgrade commit."
)
@click.option(
    "--threads", type=int, default=0, show_default=True, help="ONNX Runtime intra-op threads (0: its default)."
)
@click.option("--search-backend", type=click.Choice(["auto", "numpy", "faiss"]), default="auto", show_default=True)
@click.option(
    "--import-key",
    "import_key",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="The owner key exported by another device of the owner (`fctkit device export-key`): join it, or restore.",
)
@_KEY_PASSPHRASE
def init_command(
    root,
    passphrase_env,
    trust_root,
    publisher_key,
    providers,
    batch_size,
    threads,
    search_backend,
    import_key,
    key_passphrase_env,
) -> None:
    """Create a device: a new 0600 device key (passphrase-wrapped with --passphrase-env), an
    owner key (new, or imported with --import-key) and an empty gallery."""
    settings = DeviceSettings(
        providers=tuple(p.strip() for p in providers.split(",") if p.strip()),
        batch_size=batch_size,
        threads=threads,
        search_backend=search_backend,
    )
    _ = settings.engine  # evaluated for its check: it validates the engine choices before anything is written
    if trust_root and publisher_key:
        raise click.UsageError(
            "--root and --publisher-key exclude each other: pin a root of trust, or (before roots) one key"
        )
    wrapped = import_key is not None and key_file_wrapped(import_key)  # an unwrapped key needs no passphrase
    owner_passphrase = _key_passphrase(key_passphrase_env, confirm=False) if wrapped else None
    with Device.init(
        root,
        passphrase=_passphrase(passphrase_env),
        publisher_key=publisher_key,
        settings=settings,
        owner_key_file=import_key,
        owner_key_passphrase=owner_passphrase,
        trust_root=trust_root,
    ) as device:
        _echo(
            {
                "device": str(device.root),
                "gallery_id": device.gallery.gallery_id.hex(),
                "owner_key_imported": bool(import_key),
                "root_version": device.trust.status()["root_version"],
            }
        )


@device_command.command("export-key")
@_DIR
@_PASSPHRASE
@click.argument("out", type=click.Path(path_type=Path, dir_okay=False))
@_KEY_PASSPHRASE
def export_key_command(root, passphrase_env, out, key_passphrase_env) -> None:
    """Write the owner key to OUT (new, 0600), wrapped by a passphrase (scrypt), for
    `fctkit device init --import-key OUT` on the owner's other or replacement devices."""
    with _open(root, passphrase_env) as device:
        device.export_owner_key(out, _key_passphrase(key_passphrase_env, confirm=True))
        _echo({"exported": str(out), "owner_id": device.settings.owner_id})


@device_command.command("enrol")
@_DIR
@_PASSPHRASE
@click.option("--server", required=True, help="host:port of the fctkit server.")
@click.option("--code", required=True, help="The enrolment code an admin created (`fctkit admin enrol-code`).")
@click.option("--name", default="", help="A name for this device in the fleet.")
@click.option(
    "--tls-ca",
    "--tls-root",
    "tls_root",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="PEM CA certificate to trust: connect with TLS (the same flag as `fctkit admin --tls-ca`; "
    "--tls-root is its older name).",
)
@click.option(
    "--tls-cert",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="PEM client certificate, for a server that requires one (`fctkit serve --tls-ca`); with --tls-key.",
)
@click.option(
    "--tls-key", type=click.Path(exists=True, dir_okay=False), default=None, help="PEM private key of --tls-cert."
)
@click.option(
    "--root",
    "trust_root",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Start from this root file (from the publisher, offline) and walk the server's newer roots from it.",
)
@click.option(
    "--root-fingerprint",
    metavar="SHA256",
    default=None,
    help="Pin the server's root with this fingerprint (printed by `fctkit keys init-root`); refuse any other.",
)
@click.option(
    "--trust-on-first-use",
    is_flag=True,
    help="Accept whatever root (or, from a server without one, publisher key) the server offers, unchecked.",
)
def enrol_command(
    root,
    passphrase_env,
    server,
    code,
    name,
    tls_root,
    tls_cert,
    tls_key,
    trust_root,
    root_fingerprint,
    trust_on_first_use,
) -> None:
    """Enrol with a server: get a device token and take its root of trust. The server and TLS
    files are kept in the device's settings: later syncs connect the same way (enrol again with
    a new code to change them).

    A device that pins nothing yet needs exactly one of --root, --root-fingerprint and
    --trust-on-first-use. Trust on first use accepts whatever this server offers at this moment:
    a dishonest server or network then owns the device for good. A refusal (a wrong fingerprint,
    a forged chain, a server without a root when one was asked for) writes nothing: no token,
    no root (the code is spent; ask for a new one). A device that already pins a root (init
    --root) or a publisher key checks the server against it."""
    if sum((trust_root is not None, root_fingerprint is not None, trust_on_first_use)) > 1:
        raise click.UsageError("--root, --root-fingerprint and --trust-on-first-use exclude each other. " + CHOOSE)
    with _open(root, passphrase_env) as device:
        device_id = device.enrol(
            server,
            code,
            device_name=name,
            tls_ca=tls_root,
            tls_cert=tls_cert,
            tls_key=tls_key,
            trust_root=trust_root,
            root_fingerprint=root_fingerprint,
            trust_on_first_use=trust_on_first_use,
        )
        _echo({"device_id": device_id, "owner_id": device.settings.owner_id, "trust": device.trust.status()})


_SOURCES = click.argument("sources", nargs=-1, required=True, type=click.Path(path_type=Path))
_ON_BAD_ITEM = click.option(
    "--on-bad-item",
    type=click.Choice(ON_BAD_ITEM),
    default="refuse",
    show_default=True,
    help="An item the bundle's preprocessing cannot take (a corrupt image, an empty text, a text "
    "over the limit): refuse the whole call (nothing is stored), or skip it. Either way it "
    "is reported by id.",
)


def _skipped(skipped: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"id": item_id, "reason": reason} for item_id, reason in skipped]


@device_command.command("add")
@_DIR
@_PASSPHRASE
@_SOURCES
@click.option("--no-upload", is_flag=True, help="Only queue the sealed originals; upload at the next sync.")
@_ON_BAD_ITEM
@click.option("--quiet", is_flag=True, help="No progress bar.")
def add_command(root, passphrase_env, sources, no_upload, on_bad_item, quiet) -> None:
    """Embed the items of SOURCES locally and store them sealed: image files (.jpg, .jpeg,
    .png) and folders of them (id: the path inside the folder), JSON Lines (.jsonl) of
    {"id", "text"} or {"id", "image": path} with an optional "label" — for a bundle that
    declares preprocessing — or one .npy / .npz (images, optional labels and ids) of arrays."""
    source = read_items(sources)
    with _open(root, passphrase_env, quiet) as device:
        added = device.add_items(
            source.items, item_ids=source.ids, labels=source.labels, upload=not no_upload, on_bad_item=on_bad_item
        )
        _echo(
            {
                "added": len(added.item_ids),
                "skipped": _skipped(added.skipped),
                "rows": len(device.gallery),
                "queued_uploads": device.gallery.replica_log.outbox_size(),
            }
        )


@device_command.command("query")
@_DIR
@_PASSPHRASE
@_SOURCES
@click.option("-k", type=int, default=5, show_default=True, help="Neighbours per query.")
@_ON_BAD_ITEM
def query_command(root, passphrase_env, sources, k, on_bad_item) -> None:
    """The k nearest gallery items of each query in SOURCES (the kinds `add` takes), one JSON
    line per query: {"id", "matches"} for image files and JSON Lines, a plain list of matches
    for an .npy / .npz. Skipped queries are listed on stderr."""
    source = read_items(sources)
    with _open(root, passphrase_env) as device:
        if source.kind == "arrays":
            for matches in device.query(source.items, k=k):
                click.echo(json.dumps([dataclasses.asdict(m) for m in matches]))
        else:
            assert source.ids is not None  # raw items always come with their ids
            answered, skipped = device.query_items(source.items, source.ids, k=k, on_bad_item=on_bad_item)
            for query_id, matches in answered:
                click.echo(json.dumps({"id": query_id, "matches": [dataclasses.asdict(m) for m in matches]}))
            for query_id, reason in skipped:
                click.echo(f"skipped query {query_id!r}: {reason}", err=True)
        damaged, missing = device.damaged_rows(), device.missing_rows()
    if damaged or missing:  # never a silently shorter answer
        first = f" (first: row {damaged[0][0]}, {damaged[0][2]})" if damaged else ""
        gone = f" and {missing} row(s) are gone from the gallery file" if missing else ""
        click.echo(
            f"warning: {len(damaged)} damaged row(s) were left out of these answers or answered without their "
            f"label{first}{gone}; run "
            f"`fctkit device check --dir DIR`, then `fctkit device repair --dir DIR`",
            err=True,
        )
        sys.exit(DAMAGED_EXIT)


@device_command.command("check")
@_DIR
@_PASSPHRASE
def check_command(root, passphrase_env) -> None:
    """Open every row, per-row extra and queued original and report what is damaged, all at
    once (JSON). Exits 0 when everything opened, 3 when something is damaged."""
    with _open(root, passphrase_env) as device:
        report = device.check()
    _echo_report(report, damaged=bool(report["damaged"]))


@device_command.command("repair")
@_DIR
@_PASSPHRASE
def repair_command(root, passphrase_env) -> None:
    """Repair what `check` reports, in one step: settings that can be derived again are
    rewritten, damaged rows are forgotten here and pulled back from the owner's replica (an
    enrolled device), damaged per-row extras and queued originals are dropped. Prints what was
    restored and what was removed (JSON); exits 3 when damage remains (the message says how to
    rebuild the gallery from the replica)."""
    try:
        with _open(root, passphrase_env) as device:
            report = device.repair()
    except GalleryDamagedError as exc:  # opening or repairing: its own advice would be to run repair again
        raise GalleryDamagedError(
            f"the repair could not finish: {_reason(exc)}. Running it again will not help: "
            f"restore a backup of the device directory, or {rebuild_advice(root)}",
            exc.settings,
        ) from None
    _echo_report(report, damaged=bool(report["damaged_after"]))


def _reason(exc: GalleryDamagedError) -> str:
    """What failed, without the advice (to run check or repair) that the error carries elsewhere."""
    reason = str(exc).split(f"{REBUILD_LEAD}:")[0].split("; run ")[0].split("; restore a backup")[0]
    return reason.replace(RECOVERY, "").rstrip(" .;")


@device_command.command("sync")
@_DIR
@_PASSPHRASE
@click.option("--no-upgrade", is_flag=True, help="Download and verify, but defer upgrading the gallery.")
@click.option("--no-replicate", is_flag=True, help="Skip pulling and pushing the owner's gallery replica.")
@click.option("--watch", is_flag=True, help="Then keep following the server and sync on every new version.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@_NO_HEALTH
def sync_command(root, passphrase_env, no_upgrade, no_replicate, watch, quiet, no_health_check) -> None:
    """Upload queued originals, take the publisher's signed withdrawals (a device on a withdrawn
    version, or interrupted on its way to one, goes back to the one it names; the notes say how:
    exact, backward, reembedded or a mix, and which withdrawals were refused), install or upgrade
    to the latest published version not withdrawn, then pull and push the owner's encrypted
    gallery replica. The output ends with the last upgrade's health check (upgrade_health)."""
    with _open(root, passphrase_env, quiet, no_health_check) as device:
        _echo(_with_health(device, dataclasses.asdict(device.sync(upgrade=not no_upgrade, replicate=not no_replicate))))
        if watch:
            for result in device.watch(upgrade=not no_upgrade):
                _echo(_with_health(device, dataclasses.asdict(result)))


@device_command.command("remove")
@_DIR
@_PASSPHRASE
@click.argument("item_ids", nargs=-1, required=True)
def remove_command(root, passphrase_env, item_ids) -> None:
    """Remove items; the removal reaches the owner's other devices as tombstones at the next sync."""
    with _open(root, passphrase_env) as device:
        _echo({"removed": device.remove(list(item_ids)), "rows": len(device.gallery)})


@device_command.command("end-transition")
@_DIR
@_PASSPHRASE
def end_transition_command(root, passphrase_env) -> None:
    """End transition scoring now. While a bundle's transition lasts, queries are embedded by
    the previous and the new model and ranked by both scores (the weight is signed in the
    manifest); ending it deletes the rows' previous embeddings and searches the adapted rows
    alone. It also ends by itself after a full backfill or the manifest's max_days."""
    with _open(root, passphrase_env) as device:
        _echo({"ended": device.end_transition()})


@device_command.command("upgrade")
@_DIR
@_PASSPHRASE
@click.option(
    "--bundle",
    "bundle_dirs",
    type=click.Path(path_type=Path),
    multiple=True,
    help="Install this local bundle (a folder or its .tar archive; verified) and upgrade to the newest "
    "one given; repeat it to bring intermediate versions for a chained path.",
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
@_NO_HEALTH
@_MAX_SECONDS
@_MAX_ROWS
def upgrade_command(root, passphrase_env, bundle_dirs, quiet, no_health_check, max_seconds, max_rows) -> None:
    """Resume an interrupted upgrade; else upgrade offline to the newest --bundle along the
    cheapest path the installed bundles offer (the first bundle of a new device is just
    installed), or, on an enrolled device, to the server's latest version. The output ends
    with the last upgrade's health check (upgrade_health).

    With --max-seconds and/or --max-rows it works in a background window: once spent it pauses
    after a committed batch (queries keep being answered: in forward mode by the version before
    the upgrade until its switch), prints rows_done, rows_left and the command that continues,
    and exits 5; that command resumes where it stopped."""
    window = Window(max_seconds, max_rows)
    windowed = max_seconds is not None or max_rows is not None
    with _open(root, passphrase_env, quiet, no_health_check) as device:
        if not bundle_dirs and device.gallery.upgrade_state is None and device.settings.server:
            synced = device.sync(upgrade=not windowed)  # a deferred upgrade: planned with the server now
            if not windowed:
                _echo(_with_health(device, dataclasses.asdict(synced)))
                return  # windowed: the bundles it downloaded are upgraded to below, in this window
        rows = device.upgrade(list(bundle_dirs) or None, window=window)
        result = _with_health(device, {"rows_upgraded": rows, "installed_version": device.version})
        state = device.gallery.upgrade_state
        if state is None:
            _echo(result)
            return
        left, total = device.gallery.remaining(state["target"]), len(device.gallery)
    _echo_paused(result, left, total, f"fctkit device upgrade --dir {root}{_window_flags(window)}")


@device_command.command("status")
@_DIR
@_PASSPHRASE
def status_command(root, passphrase_env) -> None:
    """The installed version, rows per space, queued uploads, any upgrade in progress, the
    owner, the replica (cursor, pending records, unpushed changes), the withdrawals (the rollback
    window, open or confirmed, and the rows it keeps, withdrawn versions and why, refused withdrawals, the last revert:
    from and to which version, method, when, rows not moved) and the trust: root version
    and fingerprint, timestamp version, freshness. Exits 3 whenever `check` would report damage
    (damaged settings or rows, rows gone from the file, anything else); else 4 when the trust is
    stale ("stale: possible freeze": no fresh timestamp for longer than the root allows) or the
    device clock may be wrong (it reads earlier than when the last timestamp was accepted, or
    the last sync refused metadata as expired), or the trust files are damaged. Expiry is checked against the device clock with
    a tolerance of 300 s (DEFAULT_CLOCK_TOLERANCE_S; clock_tolerance_s in device.json). A stale
    device still answers queries."""
    with _open(root, passphrase_env) as device:
        status = device.status()
    damaged = any(status.get(k) for k in ("damaged_settings", "damaged_rows", "missing_rows", "damaged"))
    _echo_report(status, damaged=damaged)
    if trust_alarm(status["trust"]):
        sys.exit(STALE_EXIT)


@device_command.command("backfill")
@_DIR
@_PASSPHRASE
@click.option("--budget", type=click.IntRange(min=0), default=None, help="Rows to re-embed at most.")
@click.option("--budget-bytes", type=click.IntRange(min=0), default=None, help="Vault bytes to download at most.")
@click.option(
    "--order",
    type=click.Choice(["random", "uncertainty", "class-mean", "class-mean-l2", "class-mean-cosine", "kmeans"]),
    default=None,
    help="Which rows first (class-mean = class-mean-l2; default: uncertainty when the bundle has FastFill σ, else class-mean-l2).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random and k-means orderings.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@_MAX_SECONDS
@_MAX_ROWS
def backfill_command(root, passphrase_env, budget, budget_bytes, order, seed, quiet, max_seconds, max_rows) -> None:
    """Re-embed the most useful rows from their encrypted vault originals with the installed
    model (tag: native); resumes an interrupted or paused backfill first (its recorded plan:
    --budget and --order then apply to the next plan only).

    --budget sizes the whole backfill; --max-seconds and/or --max-rows bound this call (a
    background window): once spent it pauses after a committed batch, prints rows_done,
    rows_left and the command that continues, and exits 5."""
    window = Window(max_seconds, max_rows)
    with _open(root, passphrase_env, quiet) as device:
        if budget is None and budget_bytes is None and device.gallery.meta("backfill") is None:
            raise InputError("give --budget N (rows) and/or --budget-bytes B")
        order = "class-mean-l2" if order == "class-mean" else order
        result = device.backfill(budget, budget_bytes=budget_bytes, order=order, seed=seed, window=window)
    if not result.left:
        _echo(dataclasses.asdict(result))
        return
    total = result.skipped + result.backfilled + result.left
    _echo_paused(
        dataclasses.asdict(result), result.left, total, f"fctkit device backfill --dir {root}{_window_flags(window)}"
    )
