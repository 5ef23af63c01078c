"""Restrictions on a key (issue 16): rate limits, allowed referrers and IPs, a cap on hits,
brute-force throttling.

Unit tests for the pure parts first (rate specs, referrer patterns, IP ranges, the client
address behind trusted proxies, hit caps, the bounded counters), then black-box tests: the
real `searchkeys.py serve` on a free loopback port in front of a stand-in backend that records
what it is asked.
"""
import ipaddress
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
    assert urllib.parse.parse_qs(sk.cap_search_query(query, 5)) == expected


def test_restrictions_validate_like_meilisearch():
    value = sk.Restrictions.from_json({"rateLimit": {"perIp": "60/minute"},
                                       "allowedIps": ["10.0.0.0/8"], "maxHitsPerQuery": 50})
    assert value.to_json() == {"rateLimit": {"perIp": "60/minute"}, "allowedReferrers": None,
                               "allowedIps": ["10.0.0.0/8"], "maxHitsPerQuery": 50}
    assert sk.Restrictions.from_json({}) is None
    assert sk.Restrictions.from_json({"rateLimit": {"perIp": None}, "allowedIps": None}) is None
    cases = [
        ({"rateLimits": {}}, "bad_request", "Unknown field `rateLimits`: did you mean "
         "`rateLimit`? expected one of `rateLimit`, `allowedReferrers`, `allowedIps`, "
         "`maxHitsPerQuery`"),
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
    wait, refused, _ = counters.take([("k", rate)])
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
    counters = sk.Counters(clock=clock)
    for _ in range(3):
        counters.fail("ip", 60)
    clock.now += 59
    assert counters.failures("ip") == (3, pytest.approx(1.0))
    clock.now += 1
    assert counters.failures("ip") == (0, 0.0)


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
