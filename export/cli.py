"""`fctkit keys …`, `fctkit bundle …` and `fctkit export`. `bundle verify` needs neither torch
nor onnx: it runs on a device with the core install plus onnxruntime. `export` turns a
`fctkit train` run into signed bundles (:mod:`fctkit.export.release`; needs torch)."""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import click
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fctkit.errors import ThresholdError, TrustError
from fctkit.protos.trust import ROLE_NAMES, Root, Signed, root_fingerprint, verify_root_update, verify_self_signed

from fctkit.protos.bundle import VerifiedBundle, pack_bundle, unpack_bundle, verify_bundle

from .compatible_release import COMPATIBLE_METHODS
from .features_release import UserGraphs
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
    write_root,
)
from .release import build_release
from .release_plan import METHODS
from .user_preprocessing import load_graph_preprocessing

_PASSPHRASE_HELP = f"file holding the key passphrase (or set ${PASSPHRASE_ENV}); never a plain argument"
_PASSPHRASE_FILE = click.option("--passphrase-file", type=click.Path(dir_okay=False, path_type=Path), help=_PASSPHRASE_HELP)

# What every release export takes: the run, the signing key, where the bundles go, their numbering, fp16.
_RUN_DIR = click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
_KEY = click.option("--key", "key_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
                    help="publisher private key (publisher.key)")
_OUT = click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
                    help="folder for the bundles v<N>/ and their v<N>.tar archives")
_FIRST_VERSION = click.option("--first-version", default=1, show_default=True, type=click.IntRange(min=1),
                              help="version number of the first bundle; the others follow")
_FP16 = click.option("--fp16", is_flag=True, help="store the graphs' weights in float16 (inputs/outputs stay float32)")
_FORCE = click.option("--force", is_flag=True, help="publish although an ECC gate fails (recorded in the signed manifests)")
_REASON = click.option("--reason", help="why the gate is overridden; required with --force")


@click.group("keys")
def keys_command() -> None:
    """Signing keys (Ed25519) and the root of trust: a publisher key pair (`generate`); an
    offline root with k-of-n root keys (`init-root`), its next versions (`add-publisher`,
    `remove-publisher`, `rotate-root`), co-signing a root or a release (`sign`), `show`.

    Devices and the server do not check roots yet: a device still pins one publisher key
    (`generate`) and verifies a release's `manifest.sig` with it. The root commands write and
    check the offline root files and co-signatures that devices will pin."""


@keys_command.command("generate")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="folder for publisher.key (mode 0600) and publisher.pub")
@_PASSPHRASE_FILE
def generate_command(out_dir: Path, passphrase_file: Path | None) -> None:
    """Create a publisher key pair; devices pin publisher.pub."""
    passphrase = read_passphrase(passphrase_file)
    private_path, public_path = generate_keys(out_dir, passphrase)
    key_id = public_key_id(load_private_key(private_path, passphrase).public_key())
    state = "passphrase-encrypted" if passphrase else "unencrypted"
    click.echo(f"private key: {private_path} (0600, {state})\npublic key:  {public_path}\nkey id:      {key_id}")


_PUBLIC = click.Path(exists=True, dir_okay=False, path_type=Path)
_ROOT_FILE = click.argument("root_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
_EXPIRES = click.option("--expires-days", default=DEFAULT_ROOT_EXPIRY_DAYS, show_default=True, type=click.IntRange(min=1),
                        help="the new root expires this many days from now; renew it before then")
_KEYID = re.compile(r"[0-9a-f]{64}")


def _next_root_options(command: Callable) -> Callable:
    """What every command writing the next root version takes: who signs it, where it goes."""
    for option in reversed((
        click.option("--sign-with", "sign_with", multiple=True, type=_PUBLIC, metavar="KEYFILE",
                     help="a root private key (root-<i>.key) that signs the new root; repeat it. It needs a threshold "
                          "of the current root's root keys AND of the new root's; others add theirs with `keys sign`"),
        click.option("--partial", is_flag=True, help="write the new root although it lacks signatures (refused "
                     "otherwise); devices refuse it until enough key holders ran `fctkit keys sign` on it"),
        click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path),
                     help="where the new root goes (default: root.<N+1>.json next to ROOT_FILE)"),
        _EXPIRES, _PASSPHRASE_FILE,
    )):
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
    return "complete: signed by a threshold of " + ("the previous and its own root keys" if previous else "its root keys")


def _previous_root(path: Path, signed: Signed[Root]) -> Signed[Root] | None:
    before = path.parent / root_file_name(signed.body.version - 1)
    return load_root_file(before) if signed.body.version > 1 and before.exists() else None


def _write_next(root_file: Path, change: Callable[[Root], Root], sign_with: Sequence[Path], passphrase_file: Path | None,
                out_path: Path | None, partial: bool) -> None:
    current = load_root_file(root_file)
    verify_self_signed(current, str(root_file))
    signed = Signed(change(current.body))
    passphrase = read_passphrase(passphrase_file)
    for key_file in sign_with:
        signed = signed.signed_by(load_private_key(key_file, passphrase))
    missing = _missing_signatures(current, signed)
    if missing is not None and not partial:
        raise ThresholdError(f"root v{signed.body.version} not written: {missing}; or write it with --partial "
                             "and collect the other signatures with `fctkit keys sign`")
    status = _root_status(current, signed)
    out = write_root(out_path or root_file.parent / root_file_name(signed.body.version), signed)
    click.echo(f"root v{signed.body.version}: {out}\n{status}\nfingerprint {root_fingerprint(signed)}")


@keys_command.command("init-root")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="folder for root.1.json and the root keys root-<i>.key (0600) / root-<i>.pub")
@click.option("--root-keys", required=True, type=click.IntRange(1, 16), help="how many root keys to generate (n)")
@click.option("--root-threshold", required=True, type=click.IntRange(min=1), help="how many must sign each new root (k)")
@click.option("--publisher-key", "publisher_keys", multiple=True, type=_PUBLIC, help="a publisher.pub; repeat it")
@click.option("--publisher-threshold", default=1, show_default=True, type=click.IntRange(min=1),
              help="how many publisher keys must sign a release")
@click.option("--timestamp-key", "timestamp_keys", multiple=True, type=_PUBLIC,
              help="the online timestamp key the server signs with (its .pub)")
@_EXPIRES
@click.option("--freshness-days", default=7.0, show_default=True, type=click.FloatRange(min=0.001),
              help="a device without a fresh timestamp for longer reports 'stale: possible freeze'")
@_PASSPHRASE_FILE
def init_root_command(out_dir: Path, root_keys: int, root_threshold: int, publisher_keys: tuple[Path, ...],
                      publisher_threshold: int, timestamp_keys: tuple[Path, ...], expires_days: int, freshness_days: float,
                      passphrase_file: Path | None) -> None:
    """Create the root of trust offline: n root keys (each passphrase-wrapped; hand each to its
    holder and keep them off networked machines) and root.1.json signed by all of them, and
    print its fingerprint (SHA-256 of its signed part). Devices do not pin roots yet."""
    root_path, signed, key_paths = init_root(
        out_dir, root_keys=root_keys, root_threshold=root_threshold, publisher_keys=_public_keys(publisher_keys),
        publisher_threshold=publisher_threshold, timestamp_keys=_public_keys(timestamp_keys), expires_days=expires_days,
        freshness_s=round(freshness_days * 86400), passphrase=read_passphrase(passphrase_file))
    click.echo(f"root v1: {root_path} ({root_threshold} of {root_keys} root keys)")
    click.echo("root keys: " + ", ".join(str(p) for p in key_paths))
    click.echo(f"fingerprint {root_fingerprint(signed)}")


@keys_command.command("add-publisher")
@_ROOT_FILE
@click.option("--key", "keys", required=True, multiple=True, type=_PUBLIC, help="the new publisher's publisher.pub; repeat it")
@click.option("--threshold", type=click.IntRange(min=1), help="the publisher threshold from this root on (default: unchanged)")
@_next_root_options
def add_publisher_command(root_file: Path, keys: tuple[Path, ...], threshold: int | None, **options) -> None:
    """Write the next root version with these publisher keys added."""
    days = options.pop("expires_days")
    _write_next(root_file, lambda root: next_root(root, add_publishers=_public_keys(keys), publisher_threshold=threshold,
                                                  expires_days=days), **options)


@keys_command.command("remove-publisher")
@_ROOT_FILE
@click.option("--key", "keys", required=True, multiple=True, help="the publisher's .pub file or key id; repeat it")
@click.option("--threshold", type=click.IntRange(min=1), help="the publisher threshold from this root on (default: unchanged)")
@_next_root_options
def remove_publisher_command(root_file: Path, keys: tuple[str, ...], threshold: int | None, **options) -> None:
    """Write the next root version without these publisher keys: once devices have it, their
    signatures no longer count (revoke a leaked or departed publisher's key this way)."""
    days = options.pop("expires_days")
    _write_next(root_file, lambda root: next_root(root, remove_publishers=_key_ids(keys), publisher_threshold=threshold,
                                                  expires_days=days), **options)


@keys_command.command("rotate-root")
@_ROOT_FILE
@click.option("--add-root-key", "added", multiple=True, type=_PUBLIC, help="a new root key holder's .pub; repeat it")
@click.option("--remove-root-key", "removed", multiple=True, help="a root key (.pub file or key id) to drop; repeat it")
@click.option("--threshold", type=click.IntRange(min=1), help="the root threshold from this root on (default: unchanged)")
@click.option("--timestamp-key", "timestamp_keys", multiple=True, type=_PUBLIC,
              help="replace the timestamp key(s) (devices then forget their last timestamp version)")
@_next_root_options
def rotate_root_command(root_file: Path, added: tuple[Path, ...], removed: tuple[str, ...], threshold: int | None,
                        timestamp_keys: tuple[Path, ...], **options) -> None:
    """Write the next root version with root keys added or removed, a new root threshold, or a
    new timestamp key; after a root key leaks, rotate it out with the others' signatures."""
    days = options.pop("expires_days")
    _write_next(root_file, lambda root: next_root(
        root, add_root_keys=_public_keys(added), remove_root_keys=_key_ids(removed), root_threshold=threshold,
        timestamp_keys=_public_keys(timestamp_keys) or None, expires_days=days), **options)


@keys_command.command("sign")
@click.argument("target", type=click.Path(exists=True, path_type=Path))
@click.option("--key", "key_path", required=True, type=_PUBLIC, help="your private key (root-<i>.key or publisher.key)")
@_PASSPHRASE_FILE
def sign_command(target: Path, key_path: Path, passphrase_file: Path | None) -> None:
    """Add your signature to TARGET: a root file (root.<N>.json), or a release (a bundle folder
    v<N>/ or its v<N>.tar), whose manifest.sigs.json lists the co-signing publishers."""
    key = load_private_key(key_path, read_passphrase(passphrase_file))
    if target.is_file() and target.suffix == ".json":
        _sign_root(target, key)
        return
    signature = sign_release(target, key)
    click.echo(f"signed the release {target} with key {signature.keyid}")


def _sign_root(target: Path, key: Ed25519PrivateKey) -> None:
    """Sign a root file, refusing a key whose signature would count for nothing."""
    current = load_root_file(target)
    previous = _previous_root(target, current)
    keyid = public_key_id(key.public_key())
    root_keys = {*current.body.role("root").keyids, *(previous.body.role("root").keyids if previous else ())}
    if keyid not in root_keys:
        raise TrustError(f"key {keyid[:16]}… is not a root key of root v{current.body.version} nor of the one before "
                         "it: its signature would not count; sign with a root-<i>.key")
    signed = sign_root_file(target, key)
    click.echo(f"signed root v{signed.body.version} with key {keyid}")
    click.echo(_root_status(previous, signed))


@keys_command.command("show")
@click.argument("root_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of a table")
def show_command(root_file: Path, as_json: bool) -> None:
    """Print a root's version, expiry, fingerprint, roles (keys and thresholds) and whether it
    carries enough signatures (against root.<N-1>.json when it lies beside it)."""
    signed = load_root_file(root_file)
    root = signed.body
    info = {"version": root.version, "expires": root.signed_dict()["expires"], "fingerprint": root_fingerprint(signed),
            "freshness_limit_s": root.freshness_limit_s, "signatures": [s.keyid for s in signed.signatures],
            "status": _root_status(_previous_root(root_file, signed), signed),
            "roles": {name: root.role(name).to_dict() for name in ROLE_NAMES}}
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"root v{root.version}, expires {info['expires']}, freshness limit {root.freshness_limit_s} s")
    click.echo(f"fingerprint {info['fingerprint']}\n{info['status']}")
    for name in ROLE_NAMES:
        role = root.role(name)
        short = " (never met: add keys)" if role.threshold > len(role.keyids) else ""
        click.echo(f"  {name:<10} {role.threshold} of {len(role.keyids)}{short}: {', '.join(role.keyids) or '-'}")


@click.group("bundle")
def bundle_command() -> None:
    """Build, verify and pack signed model bundles."""


@bundle_command.command("build")
@click.argument("spec", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_KEY
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path), help="new bundle folder (must not exist)")
@_PASSPHRASE_FILE
@click.option("--archive", type=click.Path(dir_okay=False, path_type=Path), help="also pack the bundle into this .tar")
@click.option("--force", is_flag=True, help="publish although the ECC gate fails (recorded in the signed manifest)")
@click.option("--reason", help="why the gate is overridden; required with --force")
def build_command(spec: Path, key_path: Path, out_dir: Path, passphrase_file: Path | None,
                  archive: Path | None, force: bool, reason: str | None) -> None:
    """Build and sign a bundle from a TOML SPEC (version, parents, mode, distance,
    normalize, optional gate = a gate JSON or the trainer's report.json, and [[artifact]]
    tables with file/role/source_version/target_version[/ecc = "report verdict"])."""
    from .bundle_builder import build_bundle, load_bundle_spec

    bundle_spec, sources, gate = load_bundle_spec(spec)
    private_key = load_private_key(key_path, read_passphrase(passphrase_file))
    bundle = build_bundle(
        out_dir, version=bundle_spec.version, parents=bundle_spec.parents, mode=bundle_spec.mode,
        distance=bundle_spec.distance, normalize=bundle_spec.normalize, artifacts=sources,
        gate=gate, private_key=private_key, force=force, force_reason=reason,
    )
    _echo_summary(bundle)
    if archive is not None:
        click.echo(f"archive: {pack_bundle(bundle.root, archive)}")


@bundle_command.command("verify")
@click.argument("bundle", type=click.Path(exists=True, path_type=Path))
@click.option("--public-key", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="the pinned publisher public key (publisher.pub)")
@click.option("--installed-version", type=click.IntRange(min=0),
              help="refuse the bundle unless its version is newer than this")
def verify_command(bundle: Path, public_key: Path, installed_version: int | None) -> None:
    """Verify a bundle folder or .tar archive: signature, every hash and size, dims,
    version monotonicity, and that every graph loads in ONNX Runtime with the declared
    input/output names and dims."""
    from .bundle_builder import check_graphs_load

    with tempfile.TemporaryDirectory(prefix="fctkit-verify-") as scratch:
        root = bundle if bundle.is_dir() else unpack_bundle(bundle, Path(scratch) / "bundle")
        verified = verify_bundle(root, public_key, installed_version=installed_version)
        providers = check_graphs_load(verified)
        _echo_summary(verified)
        click.echo(f"onnxruntime: {len(providers)} graph(s) load with the declared inputs/outputs")


@bundle_command.command("pack")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("archive", type=click.Path(dir_okay=False, path_type=Path))
def pack_command(bundle: Path, archive: Path) -> None:
    """Pack a bundle folder into a deterministic .tar ARCHIVE."""
    click.echo(f"archive: {pack_bundle(bundle, archive)}")


def _echo_summary(bundle: VerifiedBundle) -> None:
    m = bundle.manifest
    parents = ", ".join(f"v{p}" for p in m.parents) or "none"
    click.echo(f"OK bundle v{m.version} (parents {parents}) at {bundle.root}")
    click.echo(f"mode {m.mode}, distance {m.distance}, normalize {str(m.normalize).lower()}, "
               f"embedding_dim {m.embedding_dim}, side_info_dim {m.side_info_dim}")
    click.echo(f"publisher key id {m.publisher_key_id}")
    for a in m.artifacts:
        hop = f" v{a.source_version}->v{a.target_version}" if a.source_version is not None else ""
        dims = "a file the preprocessing reads" if a.is_file else ", ".join(
            f"{s.name}{list(s.shape)}" for s in a.inputs) + " -> " + ", ".join(f"{s.name}{list(s.shape)}" for s in a.outputs)
        click.echo(f"  {a.name:<22} {a.role}{hop} {a.precision} {a.size} B  {dims}")
    if m.preprocessing is not None:
        roles = ", ".join(f"{role} ({d.kind})" for role, d in m.preprocessing.roles)
        click.echo(f"takes raw items: {roles}; every graph is ONNX (no TensorRT engines: a GPU device's ONNX Runtime "
                   "may build its own, a device without one runs the graphs on the CPU)")
    if m.gate["forced"]:
        click.echo(f"WARNING gate overridden (forced): {m.gate['force_reason']}")


_GRAPH = dict(type=click.Path(exists=True, dir_okay=False, path_type=Path))


@click.command("export")
@_RUN_DIR
@_KEY
@_OUT
@click.option("--method", default="fct", show_default=True,
              help=f"which of the run's adapters v2 carries: for a run on images one of {', '.join(METHODS)} (λ-orth "
                   "methods give unified-mode bundles); for a features-mode run any variant in its gate.json, e.g. "
                   "residual, residual+query-positives+hubness, residual+query-map, residual+query-map+transition — the gate then "
                   "checks ECC, on the task's primary metric, of exactly what devices will run")
@click.option("--old-graph", **_GRAPH, help="features-mode runs: ONNX graph of the old model (v1's embed role): one float "
              "input, or with --preprocessing any inputs its declaration feeds")
@click.option("--new-graph", **_GRAPH, help="features-mode runs: ONNX graph of the new model (v2's embed role)")
@click.option("--side-info-graph", **_GRAPH, help="features-mode runs whose features have side-info: the side-info model's graph")
@click.option("--sample", **_GRAPH, help="features-mode runs: .npz of items' graph inputs ('input', or 'old_input'/"
              "'new_input'/'side_input') and the features your pipeline computed for them ('old', 'new', 'side'); each "
              "graph must reproduce them (parity, recorded in the manifest); with --preprocessing, JSON Lines of raw "
              "items and their features: {\"text\": ...} or {\"image\": \"path\"} (relative to the sample), \"old\": [...], "
              "\"new\": [...] (\"side\": [...]), optional \"purpose\": \"query\"")
@click.option("--preprocessing", "preprocessing_file", **_GRAPH,
              help="features-mode runs whose graphs take raw items: JSON or TOML (*.toml) declaring how devices turn an "
                   "image file or a text into the graphs' inputs (one declaration, or tables old/new/side_info; keys in "
                   "the README); bundles carry it signed")
@click.option("--tokenizer", "tokenizers", multiple=True, metavar="[GRAPH=]PATH",
              help="with a text --preprocessing: the tokenizer.json of every text graph (PATH) or of one (old=PATH, "
                   "new=PATH, side_info=PATH); repeat for several; bundles carry it signed")
@click.option("--parity-tolerance", default=1e-3, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="largest absolute difference allowed between a graph's outputs and the sample's features")
@click.option("--transition-days", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="+transition variants: devices end transition scoring this many days after upgrading at the latest "
                   "(0: only after a full backfill or `fctkit device end-transition`)")
@click.option("--chain", is_flag=True, help="export v1, v2, v3 from the run's chain models (h2, g2, h3 and direct h13)")
@_FIRST_VERSION
@_FP16
@click.option("--quantize", type=click.Choice(["int8", "fp16"]),
              help="the forward adapter (the graph every stored row passes through on upgrade) in int8 (ONNX Runtime "
                   "dynamic quantisation) or fp16; the gate is judged again on the run's evaluation data with the "
                   "quantised graph, and what it cost against fp32 is recorded in the manifest")
@_FORCE
@_REASON
@_PASSPHRASE_FILE
@click.option("--progress/--no-progress", default=True, show_default=True, help="progress bar while exporting")
def export_command(run_dir: Path, key_path: Path, out_dir: Path, method: str, old_graph: Path | None, new_graph: Path | None,
                   side_info_graph: Path | None, sample: Path | None, preprocessing_file: Path | None,
                   tokenizers: tuple[str, ...], parity_tolerance: float, transition_days: float,
                   chain: bool, first_version: int, fp16: bool, quantize: str | None, force: bool, reason: str | None,
                   passphrase_file: Path | None, progress: bool) -> None:
    """Export a `fctkit train` RUN_DIR as signed, versioned bundles ready for `fctkit admin publish`:
    every role exported to ONNX and parity-checked on the run's evaluation data, gated by the
    run's ECC verdicts. A run on features (a retrieval task, a features file) carries your own
    models: give --old-graph, --new-graph (--side-info-graph) and --sample; graphs that take
    image files or texts need --preprocessing (and --tokenizer for text)."""
    graphs = None
    named = {"--old-graph": old_graph, "--new-graph": new_graph, "--sample": sample}
    if any(v is not None for v in (*named.values(), side_info_graph, preprocessing_file)) or tokenizers:
        missing = [name for name, value in named.items() if value is None]
        if missing:
            raise click.UsageError(f"a features-mode export needs {', '.join(missing)} as well")
        if tokenizers and preprocessing_file is None:
            raise click.UsageError("--tokenizer goes with a text --preprocessing declaration")
        preprocessing = None if preprocessing_file is None else load_graph_preprocessing(
            preprocessing_file, tokenizers, ["old", "new"] + (["side_info"] if side_info_graph else []))
        graphs = UserGraphs(old_graph, new_graph, sample, side_info_graph, parity_tolerance, preprocessing)
    private_key = load_private_key(key_path, read_passphrase(passphrase_file))
    released = build_release(run_dir, out_dir, private_key=private_key, method=method, first_version=first_version,
                             chain=chain, fp16=fp16, force=force, force_reason=reason, progress=progress, graphs=graphs,
                             transition_days=transition_days, quantize=quantize)
    seen: dict[str, int] = {}
    for item in released:
        m = item.bundle.manifest
        parents = ", ".join(f"v{p}" for p in m.parents) or "none"
        click.echo(f"bundle v{m.version} (parents {parents}, mode {m.mode}) -> {item.bundle.root}  archive {item.archive}")
        click.echo(f"  {'artifact':<22} {'role':<13} {'hop':<8} {'size (B)':>9}  {'parity max abs err':>18}  from")
        for plan, export in item.exports:
            artifact = m.artifact(plan.role, source_version=plan.source_version, target_version=plan.target_version)
            hop = f"v{plan.source_version}->v{plan.target_version}" if plan.source_version is not None else ""
            shared = f" (same graph as v{seen[artifact.sha256]})" if seen.get(artifact.sha256, m.version) != m.version else ""
            seen.setdefault(artifact.sha256, m.version)
            click.echo(f"  {artifact.name:<22} {plan.role:<13} {hop:<8} {artifact.size:>9}  "
                       f"{export.parity.max_abs_error:>18.2e}  {plan.source}{shared}")
        verdicts = ", ".join(f"{name} {'holds' if ok else 'FAILS'}" for name, ok in m.gate["ecc"].items()) or "no adapters to gate"
        click.echo(f"  ECC gate: {verdicts}")
        if m.transition is not None:
            click.echo(f"  transition scoring from v{m.transition.previous_version}: weight {m.transition.weight:g}, "
                       f"at most {m.transition.max_days:g} days (0: until a full backfill or an explicit end)")
        if m.hubness is not None:
            click.echo(f"  hubness offsets: β = {m.hubness.beta:g}")
        if "quantization" in m.gate:
            q = m.gate["quantization"]
            click.echo(f"  {q['precision']} forward adapter: {q['metric']} {q['quantized']:.4f} (fp32 {q['fp32']:.4f}, "
                       f"{q['quantized'] - q['fp32']:+.4f})")
        if m.gate["forced"]:
            click.echo(f"  WARNING gate overridden (forced, recorded in the manifest): {m.gate['force_reason']}")


@click.command("export-compatible")
@_RUN_DIR
@_KEY
@_OUT
@click.option("--method", required=True, type=click.Choice(COMPATIBLE_METHODS),
              help="which compatible backbone of the run's one upgrade the bundles carry")
@_FIRST_VERSION
@_FP16
@_FORCE
@_REASON
@_PASSPHRASE_FILE
def export_compatible_command(run_dir: Path, key_path: Path, out_dir: Path, method: str, first_version: int, fp16: bool,
                              force: bool, reason: str | None, passphrase_file: Path | None) -> None:
    """Export a `fctkit train-compatible` RUN_DIR's old and new backbone of METHOD as signed
    bundles in mode "compatible" (devices switch query models, the gallery stays as it is);
    refused unless the run's ECC held for the method (or --force with a --reason, recorded in v2's manifest)."""
    from .compatible_release import export_compatible_release

    private_key = load_private_key(key_path, read_passphrase(passphrase_file))
    for bundle in export_compatible_release(run_dir, out_dir, private_key=private_key, method=method,
                                            first_version=first_version, fp16=fp16, force=force, force_reason=reason):
        m = bundle.manifest
        parents = ", ".join(f"v{p}" for p in m.parents) or "none"
        prefix = f", parents' rows compared on the first {m.compatible_dims} dims" if m.parents and m.compatible_dims < m.embedding_dim else ""
        click.echo(f"bundle v{m.version} (parents {parents}, mode {m.mode}, {m.embedding_dim}-d{prefix}) -> {bundle.root}")
        click.echo("  cases: " + ", ".join(f"{case} {metrics['top1']:.4f}" for case, metrics in m.gate["cases"].items()))
        if m.gate["forced"]:
            click.echo(f"  WARNING gate overridden (forced, recorded in the manifest): {m.gate['force_reason']}")
