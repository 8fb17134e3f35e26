// Shared by every vkpool compute shader: tensors are reached through buffer-device-address
// pointers carried in push constants (GL_EXT_buffer_reference), so no descriptor sets exist.
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_shader_16bit_storage : require

// DEP = 1: the dispatch orders itself after the one it depends on with counters in memory instead
// of a pipeline barrier before it (see dep_main.glsl; bench/dep_probe.py measures it). The shader's
// push-constant block ends with DEP_ARGS, and its main becomes op_main, called by dep_main.glsl's.
#ifndef DEP
#define DEP 0
#endif
#if DEP
#extension GL_KHR_memory_scope_semantics : require
#define DEP_ARGS layout(offset = DEP_OFFSET) uint64_t dep_counters; uint dep_wait; uint dep_expect; uint dep_signal;
#define main op_main
// tensors written by a dispatch still running elsewhere on the device: loads and stores go to
// the device's coherent level (L2), not a multiprocessor's own cache
#define DEP_COHERENT coherent
#else
#define DEP_ARGS
#define DEP_COHERENT
#endif

layout(buffer_reference, std430, buffer_reference_align = 4) DEP_COHERENT buffer F32Buf { float v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) DEP_COHERENT buffer I32Buf { int v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) DEP_COHERENT buffer U32Buf { uint v[]; };
layout(buffer_reference, std430, buffer_reference_align = 8) DEP_COHERENT buffer I64Buf { int64_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 1) DEP_COHERENT buffer U8Buf { uint8_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) DEP_COHERENT buffer V4Buf { vec4 v[]; };

// RELU = 1: the product's epilogue applies a fused Relu (a load-time rewrite, vkpool.fusion)
#ifndef RELU
#define RELU 0
#endif

#ifndef LOCAL_SIZE
#define LOCAL_SIZE 256
#endif

// Flat invocation index for 1-D work folded into x and y (see kernels.base.groups_1d).
uint flat_index() {
    return gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
}
