"""Attack suite for webhookd.py (issue 7): try to break it, black-box, over real HTTP.

What is attacked, and what must hold every time:
- malformed requests of every kind (bad request lines, huge headers, bad percent-encoding,
  non-UTF-8 query/header/body, truncated multipart, deeply nested JSON/XML, XML entity bombs,
  30 MiB bodies, chunked bodies, slow clients): a clean status from the documented set, the
  500/504 bodies exactly the documented ones, no traceback in any answer or in the log, and the
  server still answers the next request;
- a seeded random stream of hook definitions and requests sent to webhookd.py and to Debian's
  webhook (the oracle): same status, same body (which carries the argv), same hook headers;
- concurrent triggers (some clients hanging up mid-request, command timeouts, max-concurrency):
  every request answered with its own correct output, no zombie or stray process, no leaked file
  descriptor, temp file or thread, thread count bounded; pipelined requests answered in order;
- reload storms: the hooks file rewritten (in place, in chunks, by rename, by unlink and create,
  broken then fixed) and SIGHUP'd while requests flow: never a 404 or 5xx, never an older version
  after a newer one, the last version wins;
- SIGTERM while commands run: every one finishes and is answered, exit 0, pidfile removed;
- secrets: HMAC secrets and signature headers never in the logs (even with -debug), and every
  signature check goes through hmac.compare_digest (observed with a spy, no timing test);
- argv: shell metacharacters, newlines and --flag lookalikes arrive verbatim and never run a
  second command; a NUL byte or an over-long argument gets a clean error, never a truncation.

Each scenario is a plain function taking its counts and a seed, so bench/soak.py runs the same
code with the full counts. The seed comes from ATTACK_SEED (default fixed) and is printed in
every failure message.
"""
import ast
import contextlib
import hashlib
import hmac
import json
import os
import random
import re
import shutil
import signal
import socket
import string
import tempfile
import threading
import time
import http.client
import urllib.parse
from pathlib import Path

import pytest

import support

SEED = int(os.environ.get("ATTACK_SEED", "20261121"))

EXEC_500 = b"Error occurred while executing the hook's command. Please check your logs for more details."
RULES_500 = b"Error occurred while evaluating hook rules."
MULTIPART_500 = b"Error occurred while parsing multipart form."
TIMEOUT_504 = b"Hook command timed out."
MISMATCH = b"Hook rules were not satisfied."
NOT_FOUND_BODIES = {b"Hook not found.", b"404 page not found\n"}
# The only bodies a 500/504 may carry (webhook.md section 3, webhookd.md command-timeout).
DOCUMENTED_5XX = {500: {EXEC_500, RULES_500, MULTIPART_500}, 504: {TIMEOUT_504}}
LEAK_PATTERN = re.compile(rb'Traceback \(most recent call last\)|File "[^"]+", line \d+'
                          rb'|\b[A-Z][A-Za-z]*(?:Error|Exception)\b')

MIB = 1024 * 1024
# webhookd's own thread ceiling: a thread per connection served at once (-max-connections, 64 where
# a test floods it, the 30 slow clients otherwise), -max-async-runs 64 background runs, plus a few
# fixed ones (main, acceptor, logger); 32 is generous.
FLOOD_CONNECTIONS = 64
THREAD_BOUND = FLOOD_CONNECTIONS + 64 + 32


# ============================================================================
# Plumbing: raw HTTP, hooks files, daemons, /proc inspection
# ============================================================================

def raw_exchange(port, data, timeout=10.0, half_close=True):
    """Send raw bytes on a fresh connection, return every byte the server sent back."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                raise AssertionError(f"no end of answer within {timeout}s to {data[:80]!r}")
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def parse_responses(raw):
    """Split a byte stream into [(status, headers, body)]; fails on anything not HTTP/1.x."""
    responses = []
    while raw:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        assert sep, f"incomplete HTTP response: {raw[:200]!r}"
        lines = head.split(b"\r\n")
        match = re.match(rb"HTTP/1\.[01] (\d{3})(?: |$)", lines[0])
        assert match, f"not an HTTP/1.x status line: {lines[0][:100]!r}"
        status = int(match.group(1))
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers.setdefault(name.strip().lower().decode("latin-1"), value.strip().decode("latin-1"))
        if "content-length" in headers:
            length = int(headers["content-length"])
            body, raw = rest[:length], rest[length:]
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            body, raw = _dechunk(rest)
        elif status in (204, 304) or 100 <= status < 200:
            body, raw = b"", rest
        else:
            body, raw = rest, b""
        responses.append((status, headers, body))
    return responses


def _dechunk(data):
    body = b""
    while True:
        size_line, sep, data = data.partition(b"\r\n")
        assert sep, "truncated chunked body"
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            _, _, data = data.partition(b"\r\n")
            return body, data
        body += data[:size]
        data = data[size + 2:]


def http_request(port, method, path, body=None, headers=(), timeout=30.0):
    """One request on a fresh connection; headers is a list of pairs (duplicates allowed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers:
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


def build_request(method=b"GET", target=b"/hooks/ok", headers=b"", body=b"", version=b"HTTP/1.1",
                  content_length=True):
    head = method + b" " + target + b" " + version + b"\r\nHost: 127.0.0.1\r\n" + headers
    if body and content_length:
        head += b"Content-Length: %d\r\n" % len(body)
    return head + b"\r\n" + body


arg = support.hook_arg  # hooks below are built from many of these


# printf with the format "%s\0" prints each later argument followed by a NUL: the captured
# output is the argv, byte for byte (an argument itself can never hold a NUL).
ARGV_FORMAT = arg("string", "%s\\0")


def printf_hook(hook_id, *args, **fields):
    hook = {"id": hook_id, "execute-command": "/usr/bin/printf",
            "include-command-output-in-response": True,
            "pass-arguments-to-command": [ARGV_FORMAT, *args]}
    hook.update(fields)
    return hook


def argv_of(body):
    """The argv printed by a printf_hook, as a list of bytes."""
    assert body.endswith(b"\0"), f"not printf %s\\0 output: {body[:200]!r}"
    return body.split(b"\0")[:-1]


def write_hooks(path, hooks):
    Path(path).write_text(json.dumps(hooks, indent=1))


def start_webhookd(hooks_file, *flags, env=None, cwd=None, prefix=None):
    """webhookd.py on a free loopback port (prefix: argv before the script, e.g. a spy)."""
    port = support.free_port()
    argv = support.python_cmd(support.WEBHOOKD) if prefix is None else list(prefix)
    argv += ["-hooks", str(hooks_file), "-ip", "127.0.0.1", "-port", str(port), *flags]
    return support.Daemon(argv, port, env=env, cwd=cwd, timeout=20.0)


def proc_table():
    """{pid: (ppid, state, cmdline bytes)} of every process visible now."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        fields = stat.rsplit(b")", 1)[1].split()
        table[int(entry)] = (int(fields[1]), fields[0].decode(), cmdline)
    return table


def descendants(pid, table=None):
    """[(pid, state, cmdline)] of every process below pid."""
    table = proc_table() if table is None else table
    children = {}
    for child, (ppid, state, cmdline) in table.items():
        children.setdefault(ppid, []).append((child, state, cmdline))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child[0])
    return found


def processes_with(marker):
    """Processes anywhere whose command line contains marker (bytes)."""
    return [(pid, state, cmd) for pid, (_, state, cmd) in proc_table().items() if marker in cmd]


def fd_count(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def thread_count(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads line")


def poll(condition, timeout, interval=0.05):
    """True as soon as condition() is true, False after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def assert_no_leak(body, context):
    match = LEAK_PATTERN.search(body)
    assert match is None, f"{context}: internals leaked in the answer ({match.group(0)!r}): {body[:300]!r}"


def assert_log_clean(daemon, context, since=0):
    """No traceback in the daemon's log (from offset `since`: a shared daemon's earlier tests)."""
    log = daemon.log()[since:]
    assert "Traceback (most recent call last)" not in log, f"{context}: traceback in the log:\n{log[-3000:]}"


def assert_still_serving(daemon, context):
    assert daemon.proc.poll() is None, f"{context}: the server died (exit {daemon.proc.returncode})"
    status, _, body = http_request(daemon.port, "GET", "/hooks/ok")
    assert (status, body) == (200, b"fine"), f"{context}: the server stopped serving ({status} {body!r})"


@pytest.fixture
def workdir():
    with support.scratch_dir("webhookd-attack-") as path:
        yield path


# ============================================================================
# The shared target: one daemon with hooks that expose argv, env, files
# ============================================================================

def target_hooks(workdir):
    files = workdir / "files"
    files.mkdir(exist_ok=True)
    return [
        {"id": "ok", "execute-command": "/bin/true", "response-message": "fine"},
        printf_hook("argv", arg("url", "a"), arg("payload", "p"), arg("header", "X-A")),
        printf_hook("mp", arg("payload", "a")),
        printf_hook("ep", arg("entire-payload")),
        printf_hook("rawbody", arg("raw-request-body")),
        {"id": "touch", "execute-command": "/usr/bin/touch", "include-command-output-in-response": True,
         "pass-arguments-to-command": [arg("url", "f")]},
        {"id": "touch-async", "execute-command": "/usr/bin/touch", "response-message": "queued",
         "pass-arguments-to-command": [arg("url", "f")]},
        {"id": "env", "execute-command": "/usr/bin/printenv", "include-command-output-in-response": True,
         "pass-arguments-to-command": [arg("string", "HOOK_V")],
         "pass-environment-to-command": [arg("url", "a", envname="HOOK_V"), arg("payload", "p", envname="HOOK_V")]},
        {"id": "file", "execute-command": "/bin/sh", "include-command-output-in-response": True,
         "command-working-directory": str(files),
         "pass-arguments-to-command": [arg("string", "-c"), arg("string", 'cat "$HOOK_F"')],
         "pass-file-to-command": [arg("url", "a", envname="HOOK_F")]},
    ]


@contextlib.contextmanager
def running_target():
    """(daemon, its folder) serving target_hooks; both removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="webhookd-target-"))
    tmp = path / "tmp"
    tmp.mkdir()
    hooks = path / "hooks.json"
    write_hooks(hooks, target_hooks(path))
    try:
        with start_webhookd(hooks, "-verbose", env={"TMPDIR": str(tmp)}, cwd=path) as daemon:
            yield daemon, path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def target():
    with running_target() as pair:
        yield pair


# ============================================================================
# Malformed requests
# ============================================================================

def _argv_is(index, *accepted):
    def check(body):
        got = argv_of(body)[index]
        assert got in accepted, f"argv[{index}] is {got!r}, expected one of {accepted!r} (verbatim bytes)"
    return check


def _argv_hook_body(body):
    argv_of(body)


def _no_file_content(body):
    assert b"root:" not in body, f"an XML external entity was resolved: {body[:200]!r}"


def _multipart(body, content_type=b"multipart/form-data; boundary=XX"):
    return build_request(b"POST", b"/hooks/mp", b"Content-Type: " + content_type + b"\r\n", body)


def _json(body, target=b"/hooks/argv", content_type=b"application/json"):
    return build_request(b"POST", target, b"Content-Type: " + content_type + b"\r\n", body)


def _many_parts(count):
    parts = b"".join(b'--XX\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nv\r\n' % i for i in range(count))
    return parts + b"--XX--\r\n"


_LAUGHS = (b'<?xml version="1.0"?><!DOCTYPE r [<!ENTITY a "aaaaaaaaaa">'
           + b"".join(b'<!ENTITY %s "%s">' % (bytes([c]), (b"&" + bytes([c - 1]) + b";") * 10)
                      for c in range(ord("b"), ord("j")))
           + b"]><r>&i;</r>")
_XXE = b'<?xml version="1.0"?><!DOCTYPE r [<!ENTITY x SYSTEM "file:///etc/passwd">]><r>&x;</r>'

# (name, raw request, allowed statuses, silent close allowed, extra check of a 200 body)
# The allowed sets hold what Debian's webhook answers plus the 4xx a stricter server may give.
MALFORMED = [
    ("garbage request line", b"GARBAGE\r\n\r\n", {400}, False, None),
    ("request line without version", b"GET /hooks/ok\r\n\r\n", {400, 505}, False, None),
    ("unknown HTTP version", build_request(version=b"HTTP/9.9"), {400, 505}, False, None),
    ("HTTP/2.0 in text", build_request(version=b"HTTP/2.0"), {400, 505}, False, None),
    ("extra token in request line", b"GET /hooks/ok HTTP/1.1 extra\r\nHost: x\r\n\r\n", {400}, False, None),
    ("binary junk", b"\x00\xff\xfe\x16\x03\x01\x02\x00\r\n\r\n", {400}, False, None),
    ("TLS ClientHello", bytes.fromhex("16030100a5010000a10303") + bytes(range(160)), {400}, True, None),
    ("only CRLFs", b"\r\n\r\n\r\n", {400}, True, None),
    ("nothing at all", b"", set(), True, None),
    ("truncated request line", b"GET /hooks/ok HTT", {400}, True, None),
    ("truncated headers", b"GET /hooks/ok HTTP/1.1\r\nHost: x\r\nX-A: b", {400}, True, None),
    ("200 KiB request target", build_request(target=b"/hooks/ok?a=" + b"x" * 200_000), {200, 400, 414}, False, None),
    ("2 MiB header", build_request(headers=b"X-Big: " + b"y" * (2 * MIB) + b"\r\n"), {400, 431}, False, None),
    ("20000 headers", build_request(headers=b"".join(b"X-H%d: v\r\n" % i for i in range(20000))),
     {200, 400, 431}, False, None),
    ("header line without colon", build_request(headers=b"BadHeader\r\n"), {400}, False, None),
    ("space in header name", build_request(headers=b"Bad Name: v\r\n"), {400}, False, None),
    ("obs-fold continuation", build_request(headers=b"X-A: a\r\n b\r\n"), {200, 400}, False, None),
    ("NUL in a header value", build_request(target=b"/hooks/argv", headers=b"X-A: a\x00b\r\n"), {400, 500}, False, None),
    ("Content-Length not a number", build_request(b"POST", headers=b"Content-Length: abc\r\n"), {400}, False, None),
    ("negative Content-Length", build_request(b"POST", headers=b"Content-Length: -1\r\n"), {400}, False, None),
    ("two different Content-Lengths", build_request(b"POST", headers=b"Content-Length: 1\r\nContent-Length: 2\r\n",
                                                    body=b"ab", content_length=False), {400}, False, None),
    ("Content-Length and chunked together", build_request(
        b"POST", b"/hooks/rawbody", b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\n",
        content_length=False), {200, 400, 411, 501}, False, _argv_is(0, b"")),
    ("bad chunk size", build_request(b"POST", headers=b"Transfer-Encoding: chunked\r\n",
                                     body=b"zz\r\nabc\r\n0\r\n\r\n", content_length=False),
     {200, 400, 411, 501}, False, None),
    ("unknown transfer coding", build_request(b"POST", headers=b"Transfer-Encoding: gzip\r\n",
                                              body=b"xyz", content_length=False), {400, 411, 501}, False, None),
    ("%zz in the path", build_request(target=b"/hooks/%zz"), {400, 404}, False, None),
    ("lone % in the path", build_request(target=b"/hooks/%"), {400, 404}, False, None),
    ("truncated UTF-8 escape in the path", build_request(target=b"/hooks/%e2%82"), {400, 404}, False, None),
    ("raw 0xff in the path", build_request(target=b"/hooks/\xff"), {400, 404}, False, None),
    ("%00 in the hook id", build_request(target=b"/hooks/ok%00"), {400, 404}, False, None),
    ("%zz in the query", build_request(target=b"/hooks/argv?a=%zz"), {200, 400}, False, _argv_is(0, b"", b"%zz")),
    ("non-UTF-8 escapes in the query", build_request(target=b"/hooks/argv?a=%ff%fe"), {200, 400}, False,
     _argv_is(0, b"\xff\xfe")),
    ("raw 0xff byte in the query", build_request(target=b"/hooks/argv?a=\xff"), {200, 400}, False,
     _argv_is(0, b"\xff")),
    ("latin-1 byte in a header", build_request(target=b"/hooks/argv", headers=b"X-A: caf\xe9\r\n"), {200, 400}, False,
     _argv_is(2, b"caf\xe9")),
    ("non-UTF-8 form field", _json(b"p=%ff", content_type=b"application/x-www-form-urlencoded"), {200, 400}, False,
     _argv_is(1, b"\xff")),
    ("invalid UTF-8 in JSON", _json(b'{"p":"\xff\xfe"}'), {200, 400}, False, _argv_hook_body),
    ("lone surrogate escape in JSON", _json(b'{"p":"\\ud800"}'), {200, 400}, False, _argv_hook_body),
    ("NaN in JSON", _json(b'{"p":NaN}'), {200, 400}, False, _argv_hook_body),
    ("JSON string at the top", _json(b'"str"', b"/hooks/ep"), {200, 400}, False, _argv_hook_body),
    ("JSON number at the top", _json(b"5", b"/hooks/ep"), {200, 400}, False, _argv_hook_body),
    ("JSON null at the top", _json(b"null", b"/hooks/ep"), {200, 400}, False, _argv_hook_body),
    ("truncated JSON", _json(b'{"p": "abc', b"/hooks/argv"), {200, 400}, False, _argv_hook_body),
    ("JSON nested 100000 deep", _json(b"[" * 100_000 + b"]" * 100_000, b"/hooks/ep"), {200, 400}, False, None),
    ("JSON objects nested 5000 deep", _json(b'{"a":' * 5000 + b"1" + b"}" * 5000, b"/hooks/ep"),
     {200, 400, 500}, False, None),
    ("JSON unclosed 100000 deep", _json(b'{"a":[' * 100_000, b"/hooks/ep"), {200, 400}, False, None),
    ("XML nested 100000 deep", _json(b"<a>" * 100_000 + b"</a>" * 100_000, b"/hooks/ep", b"application/xml"),
     {200, 400, 500}, False, None),
    ("XML entity expansion bomb", _json(_LAUGHS, b"/hooks/ep", b"application/xml"), {200, 400}, False, None),
    ("XML external entity", _json(_XXE, b"/hooks/ep", b"application/xml"), {200, 400}, False, _no_file_content),
    ("truncated multipart", _multipart(b'--XX\r\nContent-Disposition: form-data; name="a"\r\n\r\nval'),
     {400, 500}, False, None),
    ("empty multipart", _multipart(b""), {400, 500}, False, None),
    ("multipart without delimiters", _multipart(b"hello world"), {400, 500}, False, None),
    ("multipart without boundary", _multipart(b"--XX\r\n\r\nv\r\n--XX--\r\n", b"multipart/form-data;"),
     {400, 500}, False, None),
    ("multipart with empty boundary", _multipart(b"--XX\r\n\r\nv\r\n--XX--\r\n", b"multipart/form-data; boundary="),
     {400, 500}, False, None),
    ("multipart part without headers", _multipart(b"--XX\r\n\r\nval\r\n--XX--\r\n"), {200, 400, 500}, False,
     _argv_hook_body),
    ("multipart JSON file part that is not JSON", _multipart(
        b'--XX\r\nContent-Disposition: form-data; name="a"; filename="f"\r\nContent-Type: application/json'
        b'\r\n\r\n{bad\r\n--XX--\r\n'), {200, 400, 500}, False, _argv_hook_body),
    ("multipart with 5000 parts", _multipart(_many_parts(5000)), {200, 400, 413, 500}, False, _argv_hook_body),
    ("multipart, well formed (control)", _multipart(
        b'--XX\r\nContent-Disposition: form-data; name="a"\r\n\r\nval\r\n--XX--\r\n'), {200}, False,
     _argv_is(0, b"val")),
    ("absolute-form target", build_request(target=b"http://127.0.0.1/hooks/ok"), {200, 400}, False, None),
    ("OPTIONS *", build_request(b"OPTIONS", b"*"), {200, 400, 404, 405}, False, None),
    ("CONNECT", build_request(b"CONNECT", b"127.0.0.1:80"), {301, 400, 404, 405, 501}, False, None),
    ("dot-dot in the path", build_request(target=b"/hooks/../hooks/ok"), {200, 301, 400, 404}, False, None),
    ("bare LF line endings", b"GET /hooks/ok HTTP/1.1\nHost: x\n\n", {200, 400}, False, None),
    ("HTTP/1.0 without Host", b"GET /hooks/ok HTTP/1.0\r\n\r\n", {200}, False, None),
    ("HTTP/1.1 without Host", b"GET /hooks/ok HTTP/1.1\r\n\r\n", {200, 400}, False, None),
    ("body shorter than Content-Length", b"POST /hooks/ok HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc",
     {200, 400}, True, None),
]


def check_malformed_case(daemon, name, data, allowed, silent_ok, check, seed=SEED):
    """One malformed request: a clean answer from the allowed set, and the server lives on."""
    context = f"[seed {seed}] malformed case {name!r}"
    raw = raw_exchange(daemon.port, data)
    if not raw:
        assert silent_ok, f"{context}: the server closed the connection without any answer"
    else:
        responses = parse_responses(raw)
        status, headers, body = responses[0]
        assert status in allowed, f"{context}: status {status} not in {sorted(allowed)}; body {body[:300]!r}"
        for later_status, _, later_body in responses:
            assert_no_leak(later_body, context)
            if later_status in DOCUMENTED_5XX:
                assert later_body in DOCUMENTED_5XX[later_status], \
                    f"{context}: undocumented {later_status} body {later_body[:300]!r}"
            if later_status == 404:
                assert later_body in NOT_FOUND_BODIES, f"{context}: undocumented 404 body {later_body[:300]!r}"
        assert all(s >= 400 for s, _, _ in responses[1:]), \
            f"{context}: the request was split into several that ran: {[s for s, _, _ in responses]}"
        if status == 200 and check is not None:
            try:
                check(body)
            except AssertionError as exc:
                raise AssertionError(f"{context}: {exc}") from None
    assert_still_serving(daemon, context)


def run_malformed(daemon, seed=SEED):
    """Every MALFORMED case once (all run, all failures reported); returns requests sent."""
    since = len(daemon.log())
    failures = []
    for name, data, allowed, silent_ok, check in MALFORMED:
        try:
            check_malformed_case(daemon, name, data, allowed, silent_ok, check, seed)
        except AssertionError as exc:
            failures.append(str(exc).split("\n")[0])
    assert not failures, f"{len(failures)} of {len(MALFORMED)} malformed cases failed:\n" + "\n".join(failures)
    assert_log_clean(daemon, f"[seed {seed}] malformed requests", since)
    return 2 * len(MALFORMED)


def test_malformed_requests_get_clean_answers(target):
    daemon, _ = target
    run_malformed(daemon)


def send_large_body(port, head, body_chunks, timeout=60.0):
    """Send head then the body chunks while reading the answer; returns the raw answer.

    The server may answer (413) and close before the body is sent: a failing send is fine,
    losing the answer is not.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        received = []
        reader_done = threading.Event()

        def reader():
            try:
                while True:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    received.append(chunk)
            except OSError:
                pass
            finally:
                reader_done.set()

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        try:
            sock.sendall(head)
            for chunk in body_chunks:
                if reader_done.is_set():
                    break
                sock.sendall(chunk)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        thread.join(timeout)
        return b"".join(received)


def run_oversized_bodies(daemon, workdir, seed=SEED):
    """30 MiB bodies, with Content-Length and chunked: 413 (or a refusal), the hook never runs."""
    since = len(daemon.log())
    context = f"[seed {seed}] 30 MiB body"
    block = b"x" * MIB
    marker = workdir / "big-body-ran"
    target = b"/hooks/touch?f=" + urllib.parse.quote(str(marker)).encode()
    head = build_request(b"POST", target, b"Content-Type: application/octet-stream\r\n"
                         b"Content-Length: %d\r\n" % (30 * MIB), content_length=False)
    raw = send_large_body(daemon.port, head, [block] * 30)
    assert raw, f"{context}: no answer (connection dropped without a 413)"
    status, _, body = parse_responses(raw)[0]
    assert status == 413, f"{context} with Content-Length: status {status}, body {body[:200]!r}"
    assert_no_leak(body, context)
    chunked_head = build_request(b"POST", target, b"Transfer-Encoding: chunked\r\n", content_length=False)
    chunk = b"%x\r\n" % len(block) + block + b"\r\n"
    raw = send_large_body(daemon.port, chunked_head, [chunk] * 30 + [b"0\r\n\r\n"])
    assert raw, f"{context} chunked: no answer"
    status, _, body = parse_responses(raw)[0]
    assert status in (400, 411, 413, 501), f"{context} chunked: status {status}, body {body[:200]!r}"
    assert_no_leak(body, context)
    # Expect: 100-continue: the refusal comes before the body is sent.
    expect_head = build_request(b"POST", target, b"Expect: 100-continue\r\nContent-Length: %d\r\n" % (40 * MIB),
                                content_length=False)
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=15) as sock:
        sock.sendall(expect_head)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413 "), f"{context} with Expect: 100-continue: {answer[:100]!r}"
    time.sleep(0.3)
    assert not marker.exists(), f"{context}: the hook ran although the body was refused"
    # Just under a small limit the same request is fine (the limit is not "any body").
    status, _, body = http_request(daemon.port, "POST", "/hooks/rawbody", body=b"z" * 1000)
    assert status == 200 and argv_of(body) == [b"z" * 1000], f"{context}: small body refused: {status}"
    assert_still_serving(daemon, context)
    assert_log_clean(daemon, context, since)
    return 3


def test_30_mib_bodies_are_refused_with_413(target):
    daemon, path = target
    run_oversized_bodies(daemon, path)


def run_slow_clients(workdir, connections=30, header_timeout=2):
    """Slowloris: connections trickling header bytes are closed after -read-header-timeout,
    while normal requests keep being served. Returns requests sent."""
    hooks = workdir / "hooks.json"
    write_hooks(hooks, [{"id": "ok", "execute-command": "/bin/true", "response-message": "fine"}])
    probes = 0
    with start_webhookd(hooks, "-verbose", "-read-header-timeout", str(header_timeout)) as daemon:
        slow = []
        for i in range(connections):
            sock = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
            if i % 4 == 0:
                sock.sendall(b"GET /hooks/ok HTTP/1.1\r\n")      # trickles below
            elif i % 4 == 1:   # one full request, then a second one trickled on the same connection
                sock.sendall(b"GET /hooks/ok HTTP/1.1\r\nHost: x\r\n\r\nGET /hooks/ok HTTP/1.1\r\n")
            elif i % 4 == 3:   # a body announced and never sent
                sock.sendall(b"POST /hooks/ok HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n0123456789")
            slow.append((sock, time.monotonic()))                  # i % 4 == 2: silent from the start
        closed_at = {}
        deadline = time.monotonic() + header_timeout + 8
        next_probe = 0.0
        while len(closed_at) < len(slow) and time.monotonic() < deadline:
            now = time.monotonic()
            if now >= next_probe:
                started = time.monotonic()
                status, _, body = http_request(daemon.port, "GET", "/hooks/ok", timeout=header_timeout + 5)
                probes += 1
                assert (status, body) == (200, b"fine")
                assert time.monotonic() - started < header_timeout + 4, "slow clients delayed a normal request"
                next_probe = now + 0.5
            for i, (sock, opened) in enumerate(slow):
                if i in closed_at:
                    continue
                try:
                    if i % 4 < 2:
                        sock.sendall(b"X")                         # one header byte at a time
                    sock.setblocking(False)
                    try:
                        data = sock.recv(65536)
                        while data:                                # drain answers (200, 408)
                            data = sock.recv(65536)
                        closed_at[i] = time.monotonic() - opened
                    except BlockingIOError:
                        pass
                    finally:
                        sock.setblocking(True)
                except (BrokenPipeError, ConnectionResetError):
                    closed_at[i] = time.monotonic() - opened
            time.sleep(0.25)
        for sock, _ in slow:
            sock.close()
        still_open = [i for i in range(len(slow)) if i not in closed_at]
        assert not still_open, (f"connections {still_open} (0: trickling headers, 1: trickling a 2nd keep-alive request, 2: silent, 3: stalled body) "
                                f"still open {header_timeout + 8}s after opening with -read-header-timeout "
                                f"{header_timeout}")
        assert max(closed_at.values()) <= header_timeout + 6, f"closed too late: {closed_at}"
        assert thread_count(daemon.proc.pid) <= THREAD_BOUND, \
            f"{thread_count(daemon.proc.pid)} threads after {connections} slow clients (bound {THREAD_BOUND})"
        assert_still_serving(daemon, "slow clients")
        assert_log_clean(daemon, "slow clients")
    return connections + probes


def test_slow_clients_time_out_and_do_not_block(workdir):
    run_slow_clients(workdir)


# ============================================================================
# argv: shell metacharacters, newlines, flag lookalikes, NUL, over-long arguments
# ============================================================================

def nasty_values(pwn_dir):
    """Values that a shell, a naive splitter or an option parser would misread."""
    return [
        f"; touch {pwn_dir}/pwned1", f"$(touch {pwn_dir}/pwned2)", f"`touch {pwn_dir}/pwned3`",
        f"| touch {pwn_dir}/pwned4", f"&& touch {pwn_dir}/pwned5", f"\ntouch {pwn_dir}/pwned6\n",
        f"> {pwn_dir}/pwned7", f"x; /usr/bin/touch {pwn_dir}/pwned8 #", "--help", "-rf", "--version",
        "--output=/etc/passwd", "-", "--", "'\"", "*", "~", "$HOME", "${IFS}", "\\", "a b\tc",
        "line1\nline2\r\nline3", "%s%n%x", "é€中\u2028", "", " leading and trailing ", "-e 'x'",
        "<script>&amp;", "a=b&c=d", "#fragment", "?q=1", "%00-not-a-nul", "%2F",
    ]


def run_argv_injection(daemon, workdir, seed=SEED):
    """Each nasty value through url, payload, header, form, env and file: verbatim, never a command."""
    rng = random.Random(seed)
    pwn_dir = workdir / "pwn"
    pwn_dir.mkdir(exist_ok=True)
    values = nasty_values(pwn_dir)
    rng.shuffle(values)
    sent = 0
    for value in values:
        context = f"[seed {seed}] value {value!r}"
        raw = value.encode()
        header_ok = "\n" not in value and "\r" not in value and value == value.strip()
        headers = [("X-A", value)] if header_ok else []
        query = "/hooks/argv?a=" + urllib.parse.quote(value, safe="")
        body = json.dumps({"p": value}).encode()
        status, _, out = http_request(daemon.port, "POST", query, body=body,
                                      headers=[("Content-Type", "application/json")] + headers)
        assert status == 200, f"{context}: status {status} {out[:200]!r}"
        assert argv_of(out) == [raw, raw, raw if header_ok else b""], f"{context}: argv {argv_of(out)!r}"
        form = urllib.parse.urlencode({"p": value}).encode()
        status, _, out = http_request(daemon.port, "POST", "/hooks/argv", body=form,
                                      headers=[("Content-Type", "application/x-www-form-urlencoded")])
        assert status == 200 and argv_of(out)[1] == raw, f"{context}: form argv {out[:200]!r}"
        status, _, out = http_request(daemon.port, "GET", "/hooks/env?a=" + urllib.parse.quote(value, safe=""))
        if value:
            assert (status, out) == (200, raw + b"\n"), f"{context}: env {status} {out[:200]!r}"
        status, _, out = http_request(daemon.port, "GET", "/hooks/file?a=" + urllib.parse.quote(value, safe=""))
        assert (status, out) == (200, raw), f"{context}: pass-file {status} {out[:200]!r}"
        sent += 4
    time.sleep(0.2)
    pwned = sorted(p.name for p in pwn_dir.iterdir())
    assert not pwned, f"[seed {seed}] a value ran as a command: {pwned}"
    return sent


def test_argv_values_are_verbatim_and_never_a_command(target):
    daemon, path = target
    since = len(daemon.log())
    run_argv_injection(daemon, path)
    assert_log_clean(daemon, "argv injection", since)


def run_nul_cases(daemon, path):
    """NUL bytes and over-long arguments: a clean error, never a truncated argument."""
    since = len(daemon.log())
    marker = path / "nul-marker"
    quoted = urllib.parse.quote(str(marker))
    cases = [
        ("NUL in a url argument", "GET", "/hooks/argv?a=x%00y", None, {400, 500}),
        ("NUL in a JSON argument", "POST", "/hooks/argv", b'{"p":"x\\u0000y"}', {400, 500}),
        ("NUL in an environment value", "GET", "/hooks/env?a=x%00y", None, {400, 500}),
        ("NUL cutting a path argument", "GET", f"/hooks/touch?f={quoted}%00tail", None, {400, 500}),
        ("300 KB argument", "POST", "/hooks/argv", json.dumps({"p": "y" * 300_000}).encode(), {400, 413, 500}),
    ]
    for name, method, path_q, body, allowed in cases:
        headers = [("Content-Type", "application/json")] if body else []
        status, _, out = http_request(daemon.port, method, path_q, body=body, headers=headers)
        assert status in allowed, f"{name}: status {status}, body {out[:200]!r} (a truncated argument ran?)"
        if status == 500:
            assert out == EXEC_500, f"{name}: undocumented 500 body {out[:200]!r}"
        assert_no_leak(out, name)
    status, _, out = http_request(daemon.port, "GET", f"/hooks/touch-async?f={quoted}2%00tail")
    assert status in (200, 400), f"async NUL: {status} {out!r}"
    time.sleep(0.5)
    leftovers = sorted(p.name for p in path.iterdir() if p.name.startswith("nul-marker"))
    assert not leftovers, f"a NUL-truncated argument ran: {leftovers}"
    # A file can carry a NUL: pass-file-to-command keeps it (or the request is refused whole).
    status, _, out = http_request(daemon.port, "GET", "/hooks/file?a=x%00y")
    assert (status, out) == (200, b"x\x00y") or status == 400, f"pass-file with NUL: {status} {out!r}"
    assert_still_serving(daemon, "NUL")
    assert_log_clean(daemon, "NUL", since)
    return len(cases) + 2


def test_nul_bytes_and_overlong_arguments_get_clean_errors(target):
    run_nul_cases(*target)


# ============================================================================
# Concurrent triggers
# ============================================================================

def concurrency_hooks(workdir, sleep_marker):
    for name in ("done", "files", "serial"):
        (workdir / name).mkdir(exist_ok=True)
    return [
        {"id": "ok", "execute-command": "/bin/true", "response-message": "fine"},
        printf_hook("cap", arg("url", "id")),
        {"id": "file", "execute-command": "/bin/sh", "include-command-output-in-response": True,
         "command-working-directory": str(workdir / "files"),
         "pass-arguments-to-command": [arg("string", "-c"), arg("string", 'cat "$HOOK_F"')],
         "pass-file-to-command": [arg("payload", "p", envname="HOOK_F")]},
        {"id": "async", "execute-command": "/usr/bin/touch", "response-message": "queued",
         "pass-arguments-to-command": [arg("url", "f")]},
        # max-concurrency 1: two runs at once would find the lock directory taken and exit 7.
        {"id": "serial", "execute-command": "/bin/sh", "include-command-output-in-response": True,
         "command-working-directory": str(workdir / "serial"), "max-concurrency": 1,
         "pass-arguments-to-command": [arg("string", "-c"),
                                       arg("string", "mkdir lock || exit 7; sleep 0.02; rmdir lock; printf ok")]},
        {"id": "slow", "execute-command": "/usr/bin/sleep", "include-command-output-in-response": True,
         "command-timeout": 1, "pass-arguments-to-command": [arg("string", sleep_marker)]},
        {"id": "stubborn", "execute-command": "/bin/sh", "include-command-output-in-response": True,
         "command-timeout": 1,
         "pass-arguments-to-command": [arg("string", "-c"),
                                       arg("string", f"trap '' TERM; /usr/bin/sleep {sleep_marker}; exit 0")]},
    ]


def run_concurrent_triggers(workdir, n, seed=SEED):
    """n triggers released at once; returns stats. Raises AssertionError on any violation."""
    rng = random.Random(seed)
    sleep_marker = f"29.{rng.randint(1000, 9999)}"
    hooks = workdir / "hooks.json"
    write_hooks(hooks, concurrency_hooks(workdir, sleep_marker))
    tmp = workdir / "tmp"
    tmp.mkdir(exist_ok=True)
    plan = ["slow", "stubborn"]
    kinds = ["cap"] * 4 + ["file"] * 3 + ["async"] * 3 + ["serial", "abort"]
    plan += [rng.choice(kinds) for _ in range(n - len(plan))]
    rng.shuffle(plan)
    with start_webhookd(hooks, "-verbose", "-max-connections", str(FLOOD_CONNECTIONS),
                        env={"TMPDIR": str(tmp)}, cwd=workdir) as daemon:
        pid = daemon.proc.pid
        for _ in range(3):
            assert_still_serving(daemon, "warm-up")
        base_fds, base_threads = fd_count(pid), thread_count(pid)
        results = [None] * n
        barrier = threading.Barrier(n + 1)
        stop_sampling = threading.Event()
        peak = [base_threads]

        def sampler():
            while not stop_sampling.is_set():
                try:
                    peak[0] = max(peak[0], thread_count(pid))
                except (OSError, AssertionError):
                    pass
                time.sleep(0.01)

        tokens = [f"{kind}-{i}-{rng.getrandbits(32):08x}" for i, kind in enumerate(plan)]

        def client(i):
            kind, token = plan[i], tokens[i]
            try:
                barrier.wait(60)
                if kind == "cap":
                    results[i] = (kind, token, http_request(daemon.port, "GET", "/hooks/cap?id=" + token, timeout=120))
                elif kind == "file":
                    body = json.dumps({"p": token + "\n\u00e9$(x)"}).encode()
                    results[i] = (kind, token, http_request(daemon.port, "POST", "/hooks/file", body=body, timeout=120,
                                                            headers=[("Content-Type", "application/json")]))
                elif kind == "async":
                    path = urllib.parse.quote(str(workdir / "done" / token))
                    results[i] = (kind, token, http_request(daemon.port, "GET", "/hooks/async?f=" + path, timeout=120))
                elif kind == "abort":   # send a pass-file request and hang up without reading
                    body = json.dumps({"p": token}).encode()
                    with socket.create_connection(("127.0.0.1", daemon.port), timeout=60) as sock:
                        sock.sendall(build_request(b"POST", b"/hooks/file", b"Content-Type: application/json\r\n",
                                                   body))
                    results[i] = (kind, token, None)
                else:
                    results[i] = (kind, token, http_request(daemon.port, "GET", "/hooks/" + kind, timeout=120))
            except Exception as exc:  # noqa: BLE001 - every failure is reported below
                results[i] = (kind, token, exc)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        sampling = threading.Thread(target=sampler)
        sampling.start()
        started = time.monotonic()
        barrier.wait(60)
        for t in threads:
            t.join(180)
        elapsed = time.monotonic() - started
        stop_sampling.set()
        sampling.join()

        problems = []
        for kind, token, outcome in results:
            if kind == "abort" and outcome is None:
                continue
            if isinstance(outcome, Exception):
                problems.append(f"{kind} {token}: {outcome!r}")
                continue
            status, _, body = outcome
            expected = {
                "cap": (200, token.encode() + b"\0"),
                "file": (200, (token + "\n\u00e9$(x)").encode()),
                "async": (200, b"queued"),
                "serial": (200, b"ok"),
                "slow": (504, TIMEOUT_504),
                "stubborn": (504, TIMEOUT_504),
            }[kind]
            if (status, body) != expected:
                problems.append(f"{kind} {token}: got {status} {body[:120]!r}, expected {expected[0]} {expected[1][:60]!r}")
        context = f"[seed {seed}] {n} concurrent triggers"
        assert not problems, f"{context}: {len(problems)} wrong answers, e.g. {problems[:5]}"
        async_tokens = [token for kind, token, _ in results if kind == "async"]
        assert poll(lambda: all((workdir / "done" / t).exists() for t in async_tokens), 60), \
            f"{context}: async commands never ran: {[t for t in async_tokens if not (workdir / 'done' / t).exists()][:5]}"
        marker = sleep_marker.encode()
        assert poll(lambda: not descendants(pid) and not processes_with(marker), 30), \
            f"{context}: processes left: {descendants(pid)[:5]} {processes_with(marker)[:5]}"
        assert poll(lambda: fd_count(pid) <= base_fds + 2, 15), \
            f"{context}: file descriptors leaked: {base_fds} before, {fd_count(pid)} after"
        assert poll(lambda: not list((workdir / "files").iterdir()) and not list(tmp.iterdir()), 15), \
            f"{context}: temp files left: {list((workdir / 'files').iterdir())[:5]} {list(tmp.iterdir())[:5]}"
        assert peak[0] <= THREAD_BOUND, f"{context}: thread count not bounded: peak {peak[0]} > {THREAD_BOUND}"
        assert thread_count(pid) <= THREAD_BOUND, f"{context}: {thread_count(pid)} threads after the burst"
        assert_still_serving(daemon, context)
        assert_log_clean(daemon, context)
        return {"requests": n, "seconds": round(elapsed, 2), "peak_threads": peak[0],
                "baseline_threads": base_threads}


def test_200_concurrent_triggers(workdir):
    run_concurrent_triggers(workdir, 200)


def run_graceful_stop(workdir, n=20, seed=SEED):
    """SIGTERM while n captured commands run: each still answered, exit 0, nothing left behind."""
    marker = f"2.{random.Random(seed).randint(100000, 999999)}"   # seconds: long enough to see all n run
    hooks = workdir / "stop.json"
    write_hooks(hooks, [{"id": "work", "execute-command": "/bin/sh", "include-command-output-in-response": True,
                         "pass-arguments-to-command": [arg("string", "-c"),
                                                       arg("string", f"/usr/bin/sleep {marker}; printf done")]}])
    pidfile = workdir / "run" / "webhookd.pid"
    daemon = start_webhookd(hooks, "-verbose", "-pidfile", str(pidfile))
    try:
        results = [None] * n
        barrier = threading.Barrier(n + 1)

        def client(i):
            barrier.wait(30)
            try:
                results[i] = http_request(daemon.port, "GET", "/hooks/work", timeout=60)[::2]
            except Exception as exc:  # noqa: BLE001
                results[i] = repr(exc)

        pool = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for t in pool:
            t.start()
        barrier.wait(30)
        assert poll(lambda: len(processes_with(marker.encode())) >= n, 20), "the commands did not all start"
        daemon.signal(signal.SIGTERM)
        for t in pool:
            t.join(90)
        code = daemon.proc.wait(60)
        log = daemon.log()
    finally:
        daemon.__exit__(None, None, None)
    context = f"[seed {seed}] SIGTERM during {n} running commands"
    assert all(r == (200, b"done") for r in results), f"{context}: answers {results}"
    assert code == 0, f"{context}: exit status {code}"
    assert not pidfile.exists(), f"{context}: pidfile left behind"
    assert poll(lambda: not processes_with(marker.encode()), 10), f"{context}: commands left running"
    assert "Traceback (most recent call last)" not in log, f"{context}:\n{log[-2000:]}"
    return n


def test_sigterm_lets_running_commands_finish(workdir):
    run_graceful_stop(workdir, 10)


def run_pipelining(daemon, count=60):
    """Requests pipelined on one keep-alive connection: every answer, in order, each its own."""
    wanted, data = [], b""
    for i in range(count):
        if i % 3 == 0:
            data += build_request(target=b"/hooks/ok")
            wanted.append((200, b"fine"))
        elif i % 3 == 1:
            data += build_request(target=b"/hooks/argv?a=%d" % i)
            wanted.append((200, b"%d\0\0\0" % i))
        else:
            body = b'{"p":"%d"}' % i
            data += build_request(b"POST", b"/hooks/argv", b"Content-Type: application/json\r\n", body)
            wanted.append((200, b"\0%d\0\0" % i))
    got = [(status, body) for status, _, body in parse_responses(raw_exchange(daemon.port, data, timeout=60))]
    assert got == wanted, f"pipelined answers differ: {len(got)} of {count}, first difference at " \
        f"{next((i for i, (g, w) in enumerate(zip(got, wanted)) if g != w), len(got))}"
    return count


def test_pipelined_requests_answered_in_order(target):
    run_pipelining(target[0])


# ============================================================================
# Reload storms
# ============================================================================

STORM_HOOKS = 10


def storm_version(version):
    """Hooks file of one version: every hook answers the version; only-<v> exists only in it."""
    message = f"v{version:05d}"
    hooks = [{"id": f"h{i}", "execute-command": "/bin/true", "response-message": message}
             for i in range(STORM_HOOKS)]
    hooks.append({"id": f"only-{version}", "execute-command": "/bin/true", "response-message": message})
    hooks.append(printf_hook("captured", arg("string", message)))   # a command run across reloads
    hooks += [{"id": f"pad{i}", "execute-command": "/bin/true", "response-message": "p" * 100}
              for i in range(40)]   # a file of ~10 KB: several writes, several reads
    return json.dumps(hooks, indent=1).encode()


def rewrite(path, data, mode, rng):
    """Replace the hooks file the way editors, git and deploy tools do."""
    if mode == "recreate":        # git checkout: unlink, then create anew
        path.unlink()
        time.sleep(rng.uniform(0, 0.02))
        path.write_bytes(data)
    elif mode == "broken":        # a bad edit first (old hooks must keep serving), then the fix
        path.write_bytes(data[: len(data) // 2])
        time.sleep(rng.uniform(0, 0.03))
        path.write_bytes(data)
    elif mode == "rename":
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    elif mode == "chunked":
        with open(path, "wb") as f:
            cut = rng.randint(1, len(data) - 1)
            f.write(data[:cut])
            f.flush()
            time.sleep(rng.uniform(0, 0.01))
            f.write(data[cut:])
    else:
        with open(path, "wb") as f:
            f.write(data)


def run_reload_storm(workdir, rewrites, seed=SEED, clients=4):
    rng = random.Random(seed)
    hooks = workdir / "storm.json"
    hooks.write_bytes(storm_version(0))
    context = f"[seed {seed}] reload storm"
    with start_webhookd(hooks, "-hotreload", "-verbose") as daemon:
        written = [0]
        stop = threading.Event()
        violations, counts = [], [0] * clients

        def client(k):
            crng = random.Random(seed * 100 + k)
            last = 0
            while not stop.is_set():
                hook = "captured" if crng.random() < 0.1 else f"h{crng.randrange(STORM_HOOKS)}"
                try:
                    status, _, body = http_request(daemon.port, "GET", "/hooks/" + hook, timeout=20)
                except Exception as exc:  # noqa: BLE001
                    violations.append(f"client {k}: {exc!r}")
                    return
                counts[k] += 1
                match = re.fullmatch(rb"v(\d{5})\0?", body)
                if status != 200 or not match:
                    violations.append(f"client {k} {hook}: {status} {body[:80]!r}")
                    continue
                version = int(match.group(1))
                if version < last:
                    violations.append(f"client {k} {hook}: saw v{version} after v{last} (half-loaded state)")
                if version > written[0]:
                    violations.append(f"client {k}: version {version} before it was written")
                last = version

        threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        for t in threads:
            t.start()
        modes = ["inplace", "chunked", "rename", "recreate", "broken"]
        try:
            for version in range(1, rewrites + 1):
                time.sleep(rng.uniform(0, 0.08))
                written[0] = version
                rewrite(hooks, storm_version(version), rng.choice(modes), rng)
                if rng.random() < 0.2:
                    daemon.signal(signal.SIGHUP)
            last = rewrites
            expected = f"v{last:05d}".encode()

            def converged():
                answers = [http_request(daemon.port, "GET", f"/hooks/h{i}")[::2] for i in range(STORM_HOOKS)]
                return (all(a == (200, expected) for a in answers)
                        and http_request(daemon.port, "GET", f"/hooks/only-{last}")[0] == 200
                        and http_request(daemon.port, "GET", f"/hooks/only-{last - 1}")[0] == 404)

            assert poll(converged, 10, 0.1), f"{context}: the last version (v{last}) never won"
            time.sleep(0.3)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not violations, f"{context}: {len(violations)} violations, e.g. {violations[:6]}"
        assert sum(counts) > 0
        assert_log_clean(daemon, context)
        return {"requests": sum(counts), "rewrites": rewrites}


def test_reload_storm_30_rewrites(workdir):
    run_reload_storm(workdir, 30)


# ============================================================================
# Secrets: never logged, always compared with hmac.compare_digest
# ============================================================================

SPY = '''
import hmac, runpy, secrets, sys, threading
_real = hmac.compare_digest
_lock = threading.Lock()
_log = open(sys.argv[1], "a")
def _spy(a, b):
    result = _real(a, b)
    with _lock:
        _log.write(repr((a, b, result)) + "\\n")
        _log.flush()
    return result
hmac.compare_digest = _spy
secrets.compare_digest = _spy
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def _as_text(value):
    return value.decode("latin-1") if isinstance(value, (bytes, bytearray)) else str(value)


def run_secrets(workdir, seed=SEED):
    """Signed and token-guarded hooks under -verbose -debug -logfile and a compare_digest spy;
    returns requests sent."""
    rng = random.Random(seed)
    secrets_ = {algo: f"S3cr3t-{algo}-{rng.getrandbits(64):016x}" for algo in ("sha1", "sha256", "sha512")}
    token = f"T0ken-{rng.getrandbits(64):016x}"
    hooks = [{"id": f"gh-{algo}", "execute-command": "/bin/true", "response-message": "signed",
              "trigger-rule": {"match": {"type": f"payload-hmac-{algo}", "secret": secret,
                                         "parameter": arg("header", f"X-Sig-{algo}")}}}
             for algo, secret in secrets_.items()]
    hooks.append({"id": "tok", "execute-command": "/bin/true", "response-message": "token ok",
                  "trigger-rule": {"match": {"type": "value", "value": token, "parameter": arg("header", "X-Token")}}})
    hooks.append({"id": "ok", "execute-command": "/bin/true", "response-message": "fine"})
    hooks_file = workdir / "hooks.json"
    write_hooks(hooks_file, hooks)
    spy_script, spy_log, log_file = workdir / "spy.py", workdir / "spy.log", workdir / "webhookd.log"
    spy_script.write_text(SPY)
    prefix = support.python_cmd(spy_script, str(spy_log), str(support.WEBHOOKD))
    sent_secrets = set(secrets_.values()) | {token}
    expected_calls = []
    with start_webhookd(hooks_file, "-verbose", "-debug", "-logfile", str(log_file), prefix=prefix) as daemon:
        for algo, secret in secrets_.items():
            body = json.dumps({"ref": "refs/heads/main", "n": rng.random()}).encode()
            good = hmac.new(secret.encode(), body, getattr(hashlib, algo)).hexdigest()
            bad = hmac.new(b"wrong", body, getattr(hashlib, algo)).hexdigest()
            for signature, expected in ((f"{algo}={good}", (200, b"signed")), (good, (200, b"signed")),
                                        (f"{algo}={bad}", (500, RULES_500)), (bad.upper(), (500, RULES_500))):
                status, _, out = http_request(daemon.port, "POST", f"/hooks/gh-{algo}", body=body,
                                              headers=[("Content-Type", "application/json"),
                                                       (f"X-Sig-{algo}", signature)])
                assert (status, out) == expected, f"{algo} signature {signature[:20]}...: {status} {out!r}"
                sent_secrets |= {signature, signature.split("=")[-1]}
                expected_calls.append(signature.split("=")[-1])
            sent_secrets.add(good)
            status, _, out = http_request(daemon.port, "POST", f"/hooks/gh-{algo}", body=body,
                                          headers=[("Content-Type", "application/json")])
            assert (status, out) == (200, MISMATCH), f"{algo} without signature: {status} {out!r}"
        for value, expected in ((token, (200, b"token ok")), ("wrong-" + token[::-1], (200, MISMATCH))):
            status, _, out = http_request(daemon.port, "GET", "/hooks/tok", headers=[("X-Token", value)])
            assert (status, out) == expected, f"token {value[:8]}...: {status} {out!r}"
            sent_secrets.add(value)
            expected_calls.append(value)
        time.sleep(0.3)
        logs = daemon.log() + (log_file.read_text(errors="replace") if log_file.exists() else "")
    leaked = sorted(s for s in sent_secrets if s and s in logs)
    assert not leaked, f"secrets or signature values in the logs: {[s[:24] + '...' for s in leaked]}"
    calls = [ast.literal_eval(line) for line in spy_log.read_text().splitlines()] if spy_log.exists() else []
    compared = {_as_text(x).split("=")[-1] for a, b, _ in calls for x in (a, b)}
    compared |= {bytes(x).hex() for a, b, _ in calls for x in (a, b) if isinstance(x, (bytes, bytearray))}
    missing = [v[:24] + "..." for v in expected_calls if v not in compared and v.lower() not in compared]
    assert not missing, (f"these presented signatures/tokens never reached hmac.compare_digest "
                         f"(a non-constant-time comparison?): {missing}; {len(calls)} calls seen")
    # The source must not compare digests with == either (belt and braces for the spy).
    tree = ast.parse(Path(support.WEBHOOKD).read_text())
    offenders = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
            for operand in [node.left, *node.comparators]:
                if (isinstance(operand, ast.Call) and isinstance(operand.func, ast.Attribute)
                        and operand.func.attr in ("hexdigest", "digest")):
                    offenders.append(node.lineno)
    assert not offenders, f"webhookd.py compares a digest with ==/!= at lines {offenders}"
    return len(expected_calls) + 3


def test_secrets_never_logged_and_compared_in_constant_time(workdir):
    run_secrets(workdir)


# ============================================================================
# Differential stream against Debian's webhook
# ============================================================================

TEXT = string.ascii_letters + string.digits + " -_.,:;!?@#$%^*()[]{}'\"\\|/~`=+\t" + "é中€ß"
HEADER_TEXT = string.ascii_letters + string.digits + "-_.,:;!?@#$%^*()[]{}'\"\\|/~`=+ "
NUMBER_TOKENS = ["1.50", "12345678901234567890", "-3", "0.1", "1e3", "0", "true", "false"]
REGEXES = ["^a", "b$", "[0-9]+", "x|y", "^$", "é", "(?i)abc", "^[a-z]+$", "a("]
SOURCES_URL = ["a", "b", "c"]
SOURCES_HEADER = ["X-Alpha", "x-beta-two", "X-GAMMA"]
SOURCES_PAYLOAD = ["a", "b", "n", "obj", "obj.k", "list.0", "list.1.id", "c.d", "root.0.x", "missing", "f.k"]
STATUS_CODES = [200, 201, 202, 299, 400, 403, 418, 425, 451, 500, 503, 999]
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "FOO", "post", "HEAD", "OPTIONS"]
# Flags given to both runners of one differential run (prefix, default methods, global header).
GLOBAL_FLAGS = [("hooks", []), ("hooks", ["-header", "X-Global=g=1"]), ("api/v1", []), ("", []),
                ("hooks", ["-http-methods", "post, Get"])]


def rand_text(rng, alphabet=TEXT, lo=0, hi=12):
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


class HookStream:
    """Seeded generator of hook definitions and of requests aimed at them."""

    def __init__(self, seed, workdir):
        self.rng = random.Random(seed)
        self.workdir = workdir

    def param(self):
        rng = self.rng
        source = rng.choice(["url", "header", "payload"])
        name = rng.choice({"url": SOURCES_URL, "header": SOURCES_HEADER, "payload": SOURCES_PAYLOAD}[source])
        return arg(source, name)

    def argument(self):
        rng = self.rng
        roll = rng.random()
        if roll < 0.6:
            return self.param()
        return rng.choice([arg("string", rand_text(rng)), arg("request", "method"), arg("raw-request-body"),
                           arg("entire-query"), arg("entire-payload"), arg("entire-headers")])

    def match(self, leaves):
        rng = self.rng
        kind = rng.choices(["value", "regex", "hmac", "ip"], weights=[6, 3, 2, 1])[0]
        if kind == "value":
            param, value = self.param(), rng.choice([rand_text(rng, lo=1, hi=6)] + NUMBER_TOKENS[:3])
            leaves.append((param, value))
            return {"type": "value", "value": value, "parameter": param}
        if kind == "regex":
            param = self.param()
            leaves.append((param, rng.choice(["abc", "xyz", "a9", "", "é", "ABC", "b"])))
            return {"type": "regex", "regex": rng.choice(REGEXES), "parameter": param}
        if kind == "hmac":
            algo = rng.choice(["sha1", "sha256", "sha512"])
            secret = rng.choice(["k1", "k2", "k3", ""])
            param = arg("header", f"X-Sig-{algo}")
            leaves.append((param, ("hmac", algo, secret)))
            return {"type": f"payload-hmac-{algo}", "secret": secret, "parameter": param}
        return {"type": "ip-whitelist", "ip-range": rng.choice(
            ["127.0.0.1", "127.0.0.0/8", "10.0.0.0/8", "10.0.0.0/8 127.0.0.1/32", "192.168.0.0/16"])}

    def rule(self, depth, leaves):
        rng = self.rng
        roll = rng.random()
        if depth < 2 and roll < 0.3:
            return {rng.choice(["and", "or"]): [self.rule(depth + 1, leaves) for _ in range(rng.randint(1, 3))]}
        if depth < 2 and roll < 0.4:
            return {"not": self.rule(depth + 1, leaves)}
        return {"match": self.match(leaves)}

    def hook(self, hook_id):
        rng = self.rng
        leaves = []
        hook = {"id": hook_id}
        kind = rng.choices(["printf", "false", "missing", "relative", "printenv", "spaced"],
                           weights=[10, 1, 1, 1, 2, 1])[0]
        args = [self.argument() for _ in range(rng.randint(0, 4))]
        if kind == "printf":
            hook["execute-command"] = "/usr/bin/printf"
            args = [ARGV_FORMAT] + args
        elif kind == "false":
            hook["execute-command"] = "/bin/false"
        elif kind == "missing":
            hook["execute-command"] = "/nonexistent/command"
        elif kind == "relative":
            hook["execute-command"] = "printf"
            args = [ARGV_FORMAT] + args
            if rng.random() < 0.5:
                hook["command-working-directory"] = str(self.workdir)
        elif kind == "spaced":
            hook["execute-command"] = "/usr/bin/printf x"
        else:
            hook["execute-command"] = "/usr/bin/printenv"
            names = [f"HOOK_E{i}" for i in range(rng.randint(1, 3))]
            args = [arg("string", n) for n in names]
            hook["pass-environment-to-command"] = [dict(self.param(), envname=n) for n in names]
        hook["pass-arguments-to-command"] = args
        if rng.random() < 0.7:
            hook["include-command-output-in-response"] = True
            if rng.random() < 0.4:
                hook["include-command-output-in-response-on-error"] = True
        if rng.random() < 0.4:
            hook["response-message"] = rand_text(rng, lo=1)
        if rng.random() < 0.3:
            hook["success-http-response-code"] = rng.choice(STATUS_CODES)
        if rng.random() < 0.3:
            hook["trigger-rule-mismatch-http-response-code"] = rng.choice(STATUS_CODES)
        if rng.random() < 0.3:
            hook["http-methods"] = rng.choice([["POST"], ["get ", " Put"], [], ["FOO", "GET"]])
        if rng.random() < 0.25:
            hook["response-headers"] = [{"name": "X-Hook", "value": rand_text(rng, HEADER_TEXT, 1).strip() or "v"}]
        if rng.random() < 0.2:
            hook["parse-parameters-as-json"] = [arg("url", "j")]
            hook["pass-arguments-to-command"] = hook["pass-arguments-to-command"] + [arg("url", "j.k")]
        if rng.random() < 0.6:
            hook["trigger-rule"] = self.rule(0, leaves)
        return hook, leaves

    def value_for(self, wanted):
        rng = self.rng
        if wanted is not None and rng.random() < 0.65:
            return wanted
        return rand_text(rng, lo=0, hi=8)

    def payload_text(self, wants):
        """A JSON text written by hand so numbers stay exactly as written."""
        rng = self.rng

        def scalar(want=None):
            if want is not None and not isinstance(want, tuple) and rng.random() < 0.65:
                return want if want in NUMBER_TOKENS else json.dumps(want, ensure_ascii=False)
            if rng.random() < 0.3:
                return rng.choice(NUMBER_TOKENS)
            return json.dumps(rand_text(rng), ensure_ascii=False)

        fields = {
            "a": scalar(wants.get("a")), "b": scalar(wants.get("b")), "n": rng.choice(NUMBER_TOKENS),
            "obj": '{"k":%s,"z":%s}' % (scalar(wants.get("obj.k")), rng.choice(NUMBER_TOKENS)),
            "list": "[%s,{\"id\":%s}]" % (scalar(wants.get("list.0")), scalar(wants.get("list.1.id"))),
            "c.d": scalar(wants.get("c.d")), "c": '{"d":%s}' % scalar(),
        }
        chosen = [k for k in fields if rng.random() < 0.8]
        return "{" + ",".join(f"{json.dumps(k)}:{fields[k]}" for k in chosen) + "}"

    def request(self, hook_id, leaves, prefix="/hooks", allowed_methods=()):
        rng = self.rng
        wants = {"url": {}, "header": {}, "payload": {}}
        hmacs = []
        for param, value in leaves:
            if isinstance(value, tuple):
                hmacs.append(value)
            else:
                wants[param["source"]][param["name"]] = value
        query = []
        for name in SOURCES_URL:
            if rng.random() < 0.7:
                query.append((name, self.value_for(wants["url"].get(name))))
        if rng.random() < 0.2 and query:
            query.append((query[0][0], "second-value"))
        if rng.random() < 0.3:
            query.append(("j", rng.choice([json.dumps({"k": rand_text(rng), "z": 1}, ensure_ascii=False),
                                           "[1,2]", "{bad", '"str"', '{"k":{"x":[1,2.50]}}'])))
        quoter = rng.choice([urllib.parse.quote, urllib.parse.quote_plus])
        query_text = "&".join(f"{quoter(k, safe='')}={quoter(v, safe='')}" for k, v in query)
        headers = []
        for name in SOURCES_HEADER:
            if rng.random() < 0.7:
                value = self.value_for(wants["header"].get(name))
                value = "".join(ch for ch in value if ch in HEADER_TEXT).strip()
                headers.append((rng.choice([name, name.upper(), name.lower()]), value))
        body_kind = rng.choice(["none", "json", "json", "array", "form", "text", "scalar", "multipart"])
        body = None
        if body_kind == "json":
            body = self.payload_text(wants["payload"]).encode()
            headers.append(("Content-Type", rng.choice(["application/json", "application/json; charset=utf-8"])))
        elif body_kind == "array":
            body = ('[{"x":%s}]' % json.dumps(self.value_for(wants["payload"].get("root.0.x")),
                                               ensure_ascii=False)).encode()
            headers.append(("Content-Type", "application/json"))
        elif body_kind == "form":
            form = [(k, self.value_for(wants["payload"].get(k))) for k in ("a", "b", "c.d") if rng.random() < 0.8]
            body = urllib.parse.urlencode(form).encode()
            headers.append(("Content-Type", "application/x-www-form-urlencoded"))
        elif body_kind == "text":
            body = rand_text(rng).encode()
            headers.append(("Content-Type", "text/plain"))
        elif body_kind == "scalar":
            body = rng.choice([b'"str"', b"5", b"null", b"[]"])
            headers.append(("Content-Type", "application/json"))
        elif body_kind == "multipart":
            boundary = "B%08x" % rng.getrandbits(32)
            parts = []
            for name in ("a", "b", "c.d"):
                if rng.random() < 0.7:
                    value = self.value_for(wants["payload"].get(name))
                    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n')
            if rng.random() < 0.5:   # a JSON file part: decoded, so f.k reaches inside it
                inner = rng.choice([json.dumps({"k": rand_text(rng)}, ensure_ascii=False), "{bad", "[1]"])
                parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="f"; filename="f.json"\r\n'
                             f'Content-Type: application/json\r\n\r\n{inner}\r\n')
            body = ("".join(parts) + f"--{boundary}--\r\n").encode()
            headers.append(("Content-Type", f"multipart/form-data; boundary={boundary}"))
        for _, algo, secret in hmacs:
            roll = rng.random()
            digest = hmac.new(secret.encode(), body or b"", getattr(hashlib, algo)).hexdigest()
            name = rng.choice([f"X-Sig-{algo}", f"x-sig-{algo}", f"X-SIG-{algo.upper()}"])
            if roll < 0.45:
                headers.append((name, f"{algo}={digest}"))
            elif roll < 0.55:
                headers.append((name, digest))
            elif roll < 0.65:
                headers.append((name, f"{algo}=00{digest[2:]},{algo}={digest}"))
            elif roll < 0.85:
                headers.append((name, f"{algo}={'0' * len(digest)}"))
        method = rng.choice(METHODS)
        if allowed_methods and rng.random() < 0.6:
            method = rng.choice(allowed_methods).strip().upper()
        quoted_id = urllib.parse.quote(hook_id, safe="/" if rng.random() < 0.7 else "")
        path = f"{prefix}/{quoted_id}" + (f"?{query_text}" if query_text else "")
        return method, path, body, headers


def generate_stream(seed, workdir, n_hooks):
    """(hooks, [(hook, request)], runner flags) of one differential run."""
    stream = HookStream(seed, workdir)
    rng = stream.rng
    url_prefix, flags = rng.choice(GLOBAL_FLAGS)
    prefix = "/" + url_prefix if url_prefix else ""
    hooks, requests = [], []
    for i in range(n_hooks):
        hook_id = rng.choice([f"h{i}", f"hook-{i}.x", f"dir/h_{i}", f"H{i}é"])
        hook, leaves = stream.hook(hook_id)
        hooks.append(hook)
        allowed = hook.get("http-methods") or []
        for _ in range(rng.randint(1, 4)):
            requests.append((hook, stream.request(hook_id, leaves, prefix, allowed)))
    for path in ["/", "/hooks", "/hooks/", "/hooks/nope", "/other", "/hooks/h0/extra", "/hooks/dir%2Fh_0",
                 prefix + "/", prefix + "/nope", prefix]:
        requests.append((None, (rng.choice(["GET", "POST"]), path or "/", None, [])))
    rng.shuffle(requests)
    return hooks, requests, ["-urlprefix", url_prefix] + flags


def observe(port, request, hook):
    method, path, body, headers = request
    status, resp_headers, data = http_request(port, method, path, body=body, headers=headers)
    hook_header = resp_headers.get("x-hook") if hook and hook.get("response-headers") else None
    return status, data, hook_header, resp_headers.get("x-global")


def run_differential(workdir, n_hooks, seed=SEED, oracle=None):
    """Same hooks, same requests, to webhookd.py and to Debian's webhook; returns stats."""
    oracle = oracle or support.WEBHOOK_BIN
    hooks, requests, flags = generate_stream(seed, workdir, n_hooks)
    hooks_file = workdir / "stream.json"
    write_hooks(hooks_file, hooks)
    port = support.free_port()
    reference = support.Daemon([oracle, "-hooks", hooks_file, "-ip", "127.0.0.1", "-port", port, "-verbose",
                                *flags], port, cwd=workdir)
    mismatches = []
    try:
        with start_webhookd(hooks_file, "-verbose", *flags, cwd=workdir) as daemon:
            for hook, request in requests:
                expected = observe(reference.port, request, hook)
                got = observe(daemon.port, request, hook)
                if got != expected:
                    mismatches.append((hook, request, expected, got))
            assert_log_clean(daemon, f"[seed {seed}] differential")
    finally:
        reference.__exit__(None, None, None)
    if mismatches:
        lines = [f"[seed {seed}] {len(mismatches)} of {len(requests)} answers differ from Debian's webhook "
                 f"(flags {flags}):"]
        for hook, request, expected, got in mismatches[:6]:
            lines.append(f"  hook {json.dumps(hook, ensure_ascii=False)}\n  request {request!r}\n"
                         f"  webhook  {expected!r}\n  webhookd {got!r}")
        raise AssertionError("\n".join(lines))
    return {"requests": 2 * len(requests), "hooks": n_hooks}


@pytest.mark.skipif(support.WEBHOOK_BIN is None, reason="needs Debian's webhook as the oracle: apt-get install webhook")
def test_random_hooks_and_requests_match_debian_webhook(workdir):
    run_differential(workdir, 40)
