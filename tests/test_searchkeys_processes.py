"""Issue 32: several `serve` processes on one store. A key created, deleted, rotated or
restricted through one is honoured or refused by the others within 1 s; concurrent writers
lose nothing; `serve --workers N` runs N processes behind one port. Each test runs the real
script as subprocesses, on loopback ports.
"""
import collections
import http.client
import json
import os
import re
import shlex
import signal
import subprocess
import threading
import time

import pytest

from support import ROOT, SEARCHKEYS, Daemon, free_port, python_cmd, request, scratch_dir, \
    stop_session, wait_for_port
from test_searchkeys_nginx import NGINX
from test_searchkeys_startup import MASTER, clean_env, refused, start

WITHIN = 1.0  # seconds: the bound for every process to honour a change
MASTER_HEADERS = {"Authorization": "Bearer " + MASTER, "Content-Type": "application/json"}


def call(port, method, path, body=None, key=MASTER):
    headers = {"Authorization": "Bearer " + key}
    if body is not None:
        headers["Content-Type"] = "application/json"
        body = json.dumps(body)
    status, _, data = request(port, method, path, body, headers)
    return status, json.loads(data) if data else None


def create(port, **fields):
    status, key = call(port, "POST", "/keys", dict({"actions": ["keys.get"], "indexes": ["*"],
                                                    "expiresAt": None}, **fields))
    assert status == 201, key
    return key


def works(port, key):
    """Whether `key` (one with keys.get) is let through by the process on `port`."""
    status, answer = call(port, "GET", "/keys?limit=1", key=key)
    assert status in (200, 403), answer
    return status == 200


def within(seconds, check):
    """Whether `check()` turns true within `seconds` (from now); the time it took."""
    started = time.monotonic()
    while True:
        if check():
            return True, time.monotonic() - started
        if time.monotonic() - started > seconds:
            return False, time.monotonic() - started
        time.sleep(0.02)


@pytest.fixture
def pair(tmp_path):
    store = tmp_path / "keys.json"
    with start(free_port(), "--master-key", MASTER, "--store", str(store)) as a, \
            start(free_port(), "--master-key", MASTER, "--store", str(store)) as b:
        yield a.port, b.port, store


def test_a_key_created_through_one_process_works_through_the_other_within_1s(pair):
    a, b, _ = pair
    key = create(a)
    assert works(a, key["key"])
    honoured, took = within(WITHIN, lambda: works(b, key["key"]))
    assert honoured, "created through A, still refused by B after %.2f s" % took


def test_a_key_deleted_through_one_process_is_refused_by_the_other_within_1s(pair):
    a, b, _ = pair
    key = create(a)
    assert within(WITHIN, lambda: works(b, key["key"]))[0]
    assert call(b, "DELETE", "/keys/" + key["uid"])[0] == 204
    refused, took = within(WITHIN, lambda: not works(a, key["key"]))
    assert refused, "deleted through B, still honoured by A after %.2f s" % took
    assert call(a, "GET", "/keys/" + key["uid"])[0] == 404


def test_rotated_and_restricted_through_one_process_are_honoured_by_the_other_within_1s(pair):
    a, b, _ = pair
    key = create(a)
    assert within(WITHIN, lambda: works(b, key["key"]))[0]
    status, new = call(a, "POST", "/keys/%s/rotate" % key["uid"], {"grace": 0})
    assert status == 201, new
    swapped, took = within(WITHIN, lambda: works(b, new["key"]) and not works(b, key["key"]))
    assert swapped, "rotated through A, B still had the old key after %.2f s" % took
    status, _ = call(b, "PUT", "/keys/%s/restrictions" % new["uid"],
                     {"allowedIps": ["10.0.0.0/8"]})
    assert status == 200
    refused, took = within(WITHIN, lambda: not works(a, new["key"]))
    assert refused, "restricted through B to 10.0.0.0/8, A still let 127.0.0.1 through " \
                    "after %.2f s" % took
    status, answer = call(a, "GET", "/keys?limit=1", key=new["key"])
    assert status == 403 and "allowedIps" in answer["message"], answer


def test_a_key_restricted_through_one_process_cannot_be_deleted_by_an_admin_key_through_the_other(
        pair):
    """Only the master key may delete or rotate a key with restrictions (an admin key could
    make it again, same uid and value, without them). The other process used to judge by its
    own copy of the key, up to 0.25 s old: restricted through B, then deleted or rotated at once
    through A with an admin key, the key was gone (or rotated) with its restrictions."""
    a, b, _ = pair
    admin = create(a, actions=["keys.get", "keys.create", "keys.delete"])["key"]
    for attempt in range(5):
        victim = create(a)
        assert within(WITHIN, lambda: works(b, victim["key"]))[0]
        status, answer = call(b, "PUT", "/keys/%s/restrictions" % victim["uid"],
                              {"maxHitsPerQuery": 5})
        assert status == 200, answer
        status, answer = call(a, "DELETE", "/keys/" + victim["uid"], key=admin)
        assert status == 403, (attempt, status, answer)
        status, answer = call(a, "POST", "/keys/%s/rotate" % victim["uid"], key=admin)
        assert status == 403, (attempt, status, answer)
        assert call(a, "GET", "/keys/" + victim["uid"])[0] == 200


def test_a_key_just_created_through_one_process_is_found_by_the_other(pair):
    """`keys create` then `keys restrict` (as the docs run them) may reach two workers: the
    second used to answer 404 `api_key_not_found` for up to 0.25 s, its copy of the store not yet
    renewed, to a change, or a read, of a key the file already held."""
    a, b, _ = pair
    for attempt in range(5):
        made = create(a)
        status, answer = call(b, "PUT", "/keys/%s/restrictions" % made["uid"],
                              {"maxHitsPerQuery": 5})
        assert status == 200, (attempt, answer)
        made = create(b)
        status, answer = call(a, "GET", "/keys/" + made["key"])
        assert status == 200 and answer["uid"] == made["uid"], (attempt, answer)


def test_200_concurrent_creates_split_across_two_processes_all_survive(pair):
    a, b, store = pair
    made, errors = [], []

    def creator(port, count):
        for _ in range(count):
            try:
                made.append(create(port)["uid"])
            except AssertionError as exc:
                errors.append(exc)
    threads = [threading.Thread(target=creator, args=(port, 25)) for port in (a, b) * 4]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(made) == 200
    uids = [record["uid"] for record in json.loads(store.read_text())["keys"]]
    duplicated = [uid for uid, n in collections.Counter(uids).items() if n > 1]
    assert not duplicated, duplicated
    assert set(made) <= set(uids), "lost: %s" % sorted(set(made) - set(uids))[:5]
    assert len(uids) == 204  # and the four defaults
    for port in (a, b):  # each has taken in the other's last writes
        assert within(WITHIN, lambda: call(port, "GET", "/keys?limit=1")[1]["total"] == 204)[0]


def test_usage_counted_by_two_processes_adds_up_in_the_store(pair):
    a, b, store = pair
    key = create(a)
    assert within(WITHIN, lambda: works(b, key["key"]))[0]  # one request allowed by B
    for port, times in ((a, 3), (b, 4)):
        for _ in range(times):
            assert works(port, key["key"])
    shown = call(a, "GET", "/keys/%s/usage" % key["uid"])[1]
    assert shown["unsaved"]["allowed"] <= shown["allowed"] and shown["unsaved"]["refused"] == 0

    def saved():  # each process adds what it counted within USAGE_FLUSH_SECONDS (5 s)
        usage = json.loads(store.read_text()).get("usage", {}).get(key["uid"])
        return usage is not None and usage["allowed"] == 8
    assert within(15, saved)[0], store.read_text()[-300:]
    # A shows the saved totals, B's counts included, once it has taken in B's last save
    assert within(WITHIN, lambda: call(a, "GET", "/keys/%s/usage" % key["uid"])[1] == dict(
        shown, allowed=8, unsaved={"allowed": 0, "refused": 0},
        lastUsedAt=call(b, "GET", "/keys/%s/usage" % key["uid"])[1]["lastUsedAt"]))[0]


# ---------------------------------------------------------------------------------------------
# serve --workers
# ---------------------------------------------------------------------------------------------

def children(pid):
    """The pids whose parent is `pid` (Linux's /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/stat" % entry) as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return sorted(found)


def connection_owners(port, pids):
    """{pid: connections to `port` it holds} of the given processes (Linux's /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines)
                for line in lines:
                    fields = line.split()
                    if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                        inodes.add(fields[9])
        except OSError:
            continue
    owners = {}
    for pid in pids:
        held = 0
        for fd in os.listdir("/proc/%d/fd" % pid):
            try:
                target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
            except OSError:
                continue
            match = re.match(r"socket:\[(\d+)\]", target)
            held += bool(match and match.group(1) in inodes)
        owners[pid] = held
    return owners


linux_only = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"),
                                reason="needs Linux's /proc, to see which process holds a "
                                       "connection: run the suite on Linux")


@pytest.fixture
def workers(tmp_path):
    port = free_port()
    argv = python_cmd(SEARCHKEYS, "serve", "--host", "127.0.0.1", "--port", str(port),
                      "--master-key", MASTER, "--store", str(tmp_path / "keys.json"),
                      "--workers", "2")
    with Daemon(argv, port, env=clean_env(), timeout=20.0) as server:
        assert within(10, lambda: len(children(server.proc.pid)) == 2)[0], server.log()
        yield server


@linux_only
def test_serve_workers_2_answers_on_one_port_from_two_processes(workers):
    pids = children(workers.proc.pid)
    held = []
    try:
        for _ in range(60):  # kept open: each stays with the process that accepted it
            connection = http.client.HTTPConnection("127.0.0.1", workers.port, timeout=10)
            connection.request("GET", "/health")
            assert connection.getresponse().read()
            held.append(connection)
        owners = connection_owners(workers.port, pids)
        assert all(owners[pid] > 0 for pid in pids), owners
        assert sum(owners.values()) == len(held), owners
    finally:
        for connection in held:
            connection.close()
    key = create(workers.port)
    honoured, took = within(WITHIN, lambda: all(works(workers.port, key["key"])
                                                for _ in range(10)))
    assert honoured, "a key created through one worker was refused by another after %.2f s" % took


@linux_only
def test_a_killed_worker_is_replaced_and_sigterm_stops_them_all(workers):
    first = children(workers.proc.pid)
    os.kill(first[0], signal.SIGKILL)
    assert all(request(workers.port, "GET", "/health")[0] == 200 for _ in range(20))
    replaced, _ = within(10, lambda: len(children(workers.proc.pid)) == 2
                         and first[0] not in children(workers.proc.pid))
    assert replaced, workers.log()
    assert "worker %d ended (signal 9)" % first[0] in workers.log()
    now = children(workers.proc.pid)
    workers.proc.send_signal(signal.SIGTERM)
    assert workers.proc.wait(10) == 0, workers.log()
    for pid in now:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "Traceback" not in workers.log()


def test_workers_need_a_store_file(tmp_path):
    code, message = refused("--master-key", MASTER, "--workers", "2")
    assert code == 2 and "--store" in message, message
    code, message = refused("--master-key", MASTER, "--workers", "0", "--store",
                            str(tmp_path / "keys.json"))
    assert code == 2 and "--workers" in message, message


# ---------------------------------------------------------------------------------------------
# docs/searchkeys.md, "Several processes": two processes behind nginx, as written
# ---------------------------------------------------------------------------------------------

def several_processes_section():
    text = (ROOT / "docs" / "searchkeys.md").read_text()
    return text.split("### Several processes\n", 1)[1].split("\n## ", 1)[0]


def fenced(section, language):
    return [block.split("\n", 1)[1] for block in section.split("```")[1::2]
            if block.startswith(language + "\n")]


def test_the_docs_several_processes_setup_behind_nginx_works_as_written(tmp_path):
    if NGINX is None:
        pytest.skip("needs nginx: apt-get install nginx")
    section = several_processes_section()
    (commands,) = fenced(section, "sh")
    (config,) = fenced(section, "nginx")
    ports = {"7700": free_port(), "7702": free_port()}
    store = tmp_path / "keys.json"
    argvs = []
    for line in commands.splitlines():
        if line.startswith("python3 searchkeys.py serve") and "--port" in line:
            argv = shlex.split(line.rstrip("& "))
            argvs.append(python_cmd(SEARCHKEYS, *[
                str(store) if word == "/var/lib/searchkeys/keys.json" else ports.get(word, word)
                for word in argv[2:]]))
    assert len(argvs) == 2 and "--trusted-proxy" in argvs[0], commands
    listen = free_port()
    assert "listen 443 ssl;" in config and "127.0.0.1:7700" in config, config
    config = config.replace("listen 443 ssl;", "listen 127.0.0.1:%d;" % listen)
    for written, port in ports.items():
        config = config.replace("127.0.0.1:%s" % written, "127.0.0.1:%d" % port)
    env = clean_env(MEILI_MASTER_KEY=MASTER)
    with Daemon(argvs[0], ports["7700"], env=env, timeout=20.0), \
            Daemon(argvs[1], ports["7702"], env=env, timeout=20.0), \
            scratch_dir("searchkeys-nginx-") as prefix:
        os.chmod(prefix, 0o755)  # nginx's workers may run as another user
        (prefix / "nginx.conf").write_text("daemon off;\nevents {}\n" + config)
        nginx = subprocess.Popen([NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"),
                                  "-e", "stderr"], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            wait_for_port(listen, nginx, timeout=15)
            key = create(listen)  # through nginx, on one of the two processes

            def all_answer(expected):  # nginx takes turns between the two processes
                return all(works(listen, key["key"]) == expected for _ in range(10))
            honoured, took = within(WITHIN, lambda: all_answer(True))
            assert honoured, "a key created through nginx was refused after %.2f s" % took
            assert call(listen, "DELETE", "/keys/" + key["uid"])[0] == 204
            refused_by_all, took = within(WITHIN, lambda: all_answer(False))
            assert refused_by_all, "a deleted key was still let through after %.2f s" % took
        finally:
            stop_session(nginx, signal.SIGQUIT)


def test_a_store_being_written_in_place_is_never_loaded_half_written(pair):
    """A hand edit in progress (the file cut short) leaves each process with the keys it has,
    refuses changes (500, the file left alone) and is taken in once whole."""
    a, b, store = pair
    key = create(a)
    assert within(WITHIN, lambda: works(b, key["key"]))[0]
    whole = store.read_bytes()
    with open(store, "r+b") as file:  # in place, as an editor may write
        file.truncate(len(whole) // 2)
    time.sleep(3 * 0.25 + 0.5)  # a few polls
    assert works(a, key["key"]) and works(b, key["key"])
    status, answer = call(b, "POST", "/keys", {"actions": ["search"], "indexes": ["*"],
                                               "expiresAt": None})
    assert status == 500 and "corrupt" in answer["message"], answer
    assert store.read_bytes() == whole[:len(whole) // 2]
    document = json.loads(whole)
    document["keys"] = [r for r in document["keys"] if r["uid"] != key["uid"]]
    with open(store, "r+b") as file:
        file.write(json.dumps(document).encode())
        file.truncate()
    refused, took = within(WITHIN, lambda: not works(a, key["key"])
                           and not works(b, key["key"]))
    assert refused, "the whole file, without the key, was not taken in after %.2f s" % took


@linux_only
def test_workers_ending_again_and_again_stop_them_all(workers):
    """Five workers ending within 10 s is a fault, not a crash to retry for ever."""
    for killed in range(1, 6):
        assert within(10, lambda: len(children(workers.proc.pid)) == 2)[0], workers.log()
        os.kill(children(workers.proc.pid)[0], signal.SIGKILL)
        assert within(10, lambda: workers.log().count("ended (signal 9)") == killed)[0]
    assert workers.proc.wait(10) == 1, workers.log()
    assert "within 10 s; stopping" in workers.log()
