"""Load-time fusion of transformer blocks (vkpool.fusion): a Linear's bias and GELU into the
product, and scaled dot-product attention as exporters spell it into one Attention node on the
tiled kernel. Each graph is checked twice: what the rewrite made of it, and its outputs on the
real Vulkan device against onnxruntime (CPU), rtol 1e-4, atol 1e-5; odd sizes, several key
tiles, partial row blocks, masks of every kind, and the device limits that change the kernel."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import vkpool
from conftest import vulkan_pool
from vkpool.model import load_model

ort = pytest.importorskip("onnxruntime", reason="onnxruntime computes the expected outputs")
RNG = np.random.default_rng(11)


def _c(name: str, value) -> object:
    return numpy_helper.from_array(np.asarray(value), name)


def _w(name: str, *shape: int) -> object:
    return _c(name, (RNG.standard_normal(shape) * 0.3).astype(np.float32))


def _model(nodes, inputs, inits, outputs, opset: int = 17) -> bytes:
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in inputs]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs]
    graph = helper.make_graph(nodes, "g", ins, outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


def _check(pool, model: bytes, feeds: dict[str, np.ndarray]) -> vkpool.Session:
    expected = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    session = vkpool.Session(model, pool=pool, device=pool.vulkan_members[0].id)
    for got, want in zip(session.run(None, feeds), expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    return session


def _ops(model: bytes) -> list[tuple[str, object]]:
    return [(n.op_type, n.attrs.get("activation")) for n in load_model(model, cache=False).nodes]


# -- GELU after a Linear ------------------------------------------------------------------------

def _linear(chain: list, out: str = "y", extra_inits: tuple = ()) -> bytes:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["bias", "p"], ["h"]), *chain]
    inits = [_w("w", 10, 24), _w("bias", 24), *extra_inits]
    return _model(nodes, [("x", (2, 5, 10))], inits, [out])


GELU_ERF = [  # BERT's spelling: x * 0.5 * (1 + erf(x / sqrt(2)))
    helper.make_node("Div", ["h", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
    helper.make_node("Add", ["e", "one"], ["a"]), helper.make_node("Mul", ["h", "a"], ["m"]),
    helper.make_node("Mul", ["m", "half"], ["y"])]
GELU_TANH_POW = [  # 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), constants first
    helper.make_node("Pow", ["h", "three"], ["c3"]), helper.make_node("Mul", ["k", "c3"], ["kc"]),
    helper.make_node("Add", ["h", "kc"], ["in"]), helper.make_node("Mul", ["s2pi", "in"], ["arg"]),
    helper.make_node("Tanh", ["arg"], ["t"]), helper.make_node("Add", ["one", "t"], ["a"]),
    helper.make_node("Mul", ["half", "h"], ["hh"]), helper.make_node("Mul", ["hh", "a"], ["y"])]
SCALARS = (_c("sqrt2", np.float32(np.sqrt(2))), _c("one", np.float32(1)), _c("half", np.float32(0.5)),
           _c("three", np.float32(3)), _c("k", np.float32(0.044715)), _c("s2pi", np.float32(np.sqrt(2 / np.pi))))


@pytest.mark.parametrize("chain,activation", [(GELU_ERF, "Gelu"), (GELU_TANH_POW, "GeluTanh")], ids=["erf", "tanh"])
def test_a_spelled_out_gelu_becomes_the_products_epilogue(pool, chain, activation):
    model = _linear(chain, extra_inits=SCALARS)
    assert _ops(model) == [("MatMul", activation)]
    _check(pool, model, {"x": RNG.standard_normal((2, 5, 10)).astype(np.float32) * 3})


def test_a_chain_that_is_not_gelu_stays():
    # erf(x / 1.5): close to GELU in shape, not in value
    other = [helper.make_node("Div", ["h", "c15"], ["d"]), *GELU_ERF[1:]]
    model = _linear(other, extra_inits=(*SCALARS, _c("c15", np.float32(1.5))))
    assert [op for op, _ in _ops(model)] == ["MatMul", "Div", "Erf", "Add", "Mul", "Mul"]
    # an intermediate the caller reads keeps the chain whole
    seen = _model([helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["bias", "p"], ["h"]),
                   *GELU_ERF], [("x", (2, 5, 10))], [_w("w", 10, 24), _w("bias", 24), *SCALARS], ["y", "e"])
    assert [op for op, _ in _ops(seen)] == ["MatMul", "Div", "Erf", "Add", "Mul", "Mul"]


def test_the_gelu_op_and_a_bias_in_front_fuse(pool):
    model = _model([helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "bias"], ["h"]),
                    helper.make_node("Gelu", ["h"], ["y"], approximate="tanh")],
                   [("x", (3, 10))], [_w("w", 10, 7), _w("bias", 1, 7)], ["y"], opset=20)
    assert _ops(model) == [("MatMul", "GeluTanh")]
    _check(pool, model, {"x": RNG.standard_normal((3, 10)).astype(np.float32)})


# -- attention -----------------------------------------------------------------------------------

def _attention(b: int, s: int, t: int, h: int, d: int, *, mask: str = "none", key: str = "direct",
               scale: str = "Div", scores_out: bool = False) -> tuple[bytes, dict[str, np.ndarray]]:
    e = h * d
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"]), helper.make_node("MatMul", ["kv", "wk"], ["k"]),
             helper.make_node("MatMul", ["kv", "wv"], ["v"]),
             helper.make_node("Reshape", ["q", "qshape"], ["q4r"]),
             helper.make_node("Transpose", ["q4r"], ["q4"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["k", "kshape"], ["k4r"]),
             helper.make_node("Reshape", ["v", "kshape"], ["v4r"]),
             helper.make_node("Transpose", ["v4r"], ["v4"], perm=[0, 2, 1, 3])]
    if key == "direct":
        nodes.append(helper.make_node("Transpose", ["k4r"], ["kt"], perm=[0, 2, 3, 1]))
    else:
        nodes += [helper.make_node("Transpose", ["k4r"], ["k4"], perm=[0, 2, 1, 3]),
                  helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 1, 3, 2])]
    nodes.append(helper.make_node("MatMul", ["q4", "kt"], ["sc"]))
    factor = np.float32(np.sqrt(d))
    nodes.append(helper.make_node(scale, ["sc", "c"], ["z"]))
    inits = [_w("wq", e, e), _w("wk", e, e), _w("wv", e, e), _w("wo", e, e),
             _c("qshape", np.array([b, s, h, d], np.int64)), _c("kshape", np.array([b, t, h, d], np.int64)),
             _c("oshape", np.array([b, s, e], np.int64)),
             _c("c", factor if scale == "Div" else np.float32(1 / factor))]
    feeds = {"x": RNG.standard_normal((b, s, e)).astype(np.float32),
             "kv": RNG.standard_normal((b, t, e)).astype(np.float32)}
    inputs = [("x", (b, s, e)), ("kv", (b, t, e))]
    soft_in = "z"
    if mask == "add":
        nodes.append(helper.make_node("Add", ["z", "m"], ["zm"]))
        padding = np.zeros((b, 1, 1, t), np.float32)
        padding[0, ..., t - 2:] = -1e4  # the first batch's last two keys are padding
        feeds["m"] = padding
        inputs.append(("m", (b, 1, 1, t)))
        soft_in = "zm"
    elif mask in ("causal", "pattern"):
        masked = ~np.tril(np.ones((s, t), bool)) if mask == "causal" else RNG.random((s, t)) < 0.4
        masked[:, 0] = False  # every row keeps a key
        inits += [_c("masked", masked), _c("fill", np.float32(np.finfo(np.float32).min))]
        nodes.append(helper.make_node("Where", ["masked", "fill", "z"], ["zm"]))
        soft_in = "zm"
    nodes += [helper.make_node("Softmax", [soft_in], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v4"], ["o"]),
              helper.make_node("Transpose", ["o"], ["o2"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["o2", "oshape"], ["o3"]), helper.make_node("MatMul", ["o3", "wo"], ["y"])]
    return _model(nodes, inputs, inits, ["y", "sc"] if scores_out else ["y"]), feeds


#: attention as exporters spell it, in float32 here and in float16 (test_fp16_fusion.py)
ATTENTION_CASES = pytest.mark.parametrize("b,s,t,h,d,mask,key,scale", [
    (2, 7, 7, 3, 5, "none", "direct", "Div"),
    (1, 20, 70, 2, 8, "add", "double", "Mul"),     # two row blocks, two key tiles, a partial one of each
    (2, 17, 17, 4, 6, "causal", "direct", "Div"),
    (1, 9, 33, 3, 4, "pattern", "double", "Div"),
], ids=["plain", "padding-mask-cross", "causal", "mask-pattern"])


@ATTENTION_CASES
def test_attention_as_exporters_spell_it_becomes_one_node(pool, b, s, t, h, d, mask, key, scale):
    model, feeds = _attention(b, s, t, h, d, mask=mask, key=key, scale=scale)
    ops = [op for op, _ in _ops(model)]
    assert ops.count("Attention") == 1 and "Softmax" not in ops and "Transpose" not in ops, ops
    attention = next(n for n in load_model(model, cache=False).nodes if n.op_type == "Attention")
    assert attention.attrs["is_causal"] == int(mask == "causal")
    with _check(pool, model, feeds) as session:
        kernel = "[attention_rows]" if session._chunk.device.caps.cpu_like else "[attention_tiled]"
        assert any(label.endswith(kernel) for label in session._chunk.dispatch_labels)


def test_attention_whose_scores_the_caller_reads_stays_unfused(pool):
    model, feeds = _attention(1, 5, 5, 2, 3, scores_out=True)
    assert "Attention" not in [op for op, _ in _ops(model)]
    _check(pool, model, feeds).close()


@pytest.mark.parametrize("limits,keys", [
    ("", 64),
    ("max_shared_memory_bytes=4096", 16),          # tiles of 16 keys
    ("max_shared_memory_bytes=2048", None),        # no tile fits: one query row per workgroup
    ("max_workgroup_invocations=128", None),       # the tiled kernel's 256 invocations are too many
])
def test_attention_follows_the_device_limits(limits, keys):
    from node_cases import assert_outputs_match, run_node
    from vkpool.kernels.registry import create_op
    from vkpool.kernels.base import TensorInfo

    b, hq, hkv, s, t, d = 1, 4, 2, 20, 70, 5
    q, k, v = (RNG.standard_normal(shape).astype(np.float32) for shape in ((b, s, hq * d), (b, t, hkv * d), (b, t, hkv * d)))
    mask = RNG.standard_normal((b, 1, s, t)).astype(np.float32)
    attrs = {"q_num_heads": hq, "kv_num_heads": hkv, "is_causal": 1, "scale": 0.7}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VKPOOL_DEVICE_LIMITS", limits)
        p = vulkan_pool()
    try:
        op = create_op("Attention", attrs, [TensorInfo(x.shape, x.dtype) for x in (q, k, v, mask)], opset=23)
        assert op._tile_keys(p.vulkan_members[0].device.caps) == keys
        got, want = run_node(p, "Attention", [q, k, v, mask], attrs, opset=23)
        assert_outputs_match(got, want)
    finally:
        p.close()


# -- residual Add into LayerNormalization ----------------------------------------------------------

def _residual_block(pre_norm: bool) -> bytes:
    """x + Linear(x) normalised; in the pre-norm spelling the sum also feeds a later Add."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["x", "h"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "g", "bn"], ["n"], axis=-1, epsilon=1e-5)]
    outputs = ["n"]
    if pre_norm:
        nodes.append(helper.make_node("Add", ["s", "n"], ["y"]))
        outputs = ["y"]
    return _model(nodes, [("x", (2, 9, 13))], [_w("w", 13, 13), _w("g", 13), _w("bn", 13)], outputs)


@pytest.mark.parametrize("pre_norm", [False, True], ids=["post-norm", "pre-norm"])
def test_a_residual_add_joins_the_layernorm(pool, pre_norm):
    model = _residual_block(pre_norm)
    nodes = load_model(model, cache=False).nodes
    norm = next(n for n in nodes if n.op_type == "LayerNormalization")
    assert norm.attrs["residual"] == 1 and norm.inputs[3] == "h"
    assert [n.op_type for n in nodes] == ["MatMul", "LayerNormalization"] + (["Add"] if pre_norm else [])
    assert (len(norm.outputs) == 4 and norm.outputs[3] == "s") if pre_norm else len(norm.outputs) == 1
    _check(pool, model, {"x": RNG.standard_normal((2, 9, 13)).astype(np.float32)}).close()


# -- embeddings: constant adds merged, a constant residual joins the LayerNormalization ----------

def _embeddings(dtype: type = np.float32, sum_read: bool = False, vocab: int = 23, seq: int = 11,
                width: int = 13) -> bytes:
    """BERT's embeddings as exporters spell them: word embeddings gathered by token id, plus the
    position embeddings (a Gather of constant indices, which folds into a constant at load), plus
    the token type's row (a constant), then LayerNormalization. ``sum_read``: the first sum is a
    graph output too."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [_c(name, (RNG.standard_normal(shape) * 0.5).astype(dtype)) for name, shape in
             (("words", (vocab, width)), ("positions", (seq, width)), ("token_type", (width,)), ("g", (width,)),
              ("bn", (width,)))]
    inits.append(_c("position_ids", np.arange(seq, dtype=np.int64)[None]))
    nodes = [helper.make_node("Gather", ["words", "ids"], ["w"]), helper.make_node("Gather", ["positions", "position_ids"], ["p"]),
             helper.make_node("Add", ["w", "p"], ["s"]), helper.make_node("Add", ["s", "token_type"], ["e"]),
             helper.make_node("LayerNormalization", ["e", "g", "bn"], ["y"], axis=-1, epsilon=1e-5)]
    outputs = [helper.make_tensor_value_info(n, elem, None) for n in (["y", "s"] if sum_read else ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, seq])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_embeddings_become_a_gather_and_a_norm_with_a_constant_residual(pool, dtype):
    model = _embeddings(dtype)
    loaded = load_model(model, cache=False)
    assert [n.op_type for n in loaded.nodes] == ["Gather", "LayerNormalization"]
    norm = loaded.nodes[1]
    # the position and token type embeddings, summed at load, are the norm's residual
    assert norm.attrs["residual"] == 1 and norm.inputs[0] == "w" and norm.inputs[3] in loaded.constants
    ids = {"ids": RNG.integers(0, 23, (1, 11)).astype(np.int64)}
    if dtype == np.float32:
        _check(pool, model, ids).close()
        return
    # float16: the constants' sum and the norm's are taken in float32 or wider and rounded once,
    # onnxruntime rounds after every op; both within a few float16 roundings of the exact value
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, ids)[0]
    with vkpool.Session(model, pool=pool, device=pool.vulkan_members[0].id) as session:
        (got,) = session.run(None, ids)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=0, atol=2.0 ** -7 * np.abs(want).max())


def test_a_sum_read_elsewhere_stays_and_only_the_constants_after_it_join_the_norm(pool):
    model = _embeddings(sum_read=True)
    loaded = load_model(model, cache=False)
    # the first sum is an output: it stays, and the token type's row (broadcast) is the residual
    assert [n.op_type for n in loaded.nodes] == ["Gather", "Add", "LayerNormalization"]
    norm = loaded.nodes[2]
    assert norm.attrs["residual"] == 1 and norm.inputs[0] == "s" and norm.inputs[3] in loaded.constants
    _check(pool, model, {"ids": RNG.integers(0, 23, (1, 11)).astype(np.int64)}).close()


def test_a_chain_of_constant_adds_without_a_norm_stays():
    # what the add_chain workloads are: every Add a dispatch of its own
    nodes = [helper.make_node("Add", [f"t{k}", f"c{k}"], [f"t{k + 1}"]) for k in range(3)]
    model = _model([helper.make_node("Identity", ["x"], ["t0"]), *nodes], [("x", (4, 5))],
                   [_w(f"c{k}", 4, 5) for k in range(3)], ["t3"])
    assert [n.op_type for n in load_model(model, cache=False).nodes].count("Add") == 3


# -- every tile of the tiled GEMM ------------------------------------------------------------------

@pytest.mark.parametrize("tile", ["64x64", "32x32", "32x256", "128x128"])
def test_every_gemm_tile_matches_on_odd_sizes(tile, monkeypatch):
    """Each tile the planner may choose (the choice depends on shapes lavapipe's tests rarely
    reach), forced on a product and a convolution whose sizes fill no tile evenly. The shared
    tiling is forced too: lavapipe, a CPU-like device, runs the register tiling by default."""
    from node_cases import assert_outputs_match, ort_case
    from vkpool.kernels.ops import gemm

    monkeypatch.setenv("VKPOOL_KERNEL_VARIANT", "gemm=shared")
    monkeypatch.setattr(gemm, "choose_tile", lambda p, workgroups: tile)
    pool = vulkan_pool()
    a, w = RNG.standard_normal((37, 300)).astype(np.float32), RNG.standard_normal((300, 70)).astype(np.float32)
    x, k = RNG.standard_normal((1, 9, 13, 11)).astype(np.float32), RNG.standard_normal((17, 9, 3, 3)).astype(np.float32)
    try:
        assert pool.vulkan_members[0].device.caps.gemm_variant == "shared"
        for op, inputs, attrs in (("MatMul", [a, w], {}), ("Conv", [x, k], {"pads": [1, 1, 1, 1]})):
            model, feeds, expected = ort_case(op, inputs, attrs, constants=(1,))
            with vkpool.Session(model, pool=pool, device=pool.vulkan_members[0].id) as session:
                assert "[gemm]" in " ".join(session._chunk.dispatch_labels)
                assert_outputs_match(session.run(None, feeds), expected)
    finally:
        pool.close()
