// Shared by every vkpool compute shader: tensors are reached through buffer-device-address
// pointers carried in push constants (GL_EXT_buffer_reference), so no descriptor sets exist.
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_shader_16bit_storage : require

layout(buffer_reference, std430, buffer_reference_align = 4) buffer F32Buf { float v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer I32Buf { int v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer U32Buf { uint v[]; };
layout(buffer_reference, std430, buffer_reference_align = 8) buffer I64Buf { int64_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 1) buffer U8Buf { uint8_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) buffer V4Buf { vec4 v[]; };

// RELU = 1: the product's epilogue applies a fused Relu (a load-time rewrite, vkpool.fusion)
#ifndef RELU
#define RELU 0
#endif

#ifndef LOCAL_SIZE
#define LOCAL_SIZE 256
#endif

// Flat invocation index for 1-D work folded into x, y and z (see kernels.base.groups_1d).
// NOTE: a macro, not a function: it reads gl_WorkGroupSize, whose value is only known after the
// shader's `layout(local_size_x = ...) in;` line. glslang compiles a function defined before that
// line with a workgroup size of 1 (every folded dispatch then left most of its output unwritten);
// vkpool.shaders refuses any shader that reads gl_WorkGroupSize before its layout.
#define flat_index() (gl_GlobalInvocationID.x + (gl_GlobalInvocationID.y + gl_GlobalInvocationID.z * \
    gl_NumWorkGroups.y) * gl_NumWorkGroups.x * gl_WorkGroupSize.x)
// The flat workgroup index of a grid folded the same way (one workgroup per row or output).
#define flat_group() (gl_WorkGroupID.x + (gl_WorkGroupID.y + gl_WorkGroupID.z * gl_NumWorkGroups.y) * \
    gl_NumWorkGroups.x)
