"""GLSL compute kernels and the ONNX op registry."""
