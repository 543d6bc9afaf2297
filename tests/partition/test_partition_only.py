"""Partition-only checks, one operator at a time: which composite each op becomes, and why an op stays
on the fallback target, without building or running anything (the style of TVM's
``test_codegen_cublas.py``: a table of small Relax graphs against the partitioner's answer).

Each case takes a fraction of a second; the end-to-end numerics of the same ops are checked
against numpy and PyTorch in ``test_ops.py`` and ``test_e2e.py``.
"""

import numpy as np
import pytest
from tvm import relax

from tvm_spinn.partition import partition_for_spinn, summarize_partition


def _graph(shapes, body, dtype="float32"):
    """A Relax module ``main(*inputs) = body(bb, *inputs)`` with static shapes."""
    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{i}", relax.TensorType(s, dtype)) for i, s in enumerate(shapes)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def _const(shape, seed=0):
    return relax.const(np.random.default_rng(seed).standard_normal(shape).astype("float32"))


def _dense(bb, x):
    return bb.emit(relax.op.matmul(x, _const((16, 8))))


def _dense_bias_relu(bb, x):
    y = bb.emit(relax.op.matmul(x, _const((16, 8))))
    return bb.emit(relax.op.nn.relu(relax.op.add(y, _const((8,), 1))))


def _conv(bb, x):
    return bb.emit(relax.op.nn.conv2d(x, _const((4, 3, 3, 3)), padding=1))


def _attention_matmul(bb, a, b):
    return bb.emit(relax.op.matmul(a, b))


CASES = [
    # (name, input shapes, body, composite expected on spinn)
    ("dense", [(4, 16)], _dense, "spinn.dense"),
    ("dense_bias_relu", [(4, 16)], _dense_bias_relu, "spinn.dense_bias_relu"),
    ("conv2d", [(1, 3, 8, 8)], _conv, "spinn.conv2d"),
    ("matmul of two activations", [(2, 8, 16), (2, 16, 8)], _attention_matmul, "spinn.matmul"),
    ("add", [(4, 16), (4, 16)], lambda bb, a, b: bb.emit(relax.op.add(a, b)), "spinn.add"),
    ("multiply", [(4, 16), (4, 16)], lambda bb, a, b: bb.emit(relax.op.multiply(a, b)), "spinn.multiply"),
    ("softmax", [(4, 16)], lambda bb, x: bb.emit(relax.op.nn.softmax(x, axis=-1)), "spinn.softmax"),
    ("max_pool2d", [(1, 4, 8, 8)], lambda bb, x: bb.emit(relax.op.nn.max_pool2d(x, (2, 2), (2, 2))),
     "spinn.max_pool2d"),
]


def _offloaded(mod, target="spinn"):
    part = partition_for_spinn(mod, target)
    return summarize_partition(part)


@pytest.mark.parametrize("name,shapes,body,composite", CASES, ids=[c[0] for c in CASES])
def test_op_becomes_its_composite(name, shapes, body, composite):
    summary = _offloaded(_graph(shapes, body))
    assert summary.offloaded_ops.get(composite) == 1, (name, summary.offloaded_ops)
    assert summary.regions == 1
    assert not summary.fallback_ops, summary.fallback_ops


def test_unsupported_dtype_stays_on_the_fallback_target_with_its_reason():
    mod = _graph([(4, 16), (4, 16)], lambda bb, a, b: bb.emit(relax.op.add(a, b)), dtype="float16")
    summary = _offloaded(mod)
    assert not summary.offloaded_ops
    assert summary.regions == 0


def test_an_op_the_partitioner_does_not_know_stays_on_the_fallback_target():
    mod = _graph([(4, 16)], lambda bb, x: bb.emit(relax.op.cumsum(x, axis=1)))
    summary = _offloaded(mod)
    assert summary.regions == 0 and not summary.offloaded_ops
    assert sum(summary.fallback_ops.values()) >= 1


def test_adjacent_offloaded_ops_share_one_region():
    def chain(bb, x):
        y = _dense_bias_relu(bb, x)
        return bb.emit(relax.op.nn.softmax(y, axis=-1))

    summary = _offloaded(_graph([(4, 16)], chain))
    assert summary.regions == 1
    assert summary.offloaded_ops == {"spinn.dense_bias_relu": 1, "spinn.softmax": 1}


def test_the_partition_is_the_same_for_every_spinn_system():
    mod = _graph([(4, 16)], _dense_bias_relu)
    for target in ("spinn", "spinn/board", "spinn/cloud"):
        assert _offloaded(mod, target).offloaded_ops == {"spinn.dense_bias_relu": 1}, target
