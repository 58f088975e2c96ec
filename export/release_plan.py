"""The plan of a release: which versions, roles and gates a ``fctkit train`` run's bundles get.

Planning exports nothing; :func:`fctkit.export.release.build_release` exports and signs what
the plan lists. A release is one bundle per model version:

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

Each version's gate holds the evaluation cases that justify it and, per forward/backward
artifact, the run's ECC verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fctkit.errors import InputError
from fctkit.protos.bundle import GATED_ROLES, Mode, Role, artifact_name

from .features_release import declarations
from .trained_run import TrainedRun
from .variants import Variant

FORWARD_METHODS = ("fct", "fct-no-side-info", "fastfill", "least-squares", "procrustes")
UNIFIED_METHODS = ("lambda-orth", "lambda-orth-relaxed")
METHODS = FORWARD_METHODS + UNIFIED_METHODS
#: The case name under which the method's adapted retrieval is recorded in a bundle's gate.
ADAPTED_CASE = {"forward": "new/h(old)", "unified": "B(new)/F(old)"}


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
    gate: dict[str, Any] = field(default_factory=dict)
    declarations: dict[str, Any] = field(default_factory=dict)  # transition= / hubness= (fctkit.protos.search_policy)


def plan_release(
    run: TrainedRun, *, method: str = "fct", first_version: int = 1, chain: bool = False, transition_days: float = 30.0
) -> list[VersionPlan]:
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
        raise InputError(
            f"the run did not train {method!r} (it trained: {trained}); add it to `methods` and train again"
        )
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
        VersionPlan(
            v1,
            (),
            mode,
            (RolePlan("embed", "models/old_backbone.pt", ("images",)), *side),
            {"cases": {"old/old": cases["old/old"]}, "ecc": {}},
        ),
        VersionPlan(
            v2,
            (v1,),
            mode,
            (RolePlan("embed", "models/new_backbone.pt", ("images",)), *side, *transforms),
            {
                "cases": {"old/old": cases["old/old"], "new/new": cases["new/new"], ADAPTED_CASE[mode]: cases[method]},
                "ecc": gated,
            },
        ),
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
        transforms.append(RolePlan("query_map", variant.query_map_file, ("new",)))
    if variant.hubness:
        transforms.append(RolePlan("hubness", f"adapters/{key}.reference.npy", ()))  # the graph holds these queries
    cases = gate["cases"]
    gated = {p.name: gate["ecc"][key] is True for p in transforms if p.role in GATED_ROLES}
    return [
        VersionPlan(
            v1,
            (),
            mode,
            (RolePlan("embed", "graph:old", ()), *side),
            {"cases": {"old/old": cases["old/old"]}, "ecc": {}},
        ),
        VersionPlan(
            v2,
            (v1,),
            mode,
            (RolePlan("embed", "graph:new", ()), *side, *transforms),
            {
                "cases": {"old/old": cases["old/old"], "new/new": cases["new/new"], variant.case: cases[key]},
                "ecc": gated,
            },
            declarations(variant, gate, v1, transition_days),
        ),
    ]


def _chain_plan(run: TrainedRun, method: str, v1: int) -> list[VersionPlan]:
    if method != "fct":
        raise InputError(
            f"chain releases use the chain's FCT adapters (h2, g2, h3, h13); --method {method} does not apply"
        )
    chain = run.gate.get("chain")
    if not isinstance(chain, dict) or "ecc" not in chain:
        raise InputError(
            f"{run.root} has no per-hop chain results in gate.json: train with `[chain] enabled = true` "
            "(with this fctkit version) to export a chain release"
        )
    v2, v3 = v1 + 1, v1 + 2

    def own(v: int) -> tuple[RolePlan, RolePlan]:
        k = v - v1 + 1
        return (
            RolePlan("embed", f"models/chain_v{k}_backbone.pt", ("images",)),
            RolePlan("side_info", f"models/chain_v{k}_side_info.pt", ("images",)),
        )

    h2 = RolePlan("forward", "adapters/chain_h2.pt", ("v1_embedding", "v1_side"), v1, v2)
    g2 = RolePlan("side_forward", "adapters/chain_g2.pt", ("v1_embedding", "v1_side"), v1, v2)
    h3 = RolePlan("forward", "adapters/chain_h3.pt", ("v2_embedding", "v2_side"), v2, v3)
    h13 = RolePlan("forward", "adapters/chain_h13.pt", ("v1_embedding", "v1_side"), v1, v3)
    ecc = chain["ecc"]
    return [
        VersionPlan(v1, (), "forward", own(v1), {"cases": {"v1/v1": chain["v1/v1"]}, "ecc": {}}),
        VersionPlan(
            v2,
            (v1,),
            "forward",
            (*own(v2), h2, g2),
            {
                "cases": {k: chain[k] for k in ("v1/v1", "v2/v2", "v2/h2(v1)")},
                "ecc": {h2.name: ecc["chain_h2"] is True},
            },
        ),
        VersionPlan(
            v3,
            (v1, v2),
            "forward",
            (*own(v3), h3, h13),
            {
                "cases": {
                    "v2/v2": chain["v2/v2"],
                    "v3/v3": chain["v3/v3"],
                    "v3/h3(v2)": chain["v3/h3(v2)"],
                    "v3/h13(v1)": chain["direct"],
                    "v3/h3(h2(v1))": chain["hop_by_hop"],
                    "v1/v1": chain["v1/v1"],
                },
                "ecc": {h3.name: ecc["chain_h3"] is True, h13.name: ecc["chain_h13"] is True},
            },
        ),
    ]


__all__ = ["FORWARD_METHODS", "METHODS", "UNIFIED_METHODS", "RolePlan", "VersionPlan", "plan_release"]
