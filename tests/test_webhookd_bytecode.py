"""Black-box tests of webhookd.py started as a script beside its bytecode cache (`python3 -m
py_compile webhookd.py`, as the install docs and the .deb do): the daemon then runs as the cached
module, in less memory, with systemd's sockets, sd_notify and signals as before; a cache another
user could have planted is not run; the commands that do not serve never read the cache.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import support
from support import (WEBHOOKD, Daemon, free_port, plant_bytecode_cache, python_cmd,
                     untrusted_cache_cases)

needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                                reason="needs /proc (Linux) to read the RSS")


def copy_of_webhookd(folder, compiled):
    """webhookd.py copied into `folder` (made 0755), byte-compiled there if `compiled`."""
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    script = folder / "webhookd.py"
    script.write_bytes(WEBHOOKD.read_bytes())
    if compiled:
        subprocess.run([sys.executable, "-m", "py_compile", str(script)], check=True)
    return script


def rss_kib(pid):
    with open("/proc/%d/status" % pid) as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def echo_hooks(path, hook_id):
    path.write_text(json.dumps([{"id": hook_id, "execute-command": "/bin/echo",
                                 "include-command-output-in-response": True,
                                 "pass-arguments-to-command": [{"source": "string",
                                                                "name": hook_id}]}]))
    os.chmod(path, 0o644)
    return path


def socket_activated(script, hooks, notify_address, workdir):
    """Start `script` as systemd would: its listening socket on fd 3, LISTEN_PID its own pid,
    NOTIFY_SOCKET set.  (process, port)"""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    wrapper = ("import os, sys; os.dup2(%d, 3); os.environ['LISTEN_PID'] = str(os.getpid()); "
               "os.environ['LISTEN_FDS'] = '1'; os.execv(sys.executable, [sys.executable] + "
               "sys.argv[1:])" % listener.fileno())
    env = dict(os.environ, NOTIFY_SOCKET=notify_address)
    with listener:
        proc = subprocess.Popen([sys.executable, "-c", wrapper, str(script), "-hooks", str(hooks),
                                 "-port", "1"], pass_fds=[listener.fileno()], env=env, cwd=workdir,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return proc, listener.getsockname()[1]


@needs_proc
def test_socket_activated_daemon_runs_from_the_cache_in_less_memory(tmp_path):
    """From its cache the daemon answers on systemd's socket, tells NOTIFY_SOCKET it is ready,
    reloads on SIGHUP and stops on SIGTERM as before, in far less memory (the file is not
    compiled at start); the working directory (with a `json.py` that would fail) is not on its
    import path."""
    hooks = echo_hooks(tmp_path / "hooks.json", "activated")
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "json.py").write_text("raise SystemExit('json.py from the working directory')\n")
    rss = {}
    for compiled in (False, True):
        script = copy_of_webhookd(tmp_path / ("cached" if compiled else "plain"), compiled)
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(tmp_path / ("notify-%d.sock" % compiled)))
        notify.settimeout(15)
        proc, port = socket_activated(script, hooks, notify.getsockname(), workdir)
        try:
            with notify:
                assert notify.recv(4096).startswith(b"READY=1")
                assert support.request(port, "GET", "/hooks/activated")[::2] == (200,
                                                                                 b"activated\n")
                rss[compiled] = rss_kib(proc.pid)
                proc.send_signal(signal.SIGHUP)
                assert notify.recv(4096).startswith(b"RELOADING=1\nMONOTONIC_USEC=")
                assert notify.recv(4096) == b"READY=1"
                proc.send_signal(signal.SIGTERM)
                assert notify.recv(4096) == b"STOPPING=1"
                assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=20)
    assert rss[True] < rss[False] - 5 * 1024, rss


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="needs root to drop privileges: run the suite as root to cover it")
def test_setuid_and_hotreload_work_from_the_cache(tmp_path):
    """Run from its cache as root, the daemon still drops to -setuid/-setgid after binding and
    still sees a changed hooks file with -hotreload (read as the user it now is)."""
    script = copy_of_webhookd(tmp_path / "app", compiled=True)
    shared = tempfile.mkdtemp(prefix="webhookd-bytecode-")  # a folder nobody can read
    os.chmod(shared, 0o755)
    try:
        hooks = echo_hooks(Path(shared) / "hooks.json", "first")
        port = free_port()
        argv = python_cmd(script, "-hooks", hooks, "-ip", "127.0.0.1", "-port", str(port),
                          "-hotreload", "-setuid", "65534", "-setgid", "65534")
        with Daemon(argv, port) as daemon:
            assert daemon.request("GET", "/hooks/first")[::2] == (200, b"first\n")
            with open("/proc/%d/status" % daemon.proc.pid) as status:
                assert any(line.split()[:3] == ["Uid:", "65534", "65534"] for line in status)
            echo_hooks(hooks, "second")
            deadline = time.monotonic() + 10
            while daemon.request("GET", "/hooks/second")[0] != 200:
                assert time.monotonic() < deadline, daemon.log()
                time.sleep(0.1)
    finally:
        for name in os.listdir(shared):
            os.unlink(os.path.join(shared, name))
        os.rmdir(shared)


def plant_in_copy(tmp_path, folder_mode=0o755, cache_mode=0o755, owner=None):
    script = copy_of_webhookd(tmp_path / "app", compiled=False)
    plant_bytecode_cache(script, folder_mode, cache_mode, owner)
    return script


def test_a_cache_in_a_trusted_folder_is_what_the_daemon_runs_and_only_the_daemon(tmp_path):
    """The control for the test below: a cache only this user or root could have written is run
    instead of the file when serving (so the planted cache there would have run), and not for
    -version, -validate or a bad flag, which never start the daemon."""
    script = plant_in_copy(tmp_path)
    hooks = echo_hooks(tmp_path / "hooks.json", "x")

    def run(*flags):
        proc = subprocess.run(python_cmd(script, *flags), capture_output=True, text=True,
                              timeout=20, stdin=subprocess.DEVNULL)
        return proc.returncode, proc.stdout + proc.stderr

    assert run("-hooks", hooks, "-ip", "127.0.0.1", "-port", str(free_port())) == (7, "PLANTED\n")
    for flags in (["-version"], ["-validate", "-hooks", str(hooks)], ["-no-such-flag"]):
        status, out = run(*flags)
        assert "PLANTED" not in out and status in (0, 2), (flags, out)


@pytest.mark.parametrize("folder_mode, cache_mode, owner", untrusted_cache_cases())
def test_the_daemon_ignores_a_cache_others_could_have_planted(tmp_path, folder_mode, cache_mode,
                                                             owner):
    """A script run as __main__ never read a .pyc; the daemon now does, so a cache in a folder
    another user can write (or own) would run as the daemon's user, often root: it runs the
    file."""
    script = plant_in_copy(tmp_path, folder_mode, cache_mode, owner)
    hooks = echo_hooks(tmp_path / "hooks.json", "x")
    port = free_port()
    argv = python_cmd(script, "-hooks", hooks, "-ip", "127.0.0.1", "-port", str(port))
    with Daemon(argv, port) as daemon:
        assert daemon.request("GET", "/hooks/x")[::2] == (200, b"x\n"), daemon.log()
        assert "PLANTED" not in daemon.log()


def test_the_daemon_from_its_cache_reads_a_piped_status_token_once(tmp_path):
    """`-status-token-file /dev/stdin` (or a shell's `<(...)`) can be read once only: the restart
    from the bytecode cache must come before the flags' files are read, or the cached module
    finds the pipe drained and refuses to start."""
    script = copy_of_webhookd(tmp_path / "app", compiled=True)
    hooks = echo_hooks(tmp_path / "hooks.json", "x")
    port, token = free_port(), "piped-status-token-0123456789"
    argv = python_cmd(script, "-hooks", hooks, "-ip", "127.0.0.1", "-port", str(port),
                      "-status-path", "/status", "-status-token-file", "/dev/stdin")
    assert support.status_with_piped_token(argv, port, "/status", token) == 200


def test_the_daemon_starts_beside_a_cache_cut_short(tmp_path):
    """A trusted cache whose header is whole but whose code was cut short (a copy or a disk that
    failed half-way) makes the import fail: the daemon compiles the file instead, as the script
    always could, rather than stopping with a traceback."""
    import importlib.util
    script = copy_of_webhookd(tmp_path / "app", compiled=True)
    cache = importlib.util.cache_from_source(str(script))
    with open(cache, "r+b") as handle:
        handle.truncate(os.path.getsize(cache) // 2)
    hooks = echo_hooks(tmp_path / "hooks.json", "x")
    port = free_port()
    argv = python_cmd(script, "-hooks", hooks, "-ip", "127.0.0.1", "-port", str(port))
    with Daemon(argv, port, timeout=20.0) as daemon:
        assert daemon.request("GET", "/hooks/x")[::2] == (200, b"x\n"), daemon.log()
