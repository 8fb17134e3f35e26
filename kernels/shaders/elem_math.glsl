// Float helpers GLSL lacks (erf, log1p) or whose driver lowering overflows (tanh as
// (e^2x - 1)/(e^2x + 1) is inf/inf = NaN for |x| > ~44 on some drivers).

float log1p_(float t) {
    // NOTE: lavapipe (Mesa 22.3, llvmpipe) computes log(u) near u = 1 with an absolute, not a
    // relative, error of ~1e-8, so log(1 + 1e-7) is off by 20%; a series covers small |t|.
    if (abs(t) < 0.0078125) {
        return t * (1.0 + t * (-0.5 + t * (1.0 / 3.0 + t * (-0.25 + t * 0.2))));
    }
    // Goldberg's trick: log(u) * t / (u - 1) cancels the rounding of u = 1 + t.
    float u = 1.0 + t;
    return log(u) * (t / (u - 1.0));
}

// asin and acos through atan: lavapipe's asin/acos are accurate to ~4e-4 only (Mesa 22.3).
float asin_(float x) {
    return atan(x, sqrt((1.0 - x) * (1.0 + x)));
}

float acos_(float x) {
    return 2.0 * atan(sqrt((1.0 - x) / (1.0 + x)));
}

float tanh_(float x) {
    float a = abs(x);
    float r;
    if (a < 0.0625) {
        // Taylor series: 1 - e^(-2a) loses relative precision near 0.
        float a2 = a * a;
        r = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))));
    } else {
        float e = exp(-2.0 * a);
        r = (1.0 - e) / (1.0 + e);
    }
    return x < 0.0 ? -r : r;
}

float sigmoid_(float x) {
    // exp of a non-positive argument only: never overflows
    float e = exp(-abs(x));
    return x >= 0.0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
}

float softplus_(float x) {
    return max(x, 0.0) + log1p_(exp(-abs(x)));
}

float erf_(float x) {
    float a = abs(x);
    float r;
    if (a < 0.5) {
        // Maclaurin series to x^13: relative error below 1e-8 on [0, 0.5)
        float a2 = a * a;
        r = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (1.0 / 10.0 + a2 * (-1.0 / 42.0 + a2 * (1.0 / 216.0
            + a2 * (-1.0 / 1320.0 + a2 * (1.0 / 9360.0)))))));
        r *= 1.1283791670955126;  // 2 / sqrt(pi)
    } else {
        // erfc by the Chebyshev fit of Numerical Recipes (erfcc), fractional error < 1.2e-7
        float t = 1.0 / (1.0 + 0.5 * a);
        float erfc = t * exp(-a * a - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418
            + t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587
            + t * (-0.82215223 + t * 0.17087277)))))))));
        r = 1.0 - erfc;
    }
    return x < 0.0 ? -r : r;
}
