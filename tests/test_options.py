"""The one options struct: typed fields, errors naming the field, the context, the env reader."""

from __future__ import annotations

import ast
import pathlib

import pytest

import tvm_spinn
from tvm_spinn import _env
from tvm_spinn.mapping import MappingOptions, current_options
from tvm_spinn.options import BuildOptions, SpinnOptions, current
from tvm_spinn.program.format import options_from_json, options_to_json
from tvm_spinn.program.model import ProgramError

ROOT = pathlib.Path(__file__).resolve().parents[1] / "python" / "tvm_spinn"


def test_defaults_round_trip_through_dict():
    opts = SpinnOptions()
    assert opts.to_dict() == {"mapping": {"mode": "auto", "objective": "latency", "weights": "auto",
                                          "activations": "auto", "naive": False, "double_buffer": True,
                                          "scheduler": "static", "split_k": True, "row_tiles": True},
                              "build": None, "iss": False}
    assert SpinnOptions.from_dict(opts.to_dict()) == opts
    custom = SpinnOptions.from_dict({"mapping": {"mode": "pipelined", "split_k": False},
                                     "build": {"default_schedules": False}})
    assert custom.mapping == MappingOptions(mode="pipelined", split_k=False)
    assert custom.build == BuildOptions(default_schedules=False)
    assert SpinnOptions.from_dict(custom.to_dict()) == custom
    assert tvm_spinn.SpinnOptions is SpinnOptions


def test_program_form_of_mapping_options_leaves_out_later_defaults():
    # programs built with the defaults keep their bytes: fields added later are left out at default
    assert options_to_json(MappingOptions()) == {"mode": "auto", "objective": "latency", "weights": "auto",
                                                 "activations": "auto", "naive": False}
    assert options_to_json(MappingOptions(split_k=False))["split_k"] is False
    assert options_to_json(MappingOptions(row_tiles=False))["row_tiles"] is False
    for opts in (MappingOptions(), MappingOptions(split_k=False, scheduler="software", double_buffer=False),
                 MappingOptions(row_tiles=False)):
        assert options_from_json(options_to_json(opts)) == opts
        assert MappingOptions.from_dict(opts.to_dict()) == opts


@pytest.mark.parametrize("data, match", [
    ({"nave": True}, r"^mapping\.options: unknown field 'nave' \(fields: mode, "),
    ({"split_k": 1}, r"^mapping\.options\.split_k: expected bool, got 1 \(int\)"),
    ({"mode": "fast"}, r"^mapping\.options\.mode must be one of"),
    ([], r"^mapping\.options: expected an object, got list"),
])
def test_program_options_name_the_bad_field(data, match):
    with pytest.raises(ProgramError, match=match):
        options_from_json(data)


@pytest.mark.parametrize("data, match", [
    ({"mapings": {}}, r"SpinnOptions: unknown field 'mapings' \(fields: mapping, build, iss\)"),
    ({"mapping": {"nave": True}}, r"SpinnOptions\.mapping: unknown field 'nave'"),
    ({"build": {"tuning_log": "x"}}, r"SpinnOptions\.build: unknown field 'tuning_log'"),
])
def test_unknown_field_is_named(data, match):
    with pytest.raises(TypeError, match=match):
        SpinnOptions.from_dict(data)


@pytest.mark.parametrize("data, match", [
    ({"mapping": {"naive": "yes"}}, r"SpinnOptions\.mapping\.naive: expected bool, got 'yes' \(str\)"),
    ({"mapping": {"split_k": 1}}, r"SpinnOptions\.mapping\.split_k: expected bool, got 1 \(int\)"),
    ({"mapping": {"mode": 3}}, r"SpinnOptions\.mapping\.mode: expected str, got 3 \(int\)"),
    ({"build": {"default_schedules": None}}, r"SpinnOptions\.build\.default_schedules: expected bool"),
    ({"mapping": "pipelined"}, r"SpinnOptions\.mapping: expected MappingOptions"),
    ({"build": 7}, r"SpinnOptions\.build: expected BuildOptions or None, got 7"),
])
def test_ill_typed_field_is_named_with_its_type(data, match):
    with pytest.raises(TypeError, match=match):
        SpinnOptions.from_dict(data)


def test_value_outside_the_allowed_set_is_named():
    with pytest.raises(ValueError, match=r"SpinnOptions\.mapping\.mode must be one of .*got 'fast'"):
        SpinnOptions.from_dict({"mapping": {"mode": "fast"}})
    with pytest.raises(ValueError, match=r"MappingOptions\.weights must be one of"):
        MappingOptions(weights="sram")


def test_constructor_and_replace_check_types():
    with pytest.raises(TypeError, match=r"MappingOptions\.naive: expected bool, got 'no'"):
        MappingOptions(naive="no")
    with pytest.raises(TypeError, match=r"SpinnOptions\.mapping: expected MappingOptions"):
        SpinnOptions(mapping={"mode": "auto"})
    opts = SpinnOptions()
    assert opts.replace(mapping={"weights": "stream"}).mapping == MappingOptions(weights="stream")
    assert opts.replace(build={"default_schedules": False}).build == BuildOptions(default_schedules=False)
    with pytest.raises(TypeError, match=r"SpinnOptions: unknown field 'maping'"):
        opts.replace(maping={})
    with pytest.raises(TypeError, match=r"SpinnOptions\.mapping: unknown field 'mod'"):
        opts.replace(mapping={"mod": "pipelined"})
    with pytest.raises(TypeError, match=r"SpinnOptions\.mapping\.double_buffer: expected bool"):
        opts.replace(mapping={"double_buffer": "off"})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        BuildOptions(tuning_logs="/nonexistent/tuning/dir")


def test_one_stack_innermost_wins_across_parts():
    assert SpinnOptions.current() is None and current() == SpinnOptions()
    with SpinnOptions(mapping=MappingOptions(mode="pipelined")):
        assert current_options().mode == "pipelined"
        with tvm_spinn.build_options(default_schedules=False):
            # a part's context keeps the other parts of the enclosing options
            assert current() == SpinnOptions(mapping=MappingOptions(mode="pipelined"),
                                             build=BuildOptions(default_schedules=False))
            with MappingOptions(split_k=False):
                assert current().mapping == MappingOptions(split_k=False)
                assert current().build == BuildOptions(default_schedules=False)
            assert current_options().mode == "pipelined"
        assert current().build is None
    assert SpinnOptions.current() is None


def test_split_k_is_an_option_not_a_module_global():
    from tvm_spinn.program.ops import gemm

    assert not hasattr(gemm, "SPLIT_K")


def _environ_reads(path: pathlib.Path) -> list[int]:
    """Lines of ``os.environ``/``os.getenv`` reads of a ``TVM_SPINN_*`` name in ``path``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and str(node.args[0].value).startswith("TVM_SPINN_"):
            text = ast.unparse(node.func)
            if "environ" in text or "getenv" in text:
                lines.append(node.lineno)
        if isinstance(node, ast.Subscript) and "environ" in ast.unparse(node.value) \
                and isinstance(node.slice, ast.Constant) and str(node.slice.value).startswith("TVM_SPINN_"):
            lines.append(node.lineno)
    return lines


def test_environment_is_read_in_one_place():
    bad = {str(p.relative_to(ROOT)): _environ_reads(p) for p in sorted(ROOT.rglob("*.py"))
           if p.name != "_env.py" and _environ_reads(p)}
    assert not bad, f"TVM_SPINN_* read outside tvm_spinn/_env.py: {bad}"
    # every name the package passes to env() is in the documented table
    used = set()
    for p in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "env" \
                    and node.args and isinstance(node.args[0], ast.Constant):
                used.add(node.args[0].value)
    assert used <= set(_env.ENV), used - set(_env.ENV)
    for name in _env.ENV:
        assert name in _env.__doc__


def test_env_reader_rejects_unlisted_names_and_reads_overrides(monkeypatch):
    with pytest.raises(KeyError, match="TVM_SPINN_SPLIT_K"):
        _env.env("TVM_SPINN_SPLIT_K")
    monkeypatch.delenv("TVM_SPINN_SIM_MODE", raising=False)
    assert _env.env("TVM_SPINN_SIM_MODE", "layers") == "layers"
    monkeypatch.setenv("TVM_SPINN_SIM_MODE", "tiles")
    assert _env.env("TVM_SPINN_SIM_MODE") == "tiles"
    from tvm_spinn.runtime.simulator import sim_mode

    assert sim_mode() == "tiles"  # the simulator's default comes through the one reader
    monkeypatch.setenv("TVM_SPINN_SIM_MODE", "fast")
    with pytest.raises(ValueError, match="TVM_SPINN_SIM_MODE"):
        sim_mode()
