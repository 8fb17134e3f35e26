"""``vkpool plan``: partition a model and print the plan; with ``--devices`` no GPU is needed,
with ``--remote`` the running daemon plans against its own pool."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vkpool.partition.cost import Member

# the cost model is imported by the commands: `vkpool run` builds this parser too
FORMATS = ("text", "json", "dot", "svg")


def add_parser(subparsers: Any) -> None:
    from vkpool.cli import positive_int

    p = subparsers.add_parser(
        "plan", help="partition a model across members and show the plan",
        description="Print where MODEL runs on this machine's pool: the placement `vkpool run`, a "
                    "Session and the daemon use (the whole model on the first Vulkan member whose free "
                    "budget holds it, else a plan over the Vulkan members, else over every member), "
                    "under what each member's budget has free. With --devices, the planner's plan "
                    "over the members of a device spec file.",
        epilog="Examples:\n"
               "  vkpool plan model.onnx --devices partition/specs/2xh200.yaml --budget gpu0=512MiB\n"
               "  vkpool plan model.onnx --objective throughput --format svg -o plan.svg\n"
               "  vkpool plan model.onnx --remote --budget vk0=64MiB   what-if on the daemon's pool",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="ONNX model file")
    p.add_argument("--budget", action="append", default=[], metavar="ID=SIZE",
                   help="override a member's budget (e.g. gpu0=512MiB); repeatable")
    p.add_argument("--devices", metavar="SPEC.yaml",
                   help="plan over exactly the members described in this file instead of placing the "
                        "model on this machine's pool")
    p.add_argument("--objective", choices=("latency", "throughput"),
                   help="what the plan minimises: latency (default) or the pipelined period")
    p.add_argument("--algorithm", choices=("dp", "greedy"), help="dp (optimal, default) or greedy (VKML first-fit)")
    p.add_argument("--format", choices=FORMATS, default="text")
    p.add_argument("--batch", type=positive_int, help="value of the inputs' symbolic first dims (default 1; "
                   "refused for a model without one)")
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    p.add_argument("--remote", nargs="?", const="", metavar="ENDPOINT",
                   help="ask the running daemon to plan MODEL on its pool (at ENDPOINT, default: "
                        "$VKPOOL_ENDPOINT, else the ipc socket in the runtime directory); --budget "
                        "becomes a what-if; text or json only")
    p.add_argument("--cluster", metavar="ADDRESS|SPEC.yaml",
                   help="plan on the vkpool nodes of the Ray cluster at ADDRESS (--budget becomes a what-if), "
                        "or on a cluster spec file's members and links (docs/cluster.md)")
    p.set_defaults(func=run_plan, refuse=[
        ("--config", "config", lambda a: a.devices,
         "--devices describes the members and their budgets; the config's are not read")])


def run_plan(args: argparse.Namespace) -> int:
    """The plan ``vkpool run``, a Session and the daemon would run MODEL with on this machine
    (:func:`vkpool.partition.place_model` over the pool, each member's budget less what every
    vkpool process holds), or with ``--devices`` the planner's plan over that file's members."""
    from vkpool.config.loader import load_config, placement_policy
    from vkpool.partition.api import place_model
    from vkpool.partition.cost import load_device_spec
    from vkpool.partition.render import render

    if args.cluster:
        from vkpool.cluster.cli import run_cluster_plan

        return run_cluster_plan(args)
    if args.remote is not None:
        return run_remote_plan(args)
    members = apply_budgets(load_device_spec(args.devices), args.budget) if args.devices else pool_members(args.budget)
    model = _static_model(args.model, args.batch or 1)
    G, plan = place_model(model, members, objective=args.objective or "latency", algorithm=args.algorithm or "dp",
                          plan_over_all=bool(args.devices), policy=placement_policy(load_config(None)))
    write_plan(render(G, plan, args.format), args.output)
    return 0


def write_plan(text: str, output: str | None) -> None:
    """A rendered plan to the file ``output`` names, else to standard output."""
    if output:
        Path(output).write_text(text)
    else:
        sys.stdout.write(text)


def _static_model(path: str, batch: int) -> Any:
    """The model to plan; a model cut where run-time values fix shapes is refused with where."""
    from vkpool.cut import Graph, find_cut
    from vkpool.model import load_model

    loaded = load_model(path, batch=batch, partial=True)
    split = find_cut(Graph.of(loaded))
    if split is not None:
        points = "; ".join(dict.fromkeys(f"{p.describe()}" for p in split.points))
        raise ValueError(
            f"{path}: shapes depend on run-time values ({points}), so the part after them is "
            "compiled per value when the model runs and cannot be planned ahead. `vkpool run MODEL` "
            "runs it; `vkpool.Session(MODEL).plan` shows the plan of the part before the cut and of "
            "the last part compiled after it (docs/dynamic-shapes.md)")
    if loaded.unresolved:
        return load_model(path, batch=batch)  # the loader's own error names the tensor
    return loaded


def run_remote_plan(args: argparse.Namespace) -> int:
    """The daemon plans with its own objective and algorithm on its own members and budgets."""
    from vkpool.daemon.cli import remote_plan

    refused = [flag for flag, value in (("--devices", args.devices), ("--objective", args.objective),
                                        ("--algorithm", args.algorithm), ("--batch", args.batch)) if value]
    if refused:
        raise ValueError(f"--remote plans on the daemon's pool with its settings; drop {', '.join(refused)}")
    if args.format not in ("text", "json"):
        raise ValueError(f"--remote answers text or json, not {args.format}")
    if args.remote:
        args.endpoint = args.remote
    return int(remote_plan(args) or 0)


def apply_budgets(members: list[Member], overrides: list[str]) -> list[Member]:
    """Members with ``ID=SIZE`` budget overrides applied; unknown ids are an error."""
    from vkpool.units import parse_size

    by_id = {m.id: m for m in members}
    for member_id, size in parse_overrides(overrides, list(by_id)).items():
        by_id[member_id] = by_id[member_id].with_budget(parse_size(size))
    return [by_id[m.id] for m in members]


def parse_overrides(overrides: list[str], ids: list[str]) -> dict[str, str]:
    """``ID=SIZE`` items as member id → size text; an unknown id or a missing ``=`` is an error."""
    out: dict[str, str] = {}
    for item in overrides:
        member_id, sep, size = item.partition("=")
        if not sep or member_id not in ids:
            raise ValueError(f"--budget {item!r}: expected ID=SIZE with ID one of {', '.join(ids)}")
        out[member_id] = size
    return out


def pool_members(overrides: list[str] = []) -> list[Member]:
    """This machine's pool members as a session placing a model sees them: what each has free of
    its budget (every vkpool process counted) and its cached calibration (``vkpool calibrate``;
    else the kind's default). ``ID=SIZE`` overrides: that budget (a size, or a percentage of the
    heap) less what the processes hold, as ``Session(budgets=...)`` would leave free."""
    from vkpool.placement import planner_members
    from vkpool.pool import DevicePool, VulkanMember
    from vkpool.units import parse_size

    pool = DevicePool.from_config(None)
    try:
        free = {}
        for member_id, size in parse_overrides(overrides, [m.id for m in pool.members]).items():
            member = pool.member(member_id)
            heap = member.info.device_local_heap.size if isinstance(member, VulkanMember) else None
            free[member_id] = parse_size(size, of=heap) - member.used_bytes
        return planner_members(pool, budgets=free)
    finally:
        pool.close()
