"""The package as an index would show it: one version for the project,
the license inside the wheel and the sdist, the SPDX license field,
classifiers naming the Python versions, typing, and a README whose links
work off the repository."""

import email
import os
import re
import shutil
import subprocess
import sys
import tarfile
import typing
import zipfile

import pytest

import kunci
from conftest import PACKAGE_ROOT, REPO_ROOT, running_in_ci


def crate_version():
    with open(os.path.join(REPO_ROOT, "Cargo.toml"), encoding="utf-8") as f:
        text = f.read()
    package = text.split("[package]", 1)[1].split("\n[", 1)[0]
    return re.search(r'^version\s*=\s*"([^"]+)"', package, re.M).group(1)


def test_one_version_for_the_project():
    # The Python package's version is the crate's: one release, one number.
    assert kunci.__version__ == crate_version()
    with open(os.path.join(PACKAGE_ROOT, "pyproject.toml"), encoding="utf-8") as f:
        pyproject = f.read()
    # Not written twice: pyproject takes it from kunci.__version__.
    project = pyproject.split("\n[project]\n", 1)[1].split("\n[", 1)[0]
    assert 'dynamic = ["version"]' in project
    assert re.search(r"^version\s*=", project, re.M) is None
    assert 'version = { attr = "kunci.__version__" }' in pyproject


def test_the_license_beside_the_package_is_the_projects():
    with open(os.path.join(REPO_ROOT, "LICENSE"), "rb") as f:
        root = f.read()
    with open(os.path.join(PACKAGE_ROOT, "LICENSE"), "rb") as f:
        assert f.read() == root


def test_readme_links_work_on_a_package_index():
    with open(os.path.join(PACKAGE_ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    # A relative link to a file of the repository leads nowhere there.
    assert re.findall(r"\]\((?!https?://|#)[^)]*\)", readme) == []


def test_typed():
    assert os.path.exists(os.path.join(PACKAGE_ROOT, "kunci", "py.typed"))
    for method in ("acquire", "lock", "release", "renew", "query", "holders", "list_keys",
                   "keys", "info", "ping", "close"):
        for client in (kunci.Client, kunci.aio.Client):
            function = getattr(client, method)
            assert "return" in function.__annotations__, (client, method)
            typing.get_type_hints(function)  # every name resolves
            assert function.__doc__, (client, method)
    for method in ("renew", "release", "check", "is_valid", "detach"):
        for ticket in (kunci.Ticket, kunci.aio.Ticket):
            assert "return" in getattr(ticket, method).__annotations__, (ticket, method)


def _build(tmp_path):
    try:
        import build  # noqa: F401
    except ImportError:
        message = "the `build` package is not installed (.ci/test installs it)"
        if running_in_ci():
            pytest.fail(message + ": under CI=true a missing tool fails the test", pytrace=False)
        pytest.skip(message)
    source = tmp_path / "src"
    shutil.copytree(PACKAGE_ROOT, str(source), ignore=shutil.ignore_patterns(
        "__pycache__", "build", "*.egg-info", ".pytest_cache"))
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out),
                    str(source)], check=True, capture_output=True, timeout=300)
    version = crate_version()
    return (out / ("kunci-%s.tar.gz" % version), out / ("kunci-%s-py3-none-any.whl" % version))


def test_wheel_and_sdist_carry_the_license(tmp_path):
    sdist, wheel = _build(tmp_path)
    version = crate_version()
    with tarfile.open(str(sdist)) as tar:
        names = tar.getnames()
    assert "kunci-%s/LICENSE" % version in names
    assert "kunci-%s/kunci/py.typed" % version in names
    with zipfile.ZipFile(str(wheel)) as whl:
        names = whl.namelist()
        metadata = email.message_from_bytes(
            whl.read("kunci-%s.dist-info/METADATA" % version))
    assert "kunci-%s.dist-info/licenses/LICENSE" % version in names
    assert "kunci/py.typed" in names
    assert metadata["Version"] == version
    assert metadata["License-Expression"] == "MIT"
    assert metadata.get_all("License-File") == ["LICENSE"]
    classifiers = metadata.get_all("Classifier")
    for minor in range(9, 14):
        assert "Programming Language :: Python :: 3.%d" % minor in classifiers
    assert "Typing :: Typed" in classifiers
