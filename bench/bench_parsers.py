"""Benchmark: what one request costs each of webhookd.py's request parsers, at full size.

    python3 bench/bench_parsers.py [--body-mib 25] [--only json,multipart]

Runs the cases of tests/test_webhookd_parser_cost.py (heads at their 1 MiB limit, media types
at theirs), with bodies at --body-mib (default 25, the default -max-body-bytes) instead of the
test's 1 MiB.  For each: the CPU time of one call (best of 2, GC paused, as the test measures),
and the longest the call kept another thread from running (a thread that wakes every
millisecond, GC running as usual): the stall every other request would see.

Prints one JSON object; progress on stderr.
"""
import argparse
import gc
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import test_webhookd_parser_cost as cost  # noqa: E402


def longest_stall(parser, data):
    """Seconds of the longest gap a 1 ms ticker thread saw while parser(data) ran."""
    running, worst = [True], [0.0]

    def tick():
        last = time.perf_counter()
        while running[0]:
            time.sleep(0.001)
            now = time.perf_counter()
            worst[0], last = max(worst[0], now - last), now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.01)
    try:
        parser(data)
    except Exception:  # a refusal is a result too; only its cost is measured
        pass
    running[0] = False
    ticker.join()
    return worst[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--body-mib", type=int, default=25)
    parser.add_argument("--only", default="", help="comma-separated parts of case names")
    args = parser.parse_args()
    wanted = [part for part in args.only.split(",") if part]
    figures = {}
    for name in sorted(cost.CASES):
        if wanted and not any(part in name for part in wanted):
            continue
        function, make, size = cost.CASES[name]
        size = dict(cost.SIZES, body=args.body_mib << 20).get(size, size)
        data = make(size)
        print("%s at %d bytes" % (name, size), file=sys.stderr, flush=True)
        figures[name] = {"bytes": size,
                         "cpu_ms": round(cost.cpu_seconds(function, data, 2) * 1000, 1),
                         "longest_stall_ms": round(longest_stall(function, data) * 1000, 1)}
        gc.collect()
    json.dump({"python": sys.version.split()[0], "parsers": figures}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
