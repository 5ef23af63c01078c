"""Benchmark: what run history costs webhookd.py, and whether 10,000 runs stay in bounds.

    python3 bench/bench_runs.py [--quick] [--repeat N] [--requests N] [--concurrency 1,8]

Starts three webhookd.py processes on 127.0.0.1 with the same hooks file: history off
(``-runs-keep 0``), in memory (the default) and on disk (``-runs-dir``).  Then:

- awaited-command throughput (``include-command-output-in-response``, /bin/true) at each
  concurrency, the three servers measured in alternating slices (ABBA) so that load from elsewhere
  hits all alike; medians of ``--repeat`` runs; ratios memory/off and disk/off (target >= 0.95);
- the record alone, in this process: ``RunStore`` open (on disk: the file written before the
  id is handed out), started and ended for ``--record-runs`` runs, in memory and on disk in
  alternating rounds, CPU time of the whole process (its disk writer thread included) per run:
  steadier than the servers' CPU, where a run's record is a few percent of a command start;
- 10,000 awaited runs of a hook printing 2,000 bytes into a store bounded by
  ``-runs-max-bytes 4194304`` (``-runs-keep 100000``, so the size bound is what applies): the
  size of the -runs-dir folder afterwards, the number of records kept, and the in-memory
  server's RSS before and after.

Prints ONE JSON object and keeps a copy in bench/results/.  Progress goes to stderr.
"""
import argparse
import json
import sys
import tempfile
import time
import types
import urllib.request
from pathlib import Path

import common
from common import log, median, ratio

WEBHOOKD = common.ROOT / "webhookd.py"
HOOKS = [
    {"id": "exec-sync", "execute-command": "/bin/true", "include-command-output-in-response": True},
    {"id": "print-2k", "execute-command": "/bin/echo", "include-command-output-in-response": True,
     "pass-arguments-to-command": [{"source": "string", "name": "x" * 1999}]},
]
MODES = {"off": ["-runs-keep", "0"], "memory": [], "disk": None}  # disk: -runs-dir, per run
BOUND = 4 * 1024 * 1024


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="repeat 1, 400 requests, 2,000 runs")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1200, help="per server and concurrency")
    parser.add_argument("--slices", type=int, default=4)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--runs", type=int, default=10000, help="runs for the size check (0: "
                        "skip it)")
    parser.add_argument("--record-runs", type=int, default=2000,
                        help="runs per round of the in-process record cost (0: skip it)")
    parser.add_argument("--python", default=common.DEFAULT_PYTHON)
    args = parser.parse_args()
    if args.quick:
        args.repeat, args.requests, args.runs = 1, 400, 2000
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    return args


def start(args, workdir, mode, extra=()):
    port = common.free_port()
    flags = MODES[mode]
    if flags is None:
        flags = ["-runs-dir", str(workdir / ("runs-%d" % port))]
    argv = [args.python, WEBHOOKD, "-hooks", workdir / "hooks.json", "-ip", common.HOST,
            "-port", port, "-status-path", "/status", *flags, *extra]
    return common.Server(mode, argv, port, ready_path="/", log_dir=workdir)


def measure_throughput(args, servers):
    request = [common.build_request("GET", "/hooks/exec-sync")]
    raw = {}
    names = list(servers)
    for rep in range(args.repeat):
        for c in args.concurrency:
            parts = {name: [] for name in names}
            for k in range(args.slices):
                for name in names if k % 2 == 0 else names[::-1]:
                    server = servers[name]
                    parts[name].append(common.run_load(
                        server.port, request, args.requests // args.slices, c, 2, {200},
                        server.pid, keep_raw=True))
            for name in names:
                fig = common.summarize(parts[name], {200})
                raw.setdefault((c, name), []).append(fig)
                log(f"rep {rep + 1} c={c} {name}: {fig['rps']} rps p50 {fig['p50_ms']} ms "
                    f"cpu {fig['server_cpu_us_per_req']} us/req errors {fig['errors']}")
    table = {}
    for c in args.concurrency:
        row = {name: {"rps": median([f["rps"] for f in raw[(c, name)]]),
                      "p50_ms": median([f["p50_ms"] for f in raw[(c, name)]]),
                      "server_cpu_us_per_req": median([f["server_cpu_us_per_req"]
                                                       for f in raw[(c, name)]])}
               for name in names}
        for name in ("memory", "disk"):
            row[name + "/off rps"] = ratio(row[name]["rps"], row["off"]["rps"])
            row[name + "/off cpu"] = ratio(row[name]["server_cpu_us_per_req"],
                                           row["off"]["server_cpu_us_per_req"])
        table[str(c)] = row
    return table


def measure_record_cost(args, workdir):
    """CPU µs per run of RunStore open + started + ended (what a run's record adds to it), in
    memory and on disk (every record saved again when it ends), alternating, median of 5."""
    sys.path.insert(0, str(common.ROOT))
    import webhookd
    request = types.SimpleNamespace(remote_addr="127.0.0.1:40000", id="1")
    outcome = types.SimpleNamespace(started=True, returncode=0, timed_out=False)
    samples = {"memory": [], "disk": []}
    for rep in range(5):
        for mode in ("memory", "disk") if rep % 2 == 0 else ("disk", "memory"):
            folder = tempfile.mkdtemp(dir=workdir) if mode == "disk" else None
            store = webhookd.RunStore(10 ** 6, 1 << 40, 65536, folder)
            store.start()
            before = time.process_time()
            for i in range(args.record_runs):
                record = store.open("h", request)
                store.started(record)
                store.ended(record, outcome, False)
                if i % 50 == 49:
                    time.sleep(0.001)  # the writer gathers its batches as in a daemon
            store.flush(timeout=60.0)
            samples[mode].append((time.process_time() - before) * 1e6 / args.record_runs)
    result = {mode: {"cpu_us_per_run": round(median(values), 1),
                     "samples": [round(v) for v in values]} for mode, values in samples.items()}
    log(f"record cost in process: {result}")
    return result


def folder_bytes(path):
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


def measure_bounds(args, workdir):
    """--runs awaited runs printing 2,000 bytes each into a store bounded at BOUND."""
    extra = ["-runs-keep", "100000", "-runs-max-bytes", str(BOUND)]
    result = {}
    for mode in ("disk", "memory"):
        server = start(args, workdir, mode, extra)
        try:
            rss_before = server.status().get("rss_kib")
            fig = common.run_load(server.port, [common.build_request("GET", "/hooks/print-2k")],
                                  args.runs, 8, 2, {200}, server.pid)
            time.sleep(2.0)  # the disk writer catches up
            with urllib.request.urlopen("http://%s:%d/status/runs?limit=10000"
                                        % (common.HOST, server.port), timeout=30) as answer:
                kept = len(json.load(answer))
            entry = {"runs": args.runs, "rps": fig["rps"], "errors": fig["errors"],
                     "records_kept": kept, "bound_bytes": BOUND,
                     "rss_kB_before": rss_before, "rss_kB_after": server.status().get("rss_kib")}
            if mode == "disk":
                folder = server.argv[server.argv.index("-runs-dir") + 1]
                entry["folder_bytes"] = folder_bytes(folder)
                entry["within_bound"] = entry["folder_bytes"] <= BOUND
            result[mode] = entry
            log(f"{mode}: {entry}")
        finally:
            server.stop()
    return result


def main():
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-runs-") as tmp:
        workdir = Path(tmp)
        (workdir / "hooks.json").write_text(json.dumps(HOOKS))
        servers = {mode: start(args, workdir, mode) for mode in MODES}
        try:
            throughput = measure_throughput(args, servers)
        finally:
            for server in servers.values():
                server.stop()
        bounds = measure_bounds(args, workdir) if args.runs else {"disk": {}}
        record_cost = measure_record_cost(args, workdir) if args.record_runs else {}
    worst = min(row[k] for row in throughput.values() for k in ("memory/off rps", "disk/off rps"))
    result = {"bench": "runs", "machine": common.machine_description(),
              "args": {k: v for k, v in vars(args).items()},
              "awaited_throughput": throughput, "bounds": bounds, "record_cost": record_cost,
              "targets": {"recording costs < 5% of awaited throughput": worst >= 0.95,
                          "10,000 runs within -runs-max-bytes on disk":
                          bounds["disk"].get("within_bound")}}
    if record_cost:
        targets = result["targets"]
        targets["a record in memory <= 100 µs CPU per run (in process)"] = \
            record_cost["memory"]["cpu_us_per_run"] <= 100
        targets["a record on disk <= 500 µs CPU per run (in process)"] = \
            record_cost["disk"]["cpu_us_per_run"] <= 500
    common.write_result("runs", result)


if __name__ == "__main__":
    main()
