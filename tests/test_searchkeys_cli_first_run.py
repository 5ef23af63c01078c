"""Issue 24, first run: a `--preset search` key is restricted as created (it goes into a web
page), and the CLI's own errors name the option and the command they belong to."""
import http.server
import json
import re

import support
from test_searchkeys_cli import MASTER, api, cli, cli_at, server  # noqa: F401 - fixture

SEARCH_PRESET = {"rateLimit": {"perIp": "120/minute"}, "allowedReferrers": None,
                 "allowedIps": None, "maxHitsPerQuery": 100, "forcedParameters": None,
                 "maxConcurrentSearches": None, "allowBrowser": None}


def create_search_key(server, *extra):
    code, out, err = cli_at(server, "keys", "create", "--preset", "search", "--indexes", "blog",
                            *extra)
    assert code == 0, err
    return json.loads(out), err


def test_search_preset_key_gets_the_search_restrictions(server):
    key, err = create_search_key(server)
    assert key["actions"] == ["search"]
    status, restrictions = api(server, "GET", "/keys/%s/restrictions" % key["uid"])
    assert status == 200 and restrictions == SEARCH_PRESET, restrictions


def test_no_restrictions_asks_for_a_bare_search_key(server):
    key, _ = create_search_key(server, "--no-restrictions")
    status, restrictions = api(server, "GET", "/keys/%s/restrictions" % key["uid"])
    assert status == 200 and restrictions == dict.fromkeys(SEARCH_PRESET), restrictions
    code, out, err = cli_at(server, "keys", "create", "--actions", "search", "--indexes", "b",
                            "--no-restrictions")
    assert code == 2 and "--no-restrictions goes with --preset search" in err, err


class FakeMeilisearch(http.server.BaseHTTPRequestHandler):
    """What Meilisearch does here: creates keys, has no /keys/{uid}/restrictions route; a
    `fail` class attribute makes that route answer 500 instead."""
    fail = False
    hits = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.hits.append(("POST", self.path))
        support.answer_json(self, json.dumps(dict(body, key="k" * 64, uid=body.get("uid") or
                                                  "0b9a1d9e-2c5e-4d6b-9b8e-6f1f7f0b0b0b"))
                            .encode(), 201)

    def do_PUT(self):
        self.hits.append(("PUT", self.path))
        self.send_response(500 if self.fail else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_DELETE(self):
        self.hits.append(("DELETE", self.path))
        self.send_response(204)
        self.end_headers()


def test_search_preset_against_meilisearch_says_so_and_keeps_the_key():
    fake = support.serve_in_thread(FakeMeilisearch)
    try:
        code, out, err = cli("keys", "create", "--preset", "search", "--indexes", "blog",
                             "--quiet", "--url", fake.url, "--key", MASTER)
        assert code == 0 and out.strip() == "k" * 64, (out, err)
        assert len(err.strip().splitlines()) == 1 and "has no restrictions API" in err, err
        FakeMeilisearch.fail = True  # any other failure: the key is deleted again
        FakeMeilisearch.hits.clear()
        code, out, err = cli("keys", "create", "--preset", "search", "--indexes", "blog",
                             "--quiet", "--url", fake.url, "--key", MASTER)
        assert code == 1 and out == "", out
        assert "restrictions" in err and "the key was deleted again" in err, err
        assert [method for method, _ in FakeMeilisearch.hits] == ["POST", "PUT", "DELETE"]
    finally:
        fake.shutdown()
        fake.server_close()


def test_unknown_option_and_subcommand_errors_name_their_command():
    code, out, err = cli("--nosuch")
    assert code == 2 and "unrecognized arguments: --nosuch" in err and "COMMAND" not in \
        err.splitlines()[-1], err
    code, out, err = cli("keys", "create", "--preset", "search", "--indexes", "a", "--bogus")
    assert code == 2 and err.startswith("usage: searchkeys.py keys create"), err
    assert err.splitlines()[-1] == "searchkeys.py keys create: error: unrecognized arguments: " \
        "--bogus", err
    code, out, err = cli("keys", "create", "--preset", "search", "--indexes", ",")
    assert code == 2 and err.startswith("usage: searchkeys.py keys create"), err
    assert "searchkeys.py keys create: error: --indexes is empty" in err, err
    code, out, err = cli("serve", "--store", "", "--open")
    assert code == 2 and err.startswith("usage: searchkeys.py serve"), err
    code, out, err = cli()
    assert code == 2 and "required: COMMAND" in err, err


def test_version_prints_the_version():
    code, out, err = cli("--version")
    assert code == 0 and re.fullmatch(r"searchkeys\.py \d+\.\d+\S*\n", out), (out, err)
