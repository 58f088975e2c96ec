"""Exporting and signing a ``fctkit train`` run's release (``fctkit export``).

:func:`build_release` exports every artifact :func:`~fctkit.export.release_plan.plan_release`
lists from the run's saved models and adapters, each role parity-checked on the run's real
evaluation data, and builds one signed bundle per version.
:func:`fctkit.export.bundle_builder.build_bundle` refuses a failing gate unless ``force`` (with
a reason, recorded in the signed manifest); the release refuses it before exporting anything.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fctkit.errors import GateError, InputError
from fctkit.protos.bundle import VerifiedBundle, gate_failures, gated_artifacts, pack_bundle, verify_bundle

from .bundle_builder import build_bundle
from .expected_health import measured_expectation
from .features_release import UserGraphs, check_user_graphs, hubness_role
from .quantize import check_quantization, judged_gate, quantized_forward
from .release_plan import RolePlan, VersionPlan, plan_release
from .roles import RoleExport, export_role, role_module
from .trained_run import TrainedRun
from .user_preprocessing import bundle_preprocessing

#: the rollback window `fctkit export` writes into new bundles: a withdrawal within a week reverts devices exactly
DEFAULT_EXPORT_ROLLBACK_DAYS = 7


@dataclass(frozen=True)
class ReleasedBundle:
    """One built bundle: the verified bundle, its archive, and how each artifact was exported."""

    bundle: VerifiedBundle
    archive: Path
    exports: tuple[tuple[RolePlan, RoleExport], ...]


def build_release(
    run_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    private_key: Ed25519PrivateKey,
    method: str = "fct",
    first_version: int = 1,
    chain: bool = False,
    fp16: bool = False,
    force: bool = False,
    force_reason: str | None = None,
    progress: bool = False,
    graphs: UserGraphs | None = None,
    transition_days: float = 30.0,
    quantize: str | None = None,
    rollback_window_days: int = DEFAULT_EXPORT_ROLLBACK_DAYS,
) -> list[ReleasedBundle]:
    """Export and sign every version of the release into ``out_dir/v{N}/`` and ``out_dir/v{N}.tar``.

    A features-mode run needs ``graphs`` (the team's embed graphs and the sample that checks
    them, before anything is exported); ``transition_days``: how long a declared transition
    lasts on a device at most (0: until a full backfill or an explicit end). ``quantize``
    ("int8", "fp16"): the forward adapter in that precision, judged again (:mod:`.quantize`).
    ``rollback_window_days``: how long devices keep the rows' previous vectors after upgrading (0: none).

    A role exported from the same saved file (ψ shared by v1 and v2) is exported once and the
    same ONNX bytes go into every bundle that lists it. Raises :class:`GateError` before
    exporting anything when a version's ECC gate fails and ``force`` is not given. Versions
    appear in ``out_dir`` only when the whole release succeeded."""
    if force and not (force_reason and force_reason.strip()):
        raise GateError("--force needs a reason (--reason '...'): the override is recorded in the signed manifest")
    _check_quantize(quantize, fp16, chain)
    run = TrainedRun.open(run_dir)
    plans = plan_release(run, method=method, first_version=first_version, chain=chain, transition_days=transition_days)
    out_dir = Path(out_dir)
    refuse_existing_versions(out_dir, [plan.version for plan in plans])
    _check_gates(plans, force, run.gate.get("advice"))
    ready = _ready_graphs(run, plans, graphs)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        exporter = partial(
            _Exporter,
            run,
            _RealInputs(run, chain),
            fp16=fp16,
            quantize=quantize,
            ready=ready,
            bar=_progress_bar(sum(len(p.roles) for p in plans), progress),
        )
        built = _build_versions(
            run, plans, out_dir, private_key, method, exporter, force, force_reason, rollback_window_days, chain
        )
    except BaseException:
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise
    public_key = private_key.public_key()
    return [
        ReleasedBundle(verify_bundle(out_dir / f"v{version}", public_key), out_dir / f"v{version}.tar", exports)
        for version, exports in built
    ]


def _build_versions(
    run: TrainedRun,
    plans: Sequence[VersionPlan],
    out_dir: Path,
    private_key: Ed25519PrivateKey,
    method: str,
    exporter: Callable[..., _Exporter],
    force: bool,
    force_reason: str | None,
    rollback_window_days: int,
    chain: bool,
) -> list[tuple[int, tuple[tuple[RolePlan, RoleExport], ...]]]:
    """``exporter(folder=...)``: the :class:`_Exporter` of the release, given its scratch folder.
    Each forward-mode version with a forward adapter from the run's old model records its health
    expectation (not a chain's hops, whose old embeddings are another version's, nor a unified
    release, whose adapted rows live in a shared space rather than the new model's)."""
    built = []
    # Everything is built in a scratch folder and moved into place at the end: a refused or
    # failed release leaves no partial versions behind.
    with tempfile.TemporaryDirectory(prefix=".release-", dir=out_dir) as scratch_dir:
        scratch = Path(scratch_dir)
        export = exporter(folder=scratch / "onnx")
        with export.bar:
            for plan in plans:
                exports = tuple((role, export(role)) for role in plan.roles)
                quantized = [e for role, e in exports if role.role == "forward" and export.quantize]
                gate = judged_gate(run, method, plan.gate, quantized[0], force) if quantized else plan.gate
                preprocessing, tokenizers = bundle_preprocessing([e for _, e in exports])
                forwards = [e.export.path for role, e in exports if role.role == "forward"]
                measurable = len(forwards) == 1 and plan.mode == "forward" and not chain
                expectation = measured_expectation(run, forwards[0], gate["cases"]) if measurable else None
                build_bundle(
                    scratch / f"v{plan.version}",
                    version=plan.version,
                    parents=plan.parents,
                    mode=plan.mode,
                    distance=run.distance,
                    normalize=run.distance == "cosine",
                    artifacts=[e.artifact for _, e in exports] + tokenizers,
                    gate=gate,
                    private_key=private_key,
                    force=force,
                    force_reason=force_reason,
                    preprocessing=preprocessing,
                    **plan.declarations,
                    rollback_window_days=rollback_window_days,
                    health_expectation=expectation,
                    parity={
                        role.name: {
                            "max_abs_error": e.parity.max_abs_error,
                            "tolerance": e.parity.tolerance,
                            "against": e.parity.against,
                        }
                        for role, e in exports
                    },
                )
                pack_bundle(scratch / f"v{plan.version}", scratch / f"v{plan.version}.tar")
                built.append((plan.version, exports))
        move_versions_into_place(scratch, out_dir, [version for version, _ in built])
    return built


def refuse_existing_versions(out_dir: Path, versions: Sequence[int]) -> None:
    """:class:`InputError` when ``out_dir`` already holds any of these versions' bundle or archive."""
    for version in versions:
        for target in (out_dir / f"v{version}", out_dir / f"v{version}.tar"):
            if target.exists():
                raise InputError(f"{target} already exists: choose an empty --out folder or remove it")


def move_versions_into_place(scratch: Path, out_dir: Path, versions: Sequence[int]) -> None:
    """Move each version's bundle folder and archive, built in ``scratch``, into ``out_dir``."""
    for version in versions:
        for name in (f"v{version}", f"v{version}.tar"):
            os.rename(scratch / name, out_dir / name)


def export_release(
    run_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    private_key: Ed25519PrivateKey,
    method: str = "fct",
    first_version: int = 1,
    chain: bool = False,
    fp16: bool = False,
    force: bool = False,
    force_reason: str | None = None,
    quantize: str | None = None,
) -> list[VerifiedBundle]:
    """The release's bundles, verified as a device verifies them; see :func:`build_release`."""
    released = build_release(
        run_dir,
        out_dir,
        private_key=private_key,
        method=method,
        first_version=first_version,
        chain=chain,
        fp16=fp16,
        force=force,
        force_reason=force_reason,
        quantize=quantize,
    )
    return [r.bundle for r in released]


class _RealInputs:
    """The held-out real arrays each role's parity check runs on, by name."""

    def __init__(self, run: TrainedRun, chain: bool) -> None:
        self.run, self.chain = run, chain

    def __getitem__(self, key: str) -> np.ndarray:
        if key == "images":
            return self.run.eval_images
        table = self.run.chain_features if self.chain else self.run.eval_features
        return table[key]


@dataclass
class _Exporter:
    run: TrainedRun
    real: _RealInputs
    folder: Path
    fp16: bool
    quantize: str | None
    bar: Any
    ready: dict[str, Callable[[Path], RoleExport]] = field(default_factory=dict)  # graphs not exported from torch
    done: dict[tuple[Any, ...], RoleExport] = field(default_factory=dict)

    def __call__(self, plan: RolePlan) -> RoleExport:
        key: tuple[Any, ...] = (plan.source, plan.role, plan.source_version, plan.target_version)
        if plan.role in ("embed", "side_info"):
            key = (plan.source, plan.role)  # one graph per model, whichever versions list it
        if key not in self.done and plan.source in self.ready:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.done[key] = self.ready[plan.source](self.folder)
        if key not in self.done:
            path = self.folder / f"{len(self.done):02d}-{plan.name}.onnx"
            self.bar.set_description(f"export {plan.name} from {plan.source}")
            trained, real = self.run.load(plan.source), [np.asarray(self.real[k], np.float32) for k in plan.inputs]
            self.done[key] = export_role(
                plan.role,
                trained,
                path,
                real,
                source_version=plan.source_version,
                target_version=plan.target_version,
                fp16=self.fp16,
            )
            if self.quantize and plan.role == "forward":
                self.done[key] = quantized_forward(
                    self.done[key], role_module("forward", trained)[0], real, self.quantize
                )
        self.bar.update(1)
        return self.done[key]


def _ready_graphs(
    run: TrainedRun, plans: Sequence[VersionPlan], graphs: UserGraphs | None
) -> dict[str, Callable[[Path], RoleExport]]:
    """The graphs a features-mode release takes as they are (the team's, checked now, before
    anything is exported) or builds without torch (the hubness graph)."""
    if not run.features_mode:
        if graphs is not None:
            raise InputError(
                f"{run.root} was trained on images: its bundles carry the run's own backbones; drop the graph options"
            )
        return {}
    if graphs is None:
        raise InputError(
            f"{run.root} was trained on pre-extracted features: name the embed graphs of the models they came "
            "from (--old-graph, --new-graph, --side-info-graph when the features have side-info) and a --sample "
            "that checks them"
        )
    has_side = run.eval_features["side"].shape[1] > 0
    if has_side != (graphs.side_info is not None):
        raise InputError(
            "the run's features have side-info: name its graph with --side-info-graph"
            if has_side
            else "the run's features have no side-info: drop --side-info-graph"
        )
    checked = check_user_graphs(graphs, run.eval_features)
    ready: dict[str, Callable[[Path], RoleExport]] = {
        source: partial(_made, export) for source, export in checked.items()
    }
    for role in (r for plan in plans for r in plan.roles if r.role == "hubness"):
        reference = np.load(run.root / role.source, allow_pickle=False)
        ready[role.source] = hubness_role(reference, int(run.gate["hubness_k"]), run.eval_features["new"][:1000])
    return ready


def _check_quantize(quantize: str | None, fp16: bool, chain: bool) -> None:
    if quantize is None:
        return
    check_quantization(quantize)
    if fp16:
        raise InputError("--fp16 stores every graph in float16 already; give --fp16 or --quantize, not both")
    if chain:
        raise InputError("--quantize judges one upgrade's forward adapter; chain releases are exported in fp32 only")


def _check_gates(plans: Sequence[VersionPlan], force: bool, advice: str | None = None) -> None:
    """Refuse before exporting anything when a version's ECC gate fails and ``force`` is not set
    (with the run's ``advice`` on why, when it has one)."""
    failing = [
        f"v{plan.version} {name}"
        for plan in plans
        for name in gate_failures(gated_artifacts(plan.roles, plan.mode, plan.parents), plan.gate["ecc"])
    ]
    if failing and not force:
        raise GateError(
            f"publishing refused: the run's ECC (M(new, h(old)) > M(old, old)) does not hold for {', '.join(failing)}; "
            "fix the adapters, or pass --force --reason '...' to override on the record"
            + (f". Why: {advice}" if advice else "")
        )


def _progress_bar(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, unit="role", leave=False)


__all__ = ["ReleasedBundle", "build_release", "export_release"]


def _made(export: RoleExport, _folder: Path) -> RoleExport:
    """A graph given ready-made (exported elsewhere): the same export whatever the folder."""
    return export
