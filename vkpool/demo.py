"""``make demo`` / ``python -m vkpool.demo``: the pool, then the daemon serving a real model to 3 processes.

1. Build the device pool from the default config; list its members and budgets; send an array
   through every member (upload, download, compare).
2. Start ``vkpool serve`` on a private ipc socket in a temporary folder (never a user's daemon).
3. Load the shipped digit classifier (``demo_data/digits.onnx``, trained by
   ``scripts/train_digits.py`` on scikit-learn's 8x8 digits) and print the daemon's plan.
4. Start 3 client processes at once; each classifies its share of the held-out test digits
   (``demo_data/digits_test.npz``), one job per digit.
5. Print per-client results, the accuracy, a check against a numpy evaluation of the same
   weights, and the daemon's counters; stop the daemon.

Exit status 0 on success. On any failure the daemon is stopped anyway, the reason (and the end of
the daemon's log) is printed, and the exit status is 1.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

DATA = Path(__file__).resolve().parent / "demo_data"
MODEL = DATA / "digits.onnx"
TEST_SET = DATA / "digits_test.npz"
N_CLIENTS = 3
READY_TIMEOUT_S = 60.0
CLIENT_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 30.0  # a daemon that stops answering fails the demo instead of hanging it


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and why."""


def say(text: str = "") -> None:
    """Print a line in one write: the client processes share this stdout, and ``print`` writes
    the line and its end apart when Python runs unbuffered (PYTHONUNBUFFERED, -u), so that
    another process's line could land between them."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def step(number: int, title: str) -> None:
    say()
    say(f"[{number}] {title}")


def fmt_bytes(n: int) -> str:
    from vkpool.units import format_size

    return format_size(int(n))


def config_name() -> str:
    path = os.environ.get("VKPOOL_CONFIG")
    return f"config {path} from $VKPOOL_CONFIG" if path else "default config"


# -- 1. the pool ------------------------------------------------------------------------------------
def show_pool() -> None:
    from vkpool.pool import DevicePool, VulkanMember

    step(1, f"The device pool ({config_name()}): members, budgets, and a round trip through each")
    pool = DevicePool.from_config(None)
    try:
        if not pool.members:
            raise DemoError("the pool has no members: no Vulkan device and the host member disabled")
        for m in pool.members:
            where = (f"{m.info.name} ({m.info.vendor}, {m.info.type})" if isinstance(m, VulkanMember)
                     else "numpy on the host")
            say(f"    {m.id:<7} {m.kind:<7} budget {fmt_bytes(m.budget_bytes):>10}   {where}")
        if not pool.vulkan_members:
            say("    (no Vulkan member: the daemon will run everything on the host member)")
        rng = np.random.default_rng(0)
        data = rng.standard_normal((256, 1024)).astype(np.float32)  # 1 MiB
        for m in pool.members:
            t0 = time.perf_counter()
            alloc = m.alloc(data.nbytes)
            try:
                m.upload(alloc, data)
                back = m.download(alloc, data.shape, data.dtype)
            finally:
                alloc.free()
            ms = (time.perf_counter() - t0) * 1e3
            if not np.array_equal(back, data):
                raise DemoError(f"member {m.id}: the array downloaded differs from the one uploaded")
            say(f"    {m.id:<7} round trip of {fmt_bytes(data.nbytes)} (alloc, upload, download, free): "
                f"identical, {ms:.1f} ms")
    finally:
        pool.close()


# -- 2. the daemon ----------------------------------------------------------------------------------
class Daemon:
    """``vkpool serve`` in a subprocess on a private ipc socket; its log goes to a file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.endpoint = f"ipc://{folder / 'daemon.sock'}"
        self.log_path = folder / "daemon.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "vkpool", "serve", "--endpoint", self.endpoint],
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        from vkpool.daemon.client import Client
        from vkpool.daemon.errors import DaemonUnavailable

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise DemoError(f"the daemon exited with status {self.proc.returncode} while starting")
            try:
                Client(self.endpoint, hello_timeout=2).close()
                return time.monotonic() - t0
            except DaemonUnavailable:
                time.sleep(0.1)
        raise DemoError(f"the daemon did not answer within {timeout:g} s")

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace").rstrip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def stop(self) -> int | None:
        """Ask politely (shutdown request), then SIGTERM, then SIGKILL; the exit status."""
        if self.proc.poll() is None:
            try:
                from vkpool.daemon.client import Client

                with Client(self.endpoint, hello_timeout=2) as client:
                    client.request("shutdown", timeout=5)
            except Exception:  # noqa: BLE001 - fall back to a signal below
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self._log.close()
        return self.proc.returncode


# -- 4. a client process ----------------------------------------------------------------------------
def client_main(argv: list[str]) -> int:
    """One client process: ``python -m vkpool.demo --client ENDPOINT INDEX START STOP FOLDER``."""
    from vkpool.daemon.client import Client

    endpoint, index, start, stop, folder = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    tag = f"    [client {index}]"
    test = np.load(TEST_SET)
    images = test["images"][start:stop]
    with Client(endpoint, name=f"demo client {index} (pid {os.getpid()})",
                timeout=REQUEST_TIMEOUT_S) as client:
        session = client.session(MODEL)  # the same content: the daemon shares one loaded model
        (folder / f"ready{index}").touch()
        deadline = time.monotonic() + 30
        while not (folder / "go").exists():  # start together with the other clients
            if time.monotonic() > deadline:
                raise SystemExit(f"{tag} the other clients never became ready")
            time.sleep(0.005)
        name = session.get_inputs()[0].name
        logits, latencies = [], []
        t_start = time.perf_counter()
        for k, image in enumerate(images):
            x = image.astype(np.float32)[None, None]  # [1, 1, 8, 8], intensities 0..16
            t0 = time.perf_counter()
            (y,) = session.run(None, {name: x})
            latencies.append(time.perf_counter() - t0)
            logits.append(y[0])
            if (k + 1) % 40 == 0 or k + 1 == len(images):
                say(f"{tag} {k + 1:>3}/{len(images)} jobs answered")
        wall = time.perf_counter() - t_start
        session.close()
    np.save(folder / f"logits{index}.npy", np.array(logits, dtype=np.float32).reshape(len(images), -1))
    (folder / f"client{index}.json").write_text(json.dumps({"pid": os.getpid(), "latencies": latencies,
                                                            "wall": wall, "start": start, "stop": stop}))
    return 0


def run_clients(daemon: subprocess.Popen[bytes], endpoint: str, n_images: int, folder: Path
                ) -> list[dict[str, Any]]:
    bounds = np.linspace(0, n_images, N_CLIENTS + 1).astype(int)
    procs = []
    for i in range(N_CLIENTS):
        args = [endpoint, str(i + 1), str(bounds[i]), str(bounds[i + 1]), str(folder)]
        procs.append(subprocess.Popen([sys.executable, "-m", "vkpool.demo", "--client", *args],
                                      stdin=subprocess.DEVNULL, stderr=subprocess.PIPE))
        say(f"    client {i + 1}: pid {procs[-1].pid}, test digits {bounds[i]}..{bounds[i + 1] - 1} "
            f"({bounds[i + 1] - bounds[i]} jobs, one digit each)")
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all((folder / f"ready{i + 1}").exists() for i in range(N_CLIENTS)):
            for i, p in enumerate(procs):
                if p.poll() is not None:
                    raise DemoError(f"client {i + 1} exited with status {p.returncode} before starting: "
                                    f"{p.stderr.read().decode(errors='replace').strip()[-2000:]}")
            if time.monotonic() > deadline:
                raise DemoError("the clients did not connect in time")
            time.sleep(0.01)
        say(f"    all {N_CLIENTS} clients connected and holding the model; go")
        (folder / "go").touch()
        deadline = time.monotonic() + CLIENT_TIMEOUT_S
        while any(p.poll() is None for p in procs):
            if daemon.poll() is not None:
                raise DemoError(f"the daemon died (status {daemon.returncode}) while the clients were running")
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                break
            if time.monotonic() > deadline:
                raise DemoError(f"the clients did not finish within {CLIENT_TIMEOUT_S:g} s")
            time.sleep(0.02)
        results = []
        for i, p in enumerate(procs):
            if p.wait() != 0:
                err = p.stderr.read().decode(errors="replace").strip()
                raise DemoError(f"client {i + 1} failed (status {p.returncode}): {err[-2000:]}")
            result = json.loads((folder / f"client{i + 1}.json").read_text())
            result["logits"] = np.load(folder / f"logits{i + 1}.npy")
            results.append(result)
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def numpy_logits(images: np.ndarray) -> np.ndarray:
    """The shipped model evaluated with numpy from its own weights (a check on the daemon)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(MODEL))
    weights = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    h = images.reshape(len(images), -1).astype(np.float64)
    for node in model.graph.node:
        if node.op_type == "Gemm":
            h = h @ weights[node.input[1]] + weights[node.input[2]]
        elif node.op_type == "Relu":
            h = np.maximum(h, 0.0)
    return h


def ascii_digit(image: np.ndarray) -> list[str]:
    shades = " .:-=+*#%@"
    return ["".join(shades[min(9, int(v) * 10 // 17)] * 2 for v in row) for row in image]


# -- the whole demo ---------------------------------------------------------------------------------
def run(folder: Path) -> None:
    from vkpool.daemon.client import Client

    for path in (MODEL, TEST_SET):
        if not path.exists():
            raise DemoError(f"{path} is missing (run scripts/train_digits.py, or reinstall vkpool)")
    test = np.load(TEST_SET)
    images, labels = test["images"], test["labels"].astype(np.int64)

    show_pool()

    step(2, f"Starting the daemon (`vkpool serve`, {config_name()}) on a private socket")
    daemon = Daemon(folder)
    try:
        say(f"    endpoint {daemon.endpoint}, pid {daemon.proc.pid}, log {daemon.log_path}")
        say(f"    ready after {daemon.wait_ready():.1f} s")
        with Client(daemon.endpoint, name="demo driver", timeout=REQUEST_TIMEOUT_S) as client:
            say(f"    daemon {client.info['server_version']}, protocol {client.info['protocol_version']}; "
                "its members:")
            for m in client.devices():
                say(f"    {m['id']:<7} {m['kind']:<7} budget {fmt_bytes(m['budget_bytes']):>10}, "
                    f"{fmt_bytes(m['used_bytes'])} used")

            step(3, f"Loading the digit classifier ({MODEL.name}, {MODEL.stat().st_size // 1024} KiB) "
                    "and asking for its plan")
            t0 = time.perf_counter()
            session = client.session(MODEL)
            memory = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in session.info["memory_by_member"].items())
            inp, out = session.get_inputs()[0], session.get_outputs()[0]
            say(f"    model {session.model_id[:12]} loaded in {(time.perf_counter() - t0) * 1e3:.0f} ms on {memory}")
            say(f"    input {inp.name} {inp.shape} {inp.type}, output {out.name} {out.shape} {out.type}")
            say("    plan:")
            for line in client.plan(session.model_id)["text"].rstrip().splitlines():
                say(f"      {line}")

            step(4, f"Classifying {len(images)} held-out test digits from {N_CLIENTS} client processes at once")
            t0 = time.perf_counter()
            results = run_clients(daemon.proc, daemon.endpoint, len(images), folder)
            wall = time.perf_counter() - t0
            status = client.status()
            session.close()

        step(5, "Results")
        logits = np.concatenate([r["logits"] for r in results])
        predicted = logits.argmax(axis=1)
        say(f"    {'client':<8} {'pid':>7} {'jobs':>5} {'correct':>8} {'accuracy':>9} {'latency: mean':>14} "
            f"{'median':>9} {'p95':>9} {'wall':>7}")
        for i, r in enumerate(results):
            lat = np.array(r["latencies"]) * 1e3
            right = int((predicted[r["start"]:r["stop"]] == labels[r["start"]:r["stop"]]).sum())
            n = r["stop"] - r["start"]
            say(f"    {i + 1:<8} {r['pid']:>7} {n:>5} {right:>8} {right / n:>9.4f} {lat.mean():>11.2f} ms "
                f"{np.median(lat):>6.2f} ms {np.percentile(lat, 95):>6.2f} ms {r['wall']:>5.2f} s")
        say(f"    {N_CLIENTS} clients answered {len(predicted)} jobs in {wall:.2f} s "
            f"({len(predicted) / wall:.0f} jobs/s including process start-up)")

        say()
        say("    the first 4 test digits, then the first 2 the model gets wrong (true label -> answer):")
        picks = list(range(4)) + [int(i) for i in np.flatnonzero(predicted != labels)[:2]]
        arts = [ascii_digit(images[i]) for i in picks]
        say("    " + "  ".join(f"{'#' + str(i):<16}" for i in picks))
        for row in range(8):
            say("    " + "  ".join(a[row] for a in arts))
        say("    " + "  ".join(f"{f'true {labels[i]} -> {predicted[i]}':<16}" for i in picks))

        reference = numpy_logits(images)
        agree = int((reference.argmax(axis=1) == predicted).sum())
        diff = float(np.abs(reference - logits).max())
        say()
        say(f"    check: numpy evaluation of the same weights agrees on {agree}/{len(predicted)} predictions "
            f"(largest logit difference {diff:.2e})")
        c, lat = status["counters"], status["latency_ms"]
        say(f"    daemon counters: {c['ok']} requests ok (jobs, loads, plans, hellos), {c['error']} errors; "
            f"job latency p50 {lat['p50']:.2f} ms, "
            f"p90 {lat['p90']:.2f} ms, p99 {lat['p99']:.2f} ms")
        accuracy = float((predicted == labels).mean())
        say()
        say(f"accuracy: {accuracy:.4f} ({int((predicted == labels).sum())}/{len(labels)} test digits, "
            f"{len(results)} clients answered)")
        if agree != len(predicted):
            raise DemoError("the daemon's answers differ from the numpy evaluation of the model")
    finally:
        step(6, "Stopping the daemon")
        code = daemon.stop()
        if code == 0:
            say("    stopped (exit status 0)")
        else:
            say(f"    the daemon exited with status {code}")
            if sys.exc_info()[0] is None:
                raise DemoError(f"the daemon exited with status {code} when asked to stop")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--client"]:
        try:
            return client_main(argv[1:])
        except Exception as exc:  # noqa: BLE001 - one line for the driver to show
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
    started = time.perf_counter()
    say("vkpool demo: pool the Vulkan devices, serve a digit classifier to 3 processes through the daemon")
    base = "/tmp" if len(tempfile.gettempdir()) > 60 and os.path.isdir("/tmp") else None  # ipc paths <= 107 B
    folder = Path(tempfile.mkdtemp(prefix="vkpool-demo-", dir=base))
    try:
        run(folder)
    except KeyboardInterrupt:
        print("\nvkpool demo: interrupted; the daemon was stopped", file=sys.stderr, flush=True)
        shutil.rmtree(folder, ignore_errors=True)
        return 130
    except Exception as exc:  # noqa: BLE001 - every failure gets a clear message and status 1
        log = folder / "daemon.log"
        tail = log.read_text(errors="replace").rstrip().splitlines()[-20:] if log.exists() else []
        print(f"\nvkpool demo FAILED: {type(exc).__name__ if not isinstance(exc, DemoError) else ''}"
              f"{': ' if not isinstance(exc, DemoError) else ''}{exc}", file=sys.stderr, flush=True)
        if tail:
            print(f"the end of the daemon's log ({log}, kept):\n" + "\n".join(tail), file=sys.stderr, flush=True)
        return 1
    shutil.rmtree(folder, ignore_errors=True)
    say(f"\ndemo done in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
