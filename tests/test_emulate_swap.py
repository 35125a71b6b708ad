"""What the emulator replaces for a run comes back as it was: a user's process goes on after the run."""

from __future__ import annotations

import types

import pytest

from memdiff.recording.emulate.swap import replaced


def test_what_was_replaced_comes_back_as_it_was_a_staticmethod_as_itself_and_a_new_name_gone():
    class Props:
        @staticmethod
        def device_count() -> int:
            return 0

    module = types.ModuleType("fake_c")
    module.real = lambda: "real"
    with replaced([(Props, "device_count", staticmethod(lambda: 1)), (module, "real", lambda: "ours"),
                   (module, "_broadcast", lambda: "added")]):
        assert Props().device_count() == 1 and module.real() == "ours" and module._broadcast() == "added"
    assert isinstance(Props.__dict__["device_count"], staticmethod) and Props().device_count() == 0
    assert module.real() == "real" and not hasattr(module, "_broadcast")


def test_a_failing_block_still_puts_everything_back():
    module = types.ModuleType("fake_os")
    module.replace = "real"
    with pytest.raises(RuntimeError), replaced([(module, "replace", "ours")]):
        raise RuntimeError("the script failed")
    assert module.replace == "real"
