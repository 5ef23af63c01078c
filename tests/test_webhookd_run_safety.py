"""Black-box tests of issue 20 for runs: who may read them, what -runs-dir trusts, and that no
request stalls, leaks or loses a run (command-timeout, kill -9, -setuid, -runs-follow).

Each test starts the real daemon on a free 127.0.0.1 port, talks HTTP to it and checks status,
body and files; timeouts are hang detectors only.
"""
import json
import os
import stat
import shutil
import signal
import socket
import subprocess
import time

import pytest

import support
from support import WEBHOOKD, Daemon, free_port, python_cmd
from test_webhookd_features import exchange, script, wait_until, write_hooks
from test_webhookd_runs import ended, get_json, hook, start, trigger

NOBODY = 65534


def raw_get(port, target, header_lines=b""):
    """(status, body) of one GET with these raw header lines (each ending in CRLF)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        host = b"" if b"Host:" in header_lines else b"Host: 127.0.0.1\r\n"
        data = exchange(sock, b"GET %s HTTP/1.1\r\n%sConnection: close\r\n%s\r\n"
                        % (target.encode(), host, header_lines))
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


# ---------------------------------------------------------------------------------------------
# Who sees what: runs, output and the status page
# ---------------------------------------------------------------------------------------------

def test_any_relay_header_even_empty_keeps_run_output_from_relayed_clients(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [hook("deploy", "/bin/echo", **{
        "pass-arguments-to-command": [{"source": "string", "name": "db-password"}]})])
    with start(hooks) as daemon:
        run_id = ended(daemon, trigger(daemon, "deploy"))["id"]
        output = "/status/runs/%s/output" % run_id
        assert raw_get(daemon.port, output) == (200, b"db-password\n")  # loopback, no proxy
        # a client's empty line, then the line HAProxy's `option forwardfor` appends
        for lines in (b"X-Forwarded-For:\r\n", b"X-Forwarded-For: \r\nX-Forwarded-For: 1.2.3.4\r\n",
                      b"Forwarded:\r\n", b"X-Real-IP:\r\n"):
            status, body = raw_get(daemon.port, output, lines)
            assert status == 403 and b"db-password" not in body, lines
    with start(hooks, "-status-token", "s3cret") as daemon:  # a token: required from everyone
        run_id = trigger(daemon, "deploy")
        output = "/status/runs/%s/output" % run_id
        status, body = raw_get(daemon.port, output)
        assert status == 403 and b"db-password" not in body
        wait_until(lambda: raw_get(daemon.port, output, b"Authorization: Bearer s3cret\r\n")
                   == (200, b"db-password\n"), what="output with the token")


def test_a_page_naming_another_host_gets_nothing_even_from_loopback(tmp_path):
    """DNS rebinding: a web site re-points its name at 127.0.0.1, and the visitor's browser
    sends that name as Host; only loopback names are trusted without a token."""
    hooks = write_hooks(tmp_path / "hooks.json", [hook("deploy", "/bin/echo", **{
        "pass-arguments-to-command": [{"source": "string", "name": "db-password"}]})])
    with start(hooks) as daemon:
        run_id = ended(daemon, trigger(daemon, "deploy"))["id"]
        output = "/status/runs/%s/output" % run_id
        for host in (b"localhost:%d" % daemon.port, b"127.0.0.1", b"[::1]:1", b"LOCALHOST.",
                     b"app.localhost"):
            assert raw_get(daemon.port, output, b"Host: %s\r\n" % host) == (200, b"db-password\n")
        for host in (b"evil.example:%d" % daemon.port, b"evil.example", b"127.0.0.1.evil.example",
                     b"[::1", b"0x7f000001"):
            status, body = raw_get(daemon.port, output, b"Host: %s\r\n" % host)
            assert status == 403 and b"db-password" not in body, host
            status, body = raw_get(daemon.port, "/status/metrics", b"Host: %s\r\n" % host)
            assert status == 403, host


def test_status_page_shows_untrusted_callers_only_status_and_version(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [hook("secret-hook-id-9f3a", "/bin/true")])
    with start(hooks) as daemon:
        full = get_json(daemon, "/status")
        assert full["hooks_files"][0]["hooks"] == ["secret-hook-id-9f3a"]
        status, body = raw_get(daemon.port, "/status", b"X-Forwarded-For: 203.0.113.9\r\n")
        assert status == 200 and json.loads(body) == {"status": "ok", "version": "2.8.0"}
    with start(hooks, "-status-token", "s3cret") as daemon:
        status, body = raw_get(daemon.port, "/status")
        assert status == 200 and json.loads(body) == {"status": "ok", "version": "2.8.0"}
        status, body = raw_get(daemon.port, "/status", b"Authorization: Bearer s3cret\r\n")
        assert b"secret-hook-id-9f3a" in body and str(hooks).encode() in body


# ---------------------------------------------------------------------------------------------
# -runs-dir trusts nothing it finds
# ---------------------------------------------------------------------------------------------

def planted_record(runs_dir, run_id, **fields):
    record = dict({"id": run_id, "hook": "h", "state": "succeeded", "queued_at":
                   "2020-01-01T00:00:00Z", "output_bytes": 0}, **fields)
    (runs_dir / (run_id + ".json")).write_text(json.dumps(record))
    return record


def test_runs_dir_records_cannot_reach_outside_the_folder(tmp_path):
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir(mode=0o700)
    victim = tmp_path / "victim.json"
    victim.write_text("keep me")
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the folder")
    # an id that is not its file name: retention would delete `<runs>/../victim.json`
    planted_record(runs_dir, "20200101T000000Z-00000001", id="../victim")
    # a record whose output is a link to a file elsewhere
    planted_record(runs_dir, "20200101T000000Z-00000002", output_bytes=18)
    (runs_dir / "20200101T000000Z-00000002.log").symlink_to(secret)
    hooks = write_hooks(tmp_path / "hooks.json", [hook("h", "/bin/true")])
    with start(hooks, "-runs-dir", runs_dir, "-runs-keep", "1") as daemon:
        assert "../victim" not in [r["id"] for r in get_json(daemon, "/status/runs")]
        status, _, body = daemon.request("GET", "/status/runs/20200101T000000Z-00000002/output")
        assert b"outside the folder" not in body
        ended(daemon, trigger(daemon, "h"))  # retention drops the older runs of `h`
        time.sleep(0.5)  # the writer deletes what retention dropped
    assert victim.read_text() == "keep me"
    assert secret.read_text() == "outside the folder"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the folder to another user")
def test_runs_dir_owned_by_another_user_is_refused(tmp_path):
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir(mode=0o700)
    os.chown(runs_dir, NOBODY, NOBODY)
    hooks = write_hooks(tmp_path / "hooks.json", [hook("h", "/bin/true")])
    result = subprocess.run(python_cmd(WEBHOOKD, "-hooks", hooks, "-port", str(free_port()),
                                       "-runs-dir", runs_dir), capture_output=True, text=True,
                            timeout=30)
    out = result.stdout + result.stderr
    assert result.returncode == 1 and "owned by uid 65534" in out and "Traceback" not in out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop privileges")
def test_a_runs_dir_that_is_a_link_is_refused_and_its_target_left_alone(tmp_path):
    """Whoever owns the folder above -runs-dir can replace it with a link (to /etc, say):
    root must not hand the target over to the -setuid user."""
    target = tmp_path / "target"
    (target / "sub").mkdir(parents=True)
    (target / "file").write_text("x")
    runs_dir = tmp_path / "runs"
    runs_dir.symlink_to(target)
    hooks = write_hooks(tmp_path / "hooks.json", [hook("h", "/bin/true")])
    result = subprocess.run(python_cmd(WEBHOOKD, "-hooks", hooks, "-port", str(free_port()),
                                       "-runs-dir", runs_dir, "-setuid", str(NOBODY),
                                       "-setgid", str(NOBODY)),
                            capture_output=True, text=True, timeout=30)
    out = result.stdout + result.stderr
    assert result.returncode == 1 and "symbolic link" in out and "Traceback" not in out
    for path in (target, target / "sub", target / "file"):
        assert path.stat().st_uid == 0, path
    assert stat.S_IMODE(target.stat().st_mode) != 0o700


def public_python():
    """/usr/bin/python3 if user nobody may run it (the tests' own interpreter may be under
    /root, which nobody cannot enter), else None."""
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        return None

    def as_nobody():
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    check = subprocess.run([python, "-c", "import json"], preexec_fn=as_nobody,
                           capture_output=True)
    return python if check.returncode == 0 else None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop privileges")
def test_runs_dir_with_setuid_saves_records_as_the_dropped_to_user():
    python = public_python()
    if python is None:
        pytest.skip("needs a /usr/bin/python3 that user nobody can run (run the suite as root on Debian)")
    with support.scratch_dir("webhookd-setuid-") as base:
        base.chmod(0o755)  # nobody must reach the runs folder inside
        runs_dir = base / "runs"
        hooks = write_hooks(base / "hooks.json", [hook("h", "/bin/echo")])
        port = free_port()
        argv = [python, str(WEBHOOKD), "-hooks", hooks, "-ip", "127.0.0.1", "-port", str(port),
                "-verbose", "-status-path", "/status", "-runs-dir", runs_dir,
                "-setuid", str(NOBODY), "-setgid", str(NOBODY)]
        with Daemon(argv, port, cwd=str(base)) as daemon:
            record = ended(daemon, trigger(daemon, "h"))
            path = runs_dir / (record["id"] + ".json")
            saved = wait_until(lambda: path.exists() and json.loads(path.read_text())["state"]
                               == "succeeded" and json.loads(path.read_text()),
                               what="the record saved")
            assert saved["storage_error"] is None
            assert get_json(daemon, "/status/runs/" + record["id"])["storage_error"] is None
        assert runs_dir.stat().st_uid == NOBODY and path.stat().st_uid == NOBODY


# ---------------------------------------------------------------------------------------------
# Runs are never lost or stuck
# ---------------------------------------------------------------------------------------------

def test_a_handed_out_run_id_survives_kill_9_at_once(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [hook("long", "/bin/sleep", **{
        "pass-arguments-to-command": [{"source": "string", "name": "30"}]})])
    runs_dir = tmp_path / "runs"
    port = free_port()
    with start(hooks, "-runs-dir", runs_dir, port=port) as daemon:
        ids = [trigger(daemon, "long") for _ in range(3)]
        daemon.stop(signal.SIGKILL)
    with start(hooks, "-runs-dir", runs_dir, port=port) as daemon:
        for run_id in ids:
            assert get_json(daemon, "/status/runs/" + run_id)["state"] == "interrupted"


def test_a_run_that_cannot_start_ends_failed_never_stays_queued(tmp_path):
    nul = "/bin/echo\u0000x"  # a NUL in the path: no such command can exist
    hooks = write_hooks(tmp_path / "hooks.json", [
        hook("background", nul),
        hook("captured", nul, **{"include-command-output-in-response": True})])
    with start(hooks) as daemon:
        assert ended(daemon, trigger(daemon, "background"))["state"] == "failed"
        status, headers, _ = daemon.request("GET", "/hooks/captured")
        assert status == 500 and ended(daemon, headers["x-webhookd-run"])["state"] == "failed"
        assert "Traceback" not in daemon.log()


def rss_bytes(pid):
    with open("/proc/%d/status" % pid) as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux: reads RSS from /proc")
def test_runs_waiting_in_the_backlog_do_not_hold_request_bodies(tmp_path):
    gate = tmp_path / "gate"
    held = script(tmp_path / "held.sh", "while [ ! -e %s ]; do sleep 0.05; done\n" % gate)
    hooks = write_hooks(tmp_path / "hooks.json", [hook("held", held, **{"max-concurrency": 1})])
    body = b"x" * (1 << 20)
    with start(hooks, "-max-body-bytes", str(2 << 20)) as daemon:
        trigger(daemon, "held")  # runs, and holds the hook's one slot until the gate opens
        before = rss_bytes(daemon.proc.pid)
        for _ in range(40):  # each waits for its turn
            trigger(daemon, "held", "POST", body, {"Content-Type": "application/octet-stream"})
        grown = rss_bytes(daemon.proc.pid) - before
        gate.touch()
    assert grown < 20 << 20, grown  # 40 MiB of bodies are not kept


@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid(1)")
def test_command_timeout_bounds_the_answer_when_a_left_process_holds_the_output(tmp_path):
    pids = tmp_path / "pids"
    leave = "setsid sleep 30 &\necho $! >> %s\n" % pids  # holds the output pipe for 30 s
    hooks = write_hooks(tmp_path / "hooks.json", [
        hook("slow", script(tmp_path / "slow.sh", leave + "echo started\nexec sleep 30\n"),
             **{"include-command-output-in-response": True, "command-timeout": 1}),
        hook("done", script(tmp_path / "done.sh", leave + "echo done\n"),
             **{"include-command-output-in-response": True, "max-concurrency": 1})])
    with start(hooks) as daemon:
        try:
            # the timeouts are hang detectors: unbounded, each answer takes 30 s
            assert daemon.request("GET", "/hooks/slow", timeout=10)[::2] == (
                504, b"Hook command timed out.")
            for _ in range(2):  # the second needs the first's max-concurrency slot back
                assert daemon.request("GET", "/hooks/done", timeout=10)[::2] == (200, b"done\n")
        finally:
            for pid in pids.read_text().split() if pids.exists() else ():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_runs_follow_never_skips_output_when_the_log_is_cut_to_its_tail(tmp_path):
    gate = tmp_path / "gate"
    first, second = "A" * 900, "B" * 600
    hooks = write_hooks(tmp_path / "hooks.json", [hook("loud", script(
        tmp_path / "loud.sh", "printf %s\nwhile [ ! -e %s ]; do sleep 0.05; done\nprintf %s\n"
        % (first, gate, second)))])
    runs_dir = tmp_path / "runs"
    with start(hooks, "-runs-dir", runs_dir, "-runs-max-output", "1000") as daemon:
        run_id = trigger(daemon, "loud")
        log_file = runs_dir / (run_id + ".log")
        wait_until(lambda: log_file.exists() and log_file.stat().st_size == 900,
                   what="the first output on disk")
        follower = subprocess.Popen(python_cmd(WEBHOOKD, "-runs-dir", runs_dir, "-runs-follow",
                                               run_id), stdout=subprocess.PIPE)
        try:
            assert follower.stdout.read(900) == first.encode()
            gate.touch()  # 600 more bytes: the log ends cut to the last 1000
            printed = follower.stdout.read()
            assert follower.wait(15) == 0
        finally:
            follower.kill()
            follower.wait()
    assert second.encode() in printed, printed
