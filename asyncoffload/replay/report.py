"""The replay's results presented: a table that fits the terminal (:func:`format_table`),
a plot (:func:`figure`, :func:`plot`), the lines around the table, and JSON."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from asyncoffload._term import fitted_table, terminal_columns
from asyncoffload.keys import OffloadKey
from asyncoffload.replay.bound import BELADY
from asyncoffload.replay.result import LLAMA3_8B_BYTES_PER_TOKEN, ReplayResult, _share_label
from asyncoffload.workloads import Request, summarize

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "engine_mismatches",
    "figure",
    "format_caption",
    "format_costs",
    "format_engine_check",
    "format_headline",
    "format_json",
    "format_table",
    "infinite_tier_hit_rate",
    "json_row",
    "plot",
]


def format_table(
    results: Sequence[ReplayResult], metric: str = "block", columns: int | None = None
) -> str:
    """A text table: one row per capacity, per policy the hit rate and blocks written.
    No line is as wide as ``columns`` (default: the terminal's width): a table too wide
    is cut into blocks of policies, stacked, each repeating the capacity column."""
    if metric not in ("block", "token"):
        raise ValueError(f"metric must be 'block' or 'token', got {metric!r}")
    if any(r.has_disk for r in results):
        return _format_tiers_table(results, metric, columns)
    policies: list[str] = []
    for r in results:
        if r.label not in policies:
            policies.append(r.label)
    shares = sorted({r.capacity_share for r in results})
    by = {(r.label, r.capacity_share): r for r in results}
    head = ["capacity"] + [f"{p} hit / written" for p in policies]
    rows = [head]
    slots = {r.capacity_share: r.capacity for r in results}
    for share in shares:
        row = [f"{_share_label(share)} ({slots[share]:,})"]
        for p in policies:
            found = by.get((p, share))
            if found is None:
                row.append("-")
                continue
            rate = found.block_hit_rate if metric == "block" else found.token_hit_rate
            row.append(f"{rate:.3f} / {found.stored:,}")
        rows.append(row)
    return fitted_table(rows, columns)


def _gb(n: int) -> str:
    gb = n / 1e9
    return f"{gb:,.0f}" if gb >= 100 else f"{gb:.1f}"


def _format_tiers_table(results: Sequence[ReplayResult], metric: str, columns: int | None) -> str:
    """:func:`format_table` with a disk tier: one row per CPU capacity x disk capacity
    (``none``: the CPU tier alone), per policy the hit rates served from CPU / disk /
    both and the GB (10^9 bytes) written to disk; the offline bound is the CPU tier's."""
    policies: list[str] = []
    for r in results:
        if r.policy != BELADY and r.label not in policies:
            policies.append(r.label)
    bound = {r.capacity_share: r for r in results if r.policy == BELADY}
    slots = {r.capacity_share: r.capacity for r in results}
    disk_slots = {r.disk_capacity_share: r.disk_capacity for r in results if r.has_disk}
    by = {
        (r.label, r.capacity_share, r.disk_capacity_share): r for r in results if r.policy != BELADY
    }
    cells = sorted(
        {(share, disk) for _, share, disk in by},
        key=lambda c: (c[0], -1.0 if c[1] is None else c[1]),
    )
    head = ["cpu", "disk"] + [f"{p} cpu / disk / total, GB to disk" for p in policies]
    if bound:
        head.append(f"{BELADY} (cpu only)")
    rows = [head]
    for share, disk in cells:
        row = [
            f"{_share_label(share)} ({slots[share]:,})",
            "none" if disk is None else f"{_share_label(disk)} ({disk_slots[disk]:,})",
        ]
        for p in policies:
            found = by.get((p, share, disk))
            if found is None:
                row.append("-")
            elif not found.has_disk:
                rate = found.block_hit_rate if metric == "block" else found.token_hit_rate
                row.append(f"{rate:.3f} / - / {rate:.3f}, -")
            else:
                cpu, on_disk, total = found.hit_rates(metric)
                row.append(
                    f"{cpu:.3f} / {on_disk:.3f} / {total:.3f}, {_gb(found.disk_bytes_stored)}"
                )
        if bound:
            b = bound.get(share)
            if b is None:
                row.append("-")
            else:
                row.append(f"{b.block_hit_rate if metric == 'block' else b.token_hit_rate:.3f}")
        rows.append(row)
    return _fitted_two_key_table(rows, columns)


def _fitted_two_key_table(rows: list[list[str]], columns: int | None) -> str:
    """:func:`fitted_table` keyed by the first two columns (CPU and disk capacity): they
    are joined into one, which every stacked block repeats."""
    joined = [[f"{row[0]}  {row[1].rjust(max(len(r[1]) for r in rows))}", *row[2:]] for row in rows]
    return fitted_table(joined, columns)


def infinite_tier_hit_rate(requests: Sequence[Request], metric: str = "block") -> float:
    """The prefix hit rate of a tier that holds everything, stored at once: what the
    table's rates would reach with unlimited capacity, in the table's ``metric``."""
    if metric not in ("block", "token"):
        raise ValueError(f"metric must be 'block' or 'token', got {metric!r}")
    seen: set[OffloadKey] = set()
    hit = total = 0
    for req in requests:
        hits = 0
        for key in req.keys:
            if key not in seen:
                break
            hits += 1
        if metric == "block":
            hit += hits
            total += len(req.keys)
        else:
            hit += sum(req.block_tokens()[:hits])
            total += req.input_tokens
        seen.update(req.keys)
    return hit / total if total else 0.0


def figure(results: Sequence[ReplayResult], title: str = "", metric: str = "block") -> Figure:
    """A figure of two panels against capacity, one line per policy (matplotlib): the
    prefix hit rate (``metric``: ``"block"`` or ``"token"``) and the blocks written to
    the tier. The legend sits below the panels, where it covers no point."""
    if metric not in ("block", "token"):
        raise ValueError(f"metric must be 'block' or 'token', got {metric!r}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("plotting needs matplotlib: pip install 'asyncoffload[replay]'") from exc
    fig, (hits, written) = plt.subplots(1, 2, figsize=(11, 4.8), dpi=120)
    policies: list[str] = []
    for r in results:
        if r.label not in policies:
            policies.append(r.label)
    markers = "os^vDP*Xh<>"
    shares = sorted({r.capacity_share for r in results})
    for i, p in enumerate(policies):
        mine = sorted((r for r in results if r.label == p), key=lambda r: r.capacity_share)
        xs = [r.capacity_share * 100 for r in mine]
        rates = [r.block_hit_rate if metric == "block" else r.token_hit_rate for r in mine]
        style = "k--" if p == BELADY else "-"
        marker = "o" if p == BELADY else markers[i % len(markers)]
        hits.plot(xs, rates, style, marker=marker, label=p)
        written.plot(xs, [r.stored for r in mine], style, marker=marker, label=p)
    for ax in (hits, written):
        ax.set_xscale("log")
        ax.set_xticks([x * 100 for x in shares], [_share_label(x) for x in shares])
        ax.minorticks_off()
        ax.set_xlabel("capacity (share of the workload's unique blocks)")
        ax.grid(True, which="both", alpha=0.3)
    hits.set_ylabel(f"prefix hit rate ({metric}s)")
    written.set_ylabel("blocks written to the tier")
    if title:
        fig.suptitle(title)
    handles, labels = hits.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), frameon=False)
    rows = -(-len(labels) // 6)
    fig.tight_layout(rect=(0, 0.06 * rows + 0.02, 1, 1))
    return fig


def plot(
    results: Sequence[ReplayResult], path: str, title: str = "", metric: str = "block"
) -> None:
    """Write :func:`figure` to ``path`` (any format matplotlib saves: .png, .svg, .pdf)."""
    import matplotlib.pyplot as plt

    fig = figure(results, title, metric)
    try:
        fig.savefig(path)
    finally:
        plt.close(fig)


# --- the lines around the table, and JSON ------------------------------------------------


def _width(columns: int | None) -> int:
    """Room for a line that must not wrap: shorter than ``columns`` (default: the
    terminal's width)."""
    return (terminal_columns() if columns is None else columns) - 1


def format_headline(
    trace: str, requests: Sequence[Request], metric: str = "block", columns: int | None = None
) -> str:
    """The line above the table: the workload's size and what an infinite tier would
    hit, wrapped to fit ``columns`` (default: the terminal's width)."""
    summary = summarize(requests)
    text = (
        f"asyncoffload replay: {trace}: {summary.requests:,} requests, "
        f"{summary.total_blocks:,} blocks, {summary.unique_blocks:,} unique "
        f"(an infinite tier would hit {infinite_tier_hit_rate(requests, metric):.3f} "
        f"of the {metric}s)"
    )
    return textwrap.fill(text, _width(columns), subsequent_indent="  ")


def format_caption(
    metric: str = "block",
    *,
    disk_policy: str | None = None,
    disk_admission: str | None = None,
    bound: bool = True,
    columns: int | None = None,
) -> str:
    """What the cells of :func:`format_table` hold. ``disk_policy`` and
    ``disk_admission`` are the disk tier's (``disk_policy`` ``None``: no disk tier
    modelled), ``bound`` whether the offline bound is among the results."""
    if disk_policy is None:
        return f"prefix hit rate ({metric}s) / blocks written, by tier capacity:"
    text = (
        f"prefix hit rate ({metric}s) served from the CPU tier / disk / both, and "
        f"GB written to disk (10^9 bytes, at {LLAMA3_8B_BYTES_PER_TOKEN:,} bytes a "
        f"token), by CPU x disk capacity (disk: {disk_policy}, admission "
        f"{disk_admission or 'none: every block'}; disk none: no disk tier"
        f"{'; belady: the bound of the CPU tier alone' if bound else ''}):"
    )
    return textwrap.fill(text, _width(columns))


def format_costs(results: Sequence[ReplayResult], engine: bool = False) -> str | None:
    """Each online spec's mean time per block over the capacities (the CPU tier alone),
    against lru's; ``None`` without lru among them. ``engine``: the times are the
    engine's (copies awaited), not the manager's."""
    costs: dict[str, list[float]] = {}
    for r in results:
        if r.policy != BELADY and not r.has_disk:
            costs.setdefault(r.label, []).append(r.us_per_block)
    if "lru" not in costs:
        return None
    base = sum(costs["lru"]) / len(costs["lru"])
    what = "engine time per block, copies awaited" if engine else "manager time per block"
    lines = [f"{what} (mean over capacities), against lru:"]
    for label, values in costs.items():
        mean = sum(values) / len(values)
        lines.append(f"  {label:<14} {mean:6.2f} us  x{mean / base:.2f}")
    return "\n".join(lines)


def engine_mismatches(results: Sequence[ReplayResult]) -> int:
    """Loaded blocks with wrong bytes over the engine replays among ``results``."""
    return sum(int(r.extra.get("mismatches", 0)) for r in results)


def format_engine_check(results: Sequence[ReplayResult], columns: int | None = None) -> str:
    """What the engine replays checked: loaded blocks, those with wrong bytes, and the
    stores too large for the tier (counted as refused)."""
    loaded = sum(r.loaded for r in results if r.policy != BELADY)
    lines = [
        f"through the engine: {loaded:,} loaded blocks checked, "
        f"{engine_mismatches(results)} with wrong bytes"
    ]
    too_large = sum(int(r.extra.get("too_large", 0)) for r in results)
    if too_large:
        text = (
            f"{too_large:,} stores had more new blocks than the CPU tier holds: not "
            "stored, counted as refused (as without --engine)"
        )
        lines.append(textwrap.fill(text, _width(columns)))
    return "\n".join(lines)


#: What :func:`json_row` writes of a result with a disk tier, besides its fields.
_TIER_RATES = (
    "cpu_hit_blocks",
    "cpu_hit_tokens",
    "cpu_block_hit_rate",
    "cpu_token_hit_rate",
    "disk_block_hit_rate",
    "disk_token_hit_rate",
)


def json_row(result: ReplayResult, disk: bool) -> dict[str, Any]:
    """A result for JSON: its fields and rates; the disk tier's only with ``disk``."""
    row = {
        **result.__dict__,
        "label": result.label,
        "block_hit_rate": result.block_hit_rate,
        "token_hit_rate": result.token_hit_rate,
    }
    defaults = {f.name for f in dataclasses.fields(result) if f.name.startswith("disk_")}
    defaults.add("promoted")
    if not disk:
        for name in defaults:
            del row[name]
    else:
        row.update({name: getattr(result, name) for name in _TIER_RATES})
    return row


def format_json(trace: str, results: Sequence[ReplayResult], disk: bool = False) -> str:
    """Every result as JSON, under the trace's name (:func:`json_row`)."""
    rows = [json_row(r, disk) for r in results]
    return json.dumps({"trace": trace, "results": rows}, indent=1)
