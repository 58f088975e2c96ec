"""The lemma → gloss task's offline pieces: which synsets a task may use, and the distractor
glosses that grow its gallery (instance_scaling.py). No model, no WordNet files."""

from __future__ import annotations

import pytest

from tests.support.benchmark_scripts import benchmark_script


@pytest.fixture(scope="module")
def bench():
    with benchmark_script("wordnet_lemma_task.py") as module:
        yield module


def test_the_distractor_pool_holds_unique_definitions_of_no_query(bench):
    S = bench.LemmaSynset
    synsets = [
        S("n:1", ("bank",), "sloping land beside a river"),
        S("n:2", ("bank",), "a financial institution"),
        S("n:3", ("dog",), 'a domestic canine; "the dog barked"'),
        S("n:4", ("cur",), "a domestic canine"),
        S("n:5", ("cat",), "a feline"),
        S("n:6", ("fox",), "a wild canid"),
        S("n:7", ("quote",), 'says "hi" often'),
    ]
    usable, dropped = bench.usable_synsets(synsets)
    assert [s.key for s, _ in usable] == ["n:1", "n:3", "n:5", "n:6"]
    assert (
        dropped["repeated lemma text (polysemy; first synset kept)"] == 1
        and dropped["repeated definition (first synset kept)"] == 1
    )
    unused = [u for u in usable if u[0].key in ("n:6",)]  # n:1, n:3, n:5 went to the task's splits
    pool = bench.distractor_pool(synsets, usable, unused, seed=0)
    # the unused usable synset first, then the polysemous "bank" (its definition is no split's)
    assert [(s.key, text) for s, text in pool] == [("n:6", "a wild canid"), ("n:2", "a financial institution")]
