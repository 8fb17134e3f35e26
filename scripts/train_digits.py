"""Train the digit classifier that `make demo` serves, and write it with its test split.

Data: scikit-learn's bundled 8x8 digits (1,797 real handwritten samples shipped inside the
package, no download). The model is a small MLP trained here with plain numpy (Adam, fixed
seed), then written as ONNX with ``onnx.helper`` using only ops vkpool runs:

    x float32 [N, 1, 8, 8] (raw pixel intensities 0..16)
      -> Flatten -> Gemm(64->128) -> Relu -> Gemm(128->64) -> Relu -> Gemm(64->10) -> logits [N, 10]

The 1/16 input scaling is folded into the first layer's weights, so clients send pixels as-is.

Writes vkpool/demo_data/digits.onnx and vkpool/demo_data/digits_test.npz (the held-out split:
uint8 pixels [M, 8, 8] and uint8 labels [M]). scikit-learn is needed only here:

    .venv/bin/pip install scikit-learn
    .venv/bin/python scripts/train_digits.py
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OUT_DIR = Path(__file__).resolve().parent.parent / "vkpool" / "demo_data"
SEED = 0
HIDDEN = (128, 64)
TEST_FRACTION = 0.2


def load_split(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A stratified train/test split of the digits: uint8 pixels [n, 8, 8] and uint8 labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.astype(np.uint8)  # intensities 0..16
    labels = digits.target.astype(np.uint8)
    x_tr, x_te, y_tr, y_te = train_test_split(images, labels, test_size=TEST_FRACTION, random_state=seed,
                                              stratify=labels)
    return x_tr, y_tr, x_te, y_te


def init_params(rng: np.random.Generator, sizes: list[int]) -> list[np.ndarray]:
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        params.append(rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in))  # He init
        params.append(np.zeros(fan_out))
    return params


def forward(params: list[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Logits and the activations of each layer's input (for the backward pass)."""
    acts = [x]
    h = x
    n_layers = len(params) // 2
    for i in range(n_layers):
        h = h @ params[2 * i] + params[2 * i + 1]
        if i < n_layers - 1:
            h = np.maximum(h, 0.0)
            acts.append(h)
    return h, acts


def loss_and_grads(params: list[np.ndarray], x: np.ndarray, y: np.ndarray,
                   weight_decay: float) -> tuple[float, list[np.ndarray]]:
    logits, acts = forward(params, x)
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    n = len(y)
    loss = -np.log(p[np.arange(n), y] + 1e-12).mean()
    grad = p
    grad[np.arange(n), y] -= 1.0
    grad /= n
    grads: list[np.ndarray] = [np.empty(0)] * len(params)
    for i in reversed(range(len(params) // 2)):
        w = params[2 * i]
        grads[2 * i] = acts[i].T @ grad + weight_decay * w
        grads[2 * i + 1] = grad.sum(axis=0)
        if i > 0:
            grad = (grad @ w.T) * (acts[i] > 0)
    loss += 0.5 * weight_decay * sum(float((params[2 * i] ** 2).sum()) for i in range(len(params) // 2))
    return float(loss), grads


def train(x: np.ndarray, y: np.ndarray, *, seed: int, epochs: int, batch: int, lr: float,
          weight_decay: float, log: bool = True) -> list[np.ndarray]:
    """Adam on mini-batches of the (already scaled) float64 inputs ``x`` [n, 64]."""
    rng = np.random.default_rng(seed)
    params = init_params(rng, [x.shape[1], *HIDDEN, 10])
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    b1, b2, eps = 0.9, 0.999, 1e-8
    step = 0
    for epoch in range(epochs):
        order = rng.permutation(len(x))
        total = 0.0
        for start in range(0, len(x), batch):
            idx = order[start:start + batch]
            loss, grads = loss_and_grads(params, x[idx], y[idx], weight_decay)
            total += loss * len(idx)
            step += 1
            for k, g in enumerate(grads):
                m[k] = b1 * m[k] + (1 - b1) * g
                v[k] = b2 * v[k] + (1 - b2) * g * g
                m_hat = m[k] / (1 - b1 ** step)
                v_hat = v[k] / (1 - b2 ** step)
                params[k] -= lr * m_hat / (np.sqrt(v_hat) + eps)
        if log and (epoch + 1) % 10 == 0:
            acc = (forward(params, x)[0].argmax(axis=1) == y).mean()
            print(f"epoch {epoch + 1:3d}: loss {total / len(x):.4f}, train accuracy {acc:.4f}")
    return params


def to_onnx(params: list[np.ndarray]) -> onnx.ModelProto:
    """The trained MLP as an opset-17 ONNX graph; the 1/16 input scale folded into layer 1."""
    weights = [p.astype(np.float32) for p in params]
    weights[0] = (weights[0] / 16.0).astype(np.float32)
    inits, nodes = [], [helper.make_node("Flatten", ["x"], ["flat"], axis=1, name="flatten")]
    h = "flat"
    n_layers = len(weights) // 2
    for i in range(n_layers):
        w_name, b_name = f"fc{i + 1}.weight", f"fc{i + 1}.bias"
        inits.append(numpy_helper.from_array(weights[2 * i], w_name))
        inits.append(numpy_helper.from_array(weights[2 * i + 1], b_name))
        last = i == n_layers - 1
        out = "logits" if last else f"fc{i + 1}"
        nodes.append(helper.make_node("Gemm", [h, w_name, b_name], [out], name=f"fc{i + 1}"))
        if not last:
            nodes.append(helper.make_node("Relu", [out], [f"relu{i + 1}"], name=f"relu{i + 1}"))
            out = f"relu{i + 1}"
        h = out
    graph = helper.make_graph(
        nodes, "digits_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="vkpool scripts/train_digits.py")
    model.ir_version = 9
    model.doc_string = ("8x8 handwritten digit classifier (scikit-learn load_digits), MLP 64-128-64-10. "
                        "Input: raw pixel intensities 0..16 as float32 [N,1,8,8]; output: logits [N,10].")
    onnx.checker.check_model(model, full_check=True)
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()

    x_tr, y_tr, x_te, y_te = load_split(args.seed)
    print(f"digits: {len(x_tr)} training and {len(x_te)} test samples")
    scale = lambda a: a.reshape(len(a), -1).astype(np.float64) / 16.0  # noqa: E731
    params = train(scale(x_tr), y_tr.astype(np.int64), seed=args.seed, epochs=args.epochs, batch=32,
                   lr=1e-3, weight_decay=1e-4)
    test_acc = float((forward(params, scale(x_te))[0].argmax(axis=1) == y_te).mean())
    print(f"test accuracy (numpy, float64): {test_acc:.4f}")

    model = to_onnx(params)
    # The exported graph must give the same answers: evaluate it with the ONNX reference runtime.
    from onnx.reference import ReferenceEvaluator

    (logits,) = ReferenceEvaluator(model).run(None, {"x": x_te[:, None].astype(np.float32)})
    onnx_acc = float((logits.argmax(axis=1) == y_te).mean())
    print(f"test accuracy (exported ONNX, reference runtime): {onnx_acc:.4f}")
    if abs(onnx_acc - test_acc) > 1e-9:
        raise SystemExit("the exported model disagrees with the trained one")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(model, args.out_dir / "digits.onnx")
    np.savez_compressed(args.out_dir / "digits_test.npz", images=x_te, labels=y_te)
    for name in ("digits.onnx", "digits_test.npz"):
        print(f"wrote {args.out_dir / name} ({(args.out_dir / name).stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
