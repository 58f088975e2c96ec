from __future__ import annotations

import subprocess
import sys
import warnings

from click.testing import CliRunner

import fctkit
from fctkit import _environment
from fctkit.cli import cli


def test_help_lists_commands_and_version_prints():
    runner = CliRunner()
    result = runner.invoke(cli, ["--help"])
    assert result.exit_code == 0
    assert "Commands:" in result.output and "eval" in result.output
    result = runner.invoke(cli, ["--version"])
    assert result.exit_code == 0 and fctkit.__version__ in result.output


def test_console_script_reports_kit_errors_in_one_line(tmp_path):
    missing = tmp_path / "nope.npz"
    proc = subprocess.run(
        [sys.executable, "-m", "fctkit.cli", "eval", "--query", str(missing), "--gallery", str(missing)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr


def test_warns_when_both_onnxruntime_flavours_are_installed(monkeypatch):
    monkeypatch.setattr(_environment, "installed_distributions", lambda names: list(names))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _environment.warn_on_conflicting_onnxruntime()
    assert any("onnxruntime-gpu" in str(w.message) for w in caught)


def test_no_warning_with_one_flavour(monkeypatch):
    monkeypatch.setattr(_environment, "installed_distributions", lambda names: ["onnxruntime"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _environment.warn_on_conflicting_onnxruntime()
