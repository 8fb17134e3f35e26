"""Plan renderers: text (like VKML's Listing 2, plus memory and transfers per member), JSON
(schema ``vkpool.plan`` version 1, documented in docs/partitioning.md), DOT and SVG.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from html import escape
from typing import Any

import networkx as nx

from vkpool.partition.plan import Plan

JSON_SCHEMA = "vkpool.plan"
JSON_VERSION = 1
_PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"]


def _size(n: int) -> str:
    from vkpool.units import format_size

    return format_size(n)


def _ms(ps: int) -> str:
    return f"{ps / 1e9:.3f} ms"


def to_text(plan: Plan) -> str:
    lines = [
        f"Plan: algorithm={plan.algorithm} objective={plan.objective} chunks={len(plan.chunks)} "
        f"transfers={len(plan.transfers)} ({_size(plan.transfer_bytes)})",
        f"  predicted latency {plan.latency_s * 1e3:.3f} ms, throughput {plan.throughput_per_s:.1f}/s, "
        f"solved in {plan.solve_time_s * 1e3:.1f} ms",
    ]
    if plan.replicas:
        lines.append(f"  replicas: the whole model also runs on {', '.join(plan.replicas)}")
    by_src: dict[int, list] = {}
    for t in plan.transfers:
        by_src.setdefault(t.src_chunk, []).append(t)
    for c in plan.chunks:
        lines.append("")
        lines.append(f"Chunk {c.index}: device={c.member} ops={len(c.ops)} preds={c.preds} deps={c.succs}")
        lines.append(f"  ops: {_op_range(c.ops)}")
        lines.append(f"  time {_ms(c.time_ps)} (upload {_ms(c.upload_ps)} of {_size(c.upload_bytes)}, "
                     f"compute {_ms(c.compute_ps)}, download {_ms(c.download_ps)} of {_size(c.download_bytes)}); "
                     f"peak memory {_size(c.peak_bytes)}")
        for t in by_src.get(c.index, []):
            lines.append(f"  Instruction: TransferToDevice(tensor={t.tensor}, bytes={_size(t.nbytes)}, "
                         f"from={t.src}, to={t.dst}, to_chunk={t.dst_chunk})")
    lines.append("")
    lines.append("Members:")
    for member, budget in plan.budget_bytes.items():
        used = plan.memory_bytes.get(member, 0)
        sent = sum(t.nbytes for t in plan.transfers if t.src == member)
        got = sum(t.nbytes for t in plan.transfers if t.dst == member)
        share = f"{100 * used / budget:.0f}%" if budget else "-"
        lines.append(f"  {member:<12} memory {_size(used):>10} of {_size(budget):>10} ({share:>4})   "
                     f"sends {_size(sent):>10}   receives {_size(got):>10}")
    return "\n".join(lines) + "\n"


def _op_range(ops: list[str]) -> str:
    return ", ".join(ops) if len(ops) <= 6 else f"{', '.join(ops[:3])}, ..., {', '.join(ops[-2:])}"


def to_json_dict(plan: Plan) -> dict[str, Any]:
    chunk_of = {op: c.index for c in plan.chunks for op in c.ops}
    return {
        "schema": JSON_SCHEMA,
        "version": JSON_VERSION,
        "algorithm": plan.algorithm,
        "objective": plan.objective,
        "solve_time_s": plan.solve_time_s,
        "latency_s": plan.latency_s,
        "throughput_per_s": plan.throughput_per_s,
        "transfer_bytes": plan.transfer_bytes,
        "replicas": list(plan.replicas),
        "members": [{"id": m, "budget_bytes": b, "memory_bytes": plan.memory_bytes.get(m, 0)}
                    for m, b in plan.budget_bytes.items()],
        "ops": [{"name": op, "member": member, "chunk": chunk_of[op]} for op, member in plan.member_of.items()],
        "chunks": [{"index": c.index, "member": c.member, "ops": list(c.ops), "preds": c.preds, "succs": c.succs,
                    "compute_s": c.compute_ps / 1e12, "upload_s": c.upload_ps / 1e12,
                    "download_s": c.download_ps / 1e12, "upload_bytes": c.upload_bytes,
                    "download_bytes": c.download_bytes, "peak_bytes": c.peak_bytes} for c in plan.chunks],
        "transfers": [{"tensor": t.tensor, "bytes": t.nbytes, "src": t.src, "dst": t.dst,
                       "src_chunk": t.src_chunk, "dst_chunk": t.dst_chunk} for t in plan.transfers],
    }


def to_json(plan: Plan) -> str:
    return json.dumps(to_json_dict(plan), indent=2) + "\n"


def _colours(plan: Plan) -> dict[str, str]:
    return {m: _PALETTE[i % len(_PALETTE)] for i, m in enumerate(plan.budget_bytes)}


def to_dot(G: nx.DiGraph, plan: Plan) -> str:
    colour = _colours(plan)
    out = ["digraph plan {", "  rankdir=TB; node [shape=box, style=filled, fontname=Helvetica];"]
    for c in plan.chunks:
        out.append(f'  subgraph cluster_{c.index} {{ label="chunk {c.index} on {c.member}"; color="{colour[c.member]}";')
        for op in c.ops:
            out.append(f'    "{op}" [label="{op}\\n{G.nodes[op]["op_type"]}", fillcolor="{colour[c.member]}"];')
        out.append("  }")
    for u, v, data in G.edges(data=True):
        if plan.member_of[u] != plan.member_of[v]:
            out.append(f'  "{u}" -> "{v}" [color=red, style=dashed, label="{_size(data["bytes"])}"];')
        else:
            out.append(f'  "{u}" -> "{v}";')
    out.append("}")
    return "\n".join(out) + "\n"


def to_svg(G: nx.DiGraph, plan: Plan, *, use_graphviz: bool = True) -> str:
    """SVG of the plan: graphviz ``dot`` when installed, else :func:`layered_svg`."""
    dot = shutil.which("dot") if use_graphviz else None
    if dot:
        done = subprocess.run([dot, "-Tsvg"], input=to_dot(G, plan), capture_output=True, text=True, timeout=60)
        if done.returncode == 0:
            return done.stdout
    return layered_svg(G, plan)


def layered_svg(G: nx.DiGraph, plan: Plan) -> str:
    """A layered drawing (Sugiyama-style layers by longest path from the sources, ops in a layer
    kept in topological order; no crossing minimisation): O(ops + edges)."""
    colour = _colours(plan)
    layer: dict[str, int] = {}
    for op in G.graph["order"]:
        layer[op] = max((layer[p] + 1 for p in G.predecessors(op)), default=0)
    rows: dict[int, list[str]] = {}
    for op in G.graph["order"]:
        rows.setdefault(layer[op], []).append(op)
    box_w, box_h, gap_x, gap_y, margin = 150, 34, 30, 46, 20
    width = max(len(r) for r in rows.values()) * (box_w + gap_x) + 2 * margin + 170
    height = len(rows) * (box_h + gap_y) + 2 * margin + 40
    xy: dict[str, tuple[float, float]] = {}
    for depth, ops in rows.items():
        for k, op in enumerate(ops):
            xy[op] = (margin + k * (box_w + gap_x), margin + 40 + depth * (box_h + gap_y))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="Helvetica, Arial, sans-serif" font-size="11">',
             '<rect width="100%" height="100%" fill="white"/>',
             f'<text x="{margin}" y="{margin + 10}" font-size="13">{escape(plan.algorithm)} plan, '
             f'{escape(plan.objective)}: {len(plan.chunks)} chunks, {_size(plan.transfer_bytes)} moved, '
             f'latency {plan.latency_s * 1e3:.3f} ms</text>']
    for u, v, data in G.edges(data=True):
        (x1, y1), (x2, y2) = xy[u], xy[v]
        a = (x1 + box_w / 2, y1 + box_h)
        b = (x2 + box_w / 2, y2)
        cross = plan.member_of[u] != plan.member_of[v]
        style = 'stroke="#d62728" stroke-dasharray="5,3" stroke-width="2"' if cross else 'stroke="#555"'
        parts.append(f'<line x1="{a[0]}" y1="{a[1]}" x2="{b[0]}" y2="{b[1]}" {style}/>')
        if cross:
            parts.append(f'<text x="{(a[0] + b[0]) / 2 + 4}" y="{(a[1] + b[1]) / 2}" fill="#d62728">'
                         f'{escape(_size(data["bytes"]))}</text>')
    for op, (x, y) in xy.items():
        fill = colour[plan.member_of[op]]
        parts.append(f'<rect x="{x}" y="{y}" width="{box_w}" height="{box_h}" rx="4" fill="{fill}" '
                     f'stroke="#222"><title>{escape(op)} on {escape(plan.member_of[op])}</title></rect>')
        parts.append(f'<text x="{x + 6}" y="{y + 14}" fill="white">{escape(op[:22])}</text>')
        parts.append(f'<text x="{x + 6}" y="{y + 27}" fill="white">{escape(G.nodes[op]["op_type"])}</text>')
    lx = width - 160
    for i, (member, fill) in enumerate(colour.items()):
        y = margin + 40 + i * 20
        parts.append(f'<rect x="{lx}" y="{y}" width="14" height="14" fill="{fill}"/>')
        parts.append(f'<text x="{lx + 20}" y="{y + 11}">{escape(member)} '
                     f'{escape(_size(plan.memory_bytes.get(member, 0)))}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def render(G: nx.DiGraph, plan: Plan, fmt: str) -> str:
    if fmt == "text":
        return to_text(plan)
    if fmt == "json":
        return to_json(plan)
    if fmt == "dot":
        return to_dot(G, plan)
    if fmt == "svg":
        return to_svg(G, plan)
    raise ValueError(f"unknown format {fmt!r}; use text, json, dot or svg")
