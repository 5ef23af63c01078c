"""Black-box tests of issue 33 item 5: a run's record holds its command line and environment,
and every secret of the hooks file (rule secrets, template expansions, a hook's `mask`
patterns) is masked wherever a run is shown: its record, output, page and the log.  The real
daemon on a free 127.0.0.1 port, real HTTP, the page in headless Chromium.
"""
import hashlib
import hmac
import json
import subprocess
import time

from support import WEBHOOKD, Daemon, free_port, python_cmd
from test_webhookd_features import script, wait_until, write_hooks
from test_webhookd_page import HTML, browser, page_problems, text_of  # noqa: F401 (fixture)

SECRET = "hmac-secret-zzz"
DEPLOY_KEY = "dk-0123456789abcdef"
API_TOKEN = "tok-ffffeeee1111"
GITHUB_TOKEN = "ghp_" + "A1b2C3d4E5f6G7h8I9j0" + "K1l2M3n4O5p6Q7r8"
HIDDEN = (SECRET, DEPLOY_KEY, API_TOKEN, GITHUB_TOKEN)


def setup(tmp_path, *flags):
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "api-token").write_text(API_TOKEN + "\n")
    deploy = script(tmp_path / "deploy.sh", (
        'echo "branch=$1 commit=$2 key=$3 token=$TOKEN"\n'
        # each secret's end comes in a write of its own
        "printf 'secret=%s'\nsleep 0.3\nprintf '%s gh=%s'\nsleep 0.3\nprintf '%s\\n'\n")
        % (SECRET[:5], SECRET[5:], GITHUB_TOKEN[:10], GITHUB_TOKEN[10:]))
    hooks = tmp_path / "hooks.json"
    hooks.write_text(json.dumps([{
        "id": "deploy", "execute-command": str(deploy),
        "include-command-output-in-response": True,
        "pass-arguments-to-command": [
            {"source": "payload", "name": "ref"},
            {"source": "payload", "name": "head_commit.id"},
            {"source": "string", "name": '{{ getenv `DEPLOY_KEY` }}'}],
        "pass-environment-to-command": [
            {"source": "string", "name": '{{ credential `api-token` }}', "envname": "TOKEN"},
            {"source": "payload", "name": "ref", "envname": "BRANCH"}],
        "mask": ["ghp_[A-Za-z0-9]{36}"],
        "trigger-rule": {"match": {"type": "payload-hmac-sha256", "secret": SECRET,
                                   "parameter": {"source": "header",
                                                 "name": "X-Hub-Signature-256"}}}}]))
    hooks.chmod(0o600)
    env = {"DEPLOY_KEY": DEPLOY_KEY, "CREDENTIALS_DIRECTORY": str(credentials)}
    port = free_port()
    return Daemon(python_cmd(WEBHOOKD, "-template", "-hooks", hooks, "-ip", "127.0.0.1",
                             "-port", str(port), "-verbose", "-status-path", "/status", *flags),
                  port, env=env)


def deploy(daemon):
    body = json.dumps({"ref": "refs/heads/main", "head_commit": {"id": "c0ffee"}}).encode()
    signature = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    status, headers, answer = daemon.request("POST", "/hooks/deploy", body, {
        "Content-Type": "application/json", "X-Hub-Signature-256": signature})
    assert status == 200, answer
    run_id = headers["x-webhookd-run"]

    def ended():
        record = json.loads(daemon.request("GET", "/status/runs/" + run_id)[2])
        return record["state"] not in ("queued", "running") and record
    return answer, wait_until(ended, what="the run to end")


def test_a_run_record_shows_its_command_line_with_every_secret_masked(tmp_path):
    with setup(tmp_path) as daemon:
        answer, record = deploy(daemon)
        assert record["state"] == "succeeded", record
        assert record["arguments"] == [str(tmp_path / "deploy.sh"), "refs/heads/main",
                                       "c0ffee", "********"]
        assert record["environment"] == {"TOKEN": "********", "BRANCH": "refs/heads/main"}
        output = daemon.request("GET", "/status/runs/%s/output" % record["id"])[2].decode()
        assert output == ("branch=refs/heads/main commit=c0ffee key=******** token=********\n"
                          "secret=******** gh=********\n")
        # the sender's answer stays Go's: the command's output as it printed it
        assert DEPLOY_KEY.encode() in answer and GITHUB_TOKEN.encode() in answer
        shown = [daemon.request("GET", path, headers=headers)[2].decode() for path, headers in (
            ("/status/runs", None), ("/status/runs/" + record["id"], None),
            ("/status/runs/" + record["id"], HTML), ("/status", HTML))]
        # (the log is written by its own thread: wait for the run's last line)
        log = wait_until(lambda: "command output" in daemon.log() and daemon.log(), 20,
                         "the run's output in the log")
        assert "executing" in log and "c0ffee" in log
        for secret in HIDDEN:
            assert not any(secret in text for text in shown + [log]), secret


def test_runs_prints_each_runs_command_line_masked(tmp_path):
    runs_dir = tmp_path / "runs"
    with setup(tmp_path, "-runs-dir", runs_dir) as daemon:
        _, record = deploy(daemon)
        time.sleep(0.3)  # the record reaches -runs-dir a moment after the run ends
    listing = subprocess.run(python_cmd(WEBHOOKD, "-runs", "-runs-dir", runs_dir),
                             capture_output=True, text=True, timeout=30)
    assert listing.returncode == 0, listing.stderr
    head, row = listing.stdout.splitlines()
    assert head.endswith("HOOK  COMMAND")
    assert row.startswith(record["id"] + " ")
    assert row.endswith("  deploy  %s refs/heads/main c0ffee '********'" % (tmp_path / "deploy.sh"))
    assert not any(secret in listing.stdout for secret in HIDDEN)


def test_runs_lists_and_validate_know_the_mask_field(tmp_path):
    def validate(mask):
        hooks = write_hooks(tmp_path / "check.json", [
            {"id": "h", "execute-command": "/bin/true", "mask": mask}])
        return subprocess.run(python_cmd(WEBHOOKD, "-hooks", hooks, "-validate"),
                              capture_output=True, text=True, timeout=30)
    for good in (["ghp_[A-Za-z0-9]{36}"], ["xoxb-\\d{12}-[a-z]{4}"], ["a.b"]):
        assert validate(good).returncode == 0, (good, validate(good).stdout)
    for bad in (["(a+)+b"], ["x*"], ["a|b"], ["t{2000}"], ["é{3}"], "ghp_"):
        result = validate(bad)
        assert result.returncode == 1, (bad, result.stdout)
        assert "mask" in result.stdout, result.stdout


def test_the_run_page_shows_the_command_masked(browser, tmp_path):  # noqa: F811
    with setup(tmp_path) as daemon:
        _, record = deploy(daemon)
        page_problems(browser)
        browser.get("http://127.0.0.1:%d/status/runs/%s" % (daemon.port, record["id"]))
        facts = text_of(browser, "dl")
        assert "%s refs/heads/main c0ffee '********'" % (tmp_path / "deploy.sh") in facts
        assert "TOKEN='********'" in facts and "BRANCH=refs/heads/main" in facts
        assert "gh=********" in text_of(browser, "#output")
        assert not any(secret in browser.page_source for secret in HIDDEN)
        assert page_problems(browser) == []
