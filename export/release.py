"""From a ``fctkit train`` run to signed, versioned bundles (``fctkit export``).

A release is one bundle per model version, exported from the run's saved models and
adapters, each role parity-checked on the run's real evaluation data:

==========  ==================================================================================
version     artifacts (forward methods: FCT, FastFill, least squares, Procrustes)
==========  ==================================================================================
v1          ``embed`` = old backbone, ``side_info`` = ψ
v2          ``embed`` = new backbone, ``side_info`` = ψ (the *same* graph file as v1's, so both
            manifests list the same SHA-256), ``forward`` 1→2 = the method's h; FastFill adds
            ``uncertainty`` 1→2 (σ)
==========  ==================================================================================

λ-orth methods give ``unified`` bundles: v2 holds ``forward`` F (1→2) and ``backward`` B
(2→1, the materialised matrix). With ``chain=True`` the release is v1, v2, v3 from the run's
chain models: v2 holds ``forward`` h2 and ``side_forward`` g2 (1→2); v3 holds ``forward``
h3 (2→3) and the direct ``forward`` h13 (1→3) for devices that skipped v2; every version
carries its own ψ_v.

Each bundle's gate holds the evaluation cases that justify it and, per forward/backward
artifact, the run's ECC verdict; :func:`fctkit.export.bundle.build_bundle` refuses a
failing gate unless ``force`` (with a reason, recorded in the signed manifest).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fctkit.errors import DataUnavailableError, GateError, InputError
from fctkit.protos.bundle import (GATED_ROLES, Mode, Role, VerifiedBundle, artifact_name, gate_failures, gated_artifacts,
                                  pack_bundle, verify_bundle)

from .bundle import build_bundle
from .features_release import UserGraphs, Variant, check_user_graphs, declarations, hubness_role
from .roles import RoleExport, export_role

FORWARD_METHODS = ("fct", "fct-no-side-info", "fastfill", "least-squares", "procrustes")
UNIFIED_METHODS = ("lambda-orth", "lambda-orth-relaxed")
METHODS = FORWARD_METHODS + UNIFIED_METHODS
#: The case name under which the method's adapted retrieval is recorded in a bundle's gate.
ADAPTED_CASE = {"forward": "new/h(old)", "unified": "B(new)/F(old)"}
CHAIN_VERSIONS = 3


# --------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class TrainedRun:
    """A ``fctkit train`` output folder, read lazily: config, gate, features, models."""

    root: Path

    @classmethod
    def open(cls, run_dir: str | os.PathLike) -> TrainedRun:
        root = Path(run_dir)
        for name in ("config.json", "gate.json", "features/eval.npz"):
            if not (root / name).is_file():
                raise DataUnavailableError(
                    f"{root} is not a complete `fctkit train` run: {name} is missing; run "
                    f"`fctkit train --config CONFIG --out {root}` first"
                )
        return cls(root)

    @cached_property
    def config(self) -> Any:
        """The run's :class:`~fctkit.trainer.pipeline.PipelineConfig` (from config.json)."""
        from fctkit.config import from_mapping
        from fctkit.trainer.pipeline import PipelineConfig

        return from_mapping(PipelineConfig, _read_json(self.root / "config.json"), where=f"{self.root}/config.json")

    @cached_property
    def gate(self) -> dict:
        return _read_json(self.root / "gate.json")

    @property
    def features_mode(self) -> bool:
        """Trained on pre-extracted features (a task or a features file): no backbones of its own."""
        return self.config.data.name in ("features", "task")

    @property
    def distance(self) -> str:
        return self.config.evaluation.distance

    @cached_property
    def eval_features(self) -> dict[str, np.ndarray]:
        """``old``, ``side``, ``new`` and (class-level runs) ``labels`` of the evaluation gallery."""
        return _read_npz(self.root / "features" / "eval.npz", ("old", "side", "new"), optional=("labels",))

    @cached_property
    def chain_features(self) -> dict[str, np.ndarray]:
        """``v{v}_embedding``, ``v{v}_side`` (v = 1..3) and ``labels`` of the evaluation split."""
        keys = ("labels", *(f"v{v}_{kind}" for v in range(1, CHAIN_VERSIONS + 1) for kind in ("embedding", "side")))
        return _read_npz(self.root / "features" / "chain_eval.npz", keys)

    @cached_property
    def eval_images(self) -> np.ndarray:
        """The evaluation split's images, rebuilt deterministically from the run's config."""
        if self.config.data.name == "features":
            raise InputError(
                f"{self.root} was trained on pre-extracted features: it has no backbones to put in a bundle's "
                "embed role; export needs a run on image data (digits, fashion-mnist)"
            )
        from fctkit.trainer.pipeline import load_image_splits

        splits = load_image_splits(self.config)
        labels = splits.labels[splits.evaluation]
        if not np.array_equal(labels, self.eval_features["labels"]):
            raise InputError(
                f"{self.root}: the evaluation split rebuilt from config.json does not match features/eval.npz "
                "(the dataset or the split code changed since the run); train the run again"
            )
        return splits.images[splits.evaluation]

    def load(self, relative: str) -> Any:
        """A saved model or adapter (``models/….pt`` or ``adapters/….pt``) on the CPU."""
        from fctkit.trainer import load_adapter, load_backbone, load_side_info

        path = self.root / relative
        if not path.is_file():
            raise DataUnavailableError(f"{path} is missing: this run did not train it (check its config) or is incomplete")
        if relative.startswith("adapters/"):
            return load_adapter(path)
        return load_side_info(path) if relative.endswith("side_info.pt") else load_backbone(path)


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class RolePlan:
    """One artifact of one version: which saved file it comes from and its real inputs."""

    role: Role
    source: str  # the run-relative file it is exported from, e.g. "models/side_info.pt"
    inputs: tuple[str, ...]  # keys of the real-input table, one per graph input
    source_version: int | None = None
    target_version: int | None = None

    @property
    def name(self) -> str:
        return artifact_name(self.role, self.source_version, self.target_version)


@dataclass(frozen=True)
class VersionPlan:
    """One bundle of the release."""

    version: int
    parents: tuple[int, ...]
    mode: Mode
    roles: tuple[RolePlan, ...]
    gate: dict = field(default_factory=dict)
    declarations: dict = field(default_factory=dict)  # transition= / hubness= (fctkit.protos.search_policy)


def plan_release(run: TrainedRun, *, method: str = "fct", first_version: int = 1, chain: bool = False,
                 transition_days: float = 30.0) -> list[VersionPlan]:
    """The versions, roles and gates of a release, without exporting anything. For a
    features-mode run ``method`` is a variant the run trained (``residual+query-map+transition``…;
    :mod:`.features_release`) and its embed graphs are the team's own."""
    if first_version < 1:
        raise InputError(f"first_version must be >= 1, got {first_version}")
    try:
        if run.features_mode:
            if chain:
                raise InputError("chain releases need a run on image data; a features-mode run has one upgrade")
            return _features_plan(run, method, first_version, transition_days)
        return _chain_plan(run, method, first_version) if chain else _two_version_plan(run, method, first_version)
    except (KeyError, TypeError) as exc:
        raise InputError(
            f"{run.root}/gate.json lacks the entry {exc} (or it has the wrong type): it was not written by this "
            "fctkit's trainer; train the run again"
        ) from exc


def _two_version_plan(run: TrainedRun, method: str, v1: int) -> list[VersionPlan]:
    if method not in METHODS:
        raise InputError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    gate = run.gate
    if method not in gate.get("ecc", {}):
        trained = ", ".join(sorted(gate.get("ecc", {}))) or "none"
        raise InputError(f"the run did not train {method!r} (it trained: {trained}); add it to `methods` and train again")
    v2 = v1 + 1
    mode: Mode = "unified" if method in UNIFIED_METHODS else "forward"
    has_side = run.eval_features["side"].shape[1] > 0
    side = (RolePlan("side_info", "models/side_info.pt", ("images",)),) if has_side else ()
    adapter = f"adapters/{method}.pt"
    takes_side = has_side and method in ("fct", "fastfill")
    h_inputs = ("old", "side") if takes_side else ("old",)
    transforms = [RolePlan("forward", adapter, h_inputs, v1, v2)]
    if method == "fastfill":
        transforms.append(RolePlan("uncertainty", adapter, h_inputs, v1, v2))
    if mode == "unified":
        transforms.append(RolePlan("backward", adapter, ("new",), v2, v1))
    cases = gate["cases"]
    gated = {p.name: gate["ecc"][method] is True for p in transforms if p.role in GATED_ROLES}
    return [
        VersionPlan(v1, (), mode, (RolePlan("embed", "models/old_backbone.pt", ("images",)), *side),
                    {"cases": {"old/old": cases["old/old"]}, "ecc": {}}),
        VersionPlan(v2, (v1,), mode, (RolePlan("embed", "models/new_backbone.pt", ("images",)), *side, *transforms),
                    {"cases": {"old/old": cases["old/old"], "new/new": cases["new/new"], ADAPTED_CASE[mode]: cases[method]},
                     "ecc": gated}),
    ]


def _features_plan(run: TrainedRun, key: str, v1: int, transition_days: float) -> list[VersionPlan]:
    gate = run.gate
    variant = Variant.parse(key, gate["ecc"])
    v2 = v1 + 1
    mode: Mode = "unified" if variant.method in UNIFIED_METHODS else "forward"
    side = (RolePlan("side_info", "graph:side_info", ()),) if run.eval_features["side"].shape[1] > 0 else ()
    inputs = tuple(getattr(run.load(variant.adapter_file), "input_names", ("old",)))
    transforms = [RolePlan("forward", variant.adapter_file, inputs, v1, v2)]
    if mode == "unified":
        transforms.append(RolePlan("backward", variant.adapter_file, ("new",), v2, v1))
    if variant.query_map:
        transforms.append(RolePlan("query_map", f"adapters/{variant.method}+query-map.query_map.pt", ("new",)))
    if variant.scoring == "hubness":
        transforms.append(RolePlan("hubness", f"adapters/{key}.reference.npy", ()))  # the graph holds these queries
    cases = gate["cases"]
    gated = {p.name: gate["ecc"][key] is True for p in transforms if p.role in GATED_ROLES}
    return [
        VersionPlan(v1, (), mode, (RolePlan("embed", "graph:old", ()), *side), {"cases": {"old/old": cases["old/old"]}, "ecc": {}}),
        VersionPlan(v2, (v1,), mode, (RolePlan("embed", "graph:new", ()), *side, *transforms),
                    {"cases": {"old/old": cases["old/old"], "new/new": cases["new/new"], variant.case: cases[key]}, "ecc": gated},
                    declarations(variant, gate, v1, transition_days)),
    ]


def _chain_plan(run: TrainedRun, method: str, v1: int) -> list[VersionPlan]:
    if method != "fct":
        raise InputError(f"chain releases use the chain's FCT adapters (h2, g2, h3, h13); --method {method} does not apply")
    chain = run.gate.get("chain")
    if not isinstance(chain, dict) or "ecc" not in chain:
        raise InputError(
            f"{run.root} has no per-hop chain results in gate.json: train with `[chain] enabled = true` "
            "(with this fctkit version) to export a chain release"
        )
    v2, v3 = v1 + 1, v1 + 2

    def own(v: int) -> tuple[RolePlan, RolePlan]:
        k = v - v1 + 1
        return (RolePlan("embed", f"models/chain_v{k}_backbone.pt", ("images",)),
                RolePlan("side_info", f"models/chain_v{k}_side_info.pt", ("images",)))

    h2 = RolePlan("forward", "adapters/chain_h2.pt", ("v1_embedding", "v1_side"), v1, v2)
    g2 = RolePlan("side_forward", "adapters/chain_g2.pt", ("v1_embedding", "v1_side"), v1, v2)
    h3 = RolePlan("forward", "adapters/chain_h3.pt", ("v2_embedding", "v2_side"), v2, v3)
    h13 = RolePlan("forward", "adapters/chain_h13.pt", ("v1_embedding", "v1_side"), v1, v3)
    ecc = chain["ecc"]
    return [
        VersionPlan(v1, (), "forward", own(v1), {"cases": {"v1/v1": chain["v1/v1"]}, "ecc": {}}),
        VersionPlan(v2, (v1,), "forward", (*own(v2), h2, g2),
                    {"cases": {k: chain[k] for k in ("v1/v1", "v2/v2", "v2/h2(v1)")}, "ecc": {h2.name: ecc["chain_h2"] is True}}),
        VersionPlan(v3, (v1, v2), "forward", (*own(v3), h3, h13),
                    {"cases": {"v2/v2": chain["v2/v2"], "v3/v3": chain["v3/v3"], "v3/h3(v2)": chain["v3/h3(v2)"],
                               "v3/h13(v1)": chain["direct"], "v3/h3(h2(v1))": chain["hop_by_hop"], "v1/v1": chain["v1/v1"]},
                     "ecc": {h3.name: ecc["chain_h3"] is True, h13.name: ecc["chain_h13"] is True}}),
    ]


# --------------------------------------------------------------------------- export and build


@dataclass(frozen=True)
class ReleasedBundle:
    """One built bundle: the verified bundle, its archive, and how each artifact was exported."""

    bundle: VerifiedBundle
    archive: Path
    exports: tuple[tuple[RolePlan, RoleExport], ...]


def build_release(
    run_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
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
) -> list[ReleasedBundle]:
    """Export and sign every version of the release into ``out_dir/v{N}/`` and ``out_dir/v{N}.tar``.

    A features-mode run needs ``graphs`` (the team's embed graphs and the sample that checks
    them, before anything is exported); ``transition_days``: how long a declared transition
    lasts on a device at most (0: until a full backfill or an explicit end).

    A role exported from the same saved file (ψ shared by v1 and v2) is exported once and the
    same ONNX bytes go into every bundle that lists it. Raises :class:`GateError` before
    exporting anything when a version's ECC gate fails and ``force`` is not given. Versions
    appear in ``out_dir`` only when the whole release succeeded."""
    if force and not (force_reason and force_reason.strip()):
        raise GateError("--force needs a reason (--reason '...'): the override is recorded in the signed manifest")
    run = TrainedRun.open(run_dir)
    plans = plan_release(run, method=method, first_version=first_version, chain=chain, transition_days=transition_days)
    out_dir = Path(out_dir)
    refuse_existing_versions(out_dir, [plan.version for plan in plans])
    _check_gates(plans, force)
    ready = _ready_graphs(run, plans, graphs)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        built = _build_versions(run, plans, out_dir, private_key, chain, fp16, force, force_reason, progress, ready)
    except BaseException:
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise
    public_key = private_key.public_key()
    return [
        ReleasedBundle(verify_bundle(out_dir / f"v{version}", public_key), out_dir / f"v{version}.tar", exports)
        for version, exports in built
    ]


def _build_versions(run: TrainedRun, plans: Sequence[VersionPlan], out_dir: Path, private_key: Ed25519PrivateKey,
                    chain: bool, fp16: bool, force: bool, force_reason: str | None, progress: bool,
                    ready: dict[str, Callable[[Path], RoleExport]]) -> list[tuple[int, tuple[tuple[RolePlan, RoleExport], ...]]]:
    real = _RealInputs(run, chain)
    built = []
    # Everything is built in a scratch folder and moved into place at the end: a refused or
    # failed release leaves no partial versions behind.
    with tempfile.TemporaryDirectory(prefix=".release-", dir=out_dir) as scratch:
        scratch = Path(scratch)
        export = _Exporter(run, real, scratch / "onnx", fp16, _progress_bar(sum(len(p.roles) for p in plans), progress), ready)
        with export.bar:
            for plan in plans:
                exports = tuple((role, export(role)) for role in plan.roles)
                build_bundle(
                    scratch / f"v{plan.version}", version=plan.version, parents=plan.parents, mode=plan.mode,
                    distance=run.distance, normalize=run.distance == "cosine",
                    artifacts=[e.artifact for _, e in exports], gate=plan.gate, private_key=private_key,
                    force=force, force_reason=force_reason, **plan.declarations,
                    parity={role.name: {"max_abs_error": e.parity.max_abs_error, "tolerance": e.parity.tolerance,
                                        "against": e.parity.against} for role, e in exports},
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
    run_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    private_key: Ed25519PrivateKey,
    method: str = "fct",
    first_version: int = 1,
    chain: bool = False,
    fp16: bool = False,
    force: bool = False,
    force_reason: str | None = None,
) -> list[VerifiedBundle]:
    """The release's bundles, verified as a device verifies them; see :func:`build_release`."""
    released = build_release(run_dir, out_dir, private_key=private_key, method=method, first_version=first_version,
                             chain=chain, fp16=fp16, force=force, force_reason=force_reason)
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
    bar: Any
    ready: dict[str, Callable[[Path], RoleExport]] = field(default_factory=dict)  # graphs not exported from torch
    done: dict[tuple, RoleExport] = field(default_factory=dict)

    def __call__(self, plan: RolePlan) -> RoleExport:
        key = (plan.source, plan.role, plan.source_version, plan.target_version)
        if plan.role in ("embed", "side_info"):
            key = (plan.source, plan.role)  # one graph per model, whichever versions list it
        if key not in self.done and plan.source in self.ready:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.done[key] = self.ready[plan.source](self.folder)
        if key not in self.done:
            path = self.folder / f"{len(self.done):02d}-{plan.name}.onnx"
            self.bar.set_description(f"export {plan.name} from {plan.source}")
            self.done[key] = export_role(
                plan.role, self.run.load(plan.source), path, [self.real[k] for k in plan.inputs],
                source_version=plan.source_version, target_version=plan.target_version, fp16=self.fp16,
            )
        self.bar.update(1)
        return self.done[key]


def _ready_graphs(run: TrainedRun, plans: Sequence[VersionPlan], graphs: UserGraphs | None) -> dict[str, Callable[[Path], RoleExport]]:
    """The graphs a features-mode release takes as they are (the team's, checked now, before
    anything is exported) or builds without torch (the hubness graph)."""
    if not run.features_mode:
        if graphs is not None:
            raise InputError(f"{run.root} was trained on images: its bundles carry the run's own backbones; drop the graph options")
        return {}
    if graphs is None:
        raise InputError(f"{run.root} was trained on pre-extracted features: name the embed graphs of the models they came "
                         "from (--old-graph, --new-graph, --side-info-graph when the features have side-info) and a --sample "
                         "that checks them")
    has_side = run.eval_features["side"].shape[1] > 0
    if has_side != (graphs.side_info is not None):
        raise InputError("the run's features have side-info: name its graph with --side-info-graph" if has_side else
                         "the run's features have no side-info: drop --side-info-graph")
    checked = check_user_graphs(graphs, run.eval_features)
    ready: dict[str, Callable[[Path], RoleExport]] = {source: (lambda _folder, e=export: e) for source, export in checked.items()}
    for role in (r for plan in plans for r in plan.roles if r.role == "hubness"):
        reference = np.load(run.root / role.source, allow_pickle=False)
        ready[role.source] = hubness_role(reference, int(run.gate["hubness_k"]), run.eval_features["new"][:1000])
    return ready


def _check_gates(plans: Sequence[VersionPlan], force: bool) -> None:
    """Refuse before exporting anything when a version's ECC gate fails and ``force`` is not set."""
    failing = [f"v{plan.version} {name}" for plan in plans
               for name in gate_failures(gated_artifacts(plan.roles, plan.mode, plan.parents), plan.gate["ecc"])]
    if failing and not force:
        raise GateError(
            f"publishing refused: the run's ECC (M(new, h(old)) > M(old, old)) does not hold for {', '.join(failing)}; "
            "fix the adapters, or pass --force --reason '...' to override on the record"
        )


def _progress_bar(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, unit="role", leave=False)


# --------------------------------------------------------------------------- helpers


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path}: {exc}; the run folder is damaged, train again") from exc
    if not isinstance(data, dict):
        raise InputError(f"{path} does not hold a JSON object; the run folder is damaged, train again")
    return data


def _read_npz(path: Path, keys: Sequence[str], optional: Sequence[str] = ()) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise DataUnavailableError(f"{path} is missing: train the run again (with `[chain] enabled = true` for chain features)")
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = sorted(set(keys) - set(data.files))
            if missing:
                raise InputError(f"{path} lacks {', '.join(missing)}; train the run again with this fctkit version")
            return {k: np.asarray(data[k]) for k in (*keys, *(k for k in optional if k in data.files))}
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path}: {exc}; the run folder is damaged, train again") from exc


__all__ = [
    "FORWARD_METHODS", "UNIFIED_METHODS", "METHODS", "TrainedRun", "RolePlan", "VersionPlan", "ReleasedBundle",
    "plan_release", "build_release", "export_release",
]
