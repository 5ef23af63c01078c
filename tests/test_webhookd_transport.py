"""Issue 29, the transport holes: no way a client holds a request thread (so that a few of them
lock everyone out) and no request input that makes a 500.  Each test talks to the real daemon
over loopback; the bounds are hang detectors well below the timeout that used to hold the thread
(a new client is answered in milliseconds on an idle machine)."""
import os
import socket
import ssl
import threading
import time

import support
from support import WEBHOOKD, Daemon, python_cmd
from test_webhookd_features import (echo_hook, exchange, self_signed_certificate, started_with,
                                    write_hooks)

HELD_SECONDS = 60  # what a thread used to be held for: -read-header-timeout/-write-timeout here
ANSWERED_WITHIN = 15  # seconds a new client may wait, far below HELD_SECONDS


def start(tmp_path, *flags):
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("echo")])
    port = support.free_port()
    return Daemon(python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", port,
                             *flags), port)


def raw_answer(port, raw, timeout=10):
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        return exchange(sock, raw)


def answered_quickly(port):
    """A new client's GET / is answered within ANSWERED_WITHIN seconds."""
    began = time.monotonic()
    answer = raw_answer(port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                        timeout=ANSWERED_WITHIN)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer
    return time.monotonic() - began


# ---------------------------------------------------------------------------------------------
# Numbers of thousands of digits are a 400, as Go's, not a 500
# ---------------------------------------------------------------------------------------------

def test_a_content_length_of_thousands_of_digits_is_a_400(tmp_path):
    with start(tmp_path) as daemon:
        for path in ("/hooks/echo", "/"):
            answer = raw_answer(daemon.port, b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 1%s"
                                b"\r\n\r\n" % (path.encode(), b"0" * 4400))
            assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer[:200]
        # leading zeros are no size: Go reads 000...05 as 5
        answer = raw_answer(daemon.port, b"POST /hooks/echo HTTP/1.1\r\nHost: x\r\nConnection: "
                            b"close\r\nContent-Length: %s5\r\n\r\nhello" % (b"0" * 5000))
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"echo\n"), answer
        assert "Traceback" not in daemon.log()


def test_a_body_over_the_limit_on_a_path_that_reads_none_keeps_gos_answer(tmp_path):
    """-max-body-bytes (ours) is about bodies a hook reads: a 404 or 405 stays Go's answer
    (webhook has no such limit), and the connection closes instead of reading the body."""
    with start(tmp_path, "-max-body-bytes", "100") as daemon:
        for path, status in ((b"/hooks/nope", b"404 Not Found"), (b"/nowhere", b"404 Not Found")):
            answer = raw_answer(daemon.port, b"POST %s HTTP/1.1\r\nHost: x\r\n"
                                b"Content-Length: 1000\r\n\r\n" % path + b"x" * 100)
            assert answer.startswith(b"HTTP/1.1 " + status + b"\r\n"), answer[:200]
            assert b"Connection: close\r\n" in answer, answer[:300]
        answer = raw_answer(daemon.port, b"POST /hooks/echo HTTP/1.1\r\nHost: x\r\n"
                            b"Content-Length: 1000\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]  # a hook's own body: refused


def test_a_run_list_limit_of_thousands_of_digits_is_a_400(tmp_path):
    with start(tmp_path, "-status-path", "/-/status") as daemon:
        status, _, body = daemon.request("GET", "/-/status/runs?limit=1" + "0" * 5000)
        assert status == 400 and b"limit must be" in body, (status, body[:200])
        status, _, _ = daemon.request("GET", "/-/status/runs?limit=" + "0" * 5000 + "7")
        assert status == 200
        assert "Traceback" not in daemon.log()


# ---------------------------------------------------------------------------------------------
# Clients that pipeline requests and never read the answers
# ---------------------------------------------------------------------------------------------

def test_clients_that_pipeline_and_never_read_lock_nobody_out(tmp_path):
    """Each asks for answers of 60 KB (a redirect echoes its path) again and again and reads
    none: once its socket buffers are full, its answer waits without a thread."""
    with start(tmp_path, "-max-connections", "2", "-write-timeout", str(HELD_SECONDS)) as daemon:
        request = b"GET //%s HTTP/1.1\r\nHost: x\r\n\r\n" % (b"a" * 60000)
        clients = []
        try:
            for _ in range(6):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(("127.0.0.1", daemon.port))
                sock.setblocking(False)
                clients.append(sock)
            pending = {sock: request * 200 for sock in clients}
            until = time.monotonic() + 5
            while pending and time.monotonic() < until:  # send what the daemon takes
                for sock in list(pending):
                    try:
                        pending[sock] = pending[sock][sock.send(pending[sock]):]
                    except BlockingIOError:
                        pass
                    if not pending[sock]:
                        del pending[sock]
                time.sleep(0.01)
            assert answered_quickly(daemon.port) < ANSWERED_WITHIN
        finally:
            for sock in clients:
                sock.close()


# ---------------------------------------------------------------------------------------------
# A thread that cannot start (a pids limit)
# ---------------------------------------------------------------------------------------------

NO_REQUEST_THREADS = """
import threading
_start, _failures = threading.Thread.start, [3]
def start(self):
    if self.name == "request" and _failures[0] > 0:
        _failures[0] -= 1
        raise RuntimeError("can't start new thread")
    return _start(self)
threading.Thread.start = start
"""


def test_threads_that_cannot_start_cost_no_capacity_and_run_nothing_later(tmp_path):
    """Three request threads fail to start (-max-connections 2): those connections are closed
    unanswered, their hooks never run, and the next request is served as if nothing happened."""
    marker = tmp_path / "ran"
    hooks = write_hooks(tmp_path / "hooks.json", [{
        "id": "mark", "execute-command": "/bin/sh", "include-command-output-in-response": True,
        "pass-arguments-to-command": [
            {"source": "string", "name": "-c"},
            {"source": "string", "name": 'echo "$1" >> %s; echo done' % marker},
            {"source": "string", "name": "sh"}, {"source": "url", "name": "n"}]}])
    with started_with(NO_REQUEST_THREADS, ["-hooks", str(hooks), "-max-connections", "2"],
                      tmp_path) as daemon:
        for n in range(3):
            try:
                answer = raw_answer(daemon.port, b"GET /hooks/mark?n=%d HTTP/1.1\r\nHost: x\r\n"
                                    b"Connection: close\r\n\r\n" % n, timeout=ANSWERED_WITHIN)
            except ConnectionResetError:
                answer = b""
            assert answer == b"", answer  # refused, with no thread to serve it
        answer = raw_answer(daemon.port, b"GET /hooks/mark?n=ok HTTP/1.1\r\nHost: x\r\n"
                            b"Connection: close\r\n\r\n", timeout=ANSWERED_WITHIN)
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"done\n"), answer
        time.sleep(0.5)  # a refused request run later would show up by now
        assert marker.read_text() == "ok\n"


# ---------------------------------------------------------------------------------------------
# Slow heads: an unfinished head over 16 KiB, one byte of the next TLS record
# ---------------------------------------------------------------------------------------------

def test_unfinished_heads_over_16_kib_hold_no_thread(tmp_path):
    with start(tmp_path, "-max-connections", "2",
               "-read-header-timeout", str(HELD_SECONDS)) as daemon:
        clients = []
        try:
            for n in range(20):
                sock = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: %s" % (b"b" * 20000))
                clients.append(sock)
            time.sleep(0.5)
            assert answered_quickly(daemon.port) < ANSWERED_WITHIN
            # a whole head sent that slowly is still served
            clients[0].sendall(b"\r\nConnection: close\r\n\r\n")
            assert exchange(clients[0], b"").startswith(b"HTTP/1.1 200 OK\r\n")
        finally:
            for sock in clients:
                sock.close()


def test_one_byte_of_the_next_tls_record_holds_no_thread(tmp_path):
    self_signed_certificate(tmp_path)
    with start(tmp_path, "-max-connections", "1", "-read-header-timeout", str(HELD_SECONDS),
               "-secure", "-cert", tmp_path / "cert.pem", "-key", tmp_path / "key.pem") as daemon:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE

        def tls_get(sock, extra=b""):
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            if extra:  # beneath TLS: the first byte of a record that never comes whole
                raw = socket.socket(fileno=os.dup(sock.fileno()))
                raw.sendall(extra)
                raw.detach()
            data = b""
            while not data.endswith(b"\r\n\r\nOK"):
                data += sock.recv(4096)
            return data

        with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as plain, \
                context.wrap_socket(plain) as stuck:
            assert tls_get(stuck, extra=b"\x17").startswith(b"HTTP/1.1 200 OK\r\n")
            began = time.monotonic()
            result = []

            def new_client():
                with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as p, \
                        context.wrap_socket(p) as other:
                    other.settimeout(ANSWERED_WITHIN)
                    result.append(tls_get(other))
            client = threading.Thread(target=new_client)
            client.start()
            client.join(ANSWERED_WITHIN + 5)
            assert result and result[0].startswith(b"HTTP/1.1 200 OK\r\n"), result
            assert time.monotonic() - began < ANSWERED_WITHIN


# ---------------------------------------------------------------------------------------------
# The one writer: Go's framing
# ---------------------------------------------------------------------------------------------

def test_a_204_has_no_length_and_no_header_line_can_be_injected(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [{
        "id": "empty", "execute-command": "/bin/true", "success-http-response-code": 204,
        "response-message": "ignored",
        "response-headers": [{"name": "X-A", "value": "a\r\nInjected: 1"}]}])
    port = support.free_port()
    with Daemon(python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", port), port):
        raw = raw_answer(port, b"GET /hooks/empty HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 204 No Content\r\nX-A: a  Injected: 1\r\n"), raw
    assert b"\nInjected" not in raw and b"\r\nDate: " in raw, raw
    assert b"Content-Length" not in raw and raw.endswith(b"\r\n\r\n"), raw
