"""From a ``fctkit train-compatible`` run to signed bundles in mode ``compatible``.

A backbone trained to be compatible (BCT, BT², CoReS) needs no transformation on the device:
its queries are compared with the older version's gallery rows as they are. The release is

==========  ==================================================================================
version     artifacts
==========  ==================================================================================
v1          ``embed`` = the method's first version (mode ``compatible``, no parents)
v2          ``embed`` = the method's new version (mode ``compatible``, parent v1); for BT² the
            manifest's ``compatible_prefix_dim`` = the old dim: v1's rows are compared with
            the first that many dims of v2's embedding
==========  ==================================================================================

Each gate records old/old, new/old and new/new of the run's one-upgrade evaluation, and v2's
records the run's ECC verdict (new/old > old/old) for its ``embed`` graph, which the bundle
format gates like an adapter: publishing is refused when it failed, unless ``force`` with a
reason, which the signed manifest then records.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, cast

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fctkit.errors import DataUnavailableError, GateError, InputError
from fctkit.protos.bundle import VerifiedBundle, artifact_name, pack_bundle

from .bundle_builder import build_bundle
from .release import move_versions_into_place, refuse_existing_versions
from .roles import export_role
from .trained_run import read_run_json

COMPATIBLE_METHODS = ("bct", "bt2", "cores", "cores-hoc")
PARITY_ROWS = 512  # held-out evaluation images each graph's parity check runs on


def export_compatible_release(
    run_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    private_key: Ed25519PrivateKey,
    method: str,
    first_version: int = 1,
    fp16: bool = False,
    force: bool = False,
    force_reason: str | None = None,
) -> list[VerifiedBundle]:
    """Export the run's one-upgrade models of ``method`` as bundles ``v{first_version}`` and
    ``v{first_version + 1}`` (directories and ``.tar`` archives) in ``out_dir``; returns them
    verified as a device verifies them. Nothing is left in ``out_dir`` when it fails."""
    run, out = Path(run_dir), Path(out_dir)
    if method not in COMPATIBLE_METHODS:
        raise InputError(
            f"method {method!r} is not a compatible backbone method; choose from {', '.join(COMPATIBLE_METHODS)}"
        )
    if first_version < 1:
        raise InputError(f"first_version must be >= 1, got {first_version}")
    config, gate = _run_files(run)
    if method not in gate["ecc"]:
        raise InputError(
            f"{run} did not train {method!r} (it trained: {', '.join(sorted(gate['ecc']))}); add it to `methods`"
        )
    holds = gate["ecc"][method] is True
    if not holds and not force:
        cases = gate["cases"][method]
        raise GateError(
            f"publishing refused: ECC does not hold for {method} in {run} (new/old {cases['new/old']['top1']:.4f} "
            f"<= old/old {cases['old/old']['top1']:.4f}): its queries would degrade the devices' galleries; "
            "pass --force --reason '...' to publish anyway on the record"
        )
    models = [_load(run / "models" / "upgrade" / method / f"v{k}.pt") for k in (1, 2)]
    images = _parity_images(config)
    old_dim, new_dim = gate["dims"][method]
    v1, v2 = first_version, first_version + 1
    cases = gate["cases"][method]
    plans = [
        (v1, (), models[0], {"cases": {"old/old": cases["old/old"]}, "ecc": {}}, None),
        (
            v2,
            (v1,),
            models[1],
            {"cases": cases, "ecc": {artifact_name("embed"): holds}},
            old_dim if new_dim != old_dim else None,
        ),
    ]
    refuse_existing_versions(out, [v1, v2])
    out.mkdir(parents=True, exist_ok=True)
    distance = config.evaluation.distance
    bundles = []
    with tempfile.TemporaryDirectory(prefix=".compatible-release-", dir=out) as scratch_dir:
        scratch = Path(scratch_dir)
        for version, parents, model, version_gate, prefix in plans:
            exported = export_role("embed", model, scratch / f"embed-v{version}.onnx", [images], fp16=fp16)
            build_bundle(
                scratch / f"v{version}",
                version=version,
                parents=parents,
                mode="compatible",
                distance=distance,
                normalize=distance == "cosine",
                artifacts=[exported.artifact],
                gate=version_gate,
                private_key=private_key,
                force=force,
                force_reason=force_reason,
                compatible_prefix_dim=prefix,
            )
            pack_bundle(scratch / f"v{version}", scratch / f"v{version}.tar")
        move_versions_into_place(scratch, out, [v1, v2])
    from fctkit.protos.bundle import verify_bundle

    for version, *_ in plans:
        bundles.append(verify_bundle(out / f"v{version}", private_key.public_key()))
    return bundles


def _run_files(run: Path) -> tuple[Any, dict[str, Any]]:
    for name in ("config.json", "gate.json"):
        if not (run / name).is_file():
            raise DataUnavailableError(
                f"{run} is not a complete `fctkit train-compatible` run: {name} is missing; run "
                f"`fctkit train-compatible --config CONFIG --out {run}` first"
            )
    from fctkit.config import from_mapping
    from fctkit.trainer.compatible_config import CompatibleConfig

    config = from_mapping(CompatibleConfig, read_run_json(run / "config.json"), where=f"{run}/config.json")
    gate = read_run_json(run / "gate.json")
    if not all(isinstance(gate.get(k), dict) for k in ("cases", "ecc", "dims")):
        raise InputError(f"{run}/gate.json is not a train-compatible gate (cases, ecc, dims); train the run again")
    return config, gate


def _load(path: Path) -> Any:
    from fctkit.trainer.compatible_models import BT2Backbone, load_compatible_model

    if not path.is_file():
        raise DataUnavailableError(f"{path} is missing: the run is incomplete; train it again")
    model = load_compatible_model(path)
    return model.export_module() if isinstance(model, BT2Backbone) else model


def _parity_images(config: Any) -> np.ndarray:
    from fctkit.trainer.run_data import load_image_splits

    splits = load_image_splits(config)
    return cast(np.ndarray, splits.images[splits.evaluation[:PARITY_ROWS]])
