"""Shared test plumbing: free loopback ports, daemons under test, raw HTTP.

Every test talks to a real process over 127.0.0.1; nothing here mocks the
network. Import it from a test module with ``import support``.
"""
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WEBHOOKD = ROOT / "webhookd.py"
SEARCHKEYS = ROOT / "searchkeys.py"
WEBHOOK_BIN = shutil.which("webhook")  # Debian's adnanh/webhook, if installed
# A sitecustomize.py that removes Linux-only names (select.epoll, os.pipe2, ...) and ctypes.
PORTABLE = Path(__file__).resolve().parent / "portable"


def free_port():
    """A TCP port that no socket uses on any address right now, and that no other pytest-xdist
    worker can be handed meanwhile (between this call and the daemon's bind, another worker's
    probe could get the same port, and its daemon would answer this test's requests): each
    worker takes only its own share of the ports, by remainder."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    for _ in range(10000):
        port = unused_port()
        # Linux hands bind() odd ports (even ones are kept for connect()): halve it first
        if (port >> 1) % count == worker % count:
            return port
    return port


def unused_port():
    """A port the kernel thinks free: a daemon binding it on 0.0.0.0 or dual-stack [::] must
    not meet a client socket another test bound on 127.0.0.2 or ::1 (still open, or in
    TIME_WAIT).  The probe binds the wildcard address of both families where it can, so the
    kernel picks a port free in both; it never listens."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind(("::", 0))
            return s.getsockname()[1]
    except OSError:  # no IPv6 here
        with socket.socket() as s:
            s.bind(("0.0.0.0", 0))
            return s.getsockname()[1]


def ipv6_loopback():
    """Can a socket listen on ::1 here?"""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def wait_for_port(port, proc=None, timeout=10.0):
    """Block until something accepts on 127.0.0.1:port (or the process dies)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


def request(port, method, path, body=None, headers=None, timeout=10.0):
    """One HTTP request on a fresh connection: (status, headers dict, body bytes).

    Header names in the returned dict are lower-cased.
    """
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        if isinstance(body, str):
            body = body.encode()
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


class Daemon:
    """A server process under test, its output captured to a log file.

    ``argv`` is the full command line; ``port`` is where it will listen.
    Use as a context manager, or call ``stop()``.
    """

    def __init__(self, argv, port, env=None, cwd=None, wait=True, timeout=10.0):
        self.argv = [str(a) for a in argv]
        self.port = port
        self._logfile = tempfile.NamedTemporaryFile(prefix="daemon-", suffix=".log", delete=False)
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            self.argv, stdout=self._logfile, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=full_env, cwd=cwd, start_new_session=True,
        )
        if wait:
            try:
                wait_for_port(port, self.proc, timeout)
            except Exception:
                self.stop()
                raise RuntimeError(f"{self.argv} did not start:\n{self.log()}")

    def request(self, method, path, body=None, headers=None, timeout=10.0):
        return request(self.port, method, path, body, headers, timeout)

    def log(self):
        """Everything the process printed so far (stdout and stderr)."""
        self._logfile.flush()
        return Path(self._logfile.name).read_text(errors="replace")

    def signal(self, sig):
        self.proc.send_signal(sig)

    def stop(self, sig=None, timeout=10.0):
        """Stop the process (SIGTERM unless told), then anything left in its session."""
        # Inside a method body `signal` is the module again (the class-level name is the method).
        sig = signal.SIGTERM if sig is None else sig
        commands = descendants(self.proc.pid)  # each in a session of its own
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # Commands the daemon started (in its session, or each in one of their own, as hooks
        # run) must not outlive the test: a test's command waiting for a gate file would.
        for group in [self.proc.pid] + commands:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        try:
            os.unlink(self._logfile.name)
        except OSError:
            pass


def status_with_piped_token(argv, port, path, token, env=None):
    """Start a server whose token file is /dev/stdin, pipe it the token, and return the status
    of `GET path` with that token as the bearer (fails the test if it never listens)."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        proc.stdin.write(token.encode() + b"\n")
        proc.stdin.close()
        try:
            wait_for_port(port, proc, timeout=20.0)
        except RuntimeError:
            raise AssertionError("not started: %s" % proc.stdout.read().decode(errors="replace"))
        return request(port, "GET", path, headers={"Authorization": "Bearer " + token})[0]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def descendants(pid):
    """The pids of a process's children, theirs, and so on (from `ps`, which every POSIX
    system has)."""
    try:
        table = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True,
                               text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return []
    children = {}
    for child, parent in zip(table[::2], table[1::2]):
        children.setdefault(int(parent), []).append(int(child))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def with_portable_path(pythonpath):
    """PYTHONPATH with tests/portable first: a Python started with it lacks Linux-only names."""
    return os.pathsep.join([str(PORTABLE)] + ([pythonpath] if pythonpath else []))


def python_cmd(script, *args):
    """argv that runs one of our tools with the interpreter running the tests."""
    return [sys.executable, str(script), *args]


@contextmanager
def scratch_dir(prefix):
    """A temporary folder removed afterwards even if a test left unreadable files in it.

    (TemporaryDirectory(ignore_cleanup_errors=True) would do, but only from Python 3.10.)
    """
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def hook_arg(source, name=None, **extra):
    """An argument object of a hook definition: {"source": ..., "name": ..., **extra}."""
    obj = {"source": source}
    if name is not None:
        obj["name"] = name
    obj.update(extra)
    return obj


def serve_in_thread(handler):
    """A stand-in HTTP server: a ThreadingHTTPServer on a free 127.0.0.1 port answering with
    the BaseHTTPRequestHandler subclass `handler`, serving from a daemon thread. Its `url`
    attribute is its base URL; stop it with `shutdown()` then `server_close()`."""
    import http.server
    import threading
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.url = "http://127.0.0.1:%d" % server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def answer_json(handler, payload, status=200):
    """Answer from a stand-in server's request handler: `payload` (bytes) as JSON, framed with
    Content-Length."""
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    handler.wfile.write(payload)


def stop_session(proc, sig, timeout=10.0):
    """Send `sig` to a process started with start_new_session=True, wait for it, and kill its
    whole session if it outlives `timeout`."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def plant_bytecode_cache(script, folder_mode, cache_mode, owner=None):
    """Put beside `script` a bytecode cache whose code prints PLANTED and exits 7 (an unchecked-hash
    .pyc, so the import takes it whatever the source), its folders given these modes and owner."""
    import importlib.util
    import py_compile
    decoy = script.parent.parent / "decoy.py"
    decoy.write_text("import sys\nprint('PLANTED')\nsys.exit(7)\n")
    cache = importlib.util.cache_from_source(str(script))
    py_compile.compile(str(decoy), cfile=cache, doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    os.chmod(os.path.dirname(cache), cache_mode)
    os.chmod(script.parent, folder_mode)
    if owner is not None:
        os.chown(os.path.dirname(cache), owner, -1)
    return cache


def untrusted_cache_cases():
    """pytest params (folder mode, __pycache__ mode, its owner) of caches another user could
    have written: a test that such a cache is not run."""
    import pytest
    cases = [("group-writable __pycache__", 0o755, 0o775, None),
             ("world-writable sticky folder, like /tmp", 0o1777, 0o755, None),
             ("group-writable folder", 0o775, 0o755, None)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cases.append(("__pycache__ of another user", 0o755, 0o755, 65534))
    return [pytest.param(*case[1:], id=case[0]) for case in cases]

