// Storage types beyond common.glsl's, for the elementwise and data-movement shaders (see
// kernels/ops/dtypes.py). Narrow types are only loaded and stored: arithmetic is 32-bit.
layout(buffer_reference, std430, buffer_reference_align = 1) buffer I8Buf { int8_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 2) buffer I16Buf { int16_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 2) buffer U16Buf { uint16_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 2) buffer F16Buf { float16_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 8) buffer U64Buf { uint64_t v[]; };
