#!/usr/bin/env python3
"""Run the test suite with whatever Python runs this script: ``python3 tests/run.py -q``.

Arguments are passed on to pytest (paths are relative to the clone's top folder).

The tools need nothing beyond the standard library, but the tests need pytest and the
official ``meilisearch`` client. If this interpreter can import both they are used as they
are. Otherwise (a distribution's own python3, where PEP 668 forbids ``pip install`` and
pip or python3-venv may not even be installed) the test packages go into a virtual
environment in the clone, ``.venv`` (git ignores it), made once and reused:

- ``python3 -m venv .venv`` when ensurepip is available, else ``--without-pip``;
- without pip, the newest pip wheel this Python can run is fetched from PyPI, its sha256
  checked against the digest PyPI's JSON API publishes, and run straight from the wheel
  (``python pip-X-py3-none-any.whl/pip install ...``) to install itself and
  requirements-dev.txt into the venv.

This file uses only the standard library and works on Python 3.9+.
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
REQUIREMENTS = ROOT / "requirements-dev.txt"
TEST_MODULES = ("pytest", "meilisearch")
PYPI_PIP_JSON = "https://pypi.org/pypi/pip/json"
# Written into the venv once requirements-dev.txt is installed: its sha256, so an edited
# requirements file is installed again on the next run.
STAMP = VENV / "requirements-dev.sha256"


class SetupError(Exception):
    """Why the test environment could not be prepared (one sentence for the user)."""


# ---------------------------------------------------------------- decisions (pure)

def plan(has_test_modules, venv_ready, venv_exists, has_ensurepip):
    """The steps that lead to an interpreter able to run the suite, in order.

    Steps: "use-current", "use-venv", "make-venv", "make-venv-without-pip",
    "install-with-venv-pip", "install-with-downloaded-pip".
    """
    if has_test_modules:
        return ["use-current"]
    if venv_ready:
        return ["use-venv"]
    steps = []
    if not venv_exists:
        steps.append("make-venv" if has_ensurepip else "make-venv-without-pip")
        venv_has_pip = has_ensurepip
    else:
        venv_has_pip = None  # decided later by looking inside it
    if venv_has_pip is False:
        steps.append("install-with-downloaded-pip")
    else:
        steps.append("install-with-venv-pip")
    steps.append("use-venv")
    return steps


def version_tuple(text):
    """'3.11.2' -> (3, 11, 2); trailing non-numeric parts are dropped ('3.12.0rc1' -> (3, 12, 0))."""
    parts = []
    for piece in text.strip().split("."):
        digits = re.match(r"\d+", piece)
        if not digits:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def python_ok(requires_python, version):
    """Whether a PEP 440 Requires-Python specifier admits ``version`` (a tuple like (3, 9, 2)).

    Enough of PEP 440 for what pip itself has ever declared: comma-separated
    >=, >, <=, <, ==, != clauses, with or without a trailing ``.*``.
    """
    for clause in (requires_python or "").split(","):
        clause = clause.strip()
        if not clause:
            continue
        match = re.match(r"(>=|<=|==|!=|>|<|~=)\s*([0-9][0-9.]*)(\.\*)?$", clause)
        if not match:
            return False  # a form we cannot judge: do not pick this file
        op, wanted, wildcard = match.group(1), version_tuple(match.group(2)), match.group(3)
        if wildcard:
            same = version[:len(wanted)] == wanted
            if (op == "==" and not same) or (op == "!=" and same):
                return False
            continue
        have = version[:len(wanted)] if op in ("==", "!=") else version
        prefix = len(wanted) - 1  # ~=3.9 means >=3.9 and ==3.*
        width = max(len(have), len(wanted))
        have, wanted = have + (0,) * (width - len(have)), wanted + (0,) * (width - len(wanted))
        ok = {">=": have >= wanted, ">": have > wanted, "<=": have <= wanted, "<": have < wanted,
              "==": have == wanted, "!=": have != wanted,
              "~=": have >= wanted and have[:prefix] == wanted[:prefix]}[op]
        if not ok:
            return False
    return True


def pick_pip_wheel(pypi_json, version):
    """The newest released, non-yanked pure-Python pip wheel that admits ``version``.

    ``pypi_json`` is PyPI's JSON API answer for pip. Returns (filename, url, sha256).
    """
    releases = pypi_json.get("releases", {})
    for release in sorted(releases, key=version_tuple, reverse=True):
        if not re.fullmatch(r"[0-9.]+", release):
            continue  # pre-releases
        for item in releases[release]:
            if (item.get("packagetype") == "bdist_wheel" and item["filename"].endswith("-py3-none-any.whl")
                    and not item.get("yanked") and python_ok(item.get("requires_python"), version)):
                url = urllib.parse.urljoin(PYPI_PIP_JSON, item["url"])  # mirrors may answer relative URLs
                return item["filename"], url, item["digests"]["sha256"]
    raise SetupError("PyPI lists no pip wheel for Python %s" % ".".join(map(str, version)))


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


def run(argv, what):
    print("tests/run.py: " + what, file=sys.stderr, flush=True)
    if subprocess.run([str(a) for a in argv]).returncode != 0:
        raise SetupError("%s failed: %s" % (what, " ".join(map(str, argv))))


def make_venv(with_pip):
    try:
        import venv  # noqa: F401  (some distributions split it off)
    except ImportError:
        raise SetupError("this Python has no venv module: install your distribution's python3-venv "
                         "package, or pytest and meilisearch for this Python")
    argv = [sys.executable, "-m", "venv", VENV] + ([] if with_pip else ["--without-pip"])
    run(argv, "making a virtual environment for the test packages in %s" % VENV)


def download(url, what):
    try:
        with urllib.request.urlopen(url, timeout=60) as answer:
            return answer.read()
    except OSError as error:
        raise SetupError("could not download %s from %s: %s" % (what, url, error))


def fetch_pip_wheel(folder):
    """Download pip's wheel into ``folder``, checked against PyPI's digest; its path."""
    try:
        listing = json.loads(download(PYPI_PIP_JSON, "pip's release list"))
    except ValueError:
        raise SetupError("PyPI's answer for pip is not JSON")
    filename, url, sha256 = pick_pip_wheel(listing, sys.version_info[:3])
    data = download(url, filename)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise SetupError("%s does not match the sha256 PyPI publishes for it: not installed" % filename)
    path = Path(folder) / filename
    path.write_bytes(data)
    return path


def install_requirements(pip_argv):
    run(pip_argv + ["install", "-q", "-r", REQUIREMENTS], "installing requirements-dev.txt into .venv")
    STAMP.write_text(requirements_digest() + "\n")


def venv_has_pip():
    return subprocess.run([str(venv_python()), "-c", "import pip"], capture_output=True).returncode == 0


def prepare():
    """Carry out the plan; the interpreter to run pytest with."""
    steps = plan(has_test_modules=all(importable(name) for name in TEST_MODULES),
                 venv_ready=venv_is_ready(), venv_exists=venv_python().exists(),
                 has_ensurepip=importable("ensurepip"))
    for step in steps:
        if step == "use-current":
            return sys.executable
        if step == "use-venv":
            return str(venv_python())
        if step in ("make-venv", "make-venv-without-pip"):
            make_venv(with_pip=step == "make-venv")
        elif step == "install-with-venv-pip" and venv_has_pip():
            install_requirements([venv_python(), "-m", "pip"])
        else:
            folder = tempfile.mkdtemp(prefix="pip-bootstrap-")
            try:
                wheel = fetch_pip_wheel(folder)
                # pip runs from inside its own wheel and installs itself too, for next time.
                run([venv_python(), wheel / "pip", "install", "-q", wheel], "installing %s into .venv" % wheel.name)
                install_requirements([venv_python(), "-m", "pip"])
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    raise AssertionError("plan without an interpreter: %r" % steps)


def main(args):
    try:
        python = prepare()
    except SetupError as error:
        print("tests/run.py: %s" % error, file=sys.stderr)
        return 2
    os.chdir(ROOT)
    argv = [python, "-m", "pytest", *args]
    sys.stdout.flush()
    os.execv(python, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
