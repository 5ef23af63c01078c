#!/usr/bin/env python3
"""Run the test suite with whatever Python runs this script: ``python3 tests/run.py -q``.

Arguments are passed on to pytest (paths are relative to the clone's top folder).

The tools need nothing beyond the standard library; the tests need the packages in
requirements-dev.txt (pytest, the official ``meilisearch`` client, ...). If this interpreter
can import them all they are used as they are. Otherwise (a distribution's own python3,
where PEP 668 forbids ``pip install``) they go into a virtual environment in the clone,
``.venv`` (git ignores it), made once with ``python3 -m venv`` (which brings pip) and reused.
Debian and Ubuntu ship venv's pip in a package of its own, python3-venv: run as root with
apt-get, this script installs it (and says so); otherwise it says to.

This file uses only the standard library and works on Python 3.9+.
"""
import hashlib
import os
import re
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
REQUIREMENTS = ROOT / "requirements-dev.txt"
# Written into the venv once requirements-dev.txt is installed: its sha256, so an edited
# requirements file is installed again on the next run.
STAMP = VENV / "requirements-dev.sha256"
VENV_PACKAGE = "python3-venv"
NO_VENV = ("this Python cannot make a virtual environment with pip: install the package %s "
           "(apt install %s, as root), or install requirements-dev.txt for this Python yourself"
           % (VENV_PACKAGE, VENV_PACKAGE))


class SetupError(Exception):
    """Why the test environment could not be prepared (one sentence for the user)."""


# ---------------------------------------------------------------- decisions (pure)

def plan(has_test_modules, venv_ready, venv_has_pip, can_make_venv, can_apt_install):
    """The steps that lead to an interpreter able to run the suite, in order.

    Steps: "use-current", "use-venv", "apt-install-venv", "make-venv", "install-requirements".
    Raises SetupError when no step can help.
    """
    if has_test_modules:
        return ["use-current"]
    if venv_ready:
        return ["use-venv"]
    steps = []
    if not venv_has_pip:
        if not can_make_venv:
            if not can_apt_install:
                raise SetupError(NO_VENV)
            steps.append("apt-install-venv")
        steps.append("make-venv")
    return steps + ["install-requirements", "use-venv"]


# Packages whose import name is not their name with '_' for '-'.
IMPORT_NAMES = {"pytest_xdist": "xdist"}


def module_names(requirements_text):
    """The import names of the packages a requirements file lists ('prometheus_client>=0.1'
    -> 'prometheus_client'; 'pytest-xdist' -> 'xdist')."""
    names = []
    for line in requirements_text.splitlines():
        line = line.split("#", 1)[0].strip()
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)
        if match:
            name = match.group().replace("-", "_").lower()
            names.append(IMPORT_NAMES.get(name, name))
    return names


def pytest_arguments(args, cpus):
    """The suite runs in two processes where there are two cores (pytest-xdist), unless the
    arguments choose (-n N, or -p no:xdist)."""
    chosen = any(a == "-n" or a.startswith(("-n", "--numprocesses")) or a == "no:xdist"
                 for a in args)
    if chosen or cpus < 2:
        return list(args)
    return ["-n", "2", *args]


# ---------------------------------------------------------------- actions

def importable(name):
    try:
        return find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def venv_python():
    return VENV / "bin" / "python"


def requirements_digest():
    return hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()


def venv_is_ready():
    return (venv_python().exists() and STAMP.exists()
            and STAMP.read_text().strip() == requirements_digest())


def venv_has_pip():
    return venv_python().exists() and subprocess.run(
        [str(venv_python()), "-c", "import pip"], capture_output=True).returncode == 0


def can_apt_install():
    """Root, apt-get, and this Python is the distribution's own (its python3-venv fits it)."""
    return (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get") is not None
            and sys.prefix == "/usr")


def run(argv, what):
    print("tests/run.py: " + what, file=sys.stderr, flush=True)
    if subprocess.run([str(a) for a in argv]).returncode != 0:
        raise SetupError("%s failed: %s" % (what, " ".join(map(str, argv))))


def make_venv():
    """python3 -m venv --clear .venv (an earlier venv without pip is replaced)."""
    print("tests/run.py: making a virtual environment for the test packages in %s" % VENV,
          file=sys.stderr, flush=True)
    made = subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if made.returncode != 0 or not venv_has_pip():
        shutil.rmtree(VENV, ignore_errors=True)
        raise SetupError(NO_VENV)


def prepare():
    """Carry out the plan; the interpreter to run pytest with."""
    steps = plan(has_test_modules=all(map(importable, module_names(REQUIREMENTS.read_text()))),
                 venv_ready=venv_is_ready(), venv_has_pip=venv_has_pip(),
                 can_make_venv=importable("venv") and importable("ensurepip"),
                 can_apt_install=can_apt_install())
    for step in steps:
        if step == "use-current":
            return sys.executable
        if step == "use-venv":
            return str(venv_python())
        if step == "apt-install-venv":
            os.environ.setdefault("DEBIAN_FRONTEND", "noninteractive")
            run(["apt-get", "update", "-qq"], "updating apt's package lists")
            run(["apt-get", "install", "-y", "-qq", VENV_PACKAGE],
                "installing %s with apt-get (this Python's venv has no pip)" % VENV_PACKAGE)
        elif step == "make-venv":
            make_venv()
        elif step == "install-requirements":
            run([venv_python(), "-m", "pip", "install", "-q", "-r", REQUIREMENTS],
                "installing requirements-dev.txt into .venv")
            STAMP.write_text(requirements_digest() + "\n")
    raise AssertionError("plan without an interpreter: %r" % steps)


def main(args):
    try:
        python = prepare()
    except SetupError as error:
        print("tests/run.py: %s" % error, file=sys.stderr)
        return 2
    os.chdir(ROOT)
    argv = [python, "-m", "pytest", *pytest_arguments(args, os.cpu_count() or 1)]
    sys.stdout.flush()
    os.execv(python, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
