"""Benchmark: what a refused delivery costs webhookd.py in process (issue 33's refused records).

    python3 bench/bench_refusals.py [--deliveries N] [--rounds N] [--webhookd A.py,B.py]

For each file given (default: this checkout's webhookd.py; give an older copy beside it to
compare), two hooks whose rules refuse the request: the throughput benchmark's `mismatch` (one
`value` match on the query) and `push` (an `and` of a payload signature that holds and an `or`
of a `value` and a `regex` on the payload that do not: five nodes). Per delivery, CPU time of
this process (time.process_time, so other work on the machine counts less than in wall time):

- `rules`: the rules evaluated without an explanation (what a refusal cost before issue 33,
  and what it costs with -runs-keep 0);
- `tree`: the rules evaluated with their explained tree (Hooks.trigger with run history on);
- `record`: the tree and the `refused` record kept in a RunStore bounded as the daemon's
  default (-runs-keep 50: past the first 50 each delivery also drops the oldest);
- `added`: record minus rules, what run history adds to a refused delivery.

A fresh request per delivery. The files are measured in alternating order, `--rounds` times;
the figure is the lowest round (the least disturbed by other work). Prints ONE JSON object and
keeps a copy in bench/results/. Progress goes to stderr.
"""
import argparse
import hmac
import importlib.util
import json
import time

import common
from common import log

BODY = b'{"ref": "refs/heads/dev"}'
HOOKS = [
    {"id": "mismatch", "execute-command": "/bin/true",
     "trigger-rule": {"match": {"type": "value", "value": "never-sent",
                                "parameter": {"source": "url", "name": "token"}}}},
    {"id": "push", "execute-command": "/bin/true",
     "trigger-rule": {"and": [
         {"match": {"type": "payload-hmac-sha256", "secret": "bench-secret",
                    "parameter": {"source": "header", "name": "X-Hub-Signature-256"}}},
         {"or": [{"match": {"type": "value", "value": "refs/heads/main",
                            "parameter": {"source": "payload", "name": "ref"}}},
                 {"match": {"type": "regex", "regex": "^refs/tags/",
                            "parameter": {"source": "payload", "name": "ref"}}}]}]}},
]
SIGNATURE = "sha256=" + hmac.new(b"bench-secret", BODY, "sha256").hexdigest()


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deliveries", type=int, default=20000, help="per round and figure")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--webhookd", default=str(common.ROOT / "webhookd.py"),
                        help="comma-separated paths of webhookd.py versions")
    return parser.parse_args()


def load(path, index):
    spec = importlib.util.spec_from_file_location("webhookd_%d" % index, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(webhookd, hook, deliveries):
    """µs of CPU per delivery for each figure of the docstring."""
    store = webhookd.RunStore(50, 64 * 1024 * 1024, 1024 * 1024)
    figures = {}
    for name in ("rules", "tree", "record"):
        before = time.process_time()
        for number in range(deliveries):
            request = webhookd.HookRequest(
                str(number), "POST", "127.0.0.1:40000", {"X-Hub-Signature-256": SIGNATURE},
                {"token": "wrong"}, BODY, "application/json")
            request.payload = json.loads(BODY)
            if name == "rules":
                webhookd.rules_satisfied(hook, request)
                continue
            trace = []
            webhookd.rules_satisfied(hook, request, trace)
            if name == "record":
                store.refused(hook.id, request, trace[0])
        figures[name] = (time.process_time() - before) * 1e6 / deliveries
    figures["added"] = figures["record"] - figures["rules"]
    return figures


def main():
    args = parse_args()
    paths = args.webhookd.split(",")
    modules = [load(path, index) for index, path in enumerate(paths)]
    hooks = [{hook.id: hook for hook in module.parse_hooks(json.dumps(HOOKS), "bench.json")[0]}
             for module in modules]
    rounds = {(path, hook_id): [] for path in paths for hook_id in hooks[0]}
    for number in range(args.rounds):
        order = list(range(len(paths)))
        for index in order if number % 2 == 0 else order[::-1]:
            for hook_id, hook in hooks[index].items():
                figures = measure(modules[index], hook, args.deliveries)
                rounds[(paths[index], hook_id)].append(figures)
                log(f"round {number + 1} {paths[index]} {hook_id}: "
                    + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()))
    result = {"bench": "refusals", "machine": common.machine_description(),
              "args": vars(args), "cpu_us_per_delivery": {
                  path: {hook_id: {name: round(min(r[name] for r in rounds[(path, hook_id)]), 1)
                                   for name in ("rules", "tree", "record", "added")}
                         for hook_id in hooks[0]} for path in paths}}
    common.write_result("refusals", result)


if __name__ == "__main__":
    main()
