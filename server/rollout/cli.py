"""``fctkit admin rollout``, ``fctkit admin rollout-status``, ``fctkit admin rollout-confirm`` and
``fctkit admin withdraw``: stage, widen, pause, resume and complete a version's
rollout, name its cohort and its guard, show per stage what the devices reported (and how they
went back from a withdrawn version), confirm a version (its devices drop the vectors kept for a
revert), and publish a signed withdrawal. Each takes the admin's ``connect`` from the ``admin`` group."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click

from fctkit.errors import InputError
from fctkit.protos.durable_files import read_regular_file
from fctkit.protos.manifest_signature import load_private_key, read_passphrase
from fctkit.protos.trust import MAX_WITHDRAWAL_BYTES
from fctkit.protos.trust.withdrawal import withdrawal_file_name, write_withdrawal

_DEVICE_ID = re.compile(r"dev-[0-9a-f]{16}")
_STAGE_COLUMNS = (
    "stage",
    "percent",
    "started_at",
    "offered",
    "downloaded",
    "upgraded",
    "failed",
    "reverted",
    "reporting",
    "cos median",
    "cos p10",
    "r@1 median",
    "rank median",
    "vs expected",
    "reverted_by",
)


def read_cohort(path: Path) -> list[str]:
    """The device ids of ``path``, one per line (blank lines and ``#`` comments skipped); a
    malformed line is refused with its number."""
    ids = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if text and not _DEVICE_ID.fullmatch(text):
            raise InputError(
                f"{path}:{number}: {text[:80]!r} is not a device id (dev- and 16 hex digits, as "
                "`fctkit admin list-devices` shows them); nothing was changed"
            )
        if text:
            ids.append(text)
    return ids


@click.command("rollout")
@click.argument("version", type=click.IntRange(1))
@click.option(
    "--percent",
    type=click.FloatRange(0, 100),
    default=None,
    help="Start or widen the staged rollout to this percent of devices (never narrower: pause instead).",
)
@click.option("--pause", "action", flag_value="pause", help="Offer the version to nobody new (devices on it stay).")
@click.option("--resume", "action", flag_value="resume", help="Stage again after a pause or a halt by the guard.")
@click.option("--complete", "action", flag_value="complete", help="Offer the version to every device.")
@click.option(
    "--devices",
    "cohort_file",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="The cohort: a file of device ids, one per line, in the rollout whatever the percent (e.g. testers).",
)
@click.option(
    "--halt-below",
    type=click.FloatRange(-1, 1),
    default=None,
    help="Guard: halt the rollout when the median vote of reporting owners falls below this (one vote per "
    "owner: the median of its devices; what a vote is: --halt-measure).",
)
@click.option(
    "--halt-measure",
    type=click.Choice(["mean_cosine", "recall_at_1", "expected"]),
    default="mean_cosine",
    show_default=True,
    help="With --halt-below: mean_cosine or recall_at_1 (self-retrieval) as devices report them, against "
    "--halt-below as an absolute bound; or expected: the measure of the release's level minus what the "
    "release expects at each device's gallery size, halting --halt-below (a margin) under 0.",
)
@click.option(
    "--halt-min-devices",
    type=click.IntRange(1),
    default=None,
    help="Guard: only once devices of at least this many owners in the rollout reported (with --halt-below).",
)
@click.option(
    "--halt-failure-rate",
    type=click.FloatRange(0, 1, max_open=True),
    default=0.0,
    show_default=True,
    help="With --halt-below: also halt when the owners' mean share of failed upgrades among their devices that "
    "got the version rises above this (0: no bound; the default guard of a staged release uses 0.25).",
)
@click.option("--no-guard", is_flag=True, help="Remove the rollout's guard: nothing halts it from now on.")
@click.pass_obj
def rollout_command(
    connect,
    version: int,
    percent: float | None,
    action: str | None,
    cohort_file: Path | None,
    halt_below: float | None,
    halt_min_devices: int | None,
    halt_measure: str,
    halt_failure_rate: float,
    no_guard: bool,
) -> None:
    """Change the staged rollout of VERSION (published with `fctkit admin publish BUNDLE --percent P`):
    every option given at once, or none. Devices outside it keep being offered the versions before it.
    The guard keeps watching a completed rollout until the version is confirmed; resuming a halted
    rollout under the guard that would halt it again is refused (give a new guard or --no-guard).
    Once it has proved itself, `fctkit admin rollout-confirm VERSION` ends its rollback window early."""
    if (halt_below is None) != (halt_min_devices is None):
        raise click.UsageError("--halt-below and --halt-min-devices go together")
    if no_guard and halt_below is not None:
        raise click.UsageError("--no-guard removes the guard: not with --halt-below")
    if percent is None and action is None and cohort_file is None and halt_below is None and not no_guard:
        raise click.UsageError(
            "nothing to change: give --percent, --pause, --resume, --complete, --devices, --halt-below or --no-guard"
        )
    cohort = None if cohort_file is None else read_cohort(cohort_file)
    with connect() as client:
        status = client.set_rollout(
            version,
            percent=percent,
            action=action,
            cohort=cohort,
            halt_below=halt_below,
            halt_min_devices=halt_min_devices or 0,
            remove_guard=no_guard,
            guard_measure=halt_measure,
            max_failure_rate=halt_failure_rate,
        )
    click.echo(_headline(status))


@click.command("rollout-status")
@click.argument("version", type=click.IntRange(1))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_obj
def rollout_status_command(connect, version: int, as_json: bool) -> None:
    """The rollout of VERSION: its state and, per stage, the devices offered, downloaded, upgraded,
    failed and reverted, and their health signal beside what the gate measured."""
    from google.protobuf.json_format import MessageToDict

    with connect() as client:
        status = client.rollout_status(version)
    gate = json.loads(status.gate_cases_json or "{}")
    if as_json:
        data = MessageToDict(status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        data.pop("gate_cases_json")
        click.echo(json.dumps({**data, "gate_cases": gate}, indent=2))
        return
    click.echo(_headline(status))
    if status.state == "withdrawn":
        click.echo(f"withdrawn: {status.withdrawn_reason} (devices that installed it go back to v{status.revert_to})")
    if status.halt_reason:
        click.echo(f"halted: {status.halt_reason}")
    rows = [_stage_row(stage) for stage in status.stages]
    if rows:
        widths = [max(len(c), *(len(r[c]) for r in rows)) for c in _STAGE_COLUMNS]
        for row in [dict(zip(_STAGE_COLUMNS, _STAGE_COLUMNS)), *rows]:
            click.echo("  ".join(row[c].ljust(w) for c, w in zip(_STAGE_COLUMNS, widths)))
    cases = (
        ", ".join(
            f"{case} {' '.join(f'{k} {v:.4f}' for k, v in metrics.items() if _number(v))}"
            for case, metrics in gate.items()
            if isinstance(metrics, dict)
        )
        or "no cases recorded"
    )
    click.echo(f"gate (the server's evaluation data): {cases}")
    click.echo(_expectation_line(status))
    if version > 1:
        click.echo(_previous_line(client_status(connect, version - 1)))
    if status.gate_override_reason:
        click.echo(f"gate overridden at export (--force): {status.gate_override_reason}")


@click.command("rollout-confirm")
@click.argument("version", type=click.IntRange(1))
@click.pass_obj
def rollout_confirm_command(connect, version: int) -> None:
    """Confirm VERSION ("it is good"): devices running it drop the vectors they keep for an exact
    revert at their next sync, as when its rollback window ends. It can still be withdrawn
    (`fctkit admin withdraw`): its devices then go back through the bundle's backward adapter or
    by re-embedding from the vault. Needs no publisher key: it moves no device. Refused for an
    unknown or withdrawn version and for one offered to no device yet; confirming again changes nothing."""
    with connect() as client:
        status = client.confirm_version(version)
    click.echo(_headline(status))
    click.echo(f"devices running v{version} drop the vectors kept for a revert at their next sync")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _headline(status) -> str:
    return _state(status) + (f"; confirmed at {status.confirmed_at}" if status.confirmed_at else "")


def _state(status) -> str:
    if status.state == "none":
        return f"version {status.version}: no rollout (offered to every device)"
    if status.state == "withdrawn":
        cohort = f" and a cohort of {status.cohort_size}" if status.cohort_size else ""
        return f"version {status.version}: withdrawn (offered to no device; it had reached {status.percent:g}%{cohort})"
    if status.guard_measure == "expected":
        what = (
            f"median {_level_measure(status)} under {1 - status.halt_below:g} of the release's expectation "
            "(or under the break-even at a device's gallery size, where the release did worse than not upgrading)"
        )
    else:
        what = f"median {status.guard_measure or 'mean_cosine'} below {status.halt_below:g}"
    if status.max_failure_rate:
        what += f", or at a failure rate above {status.max_failure_rate:g} (now {status.failure_rate:.3f} of {status.failure_owners} owners)"
    guard = f"; guard: halt at {what} once {status.halt_min_devices} owners reported" if status.halt_min_devices else ""
    return f"version {status.version}: {status.state} at {status.percent:g}% (cohort of {status.cohort_size}){guard}"


def client_status(connect, version: int):
    """``version``'s rollout status, or None when the server has no such version."""
    from fctkit.errors import RpcStatusError

    try:
        with connect() as client:
            return client.rollout_status(version)
    except RpcStatusError as exc:
        if exc.code == "NOT_FOUND":
            return None
        raise


def _expectation_line(status) -> str:
    """What the release expects devices to report (its manifest's health_expectation), by gallery size."""
    if not status.health_expectation_json:
        return "expected health: not recorded (the release was exported before fctkit measured one)"
    e = json.loads(status.health_expectation_json)
    measure = "recall_at_1" if e["level"] == "instance" else "mean_cosine"
    means, sds = e["measures"][measure]["mean"], e["measures"][measure]["sd"]
    by_size = ", ".join(
        f"{m:.3f} ±{sd:.3f} (break-even {b:.3f}) at {rows:,} rows"
        for rows, m, sd, b in zip(e["gallery_rows"], means, sds, e["break_even"])
    )
    cosine = e["measures"]["mean_cosine"]["mean"][-1]
    return (
        f"expected health ({e['level']} level, samples of {e['sample_size']}, {e['draws']} draws on the evaluation "
        f"split): {measure} {by_size}; mean_cosine {cosine:.3f}"
    )


def _previous_line(previous) -> str:
    """The previous release's fleet health, over all its stages, for comparison."""
    if previous is None:
        return "previous release: none"
    stages = list(previous.stages)
    reporting = sum(s.health.devices for s in stages)
    if not reporting:
        return f"previous release v{previous.version}: no device reported a sampled health"
    cosine = max(stages, key=lambda s: s.health.devices)
    return (
        f"previous release v{previous.version}: {reporting} devices reported; largest stage's medians: "
        f"mean_cosine {cosine.health.median:.4f}, recall_at_1 {cosine.recall_at_1.median:.4f}"
    )


def _level_measure(status) -> str:
    if not status.health_expectation_json:
        return "measure"
    level = json.loads(status.health_expectation_json)["level"]
    return "recall_at_1" if level == "instance" else "mean_cosine"


def _stage_row(stage) -> dict[str, str]:
    health = stage.health

    def shown(summary, field: str = "median") -> str:
        return f"{getattr(summary, field):.4f}" if summary.devices else "-"

    numbers = {
        "cos median": shown(health),
        "cos p10": shown(health, "p10"),
        "r@1 median": shown(stage.recall_at_1),
        "rank median": f"{stage.median_rank.median:g}" if stage.median_rank.devices else "-",
        "vs expected": shown(stage.expected_shortfall),
    }
    return {
        "stage": "cohort" if stage.stage == 0 else str(stage.stage),
        "percent": f"{stage.percent:g}",
        "started_at": stage.started_at or "-",
        "offered": str(stage.offered),
        "downloaded": str(stage.downloaded),
        "upgraded": str(stage.upgraded),
        "failed": str(stage.failed),
        "reverted": str(stage.reverted),
        "reporting": str(health.devices),
        **numbers,
        "reverted_by": ", ".join(f"{m} {n}" for m, n in sorted(stage.revert_methods.items())) or "-",
    }


@click.command("withdraw")
@click.argument("version", type=click.IntRange(1), required=False)
@click.option("--reason", default=None, help="Why (shown to operators and devices; at most 1,024 characters).")
@click.option(
    "--key",
    "key_path",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="Your publisher.key: write withdrawal.<VERSION>.json signed with it and publish it.",
)
@click.option(
    "--revert-to",
    type=click.IntRange(0),
    default=None,
    help="The version devices that installed VERSION go back to (default: VERSION - 1; 0: none).",
)
@click.option(
    "--file",
    "withdrawal_file",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="Publish this withdrawal.<V>.json as it is (e.g. co-signed by a threshold of publishers).",
)
@click.option(
    "--passphrase-file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="File holding the --key passphrase (or set $FCTKIT_KEY_PASSPHRASE).",
)
@click.pass_obj
def withdraw_command(
    connect,
    version: int | None,
    reason: str | None,
    key_path: Path | None,
    revert_to: int | None,
    withdrawal_file: Path | None,
    passphrase_file: Path | None,
) -> None:
    """Withdraw release VERSION: from now on it is offered to no device, and devices that installed
    it go back to --revert-to. Either VERSION --reason --key (writes withdrawal.<VERSION>.json
    here, signed with that key, and publishes it) or --file (a withdrawal already signed, e.g. by
    a threshold of publishers with `fctkit keys sign`). The server checks the signatures as a
    device would: it cannot withdraw a release on its own."""
    if withdrawal_file is not None:
        if version is not None or reason is not None or key_path is not None or revert_to is not None:
            raise click.UsageError(
                "--file publishes a withdrawal as it is: give no VERSION, --reason, --key or --revert-to"
            )
        data = read_regular_file(withdrawal_file, MAX_WITHDRAWAL_BYTES)
    else:
        if version is None or reason is None or key_path is None:
            raise click.UsageError("give VERSION --reason TEXT --key publisher.key, or --file withdrawal.<V>.json")
        path = Path(withdrawal_file_name(version))
        key = load_private_key(key_path, read_passphrase(passphrase_file))
        write_withdrawal(path, version, version - 1 if revert_to is None else revert_to, reason, key)
        click.echo(f"wrote {path}")
        data = path.read_bytes()
    with connect() as client:
        response = client.withdraw(data)
    click.echo(f"withdrew version {response.version}: devices that installed it go back to v{response.revert_to}")
