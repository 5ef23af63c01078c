"""Black-box tests of issue 33 item 6: a run replayed from the status site
(`POST <status-path>/runs/<id>/replay`), with the status token as Bearer, or from the run page's
Replay button (Basic, a same-origin request, the page's nonce).  The real daemon on a free
127.0.0.1 port, real HTTP; the command is a small script recording what it was given (argv,
environment, a passed file, stdin), so a replay is checked by its side effects; the button in
headless Chromium.
"""
import http.client
import json
import re
import signal
import sys
import time

from support import WEBHOOKD, Daemon, free_port, python_cmd
from test_webhookd_features import wait_until
from test_webhookd_page import (HTML, basic, browser, page_problems, text_of,  # noqa: F401
                                wait_for)

TOKEN = "status-token-1"
HOOK_TOKEN = "tok-0123456789"  # compared by the rule: masked in the record, real in argv
BEARER = {"Authorization": "Bearer " + TOKEN}
BODY = json.dumps({"ref": "refs/heads/main", "note": "line one\nline two"})
RECORDER = """#!%s
import json, os, sys
record = {"argv": sys.argv[1:], "branch": os.environ.get("BRANCH"),
          "file": open(os.environ["NOTE"]).read(), "stdin": sys.stdin.read()}
with open(os.path.join(%r, "%%d.json" %% os.getpid()), "w") as handle:
    json.dump(record, handle)
print("recorded")
"""


def hook(tmp_path, ref_argument="ref"):
    return [{
        "id": "deploy", "execute-command": str(tmp_path / "record.py"),
        "pass-payload-to-stdin": True,
        "pass-arguments-to-command": [{"source": "payload", "name": ref_argument},
                                      {"source": "header", "name": "X-Token"}],
        "pass-environment-to-command": [{"source": "payload", "name": "ref",
                                         "envname": "BRANCH"}],
        "pass-file-to-command": [{"source": "payload", "name": "note", "envname": "NOTE"}],
        "trigger-rule": {"match": {"type": "value", "value": HOOK_TOKEN,
                                   "parameter": {"source": "header", "name": "X-Token"}}}}]


def start(tmp_path, *flags):
    ran = tmp_path / "ran"
    ran.mkdir(exist_ok=True)
    recorder = tmp_path / "record.py"
    recorder.write_text(RECORDER % (sys.executable, str(ran)))
    recorder.chmod(0o755)
    hooks = tmp_path / "hooks.json"
    hooks.write_text(json.dumps(hook(tmp_path)))
    port = free_port()
    daemon = Daemon(python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port",
                               str(port), "-verbose", "-status-path", "/status", *flags), port)
    daemon.hooks, daemon.ran = hooks, ran
    return daemon


def reload(daemon, hooks):
    """Write the hooks file and reload it (SIGHUP); returns once it is read."""
    daemon.hooks.write_text(json.dumps(hooks))
    daemon.signal(signal.SIGHUP)
    wait_until(lambda: "found %d hook(s) in file" % len(hooks) in daemon.log().partition(
        "caught HUP signal")[2], 20, "the reload")
    time.sleep(0.1)  # the hooks are published just after they are logged


def recorded(daemon):
    return [json.loads(path.read_text()) for path in sorted(daemon.ran.iterdir())]


def run_record(daemon, run_id):
    return json.loads(daemon.request("GET", "/status/runs/" + run_id, headers=BEARER)[2])


def ended(daemon, run_id):
    def done():
        record = run_record(daemon, run_id)
        return record["state"] not in ("queued", "running") and record
    return wait_until(done, 20, "run %s to end" % run_id)


def deploy(daemon, token=HOOK_TOKEN):
    status, headers, _ = daemon.request("POST", "/hooks/deploy", BODY, {
        "Content-Type": "application/json", "X-Token": token})
    assert status == 200, status
    return headers.get("x-webhookd-run")


def replay(daemon, run_id, body=None, headers=None):
    return daemon.request("POST", "/status/runs/%s/replay" % run_id, body, headers)


def test_a_replay_with_the_token_runs_the_recorded_invocation_again(tmp_path):
    with start(tmp_path, "-status-token", TOKEN) as daemon:
        original = ended(daemon, deploy(daemon))
        assert original["state"] == "succeeded" and original["replayOf"] is None
        # the hooks file changes: a replay still runs what the run was given, not a rebuild
        reload(daemon, hook(tmp_path, ref_argument="note"))
        status, headers, body = replay(daemon, original["id"], headers=BEARER)
        assert status == 202, body
        answer = json.loads(body)
        assert answer == {"id": headers["x-webhookd-run"], "replayOf": original["id"]}
        again = ended(daemon, answer["id"])
        assert again["state"] == "succeeded" and again["replayOf"] == original["id"]
        assert again["arguments"] == original["arguments"] == [
            str(tmp_path / "record.py"), "refs/heads/main", "********"]
        assert again["environment"] == original["environment"]
        first, second = recorded(daemon)
        assert first == second == {"argv": ["refs/heads/main", HOOK_TOKEN],
                                   "branch": "refs/heads/main", "file": "line one\nline two",
                                   "stdin": BODY}
        wait_until(lambda: "replaying run %s of deploy as run %s" % (
            original["id"], answer["id"]) in daemon.log(), 20, "the log line")  # (a log thread)
        # a replay of the replay is one more run, of the same invocation
        status, headers, _ = replay(daemon, again["id"], headers=BEARER)
        assert status == 202 and ended(daemon, headers["x-webhookd-run"])["replayOf"] == again["id"]
        assert len(recorded(daemon)) == 3
        assert HOOK_TOKEN not in daemon.request("GET", "/status/runs", headers=BEARER)[2].decode()


def test_replays_a_page_elsewhere_could_forge_are_refused_and_run_nothing(tmp_path):
    with start(tmp_path, "-status-token", TOKEN) as daemon:
        run_id = ended(daemon, deploy(daemon))["id"]
        page = daemon.request("GET", "/status/runs/" + run_id, headers=dict(
            HTML, Authorization=basic("me", TOKEN)))[2].decode()
        nonce = re.search(r'name="nonce" value="([^"]+)"', page).group(1)
        other = ended(daemon, deploy(daemon))["id"]
        other_page = daemon.request("GET", "/status/runs/" + other, headers=dict(
            HTML, Authorization=basic("me", TOKEN)))[2].decode()
        other_nonce = re.search(r'name="nonce" value="([^"]+)"', other_page).group(1)
        form = {"Authorization": basic("me", TOKEN),
                "Content-Type": "application/x-www-form-urlencoded"}
        here = "http://127.0.0.1:%d" % daemon.port
        for body, sent in (
                (None, form),  # Basic alone: what a browser sends by itself
                ("nonce=", form),
                ("nonce=" + nonce[:-1] + ("0" if nonce[-1] != "0" else "1"), form),
                ("nonce=" + other_nonce, form),  # another run's page
                ("nonce=" + nonce.split(".")[0] + ".", form),
                ("nonce=1.%s" % nonce.split(".")[1], form),  # the time changed
                ("nonce=" + nonce, dict(form, Origin="http://evil.example")),
                ("nonce=" + nonce, dict(form, Origin="null")),
                ("nonce=" + nonce, dict(form, Origin="http://evil.example", **HTML)),
                ("nonce=" + nonce, dict(form, Origin=here, **{"Sec-Fetch-Site": "cross-site"})),
                ("nonce=" + nonce, dict(form, **{"Sec-Fetch-Site": "same-site"})),
                ("nonce=" + nonce, {"Content-Type": "application/x-www-form-urlencoded"}),
                ("nonce=" + nonce, dict(form, Authorization=basic("me", "wrong"))),
                ("nonce=" + nonce, dict(form, Authorization="Bearer wrong"))):
            status, headers, answer = replay(daemon, run_id, body, sent)
            assert status == 403, (body, sent, status, answer)
            assert ("Not replayed" in answer.decode()) == ("Accept" in sent), answer
            assert "x-webhookd-run" not in headers
        status, _, _ = replay(daemon, run_id, "nonce=" + nonce + "&x=" + "a" * 2000, form)
        assert status == 413
        time.sleep(0.5)  # anything started would have recorded by now
        assert len(recorded(daemon)) == 2
        assert len(json.loads(daemon.request("GET", "/status/runs", headers=BEARER)[2])) == 2
        # the same page's nonce, from the page's own origin: one replay
        status, headers, _ = replay(daemon, run_id, "nonce=" + nonce, dict(
            form, Origin=here, **{"Sec-Fetch-Site": "same-origin"}))
        assert status == 202 and ended(daemon, headers["x-webhookd-run"])["replayOf"] == run_id
        assert len(recorded(daemon)) == 3


def test_without_a_token_set_even_loopback_needs_the_pages_nonce(tmp_path):
    with start(tmp_path) as daemon:
        run_id = ended(daemon, deploy(daemon))["id"]
        for headers in ({}, {"Authorization": "Bearer anything"}):
            assert replay(daemon, run_id, headers=headers)[0] == 403
        assert replay(daemon, run_id, headers={"X-Forwarded-For": "203.0.113.9"})[0] == 403
        # the access check comes before the lookup: without the nonce, no telling which runs exist
        assert replay(daemon, "20260101T000000Z-00000000")[0] == 403
        page = daemon.request("GET", "/status/runs/" + run_id, headers=HTML)[2].decode()
        nonce = re.search(r'name="nonce" value="([^"]+)"', page).group(1)
        status, headers, _ = replay(daemon, run_id, "nonce=" + nonce, {
            "Content-Type": "application/x-www-form-urlencoded", "Accept": "text/html"})
        assert status == 303 and headers["location"] == "/status/runs/" + headers[
            "x-webhookd-run"]
        assert ended(daemon, headers["x-webhookd-run"])["replayOf"] == run_id
        assert len(recorded(daemon)) == 2


def test_what_cannot_be_replayed_gets_a_clear_4xx(tmp_path):
    runs_dir = tmp_path / "runs"
    with start(tmp_path, "-status-token", TOKEN, "-runs-dir", runs_dir) as daemon:
        assert deploy(daemon, token="wrong") is None
        refused = json.loads(daemon.request("GET", "/status/runs?state=refused",
                                            headers=BEARER)[2])[0]
        status, headers, body = replay(daemon, refused["id"], headers=BEARER)
        assert status == 409 and "refused delivery" in json.loads(body)["error"]
        assert "x-webhookd-run" not in headers
        assert replay(daemon, "20260101T000000Z-00000000", headers=BEARER)[0] == 404
        assert daemon.request("GET", "/status/runs/%s/replay" % refused["id"],
                              headers=BEARER)[0] == 405
        for path in ("/status/runs/replay", "/status/runs/%s/x/replay" % refused["id"]):
            assert daemon.request("POST", path, headers=BEARER)[0] == 405, path
            assert daemon.request("GET", path, headers=BEARER)[0] == 404, path
        run_id = ended(daemon, deploy(daemon))["id"]
        time.sleep(0.3)  # the record reaches -runs-dir
        # the invocation is kept in memory only, and never written to -runs-dir
        assert not any(HOOK_TOKEN.encode() in path.read_bytes()
                       for path in runs_dir.iterdir() if path.is_file())
        # the hook is removed: its runs are no longer replayed
        reload(daemon, [dict(hook(tmp_path)[0], id="renamed")])
        status, _, body = replay(daemon, run_id, headers=BEARER)
        assert status == 409 and "no longer served" in json.loads(body)["error"]
        daemon.hooks.write_text(json.dumps(hook(tmp_path)))
    with start(tmp_path, "-status-token", TOKEN, "-runs-dir", runs_dir) as daemon:
        status, headers, body = replay(daemon, run_id, headers=BEARER)
        assert status == 410 and "not kept" in json.loads(body)["error"], body
        page = daemon.request("GET", "/status/runs/" + run_id, headers=dict(
            HTML, Authorization=basic("me", TOKEN)))[2].decode()
        assert "not kept" in page and 'name="nonce"' not in page
    assert len(recorded(daemon)) == 1


def test_the_replay_button_on_the_run_page(browser, tmp_path):  # noqa: F811
    with start(tmp_path) as daemon:
        run_id = ended(daemon, deploy(daemon))["id"]
        page_problems(browser)
        browser.get("http://127.0.0.1:%d/status/runs/%s" % (daemon.port, run_id))
        assert "Replay" in text_of(browser, "dl")
        browser.find_element("css selector", "form button").click()
        wait_for(browser, lambda: run_id not in browser.current_url, "the new run's page")
        new_id = browser.current_url.rsplit("/", 1)[1]
        # (while the replay runs, the page's script replaces its record: wait_for reads again)
        wait_for(browser, lambda: "succeeded" in text_of(browser, ".state"), "the replay's end")
        wait_for(browser, lambda: run_id in text_of(browser, "dl"), "Replay of")
        assert ended(daemon, new_id)["replayOf"] == run_id
        first, second = recorded(daemon)
        assert first == second
        assert page_problems(browser) == []


def test_a_replay_waits_for_the_hooks_max_concurrency_turn(tmp_path):
    """A replay is no way around max-concurrency: it waits while a run of the hook goes, and
    leaves the hook's count of running commands as it found it (a replay that skipped the turn
    but gave it back left the count at -1, so two deploys then ran at once)."""
    gate = tmp_path / "gate"
    slow = tmp_path / "slow.sh"
    slow.write_text("#!/bin/sh\nwhile [ ! -e %s ]; do sleep 0.05; done\n" % gate)
    slow.chmod(0o755)
    with start(tmp_path, "-status-token", TOKEN) as daemon:
        reload(daemon, [{"id": "slow", "execute-command": str(slow), "max-concurrency": 1}])

        def trigger():
            status, headers, _ = daemon.request("POST", "/hooks/slow")
            assert status == 200
            return headers["x-webhookd-run"]

        def state(run_id):
            return run_record(daemon, run_id)["state"]

        def busy():
            return json.loads(daemon.request("GET", "/status", headers=BEARER)[2])["runs"]

        first = trigger()
        wait_until(lambda: state(first) == "running", 20, "the first run")
        status, headers, _ = replay(daemon, first, headers=BEARER)
        assert status == 202
        again = headers["x-webhookd-run"]
        time.sleep(0.5)
        assert state(again) == "queued" and busy() == {"slow": {"running": 1, "queued": 1}}
        gate.touch()
        assert ended(daemon, first)["state"] == ended(daemon, again)["state"] == "succeeded"
        wait_until(lambda: busy() == {}, 20, "the turns given back")  # just after the records
        # the hook still runs one command at a time
        gate.unlink()
        second, third = trigger(), trigger()
        wait_until(lambda: state(second) == "running", 20, "the second run")
        time.sleep(0.5)
        assert state(third) == "queued"
        gate.touch()
        assert ended(daemon, third)["state"] == "succeeded"


def test_a_run_id_of_any_bytes_gets_a_4xx(tmp_path):
    """The nonce is checked against the run id of the path, whatever bytes it decodes to: a
    `%ff` there, with a nonce of the current time, was a 500 and a traceback, from any loopback
    client (or any page its browser shows) without a token set."""
    with start(tmp_path) as daemon:
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        for run_id in ("%ff", "%ed%a0%80", "a%ffb"):
            status, _, body = replay(daemon, run_id, "nonce=%d.00" % time.time(), form)
            assert status == 403, (run_id, status, body)
        assert "Traceback" not in daemon.log()


def test_a_chunked_replay_form_is_capped_as_a_sized_one(tmp_path):
    """The replay's form holds a nonce: more than 1024 bytes is a 413 whether its length is
    declared or it comes chunked (which was read on up to -max-body-bytes, all of it held,
    from any loopback client without a token)."""
    with start(tmp_path) as daemon:
        run_id = ended(daemon, deploy(daemon))["id"]
        for chunks in ([b"nonce=" + b"a" * 1100], [b"nonce=1.", b"a" * 700, b"b" * 700]):
            conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=10)
            try:
                conn.request("POST", "/status/runs/%s/replay" % run_id, body=iter(chunks),
                             headers={"Content-Type": "application/x-www-form-urlencoded"},
                             encode_chunked=True)
                assert conn.getresponse().status == 413
            finally:
                conn.close()
        assert len(recorded(daemon)) == 1
