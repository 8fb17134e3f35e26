"""``python -m bench.export_models``: real model graphs, written in torch and exported to ONNX.

Five architectures with random weights from a fixed seed, so nothing is downloaded and every run
writes the same files:

- ``bert``: a BERT-base encoder (token ids in, last hidden state out; post-LayerNorm, erf GELU);
- ``gpt2``: a GPT-2-small decoder (causal mask, no KV cache; logits out, LM head tied);
- ``resnet50``: ResNet-50 (bottleneck blocks 3-4-6-3) at 224×224;
- ``mobilenetv2``: MobileNetV2 (inverted residuals, depthwise convolutions, ReLU6) at 224×224;
- ``unet``: a four-level U-Net (ConvTranspose upsampling, skip Concats) at 256×256.

Each builder takes its sizes as keyword arguments (the defaults are the full-size models), so
the tests export the same architectures small. Export uses torch's TorchScript-based exporter
(``dynamo=False``) at opset 17: it needs no package beyond torch and leaves plain ops
(attention as MatMul/Softmax, BatchNormalization folded into Conv).
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import io
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

OPSET = 17
SEED = 0
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "models"


# -- torch modules ---------------------------------------------------------------------------------


def _modules() -> dict[str, Any]:
    """The torch module classes, defined on first use so that importing this file needs no torch."""
    import torch
    from torch import nn

    # -- transformers ----------------------------------------------------------------------------

    class SelfAttention(nn.Module):
        def __init__(self, hidden: int, heads: int, causal_len: int = 0) -> None:
            super().__init__()
            if hidden % heads:
                raise ValueError(f"hidden {hidden} is not a multiple of heads {heads}")
            self.heads, self.head_dim = heads, hidden // heads
            self.q, self.k, self.v = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
            self.out = nn.Linear(hidden, hidden)
            if causal_len:
                self.register_buffer("causal", torch.tril(torch.ones(causal_len, causal_len, dtype=torch.bool)))
            else:
                self.causal = None

        def _split(self, x: Any) -> Any:
            b, s, _ = x.shape
            return x.reshape(b, s, self.heads, self.head_dim).transpose(1, 2)

        def forward(self, x: Any) -> Any:
            b, s, h = x.shape
            q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
            if self.causal is not None:
                # the most negative float, as GPT-2 implementations use: exp() of it is exactly 0
                scores = scores.masked_fill(~self.causal[:s, :s], torch.finfo(scores.dtype).min)
            ctx = torch.softmax(scores, dim=-1) @ v
            return self.out(ctx.transpose(1, 2).reshape(b, s, h))

    class BertLayer(nn.Module):
        def __init__(self, hidden: int, heads: int, ffn: int) -> None:
            super().__init__()
            self.attn = SelfAttention(hidden, heads)
            self.ln1 = nn.LayerNorm(hidden, eps=1e-12)
            self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
            self.ln2 = nn.LayerNorm(hidden, eps=1e-12)

        def forward(self, x: Any) -> Any:
            x = self.ln1(x + self.attn(x))
            return self.ln2(x + self.down(torch.nn.functional.gelu(self.up(x))))

    class Bert(nn.Module):
        def __init__(self, layers: int, hidden: int, heads: int, ffn: int, seq: int, vocab: int) -> None:
            super().__init__()
            self.words = nn.Embedding(vocab, hidden)
            self.positions = nn.Embedding(seq, hidden)
            self.token_types = nn.Embedding(2, hidden)
            self.register_buffer("position_ids", torch.arange(seq).unsqueeze(0))
            self.ln = nn.LayerNorm(hidden, eps=1e-12)
            self.layers = nn.ModuleList(BertLayer(hidden, heads, ffn) for _ in range(layers))

        def forward(self, input_ids: Any) -> Any:
            s = input_ids.shape[1]
            x = self.words(input_ids) + self.positions(self.position_ids[:, :s]) + self.token_types.weight[0]
            x = self.ln(x)
            for layer in self.layers:
                x = layer(x)
            return x

    class Gpt2Block(nn.Module):
        def __init__(self, hidden: int, heads: int, seq: int) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.attn = SelfAttention(hidden, heads, causal_len=seq)
            self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x: Any) -> Any:
            x = x + self.attn(self.ln1(x))
            return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x)), approximate="tanh"))

    class Gpt2(nn.Module):
        def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int) -> None:
            super().__init__()
            self.words = nn.Embedding(vocab, hidden)
            self.positions = nn.Embedding(seq, hidden)
            self.register_buffer("position_ids", torch.arange(seq).unsqueeze(0))
            self.blocks = nn.ModuleList(Gpt2Block(hidden, heads, seq) for _ in range(layers))
            self.ln = nn.LayerNorm(hidden)

        def forward(self, input_ids: Any) -> Any:
            s = input_ids.shape[1]
            x = self.words(input_ids) + self.positions(self.position_ids[:, :s])
            for block in self.blocks:
                x = block(x)
            return self.ln(x) @ self.words.weight.t()  # the LM head shares the token embedding

    # -- convolutional networks ------------------------------------------------------------------

    def conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1) -> list[Any]:
        return [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, width: int, stride: int) -> None:
            super().__init__()
            cout = 4 * width
            self.body = nn.Sequential(
                *conv_bn(cin, width, 1), nn.ReLU(),
                *conv_bn(width, width, 3, stride), nn.ReLU(),
                *conv_bn(width, cout, 1),
            )
            self.skip = (nn.Sequential(*conv_bn(cin, cout, 1, stride))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x: Any) -> Any:
            return torch.relu(self.body(x) + self.skip(x))

    class ResNet(nn.Module):
        def __init__(self, blocks: tuple[int, ...], width: int, classes: int) -> None:
            super().__init__()
            layers: list[Any] = [*conv_bn(3, width, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
            cin = width
            for stage, count in enumerate(blocks):
                w = width << stage
                for i in range(count):
                    layers.append(Bottleneck(cin, w, 2 if i == 0 and stage > 0 else 1))
                    cin = 4 * w
            self.features = nn.Sequential(*layers)
            self.fc = nn.Linear(cin, classes)

        def forward(self, x: Any) -> Any:
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
            super().__init__()
            hidden = cin * expand
            layers: list[Any] = [] if expand == 1 else [*conv_bn(cin, hidden, 1), nn.ReLU6()]
            layers += [*conv_bn(hidden, hidden, 3, stride, groups=hidden), nn.ReLU6(), *conv_bn(hidden, cout, 1)]
            self.body = nn.Sequential(*layers)
            self.residual = stride == 1 and cin == cout

        def forward(self, x: Any) -> Any:
            return x + self.body(x) if self.residual else self.body(x)

    class MobileNetV2(nn.Module):
        # (expansion, channels, repeats, first stride), from the MobileNetV2 paper's Table 2
        SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                    (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))

        def __init__(self, width_mult: float, classes: int) -> None:
            super().__init__()

            def ch(c: float) -> int:  # round to a multiple of 8, never below 90 % of c
                r = max(8, int(c + 4) // 8 * 8)
                return r + 8 if r < 0.9 * c else r

            cin = ch(32 * width_mult)
            last = ch(1280 * max(1.0, width_mult))
            layers: list[Any] = [*conv_bn(3, cin, 3, 2), nn.ReLU6()]
            for t, c, n, s in self.SETTINGS:
                cout = ch(c * width_mult)
                for i in range(n):
                    layers.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                    cin = cout
            layers += [*conv_bn(cin, last, 1), nn.ReLU6()]
            self.features = nn.Sequential(*layers)
            self.classifier = nn.Linear(last, classes)

        def forward(self, x: Any) -> Any:
            return self.classifier(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))

    def double_conv(cin: int, cout: int) -> Any:
        return nn.Sequential(*conv_bn(cin, cout, 3), nn.ReLU(), *conv_bn(cout, cout, 3), nn.ReLU())

    class UNet(nn.Module):
        def __init__(self, levels: int, base: int, in_ch: int, classes: int) -> None:
            super().__init__()
            widths = [base << i for i in range(levels + 1)]
            self.down = nn.ModuleList(double_conv(in_ch if i == 0 else widths[i - 1], widths[i])
                                      for i in range(levels))
            self.bottom = double_conv(widths[levels - 1], widths[levels])
            self.up = nn.ModuleList(nn.ConvTranspose2d(widths[i + 1], widths[i], 2, 2)
                                    for i in reversed(range(levels)))
            self.merge = nn.ModuleList(double_conv(2 * widths[i], widths[i]) for i in reversed(range(levels)))
            self.head = nn.Conv2d(base, classes, 1)

        def forward(self, x: Any) -> Any:
            skips = []
            for block in self.down:
                x = block(x)
                skips.append(x)
                x = nn.functional.max_pool2d(x, 2)
            x = self.bottom(x)
            for up, merge, skip in zip(self.up, self.merge, reversed(skips)):
                x = merge(torch.cat([up(x), skip], dim=1))
            return self.head(x)

    return {"Bert": Bert, "Gpt2": Gpt2, "ResNet": ResNet, "MobileNetV2": MobileNetV2, "UNet": UNet}


# -- builders --------------------------------------------------------------------------------------


@dataclass
class Built:
    """A torch module in eval mode and the inputs it is exported and run with."""

    name: str
    module: Any
    inputs: dict[str, np.ndarray]
    output: str


def _randomize_batchnorm(module: Any, rng: Any) -> None:
    """Running statistics and affine terms away from the identity, so that folding them into the
    convolutions is exercised, yet near enough to keep activations of unit scale."""
    import torch

    for m in module.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            n = m.num_features
            m.weight.data = 0.5 + torch.rand(n, generator=rng)
            m.bias.data = 0.1 * torch.randn(n, generator=rng)
            m.running_mean.data = 0.1 * torch.randn(n, generator=rng)
            m.running_var.data = 0.5 + torch.rand(n, generator=rng)


def _finish(name: str, module: Any, inputs: dict[str, np.ndarray], output: str) -> Built:
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return Built(name, module, inputs, output)


def _token_ids(batch: int, seq: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, vocab, size=(batch, seq), dtype=np.int64)


def _image(batch: int, channels: int, size: int) -> np.ndarray:
    return np.random.default_rng(SEED).standard_normal((batch, channels, size, size), dtype=np.float32)


def build_bert(layers: int = 12, hidden: int = 768, heads: int = 12, ffn: int = 3072, seq: int = 128,
               vocab: int = 30522, batch: int = 1) -> Built:
    import torch

    torch.manual_seed(SEED)
    module = _modules()["Bert"](layers, hidden, heads, ffn, seq, vocab)
    return _finish("bert", module, {"input_ids": _token_ids(batch, seq, vocab)}, "hidden_states")


def build_gpt2(layers: int = 12, hidden: int = 768, heads: int = 12, seq: int = 128, vocab: int = 50257,
               batch: int = 1) -> Built:
    import torch

    torch.manual_seed(SEED)
    module = _modules()["Gpt2"](layers, hidden, heads, seq, vocab)
    return _finish("gpt2", module, {"input_ids": _token_ids(batch, seq, vocab)}, "logits")


def build_resnet50(blocks: tuple[int, ...] = (3, 4, 6, 3), width: int = 64, image: int = 224,
                   classes: int = 1000, batch: int = 1) -> Built:
    import torch

    torch.manual_seed(SEED)
    module = _modules()["ResNet"](tuple(blocks), width, classes)
    _randomize_batchnorm(module, torch.Generator().manual_seed(SEED))
    return _finish("resnet50", module, {"image": _image(batch, 3, image)}, "logits")


def build_mobilenetv2(width_mult: float = 1.0, image: int = 224, classes: int = 1000, batch: int = 1) -> Built:
    import torch

    torch.manual_seed(SEED)
    module = _modules()["MobileNetV2"](width_mult, classes)
    _randomize_batchnorm(module, torch.Generator().manual_seed(SEED))
    return _finish("mobilenetv2", module, {"image": _image(batch, 3, image)}, "logits")


def build_unet(levels: int = 4, base: int = 32, image: int = 256, in_channels: int = 3, classes: int = 2,
               batch: int = 1) -> Built:
    import torch

    if image % (1 << levels):
        raise ValueError(f"image size {image} is not divisible by 2**levels = {1 << levels}")
    torch.manual_seed(SEED)
    module = _modules()["UNet"](levels, base, in_channels, classes)
    _randomize_batchnorm(module, torch.Generator().manual_seed(SEED))
    return _finish("unet", module, {"image": _image(batch, in_channels, image)}, "mask")


BUILDERS: dict[str, Callable[..., Built]] = {
    "bert": build_bert,
    "gpt2": build_gpt2,
    "resnet50": build_resnet50,
    "mobilenetv2": build_mobilenetv2,
    "unet": build_unet,
}


def build(name: str, **sizes: Any) -> Built:
    """The module and inputs of model ``name``; ``sizes`` override the full-size defaults."""
    if name not in BUILDERS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(BUILDERS)}")
    return BUILDERS[name](**sizes)


# -- export ----------------------------------------------------------------------------------------


def to_onnx(built: Built, batch_dim: bool = False) -> bytes:
    """The module exported at opset 17 with the TorchScript-based exporter; constants folded.
    ``batch_dim``: the first dim of every input and of the output is the symbolic ``batch``."""
    import torch

    args = tuple(torch.from_numpy(v) for v in built.inputs.values())
    # torch before 2.5 has only this exporter and no ``dynamo`` argument; from 2.9 it is not the default
    choose = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch >= 2.9: "legacy exporter"
        dynamic = {name: {0: "batch"} for name in [*built.inputs, built.output]} if batch_dim else None
        torch.onnx.export(built.module, args, buf, opset_version=OPSET, input_names=list(built.inputs),
                          output_names=[built.output], do_constant_folding=True, dynamic_axes=dynamic, **choose)
    return buf.getvalue()


def stamp() -> str:
    """Changes when the exported graphs or weights may change: this file or the torch version."""
    import torch

    source = Path(__file__).read_bytes()
    return hashlib.sha256(source + torch.__version__.encode()).hexdigest()[:16]


def export(name: str, out: Path = DEFAULT_OUT, batch_dim: bool = False, **sizes: Any) -> Path:
    """Writes ``<out>/<name>.onnx`` (full size unless ``sizes`` are given), with ``batch_dim``
    ``<out>/<name>-batch.onnx`` (see :func:`to_onnx`), and for a fixed ``batch`` of more than one
    ``<out>/<name>-b<batch>.onnx``; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    fixed = int(sizes.get("batch", 1))
    path = out / f"{name}{'-batch' if batch_dim else f'-b{fixed}' if fixed > 1 else ''}.onnx"
    path.write_bytes(to_onnx(build(name, **sizes), batch_dim))
    return path


def ensure(name: str, out: Path = DEFAULT_OUT, batch: int = 1) -> Path:
    """The full-size ``<out>/<name>.onnx`` (``<name>-b<batch>.onnx`` for a batch of more than
    one), exported again only when :func:`stamp` changed."""
    path = out / f"{name}{f'-b{batch}' if batch > 1 else ''}.onnx"
    stamp_path = path.with_suffix(".stamp")
    if not (path.exists() and stamp_path.exists() and stamp_path.read_text() == stamp()):
        export(name, out, **({"batch": batch} if batch > 1 else {}))
        stamp_path.write_text(stamp())
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.export_models", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: models/)")
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=list(BUILDERS),
                        help=f"models to export (default: all): {', '.join(BUILDERS)}")
    parser.add_argument("--batch-dim", action="store_true",
                        help="export with a symbolic first dim `batch` (written as NAME-batch.onnx), for dynamic batching")
    args = parser.parse_args(argv)
    for name in args.only or list(BUILDERS):
        path = export(name, args.out, args.batch_dim)
        path.with_suffix(".stamp").write_text(stamp())
        print(f"{name}: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
