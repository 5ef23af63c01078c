"""Black-box tests of the searchkeys client CLI (`keys ...`, `token`), run as a subprocess
against a `searchkeys.py serve` started here on 127.0.0.1.

Expected behaviour comes from /work/shared/spec/searchkeys.md "Client" (SK) and
/work/shared/spec/meilisearch-keys.md (MK). Tenant tokens printed by the CLI are
checked by hand (base64url + hmac), never by importing searchkeys.
"""
import base64
import calendar
import hashlib
import hmac
import http.server
import json
import os
import re
import subprocess
import threading
import time
import uuid

import pytest

from support import SEARCHKEYS, Daemon, free_port, python_cmd, request

MASTER = "cli-master-key-0123456789"
KEY_FIELDS = ["name", "description", "key", "uid", "actions", "indexes", "expiresAt",
              "createdAt", "updatedAt"]  # MK §1.1
# SK presets; backend grants what its help says (issue 17 point 8): no index deletion
BACKEND = ["search", "documents.*", "indexes.create", "indexes.get", "tasks.get", "settings.get",
           "stats.get"]
HASHES = {"HS256": hashlib.sha256, "HS384": hashlib.sha384, "HS512": hashlib.sha512}


def derive(master, uid):
    return hmac.new(master.encode(), uid.encode(), hashlib.sha256).hexdigest()


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def b64url_decode(text):
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# ---------------------------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------------------------

class Recorder:
    """An HTTP server on 127.0.0.1 that counts requests: proves the CLI sent none."""

    def __init__(self):
        self.hits = []
        rec = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def handle_any(self):
                rec.hits.append((self.command, self.path))
                self.send_response(500)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = handle_any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def server():
    port = free_port()
    argv = python_cmd(SEARCHKEYS, "serve", "--host", "127.0.0.1", "--port", str(port),
                      "--master-key", MASTER)
    with Daemon(argv, port, timeout=15.0) as d:
        d.url = "http://127.0.0.1:%d" % port
        yield d


@pytest.fixture(scope="module")
def recorder():
    r = Recorder()
    yield r
    r.close()


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MEILI_URL", "MEILI_MASTER_KEY", "SEARCHKEYS_UPSTREAM_KEY")}
    env.update(extra)
    return env


def cli(*args, env=None):
    """Run the CLI: (exit status, stdout, stderr)."""
    proc = subprocess.run(python_cmd(SEARCHKEYS, *args), capture_output=True, text=True,
                          timeout=30, env=env if env is not None else clean_env(),
                          stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stdout, proc.stderr


def cli_at(server, *args, key=MASTER):
    """The CLI pointed at the test server with --url/--key after the subcommand."""
    extra = ["--url", server.url]
    if key is not None:
        extra += ["--key", key]
    return cli(*args, *extra)


def api(server, method, path, body=None, key=MASTER):
    headers = {"Authorization": "Bearer " + key} if key else {}
    if body is not None:
        body = json.dumps(body)
        headers["Content-Type"] = "application/json"
    status, hdrs, data = request(server.port, method, path, body, headers)
    return status, (json.loads(data) if data else None)


def ok_json(result):
    code, out, err = result
    assert code == 0, (code, out, err)
    data = json.loads(out)
    assert "\n" in out.strip(), out  # pretty-printed (SK "Output")
    return data


def fails_with(result, code_name, message):
    """SK: a server error → its code and message on stderr, exit status 1."""
    code, out, err = result
    assert code == 1, (code, out, err)
    assert code_name in err and message in err, err
    assert "Traceback" not in err
    assert out.strip() == ""


def rejected_before_request(result, recorder, *needles):
    code, out, err = result
    assert code != 0, (code, out, err)
    assert recorder.hits == [], recorder.hits
    assert "Traceback" not in err, err
    for needle in needles:
        assert re.search(needle, err), (needle, err)


def iso(ts):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


# ---------------------------------------------------------------------------------------------
# keys create
# ---------------------------------------------------------------------------------------------

def test_create_preset_search(server):
    key = ok_json(cli_at(server, "keys", "create", "--preset", "search", "--indexes", "blog,news"))
    assert list(key) == KEY_FIELDS  # the server's JSON, as it came
    assert key["actions"] == ["search"] and key["indexes"] == ["blog", "news"]
    assert key["expiresAt"] is None  # no --expires-at: a key that never expires
    assert key["key"] == derive(MASTER, key["uid"])
    assert api(server, "GET", "/keys/" + key["uid"]) == (200, key)


def test_create_preset_backend(server):
    key = ok_json(cli_at(server, "keys", "create", "--preset", "backend", "--indexes", "blog"))
    assert key["actions"] == BACKEND and key["indexes"] == ["blog"]
    # it manages documents and may not delete the index or change its settings
    headers = {"Authorization": "Bearer " + key["key"]}
    assert request(server.port, "DELETE", "/indexes/blog", None, headers)[0] == 403
    assert request(server.port, "PATCH", "/indexes/blog/settings", "{}",
                   dict(headers, **{"Content-Type": "application/json"}))[0] == 403
    assert request(server.port, "DELETE", "/indexes/blog/documents", None, headers)[0] == 501


def test_create_help_says_what_each_option_does():
    code, out, err = cli("keys", "create", "--help")
    assert code == 0, err
    text = " ".join(out.split())
    for action in BACKEND:  # the preset's help lists what it grants
        assert action in text, action
    assert "no index deletion" in text
    for action in ("documents.add", "indexes.delete", "chatCompletions", "dynamicSearchRules.*"):
        assert action in text, action  # --actions lists the valid names
    for option in ("--name", "--description", "--uid", "--indexes", "--expires-at"):
        described = re.search(r"^ +" + re.escape(option) + r" \S+\s+(\S+)", out, re.M)
        assert described and not described.group(1).startswith("-"), (option, out)


def test_create_with_every_option(server):
    uid = str(uuid.uuid4())
    key = ok_json(cli_at(server, "keys", "create", "--actions", "documents.add,documents.get",
                         "--indexes", "blog,news*", "--expires-at", "2050-11-13T00:00:00+02:00",
                         "--description", "a desc", "--name", "a name", "--uid", uid))
    assert key["uid"] == uid and key["key"] == derive(MASTER, uid)
    assert key["actions"] == ["documents.add", "documents.get"]
    assert key["indexes"] == ["blog", "news*"]
    assert key["expiresAt"] == "2050-11-13T00:00:00+02:00"  # MK §1.1 re-serialized by server
    assert key["name"] == "a name" and key["description"] == "a desc"


@pytest.mark.parametrize("sent,shown", [
    ("never", None),
    ("2050-11-13 10:00:00", "2050-11-13T10:00:00Z"),  # passed on as upstream accepts it
])
def test_create_expires_at_forms(server, sent, shown):
    key = ok_json(cli_at(server, "keys", "create", "--preset", "search", "--indexes", "x",
                         "--expires-at", sent))
    assert key["expiresAt"] == shown


def test_create_quiet_prints_only_the_key(server):
    code, out, err = cli_at(server, "keys", "create", "--preset", "search", "--indexes", "blog",
                            "--quiet")
    assert code == 0, err
    assert re.fullmatch(r"[0-9a-f]{64}\n?", out), out
    status, got = api(server, "GET", "/keys/" + out.strip())
    assert status == 200 and got["key"] == out.strip() and got["actions"] == ["search"]
    code, out2, err = cli_at(server, "keys", "get", got["uid"], "--quiet")
    assert code == 0 and out2.strip() == out.strip()


# ---------------------------------------------------------------------------------------------
# keys list / get / update / delete
# ---------------------------------------------------------------------------------------------

def test_list(server):
    for i in range(3):
        api(server, "POST", "/keys", {"name": "l%d" % i, "actions": ["search"], "indexes": ["*"],
                                      "expiresAt": None})
    data = ok_json(cli_at(server, "keys", "list"))
    assert data == api(server, "GET", "/keys")[1]
    assert list(data) == ["results", "offset", "limit", "total"]
    data = ok_json(cli_at(server, "keys", "list", "--offset", "1", "--limit", "2"))
    assert data == api(server, "GET", "/keys?offset=1&limit=2")[1]
    assert data["offset"] == 1 and data["limit"] == 2 and len(data["results"]) == 2


def test_get_by_uid_and_by_key(server):
    status, key = api(server, "POST", "/keys", {"name": "g", "actions": ["search"],
                                                "indexes": ["*"], "expiresAt": None})
    assert ok_json(cli_at(server, "keys", "get", key["uid"])) == key
    assert ok_json(cli_at(server, "keys", "get", key["key"])) == key


def test_update(server):
    status, key = api(server, "POST", "/keys", {"name": "old", "description": "old d",
                                                "actions": ["search"], "indexes": ["*"],
                                                "expiresAt": None})
    got = ok_json(cli_at(server, "keys", "update", key["uid"], "--name", "new"))
    assert got["name"] == "new" and got["description"] == "old d"
    got = ok_json(cli_at(server, "keys", "update", key["key"], "--description", "new d"))
    assert got["name"] == "new" and got["description"] == "new d"
    assert got["createdAt"] == key["createdAt"] and got["actions"] == ["search"]
    assert api(server, "GET", "/keys/" + key["uid"])[1] == got


def test_delete(server):
    status, key = api(server, "POST", "/keys", {"actions": ["search"], "indexes": ["*"],
                                                "expiresAt": None})
    code, out, err = cli_at(server, "keys", "delete", key["uid"])
    assert code == 0, err
    assert api(server, "GET", "/keys/" + key["uid"])[0] == 404
    fails_with(cli_at(server, "keys", "delete", key["uid"]), "api_key_not_found",
               "API key `%s` not found." % key["uid"])


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def test_server_errors_on_stderr(server):
    fails_with(cli_at(server, "keys", "get", "doggo"), "api_key_not_found",
               "API key `doggo` not found.")
    fails_with(cli_at(server, "keys", "list", key="wrong-key"), "invalid_api_key",
               "The provided API key is invalid.")
    fails_with(cli_at(server, "keys", "list", key=None), "missing_authorization_header",
               "The Authorization header is missing.")
    uid = str(uuid.uuid4())
    assert cli_at(server, "keys", "create", "--preset", "search", "--indexes", "a",
                  "--uid", uid)[0] == 0
    fails_with(cli_at(server, "keys", "create", "--preset", "search", "--indexes", "a",
                      "--uid", uid), "api_key_already_exists",
               "`uid` field value `%s` is already an existing API key." % uid)
    # the server's own check of a global action on an index-scoped key (MK §3.2)
    fails_with(cli_at(server, "keys", "create", "--actions", "version", "--indexes", "a"),
               "index_scoped_api_key_with_global_action",
               "cannot create index-scoped API key with global action")


def test_connection_failure_names_the_url():
    url = "http://127.0.0.1:%d" % free_port()
    code, out, err = cli("keys", "list", "--url", url, "--key", MASTER)
    assert code != 0 and url in err and "Traceback" not in err, err
    code, out, err = cli("token", "--api-key", "0" * 64, "--uid", str(uuid.uuid4()),
                         "--rules", '["*"]', "--url", url)
    assert code == 0, err  # token makes no request at all (SK)


def test_default_url():
    with __import__("socket").socket() as probe:
        try:
            probe.bind(("127.0.0.1", 7700))
        except OSError:
            pytest.skip("port 7700 is in use here: stop what listens on it to run this")
    code, out, err = cli("keys", "list", "--key", MASTER)
    assert code != 0 and "http://127.0.0.1:7700" in err, err


@pytest.mark.parametrize("args,needles", [
    (["--actions", "serch,documents.get", "--indexes", "a"], [r"serch", r"\bsearch\b"]),
    (["--actions", "search,Documents.get", "--indexes", "a"], [r"Documents\.get",
                                                               r"\bdocuments\.get\b"]),
    (["--preset", "search", "--indexes", "a", "--expires-at", "tomorrow"], [r"tomorrow"]),
    (["--preset", "search", "--indexes", ""], []),
    (["--preset", "search", "--indexes", ","], []),
    (["--preset", "search"], []),
    (["--indexes", "a"], []),
    (["--preset", "search", "--actions", "search", "--indexes", "a"], []),
])
def test_bad_arguments_caught_before_any_request(recorder, args, needles):
    recorder.hits.clear()
    result = cli("keys", "create", *args, "--url", recorder.url, "--key", MASTER)
    rejected_before_request(result, recorder, *needles)


@pytest.mark.parametrize("args,needle", [
    (["keys", "create", "--preset", "search", "--indexes", "a", "--uid", "nope"], "--uid"),
    (["token", "--api-key", "0" * 64, "--uid", "nope", "--rules", '["a"]'], "--uid"),
    (["keys", "list", "--url", "localhost:7700"], "--url"),
    (["keys", "list", "--url", "http://127.0.0.1:99999"], "--url"),
    (["keys", "list", "--key", "line\nbreak"], "--key"),
    (["keys", "list", "--offset", "-1"], "--offset"),
    (["keys", "get", ""], "KEY_OR_UID"),
    (["token", "--api-key", "", "--uid", str(uuid.uuid4()), "--rules", '["a"]'], "--api-key"),
    (["keys", "create", "--preset", "search", "--indexes", "a", "--name", b"\xff".decode(
        "utf-8", "surrogateescape")], "--name"),
])
def test_bad_values_name_their_flag(recorder, args, needle):
    recorder.hits.clear()
    extra = [] if "--url" in args else ["--url", recorder.url]
    code, out, err = cli(*args, *extra)
    assert code == 2 and needle in err and "Traceback" not in err, (code, err)
    usage, sentence = err.strip().rsplit("\n", 1)  # the command's usage, then one sentence
    assert usage.startswith("usage: searchkeys.py %s" % args[0]) and needle in sentence, err
    assert recorder.hits == []


def test_other_bad_arguments(recorder):
    recorder.hits.clear()
    for args in (["keys", "list", "--limit", "abc"], ["keys", "frobnicate"],
                 ["token", "--api-key", "0" * 64, "--uid", str(uuid.uuid4()), "--rules", "[oops"],
                 ["token", "--api-key", "0" * 64, "--uid", str(uuid.uuid4()), "--rules", '["a"]',
                  "--expires-at", "tomorrow"],
                 ["token", "--api-key", "0" * 64, "--rules", '["a"]']):
        rejected_before_request(cli(*args, "--url", recorder.url, "--key", MASTER), recorder)


# ---------------------------------------------------------------------------------------------
# Environment variables (SK "Common options")
# ---------------------------------------------------------------------------------------------

def test_env_vars(server, recorder):
    env = clean_env(MEILI_URL=server.url, MEILI_MASTER_KEY=MASTER)
    code, out, err = cli("keys", "list", env=env)
    assert code == 0, err
    assert json.loads(out) == api(server, "GET", "/keys")[1]
    # flags win over the environment
    env = clean_env(MEILI_URL=recorder.url, MEILI_MASTER_KEY="wrong")
    code, out, err = cli("keys", "list", "--url", server.url, "--key", MASTER, env=env)
    assert code == 0, err
    env = clean_env(MEILI_URL=server.url, MEILI_MASTER_KEY="wrong")
    fails_with(cli("keys", "list", env=env), "invalid_api_key", "The provided API key is invalid.")
    code, out, err = cli("keys", "create", "--preset", "search", "--indexes", "e", "--quiet",
                         env=clean_env(MEILI_URL=server.url, MEILI_MASTER_KEY=MASTER))
    assert code == 0 and api(server, "GET", "/keys/" + out.strip())[0] == 200


# ---------------------------------------------------------------------------------------------
# token (SK "Client", MK §9)
# ---------------------------------------------------------------------------------------------

def decode_token(token):
    head, payload, sig = token.split(".")
    header = json.loads(b64url_decode(head))
    claims = json.loads(b64url_decode(payload))
    return header, claims, head + "." + payload, b64url_decode(sig)


def mint_with_cli(recorder, parent, rules, *extra):
    recorder.hits.clear()
    code, out, err = cli("token", "--api-key", parent["key"], "--uid", parent["uid"],
                         "--rules", json.dumps(rules), *extra, "--url", recorder.url)
    assert code == 0, err
    assert recorder.hits == []  # minted offline
    token = out.strip()
    header, claims, signed, sig = decode_token(token)
    assert header["alg"] in HASHES
    expected = hmac.new(parent["key"].encode(), signed.encode(), HASHES[header["alg"]]).digest()
    assert hmac.compare_digest(sig, expected)  # signed with the parent key's hex text (MK §9)
    assert claims["searchRules"] == rules and claims["apiKeyUid"] == parent["uid"]
    return token, claims


@pytest.fixture(scope="module")
def parent(server):
    status, key = api(server, "POST", "/keys", {"actions": ["search"], "indexes": ["*"],
                                                "expiresAt": None})
    assert status == 201
    return key


def search(server, token, index="movies"):
    return api(server, "GET", "/indexes/%s/search?q=a" % index, key=token)


def test_token_accepted_by_the_server(server, recorder, parent):
    token, claims = mint_with_cli(recorder, parent, ["movies"])
    assert claims.get("exp") is None
    status, body = search(server, token)
    assert status == 501 and body["code"] == "no_upstream", body
    status, body = search(server, token, "other")
    assert status == 403 and body["message"] == (
        'The provided tenant token cannot acces the index `other`, allowed indexes are '
        '["movies"].')
    token, _ = mint_with_cli(recorder, parent, {"movies": {"filter": "a = 1"}, "b*": None})
    assert search(server, token)[0] == 501 and search(server, token, "books")[0] == 501
    # refused on a non-search route (MK §9)
    status, body = api(server, "GET", "/indexes/movies/documents", key=token)
    assert status == 403 and body["message"] == "The provided API key is invalid."


def test_token_with_expiry(server, recorder, parent):
    token, claims = mint_with_cli(recorder, parent, ["*"], "--expires-at", "2050-01-01T00:00:00Z")
    assert claims["exp"] == calendar.timegm((2050, 1, 1, 0, 0, 0)) == 2524608000
    assert search(server, token)[0] == 501
    exp = int(time.time()) + 3
    token, claims = mint_with_cli(recorder, parent, ["*"], "--expires-at", iso(exp))
    assert claims["exp"] == exp
    status = search(server, token)[0]
    if time.time() < exp - 0.2:  # only meaningful if the machine was not too slow
        assert status == 501
    while time.time() <= exp + 1.05:
        time.sleep(0.1)
    status, body = search(server, token)
    assert status == 403 and body["code"] == "invalid_api_key"
    assert body["message"].startswith("Tenant token expired. Was valid up to `%d`" % exp), body


def test_tampered_token_refused(server, recorder, parent):
    token, claims = mint_with_cli(recorder, parent, ["movies"])
    head, payload, sig = token.split(".")
    forged = b64url(json.dumps({"searchRules": ["*"], "apiKeyUid": parent["uid"]}).encode())
    for bad in (head + "." + forged + "." + sig, head + "." + payload + "." + sig[:-4] + "AAAA"):
        status, body = search(server, bad)
        assert status == 403 and body == {
            "message": "Could not decode tenant token, InvalidSignature.",
            "code": "invalid_api_key", "type": "auth",
            "link": "https://docs.meilisearch.com/errors#invalid_api_key"}
    other = dict(parent, key="f" * 64)
    token, _ = mint_with_cli(recorder, other, ["movies"])
    assert search(server, token)[1]["message"] == "Could not decode tenant token, InvalidSignature."


def test_a_redirect_is_not_followed_with_the_key():
    """urllib re-sent Authorization to wherever a redirect pointed (another host, https to
    http): the client stops at the redirect with one sentence, and the key goes nowhere."""
    elsewhere, seen = Recorder(), []

    class Redirecting(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(302)
            self.send_header("Location", elsewhere.url + "/keys")
            self.send_header("Content-Length", "0")
            self.end_headers()

    redirecting = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
    threading.Thread(target=redirecting.serve_forever, daemon=True).start()
    try:
        done = subprocess.run(python_cmd(SEARCHKEYS, "keys", "list", "--url", "http://127.0.0.1:%d"
                                         % redirecting.server_address[1], "--key", MASTER),
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 1 and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "redirect" in done.stderr and elsewhere.url in done.stderr
        assert seen == ["Bearer " + MASTER] and elsewhere.hits == []
    finally:
        elsewhere.close()
        redirecting.shutdown()
        redirecting.server_close()
