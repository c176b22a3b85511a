"""The one parser of on/off environment switches: a typo is an error, not the default."""

import pytest

from tokenmill.engine.switches import switch


@pytest.mark.parametrize("raw, want", [
    ("0", False), ("false", False), ("No", False), (" off ", False),
    ("1", True), ("TRUE", True), ("yes", True), ("on", True), ("", None), ("  ", None),
])
def test_the_spellings_of_on_and_off(monkeypatch, raw, want):
    monkeypatch.setenv("TOKENMILL_TEST_SWITCH", raw)
    assert switch("TOKENMILL_TEST_SWITCH") is want


def test_unset_is_none_and_anything_else_names_the_variable(monkeypatch):
    monkeypatch.delenv("TOKENMILL_TEST_SWITCH", raising=False)
    assert switch("TOKENMILL_TEST_SWITCH") is None
    monkeypatch.setenv("TOKENMILL_TEST_SWITCH", "2")
    with pytest.raises(ValueError, match="TOKENMILL_TEST_SWITCH='2'"):
        switch("TOKENMILL_TEST_SWITCH")


@pytest.mark.parametrize("encoded_copy", [True, False])
def test_a_change_to_the_environment_is_seen_at_the_next_read(monkeypatch, encoded_copy):
    # The fast read goes through os.environ's encoded copy; without one, through os.environ.get.
    from tokenmill.engine import switches

    if not encoded_copy:
        monkeypatch.setattr(switches, "_ENCODED", None)
    monkeypatch.delenv("TOKENMILL_TEST_SWITCH", raising=False)
    assert switch("TOKENMILL_TEST_SWITCH") is None
    monkeypatch.setenv("TOKENMILL_TEST_SWITCH", "off")
    assert switch("TOKENMILL_TEST_SWITCH") is False
    monkeypatch.setenv("TOKENMILL_TEST_SWITCH", "on")
    assert switch("TOKENMILL_TEST_SWITCH") is True
    monkeypatch.delenv("TOKENMILL_TEST_SWITCH")
    assert switch("TOKENMILL_TEST_SWITCH") is None
