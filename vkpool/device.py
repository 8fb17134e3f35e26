"""A logical Vulkan device: queue, memory types, pipelines, command buffers and fences.

One :class:`LogicalDevice` exists per physical device; the members of a split device share
it (each with its own budget and allocators). All pipelines share one layout: no descriptor
sets, one push-constant range. Tensors are reached by buffer device address.
"""
from __future__ import annotations

import atexit
import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from vkpool import shaders, vk
from vkpool.cache import cache_dir, write_atomic
from vkpool.config.loader import TRANSFER_QUEUE_MODES
from vkpool.discovery import PhysicalDeviceInfo
from vkpool.kernels.base import DeviceCaps, UnsupportedOp
from vkpool.kernel_variants import gemm_choice


@dataclass
class Counters:
    """What the device did: tests prove a steady-state run records, writes and allocates nothing."""

    recordings: int = 0
    descriptor_writes: int = 0
    pipelines_created: int = 0
    submissions: int = 0


#: bounds of the window in which :meth:`LogicalDevice.wait` polls a fence before blocking
WAIT_POLL_MIN_S = 0.0002
WAIT_POLL_MAX_S = 0.005


@dataclass(eq=False)
class Timeline:
    """A timeline semaphore: each run of a chunk signals the next value, and a run of another
    chunk on the same device waits on the device for the value of the run it reads from."""

    handle: Any
    value: int = 0  # the value the last submitted run signals (guarded by the device's queue lock)


@dataclass(eq=False)
class Submission:
    """A recorded command buffer with its prebuilt VkSubmitInfo and fence."""

    device: LogicalDevice
    cmd: Any
    info: Any
    keep: Any  # the C arrays the submit infos point to
    fence: Any
    fence_array: Any
    #: when the last submit happened (``perf_counter``) and how long this command buffer's runs
    #: take until the host sees them done (seconds): how long :meth:`LogicalDevice.wait` polls
    submitted_at: float = 0.0
    typical_s: float = 0.0
    #: submit infos for the transfer queue, before and after ``info`` (semaphores between them)
    before: Any = None
    after: Any = None
    #: the values the first submission waits for on its timelines (a C array :meth:`LogicalDevice.submit`
    #: fills), the timeline the last one signals and the C array holding that value
    wait_values: Any = None
    signal: Timeline | None = None
    signal_value: Any = None
    #: the C array of command buffers of ``info`` (``cmd`` first) and how many places follow it,
    #: which :meth:`LogicalDevice.submit` fills per run
    commands: Any = None
    follow: int = 0

    def release(self) -> None:
        self.device.destroy_fence(self.fence)
        self.device.free_command_buffer(self.cmd)


class LogicalDevice:
    def __init__(self, info: PhysicalDeviceInfo, transfer_queue: str = "auto") -> None:
        if transfer_queue not in TRANSFER_QUEUE_MODES:
            raise ValueError(f"transfer queue mode {transfer_queue!r}: use one of {', '.join(TRANSFER_QUEUE_MODES)}")
        # which queue runs the copies between a run slot's host memory and device memory
        # (:meth:`submission` with ``before``/``after``; the ``transfer_queue`` of the device's
        # config rule): "auto" a queue of a transfer-only family where the device has one (copies
        # then overlap other runs' compute), else none; "off" none (copies are copy shaders in the
        # run's own command buffer); "main" separate submissions on the compute queue itself, which
        # overlaps nothing and exists to check the mechanism on devices without a transfer family.
        # Only chunks with several run slots (plans' chunks, replicas) use it. "auto" by default: on
        # two H200s it gave plans split over both GPUs lower latency at the same throughput
        # (docs/benchmarks.md, "Several GPUs"; one product with 16 MiB inputs and outputs ran 6 %
        # slower with it, bench/transfer_queue.py).
        self.transfer_queue_mode = transfer_queue
        if not info.usable:
            raise vk.VulkanUnavailable(f"device {info.index} ({info.name}) cannot be used: {info.unusable_reason}")
        self.info = info
        self.name = f"vk{info.index}"
        self.counters = Counters()
        self._b = vk.binding()
        self._ffi = vk.ffi()
        self._lib = vk.lib()
        self._keep: list[Any] = []
        #: the product tiling this device runs (vkpool.kernel_variants); a bad VKPOOL_KERNEL_VARIANT
        #: is refused here, before anything is created
        self.gemm = gemm_choice(info)
        self._create_device()
        self._choose_memory_types()
        self.queue_lock = threading.Lock()
        self._record_lock = threading.Lock()
        self._create_layout_and_cache()
        self.pipelines: dict[str, Any] = {}
        self._pipeline_lock = threading.Lock()
        self.caps = DeviceCaps(
            subgroup_size=info.subgroup_size or 32,
            max_workgroup_invocations=info.max_workgroup_invocations,
            max_workgroup_count=info.max_workgroup_count,
            max_loop_iterations=info.max_loop_iterations,
            shared_memory_bytes=info.max_shared_memory_bytes,
            max_push_constant_bytes=self.push_constant_bytes,
            float16=info.capabilities.get("fp16", False),
            int8=info.capabilities.get("int8", False),
            int64=info.capabilities.get("int64", False),
            subgroup_arithmetic=info.capabilities.get("subgroup_arithmetic", False),
            subgroup_shuffle=info.capabilities.get("subgroup_shuffle", False),
            cooperative_matrix=info.capabilities.get("cooperative_matrix", False),
            cooperative_matrix_f16=tuple(info.cooperative_matrix_f16),
            gemm_variant=self.gemm.variant,
            register_tile=self.gemm.register_tile,
            cpu_like=info.type == "cpu",
        )
        self._closed = False
        atexit.register(self.save_pipeline_cache)

    # -- creation ---------------------------------------------------------------------------
    def _create_device(self) -> None:
        ffi, b, info = self._ffi, self._b, self.info
        pd = info.handle
        count = ffi.new("uint32_t*")
        self._lib.vkGetPhysicalDeviceQueueFamilyProperties(pd, count, ffi.NULL)
        fams = ffi.new("VkQueueFamilyProperties[]", count[0])
        self._lib.vkGetPhysicalDeviceQueueFamilyProperties(pd, count, fams)
        self.queue_flags = flags = [int(fams[i].queueFlags) for i in range(count[0])]
        family = choose_queue_family(flags)
        if family is None:
            raise vk.VulkanUnavailable(f"{info.name} has no compute queue")
        self.queue_family = family
        #: the family of the queue that runs run slots' copies (None: copies are copy shaders)
        self.transfer_family: int | None = {"auto": choose_transfer_family(flags), "main": family}.get(
            self.transfer_queue_mode)
        families = list(dict.fromkeys([family, self.transfer_family if self.transfer_family is not None else family]))
        priority = ffi.new("float[]", [1.0])
        qinfo = ffi.new("VkDeviceQueueCreateInfo[]", [{
            "sType": b.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
            "queueFamilyIndex": f, "queueCount": 1, "pQueuePriorities": priority,
        } for f in families])
        # buffers that both families' queues use are shared between them (no ownership transfers)
        self._sharing = ffi.new("uint32_t[]", families)
        caps = info.capabilities
        f11 = ffi.new("VkPhysicalDeviceVulkan11Features*", {
            "sType": b.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES,
            "storageBuffer16BitAccess": int(caps.get("storage_16bit", False)),
        })
        f12 = ffi.new("VkPhysicalDeviceVulkan12Features*", {
            "sType": b.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES,
            "bufferDeviceAddress": 1,
            "timelineSemaphore": 1,
            "storageBuffer8BitAccess": 1,
            "shaderInt8": int(caps.get("int8", False)),
            "shaderFloat16": int(caps.get("fp16", False)),
            # cooperative-matrix shaders use the Vulkan memory model (glslang emits it for them)
            "vulkanMemoryModel": int(caps.get("vulkan_memory_model", False)),
        })
        f11.pNext = f12
        f2 = ffi.new("VkPhysicalDeviceFeatures2*", {"sType": b.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2})
        f2.features.shaderInt64 = int(caps.get("int64", False))
        f2.pNext = f11
        ext_names: list[bytes] = []
        if caps.get("cooperative_matrix"):
            fcm = ffi.new("VkPhysicalDeviceCooperativeMatrixFeaturesKHR*", {
                "sType": b.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR,
                "cooperativeMatrix": 1,
            })
            f12.pNext = fcm
            self._keep.append(fcm)
            ext_names.append(b"VK_KHR_cooperative_matrix")
        if caps.get("memory_budget"):
            ext_names.append(b"VK_EXT_memory_budget")
        # host memory another process shares (a mapping) read and written by kernels in place
        self.host_import_alignment: int | None = None
        if caps.get("external_memory_host"):
            ext_names.append(b"VK_EXT_external_memory_host")
            hprops = ffi.new("VkPhysicalDeviceExternalMemoryHostPropertiesEXT*", {
                "sType": b.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_EXTERNAL_MEMORY_HOST_PROPERTIES_EXT,
            })
            props2 = ffi.new("VkPhysicalDeviceProperties2*", {
                "sType": b.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, "pNext": hprops,
            })
            self._lib.vkGetPhysicalDeviceProperties2(pd, props2)
            self.host_import_alignment = int(hprops.minImportedHostPointerAlignment)
        ext_c = [ffi.new("char[]", n) for n in ext_names]
        ext_arr = ffi.new("char*[]", ext_c) if ext_c else ffi.NULL
        dinfo = ffi.new("VkDeviceCreateInfo*", {
            "sType": b.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, "pNext": f2,
            "queueCreateInfoCount": len(families), "pQueueCreateInfos": qinfo,
            "enabledExtensionCount": len(ext_c), "ppEnabledExtensionNames": ext_arr,
        })
        handle = ffi.new("VkDevice*")
        vk.call("vkCreateDevice", pd, dinfo, ffi.NULL, handle, member=self.name)
        self.handle = handle[0]
        self._keep += [priority, qinfo, f11, f12, f2, ext_c, ext_arr, dinfo]
        self.queue, self.command_pool = self._queue_and_pool(family)
        self.transfer_queue, self.transfer_pool = (self.queue, self.command_pool) if self.transfer_family in (
            None, family) else self._queue_and_pool(self.transfer_family)

    def _queue_and_pool(self, family: int) -> tuple[Any, Any]:
        ffi, b = self._ffi, self._b
        q = ffi.new("VkQueue*")
        self._lib.vkGetDeviceQueue(self.handle, family, 0, q)
        pool_info = ffi.new("VkCommandPoolCreateInfo*", {
            "sType": b.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
            "flags": b.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
            "queueFamilyIndex": family,
        })
        pool = ffi.new("VkCommandPool*")
        vk.call("vkCreateCommandPool", self.handle, pool_info, ffi.NULL, pool, member=self.name)
        return q[0], pool[0]

    def _choose_memory_types(self) -> None:
        b = self._b
        props = self._ffi.new("VkPhysicalDeviceMemoryProperties*")
        self._lib.vkGetPhysicalDeviceMemoryProperties(self.info.handle, props)
        types = [(i, props.memoryTypes[i].propertyFlags, props.memoryTypes[i].heapIndex)
                 for i in range(props.memoryTypeCount)]
        local_heap = self.info.device_local_heap.index
        DL, HV, HC, HCA = (b.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, b.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT,
                           b.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT, b.VK_MEMORY_PROPERTY_HOST_CACHED_BIT)

        def pick(required: int, preferred: int = 0, heap: int | None = None) -> int | None:
            cands = [(i, f) for i, f, h in types if f & required == required and (heap is None or h == heap)]
            if not cands:
                return None
            return max(cands, key=lambda c: (c[1] & preferred == preferred, -c[0]))[0]

        local = pick(DL, heap=local_heap)
        if local is None:
            local = pick(0, heap=local_heap)
        assert local is not None
        self.device_type = local
        self.device_type_host_visible = bool(types[local][1] & HV)
        # device memory the host can write through a mapping (all of it on lavapipe and integrated
        # GPUs; on a discrete GPU with a resizable BAR, a type of the same heap): inputs written
        # there are read by kernels at device speed with no copy on the device
        self.mapped_device_type = local if self.device_type_host_visible else pick(DL | HV | HC, heap=local_heap)
        host = pick(HV | HC, HCA)
        if host is None:
            raise vk.VulkanUnavailable(f"{self.info.name} has no host-visible coherent memory")
        self.host_type = host
        self.memory_flags = {i: f for i, f, _ in types}

    def _create_layout_and_cache(self) -> None:
        ffi, b = self._ffi, self._b
        self.push_constant_bytes = min(256, self.info.max_push_constant_bytes)
        rng = ffi.new("VkPushConstantRange*", {
            "stageFlags": b.VK_SHADER_STAGE_COMPUTE_BIT, "offset": 0, "size": self.push_constant_bytes,
        })
        linfo = ffi.new("VkPipelineLayoutCreateInfo*", {
            "sType": b.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO,
            "pushConstantRangeCount": 1, "pPushConstantRanges": rng,
        })
        layout = ffi.new("VkPipelineLayout*")
        vk.call("vkCreatePipelineLayout", self.handle, linfo, ffi.NULL, layout, member=self.name)
        self.layout = layout[0]
        self._keep += [rng, linfo]
        key = f"{self.info.uuid}-{self.info.driver_version}-{self.info.driver_info}"
        self._cache_path = cache_dir("pipelines") / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".bin")
        initial = self._cache_path.read_bytes() if self._cache_path.exists() else b""
        init_buf = ffi.from_buffer(initial) if initial else ffi.NULL
        cinfo = ffi.new("VkPipelineCacheCreateInfo*", {
            "sType": b.VK_STRUCTURE_TYPE_PIPELINE_CACHE_CREATE_INFO,
            "initialDataSize": len(initial), "pInitialData": init_buf,
        })
        cache = ffi.new("VkPipelineCache*")
        try:
            vk.call("vkCreatePipelineCache", self.handle, cinfo, ffi.NULL, cache, member=self.name)
        except vk.VulkanError:  # a corrupt or foreign cache file: start empty
            cinfo.initialDataSize, cinfo.pInitialData = 0, ffi.NULL
            vk.call("vkCreatePipelineCache", self.handle, cinfo, ffi.NULL, cache, member=self.name)
        self.pipeline_cache = cache[0]
        self._cache_dirty = False

    # -- pipelines --------------------------------------------------------------------------
    def pipeline(self, shader: str, defines: dict[str, Any]) -> Any:
        """The compute pipeline of a shader variant, built once per device."""
        code = shaders.spirv(shader, defines)
        key = hashlib.sha256(code).hexdigest()
        with self._pipeline_lock:
            found = self.pipelines.get(key)
            if found is not None:
                return found
            size = shaders.local_size(code)
            limits = self.info.max_workgroup_size
            if size is not None and (size[0] * size[1] * size[2] > self.info.max_workgroup_invocations
                                     or any(s > m for s, m in zip(size, limits))):
                raise UnsupportedOp(
                    f"{shader}: workgroups of {size[0]} x {size[1]} x {size[2]} invocations exceed {self.name}'s "
                    f"limits ({self.info.max_workgroup_invocations} invocations, {limits[0]} x {limits[1]} x "
                    f"{limits[2]})")
            ffi, b = self._ffi, self._b
            code_buf = ffi.from_buffer(code)
            minfo = ffi.new("VkShaderModuleCreateInfo*", {
                "sType": b.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO,
                "codeSize": len(code), "pCode": ffi.cast("uint32_t*", code_buf),
            })
            module = ffi.new("VkShaderModule*")
            vk.call("vkCreateShaderModule", self.handle, minfo, ffi.NULL, module, member=self.name)
            entry = ffi.new("char[]", b"main")
            stage = ffi.new("VkPipelineShaderStageCreateInfo*", {
                "sType": b.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO,
                "stage": b.VK_SHADER_STAGE_COMPUTE_BIT, "module": module[0], "pName": entry,
            })
            pinfo = ffi.new("VkComputePipelineCreateInfo*", {
                "sType": b.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO, "layout": self.layout,
            })
            pinfo.stage = stage[0]
            pipe = ffi.new("VkPipeline*")
            try:
                vk.call("vkCreateComputePipelines", self.handle, self.pipeline_cache, 1, pinfo, ffi.NULL, pipe,
                        member=self.name)
            finally:
                self._lib.vkDestroyShaderModule(self.handle, module[0], ffi.NULL)
            self.pipelines[key] = pipe[0]
            self.counters.pipelines_created += 1
            self._cache_dirty = True
            return pipe[0]

    def save_pipeline_cache(self) -> None:
        if self._closed or not self._cache_dirty:
            return
        ffi = self._ffi
        size = ffi.new("size_t*")
        vk.call("vkGetPipelineCacheData", self.handle, self.pipeline_cache, size, ffi.NULL, member=self.name)
        data = ffi.new("char[]", size[0])
        vk.call("vkGetPipelineCacheData", self.handle, self.pipeline_cache, size, data, member=self.name)
        write_atomic(self._cache_path, bytes(ffi.buffer(data, size[0])))
        self._cache_dirty = False

    # -- memory blocks ----------------------------------------------------------------------
    def create_block(self, size: int, memory_type: int, *, dedicated: bool = False
                     ) -> tuple[Any, Any, int, np.ndarray | None]:
        """A buffer with memory of its own. ``dedicated`` (one large tensor) tells the driver the
        memory serves that buffer alone (VkMemoryDedicatedAllocateInfo), which lets it choose
        placement and page size for it."""
        ffi, b = self._ffi, self._b
        buf, req = self._new_buffer(size)
        if not (req.memoryTypeBits >> memory_type) & 1:
            self._lib.vkDestroyBuffer(self.handle, buf, ffi.NULL)
            raise vk.VulkanError("vkGetBufferMemoryRequirements", b.VK_ERROR_FEATURE_NOT_PRESENT, self.name)
        only = ffi.new("VkMemoryDedicatedAllocateInfo*", {
            "sType": b.VK_STRUCTURE_TYPE_MEMORY_DEDICATED_ALLOCATE_INFO, "buffer": buf,
        })
        mem, address = self._bind_new_memory(buf, req.size, memory_type, only if dedicated else ffi.NULL)
        mapped = None
        if self.memory_flags[memory_type] & b.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT:
            ptr = ffi.new("void**")
            vk.call("vkMapMemory", self.handle, mem, 0, size, 0, ptr, member=self.name)
            mapped = np.frombuffer(ffi.buffer(ptr[0], size), dtype=np.uint8)
        return mem, buf, address, mapped

    def import_host(self, address: int, size: int) -> tuple[Any, Any, int]:
        """A buffer over ``size`` bytes of host memory at ``address`` that this process has
        mapped (``VK_EXT_external_memory_host``; both aligned to ``host_import_alignment``):
        kernels read and write that memory in place. Returns (memory, buffer, device address);
        :meth:`destroy_block` frees them, and the host memory must outlive them."""
        ffi, b = self._ffi, self._b
        query = vk.proc(self.handle, "vkGetMemoryHostPointerPropertiesEXT", device=True) \
            if self.host_import_alignment else None
        if query is None:
            raise vk.VulkanError("vkGetMemoryHostPointerPropertiesEXT", b.VK_ERROR_EXTENSION_NOT_PRESENT, self.name)
        align = self.host_import_alignment
        if address % align or size % align or size <= 0:
            raise ValueError(f"{self.name}: host memory to import must start and end on {align}-byte boundaries")
        handle_type = b.VK_EXTERNAL_MEMORY_HANDLE_TYPE_HOST_ALLOCATION_BIT_EXT
        pointer = ffi.cast("void*", address)
        props = ffi.new("VkMemoryHostPointerPropertiesEXT*", {
            "sType": b.VK_STRUCTURE_TYPE_MEMORY_HOST_POINTER_PROPERTIES_EXT,
        })
        vk.check("vkGetMemoryHostPointerPropertiesEXT", query(self.handle, handle_type, pointer, props), self.name)
        external = ffi.new("VkExternalMemoryBufferCreateInfo*", {
            "sType": b.VK_STRUCTURE_TYPE_EXTERNAL_MEMORY_BUFFER_CREATE_INFO, "handleTypes": handle_type,
        })
        buf, req = self._new_buffer(size, external)
        coherent = b.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | b.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
        usable = props.memoryTypeBits & req.memoryTypeBits
        kinds = [i for i in range(32) if (usable >> i) & 1 and self.memory_flags.get(i, 0) & coherent == coherent]
        if not kinds:
            self._lib.vkDestroyBuffer(self.handle, buf, ffi.NULL)
            raise vk.VulkanError("vkGetMemoryHostPointerPropertiesEXT", b.VK_ERROR_FEATURE_NOT_PRESENT, self.name)
        importing = ffi.new("VkImportMemoryHostPointerInfoEXT*", {
            "sType": b.VK_STRUCTURE_TYPE_IMPORT_MEMORY_HOST_POINTER_INFO_EXT,
            "handleType": handle_type, "pHostPointer": pointer,
        })
        mem, device_address = self._bind_new_memory(buf, size, kinds[0], importing)
        return mem, buf, device_address

    def _new_buffer(self, size: int, pnext: Any = None) -> tuple[Any, Any]:
        """A storage buffer of ``size`` bytes (copies and device addresses too), and its
        memory requirements."""
        ffi, b = self._ffi, self._b
        binfo = ffi.new("VkBufferCreateInfo*", {
            "sType": b.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, "pNext": ffi.NULL if pnext is None else pnext,
            "size": size,
            "usage": (b.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | b.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                      | b.VK_BUFFER_USAGE_TRANSFER_DST_BIT | vk.BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT),
            "sharingMode": b.VK_SHARING_MODE_CONCURRENT if len(self._sharing) > 1 else b.VK_SHARING_MODE_EXCLUSIVE,
            "queueFamilyIndexCount": len(self._sharing), "pQueueFamilyIndices": self._sharing,
        })
        buf = ffi.new("VkBuffer*")
        vk.call("vkCreateBuffer", self.handle, binfo, ffi.NULL, buf, member=self.name)
        req = ffi.new("VkMemoryRequirements*")
        self._lib.vkGetBufferMemoryRequirements(self.handle, buf[0], req)
        return buf[0], req

    def _bind_new_memory(self, buf: Any, size: int, memory_type: int, pnext: Any) -> tuple[Any, int]:
        """Allocates ``size`` bytes of ``memory_type`` (with ``pnext`` chained: dedicated or
        imported), binds ``buf`` to it and returns (memory, the buffer's device address); the
        buffer is destroyed if that fails."""
        ffi, b, lib = self._ffi, self._b, self._lib
        flags = ffi.new("VkMemoryAllocateFlagsInfo*", {
            "sType": b.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO, "pNext": pnext,
            "flags": vk.MEMORY_ALLOCATE_DEVICE_ADDRESS_BIT,
        })
        ainfo = ffi.new("VkMemoryAllocateInfo*", {
            "sType": b.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, "pNext": flags,
            "allocationSize": size, "memoryTypeIndex": memory_type,
        })
        mem = ffi.new("VkDeviceMemory*")
        try:
            vk.call("vkAllocateMemory", self.handle, ainfo, ffi.NULL, mem, member=self.name)
        except vk.VulkanError:
            lib.vkDestroyBuffer(self.handle, buf, ffi.NULL)
            raise
        try:
            vk.call("vkBindBufferMemory", self.handle, buf, mem[0], 0, member=self.name)
        except vk.VulkanError:
            lib.vkDestroyBuffer(self.handle, buf, ffi.NULL)
            lib.vkFreeMemory(self.handle, mem[0], ffi.NULL)
            raise
        dinfo = ffi.new("VkBufferDeviceAddressInfo*", {
            "sType": b.VK_STRUCTURE_TYPE_BUFFER_DEVICE_ADDRESS_INFO, "buffer": buf,
        })
        return mem[0], int(lib.vkGetBufferDeviceAddress(self.handle, dinfo))

    def destroy_block(self, memory: Any, buffer: Any, *, mapped: bool) -> None:
        if mapped:
            self._lib.vkUnmapMemory(self.handle, memory)
        self._lib.vkDestroyBuffer(self.handle, buffer, self._ffi.NULL)
        self._lib.vkFreeMemory(self.handle, memory, self._ffi.NULL)

    # -- command buffers ----------------------------------------------------------------------
    def allocate_command_buffer(self, *, transfer: bool = False) -> Any:
        """A primary command buffer for the compute queue, or with ``transfer`` for the
        transfer queue (free it with the same ``transfer``)."""
        ffi, b = self._ffi, self._b
        info = ffi.new("VkCommandBufferAllocateInfo*", {
            "sType": b.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
            "commandPool": self.transfer_pool if transfer else self.command_pool,
            "level": b.VK_COMMAND_BUFFER_LEVEL_PRIMARY, "commandBufferCount": 1,
        })
        cmd = ffi.new("VkCommandBuffer*")
        with self._record_lock:
            vk.call("vkAllocateCommandBuffers", self.handle, info, cmd, member=self.name)
        return cmd[0]

    def free_command_buffer(self, cmd: Any, *, transfer: bool = False) -> None:
        arr = self._ffi.new("VkCommandBuffer[]", [cmd])
        with self._record_lock:
            self._lib.vkFreeCommandBuffers(self.handle, self.transfer_pool if transfer else self.command_pool, 1, arr)

    def create_semaphore(self) -> Any:
        return self._create_sync("Semaphore")

    def create_timeline(self) -> Timeline:
        """A timeline semaphore at value 0 (free it with :meth:`destroy_semaphore` on its handle)."""
        ffi, b = self._ffi, self._b
        kind = ffi.new("VkSemaphoreTypeCreateInfo*", {"sType": b.VK_STRUCTURE_TYPE_SEMAPHORE_TYPE_CREATE_INFO,
                                                     "semaphoreType": b.VK_SEMAPHORE_TYPE_TIMELINE,
                                                     "initialValue": 0})
        info = ffi.new("VkSemaphoreCreateInfo*", {"sType": b.VK_STRUCTURE_TYPE_SEMAPHORE_CREATE_INFO, "pNext": kind})
        handle = ffi.new("VkSemaphore*")
        vk.call("vkCreateSemaphore", self.handle, info, ffi.NULL, handle, member=self.name)
        return Timeline(handle[0])

    def wait_idle(self) -> None:
        """Waits until the device has finished everything submitted to it, semaphore signals
        included: before the command buffers, fences and semaphores of runs are destroyed, since
        a fence can be seen signalled a moment before the semaphores of its batches (lavapipe)."""
        with self.queue_lock:
            vk.check("vkDeviceWaitIdle", self._lib.vkDeviceWaitIdle(self.handle), self.name)

    def destroy_semaphore(self, sem: Any) -> None:
        self._lib.vkDestroySemaphore(self.handle, sem, self._ffi.NULL)

    def record(self, cmd: Any, commands: list[tuple[Any, ...]], *, one_time: bool = False,
               query_pool: Any = None, transfer: bool = False, each: bool = True) -> None:
        """Records ``commands`` into ``cmd``: ('dispatch', pipeline, push_bytes, groups),
        ('barrier',), ('copy', src_buffer, src_offset, dst_buffer, dst_offset, size),
        ('copy_regions', src_buffer, dst_buffer, regions) with regions a C-contiguous uint64 array
        of (src offset, dst offset, size) rows,
        ('host_barrier',) making results visible to host reads,
        ('run_barrier',) ordering everything after it behind all work submitted before it
        (transfers and dispatches alike: a run after another run of the same recording).

        A barrier whose neighbouring commands (back to the previous barrier and on to the next)
        are all dispatches orders compute against compute only: leaving the transfer stage out
        spares the driver from synchronising the copy path between dependent dispatches.
        With ``query_pool`` (``len(dispatches) + 1`` timestamp queries), a timestamp is written
        before the first command and after each dispatch: the profile of :meth:`profile`; with
        ``each`` False (two queries), after the last command only.
        ``transfer``: for the transfer queue (copies and barriers over the transfer stage only)."""
        ffi, b, lib = self._ffi, self._b, self._lib
        begin = ffi.new("VkCommandBufferBeginInfo*", {
            "sType": b.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
            "flags": b.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT if one_time else 0,
        })
        all_stages = b.VK_PIPELINE_STAGE_TRANSFER_BIT | (0 if transfer else b.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT)
        mb, host_mb, compute_mb = self.memory_barriers()
        if transfer:  # a transfer queue's commands write by copying only
            mb = host_mb = ffi.new("VkMemoryBarrier*", {"sType": b.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                                                        "srcAccessMask": b.VK_ACCESS_TRANSFER_WRITE_BIT,
                                                        "dstAccessMask": b.VK_ACCESS_HOST_READ_BIT})
        compute = b.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
        near_copy = _barriers_near_copies(commands)
        region = ffi.new("VkBufferCopy*")
        with self._record_lock:
            vk.call("vkBeginCommandBuffer", cmd, begin, member=self.name)
            if query_pool is not None:
                stamps = 1 + sum(c[0] == "dispatch" for c in commands) if each else 2
                lib.vkCmdResetQueryPool(cmd, query_pool, 0, stamps)
                lib.vkCmdWriteTimestamp(cmd, b.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, query_pool, 0)
            bound = None
            stamp = 1
            for i, c in enumerate(commands):
                kind = c[0]
                if kind == "dispatch":
                    _, pipe, push, groups = c
                    if pipe != bound:
                        lib.vkCmdBindPipeline(cmd, b.VK_PIPELINE_BIND_POINT_COMPUTE, pipe)
                        bound = pipe
                    if push:
                        pbuf = ffi.from_buffer(push)
                        lib.vkCmdPushConstants(cmd, self.layout, b.VK_SHADER_STAGE_COMPUTE_BIT, 0, len(push), pbuf)
                    lib.vkCmdDispatch(cmd, *groups)
                    if query_pool is not None and each:
                        lib.vkCmdWriteTimestamp(cmd, b.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, query_pool, stamp)
                        stamp += 1
                elif kind == "barrier":
                    if i in near_copy:
                        lib.vkCmdPipelineBarrier(cmd, all_stages, all_stages, 0, 1, mb, 0, ffi.NULL, 0, ffi.NULL)
                    else:
                        lib.vkCmdPipelineBarrier(cmd, compute, compute, 0, 1, compute_mb, 0, ffi.NULL, 0, ffi.NULL)
                elif kind == "run_barrier":
                    lib.vkCmdPipelineBarrier(cmd, all_stages, all_stages, 0, 1, mb, 0, ffi.NULL, 0, ffi.NULL)
                elif kind == "host_barrier":
                    lib.vkCmdPipelineBarrier(cmd, all_stages, b.VK_PIPELINE_STAGE_HOST_BIT, 0, 1, host_mb,
                                             0, ffi.NULL, 0, ffi.NULL)
                elif kind == "copy":
                    _, src, soff, dst, doff, size = c
                    region.srcOffset, region.dstOffset, region.size = soff, doff, size
                    lib.vkCmdCopyBuffer(cmd, src, dst, 1, region)
                elif kind == "copy_regions":  # regions: uint64 rows of (src offset, dst offset, size)
                    _, src, dst, regions = c
                    lib.vkCmdCopyBuffer(cmd, src, dst, len(regions),
                                        ffi.cast("VkBufferCopy*", ffi.from_buffer(regions)))
                else:
                    raise ValueError(f"unknown command {kind!r}")
            if query_pool is not None and not each:
                lib.vkCmdWriteTimestamp(cmd, b.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, query_pool, 1)
            vk.call("vkEndCommandBuffer", cmd, member=self.name)
        self.counters.recordings += 1

    def memory_barriers(self) -> tuple[Any, Any, Any]:
        """The three memory barriers :meth:`record` uses: shader or transfer writes before any
        shader or transfer access; those writes before host reads; shader writes before shader
        access (between dispatches only)."""
        ffi, b = self._ffi, self._b
        writes = b.VK_ACCESS_SHADER_WRITE_BIT | b.VK_ACCESS_TRANSFER_WRITE_BIT

        def barrier(src: int, dst: int) -> Any:
            return ffi.new("VkMemoryBarrier*", {"sType": b.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                                                "srcAccessMask": src, "dstAccessMask": dst})

        return (barrier(writes, b.VK_ACCESS_SHADER_READ_BIT | b.VK_ACCESS_SHADER_WRITE_BIT
                        | b.VK_ACCESS_TRANSFER_READ_BIT | b.VK_ACCESS_TRANSFER_WRITE_BIT),
                barrier(writes, b.VK_ACCESS_HOST_READ_BIT),
                barrier(b.VK_ACCESS_SHADER_WRITE_BIT, b.VK_ACCESS_SHADER_READ_BIT | b.VK_ACCESS_SHADER_WRITE_BIT))

    def profile(self, commands: list[tuple[Any, ...]], *, each: bool = True) -> list[float]:
        """Runs ``commands`` once with a GPU timestamp after every dispatch and returns each
        dispatch's time in microseconds (from the previous timestamp, so a dispatch's share
        includes the barrier before it). Timestamps serialise a little, so the sum runs a bit
        above an unprofiled run; the shares are what matter. With ``each`` False, one timestamp
        before the first command and one after the last: ``[the GPU time of the whole run]``."""
        ffi, b, lib = self._ffi, self._b, self._lib
        n = sum(c[0] == "dispatch" for c in commands) if each else 1
        info = ffi.new("VkQueryPoolCreateInfo*", {
            "sType": b.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
            "queryType": b.VK_QUERY_TYPE_TIMESTAMP, "queryCount": n + 1,
        })
        pool = ffi.new("VkQueryPool*")
        vk.call("vkCreateQueryPool", self.handle, info, ffi.NULL, pool, member=self.name)
        cmd = self.allocate_command_buffer()
        sub = self.submission(cmd)
        try:
            self.record(cmd, commands, one_time=True, query_pool=pool[0], each=each)
            self.counters.recordings -= 1  # a profile is not a model recording
            self.submit(sub)
            self.wait(sub)
            stamps = np.zeros(n + 1, dtype=np.uint64)
            vk.check("vkGetQueryPoolResults", lib.vkGetQueryPoolResults(
                self.handle, pool[0], 0, n + 1, stamps.nbytes, ffi.from_buffer(stamps), 8,
                b.VK_QUERY_RESULT_64_BIT | b.VK_QUERY_RESULT_WAIT_BIT), self.name)
        finally:
            sub.release()
            lib.vkDestroyQueryPool(self.handle, pool[0], ffi.NULL)
        props = ffi.new("VkPhysicalDeviceProperties*")
        lib.vkGetPhysicalDeviceProperties(self.info.handle, props)
        period_us = props.limits.timestampPeriod / 1000.0
        return [float(d) * period_us for d in np.diff(stamps.astype(np.int64))]

    def create_fence(self) -> Any:
        return self._create_sync("Fence")

    def _create_sync(self, kind: str) -> Any:
        """A new ``VkFence`` or (binary) ``VkSemaphore``: ``kind`` is "Fence" or "Semaphore"."""
        ffi = self._ffi
        info = ffi.new(f"Vk{kind}CreateInfo*", {"sType": getattr(self._b, f"VK_STRUCTURE_TYPE_{kind.upper()}_CREATE_INFO")})
        handle = ffi.new(f"Vk{kind}*")
        vk.call(f"vkCreate{kind}", self.handle, info, ffi.NULL, handle, member=self.name)
        return handle[0]

    def destroy_fence(self, fence: Any) -> None:
        self._lib.vkDestroyFence(self.handle, fence, self._ffi.NULL)

    def submission(self, cmd: Any, *, before: tuple[Any, Any] | None = None,
                   after: tuple[Any, Any] | None = None, waits: Sequence[Timeline] = (),
                   signal: Timeline | None = None, follow: int = 0) -> Submission:
        """What a run submits, built once and reused by every run: ``cmd`` on the compute
        queue, and optionally a command buffer on the transfer queue ``before`` it (which
        ``cmd`` waits for at the compute stage) and one ``after`` it (which waits for ``cmd``,
        at the transfer stage), each given as (command buffer, semaphore it signals). The
        first of them waits for ``waits`` (timelines of other chunks' runs, the values given
        to :meth:`submit`), the last signals ``signal`` and the fence. ``follow``: places for
        that many command buffers behind ``cmd`` in its batch, given to each :meth:`submit`
        (the fence and signal then cover them too)."""
        ffi, b = self._ffi, self._b
        keep: list[Any] = []
        anywhere = b.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | b.VK_PIPELINE_STAGE_TRANSFER_BIT
        # the values the first submission waits for and the last one signals: filled by submit
        wait_values = ffi.new("uint64_t[]", len(waits)) if waits else None
        signal_value = ffi.new("uint64_t[]", 1) if signal is not None else None

        def info(buffer: Any, wait: Any = None, stage: int = 0, signal_sem: Any = None,
                 first: bool = False, last: bool = False, places: int = 0) -> Any:
            # a submission waits on a binary semaphore (the transfer before it) or, coming
            # first, on the timelines, never both; likewise for what it signals
            wait_sems, stages, signals = [], [], []
            timeline: dict[str, Any] = {}
            if wait is not None:
                wait_sems, stages = [wait], [stage]
            elif first and waits:
                wait_sems, stages = [t.handle for t in waits], [anywhere] * len(waits)
                timeline.update(waitSemaphoreValueCount=len(waits), pWaitSemaphoreValues=wait_values)
            if signal_sem is not None:
                signals = [signal_sem]
            elif last and signal is not None:
                signals = [signal.handle]
                timeline.update(signalSemaphoreValueCount=1, pSignalSemaphoreValues=signal_value)
            arrays = (ffi.new("VkCommandBuffer[]", [buffer] + [ffi.NULL] * places),
                      ffi.new("VkSemaphore[]", wait_sems), ffi.new("VkPipelineStageFlags[]", stages),
                      ffi.new("VkSemaphore[]", signals))
            keep.extend(arrays)
            fields: dict[str, Any] = {
                "sType": b.VK_STRUCTURE_TYPE_SUBMIT_INFO, "commandBufferCount": 1 + places,
                "pCommandBuffers": arrays[0],
                "waitSemaphoreCount": len(wait_sems), "pWaitSemaphores": arrays[1], "pWaitDstStageMask": arrays[2],
                "signalSemaphoreCount": len(signals), "pSignalSemaphores": arrays[3]}
            if timeline:
                fields["pNext"] = ffi.new("VkTimelineSemaphoreSubmitInfo*", {
                    "sType": b.VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO, **timeline})
                keep.append(fields["pNext"])
            return ffi.new("VkSubmitInfo*", fields)

        main = info(cmd, before[1] if before else None, b.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                    after[1] if after else None, first=before is None, last=after is None, places=follow)
        fence = self.create_fence()
        sub = Submission(self, cmd, main, keep, fence, ffi.new("VkFence[]", [fence]),
                         wait_values=wait_values, signal=signal, signal_value=signal_value,
                         commands=main.pCommandBuffers, follow=follow)
        keep.extend(v for v in (wait_values, signal_value) if v is not None)
        if before is not None:
            sub.before = info(before[0], signal_sem=before[1], first=True)
        if after is not None:
            sub.after = info(after[0], after[1], b.VK_PIPELINE_STAGE_TRANSFER_BIT, last=True)
        return sub

    def submit(self, sub: Submission, waits: Sequence[int] = (), follow: Sequence[Any] = ()) -> int:
        """Submits ``sub``, its first submission waiting for ``waits`` (one value per timeline
        it was built with) and ``follow`` (one command buffer per place it was built with)
        behind its command buffer; returns the value it signals on its timeline (0 without one)."""
        lib, null = self._lib, self._ffi.NULL
        signaled = 0
        if len(follow) != sub.follow:
            raise ValueError(f"{self.name}: {len(follow)} command buffers given for {sub.follow} places")
        for i, cmd in enumerate(follow, 1):
            sub.commands[i] = cmd
        with self.queue_lock:
            for i, value in enumerate(waits):
                sub.wait_values[i] = value
            if sub.signal is not None:
                sub.signal.value = signaled = sub.signal.value + 1
                sub.signal_value[0] = signaled
            if sub.before is not None:
                vk.check("vkQueueSubmit", lib.vkQueueSubmit(self.transfer_queue, 1, sub.before, null), self.name)
            if sub.after is None:
                vk.check("vkQueueSubmit", lib.vkQueueSubmit(self.queue, 1, sub.info, sub.fence), self.name)
            else:
                vk.check("vkQueueSubmit", lib.vkQueueSubmit(self.queue, 1, sub.info, null), self.name)
                vk.check("vkQueueSubmit", lib.vkQueueSubmit(self.transfer_queue, 1, sub.after, sub.fence), self.name)
            sub.submitted_at = time.perf_counter()
        self.counters.submissions += 1
        return signaled

    def ended(self, sub: Submission) -> bool:
        """Whether the submission's fence is signaled (without waiting; :meth:`wait` still
        follows, to reset it)."""
        r = self._lib.vkGetFenceStatus(self.handle, sub.fence)
        if r != vk.VK_SUCCESS and r != vk.VK_NOT_READY:
            vk.check("vkGetFenceStatus", r, self.name)
        return r == vk.VK_SUCCESS

    def wait(self, sub: Submission, *, spin_seconds: float | None = None) -> None:
        """Waits for the submission's fence, then resets it.

        Polls the fence first, since polling answers tens of microseconds sooner than the
        driver's blocking wait (NVIDIA H200: a 1 GiB GEMV model ran in 285 µs polled, 316 µs
        with a blocking wait after 0.2 ms, ``bench/wait_probe.py``); then blocks in the driver
        with the GIL released. The polling window is ``spin_seconds`` when given, else twice
        the time this command buffer's runs usually take, between ``WAIT_POLL_MIN_S`` and
        ``WAIT_POLL_MAX_S``: a run of usual length is polled to its end, and only a run far
        longer than usual (or longer than the cap) ends in a blocking wait. Sleeping through
        the expected time instead was tried: wake-ups came hundreds of microseconds late.

        NOTE: a timeline semaphore of each submission's own, signalled by its last batch and
        polled with ``vkGetSemaphoreCounterValue``, was tried in place of the fence (H200, driver
        580): back-to-back runs of float16 BERT-base saw their end 7 µs sooner
        (``python -m bench.sync_probe``), but the daemon's jobs/s at 16 and 64 clients fell in 7
        of 8 comparisons with this fence in the same call (docs/benchmarks.md)."""
        lib = self._lib
        fence, fence_array = sub.fence, sub.fence_array
        typical = sub.typical_s
        if spin_seconds is None:
            spin_seconds = min(WAIT_POLL_MAX_S, max(WAIT_POLL_MIN_S, 2.0 * typical))
        deadline = time.perf_counter() + spin_seconds
        while True:
            r = lib.vkGetFenceStatus(self.handle, fence)
            if r == vk.VK_SUCCESS:
                break
            if r != vk.VK_NOT_READY:
                vk.check("vkGetFenceStatus", r, self.name)
            if time.perf_counter() > deadline:
                while True:
                    r = lib.vkWaitForFences(self.handle, 1, fence_array, 1, 1_000_000_000)
                    if r == vk.VK_SUCCESS:
                        break
                    if r != vk.VK_TIMEOUT:
                        vk.check("vkWaitForFences", r, self.name)
                break
        took = time.perf_counter() - sub.submitted_at
        # follows a faster run at once and a slower one slowly, so one slow run (a clock dip)
        # does not stretch the polling of the runs after it
        sub.typical_s = took if typical == 0.0 or took < typical else 0.9 * typical + 0.1 * took
        vk.check("vkResetFences", lib.vkResetFences(self.handle, 1, fence_array), self.name)

    def run_once(self, commands: list[tuple[Any, ...]]) -> None:
        """Records, submits and waits for a one-time command buffer (uploads, downloads)."""
        cmd = self.allocate_command_buffer()
        sub = self.submission(cmd)
        try:
            self.record(cmd, commands, one_time=True)
            self.counters.recordings -= 1  # staging copies are not model recordings
            self.submit(sub)
            self.wait(sub)
        finally:
            sub.release()

    def close(self) -> None:
        if self._closed:
            return
        self.save_pipeline_cache()
        lib, ffi = self._lib, self._ffi
        lib.vkDeviceWaitIdle(self.handle)
        for pipe in self.pipelines.values():
            lib.vkDestroyPipeline(self.handle, pipe, ffi.NULL)
        self.pipelines.clear()
        lib.vkDestroyPipelineCache(self.handle, self.pipeline_cache, ffi.NULL)
        lib.vkDestroyPipelineLayout(self.handle, self.layout, ffi.NULL)
        lib.vkDestroyCommandPool(self.handle, self.command_pool, ffi.NULL)
        if self.transfer_pool != self.command_pool:
            lib.vkDestroyCommandPool(self.handle, self.transfer_pool, ffi.NULL)
        lib.vkDestroyDevice(self.handle, ffi.NULL)
        self._closed = True


def choose_queue_family(flags: list[int]) -> int | None:
    """The queue family runs use: the first with compute (on NVIDIA, AMD and Intel the main
    engine's graphics + compute family comes first), None when no family has compute."""
    compute_bit = vk.binding().VK_QUEUE_COMPUTE_BIT
    return next((i for i, f in enumerate(flags) if f & compute_bit), None)


def choose_transfer_family(flags: list[int]) -> int | None:
    """A family with transfer and neither compute nor graphics (a copy engine of its own), or None."""
    b = vk.binding()
    return next((i for i, f in enumerate(flags)
                 if f & b.VK_QUEUE_TRANSFER_BIT and not f & (b.VK_QUEUE_COMPUTE_BIT | b.VK_QUEUE_GRAPHICS_BIT)), None)


def _barriers_near_copies(commands: list[tuple[Any, ...]]) -> set[int]:
    """Indices of the barriers with a copy between them and the neighbouring barriers."""
    near: set[int] = set()
    segment_has_copy = False
    previous_barrier = -1
    for i, c in enumerate(commands):
        if c[0] == "copy":
            segment_has_copy = True
        elif c[0] in ("barrier", "host_barrier", "run_barrier"):
            if segment_has_copy:
                near.update(j for j in (previous_barrier, i) if j >= 0)
            segment_has_copy = False
            previous_barrier = i
    if segment_has_copy and previous_barrier >= 0:
        near.add(previous_barrier)
    return near
