"""searchkeys.py serve: the server under load shapes a real deployment meets.

These tests check, through real sockets, that answers keep their order on a keep-alive
connection (pipelined), that one slow party (a backend, a client that does not read) never holds
up the others, that dead pooled backend connections are handled, and that --max-connections
bounds the requests served at once (idle connections hold no thread).
"""
import http.server
import json
import socket
import threading
import time

import pytest

from support import SEARCHKEYS, Daemon, free_port, python_cmd, request

MASTER = "server-test-master-key-0123456789"
SEARCH_BODY = b'{"q": "x"}'


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """A stand-in backend's handler: HTTP/1.1 keep-alive, no log, JSON answers."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, payload):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class Backend:
    """A search backend on 127.0.0.1: answers JSON naming the path; `/indexes/slow/...`
    waits for `release`; `/indexes/big/...` answers 256 KiB."""

    def __init__(self):
        self.release = threading.Event()
        self.waiting = threading.Event()
        self.arrived = 0
        backend = self

        class Handler(QuietHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if "/slow/" in self.path:
                    backend.arrived += 1
                    backend.waiting.set()
                    backend.release.wait(30)
                payload = json.dumps({"path": self.path}).encode()
                if "/big/" in self.path:
                    payload = b"[" + b"0," * (128 * 1024) + b"0]"
                self.answer(payload)

            do_GET = do_POST

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class ClosingBackend:
    """A backend that answers one request per connection, then closes it without saying so
    (no `Connection: close`): what a keep-alive timeout on the backend looks like to a pool."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head, _, rest = data.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(rest) < length:
                    rest += conn.recv(65536)
                payload = b'{"n": %d}' % self.connections
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))

    def close(self):
        self.sock.close()


def start_guard(upstream=None, extra=()):
    port = free_port()
    argv = python_cmd(SEARCHKEYS, "serve", "--host", "127.0.0.1", "--port", str(port),
                      "--master-key", MASTER, *extra)
    if upstream:
        argv += ["--upstream", upstream, "--upstream-key", "backend-key"]
    return Daemon(argv, port, timeout=30.0)


def search_key(port):
    status, _, data = request(port, "POST", "/keys", json.dumps(
        {"actions": ["search"], "indexes": ["*"], "expiresAt": None}),
        {"Authorization": "Bearer " + MASTER, "Content-Type": "application/json"})
    assert status == 201, data
    return json.loads(data)["key"]


def raw_request(method, path, key=None, body=b"", extra=()):
    lines = ["%s %s HTTP/1.1" % (method, path), "Host: t"]
    if key:
        lines.append("Authorization: Bearer " + key)
    if body or method == "POST":
        lines += ["Content-Type: application/json", "Content-Length: %d" % len(body)]
    lines += list(extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class AnswerReader:
    """Reads HTTP/1.1 answers one by one from a socket (Content-Length framing)."""

    def __init__(self, sock):
        self.sock, self.buf = sock, b""

    def _more(self):
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("closed with %r unread" % self.buf[:200])
        self.buf += data

    def next(self):
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        while len(self.buf) < length:
            self._more()
        body, self.buf = self.buf[:length], self.buf[length:]
        return int(lines[0].split()[1]), headers, body


@pytest.fixture
def backend():
    b = Backend()
    yield b
    b.close()


def test_pipelined_requests_keep_their_order_whichever_thread_answers(backend):
    """Answers made by the loop (health, authorize, refusals, small forwards) and by workers
    (a store write, a 256 KiB answer) come back in request order on one connection."""
    with start_guard(backend.url) as guard:
        key = search_key(guard.port)
        authorize = ["X-Original-URI: /indexes/a/search", "X-Original-Method: POST"]
        pipeline = [
            (raw_request("GET", "/health"), 200, b'{"status":"available"}'),
            (raw_request("POST", "/indexes/one/search", key, SEARCH_BODY), 200,
             b'{"path": "/indexes/one/search"}'),
            (raw_request("POST", "/keys", MASTER, json.dumps(
                {"actions": ["search"], "indexes": ["a"], "expiresAt": None}).encode()),
             201, None),
            (raw_request("GET", "/authorize", key, extra=authorize), 204, b""),
            (raw_request("POST", "/indexes/big/search", key, SEARCH_BODY), 200, None),
            (raw_request("GET", "/keys", key), 403, None),
            (raw_request("POST", "/indexes/two/search", key, SEARCH_BODY), 200,
             b'{"path": "/indexes/two/search"}'),
            (raw_request("GET", "/nowhere"), 404, b""),
        ] * 3
        with socket.create_connection(("127.0.0.1", guard.port), timeout=30) as sock:
            sock.sendall(b"".join(data for data, _, _ in pipeline))
            answers = AnswerReader(sock)
            for i, (_, status, body) in enumerate(pipeline):
                got_status, _, got_body = answers.next()
                assert got_status == status, (i, got_status, got_body[:200])
                if body is not None:
                    assert got_body == body, (i, got_body[:200])
                if got_status == 201:
                    assert json.loads(got_body)["indexes"] == ["a"]
                if b"big" in pipeline[i][0].split(b"\r\n")[0]:
                    assert len(got_body) == 2 + 2 * 128 * 1024 + 1
        assert request(guard.port, "GET", "/keys?limit=100",
                       headers={"Authorization": "Bearer " + MASTER})[0] == 200


def test_a_backend_that_does_not_answer_holds_up_nobody_else(backend):
    """While the backend sits on one search, other callers' searches and health checks are
    answered (the waiting forward is not done by the thread that serves everyone)."""
    with start_guard(backend.url) as guard:
        key = search_key(guard.port)
        slow = {}

        def slow_search():
            slow["answer"] = request(guard.port, "POST", "/indexes/slow/search", SEARCH_BODY,
                                     {"Authorization": "Bearer " + key,
                                      "Content-Type": "application/json"}, timeout=30)

        thread = threading.Thread(target=slow_search)
        thread.start()
        assert backend.waiting.wait(15), "the slow search never reached the backend"
        for _ in range(20):
            status, _, data = request(guard.port, "POST", "/indexes/fast/search", SEARCH_BODY,
                                      {"Authorization": "Bearer " + key,
                                       "Content-Type": "application/json"}, timeout=10)
            assert (status, data) == (200, b'{"path": "/indexes/fast/search"}')
            assert request(guard.port, "GET", "/health", timeout=10)[0] == 200
        assert "answer" not in slow, "the slow search was answered before its backend did"
        backend.release.set()
        thread.join(30)
        assert slow["answer"][0] == 200 and slow["answer"][2] == b'{"path": "/indexes/slow/search"}'


def test_a_client_that_never_reads_its_answers_holds_up_nobody_else(backend):
    """Two clients pipeline requests and never read (their answers fill the socket buffers:
    the rest waits in a worker, not in the loop); others are still served."""
    with start_guard(backend.url) as guard:
        key = search_key(guard.port)
        greedy = []
        for path in ("/health", "/indexes/big/search"):
            sock = socket.create_connection(("127.0.0.1", guard.port), timeout=30)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            one = raw_request("POST", path, key, SEARCH_BODY) if "search" in path \
                else raw_request("GET", path)
            sock.setblocking(False)
            try:
                for _ in range(2000 if "health" in path else 40):
                    sock.send(one)
            except BlockingIOError:
                pass  # the guard stopped reading: its answers are not being read
            greedy.append(sock)
        try:
            for _ in range(10):
                status, _, data = request(guard.port, "POST", "/indexes/fast/search",
                                          SEARCH_BODY, {"Authorization": "Bearer " + key,
                                                        "Content-Type": "application/json"},
                                          timeout=10)
                assert (status, data) == (200, b'{"path": "/indexes/fast/search"}')
                assert request(guard.port, "GET", "/health", timeout=10)[0] == 200
        finally:
            for sock in greedy:
                sock.close()


def test_pooled_backend_connections_closed_by_the_backend_are_retried():
    """The backend closes every connection after one answer without announcing it: each
    search finds a dead pooled connection, and is sent again on a new one."""
    closing = ClosingBackend()
    try:
        with start_guard(closing.url) as guard:
            key = search_key(guard.port)
            with socket.create_connection(("127.0.0.1", guard.port), timeout=30) as sock:
                answers = AnswerReader(sock)
                for n in range(1, 6):
                    time.sleep(0.05)  # let the backend's close arrive first
                    sock.sendall(raw_request("POST", "/indexes/a/search", key, SEARCH_BODY))
                    status, _, body = answers.next()
                    assert status == 200, body
                    assert json.loads(body)["n"] >= n
    finally:
        closing.close()


def test_max_connections_bounds_requests_served_at_once_not_idle_connections(backend):
    """--max-connections 2: two idle keep-alive connections hold nothing (a newcomer is
    served), while two requests the backend sits on make a third wait its turn."""
    with start_guard(backend.url, extra=("--max-connections", "2")) as guard:
        key = search_key(guard.port)
        held = [socket.create_connection(("127.0.0.1", guard.port), timeout=30)
                for _ in range(3)]
        try:
            for sock in held:  # idle keep-alive connections, all answered
                sock.sendall(raw_request("GET", "/health"))
                assert AnswerReader(sock).next()[0] == 200
            for sock in held[:2]:
                sock.sendall(raw_request("POST", "/indexes/slow/search", key, SEARCH_BODY))
            assert backend.waiting.wait(15)
            deadline = time.monotonic() + 15
            while backend.arrived < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert backend.arrived == 2
            held[2].sendall(raw_request("GET", "/health"))
            held[2].settimeout(0.5)
            with pytest.raises(socket.timeout):
                held[2].recv(1)  # both workers are busy: it waits its turn
            backend.release.set()
            held[2].settimeout(30)
            assert AnswerReader(held[2]).next()[0] == 200
            for sock in held[:2]:
                assert AnswerReader(sock).next()[0] == 200
        finally:
            for sock in held:
                sock.close()


class RestartingBackend:
    """A keep-alive backend whose restart closes every connection it holds (as a restarted
    Meilisearch does) and listens again on the same port. `/indexes/hold/...` answers once
    `holding` requests wait together, so the guard pools that many connections."""

    def __init__(self, holding=4):
        self.barrier = threading.Barrier(holding, timeout=30)
        self.connections = []
        self.port = free_port()
        self.url = "http://127.0.0.1:%d" % self.port
        self._start()

    def _start(self):
        backend = self

        class Handler(QuietHandler):
            def setup(self):
                super().setup()
                backend.connections.append(self.connection)

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if "/hold/" in self.path:
                    backend.barrier.wait()
                self.answer(b'{"hits": []}')

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def restart(self):
        self.close()
        for sock in self.connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.connections = []
        self._start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_searches_after_a_backend_restart_are_answered():
    """After a backend restart every pooled connection is dead: a search that meets one is
    sent again on a new connection, not on the next dead one from the pool (which answered
    502 to 3 searches of 8)."""
    backend = RestartingBackend(holding=4)
    try:
        with start_guard(backend.url) as guard:
            key = search_key(guard.port)
            auth = {"Authorization": "Bearer " + key, "Content-Type": "application/json"}
            held = [threading.Thread(target=request, args=(
                guard.port, "POST", "/indexes/hold/search", SEARCH_BODY, auth, 30))
                for _ in range(4)]
            for thread in held:
                thread.start()
            for thread in held:
                thread.join(30)
            backend.restart()
            answers = [request(guard.port, "POST", "/indexes/a/search", SEARCH_BODY, auth)
                       for _ in range(8)]
            assert [status for status, _, _ in answers] == [200] * 8, answers
    finally:
        backend.close()


def test_a_search_that_times_out_is_not_sent_twice():
    """A backend slower than the guard's timeout may still be working on the search: the
    guard answers 502 (`backend unavailable`, nothing internal) and does not send it again."""
    import searchkeys as sk
    seen = []

    class Handler(QuietHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append(self.path)
            if "/slow/" in self.path:
                time.sleep(1.5)
            self.answer(b"{}")

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    logged = []
    try:
        upstream = sk.Upstream("http://127.0.0.1:%d" % server.server_address[1], timeout=0.5,
                               log=logged.append)
        headers = [("Host", "b"), ("Content-Type", "application/json")]
        assert upstream.forward("POST", "/indexes/a/search", headers, b"{}", True).status == 200
        with pytest.raises(sk.ApiError) as raised:  # on the pooled connection
            upstream.forward("POST", "/indexes/slow/search", headers, b"{}", True)
        assert raised.value.status == 502
        assert raised.value.message == "The search backend is unavailable."
        assert logged and "could not be reached" in logged[0]
        time.sleep(2)
        assert seen.count("/indexes/slow/search") == 1, seen
    finally:
        server.shutdown()
        server.server_close()


def test_an_unreachable_backend_is_named_nowhere_in_the_answer():
    port = free_port()
    with start_guard("http://127.0.0.1:%d" % port) as guard:
        key = search_key(guard.port)
        status, _, data = request(guard.port, "POST", "/indexes/a/search", SEARCH_BODY,
                                  {"Authorization": "Bearer " + key,
                                   "Content-Type": "application/json"})
        assert status == 502
        assert json.loads(data) == {
            "message": "The search backend is unavailable.", "code": "upstream_unavailable",
            "type": "system", "link": "https://docs.meilisearch.com/errors#upstream_unavailable"}
        assert "127.0.0.1:%d" % port in guard.log() and "Refused" in guard.log()


def _ps(pid, field):
    """One number `ps` reports about `pid` (nlwp: threads; rss: KiB), or None."""
    import subprocess
    done = subprocess.run(["ps", "-o", field + "=", "-p", str(pid)], capture_output=True,
                          text=True)
    return int(done.stdout.split()[0]) if done.returncode == 0 and done.stdout.split() else None


def _open_files(wanted):
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.skip("needs an open-files hard limit of %d (it is %d): raise it with ulimit -Hn as root" % (wanted, hard))
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def _connect(port, source):
    sock = socket.socket()
    if source is not None:
        try:
            sock.bind((source, 0))
        except OSError:
            pass  # only 127.0.0.1 here
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    return sock


def _answer_all(socks, deadline):
    """Read one /health answer on each socket (all sent already): how many came."""
    import selectors
    selector = selectors.DefaultSelector()
    pending = {}
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        pending[sock] = b""
    answered = 0
    while pending and time.monotonic() < deadline:
        for key, _ in selector.select(1.0):
            sock = key.fileobj
            pending[sock] += sock.recv(4096)
            if pending[sock].endswith(b'{"status":"available"}'):
                selector.unregister(sock)
                del pending[sock]
                answered += 1
    selector.close()
    return answered


def test_thousands_of_idle_and_trickling_connections_lock_nobody_out():
    """5,000 idle keep-alive connections and 500 clients trickling their heads a byte at a
    time, half of them after 9 KiB of it, from several addresses: a new client is still answered
    at once, and the guard's threads and memory stay bounded (520 idle connections used to stop
    it: a thread each; later ~513 heads over 8 KiB did: a worker each)."""
    idle_count, trickle_count = 5000, 500
    _open_files(idle_count + trickle_count + 500)
    with start_guard(extra=("--max-connections", "32")) as guard:
        sources = [None] + ["127.0.0.%d" % n for n in range(2, 10)]
        idle, trickling, stop = [], [], threading.Event()
        try:
            deadline = time.monotonic() + 60
            for n in range(idle_count):
                sock = _connect(guard.port, sources[n % len(sources)])
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                idle.append(sock)
            assert _answer_all(idle, deadline) == idle_count  # now idle, kept alive
            for n in range(trickle_count):
                sock = _connect(guard.port, sources[n % len(sources)])
                sock.sendall(b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * (9000 * (n % 2)))
                trickling.append(sock)

            def trickle():
                while not stop.wait(0.2):
                    for sock in trickling:
                        try:
                            sock.send(b"a")
                        except OSError:
                            pass
            trickler = threading.Thread(target=trickle, daemon=True)
            trickler.start()
            time.sleep(0.5)
            for _ in range(5):  # hang detectors: the old guard never answered these
                status, _, body = request(guard.port, "GET", "/health", timeout=10)
                assert (status, body) == (200, b'{"status":"available"}')
            threads, rss = _ps(guard.proc.pid, "nlwp"), _ps(guard.proc.pid, "rss")
            if threads is not None:
                assert threads <= 32 + 4, threads  # the workers, the watcher, the main one
            if rss is not None:
                assert rss < 300 * 1024, rss
            assert guard.proc.poll() is None
        finally:
            stop.set()
            for sock in idle + trickling:
                sock.close()


def test_long_unfinished_heads_hold_no_thread():
    """--max-connections 4: twelve clients each send 9 KiB of a head and stop there (a waiting
    connection used to hold 8 KiB, then a worker read on: 30 s each, and ~513 such clients locked
    everyone out). A newcomer is answered at once; each of the twelve once it ends its head."""
    with start_guard(extra=("--max-connections", "4")) as guard:
        unfinished = [socket.create_connection(("127.0.0.1", guard.port), timeout=30)
                      for _ in range(12)]
        try:
            for sock in unfinished:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 9000)
            time.sleep(0.5)
            for _ in range(3):  # a hang detector: the old guard answered after 30 s
                status, _, body = request(guard.port, "GET", "/health", timeout=10)
                assert (status, body) == (200, b'{"status":"available"}')
            for sock in unfinished:
                sock.sendall(b"\r\n\r\n")
                assert AnswerReader(sock).next()[0] == 200
        finally:
            for sock in unfinished:
                sock.close()


def test_connections_being_closed_hold_no_thread():
    """--max-connections 2: twenty clients each send a request line the guard refuses, then go
    on sending: each is seen out for up to 2 s, its bytes read and dropped, before the close (so
    its answer is not lost to a reset), and meanwhile a newcomer is answered (each used to hold a
    worker for those 2 s: twenty of them made a newcomer wait ~20 s)."""
    with start_guard(extra=("--max-connections", "2")) as guard:
        refused = [socket.create_connection(("127.0.0.1", guard.port), timeout=30)
                   for _ in range(20)]
        stop = threading.Event()

        def trickle():
            while not stop.wait(0.2):
                for sock in refused:
                    try:
                        sock.send(b"x")
                    except OSError:
                        pass

        for sock in refused:
            sock.sendall(b"GARBAGE\r\n\r\n")
        trickler = threading.Thread(target=trickle)
        trickler.start()
        try:
            time.sleep(0.5)
            status, _, body = request(guard.port, "GET", "/health", timeout=10)  # hang detector
            assert (status, body) == (200, b'{"status":"available"}')
        finally:
            stop.set()
            trickler.join()
        try:
            for sock in refused:
                assert AnswerReader(sock).next()[0] == 400
        finally:
            for sock in refused:
                sock.close()


def test_trickled_bodies_of_answered_requests_hold_no_worker(backend):
    """--max-connections 2: two callers announce a 1 MB body on /health and trickle it a byte
    at a time. Their answers do not need the body, so the guard skips it for a moment, then
    closes: a newcomer is served (each trickle used to hold a worker as long as it went on)."""
    with start_guard(backend.url, extra=("--max-connections", "2")) as guard:
        tricklers = [socket.create_connection(("127.0.0.1", guard.port), timeout=30)
                     for _ in range(2)]
        stop = threading.Event()

        def trickle(sock):
            try:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n"
                             b"\r\nx")
                while not stop.wait(0.3):
                    sock.sendall(b"x")
            except OSError:
                pass  # closed by the guard: what it should do

        threads = [threading.Thread(target=trickle, args=(sock,)) for sock in tricklers]
        for thread in threads:
            thread.start()
        try:
            time.sleep(0.5)
            # a hang detector: the old guard never answered while the trickles went on
            status, _, _ = request(guard.port, "GET", "/health", timeout=10)
            assert status == 200
            for sock in tricklers:  # each trickler got its answer, then the close
                answer = AnswerReader(sock).next()
                assert answer[0] == 200
        finally:
            stop.set()
            for thread in threads:
                thread.join()
            for sock in tricklers:
                sock.close()


def test_refused_requests_whose_body_never_comes_hold_no_thread():
    """--max-connections 2: forty callers without a key each announce a 500 kB body and send
    none of it. Each is refused at once; waiting for the body it announced (to keep its
    connection alive) used to hold a thread for a second each, so forty of them made a newcomer
    wait ~20 s, and a few hundred a second locked everyone out. Each still gets its answer."""
    with start_guard(extra=("--max-connections", "2")) as guard:
        stalled = [socket.create_connection(("127.0.0.1", guard.port), timeout=30)
                   for _ in range(40)]
        try:
            for sock in stalled:
                sock.sendall(b"POST /keys HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                             b"\r\nContent-Length: 500000\r\n\r\n")
            time.sleep(0.5)
            status, _, body = request(guard.port, "GET", "/health", timeout=10)  # hang detector
            assert (status, body) == (200, b'{"status":"available"}')
            for sock in stalled:
                assert AnswerReader(sock).next()[0] == 401
        finally:
            for sock in stalled:
                sock.close()


def test_small_bodies_trickled_by_a_key_holder_hold_no_thread(backend):
    """--max-connections 2: twenty holders of a search key (public, in a page) each announce a
    1000-byte search and send ten bytes of it. Its body used to be awaited on a thread (for
    30 s, then at 1 KiB/s, up to 16 MiB: hours), so twenty locked everyone out; now a body of
    at most 64 KiB is awaited without a thread, as a head is. Each is answered once it is in."""
    with start_guard(backend.url, extra=("--max-connections", "2")) as guard:
        key = search_key(guard.port)
        body = b'{"q": "%s"}' % (b"a" * 990)
        slow = [socket.create_connection(("127.0.0.1", guard.port), timeout=30)
                for _ in range(20)]
        try:
            for sock in slow:
                sock.sendall(raw_request("POST", "/indexes/movies/search", key, body)[:-990])
            time.sleep(0.5)
            status, _, data = request(guard.port, "GET", "/health", timeout=10)  # hang detector
            assert (status, data) == (200, b'{"status":"available"}')
            for sock in slow:
                sock.sendall(body[-990:])
            for sock in slow:
                assert AnswerReader(sock).next()[0] == 200
        finally:
            for sock in slow:
                sock.close()
