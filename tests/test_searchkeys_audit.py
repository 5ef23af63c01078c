"""Issue 34 item 5, an audit trail and restore: every change to a key is appended to
FILE.history (JSON lines, 0600, never through a planted link, no key value or token in it),
shown by `GET /keys/history` and `keys history`; a deleted key is kept as a tombstone for
`--tombstone-days` (in the store: restarts and every process see it), listed by `GET
/keys/deleted` and brought back, same uid, value and restrictions, by `POST
/keys/{uid}/restore` (master key only). Black-box: `searchkeys.py serve` on a free loopback
port, real HTTP, the store and its history on disk; the client CLI as a subprocess."""
import json
import os
import stat
import subprocess
import time

import pytest

import searchkeys as sk
from support import SEARCHKEYS, Daemon, free_port, python_cmd, request
from test_searchkeys_processes import WITHIN, call, children, within, works
from test_searchkeys_revocation import token
from test_searchkeys_startup import MASTER, clean_env, start

KEYS_ADMIN = ["keys.get", "keys.create", "keys.update", "keys.delete"]


def create(port, key=MASTER, actions=("search",), **fields):
    status, made = call(port, "POST", "/keys", dict(
        {"actions": list(actions), "indexes": ["*"], "expiresAt": None}, **fields), key)
    assert status == 201, made
    return made


def history_lines(store):
    return [json.loads(line) for line in (store.parent / (store.name + ".history"))
            .read_text().splitlines()]


def deleted(port, key=MASTER):
    status, answer = call(port, "GET", "/keys/deleted", key=key)
    assert status == 200, answer
    return answer


@pytest.fixture
def server(tmp_path):
    store = tmp_path / "keys.json"
    with start(free_port(), "--master-key", MASTER, "--store", str(store)) as daemon:
        daemon.store = store
        yield daemon


# ---------------------------------------------------------------------------------------------
# The history
# ---------------------------------------------------------------------------------------------

def test_each_change_appends_one_line_with_who_made_it_and_no_secret(server):
    port, store = server.port, server.store
    before = len(history_lines(store))  # the four default keys, created by searchkeys itself
    assert before == 4 and {line["by"] for line in history_lines(store)} == {"local"}
    admin = create(port, actions=KEYS_ADMIN, name="ops")
    made = create(port, admin["key"], name="site", expiresAt="2099-01-01T00:00:00Z")
    uid = made["uid"]
    assert call(port, "PATCH", "/keys/" + uid, {"name": "site 2"}, admin["key"])[0] == 200
    signed = token(made, exp=int(time.time()) + 3600, iat=int(time.time()))
    assert call(port, "POST", "/keys/%s/revoke-token" % uid, {"token": signed},
                admin["key"])[0] == 200
    assert call(port, "POST", "/keys/%s/revoke-tokens" % uid, {}, admin["key"])[0] == 200
    status, successor = call(port, "POST", "/keys/%s/rotate" % uid, {"grace": "1h"},
                             admin["key"])
    assert status == 201, successor
    assert call(port, "PUT", "/keys/%s/restrictions" % successor["uid"],
                {"maxHitsPerQuery": 7, "allowedIps": ["10.0.0.0/8"]})[0] == 200
    assert call(port, "DELETE", "/keys/%s/restrictions" % successor["uid"])[0] == 204
    assert call(port, "DELETE", "/keys/" + successor["uid"])[0] == 204
    assert call(port, "POST", "/keys/%s/restore" % successor["uid"])[0] == 201

    lines = history_lines(store)[before:]
    assert [(line["change"], line["uid"], line["by"]) for line in lines] == [
        ("create", admin["uid"], "master"),
        ("create", uid, admin["uid"]),
        ("update", uid, admin["uid"]),
        ("revoke-token", uid, admin["uid"]),
        ("revoke-tokens", uid, admin["uid"]),
        ("rotate", uid, admin["uid"]),
        ("restrict", successor["uid"], "master"),
        ("restrict", successor["uid"], "master"),
        ("delete", successor["uid"], "master"),
        ("restore", successor["uid"], "master"),
    ]
    assert lines[1]["fields"] == {"name": "site", "description": None, "actions": ["search"],
                                  "indexes": ["*"], "expiresAt": "2099-01-01T00:00:00Z"}
    assert lines[2]["fields"] == {"name": "site 2"} and lines[2]["name"] == "site 2"
    assert lines[3]["fields"] == {"revokedTokens": 1}
    assert lines[5]["fields"]["replacedBy"] == successor["uid"]
    assert lines[6]["fields"] == {"restrictions": {"maxHitsPerQuery": 7,
                                                   "allowedIps": ["10.0.0.0/8"]}}
    assert lines[7]["fields"] == {"restrictions": None}
    assert all(set(line) == {"at", "change", "uid", "name", "by", "fields"} for line in lines)
    text = (store.parent / "keys.json.history").read_text()
    for secret in (MASTER, admin["key"], made["key"], successor["key"], signed,
                   signed.rsplit(".", 1)[1]):
        assert secret not in text


def test_get_keys_history_pages_newest_first_filters_by_key_and_is_checked(server):
    port = server.port
    first = create(port, name="first")
    second = create(port, name="second")
    assert call(port, "PATCH", "/keys/" + first["uid"], {"description": "d"})[0] == 200
    status, page = call(port, "GET", "/keys/history?limit=2")
    assert status == 200, page
    assert page["offset"] == 0 and page["limit"] == 2 and page["total"] == 4 + 3
    assert [(e["change"], e["uid"]) for e in page["results"]] == [
        ("update", first["uid"]), ("create", second["uid"])]
    status, page = call(port, "GET", "/keys/history?key=%s&offset=1" % first["uid"])
    assert status == 200 and page["total"] == 2, page
    assert [e["change"] for e in page["results"]] == ["create"]
    # a rotation is in the history of the key it made too
    status, successor = call(port, "POST", "/keys/%s/rotate" % first["uid"], {"grace": 0})
    assert status == 201
    status, page = call(port, "GET", "/keys/history?key=" + successor["uid"])
    assert [e["change"] for e in page["results"]] == ["rotate"], page
    # the check of GET /keys: keys.get (or the master key)
    reader = create(port, actions=["keys.get"])
    assert call(port, "GET", "/keys/history", key=reader["key"])[0] == 200
    searcher = create(port, actions=["search"])
    assert call(port, "GET", "/keys/history", key=searcher["key"])[0] == 403
    assert call(port, "GET", "/keys/history", key="nope" * 16)[0] == 403
    assert request(port, "GET", "/keys/history")[0] == 401
    status, error = call(port, "GET", "/keys/history?key=not-a-uid")
    assert status == 400 and error["code"] == "invalid_api_key_uid", error
    status, error = call(port, "GET", "/keys/history?limit=x")
    assert status == 400 and error["code"] == "invalid_api_key_limit", error


def test_restrictions_in_the_history_are_the_master_keys_to_read(server):
    """`GET /keys/{key}/restrictions` is the master key's alone: a key granting keys.get
    must not read them (allowed addresses, forced filters) in the history either."""
    port = server.port
    reader = create(port, actions=["keys.get"])
    fenced = create(port, name="fenced")
    restrictions = {"allowedIps": ["10.9.8.0/24"],
                    "forcedParameters": {"movies": {"filter": "tenant = acme-secret"}}}
    assert call(port, "PUT", "/keys/%s/restrictions" % fenced["uid"], restrictions)[0] == 200
    assert call(port, "GET", "/keys/%s/restrictions" % fenced["uid"], key=reader["key"])[0] == 403
    for query in ("?key=" + fenced["uid"], ""):
        status, _, data = request(port, "GET", "/keys/history" + query, headers={
            "Authorization": "Bearer " + reader["key"]})
        assert status == 200 and b"10.9.8.0" not in data and b"acme-secret" not in data, data
        restrict = [e for e in json.loads(data)["results"] if e["change"] == "restrict"]
        assert restrict == [dict(restrict[0], fields={"restrictions": None},
                                 valuesLeftOut=True)], restrict
    status, page = call(port, "GET", "/keys/history?key=" + fenced["uid"])
    assert page["results"][0]["fields"] == {"restrictions": restrictions}, page
    assert "valuesLeftOut" not in page["results"][0]


def test_without_a_store_the_history_is_kept_in_memory():
    with start(free_port(), "--master-key", MASTER) as daemon:
        made = create(daemon.port, name="in memory")
        assert call(daemon.port, "DELETE", "/keys/" + made["uid"])[0] == 204
        status, page = call(daemon.port, "GET", "/keys/history?key=" + made["uid"])
        assert status == 200 and [e["change"] for e in page["results"]] == ["delete", "create"]
        assert deleted(daemon.port)["results"][0]["uid"] == made["uid"]


def test_the_history_is_0600_and_a_planted_link_is_not_followed(tmp_path):
    store = tmp_path / "keys.json"
    old = os.umask(0o022)
    try:
        with start(free_port(), "--master-key", MASTER, "--store", str(store)) as daemon:
            create(daemon.port)
    finally:
        os.umask(old)
    history = tmp_path / "keys.json.history"
    assert stat.S_IMODE(history.stat().st_mode) == 0o600
    history.unlink()
    victim = tmp_path / "victim"
    victim.write_text("someone else's\n")
    victim.chmod(0o644)
    history.symlink_to(victim)
    with start(free_port(), "--master-key", MASTER, "--store", str(store)) as daemon:
        made = create(daemon.port, name="kept")  # the change is made: it is what counts
        assert works(daemon.port, create(daemon.port, actions=["keys.get"])["key"])
        status, _, metrics = request(daemon.port, "GET", "/metrics",
                                     headers={"Authorization": "Bearer " + MASTER})
        assert "searchkeys_history_write_failures_total 2" in metrics.decode()
        log = daemon.log()
    assert "symbolic link" in log and made["uid"] in log, log
    assert victim.read_text() == "someone else's\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert made["uid"] in [record["uid"] for record in json.loads(store.read_text())["keys"]]


def test_a_line_too_long_keeps_its_field_names_and_the_file_is_capped(tmp_path, monkeypatch):
    """Library level (KeyStore): a line is one write of at most 4 KiB; past the cap the file
    becomes FILE.history.1 and the history reads both, newest first."""
    monkeypatch.setattr(sk, "MAX_HISTORY_BYTES", 4000)
    store = sk.KeyStore(MASTER, str(tmp_path / "keys.json"))
    key = store.create({"actions": ["search"], "indexes": ["*"], "expiresAt": None,
                        "name": "n" * 10000}, "master")
    lines = (tmp_path / "keys.json.history").read_bytes().splitlines()
    assert len(lines[-1]) <= 4096
    assert json.loads(lines[-1])["valuesLeftOut"] is True
    assert set(json.loads(lines[-1])["fields"]) == {"name", "description", "actions", "indexes",
                                                   "expiresAt"}
    for number in range(40):
        store.update(key.uid, {"description": "change %d" % number}, "master")
    sizes = [os.path.getsize(tmp_path / name) for name in ("keys.json.history",
                                                           "keys.json.history.1")]
    assert all(size <= 4000 + 4096 for size in sizes), sizes
    entries = store.history.entries(key.uid)
    assert entries[0]["fields"] == {"description": "change 39"}  # the name cut, the values kept
    assert entries[0]["name"] == "n" * 256 + "..." and "valuesLeftOut" not in entries[0]
    numbers = [int(e["fields"]["description"].split()[1]) for e in entries
               if e["change"] == "update"]
    assert numbers == sorted(numbers, reverse=True) and len(set(numbers)) == len(numbers)
    store.close()


# ---------------------------------------------------------------------------------------------
# Tombstones and restore
# ---------------------------------------------------------------------------------------------

def test_a_deleted_key_is_listed_then_restored_with_its_value_and_restrictions(server):
    port = server.port
    fenced = create(port, actions=["keys.get", "search"], name="fenced")
    assert call(port, "PUT", "/keys/%s/restrictions" % fenced["uid"],
                {"allowedIps": ["10.0.0.0/8"]})[0] == 200
    plain = create(port, actions=["keys.get", "search"], name="plain")
    signed = token(plain, exp=int(time.time()) + 3600)
    search = {"Authorization": "Bearer " + signed, "Content-Type": "application/json"}
    assert request(port, "POST", "/indexes/blog/search", "{}", search)[0] == 501  # allowed
    status, refusal = call(port, "GET", "/keys", key=fenced["key"])
    assert status == 403 and refusal["code"] == "forbidden_by_restriction", refusal

    for key in (fenced, plain):
        assert call(port, "DELETE", "/keys/" + key["uid"])[0] == 204
    # a tombstone authenticates nothing: the key, nor its tenant tokens
    status, refusal = call(port, "GET", "/keys", key=plain["key"])
    assert status == 403 and refusal["code"] == "invalid_api_key", refusal
    assert request(port, "POST", "/indexes/blog/search", "{}", search)[0] == 403
    assert call(port, "GET", "/keys/" + plain["uid"])[0] == 404
    assert len(json.loads(server.store.read_text())["deleted"]) == 2
    assert plain["key"] not in server.store.read_text()  # kept as the store keeps keys
    listed = deleted(port)
    assert listed["total"] == 2 and [k["uid"] for k in listed["results"]] == [
        plain["uid"], fenced["uid"]]
    shown = listed["results"][0]
    assert {f: shown[f] for f in plain} == plain  # GET /keys' fields, the value included
    assert shown["deletedBy"] == "master" and shown["deletedAt"].endswith("Z")

    for key in (fenced, plain):
        status, restored = call(port, "POST", "/keys/%s/restore" % key["uid"])
        assert status == 201 and restored == key, restored
    assert works(port, plain["key"])
    assert request(port, "POST", "/indexes/blog/search", "{}", search)[0] == 501
    status, refusal = call(port, "GET", "/keys", key=fenced["key"])
    assert status == 403 and refusal["code"] == "forbidden_by_restriction", refusal
    status, restrictions = call(port, "GET", "/keys/%s/restrictions" % fenced["uid"])
    assert restrictions["allowedIps"] == ["10.0.0.0/8"]
    assert deleted(port)["total"] == 0
    # in GET /keys at its place (by createdAt), as before
    status, keys = call(port, "GET", "/keys")
    assert [k["uid"] for k in keys["results"][:2]] == [plain["uid"], fenced["uid"]]


def test_restore_is_the_master_keys_alone_and_says_why_it_cannot(server):
    port = server.port
    admin = create(port, actions=["*"])
    key = create(port)
    assert call(port, "DELETE", "/keys/" + key["uid"])[0] == 204
    status, error = call(port, "POST", "/keys/%s/restore" % key["uid"], key=admin["key"])
    assert status == 403 and error["code"] == "invalid_api_key", error
    assert "Only the master key" in error["message"]
    status, error = call(port, "POST", "/keys/%s/restore" % admin["uid"])  # not deleted
    assert status == 404 and error["code"] == "api_key_not_found", error
    status, error = call(port, "POST", "/keys/not-a-uid/restore")
    assert status == 404 and error["code"] == "api_key_not_found", error
    # its uid taken again meanwhile (same uid, so same value): that key stays
    again = create(port, uid=key["uid"], name="again")
    status, error = call(port, "POST", "/keys/%s/restore" % key["uid"])
    assert status == 409 and error["code"] == "api_key_already_exists", error
    assert call(port, "GET", "/keys/" + key["uid"])[1]["name"] == "again" == again["name"]
    # expired while deleted
    brief = create(port, expiresAt=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                 time.gmtime(time.time() + 2)))
    assert call(port, "DELETE", "/keys/" + brief["uid"])[0] == 204
    time.sleep(2.5)
    status, error = call(port, "POST", "/keys/%s/restore" % brief["uid"])
    assert status == 409 and error["code"] == "api_key_expired", error


@pytest.mark.parametrize("grace", [0, 1])
def test_a_value_rotated_away_is_not_restored_from_an_earlier_deletion(server, grace):
    """A uid deleted, then created again (same uid, so same value), then rotated away (a
    leak): the earlier deletion's tombstone must not bring the value back."""
    port = server.port
    key = create(port, actions=["keys.get"])
    assert call(port, "DELETE", "/keys/" + key["uid"])[0] == 204
    create(port, actions=["keys.get"], uid=key["uid"])
    status, new = call(port, "POST", "/keys/%s/rotate" % key["uid"], {"grace": grace})
    assert status == 201, new
    if grace:
        assert works(port, key["key"])  # within its grace
        assert within(3.0, lambda: not works(port, key["key"]))[0]
    assert not works(port, key["key"])
    assert key["uid"] not in [k["uid"] for k in deleted(port)["results"]]
    status, error = call(port, "POST", "/keys/%s/restore" % key["uid"])
    assert status == 404 and error["code"] == "api_key_not_found", error
    assert not works(port, key["key"]) and works(port, new["key"])


def test_a_tombstone_survives_a_restart_and_every_process_sees_it(tmp_path):
    store = tmp_path / "keys.json"
    with start(free_port(), "--master-key", MASTER, "--store", str(store)) as a, \
            start(free_port(), "--master-key", MASTER, "--store", str(store)) as b:
        key = create(a.port, actions=["keys.get"])
        assert call(a.port, "DELETE", "/keys/" + key["uid"])[0] == 204
        assert within(WITHIN, lambda: deleted(b.port)["total"] == 1)[0]
        assert call(b.port, "POST", "/keys/%s/restore" % key["uid"])[0] == 201
        assert within(WITHIN, lambda: works(a.port, key["key"]))[0]
        assert call(b.port, "DELETE", "/keys/" + key["uid"])[0] == 204
    port = free_port()
    argv = python_cmd(SEARCHKEYS, "serve", "--host", "127.0.0.1", "--port", str(port),
                      "--master-key", MASTER, "--store", str(store), "--workers", "2")
    with Daemon(argv, port, env=clean_env(), timeout=20.0) as workers:
        assert within(10, lambda: len(children(workers.proc.pid)) == 2)[0], workers.log()
        # fresh connections, so both workers answer some
        assert all(deleted(port)["results"][0]["uid"] == key["uid"] for _ in range(20))
        assert call(port, "POST", "/keys/%s/restore" % key["uid"])[0] == 201
        assert within(WITHIN, lambda: all(works(port, key["key"]) for _ in range(20)))[0]


def test_tombstone_days_0_keeps_nothing(tmp_path):
    store = tmp_path / "keys.json"
    with start(free_port(), "--master-key", MASTER, "--store", str(store)) as daemon:
        kept = create(daemon.port)
        assert call(daemon.port, "DELETE", "/keys/" + kept["uid"])[0] == 204
    assert len(json.loads(store.read_text())["deleted"]) == 1
    with start(free_port(), "--master-key", MASTER, "--store", str(store),
               "--tombstone-days", "0") as daemon:
        assert deleted(daemon.port)["total"] == 0
        # purged by serve's keeper at start, no change needed (and no request)
        assert within(5, lambda: "deleted" not in json.loads(store.read_text()))[0]
        status, _ = call(daemon.port, "POST", "/keys/%s/restore" % kept["uid"])
        assert status == 404
        gone = create(daemon.port)
        assert call(daemon.port, "DELETE", "/keys/" + gone["uid"])[0] == 204
        assert deleted(daemon.port)["total"] == 0
    assert "deleted" not in json.loads(store.read_text())
    proc = subprocess.run(python_cmd(SEARCHKEYS, "serve", "--tombstone-days", "-1"),
                          capture_output=True, text=True, env=clean_env(MEILI_MASTER_KEY=MASTER))
    assert proc.returncode == 2 and "--tombstone-days" in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------------------------
# The client CLI
# ---------------------------------------------------------------------------------------------

def cli(port, *args):
    proc = subprocess.run(python_cmd(SEARCHKEYS, "keys", *args, "--url",
                                     "http://127.0.0.1:%d" % port),
                          capture_output=True, text=True, timeout=30,
                          env=clean_env(MEILI_MASTER_KEY=MASTER))
    return proc.returncode, proc.stdout, proc.stderr


def test_keys_history_deleted_and_restore_commands(server):
    port = server.port
    key = create(port, name="blog search")
    assert call(port, "DELETE", "/keys/" + key["uid"])[0] == 204
    code, out, err = cli(port, "deleted")
    assert code == 0 and json.loads(out)["results"][0]["uid"] == key["uid"], err
    code, out, err = cli(port, "restore", key["uid"])
    assert code == 0 and json.loads(out)["key"] == key["key"], err
    code, out, err = cli(port, "history", key["uid"])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["AT", "CHANGE", "UID", "NAME", "BY", "FIELDS"]
    assert [line.split()[1] for line in lines[1:4]] == ["restore", "delete", "create"]
    assert all(key["uid"] in line and "blog search" in line and "master" in line
               for line in lines[1:4])
    assert '"actions":["search"]' in lines[3] and lines[-1] == "(3 of 3 changes)"
    code, out, err = cli(port, "history", key["key"], "--limit", "1")  # by value, paged
    assert code == 0 and out.splitlines()[-1] == "(1 of 3 changes)", err
    code, out, err = cli(port, "history")
    assert code == 0 and out.count(" local ") == 4, out
    code, out, err = cli(port, "restore", "nope")
    assert code == 2 and "UID `nope` is not a UUID" in err
    code, out, err = cli(port, "restore", key["uid"])
    assert code == 1 and "api_key_not_found" in err
