"""Soak and stress runner of the attack suite (issue 7), with the full counts.

Runs the scenarios of tests/test_webhookd_attack.py and tests/test_searchkeys_attack.py -- the
same code the test suite runs with smaller counts -- at the counts of the issue: 1,000
concurrent webhookd triggers, 100 hooks-file rewrites under load, 50 kill -9 of searchkeys
under 8 writers, thousands of fuzzed /keys requests, a long differential stream against
Debian's webhook, hundreds of slow clients. Every scenario runs in its own temporary folder
with its own daemons, all stopped and removed at the end, whatever happened.

Prints one JSON summary on stdout: requests tried, faults injected, kills survived, items lost,
then each scenario's own figures and any failure. Exit status 0 when every scenario passed.

    python3 bench/soak.py [--seed N] [--only NAME[,NAME...]] [--list]

The seed (default: random, printed in the summary) drives every random choice; rerun with
--seed to replay a failure.
"""
import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS.parent))

import pytest  # noqa: E402  (the scenarios skip through pytest.skip)

import support  # noqa: E402
import test_searchkeys_attack as sk  # noqa: E402
import test_webhookd_attack as wh  # noqa: E402


# ============================================================================
# Scenarios: name -> function(workdir, seed) -> figures
# ============================================================================
# Figures use these keys, summed into the summary: requests, faults, kills_survived, lost.

def webhookd_malformed(workdir, seed):
    with wh.running_target() as (daemon, path):
        requests = wh.run_malformed(daemon, seed)
        requests += wh.run_oversized_bodies(daemon, path, seed)
        nul_cases = wh.run_nul_cases(daemon, path)
        requests += nul_cases + wh.run_argv_injection(daemon, path, seed)
        requests += sum(wh.run_pipelining(daemon, 300) for _ in range(5))
    return {"requests": requests, "faults": len(wh.MALFORMED) + 2 + nul_cases}


def webhookd_concurrency(workdir, seed):
    figures = wh.run_concurrent_triggers(workdir, 1000, seed)
    return dict(figures, requests=figures["requests"])


def webhookd_reload_storm(workdir, seed):
    figures = wh.run_reload_storm(workdir, 100, seed)
    return dict(figures, faults=figures["rewrites"])


def webhookd_slow_clients(workdir, seed):
    requests = wh.run_slow_clients(workdir, connections=300)
    return {"requests": requests, "faults": 300}


def webhookd_differential(workdir, seed):
    """Eight runs of 60 hooks, each with its own seed (and so its own runner flags)."""
    if support.WEBHOOK_BIN is None:
        pytest.skip("Debian's webhook is not installed")
    requests = 0
    for run in range(8):
        folder = workdir / f"run{run}"
        folder.mkdir()
        requests += wh.run_differential(folder, 60, seed + run)["requests"]
    return {"requests": requests, "hooks": 8 * 60}


def webhookd_graceful_stop(workdir, seed):
    return {"requests": wh.run_graceful_stop(workdir, 60, seed)}


def webhookd_secrets(workdir, seed):
    return {"requests": wh.run_secrets(workdir, seed)}


def searchkeys_kill_loop(workdir, seed, figures):
    sk.run_kill_loop(workdir, 50, seed, stats=figures)
    return figures


def searchkeys_fuzz(workdir, seed):
    requests = sk.run_fuzz(workdir, 5000, seed)
    requests += sk.run_targeted(workdir, seed)
    return {"requests": requests}


def searchkeys_store_faults(workdir, seed):
    faults = sk.run_corruption(workdir, seed)
    for run in (sk.run_full_disk, sk.run_file_size_limit):
        folder = workdir / run.__name__
        folder.mkdir()
        faults += run(folder, seed)
    faults += sk.run_unreadable()  # in a folder of its own that user nobody may enter
    return {"faults": faults}


def searchkeys_revocation(workdir, seed):
    return {"requests": sk.run_revocation(workdir, 200, seed)}


def searchkeys_races(workdir, seed):
    requests = sk.run_races(workdir, seed, threads=64)
    framing = sk.run_transport(workdir, seed)
    return {"requests": requests + framing, "faults": framing}


def searchkeys_secrets(workdir, seed):
    return {"requests": sk.run_secrets(workdir)}


SCENARIOS = {
    "webhookd-malformed": webhookd_malformed,
    "webhookd-concurrency-1000": webhookd_concurrency,
    "webhookd-reload-storm-100": webhookd_reload_storm,
    "webhookd-slow-clients-300": webhookd_slow_clients,
    "webhookd-differential-8x60-hooks": webhookd_differential,
    "webhookd-graceful-stop-60": webhookd_graceful_stop,
    "webhookd-secrets": webhookd_secrets,
    "searchkeys-kill-9-x50": searchkeys_kill_loop,
    "searchkeys-fuzz-5000": searchkeys_fuzz,
    "searchkeys-store-faults": searchkeys_store_faults,
    "searchkeys-revocation-200": searchkeys_revocation,
    "searchkeys-races-and-framing": searchkeys_races,
    "searchkeys-secrets": searchkeys_secrets,
}


def run_scenario(name, seed):
    """Run one scenario in a fresh folder; its figures plus status, seconds and any failure."""
    workdir = Path(tempfile.mkdtemp(prefix=f"soak-{name}-"))
    figures = {}
    started = time.monotonic()
    try:
        function = SCENARIOS[name]
        if function is searchkeys_kill_loop:
            figures = function(workdir, seed, figures)
        else:
            figures = function(workdir, seed)
        figures["status"] = "passed"
    except pytest.skip.Exception as exc:
        figures["status"] = "skipped"
        figures["reason"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - a failing scenario is reported, the others still run
        figures["status"] = "failed"
        figures["failure"] = f"{type(exc).__name__}: {exc}"[:3000]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    figures["seconds"] = round(time.monotonic() - started, 1)
    return figures


def summarize(seed, results, seconds):
    def total(key):
        return sum(r.get(key, 0) for r in results.values() if isinstance(r.get(key, 0), int))
    return {
        "seed": seed,
        "requests_tried": total("requests"),
        "faults_injected": total("faults") + total("kills"),
        "kills_survived": total("kills_survived"),
        "items_lost": total("lost"),
        "scenarios_passed": sum(r["status"] == "passed" for r in results.values()),
        "scenarios_failed": sorted(n for n, r in results.items() if r["status"] == "failed"),
        "scenarios_skipped": sorted(n for n, r in results.items() if r["status"] == "skipped"),
        "seconds": round(seconds, 1),
        "scenarios": results,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="seed of every random choice")
    parser.add_argument("--only", default="", help="comma-separated scenario names (see --list)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(SCENARIOS))
        return 0
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(unknown)}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 2 ** 31)
    started = time.monotonic()
    results = {}
    for name in names:
        print(f"soak: {name} ...", file=sys.stderr, flush=True)
        results[name] = run_scenario(name, seed)
        print(f"soak: {name} {results[name]['status']} in {results[name]['seconds']}s", file=sys.stderr, flush=True)
    summary = summarize(seed, results, time.monotonic() - started)
    print(json.dumps(summary, indent=2))
    return 1 if summary["scenarios_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
