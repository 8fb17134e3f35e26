"""``python -m bench.fp16_models``: half-precision transformer graphs, exported by script.

Two sources, both with random weights from a fixed seed (nothing is downloaded):

- ``bert`` and ``gpt2`` of :mod:`bench.export_models` (the float32 benchmark's architectures),
  cast to float16 with ``module.half()`` and exported by the same TorchScript-based exporter at
  opset 17: every tensor of the graph is float16 (LayerNormalization, Softmax, the GELU chain);
- ``hf_bert`` and ``hf_gpt2``: Hugging Face ``transformers``' ``BertModel`` and
  ``GPT2LMHeadModel`` built from a config (eager attention, an ``attention_mask`` input for BERT),
  ``.half()``, exported the same way. Their graphs carry what the library's code adds: the padding
  mask as ``(1 - mask) * finfo(float16).min``, Casts, GPT-2's ``Conv1D`` as ``Gemm`` on flattened
  rows, a Cast of the attention probabilities to their own type.

(``transformers``' ``sdpa`` attention exported this way gives graphs the ONNX checker rejects: a
float32 LayerNormalization input next to a float16 scale; the eager attention is the one a user
can export.)
"""
from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from bench import export_models as em

OPSET = em.OPSET
SEED = em.SEED
TRANSFORMERS = ("bert", "gpt2")
HF_MODELS = ("hf_bert", "hf_gpt2")


def half(built: em.Built) -> em.Built:
    """``built`` with its module in float16 (in place); inputs (token ids) unchanged."""
    built.module.half()
    return built


def to_onnx_half(name: str, **sizes: Any) -> bytes:
    """bench.export_models' ``name`` in float16, traced on the CPU (on CUDA the exporter's
    constant folding meets GPT-2's mask fill, a CPU scalar, next to CUDA tensors and fails)."""
    return em.to_onnx(half(em.build(name, **sizes)))


def stamp() -> str:
    """Changes when the exported float16 graphs may change."""
    return hashlib.sha256(Path(__file__).read_bytes() + em.stamp().encode()).hexdigest()[:16]


def ensure_half(name: str, out: Path = em.DEFAULT_OUT) -> Path:
    """The full-size ``<out>/<name>-fp16.onnx``, exported again only when :func:`stamp` changed."""
    path = out / f"{name}-fp16.onnx"
    stamp_path = path.with_suffix(".stamp")
    if not (path.exists() and stamp_path.exists() and stamp_path.read_text() == stamp()):
        out.mkdir(parents=True, exist_ok=True)
        path.write_bytes(to_onnx_half(name))
        stamp_path.write_text(stamp())
    return path


# -- Hugging Face transformers -----------------------------------------------------------------------


def _export_module(module: Any, args: tuple[Any, ...], inputs: list[str], output: str) -> bytes:
    import io
    import warnings

    import torch

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, buf, opset_version=OPSET, input_names=inputs, output_names=[output],
                          do_constant_folding=True, dynamo=False)
    return buf.getvalue()


def hf_bert(hidden: int = 48, layers: int = 2, heads: int = 4, ffn: int = 70, vocab: int = 97,
            batch: int = 2, seq: int = 13, dtype: str = "float16") -> tuple[bytes, dict[str, np.ndarray]]:
    """A float16 ``BertModel`` (last hidden state out) and its feeds: token ids and an attention
    mask whose second sequence ends in padding. ``dtype="float32"``: the same model (its weights
    rounded to float16) exported in float32, a reference for the float16 one."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(SEED)
    config = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=64,
                        attn_implementation="eager")
    model = BertModel(config).eval().half().to(getattr(torch, dtype))

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = model

        def forward(self, ids: Any, mask: Any) -> Any:
            return self.bert(input_ids=ids, attention_mask=mask).last_hidden_state

    rng = np.random.default_rng(SEED)
    ids = rng.integers(0, vocab, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    mask[-1, seq - max(1, seq // 3):] = 0
    data = _export_module(Encoder(), (torch.from_numpy(ids), torch.from_numpy(mask)),
                          ["input_ids", "attention_mask"], "hidden_states")
    return data, {"input_ids": ids, "attention_mask": mask}


def hf_gpt2(hidden: int = 48, layers: int = 2, heads: int = 4, vocab: int = 97,
            seq: int = 13, dtype: str = "float16") -> tuple[bytes, dict[str, np.ndarray]]:
    """A float16 ``GPT2LMHeadModel`` (logits out, no KV cache) and its feeds (token ids);
    ``dtype`` as for :func:`hf_bert`."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab, n_positions=64,
                        bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = GPT2LMHeadModel(config).eval().half().to(getattr(torch, dtype))

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt2 = model

        def forward(self, ids: Any) -> Any:
            # explicit positions and mask: the library's own derivation of them exports as aten::diff,
            # which the exporter has no ONNX form for
            positions = torch.arange(ids.shape[1]).unsqueeze(0)
            return self.gpt2(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=positions,
                             use_cache=False).logits

    ids = np.random.default_rng(SEED).integers(0, vocab, size=(1, seq), dtype=np.int64)
    return _export_module(Decoder(), (torch.from_numpy(ids),), ["input_ids"], "logits"), {"input_ids": ids}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fp16_models", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=em.DEFAULT_OUT, help="output folder (default: models/)")
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=[*TRANSFORMERS, *HF_MODELS],
                        help=f"models (default: all): {', '.join([*TRANSFORMERS, *HF_MODELS])}")
    args = parser.parse_args(argv)
    for name in args.only or [*TRANSFORMERS, *HF_MODELS]:
        if name in TRANSFORMERS:
            path = ensure_half(name, args.out)
        else:
            path = args.out / f"{name}-fp16.onnx"
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_bytes((hf_bert if name == "hf_bert" else hf_gpt2)()[0])
        print(f"{name}: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
