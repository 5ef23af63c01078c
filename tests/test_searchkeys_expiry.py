"""Issue 34 item 4, expiry warnings: `keys list --expiring 7d` lists the keys that stop working
within that time, soonest first; /metrics has a gauge of the keys expiring within 7 days and a
counter of expired keys used (each counted once, at its first refused use); serve logs one line
a day per key within 7 days of its expiry. Black-box: `searchkeys.py serve` on a free loopback
port, real HTTP, its log, and the client CLI; one pure part (the once-a-day rule, which no test
can wait for)."""
import hashlib
import hmac
import json
import os
import subprocess
import sys
import time

import pytest

import searchkeys as sk
from support import SEARCHKEYS, Daemon, free_port, python_cmd

MASTER = "expiry-test-master-key-0123456789"
ADMIN = {"Authorization": "Bearer " + MASTER, "Content-Type": "application/json"}
EXPIRED_UIDS = ["0c7f3d0e-8a7e-4a5e-9d47-1b2c3d4e5f60", "1c7f3d0e-8a7e-4a5e-9d47-1b2c3d4e5f61"]
DAY = 86400
HANG = 15.0


def stamp(seconds):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def store_with_expired_keys(folder):
    """A store holding two keys that expired in 2000 (the API refuses a past expiresAt)."""
    records = [{"uid": uid, "name": "old", "description": None, "actions": ["search"],
                "indexes": ["*"], "expiresAt": "2000-01-01T00:00:00Z", "createdAt": 1 + n,
                "updatedAt": 1 + n} for n, uid in enumerate(EXPIRED_UIDS)]
    path = folder / "keys.json"
    path.write_text(json.dumps({"format": "searchkeys-store", "version": 1, "keys": records}))
    os.chmod(path, 0o600)
    return path


@pytest.fixture
def guard(tmp_path):
    port = free_port()
    with Daemon(python_cmd(SEARCHKEYS, "serve", "--port", port, "--master-key", MASTER,
                           "--store", store_with_expired_keys(tmp_path)), port,
                timeout=30.0) as daemon:
        yield daemon


def new_key(daemon, expires_at, name):
    status, _, data = daemon.request("POST", "/keys", json.dumps(
        {"name": name, "actions": ["search"], "indexes": ["*"], "expiresAt": expires_at}), ADMIN)
    assert status == 201, data
    return json.loads(data)


def cli(daemon, *args):
    return subprocess.run([sys.executable, str(SEARCHKEYS), "keys", "list", *args, "--url",
                           "http://127.0.0.1:%d" % daemon.port, "--key", MASTER],
                          capture_output=True, text=True, timeout=30)


def metric(daemon, name):
    status, _, data = daemon.request("GET", "/metrics", None, ADMIN)
    assert status == 200
    for line in data.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError("no %s in /metrics" % name)


def test_keys_list_expiring_shows_the_keys_that_stop_working_soon_soonest_first(guard):
    now = time.time()
    in_five = new_key(guard, stamp(now + 5 * DAY), "five days")
    in_two = new_key(guard, stamp(now + 2 * DAY), "two days")
    new_key(guard, stamp(now + 30 * DAY), "a month")
    new_key(guard, None, "never")
    done = cli(guard, "--expiring", "7d")
    assert done.returncode == 0, done.stderr
    listing = json.loads(done.stdout)
    assert [k["uid"] for k in listing["results"]] == [in_two["uid"], in_five["uid"]]
    assert listing["total"] == 2  # not the expired ones, nor later ones, nor the default keys
    quiet = cli(guard, "--expiring", "3d", "--quiet")
    assert quiet.stdout.split() == [in_two["key"]]
    bad = cli(guard, "--expiring", "soon")
    assert bad.returncode == 2 and "--expiring" in bad.stderr and "Traceback" not in bad.stderr


def test_metrics_count_keys_expiring_and_each_expired_key_at_its_first_use(guard):
    now = time.time()
    assert metric(guard, "searchkeys_keys_expiring") == 0
    new_key(guard, stamp(now + 6 * DAY), "soon")
    new_key(guard, stamp(now + 8 * DAY), "later")
    assert metric(guard, "searchkeys_keys_expiring") == 1
    assert metric(guard, "searchkeys_expired_keys_used_total") == 0
    first, second = (hmac.new(MASTER.encode(), uid.encode(), hashlib.sha256).hexdigest()
                     for uid in EXPIRED_UIDS)
    for value in (first, first, first, second):
        status, _, data = guard.request("POST", "/indexes/movies/search", '{"q": "x"}', {
            "Authorization": "Bearer " + value, "Content-Type": "application/json"})
        assert status == 403 and json.loads(data)["code"] == "invalid_api_key"
    assert metric(guard, "searchkeys_expired_keys_used_total") == 2


def test_serve_logs_a_key_within_seven_days_of_its_expiry(tmp_path):
    path = store_with_expired_keys(tmp_path)
    now = time.time()
    store = json.loads(path.read_text())
    store["keys"] += [
        {"uid": "2c7f3d0e-8a7e-4a5e-9d47-1b2c3d4e5f62", "name": "shop search",
         "description": None, "actions": ["search"], "indexes": ["*"],
         "expiresAt": stamp(now + 3 * DAY), "createdAt": 10, "updatedAt": 10},
        {"uid": "3c7f3d0e-8a7e-4a5e-9d47-1b2c3d4e5f63", "name": "far", "description": None,
         "actions": ["search"], "indexes": ["*"], "expiresAt": stamp(now + 20 * DAY),
         "createdAt": 11, "updatedAt": 11}]
    path.write_text(json.dumps(store))
    port = free_port()
    with Daemon(python_cmd(SEARCHKEYS, "serve", "--port", port, "--master-key", MASTER,
                           "--store", path), port, timeout=30.0) as daemon:
        deadline = time.monotonic() + HANG
        while "stops working" not in daemon.log():
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(0.1)
        time.sleep(1)  # the keeper's next polls log nothing more
        lines = [line for line in daemon.log().splitlines() if "stops working" in line]
    assert len(lines) == 1, lines
    assert "2c7f3d0e-8a7e-4a5e-9d47-1b2c3d4e5f62 (shop search)" in lines[0]
    assert "(in 3.0 days)" in lines[0] and "warning" in lines[0]


def test_a_key_is_logged_once_a_day():
    key = sk.ApiKey("2c7f3d0e-8a7e-4a5e-9d47-1b2c3d4e5f62", "k", None, ["search"], ["*"],
                    sk.Instant(10 * sk.DAY_NS), 1, 1, None)
    warnings, start = sk.ExpiryWarnings(), 5 * sk.DAY_NS
    assert len(warnings.lines([key], start)) == 1
    assert warnings.lines([key], start + sk.DAY_NS - 1) == []
    assert len(warnings.lines([key], start + sk.DAY_NS)) == 1
    assert warnings.lines([], start + 3 * sk.DAY_NS) == [] and \
        len(warnings.lines([key], start + 3 * sk.DAY_NS + 1)) == 1  # gone, then back
