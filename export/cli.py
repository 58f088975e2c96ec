"""`fctkit bundle …` and `fctkit export` (`fctkit keys …` is :mod:`.keys_cli`). `bundle verify`
needs neither torch nor onnx: it runs on a device with the core install plus onnxruntime.
`export` turns a `fctkit train` run into signed bundles (:mod:`fctkit.export.release`; needs torch)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import click
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fctkit.errors import TrustError
from fctkit.protos.bundle import VerifiedBundle, pack_bundle, unpack_bundle, verify_bundle
from fctkit.protos.trust import Root, Signed, read_release_signatures, verify_release

from .compatible_release import COMPATIBLE_METHODS
from .features_release import UserGraphs
from .keys import load_private_key, load_root_file, read_passphrase
from .keys_cli import PASSPHRASE_FILE
from .release import DEFAULT_EXPORT_ROLLBACK_DAYS, build_release
from .release_plan import METHODS
from .trained_run import read_run_json
from .user_preprocessing import load_graph_preprocessing

# What every release export takes: the run, the signing key, where the bundles go, their numbering, fp16.
_RUN_DIR = click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
_KEY = click.option(
    "--key",
    "key_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="publisher private key (publisher.key)",
)
_OUT = click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="folder for the bundles v<N>/ and their v<N>.tar archives",
)
_FIRST_VERSION = click.option(
    "--first-version",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="version number of the first bundle; the others follow",
)
_FP16 = click.option("--fp16", is_flag=True, help="store the graphs' weights in float16 (inputs/outputs stay float32)")
_FORCE = click.option(
    "--force", is_flag=True, help="publish although an ECC gate fails (recorded in the signed manifests)"
)
_REASON = click.option("--reason", help="why the gate is overridden; required with --force")


@click.group("bundle")
def bundle_command() -> None:
    """Build, verify and pack signed model bundles."""


@bundle_command.command("build")
@click.argument("spec", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_KEY
@click.option(
    "--out", "out_dir", required=True, type=click.Path(path_type=Path), help="new bundle folder (must not exist)"
)
@PASSPHRASE_FILE
@click.option("--archive", type=click.Path(dir_okay=False, path_type=Path), help="also pack the bundle into this .tar")
@click.option("--force", is_flag=True, help="publish although the ECC gate fails (recorded in the signed manifest)")
@click.option("--reason", help="why the gate is overridden; required with --force")
def build_command(
    spec: Path,
    key_path: Path,
    out_dir: Path,
    passphrase_file: Path | None,
    archive: Path | None,
    force: bool,
    reason: str | None,
) -> None:
    """Build and sign a bundle from a TOML SPEC (version, parents, mode, distance,
    normalize, optional gate = a gate JSON or the trainer's report.json, and [[artifact]]
    tables with file/role/source_version/target_version[/ecc = "report verdict"])."""
    from .bundle_builder import build_bundle, load_bundle_spec

    bundle_spec, sources, gate = load_bundle_spec(spec)
    private_key = load_private_key(key_path, read_passphrase(passphrase_file))
    bundle = build_bundle(
        out_dir,
        version=bundle_spec.version,
        parents=bundle_spec.parents,
        mode=bundle_spec.mode,
        distance=bundle_spec.distance,
        normalize=bundle_spec.normalize,
        artifacts=sources,
        gate=gate,
        private_key=private_key,
        force=force,
        force_reason=reason,
    )
    _echo_summary(bundle)
    if archive is not None:
        click.echo(f"archive: {pack_bundle(bundle.root, archive)}")


@bundle_command.command("verify")
@click.argument("bundle", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--public-key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="the pinned publisher public key (publisher.pub)",
)
@click.option(
    "--root",
    "root_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="instead of --public-key: a root file; the release must carry signatures of its publisher threshold",
)
@click.option(
    "--installed-version", type=click.IntRange(min=0), help="refuse the bundle unless its version is newer than this"
)
def verify_command(
    bundle: Path, public_key: Path | None, root_file: Path | None, installed_version: int | None
) -> None:
    """Verify a bundle folder or .tar archive: signature, every hash and size, dims,
    version monotonicity, and that every graph loads in ONNX Runtime with the declared
    input/output names and dims. With --root, also that publishers of the root's threshold
    co-signed it (`fctkit keys sign`): check a release before publishing it."""
    from .bundle_builder import check_graphs_load

    if (public_key is None) == (root_file is None):
        raise click.UsageError("give exactly one of --public-key and --root")
    with tempfile.TemporaryDirectory(prefix="fctkit-verify-") as scratch:
        root = bundle if bundle.is_dir() else unpack_bundle(bundle, Path(scratch) / "bundle")
        signers, publisher = _release_signers(root, load_root_file(root_file)) if root_file else (None, public_key)
        verified = verify_bundle(root, publisher, installed_version=installed_version)
        providers = check_graphs_load(verified)
        _echo_summary(verified)
        if signers is not None:
            click.echo(
                f"signed by {len(signers)} publisher key(s) of the root: {', '.join(k[:16] + '…' for k in sorted(signers))}"
            )
        click.echo(f"onnxruntime: {len(providers)} graph(s) load with the declared inputs/outputs")


def _release_signers(bundle: Path, root: Signed[Root]) -> tuple[frozenset[str], Ed25519PublicKey]:
    """The root's publisher keys that signed the release (at least its threshold), and the key
    of ``manifest.sig`` (the manifest's publisher), which must be one of the root's."""
    manifest_bytes, signatures = read_release_signatures(bundle)
    signers = verify_release(root, manifest_bytes, signatures)
    if (publisher := root.body.keys.get(signatures[0].keyid)) is None:
        raise TrustError(
            f"{bundle}'s manifest.sig is by key {signatures[0].keyid[:16]}…, which root v{root.body.version} "
            "does not list: have a listed publisher export the release"
        )
    return signers, publisher


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
    click.echo(
        f"mode {m.mode}, distance {m.distance}, normalize {str(m.normalize).lower()}, "
        f"embedding_dim {m.embedding_dim}, side_info_dim {m.side_info_dim}"
    )
    click.echo(f"publisher key id {m.publisher_key_id}")
    for a in m.artifacts:
        hop = f" v{a.source_version}->v{a.target_version}" if a.source_version is not None else ""
        dims = (
            "a file the preprocessing reads"
            if a.is_file
            else ", ".join(f"{s.name}{list(s.shape)}" for s in a.inputs)
            + " -> "
            + ", ".join(f"{s.name}{list(s.shape)}" for s in a.outputs)
        )
        click.echo(f"  {a.name:<22} {a.role}{hop} {a.precision} {a.size} B  {dims}")
    if m.preprocessing is not None:
        roles = ", ".join(f"{role} ({d.kind})" for role, d in m.preprocessing.roles)
        click.echo(
            f"takes raw items: {roles}; every graph is ONNX (no TensorRT engines: a GPU device's ONNX Runtime "
            "may build its own, a device without one runs the graphs on the CPU)"
        )
    if m.gate["forced"]:
        click.echo(f"WARNING gate overridden (forced): {m.gate['force_reason']}")


_GRAPH: dict[str, Any] = {"type": click.Path(exists=True, dir_okay=False, path_type=Path)}


@click.command("export")
@_RUN_DIR
@_KEY
@_OUT
@click.option(
    "--method",
    default="fct",
    show_default=True,
    help=f"which of the run's adapters v2 carries: for a run on images one of {', '.join(METHODS)} (λ-orth "
    "methods give unified-mode bundles); for a features-mode run any variant in its gate.json, e.g. "
    "residual, residual+query-positives+hubness, residual+query-map, residual+query-map+transition — the gate then "
    "checks ECC, on the task's primary metric, of exactly what devices will run",
)
@click.option(
    "--old-graph",
    **_GRAPH,
    help="features-mode runs: ONNX graph of the old model (v1's embed role): one float "
    "input, or with --preprocessing any inputs its declaration feeds",
)
@click.option("--new-graph", **_GRAPH, help="features-mode runs: ONNX graph of the new model (v2's embed role)")
@click.option(
    "--side-info-graph", **_GRAPH, help="features-mode runs whose features have side-info: the side-info model's graph"
)
@click.option(
    "--sample",
    **_GRAPH,
    help="features-mode runs: .npz of items' graph inputs ('input', or 'old_input'/"
    "'new_input'/'side_input') and the features your pipeline computed for them ('old', 'new', 'side'); each "
    "graph must reproduce them (parity, recorded in the manifest); with --preprocessing, JSON Lines of raw "
    'items and their features: {"text": ...} or {"image": "path"} (relative to the sample), "old": [...], '
    '"new": [...] ("side": [...]), optional "purpose": "query"',
)
@click.option(
    "--preprocessing",
    "preprocessing_file",
    **_GRAPH,
    help="features-mode runs whose graphs take raw items: JSON or TOML (*.toml) declaring how devices turn an "
    "image file or a text into the graphs' inputs (one declaration, or tables old/new/side_info; keys in "
    "the README); bundles carry it signed",
)
@click.option(
    "--tokenizer",
    "tokenizers",
    multiple=True,
    metavar="[GRAPH=]PATH",
    help="with a text --preprocessing: the tokenizer.json of every text graph (PATH) or of one (old=PATH, "
    "new=PATH, side_info=PATH); repeat for several; bundles carry it signed",
)
@click.option(
    "--parity-tolerance",
    default=1e-3,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="largest absolute difference allowed between a graph's outputs and the sample's features",
)
@click.option(
    "--transition-days",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="+transition variants: devices end transition scoring this many days after upgrading at the latest "
    "(0: only after a full backfill or `fctkit device end-transition`)",
)
@click.option(
    "--rollback-window-days",
    default=DEFAULT_EXPORT_ROLLBACK_DAYS,
    show_default=True,
    type=click.IntRange(0, 365),
    help="devices keep every row's previous vectors this many days after upgrading, so that a withdrawal "
    "reverts them exactly (0: none; they then revert through a backward graph or the vault originals)",
)
@click.option("--chain", is_flag=True, help="export v1, v2, v3 from the run's chain models (h2, g2, h3 and direct h13)")
@_FIRST_VERSION
@_FP16
@click.option(
    "--quantize",
    type=click.Choice(["int8", "fp16"]),
    help="the forward adapter (the graph every stored row passes through on upgrade) in int8 (ONNX Runtime "
    "dynamic quantisation) or fp16; the gate is judged again on the run's evaluation data with the "
    "quantised graph, and what it cost against fp32 is recorded in the manifest",
)
@_FORCE
@_REASON
@PASSPHRASE_FILE
@click.option("--progress/--no-progress", default=True, show_default=True, help="progress bar while exporting")
def export_command(
    run_dir: Path,
    key_path: Path,
    out_dir: Path,
    method: str,
    old_graph: Path | None,
    new_graph: Path | None,
    side_info_graph: Path | None,
    sample: Path | None,
    preprocessing_file: Path | None,
    tokenizers: tuple[str, ...],
    parity_tolerance: float,
    transition_days: float,
    rollback_window_days: int,
    chain: bool,
    first_version: int,
    fp16: bool,
    quantize: str | None,
    force: bool,
    reason: str | None,
    passphrase_file: Path | None,
    progress: bool,
) -> None:
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
        assert old_graph is not None and new_graph is not None and sample is not None  # none is missing
        if tokenizers and preprocessing_file is None:
            raise click.UsageError("--tokenizer goes with a text --preprocessing declaration")
        preprocessing = (
            None
            if preprocessing_file is None
            else load_graph_preprocessing(
                preprocessing_file, tokenizers, ["old", "new"] + (["side_info"] if side_info_graph else [])
            )
        )
        graphs = UserGraphs(old_graph, new_graph, sample, side_info_graph, parity_tolerance, preprocessing)
    private_key = load_private_key(key_path, read_passphrase(passphrase_file))
    released = build_release(
        run_dir,
        out_dir,
        private_key=private_key,
        method=method,
        first_version=first_version,
        chain=chain,
        fp16=fp16,
        force=force,
        force_reason=reason,
        progress=progress,
        graphs=graphs,
        transition_days=transition_days,
        quantize=quantize,
        rollback_window_days=rollback_window_days,
    )
    seen: dict[str, int] = {}
    for item in released:
        m = item.bundle.manifest
        parents = ", ".join(f"v{p}" for p in m.parents) or "none"
        click.echo(
            f"bundle v{m.version} (parents {parents}, mode {m.mode}) -> {item.bundle.root}  archive {item.archive}"
        )
        click.echo(f"  {'artifact':<22} {'role':<13} {'hop':<8} {'size (B)':>9}  {'parity max abs err':>18}  from")
        for plan, export in item.exports:
            artifact = m.artifact(plan.role, source_version=plan.source_version, target_version=plan.target_version)
            hop = f"v{plan.source_version}->v{plan.target_version}" if plan.source_version is not None else ""
            shared = (
                f" (same graph as v{seen[artifact.sha256]})"
                if seen.get(artifact.sha256, m.version) != m.version
                else ""
            )
            seen.setdefault(artifact.sha256, m.version)
            click.echo(
                f"  {artifact.name:<22} {plan.role:<13} {hop:<8} {artifact.size:>9}  "
                f"{export.parity.max_abs_error:>18.2e}  {plan.source}{shared}"
            )
        verdicts = (
            ", ".join(f"{name} {'holds' if ok else 'FAILS'}" for name, ok in m.gate["ecc"].items())
            or "no adapters to gate"
        )
        click.echo(f"  ECC gate: {verdicts}")
        if m.transition is not None:
            click.echo(
                f"  transition scoring from v{m.transition.previous_version}: weight {m.transition.weight:g}, "
                f"at most {m.transition.max_days:g} days (0: until a full backfill or an explicit end)"
            )
        if m.hubness is not None:
            click.echo(f"  hubness offsets: β = {m.hubness.beta:g}")
        if "quantization" in m.gate:
            q = m.gate["quantization"]
            click.echo(
                f"  {q['precision']} forward adapter: {q['metric']} {q['quantized']:.4f} (fp32 {q['fp32']:.4f}, "
                f"{q['quantized'] - q['fp32']:+.4f})"
            )
        if m.gate["forced"]:
            click.echo(f"  WARNING gate overridden (forced, recorded in the manifest): {m.gate['force_reason']}")
    advice = read_run_json(run_dir / "gate.json").get("advice")
    if advice:
        click.echo(f"note: {advice}")


@click.command("export-compatible")
@_RUN_DIR
@_KEY
@_OUT
@click.option(
    "--method",
    required=True,
    type=click.Choice(COMPATIBLE_METHODS),
    help="which compatible backbone of the run's one upgrade the bundles carry",
)
@_FIRST_VERSION
@_FP16
@_FORCE
@_REASON
@PASSPHRASE_FILE
def export_compatible_command(
    run_dir: Path,
    key_path: Path,
    out_dir: Path,
    method: str,
    first_version: int,
    fp16: bool,
    force: bool,
    reason: str | None,
    passphrase_file: Path | None,
) -> None:
    """Export a `fctkit train-compatible` RUN_DIR's old and new backbone of METHOD as signed
    bundles in mode "compatible" (devices switch query models, the gallery stays as it is);
    refused unless the run's ECC held for the method (or --force with a --reason, recorded in v2's manifest)."""
    from .compatible_release import export_compatible_release

    private_key = load_private_key(key_path, read_passphrase(passphrase_file))
    for bundle in export_compatible_release(
        run_dir,
        out_dir,
        private_key=private_key,
        method=method,
        first_version=first_version,
        fp16=fp16,
        force=force,
        force_reason=reason,
    ):
        m = bundle.manifest
        parents = ", ".join(f"v{p}" for p in m.parents) or "none"
        prefix = (
            f", parents' rows compared on the first {m.compatible_dims} dims"
            if m.parents and m.compatible_dims < m.embedding_dim
            else ""
        )
        click.echo(
            f"bundle v{m.version} (parents {parents}, mode {m.mode}, {m.embedding_dim}-d{prefix}) -> {bundle.root}"
        )
        click.echo(
            "  cases: " + ", ".join(f"{case} {metrics['top1']:.4f}" for case, metrics in m.gate["cases"].items())
        )
        if m.gate["forced"]:
            click.echo(f"  WARNING gate overridden (forced, recorded in the manifest): {m.gate['force_reason']}")
