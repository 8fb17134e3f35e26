"""The device pool: members built from discovery and config, each with a hard memory budget.

Member ids: ``vk<N>`` for physical device N, ``vk<N>.<K>`` for the K-th member of a split
device, ``cpu`` for the host member.
"""
from __future__ import annotations

import fnmatch
import threading
from collections import Counter
from typing import Any, Iterable

import numpy as np

from vkpool.config.loader import Config, ConfigError, DeviceRule, load_config
from vkpool import inline_weights, progress
from vkpool.discovery import PhysicalDeviceInfo, discover
from vkpool.ledger import HOST_KEY, member_key
from vkpool.memory import HOST_BLOCK_BYTES, Allocation, BlockAllocator, Budget, DeviceOutOfMemory
from vkpool.units import format_size, parse_size

#: default budget of a device no rule budgets: this fraction of its device-local heap's budget
DEFAULT_BUDGET_FRACTION = 0.90
STAGING_CHUNK_BYTES = 32 << 20


def matches(info: PhysicalDeviceInfo, selector: dict[str, Any]) -> bool:
    """Whether a device satisfies every key of ``selector`` (index, name glob, vendor, type, uuid)."""
    for key, want in selector.items():
        if key == "index" and info.index != int(want):
            return False
        if key == "name" and not fnmatch.fnmatch(info.name.lower(), str(want).lower()):
            return False
        if key == "vendor" and info.vendor.lower() != str(want).lower():
            return False
        if key == "type" and info.type != str(want).lower():
            return False
        if key == "uuid" and info.uuid.lower().replace("-", "") != str(want).lower().replace("-", ""):
            return False
    return True


class Member:
    """A pool member: somewhere a chunk of a model can run, with its own budget."""

    kind = ""

    def __init__(self, member_id: str, budget_bytes: int, ledger_key: str | None = None) -> None:
        self.id = member_id
        # with a ledger key the budget is machine-wide (vkpool.ledger); without, this object's own
        self.budget = Budget(member_id, budget_bytes, ledger_key)
        #: the config's planner speeds for this member (``cost:``), over its calibration
        self.cost_override: dict[str, float] = {}

    @property
    def budget_bytes(self) -> int:
        return self.budget.budget_bytes

    @property
    def used_bytes(self) -> int:
        """What every vkpool process on this machine holds on the member."""
        return self.budget.machine_used_bytes

    def describe(self) -> dict[str, Any]:
        """The member, with ``used_bytes`` counting every process and ``holders`` naming them."""
        held = self.budget.holders()
        return {"id": self.id, "kind": self.kind, "budget_bytes": self.budget_bytes,
                "used_bytes": sum(h.nbytes for h in held) if self.budget.key else self.used_bytes,
                "holders": [{"pid": h.pid, "command": h.command, "member": h.member, "bytes": h.nbytes}
                            for h in held]}

    def close(self) -> None:
        pass


class HostAllocation:
    """Host memory of the ``cpu`` member: a numpy byte array charged to its budget."""

    def __init__(self, member: HostMember, nbytes: int) -> None:
        self.member = member
        self.nbytes = nbytes
        self.data = np.empty(nbytes, dtype=np.uint8)
        self.freed = False

    def view(self, dtype: Any = np.uint8, shape: tuple[int, ...] | None = None) -> np.ndarray:
        arr = self.data.view(dtype)
        return arr.reshape(shape) if shape is not None else arr

    def free(self) -> None:
        if self.freed:
            raise ValueError("allocation freed twice")
        self.freed = True
        self.member.budget.release(self.nbytes)


class HostMember(Member):
    """The host CPU: chunks run as onnxruntime sessions or with numpy (``engine``, the config's
    ``host.engine``: :mod:`vkpool.host_engine`)."""

    kind = "host"

    def __init__(self, budget_bytes: int, ledger_key: str | None = None, engine: str = "auto") -> None:
        super().__init__("cpu", budget_bytes, ledger_key)
        self.info = None
        self.engine = engine

    def describe(self) -> dict[str, Any]:
        from vkpool.host_engine import engine_label

        return {**super().describe(), "engine": engine_label(self.engine)}

    def alloc(self, nbytes: int) -> HostAllocation:
        self.budget.reserve(int(nbytes))
        return HostAllocation(self, int(nbytes))

    def upload(self, alloc: HostAllocation, array: np.ndarray) -> None:
        alloc.data[: array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)

    def download(self, alloc: HostAllocation, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return alloc.view(dtype, shape).copy()


class VulkanMember(Member):
    """A Vulkan device, or one split of it (members of a split share the logical device)."""

    kind = "vulkan"

    def __init__(self, member_id: str, info: PhysicalDeviceInfo, device: Any, budget_bytes: int,
                 split_index: int | None = None, ledger_key: str | None = None) -> None:
        super().__init__(member_id, budget_bytes, ledger_key)
        self.info = info
        self.device = device
        self.split_index = split_index
        self.local = BlockAllocator(device, device.device_type, self.budget, name=member_id)
        # Inputs and outputs live in host-visible memory; where device memory is itself
        # host-visible (lavapipe, integrated GPUs, ReBAR) that is the same allocator.
        self.io = self.local if device.device_type_host_visible else BlockAllocator(
            device, device.host_type, self.budget, block_bytes=HOST_BLOCK_BYTES, name=member_id)
        # Inputs go to device memory the host can write where the device has it: kernels then
        # read them at device speed, with no copy on the device first.
        mapped = device.mapped_device_type
        self.inputs: BlockAllocator | None = (
            self.local if mapped == device.device_type else None if mapped is None else BlockAllocator(
                device, mapped, self.budget, block_bytes=HOST_BLOCK_BYTES, name=member_id))
        self._staging = BlockAllocator(device, device.host_type, None, block_bytes=HOST_BLOCK_BYTES,
                                       name=f"{member_id} staging")
        self._staging_lock = threading.Lock()

    @property
    def device_local_inputs(self) -> bool:
        """Whether :meth:`alloc` with ``input=True`` gives host-writable device memory."""
        return self.inputs is not None

    def _allocators(self) -> list[BlockAllocator]:
        return list({id(a): a for a in (self.local, self.io, self.inputs) if a is not None}.values())

    @property
    def allocations(self) -> int:
        return sum(a.allocations for a in self._allocators())

    def alloc(self, nbytes: int, *, host_visible: bool = False, input: bool = False) -> Allocation:
        """Device memory; with ``host_visible`` memory the host maps (inputs and outputs); with
        ``input`` too, device memory the host maps where the device has it."""
        if host_visible and input and self.inputs is not None:
            return self.inputs.alloc(nbytes)
        return (self.io if host_visible else self.local).alloc(nbytes)

    def upload(self, alloc: Allocation, array: np.ndarray, *, transpose: bool = False) -> None:
        """Copies ``array`` into ``alloc``: a memcpy into mapped memory, or through staging.
        With ``transpose``, a 2-D array is stored transposed. Either way the source is read a
        block of its rows at a time and each block's pages are released once copied, so host
        memory holds no second copy of a weight and a weight read in place from its file
        (:mod:`vkpool.inline_weights`) never becomes resident as a whole."""
        if array.nbytes > alloc.nbytes:
            raise ValueError(f"{self.id}: {array.nbytes} bytes do not fit an allocation of {alloc.nbytes}")
        # rows of the source: a 2-D array's to transpose, else single elements of the flat array
        src = array if transpose else np.ascontiguousarray(array).reshape(-1)
        rows = src.shape[0]
        row_bytes = src.itemsize * (src.shape[1] if transpose else 1)
        step = max(1, STAGING_CHUNK_BYTES // max(1, row_bytes))
        if alloc.host_visible:
            out = alloc.view()[: src.nbytes].view(src.dtype)
            if transpose:
                out = out.reshape(src.shape[1], rows)
            for r0 in range(0, rows, step):
                if transpose:
                    out[:, r0:r0 + step] = src[r0:r0 + step].T
                else:
                    out[r0:r0 + step] = src[r0:r0 + step]
                inline_weights.release(src[r0:r0 + step])
                progress.advance("upload", src[r0:r0 + step].nbytes)
            return
        with self._staging_lock:
            stage = self._staging.alloc(max(1, min(step * row_bytes, src.nbytes)))
            try:
                for r0 in range(0, rows, step):
                    block = src[r0:r0 + step]
                    n = block.shape[0]
                    if transpose:  # block.T lands as n-element pieces of every row of the result
                        cols = src.shape[1]
                        stage.view()[: block.nbytes] = np.ascontiguousarray(block.T).reshape(-1).view(np.uint8)
                        regions = np.empty((cols, 3), np.uint64)
                        item = src.itemsize
                        regions[:, 0] = stage.offset + np.arange(cols, dtype=np.uint64) * (n * item)
                        regions[:, 1] = alloc.offset + (np.arange(cols, dtype=np.uint64) * rows + r0) * item
                        regions[:, 2] = n * item
                        self.device.run_once([("copy_regions", stage.buffer, alloc.buffer, regions)])
                    else:
                        stage.view()[: block.nbytes] = block.reshape(-1).view(np.uint8)
                        self.device.run_once([("copy", stage.buffer, stage.offset, alloc.buffer,
                                               alloc.offset + r0 * row_bytes, block.nbytes)])
                    inline_weights.release(block)
                    progress.advance("upload", block.nbytes)
            finally:
                stage.free()

    def download(self, alloc: Allocation, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if alloc.host_visible:
            return alloc.view()[:nbytes].view(dtype).reshape(shape).copy()
        out = np.empty(nbytes, dtype=np.uint8)
        with self._staging_lock:
            stage = self._staging.alloc(min(STAGING_CHUNK_BYTES, max(nbytes, 1)))
            try:
                for start in range(0, nbytes, stage.nbytes):
                    size = min(stage.nbytes, nbytes - start)
                    self.device.run_once([("copy", alloc.buffer, alloc.offset + start, stage.buffer,
                                           stage.offset, size), ("host_barrier",)])
                    out[start:start + size] = stage.view()[:size]
            finally:
                stage.free()
        return out.view(dtype).reshape(shape)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["device"] = self.info.to_dict()
        d["split_index"] = self.split_index
        return d

    def close(self) -> None:
        for allocator in self._allocators():
            allocator.close()
        self._staging.close()


class DevicePool:
    """Every member vkpool may use, with budgets. Build with :meth:`from_config`."""

    def __init__(self, members: Iterable[Member], devices: dict[int, Any] | None = None,
                 config: Config | None = None) -> None:
        self.members: list[Member] = list(members)
        self._by_id = {m.id: m for m in self.members}
        self._devices = devices or {}
        self.config = config

    @classmethod
    def from_config(cls, config: Config | str | None = None, *, infos: list[PhysicalDeviceInfo] | None = None,
                    only: str | None = None) -> DevicePool:
        """Builds the pool from a config (object, path, or None for ``$VKPOOL_CONFIG``/default).
        ``only``: the id of the one Vulkan member to build (its budget and ledger key as in the
        whole pool; no host member), as a daemon's serving process of one device uses it."""
        cfg = config if isinstance(config, Config) else load_config(config)
        infos = discover() if infos is None else infos
        plan = resolve_members(cfg, infos)
        splits = Counter(info.index for _, info, _, _ in plan)  # of the whole pool: the ledger keys
        if only is not None:
            if only not in {member_id for member_id, *_ in plan}:
                raise KeyError(f"no Vulkan pool member {only!r}; members: "
                               f"{', '.join(m for m, *_ in plan) or 'none'}")
            plan = [entry for entry in plan if entry[0] == only]
        from vkpool.device import LogicalDevice

        devices: dict[int, Any] = {}
        members: list[Member] = []
        for member_id, info, budget, split_index in plan:
            rule = next((r for r in cfg.devices if matches(info, r.match)), None)
            if info.index not in devices:
                devices[info.index] = LogicalDevice(info, rule.transfer_queue if rule is not None else "auto")
            key = member_key(info.uuid, split_index, splits[info.index])
            members.append(VulkanMember(member_id, info, devices[info.index], budget, split_index, key))
            members[-1].cost_override = dict(rule.cost) if rule is not None else {}
        if cfg.host.enabled and only is None:
            members.append(HostMember(parse_size(cfg.host.budget), HOST_KEY, cfg.host.engine))
            members[-1].cost_override = dict(cfg.host.cost)
        return cls(members, devices, cfg)

    def member(self, member_id: str) -> Member:
        try:
            return self._by_id[member_id]
        except KeyError:
            raise KeyError(
                f"no pool member {member_id!r}; members: {', '.join(self._by_id) or 'none'}"
            ) from None

    def __contains__(self, member_id: str) -> bool:
        return member_id in self._by_id

    @property
    def vulkan_members(self) -> list[VulkanMember]:
        return [m for m in self.members if isinstance(m, VulkanMember)]

    def select(self, **selector: Any) -> list[Member]:
        """Vulkan members whose device matches ``selector`` (index, name, vendor, type, uuid)."""
        return [m for m in self.vulkan_members if matches(m.info, selector)]

    def set_budget(self, member_id: str, budget: int | str) -> None:
        """Changes a member's budget at run time; refused (ValueError) below what it holds."""
        member = self.member(member_id)
        of = member.info.device_local_heap.size if isinstance(member, VulkanMember) else None
        nbytes = parse_size(budget, of=of)
        if isinstance(member, VulkanMember) and nbytes > member.info.device_local_heap.size:
            raise ValueError(f"{member_id}: {format_size(nbytes)} is more than the device's heap "
                             f"({format_size(member.info.device_local_heap.size)})")
        member.budget.set_budget(nbytes)

    def describe(self) -> list[dict[str, Any]]:
        return [m.describe() for m in self.members]

    def close(self) -> None:
        for m in self.members:
            m.close()
        for d in self._devices.values():
            d.close()
        self._devices = {}


def _heap_bytes(info: PhysicalDeviceInfo) -> int:
    return info.device_local_heap.size


def default_budget(info: PhysicalDeviceInfo, split: int = 1) -> int:
    heap = info.device_local_heap
    available = heap.budget if heap.budget else heap.size
    return int(available * DEFAULT_BUDGET_FRACTION) // split


def resolve_members(cfg: Config, infos: list[PhysicalDeviceInfo]
                    ) -> list[tuple[str, PhysicalDeviceInfo, int, int | None]]:
    """(member id, device, budget bytes, split index) for every member the config asks for."""
    usable = [i for i in infos if i.usable]
    for rule in cfg.devices:
        if not any(matches(i, rule.match) for i in infos):
            names = ", ".join(f"{i.index}: {i.name} ({i.vendor}, {i.type})" for i in infos) or "none"
            raise cfg.where.error(f"{rule.key}.match", f"{rule.match} matches no device (devices: {names})")
    out: list[tuple[str, PhysicalDeviceInfo, int, int | None]] = []
    for info in usable:
        rule = next((r for r in cfg.devices if matches(info, r.match)), None)
        if rule is not None and rule.exclude:
            continue
        split = rule.split if rule else 1
        budgets = _budgets(rule, info, split, cfg) if rule and rule.budget else [default_budget(info, split)] * split
        for k in range(split):
            member_id = f"vk{info.index}.{k}" if split > 1 else f"vk{info.index}"
            out.append((member_id, info, budgets[k], k if split > 1 else None))
    return out


def _budgets(rule: DeviceRule, info: PhysicalDeviceInfo, split: int, cfg: Config) -> list[int]:
    heap = _heap_bytes(info)
    raw = rule.budget or []
    values = [parse_size(b, of=heap) for b in raw]
    if len(values) == 1 and split > 1:
        values = values * split
    key = f"{rule.key}.budget"
    for v in values:
        if v > heap:
            raise cfg.where.error(key, f"{format_size(v)} is more than the heap of {info.name} ({format_size(heap)})")
    if sum(values) > heap:
        raise cfg.where.error(key, f"the split budgets add up to {format_size(sum(values))}, more than the heap of "
                                   f"{info.name} ({format_size(heap)})")
    return values


__all__ = ["DevicePool", "Member", "VulkanMember", "HostMember", "DeviceOutOfMemory", "ConfigError", "matches"]
