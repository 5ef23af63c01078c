"""Issue 20, the connection layer: nothing a client does, or leaves undone, stalls others,
leaks or cuts an answer short.  Each test talks to the real daemon over loopback or a Unix
socket; generous timeouts are hang detectors, not latency checks (figures are in bench/)."""
import contextlib
import os
import resource
import selectors
import socket
import subprocess
import threading
import time

import pytest

import support
from support import WEBHOOKD, Daemon, python_cmd
from test_webhookd_features import (echo_hook, exchange, script, self_signed_certificate,
                                    started_with, unix_request, wait_until, write_hooks)


# ---------------------------------------------------------------------------------------------
# -socket PATH: a live instance's socket is refused, a stale one replaced
# ---------------------------------------------------------------------------------------------

def raw_answer(port, raw, timeout=10):
    """Everything the server sends back to `raw` on a new connection, until it closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        return exchange(sock, raw)


def unix_daemon(hooks, path):
    daemon = Daemon(python_cmd(WEBHOOKD, "-hooks", hooks, "-socket", path, "-verbose"), 0,
                    wait=False)
    def listening():
        if daemon.proc.poll() is not None:
            return True
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            return probe.connect_ex(path) == 0
    wait_until(listening, what="a listening socket at " + path)
    return daemon


def test_socket_of_a_live_instance_is_refused_a_stale_one_replaced(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("unix")])
    path = str(tmp_path / "webhookd.sock")
    get = b"GET /hooks/unix HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with unix_daemon(hooks, path) as first:
        second = subprocess.run(python_cmd(WEBHOOKD, "-hooks", hooks, "-socket", path),
                                capture_output=True, text=True, timeout=30,
                                stdin=subprocess.DEVNULL)
        output = second.stdout + second.stderr
        assert second.returncode == 1 and output.count("\n") == 1, output
        assert "address already in use" in output and "Traceback" not in output, output
        assert unix_request(path, get).endswith(b"\r\n\r\nunix\n")  # the first still serves
        assert first.proc.poll() is None
    # a socket file nothing listens on (a killed instance's) is replaced
    os.unlink(path) if os.path.exists(path) else None
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()
    with unix_daemon(hooks, path) as again:
        assert again.proc.poll() is None, again.log()
        assert unix_request(path, get).endswith(b"\r\n\r\nunix\n")


# ---------------------------------------------------------------------------------------------
# Idle and slow connections never lock a new client out
# ---------------------------------------------------------------------------------------------

IDLE_CLIENTS, TRICKLING_CLIENTS = 5000, 500
SOURCES = ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"]  # one client address and more
MAX_CONNECTIONS = 16
THREAD_BOUND = MAX_CONNECTIONS + 16  # request threads, and main, accept, waiting room, logging...


def raise_own_fd_limit(needed):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < needed:
        pytest.skip("needs %d open files, the hard limit is %d" % (needed, hard))


def open_clients(port, count):
    """`count` non-blocking connections from several loopback addresses (not waited for)."""
    clients = []
    for i in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.bind((SOURCES[i % len(SOURCES)], 0))
        sock.connect_ex(("127.0.0.1", port))
        clients.append(sock)
    return clients


def one_request_each(clients, request, answer_end, timeout):
    """Send `request` on every connection and read its answer: the number answered in time.
    The connections stay open (kept alive, idle)."""
    selector = selectors.DefaultSelector()
    received = {}
    for sock in clients:
        selector.register(sock, selectors.EVENT_WRITE)
    answered, deadline = 0, time.monotonic() + timeout
    while answered < len(clients) and time.monotonic() < deadline:
        for key, events in selector.select(0.5):
            sock = key.fileobj
            if events & selectors.EVENT_WRITE:
                with contextlib.suppress(OSError):  # refused: not answered
                    sock.send(request)  # small: one send
                selector.modify(sock, selectors.EVENT_READ)
                continue
            try:
                chunk = sock.recv(4096)
            except OSError:  # reset: not answered
                chunk = b""
            data = received[sock] = received.get(sock, b"") + chunk
            if data.endswith(answer_end) or not chunk:
                selector.unregister(sock)
                answered += data.endswith(answer_end)
    selector.close()
    return answered


def daemon_threads_and_rss(pid):
    with open("/proc/%d/status" % pid) as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) // 1024


def test_thousands_of_idle_and_trickling_connections_never_lock_a_new_client_out(tmp_path):
    raise_own_fd_limit(IDLE_CLIENTS + TRICKLING_CLIENTS + 256)
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("probe")])
    port = support.free_port()
    argv = python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", port,
                      "-max-connections", MAX_CONNECTIONS,
                      "-read-header-timeout", "60")  # the trickling clients are not cut off
    with Daemon(argv, port) as daemon:
        idle = open_clients(port, IDLE_CLIENTS)
        trickling = []
        try:
            answered = one_request_each(idle, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                                        b"\r\n\r\nOK", timeout=20)
            assert answered == IDLE_CLIENTS, "only %d of %d clients answered" % (
                answered, IDLE_CLIENTS)
            trickling = open_clients(port, TRICKLING_CLIENTS)
            stop = threading.Event()

            def trickle():  # a header byte from each, again and again, until the probes end
                first = True
                while not stop.wait(0 if first else 0.3):
                    for sock in trickling:
                        with contextlib.suppress(OSError):
                            sock.send(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " if first else b"a")
                    first = False
            trickler = threading.Thread(target=trickle)
            trickler.start()
            try:
                for i in range(5):  # each a new client; 10 s: a hang detector, not a latency
                    status, _, body = daemon.request("GET", "/hooks/probe", timeout=10)
                    assert (status, body) == (200, b"probe\n")
                threads, rss_mib = daemon_threads_and_rss(daemon.proc.pid)
            finally:
                stop.set()
                trickler.join()
            assert threads <= THREAD_BOUND, "%d threads" % threads
            assert rss_mib < 256, "%d MiB resident" % rss_mib
            # the idle connections were kept, not dropped to make room
            assert one_request_each(idle[:100], b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                                    b"\r\n\r\nOK", timeout=20) == 100
        finally:
            for sock in idle + trickling:
                sock.close()


def test_when_descriptors_run_short_the_oldest_idle_connections_give_way(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("probe")])
    # 700 open files: room for about 500 waiting connections besides the served ones
    with started_with("import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, (700, 700))",
                      ["-hooks", hooks, "-max-connections", "16"], tmp_path) as daemon:
        idle = []
        try:
            for _ in range(10):  # a hundred at a time: the earlier ones are idle by then
                idle += open_clients(daemon.port, 100)
                answered = one_request_each(idle[-100:], b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                                            b"\r\n\r\nOK", timeout=20)
                assert answered == 100, "only %d of 100 clients answered" % answered
            assert daemon.request("GET", "/hooks/probe", timeout=10)[::2] == (200, b"probe\n")
            time.sleep(0.5)
            assert [peer_closed(sock) for sock in (idle[0], idle[-1])] == [True, False]
        finally:
            for sock in idle:
                sock.close()


def peer_closed(sock):
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


# ---------------------------------------------------------------------------------------------
# A quiet but alive command keeps streaming: -write-timeout bounds a blocked write, not silence
# ---------------------------------------------------------------------------------------------

def test_streamed_output_survives_silences_longer_than_the_write_timeout(tmp_path):
    quiet = script(tmp_path / "quiet.sh", "echo first\nsleep 2.5\necho second\n")
    hooks = write_hooks(tmp_path / "hooks.json", [
        {"id": "quiet", "execute-command": quiet, "stream-command-output": True},
        {"id": "deploy", "execute-command": quiet}])
    port = support.free_port()
    argv = python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", port,
                      "-status-path", "/status", "-write-timeout", "1")
    with Daemon(argv, port) as daemon:
        received = raw_answer(port, b"GET /hooks/quiet HTTP/1.1\r\nHost: x\r\n"
                                    b"Connection: close\r\n\r\n", timeout=20)
        assert b"first\n" in received and received.endswith(b"second\n\r\n0\r\n\r\n"), received
        # a follower of a running run's output, the same
        _, headers, _ = daemon.request("GET", "/hooks/deploy")
        received = raw_answer(port, b"GET /status/runs/%s/output HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                    b"Connection: close\r\n\r\n"
                              % headers["x-webhookd-run"].encode(), timeout=20)
        assert b"first\n" in received and received.endswith(b"second\n\r\n0\r\n\r\n"), received


# ---------------------------------------------------------------------------------------------
# A bug under the handler costs one 500 and a log entry, never a silently dropped connection
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def probe_daemon(tmp_path):
    """webhookd serving one echo hook, `probe`, on a free port: yields the port."""
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("probe")])
    port = support.free_port()
    with Daemon(python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", port),
                port):
        yield port


def test_a_redirect_to_a_path_that_is_not_utf8_is_answered_as_go_does(tmp_path):
    with probe_daemon(tmp_path) as port:
        answer = raw_answer(port, b"GET /a/../%ff\xfe?q=%ff HTTP/1.1\r\nHost: x\r\n"
                                  b"Connection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 301 Moved Permanently\r\n"), answer
    assert b"\r\nLocation: /%FF%FE?q=%ff\r\n" in answer, answer  # as Debian's webhook


def test_a_head_ending_in_lf_cr_lf_is_a_whole_head(tmp_path):
    """Lines may end in LF or CRLF, so `\n\r\n` ends a head, as Go reads it: both pipelined
    requests are answered (the first used to wait for more, then swallow the second)."""
    with probe_daemon(tmp_path) as port:
        answer = raw_answer(port, b"GET /hooks/probe HTTP/1.1\nHost: x\n\r\n"
                                  b"GET /hooks/probe HTTP/1.1\nHost: x\nConnection: close\n\r\n")
    assert answer.count(b"HTTP/1.1 200 OK\r\n") == 2, answer


def test_running_out_of_open_files_is_logged_and_waited_out(tmp_path):
    """accept() failing for want of open files is logged and retried after a pause (as Go
    does), not silently retried at once in a loop; once clients leave, new ones are served."""
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("probe")])
    port = support.free_port()

    def few_files():
        resource.setrlimit(resource.RLIMIT_NOFILE, (80, 80))
    argv = python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", port,
                      "-max-connections", "200")
    proc = subprocess.Popen([str(arg) for arg in argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=few_files, start_new_session=True)
    clients = []
    try:
        support.wait_for_port(port, proc)
        for _ in range(100):  # each waits for a body that never comes, holding its file
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"POST /hooks/probe HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            clients.append(sock)
        time.sleep(1.0)
        for sock in clients:
            sock.close()
        clients = []
        answer = raw_answer(port, b"GET /hooks/probe HTTP/1.1\r\nHost: x\r\n"
                                  b"Connection: close\r\n\r\n", timeout=20)
        assert answer.startswith(b"HTTP/1.1 200 OK"), answer
    finally:
        for sock in clients:
            sock.close()
        os.killpg(proc.pid, 9)
        out = proc.communicate(timeout=10)[0].decode(errors="replace")
    assert "http: Accept error: too many open files; retrying in 5ms" in out, out[-2000:]


def test_a_bug_under_the_handler_is_answered_500_and_logged(tmp_path):
    import logging
    import webhookd
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(handler.format(record))
    webhookd.log.addHandler(handler)
    level = webhookd.log.level
    webhookd.log.setLevel(logging.INFO)
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("probe")])
    opts = webhookd.parse_flags(["-hooks", str(hooks)])
    registry = webhookd.Registry(opts.hooks, False)
    registry.load(startup=True)

    class Broken(webhookd.App):
        def handle(self, request):
            raise ValueError("a programming error")
    listener = socket.create_server(("127.0.0.1", 0))
    limits = webhookd.Limits(opts)
    room = webhookd.WaitingRoom(webhookd.Workers(4), 64, limits)
    app = Broken(opts, registry, *webhookd.open_run_history(opts))
    server = webhookd.HookServer(listener, app, room, limits, None)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        answer = raw_answer(listener.getsockname()[1], b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
    finally:
        server.shutdown()
        server.server_close()
        webhookd.log.removeHandler(handler)
        webhookd.log.setLevel(level)
    assert answer.startswith(b"HTTP/1.1 500 Internal Server Error\r\n"), answer
    assert answer.endswith(b"\r\n\r\n500 Internal Server Error"), answer
    assert any("ValueError: a programming error" in entry for entry in logged), logged


# ---------------------------------------------------------------------------------------------
# A failed TLS handshake is closed at once, not when its deadline comes
# ---------------------------------------------------------------------------------------------

def test_a_failed_tls_handshake_is_closed_at_once(tmp_path):
    self_signed_certificate(tmp_path)
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("tls")])
    port = support.free_port()
    argv = python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", port, "-secure",
                      "-cert", tmp_path / "cert.pem", "-key", tmp_path / "key.pem",
                      "-read-header-timeout", "60")
    with Daemon(argv, port) as daemon:
        for _ in range(3):
            # plain HTTP to a TLS port: the handshake fails on the first bytes; a hang detector
            # well below the 60 s head deadline that used to hold the socket
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"GET /hooks/tls HTTP/1.1\r\nHost: x\r\n\r\n")
                try:
                    while sock.recv(4096):
                        pass
                except ConnectionResetError:
                    pass
        assert daemon.proc.poll() is None


def test_kept_alive_connections_are_served_again_after_pauses_plain_and_tls(tmp_path):
    # between requests a connection waits without a thread; a head may arrive in pieces
    import ssl
    self_signed_certificate(tmp_path)
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("again")])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    for tls in (False, True):
        port = support.free_port()
        flags = ["-secure", "-cert", tmp_path / "cert.pem", "-key", tmp_path / "key.pem"]
        with Daemon(python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", port,
                               *(flags if tls else [])), port):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
                sock = context.wrap_socket(raw) if tls else raw
                for pause in (0, 0.1, 0.3):
                    time.sleep(pause)
                    sock.sendall(b"GET /hooks/again HTTP/1.1\r\n")
                    time.sleep(pause)
                    sock.sendall(b"Host: x\r\n\r\n")
                    answer = b""
                    while not answer.endswith(b"again\n"):
                        chunk = sock.recv(4096)
                        assert chunk, (tls, pause, answer)
                        answer += chunk
                    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer


# ---------------------------------------------------------------------------------------------
# A body trickled in holds no worker for long: one no one needs is not waited for (the answer
# still reaches the client, then the connection closes), a hook's has one deadline for all of it
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def trickling(port, head, count, first=b""):
    """`count` connections that send `head` (and `first`), then a body byte each 0.3 s."""
    clients = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(count)]
    for sock in clients:
        sock.sendall(head + first)
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.3):
            for sock in clients:
                with contextlib.suppress(OSError):  # closed by the server
                    sock.send(b"a")
    trickler = threading.Thread(target=trickle)
    trickler.start()
    try:
        yield clients
    finally:
        stop.set()
        trickler.join()
        for sock in clients:
            sock.close()


def answer_until_closed(sock):
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return data
            data += chunk
    return data


def test_bodies_trickled_to_refused_requests_hold_no_worker_and_get_their_answer(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("ping")])
    port = support.free_port()
    argv = python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", port,
                      "-max-connections", "2")
    with Daemon(argv, port) as daemon:
        # a large declared body (Go's cut: 256 KiB) and a small one: neither is waited for
        for length, count in ((1000000, 2), (1000, 2)):
            head = b"GET /hooks/nope HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % length
            with trickling(port, head, count, first=b"x" * 10) as clients:
                # a new client: 10 s is a hang detector (it used to wait as long as they trickle)
                status, _, body = daemon.request("GET", "/hooks/ping", timeout=10)
                assert (status, body) == (200, b"ping\n")
                for sock in clients:  # each got its whole answer, then the connection closed
                    answer = answer_until_closed(sock)
                    assert answer.startswith(b"HTTP/1.1 404 Not Found\r\n"), answer
                    assert b"\r\nConnection: close\r\n" in answer, answer
                    assert answer.endswith(b"\r\n\r\nHook not found."), answer


def test_the_answer_survives_a_client_still_sending_a_body_no_one_reads(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("ping")])
    port = support.free_port()
    with Daemon(python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", port), port):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /hooks/nope HTTP/1.1\r\nHost: x\r\nContent-Length: 20000000"
                         b"\r\n\r\n" + b"x" * 300000)  # unread when the server closes
            answer = answer_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 404 Not Found\r\n"), answer
        assert answer.endswith(b"\r\n\r\nHook not found."), answer


def test_a_hook_body_trickled_in_is_cut_off_in_bounded_time(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("ping")])
    port = support.free_port()
    # all of a 16 KiB body within 2 s + 16 KiB at 16 KiB/s = 3 s, though each read is in time
    argv = python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", port,
                      "-max-connections", "1", "-read-header-timeout", "2")
    with Daemon(argv, port) as daemon:
        head = b"POST /hooks/ping HTTP/1.1\r\nHost: x\r\nContent-Length: 16384\r\n\r\n"
        with trickling(port, head, 1) as (slow,):
            # 10 s: a hang detector (the trickle used to hold the only worker as long as it went)
            status, _, body = daemon.request("GET", "/hooks/ping", timeout=10)
            assert (status, body) == (200, b"ping\n")
            assert answer_until_closed(slow) == b""  # cut off: too slow to get an answer


def test_a_large_hook_body_trickled_in_is_cut_off_as_soon_as_it_falls_behind(tmp_path):
    """The body's deadline follows what has come, not what the head announces: a body declared
    at 20 MB but sent a byte at a time held a worker for 20 minutes (its size at 16 KiB/s),
    so a few such clients locked every new one out for as long."""
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("ping")])
    port = support.free_port()
    argv = python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", port,
                      "-max-connections", "2", "-read-header-timeout", "2")
    with Daemon(argv, port) as daemon:
        for encoding in (b"Content-Length: 20000000", b"Transfer-Encoding: chunked"):
            head = b"POST /hooks/ping HTTP/1.1\r\nHost: x\r\n%s\r\n\r\n" % encoding
            first = b"1000000\r\n" if b"chunked" in encoding else b""
            with trickling(port, head, 2, first) as clients:
                time.sleep(0.5)  # both workers are taken
                # 10 s: a hang detector (the trickle used to hold both workers for 20 minutes)
                status, _, body = daemon.request("GET", "/hooks/ping", timeout=10)
                assert (status, body) == (200, b"ping\n"), encoding
                for sock in clients:
                    assert answer_until_closed(sock) == b"", encoding  # cut off, unanswered


def test_a_chunked_body_cannot_hold_a_worker_with_endless_trailers(tmp_path):
    """Bytes that are no body (trailer lines, chunk extensions) keep a body's pace too, but
    never beyond the time its whole size may take: a client sending trailers at a steady
    rate forever must not hold a worker forever."""
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("ping")])
    port = support.free_port()
    # all of a body within 2 s + 32 KiB at 16 KiB/s = 4 s, whatever comes
    argv = python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", port,
                      "-max-connections", "1", "-read-header-timeout", "2",
                      "-max-body-bytes", "32768")
    with Daemon(argv, port) as daemon:
        slow = socket.create_connection(("127.0.0.1", port), timeout=10)
        slow.sendall(b"POST /hooks/ping HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                     b"\r\n1\r\na\r\n0\r\n")
        stop = threading.Event()

        def trailers():  # ~40 KiB/s of trailer lines, for up to 15 s
            for _ in range(150):
                if stop.wait(0.1):
                    return
                with contextlib.suppress(OSError):
                    slow.sendall(b"X-Trailer: %s\r\n" % (b"t" * 4000))
        sender = threading.Thread(target=trailers)
        sender.start()
        try:
            time.sleep(0.5)  # the only worker is taken
            # 10 s: a hang detector (the trailers held the worker as long as they came)
            status, _, body = daemon.request("GET", "/hooks/ping", timeout=10)
            assert (status, body) == (200, b"ping\n")
        finally:
            stop.set()
            sender.join()
            slow.close()


def test_bodies_that_never_come_give_way_when_every_worker_is_taken(tmp_path):
    """Expect: 100-continue, then no body: each such client held a worker for all of
    -read-header-timeout, so as many of them as -max-connections, renewed as they were cut
    off, locked every new client out.  While clients wait for a worker, a read that stalls
    for a second gives way."""
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("ping")])
    port = support.free_port()
    argv = python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", port,
                      "-max-connections", "2", "-read-header-timeout", "30")
    with Daemon(argv, port) as daemon:
        stalled = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        try:
            for sock in stalled:
                sock.sendall(b"POST /hooks/ping HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n"
                             b"Expect: 100-continue\r\n\r\n")
                assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n")
            # 10 s: a hang detector (they used to hold both workers for 30 s)
            status, _, body = daemon.request("GET", "/hooks/ping", timeout=10)
            assert (status, body) == (200, b"ping\n")
        finally:
            for sock in stalled:
                sock.close()
        # without clients waiting for a worker, a body may pause as long as it may
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /hooks/ping HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
                         b"Connection: close\r\n\r\n")
            time.sleep(2.5)
            answer = exchange(sock, b"x")
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"ping\n"), answer
