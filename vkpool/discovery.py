"""Discovery: every Vulkan physical device with what vkpool needs to know about it."""
from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from vkpool import vk

VENDORS = {
    0x10DE: "NVIDIA",
    0x1002: "AMD",
    0x1022: "AMD",
    0x8086: "Intel",
    0x13B5: "ARM",
    0x5143: "Qualcomm",
    0x106B: "Apple",
    0x1010: "Imagination",
    0x14E4: "Broadcom",
    0x10005: "Mesa",  # VK_VENDOR_ID_MESA: software devices (lavapipe/llvmpipe)
    0x10002: "VeriSilicon",
    0x10003: "Kazan",
    0x10004: "Codeplay",
    0x10006: "PoCL",
    0x1AE0: "Google",
    0x19E5: "Huawei",
    0x144D: "Samsung",
}

DEVICE_TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}

#: device extensions vkpool looks for, by capability name
EXTENSIONS = {
    "push_descriptors": "VK_KHR_push_descriptor",
    "external_memory_host": "VK_EXT_external_memory_host",
    "memory_budget": "VK_EXT_memory_budget",
    "cooperative_matrix": "VK_KHR_cooperative_matrix",
    "cooperative_matrix2": "VK_NV_cooperative_matrix2",
}

# Mesa driver IDs (VkDriverId) that drive hardware which also has a vendor driver; when the same
# GPU (same UUID) shows up twice, the other driver wins.
_MESA_HW_DRIVERS = {3, 6, 18, 19, 20, 22, 23, 24, 25, 26}  # radv, anv, turnip, v3dv, panvk, venus, dozen, nvk, ...
_MESA_LLVMPIPE = 13  # VK_DRIVER_ID_MESA_LLVMPIPE: lavapipe
#: NOTE: lavapipe (Mesa's gallivm, LP_MAX_TGSI_LOOP_ITERATIONS) ends every loop of a shader
#: invocation once all its loops together have run 65,535 iterations, silently: a CumSum along
#: 131,072 elements wrote zeros from element 65,534 on. No Vulkan limit reports it.
_LLVMPIPE_LOOP_ITERATIONS = 65535


@dataclass
class MemoryHeap:
    index: int
    size: int
    device_local: bool
    budget: int | None = None  # VK_EXT_memory_budget, where present
    usage: int | None = None


@dataclass
class PhysicalDeviceInfo:
    index: int
    name: str
    vendor: str
    vendor_id: int
    device_id: int
    type: str
    driver_name: str
    driver_info: str
    driver_id: int
    driver_version: str
    api_version: str
    uuid: str
    heaps: list[MemoryHeap]
    subgroup_size: int
    max_workgroup_invocations: int
    max_workgroup_size: tuple[int, int, int]
    max_workgroup_count: tuple[int, int, int]
    max_shared_memory_bytes: int
    max_push_constant_bytes: int
    max_storage_buffer_range: int
    max_memory_allocation_bytes: int
    #: loop iterations one shader invocation may run in all (0: no limit known)
    max_loop_iterations: int = 0
    capabilities: dict[str, bool] = field(default_factory=dict)
    usable: bool = True
    unusable_reason: str = ""
    #: (M, N, K) of the subgroup-scope cooperative matrices multiplying float16 into float32
    cooperative_matrix_f16: list[tuple[int, int, int]] = field(default_factory=list)
    handle: Any = field(default=None, repr=False, compare=False)

    @property
    def device_local_heap(self) -> MemoryHeap:
        """The largest device-local heap (on a CPU device every heap is 'device-local')."""
        local = [h for h in self.heaps if h.device_local] or self.heaps
        return max(local, key=lambda h: h.size)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "handle"}
        d["heaps"] = [asdict(h) for h in self.heaps]
        d["capabilities"] = dict(self.capabilities)
        return d


class Instance:
    """The process-wide VkInstance (created on first use, never destroyed before exit)."""

    _instance: Instance | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        ffi, lib = vk.ffi(), vk.lib()
        version_p = ffi.new("uint32_t*")
        vk.call("vkEnumerateInstanceVersion", version_p)
        self.loader_version = int(version_p[0])
        api = min(self.loader_version, (1 << 22) | (3 << 12))
        if api < ((1 << 22) | (2 << 12)):
            raise vk.VulkanUnavailable(
                f"the Vulkan loader is {vk.version_string(self.loader_version)}; vkpool needs 1.2 or newer"
            )
        self._keep: list[Any] = []
        app_name = ffi.new("char[]", b"vkpool")
        app = ffi.new("VkApplicationInfo*", {
            "sType": vk.binding().VK_STRUCTURE_TYPE_APPLICATION_INFO,
            "pApplicationName": app_name, "applicationVersion": 1,
            "pEngineName": app_name, "engineVersion": 1, "apiVersion": api,
        })
        info = ffi.new("VkInstanceCreateInfo*", {
            "sType": vk.binding().VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, "pApplicationInfo": app,
        })
        handle = ffi.new("VkInstance*")
        try:
            vk.call("vkCreateInstance", info, ffi.NULL, handle)
        except vk.VulkanError as exc:
            raise vk.VulkanUnavailable(
                f"could not create a Vulkan instance ({exc.result_name}): no Vulkan driver is installed? "
                + vk._INSTALL_HINT
            ) from None
        self.handle = handle[0]
        self._keep += [app_name, app, info]
        self.api_version = api
        count = ffi.new("uint32_t*")
        vk.call("vkEnumeratePhysicalDevices", self.handle, count, ffi.NULL)
        devices = ffi.new("VkPhysicalDevice[]", count[0])
        vk.call("vkEnumeratePhysicalDevices", self.handle, count, devices)
        self.physical_devices = [devices[i] for i in range(count[0])]
        self._get_coop = vk.proc(self.handle, "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
        del lib

    @classmethod
    def get(cls) -> Instance:
        with cls._lock:
            if cls._instance is None:
                cls._instance = Instance()
            return cls._instance


def _device_extensions(pd: Any) -> set[str]:
    ffi = vk.ffi()
    count = ffi.new("uint32_t*")
    vk.call("vkEnumerateDeviceExtensionProperties", pd, ffi.NULL, count, ffi.NULL)
    props = ffi.new("VkExtensionProperties[]", count[0])
    vk.call("vkEnumerateDeviceExtensionProperties", pd, ffi.NULL, count, props)
    return {vk.string(props[i].extensionName) for i in range(count[0])}


def _chain(*structs: Any) -> None:
    for a, b in zip(structs, structs[1:]):
        a.pNext = b


def _uuid(raw: Any) -> str:
    b = bytes(raw[i] & 0xFF for i in range(16))
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _driver_version(vendor_id: int, v: int) -> str:
    if vendor_id == 0x10DE:  # NVIDIA packs 10.8.8.6 bits
        return f"{(v >> 22) & 0x3FF}.{(v >> 14) & 0xFF}.{(v >> 6) & 0xFF}.{v & 0x3F}"
    return vk.version_string(v)


def describe(index: int, pd: Any, instance: Instance) -> PhysicalDeviceInfo:
    ffi, lib, b = vk.ffi(), vk.lib(), vk.binding()
    base = ffi.new("VkPhysicalDeviceProperties*")
    lib.vkGetPhysicalDeviceProperties(pd, base)
    api = base.apiVersion
    exts = _device_extensions(pd)
    vendor_id = base.vendorID
    name = vk.string(base.deviceName)
    lim = base.limits

    p2 = ffi.new("VkPhysicalDeviceProperties2*", {"sType": b.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2})
    p11 = ffi.new("VkPhysicalDeviceVulkan11Properties*",
                  {"sType": b.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_PROPERTIES})
    p12 = ffi.new("VkPhysicalDeviceVulkan12Properties*",
                  {"sType": b.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_PROPERTIES})
    f2 = ffi.new("VkPhysicalDeviceFeatures2*", {"sType": b.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2})
    f11 = ffi.new("VkPhysicalDeviceVulkan11Features*",
                  {"sType": b.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES})
    f12 = ffi.new("VkPhysicalDeviceVulkan12Features*",
                  {"sType": b.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES})
    fcm = ffi.new("VkPhysicalDeviceCooperativeMatrixFeaturesKHR*",
                  {"sType": b.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR})
    usable, reason = True, ""
    if api >= ((1 << 22) | (2 << 12)):
        _chain(p2, p11, p12)
        lib.vkGetPhysicalDeviceProperties2(pd, p2)
        features = [f2, f11, f12] + ([fcm] if EXTENSIONS["cooperative_matrix"] in exts else [])
        _chain(*features)
        lib.vkGetPhysicalDeviceFeatures2(pd, f2)
        subgroup = p11.subgroupSize
        uuid = _uuid(p11.deviceUUID)
        driver_name = vk.string(p12.driverName)
        driver_info = vk.string(p12.driverInfo)
        driver_id = int(p12.driverID)
    else:
        lib.vkGetPhysicalDeviceFeatures(pd, ffi.addressof(f2.features))
        subgroup, uuid, driver_name, driver_info, driver_id = 0, _uuid(base.pipelineCacheUUID), "", "", 0
        usable, reason = False, f"Vulkan {vk.version_string(api)} device; vkpool needs 1.2"

    caps = {
        "fp16": bool(f12.shaderFloat16),
        "int8": bool(f12.shaderInt8),
        "int64": bool(f2.features.shaderInt64),
        "storage_16bit": bool(f11.storageBuffer16BitAccess),
        "storage_8bit": bool(f12.storageBuffer8BitAccess),
        "timeline_semaphores": bool(f12.timelineSemaphore),
        "vulkan_memory_model": bool(f12.vulkanMemoryModel),
        "buffer_device_address": bool(f12.bufferDeviceAddress),
        # subgroupAdd/subgroupMax in compute shaders
        "subgroup_arithmetic": bool(p11.subgroupSupportedStages & b.VK_SHADER_STAGE_COMPUTE_BIT
                                    and p11.subgroupSupportedOperations & b.VK_SUBGROUP_FEATURE_ARITHMETIC_BIT),
        "subgroup_shuffle": bool(p11.subgroupSupportedStages & b.VK_SHADER_STAGE_COMPUTE_BIT
                                 and p11.subgroupSupportedOperations & b.VK_SUBGROUP_FEATURE_SHUFFLE_BIT),
    }
    for cap, ext in EXTENSIONS.items():
        caps[cap] = ext in exts
    caps["cooperative_matrix"] = caps["cooperative_matrix"] and bool(fcm.cooperativeMatrix)
    coop_f16 = _cooperative_matrix_f16(pd, instance) if caps["cooperative_matrix"] else []
    if usable:
        missing = [c for c in ("timeline_semaphores", "buffer_device_address", "storage_8bit") if not caps[c]]
        if missing:
            usable, reason = False, "missing " + ", ".join(missing)

    mem = ffi.new("VkPhysicalDeviceMemoryProperties2*",
                  {"sType": b.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2})
    budget = ffi.new("VkPhysicalDeviceMemoryBudgetPropertiesEXT*",
                     {"sType": b.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT})
    has_budget = caps["memory_budget"] and api >= ((1 << 22) | (1 << 12))
    if has_budget:
        mem.pNext = budget
    lib.vkGetPhysicalDeviceMemoryProperties2(pd, mem)
    mp = mem.memoryProperties
    heaps = [
        MemoryHeap(
            index=i,
            size=int(mp.memoryHeaps[i].size),
            device_local=bool(mp.memoryHeaps[i].flags & b.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT),
            budget=int(budget.heapBudget[i]) if has_budget else None,
            usage=int(budget.heapUsage[i]) if has_budget else None,
        )
        for i in range(mp.memoryHeapCount)
    ]

    return PhysicalDeviceInfo(
        index=index,
        name=name,
        vendor=VENDORS.get(vendor_id, f"0x{vendor_id:04x}"),
        vendor_id=vendor_id,
        device_id=base.deviceID,
        type=DEVICE_TYPES.get(base.deviceType, "other"),
        driver_name=driver_name,
        driver_info=driver_info,
        driver_id=driver_id,
        driver_version=_driver_version(vendor_id, base.driverVersion),
        api_version=vk.version_string(api),
        uuid=uuid,
        heaps=heaps,
        subgroup_size=int(subgroup),
        max_workgroup_invocations=int(lim.maxComputeWorkGroupInvocations),
        max_workgroup_size=tuple(int(lim.maxComputeWorkGroupSize[i]) for i in range(3)),  # type: ignore[arg-type]
        max_workgroup_count=tuple(int(lim.maxComputeWorkGroupCount[i]) for i in range(3)),  # type: ignore[arg-type]
        max_shared_memory_bytes=int(lim.maxComputeSharedMemorySize),
        max_push_constant_bytes=int(lim.maxPushConstantsSize),
        max_storage_buffer_range=int(lim.maxStorageBufferRange),
        max_memory_allocation_bytes=int(p11.maxMemoryAllocationSize) if api >= (1 << 22 | 2 << 12) else 0,
        max_loop_iterations=_LLVMPIPE_LOOP_ITERATIONS if driver_id == _MESA_LLVMPIPE else 0,
        capabilities=caps,
        usable=usable,
        unusable_reason=reason,
        cooperative_matrix_f16=coop_f16,
        handle=pd,
    )


def _cooperative_matrix_f16(pd: Any, instance: Instance) -> list[tuple[int, int, int]]:
    """Shapes (M, N, K) the device multiplies float16 A and B into a float32 accumulator at
    subgroup scope (``vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR``)."""
    get = instance._get_coop
    if get is None:
        return []
    ffi, b = vk.ffi(), vk.binding()
    count = ffi.new("uint32_t*")
    vk.check("vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR", get(pd, count, ffi.NULL))
    props = ffi.new("VkCooperativeMatrixPropertiesKHR[]", count[0])
    for i in range(count[0]):
        props[i].sType = b.VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR
    vk.check("vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR", get(pd, count, props))
    f16, f32 = b.VK_COMPONENT_TYPE_FLOAT16_KHR, b.VK_COMPONENT_TYPE_FLOAT32_KHR
    return sorted({
        (int(p.MSize), int(p.NSize), int(p.KSize)) for p in (props[i] for i in range(count[0]))
        if p.AType == f16 and p.BType == f16 and p.CType == f32 and p.ResultType == f32
        and p.scope == b.VK_SCOPE_SUBGROUP_KHR
    })


def _driver_rank(info: PhysicalDeviceInfo) -> tuple[int, int, str]:
    """Higher is better: a vendor driver over a Mesa one for the same hardware, then API version."""
    vendor_driver = 0 if info.driver_id in _MESA_HW_DRIVERS else 1
    major, minor, patch = (int(x) for x in info.api_version.split("."))
    return (int(info.usable), vendor_driver, (major << 22) | (minor << 12) | patch)  # type: ignore[return-value]


#: limits that change which code path a kernel takes, and may be lowered by VKPOOL_DEVICE_LIMITS
LOWERABLE_LIMITS = ("max_workgroup_count", "max_workgroup_size", "max_workgroup_invocations",
                    "max_shared_memory_bytes", "max_storage_buffer_range", "max_memory_allocation_bytes",
                    "max_loop_iterations")
_TRIPLES = ("max_workgroup_count", "max_workgroup_size")


class DeviceLimitsError(ValueError):
    """VKPOOL_DEVICE_LIMITS names an unknown limit or a value that is not a whole number."""


def parse_limits(text: str) -> dict[str, tuple[int, ...]]:
    """``"max_workgroup_count=1000, max_shared_memory_bytes=16384"`` as a dict of values.

    ``max_workgroup_count`` and ``max_workgroup_size`` take one number for all three dimensions or
    three joined by ``x`` (``1000x3x1000``); every other limit takes one number.
    """
    out: dict[str, tuple[int, ...]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in LOWERABLE_LIMITS:
            raise DeviceLimitsError(f"VKPOOL_DEVICE_LIMITS: {item!r} is not LIMIT=VALUE with LIMIT one of "
                                    f"{', '.join(LOWERABLE_LIMITS)}")
        try:
            values = tuple(int(v) for v in value.strip().split("x"))
        except ValueError:
            raise DeviceLimitsError(f"VKPOOL_DEVICE_LIMITS: {name} = {value.strip()!r} is not a whole number") from None
        if name in _TRIPLES and len(values) == 1:
            values *= 3
        if len(values) != (3 if name in _TRIPLES else 1) or min(values) < 1:
            raise DeviceLimitsError(f"VKPOOL_DEVICE_LIMITS: {name} = {value.strip()!r}: give "
                                    f"{'one or three positive numbers' if name in _TRIPLES else 'a positive number'}")
        out[name] = values
    return out


def lower_limits(info: PhysicalDeviceInfo, limits: dict[str, tuple[int, ...]]) -> PhysicalDeviceInfo:
    """``info`` believing the lower of its own limits and ``limits``: tests use it to run on lavapipe
    the code paths a device with smaller limits takes (folded workgroup grids, small shared memory).
    A limit is never raised above what the driver reports."""
    changes: dict[str, Any] = {}
    for name, values in limits.items():
        own = getattr(info, name)
        if name in _TRIPLES:
            changes[name] = tuple(min(a, b) for a, b in zip(own, values))
        else:
            changes[name] = min(own, values[0]) if own else values[0]
    return replace(info, **changes)


def discover() -> list[PhysicalDeviceInfo]:
    """Every physical device, one entry per GPU: the same UUID through two drivers appears once.

    ``VKPOOL_DEVICE_LIMITS`` lowers the limits every device is believed to have (see :func:`parse_limits`).
    """
    instance = Instance.get()
    infos = [describe(i, pd, instance) for i, pd in enumerate(instance.physical_devices)]
    limits = parse_limits(os.environ.get("VKPOOL_DEVICE_LIMITS", ""))
    if limits:
        infos = [lower_limits(i, limits) for i in infos]
    best: dict[str, PhysicalDeviceInfo] = {}
    for info in infos:
        seen = best.get(info.uuid)
        if seen is None or _driver_rank(info) > _driver_rank(seen):
            best[info.uuid] = info
    kept = {id(i) for i in best.values()}
    return [i for i in infos if id(i) in kept]
