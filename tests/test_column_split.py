"""Products divided into column blocks (``vkpool.column_split``): which products are divided, that
the divided graph gives the whole product's outputs on the real Vulkan device (bit-exact against
the undivided graph on the same member, ONNX reference evaluator at rtol 1e-4, atol 1e-5), and
that a plan over members whose budgets cannot hold the product places its blocks on several
members, in threads and in worker processes, as ``vkpool plan`` shows it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from conftest import vulkan_pool
from vkpool.column_split import blocks_named, split_products, wide_products
from vkpool.config.loader import parse_config
from vkpool.model import load_model
from vkpool.session import Session

RNG = np.random.default_rng(11)
K, N = 96, 640  # a 240 KiB weight


def _const(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(np.float32), name)


def _model(nodes, inits, x_shape=(2, K), y_shape=(2, N), extra_inputs=()) -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y_shape))
    g = helper.make_graph(nodes, "g", [x, *extra_inputs], [y], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def _matmul_bias_relu() -> bytes:  # fused at load into one Gemm with its bias and Relu
    return _model([helper.make_node("MatMul", ["x", "w"], ["m"], name="dense"),
                   helper.make_node("Add", ["m", "b"], ["a"]),
                   helper.make_node("Relu", ["a"], ["y"])], [_const("w", (K, N)), _const("b", (N,))])


def _gemm_trans_b() -> bytes:  # weight stored N×K, a bias that broadcasts along the columns
    return _model([helper.make_node("Gemm", ["x", "w", "c"], ["y"], name="g", transB=1, alpha=0.5, beta=2.0)],
                  [_const("w", (N, K)), _const("c", (2, 1))])


def _matmul_3d() -> bytes:  # a product of rank 3 joins its blocks on axis 2
    return _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [_const("w", (K, N))],
                  x_shape=(2, 3, K), y_shape=(2, 3, N))


def _feeds(model: bytes) -> dict[str, np.ndarray]:
    proto = onnx.load_from_string(model)
    shape = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    return {"x": RNG.standard_normal(shape).astype(np.float32)}


@pytest.fixture(scope="module")
def split_pool():
    pool = vulkan_pool(parse_config("devices:\n  - match: {index: 0}\n    split: 2\n    budget: 256MiB\n"
                                    "host:\n  enabled: false\n"))
    yield pool
    pool.close()


@pytest.fixture
def pool2(split_pool):
    """The two members with their budgets restored after the test."""
    yield split_pool
    for member in ("vk0.0", "vk0.1"):
        split_pool.set_budget(member, 256 << 20)


@pytest.mark.parametrize("build", [_matmul_bias_relu, _gemm_trans_b, _matmul_3d])
@pytest.mark.parametrize("blocks", [2, 3])
def test_blocks_give_the_whole_products_outputs(pool2, build, blocks: int) -> None:
    model = build()
    feeds = _feeds(model)
    (want,) = ReferenceEvaluator(onnx.load_from_string(model)).run(None, feeds)
    loaded = load_model(model)
    (name,) = [n.name for n in loaded.nodes if n.op_type in ("MatMul", "Gemm")]
    with Session(model, pool=pool2, device="vk0.0") as whole:
        (undivided,) = whole.run(None, feeds)
    split_products(loaded, {name: blocks})
    assert [n.op_type for n in loaded.nodes][-1] == "Concat"
    assert [n.name for n in loaded.nodes[:blocks]] == [f"{name}/cols{i}" for i in range(blocks)]
    assert sum(loaded.tensors[n.outputs[0]].shape[-1] for n in loaded.nodes[:blocks]) == N
    assert "w" not in loaded.constants  # the blocks hold the weight now
    # the divided model's ops given as a plan on the one member: the session divides it alike
    with Session(model, pool=pool2, plan={n.name: "vk0.0" for n in loaded.nodes}) as divided:
        assert divided.model.column_splits == {name: blocks}
        (got,) = divided.run(None, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got, undivided)


def test_which_products_are_divided() -> None:
    loaded = load_model(_matmul_bias_relu())
    weight = K * N * 4
    assert wide_products(loaded, weight) == {}  # fits the limit
    assert wide_products(loaded, weight // 2) == {"dense": 2}
    assert wide_products(loaded, weight // 3 + 1) == {"dense": 3}
    assert wide_products(loaded, weight // 100) == {"dense": N // 64}  # no block under 64 columns
    assert wide_products(loaded, 0) == {}
    # a bias computed at run time with a value per column cannot be divided with the columns
    c = helper.make_tensor_value_info("c", TensorProto.FLOAT, [N])
    runtime_bias = _model([helper.make_node("Gemm", ["x", "w", "c"], ["y"], name="g")], [_const("w", (K, N))],
                          extra_inputs=[c])
    assert wide_products(load_model(runtime_bias), weight // 2) == {}
    with pytest.raises(ValueError, match="not a product"):
        split_products(load_model(runtime_bias), {"g": 2})
    split_products(loaded, {"dense": 2})
    assert loaded.column_splits == {"dense": 2}
    with pytest.raises(ValueError, match="divided already"):
        split_products(loaded, {"dense": 2})
    assert blocks_named(load_model(_matmul_bias_relu()), ["dense/cols0", "dense/cols1", "dense/join", "x/cols4"]) \
        == {"dense": 2}


def _tower() -> bytes:
    """x → dense 1 (MatMul + bias + Relu, 2 MiB of weights) → dense 2 (256 KiB) → y."""
    w1, w2 = 512, 1024
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, w1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"], name="dense1"),
             helper.make_node("Add", ["m1", "b1"], ["a1"]),
             helper.make_node("Relu", ["a1"], ["h"]),
             helper.make_node("MatMul", ["h", "w2"], ["y"], name="dense2")]
    g = helper.make_graph(nodes, "tower", [x], [y], [_const("w1", (w1, w2)), _const("b1", (w2,)),
                                                     _const("w2", (w2, 64))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


@pytest.mark.parametrize("processes", [False, True])
def test_budgets_that_cannot_hold_the_product_place_its_blocks(pool2, processes: bool) -> None:
    model = _tower()
    feeds = {"x": RNG.standard_normal((1, 512)).astype(np.float32)}
    with Session(model, pool=pool2, device="vk0.0") as one:
        (want,) = one.run(None, feeds)
    # 2 MiB of dense1 weights (2.3 MiB in all) against budgets of 2 MiB: whole, it fits neither
    # member, and each block of it is half a budget
    with Session(model, pool=pool2, budgets={"vk0.0": 2 << 20, "vk0.1": 2 << 20}, devices=["vk0.0", "vk0.1"],
                 processes=processes) as split:
        assert split.model.column_splits == {"dense1": 2}
        placed = {op: c.member for c in split.plan.chunks for op in c.ops}
        assert {placed["dense1/cols0"], placed["dense1/cols1"]} == {"vk0.0", "vk0.1"}, split.plan.to_text()
        assert "dense1/cols1" in split.plan.to_text()
        for _ in range(2):
            (got,) = split.run(None, feeds)
            np.testing.assert_array_equal(got, want)
        for member, nbytes in split.memory_by_member().items():
            assert nbytes <= 2 << 20
    # the plan, given back, divides a freshly loaded model the same way
    with Session(model, pool=pool2, plan=placed, processes=processes) as given:
        assert given.model.column_splits == {"dense1": 2}
        (again,) = given.run(None, feeds)
        np.testing.assert_array_equal(again, want)


def test_cli_plan_shows_the_blocks(tmp_path: Path) -> None:
    from vkpool.cli import main
    from vkpool.partition.cost import specs_dir

    path = tmp_path / "tower.onnx"
    path.write_bytes(_tower())
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--devices", str(specs_dir() / "2xh200.yaml"), "--budget", "gpu0=2MiB",
                 "--budget", "gpu1=2MiB", "--format", "json", "-o", str(out)]) == 0
    placed = {op: c["member"] for c in json.loads(out.read_text())["chunks"] for op in c["ops"]}
    assert {placed["dense1/cols0"], placed["dense1/cols1"]} == {"gpu0", "gpu1"}
