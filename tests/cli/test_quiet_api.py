"""The Python API is quiet by default: ``llm.compile``'s builds hide torch's export warnings,
TVM's build warnings and the per-operator fallback notes; ``verbose=True`` or
``TVM_SPINN_VERBOSE=1`` shows them, and the caller's warning filters and logger levels survive."""

import logging
import os
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("transformers")

#: A tiny GPT-2 (its token ids are int64: the embedding gather stays on the fallback, which logs a
#: note), one prefill built quietly, then verbosely; a marker line on stderr between the two.
_SCRIPT = r"""
import os, sys
import numpy as np, torch, transformers as tf
import tvm_spinn.llm as llm

torch.manual_seed(0)
cfg = tf.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=8,
                    bos_token_id=0, eos_token_id=0)
model = tf.GPT2LMHeadModel(cfg)
how = sys.argv[1]
for verbose in (False, True):
    kw = {"verbose": True} if verbose and how == "argument" else {}
    if verbose and how == "environment":
        os.environ["TVM_SPINN_VERBOSE"] = "1"
    c = llm.compile(model, max_seq_len=8, **kw)
    print("next token", c.generate(np.array([[1, 2]]), 1)[0, -1], flush=True)
    if not verbose:
        print("=== verbose ===", file=sys.stderr, flush=True)
"""

#: What ordinary builds printed before: none of it may appear in the quiet part.
_CHATTER = ("Warning", "FutureWarning", "DeprecationWarning", "dead codes", "Fast mode",
            "stays on the fallback target")


@pytest.mark.parametrize("how", ["argument", pytest.param("environment", marks=pytest.mark.slow)])
def test_llm_compile_is_quiet_unless_verbose(how):
    env = {k: v for k, v in os.environ.items() if k != "TVM_SPINN_VERBOSE"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, how], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("next token") == 2
    quiet, sep, verbose = proc.stderr.partition("=== verbose ===\n")
    assert sep, proc.stderr[-3000:]
    assert quiet == "", quiet[-3000:]
    # the verbose build shows what the quiet one hid: the per-operator fallback note at least
    assert "stays on the fallback target" in verbose, verbose[-3000:]
    assert "Fast mode" not in verbose  # the fallback's gathers are bounds-checked, not "fast"


def test_quiet_restores_the_callers_filters_and_levels():
    from tvm_spinn._quiet import QUIET_LOGGERS, quiet

    class Mine(UserWarning):
        pass

    logger = logging.getLogger(QUIET_LOGGERS[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", Mine)
        warnings.simplefilter("always", FutureWarning)
        logger.setLevel(logging.DEBUG)
        before = list(warnings.filters)
        try:
            with quiet(False):
                warnings.warn("hidden", FutureWarning)  # would be recorded below if not hidden
                assert logger.getEffectiveLevel() == logging.ERROR
            assert warnings.filters == before and logger.level == logging.DEBUG
            with pytest.raises(Mine):  # the caller's own filter works after the call
                warnings.warn("mine", Mine)
            with pytest.warns(FutureWarning):
                warnings.warn("shown again", FutureWarning)
        finally:
            logger.setLevel(logging.NOTSET)


def test_verbose_environment_switch(monkeypatch):
    from tvm_spinn._quiet import verbose_requested

    for value, want in (("", False), ("0", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("TVM_SPINN_VERBOSE", value)
        assert verbose_requested() is want
    monkeypatch.delenv("TVM_SPINN_VERBOSE")
    assert verbose_requested() is False and verbose_requested(True) is True
