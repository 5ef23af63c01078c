"""Issue 34 item 3, admin keys kept out of browsers: a request with a browser's signals
(`Origin`, `Referer`, `Sec-Fetch-Mode`) made with the master key or a key holding any action
beyond `search` is refused (403 `api_key_not_for_browsers`), unless the key's restrictions say
`allowBrowser: true`; counted by reason in usage and metrics; `keys list` flags the keys seen
from browsers. Black-box: `searchkeys.py serve` on a free loopback port in front of a stand-in
backend, real HTTP, and the client CLI."""
import json
import subprocess
import sys

import pytest

from support import SEARCHKEYS
from test_searchkeys_restrictions import (  # noqa: F401 (backend: the stand-in's fixture)
    ADMIN, MASTER, backend, new_key, serve, tenant_token)

SIGNALS = [{"Origin": "https://shop.example"}, {"Referer": "https://shop.example/admin"},
           {"Sec-Fetch-Mode": "cors"}, {"Origin": "null"}]


@pytest.fixture(scope="module")
def guard(backend):  # noqa: F811
    with serve(backend) as daemon:
        yield daemon


def search(daemon, credential, headers=None):
    sent = {"Authorization": "Bearer " + credential, "Content-Type": "application/json"}
    status, _, data = daemon.request("POST", "/indexes/movies/search", '{"q": "x"}',
                                     dict(sent, **(headers or {})))
    return status, json.loads(data)


@pytest.mark.parametrize("signal", SIGNALS)
def test_an_admin_key_from_a_browser_is_refused(guard, signal):
    admin = new_key(guard, None, ["search", "documents.add"])
    assert search(guard, admin["key"])[0] == 200  # from a server: as before
    status, error = search(guard, admin["key"], signal)
    assert status == 403 and error["code"] == "api_key_not_for_browsers", error
    assert error["type"] == "auth" and "`documents.add`" in error["message"]
    assert "allowBrowser" in error["message"] and admin["uid"] in error["message"]
    status, _, data = guard.request("GET", "/keys", None, dict(signal, Authorization="Bearer " +
                                                               new_key(guard, None, ["*"])["key"]))
    assert status == 403 and json.loads(data)["code"] == "api_key_not_for_browsers"


@pytest.mark.parametrize("signal", SIGNALS[:2])
def test_the_master_key_from_a_browser_is_refused(guard, signal):
    assert search(guard, MASTER)[0] == 200
    status, error = search(guard, MASTER, signal)
    assert status == 403 and error["code"] == "api_key_not_for_browsers", error
    assert error["message"].startswith("The master key must not be used from a browser")
    status, _, data = guard.request("GET", "/keys", None, dict(ADMIN, **signal))
    assert status == 403


def test_search_keys_and_tenant_tokens_work_from_browsers(guard):
    signal = {"Origin": "https://shop.example", "Sec-Fetch-Mode": "cors"}
    assert search(guard, new_key(guard, None, ["search"])["key"], signal)[0] == 200
    admin = new_key(guard, None, ["*"])
    assert search(guard, tenant_token(admin), signal)[0] == 200  # a token only ever searches


def test_a_key_marked_allow_browser_works_from_browsers(guard):
    admin = new_key(guard, {"allowBrowser": True}, ["*"])
    signal = {"Origin": "https://admin.example"}
    assert search(guard, admin["key"], signal)[0] == 200
    status, _, data = guard.request("GET", "/keys/%s/restrictions" % admin["uid"], None, ADMIN)
    assert json.loads(data)["allowBrowser"] is True
    status, _, data = guard.request("PUT", "/keys/%s/restrictions" % admin["uid"],
                                    '{"allowBrowser": "yes"}', ADMIN)
    assert status == 400 and json.loads(data)["code"] == "invalid_restrictions_allow_browser"


def test_authorize_refuses_an_admin_key_from_a_browser(guard):
    admin = new_key(guard, None, ["search", "settings.get"])
    headers = {"Authorization": "Bearer " + admin["key"], "X-Original-Method": "GET",
               "X-Original-URI": "/indexes/movies/settings"}
    assert guard.request("GET", "/authorize", None, headers)[0] == 204
    status, answer, _ = guard.request("GET", "/authorize", None,
                                      dict(headers, Origin="https://shop.example"))
    assert status == 403
    assert json.loads(answer["x-searchkeys-error"])["code"] == "api_key_not_for_browsers"


def test_refusals_are_counted_and_keys_list_flags_keys_seen_from_browsers(guard):
    admin, public, quiet = new_key(guard, None, ["*"]), new_key(guard, None, ["search"]), \
        new_key(guard, None, ["search"])
    signal = {"Origin": "https://shop.example"}
    assert search(guard, admin["key"], signal)[0] == 403
    assert search(guard, public["key"], signal)[0] == 200
    assert search(guard, quiet["key"])[0] == 200
    status, _, data = guard.request("GET", "/keys/%s/usage" % admin["uid"], None, ADMIN)
    usage = json.loads(data)
    assert usage["refused"]["browser"] == 1 and usage["seenFromBrowserAt"], usage
    status, _, data = guard.request("GET", "/metrics", None, ADMIN)
    assert "searchkeys_refusals_total{reason=%s} 1" % '"browser"' in data.decode()  # (test_docs
    # reads a reason= followed by a string as a skip reason)
    done = subprocess.run([sys.executable, str(SEARCHKEYS), "keys", "list", "--limit", "1000",
                           "--url", "http://127.0.0.1:%d" % guard.port, "--key", MASTER],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    keys = {key["uid"]: key for key in json.loads(done.stdout)["results"]}
    assert keys[admin["uid"]]["seenFromBrowserAt"] and keys[public["uid"]]["seenFromBrowserAt"]
    assert "seenFromBrowserAt" not in keys[quiet["uid"]] and "usage" not in keys[quiet["uid"]]


def test_cli_restrict_allow_browser(guard):
    admin = new_key(guard, None, ["*"])
    done = subprocess.run([sys.executable, str(SEARCHKEYS), "keys", "restrict", admin["uid"],
                           "--allow-browser", "--url", "http://127.0.0.1:%d" % guard.port,
                           "--key", MASTER], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["allowBrowser"] is True
    assert search(guard, admin["key"], {"Origin": "https://admin.example"})[0] == 200
