"""$MOED_TEST_RUNTIME_HOOK (moed.engine.runtime_hook): unset changes nothing, a bad one is a clear load error."""

from __future__ import annotations

import sys
import types

import pytest

from moed.engine.runtime_hook import apply_runtime_hook
from moed.errors import InvalidRequestError


def test_without_a_hook_the_runtime_is_served_as_loaded(monkeypatch):
    monkeypatch.delenv("MOED_TEST_RUNTIME_HOOK", raising=False)
    runtime = object()
    assert apply_runtime_hook(runtime, "m") is runtime


def test_the_named_function_gets_the_runtime_and_its_answer_is_served(monkeypatch, caplog):
    module = types.ModuleType("fake_hook_module")
    module.wrap = lambda runtime: ("wrapped", runtime)
    monkeypatch.setitem(sys.modules, "fake_hook_module", module)
    monkeypatch.setenv("MOED_TEST_RUNTIME_HOOK", "fake_hook_module:wrap")
    with caplog.at_level("WARNING", logger="moed.engine"):
        assert apply_runtime_hook("rt", "demo") == ("wrapped", "rt")
    assert "answers from it, not from its weights" in caplog.text  # never silent


@pytest.mark.parametrize("spec, message", [
    ("no_colon", "must look like package.module:function"),
    ("surely_not_a_module_xyz:f", "cannot import surely_not_a_module_xyz"),
    ("os:not_there", "os has no function not_there"),
    ("os:sep", "os has no function sep"),  # not callable
])
def test_a_bad_hook_is_a_clear_error(spec, message):
    with pytest.raises(InvalidRequestError, match=message):
        apply_runtime_hook(object(), "m", spec=spec)
