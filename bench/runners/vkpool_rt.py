"""vkpool itself: in-process ``vkpool.Session`` and through the daemon with ``vkpool.Client``."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.runners.base import Runner, RunFn, Unavailable


class VkpoolInProcess(Runner):
    name = "vkpool"
    is_vkpool = True

    def probe(self) -> str | None:
        try:
            from vkpool import Session  # noqa: F401
        except ImportError as exc:
            raise Unavailable(f"vkpool.Session is not importable ({exc})") from exc
        import vkpool

        return f"vkpool {vkpool.__version__}, device {self.options.device or 'chosen by vkpool'}"

    def load(self, model_path: Path, workload: str) -> RunFn:
        from vkpool import Session

        session = Session(str(model_path), device=self.options.device)
        input_name = session.get_inputs()[0].name

        def run(feed: dict[str, np.ndarray]) -> np.ndarray:
            return np.asarray(session.run(None, {input_name: feed["x"]})[0])

        run.session = session  # type: ignore[attr-defined]
        return run


class VkpoolDaemon(Runner):
    """Measured at the client; the harness starts ``vkpool serve`` once and passes its endpoint."""

    name = "vkpool_daemon"
    is_vkpool = True

    def probe(self) -> str | None:
        try:
            from vkpool import Client  # noqa: F401
        except ImportError as exc:
            raise Unavailable(f"vkpool.Client is not importable ({exc})") from exc
        if self.options.endpoint is None:
            raise Unavailable("no daemon endpoint (the daemon did not start)")
        return f"vkpool daemon at {self.options.endpoint}"

    def load(self, model_path: Path, workload: str) -> RunFn:
        from vkpool import Client

        client = Client(endpoint=self.options.endpoint)
        session = client.session(str(model_path))

        def run(feed: dict[str, np.ndarray]) -> np.ndarray:
            return np.asarray(session.run(None, {"x": feed["x"]})[0])

        run.client, run.session = client, session  # type: ignore[attr-defined]
        return run
