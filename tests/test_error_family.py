"""One mistake, one exception class: the same wrong call raises the in-process exception in a
``Session`` and a class derived from it through the daemon's client (a real runtime on the
Vulkan pool, served in this process)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from test_daemon_support import InprocDaemon, big_model, mlp_model, unsupported_model
from vkpool.daemon import errors as E
from vkpool.errors import InvalidInput
from vkpool.kernels.base import UnsupportedOp
from vkpool.model import ModelError
from vkpool.session import Session

pytestmark = pytest.mark.timeout(120)

X = np.ones((1, 8), np.float32)

#: (mistake, its feeds, the in-process class)
WRONG_INPUTS: list[tuple[str, dict[str, Any], type[Exception]]] = [
    ("wrong dtype", {"x": X.astype(np.float64)}, InvalidInput),
    ("wrong shape", {"x": np.ones((2, 8), np.float32)}, InvalidInput),
    ("missing input", {}, InvalidInput),
    ("unknown input", {"x": X, "q": X}, InvalidInput),
]


@pytest.fixture(scope="module")
def served(pool: Any) -> Iterator[tuple[Session, Any]]:
    """(an in-process Session of mlp_model, the same model through the daemon's client)."""
    from vkpool.daemon.runtime import Runtime

    daemon = InprocDaemon(Runtime(pool))
    client = daemon.client()
    local = Session(mlp_model(), pool=pool)
    try:
        yield local, client.session(mlp_model())
    finally:
        local.close()
        client.close()
        daemon.stop()


def raised(call: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


def test_an_unknown_output_name_raises_the_same_class_both_ways(served: tuple[Session, Any]) -> None:
    local, remote = served
    here = raised(lambda: local.run(["nope"], {"x": X}))
    there = raised(lambda: remote.run(["nope"], {"x": X}))
    assert type(here) is InvalidInput, here
    assert isinstance(there, InvalidInput) and isinstance(there, E.DaemonError), repr(there)


def test_a_model_too_large_for_the_budgets_raises_a_memory_error_both_ways() -> None:
    from vkpool.config.loader import parse_config
    from vkpool.daemon.runtime import Runtime
    from vkpool.pool import DevicePool

    small = DevicePool.from_config(parse_config(
        "devices:\n  - match: {name: 'llvmpipe*'}\n    budget: 1MiB\nhost:\n  budget: 1MiB\n"))
    daemon = InprocDaemon(Runtime(small))
    client = daemon.client()
    try:
        here = raised(lambda: Session(big_model(4 << 20), pool=small))
        there = raised(lambda: client.session(big_model(4 << 20)))
        assert isinstance(here, MemoryError), repr(here)
        assert isinstance(there, MemoryError) and isinstance(there, E.InsufficientMemory), repr(there)
    finally:
        client.close()
        daemon.stop()
        small.close()


@pytest.mark.parametrize("mistake, feeds, expected", WRONG_INPUTS, ids=[w[0] for w in WRONG_INPUTS])
def test_a_wrong_input_raises_the_same_class_in_process_and_through_the_client(
        served: tuple[Session, Any], mistake: str, feeds: dict[str, Any], expected: type[Exception]) -> None:
    local, remote = served
    here, there = raised(lambda: local.run(None, feeds)), raised(lambda: remote.run(None, feeds))
    assert type(here) is expected, here
    assert isinstance(there, expected) and isinstance(there, E.DaemonError), repr(there)
    assert isinstance(there, ValueError)


def test_models_that_cannot_load_raise_the_same_class_both_ways(served: tuple[Session, Any], pool: Any,
                                                                tmp_path: Path) -> None:
    _, remote = served
    missing = tmp_path / "absent.onnx"
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    cases: list[tuple[Any, type[BaseException]]] = [(unsupported_model(), UnsupportedOp),
                                                    (str(broken), ModelError), (str(missing), ModelError)]
    for source, expected in cases:
        here = raised(lambda: Session(source, pool=pool))
        there = raised(lambda: remote.client.session(source))
        assert isinstance(here, expected), repr(here)
        assert isinstance(there, expected) and isinstance(there, E.DaemonError), repr(there)
    assert isinstance(there, FileNotFoundError)  # the daemon's reply says why it could not read the file


def test_every_error_type_with_an_in_process_twin_derives_from_it() -> None:
    for name, bases in E.IN_PROCESS.items():
        assert issubclass(E.ERRORS[name], E.DaemonError), name
        assert all(issubclass(E.ERRORS[name], base) for base in bases), name
    assert str(E.ERRORS["FileNotFound"]("the daemon cannot read x")) == "the daemon cannot read x"
