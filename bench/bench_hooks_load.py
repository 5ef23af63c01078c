"""Benchmark: loading a 1,000-hook hooks file written as YAML against the same hooks as JSON.

    python3 bench/bench_hooks_load.py [--hooks 1000] [--repeat 7] [--no-startup]

Generates one set of hooks (each with an `and` of an HMAC and a value rule, arguments,
environment, response headers) and writes it twice: as block-style YAML (comments, an anchor
shared by every hook's trigger rule, a block scalar) and as JSON. Measures, medians of --repeat:

- `parse_hooks` on each text (what a load or reload costs: text -> hooks, warnings, checks),
  and the bare readers (`json.loads` with upstream's number rules, `load_yaml`);
- startup to the last hook answering, for webhookd.py and /usr/bin/webhook on each file
  (unless --no-startup).

Prints one JSON object; progress on stderr.
"""
import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import support  # noqa: E402
import webhookd  # noqa: E402


def hook(i):
    return {
        "id": "deploy-%d" % i,
        "execute-command": "/bin/true",
        "command-working-directory": "/tmp",
        "response-message": "deploying %d" % i,
        "response-headers": [{"name": "X-Hook", "value": "h%d" % i}],
        "pass-arguments-to-command": [{"source": "payload", "name": "head_commit.id"},
                                      {"source": "payload", "name": "pusher.name"}],
        "pass-environment-to-command": [{"source": "payload", "name": "ref",
                                         "envname": "REF"}],
        "trigger-rule": {"and": [
            {"match": {"type": "payload-hmac-sha256", "secret": "s3cret-%d" % i,
                       "parameter": {"source": "header", "name": "X-Hub-Signature-256"}}},
            {"match": {"type": "value", "value": "refs/heads/main",
                       "parameter": {"source": "payload", "name": "ref"}}}]},
    }


def as_yaml(count):
    """The same hooks in the YAML people write: comments, flow and block collections, a folded
    scalar, an anchor on each hook's branch rule."""
    out = ["# %d generated hooks\n" % count]
    for i in range(count):
        out.append(
            "- id: deploy-%d\n"
            "  execute-command: /bin/true\n"
            "  command-working-directory: /tmp\n"
            "  response-message: >-\n"
            "    deploying\n"
            "    %d\n"
            "  response-headers:\n"
            "  - {name: X-Hook, value: h%d}\n"
            "  pass-arguments-to-command:\n"
            "  - source: payload\n"
            "    name: head_commit.id\n"
            "  - source: payload\n"
            "    name: pusher.name\n"
            "  pass-environment-to-command:\n"
            "  - {source: payload, name: ref, envname: REF}\n"
            "  trigger-rule:\n"
            "    and:\n"
            "    - match:\n"
            "        type: payload-hmac-sha256\n"
            "        secret: 's3cret-%d'   # per hook\n"
            "        parameter:\n"
            "          source: header\n"
            "          name: X-Hub-Signature-256\n"
            "    - match: &branch\n"
            "        type: value\n"
            "        value: refs/heads/main\n"
            "        parameter: {source: payload, name: ref}\n" % (i, i, i, i))
    return "".join(out)


def summary(h):
    """What must be equal for both files to define the same hooks."""
    rule = h.trigger_rule[1]
    return (h.id, h.response_message, h.response_headers, repr(h.pass_arguments),
            repr(h.pass_environment), rule[0][1].secret, rule[1][1].value)


def timed(fn, repeat):
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(samples), 2)


def startup_ms(argv, port, last_id):
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL)
    try:
        deadline = start + 60
        while time.perf_counter() < deadline:
            try:
                if support.request(port, "GET", "/hooks/" + last_id, timeout=2)[0] != 404:
                    return (time.perf_counter() - start) * 1000
            except OSError:
                pass
            time.sleep(0.002)
        raise RuntimeError("%s never answered" % argv[0])
    finally:
        proc.terminate()
        proc.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hooks", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--no-startup", action="store_true")
    args = parser.parse_args()

    json_text = json.dumps([hook(i) for i in range(args.hooks)], indent=2)
    yaml_text = as_yaml(args.hooks)
    yaml_hooks, _ = webhookd.parse_hooks(yaml_text, "h.yaml")
    json_hooks, _ = webhookd.parse_hooks(json_text, "h.json")
    assert [summary(h) for h in yaml_hooks] == [summary(h) for h in json_hooks]
    result = {
        "hooks": args.hooks, "repeat": args.repeat, "python": sys.version.split()[0],
        "bytes": {"yaml": len(yaml_text.encode()), "json": len(json_text.encode())},
        "parse_hooks_ms": {
            "json": timed(lambda: webhookd.parse_hooks(json_text, "h.json"), args.repeat),
            "yaml": timed(lambda: webhookd.parse_hooks(yaml_text, "h.yaml"), args.repeat)},
        "reader_only_ms": {
            "json": timed(lambda: webhookd.hooks_data(json_text, "h.json"), args.repeat),
            "yaml": timed(lambda: webhookd.load_yaml(yaml_text), args.repeat)},
    }
    result["parse_hooks_ratio_yaml_over_json"] = round(
        result["parse_hooks_ms"]["yaml"] / result["parse_hooks_ms"]["json"], 2)
    print("parsed", file=sys.stderr)
    if not args.no_startup:
        folder = Path(tempfile.mkdtemp(prefix="bench-load-"))
        try:
            files = {"json": folder / "hooks.json", "yaml": folder / "hooks.yaml"}
            files["json"].write_text(json_text)
            files["yaml"].write_text(yaml_text)
            runners = {"webhookd": support.python_cmd(support.WEBHOOKD)}
            if support.WEBHOOK_BIN:
                runners["webhook"] = [support.WEBHOOK_BIN]
            last = "deploy-%d" % (args.hooks - 1)
            startup = {}
            for name, prefix in runners.items():
                for kind, path in files.items():
                    samples = []
                    for _ in range(max(3, args.repeat // 2)):
                        port = support.free_port()
                        samples.append(startup_ms(prefix + ["-hooks", str(path), "-ip",
                                                            "127.0.0.1", "-port", str(port)],
                                                  port, last))
                    startup["%s_%s" % (name, kind)] = round(statistics.median(samples), 1)
                    print(name, kind, file=sys.stderr)
            result["startup_to_last_hook_ms"] = startup
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
