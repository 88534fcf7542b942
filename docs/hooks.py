"""MkDocs hook: the benchmark tables, rendered from ``benchmarks/results/*.json`` at build time.

A page writes ``<!-- bench: NAME -->`` where a table goes; :data:`TABLES` says which result
file and which of its rows and fields make table ``NAME``. The prose around the tables stays
in Markdown; every number in a table is read from the JSON a benchmark script wrote, so a
rerun of ``make bench`` updates the site. An unknown name, a missing file or a missing field
fails the build (``mkdocs build --strict`` stops on the error).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

RESULTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results"
)
MARKER = re.compile(r"<!-- bench: ([\w-]+) -->")


# ------------------------------------------------------------------ number formats
def rate(v: float | None) -> str:
    """Records (or rows, samples) per second: 157k, 1.3k, 2.2M, 843."""
    if v is None:
        return ""
    if v >= 1e6:
        return f"{v / 1e6:.1f}M"
    if v >= 1e5:
        return f"{v / 1e3:.0f}k"
    if v >= 1e3:
        return f"{v / 1e3:.1f}k"
    return f"{v:.0f}" if v >= 10 else f"{v:.2f}"


def x(v: float | None, digits: int = 2) -> str:
    """A ratio: 0.60, 2.87, 172, 16,000."""
    if v is None:
        return ""
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def sec(v: float | None) -> str:
    if v is None:
        return ""
    if v < 0.1:
        return f"{v * 1e3:.1f} ms"
    return f"{v:.2f} s"


def mib(v: float | None) -> str:
    return "" if v is None else f"{v:,.0f}"


def num(v: float | None, digits: int = 2) -> str:
    if v is None:
        return ""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.{digits}f}".rstrip("0").rstrip(".")


def pct(v: float | None) -> str:
    return "" if v is None else f"{v:.0f}%"


# ------------------------------------------------------------------ tables
Column = tuple[str, Callable[[dict[str, Any]], Any]]


def _escape(text: str) -> str:
    """A cell's text as literal Markdown (``__getitems__`` is not bold, ``|`` not a cell)."""
    return re.sub(r"([\\`*_|<\[\]])", r"\\\1", text)


def load(name: str) -> dict[str, Any]:
    with open(os.path.join(RESULTS, name + ".json")) as f:
        return json.load(f)


def table(columns: list[Column], rows: Iterable[dict[str, Any]], source: str) -> str:
    rows = list(rows)
    if not rows:
        raise ValueError(f"benchmarks/results/{source}.json: no rows for this table")
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [_escape(str(fn(r))) for _, fn in columns]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"*From `benchmarks/results/{source}.json`.*")
    return "\n".join(lines)


def random_access(kind: str) -> str:
    d = load("random_access")
    rows = d["results"]["1KiB"]["rows"]
    fresh = [r for r in rows if r["reader"].startswith("fresh process: ")]
    warm = [r for r in rows if r["records/s"] is not None and r not in fresh]
    pick = fresh if kind == "fresh" else warm
    return table(
        [
            ("reader (1 KiB records)", lambda r: r["reader"].removeprefix("fresh process: ")),
            ("records/s", lambda r: rate(r["records/s"])),
            ("x C++ loop (wall)", lambda r: x(r["x C++ loop"])),
            ("x C++ loop (CPU)", lambda r: x(r.get("x C++ loop (CPU)"))),
        ],
        pick,
        "random_access",
    )


def pipeline_lessons() -> str:
    d = load("pipeline_lessons")
    return table(
        [
            ("lesson", lambda r: r["lesson"]),
            ("setup", lambda r: r["setup"]),
            ("torchgrain", lambda r: f"{r['torchgrain_s']:.3f} s"),
            ("ideal", lambda r: f"{r['ideal_s']:.3f} s"),
            ("ratio", lambda r: x(r["ratio"])),
            (
                "tf.data (guide)",
                lambda r: "-" if r["tf_data_s"] is None else f"{r['tf_data_s']:.3f} s",
            ),
        ],
        d["lessons"],
        "pipeline_lessons",
    )


def end_to_end() -> str:
    d = load("end_to_end")
    return table(
        [
            ("loader", lambda r: r["loader"]),
            ("workers", lambda r: r["workers"]),
            ("samples/s (median)", lambda r: f"{r['samples_per_s']:,.0f}"),
            ("runs", lambda r: ", ".join(f"{v:,.0f}" for v in r["runs_samples_per_s"])),
            ("waiting for data", lambda r: pct(r["wait_pct"])),
            ("first batch", lambda r: sec(r["first_batch_s"])),
            ("x torchgrain ArrayRecord", lambda r: x(r["vs_torchgrain_ar"], 3)),
        ],
        sorted(d["results"], key=lambda r: (r["loader"], r["workers"])),
        "end_to_end",
    )


def parquet_access() -> str:
    d = load("parquet_access")
    return table(
        [
            ("workers", lambda r: r["workers"]),
            ("naive per-item", lambda r: f"{r['naive']:,.0f}"),
            ("HF datasets", lambda r: f"{r['hf']:,.0f}"),
            ("tg Global", lambda r: f"{r['tg-global']:,.0f}"),
            ("tg Block", lambda r: f"{r['tg-block']:,.0f}"),
            ("scan through the loader", lambda r: f"{r['scan-loader']:,.0f}"),
            ("loader ceiling", lambda r: rate(r["ceiling"])),
            ("Global/naive", lambda r: x(r["global/naive"]) + "x"),
            ("Block/scan", lambda r: x(r["block/scan"])),
            ("Block/scan through the loader", lambda r: x(r["block/scan-loader"])),
            ("Global/HF", lambda r: x(r["global/hf"])),
            ("Block/HF", lambda r: x(r["block/hf"])),
        ],
        d["ratios"],
        "parquet_access",
    )


def remote() -> str:
    d = load("remote")
    return table(
        [
            ("mode", lambda r: r["mode"]),
            ("records/s", lambda r: f"{r['records/s']:,.0f}"),
            ("x sequential", lambda r: x(r["ratio"])),
            ("local / warm cache", lambda r: x(r.get("vs local"))),
            ("x whole-shard downloads", lambda r: x(r.get("vs whole"))),
        ],
        d["rows"],
        "remote",
    )


def read_ahead(source: str = "read_ahead") -> str:
    d = load(source)
    return table(
        [
            ("first epoch", lambda r: r["mode"]),
            ("records/s", lambda r: rate(r["records/s"])),
            ("x local disk", lambda r: x(r["x local"], 3)),
            ("x read-ahead off", lambda r: x(r.get("x off"))),
            ("first batch", lambda r: sec(r["first batch s"])),
            ("runs per batch", lambda r: num(r["runs per batch"], 1)),
        ],
        d["rows"],
        source,
    )


def columns() -> str:
    d = load("columns")

    def value(r: dict[str, Any]) -> str:
        return f"{r['rate']:.2f} µs" if "us/record" in r["case"] else rate(r["rate"]) + "/s"

    return table(
        [
            ("case", lambda r: r["case"]),
            ("value", value),
            ("ratio", lambda r: x(r["ratio"])),
            ("target", lambda r: r["target"]),
        ],
        d["rows"],
        "columns",
    )


def memory() -> str:
    d = load("memory")
    return table(
        [
            ("case", lambda r: r["case"]),
            ("workers", lambda r: r["workers"]),
            ("measured", lambda r: r["measure"].upper()),
            (
                "peak / end growth (MiB)",
                lambda r: f"{r['peak_growth_mib']:.0f} / {r['end_growth_mib']:.0f}",
            ),
            ("budget (MiB)", lambda r: mib(r["budget_mib"])),
            ("peak over budget per process (MiB)", lambda r: f"{r['over_per_reader_mib']:+.0f}"),
        ],
        d["rows"],
        "memory",
    )


def sampler_speed() -> str:
    d = load("sampler")
    return table(
        [
            ("N", lambda r: r["N"]),
            ("method", lambda r: r["method"]),
            ("M indices/s (CPU)", lambda r: x(r["M idx/s (cpu)"], 1)),
            ("x torch iteration", lambda r: x(r.get("x torch iter"))),
            ("first index", lambda r: sec(r["first idx s"])),
            ("peak memory growth (MiB)", lambda r: mib(r["peak +MiB"])),
        ],
        d["speed"],
        "sampler",
    )


def sampler_quality() -> str:
    d = load("sampler")
    return table(
        [
            ("sampler (1,000 blocks x 1,000 rows)", lambda r: r["sampler"]),
            ("mean jump / N", lambda r: f"{r['mean_abs_jump_over_n']:.3f}"),
            ("lag-1 correlation", lambda r: f"{r['lag1_corr']:.3f}"),
            (
                "distinct blocks per 256 samples",
                lambda r: num(_first(r, "distinct_blocks_per_"), 1),
            ),
            ("blocks each block shares a batch with", lambda r: num(r["batch_partner_blocks"], 1)),
            (
                "decodes per block, 4 workers, LRU 8 / 10 / 32 / 34",
                lambda r: " / ".join(
                    num(r[f"decodes_per_block_lru{n}"], 2) for n in (8, 10, 32, 34)
                ),
            ),
        ],
        d["quality"],
        "sampler",
    )


def _first(r: dict[str, Any], prefix: str) -> Any:
    return next(v for k, v in r.items() if k.startswith(prefix))


def resume() -> str:
    d = load("resume")
    return table(
        [
            ("recipe", lambda r: r["method"]),
            (
                "measured at position",
                lambda r: f"10^{math.log10(r['position']):.0f}" if r["position"] else "0",
            ),
            (
                "time to the first batch (at 10^8)",
                lambda r: (
                    sec(r["seconds at 1e8"]) + (" (extrapolated)" if r["extrapolated"] else "")
                ),
            ),
            ("x tg.ResumableLoader", lambda r: x(r["x tg.ResumableLoader"])),
        ],
        d["rows"],
        "resume",
    )


def peers(name: str) -> str:
    d = load(name)
    full = name == "peers"
    cols: list[Column] = [
        ("loader", lambda r: r.get("description") or r["loader"]),
        ("W", lambda r: r["workers"]),
        ("samples/s", lambda r: rate(r["rate"])),
        ("range over rounds", lambda r: f"{rate(r['rate_min'])}-{rate(r['rate_max'])}"),
        ("x torchgrain ArrayRecord", lambda r: x(r["x_tg"])),
    ]
    if full:
        cols += [
            (
                "chunks per batch / lag-1",
                lambda r: f"{r['distinct_chunks']:.1f} / {r['lag1_corr']:.2f}",
            ),
            ("first batch", lambda r: sec(r["first_batch_s"])),
            ("peak RSS (MiB)", lambda r: mib(r["peak_rss_mib"])),
            ("epoch check", lambda r: r["check"]),
        ]
    return table(cols, sorted(d["results"], key=lambda r: r["workers"]), name)


def peers_writes() -> str:
    d = load("peers")
    return table(
        [
            ("format", lambda r: r["format"]),
            ("write time", lambda r: sec(r["write_s"])),
            ("size on disk (MiB)", lambda r: mib(r["size_mib"])),
        ],
        d["writes"],
        "peers",
    )


def peers_remote(name: str) -> str:
    d = load(name)
    return table(
        [
            ("loader", lambda r: r.get("description") or r["loader"]),
            ("epoch", lambda r: r["epoch"]),
            ("samples/s", lambda r: rate(r.get("rate"))),
            ("first batch", lambda r: sec(r.get("first_batch_s"))),
            (
                "chunks per batch / lag-1",
                lambda r: (
                    ""
                    if r.get("distinct_chunks") is None
                    else f"{r['distinct_chunks']:.1f} / {r['lag1_corr']:.2f}"
                ),
            ),
            ("check", lambda r: r.get("check", "")),
        ],
        d["results"],
        name,
    )


def scale(name: str) -> str:
    d = load(name)
    return table(
        [
            ("case", lambda r: r["case"]),
            ("workers", lambda r: r["workers"]),
            ("open", lambda r: sec(r.get("open_s"))),
            ("first batch", lambda r: sec(r.get("first_batch_s"))),
            ("records/s", lambda r: rate(r.get("rate"))),
            ("loader's private MiB (beyond bare)", lambda r: mib(r.get("loader_private_mib"))),
            ("check", lambda r: r.get("check", "")),
        ],
        d["results"],
        name,
    )


def scale_targets(name: str) -> str:
    d = load(name)

    def value(r: dict[str, Any]) -> str:
        v = r["value"]
        return "" if v is None or (isinstance(v, float) and math.isnan(v)) else num(v, 3)

    return table(
        [
            ("target", lambda r: r["target"]),
            ("workers", lambda r: "" if r["workers"] is None else r["workers"]),
            ("value", value),
            ("goal", lambda r: r["goal"]),
            ("status", lambda r: r["status"]),
            ("note", lambda r: r.get("note", "")),
        ],
        d["targets"],
        name,
    )


def scale_model(name: str) -> str:
    d = load(name)
    return table(
        [
            ("loader", lambda r: r["loader"]),
            ("fixed private MiB", lambda r: num(r["fixed_private_mib"], 3)),
            ("private B/record", lambda r: num(r["private_bytes_per_record"], 3)),
            ("private B/shard", lambda r: num(r["private_bytes_per_shard"], 3)),
            ("mapped B/record (once per node)", lambda r: num(r["shared_bytes_per_record"], 3)),
            ("GiB per process at 10^9", lambda r: num(r["private_gib_per_proc"], 3)),
            ("node GiB, 64 processes", lambda r: num(r["node_gib"], 3)),
            ("node / one process", lambda r: num(r["node_vs_one_proc"], 3)),
        ],
        d["memory_model"],
        name,
    )


TABLES: dict[str, Callable[[], str]] = {
    "random_access-warm": lambda: random_access("warm"),
    "random_access-fresh": lambda: random_access("fresh"),
    "pipeline_lessons": pipeline_lessons,
    "end_to_end": end_to_end,
    "parquet_access": parquet_access,
    "remote": remote,
    "read_ahead": read_ahead,
    "read_ahead-threaded": lambda: read_ahead("read_ahead_threaded"),
    "columns": columns,
    "memory": memory,
    "sampler-speed": sampler_speed,
    "sampler-quality": sampler_quality,
    "resume": resume,
    "peers": lambda: peers("peers"),
    "peers-writes": peers_writes,
    "peers_raw": lambda: peers("peers_raw"),
    "peers_hot": lambda: peers("peers_hot"),
    "peers_quiet": lambda: peers("peers_quiet"),
    "peers_remote": lambda: peers_remote("peers_remote"),
    "peers_remote_quiet": lambda: peers_remote("peers_remote_quiet"),
    "peers_remote_quiet2": lambda: peers_remote("peers_remote_quiet2"),
    "peers_remote_quiet3": lambda: peers_remote("peers_remote_quiet3"),
    "scale_medium": lambda: scale("scale_medium"),
    "scale_medium-targets": lambda: scale_targets("scale_medium"),
    "scale_full": lambda: scale("scale_full"),
    "scale_full-model": lambda: scale_model("scale_full"),
    "scale_full-targets": lambda: scale_targets("scale_full"),
    "scale_full_2048_pq40x": lambda: scale("scale_full_2048_pq40x"),
    "scale_full_2048_pq40x-targets": lambda: scale_targets("scale_full_2048_pq40x"),
}


def render(markdown: str) -> str:
    """``markdown`` with every ``<!-- bench: NAME -->`` replaced by its table."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in TABLES:
            raise KeyError(f"<!-- bench: {name} -->: no such table (known: {', '.join(TABLES)})")
        return TABLES[name]()

    return MARKER.sub(one, markdown)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return render(markdown)
