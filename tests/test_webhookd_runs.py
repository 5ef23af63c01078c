"""Black-box tests of webhookd.py's run history (issue 14): run ids, records, output, -runs-dir.

Each test starts the real daemon on a free 127.0.0.1 port (or a Unix socket), triggers hooks
over HTTP and reads the records back over HTTP (or with -runs / -runs-follow); nothing is
mocked.  Timing is never assumed to be fast: tests poll with generous deadlines.
"""
import hashlib
import hmac
import http.client
import json
import os
import signal
import stat
import subprocess
import time

import pytest

import webhookd
from support import WEBHOOKD, Daemon, free_port, python_cmd
from test_webhookd_features import script, unix_request, wait_until, write_hooks


def hook(hook_id, command, **extra):
    return dict({"id": hook_id, "execute-command": command}, **extra)


def start(hooks_file, *flags, port=None):
    port = port or free_port()
    argv = python_cmd(WEBHOOKD, "-hooks", hooks_file, "-ip", "127.0.0.1", "-port", str(port),
                      "-verbose", "-status-path", "/status", *flags)
    return Daemon(argv, port)


def get_json(daemon, path, headers=None):
    status, _, body = daemon.request("GET", path, headers=headers)
    assert status == 200, (path, status, body)
    return json.loads(body)


def trigger(daemon, hook_id, method="GET", body=None, headers=None):
    """Trigger a hook; the run id of its answer."""
    status, answer_headers, _ = daemon.request(method, "/hooks/" + hook_id, body, headers)
    assert status == 200, status
    return answer_headers["x-webhookd-run"]


def ended(daemon, run_id):
    """The run's record once it has ended."""
    def done():
        record = get_json(daemon, "/status/runs/" + run_id)
        return record if record["state"] not in ("queued", "running") else None
    return wait_until(done, what="run %s to end" % run_id)


def printed(daemon, run_id, size):
    """Whether the run has printed `size` bytes (its output endpoint would follow it)."""
    return get_json(daemon, "/status/runs/" + run_id)["output_bytes"] == size


def output_of(daemon, run_id):
    status, headers, body = daemon.request("GET", "/status/runs/%s/output" % run_id)
    assert status == 200 and headers["content-type"].startswith("text/plain")
    return body


# ---------------------------------------------------------------------------------------------
# States, ids, output
# ---------------------------------------------------------------------------------------------

def test_each_end_state_and_its_record(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [
        hook("ok", script(tmp_path / "ok.sh", "echo out\necho err >&2\n")),
        hook("bad", script(tmp_path / "bad.sh", "echo failing\nexit 3\n")),
        hook("slow", script(tmp_path / "slow.sh", "echo started\nexec sleep 30\n"),
             **{"command-timeout": 1}),
        hook("captured", "/bin/echo", **{"include-command-output-in-response": True}),
        hook("missing", str(tmp_path / "no-such-command")),
    ])
    with start(hooks) as daemon:
        ok = ended(daemon, trigger(daemon, "ok"))
        assert ok["state"] == "succeeded" and ok["exit_code"] == 0 and ok["signal"] is None
        assert ok["hook"] == "ok" and ok["remote_addr"].startswith("127.0.0.1:")
        assert ok["output_bytes"] == len(b"out\nerr\n") and not ok["output_truncated"]
        assert ok["duration_ms"] >= 0 and ok["queued_at"] <= ok["started_at"] <= ok["ended_at"]
        assert output_of(daemon, ok["id"]) == b"out\nerr\n"

        bad = ended(daemon, trigger(daemon, "bad"))
        assert bad["state"] == "failed" and bad["exit_code"] == 3
        assert output_of(daemon, bad["id"]) == b"failing\n"

        slow = ended(daemon, trigger(daemon, "slow"))
        assert slow["state"] == "timed-out"
        assert output_of(daemon, slow["id"]) == b"started\n"

        status, headers, body = daemon.request("GET", "/hooks/captured")
        assert (status, body) == (200, b"\n")  # the body stays upstream's
        assert ended(daemon, headers["x-webhookd-run"])["state"] == "succeeded"

        status, headers, _ = daemon.request("GET", "/hooks/missing")
        assert ended(daemon, headers["x-webhookd-run"])["state"] == "failed"

        listed = get_json(daemon, "/status/runs")
        assert [r["hook"] for r in listed] == ["missing", "captured", "slow", "bad", "ok"]
        assert [r["hook"] for r in get_json(daemon, "/status/runs?state=failed")] == [
            "missing", "bad"]
        assert [r["id"] for r in get_json(daemon, "/status/runs?hook=bad")] == [bad["id"]]
        assert len(get_json(daemon, "/status/runs?limit=2")) == 2
        assert daemon.request("GET", "/status/runs?limit=0")[0] == 400
        assert daemon.request("GET", "/status/runs?state=happy")[0] == 400

        page = get_json(daemon, "/status")
        assert page["last_runs"]["bad"]["id"] == bad["id"]
        assert page["last_runs"]["ok"]["state"] == "succeeded"


def test_requests_that_run_nothing_get_no_run_id(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [
        hook("post-only", "/bin/true", **{"http-methods": ["POST"]}),
        hook("ruled", "/bin/true", **{"trigger-rule": {"match": {
            "type": "value", "value": "yes", "parameter": {"source": "url", "name": "go"}}}}),
    ])
    with start(hooks) as daemon:
        for path in ("/hooks/nothing", "/hooks/post-only", "/hooks/ruled?go=no", "/"):
            status, headers, _ = daemon.request("GET", path)
            assert status in (200, 404, 405) and "x-webhookd-run" not in headers, path
        # the refused delivery is kept as a record of its own (issue 33), with no run id given
        assert [r["state"] for r in get_json(daemon, "/status/runs")] == ["refused"]
        run_id = daemon.request("GET", "/hooks/ruled?go=yes")[1]["x-webhookd-run"]
        assert [r["id"] for r in get_json(daemon, "/status/runs")
                if r["state"] != "refused"] == [run_id]
        unknown = daemon.request("GET", "/status/runs/20260101T000000Z-00000000")
        assert unknown[0] == 404 and json.loads(unknown[2])["error"]
        assert daemon.request("GET", "/status/runs/../../etc/passwd")[0] in (301, 404)
        assert daemon.request("GET", "/status/runs/%s/other" % run_id)[0] == 404


def test_output_is_capped_keeping_the_tail(tmp_path):
    lines = "".join("line %04d\n" % i for i in range(2000))  # 20,000 bytes
    hooks = write_hooks(tmp_path / "hooks.json", [
        hook("loud", script(tmp_path / "loud.sh", "i=0\nwhile [ $i -lt 2000 ]; do "
                            "printf 'line %04d\\n' $i; i=$((i+1)); done\n"))])
    with start(hooks, "-runs-max-output", "1000") as daemon:
        record = ended(daemon, trigger(daemon, "loud"))
        assert record["output_bytes"] == len(lines) and record["output_truncated"] is True
        assert output_of(daemon, record["id"]) == lines[-1000:].encode()


def test_retention_per_hook_and_total_size(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [
        hook("a", "/bin/echo", **{"pass-arguments-to-command": [
            {"source": "string", "name": "x" * 3000}]}),
        hook("b", "/bin/true")])
    runs_dir = tmp_path / "runs"
    with start(hooks, "-runs-keep", "3", "-runs-dir", runs_dir) as daemon:
        # one after another: retention drops the oldest *finished* runs, so runs ending out of
        # order on a loaded machine would make "the oldest" ambiguous
        ids = [ended(daemon, trigger(daemon, "a"))["id"] for _ in range(5)]
        b = ended(daemon, trigger(daemon, "b"))
        assert [r["id"] for r in get_json(daemon, "/status/runs?hook=a")] == ids[:1:-1]
        assert daemon.request("GET", "/status/runs/" + ids[0])[0] == 404
        assert get_json(daemon, "/status/runs?hook=b")[0]["id"] == b["id"]
        wait_until(lambda: len(list(runs_dir.glob("*.json"))) == 4, what="old files removed")
    # a total bound smaller than three runs keeps fewer, newest first (a run of `a` counts
    # ~7.5 KB: its 3 KB output, and its 3 KB argv kept for a replay)
    with start(hooks, "-runs-keep", "3", "-runs-max-bytes", "12000") as daemon:
        # one after another again: with a run still going, the bound may drop the newest
        # ended run, as it may drop any ended run, and a loaded machine ends them out of order
        ids = [ended(daemon, trigger(daemon, "a"))["id"] for _ in range(3)]
        kept = [r["id"] for r in get_json(daemon, "/status/runs?hook=a")]
        assert kept[0] == ids[-1] and len(kept) < 3


def test_runs_max_bytes_counts_a_clients_long_request_id(tmp_path):
    """With -x-request-id (no limit, as Go), each record holds the client's id, once per saved
    state on disk: 100 KB ids must count against -runs-max-bytes, not as a 1 KiB record."""
    hooks = write_hooks(tmp_path / "hooks.json", [hook("a", "/bin/true")])
    runs_dir = tmp_path / "runs"
    with start(hooks, "-x-request-id", "-runs-max-bytes", "700000", "-runs-dir", runs_dir) \
            as daemon:
        for number in range(6):
            ended(daemon, trigger(daemon, "a", headers={"X-Request-Id": "%d" % number * 100000}))
        kept = get_json(daemon, "/status/runs?hook=a")
        assert 1 <= len(kept) <= 2 and kept[0]["request_id"] == "5" * 100000
        wait_until(lambda: sum(path.stat().st_size for path in runs_dir.iterdir()) <= 700000,
                   what="the records of dropped runs removed")


# ---------------------------------------------------------------------------------------------
# Following a run's output
# ---------------------------------------------------------------------------------------------

def test_output_of_a_running_command_streams_until_it_ends(tmp_path):
    gate = tmp_path / "gate"
    hooks = write_hooks(tmp_path / "hooks.json", [hook("deploy", script(
        tmp_path / "deploy.sh", "echo first\nwhile [ ! -e %s ]; do sleep 0.05; done\n"
        "echo second\n" % gate))])
    with start(hooks) as daemon:
        run_id = trigger(daemon, "deploy")
        conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=15)
        conn.request("GET", "/status/runs/%s/output" % run_id)
        answer = conn.getresponse()
        assert answer.status == 200 and answer.getheader("Transfer-Encoding") == "chunked"
        seen = b""
        while b"first\n" not in seen:
            seen += answer.read1(100)
        assert get_json(daemon, "/status/runs/" + run_id)["state"] == "running"
        gate.touch()
        seen += answer.read()
        assert seen.endswith(b"second\n")
        conn.close()
        assert ended(daemon, run_id)["state"] == "succeeded"


# ---------------------------------------------------------------------------------------------
# -runs-dir: files, restarts, killed and interrupted runs, the shell view
# ---------------------------------------------------------------------------------------------

def test_runs_dir_is_private_and_survives_a_restart(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [hook("ok", "/bin/echo")])
    runs_dir = tmp_path / "runs"
    port = free_port()
    with start(hooks, "-runs-dir", runs_dir, port=port) as daemon:
        record = ended(daemon, trigger(daemon, "ok"))
        daemon.signal(signal.SIGTERM)
        assert daemon.proc.wait(20) == 0
    assert stat.S_IMODE(runs_dir.stat().st_mode) == 0o700
    files = list(runs_dir.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    with start(hooks, "-runs-dir", runs_dir, port=port) as daemon:
        assert get_json(daemon, "/status/runs/" + record["id"]) == record
        assert output_of(daemon, record["id"]) == b"\n"


def test_run_cut_by_shutdown_is_killed_and_one_cut_by_kill_9_is_interrupted(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [
        hook("long", script(tmp_path / "long.sh", "echo begun\nexec sleep 60\n"),
             **{"max-concurrency": 1})])
    runs_dir = tmp_path / "runs"
    port = free_port()
    with start(hooks, "-runs-dir", runs_dir, "-shutdown-timeout", "1", port=port) as daemon:
        killed = trigger(daemon, "long")
        wait_until(lambda: printed(daemon, killed, 6), what="output")
        never_started = trigger(daemon, "long")  # waits for its max-concurrency turn
        daemon.signal(signal.SIGTERM)
        assert daemon.proc.wait(20) == 0
    with start(hooks, "-runs-dir", runs_dir, port=port) as daemon:
        record = get_json(daemon, "/status/runs/" + killed)
        assert record["state"] == "killed" and record["signal"] == "SIGKILL"
        record = get_json(daemon, "/status/runs/" + never_started)
        assert record["state"] == "killed" and record["started_at"] is None
        interrupted = trigger(daemon, "long")
        wait_until(lambda: printed(daemon, interrupted, 6), what="output")
        time.sleep(0.5)  # the writer thread saves what the record holds
        daemon.stop(signal.SIGKILL)
    with start(hooks, "-runs-dir", runs_dir, port=port) as daemon:
        record = get_json(daemon, "/status/runs/" + interrupted)
        assert record["state"] == "interrupted" and record["ended_at"] is None
        assert output_of(daemon, interrupted) == b"begun\n"
        assert get_json(daemon, "/status/runs/" + killed)["state"] == "killed"


def test_a_record_whose_last_save_was_cut_short_keeps_its_run(tmp_path):
    # A record's later states are appended to its file: a save cut short (a full disk) leaves
    # an unfinished last line, which must not cost the run its id.
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir(mode=0o700)
    run_id = "20200101T000000Z-0000000a"
    queued = {"id": run_id, "hook": "h", "state": "queued", "queued_at": "2020-01-01T00:00:00Z",
              "output_bytes": 0}
    cut = json.dumps(dict(queued, state="succeeded", exit_code=0))[:40]
    (runs_dir / (run_id + ".json")).write_text(json.dumps(queued) + "\n\n" + cut)
    hooks = write_hooks(tmp_path / "hooks.json", [hook("h", "/bin/true")])
    port = free_port()
    for _ in range(2):  # and again once the restart has saved the run's new state after it
        with start(hooks, "-runs-dir", runs_dir, port=port) as daemon:
            record = get_json(daemon, "/status/runs/" + run_id)
            assert record["state"] == "interrupted" and record["hook"] == "h"
            time.sleep(0.5)  # the writer thread saves the interrupted state


def gated_deploy(tmp_path, before="", after=""):
    """(gate, hooks file): a `deploy` hook that runs `before`, waits for the gate file to
    exist, then runs `after`."""
    gate = tmp_path / "gate"
    return gate, write_hooks(tmp_path / "hooks.json", [hook("deploy", script(
        tmp_path / "deploy.sh", "%swhile [ ! -e %s ]; do sleep 0.05; done\n%s"
        % (before, gate, after)))])


def test_shell_view_lists_runs_and_follows_one(tmp_path):
    gate, hooks = gated_deploy(tmp_path, "echo pulling\n", "echo done\n")
    runs_dir = tmp_path / "runs"
    with start(hooks, "-runs-dir", runs_dir) as daemon:
        run_id = trigger(daemon, "deploy")
        wait_until(lambda: printed(daemon, run_id, 8), what="first output")
        time.sleep(0.3)
        follower = subprocess.Popen(python_cmd(WEBHOOKD, "-runs-dir", runs_dir, "-runs-follow",
                                               run_id), stdout=subprocess.PIPE)
        try:
            assert follower.stdout.readline() == b"pulling\n"
            assert follower.poll() is None  # still following the running command
            gate.touch()
            assert follower.stdout.read() == b"done\n"
            assert follower.wait(15) == 0
        finally:
            follower.kill()
            follower.wait()
        ended(daemon, run_id)
        time.sleep(0.3)
        listing = subprocess.run(python_cmd(WEBHOOKD, "-runs", "-runs-dir", runs_dir),
                                 capture_output=True, text=True, timeout=15)
        assert listing.returncode == 0
        row = listing.stdout.splitlines()[1].split()
        assert row[0] == run_id and row[1] == "succeeded" and row[5] == "deploy"
    refused = subprocess.run(python_cmd(WEBHOOKD, "-runs"), capture_output=True, text=True,
                             timeout=15)
    assert refused.returncode == 1 and "-runs-dir" in refused.stdout + refused.stderr
    assert "Traceback" not in refused.stdout + refused.stderr


def test_start_up_log_names_the_program_as_version_does_and_says_where_the_page_is(tmp_path):
    """The log's version line and -version call the program the same (issue 31); the status
    page a unit turns on is announced with its address and who may read it."""
    version = subprocess.run(python_cmd(WEBHOOKD, "-version"), capture_output=True, text=True,
                             timeout=15).stdout.strip()
    assert version == "webhookd version %s (webhook 2.8.0 compatible)" % webhookd.__version__
    hooks = write_hooks(tmp_path / "hooks.json", [hook("ok", "/bin/true")])
    with start(hooks) as daemon:
        wait_until(lambda: "status page" in daemon.log(), what="the start-up log")
        log = daemon.log()
    assert " %s starting\n" % version in log, log
    assert "status page and run history on http://127.0.0.1:%d/status (loopback clients only)" \
        % daemon.port in log, log
    with start(hooks, "-status-token", "s3cret") as daemon:
        wait_until(lambda: "status page" in daemon.log(), what="the start-up log")
        assert "on http://127.0.0.1:%d/status (with -status-token)" % daemon.port in daemon.log()
        assert "s3cret" not in daemon.log()


def runs_listing(capsys, runs_dir, *flags):
    """The run ids `-runs` prints with these flags, newest first (webhookd's main, in this
    process: one command line more is only the start of an interpreter)."""
    capsys.readouterr()
    assert webhookd.main(["webhookd.py", "-runs", "-runs-dir", str(runs_dir), *flags]) == 0
    listing = capsys.readouterr().out
    assert listing.startswith("ID ")
    return [line.split()[0] for line in listing.splitlines()[1:]]


def test_shell_view_filters_as_the_status_page_does(tmp_path, capsys):
    """-runs-hook and -runs-state choose what the page's ?hook= and ?state= choose; -runs-since
    takes a time ago or a UTC date or time (issue 31)."""
    hooks = write_hooks(tmp_path / "hooks.json", [hook("ok", "/bin/true"),
                                                  hook("bad", "/bin/false")])
    runs_dir = tmp_path / "runs"
    with start(hooks, "-runs-dir", runs_dir) as daemon:
        for hook_id in ("ok", "bad", "ok"):
            ended(daemon, trigger(daemon, hook_id))
        time.sleep(0.3)  # the records reach -runs-dir a moment after the run ends
        for query, flags in (("hook=ok", ["-runs-hook", "ok"]),
                             ("state=failed", ["-runs-state", "failed"]),
                             ("hook=ok&state=failed", ["-runs-hook", "ok", "-runs-state", "failed"]),
                             ("hook=none", ["-runs-hook", "none"])):
            # (as sets: runs queued within one second may be listed in either order)
            page = [run["id"] for run in get_json(daemon, "/status/runs?" + query)]
            listed = runs_listing(capsys, runs_dir, *flags)
            assert sorted(listed) == sorted(page) and len(listed) == len(set(listed)), query
    everything = runs_listing(capsys, runs_dir)
    assert len(everything) == 3
    assert runs_listing(capsys, runs_dir, "-runs-since", "1h") == everything
    assert runs_listing(capsys, runs_dir, "-runs-since", "2000-01-01") == everything
    # a year before 1000 too (strftime wrote it "999-...", after every "2026-..." as text)
    assert runs_listing(capsys, runs_dir, "-runs-since", "0999-01-01T00:00") == everything
    assert runs_listing(capsys, runs_dir, "-runs-since", "2999-01-01T00:00Z") == []
    for flags, words in ((["-runs", "-runs-state", "done"], "-runs-state must be one of queued,"),
                         (["-runs", "-runs-since", "yesterday"], "-runs-since yesterday: give a"),
                         (["-runs-hook", "ok"], "add -runs")):
        assert webhookd.main(["webhookd.py", "-runs-dir", str(runs_dir), *flags]) == 1
        said = capsys.readouterr()
        assert words in said.out + said.err, said
    # and from the shell, as the operator types it
    listing = subprocess.run(python_cmd(WEBHOOKD, "-runs", "-runs-dir", runs_dir, "-runs-hook",
                                        "bad", "-runs-state", "failed", "-runs-since", "1d"),
                             capture_output=True, text=True, timeout=15)
    assert listing.returncode == 0 and len(listing.stdout.splitlines()) == 2, listing
    assert listing.stdout.splitlines()[1].split()[1:2] == ["failed"]


def test_shell_view_refuses_a_time_ago_too_long_to_count_in_one_sentence(tmp_path, capsys):
    """-runs-since with a count no clock reaches (a 400-digit number of seconds overflowed the
    float subtraction; 5,000 digits passed Python's limit for reading an int) gets the same one
    sentence as any bad value, not a traceback."""
    (tmp_path / "runs").mkdir()
    for since in ("1" + "0" * 400 + "s", "9" * 5000 + "d", "1d" + "1" + "0" * 20 + "h"):
        assert webhookd.main(["webhookd.py", "-runs", "-runs-dir", str(tmp_path / "runs"),
                              "-runs-since", since]) == 1
        said = capsys.readouterr()
        assert "-runs-since %s: give a time ago" % since in said.out + said.err, said
    assert runs_listing(capsys, tmp_path / "runs", "-runs-since", "999999999999d") == []


def test_a_second_daemon_on_the_same_runs_dir_is_refused(tmp_path):
    """Two daemons on one -runs-dir (a unit copied with its flags): the second, starting, would
    mark the first one's running run interrupted and delete its records."""
    gate, hooks = gated_deploy(tmp_path)
    runs_dir = tmp_path / "runs"
    with start(hooks, "-runs-dir", runs_dir) as daemon:
        run_id = trigger(daemon, "deploy")
        wait_until(lambda: get_json(daemon, "/status/runs/" + run_id)["state"] == "running")
        second = subprocess.run(python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1",
                                           "-port", str(free_port()), "-runs-dir", runs_dir),
                                capture_output=True, text=True, timeout=20)
        assert second.returncode == 1 and "in use by another webhookd" in second.stdout
        assert "Traceback" not in second.stdout + second.stderr
        gate.touch()
        assert ended(daemon, run_id)["state"] == "succeeded"
    with start(hooks, "-runs-dir", runs_dir) as daemon:  # free again once the first exits
        assert get_json(daemon, "/status/runs/" + run_id)["state"] == "succeeded"


def test_following_a_run_dropped_as_it_ends_stops(tmp_path):
    """-runs-keep 1 drops a run as it ends when a newer one of its hook exists, removing its
    files before its last state is written: -runs-follow must say so and stop (the bad code
    followed forever)."""
    gate = tmp_path / "gate"
    hooks = write_hooks(tmp_path / "hooks.json", [
        hook("deploy", script(tmp_path / "deploy.sh", "echo pulling\nwhile [ ! -e %s ]; do "
                              "sleep 0.05; done\n" % gate))])
    runs_dir = tmp_path / "runs"
    with start(hooks, "-runs-dir", runs_dir, "-runs-keep", "1") as daemon:
        run_id = trigger(daemon, "deploy")
        wait_until(lambda: printed(daemon, run_id, 8), what="first output")
        follower = subprocess.Popen(python_cmd(WEBHOOKD, "-runs-dir", runs_dir, "-runs-follow",
                                               run_id), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
        try:
            assert follower.stdout.readline() == b"pulling\n"
            newer = trigger(daemon, "deploy")
            gate.touch()
            ended(daemon, newer)
            assert follower.wait(20) == 1
            assert b"was dropped" in follower.stderr.read()
        finally:
            follower.kill()
            follower.wait()


# ---------------------------------------------------------------------------------------------
# Access control and secrets
# ---------------------------------------------------------------------------------------------

def unix_get(path, target, headers=b""):
    """(status, body) of one GET over the Unix socket."""
    data = unix_request(path, b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n%s\r\n"
                        % (target.encode(), headers))
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_runs_are_served_to_loopback_or_with_the_token_else_refused(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [hook("ok", "/bin/echo")])
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    path = str(tmp_path / "webhookd.sock")
    # clients behind a Unix socket (a reverse proxy, typically) are not loopback clients
    daemon = Daemon(python_cmd(WEBHOOKD, "-hooks", hooks, "-socket", path, "-status-path",
                               "/status", "-status-token-file", token_file), 0, wait=False)
    with daemon:
        wait_until(lambda: os.path.exists(path), what="socket file")
        assert unix_get(path, "/hooks/ok")[0] == 200
        assert unix_get(path, "/status/runs")[0] == 403
        assert unix_get(path, "/status/runs", b"Authorization: Bearer wrong\r\n")[0] == 403
        assert unix_get(path, "/status/runs", b"Authorization: Basic czNjcmV0\r\n")[0] == 403
        status, body = unix_get(path, "/status/runs", b"Authorization: Bearer s3cret-token\r\n")
        assert status == 200 and json.loads(body)[0]["hook"] == "ok"
        run_id = json.loads(body)[0]["id"]
        assert unix_get(path, "/status/runs/%s/output" % run_id)[0] == 403
        assert unix_get(path, "/status/runs/%s" % run_id)[0] == 403
    with start(hooks, "-status-token", "s3cret-token") as daemon:  # required from loopback too
        run_id = trigger(daemon, "ok")
        assert daemon.request("GET", "/status/runs/" + run_id)[0] == 403
        assert daemon.request("GET", "/status/runs", headers={
            "X-Forwarded-For": "203.0.113.9", "Authorization": "Bearer s3cret-token"})[0] == 200
    with start(hooks) as daemon:  # no token: loopback clients, unless a proxy relays them
        ended(daemon, trigger(daemon, "ok"))
        for relay in ("X-Forwarded-For", "Forwarded", "X-Real-IP"):
            assert daemon.request("GET", "/status/runs", headers={relay: "203.0.113.9"})[0] == 403
    bad = subprocess.run(python_cmd(WEBHOOKD, "-hooks", hooks, "-status-path", "/status",
                                    "-status-token-file", tmp_path / "absent"),
                         capture_output=True, text=True, timeout=15)
    assert bad.returncode == 1 and "Traceback" not in bad.stdout + bad.stderr


def test_no_request_secret_reaches_a_record(tmp_path):
    secret, password = "hmac-secret-123", "payload-password-456"
    hooks = write_hooks(tmp_path / "hooks.json", [hook(
        "signed", "/bin/echo", **{
            "pass-arguments-to-command": [{"source": "string", "name": "public"}],
            "trigger-rule": {"and": [
                {"match": {"type": "payload-hmac-sha256", "secret": secret,
                           "parameter": {"source": "header", "name": "X-Hub-Signature-256"}}},
                {"match": {"type": "value", "value": password,
                           "parameter": {"source": "payload", "name": "password"}}}]}})])
    body = json.dumps({"password": password}).encode()
    signature = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    runs_dir = tmp_path / "runs"
    with start(hooks, "-runs-dir", runs_dir) as daemon:
        run_id = trigger(daemon, "signed", "POST", body, {
            "X-Hub-Signature-256": signature, "Content-Type": "application/json"})
        ended(daemon, run_id)
        time.sleep(0.3)
        seen = b"".join(daemon.request("GET", path)[2] for path in (
            "/status", "/status/runs", "/status/runs/" + run_id,
            "/status/runs/%s/output" % run_id))
        seen += b"".join(f.read_bytes() for f in runs_dir.iterdir())
    assert b"public" in seen
    for value in (secret, password, signature, signature[7:]):
        assert value.encode() not in seen


# ---------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("result, stopping, expected", [
    (webhookd.CommandResult(True, 0), False, ("succeeded", 0, None)),
    (webhookd.CommandResult(True, 2), False, ("failed", 2, None)),
    (webhookd.CommandResult(True, -9), False, ("failed", -9, "SIGKILL")),
    (webhookd.CommandResult(True, -9), True, ("killed", -9, "SIGKILL")),
    (webhookd.CommandResult(True, -15, timed_out=True), False, ("timed-out", -15, "SIGTERM")),
    (webhookd.CommandResult(False, error=OSError("x")), False, ("failed", None, None)),
])
def test_run_outcome(result, stopping, expected):
    assert webhookd.run_outcome(result, stopping) == expected


@pytest.mark.parametrize("remote_addr, loopback", [
    ("127.0.0.1:5", True), ("127.3.2.1:5", True), ("[::1]:5", True),
    ("[::ffff:127.0.0.1]:5", True), ("10.0.0.1:5", False), ("[::ffff:10.0.0.1]:5", False),
    ("[2001:db8::1]:5", False), ("@", False), ("", False),
])
def test_is_loopback_peer(remote_addr, loopback):
    assert webhookd.is_loopback_peer(remote_addr) is loopback


def test_a_failing_runs_dir_never_fails_a_trigger(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [
        hook("ok", "/bin/echo", **{"include-command-output-in-response": True,
                                   "pass-arguments-to-command": [
                                       {"source": "string", "name": "still runs"}]})])
    runs_dir = tmp_path / "runs"
    with start(hooks, "-runs-dir", runs_dir) as daemon:
        (runs_dir / "webhookd.lock").unlink()  # the daemon's lock: all it holds so far
        runs_dir.rmdir()
        runs_dir.write_text("not a folder any more")  # every write fails from now on
        status, headers, body = daemon.request("GET", "/hooks/ok")
        assert (status, body) == (200, b"still runs\n")
        run_id = headers["x-webhookd-run"]
        record = wait_until(lambda: get_json(daemon, "/status/runs/" + run_id)["storage_error"],
                            what="the record to say what was not saved")
        assert "not saved" in record
        assert get_json(daemon, "/status/runs/" + run_id)["state"] == "succeeded"


def test_runs_keep_0_turns_history_off(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [hook("ok", "/bin/echo")])
    with start(hooks, "-runs-keep", "0") as daemon:
        status, headers, _ = daemon.request("GET", "/hooks/ok")
        assert status == 200 and "x-webhookd-run" not in headers
        assert get_json(daemon, "/status/runs") == []
