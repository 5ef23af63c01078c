"""Benchmark: webhookd.py against the design card's floor, with adnanh/webhook 2.8.0 recorded.

    python3 bench/bench_webhookd.py [--quick] [--repeat N] [--runners ours,peer,floor]

Starts, on 127.0.0.1, webhookd.py ("ours") and /usr/bin/webhook ("peer") with the same hooks file
and flags (``-hooks F -hotreload -ip 127.0.0.1 -port N``), plus ``stub_server.py floor`` (the card's
floor: a bare ``http.server`` + ``subprocess`` runner with no logic, keep-alive, TCP_NODELAY, one
write per answer). The targets compare ours with the floor; Go's figures are recorded, not
targets. Then, with the
same load for each, measured in the same run and interleaved so that noise hits all alike:

- throughput and p50/p99/max latency at each concurrency for four scenarios: a command awaited
  (``include-command-output-in-response``), the same in default async mode, an unknown id (404),
  a rule mismatch; first a bounded number of keep-alive requests from the Python client, then wrk
  for a fixed short duration (when wrk is installed);
- startup time (spawn → first answer), idle CPU and RSS, RSS after the load and peak RSS (VmHWM);
- hot-reload latency: the hooks file rewritten in place → the new hook id answers 200;
- crowded: a new client's p50/p99 latency (connect to whole answer, a 404) while 5,000 idle
  keep-alive and 500 header-trickling connections are held, on a fresh server of each;
- background: 1,000 triggers of a hook answered at once while its 2-second command runs
  (upstream's default): time until the last command has finished, and the server's peak
  threads, commands (child processes) and RSS meanwhile, on a fresh server of each.

Prints ONE JSON object (figures, ratios ours/peer and ours/floor, targets met or missed) and keeps a
copy in bench/results/. Progress goes to stderr. Medians of ``--repeat`` runs.
"""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
from common import log, median, ratio

WEBHOOKD = common.ROOT / "webhookd.py"
PEER_BIN = shutil.which("webhook") or "/usr/bin/webhook"
STUB = common.BENCH_DIR / "stub_server.py"

# The hooks of webhook.md §5: one awaited command, one async command, one rule never satisfied.
HOOKS = [
    {"id": "exec-sync", "execute-command": "/bin/true", "include-command-output-in-response": True},
    {"id": "exec-async", "execute-command": "/bin/true"},
    {"id": "mismatch", "execute-command": "/bin/true",
     "trigger-rule": {"match": {"type": "value", "value": "never-sent",
                                "parameter": {"source": "url", "name": "token"}}}},
]

# name -> (path, expected statuses, what the floor answers there: None where it has no peer)
SCENARIOS = {
    "exec-sync": ("/hooks/exec-sync", {200}, {200}),
    "exec-async": ("/hooks/exec-async", {200}, {200}),
    "not-found": ("/hooks/no-such-hook", {404}, {404}),
    "mismatch": ("/hooks/mismatch?token=wrong", {200}, {404}),
}

TARGETS_DOC = {
    "awaited": "awaited /bin/true throughput at c=8 and c=32 >= 0.9x the floor",
    "floor": "404 and rules-not-met throughput at c=8 and c=32 >= 0.9x the floor",
    "max40": "no cheap request slower than 40 ms at c=1",
    "reload": "hot-reload median < 250 ms",
    "idle_cpu": "idle CPU < 1% (with -hotreload)",
    "idle_rss": "idle RSS within 6 MiB of the floor's (a bare http.server + subprocess + json "
                "script on the same interpreter), measured in the same window",
    "crowded": "a new client's p99 < 1 s while 5,000 idle and 500 trickling clients are held",
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="short run: repeat 1, 300 requests, 1 s wrk, 3 reload samples")
    common.add_load_arguments(parser, 2000, "1,8,32", "webhookd.py and the floor")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    parser.add_argument("--runners", default="ours,peer,floor",
                        help="any of ours,peer,floor (ours is skipped if webhookd.py is missing)")
    parser.add_argument("--reload-samples", type=int, help="hot-reload samples (5)")
    parser.add_argument("--idle-seconds", type=float, help="idle CPU window (10)")
    parser.add_argument("--idle-clients", type=int, default=5000,
                        help="idle keep-alive connections held in the crowded phase (0: skip it)")
    parser.add_argument("--trickling-clients", type=int, default=500,
                        help="connections trickling header bytes in the crowded phase")
    parser.add_argument("--crowded-requests", type=int,
                        help="new clients timed in the crowded phase (50; --quick 30)")
    parser.add_argument("--background-triggers", type=int, default=1000,
                        help="triggers of the 2-second hook in the background phase (0: skip)")
    parser.add_argument("--webhookd", default=str(WEBHOOKD), help="path of webhookd.py")
    parser.add_argument("--peer", default=PEER_BIN, help="path of adnanh/webhook")
    args = parser.parse_args()
    quick = args.quick
    common.apply_defaults(args, {
        "repeat": 1 if quick else 3, "requests": 300 if quick else 2000,
        "wrk_seconds": 1 if quick else 2, "reload_samples": 3 if quick else 5,
        "slices": 2 if quick else 4, "idle_seconds": 3.0 if quick else 10.0,
        "crowded_requests": 30 if quick else 100})
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    args.runners = [r for r in args.runners.split(",") if r]
    if "ours" in args.runners and not Path(args.webhookd).exists():
        log(f"{args.webhookd} missing: measuring peer and floor only")
        args.runners.remove("ours")
    return args


class Runners:
    """Argv and hooks file of each runner; starts fresh server processes."""

    def __init__(self, args, workdir):
        self.args = args
        self.workdir = workdir
        self.hooks_files = {}
        for name in ("ours", "peer"):
            path = workdir / f"hooks-{name}.json"
            write_hooks(path, HOOKS)
            self.hooks_files[name] = path
        self.hooks_files["ours-bytecode"] = self.hooks_files["ours"]  # idle and start only

    def argv(self, name, port, hooks_file=None):
        if name == "floor":
            return [self.args.python, STUB, "floor", "--port", port]
        program = {"ours": [self.args.python, self.args.webhookd], "peer": [self.args.peer],
                   "ours-bytecode": [self.args.python, "-c", self.from_bytecode()]}[name]
        return program + ["-hooks", hooks_file or self.hooks_files[name], "-hotreload",
                          "-ip", common.HOST, "-port", port]

    def from_bytecode(self):
        """A -c program running webhookd.py's main() from a compiled copy (``.pyc``), as a
        module would run: Python then neither compiles the file nor keeps its syntax tree,
        which a script run does (for information: what that costs in RSS and start time)."""
        folder = self.workdir / "bytecode"
        if not folder.exists():
            folder.mkdir()
            shutil.copy(self.args.webhookd, folder / "webhookd.py")
            subprocess.run([self.args.python, "-m", "py_compile", str(folder / "webhookd.py")],
                           check=True)
        return (f"import sys; sys.path.insert(0, {str(folder)!r}); import webhookd; "
                "sys.exit(webhookd.main())")

    def start(self, name, hooks_file=None):
        port = common.free_port()
        return common.Server(name, self.argv(name, port, hooks_file), port, ready_path="/",
                             log_dir=self.workdir)


def write_hooks(path, hooks):
    """In-place rewrite (open with truncation), the edit every watcher is expected to notice."""
    with open(path, "w") as f:
        json.dump(hooks, f, indent=1)


# --------------------------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------------------------

def measure_load(args, servers):
    """Python client, then wrk, for each scenario x concurrency x runner, repeated."""
    raw = {}  # (scenario, c, client, runner) -> [figures per repeat]
    for rep in range(args.repeat):
        for scenario in args.scenarios:
            path, expected, floor_status = SCENARIOS[scenario]
            names = [n for n in servers if n != "floor" or floor_status]
            names = names[rep % len(names):] + names[:rep % len(names)]  # rotate the order
            for c in args.concurrency:
                count = args.requests // 2 if scenario == "exec-sync" else args.requests
                figures = measure_sliced(args, servers, names, path, expected,
                                         floor_status, count, c)
                for name in names:
                    fig = figures[name]
                    raw.setdefault((scenario, c, "python", name), []).append(fig)
                    log(f"rep {rep + 1} {scenario} c={c} {name} python: {fig['rps']} rps "
                        f"p50 {fig['p50_ms']} p99 {fig['p99_ms']} max {fig['max_ms']} ms "
                        f"cpu {fig['server_cpu_us_per_req']} us/req "
                        f"unexpected {fig['unexpected']} errors {fig['errors']}")
                for name in names if not args.no_wrk else ():
                    server = servers[name]
                    fig = common.run_wrk(server.port, path, c, args.wrk_seconds)
                    raw.setdefault((scenario, c, "wrk", name), []).append(fig)
                    log(f"rep {rep + 1} {scenario} c={c} {name} wrk: {fig['rps']} rps "
                        f"p50 {fig['p50_ms']} p99 {fig['p99_ms']} ms")
                    settle(server)
    table = {}
    for scenario in args.scenarios:
        for c in args.concurrency:
            for client in ("python", "wrk"):
                row = {n: common.merge_repeats(raw.get((scenario, c, client, n), []))
                       for n in servers}
                row = {n: v for n, v in row.items() if v}
                if not row:
                    continue
                row["ours/peer"] = common.compare(row.get("ours"), row.get("peer"))
                row["ours/floor"] = common.compare(row.get("ours"), row.get("floor"))
                row["peer/floor"] = common.compare(row.get("peer"), row.get("floor"))
                table.setdefault(scenario, {}).setdefault(str(c), {})[client] = row
    return table


def measure_sliced(args, servers, names, path, expected, floor_status, count, c):
    """``count`` requests per runner, sent in ``--slices`` slices that alternate between the
    runners (ABBA order), so that a burst of load from elsewhere lands on all of them."""
    parts = {name: [] for name in names}
    for k in range(args.slices):
        for name in (names if k % 2 == 0 else names[::-1]):
            server = servers[name]
            want = floor_status if name == "floor" else expected
            parts[name].append(common.run_load(
                server.port, [common.build_request("GET", path)], max(c, count // args.slices),
                c, args.client_procs, want, server.pid, keep_raw=True))
            settle(server)
    return {name: common.summarize(parts[name], floor_status if name == "floor" else expected)
            for name in names}


def settle(server):
    """Wait for an async burst's commands to exit so they do not load the next measurement."""
    left = common.wait_children_gone(server.pid)
    if left:
        log(f"{server.name}: {left} commands still running after the settle timeout")


def measure_reload(args, runners, servers):
    """Rewrite each hooks file in place with a new hook; time until that hook answers 200."""
    samples = {n: [] for n in servers if n != "floor"}
    jitter = random.Random(6)  # seeded: write at varied phases of a polling watcher's period
    for i in range(args.reload_samples):
        for name in samples:
            server = servers[name]
            new_id = f"reload-{i}-{name}"
            hooks = HOOKS + [{"id": new_id, "execute-command": "/bin/true",
                              "response-message": "reloaded"}]
            time.sleep(0.3 + jitter.random() * 0.5)  # quiet moment, distinct mtime, any phase
            write_hooks(runners.hooks_files[name], hooks)
            written = time.monotonic()
            elapsed = poll_until_200(server.port, f"/hooks/{new_id}", timeout=10.0)
            samples[name].append(None if elapsed is None else
                                 round((elapsed - written) * 1000, 1))
            log(f"reload {i + 1} {name}: {samples[name][-1]} ms")
    out = {}
    for name, values in samples.items():
        ok = [v for v in values if v is not None]
        out[name] = {"samples_ms": values, "median_ms": median(ok) if ok else None,
                     "timeouts": len(values) - len(ok)}
    if "ours" in out and "peer" in out:
        out["ours/peer"] = ratio(out["ours"]["median_ms"], out["peer"]["median_ms"])
    return out


def poll_until_200(port, path, timeout):
    """Monotonic time of the first 200 for ``path`` (polled every ~1 ms), or None."""
    conn = common.Connection(port, timeout=2.0)
    request = common.build_request("GET", path)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                status, _ = conn.exchange(request)
            except (OSError, ValueError):
                conn.close()
                status = None
            if status == 200:
                return time.monotonic()
            time.sleep(0.001)
    finally:
        conn.close()
    return None


def measure_crowded(args, runners):
    """A new client's latency while 5,000 idle keep-alive and 500 trickling clients are held,
    on a fresh server of each runner in turn (ours, then Go's)."""
    out = {}
    common.raise_fd_limit(args.idle_clients + args.trickling_clients + 512)
    for name in (n for n in ("ours", "peer") if n in args.runners):
        server = runners.start(name)
        try:
            with common.Crowd(server.port, args.idle_clients, args.trickling_clients) as crowd:
                log(f"crowded {name}: {crowd.idle_answered} idle, {crowd.trickling_held} "
                    f"trickling held")
                times, failures = [], 0
                for _ in range(args.crowded_requests):
                    try:
                        times.append(common.timed_new_client(server.port, "/hooks/no-such-hook"))
                    except (OSError, ValueError):
                        failures += 1
                st = server.status() or {}
                times.sort()
                out[name] = {"idle_held": crowd.idle_answered,
                             "trickling_held": crowd.trickling_held,
                             "new_clients": len(times), "failures": failures,
                             "p50_ms": common._ms(common.percentile(times, 50)),
                             "p99_ms": common._ms(common.percentile(times, 99)),
                             "max_ms": common._ms(times[-1]) if times else None,
                             "threads": st.get("threads"),
                             "rss_mib": round(st.get("rss_kib", 0) / 1024, 1)}
                log(f"crowded {name}: {out[name]}")
        finally:
            server.stop()
    if "ours" in out and "peer" in out:
        out["ours/peer"] = {k: ratio(out["ours"][k], out["peer"][k]) for k in ("p50_ms", "p99_ms")}
    return out


BACKGROUND_SCRIPT = """#!/bin/sh
sleep 2
echo done >> "$1"
"""


def measure_background(args, runners):
    """``--background-triggers`` triggers of a hook whose command sleeps 2 s, answered at once
    (upstream's default), on a fresh server of each runner: time from the first trigger sent
    until the last command has appended its line to a marker file, and the server's peak
    threads, running commands (its child processes) and RSS, sampled every 20 ms."""
    script = runners.workdir / "sleep2.sh"
    script.write_text(BACKGROUND_SCRIPT)
    script.chmod(0o755)
    out = {}
    for name in (n for n in ("ours", "peer") if n in args.runners):
        marker = runners.workdir / f"background-{name}.done"
        marker.write_bytes(b"")
        hooks_file = runners.workdir / f"hooks-background-{name}.json"
        write_hooks(hooks_file, [{"id": "sleep2", "execute-command": str(script),
                                  "pass-arguments-to-command": [
                                      {"source": "string", "name": str(marker)}]}])
        server = runners.start(name, hooks_file)
        try:
            sampler = common.PeakSampler(server.pid)
            with sampler:
                started = time.monotonic()
                load = common.run_load(server.port, [common.build_request("GET", "/hooks/sleep2")],
                                       args.background_triggers, 8, args.client_procs, {200})
                answered = time.monotonic() - started
                drained = wait_lines(marker, args.background_triggers, deadline=started + 120)
            out[name] = {"triggers": args.background_triggers,
                         "answered_200": load["statuses"].get("200", 0),
                         "errors": load["errors"], "answers_s": round(answered, 2),
                         "drain_s": None if drained is None else round(drained - started, 2),
                         "commands_finished": count_lines(marker), **sampler.peaks()}
            log(f"background {name}: {out[name]}")
        finally:
            stop_commands(server)
            server.stop()
    if "ours" in out and "peer" in out:
        out["ours/peer"] = {k: ratio(out["ours"][k], out["peer"][k])
                            for k in ("drain_s", "peak_threads", "peak_rss_mib")}
    return out


def stop_commands(server):
    """Kill the commands still running (after a drain timeout): webhookd starts each in a
    process group of its own, which stopping the server's group does not reach."""
    for pid in common.proc_children(server.pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass  # gone, or not a group leader (Go's webhook: stopped with the server's group)


def count_lines(path):
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def wait_lines(path, want, deadline):
    """Monotonic time when ``path`` first holds ``want`` lines (polled every 20 ms), or None."""
    while time.monotonic() < deadline:
        if count_lines(path) >= want:
            return time.monotonic()
        time.sleep(0.02)
    return None


def rss_figures(servers):
    out = {}
    for name, server in servers.items():
        st = server.status() or {}
        out[name] = {"rss_mib": round(st.get("rss_kib", 0) / 1024, 1),
                     "peak_rss_mib": round(st.get("hwm_kib", 0) / 1024, 1),
                     "threads": st.get("threads")}
    return out


# --------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------

def evaluate_targets(args, result):
    targets = common.Targets(TARGETS_DOC)
    add = targets.add

    load = result["load"]
    clients = ["python"] + ([] if args.no_wrk else ["wrk"])
    for c in (c for c in args.concurrency if c in (8, 32)):
        for client in clients:
            row = load.get("exec-sync", {}).get(str(c), {}).get(client, {})
            r = (row.get("ours/floor") or {}).get("rps")
            if r is not None:
                add("awaited", f"exec-sync c={c} {client} rps ours/floor", r, ">= 0.9",
                    r >= 0.9)
        for scenario in ("not-found", "mismatch"):
            for client in clients:
                row = load.get(scenario, {}).get(str(c), {}).get(client, {})
                r = (row.get("ours/floor") or {}).get("rps")
                if r is not None:
                    add("floor", f"{scenario} c={c} {client} rps ours/floor", r, ">= 0.9",
                        r >= 0.9)
    if 1 in args.concurrency:
        for scenario in ("not-found", "mismatch"):
            ours = load.get(scenario, {}).get("1", {}).get("python", {}).get("ours")
            if ours:
                add("max40", f"{scenario} c=1 python max latency ms (all repeats)",
                    ours["max_ms"], "<= 40", ours["max_ms"] <= 40)
    reload = result.get("hot_reload", {}).get("ours")
    if reload:
        med = reload["median_ms"]
        add("reload", "hot-reload median ms", med, "< 250", med is not None and med < 250
            and reload["timeouts"] == 0)
    idle = result.get("idle", {}).get("ours")
    if idle:
        add("idle_cpu", f"idle CPU % over {idle['window_s']} s", idle["cpu_percent"], "< 1",
            idle["cpu_percent"] < 1)
    over_floor = result.get("idle_rss_over_floor_mib")
    if over_floor is not None:
        add("idle_rss", "idle RSS MiB ours - floor (same window)", over_floor, "<= 6",
            over_floor <= 6)
    crowded = result.get("crowded", {}).get("ours")
    if crowded:
        p99 = crowded["p99_ms"]
        add("crowded", "crowded: new client p99 ms", p99, "< 1000",
            p99 is not None and p99 < 1000 and not crowded["failures"])
    return targets


# --------------------------------------------------------------------------------------------

def main():
    args = parse_args()
    result = common.new_result("webhookd", args, (
        "quick", "repeat", "requests", "slices", "wrk_seconds", "no_wrk", "concurrency",
        "scenarios", "runners", "reload_samples", "idle_seconds", "client_procs", "python",
        "idle_clients", "trickling_clients", "crowded_requests", "background_triggers"),
        " (exec-sync: half)")
    log("runners", args.runners)
    workdir = Path(tempfile.mkdtemp(prefix="bench-webhookd-"))
    runners = Runners(args, workdir)
    servers = {}
    try:
        result["startup_ms"] = {}
        informational = ["ours-bytecode"] if "ours" in args.runners else []
        for name in args.runners + informational:
            result["startup_ms"][name] = common.measure_startup(lambda: runners.start(name),
                                                                max(3, args.repeat))
            log(f"startup {name}: {result['startup_ms'][name]}")
        if "ours" in args.runners and "peer" in args.runners:
            result["startup_ms"]["ours/peer"] = ratio(result["startup_ms"]["ours"]["median_ms"],
                                                      result["startup_ms"]["peer"]["median_ms"])
        for name in args.runners + informational:
            servers[name] = runners.start(name)
        time.sleep(1.0)
        result["idle"] = common.idle_figures(list(servers.values()), args.idle_seconds)
        for name in informational:
            servers.pop(name).stop()
            result.setdefault("idle_informational", {})[name] = result["idle"].pop(name)
        if "ours" in args.runners and "floor" in args.runners:
            result["idle_rss_over_floor_mib"] = round(
                result["idle"]["ours"]["rss_mib"] - result["idle"]["floor"]["rss_mib"], 1)
        log("idle", result["idle"])
        result["load"] = measure_load(args, servers)
        result["rss_after_load"] = rss_figures(servers)
        result["hot_reload"] = measure_reload(args, runners, servers)
        result["idle_after_load"] = common.idle_figures(list(servers.values()),
                                                        min(args.idle_seconds, 5.0))
        result["rss_end"] = rss_figures(servers)
        for name, server in servers.items():
            if server.proc.poll() is not None:
                result.setdefault("crashed", []).append(name)
        if args.idle_clients:
            result["crowded"] = measure_crowded(args, runners)
        if args.background_triggers:
            result["background"] = measure_background(args, runners)
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    common.finish_result("webhookd", result, evaluate_targets(args, result))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        log("interrupted; servers stopped")
        sys.exit(130)
