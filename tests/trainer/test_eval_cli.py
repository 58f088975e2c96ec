"""`fctkit eval` end to end with click's CliRunner."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from fctkit.cli import cli, main
from fctkit.errors import DataUnavailableError, InputError
from fctkit.trainer.evaluation import evaluate_retrieval


@pytest.fixture()
def sets(tmp_path):
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(4, 6))
    q_labels, g_labels = rng.integers(0, 4, 40), rng.integers(0, 4, 90)
    query = centers[q_labels] + 0.8 * rng.normal(size=(40, 6))
    gallery = centers[g_labels] + 0.8 * rng.normal(size=(90, 6))
    np.savez(tmp_path / "new.npz", embeddings=query.astype(np.float32), labels=q_labels)
    np.savez(tmp_path / "old.npz", embeddings=gallery.astype(np.float32), labels=g_labels)
    return tmp_path, (query.astype(np.float32), q_labels, gallery.astype(np.float32), g_labels)


def test_eval_prints_the_table_and_writes_the_report(sets):
    root, (q, ql, g, gl) = sets
    out = root / "report"
    args = [
        "eval",
        "--query",
        str(root / "new.npz"),
        "--gallery",
        str(root / "old.npz"),
        "--distance",
        "cosine",
        "--topk",
        "1,5,10",
        "--chunk-size",
        "7",
        "--out",
        str(out),
    ]
    run = CliRunner().invoke(cli, args)
    assert run.exit_code == 0, run.output
    expected = evaluate_retrieval(q, ql, g, gl, distance="cosine", topk=(1, 5, 10))
    row = f"| new/old | {expected.cmc[1]:.4f} | {expected.cmc[5]:.4f} | {expected.cmc[10]:.4f} | {expected.mean_ap:.4f} | 40 | 0 |"
    assert row in run.output
    saved = json.loads((out / "report.json").read_text())
    assert saved["cases"][0]["name"] == "new/old"
    assert saved["cases"][0]["result"] == expected.to_dict()
    assert (out / "report.md").read_text() in run.output
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_eval_without_gallery_is_leave_one_out_on_the_query_set(sets):
    root, (q, ql, _, _) = sets
    run = CliRunner().invoke(cli, ["eval", "--query", str(root / "new.npz"), "--name", "new/new"])
    assert run.exit_code == 0, run.output
    expected = evaluate_retrieval(q, ql, q, ql, leave_one_out=True)
    assert (
        f"| new/new | {expected.cmc[1]:.4f} | {expected.cmc[5]:.4f} | {expected.mean_ap:.4f} | 40 | 0 |" in run.output
    )
    assert "leave-one-out" in run.output


def test_eval_leave_one_out_flag_needs_matching_sets(sets):
    root, _ = sets
    args = ["eval", "--query", str(root / "new.npz"), "--gallery", str(root / "old.npz"), "--leave-one-out"]
    run = CliRunner().invoke(cli, args)
    assert isinstance(run.exception, InputError) and "same items" in str(run.exception)


def test_missing_file_and_missing_keys_and_truncated_file(sets):
    root, _ = sets
    runner = CliRunner()
    run = runner.invoke(cli, ["eval", "--query", str(root / "absent.npz")])
    assert isinstance(run.exception, DataUnavailableError) and "not found" in str(run.exception)

    np.savez(root / "wrong.npz", features=np.zeros((3, 2)), labels=np.zeros(3))
    run = runner.invoke(cli, ["eval", "--query", str(root / "wrong.npz")])
    assert isinstance(run.exception, InputError)
    assert "unknown key(s) features" in str(run.exception)
    np.savez(root / "no-labels.npz", embeddings=np.zeros((3, 2)))
    run = runner.invoke(cli, ["eval", "--query", str(root / "no-labels.npz")])
    assert isinstance(run.exception, InputError) and "missing key(s) labels" in str(run.exception)

    data = (root / "new.npz").read_bytes()
    (root / "cut.npz").write_bytes(data[: len(data) // 2])
    run = runner.invoke(cli, ["eval", "--query", str(root / "new.npz"), "--gallery", str(root / "cut.npz")])
    assert isinstance(run.exception, InputError) and "not a readable .npz" in str(run.exception)

    np.savez(root / "nan.npz", embeddings=np.full((3, 6), np.nan), labels=np.zeros(3, int))
    run = runner.invoke(cli, ["eval", "--query", str(root / "new.npz"), "--gallery", str(root / "nan.npz")])
    assert isinstance(run.exception, InputError) and "nan.npz: embeddings: 3 row(s) hold NaN or inf" in str(
        run.exception
    )


@pytest.mark.parametrize("topk", ["0", "1,x", ""])
def test_bad_topk_is_a_usage_error(sets, topk):
    root, _ = sets
    run = CliRunner().invoke(cli, ["eval", "--query", str(root / "new.npz"), "--topk", topk])
    assert run.exit_code == 2 and "--topk" in run.output


def test_main_turns_kit_errors_into_one_line_and_exit_2(sets, capsys):
    root, _ = sets
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--query", str(root / "absent.npz")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: ") and "feature file not found" in err and "absent.npz" in err and "Traceback" not in err
    )
