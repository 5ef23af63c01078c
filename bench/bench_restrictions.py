"""Restrictions: what they cost per guarded request, and what the counters weigh.

    python3 bench/bench_restrictions.py [--requests 3000] [--rounds 5]

CPU: a `searchkeys.py serve --upstream` process in front of a stand-in backend gets the same
GET search with two keys, one with no restrictions and one with every restriction (rates too
high to refuse, its IP range and referrer matched, a hit cap that rewrites the query). The
server's own CPU time (user + system, from /proc/PID/stat; Linux only) is divided by the
requests. Rounds alternate the keys so that the noise of a shared machine falls on both;
the median of the rounds is reported.

Memory: tracemalloc of a Counters LRU filled with 100,000 distinct clients of one key, the
default bound (`--max-clients`), the way the Gate keys them.
"""
import argparse
import http.client
import json
import os
import statistics
import sys
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import searchkeys  # noqa: E402
from support import SEARCHKEYS, Daemon, answer_json, free_port, python_cmd, serve_in_thread  # noqa: E402,E501

MASTER = "bench-restrictions-master-key-0123"
EVERYTHING = {"rateLimit": {"perIp": "999999999/second", "perKey": "999999999/second"},
              "allowedReferrers": ["https://example.com/*", "*.example.org"],
              "allowedIps": ["10.0.0.0/8", "127.0.0.0/8"], "maxHitsPerQuery": 10}


class Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # head and body leave at once, no delayed-ACK stall

    def do_GET(self):
        answer_json(self, b'{"hits":[]}')

    def log_message(self, *args):
        pass


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drive(port, key, count):
    connection = http.client.HTTPConnection("127.0.0.1", port)
    headers = {"Authorization": "Bearer " + key, "Origin": "https://example.com"}
    for _ in range(count):
        connection.request("GET", "/indexes/movies/search?q=a&limit=50", headers=headers)
        response = connection.getresponse()
        response.read()
        assert response.status == 200, response.status
    connection.close()


def create_key(port, restrictions):
    connection = http.client.HTTPConnection("127.0.0.1", port)
    headers = {"Authorization": "Bearer " + MASTER, "Content-Type": "application/json"}
    connection.request("POST", "/keys", json.dumps(
        {"actions": ["search"], "indexes": ["*"], "expiresAt": None}), headers)
    key = json.loads(connection.getresponse().read())
    if restrictions:
        connection.request("PUT", "/keys/%s/restrictions" % key["uid"],
                           json.dumps(restrictions), headers)
        assert connection.getresponse().read()
    connection.close()
    return key["key"]


def cpu_per_request(requests, rounds):
    backend = serve_in_thread(Stub)
    port = free_port()
    argv = python_cmd(SEARCHKEYS, "serve", "--port", port, "--master-key", MASTER, "--upstream",
                      backend.url)
    results = {"none": [], "every": []}
    with Daemon(argv, port, timeout=30.0) as daemon:
        keys = {"none": create_key(port, None), "every": create_key(port, EVERYTHING)}
        for name, key in keys.items():
            drive(port, key, 200)  # warm up
        for _ in range(rounds):
            for name, key in keys.items():
                before = cpu_seconds(daemon.proc.pid)
                drive(port, key, requests)
                results[name].append((cpu_seconds(daemon.proc.pid) - before) / requests)
    backend.shutdown()
    for name, values in results.items():
        print("  rounds, %s: %s us" % (name, " ".join("%.0f" % (v * 1e6) for v in values)))
    return {name: statistics.median(values) for name, values in results.items()}


def added_in_process(calls=20000):
    """CPU per call of what restrictions add to a request (Gate.check, the decision and its
    value steps, no sockets) for each key: (none, every) in seconds. Steadier than the
    server's figures."""
    import email.message
    store = searchkeys.KeyStore(MASTER)
    keys = {}
    for name, restrictions in (("none", None), ("every", EVERYTHING)):
        key = store.create({"actions": ["search"], "indexes": ["*"], "expiresAt": None})
        if restrictions:
            key = store.restrict(key.uid, searchkeys.Restrictions.from_json(restrictions))
        keys[name] = key
    gate = searchkeys.Gate(searchkeys.Guard(store, MASTER))
    route, _, _ = searchkeys.match_route("GET", searchkeys.path_segments("/indexes/movies/search"))
    results = {}
    for name, key in keys.items():
        headers = email.message.Message()
        headers["Authorization"] = "Bearer " + key.value
        headers["Origin"] = "https://example.com"
        request = searchkeys.Request("GET", "/indexes/movies/search?q=a&limit=50", headers, None,
                                     peer="127.0.0.1")
        started = time.process_time()
        for _ in range(calls):
            principal = gate.check(request, route.actions, "movies")
            value = {"q": "a", "limit": 50}
            for step in searchkeys.decide(route, principal, "movies").value_steps:
                value = step.apply(value)
        results[name] = (time.process_time() - started) / calls
    return results["none"], results["every"]


def counter_memory(clients=100000):
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    counters = searchkeys.Counters(clients)
    rate = searchkeys.parse_rate("60/minute")
    uid = "6062abda-a5aa-4414-ac91-ecd7944c0f8d"
    for n in range(clients):
        address = searchkeys.parse_address("10.%d.%d.%d" % (n >> 16, (n >> 8) & 255, n & 255))
        counters.take([((uid, searchkeys.counter_client(address)), rate)])
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return len(counters), used


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    count, used = counter_memory()
    print("counters: %d clients held in %.1f MiB (%.0f bytes each)"
          % (count, used / 2 ** 20, used / count))
    cpu = cpu_per_request(args.requests, args.rounds)
    print("server CPU per guarded GET search: no restrictions %.1f us, every restriction "
          "%.1f us (%+.1f%%)" % (cpu["none"] * 1e6, cpu["every"] * 1e6,
                                 (cpu["every"] / cpu["none"] - 1) * 100))
    none, every = added_in_process()
    print("in process, Gate.check + cap_hits: no restrictions %.1f us, every restriction "
          "%.1f us: %.1f us added, %+.1f%% of the server's CPU per request without them"
          % (none * 1e6, every * 1e6, (every - none) * 1e6, (every - none) / cpu["none"] * 100))


if __name__ == "__main__":
    main()
