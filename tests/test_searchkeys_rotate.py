"""Issue 23 item 2, key rotation: `POST /keys/{key}/rotate` makes a new key (new uid, same
actions, indexes, expiry, name, description and restrictions) and lets the old one work for a
grace period, then it stops and is removed; `keys rotate` in the client, also against a plain
Meilisearch (a copy, and the command that deletes the old key). Black-box: `searchkeys.py serve`
on a free loopback port, real HTTP, the store file on disk."""
import calendar
import hashlib
import hmac
import http.server
import json
import signal
import time

import pytest

import support
from support import SEARCHKEYS, Daemon, free_port, python_cmd, request
from test_searchkeys_cli import Recorder, cli

MASTER = "rotate-master-key-0123456789"
KEY_FIELDS = ["name", "description", "key", "uid", "actions", "indexes", "expiresAt",
              "createdAt", "updatedAt"]
HANG = 15.0  # seconds: only a hang detector, never a timing assertion


def derive(uid, master=MASTER):
    return hmac.new(master.encode(), uid.encode(), hashlib.sha256).hexdigest()


def start(store=None):
    port = free_port()
    argv = python_cmd(SEARCHKEYS, "serve", "--host", "127.0.0.1", "--port", str(port),
                      "--master-key", MASTER, *(["--store", str(store)] if store else []))
    server = Daemon(argv, port, timeout=20.0)
    server.url = "http://127.0.0.1:%d" % port
    return server


@pytest.fixture(scope="module")
def server():
    with start() as daemon:
        yield daemon


def api(server, method, path, body=None, key=MASTER, raw=None):
    headers = {"Authorization": "Bearer " + key} if key else {}
    if body is not None or raw is not None:
        headers["Content-Type"] = "application/json"
    status, _, data = request(server.port, method, path,
                              raw if raw is not None else
                              (json.dumps(body) if body is not None else None), headers)
    return status, (json.loads(data) if data else None)


def new_key(server, actions=("search",), **fields):
    body = dict({"name": "site", "description": "the blog's search box", "actions": list(actions),
                 "indexes": ["blog", "news*"], "expiresAt": "2050-01-01T00:00:00.5Z"}, **fields)
    status, key = api(server, "POST", "/keys", body)
    assert status == 201, key
    return key


def works(server, key):
    """Is `key` accepted? Allowed, a search has no backend to go to here (501)."""
    status, answer = api(server, "GET", "/indexes/blog/search?q=x", key=key["key"])
    assert status in (501, 403), answer
    return status == 501


def rotate(server, ref, grace=None, key=MASTER):
    return api(server, "POST", "/keys/%s/rotate" % ref,
               None if grace is None else {"grace": grace}, key=key)


def listed(server):
    status, page = api(server, "GET", "/keys?limit=1000")
    assert status == 200
    return {k["uid"]: k for k in page["results"]}


def seconds(stamp):
    """An RFC 3339 UTC time of the /keys API, in whole seconds since the epoch (the grace
    period starts when the new key is created: its createdAt)."""
    return calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S"))


def wait_until_refused(server, key):
    deadline = time.monotonic() + HANG
    while works(server, key):
        assert time.monotonic() < deadline, "the old key still works long after its grace period"
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# The route
# ---------------------------------------------------------------------------------------------

def test_rotation_makes_a_copy_with_a_new_value_shaped_as_post_keys(server):
    old = new_key(server)
    restrictions = {"rateLimit": {"perIp": "60/minute"}, "allowedReferrers": None,
                    "allowedIps": ["127.0.0.0/8"], "maxHitsPerQuery": 50,
                    "forcedParameters": {"movies*": {"filter": "public = true",
                                                     "attributesToRetrieve": ["title"]}},
                    "maxConcurrentSearches": 4, "allowBrowser": True}
    assert api(server, "PUT", "/keys/%s/restrictions" % old["uid"], restrictions)[0] == 200
    status, new = rotate(server, old["key"], "1h")  # by value, as other /keys/{key} routes
    assert status == 201 and list(new) == KEY_FIELDS, new
    assert new["uid"] != old["uid"] and new["key"] == derive(new["uid"])
    for field in ("name", "description", "actions", "indexes", "expiresAt"):
        assert new[field] == old[field], field
    assert new["createdAt"] == new["updatedAt"] > old["createdAt"]
    assert api(server, "GET", "/keys/%s/restrictions" % new["uid"]) == (200, restrictions)
    assert works(server, new) and works(server, old)  # both, during the grace period
    keys = listed(server)
    assert list(keys[new["uid"]]) == KEY_FIELDS  # the new one is a plain key
    marked = keys[old["uid"]]
    assert list(marked) == KEY_FIELDS + ["retiresAt", "replacedBy"], marked
    assert marked["replacedBy"] == new["uid"]
    assert seconds(marked["retiresAt"]) - seconds(new["createdAt"]) == 3600


def test_old_key_stops_after_its_grace_period_and_is_removed(tmp_path):
    store = tmp_path / "keys.json"
    with start(store) as server:
        old = new_key(server)
        status, new = rotate(server, old["uid"], "1s")
        assert status == 201 and works(server, new)
        wait_until_refused(server, old)
        status, error = api(server, "GET", "/indexes/blog/search", key=old["key"])
        assert status == 403 and error["code"] == "invalid_api_key", error
        assert api(server, "GET", "/keys/" + old["uid"])[0] == 404
        assert old["uid"] not in listed(server) and works(server, new)
        assert old["uid"] not in store.read_text()
        # grace 0: the old key is gone at once
        status, newer = rotate(server, new["uid"], 0)
        assert status == 201 and not works(server, new) and works(server, newer)
        assert api(server, "GET", "/keys/" + new["uid"])[0] == 404


def test_default_grace_is_a_few_minutes(server):
    old = new_key(server)
    status, new = api(server, "POST", "/keys/%s/rotate" % old["uid"])  # no body at all
    assert status == 201, new
    retires = listed(server)[old["uid"]]["retiresAt"]
    assert seconds(retires) - seconds(new["createdAt"]) == 300


def test_rotation_needs_keys_create_and_keys_delete(server):
    target = new_key(server)
    only_create = new_key(server, actions=["keys.create"], indexes=["*"], expiresAt=None)
    status, error = rotate(server, target["uid"], key=only_create["key"])
    assert status == 403 and error["code"] == "invalid_api_key", error
    for actions in (["keys.create", "keys.delete"], ["*"]):
        admin = new_key(server, actions=actions, indexes=["*"], expiresAt=None)
        subject = new_key(server)
        status, rotated = rotate(server, subject["uid"], key=admin["key"])
        assert status == 201, (actions, rotated)
    # a key with restrictions only by the master key, as for DELETE
    admin = new_key(server, actions=["keys.create", "keys.delete"], indexes=["*"], expiresAt=None)
    api(server, "PUT", "/keys/%s/restrictions" % target["uid"], {"maxHitsPerQuery": 5})
    status, error = rotate(server, target["uid"], key=admin["key"])
    assert status == 403 and "Only the master key" in error["message"], error
    assert api(server, "GET", "/keys/" + target["uid"])[1].get("retiresAt") is None
    assert rotate(server, MASTER)[0] == 404  # the master key is not a key


@pytest.mark.parametrize("grace", ["1w", "31d", "2592001", -1, 1.5, True, "", "5 m", "١s",
                                   "99999999s", ["1h"]])
def test_bad_grace_is_a_400_naming_grace(server, grace):
    old = new_key(server)
    status, error = rotate(server, old["uid"], grace)
    assert status == 400 and error["code"] == "invalid_rotation_grace", error
    assert "`.grace`" in error["message"], error
    assert "retiresAt" not in listed(server)[old["uid"]]


def test_other_bad_bodies_are_400s_that_change_nothing(server):
    old = new_key(server)
    for raw, code in (('{"grace": "1h", "graec": 1}', "bad_request"), ("[]", "bad_request"),
                      ('{"grace": ', "malformed_payload")):
        status, error = api(server, "POST", "/keys/%s/rotate" % old["uid"], raw=raw)
        assert status == 400 and error["code"] == code, (raw, error)
    assert "retiresAt" not in listed(server)[old["uid"]]


@pytest.mark.parametrize("grace", ["90", 90, "0s", "30d", None])
def test_good_graces(server, grace):
    assert rotate(server, new_key(server)["uid"], grace)[0] == 201


def test_rotating_a_rotated_key_is_refused(server):
    old = new_key(server)
    status, new = rotate(server, old["uid"], "1h")
    assert status == 201
    status, error = rotate(server, old["uid"], "1h")
    assert status == 409 and error["code"] == "api_key_already_rotated", error
    assert new["uid"] in error["message"]
    assert rotate(server, new["uid"], "1h")[0] == 201  # the replacement rotates as usual
    assert api(server, "DELETE", "/keys/" + old["uid"])[0] == 204  # stop it now


# ---------------------------------------------------------------------------------------------
# Durability
# ---------------------------------------------------------------------------------------------

def rotated_then_killed(store, grace):
    """Rotate a key of a server on `store` and kill -9 it right after the 201: (old, new)."""
    with start(store) as server:
        old = new_key(server)
        status, new = rotate(server, old["uid"], grace)
        assert status == 201
        server.stop(signal.SIGKILL)
    return old, new


def test_kill_9_right_after_201_loses_neither_key_nor_the_retirement(tmp_path):
    store = tmp_path / "keys.json"
    old, new = rotated_then_killed(store, "1h")
    with start(store) as server:
        keys = listed(server)
        assert keys[new["uid"]] == new and keys[old["uid"]]["replacedBy"] == new["uid"]
        assert seconds(keys[old["uid"]]["retiresAt"]) - seconds(new["createdAt"]) == 3600
        assert works(server, new) and works(server, old)


def test_a_restart_after_the_deadline_drops_the_old_key(tmp_path):
    store = tmp_path / "keys.json"
    old, new = rotated_then_killed(store, "1s")
    assert old["uid"] in store.read_text()
    deadline = time.monotonic() + HANG
    while old["uid"] in store.read_text():
        assert time.monotonic() < deadline, "the retired key was never removed"
        with start(store) as server:
            keys = listed(server)
            if old["uid"] not in keys:  # its grace is over: gone, at start
                assert works(server, new) and new["uid"] in keys
                break
        time.sleep(0.2)
    assert old["uid"] not in store.read_text() and new["uid"] in store.read_text()


# ---------------------------------------------------------------------------------------------
# The official client and ours
# ---------------------------------------------------------------------------------------------

def test_meilisearch_client_lists_keys_during_a_rotation(server):
    meilisearch = pytest.importorskip(
        "meilisearch", reason="needs the meilisearch client: run python3 tests/run.py, which "
                              "installs requirements-dev.txt")
    old = new_key(server)
    status, new = rotate(server, old["uid"], "1h")
    assert status == 201
    client = meilisearch.Client(server.url, MASTER, timeout=10)
    uids = [k.uid for k in client.get_keys({"limit": 1000}).results]
    assert old["uid"] in uids and new["uid"] in uids
    assert client.get_key(old["uid"]).key == old["key"]


def test_cli_rotates_and_prints_the_new_key(server):
    old = new_key(server)
    code, out, err = cli("keys", "rotate", old["uid"], "--grace", "1h", "--url", server.url,
                         "--key", MASTER)
    assert code == 0, err
    new = json.loads(out)
    assert list(new) == KEY_FIELDS and new["key"] == derive(new["uid"]) and "\n" in out.strip()
    assert listed(server)[old["uid"]]["replacedBy"] == new["uid"]
    code, out, err = cli("keys", "rotate", new["key"], "--quiet", "--url", server.url, "--key",
                         MASTER)
    assert code == 0 and len(out.split()) == 1 and works(server, {"uid": new["uid"],
                                                                  "key": new["key"]}), err
    code, out, err = cli("keys", "rotate", old["uid"], "--url", server.url, "--key", MASTER)
    assert code == 1 and "api_key_already_rotated" in err and "Traceback" not in err, err
    before = len(listed(server))
    code, out, err = cli("keys", "rotate", "0b9a1d9e-2c5e-4d6b-9b8e-6f1f7f0b0b0b", "--url",
                         server.url, "--key", MASTER)  # an unknown key is not a missing route
    assert code == 1 and "api_key_not_found" in err and len(listed(server)) == before, err


def test_cli_bad_grace_is_caught_before_any_request():
    recorder = Recorder()
    try:
        code, out, err = cli("keys", "rotate", "0b9a1d9e-2c5e-4d6b-9b8e-6f1f7f0b0b0b", "--grace",
                             "1 week", "--url", recorder.url, "--key", MASTER)
        assert code == 2 and "--grace" in err.splitlines()[-1] and recorder.hits == [], err
        assert err.startswith("usage: searchkeys.py keys rotate"), err
    finally:
        recorder.close()


class PlainMeilisearch(http.server.BaseHTTPRequestHandler):
    """Meilisearch has no rotate route: 404 there; GET and POST /keys as usual."""
    hits = []
    KEY = {"name": "site", "description": "d", "key": "a" * 64,
           "uid": "11111111-2c5e-4d6b-9b8e-6f1f7f0b0b0b", "actions": ["search"],
           "indexes": ["blog"], "expiresAt": "2050-01-01T00:00:00Z",
           "createdAt": "2025-01-01T00:00:00.5Z", "updatedAt": "2025-01-01T00:00:00.5Z"}

    def log_message(self, *args):
        pass

    RESTRICTIONS = None  # Meilisearch has no restrictions route either

    def do_GET(self):
        self.hits.append(("GET", self.path, None))
        if self.path.endswith("/restrictions") and self.RESTRICTIONS is None:
            support.answer_json(self, b"", 404)
            return
        support.answer_json(self, json.dumps(
            self.RESTRICTIONS if self.path.endswith("/restrictions") else self.KEY).encode())

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.hits.append(("POST", self.path, body))
        if self.path.endswith("/rotate"):
            support.answer_json(self, json.dumps({
                "message": "Not found", "code": "not_found", "type": "invalid_request",
                "link": "https://docs.meilisearch.com/errors#not_found"}).encode(), 404)
            return
        support.answer_json(self, json.dumps(dict(
            self.KEY, **body, key="b" * 64, uid="22222222-2c5e-4d6b-9b8e-6f1f7f0b0b0b")).encode(),
            201)


def test_cli_against_meilisearch_makes_a_copy_and_says_how_to_delete_the_old_key():
    fake = support.serve_in_thread(PlainMeilisearch)
    try:
        old = PlainMeilisearch.KEY
        code, out, err = cli("keys", "rotate", old["uid"], "--quiet", "--url", fake.url,
                             "--key", MASTER)
        assert code == 0 and out.strip() == "b" * 64, (out, err)
        created = [body for method, path, body in PlainMeilisearch.hits
                   if method == "POST" and path == "/keys"]
        assert created == [{"description": "d", "name": "site", "actions": ["search"],
                            "indexes": ["blog"], "expiresAt": "2050-01-01T00:00:00Z"}]
        assert "searchkeys.py keys delete %s --url %s" % (old["uid"], fake.url) in err, err
        assert "restrictions" in err and len(err.strip().splitlines()) == 1, err
        assert MASTER not in err
    finally:
        fake.shutdown()
        fake.server_close()


class OlderSearchkeys(PlainMeilisearch):
    """A searchkeys without the rotate route (older, or behind a proxy that hides it): the key
    has restrictions there."""
    hits = []
    RESTRICTIONS = {"rateLimit": {"perIp": "60/minute"}, "allowedReferrers": None,
                    "allowedIps": None, "maxHitsPerQuery": None, "forcedParameters": None,
                    "maxConcurrentSearches": None, "allowBrowser": None}


def test_cli_never_copies_a_key_whose_restrictions_the_copy_would_lose():
    # the copy would be a public site key without its rate limit or forced filter
    fake = support.serve_in_thread(OlderSearchkeys)
    try:
        code, out, err = cli("keys", "rotate", OlderSearchkeys.KEY["uid"], "--url", fake.url,
                             "--key", MASTER)
        assert code == 1 and out == "" and "restrictions" in err and "Traceback" not in err, err
        assert [hit for hit in OlderSearchkeys.hits if hit[0] == "POST"] == [
            ("POST", "/keys/%s/rotate" % OlderSearchkeys.KEY["uid"], None)]
    finally:
        fake.shutdown()
        fake.server_close()
