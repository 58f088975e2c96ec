"""Trainer commands of the `fctkit` CLI (registered in :data:`fctkit.cli.SUBCOMMANDS`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import click


def _parse_topk(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        ks = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated integers like 1,5,10; got {value!r}") from exc
    if not ks or min(ks) < 1:
        raise click.BadParameter(f"every k must be >= 1; got {value!r}")
    return ks


@click.command("eval")
@click.option(
    "--query", "query_path", required=True, type=click.Path(path_type=Path), help="Query .npz (embeddings, labels)."
)
@click.option(
    "--gallery",
    "gallery_path",
    type=click.Path(path_type=Path),
    help="Gallery .npz; omitted: the query set is its own gallery with leave-one-out.",
)
@click.option("--distance", type=click.Choice(["l2", "cosine"]), default="l2", show_default=True)
@click.option("--topk", default="1,5", show_default=True, callback=_parse_topk, help="Comma-separated CMC ks.")
@click.option("--leave-one-out", is_flag=True, help="Query i and gallery i are the same item: exclude it.")
@click.option(
    "--chunk-size",
    default=1024,
    show_default=True,
    type=click.IntRange(min=1),
    help="Queries per chunk (memory ~ chunk x gallery x 8 bytes).",
)
@click.option("--name", "case_name", default=None, help="Case name in the report (default: QUERY/GALLERY file stems).")
@click.option(
    "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), help="Write report.md/json/png here."
)
def eval_command(
    query_path: Path,
    gallery_path: Path | None,
    distance: Literal["l2", "cosine"],  # click.Choice
    topk: tuple[int, ...],
    leave_one_out: bool,
    chunk_size: int,
    case_name: str | None,
    out_dir: Path | None,
) -> None:
    """Evaluate retrieval (CMC top-k, mAP@1.0) of query embeddings against a gallery."""
    from .datasets import load_features
    from .evaluation import evaluate_retrieval
    from .report import Report

    queries = load_features(query_path)
    query, query_labels = queries.embeddings, queries.labels
    if gallery_path is None:
        gallery, gallery_labels, leave_one_out = query, query_labels, True
    else:
        galleries = load_features(gallery_path)
        gallery, gallery_labels = galleries.embeddings, galleries.labels
    result = evaluate_retrieval(
        query,
        query_labels,
        gallery,
        gallery_labels,
        distance=distance,
        topk=topk,
        leave_one_out=leave_one_out,
        chunk_size=chunk_size,
        progress=True,
    )
    name = case_name or f"{query_path.stem}/{(gallery_path or query_path).stem}"
    report = Report(f"Retrieval evaluation ({distance}{', leave-one-out' if leave_one_out else ''})")
    report.add_case(name, result)
    click.echo(report.to_markdown())
    if out_dir is not None:
        for path in report.save(out_dir).values():
            click.echo(f"wrote {path}")


def _parse_overrides(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> dict[str, object]:
    """``--set fct.train.epochs=5`` → {"fct.train.epochs": 5}; values are read as TOML (strings may be bare)."""
    import tomllib

    overrides: dict[str, object] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE (e.g. fct.train.epochs=5), got {item!r}")
        try:
            overrides[key.strip()] = tomllib.loads(f"value = {raw}")["value"]
        except tomllib.TOMLDecodeError:
            overrides[key.strip()] = raw
    return overrides


def _run_options(example_config: str, outputs: str, example_override: str):
    """The options every config-driven training command takes: --config, --out, --set, --device, --quiet."""
    options = [
        click.option(
            "--config",
            "config_path",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help=f"TOML config (see {example_config}); unknown keys are errors. Omitted: digits defaults.",
        ),
        click.option(
            "--out",
            "out_dir",
            required=True,
            type=click.Path(file_okay=False, path_type=Path),
            help=f"Output folder: {outputs}.",
        ),
        click.option(
            "--set",
            "overrides",
            multiple=True,
            callback=_parse_overrides,
            metavar="KEY=VALUE",
            help=f"Override a config value by dotted key, e.g. --set {example_override} (repeatable).",
        ),
        click.option(
            "--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None, help="Overrides the config's device."
        ),
        click.option("--quiet", is_flag=True, help="No progress bars."),
    ]

    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def _with_run_settings(overrides: dict[str, object], device: str | None, quiet: bool) -> dict[str, object]:
    """--device and --quiet as config overrides."""
    return {**overrides, **({"device": device} if device is not None else {}), **({"progress": False} if quiet else {})}


@click.command("train")
@_run_options(
    "configs/digits.toml",
    "models/, adapters/, features/, report.md/json/png, gate.json, config.json",
    "fct.train.epochs=5",
)
def train_command(
    config_path: Path | None, out_dir: Path, overrides: dict[str, object], device: str | None, quiet: bool
) -> None:
    """Train backbones, side-info and every adapter method; evaluate every case; write the report.

    Image data (digits, fashion-mnist) trains the old/new backbones and the side-info model
    first; `data.name = "features"` starts from your own .npz embeddings instead.
    """
    from .pipeline import run_pipeline
    from .pipeline_config import load_pipeline_config

    config = load_pipeline_config(config_path, _with_run_settings(overrides, device, quiet))
    result = run_pipeline(config, out_dir, log=lambda message: click.echo(f"[train] {message}", err=True))
    click.echo(result.report.to_markdown())


@click.command("train-compatible")
@_run_options(
    "configs/digits-compatible.toml",
    "models/<upgrade|sequence>/<method>/v<k>.pt, report.md/json/png, results.json, gate.json, config.json",
    "bt2.extra_dims=32",
)
def train_compatible_command(
    config_path: Path | None, out_dir: Path, overrides: dict[str, object], device: str | None, quiet: bool
) -> None:
    """Train new backbones to be compatible with the old one (BCT, BT², CoReS, CoReS + HOC),
    next to independent training and the FCT / λ-orth adapters; one upgrade and a multi-step
    sequence with compatibility matrices (AC, AM), evaluated on the last version's classes or
    (evaluation_classes = "held-out") on classes no version trains on; write the report."""
    from .compatible_comparison import results_markdown, run_compatible
    from .compatible_config import load_compatible_config

    config = load_compatible_config(config_path, _with_run_settings(overrides, device, quiet))
    result = run_compatible(config, out_dir, log=lambda message: click.echo(f"[train-compatible] {message}", err=True))
    click.echo(results_markdown(result.upgrade, result.sequence))
