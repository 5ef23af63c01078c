"""Black-box tests of webhookd.py's Prometheus metrics (issue 22, item 2) at
<status-path>/metrics: the real daemon on a free 127.0.0.1 port, real HTTP, and the text parsed
with the official Prometheus client's own parser."""
import json
import signal
import socket
import sys

import pytest

import webhookd
from support import WEBHOOKD, Daemon, free_port, python_cmd
from test_webhookd_features import script, wait_until, write_hooks

parser = pytest.importorskip("prometheus_client.parser", reason="needs prometheus_client: run "
                             "python3 tests/run.py, which installs requirements-dev.txt")

QUOTED_ID = 'say "hi" \\ bye'  # a quote and a backslash, escaped in the label
QUOTED_PATH = "/hooks/say%20%22hi%22%20%5C%20bye"
MAX_BUCKET = 300.0


def hook(hook_id, command, **extra):
    return dict({"id": hook_id, "execute-command": command}, **extra)


def awaited(hook_id, command, **extra):
    """A hook whose answer waits for the command: its run has ended once answered."""
    return hook(hook_id, command, **dict({"include-command-output-in-response": True}, **extra))


def start(hooks_file, *flags):
    port = free_port()
    return Daemon(python_cmd(WEBHOOKD, "-hooks", hooks_file, "-ip", "127.0.0.1", "-port",
                             str(port), "-verbose", "-status-path", "/status", *flags), port)


def scrape(daemon, headers=None):
    """{(sample name, sorted label pairs): value} of one scrape; also checks the framing."""
    status, answer_headers, body = daemon.request("GET", "/status/metrics", headers=headers)
    assert status == 200, (status, body)
    assert answer_headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in parser.text_string_to_metric_families(body.decode("utf-8"))
            for sample in family.samples}


def scrape_until(daemon, condition, what):
    """The first scrape whose samples meet condition(samples)."""
    def met():
        samples = scrape(daemon)
        return samples if condition(samples) else None
    return wait_until(met, what=what)


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


def hooks_in_labels(samples):
    return {dict(labels)["hook"] for _, labels in samples if "hook" in dict(labels)}


def reload_and_wait(daemon, log_line, times):
    """SIGHUP, then wait until the daemon's log holds `log_line` `times` times."""
    daemon.signal(signal.SIGHUP)
    wait_until(lambda: daemon.log().count(log_line) >= times, what=log_line)


def test_runs_answers_and_reloads_are_counted(tmp_path):
    hooks_file = tmp_path / "hooks.json"
    write_hooks(hooks_file, [
        awaited("ok", "/bin/true"),
        awaited("fail", script(tmp_path / "fail.sh", "exit 3\n")),
        awaited("missing", str(tmp_path / "no-such-command")),
        awaited(QUOTED_ID, "/bin/true"),
        hook("ruled", "/bin/true", **{"trigger-rule": {"match": {
            "type": "value", "value": "yes", "parameter": {"source": "header", "name": "X-Go"}}}}),
    ])
    with start(hooks_file) as daemon:
        answers = [daemon.request("GET", path)[0] for path in (
            "/hooks/ok", "/hooks/ok", "/hooks/fail", "/hooks/missing", QUOTED_PATH,
            "/hooks/ruled", "/hooks/nope", "/hooks/nope", "/hooks/ok%0Aevil")]
        assert answers == [200, 200, 500, 500, 200, 200, 404, 404, 404]
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as malformed:
            malformed.sendall(b"GET /hooks/ok HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n")
            assert malformed.recv(64).startswith(b"HTTP/1.1 400 ")
        write_hooks(hooks_file, [awaited("ok", "/bin/true")])  # the others are removed
        reload_and_wait(daemon, "found 1 hook(s) in file", 1)
        hooks_file.write_text("[{broken")
        reload_and_wait(daemon, "couldn't load hooks from file!", 1)

        samples = scrape(daemon)
        runs = {(dict(labels)["hook"], dict(labels)["state"]): count
                for (name, labels), count in samples.items() if name == "webhookd_runs_total"}
        assert runs == {("ok", "succeeded"): 2, ("fail", "failed"): 1,
                        ("missing", "failed"): 1, (QUOTED_ID, "succeeded"): 1}
        # labels only for hooks of the hooks file, whatever the requests asked for
        assert hooks_in_labels(samples) == {"ok", "fail", "missing", QUOTED_ID, "ruled"}
        assert value(samples, "webhookd_refused_total", hook="ruled") == 1  # issue 33
        codes = {dict(labels)["code"]: count for (name, labels), count in samples.items()
                 if name == "webhookd_http_requests_total"}
        assert codes == {"200": 4, "500": 2, "404": 3, "400": 1}
        assert value(samples, "webhookd_hooks_loaded") == 1  # the broken file keeps its hooks
        assert value(samples, "webhookd_reload_failures_total") == 1
        assert value(samples, "webhookd_last_reload_successful") == 0
        assert value(samples, "webhookd_last_reload_success_timestamp_seconds") >= \
            value(samples, "webhookd_start_time_seconds") > 1.6e9
        assert value(samples, "webhookd_runs_in_progress") == 0
        assert value(samples, "webhookd_runs_queued") == 0
        assert value(samples, "webhookd_build_info", version=webhookd.__version__,
                     webhook_version=webhookd.VERSION, python="%d.%d.%d" % sys.version_info[:3],
                     implementation=sys.implementation.name) == 1
        assert_histograms(samples, {"ok": 2, "fail": 1, QUOTED_ID: 1})


def assert_histograms(samples, counts):
    """Each hook's duration histogram: as many runs as started, cumulative buckets ending in
    +Inf == _count, a plausible _sum; none for a command that never started."""
    for hook_id, count in counts.items():
        buckets = sorted((float(dict(labels)["le"]), seen) for (name, labels), seen
                         in samples.items() if name == "webhookd_run_duration_seconds_bucket"
                         and dict(labels)["hook"] == hook_id)
        assert [le for le, _ in buckets] == [0.1, 0.5, 1, 5, 10, 30, 60, MAX_BUCKET,
                                             float("inf")]
        seen = [n for _, n in buckets]
        assert seen == sorted(seen) and seen[-1] == count
        assert value(samples, "webhookd_run_duration_seconds_count", hook=hook_id) == count
        assert 0 < value(samples, "webhookd_run_duration_seconds_sum", hook=hook_id) \
            <= count * MAX_BUCKET
    assert value(samples, "webhookd_run_duration_seconds_count", hook="missing") is None


def test_background_runs_in_progress_queued_and_counted_without_history(tmp_path):
    go = tmp_path / "go"
    hooks_file = write_hooks(tmp_path / "hooks.json", [hook(
        "deploy", script(tmp_path / "wait.sh", "while [ ! -e %s ]; do sleep 0.05; done\n" % go),
        **{"max-concurrency": 1})])
    with start(hooks_file, "-runs-keep", "0") as daemon:  # run history off
        for _ in range(3):
            assert daemon.request("GET", "/hooks/deploy")[0] == 200
        busy = scrape_until(daemon, lambda s: value(s, "webhookd_runs_in_progress") == 1,
                            "a run in progress")
        assert value(busy, "webhookd_runs_queued") == 2  # behind max-concurrency 1
        go.touch()
        done = scrape_until(daemon, lambda s: value(s, "webhookd_runs_total", hook="deploy",
                                                    state="succeeded") == 3, "three runs counted")
        assert value(done, "webhookd_runs_in_progress") == 0
        assert value(done, "webhookd_runs_queued") == 0
        assert value(done, "webhookd_run_duration_seconds_count", hook="deploy") == 3


def test_metrics_need_the_token_or_an_unrelayed_loopback_client(tmp_path):
    hooks_file = write_hooks(tmp_path / "hooks.json", [hook("ok", "/bin/true")])
    with start(hooks_file, "-status-token", "s3cret-token") as daemon:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"}):
            status, answer_headers, body = daemon.request("GET", "/status/metrics",
                                                          headers=headers)
            assert status == 403 and "error" in json.loads(body)
            assert answer_headers["content-type"] == "application/json"
        granted = {"Authorization": "Bearer s3cret-token"}
        assert value(scrape(daemon, granted), "webhookd_hooks_loaded") == 1
        status, answer_headers, body = daemon.request("HEAD", "/status/metrics",
                                                      headers=granted)
        assert (status, body) == (200, b"")
        assert answer_headers["content-type"].startswith("text/plain; version=0.0.4")
        assert daemon.request("POST", "/status/metrics", headers=granted)[0] == 405
        assert daemon.request("GET", "/status/metrics/x", headers=granted)[0] == 404
    with start(hooks_file) as daemon:  # no token: loopback clients, unless a proxy relays them
        assert value(scrape(daemon), "webhookd_hooks_loaded") == 1
        status, _, body = daemon.request("GET", "/status/metrics",
                                         headers={"X-Forwarded-For": "203.0.113.9"})
        assert status == 403 and b"relays" in body
    port = free_port()  # no -status-path: no metrics either
    with Daemon(python_cmd(WEBHOOKD, "-hooks", hooks_file, "-ip", "127.0.0.1", "-port",
                           str(port)), port) as daemon:
        assert daemon.request("GET", "/status/metrics")[0] == 404
