"""Usage per key (issue 23, item 3): requests allowed and refused by reason, last used, kept in
memory and saved with the store (every few seconds and at shutdown, never once a request);
GET /keys/{key}/usage, GET /keys?usage=true and the client's `keys usage` table.

Black-box: the real `searchkeys.py serve` on a free loopback port in front of the recording
stand-in backend of test_searchkeys_restrictions.
"""
import datetime
import hashlib
import hmac
import http.server
import json
import os
import signal
import subprocess
import time

import pytest

from support import SEARCHKEYS, Daemon, answer_json, free_port, python_cmd, scratch_dir, \
    serve_in_thread
from test_searchkeys_restrictions import ADMIN, JSON, MASTER, new_key, tenant_token
from test_searchkeys_restrictions import backend  # noqa: F401 - fixture

REASONS = ["action", "index", "expiry", "rate", "referrer", "ip", "hits", "forced", "revoked",
           "concurrency", "browser"]
EXPIRED_UID = "11111111-2222-4333-8444-555555555555"


def serve(backend, store=None, *extra):
    port = free_port()
    argv = ["serve", "--port", port, "--master-key", MASTER, "--upstream", backend.url,
            "--trusted-proxy", "127.0.0.1/32"]
    return Daemon(python_cmd(SEARCHKEYS, *argv, *(["--store", store] if store else []), *extra),
                  port, timeout=30.0)


def usage(daemon, key_or_uid):
    status, _, data = daemon.request("GET", "/keys/%s/usage" % key_or_uid, None, ADMIN)
    assert status == 200, data
    return json.loads(data)


def search(daemon, key, index="movies", client="192.0.2.1", origin="https://example.com",
           token=None, limit=None):
    headers = dict(JSON, Authorization="Bearer " + (token or key["key"]), Origin=origin)
    headers["X-Forwarded-For"] = client
    body = {"q": "x"} if limit is None else {"q": "x", "limit": limit}
    return daemon.request("POST", "/indexes/%s/search" % index, json.dumps(body), headers)[0]


def authorize(daemon, key, uri, client="192.0.2.1"):
    headers = {"Authorization": "Bearer " + key["key"], "X-Original-URI": uri,
               "X-Original-Method": "GET", "X-Forwarded-For": client,
               "Origin": "https://example.com"}
    return daemon.request("GET", "/authorize", None, headers)[0]


def expired_key_store(folder):
    """A store holding one key that expired in 2000 (the API refuses a past expiresAt)."""
    record = {"uid": EXPIRED_UID, "name": "expired", "description": None, "actions": ["search"],
              "indexes": ["*"], "expiresAt": "2000-01-01T00:00:00Z", "createdAt": 1,
              "updatedAt": 1}
    path = folder / "keys.json"
    path.write_text(json.dumps({"format": "searchkeys-store", "version": 1, "keys": [record]}))
    os.chmod(path, 0o600)
    return path


def test_usage_counts_allowed_and_every_refusal_reason(backend):
    restrictions = {"allowedIps": ["192.0.2.0/24"], "allowedReferrers": ["https://example.com/*"],
                    "rateLimit": {"perIp": "6/minute"}, "maxHitsPerQuery": 10}
    with scratch_dir("sk-usage-") as folder, serve(backend, expired_key_store(folder)) as daemon:
        key = new_key(daemon, restrictions, indexes=["movies"])
        idle = new_key(daemon, None)
        assert usage(daemon, key["uid"]) == {"uid": key["uid"], "allowed": 0,
                                             "refused": dict.fromkeys(REASONS, 0),
                                             "lastUsedAt": None, "seenFromBrowserAt": None,
                                             "unsaved": {"allowed": 0, "refused": 0}}
        before = datetime.datetime.now(datetime.timezone.utc)
        statuses = {
            "allowed": search(daemon, key),                                      # rate 1
            "token": search(daemon, key, token=tenant_token(key)),               # rate 2
            "authorize": authorize(daemon, key, "/indexes/movies/search?q=x&limit=5"),  # 3
            "index": search(daemon, key, index="books"),
            "action": daemon.request("GET", "/indexes/movies/documents", None,
                                     {"Authorization": "Bearer " + key["key"]})[0],
            "ip": search(daemon, key, client="198.51.100.7"),
            "referrer": search(daemon, key, origin="https://evil.example"),      # rate 4
            "hits": authorize(daemon, key, "/indexes/movies/search?q=x&limit=500"),  # rate 5
        }
        assert statuses == {"allowed": 200, "token": 200, "authorize": 204, "index": 403,
                            "action": 403, "ip": 403, "referrer": 403, "hits": 403}
        # the rest of the burst of 6, then 429s: each counted as allowed or refused for its rate
        answers = [search(daemon, key) for _ in range(4)]
        assert set(answers) == {200, 429} and answers[0] == 200, answers
        expired = {"key": hmac.new(MASTER.encode(), EXPIRED_UID.encode(),
                                   hashlib.sha256).hexdigest()}
        assert search(daemon, expired) == 403
        after = datetime.datetime.now(datetime.timezone.utc)

        shown = usage(daemon, key["key"])  # by value, as the other /keys routes
        assert shown["uid"] == key["uid"]
        assert shown["allowed"] == 3 + answers.count(200)
        assert shown["refused"] == {"action": 1, "index": 1, "expiry": 0, "rate": answers.count(429),
                                    "referrer": 1, "ip": 1, "hits": 1, "forced": 0,
                                    "revoked": 0, "concurrency": 0, "browser": 0}
        last = datetime.datetime.strptime(shown["lastUsedAt"][:19] + "+0000", "%Y-%m-%dT%H:%M:%S%z")
        assert before - datetime.timedelta(seconds=1) <= last <= after
        assert shown["lastUsedAt"].endswith("Z")
        assert usage(daemon, EXPIRED_UID)["refused"] == dict.fromkeys(REASONS, 0) | {"expiry": 1}
        assert usage(daemon, idle["uid"])["lastUsedAt"] is None
        forced = new_key(daemon, {"forcedParameters": {"movies": {"attributesToRetrieve": ["t"]}}})
        assert authorize(daemon, forced, "/indexes/movies/search?q=x") == 403
        assert usage(daemon, forced["uid"])["refused"] == dict.fromkeys(REASONS, 0) | {"forced": 1}


def test_usage_route_is_for_the_master_key_and_answers_404_like_meilisearch(backend):
    with serve(backend) as daemon:
        key = new_key(daemon, None, actions=["*"])
        status, _, data = daemon.request("GET", "/keys/%s/usage" % key["uid"], None,
                                         {"Authorization": "Bearer " + key["key"]})
        assert status == 403 and json.loads(data)["code"] == "invalid_api_key"
        status, _, data = daemon.request("GET", "/keys?usage=true", None,
                                         {"Authorization": "Bearer " + key["key"]})
        assert status == 403 and json.loads(data)["code"] == "invalid_api_key"
        status, _, data = daemon.request("GET", "/keys/usage", None, ADMIN)
        assert status == 404 and json.loads(data)["code"] == "api_key_not_found"
        unknown = "00000000-0000-4000-8000-000000000000"
        status, _, data = daemon.request("GET", "/keys/%s/usage" % unknown, None, ADMIN)
        assert (status, json.loads(data)) == (404, {
            "message": "API key `%s` not found." % unknown, "code": "api_key_not_found",
            "type": "invalid_request", "link": "https://docs.meilisearch.com/errors#api_key_not_found"})
        status, _, data = daemon.request("GET", "/keys?usage=true&limit=1000", None, ADMIN)
        listing = json.loads(data)
        assert status == 200 and all(set(k["usage"]) == {"allowed", "refused", "lastUsedAt",
                                                            "seenFromBrowserAt"}
                                     for k in listing["results"])
        assert daemon.request("GET", "/keys?usage=maybe", None, ADMIN)[0] == 400
        # without the parameter GET /keys answers exactly Meilisearch's fields
        plain = json.loads(daemon.request("GET", "/keys", None, ADMIN)[2])["results"][0]
        assert "usage" not in plain


def store_state(path):
    info = os.stat(path)
    return info.st_ino, info.st_mtime_ns


def test_usage_is_saved_at_shutdown_never_once_a_request(backend):
    with scratch_dir("sk-usage-") as folder:
        path = folder / "keys.json"
        with serve(backend, path) as daemon:
            key = new_key(daemon, None)
            states, started = {store_state(path)}, time.monotonic()
            for _ in range(40):
                assert search(daemon, key) == 200
                states.add(store_state(path))
            # a save every 5 s at most: never a write per request
            assert len(states) <= 2 + (time.monotonic() - started) // 5, len(states)
            assert daemon.stop() == 0
        saved = json.loads(path.read_text())
        assert saved["usage"][key["uid"]]["allowed"] == 40
        with serve(backend, path) as daemon:
            shown = usage(daemon, key["uid"])
            assert shown["allowed"] == 40 and shown["lastUsedAt"] is not None
            status, _, data = daemon.request("GET", "/keys?limit=100", None, ADMIN)
            assert len(json.loads(data)["results"]) == 5  # the four defaults and ours


def test_usage_reaches_the_store_within_seconds_and_survives_kill_9(backend):
    with scratch_dir("sk-usage-") as folder:
        path = folder / "keys.json"
        with serve(backend, path) as daemon:
            key = new_key(daemon, None)
            for _ in range(3):
                assert search(daemon, key) == 200
            deadline = time.monotonic() + 30  # a hang detector: the flush comes within 5 s
            while key["uid"] not in json.loads(path.read_text()).get("usage", {}):
                assert time.monotonic() < deadline, "usage never saved while running"
                time.sleep(0.2)
            daemon.stop(signal.SIGKILL)
        with serve(backend, path) as daemon:
            assert usage(daemon, key["uid"])["allowed"] == 3


def test_deleted_keys_lose_their_usage_and_a_bad_usage_section_loses_no_key(backend):
    with scratch_dir("sk-usage-") as folder:
        path = expired_key_store(folder)  # an older store: no usage section
        with serve(backend, path) as daemon:
            gone, kept = new_key(daemon, None), new_key(daemon, None)
            assert search(daemon, gone) == 200 and search(daemon, kept) == 200
            assert daemon.request("DELETE", "/keys/" + gone["uid"], None, ADMIN)[0] == 204
            section = json.loads(path.read_text())["usage"]  # the delete wrote the store
            assert gone["uid"] not in section and section[kept["uid"]]["allowed"] == 1
        document = json.loads(path.read_text())
        document["usage"][kept["uid"]] = {"allowed": "many"}
        path.write_text(json.dumps(document))
        with serve(backend, path) as daemon:
            assert "bad usage counts for key %s" % kept["uid"] in daemon.log()
            assert usage(daemon, kept["uid"])["allowed"] == 0
            status, _, data = daemon.request("GET", "/keys?limit=100", None, ADMIN)
            assert {k["uid"] for k in json.loads(data)["results"]} >= {kept["uid"], EXPIRED_UID}


def cli(port, *args):
    done = subprocess.run(python_cmd(SEARCHKEYS, "keys", "usage", "--url",
                                     "http://127.0.0.1:%d" % port, "--key", MASTER, *args),
                          capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    return done.returncode, done.stdout, done.stderr


def test_cli_usage_table_most_used_first_never_used_flagged(backend):
    with serve(backend) as daemon:  # in memory: counts live in memory
        busy, quiet = new_key(daemon, None), new_key(daemon, None)
        for _ in range(3):
            search(daemon, busy)
        search(daemon, quiet)
        assert daemon.request("GET", "/indexes/movies/documents", None,
                              {"Authorization": "Bearer " + quiet["key"]})[0] == 403
        status, out, err = cli(daemon.port)
        assert status == 0, err
        lines = out.splitlines()
        assert lines[0].split()[:4] == ["NAME", "UID", "ALLOWED", "REFUSED"]
        assert busy["uid"] in lines[1] and quiet["uid"] in lines[2]
        assert lines[1].split()[2:4] == ["3", "0"] and lines[2].split()[2:5] == ["1", "1", "1"]
        assert all(line.rstrip().endswith("never") for line in lines[3:]) and len(lines) == 7
        assert not lines[1].rstrip().endswith("never")


class FakeMeilisearch(http.server.BaseHTTPRequestHandler):
    """A real Meilisearch's answer to GET /keys?usage=true."""

    def do_GET(self):
        answer_json(self, json.dumps({
            "message": "Unknown parameter `usage`: expected one of `offset`, `limit`",
            "code": "bad_request", "type": "invalid_request",
            "link": "https://docs.meilisearch.com/errors#bad_request"}).encode(), 400)

    def log_message(self, *args):
        pass


def test_cli_usage_against_meilisearch_says_it_has_no_usage():
    server = serve_in_thread(FakeMeilisearch)
    try:
        status, out, err = cli(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
    assert status == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "keeps no usage counts" in err and "searchkeys.py serve" in err
