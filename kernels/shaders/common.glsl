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

// a / b rounded as IEEE 754 rounds it. NOTE: Vulkan lets OpFDiv be 2.5 ulp off and does not promise
// that fma() is fused (GPUs divide through an approximate reciprocal); harmless for most ops, but a
// quantizer that rounds the quotient to an integer then lands one step away from onnxruntime near a
// tie. The quotient and its neighbours within 2 ulp are compared by their exact residuals
// a - q * b (Dekker's product: plain multiplies and adds), and the nearest wins, ties to the even one.
// (lavapipe divides exactly already: tests/test_kernels_quantize.py checks the ties there.)
float exact_residual(float a, float b, float q) {
    precise float p = q * b;
    precise float cq = 4097.0 * q;
    precise float qh = cq - (cq - q);
    precise float ql = q - qh;
    precise float cb = 4097.0 * b;
    precise float bh = cb - (cb - b);
    precise float bl = b - bh;
    precise float e = ((qh * bh - p) + qh * bl + ql * bh) + ql * bl;  // q * b == p + e exactly
    precise float r = (a - p) - e;
    return r;
}

float div_rn(float a, float b) {
    precise float q = a / b;
    if (q == 0.0 || isinf(q) || isnan(q) || abs(q) > 1e30 || abs(b) > 1e30 || abs(b) < 1e-30) return q;
    float best = q;
    float best_r = abs(exact_residual(a, b, q));
    for (int k = -2; k <= 2; ++k) {
        if (k == 0) continue;
        float c = uintBitsToFloat(uint(int(floatBitsToUint(q)) + k));
        float r = abs(exact_residual(a, b, c));
        if (r < best_r || (r == best_r && (floatBitsToUint(c) & 1u) == 0u)) {
            best = c;
            best_r = r;
        }
    }
    return best;
}

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
