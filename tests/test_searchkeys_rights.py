"""A key never gets more than it was given (issue 21): the guard (`searchkeys.py serve
--upstream`) on a loopback port in front of a stand-in backend that records what it is asked
and answers what each test scripts. Each test checks the answer and what reached the backend.
"""
import http.server
import json
import threading

import pytest

from support import answer_json, serve_in_thread
from test_searchkeys_restrictions import ADMIN, JSON, new_key, serve
INDEXES = {"results": [{"uid": "movies", "updatedAt": "2025-03-01T10:00:00.5Z"},
                       {"uid": "books", "updatedAt": "2026-01-02T00:00:00Z"}],
           "offset": 0, "limit": 1000000, "total": 2}


class Backend:
    """Records (method, target, headers, JSON body) of each request; answers what `script`
    holds for its path (status, JSON value), else 200 with an empty hit list."""

    def __init__(self):
        seen = self.seen = []
        script = self.script = {"/indexes": (200, INDEXES)}
        lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with lock:
                    seen.append((self.command, self.path, dict(self.headers.items()),
                                 json.loads(body) if body else None))
                status, value = script.get(self.path.partition("?")[0], (200, {"hits": []}))
                answer_json(self, json.dumps(value).encode(), status)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = answer

            def log_message(self, *args):
                pass

        self.server = serve_in_thread(Handler)
        self.url = self.server.url

    def targets(self):
        return [(method, target) for method, target, _, _ in self.seen]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def backend():
    stand_in = Backend()
    yield stand_in
    stand_in.close()


@pytest.fixture(scope="module")
def guard(backend):
    with serve(backend) as daemon:
        yield daemon


@pytest.fixture
def seen(backend):
    backend.seen.clear()
    backend.script.clear()
    backend.script["/indexes"] = (200, INDEXES)
    return backend


def call(guard, key, method, path, body=None, headers=None):
    """(status, JSON answer or None)."""
    sent = dict(JSON, Authorization="Bearer " + key["key"], **(headers or {}))
    status, _, data = guard.request(method, path, None if body is None else json.dumps(body),
                                    sent)
    return status, json.loads(data) if data else None


# --- hit caps -----------------------------------------------------------------------------------

def test_a_null_page_does_not_lift_the_hit_cap(guard, seen):
    """Meilisearch reads `page: null` as absent and applies `limit`: the cap must too."""
    key = new_key(guard, {"maxHitsPerQuery": 50})
    assert call(guard, key, "POST", "/indexes/movies/search",
                {"q": "a", "page": None, "limit": 1000})[0] == 200
    assert seen.seen[-1][3]["limit"] == 50
    assert call(guard, key, "POST", "/indexes/movies/search",
                {"q": "a", "hitsPerPage": None, "limit": 1000})[0] == 200
    assert seen.seen[-1][3]["limit"] == 50
    assert call(guard, key, "POST", "/multi-search", {"queries": [
        {"indexUid": "movies", "page": None, "limit": 1000}]})[0] == 200
    assert seen.seen[-1][3]["queries"][0]["limit"] == 50
    assert call(guard, key, "POST", "/multi-search", {
        "federation": {"page": None, "limit": 1000}, "queries": [{"indexUid": "movies"}]})[0] \
        == 200
    assert seen.seen[-1][3]["federation"]["limit"] == 50
    # a real page still caps hitsPerPage, and a stray large limit beside it too
    assert call(guard, key, "POST", "/indexes/movies/search",
                {"page": 1, "hitsPerPage": 900, "limit": 900})[0] == 200
    assert (seen.seen[-1][3]["hitsPerPage"], seen.seen[-1][3]["limit"]) == (50, 50)


def test_a_multi_search_counts_each_query_against_the_rate_limit(guard, seen):
    """200 queries of 50 hits in one request must not cost one request of the rate."""
    key = new_key(guard, {"rateLimit": {"perKey": "5/hour"},
                                       "maxHitsPerQuery": 50})
    three = {"queries": [{"indexUid": "movies", "q": str(n)} for n in range(3)]}
    assert call(guard, key, "POST", "/multi-search", three)[0] == 200
    status, error = call(guard, key, "POST", "/multi-search", three)
    assert status == 429 and error["code"] == "too_many_requests"
    assert len(seen.seen) == 1
    many = new_key(guard, {"rateLimit": {"perIp": "120/minute"}})
    status, error = call(guard, many, "POST", "/multi-search", {
        "queries": [{"indexUid": "movies", "limit": 50}] * 200})
    assert status in (403, 429) and "rateLimit" in error["message"]
    assert len(seen.seen) == 1
    # nginx never shows /authorize the body: it cannot count the queries
    status, _, _ = guard.request("GET", "/authorize", None, {
        "Authorization": "Bearer " + many["key"], "X-Original-URI": "/multi-search",
        "X-Original-Method": "POST"})
    assert status == 403


# --- index creation ------------------------------------------------------------------------------

MISSING = (404, {"message": "Index `shows` not found.", "code": "index_not_found",
                 "type": "invalid_request",
                 "link": "https://docs.meilisearch.com/errors#index_not_found"})
CREATING_WRITES = [("POST", "/indexes/%s/documents", [{"id": 1}]),
                   ("PUT", "/indexes/%s/documents", [{"id": 1}]),
                   ("PATCH", "/indexes/%s/settings", {"stopWords": ["a"]}),
                   ("PUT", "/indexes/%s/settings/stop-words", ["a"]),
                   ("PATCH", "/indexes/%s/settings/typo-tolerance", {"enabled": False}),
                   # deletions pass allow_index_creation too; the guard does not rely on
                   # Meilisearch's scheduler dropping it for them
                   ("DELETE", "/indexes/%s/settings", None),
                   ("DELETE", "/indexes/%s/settings/stop-words", None)]


@pytest.mark.parametrize("method, path, body", CREATING_WRITES)
def test_a_write_never_creates_an_index_for_a_key_without_indexes_create(
        guard, seen, method, path, body):
    """Meilisearch lets a documents or settings write create its missing index only for a key
    with `indexes.create`; the backend gets the upstream key, which has it."""
    writer = new_key(guard, None, actions=["documents.add", "settings.update"])
    seen.script["/indexes/shows"] = MISSING
    status, error = call(guard, writer, method, path % "shows", body)
    assert (status, error) == MISSING
    assert seen.targets() == [("GET", "/indexes/shows")]  # the guard's question, no write
    seen.script["/indexes/shows"] = (503, {"message": "busy", "code": "unavailable",
                                           "type": "system", "link": "x"})
    status, error = call(guard, writer, method, path % "shows", body)
    assert status == 502 and error["code"] == "upstream_unavailable"
    status, _, _ = guard.request("GET", "/authorize", None, {
        "Authorization": "Bearer " + writer["key"], "X-Original-URI": path % "shows",
        "X-Original-Method": method})
    assert status != 204
    seen.script["/indexes/shows"] = MISSING
    status, _, data = guard.request("GET", "/authorize", None, {
        "Authorization": "Bearer " + writer["key"], "X-Original-URI": path % "shows",
        "X-Original-Method": method})
    assert status == 403 and json.loads(data)["code"] == "index_not_found"
    assert (method, path % "shows") not in seen.targets()
    seen.seen.clear()
    assert call(guard, writer, method, path % "movies", body)[0] == 200  # an index that exists
    assert seen.targets() == [("GET", "/indexes/movies"), (method, path % "movies")]
    creator = new_key(guard, None, actions=["documents.add", "settings.update",
                                            "indexes.create"], indexes=["shows", "movies"])
    seen.seen.clear()
    assert call(guard, creator, method, path % "shows", body)[0] == 200
    assert seen.targets() == [(method, path % "shows")]


# --- restrictions belong to the key -------------------------------------------------------------

def test_only_the_master_key_deletes_a_restricted_key(guard, seen):
    """Otherwise an admin key deletes it and creates it again with the same uid (hence the
    same value): the public key, without its restrictions."""
    admin = new_key(guard, None, actions=["*"])
    as_admin = dict(JSON, Authorization="Bearer " + admin["key"])
    public = new_key(guard, {"maxHitsPerQuery": 5})
    status, _, data = guard.request("DELETE", "/keys/" + public["uid"], None, as_admin)
    assert status == 403 and json.loads(data)["code"] == "invalid_api_key"
    status, _, data = guard.request("POST", "/keys", json.dumps(
        {"uid": public["uid"], "actions": ["search"], "indexes": ["*"], "expiresAt": None}),
        as_admin)
    assert status == 409
    assert call(guard, public, "POST", "/indexes/movies/search", {"limit": 100})[0] == 200
    assert seen.seen[-1][3]["limit"] == 5
    plain = new_key(guard, None)
    assert guard.request("DELETE", "/keys/" + plain["uid"], None, as_admin)[0] == 204
    assert guard.request("DELETE", "/keys/" + public["key"], None, ADMIN)[0] == 204


# --- tasks and batches --------------------------------------------------------------------------

def test_task_documents_are_forwarded_only_for_a_task_the_key_covers(guard, seen):
    key = new_key(guard, None, actions=["tasks.get"], indexes=["movies"])
    seen.script["/tasks/7"] = (503, {"message": "busy", "code": "unavailable",
                                     "type": "system", "link": "x"})
    assert call(guard, key, "GET", "/tasks/7/documents")[0] != 200
    seen.script["/tasks/7"] = (200, {"uid": 7, "indexUid": "books"})
    status, error = call(guard, key, "GET", "/tasks/7/documents")
    assert status == 404 and error["code"] == "task_not_found"
    seen.script["/tasks/7"] = (200, ["not", "a", "task"])
    assert call(guard, key, "GET", "/tasks/7/documents")[0] == 404
    assert ("GET", "/tasks/7/documents") not in seen.targets()
    seen.script["/tasks/7"] = (200, {"uid": 7, "indexUid": "movies"})
    assert call(guard, key, "GET", "/tasks/7/documents")[0] == 200
    assert seen.targets()[-1] == ("GET", "/tasks/7/documents")


@pytest.mark.parametrize("method, path, what", [("DELETE", "/tasks", "delete"),
                                                 ("POST", "/tasks/cancel", "cancel")])
def test_task_deletion_and_cancelation_need_a_filter(guard, seen, method, path, what):
    """Meilisearch refuses them without one; the guard must not turn them into "every task
    of my indexes"."""
    key = new_key(guard, None, actions=["tasks.*"], indexes=["movies"])
    for query in ("", "?", "?&"):
        status, error = call(guard, key, method, path + query)
        assert status == 400 and error == {
            "message": "Query parameters to filter the tasks to %s are missing. Available "
                       "query parameters are: `uids`, `indexUids`, `statuses`, `types`, "
                       "`canceledBy`, `beforeEnqueuedAt`, `afterEnqueuedAt`, "
                       "`beforeStartedAt`, `afterStartedAt`, `beforeFinishedAt`, "
                       "`afterFinishedAt`." % what,
            "code": "missing_task_filters", "type": "invalid_request",
            "link": "https://docs.meilisearch.com/errors#missing_task_filters"}
    assert [t for t in seen.targets() if t[0] == method] == []
    assert call(guard, key, method, path + "?statuses=failed")[0] == 200
    assert seen.targets()[-1] == (method, path + "?statuses=failed&indexUids=movies")


def test_a_batch_is_shown_when_any_of_its_indexes_is_covered(guard, seen):
    """As Meilisearch: GET /batches/{id} agrees with GET /batches (a batch with one covered
    index), and a batch of tasks spanning indexes (a swap) is never shown."""
    key = new_key(guard, None, actions=["tasks.get"], indexes=["movies"])
    seen.script["/batches/3"] = (200, {"uid": 3, "stats": {
        "indexUids": {"movies": 1, "books": 1}, "types": {"documentAdditionOrUpdate": 2}}})
    assert call(guard, key, "GET", "/batches/3")[0] == 200
    seen.script["/batches/3"] = (200, {"uid": 3, "stats": {
        "indexUids": {"movies": 1, "books": 1}, "types": {"indexSwap": 1}}})
    assert call(guard, key, "GET", "/batches/3")[0] == 404
    seen.script["/batches/3"] = (200, {"uid": 3, "stats": {
        "indexUids": {"books": 1}, "types": {"documentAdditionOrUpdate": 1}}})
    assert call(guard, key, "GET", "/batches/3")[0] == 404


# --- other answers and headers ------------------------------------------------------------------

def test_stats_last_update_covers_only_the_keys_indexes(guard, seen):
    seen.script["/stats"] = (200, {"databaseSize": 9, "lastUpdate": "2026-01-02T00:00:00Z",
                                   "indexes": {"movies": {"numberOfDocuments": 1},
                                               "books": {"numberOfDocuments": 2}}})
    key = new_key(guard, None, actions=["stats.get"], indexes=["movies"])
    status, stats = call(guard, key, "GET", "/stats")
    assert status == 200 and stats["indexes"] == {"movies": {"numberOfDocuments": 1}}
    assert stats["lastUpdate"] == "2025-03-01T10:00:00.5Z"
    nothing = new_key(guard, None, actions=["stats.get"], indexes=["shows"])
    assert call(guard, nothing, "GET", "/stats")[1]["lastUpdate"] is None


def test_meilisearch_network_headers_never_reach_the_backend(guard, seen):
    """The backend trusts them from its network peers; it gets our key, not the caller's."""
    key = new_key(guard, None)
    forged = {"X-Meili-Proxy-Origin-Remote": "ms-0", "X-Meili-Proxy-Origin-TaskUid": "1",
              "Meili-Proxy-Search": "true", "X-Meili-Proxy-Import-Remote": "ms-1",
              "X-Custom": "kept"}
    assert call(guard, key, "POST", "/indexes/movies/search", {"q": "a"}, forged)[0] == 200
    names = {name.lower() for name in seen.seen[-1][2]}
    assert "x-custom" in names and not any("meili-proxy" in name for name in names)


def test_authorize_needs_the_original_method(guard, seen):
    """Without X-Original-Method (a config that omits it) a POST adding documents would be
    judged as a GET reading them."""
    reader = new_key(guard, None, actions=["documents.get"])
    for headers in ({}, {"X-Original-Method": ""}):
        status, _, data = guard.request("GET", "/authorize", None, dict(
            headers, Authorization="Bearer " + reader["key"],
            **{"X-Original-URI": "/indexes/movies/documents"}))
        assert status == 400 and "X-Original-Method" in json.loads(data)["message"]
    status, _, _ = guard.request("GET", "/authorize", None, {
        "Authorization": "Bearer " + reader["key"], "X-Original-URI": "/indexes/movies/documents",
        "X-Original-Method": "GET"})
    assert status == 204


def test_an_index_scoped_key_renames_its_index_only_to_a_name_it_covers(guard, seen):
    """PATCH /indexes/{uid} with a new `uid` renames the index (Meilisearch checks only that the
    key may update the old one): a key held to `movies` could move it under any name, e.g. one a
    public search key covers, as it may not create (POST /indexes) nor swap (POST /swap-indexes)
    an index of a name outside its own."""
    key = new_key(guard, None, actions=["indexes.update", "indexes.create"],
                  indexes=["movies", "films*"])
    for uid in ("secret", "public-movies", "film"):
        assert call(guard, key, "PATCH", "/indexes/movies", {"uid": uid})[0] == 403, uid
        assert call(guard, key, "POST", "/swap-indexes", [
            {"indexes": ["movies", uid], "rename": True}])[0] == 403, uid
    assert seen.seen == []
    for body in ({"uid": "films-2024"}, {"primaryKey": "id"}, {"uid": None, "primaryKey": "id"}):
        assert call(guard, key, "PATCH", "/indexes/movies", body)[0] == 200, body
        assert seen.seen[-1][3] == body
    # an unscoped key renames as Meilisearch lets it
    anywhere = new_key(guard, None, actions=["indexes.update"], indexes=["*"])
    assert call(guard, anywhere, "PATCH", "/indexes/movies", {"uid": "secret"})[0] == 200
