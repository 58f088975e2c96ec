"""Publisher keys and the `fctkit keys` / `fctkit bundle` commands end to end."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from fctkit.cli import cli
from fctkit.errors import PublisherKeyError
from fctkit.export.keys import PASSPHRASE_ENV, generate_keys, load_private_key, read_passphrase
from fctkit.protos.bundle import load_public_key, public_key_id

BLOCK_TORCH_AND_ONNX = textwrap.dedent(
    """
    import importlib.abc, sys
    class _Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "onnx", "onnxscript"):
                raise ImportError(name + " is blocked: the device side must not need it")
    sys.meta_path.insert(0, _Blocked())
    """
)


def test_generated_keys_are_0600_and_pair_up(tmp_path):
    private_path, public_path = generate_keys(tmp_path / "keys")
    assert stat.S_IMODE(private_path.stat().st_mode) == 0o600
    private = load_private_key(private_path)
    assert public_key_id(private.public_key()) == public_key_id(load_public_key(public_path))
    raw = load_public_key(public_path).public_bytes_raw()
    assert public_key_id(load_public_key(raw)) == public_key_id(private.public_key())
    with pytest.raises(PublisherKeyError, match="never overwritten"):
        generate_keys(tmp_path / "keys")


def test_passphrase_protected_key(tmp_path):
    private_path, _ = generate_keys(tmp_path, passphrase=b"correct horse")
    assert b"ENCRYPTED" in private_path.read_bytes()
    assert load_private_key(private_path, b"correct horse") is not None
    with pytest.raises(PublisherKeyError, match="passphrase is wrong"):
        load_private_key(private_path, b"wrong")
    with pytest.raises(PublisherKeyError, match="passphrase-file"):
        load_private_key(private_path)


def test_a_readable_private_key_is_refused(tmp_path):
    private_path, _public_path = generate_keys(tmp_path)
    private_path.chmod(0o644)
    with pytest.raises(PublisherKeyError, match="chmod 600"):
        load_private_key(private_path)
    with pytest.raises(PublisherKeyError, match="not an Ed25519 public key"):
        load_public_key(private_path)


def test_passphrase_sources(tmp_path, monkeypatch):
    monkeypatch.delenv(PASSPHRASE_ENV, raising=False)
    assert read_passphrase(None) is None
    (tmp_path / "p").write_bytes(b"secret\n")
    assert read_passphrase(tmp_path / "p") == b"secret"
    monkeypatch.setenv(PASSPHRASE_ENV, "from-env")
    assert read_passphrase(None) == b"from-env"
    (tmp_path / "empty").write_bytes(b"\n")
    with pytest.raises(PublisherKeyError, match="empty"):
        read_passphrase(tmp_path / "empty")


def _run(args: list[str], env: dict | None = None):
    result = CliRunner().invoke(cli, args, env=env, catch_exceptions=True)
    return result


def _write_spec(folder: Path, tiny_sources, *, gate: dict | None, verdicts: dict | None = None) -> Path:
    """A build spec for the tiny graphs; ``verdicts`` (role -> report verdict) adds ``ecc`` keys."""
    sources = tiny_sources(folder / "graphs")
    lines = ["version = 2", "parents = [1]", 'mode = "forward"', 'distance = "cosine"', "normalize = true"]
    if gate is not None:
        (folder / "gate.json").write_text(json.dumps(gate))
        lines.append('gate = "gate.json"')
    for s in sources:
        lines += ["", "[[artifact]]", f'file = "graphs/{s.file.name}"', f'role = "{s.role}"']
        if s.source_version is not None:
            lines += [f"source_version = {s.source_version}", f"target_version = {s.target_version}"]
        if verdicts and s.role in verdicts:
            lines.append(f'ecc = "{verdicts[s.role]}"')
    spec = folder / "bundle.toml"
    spec.write_text("\n".join(lines) + "\n")
    return spec


def test_cli_generate_build_verify_pack(tmp_path, passing_gate, monkeypatch, tiny_sources):
    monkeypatch.delenv(PASSPHRASE_ENV, raising=False)
    (tmp_path / "pass").write_text("hunter2-but-longer\n")
    result = _run(["keys", "generate", "--out", str(tmp_path / "keys"), "--passphrase-file", str(tmp_path / "pass")])
    assert result.exit_code == 0, result.output
    assert "passphrase-encrypted" in result.output

    spec = _write_spec(tmp_path, tiny_sources, gate=passing_gate)
    build = ["bundle", "build", str(spec), "--key", str(tmp_path / "keys/publisher.key"), "--out", str(tmp_path / "v2")]
    result = _run(build)
    assert result.exit_code != 0 and "passphrase-encrypted" in str(result.exception)
    result = _run([*build, "--passphrase-file", str(tmp_path / "pass"), "--archive", str(tmp_path / "v2.tar")])
    assert result.exit_code == 0, result.output
    assert "OK bundle v2" in result.output and "forward_1_to_2" in result.output

    public = str(tmp_path / "keys/publisher.pub")
    for target in ("v2", "v2.tar"):
        result = _run(["bundle", "verify", str(tmp_path / target), "--public-key", public, "--installed-version", "1"])
        assert result.exit_code == 0, result.output
        assert "4 graph(s) load" in result.output

    result = _run(["bundle", "verify", str(tmp_path / "v2"), "--public-key", public, "--installed-version", "2"])
    assert result.exit_code != 0 and "replay" in str(result.exception)

    result = _run(["bundle", "pack", str(tmp_path / "v2"), str(tmp_path / "again.tar")])
    assert result.exit_code == 0
    assert (tmp_path / "again.tar").read_bytes() == (tmp_path / "v2.tar").read_bytes()


def test_cli_gate_refusal_and_force(tmp_path, passing_gate, monkeypatch, tiny_sources):
    monkeypatch.delenv(PASSPHRASE_ENV, raising=False)
    generate_keys(tmp_path / "keys")
    failing = {"cases": passing_gate["cases"], "ecc": {**passing_gate["ecc"], "backward_2_to_1": False}}
    spec = _write_spec(tmp_path, tiny_sources, gate=failing)
    build = ["bundle", "build", str(spec), "--key", str(tmp_path / "keys/publisher.key"), "--out", str(tmp_path / "v2")]
    result = _run(build)
    assert result.exit_code != 0 and "publishing refused" in str(result.exception)
    result = _run([*build, "--force"])
    assert "needs a reason" in str(result.exception)
    result = _run([*build, "--force", "--reason", "known regression on class 7, fix in v3"])
    assert result.exit_code == 0, result.output
    assert "WARNING gate overridden (forced): known regression" in result.output


def test_cli_spec_errors_are_clear(tmp_path, tiny_sources):
    generate_keys(tmp_path / "keys")
    spec = _write_spec(tmp_path, tiny_sources, gate=None)
    spec.write_text(spec.read_text().replace("normalize = true", "normalise = true"))
    result = _run(
        ["bundle", "build", str(spec), "--key", str(tmp_path / "keys/publisher.key"), "--out", str(tmp_path / "o")]
    )
    assert result.exit_code != 0 and "unknown key(s) 'normalise'" in str(result.exception)


def test_fctkit_bundle_verify_runs_without_torch_or_onnx(tmp_path, publisher_key, make_bundle):
    """A device has the core install plus onnxruntime: verify must not import torch or onnx."""
    from fctkit.export.keys import save_public_key

    bundle = make_bundle(tmp_path / "v2", publisher_key)
    public = save_public_key(publisher_key.public_key(), tmp_path / "publisher.pub")
    code = BLOCK_TORCH_AND_ONNX + textwrap.dedent(
        f"""
        from fctkit.cli import main
        try:
            main(["bundle", "verify", {str(bundle.root)!r}, "--public-key", {str(public)!r}])
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
        assert not any(m.split(".")[0] in ("torch", "onnx") for m in sys.modules), "torch/onnx imported"
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd="/",
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "OK bundle v2" in proc.stdout and "4 graph(s) load" in proc.stdout


def test_bundle_verify_without_onnxruntime_says_what_to_install(tmp_path, publisher_key, make_bundle):
    from fctkit.export.keys import save_public_key

    bundle = make_bundle(tmp_path / "v2", publisher_key)
    public = save_public_key(publisher_key.public_key(), tmp_path / "publisher.pub")
    code = BLOCK_TORCH_AND_ONNX.replace(
        '("torch", "onnx", "onnxscript")', '("torch", "onnx", "onnxscript", "onnxruntime")'
    ) + (
        f"from fctkit.cli import main\nmain(['bundle', 'verify', {str(bundle.root)!r}, '--public-key', {str(public)!r}])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "onnxruntime" in proc.stderr and "fctkit[cpu]" in proc.stderr


def _trainer_report(forward_top1: float) -> dict:
    from fctkit.trainer import Report, RetrievalResult

    report = Report("digits v1 -> v2")
    for name, top1 in (("old/old", 0.90), ("new/h(old)", forward_top1), ("B(new)/old", 0.91)):
        report.add_case(name, RetrievalResult(cmc={1: top1, 5: 0.99}, mean_ap=top1 - 0.1, n_queries=300, n_skipped=0))
    report.add_ecc()
    report.add_verdict("ECC backward (top1)", True, "B(new)/old 0.91 > old/old 0.90")
    return report.to_json()


def test_cli_gate_from_a_trainer_report(tmp_path, tiny_sources, monkeypatch):
    monkeypatch.delenv(PASSPHRASE_ENV, raising=False)
    generate_keys(tmp_path / "keys")
    verdicts = {"forward": "ECC (top1)", "backward": "ECC backward (top1)"}
    spec = _write_spec(tmp_path, tiny_sources, gate=_trainer_report(0.93), verdicts=verdicts)
    build = ["bundle", "build", str(spec), "--key", str(tmp_path / "keys/publisher.key")]
    result = _run([*build, "--out", str(tmp_path / "ok")])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "ok/manifest.json").read_text())
    assert manifest["gate"]["cases"]["new/h(old)"] == {"top1": 0.93, "top5": 0.99, "mAP": 0.93 - 0.1}
    assert manifest["gate"]["ecc"] == {"forward_1_to_2": True, "backward_2_to_1": True}

    (tmp_path / "gate.json").write_text(json.dumps(_trainer_report(0.85)))  # ECC fails for h
    result = _run([*build, "--out", str(tmp_path / "refused")])
    assert "publishing refused" in str(result.exception) and "forward_1_to_2" in str(result.exception)

    spec.write_text(spec.read_text().replace('ecc = "ECC (top1)"', 'ecc = "ECC (top5)"', 1))
    result = _run([*build, "--out", str(tmp_path / "unknown")])
    assert "verdict 'ECC (top5)'" in str(result.exception)
    report = _trainer_report(0.93)
    report["verdicts"].append(dict(report["verdicts"][0]))
    (tmp_path / "gate.json").write_text(json.dumps(report))
    spec.write_text(spec.read_text().replace('ecc = "ECC (top5)"', 'ecc = "ECC (top1)"'))
    result = _run([*build, "--out", str(tmp_path / "ambiguous")])
    assert "several verdicts named 'ECC (top1)'" in str(result.exception)
