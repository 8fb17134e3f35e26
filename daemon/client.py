"""Client library: talk to a running ``vkpool serve`` the way you would use ``vkpool.Session``.

    with Client() as client:
        session = client.session("model.onnx")
        (y,) = session.run(None, {"x": x})

A :class:`Client` owns one DEALER socket, driven by a background thread so that any number of
threads can have requests in flight at once (zmq sockets are not thread-safe). Error replies
raise the exception class named by their type (:mod:`vkpool.daemon.errors`).
"""
from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import zmq

from vkpool.daemon import protocol as P
from vkpool.daemon.endpoint import default_endpoint, ipc_path
from vkpool.daemon.errors import DaemonUnavailable, from_reply

HELLO_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ValueInfo:
    """An input or output of a remote model, shaped like the in-process session's."""

    name: str
    shape: list[int | str]
    type: str
    dtype: np.dtype


def resolve_endpoint(endpoint: str | None) -> str:
    return endpoint or os.environ.get("VKPOOL_ENDPOINT") or default_endpoint()


def _not_running(endpoint: str, why: str) -> DaemonUnavailable:
    return DaemonUnavailable(f"no vkpool daemon answers at {endpoint} ({why}); start it with `vkpool serve`")


def make_socket(ctx: zmq.Context, endpoint: str, curve: tuple[bytes, bytes, bytes] | None) -> zmq.Socket:
    """A DEALER with a random routing id (the daemon keys references and retries by it)."""
    sock = ctx.socket(zmq.DEALER)
    sock.routing_id = b"\x01" + uuid.uuid4().bytes  # a leading zero byte is reserved by libzmq
    sock.linger = 0
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
    sock.connect(endpoint)
    return sock


def check_endpoint(endpoint: str) -> None:
    path = ipc_path(endpoint)
    if path is not None and not path.exists():
        raise _not_running(endpoint, f"{path} does not exist")


def build_request(action: str, rid: str, content: Mapping[str, Any], frames: Sequence[Any]) -> list[Any]:
    return P.encode(P.request_header(action, rid), {k: v for k, v in content.items()}, frames)


def parse_reply(frames: list[zmq.Frame]) -> tuple[dict[str, Any], dict[str, Any], list[zmq.Frame]] | None:
    """Header, content and raw frames of a reply; None for anything that is not one (probes)."""
    try:
        _, body = P.split_routing(frames)
        header, content = P.unpack(body[0].buffer), P.unpack(body[1].buffer)
    except (P.ProtocolViolation, IndexError):
        return None
    if not isinstance(header, dict) or "status" not in header or not isinstance(content, dict):
        return None
    return header, content, body[2:]


def result_of(reply: tuple[dict[str, Any], dict[str, Any], list[zmq.Frame]]) -> tuple[dict[str, Any], list[Any]]:
    header, content, frames = reply
    if header["status"] != "ok":
        raise from_reply(content)
    return content, frames


def infer_content(model: str, feeds: Mapping[str, Any], outputs: Iterable[str] | None,
                  priority: int, timeout: float | None) -> tuple[dict[str, Any], list[Any]]:
    metas, frames = P.tensor_frames([(name, np.asarray(value)) for name, value in feeds.items()])
    content: dict[str, Any] = {"model": model, "inputs": metas, "priority": priority, "timeout": timeout,
                               "outputs": None if outputs is None else list(outputs)}
    return content, frames


def outputs_of(content: dict[str, Any], frames: list[Any]) -> list[np.ndarray]:
    arrays = P.decode_tensors(content["outputs"], frames, "outputs")
    return [a.copy() for a in arrays.values()]  # writable, like the in-process session's results


def load_content(model: str | os.PathLike[str] | bytes, name: str | None,
                 keep_alive: float | None) -> tuple[dict[str, Any], list[Any]]:
    content: dict[str, Any] = {"name": name, "keep_alive": keep_alive}
    if isinstance(model, (bytes, bytearray, memoryview)):
        return content, [bytes(model)]
    content["path"] = str(Path(model).expanduser().resolve())
    return content, []


class Client:
    """A connection to the daemon. Thread-safe; close it (or use ``with``) when done."""

    def __init__(self, endpoint: str | None = None, *, timeout: float | None = None,
                 hello_timeout: float = HELLO_TIMEOUT_S, curve: tuple[bytes, bytes, bytes] | None = None,
                 name: str | None = None, context: zmq.Context | None = None) -> None:
        self.endpoint = resolve_endpoint(endpoint)
        self.timeout = timeout
        check_endpoint(self.endpoint)
        self._own_ctx = context is None  # inproc:// endpoints need the daemon's context
        self._ctx = context or zmq.Context()
        self._sock = make_socket(self._ctx, self.endpoint, curve)
        self._outbox_addr = f"inproc://vkpool-client-{id(self)}"
        self._outbox_pull = self._ctx.socket(zmq.PULL)
        self._outbox_pull.bind(self._outbox_addr)
        self._outbox = self._ctx.socket(zmq.PUSH)
        self._outbox.connect(self._outbox_addr)
        self._send_lock = threading.Lock()
        self._pending: dict[str, concurrent.futures.Future[Any]] = {}
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._io_loop, name="vkpool-client", daemon=True)
        self._thread.start()
        try:
            self.info = self.request("hello", {"client": name or f"pid {os.getpid()}"}, timeout=hello_timeout)[0]
        except TimeoutError:
            self.close()
            raise _not_running(self.endpoint, f"no reply to hello within {hello_timeout:g} s") from None
        except BaseException:
            self.close()
            raise

    # -- transport ----------------------------------------------------------------------------
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._outbox_pull, zmq.POLLIN)
        while not self._closed.is_set():
            events = dict(poller.poll(100))
            if self._outbox_pull in events:
                while True:
                    try:
                        self._sock.send_multipart(self._outbox_pull.recv_multipart(zmq.NOBLOCK, copy=False),
                                                  copy=False)
                    except zmq.Again:
                        break
            if self._sock in events:
                while True:
                    try:
                        reply = parse_reply(self._sock.recv_multipart(zmq.NOBLOCK, copy=False))
                    except zmq.Again:
                        break
                    if reply is not None:
                        future = self._pending.pop(str(reply[0].get("id")), None)
                        if future is not None and not future.done():
                            future.set_result(reply)

    def request(self, action: str, content: Mapping[str, Any] | None = None, frames: Sequence[Any] = (),
                *, timeout: float | None = None, request_id: str | None = None) -> tuple[dict[str, Any], list[Any]]:
        """Send one request and wait for its reply: ``(content, raw frames)``; raises on error replies."""
        future = self.submit(action, content, frames, request_id=request_id)
        wait = timeout if timeout is not None else self.timeout
        try:
            return result_of(future.result(wait))
        except concurrent.futures.TimeoutError:
            self._pending.pop(future.request_id, None)  # type: ignore[attr-defined]
            raise TimeoutError(f"no {action}_reply from {self.endpoint} within {wait:g} s") from None

    def submit(self, action: str, content: Mapping[str, Any] | None = None, frames: Sequence[Any] = (),
               *, request_id: str | None = None) -> concurrent.futures.Future[Any]:
        """Send without waiting; the future's result is the raw reply (see :func:`result_of`)."""
        if self._closed.is_set():
            raise DaemonUnavailable("this client is closed")
        rid = request_id or f"{self._prefix}-{next(self._ids)}"
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.request_id = rid  # type: ignore[attr-defined]
        self._pending[rid] = future
        message = build_request(action, rid, content or {}, frames)
        with self._send_lock:
            self._outbox.send_multipart(message, copy=False)
        return future

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        for sock in (self._sock, self._outbox, self._outbox_pull):
            sock.close(0)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -----------------------------------------------------------------------------
    def devices(self) -> list[dict[str, Any]]:
        return self.request("devices")[0]["members"]

    def load_model(self, model: str | os.PathLike[str] | bytes, *, name: str | None = None,
                   keep_alive: float | None = None) -> dict[str, Any]:
        return self.request("load_model", *load_content(model, name, keep_alive))[0]["model"]

    def list_models(self) -> list[dict[str, Any]]:
        return self.request("list_models")[0]["models"]

    def plan(self, model_id: str, budgets: Mapping[str, int | str] | None = None) -> dict[str, Any]:
        return self.request("plan", {"model": model_id, "budgets": dict(budgets) if budgets else None})[0]

    def infer(self, model_id: str, feeds: Mapping[str, Any], outputs: Iterable[str] | None = None, *,
              priority: int = 0, timeout: float | None = None) -> list[np.ndarray]:
        content, frames = infer_content(model_id, feeds, outputs, priority, timeout)
        wait = None if timeout is None else timeout + 5.0  # the daemon answers Timeout itself
        return outputs_of(*self.request("infer", content, frames, timeout=wait))

    def cancel(self, request_id: str) -> dict[str, Any]:
        return self.request("cancel", {"request_id": request_id})[0]

    def unload_model(self, model_id: str) -> dict[str, Any]:
        return self.request("unload_model", {"model": model_id})[0]

    def set_budget(self, member: str, size: int | str) -> dict[str, Any]:
        return self.request("set_budget", {"member": member, "size": size})[0]

    def status(self) -> dict[str, Any]:
        return self.request("status")[0]

    def shutdown(self) -> dict[str, Any]:
        return self.request("shutdown")[0]

    def session(self, model: str | os.PathLike[str] | bytes, *, name: str | None = None,
                keep_alive: float | None = None) -> "RemoteSession":
        return RemoteSession(self, self.load_model(model, name=name, keep_alive=keep_alive))


def value_infos(described: list[dict[str, Any]]) -> list[ValueInfo]:
    return [ValueInfo(d["name"], d["shape"], d["type"], np.dtype(d["dtype"])) for d in described]


class RemoteSession:
    """A model loaded in the daemon, used like ``vkpool.Session``."""

    def __init__(self, client: Client, info: dict[str, Any]) -> None:
        self.client = client
        self.info = info
        self.model_id: str = info["id"]
        self._inputs = value_infos(info["inputs"])
        self._outputs = value_infos(info["outputs"])

    def get_inputs(self) -> list[ValueInfo]:
        return list(self._inputs)

    def get_outputs(self) -> list[ValueInfo]:
        return list(self._outputs)

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], *,
            priority: int = 0, timeout: float | None = None) -> list[np.ndarray]:
        return self.client.infer(self.model_id, input_feed, output_names, priority=priority, timeout=timeout)

    def memory_by_member(self) -> dict[str, int]:
        for model in self.client.list_models():
            if model["id"] == self.model_id:
                return dict(model["memory_by_member"])
        return {}

    def close(self) -> None:
        self.client.unload_model(self.model_id)

    def __enter__(self) -> "RemoteSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


from vkpool.daemon.aclient import AsyncClient, AsyncRemoteSession  # noqa: E402  (re-export)

__all__ = ["AsyncClient", "AsyncRemoteSession", "Client", "RemoteSession", "ValueInfo"]
