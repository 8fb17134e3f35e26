"""The op contract: what every ONNX op class declares and how it is dispatched.

An op class is built once per graph node, at load time, from the node's attributes and
the static shapes/dtypes of its inputs. It then answers everything the partitioner, the
memory planner and the recorder need without touching a device:

- ``output_infos()``: shape and dtype of each output;
- ``flops()``, ``bytes_read()``, ``bytes_written()``, ``workspace_bytes()``;
- ``reference(inputs)``: a numpy implementation (the host member runs it; tests compare with it);
- ``dispatches(ctx)``: the compute dispatches that implement it on a Vulkan device.

Shaders address memory through ``GL_EXT_buffer_reference`` pointers passed as push
constants: there are no descriptor sets, so nothing is written per run and a tensor may be
larger than ``maxStorageBufferRange``. A dispatch is a shader name (file stem under
``shaders/``), compile-time defines, the push-constant arguments in declaration order and
the workgroup counts.
"""
from __future__ import annotations

import math
import struct
from abc import ABCMeta, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import numpy as np


class UnsupportedOp(Exception):
    """A node whose op type (or attribute combination) vkpool has no kernel for."""


class OpError(ValueError):
    """A node whose inputs or attributes are invalid for its op."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: np.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


# ---------------------------------------------------------------------------------------------
# Push-constant arguments. Packed with std430 scalar alignment: pointers and 64-bit values on 8
# bytes, everything else on 4, in the order the shader's push_constant block declares them.


@dataclass(frozen=True)
class Ptr:
    """Device address of a tensor (``tensor``) plus a byte offset into it."""

    tensor: Any
    byte_offset: int = 0


@dataclass(frozen=True)
class U32:
    value: int


@dataclass(frozen=True)
class I32:
    value: int


@dataclass(frozen=True)
class F32:
    value: float


@dataclass(frozen=True)
class U64:
    value: int


PushArg = Ptr | U32 | I32 | F32 | U64


def pack_push_constants(args: Sequence[PushArg], address_of: Any) -> bytes:
    """Packs ``args`` as the shader's push_constant block lays them out.

    ``address_of(tensor)`` returns the device address of a tensor handle.
    """
    out = bytearray()
    for arg in args:
        if isinstance(arg, (Ptr, U64)):
            out.extend(b"\0" * (-len(out) % 8))
            value = address_of(arg.tensor) + arg.byte_offset if isinstance(arg, Ptr) else arg.value
            out.extend(struct.pack("<Q", value))
        elif isinstance(arg, U32):
            out.extend(struct.pack("<I", arg.value & 0xFFFFFFFF))
        elif isinstance(arg, I32):
            out.extend(struct.pack("<i", arg.value))
        elif isinstance(arg, F32):
            out.extend(struct.pack("<f", arg.value))
        else:
            raise TypeError(f"unknown push-constant argument {arg!r}")
    return bytes(out)


@dataclass
class Dispatch:
    """One ``vkCmdDispatch`` of a compute shader."""

    shader: str
    args: list[PushArg]
    groups: tuple[int, int, int]
    defines: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceCaps:
    """What kernels may tune on: filled from the member's physical device."""

    subgroup_size: int = 32
    max_workgroup_invocations: int = 1024
    max_workgroup_count: tuple[int, int, int] = (65535, 65535, 65535)
    #: loop iterations one invocation may run in all its loops together (0: no limit); past it
    #: a driver may end the loops early (lavapipe), so kernels split serial work or refuse it
    max_loop_iterations: int = 0
    shared_memory_bytes: int = 32768
    max_push_constant_bytes: int = 128
    float16: bool = False
    int8: bool = False
    int64: bool = True
    #: subgroupAdd/subgroupMax in compute shaders (reductions within a subgroup first)
    subgroup_arithmetic: bool = False
    #: subgroupShuffle in compute shaders
    subgroup_shuffle: bool = False
    cooperative_matrix: bool = False
    #: (M, N, K) of subgroup-scope cooperative matrices multiplying float16 into float32
    cooperative_matrix_f16: tuple[tuple[int, int, int], ...] = ()
    #: the tiling of gemm.comp (products and implicit-GEMM convolutions): "shared" (tiles staged
    #: in shared memory, for GPUs) or "register" (TM x TN outputs per invocation in registers,
    #: ``register_tile`` = (TM, TN, WG), for CPU-like devices); see vkpool.kernel_variants
    gemm_variant: str = "shared"
    register_tile: tuple[int, int, int] = (32, 8, 8)
    #: a device of Vulkan type cpu (lavapipe, SwiftShader), where shared memory is ordinary memory
    #: and a barrier switches between the invocations of a workgroup: kernels that have one run
    #: their variant without either (see vkpool.kernel_variants)
    cpu_like: bool = False


@dataclass
class DispatchContext:
    """What ``Op.dispatches`` receives: tensor handles and the device's capabilities.

    ``inputs``/``outputs`` hold one handle per ONNX input/output (``None`` for an omitted
    optional input). ``workspace`` is a handle of ``workspace_bytes()`` bytes, or ``None``.
    ``constants`` are the values of inputs known at load time (initializers, folded values).
    """

    inputs: list[Any]
    outputs: list[Any]
    workspace: Any
    caps: DeviceCaps
    constants: dict[int, np.ndarray]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def groups_1d(n: int, local: int = 256, caps: DeviceCaps | None = None) -> tuple[int, int, int]:
    """Workgroup counts covering ``n`` invocations with ``local``-wide groups.

    Counts past the device's limit are folded into y, then z, so no dimension exceeds it; shaders
    recover the flat index with ``flat_index()`` (or the flat workgroup with ``flat_group()``) of
    ``common.glsl``. A count that not even three folded dimensions hold is refused.
    """
    groups = max(1, ceil_div(n, local))
    mx, my, mz = caps.max_workgroup_count if caps else DeviceCaps.max_workgroup_count
    if groups <= mx:
        return (groups, 1, 1)
    x = mx
    rest = ceil_div(groups, x)
    if rest <= my:
        return (ceil_div(groups, rest), rest, 1)  # the narrowest x with the fewest idle groups
    z = ceil_div(rest, my)
    if z > mz:
        raise UnsupportedOp(f"{n} invocations in groups of {local} exceed the device's workgroup grid "
                            f"{mx} x {my} x {mz}")
    return (x, my, z)


def check_grid(groups: tuple[int, int, int], caps: DeviceCaps | None, what: str) -> None:
    """Refuses a workgroup grid the device cannot dispatch (a dispatch past
    ``maxComputeWorkGroupCount`` is undefined behaviour, not an error, in Vulkan)."""
    limit = caps.max_workgroup_count if caps else DeviceCaps.max_workgroup_count
    if any(g > m for g, m in zip(groups, limit)):
        raise UnsupportedOp(f"{what}: workgroup grid {groups[0]} x {groups[1]} x {groups[2]} exceeds the "
                            f"device's {limit[0]} x {limit[1]} x {limit[2]}")


#: loop iterations a shader may spend outside its long serial loop (index arithmetic over the
#: rank, small fixed loops) when it checks that loop against ``DeviceCaps.max_loop_iterations``
LOOP_SLACK = 64


def serial_pieces(n: int, cost: int, caps: DeviceCaps | None, what: str) -> list[tuple[int, int]]:
    """``(start, count)`` pieces of ``n`` serial steps, each step ``cost`` loop iterations of one
    invocation, such that one dispatch per piece stays within the device's loop limit. A step
    that alone exceeds it is refused."""
    limit = caps.max_loop_iterations if caps else 0
    if not limit or n * cost + LOOP_SLACK <= limit:
        return [(0, n)]
    per = (limit - LOOP_SLACK) // cost
    if per < 1:
        raise UnsupportedOp(f"{what}: {cost} loop iterations per step in one invocation exceed the device's "
                            f"limit of {limit}")
    return [(s, min(per, n - s)) for s in range(0, n, per)]


def check_serial(iterations: int, caps: DeviceCaps | None, what: str) -> None:
    """Refuses a kernel whose invocations would each run more loop iterations than the device
    completes (a driver may end such loops early without an error, which is a wrong answer)."""
    limit = caps.max_loop_iterations if caps else 0
    if limit and iterations + LOOP_SLACK > limit:
        raise UnsupportedOp(f"{what}: {iterations} loop iterations in one invocation exceed the device's "
                            f"limit of {limit}")


class Op(metaclass=ABCMeta):
    """Base class of every op. Subclasses set ``op_type`` and implement the hooks below.

    ``inputs`` are the static infos of the node's inputs (``None`` where an optional input is
    omitted); ``constants`` maps input positions to values known at load time.
    """

    op_type: ClassVar[str] = ""
    domain: ClassVar[str] = ""
    #: input positions whose values must be known at load time (e.g. Reshape's shape)
    constant_inputs: ClassVar[tuple[int, ...]] = ()
    #: when not None, output 0 is a view of this input (same bytes, new shape): no dispatch
    alias_input: ClassVar[int | None] = None
    #: the kernels read each input element many times (every workgroup of a GEMV reads the whole
    #: vector): a model input read so is first copied to device memory, not fetched across the bus
    rereads_inputs: ClassVar[bool] = False
    #: positions of 2-D constant inputs the kernels read transposed (an op sets it in ``check``):
    #: the engine stores their transpose, e.g. a GEMV's K x N weights as N x K so that each
    #: output's weights are contiguous
    transposed_constants: frozenset[int] = frozenset()

    def __init__(
        self,
        attrs: dict[str, Any],
        inputs: Sequence[TensorInfo | None],
        constants: dict[int, np.ndarray] | None = None,
        *,
        opset: int = 17,
        num_outputs: int = 1,
    ) -> None:
        self.attrs = dict(attrs)
        self.inputs = list(inputs)
        self.constants = dict(constants or {})
        self.opset = opset
        self.num_outputs = num_outputs
        for pos in self.constant_inputs:
            if pos < len(self.inputs) and self.inputs[pos] is not None and pos not in self.constants:
                raise UnsupportedOp(
                    f"{self.op_type}: input {pos} must be a constant known at load time"
                )
        self.check()

    # -- hooks ------------------------------------------------------------------------------
    def check(self) -> None:
        """Validates attributes and input infos; raises OpError or UnsupportedOp."""

    @abstractmethod
    def output_infos(self) -> list[TensorInfo]:
        """Shapes and dtypes of the outputs, from the static input infos."""

    @abstractmethod
    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        """The outputs computed with numpy: the tests' reference and the ``cpu`` member's kernel."""

    @abstractmethod
    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        """The compute dispatches that produce the outputs, in order, for tensors at ``ctx``."""

    # -- costs (defaults suit elementwise ops) ---------------------------------------------
    def flops(self) -> int:
        return sum(o.size for o in self.output_infos())

    def bytes_read(self) -> int:
        return sum(i.nbytes for i in self.inputs if i is not None)

    def bytes_written(self) -> int:
        return sum(o.nbytes for o in self.output_infos())

    def workspace_bytes(self) -> int:
        return 0

    # -- helpers ------------------------------------------------------------------------------
    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def input(self, pos: int) -> TensorInfo:
        info = self.inputs[pos] if pos < len(self.inputs) else None
        if info is None:
            raise OpError(f"{self.op_type}: input {pos} is required")
        return info

    def has_input(self, pos: int) -> bool:
        return pos < len(self.inputs) and self.inputs[pos] is not None


#: element types a shader can be specialised for: numpy dtype -> (GLSL type, pointer type)
GLSL_TYPES: dict[np.dtype, tuple[str, str]] = {
    np.dtype(np.float32): ("float", "F32Buf"),
    np.dtype(np.int32): ("int", "I32Buf"),
    np.dtype(np.int64): ("int64_t", "I64Buf"),
    np.dtype(np.uint8): ("uint8_t", "U8Buf"),
    np.dtype(np.bool_): ("uint8_t", "U8Buf"),
}


def type_defines(dtype: np.dtype, prefix: str = "") -> dict[str, str]:
    """Defines ``{prefix}T`` and ``{prefix}TBUF`` selecting a shader's element type."""
    try:
        glsl, buf = GLSL_TYPES[np.dtype(dtype)]
    except KeyError:
        raise UnsupportedOp(f"element type {np.dtype(dtype)} has no kernel") from None
    return {f"{prefix}T": glsl, f"{prefix}TBUF": buf}
