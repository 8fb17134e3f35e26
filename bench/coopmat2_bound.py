"""Does VK_NV_cooperative_matrix2's tensor-addressing GEMM run faster with its matrices in
descriptor-bound storage buffers than through device addresses?

Usage: python -m bench.coopmat2_bound [--size 8192] [--reps 10] [--tiles cm2_128x256x32_t256_z8,...]

vkpool binds no descriptors (every kernel takes device addresses in push constants), and
``gemm_coopmat2.spvasm`` loads through those addresses. This experiment assembles
``bench/gemm_coopmat2_bound.spvasm``, the same kernel over three bound storage buffers, builds a
pipeline layout with one descriptor set for it, and times it with GPU timestamps against the
address form and the planner's subgroup-scope kernel, all on the same inputs; each result is
compared with the session's own output.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from bench.gemm_fp16 import _model, _replayed, tflops


class BoundPipeline:
    """A compute pipeline whose layout has one descriptor set of ``buffers`` storage buffers
    (bindings 0..n-1) and vkpool's push-constant range."""

    def __init__(self, device: Any, code: bytes, buffers: int) -> None:
        self.device = device
        ffi, b, h = device._ffi, device._b, device.handle
        self._keep: list[Any] = []
        binds = ffi.new(f"VkDescriptorSetLayoutBinding[{buffers}]")
        for i in range(buffers):
            binds[i].binding = i
            binds[i].descriptorType = b.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
            binds[i].descriptorCount = 1
            binds[i].stageFlags = b.VK_SHADER_STAGE_COMPUTE_BIT
        dsl = ffi.new("VkDescriptorSetLayout*")
        device_call = device._lib
        self._check("vkCreateDescriptorSetLayout", device_call.vkCreateDescriptorSetLayout(h, ffi.new(
            "VkDescriptorSetLayoutCreateInfo*", {"sType": b.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO,
                                                 "bindingCount": buffers, "pBindings": binds}), ffi.NULL, dsl))
        self.set_layout = dsl[0]
        rng = ffi.new("VkPushConstantRange*", {"stageFlags": b.VK_SHADER_STAGE_COMPUTE_BIT, "offset": 0,
                                               "size": device.push_constant_bytes})
        layout = ffi.new("VkPipelineLayout*")
        self._check("vkCreatePipelineLayout", device_call.vkCreatePipelineLayout(h, ffi.new(
            "VkPipelineLayoutCreateInfo*", {"sType": b.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO,
                                            "setLayoutCount": 1, "pSetLayouts": dsl,
                                            "pushConstantRangeCount": 1, "pPushConstantRanges": rng}),
            ffi.NULL, layout))
        self.layout = layout[0]
        sizes = ffi.new("VkDescriptorPoolSize*", {"type": b.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                                   "descriptorCount": buffers})
        pool = ffi.new("VkDescriptorPool*")
        self._check("vkCreateDescriptorPool", device_call.vkCreateDescriptorPool(h, ffi.new(
            "VkDescriptorPoolCreateInfo*", {"sType": b.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
                                            "maxSets": 1, "poolSizeCount": 1, "pPoolSizes": sizes}),
            ffi.NULL, pool))
        self.pool = pool[0]
        dset = ffi.new("VkDescriptorSet*")
        self._check("vkAllocateDescriptorSets", device_call.vkAllocateDescriptorSets(h, ffi.new(
            "VkDescriptorSetAllocateInfo*", {"sType": b.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO,
                                             "descriptorPool": self.pool, "descriptorSetCount": 1,
                                             "pSetLayouts": dsl}), dset))
        self.set = dset[0]
        code_buf = ffi.from_buffer(code)
        module = ffi.new("VkShaderModule*")
        self._check("vkCreateShaderModule", device_call.vkCreateShaderModule(h, ffi.new(
            "VkShaderModuleCreateInfo*", {"sType": b.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO,
                                          "codeSize": len(code), "pCode": ffi.cast("uint32_t*", code_buf)}),
            ffi.NULL, module))
        entry = ffi.new("char[]", b"main")
        pinfo = ffi.new("VkComputePipelineCreateInfo*", {
            "sType": b.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO, "layout": self.layout})
        pinfo.stage = ffi.new("VkPipelineShaderStageCreateInfo*", {
            "sType": b.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO,
            "stage": b.VK_SHADER_STAGE_COMPUTE_BIT, "module": module[0], "pName": entry})[0]
        pipe = ffi.new("VkPipeline*")
        try:
            self._check("vkCreateComputePipelines", device_call.vkCreateComputePipelines(
                h, ffi.NULL, 1, pinfo, ffi.NULL, pipe))
        finally:
            device_call.vkDestroyShaderModule(h, module[0], ffi.NULL)
        self.pipeline = pipe[0]

    def _check(self, name: str, result: int) -> None:
        from vkpool import vk

        vk.check(name, result, self.device.name)

    def bind(self, allocations: list[Any]) -> None:
        ffi, b = self.device._ffi, self.device._b
        infos = [ffi.new("VkDescriptorBufferInfo*", {"buffer": a.buffer, "offset": a.offset, "range": a.nbytes})
                 for a in allocations]
        writes = ffi.new(f"VkWriteDescriptorSet[{len(allocations)}]")
        for i, info in enumerate(infos):
            writes[i].sType = b.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET
            writes[i].dstSet = self.set
            writes[i].dstBinding = i
            writes[i].descriptorCount = 1
            writes[i].descriptorType = b.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
            writes[i].pBufferInfo = info
        self.device._lib.vkUpdateDescriptorSets(self.device.handle, len(allocations), writes, 0, ffi.NULL)

    def time(self, push: bytes, groups: tuple[int, int, int], reps: int) -> float:
        """Median GPU microseconds of ``reps`` dispatches, a compute barrier between each."""
        device = self.device
        ffi, b, lib = device._ffi, device._b, device._lib
        pool = ffi.new("VkQueryPool*")
        self._check("vkCreateQueryPool", lib.vkCreateQueryPool(device.handle, ffi.new(
            "VkQueryPoolCreateInfo*", {"sType": b.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
                                       "queryType": b.VK_QUERY_TYPE_TIMESTAMP, "queryCount": reps + 1}),
            ffi.NULL, pool))
        cmd = device.allocate_command_buffer()
        sub = device.submission(cmd)
        compute = b.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
        _, _, compute_mb = device.memory_barriers()
        try:
            self._check("vkBeginCommandBuffer", lib.vkBeginCommandBuffer(cmd, ffi.new(
                "VkCommandBufferBeginInfo*", {"sType": b.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
                                              "flags": b.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT})))
            lib.vkCmdResetQueryPool(cmd, pool[0], 0, reps + 1)
            lib.vkCmdBindPipeline(cmd, b.VK_PIPELINE_BIND_POINT_COMPUTE, self.pipeline)
            sets = ffi.new("VkDescriptorSet*", self.set)
            lib.vkCmdBindDescriptorSets(cmd, b.VK_PIPELINE_BIND_POINT_COMPUTE, self.layout, 0, 1, sets, 0, ffi.NULL)
            pbuf = ffi.from_buffer(push)
            lib.vkCmdPushConstants(cmd, self.layout, b.VK_SHADER_STAGE_COMPUTE_BIT, 0, len(push), pbuf)
            lib.vkCmdWriteTimestamp(cmd, b.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, pool[0], 0)
            for i in range(reps):
                if i:
                    lib.vkCmdPipelineBarrier(cmd, compute, compute, 0, 1, compute_mb, 0, ffi.NULL, 0, ffi.NULL)
                lib.vkCmdDispatch(cmd, *groups)
                lib.vkCmdWriteTimestamp(cmd, b.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, pool[0], i + 1)
            self._check("vkEndCommandBuffer", lib.vkEndCommandBuffer(cmd))
            device.submit(sub)
            device.wait(sub)
            stamps = np.zeros(reps + 1, dtype=np.uint64)
            self._check("vkGetQueryPoolResults", lib.vkGetQueryPoolResults(
                device.handle, pool[0], 0, reps + 1, stamps.nbytes, ffi.from_buffer(stamps), 8,
                b.VK_QUERY_RESULT_64_BIT | b.VK_QUERY_RESULT_WAIT_BIT))
        finally:
            sub.release()
            lib.vkDestroyQueryPool(device.handle, pool[0], ffi.NULL)
        props = ffi.new("VkPhysicalDeviceProperties*")
        lib.vkGetPhysicalDeviceProperties(device.info.handle, props)
        return statistics.median(np.diff(stamps.astype(np.int64)) * props.limits.timestampPeriod / 1000.0)

    def close(self) -> None:
        lib, h, ffi = self.device._lib, self.device.handle, self.device._ffi
        lib.vkDestroyPipeline(h, self.pipeline, ffi.NULL)
        lib.vkDestroyDescriptorPool(h, self.pool, ffi.NULL)
        lib.vkDestroyPipelineLayout(h, self.layout, ffi.NULL)
        lib.vkDestroyDescriptorSetLayout(h, self.set_layout, ffi.NULL)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tiles", default="cm2_128x256x32_t256_z8,cm2_128x128x32_t256_z8,cm2_128x256x64_t256_z8,"
                                      "cm2_128x128x32_t128_z8")
    args = ap.parse_args(argv)
    from vkpool import shaders
    from vkpool.kernels.base import pack_push_constants
    from vkpool.kernels.ops.gemm import MatmulProblem
    from vkpool.kernels.ops.gemm_f16 import HalfMatmulPlan, parse_tile
    from vkpool.session import Session

    size = args.size
    rng = np.random.default_rng(size)
    a = rng.uniform(-1.0, 1.0, size=(size, size)).astype(np.float16)
    b = rng.uniform(-1.0, 1.0, size=(size, size)).astype(np.float16)
    template = (Path(__file__).resolve().parent / "gemm_coopmat2_bound.spvasm").read_text()
    sess = Session(_model(size))
    try:
        (expected,) = sess.run(None, {"a": a, "b": b})
        device, member = sess._chunk.device, sess.member
        caps = device.caps
        print(f"{device.info.name}, driver {device.info.driver_version}, size {size}, {args.reps} replays (median)")
        plan = HalfMatmulPlan(MatmulProblem(M=size, N=size, K=size, sAm=size, sAk=1, sBk=size, sBn=1))
        bufs = [member.alloc(a.nbytes), member.alloc(b.nbytes), member.alloc(a.nbytes)]
        member.upload(bufs[0], a)
        member.upload(bufs[1], b)

        def check() -> float:
            y = member.download(bufs[2], (size, size), np.float16).astype(np.float32)
            return float(np.max(np.abs(y - expected.astype(np.float32))))

        try:
            (d,) = plan.dispatches(*bufs, caps)
            dispatch = ("dispatch", device.pipeline(d.shader, d.defines),
                        pack_push_constants(d.args, lambda alloc: alloc.address), d.groups)
            us = _replayed(device, dispatch, args.reps)
            print(f"  planner's kernel {d.shader:16s} {us:9.1f} us {tflops(size, us):6.1f} TFLOP/s  "
                  f"max |y - session| {check():.3g}")
            for name in args.tiles.split(","):
                tile = parse_tile(name)
                (d,) = plan.dispatches(*bufs, caps, tile)
                push = pack_push_constants(d.args, lambda alloc: alloc.address)
                dispatch = ("dispatch", device.pipeline(d.shader, d.defines), push, d.groups)
                member.upload(bufs[2], np.zeros_like(a))  # each form must write the whole result
                us = _replayed(device, dispatch, args.reps)
                print(f"  {name:24s} addresses {us:9.1f} us {tflops(size, us):6.1f} TFLOP/s  "
                      f"max |y - session| {check():.3g}", flush=True)
                member.upload(bufs[2], np.zeros_like(a))
                bound = BoundPipeline(device, shaders.assemble(template, d.defines, "gemm_coopmat2_bound.spvasm"), 3)
                try:
                    bound.bind(bufs)
                    bound.time(push, d.groups, 2)  # warm-up
                    us = bound.time(push, d.groups, args.reps)
                    print(f"  {name:24s} bound     {us:9.1f} us {tflops(size, us):6.1f} TFLOP/s  "
                          f"max |y - session| {check():.3g}", flush=True)
                finally:
                    bound.close()
        finally:
            for buf in bufs:
                buf.free()
    finally:
        sess.close()


if __name__ == "__main__":
    main()
