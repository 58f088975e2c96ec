"""Device costs at real image widths (issue 37, part 3), as ratios against bare libraries.

    python benchmarks/photo_costs.py                      # 1,000,000 rows to upgrade, 100,000 to query, 1280-d
    python benchmarks/photo_costs.py --rows 100000 --markdown photo-costs.md

Two measurements, each against its baseline in the same process (synthetic rows: these costs do
not depend on the values):

* upgrade: ``Device.upgrade`` of N sealed rows of 1280-d φ and a ψ (``--side-dim``, 128 by default,
  a SimCLR-sized side-info as in the FCT paper) through the kit's FCT mixer at its default
  widths, fp32 and int8 (as ``fctkit export --quantize int8`` ships it), ÷ the bare ONNX Runtime
  transform of the same rows (``benchmarks/edge_upgrade.py`` does the work);
* query: single queries on a 100k-row gallery of 1280-d rows, ``Device.query`` (embed the query,
  search the decrypted gallery) and the device's index alone, p50 ÷ bare faiss ``IndexFlatIP``'s
  p50 (``benchmarks/edge_query.py`` does the work), with faiss's default OpenMP threads and one.

Prints the ratio table, then both detailed tables; ``--markdown FILE`` writes them too. Needs
faiss-cpu. Timings vary with load on shared machines: read the ratios.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import edge_query
import edge_upgrade
from edge_upgrade import Dims, bench_workspace, emit, measure_adapter

QUERY_CASES = (edge_query.DEVICE_QUERY, "ExactIndex, faiss backend")


def ratio_table(upgrades: list[dict], query: edge_query.QueryTimes) -> str:
    lines = ["| cost | rows | measured | baseline | ratio |", "|---|---:|---:|---:|---:|"]
    for r in upgrades:
        lines.append(
            f"| upgrade, {r['adapter']} ({r['dims']}) ÷ bare ORT transform | {r['rows']:,} "
            f"| {r['upgrade_rows_per_s']:,.0f} rows/s | {r['bare_rows_per_s']:,.0f} rows/s | **{r['ratio']:.2f}** |"
        )
    for threads, cases in query.times.items():
        base = cases[edge_query.BASELINE]
        for name in QUERY_CASES:
            lines.append(
                f"| query p50, {name}, faiss threads {threads} ({query.dims.embedding}-d) ÷ faiss IndexFlatIP "
                f"| {query.rows:,} | {_ms(cases[name])} | {_ms(base)} | **{query.p50_ratio(threads, name):.2f}** |"
            )
    return "\n".join(lines) + "\n"


def _ms(times: np.ndarray) -> str:
    return f"p50 {np.percentile(times, 50) * 1e3:.2f} ms (p99 {np.percentile(times, 99) * 1e3:.2f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="Rows the device upgrades.")
    parser.add_argument("--query-rows", type=int, default=100_000, help="Rows of the queried gallery.")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--dim", type=int, default=1280, help="Width of φ (old and new).")
    parser.add_argument("--side-dim", type=int, default=128, help="Width of the side-info ψ.")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0: its default).")
    parser.add_argument("--adapters", default="fct,fct-int8", help="Comma-separated, as in edge_upgrade.py.")
    parser.add_argument("--markdown", type=Path, help="Also write the tables to this file.")
    args = parser.parse_args(argv)
    dims = Dims(args.dim, args.side_dim)
    query = edge_query.measure(args.query_rows, args.queries, dims)
    with bench_workspace("fctkit-photo-costs-") as (work, key, pub):
        upgrades = [
            measure_adapter(a, args.rows, args.batch, args.threads, work, key, pub, dims)
            for a in args.adapters.split(",")
        ]
    details = edge_upgrade.markdown(upgrades, None, args)
    emit(
        "\n".join([ratio_table(upgrades, query), "Upgrade:", "", details, "Query:", "", edge_query.markdown(query)]),
        args.markdown,
    )


if __name__ == "__main__":
    main()
