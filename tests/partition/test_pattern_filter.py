"""Pattern filtering: FuseOpsByPattern only gets the patterns whose operators a module calls."""

import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from tvm_spinn.partition import partition as part
from tvm_spinn.partition.patterns import FallbackReason, patterns_for, required_ops, spinn_patterns
from tvm_spinn.target.registry import arch_of, get_target


def test_required_ops_of_alternatives_is_their_intersection():
    x = wildcard()
    conv = is_op("relax.nn.conv2d")(x, is_const())
    relu = is_op("relax.nn.relu")(conv)
    either = is_op("relax.add")(x, x) | is_op("relax.add")(relu, x)
    assert required_ops(relu) == {"relax.nn.conv2d", "relax.nn.relu"}
    assert required_ops(either) == {"relax.add"}
    assert required_ops(wildcard()) == frozenset()


def test_patterns_for_keeps_order_and_drops_unmatchable():
    table = spinn_patterns(arch_of(get_target("spinn")), FallbackReason())
    kept = patterns_for(table, {"relax.matmul", "relax.add"})
    names = [entry[0] for entry in kept]
    assert names == [e[0] for e in table if e[0] in set(names)]  # table order
    assert "spinn.dense_bias" in names and "spinn.add" in names
    assert not any(n.startswith(("spinn.q", "spinn.conv2d")) or "relu" in n for n in names)


def _mlp() -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 16), "float32"))
    w = relax.const(tvm.runtime.tensor(__import__("numpy").ones((16, 8), "float32")))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w))
            z = bb.emit(relax.op.nn.relu(relax.op.add(y, y)))
            out = bb.emit_output(z)
        bb.emit_func_output(out)
    return bb.get()


def test_filtered_fusion_equals_full_table():
    mod = _mlp()
    table = spinn_patterns(arch_of(get_target("spinn")), FallbackReason())
    full = relax.transform.FuseOpsByPattern(table, bind_constants=True, annotate_codegen=False)(mod)
    filtered = part._fuse_spinn_patterns(table)(mod)
    tvm.ir.assert_structural_equal(full, filtered)
