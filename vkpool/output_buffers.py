"""Host memory the device writes a chunk's large outputs into, handed to the caller as arrays.

A run's output goes from device memory straight into host memory imported into the device
(``VK_EXT_external_memory_host``), and the array the caller gets is that memory: no copy on the
host. Imports are made once and recycled:

- each output of a chunk has an :class:`OutputBuffers` pool of at most ``cap``
  :class:`HostBuffer` (page-aligned anonymous mappings, each imported once);
- :meth:`HostBuffer.array` wraps the buffer in a fresh ``ctypes`` array, the exporter of the
  numpy array it returns. numpy collapses a view's base only through arrays of the same type, so
  every view, and every view of a view, keeps alive the array whose base is the exporter, which
  keeps the exporter alive: it dies when the last array or view over the buffer does, and a weak
  reference to it (``weakref.finalize``) puts the buffer back in its pool then, never earlier. A
  finalizer on the returned array would fire too soon (a view of a view records the array
  below it as base). ``__release_buffer__`` (PEP 688) would tell the same moment, but only from
  Python 3.12, and vkpool supports 3.10.
- the exporter keeps the mapping alive: :meth:`OutputBuffers.close` frees the imports, and arrays
  still held stay valid host memory until they go.
"""
from __future__ import annotations

import ctypes
import mmap
import threading
import weakref
from collections import deque
from typing import Any

import numpy as np

from vkpool import vk
from vkpool.memory import HostImport


class HostBuffer:
    """``nbytes`` of page-aligned host memory imported into ``device`` once. ``commands``: per
    run slot, the chunk's command buffer copying the output here."""

    def __init__(self, device: Any, nbytes: int) -> None:
        align = max(int(device.host_import_alignment), mmap.PAGESIZE)
        span = -(-nbytes // align) * align
        self.memory = mmap.mmap(-1, span + align - mmap.PAGESIZE)  # page-aligned: room to reach ``align``
        self.offset = -np.frombuffer(self.memory, np.uint8).ctypes.data % align
        self.nbytes = nbytes
        self.imported = HostImport(device, np.frombuffer(self.memory, np.uint8, span, self.offset))
        self.commands: dict[int, Any] = {}

    @property
    def allocation(self) -> Any:
        """The import, as the :class:`~vkpool.memory.Allocation` kernels and copies address."""
        return self.imported.allocation

    def array(self, dtype: Any, shape: tuple[int, ...], on_release: Any) -> np.ndarray:
        """The buffer as an array of ``dtype`` and ``shape``; ``on_release(self)`` runs once the
        array and every view of it are gone."""
        exporter = (ctypes.c_char * self.nbytes).from_buffer(self.memory, self.offset)
        weakref.finalize(exporter, on_release, self).atexit = False
        return np.frombuffer(exporter, dtype).reshape(shape)

    def free(self) -> None:
        """Ends the device's hold on the memory; the memory itself lives as long as an array over it."""
        self.imported.allocation.free()


class OutputBuffers:
    """At most ``cap`` :class:`HostBuffer` of ``nbytes`` each for one output of a chunk, the free
    ones ready for a run. Counters: ``imports`` (buffers made), ``reuses`` (runs given a buffer a
    caller had released), ``copies`` (runs that found every buffer held and copied instead)."""

    def __init__(self, device: Any, nbytes: int, cap: int) -> None:
        self.device = device
        self.nbytes = nbytes
        self.cap = cap
        self.buffers: list[HostBuffer] = []
        self._free: deque[HostBuffer] = deque()  # appended to by finalizers: no lock there
        self._lock = threading.Lock()
        self.closed = False
        self.imports = self.reuses = self.copies = 0

    def take(self) -> HostBuffer | None:
        """A free buffer (made if fewer than ``cap`` exist), or None: every one is held, or the
        device refused an import (then none is tried again)."""
        with self._lock:
            if self.closed:
                return None
            if self._free:
                self.reuses += 1
                return self._free.popleft()
            if len(self.buffers) >= self.cap:
                self.copies += 1
                return None
            try:
                buf = HostBuffer(self.device, self.nbytes)
            except (vk.VulkanError, ValueError, OSError):
                self.cap = len(self.buffers)
                self.copies += 1
                return None
            self.buffers.append(buf)
            self.imports += 1
            return buf

    def give_back(self, buf: HostBuffer) -> None:
        """Makes ``buf`` free again (nothing reads or writes it any more)."""
        if not self.closed:
            self._free.append(buf)

    def hand_out(self, buf: HostBuffer, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        """``buf`` as the caller's array; it comes back here when that array and its views are gone."""
        return buf.array(dtype, shape, self.give_back)

    def close(self) -> None:
        """Frees every import (the device done with them, and the command buffers copying into
        them freed); arrays still held stay valid."""
        with self._lock:
            self.closed = True
            self._free.clear()
            for buf in self.buffers:
                buf.free()
            self.buffers = []


__all__ = ["HostBuffer", "OutputBuffers"]
