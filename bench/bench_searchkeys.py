"""Benchmark: searchkeys.py serve — authorization, key creation, startup, memory, guard cost.

    python3 bench/bench_searchkeys.py [--quick] [--repeat N] [--keys 10000]

Starts ``searchkeys.py serve`` on 127.0.0.1 with a durable ``--store`` and measures, in one run:

- authorization throughput and latency (``GET /authorize`` with a valid search key, as nginx
  ``auth_request`` sends it) with 10, 10,000 and 100,000 stored keys; the key used is always the
  newest one (worst case for a lookup that scans in insertion order); the same requests against
  the bare-stdlib floor (``stub_server.py floor``) for scale;
- ``POST /keys`` rate (durable store: every create is on disk before the answer) with ~100 and
  with ~100,000 stored keys, at concurrency 1 and 8;
- startup time (spawn → first answer on ``/health``) with an empty store and with 100,000 keys,
  and idle RSS for both (→ memory per 100,000 keys);
- idle RSS next to a bare ThreadingHTTPServer + subprocess + json script: searchkeys.py copied
  and run as a script, and imported as a module from its bytecode cache (the installed form);
- the guard's cost: GET and POST searches, a multi-search, a tenant token's search and document
  fetches, each through ``serve --upstream`` to ``stub_server.py search`` vs the same request
  through the card's floor (``stub_server.py proxy``: bare http.server + http.client, no
  authorization) and sent to the stub directly, interleaved in the same run, at c=1, 8 and 32
  with the Python client and wrk;
- where nginx is installed: the same search through nginx with ``auth_request`` to searchkeys
  (the README's recipe, ``searchkeys-nginx.conf.example``: searches go through ``serve
  --upstream``) vs through nginx alone;
- a new client's latency (``GET /health`` on a fresh connection, p50/p99) while 5,000 idle
  keep-alive connections and 500 clients trickling their heads are held against the guard, next
  to the same figure with nothing held, plus the guard's threads and RSS meanwhile;
- ``serve --workers`` 1, 2 and ``auto`` (one per core) behind one port, each on a store of its
  own: a GET search through the guard to ``stub_server.py search``, requests per second and the
  ratio to one worker, with the machine's core count and load; and the time from a key's
  creation through one worker to its acceptance by every worker (p50, max), measured on
  keep-alive connections that every worker holds some of.

The store is filled through the API (``POST /keys`` from a concurrent keep-alive client), the way
a user would; the fill rate is reported too. Prints ONE JSON object with the figures, the ratios
and the targets met or missed; keeps a copy in bench/results/. Progress goes to stderr.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_store
import common
from common import log, ratio

SEARCHKEYS = common.ROOT / "searchkeys.py"
STUB = common.BENCH_DIR / "stub_server.py"
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None)
MASTER_KEY = "bench-master-key-0123456789abcdef"
UPSTREAM_KEY = "bench-upstream-key-0123456789"
INDEX = "blog"
SEARCH_PATH = f"/indexes/{INDEX}/search"
SEARCH_BODY = json.dumps({"q": "bench", "limit": 20})
NEW_KEY_BODY = json.dumps({"description": "bench", "actions": ["search"], "indexes": [INDEX],
                           "expiresAt": None})
MASTER_AUTH = {"Authorization": f"Bearer {MASTER_KEY}", "Content-Type": "application/json"}

TARGETS_DOC = {
    "authorize_scaling": "authorization throughput at 10 keys / at 100,000 keys < 1.2",
    "create_scaling": "POST /keys per-create cost does not grow: rate at 100k / rate at 100 >= 0.8",
    "startup_100k": "startup with 100,000 keys < 2 s",
    "guard_p50": "the guard adds < 0.3 ms to the floor proxy's p50 at c=1, each request shape",
    "guard_rps": "guarded throughput >= 0.9x the floor (bare http.server + http.client proxy) "
                 "at each concurrency, each request shape, Python client and wrk",
    "nginx_rps": "nginx + searchkeys (the recipe) >= 0.8x nginx direct at c=8",
    "idle_rss": "idle RSS within 6 MiB of a bare ThreadingHTTPServer + subprocess + json script",
    "held_new_client": "a new client is answered within 1 s (p99) while 5,000 idle keep-alive "
                       "and 500 trickling connections are held",
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="short run: repeat 1, 300 requests, 1 s wrk, the 10,000-key "
                             "store written in its format instead of filled through the API")
    common.add_load_arguments(parser, 3000, "1,8", "searchkeys.py and the stubs")
    parser.add_argument("--creates", type=int, help="POST /keys per rate measurement (300)")
    parser.add_argument("--keys", type=int,
                        help="largest store size (10000: every create rewrites the store, so "
                             "an API fill costs O(keys squared))")
    parser.add_argument("--fill-concurrency", type=int, default=8,
                        help="concurrent clients filling the store through the API (8)")
    parser.add_argument("--fill-budget", type=float, default=900.0,
                        help="seconds allowed for filling the store; the run stops if exceeded")
    parser.add_argument("--searchkeys", default=str(SEARCHKEYS), help="path of searchkeys.py")
    parser.add_argument("--guard-only", action="store_true",
                        help="measure only the guard's cost (no store filling)")
    parser.add_argument("--guard-concurrency", default="1,8,32",
                        help="concurrencies of the guard phase, each with the Python client "
                             "and wrk (1,8,32)")
    parser.add_argument("--guard-requests", type=int,
                        help="Python-client requests per guard shape, concurrency and server "
                             "(a third of --requests)")
    parser.add_argument("--workers-only", action="store_true",
                        help="measure only serve --workers: throughput with 1, 2 and auto "
                             "workers, and a new key's time to reach every worker")
    parser.add_argument("--workers-trials", type=int,
                        help="keys created to time their reaching every worker (20)")
    parser.add_argument("--held-only", action="store_true",
                        help="measure only a new client's latency while thousands of idle and "
                             "trickling connections are held")
    args = parser.parse_args()
    quick = args.quick
    common.apply_defaults(args, {
        "repeat": 1 if quick else 3, "requests": 300 if quick else 3000,
        "creates": 60 if quick else 300, "keys": 10000,
        "wrk_seconds": 1 if quick else 2, "slices": 2 if quick else 4,
        "workers_trials": 5 if quick else 20})
    args.guard_concurrency = [int(c) for c in args.guard_concurrency.split(",")]
    if args.guard_requests is None:
        args.guard_requests = max(100, args.requests // 3)
    if not Path(args.searchkeys).exists():
        sys.exit(f"{args.searchkeys} does not exist yet")
    return args


# --------------------------------------------------------------------------------------------
# Servers and single API calls
# --------------------------------------------------------------------------------------------

def start_searchkeys(args, workdir, store=None, upstream=None, workers=1):
    port = common.free_port()
    argv = [args.python, args.searchkeys, "serve", "--host", common.HOST, "--port", port,
            "--master-key", MASTER_KEY]
    if store:
        argv += ["--store", store]
    if upstream:
        argv += ["--upstream", upstream, "--upstream-key", UPSTREAM_KEY]
    if workers != 1:
        argv += ["--workers", workers]
    return common.Server("searchkeys", argv, port, ready_path="/health", log_dir=workdir,
                         timeout=120.0)


def start_stub(args, kind, workdir):
    port = common.free_port()
    return common.Server(f"stub-{kind}", [args.python, STUB, kind, "--port", port], port,
                         ready_path="/", log_dir=workdir)


def call(port, method, path, headers=None, body=b""):
    """One request on a fresh connection: (status, decoded JSON or None)."""
    conn = common.Connection(port, timeout=60.0)
    try:
        status, data = conn.exchange(common.build_request(method, path, headers, body))
    finally:
        conn.close()
    try:
        return status, json.loads(data) if data else None
    except ValueError:
        return status, None


def stored_keys(port):
    status, body = call(port, "GET", "/keys?limit=1", MASTER_AUTH)
    if status != 200 or not isinstance(body, dict) or "total" not in body:
        raise RuntimeError(f"GET /keys answered {status}: {body}")
    return body["total"]


def new_search_key(port):
    status, body = call(port, "POST", "/keys", MASTER_AUTH, NEW_KEY_BODY)
    if status != 201 or not isinstance(body, dict) or "key" not in body:
        raise RuntimeError(f"POST /keys answered {status}: {body}")
    return body["key"]


def authorize_headers(key):
    return {"X-Original-Method": "POST", "X-Original-URI": SEARCH_PATH,
            "Authorization": f"Bearer {key}"}


# --------------------------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------------------------

def fill(args, server, target, deadline, fill_log):
    """Create keys through the API until ``target`` are stored; chunks of at most 5000."""
    have = stored_keys(server.port)
    request = [common.build_request("POST", "/keys", MASTER_AUTH, NEW_KEY_BODY)]
    while have < target:
        if time.monotonic() > deadline:
            raise RuntimeError(f"store fill exceeded --fill-budget at {have} keys")
        chunk = min(5000, target - have)
        fig = common.run_load(server.port, request, chunk, args.fill_concurrency,
                              args.client_procs, {201})
        if fig["unexpected"] or fig["errors"]:
            raise RuntimeError(f"fill failed: {fig}")
        fill_log.append({"stored_before": have, "created": chunk, "rps": fig["rps"],
                         "p50_ms": fig["p50_ms"], "p99_ms": fig["p99_ms"]})
        have = stored_keys(server.port)
        log(f"fill: {have} keys stored, last chunk {fig['rps']} creates/s "
            f"(p50 {fig['p50_ms']} ms, p99 {fig['p99_ms']} ms)")
    return have


def interleaved(args, targets, requests, labels, expected, count=None):
    """The same requests against several servers, alternated within each repeat (the order
    rotates), so that the machine's load changes hit all of them alike.

    ``targets``: name -> (server, pre-encoded requests for it); ``labels``: which clients and
    concurrencies ("python c=N" / "wrk c=N"); returns label -> name -> merged figures.
    """
    raw = {}
    names = list(targets)
    for rep in range(args.repeat):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for label in labels:
            client, c = label.split(" c=")
            c = int(c)
            if client == "python":  # slices alternating between the servers (ABBA order)
                parts = {name: [] for name in order}
                per_slice = max(c, (count or args.requests) // args.slices)
                for k in range(args.slices):
                    for name in (order if k % 2 == 0 else order[::-1]):
                        server, request = targets[name]
                        parts[name].append(common.run_load(
                            server.port, [request.encode()], per_slice, c, args.client_procs,
                            expected[name], server.pid, keep_raw=True))
                figures = {n: common.summarize(parts[n], expected[n]) for n in order}
            else:
                figures = {}
                for name in order:
                    server, request = targets[name]
                    figures[name] = common.run_wrk(server.port, request.path, c,
                                                   args.wrk_seconds, request.headers,
                                                   request.method, request.body)
            for name in order:
                fig = figures[name]
                raw.setdefault((label, name), []).append(fig)
                log(f"{requests} {label} {name}: {fig['rps']} rps p50 {fig['p50_ms']} "
                    f"p99 {fig['p99_ms']} ms cpu {fig.get('server_cpu_us_per_req')} us/req "
                    f"(unexpected {fig.get('unexpected', fig.get('non_2xx_3xx'))}, "
                    f"errors {fig.get('errors', fig.get('socket_errors'))})")
    return {label: {name: common.merge_repeats(raw[(label, name)]) for name in names}
            for label in labels}


class Req:
    """One request, kept both as parts (for wrk) and pre-encoded (for the Python client)."""

    def __init__(self, method, path, headers, body=""):
        self.method, self.path, self.headers, self.body = method, path, headers, body

    def encode(self):
        return common.build_request(self.method, self.path, self.headers, self.body)


def authorize_request(key):
    return Req("GET", "/authorize", authorize_headers(key))


def client_labels(args, with_wrk=True):
    labels = [f"python c={c}" for c in args.concurrency]
    if with_wrk and not args.no_wrk:
        labels.append(f"wrk c={max(args.concurrency)}")
    return labels


def measure_authorize(args, small, big, floor, level):
    """Authorization with ``level`` keys (``big``) vs 10 keys (``small``) and the floor."""
    targets = {"floor": (floor[0], authorize_request(floor[1])),
               "10 keys": (small[0], authorize_request(small[1])),
               f"{level} keys": (big[0], authorize_request(big[1]))}
    expected = {"floor": {404}, "10 keys": {204}, f"{level} keys": {204}}
    table = interleaved(args, targets, f"authorize@{level}", client_labels(args), expected)
    for row in table.values():
        row["big/10"] = common.compare(row[f"{level} keys"], row["10 keys"])
        row["big/floor"] = common.compare(row[f"{level} keys"], row["floor"])
    return table


def measure_creates(args, small, big, level):
    """POST /keys on durable stores: ~100 stored keys (``small``) vs ``level`` (``big``)."""
    request = Req("POST", "/keys", MASTER_AUTH, NEW_KEY_BODY)
    small_label, big_label = f"~{stored_keys(small.port)} keys", f"{level} keys"
    targets = {small_label: (small, request), big_label: (big, request)}
    expected = {small_label: {201}, big_label: {201}}
    table = interleaved(args, targets, "POST /keys", client_labels(args, with_wrk=False),
                        expected, count=args.creates)
    for row in table.values():
        row["big/small"] = common.compare(row[big_label], row[small_label])
    table["stored_after"] = {small_label: stored_keys(small.port),
                             big_label: stored_keys(big.port)}
    return table


def start_floor_proxy(args, workdir, upstream):
    port = common.free_port()
    return common.Server("floor-proxy", [args.python, STUB, "proxy", "--port", port,
                                         "--upstream", upstream], port, ready_path="/",
                         log_dir=workdir)


GUARD_SEARCH = "/indexes/movies/search"


def guard_shapes(args, port):
    """The request shapes the guard target covers, with a key for `movies` (search and
    documents.get) and a tenant token of that key whose rule adds a filter (a rewrite)."""
    status, body = call(port, "POST", "/keys", MASTER_AUTH, json.dumps(
        {"actions": ["search", "documents.get"], "indexes": ["movies"], "expiresAt": None}))
    if status != 201:
        raise RuntimeError(f"POST /keys answered {status}: {body}")
    token = subprocess.run(
        [args.python, args.searchkeys, "token", "--api-key", body["key"], "--uid", body["uid"],
         "--rules", json.dumps({"movies": {"filter": "genre = comedy"}})],
        capture_output=True, text=True, check=True).stdout.strip()
    key = {"Authorization": f"Bearer {body['key']}", "Content-Type": "application/json"}
    tenant = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    shapes = {
        "GET search": Req("GET", GUARD_SEARCH + "?q=a", key),
        "POST search": Req("POST", GUARD_SEARCH, key, json.dumps({"q": "a", "limit": 20})),
        "multi-search": Req("POST", "/multi-search", key,
                            json.dumps({"queries": [{"indexUid": "movies", "q": "a"}]})),
        "tenant token search": Req("POST", GUARD_SEARCH, tenant, json.dumps({"q": "a"})),
        "GET document": Req("GET", "/indexes/movies/documents/1", key),
        "GET documents": Req("GET", "/indexes/movies/documents", key),
    }
    if args.quick:  # the plain search and the one that is rewritten
        shapes = {name: shapes[name] for name in ("POST search", "tenant token search")}
    return shapes


def measure_guard(args, workdir):
    """Each request shape through the guard, through the card's floor (a bare http.server +
    http.client proxy, no authorization) and directly to the stub, interleaved."""
    stub = start_stub(args, "search", workdir)
    upstream = f"http://{common.HOST}:{stub.port}"
    floor = start_floor_proxy(args, workdir, upstream)
    guard = start_searchkeys(args, workdir, upstream=upstream)
    labels = [f"python c={c}" for c in args.guard_concurrency]
    if not args.no_wrk:
        labels += [f"wrk c={c}" for c in args.guard_concurrency]
    try:
        result = {"shapes": {}}
        for shape, request in guard_shapes(args, guard.port).items():
            status, body = call(guard.port, request.method, request.path, request.headers,
                                request.body)
            if status != 200:
                raise RuntimeError(f"guarded {shape} answered {status}: {body}")
            targets = {"direct": (stub, request), "floor": (floor, request),
                       "guarded": (guard, request)}
            table = interleaved(args, targets, shape, labels,
                                {"direct": {200}, "floor": {200}, "guarded": {200}},
                                count=args.guard_requests)
            for row in table.values():
                row["guarded/floor"] = common.compare(row["guarded"], row["floor"])
                row["guarded/direct"] = common.compare(row["guarded"], row["direct"])
                row["added_p50_ms"] = round(row["guarded"]["p50_ms"] - row["direct"]["p50_ms"],
                                            3)
                row["added_p50_vs_floor_ms"] = round(
                    row["guarded"]["p50_ms"] - row["floor"]["p50_ms"], 3)
            result["shapes"][shape] = table
        result["guard_rss_mib"] = round((guard.status() or {}).get("rss_kib", 0) / 1024, 1)
        result["load_average"] = common.load_average()
        return result
    finally:
        guard.stop()
        floor.stop()
        stub.stop()


def core_count():
    """The cores this process may run on (what `serve --workers auto` starts)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def connections_held(port, pids):
    """{pid: established connections to ``port`` it holds}, read from Linux's /proc; None
    elsewhere."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                for row in list(rows)[1:]:
                    fields = row.split()
                    if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                        inodes.add("socket:[%s]" % fields[9])
        except OSError:
            return None
    held = {}
    for pid in pids:
        fds = f"/proc/{pid}/fd"
        held[pid] = sum(os.readlink(f"{fds}/{fd}") in inodes for fd in os.listdir(fds))
    return held


def connections_to_every_worker(server, workers):
    """Keep-alive connections of which every worker of ``server`` holds at least one."""
    health = common.build_request("GET", "/health")
    connections = []
    while len(connections) < 64 * workers:
        for _ in range(2 * workers):
            connection = common.Connection(server.port)
            connection.exchange(health)
            connections.append(connection)
        held = connections_held(server.port, common.proc_children(server.pid))
        if held is None or (len(held) == workers and all(held.values())):
            return connections, held
    raise RuntimeError(f"{len(connections)} connections did not reach every worker: {held}")


def time_to_every_worker(server, workers, trials):
    """Seconds from a key's creation (its 201, from whichever worker took the POST) until a
    request with it succeeds on a connection of every worker, ``trials`` times."""
    connections, held = connections_to_every_worker(server, workers)
    times = []
    try:
        for _ in range(trials):
            status, body = call(server.port, "POST", "/keys", MASTER_AUTH, json.dumps(
                {"actions": ["search"], "indexes": ["movies"], "expiresAt": None}))
            created = time.monotonic()
            if status != 201:
                raise RuntimeError(f"POST /keys answered {status}: {body}")
            probe = Req("GET", GUARD_SEARCH + "?q=a",
                        {"Authorization": f"Bearer {body['key']}"}).encode()
            waiting = list(connections)
            while waiting:
                waiting = [c for c in waiting if c.exchange(probe)[0] != 200]
                if time.monotonic() - created > 10:
                    raise RuntimeError("a new key had not reached every worker after 10 s")
            times.append(time.monotonic() - created)
    finally:
        for connection in connections:
            connection.close()
    times.sort()
    return {"trials": trials, "p50_ms": round(times[len(times) // 2] * 1000, 1),
            "max_ms": round(times[-1] * 1000, 1), "connections": len(connections),
            "per_worker": sorted(held.values()) if held else "unknown (no /proc)"}


def measure_workers(args, workdir):
    """serve --workers 1, 2 and auto behind one port each (a store each): a keyed GET search
    through the guard to the stub backend, interleaved between them; then how long a key
    created through one worker takes to be accepted by every worker."""
    cores = core_count()
    counts = sorted({1, 2, cores})
    stub = start_stub(args, "search", workdir)
    upstream = f"http://{common.HOST}:{stub.port}"
    servers = {}
    try:
        targets = {}
        for count in counts:
            name = "1 worker" if count == 1 else f"{count} workers"
            servers[count] = server = start_searchkeys(
                args, workdir, workdir / f"keys-workers-{count}.json", upstream, count)
            status, body = call(server.port, "POST", "/keys", MASTER_AUTH, json.dumps(
                {"actions": ["search"], "indexes": ["movies"], "expiresAt": None}))
            if status != 201:
                raise RuntimeError(f"POST /keys answered {status}: {body}")
            request = Req("GET", GUARD_SEARCH + "?q=a", {"Authorization": f"Bearer {body['key']}"})
            time.sleep(1)  # the key reaches every worker (the figure is measured below)
            targets[name] = (server, request)
        labels = ["python c=8", "python c=32"] + ([] if args.no_wrk else ["wrk c=32"])
        table = interleaved(args, targets, "GET search, workers", labels,
                            {name: {200} for name in targets}, count=args.guard_requests)
        for row in table.values():
            for name in targets:  # the CPU figure would be the supervisor's alone
                row[name].pop("server_cpu_us_per_req", None)
                if name != "1 worker":
                    row[f"{name}/1 worker"] = common.compare(row[name], row["1 worker"])
        propagation = {f"{count} workers": time_to_every_worker(servers[count], count,
                                                               args.workers_trials)
                       for count in counts if count > 1}
        return {"cores": cores, "counts": counts, "search": table,
                "key_to_every_worker": propagation, "load_average": common.load_average()}
    finally:
        for server in servers.values():
            server.stop()
        stub.stop()


def start_nginx(workdir, name, listen, searchkeys, backend):
    """nginx from the README's recipe (searchkeys-nginx.conf.example), in its own prefix;
    with ``searchkeys`` None, the same proxy without the auth_request lines (nginx direct)."""
    prefix = workdir / name
    prefix.mkdir()
    for folder in (workdir, prefix):
        folder.chmod(0o755)  # nginx's workers may run as another user
    text = (common.ROOT / "searchkeys-nginx.conf.example").read_text()
    if searchkeys is None:  # without what goes to searchkeys, asks it or relays its refusals
        text = re.sub(r"\n        location (~ \^/\(keys|@searchkeys_).*?\n        \}", "", text,
                      flags=re.S)
        text = "\n".join(line for line in text.splitlines()
                         if "auth_request" not in line and "error_page" not in line)
    for placeholder, value in (("listen", f"{common.HOST}:{listen}"),
                               ("searchkeys", searchkeys or f"{common.HOST}:9"),
                               ("backend", backend), ("backend_key", UPSTREAM_KEY)):
        text = text.replace("{{%s}}" % placeholder, value)
    (prefix / "nginx.conf").write_text("daemon off;\n" + text)
    return common.Server(name, [NGINX, "-p", prefix, "-c", prefix / "nginx.conf", "-e", "stderr"],
                         listen, ready_path="/health", log_dir=workdir)


def measure_nginx(args, workdir):
    """A search through nginx and the recipe (via searchkeys) vs through nginx alone."""
    stub = start_stub(args, "search", workdir)
    backend = f"{common.HOST}:{stub.port}"
    guard = start_searchkeys(args, workdir, upstream=f"http://{backend}")  # searches go through it
    servers = [stub, guard]
    try:
        servers.append(start_nginx(workdir, "nginx-direct", common.free_port(), None, backend))
        servers.append(start_nginx(workdir, "nginx-searchkeys", common.free_port(),
                                   f"{common.HOST}:{guard.port}", backend))
        key = new_search_key(guard.port)
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        request = Req("POST", SEARCH_PATH, headers, SEARCH_BODY)
        targets = {"nginx direct": (servers[2], request),
                   "nginx+searchkeys": (servers[3], request)}
        table = interleaved(args, targets, "search via nginx", client_labels(args),
                            {"nginx direct": {200}, "nginx+searchkeys": {200}})
        for row in table.values():
            row["guarded/direct"] = common.compare(row["nginx+searchkeys"], row["nginx direct"])
        return table
    finally:
        for server in reversed(servers):
            server.stop()


HELD_IDLE, HELD_TRICKLING = 5000, 500


def _raise_open_files(wanted):
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (
            wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard))


def _new_client_latencies(port, samples):
    """ms of GET /health on a fresh connection each, `samples` times, sorted."""
    import socket
    request = b"GET /health HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n"
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        with socket.create_connection((common.HOST, port), timeout=30) as sock:
            sock.sendall(request)
            data = b""
            while not data.endswith(b'{"status":"available"}'):
                piece = sock.recv(4096)
                if not piece:
                    break
                data += piece
        times.append((time.perf_counter() - started) * 1000)
    return sorted(times)


def _latency_row(times):
    return {"samples": len(times), "p50_ms": round(common.percentile(times, 50), 2),
            "p99_ms": round(common.percentile(times, 99), 2), "max_ms": round(times[-1], 2)}


def _hold(port, idle, trickling):
    """Open `idle` keep-alive connections (one answered request each) and `trickling` ones
    that sent half a head; returns (sockets, trickle thread's stop event)."""
    import selectors
    import socket
    import threading
    held, selector = [], selectors.DefaultSelector()
    for _ in range(idle):
        sock = socket.create_connection((common.HOST, port), timeout=30)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: b\r\n\r\n")
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        held.append(sock)
    waiting, deadline = len(held), time.monotonic() + 120
    while waiting and time.monotonic() < deadline:
        for key, _ in selector.select(1.0):
            if key.fileobj.recv(4096).endswith(b'{"status":"available"}'):
                selector.unregister(key.fileobj)
                waiting -= 1
    selector.close()
    slow = []
    for _ in range(trickling):
        sock = socket.create_connection((common.HOST, port), timeout=30)
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        slow.append(sock)
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.5):
            for sock in slow:
                try:
                    sock.send(b"a")
                except OSError:
                    pass
    threading.Thread(target=trickle, daemon=True).start()
    return held + slow, stop, waiting


def measure_held(args, workdir):
    """A new client's latency with nothing held, then with HELD_IDLE idle keep-alive and
    HELD_TRICKLING trickling connections held against the guard."""
    _raise_open_files(HELD_IDLE + HELD_TRICKLING + 1000)
    samples = 100 if args.quick else 400
    server = start_searchkeys(args, workdir)
    result = {"samples": samples}
    try:
        result["nothing held"] = _latency_row(_new_client_latencies(server.port, samples))
        held, stop, unanswered = _hold(server.port, HELD_IDLE, HELD_TRICKLING)
        try:
            time.sleep(1.0)
            label = f"{HELD_IDLE} idle + {HELD_TRICKLING} trickling held"
            result[label] = _latency_row(_new_client_latencies(server.port, samples))
            result[label]["idle_unanswered"] = unanswered
            status = server.status() or {}
            result[label]["threads"] = status.get("threads")
            result[label]["rss_mib"] = round(status.get("rss_kib", 0) / 1024, 1)
            result["load_average"] = common.load_average()
        finally:
            stop.set()
            for sock in held:
                sock.close()
    finally:
        server.stop()
    log("new client while connections are held:", result)
    return result


def idle_rss_mib(server):
    time.sleep(1.0)
    return round((server.status() or {}).get("rss_kib", 0) / 1024, 1)


BARE_SERVER = """import json, subprocess, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "available"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def measure_memory(args, workdir):
    """Idle RSS (10 keys in memory, no upstream) next to a bare ThreadingHTTPServer +
    subprocess + json script on the same interpreter, alternated, median of >= 3 starts:
    searchkeys.py copied and run as a script (compiled at every start), and the installed form,
    the module imported from its bytecode cache (`python3 -m py_compile`), as the unit runs it."""
    bare = workdir / "bare_server.py"
    bare.write_text(BARE_SERVER)
    installed = workdir / "installed" / "searchkeys.py"
    installed.parent.mkdir()
    shutil.copy(args.searchkeys, installed)
    subprocess.run([args.python, "-m", "py_compile", str(installed)], check=True)
    as_module = ("import sys; sys.path.insert(0, %r); import searchkeys; "
                 "sys.exit(searchkeys.main())" % str(installed.parent))
    serve = ["serve", "--host", common.HOST, "--master-key", MASTER_KEY, "--port"]
    starts = {"bare http.server script": lambda port: [args.python, bare, port],
              "searchkeys.py copied, run as a script": lambda port: [
                  args.python, args.searchkeys] + serve + [port],
              "searchkeys imported from its bytecode (installed)": lambda port: [
                  args.python, "-c", as_module] + serve + [port]}
    samples = {name: [] for name in starts}
    for _ in range(max(3, args.repeat)):
        for name, argv in starts.items():
            port = common.free_port()
            server = common.Server(name, argv(port), port, ready_path="/health",
                                   log_dir=workdir)
            try:
                samples[name].append(idle_rss_mib(server))
            finally:
                server.stop()
    result = {name: {"median_mib": common.median(values), "samples_mib": values}
              for name, values in samples.items()}
    bare_mib = result["bare http.server script"]["median_mib"]
    for name in list(starts)[1:]:
        result[name]["over_bare_mib"] = round(result[name]["median_mib"] - bare_mib, 1)
    result["load_average"] = common.load_average()
    log("idle RSS:", result)
    return result


# --------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------

def evaluate_targets(args, result):
    targets = common.Targets(TARGETS_DOC)
    add = targets.add

    big = f"{args.keys} keys"
    for label, row in result.get("authorize", {}).get(str(args.keys), {}).items():
        if row["10 keys"]["rps"] and row[big]["rps"]:
            slowdown = ratio(row["10 keys"]["rps"], row[big]["rps"])
            add("authorize_scaling", f"authorize {label} rps@10 / rps@{args.keys}", slowdown,
                "< 1.2", slowdown < 1.2)
    for label, row in result.get("creates", {}).items():
        if label.startswith("python"):
            kept = row["big/small"]["rps"]
            add("create_scaling", f"POST /keys {label} rate@{args.keys} / rate@~100", kept,
                ">= 0.8", kept >= 0.8)
    startup = result.get("startup_ms", {}).get(big)
    if startup:
        add("startup_100k", f"startup ms with {args.keys} keys (median wall)",
            startup["median_ms"], "< 2000", startup["median_ms"] < 2000)
    for shape, table in result.get("guard", {}).get("shapes", {}).items():
        for label, row in table.items():
            if label == "python c=1":
                added = row["added_p50_vs_floor_ms"]
                add("guard_p50", f"{shape}: added p50 ms at c=1 (guarded - floor)", added,
                    "< 0.3", added < 0.3)
            r = (row["guarded/floor"] or {}).get("rps")
            if r is not None:
                add("guard_rps", f"{shape} {label} rps guarded/floor", r, ">= 0.9", r >= 0.9)
    for label in ("python c=8", "wrk c=8"):
        row = result.get("nginx", {}).get(label)
        if row:
            r = row["guarded/direct"]["rps"]
            add("nginx_rps", f"{label} rps nginx+searchkeys / nginx direct", r, ">= 0.8",
                r >= 0.8)
    for name, row in result.get("memory", {}).items():
        if isinstance(row, dict) and "over_bare_mib" in row:
            most = 8 if "script" in name else 6
            add("idle_rss", f"idle RSS MiB over the bare script: {name}", row["over_bare_mib"],
                "<= %d" % most, row["over_bare_mib"] <= most)
    held = result.get("held_connections", {}).get(
        f"{HELD_IDLE} idle + {HELD_TRICKLING} trickling held")
    if held:
        add("held_new_client", "new client p99 ms while connections are held", held["p99_ms"],
            "< 1000", held["p99_ms"] < 1000)
    return targets


# --------------------------------------------------------------------------------------------

def main():
    args = parse_args()
    result = common.new_result("searchkeys", args, (
        "quick", "repeat", "requests", "slices", "creates", "keys", "wrk_seconds", "no_wrk",
        "concurrency", "fill_concurrency", "client_procs", "python"))
    workdir = Path(tempfile.mkdtemp(prefix="bench-searchkeys-"))
    stores = {name: workdir / f"keys-{name}.json" for name in ("small", "mid", "big")}
    big_label = f"{args.keys} keys"
    deadline = time.monotonic() + args.fill_budget
    fill_log = []
    servers = []

    def start(store):
        server = start_searchkeys(args, workdir, store)
        servers.append(server)
        return server

    try:
        if args.held_only:
            result["held_connections"] = measure_held(args, workdir)
            return common.finish_result("searchkeys-held", result,
                                        evaluate_targets(args, result))
        if args.workers_only:
            result["workers"] = measure_workers(args, workdir)
            return common.finish_result("searchkeys-workers", result,
                                        evaluate_targets(args, result))
        if args.guard_only:
            result["guard"] = measure_guard(args, workdir)
            if NGINX:
                result["nginx"] = measure_nginx(args, workdir)
            return common.finish_result("searchkeys-guard", result,
                                        evaluate_targets(args, result))
        result["startup_ms"] = {"empty store": common.measure_startup(
            lambda: start_searchkeys(args, workdir, stores["big"]), args.repeat)}
        log("startup, empty store:", result["startup_ms"]["empty store"])
        result["memory"] = measure_memory(args, workdir)
        floor = start_stub(args, "floor", workdir)
        servers.append(floor)
        small = start(stores["small"])
        fill(args, small, 9, deadline, fill_log)
        small_key = new_search_key(small.port)
        result["idle_rss_mib"] = {"10 keys": idle_rss_mib(small)}
        mid = start(stores["mid"])
        fill(args, mid, 100, deadline, fill_log)
        if args.quick:  # written in the store's format: an API fill costs O(keys squared)
            bench_store.write_store(stores["big"], args.keys - 1)
        big = start(stores["big"])
        result["authorize"], result["rss_mib_running"] = {}, {}
        for level in sorted({10000, args.keys}):
            fill(args, big, level - 1, deadline, fill_log)
            big_key = new_search_key(big.port)  # the newest key: last in insertion order
            result["rss_mib_running"][f"{level} keys"] = idle_rss_mib(big)
            result["authorize"][str(level)] = measure_authorize(
                args, (small, small_key), (big, big_key), (floor, small_key), level)
        result["creates"] = measure_creates(args, mid, big, args.keys)
        result["fill"] = fill_log
        final_count = stored_keys(big.port)
        big.stop()
        mid.stop()
        result["store_bytes"] = sum(p.stat().st_size for p in workdir.glob("keys-big.json*"))
        result["stored_keys_final"] = final_count
        result["startup_ms"][big_label] = common.measure_startup(
            lambda: start_searchkeys(args, workdir, stores["big"]), args.repeat)
        log(f"startup with {final_count} keys:", result["startup_ms"][big_label])
        restarted = start(stores["big"])
        result["idle_rss_mib"][f"{final_count} keys, fresh start"] = full = \
            idle_rss_mib(restarted)
        per = (full - result["idle_rss_mib"]["10 keys"]) * 100000 / (final_count - 10)
        result["memory_mib_per_100k_keys"] = round(per, 1)
        for server in (restarted, small, floor):
            server.stop()
        result["guard"] = measure_guard(args, workdir)
        if NGINX:
            result["nginx"] = measure_nginx(args, workdir)
        result["held_connections"] = measure_held(args, workdir)
        result["workers"] = measure_workers(args, workdir)
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    common.finish_result("searchkeys", result, evaluate_targets(args, result))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        log("interrupted; servers stopped")
        sys.exit(130)
