"""Issue 34 item 2, revocable tenant tokens: `POST /keys/{key}/revoke-tokens` ends every token
the key signed before a time (`iat`; a token without one counts as revoked), `POST
/keys/{key}/revoke-token` denies one token until its `exp`; both kept in the store (restart,
kill -9, a second process sharing the file) and in the client CLI (`keys revoke-tokens`, `keys
revoke-token`), whose `token` command signs `iat`. Black-box: `searchkeys.py serve` on a free
loopback port in front of a stand-in backend, real HTTP, the store file on disk."""
import base64
import hashlib
import hmac
import json
import signal
import subprocess
import sys
import time

import pytest

from support import SEARCHKEYS, Daemon, free_port, python_cmd
from test_searchkeys_restrictions import backend  # noqa: F401 (the stand-in backend fixture)

MASTER = "revocation-test-master-key-0123"
ADMIN = {"Authorization": "Bearer " + MASTER, "Content-Type": "application/json"}


def serve(backend, store=None):
    port = free_port()
    return Daemon(python_cmd(SEARCHKEYS, "serve", "--port", port, "--master-key", MASTER,
                             "--upstream", backend.url,
                             *(["--store", str(store)] if store else [])), port, timeout=30.0)


@pytest.fixture(scope="module")
def guard(backend):
    with serve(backend) as daemon:
        yield daemon


def api(daemon, method, path, body=None, key=MASTER):
    headers = dict(ADMIN, Authorization="Bearer " + key)
    status, _, data = daemon.request(method, path, None if body is None else json.dumps(body),
                                     headers)
    return status, (json.loads(data) if data else None)


def new_key(daemon, actions=("search",)):
    status, key = api(daemon, "POST", "/keys", {"actions": list(actions), "indexes": ["*"],
                                                "expiresAt": None})
    assert status == 201, key
    return key


def token(key, **claims):
    """A tenant token of `key`, signed here as any JWT library would (claims as given)."""
    def b64(data):
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
    signing = b64(b'{"alg":"HS256","typ":"JWT"}') + "." + b64(json.dumps(
        dict({"searchRules": ["*"], "apiKeyUid": key["uid"]}, **claims)).encode())
    return signing + "." + b64(hmac.new(key["key"].encode(), signing.encode(),
                                        hashlib.sha256).digest())


def search(daemon, credential):
    status, _, data = daemon.request("POST", "/indexes/movies/search", '{"q": "x"}', {
        "Authorization": "Bearer " + credential, "Content-Type": "application/json"})
    return status, json.loads(data)


def works(daemon, credential):
    status, answer = search(daemon, credential)
    assert status in (200, 403), answer
    return status == 200


def stamp(seconds):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def cli(daemon, *args, stdin=None):
    return subprocess.run([sys.executable, str(SEARCHKEYS), *args, "--url",
                           "http://127.0.0.1:%d" % daemon.port, "--key", MASTER],
                          capture_output=True, text=True, timeout=30, input=stdin)


# ---------------------------------------------------------------------------------------------
# revoke-tokens: by the time a token was issued
# ---------------------------------------------------------------------------------------------

def test_tokens_issued_before_the_time_stop_working_later_ones_keep_working(guard):
    key = new_key(guard)
    now = int(time.time())
    old, new = token(key, iat=now - 3600), token(key, iat=now - 60, exp=now + 3600)
    assert works(guard, old) and works(guard, new)
    status, answer = api(guard, "POST", "/keys/%s/revoke-tokens" % key["uid"],
                         {"issuedBefore": stamp(now - 600)})
    assert status == 200 and answer == {"uid": key["uid"], "issuedBefore": stamp(now - 600),
                                        "revokedTokens": 0}, answer
    status, error = search(guard, old)
    assert status == 403 and error["code"] == "invalid_api_key" and "revoked" in error["message"]
    assert works(guard, new) and works(guard, key["key"])  # the key itself is untouched
    # a revocation for an earlier time does not bring the old tokens back
    api(guard, "POST", "/keys/%s/revoke-tokens" % key["uid"], {"issuedBefore": stamp(now - 7200)})
    assert not works(guard, old) and works(guard, new)


def test_without_a_time_every_token_so_far_is_revoked_and_a_token_without_iat_too(guard):
    key = new_key(guard)
    without_iat, with_iat = token(key), token(key, iat=int(time.time()))
    assert works(guard, without_iat) and works(guard, with_iat)
    status, _, answer = guard.request("POST", "/keys/%s/revoke-tokens" % key["key"], None,
                                      {"Authorization": "Bearer " + MASTER})  # no body: now
    assert status == 200, answer
    assert not works(guard, without_iat) and not works(guard, with_iat)
    time.sleep(1.1)  # iat is whole seconds: a token of the next second works
    assert works(guard, token(key, iat=int(time.time())))
    assert not works(guard, token(key))  # without iat: counts as issued before


def test_a_token_claiming_to_be_issued_in_the_future_is_revoked_too(guard):
    key = new_key(guard)
    now = int(time.time())
    ahead, skewed = token(key, iat=now + 10 * 365 * 86400), token(key, iat=now + 30)
    assert works(guard, ahead) and works(guard, skewed)
    assert api(guard, "POST", "/keys/%s/revoke-tokens" % key["uid"],
               {"issuedBefore": stamp(now - 3600)})[0] == 200
    assert not works(guard, ahead)  # an iat past the leeway counts as none
    assert works(guard, skewed)     # a signer's clock a little ahead is fine


@pytest.mark.parametrize("body, code", [
    ({"issuedBefore": "yesterday"}, "invalid_revocation_issued_before"),
    ({"issuedBefore": stamp(time.time() + 86400)}, "invalid_revocation_issued_before"),
    ({"issuedBefore": 12}, "invalid_revocation_issued_before"),
    ({"before": None}, "bad_request"),
    ([], "bad_request"),
])
def test_revoke_tokens_validation(guard, body, code):
    key = new_key(guard)
    status, error = api(guard, "POST", "/keys/%s/revoke-tokens" % key["uid"], body)
    assert status == 400 and error["code"] == code, error
    assert works(guard, token(key))  # nothing was revoked


def test_revoking_needs_keys_update_and_a_known_key(guard):
    key = new_key(guard)
    reader = new_key(guard, ("keys.get",))
    updater = new_key(guard, ("keys.update",))
    assert api(guard, "POST", "/keys/%s/revoke-tokens" % key["uid"], {}, key=reader["key"])[0] \
        == 403
    assert api(guard, "POST", "/keys/%s/revoke-token" % key["uid"], {"token": token(key)},
               key=key["key"])[0] == 403
    assert works(guard, token(key))
    assert api(guard, "POST", "/keys/%s/revoke-tokens" % key["uid"], {},
               key=updater["key"])[0] == 200
    assert not works(guard, token(key))
    status, error = api(guard, "POST", "/keys/0b0b6b57-5ae4-4c49-9d0b-7cb87e4e3f11/revoke-tokens",
                        {})
    assert status == 404 and error["code"] == "api_key_not_found", error


# ---------------------------------------------------------------------------------------------
# revoke-token: one token, until its exp
# ---------------------------------------------------------------------------------------------

def test_one_token_is_denied_the_others_keep_working(guard):
    key = new_key(guard)
    exp = int(time.time()) + 3600
    leaked, other = token(key, exp=exp, iat=1), token(key, exp=exp, iat=2)
    status, answer = api(guard, "POST", "/keys/%s/revoke-token" % key["uid"], {"token": leaked})
    assert status == 200 and answer == {"uid": key["uid"], "issuedBefore": None,
                                        "revokedTokens": 1}, answer
    status, error = search(guard, leaked)
    assert status == 403 and error == {
        "message": "This tenant token was revoked.", "code": "invalid_api_key",
        "type": "auth", "link": "https://docs.meilisearch.com/errors#invalid_api_key"}
    assert works(guard, other) and works(guard, key["key"])


def test_a_token_without_exp_cannot_be_revoked_singly(guard):
    key = new_key(guard)
    forever = token(key)
    status, error = api(guard, "POST", "/keys/%s/revoke-token" % key["uid"], {"token": forever})
    assert status == 400 and error["code"] == "invalid_revocation_token", error
    assert "has no `exp`" in error["message"] and "revoke-tokens" in error["message"]
    assert works(guard, forever)


def test_revoke_token_accepts_only_a_working_token_of_that_key(guard):
    key, other = new_key(guard), new_key(guard)
    exp = int(time.time()) + 3600
    cases = [
        {"token": "not-a-token"},
        {"token": token(other, exp=exp)},                   # verifies with another key only
        {"token": token(dict(key, uid=other["uid"]), exp=exp)},  # names another key
        {"token": token(key, exp=int(time.time()) - 10)},   # expired already
        {"token": 5},
    ]
    for body in cases:
        status, error = api(guard, "POST", "/keys/%s/revoke-token" % key["uid"], body)
        assert status == 400 and error["code"] == "invalid_revocation_token", (body, error)
    status, error = api(guard, "POST", "/keys/%s/revoke-token" % key["uid"], {"tokens": "x"})
    assert status == 400 and error["code"] == "bad_request", error
    assert works(guard, token(other, exp=exp))


def test_singly_revoked_tokens_are_pruned_once_expired(backend, tmp_path):
    store = tmp_path / "keys.json"
    with serve(backend, store) as daemon:
        key = new_key(daemon)
        soon = token(key, exp=int(time.time()) + 1)
        assert api(daemon, "POST", "/keys/%s/revoke-token" % key["uid"], {"token": soon})[0] == 200
        assert "tokenRevocation" in store.read_text()
        time.sleep(2.1)
        later = token(key, exp=int(time.time()) + 3600)
        status, answer = api(daemon, "POST", "/keys/%s/revoke-token" % key["uid"],
                             {"token": later})
        assert status == 200 and answer["revokedTokens"] == 1, answer  # the expired one left
        record = [k for k in json.loads(store.read_text())["keys"] if k["uid"] == key["uid"]][0]
        assert list(record["tokenRevocation"]["denied"]) == [
            hashlib.sha256(later.encode()).hexdigest()]  # a digest, never the token
        assert later not in store.read_text()


# ---------------------------------------------------------------------------------------------
# Kept in the store: restart, kill -9, another process on the same file
# ---------------------------------------------------------------------------------------------

def test_revocations_survive_kill_9_and_reach_another_process(backend, tmp_path):
    store = tmp_path / "keys.json"
    with serve(backend, store) as first, serve(backend, store) as second:
        key = new_key(first)
        exp = int(time.time()) + 3600
        early, leaked = token(key, iat=100), token(key, exp=exp, iat=int(time.time()))
        deadline = time.monotonic() + 15
        while not works(second, early):  # the other process knows the key
            assert time.monotonic() < deadline, "the other process never saw the key"
            time.sleep(0.1)
        assert api(first, "POST", "/keys/%s/revoke-tokens" % key["uid"],
                   {"issuedBefore": stamp(1000)})[0] == 200
        assert api(first, "POST", "/keys/%s/revoke-token" % key["uid"], {"token": leaked})[0] \
            == 200
        fresh = token(key, exp=exp + 1, iat=int(time.time()))  # not the same token
        deadline = time.monotonic() + 15
        while works(second, early) or works(second, leaked):  # taken in within a poll
            assert time.monotonic() < deadline, "the other process never saw the revocation"
            time.sleep(0.1)
        assert works(second, fresh)
        first.stop(signal.SIGKILL)
    with serve(backend, store) as again:
        assert not works(again, early) and not works(again, leaked) and works(again, fresh)


# ---------------------------------------------------------------------------------------------
# The client CLI
# ---------------------------------------------------------------------------------------------

def test_cli_signs_iat_and_revokes_tokens(guard):
    key = new_key(guard)
    signed = subprocess.run([sys.executable, str(SEARCHKEYS), "token", "--api-key", key["key"],
                             "--uid", key["uid"], "--rules", '["*"]', "--expires-at",
                             stamp(time.time() + 3600)], capture_output=True, text=True,
                            timeout=30)
    assert signed.returncode == 0, signed.stderr
    minted = signed.stdout.strip()
    payload = minted.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    assert abs(claims["iat"] - time.time()) < 60, claims
    assert works(guard, minted)

    done = cli(guard, "keys", "revoke-token", key["uid"], minted)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["revokedTokens"] == 1 and not works(guard, minted)

    other = token(key, iat=int(time.time()) - 100)
    done = cli(guard, "keys", "revoke-tokens", key["uid"], "--before",
               stamp(time.time() - 10))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["issuedBefore"].endswith("Z"), done.stdout
    assert not works(guard, other)

    bad = cli(guard, "keys", "revoke-tokens", key["uid"], "--before", "soon")
    assert bad.returncode == 2 and "--before" in bad.stderr and "Traceback" not in bad.stderr
    refused = cli(guard, "keys", "revoke-token", key["uid"], token(key))
    assert refused.returncode != 0 and "has no `exp`" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr


def test_cli_reads_the_token_to_revoke_from_stdin(guard):
    """`-` keeps the token off the command line (ps, the shell's history)."""
    key = new_key(guard)
    leaked = token(key, exp=int(time.time()) + 3600)
    assert works(guard, leaked)
    done = cli(guard, "keys", "revoke-token", key["uid"], "-", stdin=leaked + "\n")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["revokedTokens"] == 1 and not works(guard, leaked)
    empty = cli(guard, "keys", "revoke-token", key["uid"], "-", stdin="\n")
    assert empty.returncode == 2 and "standard input holds no token" in empty.stderr
    assert "Traceback" not in empty.stderr
    help_text = subprocess.run([sys.executable, str(SEARCHKEYS), "keys", "revoke-token", "-h"],
                               capture_output=True, text=True, timeout=30).stdout
    assert "from standard input" in " ".join(help_text.split())
