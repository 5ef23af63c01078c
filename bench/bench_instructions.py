"""Benchmark: the instructions one guarded request costs, counted by callgrind.

    python3 bench/bench_instructions.py [--searchkeys PATH] [--requests 300]

Requests per second on a shared machine swing by 15 % and more from one run to the next
(bench/README.md, "searchkeys — round five"): too much to tell two versions of the guard apart
by a few per cent. Instruction counts do not swing. This runs ``searchkeys.py serve --upstream``
and the card's floor (``stub_server.py proxy``: bare http.server + http.client, no
authorization) under ``valgrind --tool=callgrind``, each in front of ``stub_server.py search``,
sends every request shape of bench_searchkeys.py's guard target on one keep-alive connection
(c=1) and reports the instructions each server ran per request, counted from
``callgrind_control --zero`` to ``--dump`` (startup and warm-up requests excluded).

What it cannot show: the cost of threads waiting for each other (the GIL) at higher
concurrency; bench_searchkeys.py's c=8 figures are for that. At valgrind's pace the guard's
settings cache (an index's foreignKeys, kept 0.25 s) runs out every few requests, so the
guard's counts include more backend lookups than at full speed: they err high. Needs valgrind (Debian: valgrind).
Prints ONE JSON object and keeps a copy in bench/results/.
"""
import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import bench_searchkeys
import common
from common import log

VALGRIND = shutil.which("valgrind")
CALLGRIND_CONTROL = shutil.which("callgrind_control")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--searchkeys", default=str(bench_searchkeys.SEARCHKEYS),
                        help="path of searchkeys.py")
    parser.add_argument("--python", default=sys.executable,
                        help="the Python that runs the servers (a binary, not a shell shim)")
    parser.add_argument("--requests", type=int, default=300,
                        help="requests counted per shape and server (300)")
    parser.add_argument("--warmup", type=int, default=30,
                        help="requests sent per shape before counting starts (30)")
    args = parser.parse_args()
    args.quick = False  # every shape of the guard target
    if not VALGRIND or not CALLGRIND_CONTROL:
        sys.exit("bench_instructions.py needs valgrind and callgrind_control "
                 "(Debian: apt-get install valgrind)")
    if not Path(args.searchkeys).exists():
        sys.exit(f"{args.searchkeys} does not exist")
    return args


def under_callgrind(name, argv, port, ready_path, workdir):
    """`argv` started under callgrind with its counting off until counted() turns it on."""
    return common.Server(name, [VALGRIND, "--tool=callgrind", "--instr-atstart=no",
                                f"--callgrind-out-file={workdir}/{name}.%p"] + argv,
                         port, ready_path=ready_path, log_dir=workdir, timeout=300.0)


def control(server, *options):
    subprocess.run([CALLGRIND_CONTROL, *options, str(server.pid)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def counted(server, request, warmup, count, workdir):
    """Instructions `server` ran per request over `count` requests, after `warmup` more."""
    control(server, "--instr=on")
    connection = common.Connection(server.port, timeout=120.0)
    try:
        for _ in range(warmup):
            connection.exchange(request.encode())
        control(server, "--zero")
        for _ in range(count):
            status, data = connection.exchange(request.encode())
            if status != 200:
                raise RuntimeError(f"{server.name} answered {status}: {data[:200]!r}")
        dumps_before = set(Path(workdir).glob(f"{server.name}.{server.pid}*"))
        control(server, "--dump")
    finally:
        connection.close()
    dump = max(set(Path(workdir).glob(f"{server.name}.{server.pid}*")) - dumps_before,
               key=lambda path: path.stat().st_mtime)
    totals = re.search(r"^(?:totals|summary): (\d+)", dump.read_text(), re.MULTILINE)
    return round(int(totals.group(1)) / count)


def main():
    args = parse_args()
    result = {"benchmark": "instructions", "started_utc": common.utc_now(),
              "machine": dict(common.machine_description(),
                              server_python=common.python_version(args.python)),
              "load_average": {"start": common.load_average()},
              "settings": {name: getattr(args, name) for name in ("searchkeys", "requests",
                                                                   "warmup")}}
    workdir = tempfile.mkdtemp(prefix="bench-instructions-")
    stub = bench_searchkeys.start_stub(args, "search", workdir)
    upstream = f"http://{common.HOST}:{stub.port}"
    servers = []
    try:
        guard_port, floor_port = common.free_port(), common.free_port()
        guard = under_callgrind("guard", [
            args.python, args.searchkeys, "serve", "--host", common.HOST, "--port", guard_port,
            "--master-key", bench_searchkeys.MASTER_KEY, "--upstream", upstream,
            "--upstream-key", bench_searchkeys.UPSTREAM_KEY], guard_port, "/health", workdir)
        servers.append(guard)
        floor = under_callgrind("floor", [args.python, bench_searchkeys.STUB, "proxy", "--port",
                                          floor_port, "--upstream", upstream],
                                floor_port, "/", workdir)
        servers.append(floor)
        shapes = {}
        for shape, request in bench_searchkeys.guard_shapes(args, guard.port).items():
            figures = {"guard": counted(guard, request, args.warmup, args.requests, workdir),
                       "floor": counted(floor, request, args.warmup, args.requests, workdir)}
            figures["guard/floor"] = common.ratio(figures["guard"], figures["floor"])
            log(f"{shape}: guard {figures['guard']}, floor {figures['floor']} "
                f"instructions a request")
            shapes[shape] = figures
        result["instructions_per_request"] = shapes
    finally:
        for server in servers + [stub]:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    result["load_average"]["end"] = common.load_average()
    result["finished_utc"] = common.utc_now()
    common.write_result("instructions", result)


if __name__ == "__main__":
    main()
