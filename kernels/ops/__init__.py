"""One module per ONNX op (see the registry in vkpool.kernels.registry)."""
