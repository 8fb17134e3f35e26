"""Runs the protocol: models, reference outputs, one child process per measurement, the daemon."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench import workloads as wl
from bench.runners import RUNNERS, RunnerOptions

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Config:
    workloads: list[str]
    runtimes: list[str]
    out: Path
    warmup: int = 20
    runs: int = 100
    timeout_s: float = 900.0
    device: str | None = None
    smoke: bool = False


@dataclass
class Progress:
    """One stderr line per step; rewritten in place on a terminal."""

    total: int
    done: int = 0
    started: float = field(default_factory=time.monotonic)

    def step(self, text: str) -> None:
        self.done += 1
        line = f"[{self.done:>3}/{self.total}] {time.monotonic() - self.started:6.1f}s  {text}"
        if sys.stderr.isatty():
            sys.stderr.write("\r\033[K" + line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if sys.stderr.isatty():
            sys.stderr.write("\n")


def _stamp() -> str:
    source = (Path(wl.__file__)).read_bytes()
    return hashlib.sha256(source).hexdigest()[:16]


def ensure_model(name: str, models_dir: Path) -> Path:
    """The workload's .onnx file, rebuilt only when bench/workloads.py changed since it was written."""
    path = models_dir / f"{name}.onnx"
    stamp = path.with_suffix(".stamp")
    if not (path.exists() and stamp.exists() and stamp.read_text() == _stamp()):
        wl.save(name, models_dir)
        stamp.write_text(_stamp())
    return path


def ensure_reference(name: str, model: Path, refs_dir: Path) -> Path:
    """onnxruntime CPU output with every graph optimisation off: plain op-by-op evaluation."""
    import onnxruntime as ort

    refs_dir.mkdir(parents=True, exist_ok=True)
    path = refs_dir / f"{name}.npy"
    if path.exists() and path.stat().st_mtime >= model.stat().st_mtime:
        return path
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    np.save(path, session.run(None, wl.input_for(name))[0])
    return path


def run_child(mode: str, runtime: str, result_path: Path, log_path: Path, timeout_s: float,
              extra: list[str]) -> dict[str, Any]:
    """Run ``python -m bench.child`` and return its JSON plus the child's wall time (spawn to reaped)."""
    cmd = [sys.executable, "-m", "bench.child", mode, "--runtime", runtime, "--result", str(result_path), *extra]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    result_path.unlink(missing_ok=True)
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        deadline = t0 + timeout_s
        while proc.poll() is None:
            if time.perf_counter() > deadline:
                proc.kill()
                proc.wait()
                return {"status": "failed", "reason": f"timed out after {timeout_s:.0f} s (log: {log_path})"}
            time.sleep(0.002)
        wall_s = time.perf_counter() - t0
    code = proc.returncode
    if not result_path.exists():
        return {"status": "failed", "reason": f"exited with {code} and no result (log: {log_path})"}
    result: dict[str, Any] = json.loads(result_path.read_text())
    if code != 0 and result.get("status") == "ok":
        result["status"], result["reason"] = "failed", f"exited with {code} (log: {log_path})"
    result["wall_s"] = wall_s
    return result


@contextmanager
def daemon(tmp: Path, log_path: Path, timeout_s: float = 60.0) -> Iterator[tuple[str | None, str]]:
    """Start ``vkpool serve`` on an ipc endpoint in ``tmp``; yield (endpoint or None, note).

    Runs ``python -m vkpool`` with this interpreter, so a package installed without its console
    script (``pip install --target``) serves too."""
    socket = tmp / "s"
    endpoint = f"ipc://{socket}"
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "vkpool", "serve", "--endpoint", endpoint],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while not socket.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is not None:
            yield None, f"vkpool serve exited with {proc.returncode} (log: {log_path})"
        elif not socket.exists():
            yield None, f"vkpool serve did not open {endpoint} within {timeout_s:.0f} s (log: {log_path})"
        else:
            yield endpoint, ""
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def run_all(cfg: Config) -> dict[str, Any]:
    """Every (runtime, workload) measurement of ``cfg``; returns the raw results document."""
    out = cfg.out
    models_dir, logs_dir, work_dir = out / "models", out / "logs", out / "work"
    for d in (models_dir, logs_dir, work_dir):
        d.mkdir(parents=True, exist_ok=True)
    started = time.time()
    progress = Progress(total=len(cfg.runtimes) + len(cfg.workloads) * (1 + 2 * len(cfg.runtimes)))
    results: list[dict[str, Any]] = []
    unavailable: dict[str, str] = {}
    details: dict[str, str] = {}

    with tempfile.TemporaryDirectory(prefix="vkpool-bench-") as tmp, _maybe_daemon(cfg, Path(tmp), logs_dir) as (
        endpoint, daemon_note,
    ):
        common = ["--device", cfg.device] if cfg.device else []
        if endpoint:
            common += ["--endpoint", endpoint]
        for runtime in cfg.runtimes:
            progress.step(f"probe {runtime}")
            if runtime == "vkpool_daemon" and endpoint is None:
                unavailable[runtime] = daemon_note
                continue
            probe = run_child("probe", runtime, work_dir / "probe.json", logs_dir / f"probe-{runtime}.log",
                              120.0, common)
            if probe["status"] != "ok":
                unavailable[runtime] = probe.get("reason", probe["status"])
            else:
                details[runtime] = probe.get("detail", "")
        for workload in cfg.workloads:
            progress.step(f"build {workload}")
            model = ensure_model(workload, models_dir)
            ref = ensure_reference(workload, model, out / "refs")
            for runtime in cfg.runtimes:
                if runtime in unavailable:
                    results.append({"runtime": runtime, "workload": workload, "status": "unavailable",
                                    "reason": unavailable[runtime]})
                    progress.done += 2
                    continue
                results.append(_measure(cfg, runtime, workload, model, ref, common, work_dir, logs_dir, progress))
    progress.close()
    return {
        "machine": _machine(),
        "config": {"workloads": cfg.workloads, "runtimes": cfg.runtimes, "warmup": cfg.warmup,
                   "runs": cfg.runs, "smoke": cfg.smoke, "device": cfg.device},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "elapsed_s": time.time() - started,
        "runtimes": details,
        "unavailable": unavailable,
        "results": results,
    }


@contextmanager
def _maybe_daemon(cfg: Config, tmp: Path, logs_dir: Path) -> Iterator[tuple[str | None, str]]:
    if "vkpool_daemon" not in cfg.runtimes:
        yield None, ""
        return
    try:
        RUNNERS["vkpool_daemon"](RunnerOptions(endpoint="probe")).probe()
    except Exception as exc:  # noqa: BLE001 - any import failure means: report unavailable
        yield None, str(exc)
        return
    with daemon(tmp, logs_dir / "daemon.log") as started:
        yield started


def _measure(cfg: Config, runtime: str, workload: str, model: Path, ref: Path, common: list[str],
             work_dir: Path, logs_dir: Path, progress: Progress) -> dict[str, Any]:
    tag = f"{runtime}-{workload}"
    try:
        prepared = RUNNERS[runtime](RunnerOptions(device=cfg.device)).prepare(model, workload)
    except Exception as exc:  # noqa: BLE001 - a failed conversion is this row's result, not the run's
        return {"runtime": runtime, "workload": workload, "status": "failed",
                "reason": f"conversion: {type(exc).__name__}: {exc}"}
    progress.step(f"latency   {runtime:<16} {workload}")
    args = [*common, "--workload", workload, "--model", str(prepared), "--ref", str(ref)]
    lat = run_child("latency", runtime, work_dir / "latency.json", logs_dir / f"latency-{tag}.log", cfg.timeout_s,
                    [*args, "--warmup", str(cfg.warmup), "--runs", str(cfg.runs)])
    entry: dict[str, Any] = {"runtime": runtime, "workload": workload, "status": lat["status"]}
    for key in ("reason", "gate", "latency", "first_run_ms", "load_s", "samples_ms"):
        if key in lat:
            entry[key] = lat[key]
    progress.step(f"footprint {runtime:<16} {workload}")
    if lat["status"] != "ok":
        return entry
    foot = run_child("footprint", runtime, work_dir / "footprint.json", logs_dir / f"footprint-{tag}.log",
                     cfg.timeout_s, args)
    if foot["status"] == "ok":
        entry["footprint"] = {"peak_rss_mib": foot.get("peak_rss_mib"), "wall_s": foot["wall_s"],
                              "load_s": foot.get("load_s")}
    else:
        entry["footprint"] = {"error": foot.get("reason", foot["status"])}
    return entry


def _machine() -> dict[str, Any]:
    import platform

    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpus": os.cpu_count()}
    try:
        info["commit"] = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, text=True,
                                        capture_output=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        info["commit"] = None
    for module in ("numpy", "onnx", "onnxruntime", "ncnn", "torch", "vkpool"):
        try:
            info[module] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - absent or without a version: leave it out
            continue
    return info
