"""Black-box tests of webhookd.py's `when-busy` and `debounce` hook fields (issue 33, item 4):
a burst of triggers runs the newest one, the others are recorded `superseded` or `dropped`.

Each test starts the real daemon on a free 127.0.0.1 port and triggers hooks over HTTP.  The
command notes its argument in a file, then waits until the test creates a release file: the
test decides when a run ends, so no assertion depends on how fast the machine is.
"""
import json
import signal
import subprocess

from support import WEBHOOKD, free_port, python_cmd
from test_webhookd_features import script, wait_until, write_hooks
from test_webhookd_runs import ended, get_json, start, trigger


def deploy(tmp_path, hook_id, **fields):
    """A hook whose command appends `?n=` to tmp_path/ran, then waits for tmp_path/release."""
    command = script(tmp_path / "deploy.sh", 'echo "$1" >> %s\nwhile [ ! -e %s ]; do '
                     "sleep 0.05; done\n" % (tmp_path / "ran", tmp_path / "release"))
    return dict({"id": hook_id, "execute-command": command,
                 "pass-arguments-to-command": [{"source": "url", "name": "n"}]}, **fields)


def ran(tmp_path):
    """The arguments of the runs that started, in order."""
    path = tmp_path / "ran"
    return path.read_text().split() if path.exists() else []


def record(daemon, run_id):
    return get_json(daemon, "/status/runs/" + run_id)


def runs_total(daemon, hook_id, state):
    status, _, body = daemon.request("GET", "/status/metrics")
    assert status == 200
    line = 'webhookd_runs_total{hook="%s",state="%s"} ' % (hook_id, state)
    found = [row for row in body.decode().splitlines() if row.startswith(line)]
    return int(float(found[0].split()[-1])) if found else 0


def validate(tmp_path, hooks):
    path = write_hooks(tmp_path / "check.json", hooks)
    return subprocess.run(python_cmd(WEBHOOKD, "-hooks", path, "-validate"),
                          capture_output=True, text=True, timeout=30)


def test_latest_runs_the_running_one_and_the_newest_the_rest_superseded(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [deploy(tmp_path, "site",
                                                         **{"when-busy": "latest"})])
    with start(hooks) as daemon:
        first = trigger(daemon, "site?n=1")
        wait_until(lambda: ran(tmp_path) == ["1"], what="the first run to start")
        waiting = [trigger(daemon, "site?n=%d" % n) for n in (2, 3, 4)]
        second, third, newest = waiting
        for superseded in (second, third):
            found = record(daemon, superseded)
            assert found["state"] == "superseded" and found["superseded_by"] == newest
            assert found["started_at"] is None and found["ended_at"] and \
                found["exit_code"] is None
        assert record(daemon, newest)["state"] == "queued"
        assert record(daemon, first)["state"] == "running"
        assert get_json(daemon, "/status")["runs"]["site"] == {"running": 1, "queued": 1}
        assert runs_total(daemon, "site", "superseded") == 2
        listed = get_json(daemon, "/status/runs?state=superseded")
        assert sorted(r["id"] for r in listed) == sorted((second, third))
        status, _, page = daemon.request("GET", "/status/runs/" + second,
                                         headers={"Accept": "text/html"})
        assert status == 200 and b"<dt>Superseded by</dt>" in page
        assert b'href="/status/runs/%s"' % newest.encode() in page

        (tmp_path / "release").touch()
        assert ended(daemon, newest)["state"] == "succeeded"
        assert ended(daemon, first)["state"] == "succeeded"
        assert ran(tmp_path) == ["1", "4"]  # the middle ones never ran
        # not busy any more: the next trigger runs at once
        assert ended(daemon, trigger(daemon, "site?n=5"))["state"] == "succeeded"
        assert ran(tmp_path) == ["1", "4", "5"]
        assert runs_total(daemon, "site", "succeeded") == 3


def test_drop_answers_and_records_a_trigger_that_finds_the_hook_busy(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [deploy(tmp_path, "site",
                                                         **{"when-busy": "drop"})])
    with start(hooks) as daemon:
        first = trigger(daemon, "site?n=1")
        status, headers, body = daemon.request("GET", "/hooks/site?n=2")
        assert (status, body) == (200, b"Hook is busy: this trigger was dropped "
                                       b"(when-busy: drop).")
        dropped = record(daemon, headers["x-webhookd-run"])
        assert dropped["state"] == "dropped" and dropped["started_at"] is None
        assert dropped["superseded_by"] is None and dropped["ended_at"]
        assert runs_total(daemon, "site", "dropped") == 1

        (tmp_path / "release").touch()
        assert ended(daemon, first)["state"] == "succeeded"
        third = trigger(daemon, "site?n=3")  # not busy: it runs
        assert ended(daemon, third)["state"] == "succeeded"
        assert ran(tmp_path) == ["1", "3"]


def test_debounce_runs_the_newest_trigger_of_a_burst_once(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [deploy(tmp_path, "site",
                                                         debounce="2s")])
    (tmp_path / "release").touch()  # the runs end at once here
    with start(hooks) as daemon:
        burst = [trigger(daemon, "site?n=%d" % n) for n in (1, 2, 3)]  # well within 2 s
        assert ended(daemon, burst[-1])["state"] == "succeeded"
        for superseded in burst[:-1]:
            found = record(daemon, superseded)
            assert found["state"] == "superseded" and found["superseded_by"] == burst[-1]
        assert ran(tmp_path) == ["3"]
        assert runs_total(daemon, "site", "superseded") == 2
        # a trigger after the quiet time is a burst of its own
        assert ended(daemon, trigger(daemon, "site?n=4"))["state"] == "succeeded"
        assert ran(tmp_path) == ["3", "4"]


def test_without_the_fields_or_with_queue_every_trigger_runs_in_turn(tmp_path):
    """Upstream's way is the default, and `"when-busy": "queue"` names it."""
    plain = deploy(tmp_path, "plain", **{"max-concurrency": 1})
    queue = dict(deploy(tmp_path, "queue", **{"max-concurrency": 1}), **{"when-busy": "queue"})
    result = validate(tmp_path, [plain, queue])
    assert result.returncode == 0 and "0 error(s), 0 warning(s)" in result.stdout, result.stdout
    hooks = write_hooks(tmp_path / "hooks.json", [plain, queue])
    with start(hooks) as daemon:
        plain_runs = [trigger(daemon, "plain?n=p%d" % n) for n in (1, 2, 3)]
        queue_runs = [trigger(daemon, "queue?n=q%d" % n) for n in (1, 2, 3)]
        assert get_json(daemon, "/status")["runs"] == {
            "plain": {"running": 1, "queued": 2}, "queue": {"running": 1, "queued": 2}}
        (tmp_path / "release").touch()
        for run_id in plain_runs + queue_runs:
            assert ended(daemon, run_id)["state"] == "succeeded"
    assert [n for n in ran(tmp_path) if n.startswith("p")] == ["p1", "p2", "p3"]
    assert [n for n in ran(tmp_path) if n.startswith("q")] == ["q1", "q2", "q3"]


def test_validate_and_load_know_the_fields(tmp_path):
    good = [deploy(tmp_path, "a", **{"when-busy": "latest", "debounce": "500ms"}),
            deploy(tmp_path, "b", **{"when-busy": "drop", "max-concurrency": 2}),
            deploy(tmp_path, "c", debounce="1m30s")]
    result = validate(tmp_path, good)
    assert result.returncode == 0 and "0 error(s), 0 warning(s)" in result.stdout, result.stdout
    duration = '.debounce: expected a duration above 0 and at most 1h, such as "5s"'
    bad = [
        ({"when-busy": "newest"}, '.when-busy: expected "queue", "latest" or "drop", got "newest"'),
        ({"when-busy": True}, '.when-busy: expected "queue", "latest" or "drop", got boolean'),
        ({"debounce": "5"}, duration),
        ({"debounce": "2h"}, duration),
        ({"debounce": 5}, duration),
        ({"debounce": "0s"}, duration),
        ({"when-busy": "latest", "include-command-output-in-response": True},
         '"when-busy": "latest" and include-command-output-in-response do not go together'),
        ({"debounce": "5s", "stream-command-output": True},
         "debounce and stream-command-output do not go together"),
        ({"when-busy": "drop", "stream-command-output": True},
         '"when-busy": "drop" and stream-command-output do not go together'),
    ]
    for fields, message in bad:
        result = validate(tmp_path, [deploy(tmp_path, "x", **fields)])
        assert result.returncode == 1, (fields, result.stdout)
        assert message in result.stdout, (fields, result.stdout)
        assert "Traceback" not in result.stdout + result.stderr
    # the daemon refuses such a file at start, with the same sentence
    hooks = write_hooks(tmp_path / "hooks.json", [deploy(tmp_path, "x", **{
        "when-busy": "latest", "include-command-output-in-response": True})])
    started = subprocess.run(python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port",
                                        str(free_port())),
                             capture_output=True, text=True, timeout=30)
    assert started.returncode != 0
    assert "do not go together" in started.stdout + started.stderr
    assert "Traceback" not in started.stdout + started.stderr


def test_a_stop_records_waiting_triggers_killed_and_kill_9_leaves_none_unknown(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [
        deploy(tmp_path, "site", **{"when-busy": "latest"}),
        deploy(tmp_path, "slow", debounce="1h")])
    runs_dir, port = tmp_path / "runs", free_port()
    with start(hooks, "-runs-dir", runs_dir, "-shutdown-timeout", "30", port=port) as daemon:
        running = trigger(daemon, "site?n=1")
        wait_until(lambda: ran(tmp_path) == ["1"], what="the first run to start")
        waiting = trigger(daemon, "site?n=2")
        debounced = trigger(daemon, "slow?n=3")
        daemon.signal(signal.SIGTERM)  # the stop waits for the running one, for no other
        wait_until(lambda: "caught terminated signal" in daemon.log(), what="the stop")
        (tmp_path / "release").touch()
        assert daemon.proc.wait(20) == 0
    assert ran(tmp_path) == ["1"]
    with start(hooks, "-runs-dir", runs_dir, port=port) as daemon:
        assert record(daemon, running)["state"] == "succeeded"
        for never_started in (waiting, debounced):
            found = record(daemon, never_started)
            assert found["state"] == "killed" and found["started_at"] is None

        (tmp_path / "release").unlink()
        running = trigger(daemon, "site?n=4")
        wait_until(lambda: ran(tmp_path)[-1:] == ["4"], what="the run to start")
        superseded, waiting = trigger(daemon, "site?n=5"), trigger(daemon, "site?n=6")
        saved = runs_dir / (superseded + ".json")  # the writer appends the new state
        wait_until(lambda: json.loads(saved.read_text().splitlines()[-1])["state"] == "superseded",
                   what="the superseded state on disk")
        daemon.stop(signal.SIGKILL)
    with start(hooks, "-runs-dir", runs_dir, port=port) as daemon:
        found = record(daemon, superseded)
        assert found["state"] == "superseded" and found["superseded_by"] == waiting
        found = record(daemon, waiting)  # handed out, never started: not lost
        assert found["state"] == "interrupted" and found["started_at"] is None
        assert record(daemon, running)["state"] == "interrupted"
    listing = subprocess.run(python_cmd(WEBHOOKD, "-runs", "-runs-dir", runs_dir),
                             capture_output=True, text=True, timeout=30)
    assert "superseded by %s" % waiting in listing.stdout, listing.stdout
    assert ran(tmp_path) == ["1", "4"]


def test_a_reload_changes_the_mode_of_the_next_triggers(tmp_path):
    hooks = tmp_path / "hooks.json"
    write_hooks(hooks, [deploy(tmp_path, "site", **{"when-busy": "latest"}),
                        deploy(tmp_path, "slow", debounce="1h")])
    with start(hooks, "-hotreload") as daemon:
        first = trigger(daemon, "site?n=1")
        wait_until(lambda: ran(tmp_path) == ["1"], what="the first run to start")
        waiting = trigger(daemon, "site?n=2")
        debounced = trigger(daemon, "slow?n=3")
        # queue now (max-concurrency 1 keeps the runs one at a time), and no quiet time
        write_hooks(hooks, [deploy(tmp_path, "site", **{"max-concurrency": 1}),
                            deploy(tmp_path, "slow")])
        wait_until(lambda: daemon.log().count("loaded: slow") == 2, what="the reload")
        queued = trigger(daemon, "site?n=4")  # waits behind the one waiting: both run
        assert record(daemon, waiting)["state"] == "queued"
        newer = trigger(daemon, "slow?n=5")  # takes over the debounced trigger, runs now
        found = record(daemon, debounced)
        assert found["state"] == "superseded" and found["superseded_by"] == newer
        wait_until(lambda: "5" in ran(tmp_path), what="the newer trigger to run")
        (tmp_path / "release").touch()
        for run_id in (first, waiting, queued, newer):
            assert ended(daemon, run_id)["state"] == "succeeded"
    assert ran(tmp_path) == ["1", "5", "2", "4"]


def test_a_redelivery_of_a_superseded_delivery_is_handled_one_of_a_dropped_one_runs(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [
        deploy(tmp_path, "site", **{"when-busy": "latest", "deduplicate": True}),
        deploy(tmp_path, "tests", **{"when-busy": "drop", "deduplicate": True})])

    def deliver(path, delivery):
        status, headers, body = daemon.request("GET", "/hooks/" + path,
                                               headers={"X-GitHub-Delivery": delivery})
        assert status == 200
        return headers["x-webhookd-run"], body

    with start(hooks) as daemon:
        running, _ = deliver("site?n=1", "a")
        superseded, _ = deliver("site?n=2", "b")
        newest, _ = deliver("site?n=3", "c")
        assert record(daemon, superseded)["superseded_by"] == newest
        again, body = deliver("site?n=2", "b")  # its work is the newest run's: not run again
        assert again == superseded and body == b"Already run as %s (superseded).\n" % (
            superseded.encode())
        assert record(daemon, newest)["state"] == "queued"

        deliver("tests?n=4", "d")
        dropped, body = deliver("tests?n=5", "e")
        assert body.startswith(b"Hook is busy")
        (tmp_path / "release").touch()
        for run_id in (running, newest):
            assert ended(daemon, run_id)["state"] == "succeeded"
        wait_until(lambda: "4" in ran(tmp_path), what="the tests hook to run")
        wait_until(lambda: get_json(daemon, "/status")["runs"].get("tests") is None,
                   what="the tests hook to be idle")
        redelivered, _ = deliver("tests?n=5", "e")  # it never ran: now it does
        found = ended(daemon, redelivered)
        assert found["state"] == "succeeded" and found["redelivery_of"] == dropped
    assert sorted(ran(tmp_path)) == ["1", "3", "4", "5"]
