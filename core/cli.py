"""The `fctkit` command line. Subcommands live with the part they drive and are imported
only when run, so `fctkit --help` and the device commands work without torch installed."""

from __future__ import annotations

import importlib
import sys

import click

from fctkit import __version__
from fctkit.errors import FctkitError, RpcStatusError

UNAVAILABLE_HINT = (
    "hint: the server could not be reached or refused the connection. Check --server; with TLS, that --tls-ca "
    "signed the server's certificate, and, if it requires client certificates (`fctkit serve --tls-ca`), that "
    "--tls-cert and --tls-key name a certificate its CA signed and that certificate's key."
)

# name -> ("module", "attribute", "one-line help"). Parts register here when they add commands.
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "keys": (
        "fctkit.export.keys_cli",
        "keys_command",
        "Publisher keys and the offline root of trust (k of n, rotation, co-signing).",
    ),
    "bundle": ("fctkit.export.cli", "bundle_command", "Build, verify and pack signed model bundles."),
    "export": (
        "fctkit.export.cli",
        "export_command",
        "Export a train run as signed, versioned bundles (v1, v2[, v3]).",
    ),
    "export-compatible": (
        "fctkit.export.cli",
        "export_compatible_command",
        'Export a train-compatible run\'s BCT/BT²/CoReS models as signed bundles in mode "compatible".',
    ),
    "eval": ("fctkit.trainer.cli", "eval_command", "Evaluate retrieval between query and gallery .npz embeddings."),
    "train": (
        "fctkit.trainer.cli",
        "train_command",
        "Train backbones, side-info and adapters from a TOML config; write a report.",
    ),
    "train-compatible": (
        "fctkit.trainer.cli",
        "train_compatible_command",
        "Train compatible new backbones (BCT, BT², CoReS, CoReS + HOC) and compare them with FCT / λ-orth adapters.",
    ),
    "serve": ("fctkit.server.cli", "serve_command", "Run the gRPC server: model registry, encrypted vault, fleet."),
    "device": (
        "fctkit.edge_runtime.cli",
        "device_command",
        "The on-device runtime: encrypted gallery, local embedding, signed sync, upgrades, owner replication.",
    ),
    "demo": (
        "fctkit.demo",
        "demo_command",
        "Run the whole story: train v1/v2, serve, upgrade a device fleet in place, backfill; print the table.",
    ),
    "admin": (
        "fctkit.server.cli",
        "admin_command",
        "Administer a running server: enrolment codes, publish, list devices/versions.",
    ),
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(SUBCOMMANDS))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in SUBCOMMANDS:
            module_name, attr, _ = SUBCOMMANDS[name]
            return getattr(importlib.import_module(module_name), attr)
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Help texts come from the table so listing commands imports nothing heavy.
        rows = [(name, SUBCOMMANDS[name][2]) for name in sorted(SUBCOMMANDS)]
        rows += [(n, c.get_short_help_str()) for n, c in sorted(self.commands.items()) if n not in SUBCOMMANDS]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(sorted(rows))


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fctkit")
def cli() -> None:
    """fctkit: train adapters between embedding-model versions, export them as signed
    bundles, serve them over gRPC, and upgrade encrypted on-device galleries in place.

    Run `fctkit COMMAND --help` for each command's options.
    """


def main(argv: list[str] | None = None) -> None:
    """Entry point: kit errors print one clear line and exit 2 instead of a traceback."""
    try:
        cli.main(args=argv, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except FctkitError as exc:
        click.echo(f"error: {exc}", err=True)
        if isinstance(exc, RpcStatusError) and exc.code == "UNAVAILABLE":
            click.echo(UNAVAILABLE_HINT, err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
