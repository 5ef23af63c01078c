"""Black-box tests of webhookd.py's answers to webhook's open requests (issue 22): the client
behind a reverse proxy (-trusted-proxy) and the request body on a command's stdin
(pass-payload-to-stdin).  The real daemon on a free 127.0.0.1 port, real HTTP; the "proxy" is
the test itself, connecting from 127.0.0.1 with X-Forwarded-For lines of its choosing."""
import hashlib
import os
import signal
import socket
import subprocess
import sys

import pytest

from support import WEBHOOKD, python_cmd
from test_webhookd_features import exchange, start as start_daemon, started_with, wait_until
from test_webhookd_features import write_hooks


def start(hooks, tmp_path, *flags):
    return start_daemon(write_hooks(tmp_path / "hooks.json", hooks), *flags)


def raw_request(port, head_lines, body=b"", hook="who"):
    """One request with exactly these header lines (repeated names included): (status, body,
    the client's own port)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = "POST /hooks/%s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" % hook
        head += "".join(line + "\r\n" for line in head_lines)
        head += "Content-Length: %d\r\n\r\n" % len(body)
        own_port = sock.getsockname()[1]
        answer = exchange(sock, head.encode() + body)
    status = int(answer.split(b" ", 2)[1])
    return status, answer.split(b"\r\n\r\n", 1)[1], own_port


# ---------------------------------------------------------------------------------------------
# -trusted-proxy
# ---------------------------------------------------------------------------------------------

WHO = {"id": "who", "execute-command": "/bin/echo", "include-command-output-in-response": True,
       "pass-arguments-to-command": [{"source": "request", "name": "remote-addr"}],
       "trigger-rule": {"match": {"type": "ip-whitelist", "ip-range": "203.0.113.0/24"}}}
DENIED = (200, b"Hook rules were not satisfied.")


ADDR = {key: value for key, value in WHO.items() if key != "trigger-rule"}
ADDR["id"] = "addr"


def who(port, *forwarded, hook="who"):
    """(status, body) of the whitelisted hook (or another), X-Forwarded-For lines as given;
    the client's port in the body written `PORT` when it is the connection's own port."""
    status, body, own_port = raw_request(port, ["X-Forwarded-For: " + f for f in forwarded],
                                         hook=hook)
    return status, body.replace(b":%d\n" % own_port, b":PORT\n")


def test_trusted_proxy_client_is_the_rightmost_untrusted_forwarded_address(tmp_path):
    with start([WHO, ADDR], tmp_path, "-trusted-proxy", "127.0.0.0/8",
               "-trusted-proxy", "10.0.0.0/8,::1") as daemon:
        port = daemon.port
        assert who(port, "203.0.113.7") == (200, b"203.0.113.7:PORT\n")
        # the proxies' own entries (trusted) are skipped, from the right
        assert who(port, "198.51.100.1, 203.0.113.7, 10.1.2.3 ,127.0.0.9") == \
            (200, b"203.0.113.7:PORT\n")
        # a client's forged entry left of its real address changes nothing
        assert who(port, "203.0.113.7, 198.51.100.1") == DENIED
        # several header lines are one list, in order
        assert who(port, "198.51.100.1", "203.0.113.8") == (200, b"203.0.113.8:PORT\n")
        assert who(port, "203.0.113.8", "198.51.100.1") == DENIED
        assert who(port, "[::ffff:203.0.113.9]") == (200, b"203.0.113.9:PORT\n")
        # all trusted: the left-most; an unreadable entry: an unknown client, refused
        assert who(port, "10.0.0.5, 127.0.0.2", hook="addr") == (200, b"10.0.0.5:PORT\n")
        assert who(port, "203.0.113.7,", hook="addr") == (200, b"unknown\n")
        assert who(port, "203.0.113.7, not-an-address") == DENIED
        assert who(port, "203.0.113.7,") == DENIED
        log = wait_until(lambda: "from 203.0.113.8:" in daemon.log() and daemon.log(),
                         what="the access log line")
        assert "incoming HTTP POST request from 203.0.113.7:" in log
        assert "incoming HTTP POST request from unknown" in log


def test_a_forwarded_address_with_a_zone_is_an_unknown_client(tmp_path):
    """Python reads `fe80::1%<any text>` as an address: the text after `%` is the client's to
    choose, and would reach remote-addr (a command's argv, the log) as `[fe80::1%$(id)]`."""
    with start([ADDR], tmp_path, "-trusted-proxy", "127.0.0.0/8,10.0.0.0/8") as daemon:
        for entry in ("fe80::1%$(id)", "[fe80::1%eth0]", "fe80::1%25x", "fe80::1%x, 10.0.0.1"):
            assert who(daemon.port, entry, hook="addr") == (200, b"unknown\n")
        assert who(daemon.port, "fe80::1", hook="addr") == (200, b"[fe80::1]:PORT\n")


def test_a_trusted_proxy_written_ipv4_mapped_is_trusted(tmp_path):
    """A peer on a dual-stack socket (::ffff:127.0.0.1) is read as IPv4, as ip-whitelist reads
    it: a range written in that form must match it too, never silently nothing."""
    with start([ADDR], tmp_path, "-trusted-proxy", "::ffff:127.0.0.0/104") as daemon:
        assert who(daemon.port, "203.0.113.7", hook="addr") == (200, b"203.0.113.7:PORT\n")


def test_a_trusted_proxy_range_of_everything_is_warned_about(tmp_path):
    """-trusted-proxy 0.0.0.0/0 (a quick fix that "works") lets any client choose its address:
    said at start, as loudly as a status page without a token."""
    with start([WHO], tmp_path, "-trusted-proxy", "0.0.0.0/0,::/0") as daemon:
        assert who(daemon.port, "203.0.113.7") == (200, b"203.0.113.7:PORT\n")
        log = daemon.log()
        assert "-trusted-proxy 0.0.0.0/0 trusts every address" in log
        assert "-trusted-proxy ::/0 trusts every address" in log


def test_without_trusted_proxy_or_from_an_untrusted_peer_forwarded_for_is_ignored(tmp_path):
    for flags in ((), ("-trusted-proxy", "10.0.0.0/8")):  # the test connects from 127.0.0.1
        with start([WHO, ADDR], tmp_path, *flags) as daemon:
            assert who(daemon.port, "203.0.113.7") == DENIED
            assert who(daemon.port, "203.0.113.7", hook="addr") == (200, b"127.0.0.1:PORT\n")
            assert "203.0.113.7:" not in daemon.log()


def test_trusted_proxy_never_opens_the_run_history_to_a_relayed_client(tmp_path):
    """The status page's access check stays: any relay header means relayed, even when its
    address is a trusted loopback proxy's."""
    with start([WHO], tmp_path, "-trusted-proxy", "127.0.0.0/8", "-status-path", "/status") \
            as daemon:
        assert daemon.request("GET", "/status/runs")[0] == 200
        assert daemon.request("GET", "/status/runs",
                              headers={"X-Forwarded-For": "127.0.0.1"})[0] == 403


@pytest.mark.parametrize("value", ["10.0.0.1/8", "10.0.0.0/8,nonsense"])
def test_bad_trusted_proxy_is_one_sentence_and_exit_2(tmp_path, value):
    result = subprocess.run(python_cmd(WEBHOOKD, "-trusted-proxy", value, "-hooks",
                                       tmp_path / "none.json"),
                            capture_output=True, text=True, timeout=20)
    assert result.returncode == 2
    first = result.stderr.splitlines()[0]
    assert first.startswith('invalid value "%s" for flag -trusted-proxy: ' % value), first
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------------------------------------
# pass-payload-to-stdin
# ---------------------------------------------------------------------------------------------

# Prints a lot before it reads its stdin (a writer that waited for the reader would deadlock),
# then the size and SHA-256 of what it read, to stdout or to the file given as argv[1].
DIGEST = ("import hashlib, sys\n"
          "sys.stdout.write('x' * 300000 + '\\n'); sys.stdout.flush()\n"
          "data = sys.stdin.buffer.read()\n"
          "line = '%d %s' % (len(data), hashlib.sha256(data).hexdigest())\n"
          "if len(sys.argv) > 1: open(sys.argv[1], 'w').write(line)\n"
          "else: print(line)\n")


def digest_hook(hook_id, *args, **fields):
    hook = {"id": hook_id, "execute-command": sys.executable, "pass-payload-to-stdin": True,
            "pass-arguments-to-command": [{"source": "string", "name": a}
                                          for a in ("-c", DIGEST) + args]}
    hook.update(fields)
    return hook


def test_payload_reaches_stdin_intact_in_every_mode(tmp_path):
    body = os.urandom(2 * 1024 * 1024)
    expected = "%d %s" % (len(body), hashlib.sha256(body).hexdigest())
    out = tmp_path / "background.txt"
    hooks = [digest_hook("captured", **{"include-command-output-in-response": True}),
             digest_hook("streamed", **{"stream-command-output": True}),
             digest_hook("background", str(out))]
    with start(hooks, tmp_path) as daemon:
        for hook_id in ("captured", "streamed"):
            status, _, answer = daemon.request("POST", "/hooks/" + hook_id, body=body,
                                               headers={"Content-Type": "text/plain"})
            assert status == 200
            assert answer.decode().splitlines()[-1] == expected, hook_id
        assert daemon.request("POST", "/hooks/background", body=body)[0] == 200
        assert wait_until(lambda: out.exists() and out.read_text(), what="background run") == expected
        # a multipart body as sent (the hook model sees its parts, the command the bytes)
        form = (b"--XyZ\r\nContent-Disposition: form-data; name=\"f\"\r\n\r\nvalue\r\n"
                b"--XyZ--\r\n")
        status, _, answer = daemon.request("POST", "/hooks/captured", body=form, headers={
            "Content-Type": "multipart/form-data; boundary=XyZ"})
        assert answer.decode().splitlines()[-1] == "%d %s" % (
            len(form), hashlib.sha256(form).hexdigest())
        # a chunked body, as it was before chunking
        status, _, answer = daemon.request("POST", "/hooks/captured", body=iter([body[:1000],
                                                                                 body[1000:]]))
        assert answer.decode().splitlines()[-1] == expected


def test_commands_that_do_not_read_stdin_still_finish(tmp_path):
    """EPIPE is quiet; a command's leftover child holding stdin open, or a command-timeout,
    holds neither the answer nor the daemon (hang detectors: the bad code never answers)."""
    body = b"y" * (2 * 1024 * 1024)
    hooks = [{"id": "ignores", "execute-command": "/bin/echo", "pass-payload-to-stdin": True,
              "include-command-output-in-response": True,
              "pass-arguments-to-command": [{"source": "string", "name": "done"}]},
             {"id": "leaves-child", "execute-command": "/bin/sh", "pass-payload-to-stdin": True,
              "include-command-output-in-response": True,
              "pass-arguments-to-command": [{"source": "string", "name": "-c"},
                                            {"source": "string",
                                             "name": "exec 3<&0; sleep 60 >/dev/null 2>&1 & "
                                                     "test -p /dev/stdin && echo left"}]},
             {"id": "sleeps", "execute-command": "/bin/sleep", "pass-payload-to-stdin": True,
              "include-command-output-in-response": True, "command-timeout": 1,
              "pass-arguments-to-command": [{"source": "string", "name": "60"}]}]
    with start(hooks, tmp_path) as daemon:
        assert daemon.request("POST", "/hooks/ignores", body=body, timeout=15)[::2] == \
            (200, b"done\n")
        assert daemon.request("POST", "/hooks/leaves-child", body=body, timeout=15)[::2] == \
            (200, b"left\n")
        assert daemon.request("POST", "/hooks/sleeps", body=body, timeout=15)[0] == 504
        assert daemon.request("POST", "/hooks/ignores", body=b"again")[::2] == (200, b"done\n")
        assert "Traceback" not in daemon.log()


def test_a_command_whose_stdin_cannot_be_fed_is_stopped_not_left_waiting(tmp_path):
    """No thread to be had for the stdin writer (a thread limit reached): the command, which
    would wait for its input for ever and hold the request with it, is stopped and the run
    fails (hang detector: the bad code never answers)."""
    pid_file = tmp_path / "pid"
    hooks = write_hooks(tmp_path / "hooks.json", [
        {"id": "reads", "execute-command": "/bin/sh", "pass-payload-to-stdin": True,
         "include-command-output-in-response": True,
         "pass-arguments-to-command": [{"source": "string", "name": "-c"}, {
             "source": "string", "name": "echo $$ > %s; exec cat" % pid_file}]}])
    no_stdin_thread = (
        "import threading\n"
        "start = threading.Thread.start\n"
        "def refuse(self):\n"
        "    if self.name == 'stdin':\n"
        "        raise RuntimeError(\"can't start new thread\")\n"
        "    return start(self)\n"
        "threading.Thread.start = refuse")
    with started_with(no_stdin_thread, ["-hooks", str(hooks)], tmp_path) as daemon:
        status, _, body = daemon.request("POST", "/hooks/reads", body=b"payload", timeout=15)
        assert status == 500 and b"payload" not in body
        wait_until(lambda: "can't start new thread" in daemon.log(), what="the failure logged")
        if pid_file.exists():  # it started: it must be gone, not waiting for input for ever
            pid = int(pid_file.read_text())
            wait_until(lambda: not process_exists(pid), what="the command stopped and reaped")


def process_exists(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_queued_runs_hold_a_bounded_number_of_bodies_for_stdin(tmp_path):
    """A background run waiting for its max-concurrency turn keeps its body for its stdin:
    without a bound, a client could queue ASYNC_BACKLOG_LIMIT (10,000) bodies of
    -max-body-bytes each (250 GB by default).  Eight bodies' worth of commands are held at most
    (the bodies here leave room for the command lines beside them); more get 503 until the
    queue drains; nothing accepted is lost."""
    gate, out = tmp_path / "gate", tmp_path / "sizes"
    hooks = [{"id": "queue", "execute-command": "/bin/sh", "pass-payload-to-stdin": True,
              "max-concurrency": 1,
              "pass-arguments-to-command": [{"source": "string", "name": "-c"}, {
                  "source": "string", "name": "while [ ! -e %s ]; do sleep 0.05; done; "
                                              "wc -c >> %s" % (gate, out)}]}]
    body = b"z" * 99000
    with start(hooks, tmp_path, "-max-body-bytes", "100000") as daemon:
        answers = [daemon.request("POST", "/hooks/queue", body=body)[0] for _ in range(8)]
        assert answers == [200] * 8
        assert daemon.request("POST", "/hooks/queue", body=body)[0] == 503
        gate.touch()
        wait_until(lambda: out.exists() and out.read_text().split() == ["99000"] * 8,
                   what="the eight queued runs")
        assert daemon.request("POST", "/hooks/queue", body=body)[0] == 200


def validate(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    result = subprocess.run(python_cmd(WEBHOOKD, "-validate", "-hooks", path),
                            capture_output=True, text=True, timeout=20)
    return result.returncode, result.stdout


def test_validate_knows_pass_payload_to_stdin(tmp_path):
    good = '[{"id": "a", "execute-command": "/bin/cat", "pass-payload-to-stdin": true}]'
    assert validate(tmp_path, "good.json", good) == \
        (0, "1 file(s) checked: 0 error(s), 0 warning(s)\n")
    yaml = "- id: a\n  execute-command: /bin/cat\n  pass-payload-to-stdin: true\n"
    assert validate(tmp_path, "good.yaml", yaml)[0] == 0
    code, out = validate(tmp_path, "bad.json", good.replace("true", '"yes"'))
    assert code == 1 and "pass-payload-to-stdin: expected a boolean, got string" in out, out


# ---------------------------------------------------------------------------------------------
# -template's cat and credential against files that are not files
# ---------------------------------------------------------------------------------------------

def test_template_reload_of_a_fifo_or_dev_zero_is_a_load_error_never_a_hang(tmp_path):
    """A hot reload runs in the main thread, which also handles SIGTERM: a `cat` of a FIFO
    nobody writes to must not block it (the bad code never reloads again, nor exits), nor may
    /dev/zero be read without end.  The old hooks stay served."""
    fifo = tmp_path / "secret.fifo"
    os.mkfifo(fifo)
    hooks = tmp_path / "hooks.json"
    hooks.write_text('[{"id": "a", "execute-command": "/bin/echo", '
                     '"include-command-output-in-response": true}]')
    template = '[{"id": "b", "execute-command": "/bin/echo", ' \
               '"pass-arguments-to-command": [{"source": "string", "name": "{{ cat "%s" }}"}]}]'
    with start_daemon(hooks, "-template", "-hotreload", "-nopanic") as daemon:
        for path, count in ((fifo, 1), ("/dev/zero", 2)):
            hooks.write_text(template % path)
            wait_until(lambda: daemon.log().count("not a regular file") >= count,
                       what="the load error for %s" % path)
            assert daemon.request("GET", "/hooks/a", timeout=10)[::2] == (200, b"\n")
            assert daemon.request("GET", "/hooks/b", timeout=10)[0] == 404
        daemon.signal(signal.SIGTERM)
        assert daemon.proc.wait(10) == 0
