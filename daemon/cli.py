"""Daemon subcommands of ``vkpool``: serve, status, load, unload, budget, stop; and the helpers
behind ``vkpool run --remote`` / ``vkpool plan --remote``."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from vkpool.units import format_size


#: how long `vkpool stop` waits for the daemon to exit, unless told
STOP_TIMEOUT_S = 60.0


def add_parsers(subparsers: Any) -> None:
    from vkpool.cli import positive_float, positive_int

    def endpoint(p: argparse.ArgumentParser) -> None:
        p.add_argument("--endpoint", default=argparse.SUPPRESS,
                       help="daemon endpoint (default: $VKPOOL_ENDPOINT, else the ipc socket in the "
                            "runtime directory)")

    p = subparsers.add_parser("serve", help="run the daemon (in the foreground, or detached)",
                              description="Own the device pool and serve inference jobs to client processes "
                                          "over ZeroMQ until SIGTERM/SIGINT or `vkpool stop`.")
    p.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help="config file")
    endpoint(p)
    p.add_argument("--detach", action="store_true",
                   help="run in the background (a new session, output to the log file); returns once it listens")
    p.add_argument("--pid-file", type=Path, metavar="FILE",
                   help="write the daemon's pid here while it runs; a start is refused while it names a live "
                        "daemon (default: daemon.pid_file; with --detach, daemon.pid in the runtime directory)")
    p.add_argument("--log-file", type=Path, metavar="FILE",
                   help="log here too (default: daemon.log_file; with --detach, "
                        "$XDG_STATE_HOME/vkpool/daemon.log)")
    p.add_argument("--cluster", metavar="ADDRESS",
                   help="serve the pool of the Ray cluster at ADDRESS (its vkpool nodes) instead of this "
                        "machine's devices (docs/cluster.md)")
    p.set_defaults(func=cmd_serve, refuse=[
        ("--detach", "detach", lambda a: a.cluster, "a cluster's daemon runs in the foreground (or under "
         "a service manager)")])

    p = subparsers.add_parser("service", help="install the daemon as a systemd user service",
                              description="Write the shipped systemd user unit, its ExecStart naming this "
                                          "vkpool, to $XDG_CONFIG_HOME/systemd/user/vkpool.service (else "
                                          "~/.config/systemd/user/). systemctl is left to you.")
    actions = p.add_subparsers(title="actions", metavar="ACTION", required=True)
    a = actions.add_parser("install", help="write the unit file")
    a.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                   help="config file the service starts with (made absolute)")
    a.add_argument("--print", dest="dry_run", action="store_true", help="print the unit and its path; write nothing")
    a.add_argument("--dry-run", dest="dry_run", action="store_true", help="same as --print")
    a.add_argument("--force", action="store_true", help="replace a unit file that differs")
    a.set_defaults(func=cmd_service_install)
    a = actions.add_parser("uninstall", help="remove the unit file (stop and disable the service first)")
    a.set_defaults(func=cmd_service_uninstall)

    p = subparsers.add_parser("status", help="the daemon's members, models, queues and latency")
    endpoint(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = subparsers.add_parser("load", help="load a model into the daemon (kept for its keep-alive)")
    p.add_argument("model", help="ONNX model file")
    p.add_argument("--keep-alive", metavar="DURATION", help="how long it stays once unused "
                   "(30s, 5m, 1h; -1 = forever; default from the config)")
    p.add_argument("--batch", type=positive_int, metavar="N",
                   help="value of the inputs' symbolic first dims (default 1; refused for a model "
                        "without one)")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE",
                   help="value of a named symbolic dim; repeatable")
    p.add_argument("--max-batch", type=positive_int, metavar="N",
                   help="batch the requests of every client along the model's symbolic first dim, up to N rows "
                        "per run (default: the config's daemon.batching rules, else no batching)")
    p.add_argument("--max-delay", metavar="DURATION",
                   help="how long the first request of a batch may wait for company (200us, 2ms; "
                        "default 0: only what is queued already), at most: it stops waiting once the "
                        "clients of the batch answered last are all back; needs --max-batch")
    p.add_argument("--objective", choices=["latency", "throughput"],
                   help="what the plan is made for: latency (default: one request soonest, the model whole on "
                        "one member when one holds it) or throughput (most requests per second: a copy on every "
                        "member that holds one, or pipeline stages)")
    endpoint(p)
    p.set_defaults(func=cmd_load, refuse=[
        ("--max-delay", "max_delay", lambda a: a.max_batch is None, "--max-delay needs --max-batch")])

    p = subparsers.add_parser("unload", help="free a model now (when no client uses it)")
    p.add_argument("model", help="model id (or a unique prefix) or name, as `vkpool status` shows them")
    endpoint(p)
    p.set_defaults(func=cmd_unload)

    p = subparsers.add_parser("budget", help="change a member's budget in the running daemon")
    p.add_argument("member", metavar="ID", help="pool member (vk0, vk0.1, cpu)")
    p.add_argument("size", metavar="SIZE", help="new budget (512MiB, 2GiB, bytes)")
    endpoint(p)
    p.set_defaults(func=cmd_budget)

    p = subparsers.add_parser("stop", help="stop the daemon (in-flight jobs are drained)",
                              description="Ask the daemon to stop (new work is refused, in-flight jobs drained) "
                                          "and wait until it has exited. A daemon that does not answer is sent "
                                          "SIGTERM when its pid file names it.")
    endpoint(p)
    p.add_argument("--pid-file", type=Path, metavar="FILE",
                   help="the daemon's pid file (default: daemon.pid_file, else daemon.pid in the runtime directory)")
    p.add_argument("--no-wait", action="store_true", help="return once the daemon has been asked to stop")
    p.add_argument("--timeout", type=positive_float, metavar="SECONDS",
                   help=f"how long to wait for it to exit (default {STOP_TIMEOUT_S:g})")
    p.set_defaults(func=cmd_stop, refuse=[
        ("--timeout", "timeout", lambda a: a.no_wait, "--no-wait returns without waiting for the exit")])


def endpoint_of(args: argparse.Namespace) -> str | None:
    """The daemon's endpoint for every command, serve included: ``--endpoint``, else
    ``$VKPOOL_ENDPOINT``, else the config's ``daemon.endpoint`` (``--config`` or ``$VKPOOL_CONFIG``),
    else None: the default socket."""
    explicit = getattr(args, "endpoint", None) or os.environ.get("VKPOOL_ENDPOINT")
    if explicit or not os.environ.get("VKPOOL_CONFIG"):
        return explicit or None
    from vkpool.config.loader import load_config

    return load_config().daemon.get("endpoint") or None


def _client(args: argparse.Namespace) -> Any:
    from vkpool.daemon.client import Client

    return Client(endpoint_of(args))


def cmd_serve(args: argparse.Namespace) -> int:
    from vkpool.daemon.main import detach, serve

    config, endpoint = getattr(args, "config", None), endpoint_of(args)
    if args.detach:
        return detach(config, endpoint, args.pid_file, args.log_file)
    runtime = None
    if args.cluster:
        from vkpool.cluster import connect
        from vkpool.cluster.runtime import ClusterRuntime

        runtime = ClusterRuntime(connect(args.cluster))
    return serve(config, endpoint, runtime, pid_file=args.pid_file, log_file=args.log_file)


def cmd_service_install(args: argparse.Namespace) -> int:
    from vkpool.daemon import systemd

    config = getattr(args, "config", None)
    if args.dry_run:
        print(f"# {systemd.unit_dir() / systemd.UNIT_NAME}")
        sys.stdout.write(systemd.render_unit(config))
        return 0
    path = systemd.install(config, force=args.force)
    print(f"wrote {path}\nstart it now and at each login with:\n"
          "  systemctl --user daemon-reload && systemctl --user enable --now vkpool\n"
          "logs: journalctl --user -u vkpool")
    return 0


def cmd_service_uninstall(args: argparse.Namespace) -> int:
    from vkpool.daemon import systemd

    path = systemd.uninstall()
    if path is None:
        print(f"no unit file at {systemd.unit_dir() / systemd.UNIT_NAME}")
        return 1
    print(f"removed {path} (run `systemctl --user daemon-reload`)")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        status = client.status()
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(render_status(status))
    return 0


def render_status(status: dict[str, Any]) -> str:
    c = status["counters"]
    lat = status["latency_ms"]
    lines = [f"vkpool daemon up {status['uptime_s']:.0f} s{' (draining)' if status['draining'] else ''}: "
             f"{c['connections']} connection(s), {c.get('lanes', 0)} local lane(s), {status['jobs_per_s']:.1f} jobs/s, "
             f"latency p50 {lat['p50']:.2f} ms "
             f"p90 {lat['p90']:.2f} ms p99 {lat['p99']:.2f} ms",
             f"requests: {c['accepted']} accepted = {c['ok']} ok + {c['error']} error + {c['client_gone']} "
             f"client gone + {c['in_flight']} in flight; {c['busy']} busy, {c['dropped']} dropped", "",
             "members:"]
    for p in status.get("processes", []):
        lines.insert(len(lines) - 2, f"  serving process for {p['member']}: pid {p['pid'] or '-'}, {p['state']}, "
                     f"{p['clients']} client(s), {p['restarts']} restart(s), {p['endpoint']}")
    if status.get("processes"):
        lines.insert(len(lines) - 2 - len(status["processes"]), "a serving process per device "
                     "(daemon.process_per_device); latencies: all of theirs together")
    for m in status["members"]:
        lines.append(f"  {m['id']:<8} {m['kind']:<7} {format_size(m['used_bytes']):>10} used of "
                     f"{format_size(m['budget_bytes'])}  {m.get('name', '')}")
    lines += ["", "models:" if status["models"] else "models: none"]
    for m in status["models"]:
        memory = ", ".join(f"{k} {format_size(v)}" for k, v in m["memory_by_member"].items())
        lines.append(f"  {m['id'][:12]} {m['name']:<20} refs {m['refs']:<3} queued {m['queued']:<4} "
                     f"running {m['running']:<2} done {m['done']:<7} on {memory}"
                     + (f" (for {m['objective']})" if m.get("objective", "latency") != "latency" else ""))
        b = m.get("batching")
        if b:
            lines.append(f"  {'':12} batching: max {b['max_batch']}, delay {b['max_queue_delay'] * 1e6:g} us; "
                         f"{b['batches']} batches ({b.get('where_read', 0)} where read), mean "
                         f"{b['mean_batch_size']:.2f} requests, queue delay "
                         f"p50 {b['queue_delay_p50_us']:.0f} us p99 {b['queue_delay_p99_us']:.0f} us")
    for loading in status.get("loading", []):
        lines.append(f"  {'loading':<12} {loading['name']:<20} {describe_loading(loading)}")
    return "\n".join(lines)


def loading_update(loading: dict[str, Any]) -> Any:
    """A ``status`` reply's entry of a model being loaded, as a :class:`vkpool.progress.Update`
    (None before its first stage)."""
    from vkpool.progress import Update

    if loading["stage"] is None:
        return None
    return Update(loading["stage"], loading["what"], loading["done"], loading["total"], loading["unit"],
                  loading["elapsed_s"])


def describe_loading(loading: dict[str, Any]) -> str:
    update = loading_update(loading)
    stage = "starting" if update is None else update.describe()
    return f"{stage} ({loading['elapsed_s']:.0f} s so far)"


def cmd_load(args: argparse.Namespace) -> int:
    from vkpool.daemon.settings import parse_duration

    keep_alive = None if args.keep_alive is None else parse_duration(args.keep_alive)
    dims = parse_dims(args.dim)
    delay = None if args.max_delay is None else parse_duration(args.max_delay)
    options = dict(keep_alive=keep_alive, batch=args.batch, dims=dims, max_batch=args.max_batch,
                   max_queue_delay=delay, objective=args.objective)
    with _client(args) as client, _watch_load(client, args.model):
        model = client.load_model(args.model, **options)
        for other in _other_serving(client):  # process_per_device: loaded in every serving process
            with other:
                theirs = other.load_model(args.model, **options)
            model["memory_by_member"].update(theirs["memory_by_member"])
    memory = ", ".join(f"{k} {format_size(v)}" for k, v in model["memory_by_member"].items())
    kept = "forever" if model["keep_alive"] < 0 else f"{model['keep_alive']:g} s once unused"
    inputs = ", ".join(f"{i['name']}{i['shape']}" for i in model["inputs"])
    batching = model.get("batching")
    batched = (f"; batching up to {batching['max_batch']} rows, delay {batching['max_queue_delay'] * 1e6:g} us"
               if batching else "")
    print(f"{model['id']} {model['name']} ({inputs}) on {memory}; for {model['objective']}; kept {kept}{batched}")
    return 0


@contextmanager
def _watch_load(client: Any, model: str, every_s: float = 0.25) -> Iterator[None]:
    """While the block loads ``model`` (a path) through ``client``, show the daemon's progress of
    that load on stderr, polling ``status`` from a thread of its own."""
    from vkpool import progress

    path = str(Path(model).expanduser().resolve())
    console = progress.Console()
    done = threading.Event()

    def watch() -> None:
        shown = None  # the last update drawn
        while not done.wait(every_s):
            try:
                loading = [entry for entry in client.status().get("loading", []) if entry["path"] == path]
            except Exception:  # the load's own reply says what went wrong
                return
            update = loading_update(loading[0]) if loading else None
            if update is None or done.is_set():
                continue
            if shown is not None and (shown.stage, shown.what) != (update.stage, update.what):
                console.end(shown.stage, shown.what)  # its end fell between two samples
            console(update)
            shown = update

    thread = threading.Thread(target=watch, name="vkpool-load-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        console.close()


def parse_dims(items: list[str]) -> dict[str, int]:
    """``["seq=128", "n=4"]`` -> ``{"seq": 128, "n": 4}``; a malformed item is a ValueError."""
    dims: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"--dim {item!r}: expected NAME=VALUE with a positive integer VALUE")
        dims[name] = int(value)
    return dims


def _resolve_model(client: Any, key: str) -> str:
    """The id of the one loaded model whose id starts with ``key`` or whose name is ``key``."""
    models = client.list_models()
    matches = [m["id"] for m in models if m["id"].startswith(key) or m["name"] == key]
    if len(matches) != 1:
        loaded = ", ".join(f"{m['id'][:12]} {m['name']}" for m in models) or "none"
        raise ValueError(f"{len(matches)} loaded models match {key!r} by id or name (loaded: {loaded})")
    return matches[0]


def _other_serving(client: Any) -> list[Any]:
    """Clients of the serving processes other than ``client``'s, on a daemon with
    ``process_per_device`` (none on any other daemon)."""
    from vkpool.daemon.client import Client

    serving = (client.front or {}).get("serving") or []
    return [Client(p["endpoint"], follow=False) for p in serving
            if p["endpoint"] != client.serving_endpoint and p["state"] == "serving"]


def cmd_unload(args: argparse.Namespace) -> int:
    with _client(args) as client:
        model = _resolve_model(client, args.model)
        from vkpool.daemon.errors import UnknownModel

        replies = []
        for one in [client, *_other_serving(client)]:  # process_per_device: in every serving process
            try:
                replies.append(one.request("unload_model", {"model": model, "now": True})[0])
            except UnknownModel:
                pass  # not loaded in that process
            finally:
                if one is not client:
                    one.close()
    refs = sum(r["refs"] for r in replies if not r["unloaded"])
    if not refs:
        print(f"{model[:12]} unloaded")
        return 0
    print(f"{model[:12]} is still used by {refs} reference(s); it is freed once they are dropped")
    return 1


def cmd_budget(args: argparse.Namespace) -> int:
    with _client(args) as client:
        reply = client.set_budget(args.member, int(args.size) if args.size.isdigit() else args.size)
    moved = f"; re-planned {', '.join(m[:12] for m in reply['replanned'])}" if reply["replanned"] else ""
    print(f"{reply['member']}: budget {format_size(reply['budget_bytes'])}{moved}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from vkpool.daemon.client import DaemonUnavailable
    from vkpool.daemon.main import default_pid_file, live_daemon, load_settings, process_running

    timeout = STOP_TIMEOUT_S if args.timeout is None else args.timeout
    try:
        with _client(args) as client:
            reply = client.shutdown()
            pid = (client.front or client.info).get("pid") if client.endpoint.startswith("ipc://") else None
        print(f"daemon stopping; draining {reply['in_flight']} job(s)")
    except DaemonUnavailable:
        pid_file = args.pid_file or load_settings(None)[1].pid_file or default_pid_file()
        pid = live_daemon(pid_file)
        if pid is None:
            raise
        os.kill(pid, signal.SIGTERM)
        print(f"the daemon does not answer; sent SIGTERM to pid {pid} (from {pid_file})")
    if pid is None or args.no_wait:
        return 0
    deadline = time.monotonic() + timeout
    while process_running(pid):
        if time.monotonic() > deadline:
            print(f"vkpool: error: the daemon (pid {pid}) is still running after {timeout:g} s",
                  file=sys.stderr)
            return 1
        time.sleep(0.05)
    print(f"daemon (pid {pid}) stopped")
    return 0


def remote_run(args: argparse.Namespace) -> int:
    """``vkpool run MODEL --remote``: the same output as the in-process run, through the daemon."""
    from vkpool.cli import _load_feeds, check_against_onnxruntime, print_latency, print_outputs

    with _client(args) as client:
        t0 = time.perf_counter()
        with _watch_load(client, args.model):
            session = client.session(args.model, keep_alive=getattr(args, "keep_alive", None))
        t_load = time.perf_counter() - t0
        feeds = _load_feeds(args.input, session.get_inputs(), args.seed)
        t1 = time.perf_counter()
        outputs = session.run(None, feeds)
        t_first = time.perf_counter() - t1
        where = ", ".join(session.info["members"])
        print(f"model {args.model} on {where} (daemon {client.endpoint}): loaded in {t_load * 1e3:.1f} ms, "
              f"first run {t_first * 1e3:.2f} ms")
        print_outputs(session, outputs)
        print_latency(session, feeds, getattr(args, "repeat", 0))
        code = 0
        if args.check:
            code = check_against_onnxruntime(args.model, feeds, session, outputs, args.tolerance)
        session.close()
    return code


def remote_plan(args: argparse.Namespace) -> int:
    """``vkpool plan MODEL --remote``: the daemon's plan for MODEL, or what-if with ``--budget``."""
    budgets = {}
    for item in getattr(args, "budget", []) or []:
        member, sep, size = item.partition("=")
        if not sep:
            raise ValueError(f"--budget {item!r}: expected ID=SIZE")
        budgets[member] = int(size) if size.isdigit() else size
    with _client(args) as client:
        session = client.session(args.model, batch=getattr(args, "batch", None),
                                 dims=parse_dims(getattr(args, "dim", None) or []))
        reply = client.plan(session.model_id, budgets or None)
        session.close()
    fmt = getattr(args, "format", "text")
    text = json.dumps(reply["plan"], indent=2) + "\n" if fmt == "json" else reply["text"].rstrip("\n") + "\n"
    from vkpool.partition.cli import write_plan

    write_plan(text, getattr(args, "output", None))
    return 0
