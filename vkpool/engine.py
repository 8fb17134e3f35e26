"""Compiling a run of graph nodes for one pool member, and running it.

A :class:`VulkanChunk` is what one member executes as one command buffer:

1. one op object per node, built from the registry with static shapes;
2. weights uploaded once to device memory;
3. activations placed in one arena by liveness (a tensor's bytes are reused once its last
   reader has run), inputs and outputs in persistently mapped host-visible memory;
4. dispatches grouped into dependency levels: a node's level is one more than the levels of
   what produced its inputs and of what last touched the memory its outputs reuse, so a
   barrier stands only between levels, never between independent dispatches;
5. one command buffer recorded once; a run writes the inputs, submits, waits, reads outputs
   (large ones the device writes into host memory handed to the caller: :mod:`vkpool.output_buffers`).

A :class:`HostChunk` runs the same nodes on the host (the ``cpu`` member): as one onnxruntime
session of the chunk's subgraph where it can, else with the ops' numpy references
(:mod:`vkpool.host_engine`).
"""
from __future__ import annotations

import bisect
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from vkpool import progress, shaders
from vkpool.host_engine import open_engine
from vkpool.kernels.base import DispatchContext, Op, OpError, TensorInfo, check_grid, pack_push_constants
from vkpool.kernels.registry import create_op
from vkpool.memory import DeviceOutOfMemory
from vkpool.model import Node
from vkpool.output_buffers import HostBuffer, OutputBuffers

if TYPE_CHECKING:
    from vkpool.device import Timeline


#: chunk outputs of at least this size are written to device memory and copied out at the end.
#: NOTE: H200, driver 580, bench/input_placement.py --staged-output-bytes: a 64 KiB Softmax row
#: and a 16 KiB one written straight to host memory ran matmul_1GB_1layer in 275.5 µs and
#: matmul_1GB_16layers in 337.5 µs, against 280.0 and 339.8 µs copied out after a barrier
STAGED_OUTPUT_BYTES = 128 * 1024

#: chunk outputs of at least this size computed in device memory are copied by the device into
#: host memory imported into it (``VK_EXT_external_memory_host``), which the caller gets as the
#: array (:mod:`vkpool.output_buffers`): no copy on the host. Why 1 MiB: the copy it saves is
#: about 80 µs a MiB for one thread (12.3 MiB took 957 µs on the H200's host), so from 1 MiB it
#: dwarfs what the path adds per run (handing a buffer out and taking it back, 4-8 µs of Python on
#: the development VM; on the device a second command buffer and barrier, not measured on a GPU),
#: while each such output holds up to ``IMPORTED_OUTPUT_BUFFERS`` imports of its size (pinned host
#: memory, and device memory objects, of which drivers allow a few thousand).
IMPORTED_OUTPUT_BYTES = 1 << 20
#: host buffers per such output: a run whose caller holds this many of that output's arrays copies
#: it out of the run slot's memory instead, as below the threshold
IMPORTED_OUTPUT_BUFFERS = 4


@dataclass(eq=False)
class TensorHandle:
    """Where a tensor lives on a Vulkan member: an allocation plus a byte offset."""

    alloc: Any
    offset: int
    nbytes: int

    @property
    def address(self) -> int:
        return self.alloc.address + self.offset


def build_ops(nodes: Sequence[Node], tensors: dict[str, TensorInfo], constants: dict[str, np.ndarray],
              opset: int) -> list[Op]:
    """One op object per node; raises OpError where the op's shapes disagree with inference."""
    ops = []
    for node in nodes:
        infos = [tensors[n] if n else None for n in node.inputs]
        consts = {i: constants[n] for i, n in enumerate(node.inputs) if n and n in constants}
        op = create_op(node.op_type, node.attrs, infos, consts, domain=node.domain, opset=opset,
                       num_outputs=len(node.outputs))
        outs = op.output_infos()
        for name, info in zip(node.outputs, outs):
            if not name:
                continue
            known = tensors.get(name)
            if known is not None and (known.shape != info.shape or known.dtype != info.dtype):
                raise OpError(
                    f"node {node.name or node.op_type}: output {name!r} is {info.shape} {info.dtype} by the "
                    f"kernel but {known.shape} {known.dtype} by shape inference"
                )
            tensors[name] = info
        ops.append(op)
    return ops


@dataclass
class _Region:
    offset: int
    size: int
    level: int  # the highest dependency level that touched these bytes


class ArenaPlanner:
    """First-fit placement of tensors in one arena, tracking the level that last touched each byte.

    A freed range remembers the highest dependency level of the nodes that read or wrote it, so
    a later tensor placed there is written only after those nodes ran (the WAR/WAW hazard).
    """

    ALIGN = 256

    def __init__(self) -> None:
        self.free: list[_Region] = []  # sorted by offset, coalesced
        self.end = 0  # high-water mark

    def alloc(self, nbytes: int) -> tuple[int, int]:
        size = max(self.ALIGN, -(-nbytes // self.ALIGN) * self.ALIGN)
        for i, r in enumerate(self.free):
            if r.size >= size:
                off, level = r.offset, r.level
                if r.size == size:
                    del self.free[i]
                else:
                    self.free[i] = _Region(r.offset + size, r.size - size, r.level)
                return off, level
        if self.free and self.free[-1].offset + self.free[-1].size == self.end:
            last = self.free.pop()  # grow the trailing free range instead of leaving it unused
            self.end = last.offset + size
            return last.offset, last.level
        off = self.end
        self.end += size
        return off, 0

    def release(self, offset: int, nbytes: int, level: int) -> None:
        size = max(self.ALIGN, -(-nbytes // self.ALIGN) * self.ALIGN)
        keys = [r.offset for r in self.free]
        i = bisect.bisect_left(keys, offset)
        region = _Region(offset, size, level)
        if i < len(self.free) and self.free[i].offset == offset + size:
            nxt = self.free.pop(i)
            region = _Region(offset, size + nxt.size, max(level, nxt.level))
        if i > 0 and self.free[i - 1].offset + self.free[i - 1].size == offset:
            prev = self.free.pop(i - 1)
            region = _Region(prev.offset, prev.size + region.size, max(prev.level, region.level))
            i -= 1
        self.free.insert(i, region)


@dataclass
class ChunkStats:
    weight_bytes: int = 0
    arena_bytes: int = 0
    io_bytes: int = 0
    peak_live_bytes: int = 0  # the largest set of activations alive at once
    dispatches: int = 0
    barriers: int = 0
    levels: int = 0


@dataclass
class _Tensor:
    info: TensorInfo
    kind: str  # "input" | "output" | "const" | "arena"
    base: str  # the tensor whose storage this one uses (itself unless a view)
    handle: TensorHandle | None = None
    producer_level: int = 0
    access_level: int = 0
    last_use: int = -1
    offset: int = 0


def _address(handle: TensorHandle) -> int:
    return handle.address


def _copy(src: TensorHandle, dst: TensorHandle, caps: Any) -> list[Any]:
    """Work copying ``dst.nbytes`` bytes within a chunk: a copy shader moving 32-bit words where
    both ends are word-aligned (it keeps the chunk's barriers compute-to-compute; a transfer
    command between dispatches needs barriers over the transfer stage too, which cost far
    more on NVIDIA), else a transfer command ``("copy", src, dst)``."""
    from vkpool.kernels.ops.movement import strided_copy

    words, rest = divmod(dst.nbytes, 4)
    aligned = (src.alloc.offset + src.offset) % 4 == 0 and (dst.alloc.offset + dst.offset) % 4 == 0
    if rest or not aligned or words >= 2**31:
        return [("copy", src, dst)]
    return strided_copy(src, dst, [words], [1], np.dtype(np.uint32), caps)


#: outputs at least this large are copied out of mapped memory by several threads at once: one
#: thread's copy of GPT-2's 25.7 MB logits took 2.7 ms on the H200's host (NOTE: see
#: docs/benchmarks.md, "After the transformer fusion")
PARALLEL_COPY_BYTES = 8 << 20
_COPY_THREADS = max(1, min(8, (os.cpu_count() or 1)))
_copy_pool: ThreadPoolExecutor | None = None
_copy_pool_lock = threading.Lock()


def copy_out(view: np.ndarray) -> np.ndarray:
    """A copy of ``view`` (a mapped output) that the caller owns; large ones in parallel slices
    (numpy releases the interpreter lock while it copies)."""
    if view.nbytes < PARALLEL_COPY_BYTES or _COPY_THREADS == 1 or not view.flags.c_contiguous:
        return view.copy()
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None:
            _copy_pool = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="vkpool-copy")
    out = np.empty_like(view)
    src, dst = view.reshape(-1), out.reshape(-1)
    step = -(-src.size // _COPY_THREADS)
    list(_copy_pool.map(lambda i: np.copyto(dst[i:i + step], src[i:i + step]), range(0, src.size, step)))
    return out


def _io_view(handle: TensorHandle, info: TensorInfo) -> np.ndarray:
    """A mapped allocation's bytes as the tensor ``info`` describes."""
    raw = handle.alloc.view(np.uint8)[handle.offset:handle.offset + info.nbytes]
    return raw.view(info.dtype).reshape(info.shape)


class VulkanChunk:
    """Nodes compiled for one Vulkan member, recorded once into one command buffer."""

    #: what runs the chunk (a :class:`HostChunk` names its engine)
    engine = "vulkan"
    engine_note = ""

    def __init__(self, member: Any, nodes: Sequence[Node], tensors: dict[str, TensorInfo],
                 constants: dict[str, np.ndarray], inputs: Sequence[str], outputs: Sequence[str],
                 opset: int, *, slots: int = 1, io: Sequence[Mapping[str, Any]] | None = None,
                 waits: Sequence[Timeline] = (), signal: bool = False) -> None:
        if io is not None:
            slots = len(io)
        if slots < 1:
            raise ValueError(f"a chunk needs at least one run slot, not {slots}")
        # per slot, memory the caller gives for some inputs and outputs (name → allocation; None
        # or absent: the chunk's own), which runs read and write in place (:meth:`start_in_place`)
        self._io = list(io) if io is not None else None
        self._given = {name for name, alloc in (self._io[0] if self._io else {}).items() if alloc is not None}
        # inputs the host writes at start (given ones are written by whoever gave them)
        self._fed = [name for name in inputs if name not in self._given]
        self._running = 0  # runs submitted and not yet waited for, with several slots (guarded by _lock)
        self.member = member
        self.device = member.device
        self.nodes = list(nodes)
        self.input_names = list(inputs)
        self.output_names = list(outputs)
        self.slots = slots
        self.stats = ChunkStats()
        self._lock = threading.Lock()
        self._allocs: list[Any] = []
        self._slots: list[_Slot] = []
        self._idle: queue.SimpleQueue[int] = queue.SimpleQueue()  # slots with no run in flight
        self._subs: list[Any] = []
        self._links: list[tuple[Any, Any]] = []  # transfer-queue command buffers and their semaphores
        # copies between run slots' host memory and the device go on the transfer queue where
        # the device has one and runs can overlap (several slots): see _add_slot
        self._transfer = slots > 1 and self.device.transfer_family is not None
        self._arena: Any = None
        # large outputs handed out in imported host memory (see IMPORTED_OUTPUT_BYTES): their
        # names, one pool of host buffers each, and the command buffers copying into those
        self._exported: list[str] = []
        self.imported: dict[str, OutputBuffers] = {}
        self._export_cmds: list[Any] = []
        # other chunks' timelines this chunk's runs wait on (values given to start), and the
        # one its runs signal (``signal``), for chunks that read each other on the device
        self._waits = list(waits)
        self.timeline: Timeline | None = None
        try:
            if signal:
                self.timeline = self.device.create_timeline()
            self.ops = build_ops(self.nodes, tensors, constants, opset)
            self._place(tensors, constants)
            self._record(constants)
        except BaseException:
            self.close()
            raise

    # -- memory ----------------------------------------------------------------------------
    def _place(self, tensors: dict[str, TensorInfo], constants: dict[str, np.ndarray]) -> None:
        t: dict[str, _Tensor] = {}
        member = self.member
        for name in self.input_names:
            t[name] = _Tensor(tensors[name], "input", name)
        outputs = set(self.output_names)
        for op, node in zip(self.ops, self.nodes):
            for name in node.inputs:
                if name and name not in t:
                    if name not in constants:
                        raise OpError(f"tensor {name!r} is neither an input of the chunk nor produced before "
                                      f"its use")
                    t[name] = _Tensor(TensorInfo(constants[name].shape, constants[name].dtype), "const", name)
            for pos, name in enumerate(node.outputs):
                if not name:
                    continue
                info = tensors[name]
                # in device memory: an activation, or an output large enough to be copied out
                # (unless it is given in device memory, which kernels write at device speed)
                staged = name not in outputs or (info.nbytes >= STAGED_OUTPUT_BYTES
                                                 and not self._given_on_device(name))
                if pos == 0 and op.alias_input is not None and staged:  # the final copy reads its base
                    t[name] = _Tensor(info, "view", t[node.inputs[op.alias_input]].base)
                else:
                    # a large output is computed in device memory and copied out at the end: a
                    # kernel writing straight across the bus is slow when few workgroups write
                    t[name] = _Tensor(info, "arena" if staged else "output", name)
        # Inputs live in device memory the host writes through a mapping where the member has
        # it; elsewhere they live in host memory, and those that a product reads (through views
        # too) are copied into the arena first: a kernel that reads its input many times would
        # fetch it across the bus each time (NOTE: H200, driver 580, bench/gemv_probe.py: a
        # 1 GiB GEMV took 675 µs reading its vector from mapped host memory, 258 µs reading it
        # from device memory)
        # (memory a caller gives for an input, ``io``, is host memory unless it says otherwise)
        self._staged_inputs: dict[str, _Tensor] = {}
        reread = {t[n].base for op, node in zip(self.ops, self.nodes) if op.rereads_inputs for n in node.inputs if n}
        for name in self.input_names:
            in_host_memory = (not self._given_on_device(name) if name in self._given
                              else not member.device_local_inputs)
            if in_host_memory and name in reread and t[name].kind == "input":
                self._staged_inputs[name] = t[name]
                t[name] = _Tensor(t[name].info, "arena", name)
        self.tensors = t
        # Storage: constants and I/O get allocations of their own; activations share an arena.
        # A constant is stored as its readers read it: as is, transposed (ops'
        # transposed_constants), or both when readers differ.
        layouts: dict[str, set[bool]] = {}
        for op, node in zip(self.ops, self.nodes):
            for pos, name in enumerate(node.inputs):
                if name and t[name].kind == "const":
                    layouts.setdefault(name, set()).add(pos in op.transposed_constants)
        for name in self.output_names:
            if name in t and t[name].kind == "const":
                layouts.setdefault(name, set()).add(False)
        self._transposed: dict[str, TensorHandle] = {}
        weights = sum(tensor.info.nbytes * len(layouts.get(name, {False}))
                      for name, tensor in t.items() if tensor.kind == "const")
        with progress.task("upload", weights, unit="B", what=f"to {member.id}"):
            for name, tensor in t.items():
                if tensor.kind == "const":
                    for transposed in sorted(layouts.get(name, {False})):
                        alloc = member.alloc(tensor.info.nbytes)
                        self._allocs.append(alloc)
                        member.upload(alloc, constants[name], transpose=transposed)
                        handle = TensorHandle(alloc, 0, tensor.info.nbytes)
                        if transposed:
                            self._transposed[name] = handle
                        else:
                            tensor.handle = handle
                        self.stats.weight_bytes += tensor.info.nbytes
        for index, node in enumerate(self.nodes):
            for name in node.inputs:
                if name:
                    t[t[name].base].last_use = index
        for name in self.output_names:
            if name in t:
                t[t[name].base].last_use = len(self.nodes)

    def _exportable(self) -> list[str]:
        """The outputs handed out in imported host memory: those of at least
        ``IMPORTED_OUTPUT_BYTES`` that kernels write in device memory of the chunk's own, where
        the device imports host memory and the slots' copies are not the transfer queue's."""
        if not self.device.host_import_alignment or self._transfer:
            return []
        t = self.tensors
        return [name for name in dict.fromkeys(self.output_names)
                if name not in self._given and t[t[name].base].kind == "arena"
                and t[name].info.nbytes >= IMPORTED_OUTPUT_BYTES]

    def _given_on_device(self, name: str) -> bool:
        """Whether ``name`` is in memory given as ``io`` that is the device's own (a tensor
        another chunk on the device shares); imported host memory is not."""
        return name in self._given and self._io[0][name].device_local

    # -- recording -------------------------------------------------------------------------
    def _record(self, constants: dict[str, np.ndarray]) -> None:
        t = self.tensors
        planner = ArenaPlanner()
        live = 0
        frees_at: dict[int, list[str]] = {}
        for name, tensor in t.items():
            if tensor.kind == "arena":
                frees_at.setdefault(tensor.last_use, []).append(name)
        for name in self._staged_inputs:  # copied in at level 0, ready from level 1
            tensor = t[name]
            tensor.offset, _ = planner.alloc(tensor.info.nbytes)
            live += tensor.info.nbytes
            tensor.producer_level = tensor.access_level = 1
        scheduled: list[tuple[int, Op, Node, int]] = []  # (level, op, node, workspace offset or -1)
        for index, (op, node) in enumerate(zip(self.ops, self.nodes)):
            level = 0
            for name in node.inputs:
                if name:
                    level = max(level, t[t[name].base].producer_level)
            for name in node.outputs:
                if not name or t[name].kind == "view":
                    continue
                tensor = t[name]
                if tensor.kind == "arena":
                    tensor.offset, touched = planner.alloc(tensor.info.nbytes)
                    live += tensor.info.nbytes
                    level = max(level, touched)
                else:
                    level = max(level, tensor.access_level)
            ws_bytes = op.workspace_bytes()
            ws_off = -1
            if ws_bytes:
                ws_off, touched = planner.alloc(ws_bytes)
                level = max(level, touched)
                live += ws_bytes
            self.stats.peak_live_bytes = max(self.stats.peak_live_bytes, live)
            # an op's own dispatches run one after another (sub-levels of its level), so the
            # level its outputs are ready at is its level plus the number of its dispatches
            node_level = level + 1
            scheduled.append((node_level, op, node, ws_off))
            for name in node.outputs:
                if name and t[name].kind != "view":
                    t[name].producer_level = node_level
                    t[name].access_level = node_level
            for name in node.inputs:
                if name:
                    base = t[t[name].base]
                    base.access_level = max(base.access_level, node_level)
            if ws_bytes:
                planner.release(ws_off, ws_bytes, node_level)
                live -= ws_bytes
            for name in frees_at.get(index, []):
                tensor = t[name]
                planner.release(tensor.offset, tensor.info.nbytes, tensor.access_level)
                live -= tensor.info.nbytes
        self.stats.arena_bytes = planner.end
        arena = self._arena = self.member.alloc(planner.end) if planner.end else None
        if arena is not None:
            self._allocs.append(arena)
        for tensor in t.values():
            if tensor.kind == "arena":
                tensor.handle = TensorHandle(arena, tensor.offset, tensor.info.nbytes)

        self._scheduled = scheduled
        self._exported = self._exportable()
        self.imported = {name: OutputBuffers(self.device, t[name].info.nbytes, IMPORTED_OUTPUT_BUFFERS)
                         for name in self._exported}
        self._add_slot()
        for _ in range(1, self.slots):
            try:
                self._add_slot()
            except DeviceOutOfMemory:  # more slots only where the budget has room for their I/O
                if self._io is not None:
                    raise
                break
        self.slots = len(self._slots)
        if self.slots == 1:  # the others did not fit: the one left never runs behind another
            self._slots[0].chained = None
        for index in range(self.slots):
            self._idle.put(index)
        self.device.save_pipeline_cache()
        first = self._slots[0]
        self.commands, self.dispatch_labels = first.commands, first.labels
        self.submission = first.alone

    def _add_slot(self) -> None:
        """One run slot: the chunk's inputs and outputs in host-visible memory of its own, and
        its recorded commands reading and writing them. Slots share weights and the arena, so a
        slot's second recording starts with a barrier after all earlier work on the queue: the
        one submitted while another run of this chunk is in flight."""
        t, member, caps = self.tensors, self.member, self.device.caps
        io: dict[tuple[str, str], TensorHandle] = {}
        keys = ([(("in", n), t[n].info, True) for n in self.input_names]
                + [(("out", n), t[n].info, False) for n in self.output_names])
        given = self._io[len(self._slots)] if self._io is not None else {}
        own: list[TensorHandle] = []
        # with a transfer queue, the copies between this slot's host memory and the arena go
        # through device memory of the slot's own ("landing"): the transfer queue moves the
        # bytes across the bus while other runs compute, the run copies them within the device
        landing: dict[tuple[str, str], TensorHandle] = {}
        crossing = ([("in", n) for n in self._staged_inputs]
                    + [("out", n) for n in self.output_names if t[n].kind != "output"]) if self._transfer else []
        try:
            for key, info, is_input in keys:
                alloc = given.get(key[1])
                if alloc is None:
                    alloc = member.alloc(info.nbytes, host_visible=True, input=is_input)
                    own.append(TensorHandle(alloc, 0, info.nbytes))
                elif alloc.nbytes < info.nbytes:  # memory the caller gave, and frees
                    raise ValueError(f"{key[1]}: {alloc.nbytes} bytes given for a {info.nbytes}-byte tensor")
                io[key] = TensorHandle(alloc, 0, info.nbytes)
            for key in crossing:
                landing[key] = TensorHandle(member.alloc(io[key].nbytes), 0, io[key].nbytes)
                own.append(landing[key])
        except BaseException:
            for h in own:
                h.alloc.free()
            raise
        for h in own:
            self._allocs.append(h.alloc)
            self.stats.io_bytes += h.nbytes

        def handle(name: str) -> TensorHandle:
            base = t[t[name].base]
            if base.kind == "input":
                return io[("in", base.base)]
            if base.kind == "output":
                return io[("out", base.base)]
            assert base.handle is not None
            return base.handle

        arena = self._arena
        buckets: dict[tuple[int, int], list[Any]] = {}
        before: list[tuple[Any, ...]] = []  # transfer-queue commands ahead of the run, and after it
        after: list[tuple[Any, ...]] = []
        for key, dev in landing.items():
            src, dst = (io[key], dev) if key[0] == "in" else (dev, io[key])
            (before if key[0] == "in" else after).append(
                ("copy", src.alloc.buffer, src.alloc.offset + src.offset, dst.alloc.buffer,
                 dst.alloc.offset + dst.offset, dst.nbytes))
        if after:
            after.append(("host_barrier",))
        for name in self._staged_inputs:
            for item in _copy(landing.get(("in", name), io[("in", name)]), handle(name), caps):
                buckets.setdefault((0, 0), []).append((f"copy-in {name}", item))
        for level, op, node, ws_off in self._scheduled:
            ctx = DispatchContext(
                inputs=[(self._transposed[n] if pos in op.transposed_constants else handle(n))
                        if n else None for pos, n in enumerate(node.inputs)],
                outputs=[handle(n) if n else None for n in node.outputs],
                workspace=TensorHandle(arena, ws_off, op.workspace_bytes()) if ws_off >= 0 else None,
                caps=caps,
                constants=op.constants,
            )
            work: list[Any] = []
            if op.alias_input is not None:
                if t[node.outputs[0]].kind == "output":  # a view that is a chunk output: copy its bytes
                    work.extend(_copy(ctx.inputs[op.alias_input], ctx.outputs[0], caps))
                if sum(1 for n in node.outputs if n) > 1:  # e.g. Dropout's mask
                    work.extend(op.dispatches(ctx))
            else:
                work.extend(op.dispatches(ctx))
            for k, item in enumerate(work):
                buckets.setdefault((level, k), []).append((f"{node.op_type} {node.name}", item))
        commands: list[tuple[Any, ...]] = []
        labels: list[str] = []  # one per dispatch, for GPU timestamp profiles
        counting = not self._slots  # the statistics describe one run
        if counting:
            self._build_pipelines([item for bucket in buckets.values() for _, item in bucket])

        def emit(label: str, item: Any) -> None:
            commands.append(self._command(label, item))
            if commands[-1][0] == "dispatch":
                labels.append(f"{label} [{item.shader}]")
                if counting:
                    self.stats.dispatches += 1

        for key in sorted(buckets):
            if commands:
                commands.append(("barrier",))
                if counting:
                    self.stats.barriers += 1
            for label, item in buckets[key]:
                emit(label, item)
        if counting:
            self.stats.levels = len(buckets)
        # chunk outputs in device memory (large ones, and those no node writes: a chunk
        # input, a constant, a view of one) are copied to mapped memory after one barrier
        run_end = len(commands)
        barrier_before_copies = bool(commands)
        for name in self.output_names:
            if t[name].kind == "output":
                continue
            if barrier_before_copies:
                commands.append(("barrier",))
                barrier_before_copies = False
            for item in _copy(handle(name), landing.get(("out", name), io[("out", name)]), caps):
                emit(f"copy-out {name}", item)
        commands.append(("host_barrier",))
        # views of what the host maps (memory given in the device's own memory has none: only
        # the kernels of the chunks sharing it touch it)
        views = [{n: _io_view(io[(kind, n)], t[n].info) for n in names if io[(kind, n)].alloc.host_visible}
                 for kind, names in (("in", self.input_names), ("out", self.output_names))]
        slot = _Slot(commands, labels, *views)  # every command of a run, as profiles record them
        self._slots.append(slot)
        links = (self._transfer_link(before), self._transfer_link(after))
        recorded = commands
        if self._exported:
            # recorded without the copies of exported outputs: every run submits those behind
            # its commands in the same batch, into a host buffer or into this slot's memory
            recorded = commands[:run_end]
            kept = [name for name in self.output_names
                    if t[name].kind != "output" and name not in self._exported]
            if kept and recorded:
                recorded.append(("barrier",))
            recorded += [self._command(f"copy-out {name}", item) for name in kept
                         for item in _copy(handle(name), io[("out", name)], caps)]
            recorded.append(("host_barrier",))
            slot.sources = [handle(name) for name in self._exported]
            slot.to_slot = [self._export(handle(name), io[("out", name)]) for name in self._exported]
        places = len(self._exported)
        slot.alone = self._recorded(recorded, links, follow=places)
        if self.slots > 1:
            slot.chained = self._recorded([("run_barrier",), *recorded], links, follow=places)

    def _command(self, label: str, item: Any) -> tuple[Any, ...]:
        """A dispatch, or a copy ``("copy", src, dst)``, as a command of
        :meth:`~vkpool.device.LogicalDevice.record`."""
        if isinstance(item, tuple):
            _, src, dst = item
            return ("copy", src.alloc.buffer, src.alloc.offset + src.offset,
                    dst.alloc.buffer, dst.alloc.offset + dst.offset, dst.nbytes)
        check_grid(item.groups, self.device.caps, label)
        pipe = self.device.pipeline(item.shader, item.defines)
        push = pack_push_constants(item.args, _address)
        if len(push) > self.device.push_constant_bytes:
            raise OpError(f"{item.shader}: {len(push)} bytes of push constants exceed the "
                          f"device's {self.device.push_constant_bytes}")
        return ("dispatch", pipe, push, item.groups)

    def _export(self, src: TensorHandle, dst: TensorHandle) -> Any:
        """A command buffer copying an output from device memory ``src`` into host memory
        ``dst``, submitted in one batch behind a run's commands. ``src`` was written by the run's
        dispatches (no kernel writes by a copy command), so a barrier from the compute stage
        orders the copy after them; a copy command as the copy gets one over the transfer stage
        too (:meth:`~vkpool.device.LogicalDevice.record`)."""
        copies = [self._command("copy-out", item) for item in _copy(src, dst, self.device.caps)]
        commands = [("barrier",), *copies, ("host_barrier",)]
        cmd = self.device.allocate_command_buffer()
        self._export_cmds.append(cmd)
        self.device.record(cmd, commands)
        return cmd

    def _build_pipelines(self, work: list[Any]) -> None:
        """Build the pipeline of every shader variant ``work`` dispatches, once each, reporting
        progress: on a first load this compiles shaders (glslang, then the driver)."""
        variants = {(item.shader, repr(sorted(item.defines.items()))): item
                    for item in work if not isinstance(item, tuple)}
        with progress.task("compile", len(variants), what=f"for {self.member.id}") as task:
            ahead = shaders.compile_ahead([(item.shader, item.defines) for item in variants.values()], task.advance)
            for index, item in enumerate(variants.values()):
                self.device.pipeline(item.shader, item.defines)
                if index not in ahead:
                    task.advance()

    def _transfer_link(self, commands: list[tuple[Any, ...]]) -> tuple[Any, Any] | None:
        """``commands`` recorded for the transfer queue, with the semaphore its submission
        signals (see :meth:`~vkpool.device.LogicalDevice.submission`); None for none."""
        if not commands:
            return None
        cmd = self.device.allocate_command_buffer(transfer=True)
        try:
            link = (cmd, self.device.create_semaphore())
        except BaseException:
            self.device.free_command_buffer(cmd, transfer=True)
            raise
        self._links.append(link)
        self.device.record(cmd, commands, transfer=True)
        return link

    def _recorded(self, commands: list[tuple[Any, ...]], links: tuple[Any, Any] = (None, None),
                  follow: int = 0) -> Any:
        cmd = self.device.allocate_command_buffer()
        try:
            sub = self.device.submission(cmd, before=links[0], after=links[1], waits=self._waits,
                                         signal=self.timeline, follow=follow)
        except BaseException:
            self.device.free_command_buffer(cmd)
            raise
        self._subs.append(sub)
        self.device.record(cmd, commands)
        return sub

    # -- running ---------------------------------------------------------------------------
    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.finish(self.start(feeds))

    def start(self, feeds: dict[str, np.ndarray], slot: int | None = None, waits: Sequence[int] = ()) -> int:
        """Writes the inputs into a free run slot (or run slot ``slot``, which the caller keeps
        to one run at a time) and submits its recorded commands, waiting on the device for
        ``waits`` (see :meth:`start_in_place`); returns the slot, which :meth:`finish` (from any
        thread) waits for. With every slot in flight, ``start`` waits for a ``finish``. Runs of
        one chunk execute in the order they start. Inputs in memory given as ``io`` are not
        written: whoever gave it writes them. Outputs in :attr:`imported` are copied into a
        free host buffer of theirs where one is, not into the slot's memory: :meth:`finish`
        hands them out."""
        index = self._idle.get() if slot is None else slot
        run = self._slots[index]
        run.pooled = slot is None
        try:
            views = run.in_views
            for name in self._fed:
                np.copyto(views[name], feeds[name], casting="no")
            if self._exported:
                self._start_exporting(index, waits)
            else:
                self.start_in_place(index, waits)
        except BaseException:
            if slot is None:
                self._idle.put(index)
            raise
        return index

    def _start_exporting(self, index: int, waits: Sequence[int]) -> None:
        """Submits ``run`` with each output of :attr:`imported` copied into a free host buffer of
        its own (the slot's memory for one whose buffers are all held) behind the run's commands
        in one batch."""
        run = self._slots[index]
        taken = [self.imported[name].take() for name in self._exported]
        try:
            follow = [run.to_slot[k] if buf is None else self._export_into(index, k, buf)
                      for k, buf in enumerate(taken)]
            self._submit(run, waits, follow)
        except BaseException:
            self._give_back(taken)
            raise
        run.taken = taken if any(taken) else None

    def _give_back(self, taken: Sequence[HostBuffer | None]) -> None:
        """Returns the host buffers a run took (``taken``, one per exported output) to their pools."""
        for name, buf in zip(self._exported, taken):
            if buf is not None:
                self.imported[name].give_back(buf)

    def _export_into(self, index: int, k: int, buf: HostBuffer) -> Any:
        """The command buffer copying exported output ``k`` of run slot ``index`` into ``buf``
        (recorded the first time the slot uses that buffer)."""
        cmd = buf.commands.get(index)
        if cmd is None:
            source = self._slots[index].sources[k]
            cmd = buf.commands[index] = self._export(source, TensorHandle(buf.allocation, 0, buf.nbytes))
        return cmd

    def slot_views(self, index: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Run slot ``index``'s inputs and outputs as host arrays (views of its memory)."""
        slot = self._slots[index]
        return slot.in_views, slot.out_views

    def staged(self, ended: Callable[[bool], None] | None = None, block: bool = True) -> StagedRun | None:
        """A free run slot held for a caller that writes the inputs straight into it and reads the
        outputs where the run leaves them (:class:`StagedRun`): no copy of the inputs at start and
        none of the outputs at finish. None for a chunk with inputs given as ``io`` or outputs
        handed out in imported memory (those need :meth:`start` and :meth:`finish`). ``ended(ok)``
        is called once, when the slot is given back. ``block`` False: raises :class:`queue.Empty`
        at once when every slot is in use (``ended`` is then not called)."""
        if self._given or self._exported:
            return None
        return StagedRun(self, self._idle.get(block), ended)

    def done_in_place(self, index: int) -> bool:
        """Whether the run started in slot ``index`` has ended on the device (without waiting;
        :meth:`wait_in_place` still follows it)."""
        return self.device.ended(self._slots[index].submitted)

    def start_in_place(self, index: int, waits: Sequence[int] = ()) -> None:
        """Submits run slot ``index`` on the inputs already in its memory (written through
        :meth:`slot_views`, or into the memory given as ``io``); the caller keeps each slot to
        one run at a time. Runs of one chunk execute in the order they start. ``waits``: per
        timeline given as ``waits`` at construction, the value the run waits for on the device
        (that of the run whose outputs it reads); :meth:`signaled` is what this run signals.
        Every output is then in the slot's memory (:meth:`slot_views`)."""
        slot = self._slots[index]
        slot.taken = None
        self._submit(slot, waits, slot.to_slot)

    def _submit(self, slot: _Slot, waits: Sequence[int], follow: Sequence[Any] = ()) -> None:
        """Submits the slot's recording, behind another run of the chunk in flight where there is
        one, with ``follow`` (the copies of exported outputs) behind it in its batch."""
        if slot.chained is None:  # one slot: no other run of the chunk can be in flight
            slot.submitted = slot.alone
            slot.signaled = self.device.submit(slot.alone, waits, follow)
            return
        with self._lock:  # another run in flight: go behind it (the slots share the arena)
            slot.submitted = slot.chained if self._running else slot.alone
            slot.signaled = self.device.submit(slot.submitted, waits, follow)
            self._running += 1

    def signaled(self, index: int) -> int:
        """The value the run last started in slot ``index`` signals on :attr:`timeline`."""
        return self._slots[index].signaled

    def wait_in_place(self, index: int, *, spin: bool = True) -> None:
        """Waits for the run in slot ``index``: its outputs are then in the slot's memory.
        ``spin`` polls the device first (:meth:`~vkpool.device.LogicalDevice.wait`); a caller
        with another run queued behind this one can sleep in the driver instead, the
        interpreter lock free."""
        slot = self._slots[index]
        try:
            self.device.wait(slot.submitted, spin_seconds=None if spin else 0.0)
        finally:
            if slot.chained is not None:  # one slot counts no runs (see start_in_place)
                with self._lock:
                    self._running -= 1

    def finish(self, slot: int, *, spin: bool = True, outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Waits for the run in ``slot`` (see :meth:`wait_in_place`) and returns its outputs (those
        named in ``outputs`` when given): copies, or for those :meth:`start` had the device copy
        into host buffers, those buffers as arrays the caller owns (a buffer is written again
        only once that array and every view of it are gone)."""
        run = self._slots[slot]
        try:
            try:
                self.wait_in_place(slot, spin=spin)
            except BaseException:
                self._give_back(run.taken or ())  # the run failed: its buffers are free again
                run.taken = None
                raise
            names = self.output_names if outputs is None else outputs
            if run.taken is None:
                views = run.out_views
                return {name: copy_out(views[name]) for name in names}
            return self._hand_out(run, names)
        finally:
            if self._slots[slot].pooled:
                self._idle.put(slot)

    def _hand_out(self, run: _Slot, names: Sequence[str]) -> dict[str, np.ndarray]:
        taken, run.taken = run.taken, None
        held = dict(zip(self._exported, taken or ()))
        out: dict[str, np.ndarray] = {}
        for name in names:
            if name in out:
                continue
            buf = held.pop(name, None)
            if buf is None:
                out[name] = copy_out(run.out_views[name])
            else:
                info = self.tensors[name].info
                out[name] = self.imported[name].hand_out(buf, info.dtype, info.shape)
        self._give_back([held.get(name) for name in self._exported])  # written, and not asked for
        return out

    def close(self) -> None:
        if self._subs:
            self.device.wait_idle()  # nothing submitted may still use what is destroyed below
        for sub in self._subs:
            sub.release()
        self._subs = []
        for cmd, sem in self._links:
            self.device.free_command_buffer(cmd, transfer=True)
            self.device.destroy_semaphore(sem)
        self._links = []
        for cmd in self._export_cmds:
            self.device.free_command_buffer(cmd)
        self._export_cmds = []
        for pool in self.imported.values():  # arrays the caller holds stay valid host memory
            pool.close()
        if self.timeline is not None:
            self.device.destroy_semaphore(self.timeline.handle)
            self.timeline = None
        self.submission = None
        for alloc in self._allocs:
            alloc.free()
        self._allocs = []


class StagedRun:
    """One run slot of a :class:`VulkanChunk`, held (:meth:`VulkanChunk.staged`): the caller writes
    every input into :attr:`inputs` (views of the slot's memory, each of the input's whole shape),
    :meth:`run` submits the slot and waits for it, and the outputs stay readable in
    :attr:`outputs` until :meth:`release` (or the end of a ``with`` block) gives the slot back."""

    __slots__ = ("_chunk", "_ended", "_index", "_ok", "inputs", "outputs")

    def __init__(self, chunk: VulkanChunk, index: int, ended: Callable[[bool], None] | None) -> None:
        self._chunk, self._index, self._ended, self._ok = chunk, index, ended, False
        self.inputs, self.outputs = chunk.slot_views(index)

    def run(self) -> dict[str, np.ndarray]:
        """Runs the slot on the inputs written; its outputs (views, valid until the release)."""
        self.start()
        return self.finish()

    def start(self) -> None:
        """Submits the slot on the inputs written; :meth:`finish` waits for it."""
        chunk = self._chunk
        if chunk is None:
            raise RuntimeError("the run slot was given back")
        chunk.start_in_place(self._index)

    def done(self) -> bool:
        """Whether the run :meth:`start` submitted has ended (without waiting)."""
        chunk = self._chunk
        return chunk is None or chunk.done_in_place(self._index)

    def finish(self) -> dict[str, np.ndarray]:
        """Waits for the run :meth:`start` submitted; its outputs (views, valid until the release)."""
        chunk = self._chunk
        if chunk is None:
            raise RuntimeError("the run slot was given back")
        chunk.wait_in_place(self._index)
        self._ok = True
        return self.outputs

    def release(self) -> None:
        chunk, self._chunk = self._chunk, None
        if chunk is None:
            return
        chunk._idle.put(self._index)
        if self._ended is not None:
            self._ended(self._ok)

    def __enter__(self) -> StagedRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(eq=False)
class _Slot:
    """One run slot of a :class:`VulkanChunk`: its commands, I/O views and submissions."""

    commands: list[tuple[Any, ...]]
    labels: list[str]
    in_views: dict[str, np.ndarray]
    out_views: dict[str, np.ndarray]
    alone: Any = None  # the recording submitted when no other run of the chunk is in flight
    chained: Any = None  # the same after a barrier (slots > 1 only)
    submitted: Any = None
    signaled: int = 0  # the timeline value the last run started here signals
    pooled: bool = True  # the last run took this slot from the idle ones (start without a slot)
    # with exported outputs (VulkanChunk.imported; the recordings then leave their copies out,
    # each run submitting one copy per exported output behind them): those copies' sources, the
    # copies into this slot's memory, and the host buffer each got in the last run (None: this
    # slot's memory; taken None: every output in this slot's memory)
    sources: list[TensorHandle] = field(default_factory=list)
    to_slot: list[Any] = field(default_factory=list)
    taken: list[HostBuffer | None] | None = None


class HostChunk:
    """Nodes run on the host (the ``cpu`` member) by :attr:`engine`: an onnxruntime session of
    the chunk, or the ops' numpy references (``member.engine`` and :func:`~vkpool.host_engine.open_engine`)."""

    def __init__(self, member: Any, nodes: Sequence[Node], tensors: dict[str, TensorInfo],
                 constants: dict[str, np.ndarray], inputs: Sequence[str], outputs: Sequence[str],
                 opset: int) -> None:
        self.member = member
        self.nodes = list(nodes)
        self.input_names = list(inputs)
        self.output_names = list(outputs)
        self.ops = build_ops(self.nodes, tensors, constants, opset)
        used = {n for node in self.nodes for n in node.inputs if n in constants}
        self.constants = {n: constants[n] for n in used}
        self.stats = ChunkStats(weight_bytes=sum(c.nbytes for c in self.constants.values()))
        self._charge = self.stats.weight_bytes + max(
            (sum(tensors[o].nbytes for o in node.outputs if o) for node in self.nodes), default=0)
        member.budget.reserve(self._charge)
        self._feeds: dict[str, np.ndarray] = {}
        try:
            self._engine = open_engine(getattr(member, "engine", "auto"), self.nodes, tensors, constants,
                                       self.input_names, self.output_names, opset, label=member.id)
        except BaseException:
            self.close()
            raise

    @property
    def engine(self) -> str:
        """What runs the chunk: ``onnxruntime <version>`` or ``numpy``."""
        return self._engine.name

    @property
    def engine_note(self) -> str:
        """Why onnxruntime does not run the chunk ('' when it does, or numpy was asked for)."""
        return self._engine.note

    #: runs held at once (one: the work happens in :meth:`finish`)
    slots = 1

    def start(self, feeds: dict[str, np.ndarray]) -> int:
        """Keeps the inputs; the work happens in :meth:`finish` (the executor calls it from the
        member's own thread, so numpy's time is never spent in a submitting thread)."""
        self._feeds = feeds
        return 0

    def finish(self, slot: int, *, spin: bool = True, outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        feeds, self._feeds = self._feeds, {}
        return self.run(feeds)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._engine.uses_onnxruntime:
            return self._engine.run({n: feeds[n] for n in self.input_names}, self.output_names)
        values: dict[str, np.ndarray] = dict(self.constants)
        values.update(feeds)
        for op, node in zip(self.ops, self.nodes):
            results = op.reference([values[n] if n else None for n in node.inputs])
            for name, value in zip(node.outputs, results):
                if name:
                    values[name] = value
        return {n: np.asarray(values[n]) for n in self.output_names}

    def close(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()
        if self._charge:
            self.member.budget.release(self._charge)
            self._charge = 0


__all__ = ["VulkanChunk", "HostChunk", "build_ops", "ArenaPlanner", "TensorHandle", "ChunkStats"]
