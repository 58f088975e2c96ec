"""A release's health expectation: measured as a device measures (fctkit.upgrade_health), read at
any gallery size, and parsed strictly from the signed manifest."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from fctkit.errors import BundleFormatError, InputError
from fctkit.protos.health_expectation import HealthExpectation, break_even, gate_level
from fctkit.upgrade_health import MEASURES, expected_health


def test_the_expectation_is_measured_per_gallery_size_and_self_retrieval_falls_as_galleries_grow():
    rng = np.random.default_rng(0)
    new = rng.normal(size=(2000, 16))
    adapted = new + 0.9 * rng.normal(size=new.shape)  # a noisy adapter: neighbours crowd in as the gallery grows
    sizes, measures = expected_health(adapted, new, "cosine", sample_size=32, draws=8)
    assert sizes == (64, 256, 1024, 2000) and set(measures) == set(MEASURES)
    recall = measures["recall_at_1"][0]
    assert recall[0] > recall[-1] + 0.1 and all(a >= b - 0.05 for a, b in itertools.pairwise(recall))
    assert max(measures["mean_cosine"][0]) - min(measures["mean_cosine"][0]) < 0.05  # no size effect
    with pytest.raises(InputError, match="N×d alike"):
        expected_health(adapted, new[:, :8], "cosine", sample_size=32)
    with pytest.raises(InputError, match="at least 2 draws"):
        expected_health(adapted, new, "cosine", sample_size=32, draws=1)


def expectation(**changes) -> HealthExpectation:
    measures = dict.fromkeys(MEASURES, ((0.9, 0.8, 0.6), (0.01, 0.02, 0.03)))
    measures["median_rank"] = ((1.0, 1.0, 2.0), (0.0, 0.0, 0.5))
    fields = {"level": "instance", "sample_size": 32, "draws": 16, "gallery_rows": (64, 256, 1024),
              "measures": measures, "break_even": (0.8, 1.1, 1.3), **changes}  # fmt: skip
    return HealthExpectation(**fields)


def test_expected_reads_between_and_beyond_the_measured_sizes():
    e = expectation()
    assert e.expected("recall_at_1", 10) == (0.9, 0.01)  # held at the smallest size below it
    assert e.expected("recall_at_1", 128)[0] == pytest.approx(0.85)  # halfway in log(rows)
    assert e.expected("recall_at_1", 4096)[0] == pytest.approx(0.4)  # the last segment's slope carried on
    assert e.expected("recall_at_1", 10**9)[0] == -1.0  # kept within the measure's range
    assert e.expected("median_rank", 10**6)[0] >= 1.0
    assert e.ratio("recall_at_1", 0.45, 64) == pytest.approx(0.5)
    assert e.ratio("recall_at_1", 0.01, 10**9) == pytest.approx(0.01 / 0.05)  # the floor keeps it finite
    assert e.guard_measure == "recall_at_1" and expectation(level="class").guard_measure == "mean_cosine"


def test_each_device_is_held_to_the_bound_at_its_own_size():
    e = expectation()  # break-even 0.8 at 64 rows (the release beats not upgrading), 1.1 at 256, 1.3 at 1,024
    assert e.bound(0.15, 64) == pytest.approx(0.85)  # a break-even under 1 is no floor
    assert e.bound(0.15, 128) == pytest.approx(0.85)  # the break-even halfway, 0.95: still under 1
    assert e.bound(0.15, 256) == pytest.approx(1.1) and e.bound(0.15, 10**6) == pytest.approx(
        1.3
    )  # held, not carried on
    assert e.vote("recall_at_1", 0.9, 64, 0.15) == pytest.approx(1 / 0.85)  # 0.9 of 0.9 expected, over 0.85
    assert e.vote("recall_at_1", 0.8, 256, 0.15) == pytest.approx(1.0 / 1.1)  # as expected, but under the break-even


def test_the_level_and_break_even_come_from_the_gate_cases():
    instance = {"old/old": {"recall@1": 0.6, "top1": 0.6}, "new/h(old)": {"recall@1": 0.75}, "new/new": {}}
    assert gate_level(instance) == "instance" and gate_level({"old/old": {"top1": 0.5}}) == "class"
    assert break_even(instance, "instance") == pytest.approx(0.8)
    quantised = {**instance, "new/h(old)": {"recall@1": 0.5}, "new/h(old) [fp32]": {"recall@1": 0.75}}
    assert break_even(quantised, "instance") == pytest.approx(1.2)  # the served (quantised) case
    assert break_even({"old/old": {"recall@1": 0.6}, "x": {"recall@1": 0.0}}, "instance") == pytest.approx(600.0)
    assert break_even({}, "instance") == 0.0 and break_even({"old/old": {"top1": 0.5}}, "class") == 0.0


def test_the_manifest_form_round_trips_and_anything_else_is_refused():
    e = expectation()
    assert HealthExpectation.from_json(json.loads(json.dumps(e.to_json())), "m") == e
    two_sizes = {m: (means[:2], sds[:2]) for m, (means, sds) in e.measures.items()}
    gate_only = HealthExpectation.measured(
        {"old/old": {"top1": 0.6}, "x": {"top1": 0.75}}, (64, 256), two_sizes, 32, 16
    )
    assert gate_only.break_even == (pytest.approx(0.8), pytest.approx(0.8))  # the gate's figure at every size
    bad = e.to_json()
    for edit, message in [
        (lambda d: d.update(level="item"), "level must be one of"),
        (lambda d: d.update(extra=1), "unknown"),
        (lambda d: d.pop("break_even"), "missing"),
        (lambda d: d.update(gallery_rows=[256, 64, 1024]), "increasing"),
        (lambda d: d["measures"]["recall_at_1"]["mean"].pop(), "one finite mean"),
        (lambda d: d["measures"]["recall_at_1"]["sd"].__setitem__(0, -0.1), "negative standard deviation"),
        (lambda d: d["measures"].pop("median_rank"), "missing"),
        (lambda d: d.update(break_even=[-1.0, 1.0, 1.0]), "break_even"),
        (lambda d: d.update(break_even=[1.0]), "break_even"),
        (lambda d: d.update(sample_size=0), "sample_size"),
    ]:
        data = json.loads(json.dumps(bad))
        edit(data)
        with pytest.raises(BundleFormatError, match=message):
            HealthExpectation.from_json(data, "manifest.health_expectation")
    with pytest.raises(BundleFormatError, match="finite"):
        expectation(break_even=(1.0, math.inf, 1.0))
