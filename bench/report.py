"""Turns the raw results into the add-chain fits, ratios, a markdown report and PNG plots."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.runners import RUNNERS
from bench.stats import DispatchFit, fit_dispatch
from bench.workloads import add_chain_n

#: A per-op slope under this means the chain was not executed op by op (fused or eliminated).
ELIMINATED_SLOPE_US = 0.01


def _runtime_order(results: list[dict[str, Any]]) -> list[str]:
    seen = {r["runtime"] for r in results}
    return [name for name in RUNNERS if name in seen] + sorted(seen - set(RUNNERS))


def _is_vkpool(runtime: str) -> bool:
    cls = RUNNERS.get(runtime)
    return bool(cls and cls.is_vkpool)


def index(results: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["workload"], r["runtime"]): r for r in results}


def median_ms(entry: dict[str, Any] | None) -> float | None:
    if entry and entry.get("status") == "ok" and "latency" in entry:
        return float(entry["latency"]["median_ms"])
    return None


def add_chain_fits(results: list[dict[str, Any]]) -> dict[str, DispatchFit]:
    """L = C + S*N per runtime, over the add-chain lengths that runtime passed."""
    points: dict[str, list[tuple[int, float]]] = {}
    for r in results:
        n = add_chain_n(r["workload"])
        med = median_ms(r)
        if n is not None and med is not None:
            points.setdefault(r["runtime"], []).append((n, med))
    fits = {}
    for runtime, pts in points.items():
        if len({n for n, _ in pts}) >= 2:
            ns, lat = zip(*sorted(pts))
            fits[runtime] = fit_dispatch(list(ns), list(lat))
    return fits


def best_peer(by_key: dict[tuple[str, str], dict[str, Any]], workload: str,
              runtimes: list[str]) -> tuple[str, float] | None:
    """The fastest runtime that is not vkpool, with its median, for ``workload``."""
    peers = [(median_ms(by_key.get((workload, rt))), rt) for rt in runtimes if not _is_vkpool(rt)]
    timed = [(m, rt) for m, rt in peers if m is not None]
    if not timed:
        return None
    m, rt = min(timed)
    return rt, m


def _cell(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return ""
    status = entry.get("status")
    if status == "ok":
        lat = entry["latency"]
        return f"{_ms(lat['median_ms'])} ({_ms(lat['p05_ms'], unit=False)}–{_ms(lat['p95_ms'], unit=False)})"
    if status == "wrong":
        gate = entry.get("gate", {})
        return f"**wrong** (max err {gate.get('max_abs_err', float('nan')):.2g})"
    if status == "unavailable":
        return "—"
    return "failed"


def _ms(value: float, unit: bool = True) -> str:
    text = f"{value:.3g}" if value < 100 else f"{value:.0f}"
    return f"{text} ms" if unit else text


def render_markdown(doc: dict[str, Any]) -> str:
    results = doc["results"]
    by_key = index(results)
    runtimes = _runtime_order(results)
    shown = [rt for rt in runtimes if rt not in doc.get("unavailable", {})]
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    cfg = doc.get("config", {})
    lines = [
        f"Runs: {cfg.get('runs')} timed after {cfg.get('warmup')} warm-up"
        f"{' (smoke)' if cfg.get('smoke') else ''}; machine: {doc.get('machine', {}).get('platform', '?')}, "
        f"{doc.get('machine', {}).get('cpus', '?')} CPUs; started {doc.get('started', '?')}, "
        f"took {doc.get('elapsed_s', 0):.0f} s; vkpool at {doc.get('machine', {}).get('commit') or '?'}.",
        "",
        "### Latency, median (p05–p95), ms",
        "",
    ]
    if doc.get("runtimes"):
        lines[-2:-2] = [f"- {rt}: {detail}" for rt, detail in doc["runtimes"].items()] + [""]
    header = ["workload", *shown, "vkpool / best peer"]
    if "vkpool" in shown and "vkpool_daemon" in shown:
        header.append("daemon overhead")
    lines += [_row(header), _row(["---"] * len(header))]
    for workload in workloads:
        row = [f"`{workload}`", *(_cell(by_key.get((workload, rt))) for rt in shown)]
        best = best_peer(by_key, workload, shown)
        vk = median_ms(by_key.get((workload, "vkpool")))
        row.append(f"{vk / best[1]:.2f}× ({best[0]})" if vk is not None and best else "n/a")
        if len(header) > len(row):
            daemon = median_ms(by_key.get((workload, "vkpool_daemon")))
            row.append(f"{daemon - vk:+.3g} ms" if daemon is not None and vk is not None else "n/a")
        lines.append(_row(row))
    lines += ["", "Ratio: vkpool's median over the fastest other runtime's (below 1 is faster).", ""]

    fits = add_chain_fits(results)
    if fits:
        lines += ["### Dispatch overhead: add chain, L = C + S·N (least squares)", "",
                  _row(["runtime", "C (µs)", "S (µs/op)", "R²", "chain lengths"]), _row(["---"] * 5)]
        for rt in runtimes:
            if rt in fits:
                f = fits[rt]
                note = " (chain not run op by op?)" if f.s_us_per_op < ELIMINATED_SLOPE_US else ""
                lines.append(_row([rt, f"{f.c_us:.1f}", f"{f.s_us_per_op:.3f}{note}", f"{f.r2:.4f}",
                                   str(f.points)]))
        lines.append("")

    lines += ["### Host memory and process time (load + 2 runs + exit, one process)", "",
              _row(["workload", *shown]), _row(["---"] * (len(shown) + 1))]
    for workload in workloads:
        cells = []
        for rt in shown:
            foot = by_key.get((workload, rt), {}).get("footprint")
            if foot and "peak_rss_mib" in foot:
                cells.append(f"{foot['peak_rss_mib']:.0f} MiB, {foot['wall_s']:.2f} s")
            else:
                cells.append("failed" if foot else "")
        lines.append(_row([f"`{workload}`", *cells]))
    lines.append("")

    problems = [r for r in results if r.get("status") in ("wrong", "failed")]
    if problems:
        lines += ["### Not timed", ""]
        lines += [f"- {r['runtime']} on `{r['workload']}`: {r['status']}: {r.get('reason', '')}" for r in problems]
        lines.append("")
    if doc.get("unavailable"):
        lines += ["### Unavailable here", ""]
        lines += [f"- {rt}: {reason}" for rt, reason in doc["unavailable"].items()]
        lines.append("")
    return "\n".join(lines)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def plot(doc: dict[str, Any], out_dir: Path, prefix: str = "bench-") -> list[Path]:
    """Latency per workload and runtime, and add-chain latency against N (log-log, as the paper's
    Figure 2). Returns the files written; none when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    results = doc["results"]
    by_key = index(results)
    runtimes = [rt for rt in _runtime_order(results) if rt not in doc.get("unavailable", {})]
    written: list[Path] = []

    workloads = [w for w in dict.fromkeys(r["workload"] for r in results) if add_chain_n(w) is None]
    if workloads and runtimes:
        fig, ax = plt.subplots(figsize=(9, 0.9 + 0.6 * len(workloads) * max(1, len(runtimes)) / 2.5))
        height = 0.8 / len(runtimes)
        marks: list[tuple[float, str]] = []
        for i, rt in enumerate(runtimes):
            ys, xs, lo, hi = [], [], [], []
            for j, w in enumerate(workloads):
                e = by_key.get((w, rt))
                if e is not None and e.get("status") in ("wrong", "failed"):
                    marks.append((j + i * height, f"{rt}: {e['status']}"))
                if median_ms(e) is not None:
                    lat = e["latency"]  # type: ignore[index]
                    ys.append(j + i * height)
                    xs.append(lat["median_ms"])
                    lo.append(lat["median_ms"] - lat["p05_ms"])
                    hi.append(lat["p95_ms"] - lat["median_ms"])
            ax.barh(ys, xs, height=height, xerr=[lo, hi], label=rt, capsize=2)
        ax.set_yticks([j + 0.4 - height / 2 for j in range(len(workloads))], workloads)
        ax.invert_yaxis()
        ax.set_xscale("log")
        for y, text in marks:  # a runtime that was not timed says why instead of leaving a gap
            ax.text(0.005, y, text, transform=ax.get_yaxis_transform(), va="center", fontsize="x-small",
                    color="0.35")
        ax.set_xlabel("latency, median with p05–p95 (ms, log)")
        ax.legend(fontsize="small")
        ax.grid(axis="x", which="both", alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{prefix}latency.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    fits = add_chain_fits(results)
    if fits:
        fig, ax = plt.subplots(figsize=(7, 5))
        for rt in runtimes:
            pts = sorted((add_chain_n(w), median_ms(e)) for (w, r), e in by_key.items()
                         if r == rt and add_chain_n(w) is not None and median_ms(e) is not None)
            if not pts:
                continue
            ns, lat = zip(*pts)
            (line,) = ax.plot(ns, lat, "o", label=rt)
            if rt in fits:
                f = fits[rt]
                dense = [10 ** (k / 20) for k in range(0, int(20 * math.log10(max(ns))) + 1)]
                ax.plot(dense, [(f.c_us + f.s_us_per_op * n) / 1e3 for n in dense], "-", color=line.get_color(),
                        alpha=0.6, label=f"  C={f.c_us:.1f} µs, S={f.s_us_per_op:.2f} µs/op")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("chain length N (dependent Add ops)")
        ax.set_ylabel("latency, median (ms)")
        ax.set_title("add chain: L = C + S·N")
        ax.grid(which="both", alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / f"{prefix}add-chain.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
