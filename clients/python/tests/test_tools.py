"""The rule for tests that drive an external tool (conftest.require_tool):
skipped with a note outside CI, failed under CI=true."""

import pytest

from conftest import require_tool, running_in_ci

MISSING = "kunci-test-no-such-tool"


def test_running_in_ci_reads_the_ci_variable():
    assert running_in_ci({"CI": "true"})
    assert running_in_ci({"CI": "1"})
    assert not running_in_ci({})
    assert not running_in_ci({"CI": ""})
    assert not running_in_ci({"CI": "false"})
    assert not running_in_ci({"CI": "0"})


def test_a_missing_tool_fails_under_ci():
    with pytest.raises(pytest.fail.Exception, match=MISSING + "` is not installed .*CI=true"):
        require_tool(MISSING, "none", {"CI": "true"})


def test_a_missing_tool_skips_outside_ci():
    with pytest.raises(pytest.skip.Exception, match=MISSING + "` is not installed"):
        require_tool(MISSING, "none", {})


def test_a_present_tool_is_found():
    assert require_tool("sh", "dash", {"CI": "true"}).endswith("/sh")
