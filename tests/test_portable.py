"""The portability check: the tools run by the tests lack what macOS and FreeBSD lack.

The suite runs with tests/portable/sitecustomize.py loaded into every process the tests start
(unless ``TESTS_PORTABLE=0``).
"""
import json
import os
import subprocess
import sys

import pytest

import support
from support import Daemon, free_port

# Prints what a Linux-only program would miss; with a port, answers it over HTTP instead.
PROBE = r"""
import importlib.util, json, os, select, signal, sys
def report():
    try:
        import ctypes
        has_ctypes = True
    except ImportError:
        has_ctypes = False
    return {"epoll": hasattr(select, "epoll"), "pipe2": hasattr(os, "pipe2"),
            "pidfd_open": hasattr(os, "pidfd_open"),
            "pidfd_send_signal": hasattr(signal, "pidfd_send_signal"), "ctypes": has_ctypes}
if len(sys.argv) < 2:
    print(json.dumps(report()))
else:
    import http.server
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(report()).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""
NOTHING_LINUX_ONLY = {"epoll": False, "pipe2": False, "pidfd_open": False,
                      "pidfd_send_signal": False, "ctypes": False}


def test_the_portable_python_lacks_linux_only_names_and_ctypes():
    env = dict(os.environ, PYTHONPATH=support.with_portable_path(os.environ.get("PYTHONPATH")))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == NOTHING_LINUX_ONLY


def test_the_portable_python_still_runs_the_sitecustomize_it_hides(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['HIDDEN_SITECUSTOMIZE'] = 'ran'\n")
    env = dict(os.environ, PYTHONPATH=support.with_portable_path(str(tmp_path)))
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('HIDDEN_SITECUSTOMIZE'))"],
                         env=env, capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "ran", out.stderr


@pytest.mark.skipif(os.environ.get("TESTS_PORTABLE", "1") != "1", reason="TESTS_PORTABLE=0 turned the portability check off: unset it to run this")
def test_daemons_started_by_the_tests_run_without_linux_only_names(tmp_path):
    port = free_port()
    (tmp_path / "probe.py").write_text(PROBE)
    with Daemon([sys.executable, str(tmp_path / "probe.py"), str(port)], port) as daemon:
        status, _, body = daemon.request("GET", "/")
    assert status == 200 and json.loads(body) == NOTHING_LINUX_ONLY
