"""Attack suite for searchkeys.py (issue 7): try to break it, black-box, over real HTTP.

What is attacked, and what must hold every time:
- kill -9 loop: 8 writer threads create, patch and delete keys while the server is killed at
  random moments; after each restart every acknowledged change is there, no unacknowledged
  change is half-applied (name and description of one PATCH land together or not at all), the
  default keys exist exactly once, and the store (one JSON document) parses;
- store faults: truncated, corrupted, unreadable (as an unprivileged user), a directory, a full
  disk (a small tmpfs, or RLIMIT_FSIZE making writes fail with EFBIG): the server refuses to
  start with a clear message or answers a clean JSON `internal` error for the failed write, the
  failed change is not visible, and the old data is never destroyed;
- fuzzed /keys bodies, headers, paths and query strings (seeded): never a 5xx (501
  `no_upstream` is the documented answer for an authorized non-/keys route), every error in
  upstream's JSON shape with the code's documented status and type; plus targeted inputs that
  broke JSON servers before (lone surrogates, huge integers, deep nesting, NaN);
- HTTP framing: duplicate Content-Lengths, Content-Length with chunked, broken chunk sizes, huge
  headers: a clean error, and never a request smuggled in a body; pipelined requests answered in
  order; same-uid creates and PATCH-against-DELETE races settle to exactly one winner;
- revocation: an expired or deleted key (or a tenant token signed with it) never authorizes a
  request sent after the expiry or after the delete was acknowledged, under concurrent deletes;
- secrets: no master key or key value in the logs, the store files or error messages; store
  files are 0600 even under umask 0.

Scenarios are plain functions taking counts and a seed, so bench/soak.py runs the same code
with the full counts. The seed comes from ATTACK_SEED (default fixed) and is printed in every
failure message.
"""
import base64
import hashlib
import hmac
import http.client
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import support

SEED = int(os.environ.get("ATTACK_SEED", "20261121"))
MASTER = "attack-master-key-5f0c1e9a7b3d"
ERROR_LINK = "https://docs.meilisearch.com/errors#"
DEFAULT_KEY_NAMES = ("Default Search API Key", "Default Admin API Key",
                     "Default Read-Only Admin API Key", "Default Chat API Key")
KEY_FIELDS = ["name", "description", "key", "uid", "actions", "indexes", "expiresAt", "createdAt",
              "updatedAt"]

# code -> (HTTP status, type), from meilisearch-keys.md section 2 (and searchkeys.md's no_upstream,
# the /authorize extension unknown_route, and api_key_not_for_browsers: an admin credential sent
# with a browser's Origin, Referer or Sec-Fetch-Mode).
ERROR_CODES = {
    "missing_authorization_header": (401, "auth"), "invalid_api_key": (403, "auth"),
    "missing_master_key": (401, "auth"), "unknown_route": (403, "auth"),
    "api_key_not_for_browsers": (403, "auth"),
    "api_key_not_found": (404, "invalid_request"), "api_key_already_exists": (409, "invalid_request"),
    "index_scoped_api_key_with_global_action": (400, "invalid_request"),
    "missing_api_key_actions": (400, "invalid_request"), "missing_api_key_indexes": (400, "invalid_request"),
    "missing_api_key_expires_at": (400, "invalid_request"),
    "invalid_api_key_description": (400, "invalid_request"), "invalid_api_key_name": (400, "invalid_request"),
    "invalid_api_key_uid": (400, "invalid_request"), "invalid_api_key_actions": (400, "invalid_request"),
    "invalid_api_key_indexes": (400, "invalid_request"), "invalid_api_key_expires_at": (400, "invalid_request"),
    "invalid_api_key_offset": (400, "invalid_request"), "invalid_api_key_limit": (400, "invalid_request"),
    "immutable_api_key_uid": (400, "invalid_request"), "immutable_api_key_actions": (400, "invalid_request"),
    "immutable_api_key_indexes": (400, "invalid_request"),
    "immutable_api_key_expires_at": (400, "invalid_request"),
    "immutable_api_key_created_at": (400, "invalid_request"),
    "immutable_api_key_updated_at": (400, "invalid_request"),
    "bad_request": (400, "invalid_request"), "invalid_content_type": (415, "invalid_request"),
    "missing_content_type": (415, "invalid_request"), "missing_payload": (400, "invalid_request"),
    "malformed_payload": (400, "invalid_request"), "payload_too_large": (413, "invalid_request"),
}


# ============================================================================
# Plumbing: a server process we can kill -9, rlimit or run unprivileged
# ============================================================================

class Server:
    """searchkeys.py serve, its output drained from a pipe (no file: RLIMIT_FSIZE-safe)."""

    def __init__(self, store, master=MASTER, preexec_fn=None, extra=(), wait=True, port=None, python=None,
                 script=support.SEARCHKEYS):
        self.port = port or support.free_port()
        argv = support.python_cmd(script, "serve", "--host", "127.0.0.1", "--port", str(self.port))
        if python is not None:
            argv[0] = python
        if master is not None:
            argv += ["--master-key", master]
        if store is not None:
            argv += ["--store", str(store)]
        argv += list(extra)
        env = dict(os.environ)
        env.pop("MEILI_MASTER_KEY", None)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=preexec_fn, env=env,
                                     start_new_session=True)
        self._output = []
        self._drain = threading.Thread(target=self._read_output, daemon=True)
        self._drain.start()
        if wait:
            try:
                support.wait_for_port(self.port, self.proc, 20)
            except Exception:
                self.kill()
                raise RuntimeError(f"searchkeys did not start:\n{self.log()}")

    def _read_output(self):
        for chunk in iter(lambda: self.proc.stdout.read1(65536), b""):
            self._output.append(chunk)

    def log(self):
        return b"".join(self._output).decode("utf-8", "replace")

    def exit_status(self, timeout=20):
        """The exit status of a server expected to refuse to start (None if it still runs)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._drain.join(5)
        return code

    def kill(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._drain.join(5)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._drain.join(5)

    def request(self, method, path, body=None, key=MASTER, headers=None, timeout=30):
        return call(self.port, method, path, body, key, headers, timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def call(port, method, path, body=None, key=MASTER, headers=None, timeout=30):
    """(status, headers, parsed JSON or raw bytes) of one request on a fresh connection."""
    all_headers = {}
    if key is not None:
        all_headers["Authorization"] = "Bearer " + key
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
        all_headers["Content-Type"] = "application/json"
    all_headers.update(headers or {})
    status, resp_headers, data = support.request(port, method, path, body, all_headers, timeout)
    if data and resp_headers.get("content-type", "").startswith("application/json"):
        try:
            return status, resp_headers, json.loads(data)
        except ValueError:
            pass
    return status, resp_headers, data


def raw_request(port, method, target, headers=(), body=b"", timeout=30):
    """Bytes-level request (any method, target or header bytes): (status, headers, body)."""
    head = method + b" " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    for name, value in headers:
        head += name + b": " + value + b"\r\n"
    if body:
        head += b"Content-Length: %d\r\n" % len(body)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(head + b"\r\n" + body)
        except (BrokenPipeError, ConnectionResetError):
            pass
        response = http.client.HTTPResponse(sock, method=method.decode("latin-1"))
        response.begin()
        data = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data


def key_value(uid, master=MASTER):
    return hmac.new(master.encode(), uid.encode(), hashlib.sha256).hexdigest()


def uid_of(thread, seq):
    """A canonical UUID that names its writer thread and sequence number."""
    return f"{thread:08x}-0000-4000-8000-{seq:012x}"


def all_keys(port, master=MASTER):
    status, _, body = call(port, "GET", "/keys?limit=1000000", key=master)
    assert status == 200, f"GET /keys: {status} {body!r}"
    return {k["uid"]: k for k in body["results"]}


def check_error(status, headers, body, context, allow_internal=False):
    """Upstream's error JSON: field order, code, type, link, status matching the code."""
    assert headers.get("content-type", "").startswith("application/json"), \
        f"{context}: error without JSON content type: {status} {headers} {body!r:.300}"
    assert isinstance(body, dict), f"{context}: error body is not a JSON object: {status} {body!r:.300}"
    assert list(body) == ["message", "code", "type", "link"], f"{context}: error fields {list(body)}"
    assert all(isinstance(v, str) for v in body.values()), f"{context}: non-string error field {body}"
    code = body["code"]
    assert body["link"] == ERROR_LINK + code, f"{context}: link {body['link']!r} for code {code!r}"
    if code == "internal":
        assert allow_internal and status == 500 and body["type"] == "internal", \
            f"{context}: unplanned internal error {status} {body}"
    elif code == "no_upstream":
        assert status == 501, f"{context}: no_upstream with status {status}"
    else:
        assert code in ERROR_CODES, f"{context}: unknown error code {code!r} ({status} {body['message']!r})"
        assert (status, body["type"]) == ERROR_CODES[code], \
            f"{context}: {code} answered {status}/{body['type']}, expected {ERROR_CODES[code]}"


def check_key_object(obj, context):
    assert isinstance(obj, dict) and list(obj) == KEY_FIELDS, f"{context}: key object fields {obj!r:.300}"
    assert obj["key"] == key_value(obj["uid"]), f"{context}: key value is not HMAC(master, uid)"


def read_store(store):
    """The store as searchkeys.py writes it: one JSON document (None before the first write)."""
    return json.loads(Path(store).read_bytes().decode("utf-8")) if Path(store).exists() else None


def store_files(store):
    folder = Path(store).parent
    return sorted(p for p in folder.iterdir() if p.name.startswith(Path(store).name))


def snapshot_bytes(store):
    return {p.name: p.read_bytes() for p in store_files(store)}


@pytest.fixture
def workdir():
    with support.scratch_dir("searchkeys-attack-") as path:
        yield path


# ============================================================================
# kill -9 loop
# ============================================================================

class Writer:
    """One writer thread's keys: the acknowledged model and the change in flight."""

    def __init__(self, number, seed):
        self.number = number
        self.rng = random.Random(seed * 1000 + number)
        self.seq = 0
        self.model = {}       # uid -> expected visible fields, or None when deleted
        self.pending = None   # (uid, state if applied) of a request without an answer
        self.acked = 0
        self.errors = []

    def state_of(self, key):
        return None if key is None else {f: key[f] for f in ("name", "description", "actions", "indexes",
                                                              "expiresAt")}

    def step(self, port):
        rng = self.rng
        live = [uid for uid, state in self.model.items() if state is not None]
        roll = rng.random()
        self.seq += 1
        tag = f"{self.number}-{self.seq}"
        if not live or roll < 0.4:
            uid = uid_of(self.number, self.seq)
            state = {"name": "c" + tag, "description": "c" + tag,
                     "actions": rng.choice([["search"], ["documents.get", "search"], ["indexes.*"], ["*"]]),
                     "indexes": rng.choice([["*"], ["movies"], ["mov*", "books"]]),
                     "expiresAt": rng.choice([None, "2099-01-01T00:00:00Z"])}
            method, path, body, ok = "POST", "/keys", dict(state, uid=uid), 201
        elif roll < 0.75:
            uid = rng.choice(live)
            state = dict(self.model[uid], name="p" + tag, description="p" + tag)
            method, path, body, ok = "PATCH", "/keys/" + uid, {"name": "p" + tag, "description": "p" + tag}, 200
        else:
            uid = rng.choice(live)
            state = None
            method, path, body, ok = "DELETE", "/keys/" + uid, None, 204
        self.pending = (uid, state)
        try:
            status, _, answer = call(port, method, path, body, timeout=20)
        except ConnectionRefusedError:
            self.pending = None          # never reached the server: certainly not applied
            raise
        self.pending = None
        if status != ok:
            self.errors.append(f"{method} {path}: {status} {answer!r:.200}")
            return
        if ok != 204 and self.state_of(answer) != state:
            self.errors.append(f"{method} {path}: answered {answer!r:.200}, expected {state}")
        self.model[uid] = state
        self.acked += 1


def verify_after_restart(port, writers, seed, round_no, stats):
    """Every acknowledged change present, in-flight ones all-or-nothing; counts items lost."""
    keys = all_keys(port)
    problems, lost = [], 0
    for writer in writers:
        pending_uid = writer.pending[0] if writer.pending else None
        for uid, expected in writer.model.items():
            actual = writer.state_of(keys.get(uid))
            allowed = [expected]
            if uid == pending_uid:
                allowed.append(writer.pending[1])
            if actual not in allowed:
                lost += 1
                problems.append(f"{uid}: {actual} not in {allowed}")
        if writer.pending and writer.pending[0] not in writer.model:   # a create in flight
            uid, state = writer.pending
            if writer.state_of(keys.get(uid)) not in (None, state):
                problems.append(f"{uid}: half-created {keys.get(uid)}")
        if writer.pending:   # adopt what the server decided for the change in flight
            uid = writer.pending[0]
            writer.model[uid] = writer.state_of(keys.get(uid))
            writer.pending = None
        mine = {uid for uid in keys if uid.startswith(f"{writer.number:08x}-0000-4000-8000-")}
        phantoms = mine - set(writer.model)
        problems += [f"{uid}: never created but present" for uid in sorted(phantoms)]
    for uid, key in keys.items():
        if key["key"] != key_value(uid):
            problems.append(f"{uid}: key value {key['key']} is not HMAC(master, uid)")
        if key["name"] and key["description"] and key["name"][1:] != key["description"][1:] \
                and key["name"][0] in "cp":
            problems.append(f"{uid}: half-applied change: name {key['name']} description {key['description']}")
    names = [k["name"] for k in keys.values()]
    for name in DEFAULT_KEY_NAMES:
        if names.count(name) != 1:
            problems.append(f"default key {name!r} present {names.count(name)} times")
    stats["lost"] += lost
    assert not problems, f"[seed {seed}] after kill {round_no}: {len(problems)} problems, e.g. {problems[:6]}"
    return keys


def run_kill_loop(workdir, kills, seed=SEED, threads=8, stats=None):
    """Writers hammer the store; the server is killed -9 `kills` times. Returns stats (also
    filled in place in `stats`, so a caller sees the counts of a run that failed)."""
    rng = random.Random(seed)
    store = workdir / "kill" / "store.json"
    store.parent.mkdir()
    writers = [Writer(n, seed) for n in range(threads)]
    stats = {} if stats is None else stats
    stats.update({"kills": 0, "kills_survived": 0, "requests": 0, "acknowledged": 0, "lost": 0})
    for round_no in range(kills + 1):
        if round_no < kills and rng.random() < 0.25:   # killed while loading (and compacting) the store
            early = Server(store, wait=False)
            time.sleep(rng.uniform(0, 0.4))
            early.kill()
            stats["kills"] += 1
            assert "Traceback" not in early.log(), f"[seed {seed}] traceback at start:\n{early.log()[-2000:]}"
            continue
        server = Server(store)
        try:
            keys = verify_after_restart(server.port, writers, seed, round_no, stats)
            stats["kills_survived"] = stats["kills"]
            stats["acknowledged"] = sum(w.acked for w in writers)
            live = [uid for uid, k in keys.items() if "search" in k["actions"] or "*" in k["actions"]]
            for uid in rng.sample(live, min(3, len(live))):
                status, _, body = call(server.port, "GET", "/indexes/movies/search", key=key_value(uid))
                assert status == 501, f"[seed {seed}] restored key {uid} answers {status} {body}"
            if round_no == kills:
                break
            stop = threading.Event()

            def work(writer):
                while not stop.is_set():
                    stats["requests"] += 1
                    try:
                        writer.step(server.port)
                    except (OSError, http.client.HTTPException):
                        return

            pool = [threading.Thread(target=work, args=(w,)) for w in writers]
            for t in pool:
                t.start()
            time.sleep(rng.uniform(0.05, 0.5))
            server.kill()
            stats["kills"] += 1
            stop.set()
            for t in pool:
                t.join(30)
            errors = [e for w in writers for e in w.errors]
            assert not errors, f"[seed {seed}] unexpected answers: {errors[:5]}"
            snapshot = read_store(store)   # the store must parse after every kill
            assert snapshot is None or snapshot.get("keys") is not None, f"[seed {seed}] store shape {snapshot!r:.200}"
        finally:
            server.kill()
            log = server.log()
            assert "Traceback" not in log, f"[seed {seed}] traceback in the log:\n{log[-2000:]}"
    stats["acknowledged"] = sum(w.acked for w in writers)
    stats["leftover_temp_files"] = len([p for p in store.parent.iterdir() if ".tmp" in p.name])
    for path in store.parent.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, f"{path.name} has mode {oct(path.stat().st_mode)}"
    return stats


def test_kill_9_loop_loses_nothing_acknowledged(workdir):
    stats = run_kill_loop(workdir, 10)
    assert stats["acknowledged"] > 0 and stats["lost"] == 0


# ============================================================================
# Store faults: truncated, corrupted, unreadable, full disk
# ============================================================================

def seeded_store(workdir, n_keys=6, name="store.json"):
    """A store with the default keys and n_keys of ours, as a stopped server left it;
    returns (path, every key by uid)."""
    store = workdir / name
    with Server(store) as server:
        for i in range(n_keys):
            status, _, body = server.request("POST", "/keys", {"uid": uid_of(0xfa, i), "name": f"k{i}",
                                                               "actions": ["search"], "indexes": ["*"],
                                                               "expiresAt": None})
            assert status == 201, body
        return store, all_keys(server.port)


def all_keys_of(store):
    with Server(store) as server:
        return all_keys(server.port)


def expect_refusal(store, context, preexec_fn=None, python=None, script=support.SEARCHKEYS):
    """The server must exit non-zero with a message naming the store, and touch nothing."""
    before = snapshot_bytes(store)
    server = Server(store, preexec_fn=preexec_fn, wait=False, python=python, script=script)
    code = server.exit_status(20)
    if code is None:
        server.kill()
        raise AssertionError(f"{context}: the server started on a bad store:\n{server.log()[-1000:]}")
    log = server.log()
    assert code != 0, f"{context}: exit status 0"
    assert "Traceback" not in log, f"{context}: traceback instead of a message:\n{log[-2000:]}"
    assert str(Path(store).name) in log, f"{context}: the message does not name the store: {log[-500:]!r}"
    assert snapshot_bytes(store) == before, f"{context}: the store files were changed"
    return log


def assert_keys_intact(store, expected, context, absent=()):
    keys = all_keys_of(store)
    for uid, key in expected.items():
        assert uid in keys, f"{context}: key {uid} lost"
        assert {f: keys[uid][f] for f in ("name", "description", "actions", "indexes", "expiresAt")} == \
            {f: key[f] for f in ("name", "description", "actions", "indexes", "expiresAt")}, \
            f"{context}: key {uid} changed: {keys[uid]} vs {key}"
    for uid in absent:
        assert uid not in keys, f"{context}: failed change {uid} is present after restart"


def run_corruption(workdir, seed=SEED, sample=None):
    """Truncations and corruptions of the store (and a development build's journal); returns
    faults injected.

    `sample`: run only that many (seeded) cases of each kind -- the test suite's time budget."""
    rng = random.Random(seed)
    store, keys = seeded_store(workdir)
    good = store.read_bytes()
    journal = Path(str(store) + ".journal")   # what development builds kept beside the store
    first_uid = json.loads(good)["keys"][0]["uid"].encode()
    faults = 0
    cuts = sorted({0, 1, 2, len(good) // 2, len(good) - 2, len(good) - 1} | {rng.randrange(len(good)) for _ in range(4)})
    pick = (lambda cases: cases) if sample is None else (lambda cases: rng.sample(cases, min(sample, len(cases))))
    for cut in pick(cuts):
        data = good[:cut]
        store.write_bytes(data)
        context = f"[seed {seed}] snapshot truncated to {cut} of {len(good)} bytes"
        try:
            json.loads(data.decode("utf-8"))
            parses = True
        except (UnicodeDecodeError, ValueError):
            parses = False
        if parses:   # only the final newline went: still the whole store
            assert_keys_intact(store, keys, context)
        else:
            expect_refusal(store, context)
        faults += 1
    mutations = [
        ("a structural byte replaced", lambda d: d.replace(b"[", b"x", 1)),
        ("invalid UTF-8", lambda d: d.replace(b'"Default ', b'"Default \xff', 1)),
        ("NUL bytes", lambda d: d[:20] + b"\x00" * 10 + d[30:]),
        ("a JSON array", lambda d: b"[]"),
        ("JSON null", lambda d: b"null"),
        ("wrong format version", lambda d: d.replace(b'"version": 1', b'"version": 99', 1)),
        ("keys not a list", lambda d: b'{"format": "searchkeys-store", "version": 1, "keys": {}}'),
        ("a key with a bad uid", lambda d: d.replace(first_uid, b"not-a-uid", 1)),
        ("actions not a list", lambda d: d.replace(b'"actions":["search"]', b'"actions":"search"', 1)),
        ("an unknown action", lambda d: d.replace(b'"actions":["search"]', b'"actions":["serch"]', 1)),
        ("a bad index pattern", lambda d: d.replace(b'"indexes":["*"]', b'"indexes":["*a*"]', 1)),
        ("createdAt negative", lambda d: d.replace(b'"createdAt":', b'"createdAt":-', 1)),
        ("random bytes", lambda d: bytes(rng.randrange(256) for _ in range(len(d)))),
    ]
    for name, mutate in pick(mutations):
        data = mutate(good)
        assert data != good, f"mutation {name!r} did not apply"
        store.write_bytes(data)
        expect_refusal(store, f"[seed {seed}] snapshot with {name}")
        faults += 1
    store.write_bytes(good)
    # A journal (kept beside the store by development builds only) is refused, whatever it
    # holds: the start stops in one sentence and leaves both files alone.
    assert not journal.exists()
    line = json.dumps({"op": "put", "key": {"uid": uid_of(0xfb, 1)}}).encode()
    for name, damage in pick([
        ("a torn last line", b'{"op": "put", "key": {"ui'),
        ("a broken line before a good one", b'{"op": "pu\n' + b'{"op": "delete", "uid": "x"}\n'),
        ("a put of a bad record", line + b"\n"),
        ("invalid UTF-8", b'{"op": "delete", "uid": "\xff"}\n'),
    ]):
        journal.write_bytes(damage)
        expect_refusal(store, f"[seed {seed}] journal with {name}")
        assert journal.read_bytes() == damage, f"[seed {seed}] journal with {name} was changed"
        faults += 1
        journal.unlink()
        store.write_bytes(good)
    # A directory where the store should be.
    other = workdir / "dir-store"
    other.mkdir()
    server = Server(other, wait=False)
    code = server.exit_status(20)
    if code is None:
        server.kill()
    assert code not in (None, 0) and "Traceback" not in server.log(), \
        f"[seed {seed}] store path is a directory: exit {code}\n{server.log()[-800:]}"
    faults += 1
    assert_keys_intact(store, keys, f"[seed {seed}] after all corruption cases")
    return faults


def test_corrupt_or_truncated_store_refuses_to_start_and_is_kept(workdir):
    run_corruption(workdir, sample=2)


def as_nobody():
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)


def public_python(script):
    """An interpreter user nobody may run `script --help` with (the tests' own may live under /root)."""
    for candidate in (sys.executable, "/usr/bin/python3"):
        try:
            check = subprocess.run([candidate, str(script), "--help"], preexec_fn=as_nobody,
                                   capture_output=True)
        except OSError:
            continue
        if check.returncode == 0:
            return candidate
    return None


def run_unreadable():
    """Store files unreadable by the server's user, a read-only folder; returns faults injected."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the server as another user (root reads any file): run the suite as root")
    # nobody runs a copy of the script on a store, both in a folder of their own under the
    # system's temp folder: the checkout and the caller's folders may be ones only their owner
    # may enter
    with support.scratch_dir("searchkeys-nobody-") as base:
        base.chmod(0o755)
        script = base / "searchkeys.py"
        shutil.copyfile(support.SEARCHKEYS, script)
        script.chmod(0o644)
        python = public_python(script)
        if python is None:
            pytest.skip(f"needs a Python that user nobody may run {script} with: apt-get install python3")
        folder = base / "nobody"
        folder.mkdir()
        return unreadable_cases(folder, script, python)


def unreadable_cases(folder, script, python):
    store, keys = seeded_store(folder)
    for path in [folder, *folder.iterdir()]:
        os.chown(path, 65534, 65534)
    with Server(store, preexec_fn=as_nobody, python=python, script=script):
        pass  # nobody can run it on the store: the refusals below are about the files
    lock = Path(str(store) + ".lock")
    for victim in (store, lock):
        victim.chmod(0o000)
        expect_refusal(store, f"{victim.name} unreadable (mode 000)", preexec_fn=as_nobody, python=python,
                       script=script)
        victim.chmod(0o600)
    # A folder the server may not write to: serving is fine, a change must fail cleanly or not at all.
    folder.chmod(0o555)
    try:
        server = Server(store, preexec_fn=as_nobody, wait=False, python=python, script=script)
        try:
            started = True
            try:
                support.wait_for_port(server.port, server.proc, 20)
            except (RuntimeError, TimeoutError):
                started = False
            if started:
                status, headers, body = server.request("POST", "/keys", {"actions": ["search"], "indexes": ["*"],
                                                                          "expiresAt": None})
                if status != 201:
                    check_error(status, headers, body, "write in a read-only folder", allow_internal=True)
            else:
                assert "Traceback" not in server.log() and store.name in server.log(), server.log()[-800:]
        finally:
            server.kill()
    finally:
        folder.chmod(0o755)
    assert_keys_intact(store, keys, "after the permission cases")
    return 3


def test_unreadable_store_refuses_to_start():
    run_unreadable()


def fill_disk(folder):
    """Write zeros until the filesystem is full; returns the filler's path."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def exercise_failing_writes(server, seed, context, expected, attempts=200):
    """Create, patch and delete until writes fail, keeping `expected` (uid -> key) up to date.

    Returns (uids whose change failed and must stay absent, faults seen)."""
    failed, faults = [], 0
    for i in range(attempts):
        uid = uid_of(0xd1, seed % 1000 * 1000 + i)
        status, headers, body = server.request("POST", "/keys", {"uid": uid, "name": "x" * 200, "actions": ["search"],
                                                                  "indexes": ["*"], "expiresAt": None})
        if status == 201:
            expected[uid] = body
            continue
        check_error(status, headers, body, f"{context}: failed create", allow_internal=True)
        faults += 1
        failed.append(uid)
        status, _, body = server.request("GET", "/keys/" + uid)
        assert status == 404, f"{context}: a create that failed is visible: {status} {body!r:.200}"
        if faults >= 3:
            break
    assert faults, f"{context}: no write ever failed"
    victim = uid_of(0xfa, 0)   # a key of the seeded store: a failing PATCH or DELETE changes nothing
    status, headers, body = server.request("PATCH", "/keys/" + victim, {"name": "y" * 300})
    if status == 200:
        expected[victim] = body
    else:
        check_error(status, headers, body, f"{context}: failed patch", allow_internal=True)
        faults += 1
        assert server.request("GET", "/keys/" + victim)[2]["name"] == expected[victim]["name"], \
            f"{context}: a failed PATCH was applied"
    status, headers, body = server.request("DELETE", "/keys/" + victim)
    if status == 204:
        del expected[victim]
        failed.append(victim)
    else:
        check_error(status, headers, body, f"{context}: failed delete", allow_internal=True)
        faults += 1
        assert server.request("GET", "/keys/" + victim)[0] == 200, f"{context}: a failed DELETE was applied"
    status, _, body = server.request("GET", "/keys?limit=1000")
    assert status == 200, f"{context}: reads stopped working: {status}"
    return failed, faults


def run_full_disk(workdir, seed=SEED):
    """A small tmpfs filled to the brim under a running server; returns faults injected."""
    disk = workdir / "disk"
    disk.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(disk)],
                       check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"needs root that may mount a tmpfs (a VM or a privileged container), here: {exc}; "
                    "the RLIMIT_FSIZE case covers full writes meanwhile")
    context = f"[seed {seed}] full tmpfs"
    try:
        store, keys = seeded_store(disk)
        filler = None
        server = Server(store)
        try:
            for i in range(3):   # a partly used last page: the next appends fail midway
                uid = uid_of(0xd0, i)
                status, _, body = server.request("POST", "/keys", {"uid": uid, "name": "w" * (50 + 77 * i),
                                                                    "actions": ["search"], "indexes": ["*"],
                                                                    "expiresAt": None})
                assert status == 201, body
                keys[uid] = body
            filler = fill_disk(disk)
            failed, faults = exercise_failing_writes(server, seed, context, keys)
            filler.unlink()
            filler = None
            status, _, body = server.request("POST", "/keys", {"uid": uid_of(0xd2, 1), "actions": ["search"],
                                                                "indexes": ["*"], "expiresAt": None})
            assert status == 201, f"{context}: writes did not recover after space was freed: {status} {body}"
            keys[uid_of(0xd2, 1)] = body
        finally:
            server.kill()
        # A full disk at start: start or refuse, lose nothing.
        filler = fill_disk(disk)
        server = Server(store, wait=False)
        try:
            support.wait_for_port(server.port, server.proc, 20)
            assert_keys_listed(server.port, keys, context + " at start")
        except (RuntimeError, TimeoutError):
            assert "Traceback" not in server.log(), f"{context} at start:\n{server.log()[-1500:]}"
        finally:
            server.kill()
        filler.unlink()
        assert_keys_intact(store, keys, context, absent=failed)
        return faults + 1
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def assert_keys_listed(port, expected, context):
    keys = all_keys(port)
    missing = [uid for uid in expected if uid not in keys]
    assert not missing, f"{context}: keys lost: {missing[:5]}"


def test_full_disk_answers_clean_errors_and_keeps_data(workdir):
    run_full_disk(workdir)


def run_file_size_limit(workdir, seed=SEED):
    """RLIMIT_FSIZE just above the store: writes fail with EFBIG; returns faults injected."""
    store, keys = seeded_store(workdir, name="limited.json")
    sizes = [p.stat().st_size for p in store_files(store)]
    limit = max(sizes) + 2048

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    context = f"[seed {seed}] RLIMIT_FSIZE {limit}"
    server = Server(store, preexec_fn=limited)
    try:
        failed, faults = exercise_failing_writes(server, seed, context, keys)
        assert server.proc.poll() is None, f"{context}: the server died"
        # Lift the limit: writes work again, after a torn append that must have been taken back.
        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        uid = uid_of(0xd3, 1)
        status, _, body = server.request("POST", "/keys", {"uid": uid, "actions": ["search"], "indexes": ["*"],
                                                            "expiresAt": None})
        assert status == 201, f"{context}: writes did not recover once the limit was lifted: {status} {body}"
        keys[uid] = body
    finally:
        server.kill()
    assert_keys_intact(store, keys, context, absent=failed)
    return faults


def test_file_size_limit_answers_clean_errors_and_keeps_data(workdir):
    run_file_size_limit(workdir)


# ============================================================================
# Fuzzing /keys (and the routes around it)
# ============================================================================

ACTION_NAMES = ["*", "search", "documents.*", "documents.add", "documents.get", "indexes.*", "keys.get",
                "keys.create", "tasks.*", "settings.*", "*.get", "metrics.get", "version", "chatCompletions"]
NASTY_STRINGS = ["", " ", "\u0000", "\ud800", "\udfff", "é", "\u2028", "a" * 5000, "💥", "\\", "\"",
                 "{}", "null", "../../etc/passwd", "%00", "\n\r", "Search", "serch", "keys.*", "*movies",
                 "mo*vies", "movies**", "a" * 401, "1", "-1", "*"]
NASTY_VALUES = [None, True, False, 0, -1, 1.5, 10 ** 30, 1e308, [], {}, [[]], {"a": None}, "x"]
DATES = [None, "2099-01-01", "2099-01-01T00:00:00Z", "2099-01-01T00:00:00.123456789123Z", "2099-01-01 00:00:00",
         "2099-01-01T00:00:00+23:59", "2099-01-01T00:00:00-00:00", "2099-02-30", "2099-01-01T24:00:00Z",
         "2099-01-01T23:59:60Z", "9999-12-31T23:59:59-23:59", "0000-01-01", "2000-01-01", "+12000-01-01",
         "2099-01-01T00:00:00", "2099-01-01T00:00:00.5", "2099-1-1", "tomorrow", "", "2099-01-01t00:00:00z",
         "2099-01-01T00:00:00+99:00", "٢٠٩٩-01-01"]
UIDS = ["00000000-0000-0000-0000-000000000000", "A1B2C3D4-E5F6-4a7b-8c9d-0e1f2a3b4c5d",
        "a1b2c3d4e5f64a7b8c9d0e1f2a3b4c5d", "{a1b2c3d4-e5f6-4a7b-8c9d-0e1f2a3b4c5e}",
        "urn:uuid:a1b2c3d4-e5f6-4a7b-8c9d-0e1f2a3b4c5f", "doggo", "", "aaaaabbbbbccc",
        "a1b2c3d4-e5f6-4a7b-8c9d", "g1b2c3d4-e5f6-4a7b-8c9d-0e1f2a3b4c5d", "a1b2c3d4-e5f6-4a7b-8c9d-0e1f2a3b4c5dd"]


class KeysFuzzer:
    """Seeded generator of /keys requests (and neighbours), from valid ones mutated."""

    def __init__(self, seed, known):
        self.rng = random.Random(seed)
        self.known = known   # dict with uids/values of live, deleted and scoped keys

    def text(self):
        rng = self.rng
        return rng.choice(NASTY_STRINGS) if rng.random() < 0.5 else \
            "".join(rng.choice("abcXYZ-_*.é ") for _ in range(rng.randint(0, 12)))

    def value(self, depth=0):
        rng = self.rng
        roll = rng.random()
        if depth < 3 and roll < 0.15:
            return [self.value(depth + 1) for _ in range(rng.randint(0, 3))]
        if depth < 3 and roll < 0.25:
            return {self.text(): self.value(depth + 1) for _ in range(rng.randint(0, 3))}
        if roll < 0.6:
            return self.text()
        return rng.choice(NASTY_VALUES)

    def create_body(self):
        rng = self.rng
        body = {"description": rng.choice([None, self.text()]), "name": rng.choice([None, self.text()]),
                "uid": rng.choice(UIDS + [None]),
                "actions": rng.sample(ACTION_NAMES, rng.randint(0, 3)),
                "indexes": rng.choice([["*"], [], ["movies"], ["mov*", "books"], [self.text()]]),
                "expiresAt": rng.choice(DATES)}
        if body["uid"] is None:
            del body["uid"]
        for _ in range(rng.randint(0, 3)):
            mutation = rng.random()
            field = rng.choice(list(body) or ["actions"])
            if mutation < 0.3 and body:
                body.pop(field, None)
            elif mutation < 0.6:
                body[field] = self.value()
            elif mutation < 0.75:
                body[rng.choice(["expires_at", "key", "createdAt", "Actions", "index", self.text()])] = self.value()
            elif mutation < 0.9 and isinstance(body.get("actions"), list):
                body["actions"].append(rng.choice(NASTY_STRINGS + ACTION_NAMES))
        items = list(body.items())
        rng.shuffle(items)
        return dict(items)

    def patch_body(self):
        rng = self.rng
        body = {}
        for field in rng.sample(["name", "description", "uid", "actions", "indexes", "expiresAt", "createdAt",
                                 "updatedAt", "key", "nmae", self.text()], rng.randint(0, 3)):
            body[field] = self.value()
        return body

    def encode(self, value):
        rng = self.rng
        roll = rng.random()
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, allow_nan=True)
        if roll < 0.06:
            return text[: rng.randrange(len(text) + 1)].encode("utf-8", "surrogatepass")   # truncated
        if roll < 0.09:
            return text.encode("utf-8", "surrogatepass") + b"\xff\xfe"
        if roll < 0.11:
            return b"\xef\xbb\xbf" + text.encode("utf-8", "surrogatepass")                 # BOM
        if roll < 0.13:
            depth = rng.randint(10, 100_000)
            return b'{"name":' + b"[" * depth + b"]" * depth + b"}"
        if roll < 0.15:
            return rng.choice([b"NaN", b'{"name":NaN}', b'{"name":Infinity}', b'{"name":1e999}',
                               b'{"name":' + b"9" * 5000 + b"}", b'{"name":"a","name":1}', b"", b" ",
                               b"[]", b"null", b'"\\ud800"', b"\x00"])
        return text.encode("utf-8", "surrogatepass")

    def authorization(self):
        rng = self.rng
        known = self.known
        choice = rng.random()
        if choice < 0.7:
            return b"Bearer " + MASTER.encode()
        options = [None, b"Bearer", b"Bearer ", b"bearer " + MASTER.encode(), b"Basic " + base64.b64encode(b"a:b"),
                   b"Bearer " + known["admin"].encode(), b"Bearer " + known["search"].encode(),
                   b"Bearer " + known["deleted"].encode(), b"Bearer " + known["admin"].upper().encode(),
                   b"Bearer %064x" % rng.getrandbits(256), b"Bearer caf\xe9", b"Bearer " + b"a" * 9000,
                   b"Bearer " + MASTER.encode() + b"x", b"Bearer  " + MASTER.encode(), b"Bearer\t" + MASTER.encode(),
                   b"Bearer " + known["token"].encode(), b"Bearer a.b.c", b"Bearer ..", b"Bearer e30.e30.",
                   b"Bearer " + known["bad_token"].encode()]
        return rng.choice(options)

    def segment(self, deletable=False):
        """A /keys/{key_or_uid} path segment: real uids and keys in odd spellings, or junk."""
        rng = self.rng
        known = self.known
        junk = [known["deleted"], known["deleted_uid"], "doggo", "%zz", "%ff%fe", "%00", "%2F", "a" * 3000, "..",
                "%2e%2e", "é", "%e9", "%064x" % rng.getrandbits(256), rng.choice(UIDS) or "x", "%20", "*"]
        if deletable:
            return rng.choice(junk)
        return rng.choice(junk + [known["uid"], known["uid"].upper(), known["uid"].replace("-", ""),
                                  "{" + known["uid"] + "}", "urn:uuid:" + known["uid"], known["admin"],
                                  known["admin"].upper()] * 2)

    def query(self):
        return self.rng.choice(["", "?offset=0&limit=1", "?limit=-1", "?offset=+5", "?limit=1e3", "?fields=x",
                                "?limit=18446744073709551615", "?limit=18446744073709551616",
                                "?offset=9223372036854775808", "?offset=%EF%BC%91", "?limit=", "?limit=%00",
                                "?offset=1&offset=2", "?Limit=1", "?limit=00000000000000000000000001", "?&&&",
                                "?offset=99999999999999999999999", "?offset=1&limit=2&x=3", "?limit=%2B1"])

    def path(self):
        rng = self.rng
        segment = self.segment()
        return rng.choice(["/keys", "/keys/", "//keys", "/keys" + self.query(), "/keys/" + segment,
                           "/keys//" + segment, "/keys/" + segment + "/", "/keys/" + segment + "/x",
                           "/keys/" + segment + self.query(), "/indexes/movies/search",
                           "/indexes/" + segment + "/search", "/indexes/movies/documents", "/multi-search", "/health",
                           "/", "/stats", "/version", "/tasks", "/metrics", "/indexes/movies/settings/stop-words",
                           "/unknown", "/authorize", "/indexes/movies/documents/edit", "/swap-indexes"])

    def request(self):
        rng = self.rng
        intent = rng.random()
        if intent < 0.35:
            method, path = b"POST", rng.choice(["/keys", "/keys/", "//keys", "/keys?x=1"])
        elif intent < 0.6:
            method, path = b"PATCH", "/keys/" + self.segment() + rng.choice(["", "/", "?a=b"])
        elif intent < 0.75:
            method, path = b"GET", rng.choice(["/keys" + self.query(), "/keys/" + self.segment()])
        elif intent < 0.8:
            method, path = b"DELETE", "/keys/" + self.segment(deletable=True)
        else:
            method = rng.choice([b"GET", b"POST", b"PATCH", b"DELETE", b"PUT", b"HEAD", b"OPTIONS", b"FOO",
                                 b"get", b"M-SEARCH"])
            path = self.path()
        path = path.encode("utf-8", "surrogatepass")
        headers = []
        auth = self.authorization()
        if auth is not None:
            headers.append((b"Authorization", auth))
        body = b""
        if method in (b"POST", b"PATCH", b"PUT") or rng.random() < 0.1:
            value = self.create_body() if method == b"POST" else self.patch_body()
            body = self.encode(value)
            content_type = rng.choice([b"application/json"] * 6 + [
                b"application/json; charset=utf-8", b"application/vnd.api+json", None, b"text/plain", b"",
                b"json", b"application/", b"*/*", b"APPLICATION/JSON", b"multipart/form-data"])
            if content_type is not None:
                headers.append((b"Content-Type", content_type))
        if path.startswith(b"/authorize"):
            headers.append((b"X-Original-URI", self.path().encode("utf-8", "surrogatepass")))
            headers.append((b"X-Original-Method", rng.choice([b"GET", b"POST", b"get", b"", b"DELETE"])))
        if rng.random() < 0.05:
            headers.append((b"Origin", b"https://example.org"))
        return method, path, headers, body


def check_fuzz_answer(method, path, request_body, status, headers, body, context, secrets_):
    """The rules every answer obeys, whatever the request."""
    assert status < 500 or status == 501, f"{context}: {status} {body[:300]!r}"
    assert MASTER.encode() not in body, f"{context}: the master key is in the answer"
    if status >= 400:
        for secret in secrets_:
            assert secret.encode() not in body or secret.encode() in path or secret.encode() in request_body, \
                f"{context}: an error shows a key value the request did not carry"
    if method == b"HEAD" or status == 204:
        assert body == b"", f"{context}: {status} with a body {body[:100]!r}"
        return
    if not body:
        assert status in (404, 405), f"{context}: {status} with an empty body"
        return
    try:
        data = json.loads(body)
    except ValueError:
        raise AssertionError(f"{context}: {status} answer is not JSON: {body[:300]!r}") from None
    if status >= 400:
        check_error(status, headers, data, context)
    elif path.split(b"?")[0].rstrip(b"/") in (b"/keys", b"//keys") and method == b"GET":
        assert list(data) == ["results", "offset", "limit", "total"], f"{context}: list fields {list(data)}"
        for key in data["results"]:
            check_key_object(key, context)
    elif path.startswith(b"/keys") or path.startswith(b"//keys"):
        check_key_object(data, context)


def fuzz_fixture_keys(port):
    """Keys the fuzzer points at: an admin key, a search key, a deleted one, tenant tokens."""
    def create(body):
        status, _, answer = call(port, "POST", "/keys", body)
        assert status == 201, answer
        return answer
    admin = create({"actions": ["*"], "indexes": ["*"], "expiresAt": None})
    search = create({"actions": ["search"], "indexes": ["movies"], "expiresAt": None})
    deleted = create({"actions": ["*"], "indexes": ["*"], "expiresAt": None})
    assert call(port, "DELETE", "/keys/" + deleted["uid"])[0] == 204
    return {"admin": admin["key"], "uid": admin["uid"], "search": search["key"], "deleted": deleted["key"],
            "deleted_uid": deleted["uid"],
            "token": tenant_token(search["key"], search["uid"], ["movies"]),
            "bad_token": tenant_token(search["key"], search["uid"], ["movies"], header={"alg": "\ud800"})}


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def tenant_token(api_key, uid, rules, exp=None, header=None, claims=None):
    header = header or {"alg": "HS256", "typ": "JWT"}
    payload = {"searchRules": rules, "apiKeyUid": uid}
    if exp is not None:
        payload["exp"] = exp
    payload.update(claims or {})
    signed = b64url(json.dumps(header).encode()) + "." + b64url(json.dumps(payload).encode())
    signature = hmac.new(api_key.encode(), signed.encode(), hashlib.sha256).digest()
    return signed + "." + b64url(signature)


def run_fuzz(workdir, cases, seed=SEED, threads=2):
    """`cases` seeded requests, sent by `threads` concurrent fuzzers to one server; returns
    requests sent. Each thread's stream is seeded (seed, thread number): a failure names both."""
    store = workdir / "fuzz.json"
    with Server(store) as server:
        known = fuzz_fixture_keys(server.port)
        secrets_ = [known["admin"], known["search"], known["deleted"]]
        failures = []

        def fuzz(number):
            fuzzer = KeysFuzzer(seed * 100 + number, known)
            for i in range(cases // threads):
                method, path, headers, body = fuzzer.request()
                context = (f"[seed {seed} thread {number}] fuzz case {i}: {method.decode()} {path[:120]!r} "
                           f"{headers!r:.200} {body[:160]!r}")
                try:
                    status, resp_headers, data = raw_request(server.port, method, path, headers, body)
                    check_fuzz_answer(method, path, body, status, resp_headers, data, context, secrets_)
                except (OSError, http.client.HTTPException) as exc:
                    failures.append(f"{context}: no HTTP answer ({exc!r})")
                except AssertionError as exc:
                    failures.append(str(exc))
                if failures:
                    return
                if i % 100 == 99:
                    status, _, _ = call(server.port, "GET", "/indexes/movies/search", key=known["search"])
                    if status != 501:
                        failures.append(f"{context}: afterwards the search key stopped working ({status})")

        pool = [threading.Thread(target=fuzz, args=(n,)) for n in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join(600)
        assert not failures, failures[0]
        assert server.proc.poll() is None
        keys = all_keys(server.port)
        for key in keys.values():
            check_key_object(key, f"[seed {seed}] listing after the fuzz")
        log = server.log()
    assert "Traceback" not in log and "internal error" not in log, f"[seed {seed}] fuzz log:\n{log[-3000:]}"
    read_store(store)
    return cases // threads * threads


def test_fuzzed_requests_get_upstream_shaped_errors(workdir):
    run_fuzz(workdir, 1000)


def exchange(port, data, timeout=15):
    """Raw bytes in (the write side then closed), every byte of the answer out."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        chunks = []
        try:
            for chunk in iter(lambda: sock.recv(65536), b""):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
        return b"".join(chunks)


def first_answer(raw, context):
    """(status, headers, parsed body) of the first HTTP response in raw bytes."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    assert sep and head.startswith(b"HTTP/1.1 "), f"{context}: no HTTP answer: {raw[:200]!r}"
    lines = head.split(b"\r\n")
    headers = {k.strip().lower().decode(): v.strip().decode("latin-1")
               for k, _, v in (line.partition(b":") for line in lines[1:])}
    body = rest[:int(headers.get("content-length", len(rest)))]
    return int(lines[0].split()[1]), headers, json.loads(body) if body else b""


def run_transport(workdir, seed=SEED):
    """HTTP framing attacks: a clean error for each, no request smuggled, still serving."""
    auth = b"Authorization: Bearer " + MASTER.encode() + b"\r\n"
    sent = 0
    victim = uid_of(0x5a, 1)   # re-created before each case; the smuggled request deletes it
    with Server(workdir / "transport.json") as server:
        smuggled = b"DELETE /keys/" + victim.encode() + b" HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n"
        post = b"POST /keys HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Type: application/json\r\n"
        valid = json.dumps({"actions": ["search"], "indexes": ["*"], "expiresAt": None}).encode()
        cases = [  # (name, bytes, statuses allowed for the first answer)
            ("two different Content-Lengths hiding a request", post + b"Content-Length: %d\r\nContent-Length: %d\r\n\r\n"
             % (len(valid), len(valid) + len(smuggled)) + valid + smuggled, {400}),
            ("Content-Length and chunked", post + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
             + smuggled, {400}),
            ("bad chunk size", post + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", {400}),
            ("negative chunk size", post + b"Transfer-Encoding: chunked\r\n\r\n-5\r\n{}\r\n0\r\n\r\n", {400}),
            ("unknown transfer coding", post + b"Transfer-Encoding: gzip\r\n\r\nabc", {400, 501}),
            ("Content-Length not a number", post + b"Content-Length: 1e3\r\n\r\n{}", {400}),
            ("200 headers", b"GET /keys HTTP/1.1\r\nHost: x\r\n" + auth
             + b"".join(b"X-H%d: v\r\n" % i for i in range(200)) + b"\r\n", {400, 431}),
            # actix-http bounds the whole head at 128 KiB, not each line
            ("140 KB header", b"GET /keys HTTP/1.1\r\nHost: x\r\n" + auth + b"X-Big: " + b"y" * 140000 + b"\r\n\r\n",
             {400, 431}),
            ("140 KB target", b"GET /keys?" + b"a" * 140000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", {400, 414}),
            ("garbage request line", b"GARBAGE\r\n\r\n", {400}),
            ("unknown HTTP version", b"GET /keys HTTP/9.9\r\nHost: x\r\n\r\n", {400, 505}),
        ]
        failures = []
        for name, data, allowed in cases:
            context = f"[seed {seed}] {name}"
            try:
                check_framing_case(server.port, data, allowed, victim, context)
            except AssertionError as exc:
                failures.append(str(exc).split("\n")[0])
            sent += 1
        assert not failures, f"{len(failures)} of {len(cases)} framing cases failed:\n" + "\n".join(failures)
        log = server.log()
    assert "Traceback" not in log and "internal error" not in log, log[-2000:]
    return sent


def check_framing_case(port, data, allowed, victim, context):
    if call(port, "GET", "/keys/" + victim)[0] == 404:
        status, _, body = call(port, "POST", "/keys", {"uid": victim, "actions": ["search"], "indexes": ["*"],
                                                       "expiresAt": None})
        assert status == 201, body
    status, headers, body = first_answer(exchange(port, data), context)
    assert status in allowed, f"{context}: status {status} {body!r:.200}"
    if body:   # transport-level refusals may carry upstream's error shape (code bad_request)
        assert list(body) == ["message", "code", "type", "link"], f"{context}: {body}"
    assert call(port, "GET", "/keys/" + victim)[0] == 200, f"{context}: a smuggled DELETE ran"


def test_http_framing_attacks_get_clean_errors_and_smuggle_nothing(workdir):
    run_transport(workdir)


# Inputs that break JSON servers, each with upstream's answer (meilisearch-keys.md section 2).
TARGETED = [
    ("lone surrogate in a name", "POST", "/keys", b'{"name":"\\ud800","actions":[],"indexes":[],"expiresAt":null}',
     {"malformed_payload", "invalid_api_key_name"}),
    ("lone surrogate as a field name", "POST", "/keys", b'{"\\ud800":1}', {"malformed_payload", "bad_request"}),
    ("lone surrogate in an action", "POST", "/keys", b'{"actions":["\\udfff"],"indexes":[],"expiresAt":null}',
     {"malformed_payload", "invalid_api_key_actions"}),
    ("lone surrogate in a PATCH", "PATCH", "/keys/{uid}", b'{"description":"\\ud800"}',
     {"malformed_payload", "invalid_api_key_description"}),
    ("NaN", "POST", "/keys", b'{"name":NaN}', {"malformed_payload"}),
    ("Infinity", "POST", "/keys", b'{"name":-Infinity}', {"malformed_payload"}),
    ("1e999", "POST", "/keys", b'{"name":1e999}', {"invalid_api_key_name", "malformed_payload"}),
    ("5000-digit integer", "POST", "/keys", b'{"name":' + b"9" * 5000 + b"}", {"invalid_api_key_name", "malformed_payload"}),
    ("limit past usize", "GET", "/keys?limit=18446744073709551616", None, {"invalid_api_key_limit"}),
    ("limit at usize max", "GET", "/keys?limit=18446744073709551615", None, {200}),
    ("offset past isize", "GET", "/keys?offset=9223372036854775808", None, {200}),
    ("offset at usize max", "GET", "/keys?offset=18446744073709551615&limit=18446744073709551615", None, {200}),
    ("fullwidth digit limit", "GET", "/keys?limit=%EF%BC%91", None, {"invalid_api_key_limit"}),
]


def run_targeted(workdir, seed=SEED):
    store = workdir / "targeted.json"
    with Server(store) as server:
        known = fuzz_fixture_keys(server.port)
        sent = 0
        for name, method, path, body, expected in TARGETED:
            path = path.replace("{uid}", known["uid"])
            headers = {"Content-Type": "application/json"} if body is not None else {}
            status, resp_headers, data = server.request(method, path, body, headers=headers)
            context = f"{name}: {method} {path}"
            if 200 in expected:
                assert status == 200, f"{context}: {status} {data!r:.300}"
            else:
                check_error(status, resp_headers, data, context)
                assert data["code"] in expected, f"{context}: code {data['code']}, expected one of {expected}"
            sent += 1
        # Deep nesting at every depth around the recursion limit: parse or refuse, never crash.
        for depth in range(900, 1100, 3):
            body = b'{"name":' + b"[" * depth + b"]" * depth + b"}"
            status, resp_headers, data = server.request("POST", "/keys", body,
                                                        headers={"Content-Type": "application/json"})
            check_error(status, resp_headers, data, f"name nested {depth} deep")
            sent += 1
        # Tenant tokens with hostile claims.
        parent = known["search"]
        uid = call(server.port, "GET", "/keys/" + parent)[2]["uid"]
        hostile = [
            ({"alg": "\ud800"}, {}), ({"alg": ["HS256"]}, {}), ({"alg": None}, {}), ({"alg": "none"}, {}),
            ({"alg": "HS256"}, {"apiKeyUid": "\ud800"}), ({"alg": "HS256"}, {"exp": 10 ** 30}),
            ({"alg": "HS256"}, {"exp": -10 ** 30}), ({"alg": "HS256"}, {"exp": 1.5}), ({"alg": "HS256"}, {"exp": "x"}),
            ({"alg": "HS256"}, {"searchRules": {"movies": {"filter": "\ud800"}}}),
            ({"alg": "HS256"}, {"searchRules": ["\udfff"]}), ({"alg": "HS256"}, {"searchRules": None}),
            ({"alg": "HS512"}, {"apiKeyUid": uid.upper()}),
        ]
        for header, claims in hostile:
            token = tenant_token(parent, uid, ["movies"], header=dict({"typ": "JWT"}, **header), claims=claims)
            status, resp_headers, data = call(server.port, "GET", "/indexes/movies/search", key=token)
            context = f"tenant token header {header!r:.60} claims {claims!r:.80}"
            if status != 501:
                check_error(status, resp_headers, data, context)
            sent += 1
        log = server.log()
    assert "internal error" not in log and "Traceback" not in log, f"targeted inputs:\n{log[-3000:]}"
    return sent


def test_targeted_hostile_inputs_never_crash(workdir):
    run_targeted(workdir)


# ============================================================================
# Revocation: expired and deleted keys, under concurrent deletes
# ============================================================================

def run_revocation(workdir, n_keys, seed=SEED, hammers=4):
    """Requests race deletes and expiry; returns requests sent. Raises on any late authorization."""
    rng = random.Random(seed)
    store = workdir / "revoke.json"
    with Server(store) as server:
        port = server.port
        victims = []
        for i in range(n_keys):
            actions, path_kind = rng.choice([(["search"], "search"), (["search"], "authorize"),
                                             (["keys.get"], "keys"), (["search"], "token")])
            status, _, key = call(port, "POST", "/keys", {"actions": actions, "indexes": ["*"], "expiresAt": None})
            assert status == 201, key
            victims.append((key, path_kind))
        expiring = []
        for i in range(3):
            expires = time.time() + 1.5 + i * 0.4
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(expires)) + ".%06dZ" % int(expires % 1 * 1e6)
            status, _, key = call(port, "POST", "/keys", {"actions": ["search"], "indexes": ["*"], "expiresAt": stamp})
            assert status == 201, key
            expiring.append((key, expires))
        deleted_at = {}
        records = []
        stop = threading.Event()

        def attempt(key, kind):
            if kind == "search":
                return call(port, "GET", "/indexes/movies/search", key=key["key"])[0] == 501
            if kind == "authorize":
                return call(port, "GET", "/authorize", key=key["key"],
                            headers={"X-Original-URI": "/indexes/movies/search", "X-Original-Method": "GET"})[0] == 204
            if kind == "keys":
                return call(port, "GET", "/keys?limit=1", key=key["key"])[0] == 200
            token = tenant_token(key["key"], key["uid"], ["*"])
            return call(port, "GET", "/indexes/movies/search", key=token)[0] == 501

        def hammer(k):
            hrng = random.Random(seed * 10 + k)
            while not stop.is_set():
                if hrng.random() < 0.2:
                    key, expires = hrng.choice(expiring)
                    started_wall, started = time.time(), time.monotonic()
                    records.append(("expiry", key["uid"], started_wall, expires, attempt(key, "search")))
                else:
                    key, kind = hrng.choice(victims)
                    started = time.monotonic()
                    records.append(("delete", key["uid"], started, kind, attempt(key, kind)))

        pool = [threading.Thread(target=hammer, args=(k,)) for k in range(hammers)]
        for t in pool:
            t.start()
        try:
            order = list(victims)
            rng.shuffle(order)
            for key, _ in order:
                time.sleep(rng.uniform(0, 0.03))
                status, _, body = call(port, "DELETE", "/keys/" + key["uid"])
                deleted_at[key["uid"]] = time.monotonic()
                assert status == 204, body
                again = call(port, "DELETE", "/keys/" + key["uid"])
                assert again[0] == 404, f"second delete: {again}"
            remaining = max(e for _, e in expiring) + 0.5 - time.time()
            if remaining > 0:
                time.sleep(remaining)
        finally:
            stop.set()
            for t in pool:
                t.join(30)
        late = []
        for record in records:
            if record[0] == "delete":
                _, uid, started, kind, allowed = record
                if allowed and started > deleted_at.get(uid, float("inf")):
                    late.append(f"deleted key {uid} ({kind}) authorized {started - deleted_at[uid]:.3f}s after the delete")
            else:
                _, uid, started_wall, expires, allowed = record
                if allowed and started_wall > expires + 0.002:
                    late.append(f"expired key {uid} authorized {started_wall - expires:.3f}s after expiry")
        granted = sum(1 for r in records if r[-1])
        assert granted > 0, f"[seed {seed}] no request was ever authorized: the test proves nothing"
        assert not late, f"[seed {seed}] {len(late)} late authorizations, e.g. {late[:5]}"
        log = server.log()
    assert "Traceback" not in log and "internal error" not in log, log[-2000:]
    return len(records) + 2 * n_keys


def run_races(workdir, seed=SEED, threads=16):
    """Same-uid creates, PATCH against DELETE, pipelined requests; returns requests sent."""
    rng = random.Random(seed)
    sent = 0
    with Server(workdir / "races.json") as server:
        for round_no in range(3):
            uid = uid_of(0xac, rng.getrandbits(32))
            barrier = threading.Barrier(threads)
            creates, fights = [], []

            def create():
                barrier.wait(30)
                creates.append(call(server.port, "POST", "/keys", {"uid": uid, "actions": ["search"],
                                                                   "indexes": ["*"], "expiresAt": None})[0])

            def fight(i):
                barrier.wait(30)
                if i % 2:
                    fights.append(call(server.port, "PATCH", "/keys/" + uid, {"name": str(i)})[0])
                else:
                    fights.append(call(server.port, "DELETE", "/keys/" + uid)[0])

            for target, args in ((create, ()), (fight, None)):
                pool = [threading.Thread(target=target, args=args if args is not None else (i,))
                        for i in range(threads)]
                for t in pool:
                    t.start()
                for t in pool:
                    t.join(60)
            sent += 2 * threads
            assert sorted(creates) == [201] + [409] * (threads - 1), f"[seed {seed}] same-uid creates: {creates}"
            assert fights.count(204) == 1 and set(fights) <= {200, 204, 404}, f"[seed {seed}] PATCH/DELETE: {fights}"
            assert call(server.port, "GET", "/keys/" + uid)[0] == 404
        auth = b"Authorization: Bearer " + MASTER.encode() + b"\r\n"
        data, wanted = b"", []
        for i in range(20):
            uid = uid_of(0xae, i)
            body = json.dumps({"uid": uid, "actions": ["search"], "indexes": ["*"], "expiresAt": None}).encode()
            data += (b"POST /keys HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
            data += b"GET /keys/" + uid.encode() + b" HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n"
            data += b"DELETE /keys/" + uid.encode() + b" HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n"
            wanted += [201, 200, 204]
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            raw = b"".join(iter(lambda: sock.recv(65536), b""))
        statuses = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", raw)]
        assert statuses == wanted, f"[seed {seed}] pipelined /keys requests: {statuses}"
        sent += len(wanted)
        log = server.log()
    assert "Traceback" not in log and "internal error" not in log, log[-2000:]
    return sent


def test_racing_writers_and_pipelined_requests(workdir):
    run_races(workdir)


def test_expired_and_deleted_keys_never_authorize(workdir):
    run_revocation(workdir, 30)


# ============================================================================
# Secrets and file modes
# ============================================================================

def run_secrets(workdir):
    """Keys used in every spelling; then logs, files and answers are searched; returns requests."""
    folder = workdir / "secret"
    folder.mkdir()
    store = folder / "keys.json"
    master = "secret-master-" + os.urandom(12).hex()
    values, tokens, answers = [], [], []
    with Server(store, master=master, preexec_fn=lambda: os.umask(0)) as server:
        for i in range(5):
            status, _, key = call(server.port, "POST", "/keys", {"actions": ["search", "keys.get"], "indexes": ["*"],
                                                                 "expiresAt": None, "name": f"s{i}"}, key=master)
            assert status == 201, key
            values.append(key["key"])
            tokens.append(tenant_token(key["key"], key["uid"], ["*"]))
        defaults = all_keys(server.port, master)
        values += [k["key"] for k in defaults.values()]
        value = values[0]
        spellings = [value, value.upper(), "/" + value, value + "/", "%" + value[:2] + value[2:],
                     "%%%02X" % ord(value[0]) + value[1:]]
        for spelling in spellings:
            for method, body in (("GET", None), ("PATCH", {"name": "renamed"})):
                for path in ("/keys/" + spelling, "//keys/" + spelling, "/%6Beys/" + spelling,
                             "/keys/" + spelling + "?x=" + value):
                    answers.append(call(server.port, method, path, body, key=master))
        for key_value_ in values[:3] + tokens[:2] + [master]:
            answers.append(call(server.port, "GET", "/indexes/movies/search", key=key_value_))
            answers.append(call(server.port, "GET", "/keys", key=key_value_))
            answers.append(call(server.port, "GET", "/authorize", key=key_value_,
                                headers={"X-Original-URI": "/indexes/x/search?key=" + key_value_}))
        answers.append(call(server.port, "GET", "/keys", key=master + "x"))
        answers.append(call(server.port, "DELETE", "/keys/" + values[1], key=master))
        answers.append(call(server.port, "GET", "/indexes/movies/search", key=values[1]))
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
        log = server.log()
    secrets_ = [master] + values + tokens
    in_log = [s[:12] + "..." for s in secrets_ if s in log or s.upper() in log or s[8:] in log]
    assert not in_log, f"secrets in the log: {in_log}"
    for path in folder.iterdir():
        data = path.read_bytes()
        found = [s[:12] + "..." for s in secrets_ if s.encode() in data or s.upper().encode() in data]
        assert not found, f"secrets in {path.name}: {found}"
    for status, _, body in answers:
        text = json.dumps(body) if isinstance(body, dict) else body.decode("utf-8", "replace")
        assert master not in text and master[8:] not in text, f"the master key is in an answer: {text[:200]}"
        if status >= 400 and isinstance(body, dict):
            echoed = [v[:12] for v in values[1:] if v in body["message"]]
            assert not echoed or body["code"] == "api_key_not_found", f"key values in an error: {body}"
    assert modes and all(mode == 0o600 for mode in modes.values()), f"store file modes under umask 0: " \
        f"{ {k: oct(v) for k, v in modes.items()} }"
    return len(answers) + 5


def test_no_secret_in_logs_files_or_messages_and_files_are_0600(workdir):
    run_secrets(workdir)


def test_short_master_key_warns_without_echoing_it(workdir):
    short = "tiny-key-7q"
    server = Server(workdir / "short.json", master=short)
    try:
        status, _, _ = call(server.port, "GET", "/keys", key=short)
        assert status == 200
    finally:
        server.stop()
    log = server.log()
    assert "16" in log or "short" in log.lower(), f"no warning about the short master key: {log[-500:]!r}"
    assert short not in log, "the master key is in the log"
