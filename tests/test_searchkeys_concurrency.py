"""Issue 34 item 6, concurrent searches per key: the `maxConcurrentSearches` restriction lets a
key run that many searches at once (per searchkeys process); one more gets 429 with
`Retry-After`, counted as a `concurrency` refusal in the key's usage and in /metrics, and a
search gives its place back whatever becomes of it (answered, failed at the backend, its
caller gone mid-answer). Black-box: `searchkeys.py serve` on a free loopback port in front of a
stand-in backend that holds searches until told, real HTTP."""
import http.client
import http.server
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from support import SEARCHKEYS, Daemon, answer_json, free_port, python_cmd, serve_in_thread

MASTER = "concurrency-test-master-key-0123"
ADMIN = {"Authorization": "Bearer " + MASTER, "Content-Type": "application/json"}
HANG = 15.0  # seconds: only a hang detector, never a timing assertion


class Backend:
    """A stand-in search engine. `mode` says how it answers a search: "answer" at once,
    "hold" (until `release` is set), "fail" (closes the connection without an answer), or
    "big" (a 4 MiB answer sent slowly, piece by piece). `inside` counts searches being
    answered."""

    def __init__(self):
        self.mode = "answer"
        self.release = threading.Event()
        self.inside = 0
        backend = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                if self.path.endswith("/foreign-keys"):
                    answer_json(self, b"[]")
                    return
                backend.inside += 1
                try:
                    mode = backend.mode
                    if mode == "hold":
                        backend.release.wait(HANG)
                    if mode == "fail":
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    if mode == "big":
                        self.send_response(200)
                        self.send_header("Content-Type", "application/json")
                        self.send_header("Content-Length", str(4 * 1024 * 1024))
                        self.end_headers()
                        try:
                            for _ in range(64):
                                self.wfile.write(b" " * 65536)
                                self.wfile.flush()
                                time.sleep(0.02)
                        except OSError:
                            pass
                        self.close_connection = True
                        return
                    answer_json(self, b'{"hits":[]}')
                finally:
                    backend.inside -= 1

            do_GET = do_POST = answer

            def log_message(self, *args):
                pass

        self.server = serve_in_thread(Handler)
        self.url = self.server.url


@pytest.fixture(scope="module")
def backend():
    stand_in = Backend()
    yield stand_in
    stand_in.release.set()
    stand_in.server.shutdown()
    stand_in.server.server_close()


@pytest.fixture
def guard(backend):
    backend.mode, backend.inside = "answer", 0
    backend.release.clear()
    port = free_port()
    with Daemon(python_cmd(SEARCHKEYS, "serve", "--port", port, "--master-key", MASTER,
                           "--upstream", backend.url), port, timeout=30.0) as daemon:
        yield daemon
    backend.release.set()


def api(daemon, method, path, body=None):
    status, _, data = daemon.request(method, path, None if body is None else json.dumps(body),
                                     ADMIN)
    return status, (json.loads(data) if data else None)


def new_key(daemon, most):
    status, key = api(daemon, "POST", "/keys", {"actions": ["search"], "indexes": ["*"],
                                                "expiresAt": None})
    assert status == 201, key
    if most is not None:
        status, shown = api(daemon, "PUT", "/keys/%s/restrictions" % key["uid"],
                            {"maxConcurrentSearches": most})
        assert status == 200 and shown["maxConcurrentSearches"] == most, shown
    return key


def search(daemon, key, route="search"):
    headers = {"Authorization": "Bearer " + key["key"], "Content-Type": "application/json"}
    if route == "multi-search":
        return daemon.request("POST", "/multi-search", json.dumps(
            {"queries": [{"indexUid": "movies", "q": "x"}]}), headers, timeout=HANG + 5)
    return daemon.request("POST", "/indexes/movies/search", '{"q": "x"}', headers,
                          timeout=HANG + 5)


def in_background(daemon, key, count, route="search"):
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(search(daemon, key, route)))
               for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads, answers


def wait_for(condition, what):
    deadline = time.monotonic() + HANG
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def metric(daemon, name, labels):
    """The value of metric `name` with `labels` ({label: value}) in /metrics, or None."""
    status, _, data = daemon.request("GET", "/metrics", None, ADMIN)
    assert status == 200
    sample = name + "{%s}" % ",".join('%s="%s"' % item for item in labels.items())
    for line in data.decode().splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[1])
    return None


@pytest.mark.parametrize("route", ["search", "multi-search"])
def test_one_search_more_than_allowed_gets_429_and_is_counted(guard, backend, route):
    key, other = new_key(guard, 2), new_key(guard, 2)
    backend.mode = "hold"
    threads, answers = in_background(guard, key, 2, route)
    wait_for(lambda: backend.inside == 2, "the two searches never reached the backend")
    status, headers, data = search(guard, key, route)
    error = json.loads(data)
    assert status == 429 and headers["retry-after"] == "1", (status, error)
    assert error["code"] == "too_many_search_requests" and \
        "maxConcurrentSearches" in error["message"], error
    backend.mode = "answer"
    assert search(guard, other, route)[0] == 200  # another key has places of its own
    backend.release.set()
    for thread in threads:
        thread.join(HANG)
    assert [a[0] for a in answers] == [200, 200]
    assert search(guard, key, route)[0] == 200  # the places came back
    status, usage = api(guard, "GET", "/keys/%s/usage" % key["uid"])
    assert usage["refused"]["concurrency"] == 1 and usage["allowed"] == 3, usage
    assert metric(guard, "searchkeys_refusals_total", {"reason": "concurrency"}) == 1


def test_a_search_failing_at_the_backend_gives_its_place_back(guard, backend):
    key = new_key(guard, 1)
    backend.mode = "fail"
    for _ in range(3):
        assert search(guard, key)[0] == 502
    backend.mode = "answer"
    assert search(guard, key)[0] == 200


def test_a_caller_gone_mid_answer_gives_its_place_back(guard, backend):
    key = new_key(guard, 1)
    backend.mode = "big"
    connection = http.client.HTTPConnection("127.0.0.1", guard.port, timeout=HANG)
    connection.request("POST", "/indexes/movies/search", '{"q": "x"}', {
        "Authorization": "Bearer " + key["key"], "Content-Type": "application/json"})
    answer = connection.getresponse()
    assert answer.status == 200 and answer.read(1000)  # the answer streams through
    backend.mode = "answer"
    assert search(guard, key)[0] == 429  # its place is held while it streams
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()  # gone, mid-answer
    wait_for(lambda: search(guard, key)[0] == 200, "the place of a caller gone was never "
                                                   "given back")


def test_a_caller_gone_before_the_answer_gives_its_place_back(guard, backend):
    key = new_key(guard, 1)
    backend.mode = "hold"
    sock = socket.create_connection(("127.0.0.1", guard.port))
    body = b'{"q": "x"}'
    sock.sendall(b"POST /indexes/movies/search HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                 + key["key"].encode() + b"\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    wait_for(lambda: backend.inside == 1, "the search never reached the backend")
    sock.close()
    backend.mode = "answer"
    assert search(guard, key)[0] == 429
    backend.release.set()
    wait_for(lambda: search(guard, key)[0] == 200, "the place was never given back")


def test_authorize_refuses_a_key_it_cannot_hold_to_its_searches_at_once(guard):
    key = new_key(guard, 5)
    status, _, data = guard.request("GET", "/authorize", None, {
        "Authorization": "Bearer " + key["key"], "X-Original-URI": "/indexes/movies/search?q=x",
        "X-Original-Method": "GET"})
    error = json.loads(data)
    assert status == 403 and error["code"] == "forbidden_by_restriction" and \
        "maxConcurrentSearches" in error["message"], error
    plain = new_key(guard, None)
    assert guard.request("GET", "/authorize", None, {
        "Authorization": "Bearer " + plain["key"], "X-Original-URI": "/indexes/movies/search?q=x",
        "X-Original-Method": "GET"})[0] == 204


@pytest.mark.parametrize("value, message", [
    (0, "Invalid value at `.maxConcurrentSearches`: `0` is not 1 or more."),
    (10001, "Invalid value at `.maxConcurrentSearches`: `10001` is more than 10000."),
    ("2", "Invalid value type at `.maxConcurrentSearches`: expected a positive integer, but "
          "found a string: `\"2\"`"),
])
def test_max_concurrent_searches_validation(guard, value, message):
    key = new_key(guard, None)
    status, error = api(guard, "PUT", "/keys/%s/restrictions" % key["uid"],
                        {"maxConcurrentSearches": value})
    assert status == 400 and error["code"] == "invalid_restrictions_max_concurrent_searches"
    assert error["message"] == message


def test_cli_restrict_sets_max_concurrent(guard):
    key = new_key(guard, None)
    base = [sys.executable, str(SEARCHKEYS), "keys", "restrict", key["uid"], "--url",
            "http://127.0.0.1:%d" % guard.port, "--key", MASTER]
    done = subprocess.run(base + ["--max-concurrent", "3"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["maxConcurrentSearches"] == 3
    bad = subprocess.run(base + ["--max-concurrent", "0"], capture_output=True, text=True,
                         timeout=30)
    assert bad.returncode == 2 and "--max-concurrent" in bad.stderr
