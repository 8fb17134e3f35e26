"""Device memory: hard per-member budgets and sub-allocation from large blocks.

Each pool member owns a :class:`Budget` and allocators on its device. A request is charged
to the budget before any Vulkan memory is touched, so the budget is a hard cap on what the
member holds (the bytes asked for; alignment padding and the unused tail of a block are
bounded by one block per memory type and are not charged). Blocks are ``VkDeviceMemory``
with one ``VkBuffer`` over all of it, bound once; an allocation is an offset into a block
and its device address is the block's address plus that offset.
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from vkpool import vk
from vkpool.units import format_size

if TYPE_CHECKING:
    from vkpool.device import LogicalDevice

ALIGNMENT = 256  # covers minStorageBufferOffsetAlignment and 16-byte vector loads on every device seen
DEFAULT_BLOCK_BYTES = 64 << 20
#: Blocks of host memory (inputs, outputs, staging) are small: drivers pin and populate host-visible
#: memory when it is allocated, so every byte of a block counts in the process's resident memory
#: whether or not a tensor uses it. Requests above half a block get an allocation of their own.
HOST_BLOCK_BYTES = 1 << 20


class DeviceOutOfMemory(MemoryError):
    """A member's budget (or the device itself) cannot hold a request."""

    def __init__(self, member: str, requested: int, used: int, budget: int, reason: str = "",
                 advice: str | None = None) -> None:
        self.member = member
        self.requested = requested
        self.used = used
        self.budget = budget
        why = reason or "over budget"
        if requested <= 0 and budget <= 0:  # no single request: a whole model's placement failed
            super().__init__(f"{member}: the model does not fit: {why}. Raise the budgets or free memory.")
            return
        super().__init__(
            f"{member}: cannot allocate {format_size(requested)} ({requested} bytes): {why}; "
            f"{format_size(used)} of {format_size(budget)} in use ({used} of {budget} bytes). "
            + (advice if advice is not None else f"Raise the budget of {member} or free memory.")
        )


class Budget:
    """Thread-safe accounting of a member's bytes against its cap.

    With a ``key`` the cap is machine-wide: a request is checked against what every vkpool
    process holds on the member (:mod:`vkpool.ledger`), and this one's bytes are recorded there.
    ``used_bytes`` stays what this budget's own allocations hold; :attr:`machine_used_bytes`
    and :meth:`holders` tell about every process."""

    def __init__(self, member: str, budget_bytes: int, key: str | None = None) -> None:
        self.member = member
        self.budget_bytes = int(budget_bytes)
        self.used_bytes = 0
        self.peak_bytes = 0
        self.key = key
        self._ledger = None
        if key is not None:
            from vkpool.ledger import machine_ledger

            self._ledger = machine_ledger()
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> None:
        with self._lock:
            if self._ledger is not None:
                self._ledger.reserve(self.key, self.member, nbytes, self.budget_bytes)
            elif self.used_bytes + nbytes > self.budget_bytes:
                raise DeviceOutOfMemory(self.member, nbytes, self.used_bytes, self.budget_bytes)
            self.used_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def release(self, nbytes: int) -> None:
        with self._lock:
            if nbytes > self.used_bytes:
                raise AssertionError(f"{self.member}: releasing {nbytes} bytes but only {self.used_bytes} used")
            if self._ledger is not None:
                self._ledger.release(self.key, nbytes)
            self.used_bytes -= nbytes

    def set_budget(self, budget_bytes: int) -> None:
        with self._lock:
            if self._ledger is not None:
                self._ledger.check_budget(self.key, self.member, budget_bytes)
            elif budget_bytes < self.used_bytes:
                raise ValueError(
                    f"{self.member}: a budget of {format_size(budget_bytes)} is below the "
                    f"{format_size(self.used_bytes)} already in use"
                )
            self.budget_bytes = int(budget_bytes)

    @property
    def machine_used_bytes(self) -> int:
        """What every vkpool process on this machine holds on the member (this budget's bytes
        alone without a ledger key)."""
        return self._ledger.used_bytes(self.key) if self._ledger is not None else self.used_bytes

    def holders(self) -> list[Any]:
        """Every live process's :class:`~vkpool.ledger.Holding` on the member (empty without a key)."""
        return self._ledger.holders(self.key) if self._ledger is not None else []

    @property
    def free_bytes(self) -> int:
        """What a new allocation may take: the cap less what every process holds."""
        return self.budget_bytes - self.machine_used_bytes


@dataclass(eq=False)
class Block:
    memory: Any
    buffer: Any
    size: int
    address: int
    mapped: np.ndarray | None  # uint8 view of the whole block when host-visible
    dedicated: bool
    holes: list[tuple[int, int]] = field(default_factory=list)  # sorted (offset, size)
    live: int = 0


@dataclass(eq=False)
class Allocation:
    """``nbytes`` at ``offset`` of ``block``: what a tensor on a Vulkan member lives in."""

    allocator: BlockAllocator
    block: Block
    offset: int
    nbytes: int
    span: int  # bytes taken from the block (aligned)
    freed: bool = False

    @property
    def address(self) -> int:
        return self.block.address + self.offset

    @property
    def buffer(self) -> Any:
        return self.block.buffer

    @property
    def host_visible(self) -> bool:
        return self.block.mapped is not None

    @property
    def device_local(self) -> bool:
        """Whether the bytes are in the device's own memory (kernels read them at device speed);
        memory imported from the host (:class:`HostImport`) is not."""
        device = self.allocator.device
        return self.allocator.memory_type in (device.device_type, device.mapped_device_type)

    def view(self, dtype: Any = np.uint8, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A numpy view of the mapped bytes (host-visible memory only)."""
        if self.block.mapped is None:
            raise ValueError("allocation is not host-visible")
        raw = self.block.mapped[self.offset:self.offset + self.nbytes]
        arr = raw.view(dtype)
        return arr.reshape(shape) if shape is not None else arr

    def free(self) -> None:
        self.allocator.free(self)


class HostImport:
    """Host memory this process owns (a shared mapping), imported into a device with
    ``VK_EXT_external_memory_host`` so that kernels read and write it in place. Not charged
    to a budget: it is not device memory. ``allocation`` is an :class:`Allocation` over all
    of it; :meth:`free` (through the allocation) releases the device's hold on it."""

    memory_type = None  # none of the device's own memory types (see Allocation.device_local)

    def __init__(self, device: LogicalDevice, region: np.ndarray) -> None:
        self.device = device
        view = region.view(np.uint8).reshape(-1)
        memory, buffer, address = device.import_host(view.ctypes.data, view.nbytes)
        block = Block(memory, buffer, view.nbytes, address, view, dedicated=True)
        self.allocation = Allocation(self, block, 0, view.nbytes, view.nbytes)  # type: ignore[arg-type]

    def free(self, alloc: Allocation) -> None:
        if alloc.freed:
            return
        alloc.freed = True
        self.device.destroy_block(alloc.block.memory, alloc.block.buffer, mapped=False)


class BlockAllocator:
    """First-fit sub-allocation from blocks of one memory type, charged to a :class:`Budget`.

    ``budget`` may be None for memory that is not the member's to account (host staging).
    """

    def __init__(
        self,
        device: LogicalDevice,
        memory_type: int,
        budget: Budget | None,
        *,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        name: str = "",
    ) -> None:
        self.device = device
        self.memory_type = memory_type
        self.budget = budget
        #: the largest single VkDeviceMemory the device allows (maxMemoryAllocationSize; 0: not reported)
        self.max_allocation = int(getattr(getattr(device, "info", None), "max_memory_allocation_bytes", 0) or 0)
        self.block_bytes = min(block_bytes, self.max_allocation // ALIGNMENT * ALIGNMENT or block_bytes)
        self.name = name or (budget.member if budget else device.name)
        self.blocks: list[Block] = []
        self._lock = threading.Lock()
        self.allocations = 0  # counter: tests prove no allocation happens per run

    def alloc(self, nbytes: int) -> Allocation:
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"negative allocation size {nbytes}")
        span = max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)
        if self.budget is not None:
            self.budget.reserve(nbytes)
        try:
            with self._lock:
                self.allocations += 1
                if span > self.block_bytes // 2:
                    block = self._new_block(span, dedicated=True)
                    block.holes = []
                    block.live = 1
                    return Allocation(self, block, 0, nbytes, span)
                for block in self.blocks:
                    if block.dedicated:
                        continue
                    got = self._take(block, span)
                    if got is not None:
                        return Allocation(self, block, got, nbytes, span)
                block = self._new_block(self.block_bytes, dedicated=False)
                offset = self._take(block, span)
                assert offset is not None
                return Allocation(self, block, offset, nbytes, span)
        except BaseException:
            if self.budget is not None:
                self.budget.release(nbytes)
            raise

    def free(self, alloc: Allocation) -> None:
        with self._lock:
            if alloc.freed:
                raise ValueError("allocation freed twice")
            alloc.freed = True
            block = alloc.block
            block.live -= 1
            if block.dedicated:
                self._destroy_block(block)
            else:
                self._give_back(block, alloc.offset, alloc.span)
                # keep one empty block for the next request; give further empty ones back
                if block.live == 0 and any(b.live == 0 and not b.dedicated for b in self.blocks if b is not block):
                    self._destroy_block(block)
        if self.budget is not None:
            self.budget.release(alloc.nbytes)

    def close(self) -> None:
        with self._lock:
            for block in list(self.blocks):
                self._destroy_block(block)

    # -- internals (called with the lock held) ---------------------------------------------
    @staticmethod
    def _take(block: Block, span: int) -> int | None:
        for i, (off, size) in enumerate(block.holes):
            if size >= span:
                if size == span:
                    del block.holes[i]
                else:
                    block.holes[i] = (off + span, size - span)
                block.live += 1
                return off
        return None

    @staticmethod
    def _give_back(block: Block, offset: int, span: int) -> None:
        holes = block.holes
        i = bisect.bisect_left(holes, (offset, 0))
        start, size = offset, span
        if i < len(holes) and holes[i][0] == start + size:  # merge with the next hole
            size += holes[i][1]
            del holes[i]
        if i > 0 and holes[i - 1][0] + holes[i - 1][1] == start:  # and the previous one
            start, size = holes[i - 1][0], holes[i - 1][1] + size
            del holes[i - 1]
            i -= 1
        holes.insert(i, (start, size))

    def _new_block(self, size: int, *, dedicated: bool) -> Block:
        if self.max_allocation and size > self.max_allocation:
            used = self.budget.used_bytes if self.budget else 0
            cap = self.budget.budget_bytes if self.budget else 0
            raise DeviceOutOfMemory(self.name, size, used, cap, f"one tensor of {format_size(size)} is more than the "
                                    f"device allocates at once (maxMemoryAllocationSize "
                                    f"{format_size(self.max_allocation)})",
                                    advice="Place the model's largest tensors on another member.")
        try:
            memory, buffer, address, mapped = self.device.create_block(size, self.memory_type, dedicated=dedicated)
        except vk.VulkanError as exc:
            if exc.result_name in ("VK_ERROR_OUT_OF_DEVICE_MEMORY", "VK_ERROR_OUT_OF_HOST_MEMORY"):
                used = self.budget.used_bytes if self.budget else 0
                cap = self.budget.budget_bytes if self.budget else 0
                raise DeviceOutOfMemory(self.name, size, used, cap, f"the device refused ({exc.result_name})")
            raise
        block = Block(memory, buffer, size, address, mapped, dedicated, holes=[(0, size)])
        self.blocks.append(block)
        return block

    def _destroy_block(self, block: Block) -> None:
        self.blocks.remove(block)
        self.device.destroy_block(block.memory, block.buffer, mapped=block.mapped is not None)

    # -- introspection --------------------------------------------------------------------
    @property
    def reserved_bytes(self) -> int:
        """Bytes of device memory held in blocks (what the driver sees)."""
        return sum(b.size for b in self.blocks)
