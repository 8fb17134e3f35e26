"""The asyncio client: same requests as :class:`vkpool.daemon.client.Client`, awaited.

One DEALER socket used only from the event loop; a reader task matches replies to requests
by id, so any number of coroutines can have requests in flight.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from vkpool.daemon import client as C
from vkpool.daemon.errors import DaemonUnavailable


class AsyncClient:
    """``client = await AsyncClient.connect()``; then ``await client.infer(...)``."""

    #: as Client.front: the front's ``hello`` reply when this client was redirected, else None
    front: dict[str, Any] | None = None
    _front_client: "AsyncClient | None" = None  # the front's client, for its requests

    def __init__(self, endpoint: str | None = None, *, timeout: float | None = None,
                 curve: tuple[bytes, bytes, bytes] | None = None,
                 context: zmq.asyncio.Context | None = None) -> None:
        self.endpoint = C.resolve_endpoint(endpoint)
        self.timeout = timeout
        C.check_endpoint(self.endpoint)
        self._own_ctx = context is None  # inproc:// endpoints need the daemon's context
        self._ctx = context or zmq.asyncio.Context()
        self._sock, self._monitor = C.make_socket(self._ctx, self.endpoint, curve)
        self._pending: dict[str, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._connection = C.Connection()
        self.info: dict[str, Any] = {}
        self.serving_endpoint = self.endpoint

    @classmethod
    async def connect(cls, endpoint: str | None = None, *, hello_timeout: float = C.HELLO_TIMEOUT_S,
                      follow: bool = True, **kwargs: Any) -> "AsyncClient":
        """A connected client; from the front of a daemon with ``process_per_device`` (and
        ``follow``), one of the serving process it names, sending the front's requests
        (:data:`protocol.FRONT_ACTIONS`) to the front, as :class:`~vkpool.daemon.client.Client` does."""
        client = cls(endpoint, **kwargs)
        try:
            client.info = (await client.request("hello", {"client": f"pid {os.getpid()} (asyncio)"},
                                                timeout=hello_timeout))[0]
        except TimeoutError:
            await client.close()
            if client._connection.refused is not None:
                raise DaemonUnavailable(client._connection.refused) from None
            raise C._not_running(client.endpoint, f"no reply to hello within {hello_timeout:g} s") from None
        except BaseException:
            await client.close()
            raise
        redirect = client.info.get("redirect") if follow else None
        if not isinstance(redirect, str):
            return client
        try:
            served = await cls.connect(redirect, hello_timeout=hello_timeout, follow=False, **kwargs)
        except BaseException:
            await client.close()
            raise
        served.endpoint, served.front, served._front_client = client.endpoint, client.info, client
        return served

    async def _read(self) -> None:
        while True:
            reply = C.parse_reply(await self._sock.recv_multipart(copy=False))
            if reply is not None:
                future = self._pending.pop(str(reply[0].get("id")), None)
                if future is not None and not future.done():
                    future.set_result(reply)

    async def _watch(self) -> None:
        """As :meth:`Client._watch_connection`: when the connection drops, the requests waiting on
        it fail with DaemonUnavailable, and new ones until it is back."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if self._connection.event(event, self.serving_endpoint):
                pending, self._pending = self._pending, {}
                for future in pending.values():
                    if not future.done():
                        future.set_exception(DaemonUnavailable(self._connection.down))

    async def request(self, action: str, content: Mapping[str, Any] | None = None, frames: Sequence[Any] = (),
                      *, timeout: float | None = None) -> tuple[dict[str, Any], list[Any]]:
        if self._sock.closed:
            raise DaemonUnavailable("this client is closed")
        if self._front_client is not None and action in C.P.FRONT_ACTIONS and action != "hello":
            return await self._front_client.request(action, content, frames, timeout=timeout)
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read())
            self._watcher = asyncio.ensure_future(self._watch())
        if self._connection.down is not None:
            raise DaemonUnavailable(self._connection.down)
        rid = f"{self._prefix}-{next(self._ids)}"
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        await self._sock.send_multipart(C.build_request(action, rid, content or {}, frames), copy=False)
        wait = timeout if timeout is not None else self.timeout
        try:
            reply = await asyncio.wait_for(future, wait)
        except asyncio.TimeoutError:
            self._pending.pop(rid, None)
            raise TimeoutError(f"no {action}_reply from {self.endpoint} within {wait:g} s") from None
        return C.result_of(reply)

    async def close(self) -> None:
        if self._front_client is not None:
            await self._front_client.close()
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, zmq.ZMQError):
                    pass
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)
        if self._own_ctx:
            self._ctx.term()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def load_model(self, model: str | os.PathLike[str] | bytes, *, name: str | None = None,
                         keep_alive: float | None = None, batch: int | None = None,
                         dims: Mapping[str, int] | None = None, max_batch: int | None = None,
                         max_queue_delay: float | None = None, objective: str | None = None) -> dict[str, Any]:
        content, frames = C.load_content(model, name, keep_alive, batch, dims, max_batch, max_queue_delay,
                                         objective)
        return (await self.request("load_model", content, frames))[0]["model"]

    async def infer(self, model_id: str, feeds: Mapping[str, Any], outputs: Iterable[str] | None = None, *,
                    priority: int = 0, timeout: float | None = None) -> list[np.ndarray]:
        content, frames = C.infer_content(model_id, feeds, outputs, priority, timeout)
        wait = None if timeout is None else timeout + 5.0
        return C.outputs_of(*(await self.request("infer", content, frames, timeout=wait)))

    async def unload_model(self, model_id: str) -> dict[str, Any]:
        return (await self.request("unload_model", {"model": model_id}))[0]

    async def status(self) -> dict[str, Any]:
        return (await self.request("status"))[0]

    async def list_models(self) -> list[dict[str, Any]]:
        return (await self.request("list_models"))[0]["models"]

    async def session(self, model: str | os.PathLike[str] | bytes, **kwargs: Any) -> "AsyncRemoteSession":
        return AsyncRemoteSession(self, await self.load_model(model, **kwargs))


class AsyncRemoteSession:
    """A model loaded in the daemon; ``await session.run(None, feeds)``."""

    def __init__(self, client: AsyncClient, info: dict[str, Any]) -> None:
        self.client = client
        self.info = info
        self.model_id: str = info["id"]
        self._inputs = C.value_infos(info["inputs"])
        self._outputs = C.value_infos(info["outputs"])

    def get_inputs(self) -> list[C.ValueInfo]:
        return list(self._inputs)

    def get_outputs(self) -> list[C.ValueInfo]:
        return list(self._outputs)

    async def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], *,
                  priority: int = 0, timeout: float | None = None) -> list[np.ndarray]:
        return await self.client.infer(self.model_id, input_feed, output_names, priority=priority,
                                       timeout=timeout)

    async def close(self) -> None:
        await self.client.unload_model(self.model_id)
