"""`fctkit keys …`: the publisher's signing key pair and the offline root of trust (k-of-n root
keys, its next versions, co-signing a root, a release or a withdrawal, showing a root). Offline
file work only: :mod:`fctkit.export.keys` does it, :mod:`fctkit.protos.trust` holds the rules."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import click
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fctkit.errors import ThresholdError, TrustError
from fctkit.protos.trust import (
    MAX_WITHDRAWAL_BYTES,
    ROLE_NAMES,
    Root,
    Signed,
    root_fingerprint,
    verify_root_update,
    verify_self_signed,
)

from .keys import (
    DEFAULT_ROOT_EXPIRY_DAYS,
    PASSPHRASE_ENV,
    generate_keys,
    init_root,
    load_private_key,
    load_public_key,
    load_root_file,
    next_root,
    public_key_id,
    read_passphrase,
    root_file_name,
    sign_release,
    sign_root_file,
    sign_withdrawal_file,
    withdrawal_file_name,
    write_root,
    write_withdrawal,
)

_PASSPHRASE_HELP = f"file holding the key passphrase (or set ${PASSPHRASE_ENV}); never a plain argument"
PASSPHRASE_FILE = click.option(
    "--passphrase-file", type=click.Path(dir_okay=False, path_type=Path), help=_PASSPHRASE_HELP
)


@click.group("keys")
def keys_command() -> None:
    """Signing keys (Ed25519) and the root of trust: a publisher key pair (`generate`); an
    offline root with k-of-n root keys (`init-root`), its next versions (`add-publisher`,
    `remove-publisher`, `rotate-root`), co-signing a root, a release or a withdrawal (`sign`),
    a signed withdrawal of a release (`withdraw`), `show`.

    The server takes root.1.json at `fctkit serve --root` (and later versions with `fctkit admin
    publish-root`); devices pin it at `fctkit device enrol --root-fingerprint` and walk to each new
    version at their next sync. README, "Keys and trust", is the runbook."""


@keys_command.command("generate")
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="folder for publisher.key (mode 0600) and publisher.pub",
)
@PASSPHRASE_FILE
def generate_command(out_dir: Path, passphrase_file: Path | None) -> None:
    """Create a publisher key pair; devices pin publisher.pub."""
    passphrase = read_passphrase(passphrase_file)
    private_path, public_path = generate_keys(out_dir, passphrase)
    key_id = public_key_id(load_private_key(private_path, passphrase).public_key())
    state = "passphrase-encrypted" if passphrase else "unencrypted"
    click.echo(f"private key: {private_path} (0600, {state})\npublic key:  {public_path}\nkey id:      {key_id}")


_PUBLIC = click.Path(exists=True, dir_okay=False, path_type=Path)
_ROOT_FILE = click.argument("root_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
_EXPIRES = click.option(
    "--expires-days",
    default=DEFAULT_ROOT_EXPIRY_DAYS,
    show_default=True,
    type=click.IntRange(min=1),
    help="the new root expires this many days from now; renew it before then",
)
_KEYID = re.compile(r"[0-9a-f]{64}")


def _next_root_options(command: Callable) -> Callable:
    """What every command writing the next root version takes: who signs it, where it goes."""
    for option in reversed(
        (
            click.option(
                "--sign-with",
                "sign_with",
                multiple=True,
                type=_PUBLIC,
                metavar="KEYFILE",
                help="a root private key (root-<i>.key) that signs the new root; repeat it. It needs a threshold "
                "of the current root's root keys AND of the new root's; others add theirs with `keys sign`",
            ),
            click.option(
                "--partial",
                is_flag=True,
                help="write the new root although it lacks signatures (refused "
                "otherwise); devices refuse it until enough key holders ran `fctkit keys sign` on it",
            ),
            click.option(
                "--out",
                "out_path",
                type=click.Path(dir_okay=False, path_type=Path),
                help="where the new root goes (default: root.<N+1>.json next to ROOT_FILE)",
            ),
            _EXPIRES,
            PASSPHRASE_FILE,
        )
    ):
        command = option(command)
    return command


def _public_keys(paths: Sequence[Path]) -> list[Ed25519PublicKey]:
    return [load_public_key(path) for path in paths]


def _key_ids(values: Sequence[str]) -> list[str]:
    """Key ids given as 64 hex digits, or as public key files."""
    return [value if _KEYID.fullmatch(value) else public_key_id(load_public_key(Path(value))) for value in values]


def _missing_signatures(previous: Signed[Root] | None, signed: Signed[Root]) -> str | None:
    """What the root still lacks to be accepted after ``previous`` (or on its own), or None."""
    try:
        verify_root_update(previous, signed) if previous is not None else verify_self_signed(signed)
    except ThresholdError as exc:
        return str(exc)
    return None


def _root_status(previous: Signed[Root] | None, signed: Signed[Root]) -> str:
    missing = _missing_signatures(previous, signed)
    if missing is not None:
        return f"INCOMPLETE: {missing}"
    return "complete: signed by a threshold of " + (
        "the previous and its own root keys" if previous else "its root keys"
    )


def _previous_root(path: Path, signed: Signed[Root]) -> Signed[Root] | None:
    before = path.parent / root_file_name(signed.body.version - 1)
    return load_root_file(before) if signed.body.version > 1 and before.exists() else None


def _write_next(
    root_file: Path,
    change: Callable[[Root], Root],
    sign_with: Sequence[Path],
    passphrase_file: Path | None,
    out_path: Path | None,
    partial: bool,
) -> None:
    current = load_root_file(root_file)
    verify_self_signed(current, str(root_file))
    signed = Signed(change(current.body))
    passphrase = read_passphrase(passphrase_file)
    for key_file in sign_with:
        signed = signed.signed_by(load_private_key(key_file, passphrase))
    missing = _missing_signatures(current, signed)
    if missing is not None and not partial:
        raise ThresholdError(
            f"root v{signed.body.version} not written: {missing}; or write it with --partial "
            "and collect the other signatures with `fctkit keys sign`"
        )
    status = _root_status(current, signed)
    out = write_root(out_path or root_file.parent / root_file_name(signed.body.version), signed)
    click.echo(f"root v{signed.body.version}: {out}\n{status}\nfingerprint {root_fingerprint(signed)}")


@keys_command.command("init-root")
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="folder for root.1.json and the root keys root-<i>.key (0600) / root-<i>.pub",
)
@click.option("--root-keys", required=True, type=click.IntRange(1, 16), help="how many root keys to generate (n)")
@click.option(
    "--root-threshold", required=True, type=click.IntRange(min=1), help="how many must sign each new root (k)"
)
@click.option("--publisher-key", "publisher_keys", multiple=True, type=_PUBLIC, help="a publisher.pub; repeat it")
@click.option(
    "--publisher-threshold",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="how many publisher keys must sign a release",
)
@click.option(
    "--timestamp-key",
    "timestamp_keys",
    multiple=True,
    type=_PUBLIC,
    help="the online timestamp key the server signs with (its .pub)",
)
@_EXPIRES
@click.option(
    "--freshness-days",
    default=7.0,
    show_default=True,
    type=click.FloatRange(min=0.001),
    help="a device without a fresh timestamp for longer reports 'stale: possible freeze'",
)
@PASSPHRASE_FILE
def init_root_command(
    out_dir: Path,
    root_keys: int,
    root_threshold: int,
    publisher_keys: tuple[Path, ...],
    publisher_threshold: int,
    timestamp_keys: tuple[Path, ...],
    expires_days: int,
    freshness_days: float,
    passphrase_file: Path | None,
) -> None:
    """Create the root of trust offline: n root keys (each passphrase-wrapped; hand each to its
    holder and keep them off networked machines) and root.1.json signed by all of them, and
    print its fingerprint (SHA-256 of its signed part): what devices are enrolled with."""
    root_path, signed, key_paths = init_root(
        out_dir,
        root_keys=root_keys,
        root_threshold=root_threshold,
        publisher_keys=_public_keys(publisher_keys),
        publisher_threshold=publisher_threshold,
        timestamp_keys=_public_keys(timestamp_keys),
        expires_days=expires_days,
        freshness_s=round(freshness_days * 86400),
        passphrase=read_passphrase(passphrase_file),
    )
    click.echo(f"root v1: {root_path} ({root_threshold} of {root_keys} root keys)")
    click.echo("root keys: " + ", ".join(str(p) for p in key_paths))
    click.echo(f"fingerprint {root_fingerprint(signed)}")


@keys_command.command("add-publisher")
@_ROOT_FILE
@click.option(
    "--key", "keys", required=True, multiple=True, type=_PUBLIC, help="the new publisher's publisher.pub; repeat it"
)
@click.option(
    "--threshold", type=click.IntRange(min=1), help="the publisher threshold from this root on (default: unchanged)"
)
@_next_root_options
def add_publisher_command(root_file: Path, keys: tuple[Path, ...], threshold: int | None, **options) -> None:
    """Write the next root version with these publisher keys added."""
    days = options.pop("expires_days")
    _write_next(
        root_file,
        lambda root: next_root(
            root, add_publishers=_public_keys(keys), publisher_threshold=threshold, expires_days=days
        ),
        **options,
    )


@keys_command.command("remove-publisher")
@_ROOT_FILE
@click.option("--key", "keys", required=True, multiple=True, help="the publisher's .pub file or key id; repeat it")
@click.option(
    "--threshold", type=click.IntRange(min=1), help="the publisher threshold from this root on (default: unchanged)"
)
@_next_root_options
def remove_publisher_command(root_file: Path, keys: tuple[str, ...], threshold: int | None, **options) -> None:
    """Write the next root version without these publisher keys: once devices have it, their
    signatures no longer count (revoke a leaked or departed publisher's key this way)."""
    days = options.pop("expires_days")
    _write_next(
        root_file,
        lambda root: next_root(
            root, remove_publishers=_key_ids(keys), publisher_threshold=threshold, expires_days=days
        ),
        **options,
    )


@keys_command.command("rotate-root")
@_ROOT_FILE
@click.option("--add-root-key", "added", multiple=True, type=_PUBLIC, help="a new root key holder's .pub; repeat it")
@click.option("--remove-root-key", "removed", multiple=True, help="a root key (.pub file or key id) to drop; repeat it")
@click.option(
    "--threshold", type=click.IntRange(min=1), help="the root threshold from this root on (default: unchanged)"
)
@click.option(
    "--timestamp-key",
    "timestamp_keys",
    multiple=True,
    type=_PUBLIC,
    help="replace the timestamp key(s) (devices then forget their last timestamp version)",
)
@_next_root_options
def rotate_root_command(
    root_file: Path,
    added: tuple[Path, ...],
    removed: tuple[str, ...],
    threshold: int | None,
    timestamp_keys: tuple[Path, ...],
    **options,
) -> None:
    """Write the next root version with root keys added or removed, a new root threshold, or a
    new timestamp key; after a root key leaks, rotate it out with the others' signatures."""
    days = options.pop("expires_days")
    _write_next(
        root_file,
        lambda root: next_root(
            root,
            add_root_keys=_public_keys(added),
            remove_root_keys=_key_ids(removed),
            root_threshold=threshold,
            timestamp_keys=_public_keys(timestamp_keys) or None,
            expires_days=days,
        ),
        **options,
    )


@keys_command.command("sign")
@click.argument("target", type=click.Path(exists=True, path_type=Path))
@click.option("--key", "key_path", required=True, type=_PUBLIC, help="your private key (root-<i>.key or publisher.key)")
@PASSPHRASE_FILE
def sign_command(target: Path, key_path: Path, passphrase_file: Path | None) -> None:
    """Add your signature to TARGET: a root file (root.<N>.json), a withdrawal
    (withdrawal.<V>.json), or a release (a bundle folder v<N>/ or its v<N>.tar), whose
    manifest.sigs.json lists the co-signing publishers."""
    key = load_private_key(key_path, read_passphrase(passphrase_file))
    if target.is_file() and target.suffix == ".json" and _kind(target) == "withdrawal":
        signed = sign_withdrawal_file(target, key)
        click.echo(
            f"signed the withdrawal of v{signed.body.version} with key {public_key_id(key.public_key())} "
            f"({len(signed.signatures)} signature(s))"
        )
        return
    if target.is_file() and target.suffix == ".json":
        _sign_root(target, key)
        return
    signature = sign_release(target, key)
    click.echo(f"signed the release {target} with key {signature.keyid}")


def _kind(path: Path) -> str | None:
    """The ``_type`` a trust file's signed part names (None when it is not one)."""
    try:
        signed = json.loads(path.read_bytes()[: MAX_WITHDRAWAL_BYTES * 8]).get("signed", {})
    except (ValueError, AttributeError):
        return None
    return signed.get("_type") if isinstance(signed, dict) else None


@keys_command.command("withdraw")
@click.argument("version", type=click.IntRange(min=1))
@click.option("--reason", required=True, help="why (shown to operators and devices; at most 1,024 characters)")
@click.option("--revert-to", type=click.IntRange(min=0), help="the version devices go back to (default: VERSION - 1)")
@click.option("--key", "key_path", required=True, type=_PUBLIC, help="your publisher.key")
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="where it goes (default: withdrawal.<VERSION>.json here)",
)
@PASSPHRASE_FILE
def withdraw_command(
    version: int,
    reason: str,
    revert_to: int | None,
    key_path: Path,
    out_path: Path | None,
    passphrase_file: Path | None,
) -> None:
    """Write a signed withdrawal of release VERSION: devices that installed it go back to
    --revert-to. It must carry the signatures of the root's publisher threshold, like a release:
    co-signers add theirs with `fctkit keys sign withdrawal.<VERSION>.json --key KEY`. A server
    alone cannot make devices go back (that would be a downgrade attack)."""
    key = load_private_key(key_path, read_passphrase(passphrase_file))
    path = out_path or Path(withdrawal_file_name(version))
    signed = write_withdrawal(path, version, version - 1 if revert_to is None else revert_to, reason, key)
    click.echo(
        f"withdrawal of v{version} (devices go back to v{signed.body.revert_to}): {path}, signed by "
        f"{public_key_id(key.public_key())}"
    )


def _sign_root(target: Path, key: Ed25519PrivateKey) -> None:
    """Sign a root file, refusing a key whose signature would count for nothing."""
    current = load_root_file(target)
    previous = _previous_root(target, current)
    keyid = public_key_id(key.public_key())
    root_keys = {*current.body.role("root").keyids, *(previous.body.role("root").keyids if previous else ())}
    # root v1 signed by a publisher key it lists moves devices that pinned that key (publisher.pub) to the root
    bridge = current.body.version == 1 and keyid in current.body.role("publisher").keyids
    if keyid not in root_keys and not bridge:
        raise TrustError(
            f"key {keyid[:16]}… is not a root key of root v{current.body.version} nor of the one before "
            "it: its signature would not count; sign with a root-<i>.key"
        )
    signed = sign_root_file(target, key)
    click.echo(f"signed root v{signed.body.version} with key {keyid}")
    if bridge and keyid not in root_keys:
        click.echo(
            "(the publisher's migration signature: devices that pinned this key move to this root at their next sync)"
        )
    click.echo(_root_status(previous, signed))


@keys_command.command("show")
@click.argument("root_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of a table")
def show_command(root_file: Path, as_json: bool) -> None:
    """Print a root's version, expiry, fingerprint, roles (keys and thresholds) and whether it
    carries enough signatures (against root.<N-1>.json when it lies beside it)."""
    signed = load_root_file(root_file)
    root = signed.body
    info = {
        "version": root.version,
        "expires": root.signed_dict()["expires"],
        "fingerprint": root_fingerprint(signed),
        "freshness_limit_s": root.freshness_limit_s,
        "signatures": [s.keyid for s in signed.signatures],
        "status": _root_status(_previous_root(root_file, signed), signed),
        "roles": {name: root.role(name).to_dict() for name in ROLE_NAMES},
    }
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"root v{root.version}, expires {info['expires']}, freshness limit {root.freshness_limit_s} s")
    click.echo(f"fingerprint {info['fingerprint']}\n{info['status']}")
    for name in ROLE_NAMES:
        role = root.role(name)
        short = " (never met: add keys)" if role.threshold > len(role.keyids) else ""
        click.echo(f"  {name:<10} {role.threshold} of {len(role.keyids)}{short}: {', '.join(role.keyids) or '-'}")
