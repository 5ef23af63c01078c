"""GET /metrics (issue 23, item 4): Prometheus's text format, for the master key or the token of
`serve --metrics-token-file`: requests by route family and answer code, refusals by reason,
the backend's latency and errors, the rate-limit table and the keys stored. Parsed with
prometheus_client's own parser.

Black-box: the real `searchkeys.py serve` on a free loopback port in front of the recording
stand-in backend of test_searchkeys_restrictions.
"""
import json
import subprocess

import pytest

from support import SEARCHKEYS, Daemon, free_port, python_cmd, scratch_dir
from test_searchkeys_restrictions import ADMIN, JSON, MASTER, new_key
from test_searchkeys_restrictions import backend  # noqa: F401 - fixture

parser = pytest.importorskip(
    "prometheus_client.parser",
    reason="needs prometheus_client, a test dependency: pip install prometheus_client")

TOKEN = "scrape-token-abcdef0123456789"
FAMILIES = {"search", "multi-search", "documents", "settings", "indexes", "tasks", "keys",
            "authorize", "health", "metrics", "other"}
REASONS = {"action", "index", "expiry", "rate", "referrer", "ip", "hits", "forced", "revoked",
           "concurrency", "browser", "credential", "throttled"}


@pytest.fixture(scope="module")
def token_file():
    with scratch_dir("sk-metrics-") as folder:
        path = folder / "metrics-token"
        path.write_text(TOKEN + "\n")
        yield path


def serve(upstream, *extra):
    port = free_port()
    return Daemon(python_cmd(SEARCHKEYS, "serve", "--port", port, "--master-key", MASTER,
                             "--upstream", upstream, "--trusted-proxy", "127.0.0.1/32", *extra),
                  port, timeout=30.0)


def scrape(daemon, credential=MASTER):
    status, headers, data = daemon.request("GET", "/metrics", None,
                                           {"Authorization": "Bearer " + credential})
    assert status == 200, data
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in parser.text_string_to_metric_families(data.decode()):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0)


def refusals(samples, why):
    return value(samples, "searchkeys_refusals_total", reason=why)


def search(daemon, key, path="/indexes/movies/search", client="192.0.2.1"):
    headers = dict(JSON, Authorization="Bearer " + key["key"])
    headers["X-Forwarded-For"] = client
    return daemon.request("POST", path, json.dumps({"q": "x"}), headers)[0]


def test_metrics_count_requests_refusals_backend_latency_and_gauges(backend):
    backend.lookups.clear()
    with serve(backend.url) as daemon:
        key = new_key(daemon, {"rateLimit": {"perIp": "100/minute"}}, indexes=["movies"])
        for client in ("192.0.2.1", "192.0.2.2", "192.0.2.3"):
            assert search(daemon, key, client=client) == 200
        assert search(daemon, key, "/indexes/books/search") == 403
        assert daemon.request("GET", "/indexes/movies/documents", None,
                              {"Authorization": "Bearer " + key["key"]})[0] == 403
        assert daemon.request("POST", "/indexes/movies/search", "{}", JSON)[0] == 401
        assert daemon.request("GET", "/health")[0] == 200
        assert daemon.request("GET", "/no/such/route")[0] == 404
        samples = scrape(daemon)
        requests = "searchkeys_requests_total"
        assert value(samples, requests, family="search", code="200") == 3
        assert value(samples, requests, family="search", code="403") == 1
        assert value(samples, requests, family="search", code="401") == 1
        assert value(samples, requests, family="documents", code="403") == 1
        assert value(samples, requests, family="health", code="200") == 1
        assert value(samples, requests, family="other", code="404") == 1
        assert {labels[0][1] for name, labels in samples
                if name == "searchkeys_refusals_total"} == REASONS
        assert (refusals(samples, "index"), refusals(samples, "action"),
                refusals(samples, "credential")) == (1, 1, 1)
        # each search of the index-scoped key: the search, after its index's foreignKeys when
        # the guard has not just asked for them
        assert 1 <= len(backend.lookups) <= 3
        backend_requests = 3 + len(backend.lookups)
        assert value(samples, "searchkeys_backend_request_duration_seconds_count") == \
            backend_requests
        assert value(samples, "searchkeys_backend_request_duration_seconds_bucket",
                     le="+Inf") == backend_requests
        assert value(samples, "searchkeys_backend_request_duration_seconds_sum") > 0
        assert value(samples, "searchkeys_rate_limit_clients") == 3
        assert value(samples, "searchkeys_keys") == 5  # the four defaults and ours
        assert any(name == "searchkeys_build_info" for name, _ in samples)


def test_metrics_labels_come_from_fixed_sets_never_from_the_request(backend):
    with serve(backend.url) as daemon:
        for path in ("/indexes/%7Bevil%7D/search", "/x%C3%A9y", "/indexes/a/settings/nope",
                     "/keys/" + "a" * 64, "/tasks/1", "/multi-search"):
            daemon.request("GET", path, None, ADMIN)
        samples = scrape(daemon)
        for name, labels in samples:
            labels = dict(labels)
            assert set(labels) <= {"family", "code", "reason", "le", "kind", "version",
                                   "python"}, labels
            assert labels.get("family", "search") in FAMILIES
            assert labels.get("reason", "ip") in REASONS
            assert "evil" not in json.dumps(labels) and "aaaa" not in json.dumps(labels)


def test_backend_connection_errors_are_counted():
    dead = "http://127.0.0.1:%d" % free_port()  # nothing listens there
    with serve(dead) as daemon:
        key = new_key(daemon, None)
        assert search(daemon, key) == 502
        samples = scrape(daemon)
        assert value(samples, "searchkeys_backend_errors_total", kind="connection") == 1
        assert value(samples, "searchkeys_requests_total", family="search", code="502") == 1


def test_metrics_access_token_master_key_or_a_metrics_key(backend, token_file):
    with serve(backend.url, "--metrics-token-file", token_file) as daemon:
        search_key = new_key(daemon, None, actions=["search"])
        reader = new_key(daemon, None, actions=["metrics.get"])
        status, _, data = daemon.request("GET", "/metrics")
        assert status == 401 and json.loads(data)["code"] == "missing_authorization_header"
        for credential in ("wrong-token", TOKEN + "x", search_key["key"]):
            status, _, data = daemon.request("GET", "/metrics", None,
                                             {"Authorization": "Bearer " + credential})
            assert status == 403 and json.loads(data)["code"] == "invalid_api_key", credential
        assert value(scrape(daemon, TOKEN), "searchkeys_requests_total", family="metrics",
                     code="403") == 3
        assert value(scrape(daemon, MASTER), "searchkeys_keys") == 6
        assert refusals(scrape(daemon, reader["key"]), "credential") == 3  # no header, 2 wrong
        assert ("GET", "/metrics", None) not in backend.seen  # answered here, never forwarded


def test_metrics_count_nginx_authorize_decisions(backend):
    with serve(backend.url) as daemon:
        key = new_key(daemon, None, indexes=["movies"])
        for uri in ("/indexes/movies/search?q=x", "/indexes/books/search?q=x"):
            daemon.request("GET", "/authorize", None, {
                "Authorization": "Bearer " + key["key"], "X-Original-URI": uri,
                "X-Original-Method": "GET"})
        samples = scrape(daemon)
        assert value(samples, "searchkeys_requests_total", family="authorize", code="204") == 1
        assert value(samples, "searchkeys_requests_total", family="authorize", code="403") == 1
        assert refusals(samples, "index") == 1


@pytest.mark.parametrize("content, message", [
    (None, "cannot read --metrics-token-file"), ("\n", "is empty"),
    ("two words\n", "one token of visible ASCII")])
def test_a_bad_metrics_token_file_stops_serve_with_one_sentence(content, message):
    with scratch_dir("sk-metrics-") as folder:
        path = folder / "token"
        if content is not None:
            path.write_text(content)
        done = subprocess.run(python_cmd(SEARCHKEYS, "serve", "--port", str(free_port()),
                                         "--master-key", MASTER, "--metrics-token-file", path),
                              capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
