// The activation a fused product applies to each of its outputs after the bias (vkpool.fusion):
// ACT 0 none, 1 Relu, 2 Gelu (erf), 3 Gelu (tanh approximation), as kernels/ops/gemm.py names them.
#include "elem_math.glsl"
#ifndef ACT
#define ACT 0
#endif
// HAS_RES: a product adds a residual of its output's layout after the bias, before the
// activation (its push constants then end with the residual's address, ``r``)
#ifndef HAS_RES
#define HAS_RES 0
#endif

float epilogue(float v) {
#if ACT == 1
    return max(v, 0.0);
#elif ACT == 2
    return 0.5 * v * (1.0 + erf_(v * 0.70710678118654752));
#elif ACT == 3
    return 0.5 * v * (1.0 + tanh_(0.79788456080286536 * (v + 0.044715 * v * v * v)));
#else
    return v;
#endif
}
