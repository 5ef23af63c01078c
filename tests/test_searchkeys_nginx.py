"""The nginx recipe (searchkeys-nginx.conf.example): nginx asks `GET /authorize` with
`auth_request` and proxies allowed requests to a stand-in backend.

Skipped where nginx is not installed. nginx runs with its own -p prefix and -c config in a
temporary folder, on loopback ports; the system's nginx configuration is never read.
"""
import http.client
import http.server
import json
import os
import shutil
import signal
import subprocess
import threading

import pytest

from support import ROOT, SEARCHKEYS, Daemon, free_port, python_cmd, request, scratch_dir, \
    stop_session, wait_for_port

NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="needs nginx: apt-get install nginx")

MASTER = "nginx-test-master-key-0123456789"
BACKEND_KEY = "BACKEND-ADMIN-KEY"
# As docs/searchkeys.md runs it behind nginx: nginx's X-Forwarded-For names the client.
GUARD_FLAGS = ["--trusted-proxy", "127.0.0.1"]


def nginx_config(listen, searchkeys, backend):
    """The recipe (docs/searchkeys.md, "Behind nginx") with its placeholders filled, in the foreground."""
    text = (ROOT / "searchkeys-nginx.conf.example").read_text()
    for name, value in (("listen", listen), ("searchkeys", searchkeys), ("backend", backend),
                        ("backend_key", BACKEND_KEY)):
        text = text.replace("{{%s}}" % name, value)
    assert "{{" not in text
    return "daemon off;\n" + text


class Backend:
    """A stand-in search backend that records what reaches it. Of indexes it has only
    `movies`, joining none: searchkeys' own lookups of an index (`GET /indexes/{uid}`, to
    check that a write cannot create one) and of its foreignKeys are answered, not recorded."""

    def __init__(self):
        self.seen = []
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *args):
                pass

            def do_GET(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                status = 200
                if self.command == "GET" and self.path.startswith("/indexes/") and \
                        self.path.count("/") == 2:
                    status = 200 if self.path == "/indexes/movies" else 404
                elif self.command == "GET" and self.path.endswith("/settings/foreign-keys"):
                    self.send_response(200)  # an index's joins (foreignKeys): none
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"[]")
                    return
                else:
                    seen.append({"method": self.command, "path": self.path, "body": body,
                                 "authorization": self.headers.get("Authorization"),
                                 "names": {name.lower() for name in self.headers.keys()}})
                payload = json.dumps({"hits": [], "path": self.path} if status == 200 else {
                    "message": "Index not found.", "code": "index_not_found",
                    "type": "invalid_request", "link": ""}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_POST = do_DELETE = do_GET

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = "127.0.0.1:%d" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def nginx_prefix():
    """nginx's -p folder: its configuration, cache and the recipe's error.log."""
    with scratch_dir("searchkeys-nginx-") as prefix:
        os.chmod(prefix, 0o755)  # nginx's workers may run as another user
        yield prefix


@pytest.fixture(scope="module")
def stack(nginx_prefix):
    backend = Backend()
    port = free_port()
    guard = Daemon(python_cmd(SEARCHKEYS, "serve", "--host", "127.0.0.1", "--port", str(port),
                              "--master-key", MASTER, "--upstream", "http://" + backend.address,
                              "--upstream-key", BACKEND_KEY, *GUARD_FLAGS), port, timeout=30.0)
    prefix = nginx_prefix
    listen = free_port()
    (prefix / "nginx.conf").write_text(nginx_config(
        "127.0.0.1:%d" % listen, "127.0.0.1:%d" % port, backend.address))
    nginx = subprocess.Popen([NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"),
                              "-e", "stderr"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        wait_for_port(listen, nginx, timeout=15)
        yield guard, listen, backend
    finally:
        stop_session(nginx, signal.SIGQUIT)
        guard.__exit__(None, None, None)
        backend.close()


def create_key(port, actions, indexes):
    status, _, data = request(port, "POST", "/keys", json.dumps(
        {"actions": actions, "indexes": indexes, "expiresAt": None}),
        {"Authorization": "Bearer " + MASTER, "Content-Type": "application/json"})
    assert status == 201, data
    return json.loads(data)["key"]


def assert_meilisearch_error(answer, status, code):
    """A refusal as Meilisearch words it (JSON), not nginx's HTML error page."""
    got_status, headers, body = answer
    assert got_status == status, body
    assert headers["content-type"].startswith("application/json"), (headers, body)
    error = json.loads(body)
    assert error["code"] == code and error["type"] == "auth" and error["message"], error
    assert error["link"] == "https://docs.meilisearch.com/errors#" + code


def test_nginx_passes_what_searchkeys_allows_and_nothing_else(stack):
    guard, listen, backend = stack
    key = create_key(guard.port, ["search"], ["movies"])
    auth = {"Authorization": "Bearer " + key, "Content-Type": "application/json"}
    backend.seen.clear()
    for _ in range(3):  # the later ones may be answered from nginx's decision cache
        status, _, data = request(listen, "POST", "/indexes/movies/search", b'{"q":"a"}', auth)
        assert status == 200, data
        assert json.loads(data)["path"] == "/indexes/movies/search"
    assert len(backend.seen) == 3
    assert {s["authorization"] for s in backend.seen} == {"Bearer " + BACKEND_KEY}
    assert backend.seen[0]["body"] == b'{"q":"a"}'
    backend.seen.clear()
    for _ in range(2):  # the second answers may come from nginx's decision cache
        assert_meilisearch_error(request(listen, "POST", "/indexes/other/search", b"{}", auth),
                                 403, "invalid_api_key")
        assert_meilisearch_error(request(listen, "DELETE", "/indexes/movies", headers=auth),
                                 403, "invalid_api_key")
        assert_meilisearch_error(request(listen, "GET", "/keys", headers=auth), 403, "invalid_api_key")
        assert_meilisearch_error(request(listen, "POST", "/indexes/movies/search", b"{}"),
                                 401, "missing_authorization_header")
    assert backend.seen == []
    assert request(listen, "GET", "/health")[0] == 200  # public: allowed without a key


def test_a_write_that_may_create_an_index_needs_indexes_create(stack):
    """Meilisearch creates a missing index on a documents write only for a key with
    `indexes.create`; nginx forwards with the backend key, which has it, so searchkeys asks
    the backend whether the index exists and refuses the write on a missing one."""
    guard, listen, backend = stack
    writer = create_key(guard.port, ["documents.add"], ["movies", "films"])
    creator = create_key(guard.port, ["documents.add", "indexes.create"], ["films"])
    backend.seen.clear()
    for _ in range(2):  # the second answer may come from nginx's decision cache
        answer = request(listen, "POST", "/indexes/films/documents", b"[]", {
            "Authorization": "Bearer " + writer, "Content-Type": "application/json"})
        assert answer[0] == 403 and json.loads(answer[2])["code"] == "index_not_found", answer
    assert backend.seen == []
    for uid, key in (("movies", writer), ("films", creator)):
        status, _, data = request(listen, "POST", "/indexes/%s/documents" % uid, b"[]", {
            "Authorization": "Bearer " + key, "Content-Type": "application/json"})
        assert status == 200 and json.loads(data)["path"] == "/indexes/%s/documents" % uid


def test_searchkeys_own_routes_never_reach_the_backend(stack):
    """/keys, /metrics and /health are searchkeys' own: nginx must never hand them to the
    backend with the backend's key (an admin key would list, then create, backend keys)."""
    guard, listen, backend = stack
    admin = create_key(guard.port, ["*"], ["*"])
    auth = {"Authorization": "Bearer " + admin, "Content-Type": "application/json"}
    backend.seen.clear()
    status, _, data = request(listen, "GET", "/keys", headers=auth)
    assert status == 200, data
    assert admin in [k["key"] for k in json.loads(data)["results"]]
    status, _, data = request(listen, "POST", "/keys", json.dumps(
        {"actions": ["search"], "indexes": ["movies"], "expiresAt": None}), auth)
    assert status == 201, data
    made = json.loads(data)["uid"]
    assert request(guard.port, "GET", "/keys/" + made, headers={
        "Authorization": "Bearer " + MASTER})[0] == 200  # made in searchkeys' store
    status, headers, data = request(listen, "GET", "/metrics", headers=auth)
    assert status == 200 and b"searchkeys_" in data, data
    assert json.loads(request(listen, "GET", "/health")[2]) == {"status": "available"}
    assert backend.seen == []
    # and /authorize itself refuses them, whatever path spelling reaches it
    for method, uri in (("GET", "/keys"), ("POST", "/keys"), ("GET", "/metrics"),
                        ("GET", "/health"), ("GET", "/keys/" + made), ("GET", "/authorize")):
        status, headers, data = request(guard.port, "GET", "/authorize", headers={
            "Authorization": "Bearer " + MASTER, "X-Original-URI": uri,
            "X-Original-Method": method})
        assert status == 403 and json.loads(data)["code"] == "unknown_route", (uri, data)
        assert json.loads(headers["x-searchkeys-error"]) == json.loads(data)


def test_the_recommended_search_keys_work_behind_nginx(stack):
    """`keys create --preset search` (a per-IP rate and a hit cap): POST search and
    /multi-search, the official clients' routes, pass nginx, capped and counted."""
    guard, listen, backend = stack
    key = create_key(guard.port, ["search"], ["movies"])
    status, _, data = request(guard.port, "PUT", "/keys/%s/restrictions" % key, json.dumps(
        {"rateLimit": {"perIp": "120/minute"}, "maxHitsPerQuery": 100}),
        {"Authorization": "Bearer " + MASTER, "Content-Type": "application/json"})
    assert status == 200, data
    auth = {"Authorization": "Bearer " + key, "Content-Type": "application/json"}
    backend.seen.clear()
    status, _, data = request(listen, "POST", "/indexes/movies/search",
                              b'{"q":"a","limit":1000}', auth)
    assert status == 200, data
    status, _, data = request(listen, "POST", "/multi-search", json.dumps(
        {"queries": [{"indexUid": "movies", "q": "a"}, {"indexUid": "movies", "limit": 500}]}),
        auth)
    assert status == 200, data
    sent = [json.loads(s["body"]) for s in backend.seen]
    assert sent[0]["limit"] == 100 and [q.get("limit") for q in sent[1]["queries"]] == [None, 100]
    assert {s["authorization"] for s in backend.seen} == {"Bearer " + BACKEND_KEY}


def test_refusals_through_nginx_carry_their_reason(stack):
    """nginx relays no body of an auth_request refusal: the recipe answers searchkeys' own
    error (its X-Searchkeys-Error header), not a generic invalid_api_key."""
    guard, listen, backend = stack
    key = create_key(guard.port, ["search", "documents.get"], ["movies"])
    status, _, data = request(guard.port, "PUT", "/keys/%s/restrictions" % key, json.dumps(
        {"forcedParameters": {"movies": {"filter": "public = true"}}}),
        {"Authorization": "Bearer " + MASTER, "Content-Type": "application/json"})
    assert status == 200, data
    backend.seen.clear()
    for _ in range(2):
        assert_meilisearch_error(request(listen, "GET", "/indexes/movies/documents", headers={
            "Authorization": "Bearer " + key}), 403, "forbidden_by_restriction")
    assert_meilisearch_error(request(listen, "GET", "/indexes/books/documents", headers={
        "Authorization": "Bearer " + key}), 403, "invalid_api_key")
    assert b"cannot acces the index `books`" in request(
        listen, "GET", "/indexes/books/documents", headers={"Authorization": "Bearer " + key})[2]
    assert backend.seen == []


def test_documents_fetches_of_restricted_keys_go_through_searchkeys(stack):
    """A documents fetch is read and rewritten by searchkeys (the forced filter fused in); a
    GET of documents, which nginx sends through /authorize, is refused with the reason."""
    guard, listen, backend = stack
    key = create_key(guard.port, ["documents.get"], ["movies"])
    status, _, data = request(guard.port, "PUT", "/keys/%s/restrictions" % key, json.dumps(
        {"forcedParameters": {"movies": {"filter": "public = true"}}}),
        {"Authorization": "Bearer " + MASTER, "Content-Type": "application/json"})
    assert status == 200, data
    backend.seen.clear()
    status, _, data = request(listen, "POST", "/indexes/movies/documents/fetch",
                              json.dumps({"filter": "a = 1 OR b = 2"}),
                              {"Authorization": "Bearer " + key,
                               "Content-Type": "application/json"})
    assert status == 200, data
    assert [(s["path"], json.loads(s["body"])) for s in backend.seen] == [
        ("/indexes/movies/documents/fetch", {"filter": ["a = 1 OR b = 2", "public = true"]})]
    assert_meilisearch_error(request(listen, "GET", "/indexes/movies/documents/1", headers={
        "Authorization": "Bearer " + key}), 403, "forbidden_by_restriction")
    assert len(backend.seen) == 1


NETWORK_HEADERS = {  # Meilisearch's, which it believes from its network peers
    "X-Meili-Proxy-Origin-Remote": "ms-0", "X-Meili-Proxy-Origin-TaskUid": "1",
    "X-Meili-Proxy-Origin-Network-Version": "1", "X-Meili-Proxy-Import-Remote": "ms-1",
    "X-Meili-Proxy-Import-Index-Count": "1", "X-Meili-Proxy-Import-Index": "movies",
    "X-Meili-Proxy-Import-Task-Key": "x", "X-Meili-Proxy-Import-Docs": "1",
    "X-Meili-Proxy-Import-Total-Index-Docs": "1", "Meili-Proxy-Origin-Remote": "ms-0",
    "Meili-Proxy-Origin-TaskUid": "1", "Meili-Proxy-Search": "true"}


def test_meilisearch_network_headers_never_reach_the_backend_through_nginx(stack):
    """Meilisearch believes its network headers (a write from a peer, an import) from its peers
    only, and nginx forwards with the backend's key: as the guard drops them, nothing that
    nginx forwards after `GET /authorize` carries one. They used to pass through `location /`,
    also on a decision nginx had cached for the same request without them."""
    guard, listen, backend = stack
    writer = create_key(guard.port, ["documents.add", "settings.get"], ["movies"])
    auth = {"Authorization": "Bearer " + writer, "Content-Type": "application/json"}
    backend.seen.clear()
    status, _, data = request(listen, "POST", "/indexes/movies/documents", b"[]", auth)
    assert status == 200, data  # nginx may cache this decision for the requests below
    for name, value in NETWORK_HEADERS.items():
        status, _, data = request(listen, "POST", "/indexes/movies/documents", b"[]",
                                  dict(auth, **{name: value}))
        assert status in (200, 403), (name, status, data)
        status, _, data = request(listen, "GET", "/indexes/movies/settings", None,
                                  dict(auth, **{name: value}))
        assert status in (200, 403), (name, status, data)
    for seen in backend.seen:
        assert not any("meili-proxy" in name for name in seen["names"]), seen
    # /authorize refuses them too, whatever their name after the prefix (a decision nginx
    # cached for the request without one would still let a name the recipe does not list by)
    status, headers, data = request(guard.port, "GET", "/authorize", headers=dict(
        auth, **{"X-Original-URI": "/indexes/movies/settings", "X-Original-Method": "GET",
                 "X-Meili-Proxy-Something-New": "1"}))
    assert status == 403 and b"Meili-Proxy" in data, data


def request_from(address, port, method, path, headers):
    """A request whose source is another loopback address (Linux answers on all of 127/8)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(address, 0))
    try:
        conn.request(method, path, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    except OSError as error:
        pytest.skip("needs loopback addresses besides 127.0.0.1 (%s); on macOS: "
                    "ifconfig lo0 alias %s" % (error, address))
    finally:
        conn.close()


def rate_limited_search_key(guard, rate_limit):
    """A key that may search `movies`, under this rateLimit."""
    key = create_key(guard.port, ["search"], ["movies"])
    master = {"Authorization": "Bearer " + MASTER, "Content-Type": "application/json"}
    status, _, body = request(guard.port, "PUT", "/keys/%s/restrictions" % key,
                              json.dumps({"rateLimit": rate_limit}), master)
    assert status == 200, body
    return key


def test_per_ip_rate_limit_counts_each_client_not_nginx(stack):
    """One client using up its per-IP rate leaves the others theirs (with --trusted-proxy)."""
    guard, listen, _ = stack
    key = rate_limited_search_key(guard, {"perIp": "2/minute"})
    search = {"Authorization": "Bearer " + key}
    first = [request_from("127.0.0.2", listen, "GET", "/indexes/movies/search?q=a", search)[0]
             for _ in range(3)]
    assert first == [200, 200, 429], first
    status, body = request_from("127.0.0.3", listen, "GET", "/indexes/movies/search?q=a", search)
    assert status == 200, body


def test_a_rate_limit_reaches_the_caller_as_429_and_nginx_logs_no_error(stack, nginx_prefix):
    """auth_request takes 2xx, 401 and 403 from /authorize; any other status, a rate limit's
    429 included, it logs as an error and answers 500. The recipe hands the 429 over as a 403
    and turns it back into a 429 with Retry-After for the caller (issue 31)."""
    guard, listen, _ = stack
    key = rate_limited_search_key(guard, {"perKey": "1/minute"})
    error_log = nginx_prefix / "error.log"
    logged = error_log.stat().st_size if error_log.exists() else 0
    search = {"Authorization": "Bearer " + key}
    assert request(listen, "GET", "/indexes/movies/search?q=a", headers=search)[0] == 200
    for _ in range(2):
        status, headers, body = request(listen, "GET", "/indexes/movies/search?q=a",
                                        headers=search)
        assert status == 429 and headers["content-type"].startswith("application/json"), body
        assert json.loads(body)["code"] == "too_many_requests"
        assert 0 < int(headers["retry-after"]) <= 60, headers
    # a plain refusal is still a 403 with Meilisearch's error
    assert_meilisearch_error(request(listen, "GET", "/indexes/other/search?q=a", headers=search),
                             403, "invalid_api_key")
    new = error_log.read_bytes()[logged:] if error_log.exists() else b""
    assert b"[error]" not in new and b"unexpected status" not in new, new
