"""Black-box tests of webhookd.py's redelivery-aware dedup (issue 33, item 3): a hook's
`"deduplicate"` runs a delivery id once while its run is queued, running or succeeded.

Each test starts the real daemon on a free 127.0.0.1 port and sends real HTTP; what ran is
what the hook's command appended to a file.  Nothing is mocked.
"""
import hashlib
import http.client
import json
import re
import subprocess
import threading
import time

from support import WEBHOOKD, python_cmd
from test_webhookd_features import script, wait_until, write_hooks
from test_webhookd_runs import ended, get_json, hook, start


def appender(tmp_path, name, fails_first=False):
    """A command that appends its first argument to a file (returned) and then, gated, ends:
    it waits for `<file>.gate` when that file is named in `<file>.wait`; with fails_first,
    its first run exits 1."""
    ran = tmp_path / (name + ".ran")
    body = ('echo "$1" >> %s\nwhile [ -e %s.wait ] && [ ! -e %s.gate ]; do sleep 0.05; done\n'
            % (ran, ran, ran))
    if fails_first:
        body += 'if [ ! -e %s.failed ]; then touch %s.failed; exit 1; fi\n' % (ran, ran)
    command = script(tmp_path / (name + ".sh"), body)
    return command, ran


def dedup_hook(hook_id, command, deduplicate=True, **extra):
    return hook(hook_id, command, **dict({
        "deduplicate": deduplicate,
        "pass-arguments-to-command": [{"source": "header", "name": "X-Note"}]}, **extra))


def deliver(daemon, hook_id, note, headers):
    """POST a delivery: (status, the run id it was answered with, body)."""
    status, answer, body = daemon.request("POST", "/hooks/" + hook_id, b"{}", dict(
        headers, **{"X-Note": note, "Content-Type": "application/json"}))
    return status, answer.get("x-webhookd-run"), body


def lines(path):
    return path.read_text().split() if path.exists() else []


def metric(daemon, hook_id):
    text = daemon.request("GET", "/status/metrics")[2].decode()
    found = re.search(r'^webhookd_deduplicated_total\{hook="%s"\} (\d+)$' % hook_id, text, re.M)
    return int(found.group(1)) if found else 0


def test_a_delivery_already_going_or_done_is_answered_with_its_run(tmp_path):
    command, ran = appender(tmp_path, "deploy")
    plain_command, plain_ran = appender(tmp_path, "plain")
    hooks = write_hooks(tmp_path / "hooks.json", [
        dedup_hook("deploy", command, **{"response-headers": [{"name": "X-Deploy",
                                                                "value": "yes"}]}),
        hook("plain", plain_command, **{
            "pass-arguments-to-command": [{"source": "header", "name": "X-Note"}]})])
    github = {"X-GitHub-Delivery": "72d3162e-cc78-11e3-81ab-4c9367dc0958"}
    (tmp_path / "deploy.ran.wait").touch()
    with start(hooks) as daemon:
        status, first, _ = deliver(daemon, "deploy", "first", github)
        assert status == 200 and first
        wait_until(lambda: lines(ran) == ["first"], what="the first run")
        # while it runs: not run again, answered with its id
        status, again, body = deliver(daemon, "deploy", "again", github)
        assert (status, again) == (200, first)
        assert body == b"Already run as %s (running).\n" % first.encode()
        (tmp_path / "deploy.ran.gate").touch()
        record = ended(daemon, first)
        assert record["state"] == "succeeded"
        assert record["delivery"] == github["X-GitHub-Delivery"]
        assert record["redelivery_of"] is None
        # once it succeeded: still not run again
        status, later, body = deliver(daemon, "deploy", "later", github)
        assert (status, later, body) == (200, first,
                                         b"Already run as %s (succeeded).\n" % first.encode())
        status, answer, _ = daemon.request("POST", "/hooks/deploy", b"", github)
        assert (status, answer["x-webhookd-run"], answer["x-deploy"]) == (200, first, "yes")
        assert answer["content-type"] == "text/plain; charset=utf-8"
        # the first header present is the id: another id, or another sender's header, runs
        status, other, _ = deliver(daemon, "deploy", "other", {"X-GitHub-Delivery": "2"})
        status, gitea, _ = deliver(daemon, "deploy", "gitea", {"X-Gitea-Delivery": "3"})
        status, gitea_again, _ = deliver(daemon, "deploy", "gitea-again",
                                         {"X-Gitea-Delivery": "3", "Idempotency-Key": "4"})
        # a request with no delivery id always runs
        status, no_id, _ = deliver(daemon, "deploy", "no-id", {})
        status, no_id_again, _ = deliver(daemon, "deploy", "no-id-again", {})
        assert len({first, other, gitea, no_id, no_id_again}) == 5 and gitea_again == gitea
        for run_id in (other, gitea, no_id, no_id_again):
            ended(daemon, run_id)
        assert sorted(lines(ran)) == ["first", "gitea", "no-id", "no-id-again", "other"]
        assert metric(daemon, "deploy") == 4
        # no `deduplicate`: every delivery runs, as upstream
        runs = [deliver(daemon, "plain", "p%d" % i, github)[1] for i in range(2)]
        for run_id in runs:
            ended(daemon, run_id)
        assert runs[0] != runs[1] and sorted(lines(plain_ran)) == ["p0", "p1"]
        assert metric(daemon, "plain") == 0
        said = "deploy: delivery 72d3162e-cc78-11e3-81ab-4c9367dc0958 was already run as %s " \
               "(succeeded): not run again" % first
        wait_until(lambda: said in daemon.log(), what="the log line")  # (a log thread)


def test_a_redelivery_of_a_failed_run_runs_again(tmp_path):
    command, ran = appender(tmp_path, "deploy", fails_first=True)
    hooks = write_hooks(tmp_path / "hooks.json", [dedup_hook("deploy", command, **{
        "trigger-rule": {"match": {"type": "value", "value": "yes",
                                   "parameter": {"source": "header", "name": "X-Go"}}}})])
    delivery = {"X-GitHub-Delivery": "d-1", "X-Go": "yes"}
    with start(hooks) as daemon:
        # a refused delivery ran nothing: its id does not count
        status, refused, _ = deliver(daemon, "deploy", "refused", dict(delivery, **{"X-Go": "no"}))
        assert (status, refused) == (200, None)
        status, failed, _ = deliver(daemon, "deploy", "one", delivery)
        assert status == 200 and failed
        assert ended(daemon, failed)["state"] == "failed"
        status, second, _ = deliver(daemon, "deploy", "two", delivery)
        assert status == 200 and second not in (None, failed)
        record = ended(daemon, second)
        assert (record["state"], record["delivery"], record["redelivery_of"]) == (
            "succeeded", "d-1", failed)
        status, third, body = deliver(daemon, "deploy", "three", delivery)
        assert (status, third) == (200, second) and b"(succeeded)" in body
        assert lines(ran) == ["one", "two"]
        page = daemon.request("GET", "/status/runs/" + second,
                              headers={"Accept": "text/html"})[2].decode()
        assert "<code>d-1</code>, a redelivery after run" in page
        assert 'href="/status/runs/%s"' % failed in page
        assert metric(daemon, "deploy") == 1


def test_a_delivery_is_remembered_across_a_restart_with_runs_dir(tmp_path):
    command, ran = appender(tmp_path, "deploy")
    hooks = write_hooks(tmp_path / "hooks.json", [dedup_hook("deploy", command)])
    runs_dir = tmp_path / "runs"
    delivery = {"X-Gitlab-Event-UUID": "13792a30-4ad3-4e2c-8b13-4f4b1ee4b9a3"}
    with start(hooks, "-runs-dir", runs_dir) as daemon:
        status, first, _ = deliver(daemon, "deploy", "before", delivery)
        assert status == 200
        ended(daemon, first)
        time.sleep(0.3)  # the ended state reaches -runs-dir a moment after the run ends
    with start(hooks, "-runs-dir", runs_dir) as daemon:
        status, again, body = deliver(daemon, "deploy", "after", delivery)
        assert (status, again) == (200, first) and b"(succeeded)" in body
        assert lines(ran) == ["before"]


def test_concurrent_duplicates_run_once(tmp_path):
    command, ran = appender(tmp_path, "deploy")
    hooks = write_hooks(tmp_path / "hooks.json", [dedup_hook("deploy", command)])
    (tmp_path / "deploy.ran.wait").touch()  # all arrive while the one run goes on
    senders = 16
    answers, barrier = [], threading.Barrier(senders)

    def send(connection):
        # connected beforehand: after the barrier, the requests go out together
        connection.putrequest("POST", "/hooks/deploy")
        for name, value in (("Webhook-Id", "msg_1"), ("X-Note", "n"), ("Content-Length", "0")):
            connection.putheader(name, value)
        barrier.wait()
        connection.endheaders()
        answer = connection.getresponse()
        answers.append((answer.status, answer.getheader("X-Webhookd-Run")))
        connection.close()

    with start(hooks, "-runs-dir", tmp_path / "runs") as daemon:
        connections = [http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
                       for _ in range(senders)]
        for connection in connections:
            connection.connect()
        threads = [threading.Thread(target=send, args=(c,)) for c in connections]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(answers) == senders and {status for status, _ in answers} == {200}
        run_ids = {run_id for _, run_id in answers}
        assert len(run_ids) == 1
        (tmp_path / "deploy.ran.gate").touch()
        ended(daemon, run_ids.pop())
        assert len(lines(ran)) == 1
        assert metric(daemon, "deploy") == senders - 1


def test_a_named_header_in_a_yaml_hooks_file(tmp_path):
    command, ran = appender(tmp_path, "deploy")
    hooks = tmp_path / "hooks.yaml"
    hooks.write_text("".join(
        "- id: %s\n  execute-command: %s\n  deduplicate: %s\n  pass-arguments-to-command:\n"
        "  - source: header\n    name: X-Note\n" % (hook_id, command, deduplicate)
        for hook_id, deduplicate in (("deploy", "x-deploy-key"), ("other", "true"))))
    with start(hooks) as daemon:
        # only that header: GitHub's is not looked at
        runs = [deliver(daemon, "deploy", "gh%d" % i, {"X-GitHub-Delivery": "same"})[1]
                for i in range(2)]
        keyed = [deliver(daemon, "deploy", "key%d" % i, {"X-Deploy-Key": "k-1"})[1]
                 for i in range(2)]
        assert len(set(runs)) == 2 and keyed[0] == keyed[1]
        # `true` in YAML; the same id sent to another hook is that hook's to run once
        other = [deliver(daemon, "other", "other%d" % i, {"X-GitHub-Delivery": "same"})[1]
                 for i in range(2)]
        assert other[0] == other[1] and other[0] not in runs
        for run_id in runs + keyed[:1] + other[:1]:
            ended(daemon, run_id)
        assert sorted(lines(ran)) == ["gh0", "gh1", "key0", "other0"]
        assert get_json(daemon, "/status/runs/" + keyed[0])["delivery"] == "k-1"


def test_a_long_or_odd_delivery_id_is_kept_as_its_digest(tmp_path):
    command, ran = appender(tmp_path, "deploy")
    hooks = write_hooks(tmp_path / "hooks.json", [dedup_hook("deploy", command)])
    long_id = "a" * 5000
    with start(hooks) as daemon:
        first = deliver(daemon, "deploy", "long", {"Idempotency-Key": long_id})[1]
        assert deliver(daemon, "deploy", "long-again", {"Idempotency-Key": long_id})[1] == first
        record = ended(daemon, first)
        assert record["delivery"] == "sha256:" + hashlib.sha256(long_id.encode()).hexdigest()
        # 128 visible characters are kept as sent; one more, or a space, and it is hashed
        kept = deliver(daemon, "deploy", "128", {"Idempotency-Key": "b" * 128})[1]
        longer = deliver(daemon, "deploy", "129", {"Idempotency-Key": "b" * 129})[1]
        spaced = deliver(daemon, "deploy", "spaced", {"Idempotency-Key": "b b"})[1]
        assert ended(daemon, kept)["delivery"] == "b" * 128
        assert ended(daemon, longer)["delivery"].startswith("sha256:")
        assert ended(daemon, spaced)["delivery"].startswith("sha256:")
        assert sorted(lines(ran)) == ["128", "129", "long", "spaced"]


def test_a_delivery_dropped_from_the_history_runs_again(tmp_path):
    command, ran = appender(tmp_path, "deploy")
    hooks = write_hooks(tmp_path / "hooks.json", [dedup_hook("deploy", command)])
    with start(hooks, "-runs-keep", "1") as daemon:
        first = deliver(daemon, "deploy", "a", {"X-GitHub-Delivery": "a"})[1]
        ended(daemon, first)
        assert deliver(daemon, "deploy", "a-again", {"X-GitHub-Delivery": "a"})[1] == first
        ended(daemon, deliver(daemon, "deploy", "b", {"X-GitHub-Delivery": "b"})[1])
        # the run of `a` is gone (one run kept per hook): nothing remembers it ran
        wait_until(lambda: daemon.request("GET", "/status/runs/" + first)[0] == 404,
                   what="the first run to be dropped")
        again = deliver(daemon, "deploy", "a-later", {"X-GitHub-Delivery": "a"})[1]
        assert again != first and ended(daemon, again)["redelivery_of"] is None
        assert lines(ran) == ["a", "b", "a-later"]


def test_without_run_history_every_delivery_runs_and_the_log_says_why(tmp_path):
    command, ran = appender(tmp_path, "deploy")
    hooks = write_hooks(tmp_path / "hooks.json", [dedup_hook("deploy", command)])
    with start(hooks, "-runs-keep", "0") as daemon:
        for note in ("one", "two"):
            assert deliver(daemon, "deploy", note, {"X-GitHub-Delivery": "g"})[:2] == (200, None)
        wait_until(lambda: sorted(lines(ran)) == ["one", "two"], what="both runs")
        wait_until(lambda: "deploy: delivery g is not deduplicated: -runs-keep 0 keeps no runs"
                   in daemon.log(), what="the warning")  # (the log is written by a thread)


def test_validate_knows_the_deduplicate_field(tmp_path):
    def validate(value, name="hooks.json"):
        hooks = tmp_path / name
        hooks.write_text(json.dumps([{"id": "h", "execute-command": "/bin/true",
                                      "deduplicate": value}]))
        return subprocess.run(python_cmd(WEBHOOKD, "-hooks", hooks, "-validate"),
                              capture_output=True, text=True, timeout=30)

    for good in (True, False, "X-Delivery"):
        result = validate(good)
        assert result.returncode == 0, (good, result.stdout)
    for bad, said in ((1, "got number"), ("", "got ''"), ("X Delivery", "got 'X Delivery'"),
                      (["X-GitHub-Delivery"], "got array"), (None, None)):
        result = validate(bad)
        if said is None:  # null: as if not given
            assert result.returncode == 0, result.stdout
            continue
        assert result.returncode == 1, (bad, result.stdout)
        assert "hook 0 (\"h\").deduplicate: expected true, false or a header name, %s" % said \
            in result.stdout, result.stdout
        assert "Traceback" not in result.stdout + result.stderr
