"""One sequence of versions of a `fctkit train-compatible` run (:mod:`.compatible_config`):
every method's versions trained over the sequence's class counts (:class:`SequenceRun`) and
evaluated pair by pair into C[i, j] and the compatibility matrix (:class:`SequenceResult`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fctkit.errors import ConfigError, InputError
from fctkit.feature_checks import validate_labels

from .adapters import FCTAdapter
from .backbones import Backbone, BackboneConfig, extract_features
from .compatibility import CompatibilityMatrix, compatibility_matrix, ecc
from .compatible_config import METHOD_LABELS, CompatibleConfig
from .compatible_losses import (
    LossFn,
    bct_loss,
    bt2_loss,
    class_mean_classifier,
    cross_entropy,
    frozen,
    hoc_loss,
    synthesised_classifier,
)
from .compatible_models import BT2Backbone, CompatibleModel, cores_backbone, save_compatible_model
from .compatible_training import EccSelector, VersionTraining, train_model
from .datasets import class_subset, make_splits, validate_images
from .fitting import split_validation
from .lambda_orth import LambdaOrthAdapter
from .retrieval_result import RetrievalResult
from .searches import Evaluator
from .side_info import extract_side_info, train_side_info
from .torch_utils import resolve_device, set_seed

Pairs = dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]  # (i, j) -> (query rows, gallery rows)


@dataclasses.dataclass
class SequenceResult:
    """Per method: C[i, j] retrieval results on all evaluation classes and (``known``) on the
    classes gallery version j was trained on (empty when the evaluation classes are held out),
    the compatibility matrix, embedding dims."""

    name: str
    class_counts: tuple[int, ...]
    results: dict[str, dict[tuple[int, int], RetrievalResult]]
    known: dict[str, dict[tuple[int, int], RetrievalResult]]
    matrices: dict[str, CompatibilityMatrix]
    dims: dict[str, list[int]]
    facts: dict[str, Any]

    def ecc(self, method: str, i: int, j: int, known: bool = False, metric: str = "top1") -> bool:
        """ECC for query version i against gallery version j: M(i, j) > M(j, j) (``known``: on
        the classes of version j only; ``metric``: see :func:`~.retrieval_result.metric_value`)."""
        cases = (self.known if known else self.results)[method]
        return ecc(cases[(i, j)], cases[(j, j)], metric)

    def to_dict(self) -> dict[str, Any]:
        return {
            "class_counts": list(self.class_counts),
            "matrices": {m: c.to_dict() for m, c in self.matrices.items()},
            "cases": {
                m: {f"v{i + 1}/v{j + 1}": r.to_dict() for (i, j), r in cases.items()}
                for m, cases in self.results.items()
            },
            "ecc": {
                m: {f"v{i + 1}/v{j + 1}": self.ecc(m, i, j) for (i, j) in cases if i > j}
                for m, cases in self.results.items()
            },
            "cases_on_gallery_classes": {
                m: {f"v{i + 1}/v{j + 1}": r.to_dict() for (i, j), r in cases.items()} for m, cases in self.known.items()
            },
            "ecc_on_gallery_classes": {
                m: {f"v{i + 1}/v{j + 1}": self.ecc(m, i, j, True) for (i, j) in cases if i > j}
                for m, cases in self.known.items()
            },
            "dims": self.dims,
            "facts": self.facts,
        }


def evaluation_items(
    labels: np.ndarray, train: np.ndarray, evaluation: np.ndarray, last_classes: int, evaluation_classes: str
) -> np.ndarray:
    """The ``evaluation`` items every case is measured on: those of the first ``last_classes``
    training classes ("trained") or of the other classes ("held-out"; see
    :attr:`CompatibleConfig.evaluation_classes`)."""
    trained = np.isin(labels[evaluation], np.unique(labels[train])[:last_classes])
    return evaluation[~trained if evaluation_classes == "held-out" else trained]


class SequenceRun:
    """Trains every method's versions over one class sequence and evaluates them."""

    def __init__(
        self,
        config: CompatibleConfig,
        name: str,
        class_counts: tuple[int, ...],
        images: np.ndarray,
        labels: np.ndarray,
        train: np.ndarray,
        evaluation: np.ndarray,
        n_classes: int,
        out: Path,
        log: Callable[[str], None],
    ) -> None:
        self.config, self.name, self.counts, self.log = config, name, tuple(class_counts), log
        if self.counts[-1] > n_classes:
            raise ConfigError(f"{name}: {self.counts[-1]} classes asked for, the dataset has {n_classes}")
        self.images, self.labels = validate_images(images), validate_labels(labels)
        self.train = train[np.isin(labels[train], np.unique(labels[train])[: self.counts[-1]])]
        self.held_out = config.evaluation_classes == "held-out"
        self.eval_index = evaluation_items(labels, train, evaluation, self.counts[-1], config.evaluation_classes)
        if len(np.unique(labels[self.eval_index])) < 2:
            raise ConfigError(
                f"{name}: evaluation_classes = {config.evaluation_classes!r} leaves fewer than 2 evaluation "
                f"classes (the last version trains on {self.counts[-1]} of {n_classes}); "
                "train the last version on fewer classes"
            )
        self.facts: dict[str, Any] = {}
        self.version_items = [self.train[class_subset(labels[self.train], c)] for c in self.counts]
        if config.first_version_items < 1:
            self.version_items[0] = self._first_version_subset(config.first_version_items)
            self.facts["first_version_items"] = config.first_version_items
        self.reserved = config.cores.reserved_classes or n_classes
        self.out = out / "models" / name
        self.evaluate = Evaluator.labelled(labels[self.eval_index], config.evaluation)
        self._cores_first: Backbone | None = None  # CoReS's v1, shared by "cores" and "cores-hoc"

    def _first_version_subset(self, fraction: float) -> np.ndarray:
        """``fraction`` of each class's items of version 1, the stratified draw of :func:`make_splits`."""
        items = self.version_items[0]
        kept = items[
            make_splits(self.labels[items], self.config.seed, train_fraction=fraction, query_fraction=0.0).train
        ]
        classes, counts = np.unique(self.labels[kept], return_counts=True)
        if len(classes) < len(np.unique(self.labels[items])) or counts.min() < 2:
            raise ConfigError(
                f"first_version_items = {fraction} leaves version 1 fewer than 2 images of some class; raise it"
            )
        return kept

    # each version's job: its items, its backbone config and seed
    def job(self, k: int, backbone: BackboneConfig | None = None, items: np.ndarray | None = None) -> VersionTraining:
        items = self.version_items[k] if items is None else items
        config = backbone or (self.config.old_backbone if k == 0 else self.config.new_backbone)
        return VersionTraining(
            self.images[items], self.labels[items], config, self.config.seed + 10 * k, self.config.device
        )

    def run(self) -> SequenceResult:
        independent = self._independent()
        versions: dict[str, Sequence[CompatibleModel]] = {"independent": independent}
        for method in self.config.methods:
            if method != "independent":
                versions[method] = getattr(self, f"_{method.replace('-', '_')}")(independent)
        pairs: dict[str, Pairs] = {}
        for method in self.config.methods:
            embeddings = [extract_features(m, self.images[self.eval_index]) for m in versions[method]]
            pairs[method] = {
                (i, j): (embeddings[i], embeddings[j]) for i in range(len(self.counts)) for j in range(i + 1)
            }
            for k, model in enumerate(versions[method]):
                save_compatible_model(model, self.out / method / f"v{k + 1}.pt")
        for adapter in self.config.adapters:
            pairs[adapter] = self._adapter_pairs(adapter, independent)
        results = {m: {key: self.evaluate(q, g) for key, (q, g) in p.items()} for m, p in pairs.items()}
        known = (
            {}
            if self.held_out
            else {m: {key: self._evaluate_known(key[1], q, g) for key, (q, g) in p.items()} for m, p in pairs.items()}
        )
        dims = {m: [int(p[(k, k)][0].shape[1]) for k in range(len(self.counts))] for m, p in pairs.items()}

        def top1(method: str) -> Callable[[int, int], float]:
            return lambda i, j: results[method][(i, j)].top1

        matrices = {m: compatibility_matrix(top1(m), len(self.counts)) for m in results}
        return SequenceResult(self.name, self.counts, results, known, matrices, dims, self.facts)

    def _evaluate_known(self, j: int, query: np.ndarray, gallery: np.ndarray) -> RetrievalResult:
        """The case on the evaluation items of the classes gallery version j was trained on."""
        mask = np.isin(self.labels[self.eval_index], np.unique(self.labels[self.version_items[j]]))
        return Evaluator.labelled(self.labels[self.eval_index][mask], self.config.evaluation)(
            query[mask], gallery[mask]
        )

    def _independent(self) -> list[Backbone]:
        models = []
        for k in range(len(self.counts)):
            job = self.job(k)
            self.log(
                f"{self.name}: independent v{k + 1} ({job.backbone.architecture}, {self.counts[k]} classes, {len(job.labels)} images)"
            )
            set_seed(job.seed)
            model = Backbone(job.backbone, tuple(np.unique(job.labels).tolist()), job.images.shape[1])
            train_model(model, job, description=f"independent v{k + 1}")
            models.append(model)
        return models

    def _bct(self, independent: Sequence[Backbone]) -> list[Backbone]:
        models = [independent[0]]
        for k in range(1, len(self.counts)):
            previous = models[-1]
            job = self.job(k, dataclasses.replace(self.config.new_backbone, embedding_dim=previous.embedding_dim))
            self.log(f"{self.name}: BCT v{k + 1} (influence of v{k}'s classifier)")
            set_seed(job.seed)
            model = Backbone(job.backbone, tuple(np.unique(job.labels).tolist()), job.images.shape[1])
            previous = frozen(previous, resolve_device(job.device))
            head = (
                synthesised_classifier(previous, job.images, job.labels)
                if self.config.bct.new_classes == "class-means"
                else None
            )
            loss = bct_loss(previous, self.config.bct.influence_weight, head)
            train_model(model, job, loss, description=f"BCT v{k + 1}")
            models.append(model)
        return models

    def _bt2(self, independent: Sequence[Backbone]) -> list[CompatibleModel]:
        models: list[CompatibleModel] = [independent[0]]
        bt2 = self.config.bt2
        for k in range(1, len(self.counts)):
            previous, reference = models[-1], independent[k]
            job = self.job(k)
            old_items = self.version_items[k - 1]
            old_embeddings = extract_features(previous, self.images[old_items])
            pseudo = class_mean_classifier(old_embeddings, self.labels[old_items])
            self.log(f"{self.name}: BT² v{k + 1} (old block {old_embeddings.shape[1]} dims, +{bt2.extra_dims} extra)")
            set_seed(job.seed)
            new_dim = reference.embedding_dim
            model = BT2Backbone(
                dataclasses.replace(job.backbone, embedding_dim=new_dim),
                tuple(np.unique(job.labels).tolist()),
                job.images.shape[1],
                old_embeddings.shape[1],
                bt2.extra_dims,
                bt2.scale,
            )
            loss = bt2_loss(previous, reference, pseudo, bt2, resolve_device(job.device))
            train_model(model, job, loss, description=f"BT² v{k + 1}")
            models.append(model)
        return models

    def _cores_hoc(self, independent: Sequence[Backbone]) -> list[Backbone]:
        return self._cores(independent, hoc=True)

    def _cores(self, _independent: Sequence[Backbone], hoc: bool = False) -> list[Backbone]:
        """CoReS's versions (with ``hoc``: CoReS + HOC from v2 on; v1, trained with the
        cross-entropy alone, is the same model for both and trained once)."""
        models: list[Backbone] = []
        if self.counts[-1] > self.reserved:
            raise ConfigError(
                f"cores.reserved_classes = {self.reserved} leaves no room for the {self.counts[-1]} classes of the last version"
            )
        choices = []
        held_out = self._cores_validation_items()
        for k in range(len(self.counts)):
            if k == 0 and self._cores_first is not None:
                models.append(self._cores_first)
                continue
            items = self.version_items[k]
            job = self.job(k, self._cores_backbone(k), items[~np.isin(items, held_out)])
            if job.labels.max() >= self.reserved or job.labels.min() < 0:
                raise InputError(
                    f"CoReS needs class labels 0..{self.reserved - 1} (the simplex's vertices); got {job.labels.min()}..{job.labels.max()}"
                )
            self.log(f"{self.name}: CoReS v{k + 1} (fixed {self.reserved}-vertex simplex, {self.reserved - 1} dims)")
            set_seed(job.seed)
            model = cores_backbone(job.backbone, self.reserved, job.images.shape[1])
            if models and self.config.cores.warm_start:
                model.load_state_dict(models[-1].state_dict())
            selector = None
            if self.config.cores.ecc_selection:
                val_items = items[np.isin(items, held_out)]
                val_images = self.images[val_items]
                selector = EccSelector(
                    val_images,
                    self.labels[val_items],
                    [extract_features(m, val_images) for m in models],
                    self.config.evaluation,
                )
            loss: LossFn[Backbone] = cross_entropy
            if hoc and models:
                loss = hoc_loss(
                    frozen(models[-1], resolve_device(job.device)),
                    self.config.cores.hoc_weight,
                    self.config.cores.hoc_scale,
                )
            train_model(model, job, loss, description=f"CoReS{' + HOC' if hoc else ''} v{k + 1}", selector=selector)
            if selector is not None:
                choices.append({"version": k + 1, **selector.choice})
            models.append(model)
        self._cores_first = models[0]
        self.facts["cores-hoc_checkpoints" if hoc else "cores_checkpoints"] = choices
        return models

    def _cores_validation_items(self) -> np.ndarray:
        """The ECC selection's validation items: one split of the whole sequence's training items
        that no CoReS version trains on, so that old/old on validation is not measured on
        images the previous version was trained on (empty without the selection)."""
        if not self.config.cores.ecc_selection:
            return np.empty(0, dtype=self.version_items[-1].dtype)
        fraction = self.config.old_backbone.val_fraction
        if not 0 < fraction < 1:
            raise ConfigError("cores.ecc_selection needs a validation split: set old_backbone.val_fraction in (0, 1)")
        _, val_pos = split_validation(len(self.version_items[-1]), fraction, self.config.seed)
        return self.version_items[-1][val_pos]

    def _cores_backbone(self, k: int) -> BackboneConfig | None:
        cores = self.config.cores
        if not cores.warm_start:
            return None
        if k == 0 or not cores.finetune_lr:
            return self.config.old_backbone
        return dataclasses.replace(self.config.old_backbone, lr=cores.finetune_lr)

    def _adapter_pairs(self, method: str, independent: Sequence[Backbone]) -> Pairs:
        """(query, gallery) of C[i, j] for an adapter method between the independent versions
        (:mod:`.compatible_config`)."""
        train_images, eval_images = self.images[self.train], self.images[self.eval_index]
        train_features = [extract_features(m, train_images) for m in independent]
        eval_features = [extract_features(m, eval_images) for m in independent]
        side_train = side_eval = None
        if method == "fct" and self.config.side_info.kind != "none":
            self.log(f"{self.name}: side-info ψ ({self.config.side_info.kind}) on v1's data")
            first = self.version_items[0]
            side_model = train_side_info(
                self.images[first], self.labels[first], self.config.side_info, self.config.seed + 2, self.config.device
            )
            side_train, side_eval = (
                extract_side_info(side_model, train_images),
                extract_side_info(side_model, eval_images),
            )
        position = {int(item): p for p, item in enumerate(self.train)}
        cases: Pairs = {(i, i): (eval_features[i], eval_features[i]) for i in range(len(self.counts))}
        for i in range(1, len(self.counts)):
            rows = np.asarray([position[int(item)] for item in self.version_items[i]])
            for j in range(i):
                self.log(f"{self.name}: {METHOD_LABELS[method]} v{j + 1} → v{i + 1}")
                seed = self.config.seed + 100 * i + j
                if method == "fct":
                    use_side = side_train is not None
                    fct = dataclasses.replace(
                        self.config.fct, side_info=use_side, train=dataclasses.replace(self.config.fct.train, seed=seed)
                    )
                    adapter, _ = FCTAdapter.fit(
                        train_features[j][rows],
                        train_features[i][rows],
                        side_train[rows] if side_train is not None else None,
                        fct,
                    )
                    cases[(i, j)] = (
                        eval_features[i],
                        adapter.transform(eval_features[j], side_eval if use_side else None),
                    )
                else:
                    lo = dataclasses.replace(
                        self.config.lambda_orth, train=dataclasses.replace(self.config.lambda_orth.train, seed=seed)
                    )
                    unified, _ = LambdaOrthAdapter.fit(
                        train_features[j][rows], train_features[i][rows], self.labels[self.version_items[i]], lo
                    )
                    cases[(i, j)] = (unified.transform_new(eval_features[i]), unified.unified_old(eval_features[j]))
        return cases


__all__ = ["SequenceResult", "evaluation_items"]
