"""The one choke point between vkpool and the ``vulkan`` (cffi) binding.

Every Vulkan call goes through :func:`call`, which turns a negative ``VkResult`` into a
:class:`VulkanError` naming the function, the result and the pool member. ``VK_NOT_READY``,
``VK_TIMEOUT`` and ``VK_INCOMPLETE`` are returned to the caller as control flow.
Structs are built with the binding's raw ``ffi`` so that nested structs live exactly as long
as the Python objects that hold them (the binding's helpers can free them too early).
"""
from __future__ import annotations

import threading
from typing import Any

VK_SUCCESS = 0
VK_NOT_READY = 1
VK_TIMEOUT = 2
VK_INCOMPLETE = 5
# NOTE: the binding (1.3.275.1) has no value for these core 1.2 flags (None for the KHR alias)
BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT = 0x00020000
MEMORY_ALLOCATE_DEVICE_ADDRESS_BIT = 0x00000002


class VulkanUnavailable(RuntimeError):
    """No Vulkan loader, or no usable device: the message says what to install."""


class VulkanError(RuntimeError):
    """A Vulkan call failed."""

    def __init__(self, function: str, result: int, member: str | None = None) -> None:
        self.function = function
        self.result = result
        self.result_name = result_name(result)
        self.member = member
        where = f" on {member}" if member else ""
        super().__init__(f"{function} failed{where}: {self.result_name} ({result})")


class DeviceLost(VulkanError):
    """The device stopped answering (driver reset, hang, removal)."""


_INSTALL_HINT = (
    "vkpool needs a Vulkan loader and a Vulkan driver. On Debian/Ubuntu: "
    "`sudo apt-get install libvulkan1 mesa-vulkan-drivers` (Mesa's lavapipe is a software "
    "device that works everywhere); for an NVIDIA/AMD/Intel GPU install its vendor driver."
)

_binding: Any = None
_binding_lock = threading.Lock()


def binding() -> Any:
    """The imported ``vulkan`` module (loads libvulkan.so.1 on first use)."""
    global _binding
    if _binding is None:
        with _binding_lock:
            if _binding is None:
                try:
                    import vulkan
                except OSError as exc:  # the binding raises OSError when dlopen fails
                    raise VulkanUnavailable(f"no Vulkan loader found ({exc}). {_INSTALL_HINT}") from None
                _binding = vulkan
    return _binding


def ffi() -> Any:
    return binding().ffi


def lib() -> Any:
    return binding().lib


_RESULT_NAMES: dict[int, str] = {}


def result_name(code: int) -> str:
    if not _RESULT_NAMES:
        vk = binding()
        for name in dir(vk):
            if name.startswith(("VK_ERROR_", "VK_SUCCESS", "VK_NOT_READY", "VK_TIMEOUT", "VK_INCOMPLETE")):
                value = getattr(vk, name)
                if isinstance(value, int):
                    _RESULT_NAMES.setdefault(value, name)
    return _RESULT_NAMES.get(code, "VK_RESULT_UNKNOWN")


def check(function: str, result: int | None, member: str | None = None) -> int:
    """Raises on a negative result; returns non-negative ones (success or control flow)."""
    if result is None:  # void functions
        return VK_SUCCESS
    if result < 0:
        if result == binding().VK_ERROR_DEVICE_LOST:
            raise DeviceLost(function, result, member)
        raise VulkanError(function, result, member)
    return result


def call(function: str, *args: Any, member: str | None = None) -> int:
    """Calls ``lib.<function>(*args)`` and checks its result."""
    return check(function, getattr(lib(), function)(*args), member)


def new(ctype: str, init: Any = None) -> Any:
    return ffi().new(ctype, init) if init is not None else ffi().new(ctype)


def proc(instance_or_device: Any, name: str, *, device: bool = False) -> Any:
    """An extension entry point cast to its PFN type, or None when the driver lacks it."""
    getter = lib().vkGetDeviceProcAddr if device else lib().vkGetInstanceProcAddr
    ptr = getter(instance_or_device, name.encode())
    if ptr == ffi().NULL:
        return None
    return ffi().cast(f"PFN_{name}", ptr)


def string(chars: Any) -> str:
    return ffi().string(chars).decode(errors="replace")


def version_string(v: int) -> str:
    return f"{v >> 22}.{(v >> 12) & 0x3FF}.{v & 0xFFF}"
