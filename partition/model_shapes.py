"""Five model graphs with the op structure and tensor sizes of well-known networks, for planning.

Weights are zeros: the partitioner needs shapes, bytes and FLOPs, not trained values, and these
build in seconds without torch. Batch 1, float32, opset 17, batch-norm folded into the
convolutions' bias as inference exports do.

- ``bert_base_seq128``: BERT-base encoder (Devlin et al. 2019): embeddings (30,522-word table,
  positions, token types) + LayerNorm, 12 post-LN layers of 12-head attention (hidden 768) and a
  3,072-wide erf-GELU MLP; sequence 128;
- ``gpt2_small_seq128``: GPT-2 small decoder (Radford et al. 2019): token + position
  embeddings, 12 pre-LN layers with a causal mask, final LayerNorm, LM head tied to the
  50,257-word embedding (``Gemm`` with ``transB``); sequence 128;
- ``resnet50``: ResNet-50 v1.5 (He et al. 2016; stride on the 3×3), 224×224, 1,000 classes;
- ``mobilenetv2``: MobileNetV2 1.0 (Sandler et al. 2018), inverted residuals with ReLU6, 224×224;
- ``unet_small``: a 4-level U-Net (Ronneberger et al. 2015) of 32–512 channels on 3×256×256,
  transposed-convolution upsampling, skip concatenations, 2 output classes.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


class _Builder:
    """Nodes and zero initializers; values are named ``v0, v1, ...`` in creation order."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def _name(self, prefix: str = "v") -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def const(self, shape: tuple[int, ...], dtype: type = np.float32, value: float = 0.0) -> str:
        name = self._name("w")
        self.inits.append(numpy_helper.from_array(np.full(shape, value, dtype), name))
        return name

    def ints(self, values: list[int]) -> str:
        name = self._name("s")
        self.inits.append(numpy_helper.from_array(np.array(values, np.int64), name))
        return name

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        out = self._name()
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def model(self, name: str, inputs: list[onnx.ValueInfoProto], output: str, out_shape: list[int]) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs,
                                  [helper.make_tensor_value_info(output, TensorProto.FLOAT, out_shape)], self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        return model

    # -- layers shared by the networks --------------------------------------------------------
    def linear(self, x: str, n_in: int, n_out: int) -> str:
        return self.op("Add", [self.op("MatMul", [x, self.const((n_in, n_out))]), self.const((n_out,))])

    def layer_norm(self, x: str, width: int) -> str:
        return self.op("LayerNormalization", [x, self.const((width,), value=1.0), self.const((width,))], axis=-1)

    def gelu(self, x: str) -> str:
        half = self.op("Mul", [x, self.const((), value=0.5)])
        erf = self.op("Erf", [self.op("Mul", [x, self.const((), value=float(1 / np.sqrt(2)))])])
        return self.op("Mul", [half, self.op("Add", [erf, self.const((), value=1.0)])])

    def attention(self, x: str, seq: int, width: int, heads: int, mask: str | None) -> str:
        dh = width // heads
        split = self.ints([1, seq, heads, dh])
        q, k, v = (self.op("Reshape", [self.linear(x, width, width), split]) for _ in range(3))
        q = self.op("Transpose", [q], perm=[0, 2, 1, 3])
        k = self.op("Transpose", [k], perm=[0, 2, 3, 1])
        v = self.op("Transpose", [v], perm=[0, 2, 1, 3])
        scores = self.op("Mul", [self.op("MatMul", [q, k]), self.const((), value=float(1 / np.sqrt(dh)))])
        if mask is not None:
            scores = self.op("Add", [scores, mask])
        ctx = self.op("MatMul", [self.op("Softmax", [scores], axis=-1), v])
        ctx = self.op("Reshape", [self.op("Transpose", [ctx], perm=[0, 2, 1, 3]), self.ints([1, seq, width])])
        return self.linear(ctx, width, width)

    def mlp(self, x: str, width: int) -> str:
        return self.linear(self.gelu(self.linear(x, width, 4 * width)), 4 * width, width)

    def conv(self, x: str, c_in: int, c_out: int, k: int, stride: int = 1, group: int = 1,
             act: str | None = "Relu") -> str:
        y = self.op("Conv", [x, self.const((c_out, c_in // group, k, k)), self.const((c_out,))],
                    kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4, group=group)
        if act == "Relu":
            return self.op("Relu", [y])
        if act == "Relu6":
            return self.op("Clip", [y, self.const((), value=0.0), self.const((), value=6.0)])
        return y


def _tokens(seq: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, seq])


def bert_base_seq128(seq: int = 128, layers: int = 12, width: int = 768, heads: int = 12) -> onnx.ModelProto:
    b = _Builder()
    x = b.op("Gather", [b.const((30522, width)), "input_ids"])
    x = b.op("Add", [b.op("Add", [x, b.const((1, seq, width))]), b.const((1, seq, width))])  # positions, types
    x = b.layer_norm(x, width)
    for _ in range(layers):
        x = b.layer_norm(b.op("Add", [x, b.attention(x, seq, width, heads, None)]), width)
        x = b.layer_norm(b.op("Add", [x, b.mlp(x, width)]), width)
    return b.model("bert_base_seq128", [_tokens(seq)], x, [1, seq, width])


def gpt2_small_seq128(seq: int = 128, layers: int = 12, width: int = 768, heads: int = 12) -> onnx.ModelProto:
    b = _Builder()
    vocab = 50257
    wte = b.const((vocab, width))
    x = b.op("Add", [b.op("Gather", [wte, "input_ids"]), b.const((1, seq, width))])
    causal = np.triu(np.full((seq, seq), -1e4, np.float32), 1)[None, None]
    mask = b._name("w")
    b.inits.append(numpy_helper.from_array(causal, mask))
    for _ in range(layers):
        x = b.op("Add", [x, b.attention(b.layer_norm(x, width), seq, width, heads, mask)])
        x = b.op("Add", [x, b.mlp(b.layer_norm(x, width), width)])
    x = b.op("Reshape", [b.layer_norm(x, width), b.ints([seq, width])])
    logits = b.op("Gemm", [x, wte], transB=1)  # the LM head shares the embedding table
    return b.model("gpt2_small_seq128", [_tokens(seq)], logits, [seq, vocab])


def _image(channels: int, side: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, channels, side, side])


def _classifier(b: _Builder, x: str, width: int, classes: int = 1000) -> str:
    x = b.op("Flatten", [b.op("GlobalAveragePool", [x])])
    return b.op("Gemm", [x, b.const((width, classes)), b.const((classes,))])


def resnet50() -> onnx.ModelProto:
    b = _Builder()
    x = b.conv("image", 3, 64, 7, stride=2)
    x = b.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    c_in = 64
    for mid, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            s = stride if i == 0 else 1
            y = b.conv(b.conv(x, c_in, mid, 1), mid, mid, 3, stride=s)
            y = b.conv(y, mid, 4 * mid, 1, act=None)
            short = b.conv(x, c_in, 4 * mid, 1, stride=s, act=None) if i == 0 else x
            x = b.op("Relu", [b.op("Add", [y, short])])
            c_in = 4 * mid
    return b.model("resnet50", [_image(3, 224)], _classifier(b, x, 2048), [1, 1000])


def mobilenetv2() -> onnx.ModelProto:
    b = _Builder()
    x = b.conv("image", 3, 32, 3, stride=2, act="Relu6")
    c_in = 32
    for t, c, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                       (6, 160, 3, 2), (6, 320, 1, 1)):
        for i in range(n):
            stride = s if i == 0 else 1
            hidden = c_in * t
            y = b.conv(x, c_in, hidden, 1, act="Relu6") if t != 1 else x
            y = b.conv(y, hidden, hidden, 3, stride=stride, group=hidden, act="Relu6")
            y = b.conv(y, hidden, c, 1, act=None)
            x = b.op("Add", [x, y]) if stride == 1 and c_in == c else y
            c_in = c
    x = b.conv(x, 320, 1280, 1, act="Relu6")
    return b.model("mobilenetv2", [_image(3, 224)], _classifier(b, x, 1280), [1, 1000])


def unet_small(side: int = 256, base: int = 32, levels: int = 4, classes: int = 2) -> onnx.ModelProto:
    b = _Builder()
    x, c_in, skips = "image", 3, []
    for level in range(levels):
        c = base << level
        x = b.conv(b.conv(x, c_in, c, 3), c, c, 3)
        skips.append((x, c))
        x = b.op("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
        c_in = c
    c = base << levels
    x = b.conv(b.conv(x, c_in, c, 3), c, c, 3)
    for skip, c_skip in reversed(skips):
        up = b.op("ConvTranspose", [x, b.const((c, c_skip, 2, 2)), b.const((c_skip,))],
                  kernel_shape=[2, 2], strides=[2, 2])
        x = b.op("Concat", [up, skip], axis=1)
        x = b.conv(b.conv(x, 2 * c_skip, c_skip, 3), c_skip, c_skip, 3)
        c = c_skip
    x = b.conv(x, c, classes, 1, act=None)
    return b.model("unet_small", [_image(3, side)], x, [1, classes, side, side])


MODELS: dict[str, Callable[[], onnx.ModelProto]] = {
    "bert_base_seq128": bert_base_seq128,
    "gpt2_small_seq128": gpt2_small_seq128,
    "resnet50": resnet50,
    "mobilenetv2": mobilenetv2,
    "unet_small": unet_small,
}


def build(name: str) -> onnx.ModelProto:
    if name not in MODELS:
        raise ValueError(f"unknown model graph {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]()
