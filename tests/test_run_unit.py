"""tests/run.py: how it decides to get the test packages, and that it never downloads pip
itself: pip comes with `python3 -m venv` (Debian's python3-venv)."""
import subprocess
import sys

import pytest

import run as runner
from support import ROOT


@pytest.mark.parametrize("situation, steps", [
    # The test packages import: nothing to install (CI, a developer's venv).
    (dict(has_test_modules=True, venv_ready=False, venv_has_pip=False, can_make_venv=False,
          can_apt_install=False), ["use-current"]),
    # A venv made by an earlier run, requirements unchanged.
    (dict(has_test_modules=False, venv_ready=True, venv_has_pip=True, can_make_venv=False,
          can_apt_install=False), ["use-venv"]),
    # Debian's python3 with python3-venv: the venv gets pip from ensurepip.
    (dict(has_test_modules=False, venv_ready=False, venv_has_pip=False, can_make_venv=True,
          can_apt_install=False), ["make-venv", "install-requirements", "use-venv"]),
    # Debian's python3 without python3-venv, run as root: apt-get installs it first.
    (dict(has_test_modules=False, venv_ready=False, venv_has_pip=False, can_make_venv=False,
          can_apt_install=True), ["apt-install-venv", "make-venv", "install-requirements", "use-venv"]),
    # A venv left by an interrupted run, or an edited requirements-dev.txt: install again.
    (dict(has_test_modules=False, venv_ready=False, venv_has_pip=True, can_make_venv=False,
          can_apt_install=False), ["install-requirements", "use-venv"]),
])
def test_plan(situation, steps):
    assert runner.plan(**situation) == steps


def test_without_python3_venv_and_not_root_it_says_which_package_to_install():
    with pytest.raises(runner.SetupError) as error:
        runner.plan(has_test_modules=False, venv_ready=False, venv_has_pip=False,
                    can_make_venv=False, can_apt_install=False)
    assert "apt install python3-venv" in str(error.value)
    assert len(str(error.value).splitlines()) == 1


def test_every_requirement_is_checked_by_its_import_name():
    names = runner.module_names((ROOT / "requirements-dev.txt").read_text())
    assert {"pytest", "xdist", "meilisearch", "prometheus_client", "selenium"} <= set(names)
    assert runner.module_names("# c\nfoo-bar>=1  # why\n\nBaz<2\n") == ["foo_bar", "baz"]


@pytest.mark.parametrize("args, cpus, expected", [
    (["-q"], 2, ["-n", "2", "-q"]),
    (["-q"], 8, ["-n", "2", "-q"]),
    (["-q"], 1, ["-q"]),
    (["-q", "-n", "4"], 2, ["-q", "-n", "4"]),
    (["-q", "-n0"], 2, ["-q", "-n0"]),
    (["-p", "no:xdist", "tests/test_docs.py"], 2, ["-p", "no:xdist", "tests/test_docs.py"]),
])
def test_two_test_processes_unless_the_arguments_choose(args, cpus, expected):
    assert runner.pytest_arguments(args, cpus) == expected


def test_the_runner_downloads_nothing_itself():
    source = (ROOT / "tests" / "run.py").read_text()
    assert "urllib" not in source and "http.client" not in source and "://" not in source
    assert "--without-pip" not in source


# Spelled in pieces so that this file does not name them itself.
INDEX_WORDS = ("pypi" + ".org", "pythonhosted" + ".org", "get" + "-pip")


def test_no_package_index_address_in_the_repository():
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True,
                             check=True).stdout.decode().split("\0")
    if not any(tracked):
        pytest.skip("needs a git clone of this repository (git ls-files lists nothing here)")
    found = []
    for name in filter(None, tracked):
        path = ROOT / name
        if path.is_file():
            text = path.read_bytes().decode("utf-8", "replace")
            found += [name for word in INDEX_WORDS if word in text]
    assert not found, found


def test_runner_answers_in_one_sentence_when_it_cannot_prepare(tmp_path):
    """Run with a Python that lacks the test packages and whose venv cannot be made here:
    a copy of run.py in a clone-shaped folder, under python -I -S (no site packages)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "run.py").write_text((ROOT / "tests" / "run.py").read_text())
    (tmp_path / "requirements-dev.txt").write_text("a-package-nobody-has\n")
    (tmp_path / ".venv").write_text("not a folder: venv cannot be made here\n")
    result = subprocess.run([sys.executable, "-I", "-S", str(tmp_path / "tests" / "run.py")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("tests/run.py: ")
