"""tests/run.py: how it decides to get pytest, and that it installs only the pip PyPI vouches for."""
import hashlib
import http.server
import json
import threading

import pytest

import run as runner


@pytest.mark.parametrize("situation, steps", [
    # pytest and meilisearch import: nothing to install (CI, a developer's venv).
    (dict(has_test_modules=True, venv_ready=False, venv_exists=False, has_ensurepip=False), ["use-current"]),
    # A venv made by an earlier run, requirements unchanged.
    (dict(has_test_modules=False, venv_ready=True, venv_exists=True, has_ensurepip=False), ["use-venv"]),
    # Debian's python3 with python3-venv: the venv gets pip from ensurepip.
    (dict(has_test_modules=False, venv_ready=False, venv_exists=False, has_ensurepip=True),
     ["make-venv", "install-with-venv-pip", "use-venv"]),
    # Debian's python3 without python3-venv (no ensurepip): pip comes from PyPI's wheel.
    (dict(has_test_modules=False, venv_ready=False, venv_exists=False, has_ensurepip=False),
     ["make-venv-without-pip", "install-with-downloaded-pip", "use-venv"]),
    # A venv left by an interrupted run, or an edited requirements-dev.txt: install again.
    (dict(has_test_modules=False, venv_ready=False, venv_exists=True, has_ensurepip=False),
     ["install-with-venv-pip", "use-venv"]),
])
def test_plan(situation, steps):
    assert runner.plan(**situation) == steps


@pytest.mark.parametrize("spec, version, ok", [
    (">=3.9", (3, 9, 0), True),
    (">=3.9", (3, 8, 18), False),
    (">=3.10", (3, 9, 2), False),
    (">=3.10", (3, 11, 2), True),
    (">=2.7,!=3.0.*,!=3.1.*,!=3.2.*,!=3.3.*,!=3.4.*", (3, 4, 1), False),
    (">=2.7,!=3.0.*,!=3.1.*,!=3.2.*,!=3.3.*,!=3.4.*", (3, 11, 2), True),
    ("<3.12", (3, 12, 0), False),
    ("", (3, 9, 0), True),
    (None, (3, 9, 0), True),
    ("~=3.9", (3, 13, 1), True),
    (">=3.9; sys_platform", (3, 9, 0), False),  # a form we do not understand: not chosen
])
def test_python_ok(spec, version, ok):
    assert runner.python_ok(spec, version) is ok


def release(version, requires, yanked=False, kind="bdist_wheel"):
    name = f"pip-{version}-py3-none-any.whl" if kind == "bdist_wheel" else f"pip-{version}.tar.gz"
    return [{"filename": name, "packagetype": kind, "requires_python": requires, "yanked": yanked,
             "url": f"https://files.example/{name}", "digests": {"sha256": "00" * 32}}]


def test_pick_pip_wheel_takes_the_newest_that_this_python_can_run():
    listing = {"releases": {
        "9.0.1": release("9.0.1", ">=2.6"),
        "24.0": release("24.0", ">=3.7"),
        "26.3": release("26.3", ">=3.10"),
        "27.0b1": release("27.0b1", ">=3.9"),
        "25.3": release("25.3", ">=3.9", yanked=True) + release("25.3", ">=3.9", kind="sdist"),
    }}
    assert runner.pick_pip_wheel(listing, (3, 9, 2))[0] == "pip-24.0-py3-none-any.whl"
    assert runner.pick_pip_wheel(listing, (3, 11, 2))[0] == "pip-26.3-py3-none-any.whl"
    with pytest.raises(runner.SetupError):
        runner.pick_pip_wheel(listing, (2, 5, 0))


@pytest.fixture
def fake_pypi():
    """A loopback stand-in for PyPI's JSON API; returns (set the files it serves, base URL)."""
    files = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield files, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def serve_pip(files, wheel, digest):
    files["/pypi/pip/json"] = json.dumps({"releases": {"26.3": [{
        "filename": "pip-26.3-py3-none-any.whl", "packagetype": "bdist_wheel", "requires_python": ">=3.9",
        "yanked": False, "url": "../../files/pip-26.3-py3-none-any.whl",  # relative, as mirrors answer
        "digests": {"sha256": digest}}]}}).encode()
    files["/files/pip-26.3-py3-none-any.whl"] = wheel


def test_a_wheel_matching_pypis_digest_is_kept(fake_pypi, monkeypatch, tmp_path):
    files, base = fake_pypi
    wheel = b"PK\x05\x06" + b"\0" * 18  # an empty zip: contents do not matter here
    serve_pip(files, wheel, hashlib.sha256(wheel).hexdigest())
    monkeypatch.setattr(runner, "PYPI_PIP_JSON", base + "/pypi/pip/json")
    path = runner.fetch_pip_wheel(tmp_path)
    assert path.name == "pip-26.3-py3-none-any.whl" and path.read_bytes() == wheel


def test_a_wheel_not_matching_pypis_digest_is_refused(fake_pypi, monkeypatch, tmp_path):
    files, base = fake_pypi
    serve_pip(files, b"tampered", hashlib.sha256(b"the real wheel").hexdigest())
    monkeypatch.setattr(runner, "PYPI_PIP_JSON", base + "/pypi/pip/json")
    with pytest.raises(runner.SetupError, match="does not match the sha256"):
        runner.fetch_pip_wheel(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_an_unreachable_index_is_one_sentence(monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "PYPI_PIP_JSON", "http://127.0.0.1:9/pypi/pip/json")
    with pytest.raises(runner.SetupError, match="could not download pip's release list"):
        runner.fetch_pip_wheel(tmp_path)
