"""A variant of a task run — a key of its ``gate.json`` such as
``residual+query-positives+hubness+transition`` — taken apart: the method, the joint fit on the
task's query positives (``query-map`` or ``query-positives``) and the scoring a device runs
(``hubness``, ``transition`` or both). Which files of the run hold it, and what the manifest's
gate calls its case."""

from __future__ import annotations

from dataclasses import dataclass

from fctkit.errors import InputError
from fctkit.trainer.method_names import JOINT_FITS, joint_fit_of

SCORING_PARTS = ("transition", "hubness")


@dataclass(frozen=True)
class Variant:
    """A gate key such as ``residual+query-map+transition``, taken apart."""

    key: str
    method: str
    joint: str | None  # "query-map" or "query-positives": trained further on the task's query positives
    scoring: tuple[str, ...]  # of SCORING_PARTS, as the key names them: () plain, ("hubness", "transition") both

    @classmethod
    def parse(cls, key: str, trained: dict) -> Variant:
        if key not in trained:
            raise InputError(f"the run has no variant {key!r}; it has: {', '.join(sorted(trained))}")
        method, *parts = key.split("+")
        unknown = [p for p in parts if p not in (*JOINT_FITS, *SCORING_PARTS)]
        if unknown:
            raise InputError(f"variant {key!r}: unknown part(s) {unknown}")
        return cls(key, method, joint_fit_of(key), tuple(p for p in parts if p in SCORING_PARTS))

    @property
    def query_map(self) -> bool:
        return self.joint == "query-map"

    @property
    def transition(self) -> bool:
        return "transition" in self.scoring

    @property
    def hubness(self) -> bool:
        return "hubness" in self.scoring

    @property
    def adapter_file(self) -> str:
        return f"adapters/{self.method}{f'+{self.joint}' if self.joint else ''}.pt"

    @property
    def query_map_file(self) -> str:
        return f"adapters/{self.method}+query-map.query_map.pt"

    @property
    def case(self) -> str:
        """The name of the variant's case in the manifest's gate."""
        searched = "Q(new)/h(old)" if self.query_map else "new/h(old)"
        searched = (
            f"({searched} − β·r)"
            if self.hubness and self.transition
            else f"{searched} − β·r"
            if self.hubness
            else searched
        )
        return f"w·old/old + (1−w)·{searched}" if self.transition else searched


__all__ = ["SCORING_PARTS", "Variant"]
