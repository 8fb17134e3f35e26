"""Several requests in one Ray call, packed: one array per tensor, one row per request.

A Ray call costs the driver and the node's actor a fixed amount of work whatever it carries, and
so does every object in it: requests that travel together therefore travel as :class:`Rows`, one
array per tensor whose first dim is the request (``np.stack`` of the requests' tensors), not as
one dict of arrays per request. A request that failed keeps its error in ``failed`` and zeros in
its rows, so that the others of its call go on without it: a request fails alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np


@dataclass
class Rows:
    """``count`` requests' tensors: ``tensors[name][i]`` is request ``i``'s; ``failed``: the
    requests that failed (index → error)."""

    count: int
    tensors: dict[str, np.ndarray]
    failed: dict[int, BaseException] = field(default_factory=dict)

    @classmethod
    def pack(cls, feeds: Sequence[Mapping[str, np.ndarray]], names: Sequence[str]) -> Rows:
        """The requests' tensors ``names`` (each request has every name, all of one shape)."""
        return cls(len(feeds), {name: np.stack([f[name] for f in feeds]) for name in names})

    def row(self, index: int) -> dict[str, np.ndarray]:
        return {name: tensor[index] for name, tensor in self.tensors.items()}

    def writable(self) -> Rows:
        """These rows with every tensor writable (Ray hands over read-only arrays): each
        request's outputs are then views of one array per tensor, as free to write as those
        :meth:`vkpool.Session.run` returns."""
        tensors = {n: t if t.flags.writeable else t.copy() for n, t in self.tensors.items()}
        return Rows(self.count, tensors, self.failed)


def merge(parts: Sequence[Rows]) -> Rows:
    """The rows of several parts of the same requests (what several steps sent): every tensor,
    and every request that failed in any part (its first error)."""
    tensors: dict[str, np.ndarray] = {}
    failed: dict[int, BaseException] = {}
    for part in parts:
        tensors.update(part.tensors)
        for index, error in part.failed.items():
            failed.setdefault(index, error)
    return Rows(parts[0].count, tensors, failed)


class _Collector:
    """Gathers each request's outputs into one array per output name."""

    def __init__(self, count: int, failed: Mapping[int, BaseException]) -> None:
        self.rows = Rows(count, {}, dict(failed))

    def put(self, index: int, produced: Mapping[str, np.ndarray]) -> None:
        tensors = self.rows.tensors
        for name, value in produced.items():
            out = tensors.get(name)
            if out is None:
                out = tensors[name] = np.zeros((self.rows.count, *np.shape(value)), np.asarray(value).dtype)
            out[index] = value

    def fail(self, index: int, error: BaseException) -> None:
        self.rows.failed[index] = error


def pending(rows: Rows) -> list[dict[str, np.ndarray]]:
    """The feeds of each request of ``rows`` that has not failed, in order."""
    return [rows.row(i) for i in range(rows.count) if i not in rows.failed]


def gather(rows: Rows, results: Sequence[Mapping[str, np.ndarray] | Exception]) -> Rows:
    """The outputs of ``rows``' requests, packed: ``results`` holds, for each request that had
    not failed (in order, as :func:`pending` gives them), its outputs or its error."""
    out = _Collector(rows.count, rows.failed)
    live = (i for i in range(rows.count) if i not in rows.failed)
    for index, result in zip(live, results):
        if isinstance(result, Exception):
            out.fail(index, result)
        else:
            out.put(index, result)
    return out.rows

