"""Black-box tests of webhookd.py's features beyond upstream (issue 4).

Each test starts the real daemon on a free 127.0.0.1 port (or a Unix socket), talks HTTP to it
and sends it real signals; nothing is mocked.  Timing is never assumed to be fast: tests poll
for conditions with generous deadlines.
"""
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

import support
from support import WEBHOOKD, Daemon, free_port, python_cmd

ROOT = WEBHOOKD.parent


def write_hooks(path, hooks):
    path.write_text(json.dumps(hooks))
    return path


def script(path, body):
    """An executable /bin/sh script (the hooks under test run it as argv, never via a shell)."""
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def start(hooks_file, *flags, env=None, cwd=None, verbose=True):
    port = free_port()
    argv = python_cmd(WEBHOOKD, "-hooks", hooks_file, "-ip", "127.0.0.1", "-port", str(port),
                      *(("-verbose",) if verbose else ()), *flags)
    return Daemon(argv, port, env=env, cwd=cwd)


def wait_until(condition, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


def status_of(daemon, path):
    return daemon.request("GET", path)[0]


def gated_command(tmp_path, name, before, after):
    """A script that prints `before`, waits until the test creates the returned gate file,
    then prints `after`: the test decides when the command may finish."""
    gate = tmp_path / (name + ".gate")
    run = script(tmp_path / (name + ".sh"), 'echo %s\nwhile [ ! -e %s ]; do sleep 0.05; done\n'
                 'echo %s\n' % (before, gate, after))
    return run, gate


def exchange(sock, raw):
    """Send raw bytes, return everything received until the server closes the connection."""
    sock.sendall(raw)
    data = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk


def echo_hook(hook_id, **extra):
    hook = {"id": hook_id, "execute-command": "/bin/echo", "include-command-output-in-response":
            True, "pass-arguments-to-command": [{"source": "string", "name": hook_id}]}
    hook.update(extra)
    return hook


# ---------------------------------------------------------------------------------------------
# The user's deployment line and the shipped files
# ---------------------------------------------------------------------------------------------

def test_deployment_line_passes_url_argument_as_argv1(tmp_path):
    workdir = tmp_path / "site"
    workdir.mkdir()
    deploy = script(workdir / "deploy.sh", 'printf "%s|%s" "$1" "$(pwd)" > ../ran.txt\n')
    conf = write_hooks(tmp_path / "webhook.conf", [{
        "id": "redeploy", "execute-command": deploy, "command-working-directory": str(workdir),
        "pass-arguments-to-command": [{"source": "url", "name": "branch"}]}])
    port = free_port()
    argv = python_cmd(WEBHOOKD, "-nopanic", "-hooks", conf, "-hotreload", "-verbose", "-port",
                      str(port))
    with Daemon(argv, port) as daemon:
        assert daemon.request("GET", "/hooks/redeploy?branch=main")[:1] == (200,)
        ran = wait_until(lambda: (tmp_path / "ran.txt").exists()
                         and (tmp_path / "ran.txt").read_text(), what="deploy script")
        assert ran == "main|" + str(workdir)


# ---------------------------------------------------------------------------------------------
# Hot reload, signals, typos, -validate
# ---------------------------------------------------------------------------------------------

def test_hot_reload_sees_in_place_rename_and_delete_recreate(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("a")])
    with start(hooks, "-hotreload") as daemon:
        assert status_of(daemon, "/hooks/a") == 200
        hooks.write_text(json.dumps([echo_hook("a"), echo_hook("inplace")]))  # in place
        wait_until(lambda: status_of(daemon, "/hooks/inplace") == 200, what="in-place write")

        fresh = tmp_path / ".hooks.json.tmp"  # an editor's or deploy tool's rename dance
        fresh.write_text(json.dumps([echo_hook("renamed")]))
        os.replace(fresh, hooks)
        wait_until(lambda: status_of(daemon, "/hooks/renamed") == 200, what="rename-replace")
        assert status_of(daemon, "/hooks/a") == 404

        hooks.unlink()  # git's unlink + create
        hooks.write_text(json.dumps([echo_hook("recreated")]))
        wait_until(lambda: status_of(daemon, "/hooks/recreated") == 200, what="recreate")

        # a later in-place edit after all that is still seen (upstream loses the file)
        hooks.write_text(json.dumps([echo_hook("later")]))
        wait_until(lambda: status_of(daemon, "/hooks/later") == 200, what="later edit")


def test_hot_reload_sees_a_same_size_rewrite_within_one_mtime_tick(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("a")])
    tick = time.time_ns() + 5 * 10 ** 9  # both writes below get this one timestamp

    def rewrite(hook_id):
        with open(hooks, "r+") as handle:  # in place: same inode
            handle.truncate()
            handle.write(json.dumps([echo_hook(hook_id)]))
        os.utime(hooks, ns=(tick, tick))

    with start(hooks, "-hotreload") as daemon:
        rewrite("aaaa")
        wait_until(lambda: status_of(daemon, "/hooks/aaaa") == 200, what="first rewrite")
        time.sleep(1.0)  # several polls: the daemon has seen the final size and mtime
        size = os.stat(hooks).st_size
        rewrite("bbbb")  # same size, same mtime, same inode: only the content differs
        assert os.stat(hooks).st_size == size
        wait_until(lambda: status_of(daemon, "/hooks/bbbb") == 200, what="content change seen")


def test_broken_reload_keeps_old_hooks_and_logs_position(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("keep")])
    with start(hooks, "-hotreload", "-status-path", "/status") as daemon:
        hooks.write_text('[\n  {"id": "x",\n   "execute-command" "/bin/true"}\n]')
        wait_until(lambda: "%s:3:" % hooks in daemon.log(), what="file:line:col in the log")
        assert daemon.request("GET", "/hooks/keep")[2] == b"keep\n"
        status = json.loads(daemon.request("GET", "/status")[2])
        assert status["status"] == "degraded" and status["last_reload_failed"]
        assert status["load_errors"] and "hooks.json:3:" in status["load_errors"][0]


def test_file_broken_at_start_is_still_watched(tmp_path):
    hooks = tmp_path / "hooks.json"
    hooks.write_text("[{broken")
    with start(hooks, "-hotreload", "-nopanic") as daemon:
        assert status_of(daemon, "/hooks/late") == 404
        write_hooks(hooks, [echo_hook("late")])
        wait_until(lambda: status_of(daemon, "/hooks/late") == 200, what="fixed file loaded")


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGUSR1])
def test_signals_reload_without_hotreload(tmp_path, signum):
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("one")])
    with start(hooks) as daemon:
        write_hooks(hooks, [echo_hook("two")])
        time.sleep(0.5)
        assert status_of(daemon, "/hooks/two") == 404  # no polling without -hotreload
        daemon.signal(signum)
        wait_until(lambda: status_of(daemon, "/hooks/two") == 200, what="reload on signal")
        assert daemon.proc.poll() is None


def test_unknown_fields_are_warned_with_a_suggestion(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [{
        "id": "typo", "execute-comand": "/bin/true",
        "pass-arguments-to-command": [{"source": "url", "nmae": "x"}]}])
    with start(hooks) as daemon:
        log = wait_until(lambda: "execute-comand" in daemon.log() and daemon.log(),
                         what="warning")
        assert "did you mean 'execute-command'" in log
        assert "'nmae'" in log and "did you mean 'name'" in log


def test_validate_lists_every_problem_and_exits_1(tmp_path):
    other = write_hooks(tmp_path / "other.json", [echo_hook("dup")])
    bad = write_hooks(tmp_path / "bad.json", [
        echo_hook("dup"),
        {"id": "regex", "execute-command": "/bin/true",
         "trigger-rule": {"match": {"type": "regex", "regex": "(",
                                    "parameter": {"source": "url", "name": "a"}}}},
        {"id": "ip", "execute-command": "/bin/true",
         "trigger-rule": {"match": {"type": "ip-whitelist", "ip-range": "10.0.0.0/33"}}},
        {"id": "cmd", "execute-command": str(tmp_path / "missing.sh"),
         "command-working-directory": str(tmp_path / "nowhere"), "max-concurency": 1,
         # a rule: an unknown field on a hook without one is refused before these checks
         "trigger-rule": {"match": {"type": "ip-whitelist", "ip-range": "127.0.0.1"}}},
    ])
    result = subprocess.run(python_cmd(WEBHOOKD, "-validate", "-hooks", other, "-hooks", bad),
                            capture_output=True, text=True, timeout=30)
    out = result.stdout
    assert result.returncode == 1, out
    for needle in ("duplicate id", "error parsing regexp", "invalid ip range", "missing.sh",
                   "nowhere", "'max-concurency'"):
        assert needle in out, (needle, out)

    good = write_hooks(tmp_path / "good.json", [echo_hook("fine")])
    result = subprocess.run(python_cmd(WEBHOOKD, "-validate", "-hooks", good),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout
    assert "0 error(s)" in result.stdout

    broken = tmp_path / "broken.json"
    broken.write_text('[{"id": "a" "x"}]')  # a trailing comma would be fine (YAML)
    result = subprocess.run(python_cmd(WEBHOOKD, "-validate", "-hooks", broken),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "broken.json:1:" in result.stdout


# ---------------------------------------------------------------------------------------------
# max-concurrency, command-timeout, stream-command-output
# ---------------------------------------------------------------------------------------------

def test_max_concurrency_runs_one_at_a_time_in_order(tmp_path):
    journal, gate = tmp_path / "journal", tmp_path / "go"
    run = script(tmp_path / "run.sh", 'echo "start $1" >> %s\nwhile [ ! -e %s ]; do sleep 0.05; '
                 'done\nsleep 0.1\necho "end $1" >> %s\n' % (journal, gate, journal))
    hooks = write_hooks(tmp_path / "hooks.json", [{
        "id": "deploy", "execute-command": run, "max-concurrency": 1,
        "pass-arguments-to-command": [{"source": "url", "name": "n"}]}])
    with start(hooks, "-status-path", "/status") as daemon:
        for n in range(4):
            assert daemon.request("POST", "/hooks/deploy?n=%d" % n)[0] == 200
        status = json.loads(daemon.request("GET", "/status")[2])
        assert status["runs"]["deploy"] == {"running": 1, "queued": 3}
        gate.write_text("")  # from now on every run may finish
        lines = wait_until(lambda: journal.exists() and journal.read_text().count("end") == 4
                           and journal.read_text().split("\n")[:-1], what="four runs")
    assert lines == ["start 0", "end 0", "start 1", "end 1", "start 2", "end 2",
                     "start 3", "end 3"]


def test_runs_waiting_for_their_turn_do_not_block_other_hooks(tmp_path):
    held, gate = gated_command(tmp_path, "held", "a", "b")
    marker = tmp_path / "quick.done"
    quick = script(tmp_path / "quick.sh", "touch %s\n" % marker)
    hooks = write_hooks(tmp_path / "hooks.json", [
        {"id": "held", "execute-command": held, "max-concurrency": 1},
        {"id": "quick", "execute-command": quick}])
    with start(hooks, "-max-async-runs", "2") as daemon:
        for _ in range(4):  # one runs (and waits for the gate file), three wait for their turn
            assert daemon.request("GET", "/hooks/held")[0] == 200
        assert daemon.request("GET", "/hooks/quick")[0] == 200
        wait_until(marker.exists, what="the other hook ran")
        gate.write_text("")
        wait_until(lambda: daemon.log().count("finished handling held") == 4,
                   what="all held runs")


def test_command_timeout_answers_504_and_stops_the_process_group(tmp_path):
    child_pid = tmp_path / "child.pid"
    log = tmp_path / "trap.log"
    slow = script(tmp_path / "slow.sh",
                  'trap "echo TERM >> %s" TERM\nsleep 60 &\necho $! > %s\nwhile :; do sleep 0.1;'
                  ' done\n' % (log, child_pid))
    hooks = write_hooks(tmp_path / "hooks.json", [{
        "id": "slow", "execute-command": slow, "include-command-output-in-response": True,
        "command-timeout": 0.5}])
    with start(hooks) as daemon:
        started = time.monotonic()
        status, _, body = daemon.request("GET", "/hooks/slow", timeout=30)
        assert (status, body) == (504, b"Hook command timed out.")
        assert time.monotonic() - started >= 0.5
        assert "TERM" in log.read_text()  # SIGTERM first (ignored by the script) ...
        pid = int(child_pid.read_text())
        wait_until(lambda: not os.path.exists("/proc/%d" % pid)
                   or "Z" in open("/proc/%d/stat" % pid).read().split()[2],
                   what="background child killed")  # ... then SIGKILL to the whole group


def test_stream_command_output_arrives_while_the_command_runs(tmp_path):
    run, gate = gated_command(tmp_path, "stream", "first", "second")
    fail = script(tmp_path / "fail.sh", "echo partial\nexit 3\n")
    hooks = write_hooks(tmp_path / "hooks.json", [
        {"id": "stream", "execute-command": run, "stream-command-output": True},
        {"id": "fail", "execute-command": fail, "stream-command-output": True}])
    with start(hooks) as daemon:
        # a failing command: the answer ends without its closing chunk (curl reports an error)
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
            received = exchange(sock, b"GET /hooks/fail HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"partial" in received and not received.endswith(b"0\r\n\r\n")
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
            sock.sendall(b"GET /hooks/stream HTTP/1.1\r\nHost: x\r\n\r\n")
            received = b""
            while b"first" not in received:
                received += sock.recv(4096)
            assert b"Transfer-Encoding: chunked" in received
            assert b"second" not in received
            gate.write_text("")  # only now can the command finish
            while not received.endswith(b"0\r\n\r\n"):
                chunk = sock.recv(4096)
                assert chunk, received
                received += chunk
            assert b"second" in received


# ---------------------------------------------------------------------------------------------
# Graceful stop, systemd notify, socket activation, Unix socket
# ---------------------------------------------------------------------------------------------

def test_sigterm_lets_a_running_command_finish_and_removes_the_pidfile(tmp_path):
    run, gate = gated_command(tmp_path, "long", "started", "finished")
    hooks = write_hooks(tmp_path / "hooks.json", [{
        "id": "long", "execute-command": run, "include-command-output-in-response": True}])
    pidfile = tmp_path / "run" / "webhookd.pid"
    with start(hooks, "-pidfile", pidfile) as daemon:
        assert pidfile.read_text() == str(daemon.proc.pid)
        assert stat.S_IMODE(pidfile.stat().st_mode) == 0o600
        import threading
        answers = []
        client = threading.Thread(target=lambda: answers.append(
            daemon.request("GET", "/hooks/long", timeout=30)))
        client.start()
        wait_until(lambda: "executing" in daemon.log(), what="command started")
        daemon.signal(signal.SIGTERM)
        wait_until(lambda: "stopping" in daemon.log(), what="stop logged")
        with pytest.raises(OSError):  # no new connections
            socket.create_connection(("127.0.0.1", daemon.port), timeout=2).close()
        assert daemon.proc.poll() is None  # still waiting for the deploy
        gate.write_text("")
        client.join(20)
        assert answers and answers[0][0] == 200 and answers[0][2] == b"started\nfinished\n"
        assert daemon.proc.wait(20) == 0
        assert not pidfile.exists()


def test_shutdown_timeout_bounds_the_wait(tmp_path):
    run = script(tmp_path / "forever.sh", "sleep 60\n")
    hooks = write_hooks(tmp_path / "hooks.json", [{"id": "forever", "execute-command": run}])
    with start(hooks, "-shutdown-timeout", "1") as daemon:
        assert daemon.request("GET", "/hooks/forever")[0] == 200
        wait_until(lambda: "executing" in daemon.log(), what="command started")
        started = time.monotonic()
        daemon.signal(signal.SIGTERM)
        assert daemon.proc.wait(20) == 0
        assert 0.8 <= time.monotonic() - started < 15


@pytest.mark.parametrize("abstract", [False, True])
def test_sd_notify_ready_reloading_stopping(tmp_path, abstract):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = "webhookd-test-%d-%d" % (os.getpid(), time.monotonic_ns())
        listener.bind("\0" + name)
        address = "@" + name
    else:
        address = str(tmp_path / "notify.sock")
        listener.bind(address)
    listener.settimeout(15)
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("a")])
    with listener, start(hooks, env={"NOTIFY_SOCKET": address}) as daemon:
        assert listener.recv(4096).startswith(b"READY=1")
        daemon.signal(signal.SIGHUP)
        assert listener.recv(4096).startswith(b"RELOADING=1\nMONOTONIC_USEC=")
        assert listener.recv(4096) == b"READY=1"
        daemon.signal(signal.SIGTERM)
        assert listener.recv(4096) == b"STOPPING=1"
        assert daemon.proc.wait(20) == 0


def test_notify_socket_is_not_passed_to_commands(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [{
        "id": "env", "execute-command": "/usr/bin/env", "include-command-output-in-response":
        True}])
    with start(hooks, env={"NOTIFY_SOCKET": str(tmp_path / "nobody")}, verbose=False) as daemon:
        body = daemon.request("GET", "/hooks/env")[2]
        assert daemon.log() == ""  # upstream logs nothing without -verbose
        assert b"NOTIFY_SOCKET" not in body and b"PATH=" in body


def test_systemd_socket_activation_serves_on_fd_3(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("activated")])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    # what systemd does: the socket on fd 3, LISTEN_PID = the service's own pid
    wrapper = ("import os, sys; os.dup2(%d, 3); os.environ['LISTEN_PID'] = str(os.getpid()); "
               "os.environ['LISTEN_FDS'] = '1'; os.execv(sys.executable, [sys.executable] + "
               "sys.argv[1:])" % listener.fileno())
    argv = [sys.executable, "-c", wrapper, str(WEBHOOKD), "-hooks", str(hooks), "-verbose",
            "-port", "1"]  # -port is ignored when a socket is passed
    proc = subprocess.Popen(argv, pass_fds=[listener.fileno()], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        listener.close()
        status, _, body = support.request(port, "GET", "/hooks/activated")
        assert (status, body) == (200, b"activated\n")
    finally:
        proc.terminate()
        assert proc.wait(20) == 0


def test_descriptors_inherited_by_webhookd_do_not_reach_commands(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [{
        "id": "fds", "execute-command": "/bin/ls", "include-command-output-in-response": True,
        "pass-arguments-to-command": [{"source": "string", "name": "/proc/self/fd"}]}])
    read_end, write_end = os.pipe()
    os.dup2(read_end, 50)  # as a launching shell or supervisor might leave one open
    port = free_port()
    proc = subprocess.Popen(python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port",
                                       str(port)), pass_fds=[50], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        support.wait_for_port(port, proc)
        status, _, body = support.request(port, "GET", "/hooks/fds")
        assert status == 200 and set(body.split()) <= {b"0", b"1", b"2", b"3"}, body
    finally:
        proc.terminate()
        proc.wait(20)
        for fd in (read_end, write_end, 50):
            os.close(fd)


def unix_request(path, raw):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        return exchange(sock, raw)


def unix_connectable(path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(path) == 0


def test_unix_socket_serves_and_is_removed_at_exit(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("unix")])
    path = str(tmp_path / "webhookd.sock")
    daemon = Daemon(python_cmd(WEBHOOKD, "-hooks", hooks, "-socket", path, "-verbose"), 0,
                    wait=False)
    with daemon:
        wait_until(lambda: os.path.exists(path), what="socket file")
        # the file appears at bind(), a moment before listen(): a refusal then is no answer
        wait_until(lambda: unix_connectable(path), what="socket listening")
        answer = unix_request(path, b"GET /hooks/unix HTTP/1.1\r\nHost: x\r\n"
                                    b"Connection: close\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"\r\n\r\nunix\n")
        daemon.signal(signal.SIGTERM)
        assert daemon.proc.wait(20) == 0
        assert not os.path.exists(path)


# ---------------------------------------------------------------------------------------------
# -template, limits, status page
# ---------------------------------------------------------------------------------------------

def test_template_getenv_cat_credential_with_js(tmp_path):
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text('from "cat"')
    credentials = tmp_path / "creds"
    credentials.mkdir()
    (credentials / "token").write_text("cred'value\n")  # as `echo` writes it: trimmed
    hooks = tmp_path / "hooks.json"
    # the template runs on the raw text, before JSON parsing: quotes inside actions are bare
    hooks.write_text("""[{"id": "t", "execute-command": "/bin/echo",
        "include-command-output-in-response": true,
        "pass-arguments-to-command": [
            {"source": "string", "name": "{{ getenv "HOOK_TEST_VALUE" | js }}"},
            {"source": "string", "name": "{{ cat "%s" | js }}"},
            {"source": "string", "name": "{{- credential `token` | js -}}"}]}]""" % secret_file)
    env = {"HOOK_TEST_VALUE": 'a"b<c', "CREDENTIALS_DIRECTORY": str(credentials)}
    with start(hooks, "-template", env=env) as daemon:
        body = daemon.request("GET", "/hooks/t")[2]
        assert body == b'a"b<c from "cat" cred\'value\n'


def test_template_rejects_other_actions_clearly(tmp_path):
    hooks = tmp_path / "hooks.json"
    hooks.write_text('[{"id": "x", "execute-command": "{{ .Env.HOME }}"}]')
    with start(hooks, "-template", "-nopanic") as daemon:
        log = wait_until(lambda: "unsupported template action" in daemon.log()
                         and daemon.log(), what="template error")
        assert "hooks.json:1:" in log


def test_body_limit_413_and_slow_headers_are_cut_off(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("a")])
    with start(hooks, "-max-body-bytes", "1000", "-read-header-timeout", "1") as daemon:
        status, _, body = daemon.request("POST", "/hooks/a", body=b"x" * 1001)
        assert status == 413
        assert daemon.request("POST", "/hooks/a", body=b"x" * 1000)[0] == 200
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=15) as sock:
            sock.sendall(b"GET /hooks/a HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            started = time.monotonic()
            assert sock.recv(4096) == b""  # closed by the server
            assert time.monotonic() - started < 10
        assert daemon.request("GET", "/hooks/a")[0] == 200  # others were served meanwhile


def test_status_page_reports_hooks_files_and_state(tmp_path):
    first = write_hooks(tmp_path / "one.json", [echo_hook("a"), echo_hook("b")])
    second = tmp_path / "two.json"  # missing at start
    with start(first, "-hooks", second, "-status-path", "/-/status", "-nopanic") as daemon:
        status, headers, body = daemon.request("GET", "/-/status")
        assert status == 200 and headers["content-type"] == "application/json"
        doc = json.loads(body)
        assert doc["version"] == "2.8.0" and doc["hooks_loaded"] == 2
        assert doc["uptime_seconds"] >= 0 and doc["started"].endswith("Z")
        files = {f["path"]: f for f in doc["hooks_files"]}
        assert files[str(first)]["hooks"] == ["a", "b"]
        assert not files[str(second)]["loaded"] and doc["load_errors"]
        assert doc["status"] == "degraded"  # the last load failed for two.json
        assert daemon.request("POST", "/-/status")[0] == 405

    empty = write_hooks(tmp_path / "empty.json", [])
    with start(empty, "-status-path", "/health") as daemon:
        assert json.loads(daemon.request("GET", "/health")[2])["status"] == "degraded"
    with start(first, "-status-path", "/health") as daemon:
        assert json.loads(daemon.request("GET", "/health")[2])["status"] == "ok"
        assert daemon.request("GET", "/hooks/health")[0] == 404


@pytest.mark.parametrize("flags", [
    ("-status-path", "/hooks/status"),
    # the hooks under the status site: its runs/<id> route would take every hook's path
    ("-status-path", "/a", "-urlprefix", "a/runs")])
def test_status_path_inside_the_hooks_prefix_is_refused(tmp_path, flags):
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("a")])
    result = subprocess.run(python_cmd(WEBHOOKD, "-hooks", hooks, *flags,
                                       "-port", str(free_port())),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "status-path" in result.stdout


def self_signed_certificate(folder):
    """cert.pem and key.pem for localhost in `folder` (skips without the openssl command)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command: apt-get install openssl")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-keyout", str(folder / "key.pem"),
                    "-out", str(folder / "cert.pem")], check=True, capture_output=True,
                   timeout=60)


def test_https_with_minimum_tls_version(tmp_path):
    import ssl
    self_signed_certificate(tmp_path)
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("tls")])
    with start(hooks, "-secure", "-cert", tmp_path / "cert.pem", "-key", tmp_path / "key.pem",
               "-tls-min-version", "1.3") as daemon:
        context = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
        context.check_hostname = False
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as raw:
            with context.wrap_socket(raw) as sock:
                assert sock.version() == "TLSv1.3"
                for _ in range(2):  # keep-alive over TLS
                    sock.sendall(b"GET /hooks/tls HTTP/1.1\r\nHost: x\r\n\r\n")
                    answer = b""
                    while not answer.endswith(b"tls\n"):
                        answer += sock.recv(4096)
                    assert answer.startswith(b"HTTP/1.1 200 OK")
        old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        old.check_hostname, old.verify_mode = False, ssl.CERT_NONE
        old.maximum_version = ssl.TLSVersion.TLSv1_2
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as raw:
            with pytest.raises(ssl.SSLError):
                old.wrap_socket(raw)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop privileges: run the suite as root to cover it")
def test_setuid_setgid_drop_privileges_after_binding(tmp_path):
    import tempfile
    workdir = tempfile.mkdtemp(prefix="webhookd-nobody-")  # where nobody can write its file
    os.chmod(workdir, 0o777)
    hooks = write_hooks(tmp_path / "hooks.json", [{
        "id": "who", "execute-command": "/usr/bin/id", "include-command-output-in-response":
        True, "command-working-directory": workdir,
        # rules and a decoded pass-file use modules loaded lazily: after the privilege drop
        "pass-file-to-command": [{"source": "string", "name": "aGk=", "envname": "HOOK_DATA",
                                  "base64decode": True}],
        "trigger-rule": {"and": [
            {"match": {"type": "ip-whitelist", "ip-range": "127.0.0.1"}},
            {"match": {"type": "value", "value": "x", "parameter": {"source": "url",
                                                                     "name": "t"}}}]}}])
    with start(hooks, "-setuid", "65534", "-setgid", "65534") as daemon:
        assert daemon.request("GET", "/hooks/who?t=no")[2] == b"Hook rules were not satisfied."
        body = daemon.request("GET", "/hooks/who?t=x")[2]
        assert body.startswith(b"uid=65534") and b"gid=65534" in body
        assert b"groups=65534" in body and b"0(root)" not in body  # root's groups dropped
    assert os.listdir(workdir) == []  # the pass-file temp file was removed
    os.rmdir(workdir)


# ---------------------------------------------------------------------------------------------
# Cheap answers given by the connection thread (issue 6)
# ---------------------------------------------------------------------------------------------

def read_responses(sock, count, timeout=20.0):
    """Read `count` Content-Length framed responses, no more; returns [(status line, body)]."""
    sock.settimeout(timeout)
    data, found = b"", []
    while len(found) < count:
        end = data.find(b"\r\n\r\n")
        if end >= 0:
            head = data[:end].decode()
            length = int(head.lower().split("content-length: ")[1].split("\r\n")[0])
            if len(data) >= end + 4 + length:
                found.append((head.split("\r\n")[0], data[end + 4:end + 4 + length]))
                data = data[end + 4 + length:]
                continue
        chunk = sock.recv(65536)
        assert chunk, "connection closed after %d responses" % len(found)
        data += chunk
    return found


def test_pipelined_requests_are_answered_in_order_across_inline_and_command_answers(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("say", **{"trigger-rule": {
        "match": {"type": "value", "value": "yes", "parameter": {"source": "url",
                                                                 "name": "t"}}}})])
    wanted = []
    raw = b""
    for i in range(40):  # more than one loop turn: 404s, mismatches, runs, a POST body
        kind = i % 4
        if kind == 0:
            raw += b"GET /hooks/none-%d HTTP/1.1\r\nHost: x\r\n\r\n" % i
            wanted.append(("HTTP/1.1 404 Not Found", b"Hook not found."))
        elif kind == 1:
            raw += b"GET /hooks/say?t=no HTTP/1.1\r\nHost: x\r\n\r\n"
            wanted.append(("HTTP/1.1 200 OK", b"Hook rules were not satisfied."))
        elif kind == 2:
            raw += b"GET /hooks/say?t=yes HTTP/1.1\r\nHost: x\r\n\r\n"
            wanted.append(("HTTP/1.1 200 OK", b"say\n"))
        else:
            raw += (b"POST /hooks/say HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 11\r\n\r\n{\"t\": \"no\"}")
            wanted.append(("HTTP/1.1 200 OK", b"Hook rules were not satisfied."))
    with start(hooks, "-header", "X-Extra=1") as daemon:
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=20) as sock:
            sock.sendall(raw)
            assert read_responses(sock, len(wanted)) == wanted
            # a HEAD answer declares the length of a body it does not carry
            sock.sendall(b"HEAD /hooks/say?t=no HTTP/1.1\r\nHost: x\r\n\r\n")
            tail = sock.recv(65536)
            while b"\r\n\r\n" not in tail:
                tail += sock.recv(65536)
            assert tail.startswith(b"HTTP/1.1 200 OK\r\n")
            assert b"Content-Length: 30\r\n" in tail and tail.endswith(b"\r\n\r\n")
            assert b"X-Extra: 1\r\n" in tail
        # the access line of the last answer is written just after it is sent
        log = wait_until(lambda: (lambda text: "| HEAD /hooks/say?t=<redacted>" in text and text)(
            daemon.log()), what="the access line of the HEAD request")
    assert log.count("didn't get triggered because the trigger rules were not satisfied") == 21
    assert log.count("| GET /hooks/none-") == 10 and log.count(" 404 | 15 B |") == 10
    assert log.count("say hook triggered successfully") == 10


def test_a_client_that_never_reads_its_answers_does_not_stall_others(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("say", **{"trigger-rule": {
        "match": {"type": "value", "value": "yes", "parameter": {"source": "url",
                                                                 "name": "t"}}}})])
    mismatch = b"GET /hooks/say?t=no HTTP/1.1\r\nHost: x\r\n\r\n"
    with start(hooks, verbose=False) as daemon:
        hogs = []
        try:
            for _ in range(2):  # each fills its socket buffers with unread answers
                hog = socket.create_connection(("127.0.0.1", daemon.port), timeout=20)
                hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                hog.setblocking(False)
                sent, deadline = 0, time.monotonic() + 2.0
                while sent < 8 << 20 and time.monotonic() < deadline:
                    try:
                        sent += hog.send(mismatch * 200)
                    except BlockingIOError:
                        time.sleep(0.01)
                hogs.append(hog)
            for _ in range(5):
                assert daemon.request("GET", "/hooks/say?t=no", timeout=10)[2] == \
                    b"Hook rules were not satisfied."
                assert daemon.request("GET", "/hooks/say?t=yes", timeout=10)[2] == b"say\n"
                assert daemon.request("GET", "/hooks/nothing", timeout=10)[0] == 404
        finally:
            for hog in hogs:
                hog.close()


# ---------------------------------------------------------------------------------------------
# Concurrency bounds and portability (issues 6 and 11)
# ---------------------------------------------------------------------------------------------

def thread_count(pid):
    return len(os.listdir("/proc/%d/task" % pid))


def concurrent_gets(port, paths, timeout=60):
    """GET each path from its own thread and connection: [(status, body)] in the same order."""
    answers = [None] * len(paths)

    def get(i):
        try:
            status, _, body = support.request(port, "GET", paths[i], timeout=timeout)
            answers[i] = (status, body)
        except OSError as exc:
            answers[i] = exc
    clients = [threading.Thread(target=get, args=(i,)) for i in range(len(paths))]
    for client in clients:
        client.start()
    for client in clients:
        client.join(timeout + 10)
    return answers


def started_with(code, flags, tmp_path):
    """The daemon run by `python -c`: `code` first (to change os before webhookd is loaded)."""
    port = free_port()
    runner = ("import runpy, sys\n%s\nsys.argv = [%r] + sys.argv[1:]\n"
              "runpy.run_path(%r, run_name='__main__')\n" % (code, str(WEBHOOKD), str(WEBHOOKD)))
    return Daemon([sys.executable, "-c", runner, "-ip", "127.0.0.1", "-port", str(port),
                   "-verbose"] + list(flags), port, cwd=tmp_path)


def sleep_echo_hook(hook_id, **extra):
    """Captured: sleeps a little, then prints the `t` URL parameter."""
    return dict({"id": hook_id, "execute-command": "/bin/sh",
                 "include-command-output-in-response": True,
                 "pass-arguments-to-command": [
                     {"source": "string", "name": "-c"},
                     {"source": "string", "name": 'sleep 0.5; printf "%s" "$1"'},
                     {"source": "string", "name": "sh"}, {"source": "url", "name": "t"}]},
                **extra)


def test_100_concurrent_awaited_commands_answered_with_threads_bounded_by_max_connections(
        tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [sleep_echo_hook("say")])
    with start(hooks, "-max-connections", "16") as daemon:
        assert daemon.request("GET", "/hooks/say?t=warm")[2] == b"warm"
        base = thread_count(daemon.proc.pid)
        peak, done = [base], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], thread_count(daemon.proc.pid))
                time.sleep(0.02)
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            tokens = ["t%03d-%s" % (i, os.urandom(4).hex()) for i in range(100)]
            answers = concurrent_gets(daemon.port, ["/hooks/say?t=" + t for t in tokens])
        finally:
            done.set()
            sampler.join()
        assert answers == [(200, t.encode()) for t in tokens]
        # one thread per connection served at once, the others wait in the listen backlog
        assert peak[0] <= base + 16, "threads not bounded: %d -> %d" % (base, peak[0])
        log = daemon.log()
        assert log.count("finished handling say") == 101 and "Traceback" not in log


def test_timed_out_command_whose_leader_exits_has_its_group_killed_at_once(tmp_path):
    # the leader dies of SIGTERM; a grandchild that ignores it keeps the output pipe open: it
    # is SIGKILLed as soon as the leader has gone, not after the 5 s grace period
    hooks = write_hooks(tmp_path / "hooks.json", [{
        "id": "slow", "execute-command": "/bin/sh", "include-command-output-in-response": True,
        "command-timeout": 0.5, "pass-arguments-to-command": [
            {"source": "string", "name": "-c"},
            {"source": "string", "name": "(trap '' TERM; sleep 60) & echo started; wait"}]}])
    with start(hooks) as daemon:
        started = time.monotonic()
        status, _, body = daemon.request("GET", "/hooks/slow", timeout=30)
        elapsed = time.monotonic() - started
        assert (status, body) == (504, b"Hook command timed out.")
        assert 0.5 <= elapsed < 4.5, elapsed
        log = wait_until(lambda: "finished handling slow" in daemon.log() and daemon.log())
        assert "command output: started" in log and "command timed out after 0.5s" in log


def test_sigterm_with_runs_queued_behind_max_concurrency_answers_them_all(tmp_path):
    # the queued runs start after the listener is closed: their descriptors take its number
    run, gate = gated_command(tmp_path, "deploy", "started", "done")
    hooks = write_hooks(tmp_path / "hooks.json", [{
        "id": "deploy", "execute-command": run, "include-command-output-in-response": True,
        "max-concurrency": 1}])
    with start(hooks) as daemon:
        answers = []
        clients = [threading.Thread(target=lambda: answers.append(
            daemon.request("GET", "/hooks/deploy", timeout=60)[::2])) for _ in range(3)]
        for client in clients:
            client.start()
        try:
            wait_until(lambda: daemon.log().count("got matched") == 3, what="three requests")
            daemon.signal(signal.SIGTERM)
            wait_until(lambda: "stopping" in daemon.log(), what="stop logged")
        finally:
            gate.write_text("")  # the commands run in sessions of their own: let them end
        for client in clients:
            client.join(60)
        assert answers == [(200, b"started\ndone\n")] * 3
        assert daemon.proc.wait(30) == 0
        log = daemon.log()
        assert log.count("finished handling deploy") == 3
        assert "accept:" not in log and "Traceback" not in log


def test_max_async_runs_bounds_background_runs_of_the_loop(tmp_path):
    run, gate = gated_command(tmp_path, "bg", "started", "done")
    hooks = write_hooks(tmp_path / "hooks.json", [{"id": "bg", "execute-command": run}])
    with start(hooks, "-max-async-runs", "2") as daemon:
        try:
            for _ in range(5):
                assert daemon.request("GET", "/hooks/bg")[0] == 200
            wait_until(lambda: daemon.log().count("executing") == 2, what="two runs")
            time.sleep(0.5)  # the three others wait for a background slot
            assert daemon.log().count("executing") == 2
        finally:
            gate.write_text("")  # the commands run in sessions of their own: let them end
        wait_until(lambda: daemon.log().count("finished handling bg") == 5, what="five runs")
        assert daemon.log().count("command output: started\ndone\n") == 5


def test_everything_runs_without_epoll_pipe2_and_pidfds(tmp_path):
    """macOS and FreeBSD have no select.epoll, os.pipe2 or os.pidfd_open: captured, timed out,
    streamed and background runs and the HTTP server must not need them."""
    code = ("import os, select\nfor name in ('pipe2', 'pidfd_open'):\n"
            "    if hasattr(os, name): delattr(os, name)\n"
            "if hasattr(select, 'epoll'): del select.epoll\n")
    bg_done = tmp_path / "bg.done"
    hooks = write_hooks(tmp_path / "hooks.json", [
        sleep_echo_hook("say"),
        sleep_echo_hook("slow", **{"command-timeout": 0.2}),
        sleep_echo_hook("stream", **{"stream-command-output": True}),
        {"id": "bg", "execute-command": "/bin/touch",
         "pass-arguments-to-command": [{"source": "string", "name": str(bg_done)}]}])
    with started_with(code, ["-hooks", str(hooks)], tmp_path) as daemon:
        tokens = ["t%d" % i for i in range(6)]
        assert concurrent_gets(daemon.port, ["/hooks/say?t=" + t for t in tokens]) == \
            [(200, t.encode()) for t in tokens]
        assert daemon.request("GET", "/hooks/slow?t=x", timeout=30)[::2] == \
            (504, b"Hook command timed out.")
        assert daemon.request("GET", "/hooks/stream?t=s")[::2] == (200, b"s")
        assert daemon.request("GET", "/hooks/bg")[0] == 200
        wait_until(bg_done.exists, what="background run")
        log = daemon.log()
        assert log.count("finished handling say") == 6 and "Traceback" not in log


def child_count(pid):
    """Processes whose parent is pid (the commands webhookd runs)."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/stat" % entry, "rb") as handle:
                    fields = handle.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            count += fields[1] == str(pid).encode()
    return count


def test_1000_concurrent_background_triggers_bounded_and_none_lost(tmp_path):
    done = tmp_path / "done"
    done.mkdir()
    hooks = write_hooks(tmp_path / "hooks.json", [{
        "id": "bg", "execute-command": "/bin/sh", "response-message": "queued",
        "pass-arguments-to-command": [
            {"source": "string", "name": "-c"},
            {"source": "string", "name": 'sleep 0.05; : > "$1"'},
            {"source": "string", "name": "sh"}, {"source": "url", "name": "f"}]}])
    with start(hooks, "-max-connections", "32", "-max-async-runs", "16",
               "-status-path", "/-/status", verbose=False) as daemon:
        pid = daemon.proc.pid
        base = thread_count(pid)
        peaks, status_answers, stop = {"threads": base, "children": 0}, [], threading.Event()

        def sample():
            # The status page keeps answering under the flood (10 s: a hang detector; how
            # fast it answers is for bench/, not for a test on a busy machine).
            while not stop.is_set():
                peaks["threads"] = max(peaks["threads"], thread_count(pid))
                peaks["children"] = max(peaks["children"], child_count(pid))
                try:
                    status_answers.append(daemon.request("GET", "/-/status", timeout=10)[0])
                except OSError as error:
                    status_answers.append(repr(error))
                time.sleep(0.05)
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            paths = ["/hooks/bg?f=%s" % (done / ("t%04d" % i)) for i in range(1000)]
            answers = []

            def client(chunk):
                answers.extend(concurrent_gets(daemon.port, chunk, timeout=120))
            clients = [threading.Thread(target=client, args=(paths[k::10],)) for k in range(10)]
            for c in clients:
                c.start()
            for c in clients:
                c.join(200)
            assert answers.count((200, b"queued")) == 1000, set(map(str, answers))
            wait_until(lambda: len(os.listdir(done)) == 1000, timeout=120,
                       what="all 1000 runs")
        finally:
            stop.set()
            sampler.join()
        assert peaks["children"] <= 16, peaks
        assert peaks["threads"] <= base + 32 + 16 + 4, (base, peaks)
        assert status_answers and set(status_answers) == {200}, set(status_answers)
        assert "Traceback" not in daemon.log()
