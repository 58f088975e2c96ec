"""``fctkit serve`` (run the server) and ``fctkit admin ...`` (talk to one as the admin).

The admin token is read from ``--admin-token-file`` or ``$FCTKIT_ADMIN_TOKEN``, never from a
command-line argument (other users can read those from the process list)."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import click

from fctkit.errors import ConfigError

ADMIN_TOKEN_ENV = "FCTKIT_ADMIN_TOKEN"
SERVER_ENV = "FCTKIT_SERVER"
_PATH = click.Path(path_type=Path)
_EXISTING = click.Path(path_type=Path, exists=True, dir_okay=False)


@click.command("serve")
@click.option(
    "--data",
    "data_dir",
    type=_PATH,
    default=None,
    help="Embedded storage: a data directory (SQLite metadata + content files) for one server; created if missing.",
)
@click.option(
    "--database",
    default=None,
    envvar="FCTKIT_DATABASE",
    show_envvar=True,
    help="Scale-out storage: the PostgreSQL database (a libpq URL, postgresql://USER@HOST:PORT/DB) every "
    "replica shares; with --object-store. Keep the password out of the URL: libpq reads PGPASSWORD and ~/.pgpass. "
    "The schema is created by the first replica to start.",
)
@click.option(
    "--object-store",
    default=None,
    envvar="FCTKIT_OBJECT_STORE",
    show_envvar=True,
    help="Scale-out storage: s3://BUCKET/PREFIX for artifacts, vault blobs and unfinished uploads (the bucket must "
    "exist). Credentials and region come from the standard AWS settings (AWS_ACCESS_KEY_ID, "
    "AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, AWS_PROFILE, instance roles).",
)
@click.option(
    "--s3-endpoint-url",
    default=None,
    help="An S3-compatible endpoint other than AWS (MinIO, Ceph, ...); default: $AWS_ENDPOINT_URL, else AWS.",
)
@click.option(
    "--database-connections",
    type=int,
    default=20,
    show_default=True,
    help="Most PostgreSQL connections this replica opens (its pool); replicas x this must stay under the "
    "server's max_connections.",
)
@click.option(
    "--port",
    type=int,
    default=50051,
    show_default=True,
    help="Port to listen on; 0 picks a free one (logged as the 'listening' event).",
)
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0 / [::] for all interfaces)."
)
@click.option(
    "--publisher-key",
    type=_EXISTING,
    default=None,
    help="The publisher's public key (PEM or raw 32 bytes): bundles must verify under it. Or use --root.",
)
@click.option(
    "--root",
    type=_EXISTING,
    default=None,
    help="A root of trust (root.<N>.json, `fctkit keys init-root`) instead of --publisher-key: bundles must be "
    "signed by a threshold of the latest root's publisher keys, and devices get the chain of roots and a "
    "signed timestamp (GetTrust). The first start stores root.1.json; a later start takes the stored root "
    "of its version or the next one.",
)
@click.option(
    "--timestamp-key",
    "timestamp_keys",
    type=_EXISTING,
    multiple=True,
    help="With --root: the online timestamp private key (as `fctkit keys generate` writes it) this server signs "
    "timestamps with; the root's timestamp role must list it. Repeat it to hold the old and the new key "
    "while the timestamp key is rotated.",
)
@click.option(
    "--timestamp-passphrase-file",
    type=_EXISTING,
    default=None,
    help="File holding the passphrase of the --timestamp-key files (or set $FCTKIT_KEY_PASSPHRASE).",
)
@click.option(
    "--timestamp-expiry-hours",
    type=float,
    default=24.0,
    show_default=True,
    help="How long each signed timestamp stays valid (one minute to 31 days); a new one is signed once half "
    "of that is gone, or when the releases on offer change.",
)
@click.option(
    "--admin-token-file",
    type=_PATH,
    default=None,
    help="File holding the admin token; default DATA/admin.token, "
    "created (mode 0600) if missing. Required with --database (every replica reads the same token).",
)
@click.option("--tls-cert", type=_EXISTING, default=None, help="PEM certificate chain: serve TLS (with --tls-key).")
@click.option("--tls-key", type=_EXISTING, default=None, help="PEM private key of --tls-cert.")
@click.option(
    "--tls-ca",
    type=_EXISTING,
    default=None,
    help="PEM CA certificate: require every client to present a certificate it signed (mutual TLS; "
    "clients pass --tls-cert and --tls-key). Needs --tls-cert.",
)
@click.option("--quota-bytes", type=int, default=1 << 30, show_default=True, help="Vault bytes each owner may store.")
@click.option(
    "--replica-quota-bytes",
    type=int,
    default=1 << 30,
    show_default=True,
    help="Sealed gallery-record bytes each owner may store.",
)
@click.option("--max-blob-bytes", type=int, default=64 << 20, show_default=True, help="Largest vault blob.")
@click.option(
    "--max-bundle-bytes",
    type=int,
    default=4 << 30,
    show_default=True,
    help="Largest bundle archive accepted for publishing.",
)
@click.option(
    "--partial-upload-ttl",
    "partial_upload_ttl_s",
    type=float,
    default=86400.0,
    show_default=True,
    help="Seconds an unfinished vault upload may stay idle before its bytes are given back (they count "
    "against the owner's quota until then).",
)
@click.option(
    "--watch-keepalive",
    "watch_keepalive_s",
    type=float,
    default=15.0,
    show_default=True,
    help="Seconds between keep-alives on idle WatchVersions streams.",
)
@click.option(
    "--max-reports-per-minute",
    "reports_per_minute",
    type=int,
    default=120,
    show_default=True,
    help="Fleet reports each device may send in any 60 seconds (over all replicas together); more are answered "
    "RESOURCE_EXHAUSTED.",
)
@click.option(
    "--shutdown-grace",
    "shutdown_grace_s",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds in-flight calls get to finish on SIGTERM/SIGINT.",
)
@click.option(
    "--metrics-port",
    type=int,
    default=None,
    help="Serve Prometheus metrics at http://METRICS-HOST:PORT/metrics (needs `pip install 'fctkit[metrics]'`); "
    "0 picks a free port (logged as the 'metrics listening' event). Default: no metrics, nothing more listens.",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="Address the metrics listen on (0.0.0.0 for all interfaces; the metrics need no token).",
)
@click.option(
    "--metrics-cache",
    "metrics_cache_s",
    type=float,
    default=None,
    help="Seconds a rendered /metrics page answers scrapes before one renders it again (0: every scrape "
    "after a render; scrapes at the same moment share one render). Default: 2.",
)
@click.option(
    "--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True
)
def serve_command(**options) -> None:
    """Run the fctkit gRPC server (Registry, Vault, Fleet; health checking and reflection on).

    Storage is --data DIR (one server), or --database plus --object-store (PostgreSQL and an
    S3 bucket): then run as many replicas as you like behind a load balancer, each with the same
    --publisher-key (or --root and --timestamp-key) and --admin-token-file; a load balancer
    checks grpc.health.v1 (service "").

    Releases are checked against exactly one of --publisher-key (one key) or --root with
    --timestamp-key (a root of trust; docs/reference/protocol.md §6.2).

    Logs are JSON lines on stderr. Stop with SIGTERM or Ctrl-C: in-flight calls finish first.
    """
    from fctkit.config import from_mapping

    from .app import ServerConfig, serve

    config = from_mapping(ServerConfig, {k: v for k, v in options.items() if v is not None})
    asyncio.run(serve(config))


def _admin_token(token_file: Path | None) -> str:
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the admin token file {token_file}: {exc.strerror}") from exc
    else:
        token = os.environ.get(ADMIN_TOKEN_ENV, "").strip()
    if not token:
        raise ConfigError(
            f"no admin token: pass --admin-token-file (the server's DATA/admin.token) or set ${ADMIN_TOKEN_ENV}"
        )
    return token


@click.group("admin")
@click.option(
    "--server",
    default="127.0.0.1:50051",
    envvar=SERVER_ENV,
    show_default=True,
    help=f"host:port of the server (or ${SERVER_ENV}).",
)
@click.option(
    "--admin-token-file", type=_PATH, default=None, help=f"File holding the admin token (else ${ADMIN_TOKEN_ENV})."
)
@click.option("--tls-ca", type=_EXISTING, default=None, help="PEM CA certificate to trust: connect with TLS.")
@click.option(
    "--tls-cert",
    type=_EXISTING,
    default=None,
    help="PEM client certificate, for a server that requires one (`fctkit serve --tls-ca`); with --tls-key.",
)
@click.option("--tls-key", type=_EXISTING, default=None, help="PEM private key of --tls-cert.")
@click.pass_context
def admin_command(
    ctx: click.Context,
    server: str,
    admin_token_file: Path | None,
    tls_ca: Path | None,
    tls_cert: Path | None,
    tls_key: Path | None,
) -> None:
    """Administer a running fctkit server: enrolment codes, publishing releases and roots, fleet and version lists."""

    def connect():
        from fctkit.protos.client import ClientTls, FctkitClient

        return FctkitClient(server, _admin_token(admin_token_file), tls=ClientTls.from_files(tls_ca, tls_cert, tls_key))

    ctx.obj = connect


def _emit(rows: list[dict], as_json: bool, columns: tuple[str, ...]) -> None:
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("(none)")
        return
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    click.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in rows:
        click.echo("  ".join(str(row.get(c, "")).ljust(w) for c, w in zip(columns, widths)))


def _as_dict(message) -> dict:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


@admin_command.command("enrol-code")
@click.option("--ttl", type=int, default=0, help="Seconds the code stays valid (0: one day; at most 30 days).")
@click.option("--label", default="", help="A note (e.g. where the device goes), copied to the device record.")
@click.option(
    "--owner",
    default="",
    help="Enrol the device into this owner (its blobs and gallery replica are shared "
    "with the owner's other devices); default: a new owner of its own.",
)
@click.pass_obj
def enrol_code_command(connect, ttl: int, label: str, owner: str) -> None:
    """Make a one-time enrolment code for one device."""
    with connect() as client:
        response = client.create_enrolment_code(ttl, label, owner=owner)
    click.echo(response.code)
    click.echo(f"expires {response.expires_at}, owner {response.owner_id}", err=True)


@admin_command.command("publish")
@click.argument("bundle", type=click.Path(path_type=Path, exists=True))
@click.option(
    "--percent",
    type=click.FloatRange(0, 100),
    default=None,
    help="Publish as a staged rollout at this percent of devices (0: only a cohort, named with "
    "`fctkit admin rollout VERSION --devices FILE`). Default: offered to every device at once.",
)
@click.option(
    "--no-guard",
    is_flag=True,
    help="With --percent: start the rollout without its default guard (see `fctkit admin rollout --help`).",
)
@click.pass_obj
def publish_command(connect, bundle: Path, percent: float | None, no_guard: bool) -> None:
    """Publish BUNDLE (a bundle directory or its .tar archive); the server verifies it first.

    A staged rollout (--percent) of a release that records its health expectation (every bundle
    `fctkit export` makes) starts guarded: it halts when the median owner's measure — self-retrieval
    R@1 at instance level, the mean cosine at class level — falls under 0.85 (instance) or 0.75
    (class) of what the release expects at each device's gallery size, or when more than 0.25
    of the devices that got it failed to upgrade (owners' mean), once 5 owners reported."""
    from fctkit.protos.bundle import pack_bundle

    with connect() as client, tempfile.TemporaryDirectory() as tmp:
        archive = pack_bundle(bundle, Path(tmp) / "bundle.tar") if bundle.is_dir() else bundle
        if no_guard and percent is None:
            raise click.UsageError("--no-guard goes with --percent: only a staged rollout has a guard")
        info = client.publish_bundle(archive, rollout_percent=percent, no_guard=no_guard)
    staged = "" if percent is None else f", staged rollout at {percent:g}%" + (" without a guard" if no_guard else "")
    click.echo(f"published version {info.version} ({len(info.artifacts)} artifacts, mode {info.mode}{staged})")


@admin_command.command("publish-root")
@click.argument("root_file", type=_EXISTING)
@click.pass_obj
def publish_root_command(connect, root_file: Path) -> None:
    """Add ROOT_FILE (root.<N+1>.json, signed by a threshold of the current root's root keys
    and of its own) to the server's chain: devices walk to it at their next sync, and releases
    must then be signed by its publisher threshold."""
    from fctkit.protos.trust import MAX_ROOT_BYTES

    with root_file.open("rb") as fh:
        data = fh.read(MAX_ROOT_BYTES + 1)  # the server refuses anything longer
    with connect() as client:
        response = client.publish_root(data)
    click.echo(f"published root v{response.root_version} (fingerprint {response.fingerprint})")


_DEVICE_COLUMNS = (
    "device_id",
    "owner_id",
    "name",
    "version",
    "gallery_size",
    "upgrade_state",
    "last_report_at",
    "vault_bytes",
    "revoked_at",
    "root_version",
    "trust",
)
_STATES = ("idle", "downloading", "upgrading", "backfilling", "failed")


@admin_command.command("list-devices")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one array) instead of a table.")
@click.option("--version", "version", type=click.IntRange(min=0), help="Only devices at this version (0: none yet).")
@click.option("--state", type=click.Choice(_STATES), help="Only devices in this reported upgrade state.")
@click.option(
    "--stale",
    "stale_days",
    type=click.FloatRange(min=0, min_open=True),
    help="Only devices that sent no report for more than DAYS days (never reported: enrolled that long ago).",
)
@click.option("--owner", default="", help="Only this owner's devices.")
@click.pass_obj
def list_devices_command(
    connect, as_json: bool, version: int | None, state: str | None, stale_days: float | None, owner: str
) -> None:
    """The enrolled devices matching every filter given, with their version, gallery size and
    upgrade state; each page is printed as it arrives (filtered by the server)."""
    filters: dict = {"owner_id": owner}
    if version is not None:
        filters["version"] = version
    if state is not None:
        filters["upgrade_state"] = f"UPGRADE_STATE_{state.upper()}"
    if stale_days is not None:
        filters["stale_seconds"] = max(1, round(stale_days * 86400))
    with connect() as client:
        pages = ([_as_dict(d) for d in page] for page in client.device_pages(**filters))
        (_stream_json if as_json else _stream_table)(pages)


def _stream_json(pages: Iterator[list[dict]]) -> None:
    """One JSON array of every page's devices, written page by page."""
    click.echo("[", nl=False)
    separator = "\n"
    for page in pages:
        for row in page:
            click.echo(separator + textwrap.indent(json.dumps(row, indent=2), "  "), nl=False)
            separator = ",\n"
    click.echo("\n]" if separator != "\n" else "]")


def _stream_table(pages: Iterator[list[dict]]) -> None:
    """A table of every page's devices, columns as wide as the first page needs, written page by page."""
    widths: list[int] = []
    for page in pages:
        for row in page:
            row["trust"] = _trust_state(row)
        if not widths and page:
            widths = [max(len(c), *(len(str(r.get(c, ""))) for r in page)) for c in _DEVICE_COLUMNS]
            click.echo("  ".join(c.ljust(w) for c, w in zip(_DEVICE_COLUMNS, widths)))
        for row in page:
            click.echo("  ".join(str(row.get(c, "")).ljust(w) for c, w in zip(_DEVICE_COLUMNS, widths)))
    if not widths:
        click.echo("(none)")


def _trust_state(device: dict) -> str:
    """A device's reported trust state, as the device list shows it."""
    if device.get("trust_stale"):
        return "stale: possible freeze"
    if not device.get("root_version"):
        return "-"  # pins one publisher key, or never reported
    return f"fresh ({int(device.get('seconds_since_fresh', 0)) // 60} min)"


@admin_command.command("revoke-device")
@click.argument("device_id")
@click.pass_obj
def revoke_device_command(connect, device_id: str) -> None:
    """Revoke DEVICE_ID (lost, stolen or retired): its token stops working at once and it no
    longer counts among its owner's devices. The owner's blobs and gallery records stay; the
    device can come back only by enrolling again with a new code."""
    with connect() as client:
        response = client.revoke_device(device_id)
    click.echo(f"revoked {device_id} at {response.revoked_at}")


@admin_command.command("list-versions")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_obj
def list_versions_command(connect, as_json: bool) -> None:
    """Every published model version."""
    with connect() as client:
        versions = client.list_versions()
    rows = [_as_dict(v) for v in versions]
    if not as_json:
        for row, version in zip(rows, versions):
            row["artifacts"] = ",".join(a.name for a in version.artifacts)
            row["parents"] = ",".join(map(str, version.parents))
    _emit(rows, as_json, ("version", "parents", "mode", "embedding_dim", "published_at", "artifacts"))


def _add_rollout_commands() -> None:
    from .rollout.cli import rollout_command, rollout_confirm_command, rollout_status_command, withdraw_command

    admin_command.add_command(rollout_command)
    admin_command.add_command(rollout_status_command)
    admin_command.add_command(rollout_confirm_command)
    admin_command.add_command(withdraw_command)


_add_rollout_commands()
