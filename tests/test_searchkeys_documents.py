"""Tenant tokens and forced filters on the document routes (issue 34, item 1): `GET
/indexes/{i}/documents` and `POST .../documents/fetch` get the token's (and the key's forced)
filter fused in and their fields limited as a search's; `GET .../documents/{id}` answers only
a document that passes the filter (asked of the backend as a documents fetch of that id),
else Meilisearch's own 404, as if it were missing. Credentials without a filter are forwarded
as before; `GET /authorize`, which cannot rewrite, refuses them with the reason.

Black-box: the real `searchkeys.py serve` in front of a stand-in backend that holds documents
and answers the three routes as Meilisearch does (filters AND-ed per array element, OR-ed
inside, `ids`, `offset`, `fields`, `retrieveVectors`, `document_not_found`).
"""
import http.server
import json
import re
import urllib.parse

import pytest

from support import answer_json, serve_in_thread
from test_searchkeys_forced import token
from test_searchkeys_forced import guard  # noqa: F401 (the guard in front of this `backend`)
from test_searchkeys_restrictions import JSON, new_key

DOCUMENTS = [
    {"id": 1, "title": "Alpha", "tenant": "acme", "public": True, "secret": "s1",
     "_vectors": {"default": [0.5]}},
    {"id": 2, "title": "Beta", "tenant": "acme", "public": False, "secret": "s2"},
    {"id": 3, "title": "Gamma", "tenant": "other", "public": True, "secret": "s3"},
    {"id": "x-4", "title": "Delta", "tenant": "other", "public": False, "secret": "s4"},
]
# The indexes' displayedAttributes: `movies` and `catalog` hold DOCUMENTS, `catalog` shows
# only some of their attributes; `reviews` exists only to join `critics`; `broken` answers
# something else than the setting.
DISPLAYED = {"movies": ["*"], "catalog": ["id", "title", "tenant"], "reviews": ["*"],
             "broken": {"displayedAttributes": ["id"]}}


def meili_error(message, code, status=400):
    return status, {"message": message, "code": code, "type": "invalid_request",
                    "link": "https://docs.meilisearch.com/errors#" + code}


class FilterError(Exception):
    pass


def matches(document, expression):
    """A Meilisearch filter (a string, or an AND-array of strings and OR-arrays) on one
    document: `field = value`, `!=`, AND, OR, NOT and parentheses, enough for these tests."""
    if isinstance(expression, list):
        return all(any(matches(document, e) for e in item) if isinstance(item, list)
                   else matches(document, item) for item in expression)
    if not isinstance(expression, str):
        raise FilterError("expected String or Array, found %s" % json.dumps(expression))
    tokens = re.findall(r"\(|\)|!=|=|'[^']*'|\"[^\"]*\"|[^\s()=!]+", expression)
    if not tokens:
        return True
    position = [0]

    def take():
        position[0] += 1
        return tokens[position[0] - 1]

    def peek():
        return tokens[position[0]] if position[0] < len(tokens) else None

    def either():
        value = both()
        while peek() == "OR":
            take()
            value = both() or value
        return value

    def both():
        value = negated()
        while peek() == "AND":
            take()
            value = negated() and value
        return value

    def negated():
        if peek() == "NOT":
            take()
            return not negated()
        if peek() == "(":
            take()
            value = either()
            if take() != ")":
                raise FilterError("unclosed parenthesis")
            return value
        field, operator, value = take(), take(), take().strip("'\"")
        if operator not in ("=", "!="):
            raise FilterError("bad operator %s" % operator)
        found = document.get(field)
        equal = json.dumps(found) == value if isinstance(found, bool) else str(found) == value
        return equal if operator == "=" else not equal

    try:
        value = either()
    except IndexError:
        raise FilterError("unexpected end")
    if peek() is not None:
        raise FilterError("unexpected %s" % peek())
    return value


def shown(document, fields, vectors):
    """A document as Meilisearch shows it: `fields` selected (all for None), `_vectors` only
    when retrieved."""
    document = {k: v for k, v in document.items() if k != "_vectors"}
    if vectors:
        document["_vectors"] = dict(DOCUMENTS[0]["_vectors"]) if document["id"] == 1 else {}
    if fields is not None:
        document = {k: v for k, v in document.items()
                    if k in fields or k == "_vectors" and vectors}
    return document


def browse(query):
    """POST documents/fetch (or GET documents, read into the same shape): (status, answer)."""
    try:
        candidates = DOCUMENTS
        if query.get("ids") is not None:
            candidates = [d for d in DOCUMENTS if str(d["id"]) in map(str, query["ids"])]
        if query.get("filter") is not None:
            candidates = [d for d in candidates if matches(d, query["filter"])]
    except FilterError as exc:
        return meili_error(str(exc), "invalid_document_filter")
    offset, limit = query.get("offset", 0), query.get("limit", 20)
    return 200, {"results": [shown(d, query.get("fields"), query.get("retrieveVectors"))
                             for d in candidates[offset:offset + limit]],
                 "offset": offset, "limit": limit, "total": len(candidates)}


class Backend:
    """The indexes `movies` and `catalog` holding DOCUMENTS, with DISPLAYED (`reviews` exists
    only to join `critics`); every request it gets is in `seen`."""

    def __init__(self):
        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                path, _, query = self.path.partition("?")
                seen.append((self.command, self.path, body, self.headers.get("Content-Type")))
                parts = [urllib.parse.unquote(p) for p in path.split("/")[1:]]
                status, answer = self.route(parts, urllib.parse.parse_qsl(query), body)
                answer_json(self, json.dumps(answer).encode(), status)

            def route(self, parts, pairs, body):
                if parts[2:] == ["settings", "foreign-keys"]:  # only `reviews` joins another
                    return 200, [{"foreignIndexUid": "critics", "foreignKey": "critic"}] \
                        if parts[1] == "reviews" else []
                if parts[2:] == ["settings", "displayed-attributes"] and parts[1] in DISPLAYED:
                    return 200, DISPLAYED[parts[1]]
                if parts[:1] != ["indexes"] or len(parts) < 3 or parts[2] not in (
                        "documents", "settings"):
                    return 200, {"hits": []}
                if parts[1] not in ("movies", "catalog") or parts[2] != "documents":
                    return meili_error("Index `%s` not found." % parts[1], "index_not_found",
                                       404)
                params = dict(pairs)  # the last of a repeated parameter counts
                fields = params["fields"].split(",") if "fields" in params else None
                fields = None if fields and "*" in fields else fields
                vectors = params.get("retrieveVectors") == "true"
                if self.command == "POST" and parts[3:] == ["fetch"]:
                    if self.headers.get("Content-Type") != "application/json":
                        return meili_error("missing content type", "missing_content_type", 415)
                    return browse(body)
                if len(parts) == 4:
                    found = [d for d in DOCUMENTS if str(d["id"]) == parts[3]]
                    if not found:
                        return meili_error("Document `%s` not found." % parts[3],
                                           "document_not_found", 404)
                    return 200, shown(found[0], fields, vectors)
                query = {"offset": int(params.get("offset", 0)),
                         "limit": int(params.get("limit", 20)), "fields": fields,
                         "retrieveVectors": vectors,
                         "ids": params["ids"].split(",") if "ids" in params else None}
                if "filter" in params:
                    try:
                        query["filter"] = json.loads(params["filter"])
                    except ValueError:
                        query["filter"] = params["filter"]
                return browse(query)

            do_GET = do_POST = answer

            def log_message(self, *args):
                pass

        self.server = serve_in_thread(Handler)
        self.url = self.server.url


@pytest.fixture(scope="module")
def backend():
    stand_in = Backend()
    yield stand_in
    stand_in.server.shutdown()
    stand_in.server.server_close()


@pytest.fixture(scope="module")
def reader(guard):
    """A key that reads documents, with nothing forced."""
    return new_key(guard, None, actions=("search", "documents.get"))


@pytest.fixture(scope="module")
def tenant(reader):
    """A tenant token of `reader` that sees acme's documents of `movies` only."""
    return token(reader, {"movies": {"filter": "tenant = acme"}})


@pytest.fixture(scope="module")
def forced(guard):
    """A key whose forced parameters show public documents' ids and titles only."""
    return new_key(guard, {"forcedParameters": {"movies": {
        "filter": "public = true", "attributesToRetrieve": ["id", "title"]}}},
        actions=("documents.get",))["key"]


def send(guard, backend, credential, method, target, body=None):
    """(status, answer, what the backend got: (method, target, body, content type) or None)."""
    backend.seen.clear()
    raw = body if isinstance(body, (str, type(None))) else json.dumps(body)
    status, _, data = guard.request(method, target, raw,
                                    dict(JSON, Authorization="Bearer " + credential))
    return status, json.loads(data), backend.seen[-1] if backend.seen else None


def last_and(sent):
    """The last condition a filter sent AND-s (the one fused in)."""
    return sent[-1] if isinstance(sent, list) else sent


def ids(answer):
    return sorted(str(document["id"]) for document in answer["results"])


@pytest.mark.parametrize("target, expected", [
    ("/indexes/movies/documents", ["1", "2"]),
    ("/indexes/movies/documents?offset=1&limit=5", ["2"]),
    ("/indexes/movies/documents?ids=1,3,x-4", ["1"]),
    ("/indexes/movies/documents?filter=tenant%20%3D%20other%20OR%20public%20%3D%20true",
     ["1"]),
    ("/indexes/movies/documents?filter=tenant%20%3D%20other&filter=public%20%3D%20false",
     ["2"]),  # the last counts, as in Meilisearch
    ("/indexes/movies/documents?filter=%5B%5B%22tenant%20%3D%20other%22%2C%22id%20%3D%201%22%5D%5D",
     ["1"]),
    ("/indexes/movies/documents?filter=NOT%20tenant%20%3D%20acme", []),
])
def test_a_tenant_token_lists_only_its_documents(guard, backend, tenant, target, expected):
    status, answer, seen = send(guard, backend, tenant, "GET", target)
    assert status == 200 and ids(answer) == expected, answer
    assert answer["total"] == len(expected) + (1 if "offset=1" in target else 0)
    sent = dict(urllib.parse.parse_qsl(seen[1].partition("?")[2]))
    assert last_and(json.loads(sent["filter"])) == "tenant = acme"


@pytest.mark.parametrize("body, expected", [
    ({}, ["1", "2"]),
    ({"filter": None}, ["1", "2"]),
    ({"filter": "tenant = other OR id = 3"}, []),
    ({"filter": [["tenant = other", "public = true"]]}, ["1"]),
    ({"ids": ["3", "x-4", 2]}, ["2"]),
    ({"offset": 1}, ["2"]),
])
def test_a_tenant_token_fetches_only_its_documents(guard, backend, tenant, body, expected):
    status, answer, seen = send(guard, backend, tenant, "POST",
                                "/indexes/movies/documents/fetch", body)
    assert status == 200 and ids(answer) == expected, answer
    assert last_and(seen[2]["filter"]) == "tenant = acme"


def test_a_tenant_token_reads_one_document_only_when_it_passes(guard, backend, reader, tenant):
    status, answer, seen = send(guard, backend, tenant, "GET", "/indexes/movies/documents/1")
    assert status == 200 and answer == shown(DOCUMENTS[0], None, False)
    assert seen == ("POST", "/indexes/movies/documents/fetch",
                    {"ids": ["1"], "limit": 1, "filter": "tenant = acme"}, "application/json")
    # outside the filter, the path segment decoded as actix decodes it: as if missing
    for segment, document_id in (("3", "3"), ("x-4", "x-4"), ("%33", "3"), ("x%2D4", "x-4")):
        status, answer, _ = send(guard, backend, tenant, "GET",
                                 "/indexes/movies/documents/" + segment)
        assert status == 404 and answer == {
            "message": "Document `%s` not found." % document_id, "code": "document_not_found",
            "type": "invalid_request",
            "link": "https://docs.meilisearch.com/errors#document_not_found"}
    # an id no document can have: the backend's own answer to the unrestricted key
    status, answer, seen = send(guard, backend, tenant, "GET", "/indexes/movies/documents/a%20b")
    assert (status, seen[2]["ids"]) == (404, [])
    assert (status, answer) == send(guard, backend, reader["key"], "GET",
                                     "/indexes/movies/documents/a%20b")[:2]
    # the route's query string is read as Meilisearch reads it: no filter slipped in
    status, answer, _ = send(guard, backend, tenant, "GET",
                             "/indexes/movies/documents/3?filter=tenant%20%3D%20other")
    assert status == 400 and answer["code"] == "bad_request"
    assert answer["message"].startswith("Unknown parameter `filter`")
    # another index of the token's key: not its rules
    assert send(guard, backend, tenant, "GET", "/indexes/books/documents/1")[0] == 403
    # a token reads documents only when its key may
    searcher = token(new_key(guard, None, actions=("search",)), {"movies": {"filter": "a = 1"}})
    status, answer, seen = send(guard, backend, searcher, "GET", "/indexes/movies/documents/1")
    assert status == 403 and answer["code"] == "invalid_api_key" and seen is None


def test_forced_parameters_hold_documents_and_fields(guard, backend, forced):
    status, answer, _ = send(guard, backend, forced, "GET",
                             "/indexes/movies/documents?fields=title,secret&retrieveVectors=true")
    assert status == 200 and answer["results"] == [{"title": "Alpha"}, {"title": "Gamma"}]
    status, answer, _ = send(guard, backend, forced, "POST", "/indexes/movies/documents/fetch",
                             {"fields": ["secret"], "filter": "public = false OR id = 1"})
    assert status == 200 and answer["results"] == [{}]
    status, answer, _ = send(guard, backend, forced, "POST", "/indexes/movies/documents/fetch",
                             {"fields": None, "retrieveVectors": True})
    assert status == 200 and answer["results"] == [{"id": 1, "title": "Alpha"},
                                                   {"id": 3, "title": "Gamma"}]
    status, answer, seen = send(guard, backend, forced, "GET",
                                "/indexes/movies/documents/1?fields=*&retrieveVectors=true")
    assert status == 200 and answer == {"id": 1, "title": "Alpha"}
    assert seen[2]["retrieveVectors"] is False and seen[2]["fields"] == ["id", "title"]
    status, answer, _ = send(guard, backend, forced, "GET", "/indexes/movies/documents/2")
    assert status == 404 and answer["code"] == "document_not_found"
    # a GET cannot spell "no field": refused, not widened
    status, answer, seen = send(guard, backend, forced, "GET",
                                "/indexes/movies/documents?fields=secret")
    assert status == 403 and seen is None and "use POST" in answer["message"]


def test_a_key_without_a_filter_is_forwarded_as_sent(guard, backend, reader):
    key = reader["key"]
    target = "/indexes/movies/documents/3?fields=secret&retrieveVectors=true"
    status, answer, seen = send(guard, backend, key, "GET", target)
    assert status == 200 and answer == {"secret": "s3", "_vectors": {}}
    assert seen[:2] == ("GET", target)
    sent = {"filter": "tenant = other", "fields": ["secret"]}
    status, answer, seen = send(guard, backend, key, "POST", "/indexes/movies/documents/fetch",
                                sent)
    assert status == 200 and seen[2] == sent and len(answer["results"]) == 2
    target = "/indexes/movies/documents?filter=tenant%20%3D%20other"
    assert send(guard, backend, key, "GET", target)[2][1] == target
    unscoped = token(reader, ["movies"])  # a token with no filter there: as its key
    status, answer, seen = send(guard, backend, unscoped, "GET", "/indexes/movies/documents/3")
    assert status == 200 and answer == shown(DOCUMENTS[2], None, False)
    assert seen[2] == {"ids": ["3"], "limit": 1}  # a fetch (its displayedAttributes are `*`)
    target = "/indexes/movies/documents?fields=secret&retrieveVectors=true"
    assert send(guard, backend, unscoped, "GET", target)[2][1] == target


def test_authorize_refuses_them_with_the_reason(guard, reader, tenant, forced):
    """Any token: its fields are cut to the index's displayedAttributes, which /authorize can
    neither read nor apply."""
    def authorize(credential, method, uri):
        status, headers, _ = guard.request("GET", "/authorize", None, {
            "Authorization": "Bearer " + credential, "X-Original-Method": method,
            "X-Original-URI": uri})
        error = headers.get("x-searchkeys-error")
        return status, json.loads(error) if error else None
    for method, uri in (("GET", "/indexes/movies/documents"),
                        ("POST", "/indexes/movies/documents/fetch"),
                        ("GET", "/indexes/movies/documents/1")):
        for credential in (tenant, token(reader, ["movies"])):
            status, error = authorize(credential, method, uri)
            assert status == 403 and error["code"] == "invalid_api_key"
            assert "tenant token" in error["message"] and "GET /authorize" in error["message"]
        status, error = authorize(forced, method, uri)
        assert status == 403 and error["code"] == "forbidden_by_restriction"
        assert "forcedParameters" in error["message"]
        assert authorize(reader["key"], method, uri) == (204, None)


@pytest.mark.parametrize("rules", [{"catalog": {"filter": "tenant = acme"}}, ["catalog"]])
def test_a_tenant_token_reads_only_the_displayed_attributes(guard, backend, reader, rules):
    """As its searches show them (issue 34), whether its rule filters the index or not:
    Meilisearch's documents routes ignore displayedAttributes, the guard does not."""
    credential = token(reader, rules)
    results = [shown(d, DISPLAYED["catalog"], False) for d in DOCUMENTS]
    results = results[:2] if isinstance(rules, dict) else results
    status, answer, seen = send(guard, backend, credential, "GET",
                                "/indexes/catalog/documents?retrieveVectors=true")
    assert status == 200 and answer["results"] == results, answer
    sent = dict(urllib.parse.parse_qsl(seen[1].partition("?")[2]))
    assert (sent["fields"], sent["retrieveVectors"]) == ("id,title,tenant", "false")
    status, answer, _ = send(guard, backend, credential, "GET",
                             "/indexes/catalog/documents?fields=secret,title")
    assert status == 200 and answer["results"] == [{"title": d["title"]} for d in results]
    status, answer, seen = send(guard, backend, credential, "GET",
                                "/indexes/catalog/documents?fields=secret")
    # a GET cannot spell "no field": refused, not widened (the backend got a lookup at most)
    assert status == 403 and "use POST" in answer["message"]
    assert seen is None or seen[1] == "/indexes/catalog/settings/displayed-attributes"
    for body in ({}, {"fields": None, "retrieveVectors": True}, {"fields": ["*", "secret"]}):
        status, answer, seen = send(guard, backend, credential, "POST",
                                    "/indexes/catalog/documents/fetch", body)
        assert status == 200 and answer["results"] == results, (body, answer)
    status, answer, _ = send(guard, backend, credential, "POST",
                             "/indexes/catalog/documents/fetch", {"fields": ["secret"]})
    assert status == 200 and answer["results"] == [{} for _ in results]
    status, answer, seen = send(guard, backend, credential, "GET",
                                "/indexes/catalog/documents/1?retrieveVectors=true")
    assert status == 200 and answer == {"id": 1, "title": "Alpha", "tenant": "acme"}
    assert seen[1] == "/indexes/catalog/documents/fetch" and seen[2]["retrieveVectors"] is False
    status, answer, _ = send(guard, backend, credential, "GET",
                             "/indexes/catalog/documents/1?fields=secret,title")
    assert status == 200 and answer == {"title": "Alpha"}
    # the key that signed it reads every field, as in Meilisearch
    target = "/indexes/catalog/documents/1?fields=secret&retrieveVectors=true"
    status, answer, seen = send(guard, backend, reader["key"], "GET", target)
    assert status == 200 and answer == {"secret": "s1", "_vectors": {"default": [0.5]}}
    assert seen[:2] == ("GET", target)
    status, answer, seen = send(guard, backend, reader["key"], "POST",
                                "/indexes/catalog/documents/fetch", {"fields": ["secret"]})
    assert status == 200 and [d["secret"] for d in answer["results"]] == ["s1", "s2", "s3", "s4"]


def test_a_tokens_read_fails_closed_without_the_setting(guard, backend, reader):
    """A missing index: its index_not_found, as Meilisearch answers the read; a setting the
    backend does not answer as one: 502, and the read is never sent."""
    credential = token(reader, ["*"])
    for method, target in (("GET", "/indexes/books/documents"),
                           ("POST", "/indexes/books/documents/fetch"),
                           ("GET", "/indexes/books/documents/1")):
        status, answer, seen = send(guard, backend, credential, method, target,
                                    {} if method == "POST" else None)
        assert status == 404 and answer["code"] == "index_not_found", answer
        assert seen[1] == "/indexes/books/settings/displayed-attributes"
        status, answer, seen = send(guard, backend, credential, method,
                                    target.replace("books", "broken"),
                                    {} if method == "POST" else None)
        assert status == 502 and answer["code"] == "upstream_unavailable", answer
        assert seen[1] == "/indexes/broken/settings/displayed-attributes"


def test_a_filtered_read_of_an_index_joining_another_is_refused(guard, backend, reader):
    """Its own filter could reach the joined documents (`_foreign(...)`), which the token's
    filter does not hold."""
    credential = token(reader, {"reviews": {"filter": "public = true"}})
    for method, target in (("GET", "/indexes/reviews/documents"),
                           ("POST", "/indexes/reviews/documents/fetch"),
                           ("GET", "/indexes/reviews/documents/1")):
        status, answer, seen = send(guard, backend, credential, method, target,
                                    {} if method == "POST" else None)
        assert status == 403 and "foreignKeys" in answer["message"], answer
        # the read never reaches the backend: only the lookup, unless the guard just made it
        assert seen is None or seen[1] == "/indexes/reviews/settings/foreign-keys"
    # joining an index the token sees whole, or read without a filter: as before
    for credential in (token(reader, {"reviews": {"filter": "public = true"}, "critics": None}),
                       reader["key"]):
        status, _, seen = send(guard, backend, credential, "POST",
                               "/indexes/reviews/documents/fetch", {})
        assert status == 404 and seen[1] == "/indexes/reviews/documents/fetch"


def test_an_index_scoped_keys_filtered_read_of_an_index_joining_another_is_refused(
        guard, backend):
    """A key covering `reviews` but not `critics`, which `reviews` joins: its own filter on a
    documents list or fetch could probe the critics' documents (`_foreign(...)`), as its
    searches could. One document (no filter of the caller's) is forwarded as before."""
    def authorize(credential, method, uri):
        return guard.request("GET", "/authorize", None, {
            "Authorization": "Bearer " + credential, "X-Original-Method": method,
            "X-Original-URI": uri})[0]
    scoped = new_key(guard, None, actions=("documents.get",), indexes=("reviews",))["key"]
    probe = "_foreign(critic, secret = s1)"
    for method, target, body in (
            ("GET", "/indexes/reviews/documents?filter=" + urllib.parse.quote(probe), None),
            ("POST", "/indexes/reviews/documents/fetch", {"filter": probe})):
        status, answer, seen = send(guard, backend, scoped, method, target, body)
        assert status == 403 and "foreignKeys" in answer["message"], answer
        assert seen is None or seen[1] == "/indexes/reviews/settings/foreign-keys"
        assert authorize(scoped, method, target) == 403
    status, _, seen = send(guard, backend, scoped, "GET", "/indexes/reviews/documents/1")
    assert status == 404 and seen[1] == "/indexes/reviews/documents/1"
    # covering the joined index too: forwarded as sent
    both = new_key(guard, None, actions=("documents.get",), indexes=("reviews", "critics"))
    status, _, seen = send(guard, backend, both["key"], "POST",
                           "/indexes/reviews/documents/fetch", {"filter": probe})
    assert status == 404 and seen[1:3] == ("/indexes/reviews/documents/fetch", {"filter": probe})
    assert authorize(both["key"], "POST", "/indexes/reviews/documents/fetch") == 204


def test_the_official_client_reads_a_tenants_documents(guard, tenant):
    meilisearch = pytest.importorskip("meilisearch")
    from meilisearch.errors import MeilisearchApiError
    index = meilisearch.Client("http://127.0.0.1:%d" % guard.port, tenant,
                               timeout=10).index("movies")
    assert sorted(d.id for d in index.get_documents().results) == [1, 2]
    assert [d.id for d in index.get_documents({"filter": "public = true"}).results] == [1]
    assert index.get_document(2).title == "Beta"
    with pytest.raises(MeilisearchApiError) as missing:
        index.get_document(3)
    assert missing.value.status_code == 404 and missing.value.code == "document_not_found"
