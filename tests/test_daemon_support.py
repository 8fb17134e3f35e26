"""Helpers for the daemon tests: tiny ONNX models, a numpy stand-in runtime, daemon launchers.

The stand-in runtime runs models with ``onnx.reference`` and accounts memory like a pool with
budgets, so protocol, scheduling and failure handling are tested quickly and deterministically
(a configurable delay per run makes jobs slow on purpose). The end-to-end tests use the real
runtime on the Vulkan device instead.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]


# -- models ------------------------------------------------------------------------------------
def add_model(n: int = 4, constant: float = 1.0, *, opset: int = 17) -> bytes:
    """y = x + constant, x: float32[1, n]."""
    c = numpy_helper.from_array(np.full((1, n), constant, np.float32), "c")
    graph = helper.make_graph([helper.make_node("Add", ["x", "c"], ["y"])], "add",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], [c])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


def mlp_model(n: int = 8, hidden: int = 16, seed: int = 0) -> bytes:
    """y = relu(x @ w1 + b1) @ w2, z = y * 2: two outputs."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.standard_normal((n, hidden)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((1, hidden)).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.standard_normal((hidden, n)).astype(np.float32), "w2"),
             numpy_helper.from_array(np.full((1, n), 2.0, np.float32), "two")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"]),
             helper.make_node("Mul", ["y", "two"], ["z"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def batched_model(n: int = 4) -> bytes:
    """y = x + 1 with x: float32[N, n, T] (batch dim N anonymous first, T named)."""
    one = numpy_helper.from_array(np.ones((1, n, 1), np.float32), "one")
    graph = helper.make_graph([helper.make_node("Add", ["x", "one"], ["y"])], "batched",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", n, "T"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", n, "T"])], [one])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def unsupported_model() -> bytes:
    """A valid model whose op (Det) no runtime here implements."""
    graph = helper.make_graph([helper.make_node("Det", ["x"], ["y"])], "det",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def big_model(nbytes: int) -> bytes:
    """y = x + w with a weight of ``nbytes`` bytes: larger than every small budget."""
    n = nbytes // 4
    w = numpy_helper.from_array(np.zeros((1, n), np.float32), "w")
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "big",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def external_outside_model(folder: Path) -> Path:
    """A model in ``folder/model`` whose weight file is ``../weights.bin`` (outside its folder)."""
    inner = folder / "model"
    inner.mkdir(parents=True)
    (folder / "weights.bin").write_bytes(np.ones(4, np.float32).tobytes())
    proto = onnx.load_model_from_string(add_model())
    tensor = proto.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../weights.bin"), ("offset", "0"), ("length", "16")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    path = inner / "model.onnx"
    path.write_bytes(proto.SerializeToString())
    return path


def reference_run(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    return list(ReferenceEvaluator(onnx.load_model_from_string(model)).run(None, feeds))


# -- stand-in runtime ---------------------------------------------------------------------------
class ModelError(ValueError):
    pass


class UnsupportedOp(Exception):
    pass


class DeviceOutOfMemory(MemoryError):
    pass


class _Arg:
    def __init__(self, v: onnx.ValueInfoProto, binding: dict[str, Any]) -> None:
        t = v.type.tensor_type
        self.name = v.name
        dims, batch = binding.get("dims", {}), binding.get("batch", 1)
        self.shape = [d.dim_value if d.HasField("dim_value") else dims.get(d.dim_param, batch if i == 0 else d.dim_param)
                      for i, d in enumerate(t.shape.dim)]
        self.dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        self.type = {np.dtype(np.float32): "tensor(float)"}.get(self.dtype, f"tensor({self.dtype.name})")


class _Plan:
    def __init__(self, memory: dict[str, int]) -> None:
        self.memory = memory

    def to_text(self) -> str:
        return "\n".join(f"{m}: {n} bytes" for m, n in self.memory.items())

    def to_json(self) -> dict[str, Any]:
        return {"memory_by_member": self.memory}


class StandInSession:
    SUPPORTED = {"Add", "MatMul", "Relu", "Mul"}

    def __init__(self, runtime: "StandInRuntime", model: bytes, delay_s: float,
                 binding: dict[str, Any] | None = None) -> None:
        from onnx.reference import ReferenceEvaluator

        try:
            proto = onnx.load_model_from_string(model)
            onnx.checker.check_model(proto)
        except Exception as exc:
            raise ModelError(f"not an ONNX model: {exc}") from None
        bad = sorted({n.op_type for n in proto.graph.node} - self.SUPPORTED)
        if bad:
            raise UnsupportedOp(f"no kernel for {bad}; supported: {sorted(self.SUPPORTED)}")
        need = sum(numpy_helper.to_array(t).nbytes for t in proto.graph.initializer) + 1024
        member = runtime.members_[0]
        if member["used_bytes"] + need > member["budget_bytes"]:
            raise DeviceOutOfMemory(f"cpu: cannot allocate {need} bytes; {member['used_bytes']} of "
                                    f"{member['budget_bytes']} in use")
        member["used_bytes"] += need
        self.runtime, self.need, self.delay_s = runtime, need, delay_s
        self._ref = ReferenceEvaluator(proto)
        self._inputs = [_Arg(v, binding or {}) for v in proto.graph.input]
        self._outputs = [_Arg(v, binding or {}) for v in proto.graph.output]
        self.plan = _Plan({"cpu": need})
        self.closed = False

    def get_inputs(self, symbolic: bool = False) -> list[_Arg]:
        return self._inputs

    def get_outputs(self) -> list[_Arg]:
        return self._outputs

    def run(self, names: list[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        assert not self.closed, "run on a closed session"
        if self.delay_s:
            time.sleep(self.delay_s)
        return list(self._ref.run(names, feeds))

    def run_many(self, feeds: Any, names: list[str] | None = None, each: Any = None) -> list[Any]:
        """As Session.run_many: each request in turn, a failure its own."""
        out: list[Any] = []
        for index, given in enumerate(feeds):
            try:
                result: Any = self.run(names, given)
            except Exception as exc:
                result = exc
            out.append(result)
            if each is not None:
                each(index, result)
        return out

    def memory_by_member(self) -> dict[str, int]:
        return {"cpu": self.need}

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.runtime.members_[0]["used_bytes"] -= self.need


class StandInRuntime:
    """The daemon's Runtime contract over onnx.reference, with a single 'cpu' member."""

    def __init__(self, budget_bytes: int = 1 << 20, delay_s: float = 0.0) -> None:
        self.members_ = [{"id": "cpu", "kind": "host", "name": "host CPU", "budget_bytes": budget_bytes,
                          "used_bytes": 0}]
        self.delay_s = delay_s
        self.opened = 0

    def members(self) -> list[dict[str, Any]]:
        return [dict(m) for m in self.members_]

    def has_member(self, member: str) -> bool:
        return member == "cpu"

    def budget_of(self, member: str) -> int:
        return self.members_[0]["budget_bytes"]

    def open(self, source: Path | bytes, binding: dict[str, Any] | None = None,
             batching: dict[str, Any] | None = None, objective: str = "latency", run_slots: int = 1) -> StandInSession:
        # run_slots: the stand-in runs each call alone whatever it is (Session.run_many runs calls in turn)
        if batching:
            raise UnsupportedOp("the stand-in runtime does not batch requests")
        if objective != "latency":
            raise UnsupportedOp("the stand-in runtime has one member: nothing to plan for throughput")
        data = source.read_bytes() if isinstance(source, Path) else bytes(source)
        self.opened += 1
        return StandInSession(self, data, self.delay_s, binding)

    def set_budget(self, member: str, nbytes: int) -> None:
        if nbytes < self.members_[0]["used_bytes"]:
            raise ValueError(f"{member}: {self.members_[0]['used_bytes']} bytes in use exceed {nbytes}")
        self.members_[0]["budget_bytes"] = nbytes

    def what_if(self, session: StandInSession, budgets: dict[str, int]) -> _Plan:
        return _Plan(dict(budgets))


# -- daemons -----------------------------------------------------------------------------------
class InprocDaemon:
    """A Server on an inproc:// endpoint, in a thread of this process."""

    def __init__(self, runtime: Any = None, **settings: Any) -> None:
        import zmq

        from vkpool.daemon.server import Server
        from vkpool.daemon.settings import DaemonSettings

        self.ctx = zmq.Context()
        self.endpoint = f"inproc://vkpool-test-{id(self)}"
        self.runtime = runtime or StandInRuntime()
        self.server = Server(self.runtime, DaemonSettings(**settings), self.endpoint, context=self.ctx)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def client(self, **kwargs: Any) -> Any:
        from vkpool.daemon.client import Client

        return Client(self.endpoint, context=self.ctx, **kwargs)

    def raw(self) -> Any:
        import zmq

        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(self.endpoint)
        return sock

    def stop(self) -> None:
        self.server.request_stop()
        self.thread.join(30)
        assert not self.thread.is_alive(), "daemon did not stop"
        self.ctx.term()


def assert_balanced(client: Any) -> dict[str, int]:
    """The daemon's counters, after checking that every accepted request is answered or in flight."""
    c = client.status()["counters"]
    assert c["accepted"] == c["ok"] + c["error"] + c["client_gone"] + c["in_flight"], c
    return c


@contextmanager
def short_folder(prefix: str = "vkd") -> Iterator[Path]:
    """A fresh folder under /tmp, removed afterwards: short, since ipc paths are limited to 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def daemon_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")])
    return env


def spawn_daemon(endpoint: str, *, config: Path | None = None, stand_in: str | None = None,
                 extra_env: dict[str, str] | None = None, preexec: Any = None) -> subprocess.Popen[bytes]:
    """``vkpool serve`` in a subprocess; ``stand_in`` is a StandInRuntime(...) argument list."""
    code = "import sys; from vkpool.daemon.main import serve; "
    if stand_in is not None:
        code += f"from test_daemon_support import StandInRuntime; runtime = StandInRuntime({stand_in}); "
    else:
        code += "runtime = None; "
    code += f"sys.exit(serve({str(config)!r} if {config is not None} else None, {endpoint!r}, runtime=runtime))"
    env = daemon_env()
    env.update(extra_env or {})
    return subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE,
                            preexec_fn=preexec)


def wait_ready(endpoint: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    from vkpool.daemon.client import Client
    from vkpool.daemon.errors import DaemonUnavailable

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited {proc.returncode}: {proc.stderr.read().decode()[-3000:]}")
        try:
            Client(endpoint, hello_timeout=2).close()
            return
        except DaemonUnavailable:
            time.sleep(0.1)
    raise AssertionError("daemon did not become ready")


@pytest.fixture
def inproc() -> Iterator[InprocDaemon]:
    daemon = InprocDaemon()
    yield daemon
    daemon.stop()


def test_stand_in_engine_matches_reference() -> None:
    runtime = StandInRuntime()
    session = runtime.open(mlp_model())
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    for got, want in zip(session.run(None, {"x": x}), reference_run(mlp_model(), {"x": x})):
        np.testing.assert_array_equal(got, want)
    assert runtime.members()[0]["used_bytes"] == session.need
    session.close()
    assert runtime.members()[0]["used_bytes"] == 0
