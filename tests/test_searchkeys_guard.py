"""The guard (`searchkeys.py serve --upstream`) against a stand-in backend on 127.0.0.1.

Each test sends real HTTP to the guard and checks what the backend received: the guard must
forward exactly what it authorized (request targets, tenant-token filters fused as Meilisearch's
`fuse_filters` fuses them), send a request at most once unless it is safe to repeat, stream large
and chunked bodies both ways, and log nothing a caller can use to forge a log line.
"""
import base64
import hashlib
import hmac
import json
import socket
import threading
import time
import urllib.parse

import pytest

from support import SEARCHKEYS, Daemon, free_port, python_cmd, request

MASTER = "guard-test-master-key-0123456789"
UPSTREAM_KEY = "UPSTREAM-ADMIN-KEY"


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def mint(parent_key, parent_uid, rules):
    """A tenant token (HS256, signed with the parent key's text), minted by hand."""
    signing_input = (b64url(json.dumps({"alg": "HS256", "typ": "JWT"}).encode()) + "." +
                     b64url(json.dumps({"searchRules": rules, "apiKeyUid": parent_uid}).encode()))
    sig = hmac.new(parent_key.encode(), signing_input.encode(), hashlib.sha256).digest()
    return signing_input + "." + b64url(sig)


# Answers of a backend, for the guard's reading of their heads.
HEADS = {
    "interim": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nX-Tag: one\r\n"
               b"Content-Type: application/json\r\nx-tag: two\r\nContent-Length: 2\r\n\r\n{}",
    "folded": b"HTTP/1.1 200 OK\r\nX-Tag: one\r\n two\r\nContent-Length: 2\r\n\r\n{}",
    "until-close": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                   b"Connection: close\r\n\r\n{\"hits\": []}",
    # pieces sent apart: the answer comes after the interim one has been read
    "early-hints": (b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n",
                    b"HTTP/1.1 200 OK\r\nContent-Length: 18\r\n\r\n{\"hits\": [\"late\"]}"),
    "processing": (b"HTTP/1.1 102 Processing\r\n\r\n",
                   b"HTTP/1.1 200 OK\r\nContent-Length: 18\r\n\r\n{\"hits\": [\"late\"]}"),
    # a body after heads that can have none: as chunked coding, which http.client reads
    "no-content": b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n2b\r\n"
                  b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nforge\r\n0\r\n\r\n",
    "not-modified": b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n2b\r\n"
                    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nforge\r\n0\r\n\r\n",
    "endless-interim": b"HTTP/1.1 103 Early Hints\r\n\r\n" * 200,
    "two-lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 12\r\n\r\n"
                   b"{}{\"hits\": 1}",
    "upgrade": (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n",
                b"HTTP/1.1 200 OK\r\nContent-Length: 18\r\n\r\n{\"hits\": [\"late\"]}"),
}


class Recorder:
    """A backend speaking HTTP/1.1 on a raw socket, so that it can misbehave on purpose.

    It records every request (method, target, headers, body; chunked bodies decoded) and
    answers 200 JSON, except: a target containing `drop` is read, recorded, and the connection
    closed without an answer; a target containing `chunked` is answered with chunked coding
    (`size` bytes of it, from the query); a target containing `head=NAME` gets the answer
    HEADS[NAME] (a tuple: its pieces, 0.3 s apart); the guard's lookups of an index's foreignKeys are answered `[]` (no joins),
    not recorded."""

    def __init__(self):
        self.seen = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        stream = conn.makefile("rb")
        with conn:
            while True:
                line = stream.readline()
                if not line:
                    return
                method, target, _ = line.decode("latin-1").split(" ", 2)
                headers, fields = {}, []
                while True:
                    header = stream.readline().decode("latin-1").rstrip("\r\n")
                    if not header:
                        break
                    name, _, value = header.partition(":")
                    headers[name.strip().lower()] = value.strip()
                    fields.append((name.strip().lower(), value.strip()))
                if headers.get("transfer-encoding") == "chunked":
                    body = b""
                    while True:
                        size = int(stream.readline().split(b";")[0], 16)
                        body += stream.read(size)
                        stream.readline()
                        if size == 0:
                            break
                else:
                    body = stream.read(int(headers.get("content-length", "0")))
                if method == "GET" and target.endswith("/settings/foreign-keys"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 2\r\n\r\n[]")  # the guard's look at an
                    continue  # index's joins (foreignKeys): none, and not recorded
                self.seen.append({"method": method, "target": target, "headers": headers,
                                  "fields": fields, "body": body})
                if "drop" in target:
                    return
                if "head=" in target:
                    answer = HEADS[target.partition("head=")[2]]
                    pieces = answer if isinstance(answer, tuple) else (answer,)
                    for number, piece in enumerate(pieces):
                        time.sleep(0.3 if number else 0)
                        conn.sendall(piece)
                    if b"Connection: close" in b"".join(pieces):
                        return
                    continue
                if "chunked" in target:
                    size = int(dict(urllib.parse.parse_qsl(target.partition("?")[2]))["size"])
                    piece = b"0123456789abcdef" * 1024
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n")
                    sent = 0
                    while sent < size:
                        data = piece[:size - sent]
                        conn.sendall(b"%x\r\n%s\r\n" % (len(data), data))
                        sent += len(data)
                    conn.sendall(b"0\r\n\r\n")
                    continue
                payload = json.dumps({"target": target}).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))

    def close(self):
        self.sock.close()


@pytest.fixture(scope="module")
def backend():
    recorder = Recorder()
    yield recorder
    recorder.close()


@pytest.fixture(scope="module")
def guard(backend):
    port = free_port()
    argv = python_cmd(SEARCHKEYS, "serve", "--host", "127.0.0.1", "--port", str(port),
                      "--master-key", MASTER, "--upstream", backend.url,
                      "--upstream-key", UPSTREAM_KEY)
    with Daemon(argv, port, timeout=30.0) as daemon:
        yield daemon


def create_key(guard, actions, indexes):
    status, _, data = request(guard.port, "POST", "/keys", json.dumps(
        {"actions": actions, "indexes": indexes, "expiresAt": None}),
        {"Authorization": "Bearer " + MASTER, "Content-Type": "application/json"})
    assert status == 201, data
    return json.loads(data)


def raw(port, data, timeout=15):
    """Raw bytes in, the first answer's status line and body out."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_answer(sock.makefile("rb"))


def read_answer(stream):
    """The next answer on a client's `stream`, read as a client reads it: (status, body of its
    Content-Length; a 204 or 304 ends at its blank line)."""
    status = int(stream.readline().split()[1])
    length = 0
    while True:
        line = stream.readline().rstrip(b"\r\n")
        if not line:
            break
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, b"" if status in (204, 304) else stream.read(length)


# ---------------------------------------------------------------------------------------------
# Request targets: only origin form, in forwarding and in /authorize
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,target", [
    ("GET", "http://indexes/keys"),
    ("GET", "http://tasks/keys"),
    ("PATCH", "http://indexes/network"),
    ("DELETE", "http://indexes/tasks"),
    ("GET", "x/indexes/movies/search"),
    ("GET", "HTTP://indexes/keys"),
    ("GET", "*"),
])
def test_targets_not_in_origin_form_are_refused_and_never_forwarded(guard, backend, method,
                                                                   target):
    """A key holding only indexes.get must not reach the backend's /keys, /network or /tasks
    (which the backend would serve with the admin --upstream-key)."""
    key = create_key(guard, ["indexes.get", "indexes.update", "indexes.delete"], ["*"])["key"]
    backend.seen.clear()
    body = b"{}" if method == "PATCH" else b""
    status, answer = raw(guard.port, (
        "%s %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: "
        "application/json\r\nContent-Length: %d\r\n\r\n" % (method, target, key, len(body))
    ).encode() + body)
    assert status == 400, (status, answer)
    assert json.loads(answer)["code"] == "bad_request"
    assert backend.seen == []


@pytest.mark.parametrize("uri", ["http://indexes/keys", "http://tasks/keys", "x/indexes/a/search"])
def test_authorize_refuses_targets_not_in_origin_form(guard, uri):
    key = create_key(guard, ["indexes.get", "search"], ["*"])["key"]
    status, _, data = request(guard.port, "GET", "/authorize", headers={
        "Authorization": "Bearer " + key, "X-Original-URI": uri, "X-Original-Method": "GET"})
    assert status in (400, 403), (status, data)
    assert json.loads(data)["code"] in ("bad_request", "invalid_api_key")


def test_a_long_header_within_the_head_limit_is_served(guard):
    """actix-http bounds the whole head (128 KiB), not each line: a 70 KB header is fine."""
    status, _, data = request(guard.port, "GET", "/keys?limit=1", headers={
        "Authorization": "Bearer " + MASTER, "X-Big": "y" * 70000})
    assert status == 200, data


# ---------------------------------------------------------------------------------------------
# Tenant-token filters: fused as Meilisearch's fuse_filters, on every route that adds them
# ---------------------------------------------------------------------------------------------

RULE = ["tenant = 1", "deleted = false"]


@pytest.fixture(scope="module")
def token(guard):
    parent = create_key(guard, ["search"], ["*"])
    return mint(parent["key"], parent["uid"], {"movies": {"filter": RULE}})


def sent_filter(seen):
    """The filter the backend received, from the JSON body or the `filter` parameter."""
    if seen["body"]:
        return json.loads(seen["body"])
    query = dict(urllib.parse.parse_qsl(seen["target"].partition("?")[2]))
    return json.loads(query["filter"])


@pytest.mark.parametrize("user_filter,fused", [
    ("tenant = 2", ["tenant = 2", "tenant = 1", "deleted = false"]),
    (["a = 1", "b = 2"], ["a = 1", "b = 2", "tenant = 1", "deleted = false"]),
    ([["a = 1", "b = 2"]], [["a = 1", "b = 2"], "tenant = 1", "deleted = false"]),
    (None, RULE),
])
def test_tenant_filters_are_fused_on_every_search_route(guard, backend, token, user_filter,
                                                        fused):
    def with_filter(query):
        return dict(query, filter=user_filter) if user_filter is not None else query

    posts = [
        ("/indexes/movies/search", with_filter({"q": "a"}), lambda body: body["filter"]),
        ("/indexes/movies/facet-search", with_filter({"facetName": "genre"}),
         lambda body: body["filter"]),
        ("/indexes/movies/similar", with_filter({"id": 1}), lambda body: body["filter"]),
        ("/multi-search", {"queries": [with_filter({"indexUid": "movies", "q": "a"})]},
         lambda body: body["queries"][0]["filter"]),
        ("/multi-search", {"federation": {}, "queries": [
            with_filter({"indexUid": "movies", "q": "a"})]},
         lambda body: body["queries"][0]["filter"]),
    ]
    for path, body, pick in posts:
        backend.seen.clear()
        status, _, data = request(guard.port, "POST", path, json.dumps(body), {
            "Authorization": "Bearer " + token, "Content-Type": "application/json"})
        assert status == 200, (path, data)
        assert pick(sent_filter(backend.seen[-1])) == fused, (path, backend.seen[-1])
    for path in ("/indexes/movies/search?q=a", "/indexes/movies/similar?id=1"):
        if user_filter is not None:
            text = user_filter if isinstance(user_filter, str) else json.dumps(user_filter)
            path += "&" + urllib.parse.urlencode({"filter": text})
        backend.seen.clear()
        status, _, data = request(guard.port, "GET", path,
                                  headers={"Authorization": "Bearer " + token})
        assert status == 200, (path, data)
        assert sent_filter(backend.seen[-1]) == fused, (path, backend.seen[-1])


# ---------------------------------------------------------------------------------------------
# At most once, unless safe to repeat
# ---------------------------------------------------------------------------------------------

def test_a_write_is_sent_once_even_when_the_backend_drops_the_connection(guard, backend):
    """The backend reads the documents, then closes its (pooled, keep-alive) connection
    without answering: the guard answers 502 and does not send them a second time."""
    key = create_key(guard, ["documents.add", "version"], ["*"])["key"]
    auth = {"Authorization": "Bearer " + key, "Content-Type": "application/json"}
    assert request(guard.port, "GET", "/version", headers=auth)[0] == 200  # pools a connection
    backend.seen.clear()
    status, _, data = request(guard.port, "POST", "/indexes/blog/documents?drop=1",
                              b'[{"id": 1}]', auth)
    assert status == 502, data
    assert json.loads(data)["code"] == "upstream_unavailable"
    sent = [s for s in backend.seen if s["target"].startswith("/indexes/blog/documents")]
    assert len(sent) == 1, sent


# ---------------------------------------------------------------------------------------------
# Bodies both ways
# ---------------------------------------------------------------------------------------------

def test_chunked_and_large_bodies_are_streamed_both_ways(guard, backend):
    key = create_key(guard, ["documents.add", "search"], ["*"])["key"]
    documents = json.dumps([{"id": i, "text": "x" * 100} for i in range(3000)]).encode()
    pieces = [documents[i:i + 50000] for i in range(0, len(documents), 50000)]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    backend.seen.clear()
    status, answer = raw(guard.port, (
        "POST /indexes/blog/documents HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" % key
    ).encode() + chunked)
    assert status == 200, answer
    assert backend.seen[-1]["body"] == documents
    backend.seen.clear()
    status, _, data = request(guard.port, "POST", "/indexes/blog/documents", documents, {
        "Authorization": "Bearer " + key, "Content-Type": "application/json"})
    assert status == 200 and backend.seen[-1]["body"] == documents
    size = 300000
    status, headers, data = request(guard.port, "GET",
                                    "/indexes/blog/search?chunked=1&size=%d" % size,
                                    headers={"Authorization": "Bearer " + key})
    assert status == 200 and len(data) == size
    assert data == (b"0123456789abcdef" * 1024 * 20)[:size]


def test_headers_reach_the_backend_as_sent_but_the_credential(guard, backend):
    key = create_key(guard, ["search"], ["*"])["key"]
    backend.seen.clear()
    status, _ = raw(guard.port, (
        "GET /indexes/blog/search?q=a HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
        "X-Tag: one\r\nX-Tag: two\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\n"
        "Content-Length: 0\r\n\r\n" % key).encode())
    assert status == 200
    fields = backend.seen[-1]["fields"]
    assert [v for n, v in fields if n == "x-tag"] == ["one", "two"]
    assert ("authorization", "Bearer " + UPSTREAM_KEY) in fields
    assert not [n for n, _ in fields if n in ("x-hop", "connection", "accept-encoding")]


@pytest.mark.parametrize("value", [b"a\x01b", b"a\x0bb", b"a\x0cb", b"a\x1fb", b"a\x7fb"])
def test_a_control_character_in_a_header_value_is_refused_as_actix_does(guard, backend, value):
    """actix-http (httparse) takes a header value of tab, space, visible ASCII and bytes
    0x80-0xFF, and refuses the request for any other control character: the guard must too,
    not authorize and forward a request its backend cannot read (str.splitlines, which the
    email parser used, even cut such a value into lines of their own)."""
    key = create_key(guard, ["search"], ["*"])["key"]
    backend.seen.clear()
    status, answer = raw(guard.port, (
        "GET /indexes/blog/search?q=a HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
        % key).encode() + b"X-Note: " + value + b"\r\nContent-Length: 0\r\n\r\n")
    assert status == 400, (status, answer)
    assert backend.seen == []
    status, _ = raw(guard.port, (
        "GET /indexes/blog/search?q=a HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
        % key).encode() + b"X-Note: a\tb \x85\xff~\r\nContent-Length: 0\r\n\r\n")
    assert status == 200
    assert ("x-note", "a\tb \x85\xff~") in backend.seen[-1]["fields"]


# ---------------------------------------------------------------------------------------------
# Logs
# ---------------------------------------------------------------------------------------------

def test_the_access_log_cannot_be_forged(guard):
    forged = "FORGED-LINE GET /keys 200 0.10ms"
    path = "/indexes/movies%0A" + urllib.parse.quote(forged) + "%0D/search"
    request(guard.port, "GET", path, headers={"Authorization": "Bearer " + MASTER})
    deadline = time.monotonic() + 10
    while "FORGED" not in guard.log() and time.monotonic() < deadline:
        time.sleep(0.05)  # the log line may trail the answer
    lines = guard.log().splitlines()
    assert not [line for line in lines if line.startswith("FORGED")], lines[-5:]
    assert any("FORGED" in line and "\\n" in line for line in lines), lines[-5:]


def test_expect_100_continue_is_answered_only_when_the_body_is_wanted(guard, backend):
    """A refused request gets its refusal without `100 Continue` (its body is never invited);
    an authorized one gets `100 Continue`, then its body reaches the backend."""
    key = create_key(guard, ["documents.add"], ["blog"])["key"]
    body = b'[{"id": 7}]'

    def send(path):
        sock = socket.create_connection(("127.0.0.1", guard.port), timeout=15)
        sock.sendall(("POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                      "Content-Type: application/json\r\nContent-Length: %d\r\n"
                      "Expect: 100-continue\r\n\r\n" % (path, key, len(body))).encode())
        return sock, sock.makefile("rb")

    sock, stream = send("/indexes/other/documents")
    with sock:
        assert stream.readline().split()[1] == b"403"
    backend.seen.clear()
    sock, stream = send("/indexes/blog/documents")
    with sock:
        assert stream.readline().split()[1] == b"100"
        assert stream.readline() == b"\r\n"
        sock.sendall(body)
        assert stream.readline().split()[1] == b"200"
    assert backend.seen[-1]["body"] == body


# ---------------------------------------------------------------------------------------------
# Reading: methods http.server has no do_* for, and the heads of the backend's answers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,target,expected", [
    ("TRACE", "/keys", 405), ("PROPFIND", "/indexes/movies/search", 405),
    ("BREW", "/coffee", 404)])
def test_any_method_is_answered_as_meilisearch_answers_it(guard, backend, method, target,
                                                          expected):
    """A method http.server has no do_* for gets Meilisearch's 405 on a known route and 404
    elsewhere, not http.server's 501, and nothing reaches the backend."""
    backend.seen.clear()
    status, _ = raw(guard.port, ("%s %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                                 "Content-Length: 0\r\n\r\n" % (method, target, MASTER)).encode())
    assert status == expected
    assert backend.seen == []


def relayed(guard, key, head):
    """The guard's answer to a search the backend answers with HEADS[head]."""
    with socket.create_connection(("127.0.0.1", guard.port), timeout=15) as sock:
        sock.sendall(("GET /indexes/movies/search?head=%s HTTP/1.1\r\nHost: x\r\n"
                      "Authorization: Bearer %s\r\nConnection: close\r\n\r\n"
                      % (head, key)).encode())
        data = b""
        while True:
            piece = sock.recv(65536)
            if not piece:
                break
            data += piece
    head_text, _, body = data.partition(b"\r\n\r\n")
    lines = head_text.decode("latin-1").split("\r\n")
    headers = [line.partition(":")[::2] for line in lines[1:]]
    if ("Transfer-Encoding", " chunked") in headers:
        chunks = b""
        while True:
            size, _, body = body.partition(b"\r\n")
            if int(size, 16) == 0:
                break
            chunks, body = chunks + body[:int(size, 16)], body[int(size, 16) + 2:]
        body = chunks
    return int(lines[0].split()[1]), headers, body


def test_the_backends_answer_heads_are_read_as_http_client_reads_them(guard):
    """An interim 100 is skipped; repeated headers are relayed, in order; an answer whose end
    is the backend's close is relayed whole; a folded header line, which two parties could
    read differently, fails the answer (502) rather than being relayed."""
    key = create_key(guard, ["search"], ["movies"])["key"]
    status, headers, body = relayed(guard, key, "interim")
    assert status == 200 and body == b"{}"
    assert [value.strip() for name, value in headers if name.lower() == "x-tag"] == \
        ["one", "two"]
    status, _, body = relayed(guard, key, "until-close")
    assert status == 200 and json.loads(body) == {"hits": []}
    status, headers, body = relayed(guard, key, "folded")
    assert status == 502 and json.loads(body)["code"] == "upstream_unavailable"
    assert not [name for name, _ in headers if name.lower() == "x-tag"]


def test_every_interim_answer_is_skipped_and_an_upgrade_never_asked_for_fails(guard):
    """RFC 9110 (15.2): a client must read any number of 1xx answers before the answer, not
    only 100. A 103 Early Hints or 102 Processing taken for the answer would be relayed (a
    caller reads it as interim, and takes its next answer for this one) while the real answer
    waits on the pooled backend connection, to be read as the next caller's. A 101 switches
    the connection to a protocol the guard never asked for (it forwards no Upgrade): 502."""
    key = create_key(guard, ["search"], ["movies"])["key"]
    auth = {"Authorization": "Bearer " + key}
    for head, expected in (("early-hints", 200), ("processing", 200), ("upgrade", 502)):
        status, _, body = relayed(guard, key, head)
        assert status == expected, (head, status, body)
        if expected == 200:
            assert json.loads(body) == {"hits": ["late"]}, (head, body)
        status, _, data = request(guard.port, "GET", "/indexes/movies/search?q=next",
                                  headers=auth)
        assert status == 200 and json.loads(data) == {
            "target": "/indexes/movies/search?q=next"}, (head, data)


@pytest.mark.parametrize("head,status", [("no-content", 204), ("not-modified", 304)])
def test_no_body_follows_a_head_that_cannot_have_one(guard, head, status):
    """A 204 or 304 ends at its head (RFC 9112, 6.3), whatever its backend sent after it: a body
    written there would be read by the caller (or a proxy sharing the connection among its own
    callers) as the answer to its next request."""
    key = create_key(guard, ["search"], ["movies"])["key"]
    with socket.create_connection(("127.0.0.1", guard.port), timeout=15) as sock:
        sock.sendall(("GET /indexes/movies/search?head=%s HTTP/1.1\r\nHost: x\r\n"
                      "Authorization: Bearer %s\r\n\r\n"
                      "GET /indexes/movies/search?q=next HTTP/1.1\r\nHost: x\r\n"
                      "Authorization: Bearer %s\r\nConnection: close\r\n\r\n"
                      % (head, key, key)).encode())
        stream = sock.makefile("rb")
        answers = [read_answer(stream), read_answer(stream)]
    assert answers == [(status, b""), (200, b'{"target": "/indexes/movies/search?q=next"}')]


@pytest.mark.parametrize("head", ["endless-interim", "two-lengths"])
def test_a_backend_answer_without_one_reading_fails(guard, head):
    """Interim answers without end would hold a thread; two Content-Lengths could be read two
    ways: either fails the answer (502) rather than being waited for or guessed at."""
    key = create_key(guard, ["search"], ["movies"])["key"]
    status, _, body = relayed(guard, key, head)
    assert status == 502 and json.loads(body)["code"] == "upstream_unavailable"


def test_a_log_line_holds_a_bounded_method_and_path(guard):
    """A request line may be 128 KiB; its log line is not: method and path are cut."""
    method, path = "M" * 5000, "/indexes" + "/abc" * 5000
    status, _ = raw(guard.port, ("%s %s HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
                                 % (method, path)).encode())
    assert status == 404
    deadline = time.monotonic() + 10
    while "MMMM" not in guard.log() and time.monotonic() < deadline:
        time.sleep(0.05)  # the log line may trail the answer
    line = next(line for line in guard.log().splitlines() if "MMMM" in line)
    assert len(line) < 1000, len(line)
