"""Restrictions on a key (issue 16): rate limits, allowed referrers and IPs, a cap on hits,
brute-force throttling.

Unit tests for the pure parts first (rate specs, referrer patterns, IP ranges, the client
address behind trusted proxies, hit caps, the bounded counters), then black-box tests: the
real `searchkeys.py serve` on a free loopback port in front of a stand-in backend that records
what it is asked.
"""
import ipaddress
import os
import json
import urllib.parse

import pytest

import searchkeys as sk

# ---------------------------------------------------------------------------------------------
# Pure parts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, count, window", [
    ("60/minute", 60, 60), ("1/second", 1, 1), ("10000/hour", 10000, 3600), ("5/day", 5, 86400)])
def test_rates_parse(text, count, window):
    rate = sk.parse_rate(text)
    assert (rate.count, rate.window, rate.text) == (count, window, text)


@pytest.mark.parametrize("text", ["0/minute", "60", "60/min", "-1/second", "60/ minute",
                                  "1000000000/second", "", None, 60, "٣/second"])
def test_bad_rates_are_refused(text):
    with pytest.raises(ValueError):
        sk.parse_rate(text)


def _patterns(*texts):
    return [sk.referrer_pattern(t) for t in texts]


@pytest.mark.parametrize("origin, referer, allowed", [
    ("https://example.com", None, True),
    (None, "https://example.com/search?q=x", True),
    (None, "https://EXAMPLE.com/", True),
    ("http://example.com", None, False),           # another scheme
    ("https://example.com.evil.net", None, False),  # a prefix is not the site
    (None, "https://evil.net/?https://example.com/", False),
    ("https://shop.example.org", None, True),       # host pattern
    (None, "https://a.b.example.org/page", True),
    ("https://example.org", None, False),          # `*.` needs a subdomain
    (None, None, False),
    ("null", None, False),
])
def test_referrer_patterns_match_origin_or_referer(origin, referer, allowed):
    patterns = _patterns("https://example.com/*", "*.example.org")
    assert sk.referrer_allowed(patterns, origin, referer) is allowed


@pytest.mark.parametrize("origin, referer, allowed", [
    ("https://evil.com", "https://evil.com/.example.com/", False),  # the page picks its path
    (None, "https://evil.com/?.example.com/", False),
    (None, "https://evil.com?.example.com/", False),
    (None, "https://x.example.com@evil.com/", False),  # user info is not the host
    (None, "https://evil.com@x.example.com/", True),
    ("https://x.example.com", None, True),
    (None, "https://x.example.com/a/b.html", True),
    (None, "https://x.example.com:8443/", False),  # another port is another site
])
def test_a_star_in_the_site_never_reaches_into_the_path(origin, referer, allowed):
    patterns = _patterns("https://*.example.com/*")
    assert sk.referrer_allowed(patterns, origin, referer) is allowed


@pytest.mark.parametrize("text", ["*", "", "has space", "x" * 600, "é.example.com", 5])
def test_bad_referrer_patterns_are_refused(text):
    with pytest.raises(ValueError):
        sk.referrer_pattern(text)


def _nets(*texts):
    return [sk.ip_range(t) for t in texts]


def test_ip_ranges_hold_v4_v6_and_mapped_addresses():
    nets = _nets("10.0.0.0/8", "2001:db8::/32", "192.0.2.7")
    for inside in ("10.1.2.3", "2001:db8::1", "192.0.2.7", "::ffff:10.9.9.9"):
        assert sk.in_ranges(sk.parse_address(inside), nets), inside
    for outside in ("11.0.0.1", "2001:db9::1", "192.0.2.8", "garbage", ""):
        assert not sk.in_ranges(sk.parse_address(outside), nets), outside
    for bad in ("10.0.0.1/8", "10.0.0.0/33", "example.com", None):
        with pytest.raises(ValueError):
            sk.ip_range(bad)


TRUSTED = _nets("127.0.0.1", "10.0.0.0/8")


@pytest.mark.parametrize("peer, xff, expected", [
    ("203.0.113.9", "1.2.3.4", "203.0.113.9"),           # untrusted peer: XFF ignored
    ("127.0.0.1", None, "127.0.0.1"),                    # trusted peer, no XFF
    ("127.0.0.1", "198.51.100.1", "198.51.100.1"),
    ("127.0.0.1", "6.6.6.6, 198.51.100.1", "198.51.100.1"),  # right-most untrusted
    ("127.0.0.1", "6.6.6.6, 198.51.100.1, 10.0.0.2", "198.51.100.1"),
    ("127.0.0.1", "10.0.0.3, 10.0.0.2", "10.0.0.3"),     # all trusted: the left-most
    ("127.0.0.1", "6.6.6.6, junk, 10.0.0.2", "10.0.0.2"),  # junk stops at the trusted hop
    ("127.0.0.1", " 2001:db8::5 ", "2001:db8::5"),
])
def test_client_address_behind_trusted_proxies(peer, xff, expected):
    assert sk.client_address(peer, xff, TRUSTED) == ipaddress.ip_address(expected)


def test_without_trusted_proxies_forwarded_for_is_never_read():
    assert sk.client_address("127.0.0.1", "1.2.3.4", []) == ipaddress.ip_address("127.0.0.1")


def test_ipv6_clients_are_counted_by_their_64():
    a, b = sk.parse_address("2001:db8:0:1::1"), sk.parse_address("2001:db8:0:1:ffff::2")
    assert sk.counter_client(a) == sk.counter_client(b)
    assert sk.counter_client(sk.parse_address("2001:db8:0:2::1")) != sk.counter_client(a)
    assert sk.counter_client(sk.parse_address("10.0.0.1")) == "10.0.0.1"


@pytest.mark.parametrize("body, expected", [
    ({"q": "x"}, {"q": "x", "limit": 5}),
    ({"limit": 3}, {"limit": 3}),
    ({"limit": 1000, "offset": 10}, {"limit": 5, "offset": 10}),
    ({"limit": None}, {"limit": 5}),
    ({"page": 2}, {"page": 2, "hitsPerPage": 5}),
    ({"hitsPerPage": 999}, {"hitsPerPage": 5}),
    ({"limit": "1000"}, {"limit": "1000"}),   # not a count: the backend refuses it
    ({"limit": True}, {"limit": True}),
])
def test_search_bodies_are_capped(body, expected):
    assert sk.cap_search_object(body, 5) == expected


def test_a_cap_above_the_default_leaves_a_bare_query_alone():
    assert sk.cap_search_object({"q": "x"}, 50) == {"q": "x"}


def test_multi_search_caps_each_query_and_the_federation():
    body = {"queries": [{"indexUid": "a", "limit": 100}, {"indexUid": "b"}]}
    assert sk.cap_multi_search(body, 7)["queries"] == [
        {"indexUid": "a", "limit": 7}, {"indexUid": "b", "limit": 7}]
    federated = {"federation": {"limit": 100, "offset": 3}, "queries": [{"indexUid": "a"}]}
    assert sk.cap_multi_search(federated, 7) == {
        "federation": {"limit": 7, "offset": 3}, "queries": [{"indexUid": "a"}]}


@pytest.mark.parametrize("query, expected", [
    ("q=x", {"q": ["x"], "limit": ["5"]}),
    ("q=x&limit=1000", {"q": ["x"], "limit": ["5"]}),
    ("limit=%2B1000", {"limit": ["5"]}),          # usize::from_str reads `+1000`
    ("limit=2&limit=900", {"limit": ["5"]}),     # the last one is what counts
    ("limit=3", {"limit": ["3"]}),
    ("page=1&hitsPerPage=50", {"page": ["1"], "hitsPerPage": ["5"]}),
    ("limit=abc", {"limit": ["abc"]}),           # refused by the backend
])
def test_search_queries_are_capped(query, expected):
    read = sk.parse_search_query(query)
    capped = sk.encode_search_query(query, read, sk.cap_search_object(dict(read[0]), 5))
    assert urllib.parse.parse_qs(capped) == expected


def test_restrictions_validate_like_meilisearch():
    value = sk.Restrictions.from_json({"rateLimit": {"perIp": "60/minute"},
                                       "allowedIps": ["10.0.0.0/8"], "maxHitsPerQuery": 50})
    assert value.to_json() == {"rateLimit": {"perIp": "60/minute"}, "allowedReferrers": None,
                               "allowedIps": ["10.0.0.0/8"], "maxHitsPerQuery": 50,
                               "forcedParameters": None, "maxConcurrentSearches": None,
                               "allowBrowser": None}
    assert sk.Restrictions.from_json({}) is None
    assert sk.Restrictions.from_json({"rateLimit": {"perIp": None}, "allowedIps": None}) is None
    cases = [
        ({"rateLimits": {}}, "bad_request", "Unknown field `rateLimits`: did you mean "
         "`rateLimit`? expected one of `rateLimit`, `allowedReferrers`, `allowedIps`, "
         "`maxHitsPerQuery`, `forcedParameters`, `maxConcurrentSearches`, `allowBrowser`"),
        ({"rateLimit": "60/minute"}, "invalid_restrictions_rate_limit",
         "Invalid value type at `.rateLimit`: expected an object, but found a string: "
         "`\"60/minute\"`"),
        ({"rateLimit": {"perIp": "60/min"}}, "invalid_restrictions_rate_limit", None),
        ({"rateLimit": {"perIP": "60/minute"}}, "invalid_restrictions_rate_limit", None),
        ({"allowedIps": ["10.0.0.1/8"]}, "invalid_restrictions_allowed_ips", None),
        ({"allowedIps": []}, "invalid_restrictions_allowed_ips", None),
        ({"allowedReferrers": [3]}, "invalid_restrictions_allowed_referrers",
         "Invalid value type at `.allowedReferrers[0]`: expected a string, but found a "
         "positive integer: `3`"),
        ({"maxHitsPerQuery": 0}, "invalid_restrictions_max_hits_per_query", None),
        ({"maxHitsPerQuery": 2.5}, "invalid_restrictions_max_hits_per_query", None),
        ([], "bad_request", None),
    ]
    for body, code, message in cases:
        with pytest.raises(sk.ApiError) as caught:
            sk.Restrictions.from_json(body)
        assert caught.value.status == 400 and caught.value.code == code, body
        if message is not None:
            assert caught.value.message == message


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_rates_allow_a_burst_then_one_per_interval():
    clock = FakeClock()
    counters = sk.Counters(clock=clock)
    rate = sk.parse_rate("3/minute")
    assert [counters.take([("k", rate)]) for _ in range(3)] == [None] * 3
    wait, refused = counters.take([("k", rate)])
    assert refused is rate and wait == pytest.approx(20.0)
    clock.now += 20.0
    assert counters.take([("k", rate)]) is None
    assert counters.take([("other", rate)]) is None  # counters are separate


def test_a_refused_request_counts_against_no_rate():
    clock = FakeClock()
    counters = sk.Counters(clock=clock)
    loose, tight = sk.parse_rate("100/minute"), sk.parse_rate("1/minute")
    assert counters.take([("ip", loose), ("key", tight)]) is None
    for _ in range(50):
        assert counters.take([("ip", loose), ("key", tight)]) is not None
    assert counters.take([("ip", loose)]) is None  # the 50 refusals left `ip` untouched
    assert all(counters.take([("ip", loose)]) is None for _ in range(98))


def test_failures_count_in_a_fixed_window():
    clock = FakeClock()
    failures = sk.FailureCounts(sk.parse_rate("3/minute"), clock=clock)
    for _ in range(3):
        assert failures.fail("ip")
    clock.now += 59
    assert failures.throttled("ip") == pytest.approx(1.0)
    clock.now += 1
    assert failures.throttled("ip") is None


def test_a_throttled_client_is_never_forgotten_before_its_window_ends():
    """Clients cycling through addresses cannot push a throttled one out of the bounded
    table: the ones under the limit go first, and once only live throttles are left a new
    failing client is refused rather than an old one forgotten."""
    clock = FakeClock()
    failures = sk.FailureCounts(sk.parse_rate("2/minute"), capacity=3, clock=clock)
    failures.fail("attacker")
    failures.fail("attacker")
    for n in range(1000):
        failures.fail("cycled-%d" % n)
    assert failures.throttled("attacker") is not None and len(failures) == 3
    for name in ("b", "c"):
        failures.fail(name)
        failures.fail(name)
    assert failures.fail("newcomer") is False and failures.throttled("newcomer") is None
    assert all(failures.throttled(n) is not None for n in ("attacker", "b", "c"))
    clock.now += 60
    assert failures.throttled("attacker") is None and failures.fail("newcomer") is True


def test_counters_are_bounded_least_recently_used_first():
    counters = sk.Counters(capacity=1000)
    rate = sk.parse_rate("1/hour")
    counters.take([("first", rate)])
    for n in range(5000):
        counters.take([("client-%d" % n, rate)])
        if n % 100 == 0:
            counters.take([("first", rate)])  # refused, but...
    assert len(counters) == 1000
    assert counters.take([("client-0", rate)]) is None  # forgotten: starts afresh
    assert counters.take([("client-4999", rate)]) is not None


# ---------------------------------------------------------------------------------------------
# Through HTTP: the real server in front of a stand-in backend
# ---------------------------------------------------------------------------------------------

import base64  # noqa: E402
import hashlib  # noqa: E402
import hmac  # noqa: E402
import http.server  # noqa: E402

from support import SEARCHKEYS, Daemon, answer_json, free_port, python_cmd, request, \
    scratch_dir, serve_in_thread  # noqa: E402

MASTER = "restrictions-test-master-key-0123"
JSON = {"Content-Type": "application/json"}
ADMIN = dict(JSON, Authorization="Bearer " + MASTER)


class Backend:
    """A stand-in search engine: records each request (method, target, JSON body) and
    answers 200 with an empty hit list. The guard's lookups of an index's foreignKeys are
    answered from `joins` (index uid -> the setting, or the status of an error to answer;
    none: []) and recorded in `lookups`; every index displays all its attributes (`["*"]`,
    what the guard looks up for a tenant token's documents read). The indexes named in
    `missing` do not exist: `GET /indexes/{uid}` (recorded) and their settings answer
    index_not_found."""

    def __init__(self):
        seen = self.seen = []
        lookups = self.lookups = []
        joins = self.joins = {}
        missing = self.missing = set()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                parts = self.path.split("/")
                if self.command == "GET" and self.path.endswith("/settings/foreign-keys"):
                    lookups.append(parts[2])
                    setting = joins.get(parts[2], [])
                    if parts[2] in missing:
                        self.index_not_found(parts[2])
                    elif isinstance(setting, int):
                        answer_json(self, b'{"message":"Broken.","code":"internal",'
                                          b'"type":"internal","link":""}', setting)
                    else:
                        answer_json(self, json.dumps(setting).encode())
                    return
                if self.command == "GET" and self.path.endswith("/settings/displayed-attributes"):
                    if parts[2] in missing:
                        self.index_not_found(parts[2])
                    else:
                        answer_json(self, b'["*"]')
                    return
                seen.append((self.command, self.path, json.loads(body) if body else None))
                if self.command == "GET" and len(parts) == 3 and parts[2] in missing:
                    self.index_not_found(parts[2])
                    return
                answer_json(self, b'{"hits":[]}')

            def index_not_found(self, index):
                answer_json(self, json.dumps({
                    "message": "Index `%s` not found." % index, "code": "index_not_found",
                    "type": "invalid_request", "link": ""}).encode(), 404)

            do_GET = do_POST = do_PATCH = answer

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


def serve(backend, *extra):
    port = free_port()
    return Daemon(python_cmd(SEARCHKEYS, "serve", "--port", port, "--master-key", MASTER,
                             "--upstream", backend.url, *extra), port, timeout=30.0)


@pytest.fixture(scope="module")
def guard(backend):
    """Behind a trusted proxy (127.0.0.1), so each test picks its client with X-Forwarded-For."""
    with serve(backend, "--trusted-proxy", "127.0.0.1/32", "--throttle-failures",
               "5/minute") as daemon:
        yield daemon


def new_key(daemon, restrictions, actions=("search",), indexes=("*",)):
    status, _, data = daemon.request("POST", "/keys", json.dumps(
        {"actions": list(actions), "indexes": list(indexes), "expiresAt": None}), ADMIN)
    assert status == 201, data
    key = json.loads(data)
    if restrictions is not None:
        status, _, data = daemon.request("PUT", "/keys/%s/restrictions" % key["uid"],
                                         json.dumps(restrictions), ADMIN)
        assert status == 200, data
    return key


def tenant_token(key):
    def b64(data):
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
    signing = b64(b'{"alg":"HS256","typ":"JWT"}') + "." + b64(json.dumps(
        {"searchRules": ["*"], "apiKeyUid": key["uid"]}).encode())
    return signing + "." + b64(hmac.new(key["key"].encode(), signing.encode(),
                                        hashlib.sha256).digest())


FAMILIES = ["search-post", "search-get", "multi-search", "similar-post", "similar-get",
            "authorize", "tenant-token"]


def call(daemon, family, key, client="192.0.2.1", limit=None, headers=None):
    """One request of a route family with `key`, from `client`: (status, headers, body)."""
    sent = dict(JSON, Authorization="Bearer " + (tenant_token(key) if family == "tenant-token"
                                                 else key["key"]))
    sent["X-Forwarded-For"] = client
    sent.update(headers or {})
    query = {} if limit is None else {"limit": limit}
    if family in ("search-post", "tenant-token", "similar-post"):
        route = "search" if family != "similar-post" else "similar"
        body = dict(query, q="x") if route == "search" else dict(query, id=1)
        answer = daemon.request("POST", "/indexes/movies/" + route, json.dumps(body), sent)
    elif family in ("search-get", "similar-get"):
        route = "search" if family == "search-get" else "similar"
        target = "/indexes/movies/%s?%s" % (route, urllib.parse.urlencode(dict(query, q="x")))
        answer = daemon.request("GET", target, None, sent)
    elif family == "multi-search":
        body = {"queries": [dict(query, indexUid="movies", q="x"), {"indexUid": "books"}]}
        answer = daemon.request("POST", "/multi-search", json.dumps(body), sent)
    else:
        sent["X-Original-URI"] = "/indexes/movies/search?" + urllib.parse.urlencode(
            dict(query, q="x"))
        sent["X-Original-Method"] = "GET"
        answer = daemon.request("GET", "/authorize", None, sent)
    return answer


def ok(status):
    return status in (200, 204)


def refusal(answer):
    status, headers, data = answer
    return status, json.loads(data)


@pytest.mark.parametrize("family", FAMILIES)
def test_allowed_ips_refuse_other_addresses(guard, backend, family):
    key = new_key(guard, {"allowedIps": ["192.0.2.0/24", "2001:db8::/32"]})
    assert ok(call(guard, family, key, client="192.0.2.200")[0])
    assert ok(call(guard, family, key, client="2001:db8::7")[0])
    backend.seen.clear()
    status, error = refusal(call(guard, family, key, client="198.51.100.1"))
    assert status == 403 and error["code"] == "forbidden_by_restriction"
    assert "allowedIps" in error["message"] and "192.0.2" not in error["message"]
    assert backend.seen == []


@pytest.mark.parametrize("family", FAMILIES)
def test_allowed_referrers_need_a_matching_origin_or_referer(guard, backend, family):
    key = new_key(guard, {"allowedReferrers": ["https://example.com/*", "*.example.org"]})
    assert ok(call(guard, family, key, headers={"Origin": "https://example.com"})[0])
    assert ok(call(guard, family, key, headers={"Referer": "https://www.example.org/a"})[0])
    backend.seen.clear()
    for headers in ({"Origin": "https://evil.net"}, {"Referer": "https://example.com.evil/"},
                    {}):
        status, error = refusal(call(guard, family, key, headers=headers))
        assert status == 403 and "allowedReferrers" in error["message"], headers
        assert "example" not in error["message"]
    assert backend.seen == []


@pytest.mark.parametrize("family", FAMILIES)
def test_rate_limit_per_ip_answers_429_with_headers(guard, backend, family):
    searches = 2 if family == "multi-search" else 1  # each query of a multi-search counts
    key = new_key(guard, {"rateLimit": {"perIp": "%d/minute" % (3 * searches)}})
    assert all(ok(call(guard, family, key, client="198.51.100.9")[0]) for _ in range(3))
    backend.seen.clear()
    status, headers, data = call(guard, family, key, client="198.51.100.9")
    assert status == 429 and json.loads(data)["code"] == "too_many_requests"
    assert 1 <= int(headers["retry-after"]) <= 20
    assert headers["ratelimit-limit"] == str(3 * searches)
    assert headers["ratelimit-remaining"] == "0"
    assert headers["ratelimit-reset"] == headers["retry-after"]
    assert backend.seen == []
    assert ok(call(guard, family, key, client="198.51.100.10")[0])  # another client


def test_rate_limit_per_key_counts_every_client(guard):
    key = new_key(guard, {"rateLimit": {"perIp": "100/minute", "perKey": "2/hour"}})
    assert ok(call(guard, "search-post", key, client="198.51.100.20")[0])
    assert ok(call(guard, "tenant-token", key, client="198.51.100.21")[0])
    status, headers, _ = call(guard, "search-get", key, client="198.51.100.22")
    assert status == 429 and headers["ratelimit-policy"] == "2;w=3600"


@pytest.mark.parametrize("family", ["search-post", "search-get", "multi-search",
                                    "similar-post", "similar-get", "tenant-token"])
def test_max_hits_caps_what_the_backend_is_asked(guard, backend, family):
    key = new_key(guard, {"maxHitsPerQuery": 5})
    for asked, expected in ((1000, 5), (3, 3), (None, 5)):
        backend.seen.clear()
        assert call(guard, family, key, limit=asked)[0] == 200
        method, target, body = backend.seen[-1]
        if method == "GET":
            assert urllib.parse.parse_qs(target.partition("?")[2])["limit"] == [str(expected)]
        elif family == "multi-search":
            assert [q["limit"] for q in body["queries"]] == [expected, 5]
        else:
            assert body["limit"] == expected


def test_max_hits_through_authorize_refuses_what_it_cannot_cap(guard):
    key = new_key(guard, {"maxHitsPerQuery": 50})
    assert call(guard, "authorize", key, limit=50)[0] == 204
    assert call(guard, "authorize", key)[0] == 204  # the default 20
    status, error = refusal(call(guard, "authorize", key, limit=51))
    assert status == 403 and "maxHitsPerQuery" in error["message"]
    status, _, _ = guard.request("GET", "/authorize", None, {
        "Authorization": "Bearer " + key["key"], "X-Original-URI": "/indexes/movies/search",
        "X-Original-Method": "POST"})
    assert status == 403  # a body /authorize never sees


def test_restrictions_api_keeps_the_keys_contract(guard):
    key = new_key(guard, None)
    path = "/keys/%s/restrictions" % key["uid"]
    nulls = {"rateLimit": None, "allowedReferrers": None, "allowedIps": None,
             "maxHitsPerQuery": None, "forcedParameters": None,
             "maxConcurrentSearches": None, "allowBrowser": None}
    assert json.loads(guard.request("GET", path, None, ADMIN)[2]) == nulls
    wanted = {"rateLimit": {"perIp": "60/minute", "perKey": "10000/hour"},
              "allowedReferrers": ["https://example.com/*"], "allowedIps": ["10.0.0.0/8"],
              "maxHitsPerQuery": 50, "forcedParameters": {"movies": {"filter": "a = 1"}},
              "maxConcurrentSearches": 8, "allowBrowser": True}
    status, _, data = guard.request("PUT", "/keys/%s/restrictions" % key["key"],
                                    json.dumps(wanted), ADMIN)
    assert status == 200 and json.loads(data) == wanted
    assert json.loads(guard.request("GET", path, None, ADMIN)[2]) == wanted
    # /keys answers exactly Meilisearch's fields, and PATCH keeps the restrictions
    shown = json.loads(guard.request("GET", "/keys/" + key["uid"], None, ADMIN)[2])
    assert list(shown) == ["name", "description", "key", "uid", "actions", "indexes",
                           "expiresAt", "createdAt", "updatedAt"]
    listing = json.loads(guard.request("GET", "/keys?limit=1000", None, ADMIN)[2])
    assert all("restrictions" not in k for k in listing["results"])
    assert guard.request("PATCH", "/keys/" + key["uid"], '{"name": "n"}', ADMIN)[0] == 200
    assert json.loads(guard.request("GET", path, None, ADMIN)[2]) == wanted
    status, _, data = guard.request("POST", "/keys", json.dumps(
        {"actions": ["search"], "indexes": ["*"], "expiresAt": None,
         "restrictions": {"maxHitsPerQuery": 1}}), ADMIN)
    assert status == 400 and json.loads(data)["code"] == "bad_request"
    assert guard.request("DELETE", path, None, ADMIN)[0] == 204
    assert json.loads(guard.request("GET", path, None, ADMIN)[2]) == nulls


def test_restrictions_api_is_for_the_master_key_only(guard):
    key = new_key(guard, None)
    admin = new_key(guard, None, actions=["*"])
    path = "/keys/%s/restrictions" % key["uid"]
    status, error = refusal(guard.request("GET", path, None, dict(
        JSON, Authorization="Bearer " + admin["key"])))
    assert status == 403 and error["code"] == "invalid_api_key"
    assert guard.request("PUT", path, '{"maxHitsPerQuery": 1}', JSON)[0] == 401
    assert guard.request("GET", "/keys/%s/restrictions" % ("0" * 64), None, ADMIN)[0] == 404
    assert guard.request("POST", path, "{}", ADMIN)[0] == 405


@pytest.mark.parametrize("body, code, message", [
    ({"rateLimit": {"perIp": "60/min"}}, "invalid_restrictions_rate_limit",
     "Invalid value at `.rateLimit.perIp`: `60/min` is not a rate"),
    ({"allowedIps": ["10.0.0.1/8"]}, "invalid_restrictions_allowed_ips",
     "Invalid value at `.allowedIps[0]`: `10.0.0.1/8` is not an IP range"),
    ({"allowedReferrers": "https://x/*"}, "invalid_restrictions_allowed_referrers",
     "Invalid value type at `.allowedReferrers`: expected an array"),
    ({"maxHitsPerQuery": -1}, "invalid_restrictions_max_hits_per_query",
     "Invalid value at `.maxHitsPerQuery`"),
    ({"maxHits": 3}, "bad_request", "Unknown field `maxHits`"),
])
def test_restrictions_api_validation_errors(guard, body, code, message):
    key = new_key(guard, {"maxHitsPerQuery": 9})
    path = "/keys/%s/restrictions" % key["uid"]
    status, error = refusal(guard.request("PUT", path, json.dumps(body), ADMIN))
    assert status == 400 and error["code"] == code and error["message"].startswith(message)
    assert error["type"] == "invalid_request" and error["link"].endswith(code)
    assert json.loads(guard.request("GET", path, None, ADMIN)[2])["maxHitsPerQuery"] == 9
    assert guard.request("PUT", path, "{", ADMIN)[0] == 400
    assert guard.request("PUT", path, "{}", {"Authorization": "Bearer " + MASTER})[0] == 415


def test_brute_force_throttle_answers_429_after_failures(guard):
    bad = {"Authorization": "Bearer " + "f" * 64, "X-Forwarded-For": "203.0.113.66"}
    for _ in range(5):
        assert guard.request("GET", "/indexes/movies/search", None, bad)[0] == 403
    good = dict(ADMIN, **{"X-Forwarded-For": "203.0.113.66"})
    status, headers, data = guard.request("GET", "/keys", None, good)
    assert status == 429 and json.loads(data)["code"] == "too_many_requests"
    assert int(headers["retry-after"]) >= 50
    other = dict(ADMIN, **{"X-Forwarded-For": "203.0.113.67"})
    assert guard.request("GET", "/keys", None, other)[0] == 200


def test_restrictions_persist_across_restart_and_xff_needs_a_trusted_proxy(backend):
    with scratch_dir("restrict-") as folder:
        store = str(folder / "keys.json")
        with serve(backend, "--store", store) as daemon:
            key = new_key(daemon, {"allowedIps": ["192.0.2.0/24"], "maxHitsPerQuery": 4})
            # no --trusted-proxy: X-Forwarded-For is not believed, the peer is 127.0.0.1
            status, error = refusal(call(daemon, "search-post", key, client="192.0.2.1"))
            assert status == 403 and "allowedIps" in error["message"]
        assert os.stat(store).st_mode & 0o777 == 0o600
        with serve(backend, "--store", store, "--trusted-proxy", "127.0.0.0/8") as daemon:
            shown = json.loads(daemon.request("GET", "/keys/%s/restrictions" % key["uid"],
                                              None, ADMIN)[2])
            assert shown["allowedIps"] == ["192.0.2.0/24"] and shown["maxHitsPerQuery"] == 4
            backend.seen.clear()
            assert call(daemon, "search-post", key, client="192.0.2.1", limit=99)[0] == 200
            assert backend.seen[-1][2]["limit"] == 4
            assert call(daemon, "search-post", key, client="10.0.0.1")[0] == 403


def test_counters_stay_bounded_by_max_clients(backend):
    with serve(backend, "--trusted-proxy", "127.0.0.1/32", "--max-clients", "3") as daemon:
        key = new_key(daemon, {"rateLimit": {"perIp": "1/hour"}})
        clients = ["198.51.100.%d" % n for n in range(1, 5)]
        assert [call(daemon, "search-get", key, client=c)[0] for c in clients] == [200] * 4
        # the newest clients are remembered; the oldest was forgotten and starts afresh
        assert call(daemon, "search-get", key, client=clients[-1])[0] == 429
        assert call(daemon, "search-get", key, client=clients[0])[0] == 200


def test_cli_restrict_sets_shows_and_clears(guard):
    import subprocess
    import sys
    key = new_key(guard, None)
    base = [sys.executable, str(SEARCHKEYS), "keys", "restrict", key["uid"],
            "--url", "http://127.0.0.1:%d" % guard.port, "--key", MASTER]
    done = subprocess.run(base + ["--preset", "search", "--referrer", "https://example.com/*",
                                  "--ip", "10.0.0.0/8", "--max-hits", "50"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "rateLimit": {"perIp": "120/minute"}, "allowedReferrers": ["https://example.com/*"],
        "allowedIps": ["10.0.0.0/8"], "maxHitsPerQuery": 50, "forcedParameters": None,
        "maxConcurrentSearches": None, "allowBrowser": None}
    shown = subprocess.run(base, capture_output=True, text=True, timeout=30)
    assert json.loads(shown.stdout)["maxHitsPerQuery"] == 50
    bad = subprocess.run(base + ["--rate", "60/min"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "is not a rate" in bad.stderr and "Traceback" not in bad.stderr
    cleared = subprocess.run(base + ["--clear"], capture_output=True, text=True, timeout=30)
    assert cleared.returncode == 0
    assert json.loads(subprocess.run(base, capture_output=True, text=True,
                                     timeout=30).stdout)["allowedIps"] is None


def test_authorize_answers_for_restricted_keys_are_not_cacheable(guard):
    """nginx caches /authorize decisions by method, URI and credential: an answer that also
    depends on the client's address, its Origin or the time must say no-store."""
    plain = new_key(guard, None)
    assert "cache-control" not in call(guard, "authorize", plain)[1]
    key = new_key(guard, {"rateLimit": {"perIp": "1/hour"}, "allowedIps": ["192.0.2.0/24"]})
    status, headers, _ = call(guard, "authorize", key)
    assert status == 204 and headers["cache-control"] == "no-store"
    for client in ("192.0.2.1", "10.1.1.1"):  # over the rate; another address
        status, headers, _ = call(guard, "authorize", key, client=client)
        assert status in (403, 429) and headers["cache-control"] == "no-store"


def test_through_nginx_rates_and_addresses_hold_despite_the_decision_cache(backend):
    """The README's nginx recipe (searchkeys-nginx.conf.example) with `serve --trusted-proxy`:
    nginx caches /authorize decisions, yet a rate limit still answers 429 (with Retry-After),
    and a key limited to other addresses is refused."""
    import signal
    import subprocess
    nginx_binary = next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                         if os.access(p, os.X_OK)), None)
    if nginx_binary is None:
        pytest.skip("needs nginx: apt-get install nginx")
    from support import ROOT, stop_session, wait_for_port
    port = free_port()
    guard = Daemon(python_cmd(SEARCHKEYS, "serve", "--port", port, "--master-key", MASTER,
                              "--upstream", backend.url, "--upstream-key", "K",
                              "--trusted-proxy", "127.0.0.1/32"), port, timeout=30.0)
    with guard, scratch_dir("restrict-nginx-") as prefix:
        os.chmod(prefix, 0o755)
        listen = free_port()
        text = (ROOT / "searchkeys-nginx.conf.example").read_text()
        for name, value in (("listen", "127.0.0.1:%d" % listen),
                            ("searchkeys", "127.0.0.1:%d" % port),
                            ("backend", backend.url.partition("//")[2]), ("backend_key", "K")):
            text = text.replace("{{%s}}" % name, value)
        (prefix / "nginx.conf").write_text("daemon off;\n" + text)
        nginx = subprocess.Popen([nginx_binary, "-p", str(prefix), "-c",
                                  str(prefix / "nginx.conf"), "-e", "stderr"],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_for_port(listen, nginx, timeout=15)
            # searches go through searchkeys; the documents through /authorize and its cache
            for target in ("/indexes/movies/search?q=a", "/indexes/movies/documents"):
                actions = ("search", "documents.get")
                limited = new_key(guard, {"rateLimit": {"perIp": "2/minute"}}, actions)
                auth = {"Authorization": "Bearer " + limited["key"]}
                statuses = [request(listen, "GET", target, None, auth) for _ in range(3)]
                assert [s for s, _, _ in statuses] == [200, 200, 429], target
                assert int(statuses[2][1]["retry-after"]) >= 1
                assert json.loads(statuses[2][2])["code"] == "too_many_requests"
                elsewhere = new_key(guard, {"allowedIps": ["192.0.2.0/24"]}, actions)
                assert request(listen, "GET", target, None,
                               {"Authorization": "Bearer " + elsewhere["key"]})[0] == 403
        finally:
            stop_session(nginx, signal.SIGQUIT)


# ---------------------------------------------------------------------------------------------
# Referrer and client-keying hardening (issue 21)
# ---------------------------------------------------------------------------------------------

def test_a_long_referer_is_refused_quickly_and_counts_against_the_rate(guard, backend):
    """Three stars against a 128 KiB Referer backtracked for seconds of locked CPU a request;
    now patterns match in linear time, a Referer past 4096 bytes is refused as a referrer
    refusal, and every referrer refusal counts against the key's rate."""
    key = new_key(guard, {"allowedReferrers": ["https://*.example.com/*.html"],
                          "rateLimit": {"perIp": "3/minute"}})
    long_referer = "https://" + "a." * 2000 + "example.com/" + "x" * 120000
    status, error = refusal(call(guard, "search-post", key, client="198.51.100.70",
                                 headers={"Referer": long_referer}))
    assert status == 403 and "allowedReferrers" in error["message"]
    assert ok(call(guard, "search-post", key, client="198.51.100.70",
                   headers={"Referer": "https://www.example.com/a/b.html"})[0])
    status, _, _ = call(guard, "search-post", key, client="198.51.100.70",
                        headers={"Referer": "https://evil.net/"})
    assert status == 403
    status, _, _ = call(guard, "search-post", key, client="198.51.100.70",
                        headers={"Referer": "https://www.example.com/a/b.html"})
    assert status == 429  # three requests (two refused) used up the rate


def test_wildcards_match_in_linear_time():
    patterns = _patterns("https://*.example.com/*.html")
    subject = "https://" + "a." * 2000 + "example.com/" + "x" * 120000
    import time
    started = time.process_time()
    for _ in range(3):
        assert not sk.wildcard_match(patterns[0][0], subject)
    # a hang detector: backtracking took seconds a call
    assert time.process_time() - started < 1.0
    assert sk.referrer_allowed(patterns, None, "https://x.example.com/y.html")
    assert not sk.referrer_allowed(patterns, None, "https://example.com/y.html")
    star_run = _patterns("*a*a*b")
    assert sk.referrer_allowed(star_run, None, "https://aab") and \
        not sk.referrer_allowed(star_run, None, "https://" + "a" * 4000)


@pytest.mark.parametrize("headers", [{"Referer": "http://[::1/x"}, {"Origin": "http://[::1"},
                                     {"Referer": "http://[zz]/"}])
def test_a_malformed_referer_is_a_referrer_refusal_not_a_crash(guard, headers):
    key = new_key(guard, {"allowedReferrers": ["*.example.org"]})
    status, error = refusal(call(guard, "search-post", key, client="198.51.100.71",
                                 headers=headers))
    assert status == 403 and error["code"] == "forbidden_by_restriction"
    assert "internal error" not in guard.log()


def test_nat64_and_mapped_clients_are_counted_by_their_ipv4_address(guard):
    """Behind NAT64's well-known prefix every IPv4 user would share one /64: two users there
    have separate counters (and the mapped form of an address is that address)."""
    key = new_key(guard, {"rateLimit": {"perIp": "1/hour"}})
    assert ok(call(guard, "search-post", key, client="64:ff9b::192.0.2.81")[0])
    assert ok(call(guard, "search-post", key, client="64:ff9b::192.0.2.82")[0])
    assert call(guard, "search-post", key, client="64:ff9b::c000:251")[0] == 429  # .81 again
    assert call(guard, "search-post", key, client="::ffff:192.0.2.82")[0] == 429
    assert ok(call(guard, "search-post", key, client="2001:db8:0:81::1")[0])


def test_clients_cycling_addresses_cannot_lift_a_throttle(backend):
    """A /48 can walk through /64s: with room for 3 clients, six newcomers failing once each
    used to push the throttled client out, letting it start afresh. Not any more; and when
    every entry is a live throttle, a new failing client is refused (429) instead."""
    with serve(backend, "--trusted-proxy", "127.0.0.1/32", "--max-clients", "3",
               "--throttle-failures", "2/minute") as daemon:
        def attempt(client, credential="f" * 64):
            headers = {"Authorization": "Bearer " + credential, "X-Forwarded-For": client}
            return daemon.request("GET", "/indexes/movies/search", None, headers)[0]
        assert [attempt("2001:db8:1:1::1") for _ in range(2)] == [403, 403]
        assert attempt("2001:db8:1:1::1", MASTER) == 429
        assert [attempt("2001:db8:1:%x::1" % n) for n in range(2, 8)] == [403] * 6
        assert attempt("2001:db8:1:1::1", MASTER) == 429  # still throttled
        for client in ("2001:db8:2::1", "2001:db8:3::1"):
            assert [attempt(client) for _ in range(2)] == [403, 403]
        assert attempt("2001:db8:4::1") == 429  # no room: refused, nobody forgotten
        assert attempt("2001:db8:4::1", MASTER) == 200


def test_a_capped_key_runs_a_bounded_number_of_queries_per_multi_search(guard, backend):
    """Without a rate limit, maxHitsPerQuery alone must still bound one request: 200
    queries of 50 hits would ask the backend for 10,000 (as Typesense's limit_multi_searches,
    at most MAX_CAPPED_QUERIES = 20 queries)."""
    key = new_key(guard, {"maxHitsPerQuery": 50})
    auth = dict(JSON, Authorization="Bearer " + key["key"])
    for federated in (False, True):
        extra = {"federation": {}} if federated else {}
        backend.seen.clear()
        status, _, data = guard.request("POST", "/multi-search", json.dumps(dict(
            extra, queries=[{"indexUid": "movies", "q": str(n)} for n in range(200)])), auth)
        assert status == 403 and json.loads(data)["code"] == "forbidden_by_restriction", data
        assert "maxHitsPerQuery" in json.loads(data)["message"] and backend.seen == []
        status, _, data = guard.request("POST", "/multi-search", json.dumps(dict(
            extra, queries=[{"indexUid": "movies", "q": str(n)} for n in range(20)])), auth)
        assert status == 200, data
    # a key without a cap is not bounded here (its rate limit, if any, is)
    plain = new_key(guard, None)
    status, _, data = guard.request("POST", "/multi-search", json.dumps({"queries": [
        {"indexUid": "movies"}] * 200}), dict(JSON, Authorization="Bearer " + plain["key"]))
    assert status == 200, data


def test_facets_by_index_may_name_only_covered_indexes(guard, backend):
    """S8: a federation's facetsByIndex naming an index the key does not cover would get
    the backend's errors about that index (its name, its filterable attributes)."""
    for restrictions in (None, {"maxHitsPerQuery": 50}):
        key = new_key(guard, restrictions, indexes=("movies",))
        auth = dict(JSON, Authorization="Bearer " + key["key"])
        backend.seen.clear()
        status, _, data = guard.request("POST", "/multi-search", json.dumps({
            "federation": {"facetsByIndex": {"secret": ["owner"]}},
            "queries": [{"indexUid": "movies", "q": "x"}]}), auth)
        assert status == 403 and json.loads(data)["code"] == "invalid_api_key", data
        assert backend.seen == []
        status, _, data = guard.request("POST", "/multi-search", json.dumps({
            "federation": {"facetsByIndex": {"movies": ["genre"]}},
            "queries": [{"indexUid": "movies", "q": "x"}]}), auth)
        assert status == 200, data
