"""What every benchmarked runtime provides: a probe, an optional conversion, and a loaded callable."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

#: A loaded model: takes the host feed, returns the output ``y`` on the host.
RunFn = Callable[[dict[str, np.ndarray]], np.ndarray]


class Unavailable(RuntimeError):
    """The runtime cannot run on this machine; the message says why."""


@dataclass(frozen=True)
class RunnerOptions:
    device: str | None = None  # vkpool device id (--device)
    endpoint: str | None = None  # the daemon's endpoint, for the daemon runner


def is_add_chain(workload: str) -> bool:
    return workload.startswith("add_chain_")


class Runner(ABC):
    """One runtime. Subclasses import their library lazily so that probing one never needs another."""

    name: ClassVar[str]
    #: vkpool's own runners are compared against the best of the others.
    is_vkpool: ClassVar[bool] = False

    def __init__(self, options: RunnerOptions | None = None) -> None:
        self.options = options or RunnerOptions()

    @abstractmethod
    def probe(self) -> str | None:
        """Raise Unavailable with the reason when the runtime can't run here; else say what runs
        (version, device) in a few words for the report."""

    def prepare(self, onnx_path: Path, workload: str) -> Path:
        """Convert the model where the runtime needs its own format (done once, outside timing)."""
        del workload
        return onnx_path

    @abstractmethod
    def load(self, model_path: Path, workload: str) -> RunFn:
        """Load the prepared model and return the function the protocol times."""
