"""Types a checker can trust (issue 37): ``mypy --strict`` over the
package (with its pyproject's settings), and over a user program of the
public API with ``--disallow-any-expr`` too (no value it gets from kunci is
``Any``). mypy comes with the test environment (.ci/test); without it the
tests are skipped, except under CI=true, where they fail."""

import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import HERE, PACKAGE_ROOT, running_in_ci


def mypy(*args):
    """Runs mypy from the package's root (its pyproject.toml holds the
    settings); its exit status and output."""
    if importlib.util.find_spec("mypy") is None:
        message = "mypy is not installed for %s (pip install mypy)" % sys.executable
        if running_in_ci():
            pytest.fail(message + ": under CI=true a missing tool fails the test", pytrace=False)
        pytest.skip(message)
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", *args],
                          cwd=PACKAGE_ROOT, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def test_the_package_passes_mypy_strict():
    status, output = mypy("--strict", "-p", "kunci")
    assert status == 0, output


def test_a_user_program_passes_mypy_strict_with_no_any():
    # As a program that imports the installed package: errors inside kunci
    # are the previous test's (--follow-imports=silent), not the program's.
    program = os.path.join(HERE, "typed", "user_program.py")
    status, output = mypy("--strict", "--disallow-any-expr", "--follow-imports=silent", program)
    assert status == 0, output
