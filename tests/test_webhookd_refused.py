"""Black-box tests of issue 33's refused deliveries, -explain and rotating secrets (items 1, 2
and 7): the real daemon on a free 127.0.0.1 port, real HTTP, the page in headless Chromium,
-explain and -runs as a user runs them.  Nothing is mocked.
"""
import base64
import hashlib
import hmac
import json
import re
import subprocess
import time

import pytest

from support import WEBHOOKD, Daemon, free_port, python_cmd
from test_webhookd_features import wait_until, write_hooks
from test_webhookd_page import HTML, browser, page_problems, text_of  # noqa: F401 (fixture)

SECRET = "s3cret-shh-do-not-show"
TOKEN = "glpat-very-secret-token"
WHSEC_KEY = b"standard-webhooks-key-24b"
WHSEC = "whsec_" + base64.b64encode(WHSEC_KEY).decode()
HOSTILE = '<script>window.pwned=1</script>'


def signed(body, secret=SECRET):
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def hooks_file(tmp_path, secret=SECRET):
    return write_hooks(tmp_path / "hooks.json", [
        {"id": "deploy", "execute-command": "/bin/true", "trigger-rule": {"and": [
            {"match": {"type": "payload-hmac-sha256", "secret": secret, "parameter": {
                "source": "header", "name": "X-Hub-Signature-256"}}},
            {"match": {"type": "value", "value": "refs/heads/main", "parameter": {
                "source": "payload", "name": "ref"}}}]}},
        {"id": "gitlab", "execute-command": "/bin/true", "trigger-rule": {"match": {
            "type": "value", "value": TOKEN, "parameter": {
                "source": "header", "name": "X-Gitlab-Token"}}}},
        {"id": "sw", "execute-command": "/bin/true", "trigger-rule": {"match": {
            "type": "standard-webhooks", "secret": ["whsec_" + base64.b64encode(
                b"the-new-key").decode(), WHSEC]}}}])


def start(hooks, *flags):
    port = free_port()
    return Daemon(python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", str(port),
                             "-verbose", "-status-path", "/status", *flags), port)


def push(daemon, ref, signature=None, hook="deploy"):
    body = json.dumps({"ref": ref}).encode()
    return daemon.request("POST", "/hooks/" + hook, body, {
        "Content-Type": "application/json",
        "X-Hub-Signature-256": signature or signed(body)})


def refusals(daemon, hook=None):
    status, _, body = daemon.request("GET", "/status/runs?state=refused" + (
        "&hook=" + hook if hook else ""))
    assert status == 200, body
    return json.loads(body)


def refused_metric(daemon, hook):
    text = daemon.request("GET", "/status/metrics")[2].decode()
    found = re.search(r'^webhookd_refused_total\{hook="%s"\} (\d+)$' % hook, text, re.M)
    return int(found.group(1)) if found else 0


def test_a_refused_delivery_is_recorded_with_its_rules_explained(tmp_path):
    with start(hooks_file(tmp_path)) as daemon:
        status, headers, body = push(daemon, "refs/heads/dev")
        # the sender's answer stays Go's: no run id, the same words
        assert (status, body) == (200, b"Hook rules were not satisfied.")
        assert "x-webhookd-run" not in headers
        [record] = wait_until(lambda: refusals(daemon), what="the refusal's record")
        assert record["state"] == "refused" and record["hook"] == "deploy"
        assert record["reason"] == ("rule 2 of `and` - payload `ref` was `refs/heads/dev`, "
                                    "wanted `refs/heads/main`")
        tree = record["rules"]
        assert (tree["rule"], tree["result"], tree["of"]) == ("and", False, 2)
        signature, ref = tree["rules"]
        assert signature == {"rule": "match", "type": "payload-hmac-sha256", "source": "header",
                             "name": "X-Hub-Signature-256", "present": True, "length": 71,
                             "result": True}
        assert (ref["source"], ref["name"], ref["value"], ref["wanted"], ref["result"]) == (
            "payload", "ref", "refs/heads/dev", "refs/heads/main", False)

        # a signature that does not match: Go's 500, and only its presence and length shown
        status, _, body = push(daemon, "refs/heads/main", signature="sha256=" + "ab" * 32)
        assert (status, body) == (500, b"Error occurred while evaluating hook rules.")
        wait_until(lambda: len(refusals(daemon)) == 2, what="the second refusal")
        newest = refusals(daemon)[0]
        assert newest["reason"] == ("rule 1 of `and` - header `X-Hub-Signature-256`: "
                                    "signature did not match (71 characters)")
        # a token compared as a value is a secret too: its length, never its text
        assert daemon.request("POST", "/hooks/gitlab", b"", {
            "X-Gitlab-Token": "glpat-wrong-guess"})[0] == 200
        [gitlab] = wait_until(lambda: refusals(daemon, "gitlab"), what="the gitlab refusal")
        assert gitlab["reason"] == "header `X-Gitlab-Token` (17 characters) did not match"
        everything = daemon.request("GET", "/status/runs")[2].decode()
        for hidden in (SECRET, TOKEN, "glpat-wrong-guess", "ab" * 32,
                       signed(b'{"ref": "refs/heads/dev"}')[7:]):
            assert hidden not in everything
        assert refused_metric(daemon, "deploy") == 2 and refused_metric(daemon, "gitlab") == 1
        # a delivery the rules let through is a run, as before
        status, headers, _ = push(daemon, "refs/heads/main")
        assert status == 200 and headers["x-webhookd-run"]
        assert len(refusals(daemon)) == 3
        assert daemon.request("GET", "/status/runs?state=nonsense")[0] == 400


def test_refusals_are_kept_apart_from_runs_and_bounded(tmp_path):
    with start(hooks_file(tmp_path), "-runs-keep", "2") as daemon:
        assert push(daemon, "refs/heads/main")[0] == 200
        for n in range(5):
            push(daemon, "refs/heads/dev-%d" % n)
        wait_until(lambda: refused_metric(daemon, "deploy") == 5, what="five refusals")
        kept = refusals(daemon)
        # -runs-keep per hook, for refusals apart: anyone can send them, so they never push
        # a hook's runs out
        assert [r["rules"]["rules"][1]["value"] for r in kept] == [
            "refs/heads/dev-4", "refs/heads/dev-3"]
        runs = json.loads(daemon.request("GET", "/status/runs?hook=deploy")[2])
        assert [r["state"] for r in runs if r["state"] != "refused"] == ["succeeded"] or \
            [r["state"] for r in runs if r["state"] != "refused"] == ["running"]
        # a long value is cut, and its length said
        push(daemon, "refs/heads/" + "x" * 5000)
        long_one = wait_until(lambda: refusals(daemon)[0]["rules"]["rules"][1]["value"]
                              .endswith("(5011 characters)") and refusals(daemon)[0],
                              what="the long refusal")
        assert len(long_one["reason"]) < 400


def test_refusals_count_their_texts_as_written_against_runs_max_bytes(tmp_path):
    """A refusal counts against -runs-max-bytes with its texts as its record writes them: a
    request id (-x-request-id) of 50,000 quotes is 100,000 bytes of JSON on each of a record's
    lines, so a bound of 700,000 bytes keeps two such refusals, not the four their length
    alone would allow."""
    with start(hooks_file(tmp_path), "-x-request-id", "-runs-max-bytes", "700000") as daemon:
        for number in range(6):
            assert daemon.request("POST", "/hooks/gitlab", b"", {
                "X-Gitlab-Token": "a-wrong-guess",
                "X-Request-Id": '"' * 50000 + str(number)})[0] == 200
        kept = refusals(daemon, "gitlab")
        assert 1 <= len(kept) <= 2 and kept[0]["request_id"] == '"' * 50000 + "5"


def test_no_refusal_is_recorded_without_run_history(tmp_path):
    with start(hooks_file(tmp_path), "-runs-keep", "0") as daemon:
        assert push(daemon, "refs/heads/dev")[2] == b"Hook rules were not satisfied."
        assert refused_metric(daemon, "deploy") == 1
        assert refusals(daemon) == []


def test_runs_lists_refusals_from_the_runs_dir(tmp_path):
    folder = tmp_path / "runs"
    with start(hooks_file(tmp_path), "-runs-dir", folder) as daemon:
        push(daemon, "refs/heads/dev\x1b[31m")
        [record] = wait_until(lambda: refusals(daemon), what="the refusal")
        wait_until(lambda: (folder / (record["id"] + ".json")).exists(), what="its file")
    listed = subprocess.run(python_cmd(WEBHOOKD, "-runs", "-runs-dir", folder),
                            capture_output=True, text=True, timeout=30)
    assert listed.returncode == 0, listed.stderr
    [line] = [line for line in listed.stdout.splitlines() if record["id"] in line]
    assert " refused " in line and "refused: rule 2 of `and` - payload `ref` was " \
        "`refs/heads/dev\\x1b[31m`" in line  # a terminal gets no escape sequence
    # kept across a restart
    with start(hooks_file(tmp_path), "-runs-dir", folder) as daemon:
        assert [r["id"] for r in refusals(daemon)] == [record["id"]]


def test_a_value_cannot_reorder_how_it_is_shown(tmp_path):
    """Unicode's bidi controls, line separators and invisible characters in a value are shown
    as escapes, as control characters are: `refs/heads/` + RIGHT-TO-LEFT OVERRIDE + `niam` was
    listed (on the page, and in -runs on a terminal that reorders) as `refs/heads/main`, the
    very ref the rule wants; so was `ma` + ZERO WIDTH SPACE + `in`."""
    folder = tmp_path / "runs"
    spoof = "refs/heads/\u202eniam"
    with start(hooks_file(tmp_path), "-runs-dir", folder) as daemon:
        push(daemon, spoof)
        push(daemon, "refs/heads/\u2066dev\u2069\u2028\u200f")
        push(daemon, "refs/heads/ma\u200bin\ufeff")
        records = wait_until(lambda: len(refusals(daemon)) == 3 and refusals(daemon),
                             what="the refusals")
        assert [r["rules"]["rules"][1]["value"] for r in records] == [
            "refs/heads/ma\\u200bin\\ufeff", "refs/heads/\\u2066dev\\u2069\\u2028\\u200f",
            "refs/heads/\\u202eniam"]
        assert "`refs/heads/\\u202eniam`" in records[2]["reason"]
        wait_until(lambda: all((folder / (r["id"] + ".json")).exists() for r in records),
                   what="their files")
    listed = subprocess.run(python_cmd(WEBHOOKD, "-runs", "-runs-dir", folder),
                            capture_output=True, text=True, timeout=30)
    assert "refs/heads/\\u202eniam" in listed.stdout
    assert not re.search("[\u202e\u2066\u2069\u2028\u200f\u200b\ufeff]", listed.stdout)


def test_refused_trees_mask_the_hooks_files_secrets(tmp_path):
    """A secret of the hooks file that a request puts in a field a rule shows (here the HMAC
    secret, and a token another hook compares), or what a hook's `mask` names, is masked in
    the refused record, its reason, the page and -explain; one across the 120-character cut
    is masked whole."""
    github_token = "ghp_" + "a1B2" * 9
    hooks = hooks_file(tmp_path)
    data = json.loads(hooks.read_text())
    data[0]["mask"] = ["ghp_[A-Za-z0-9]{36}"]
    hooks.write_text(json.dumps(data))
    refs = (TOKEN, github_token, "x" * 110 + SECRET, "refs/heads/" + SECRET)
    with start(hooks) as daemon:
        for ref in refs:
            assert push(daemon, ref)[2] == b"Hook rules were not satisfied."
        records = list(reversed(refusals(daemon, "deploy")))
        assert [r["rules"]["rules"][1]["value"] for r in records] == [
            "********", "********", "x" * 110 + "********... (%d characters)" % len(refs[2]),
            "refs/heads/********"]
        assert records[0]["reason"] == ("rule 2 of `and` - payload `ref` was `********`, "
                                        "wanted `refs/heads/main`")
        shown = [daemon.request("GET", "/status/runs?state=refused")[2].decode()] + [
            daemon.request("GET", "/status/runs/" + r["id"], headers=HTML)[2].decode()
            for r in records]
        assert "payload `ref` was `********`" in shown[1]
        for secret in (TOKEN, github_token, SECRET[:8]):
            assert not any(secret in text for text in shown), secret
    result = explain(hooks, "deploy", saved_request(TOKEN))
    out = result.stdout.decode()
    assert result.returncode == 1 and "payload `ref` was `********`" in out, out
    assert TOKEN not in out


# ---------------------------------------------------------------------------------------------
# -explain
# ---------------------------------------------------------------------------------------------

def explain(hooks, hook_id, stdin):
    return subprocess.run(python_cmd(WEBHOOKD, "-hooks", hooks, "-explain", hook_id),
                          input=stdin, capture_output=True, timeout=30)


def saved_request(ref, signature=None):
    body = json.dumps({"ref": ref}).encode()
    return (b"POST /hooks/deploy HTTP/1.1\r\nHost: example.org\r\n"
            b"Content-Type: application/json\r\nX-Hub-Signature-256: %s\r\n"
            b"Content-Length: %d\r\n\r\n%s" % ((signature or signed(body)).encode(), len(body),
                                                body))


def test_explain_evaluates_a_saved_request_without_running_anything(tmp_path):
    marker = tmp_path / "ran"
    hooks = write_hooks(tmp_path / "hooks.json", [
        {"id": "deploy", "execute-command": "/usr/bin/touch",
         "pass-arguments-to-command": [{"source": "string", "name": str(marker)}],
         "trigger-rule": {"and": [
             {"match": {"type": "payload-hmac-sha256", "secret": SECRET, "parameter": {
                 "source": "header", "name": "X-Hub-Signature-256"}}},
             {"match": {"type": "value", "value": "refs/heads/main", "parameter": {
                 "source": "payload", "name": "ref"}}}]}}])
    refused = explain(hooks, "deploy", saved_request("refs/heads/dev"))
    assert refused.returncode == 1, refused.stderr
    assert refused.stdout.decode().splitlines() == [
        "[no ] and (2 rules)",
        "  [yes] header `X-Hub-Signature-256` (71 characters) matched",
        "  [no ] payload `ref` was `refs/heads/dev`, wanted `refs/heads/main`",
        "refused: rule 2 of `and` - payload `ref` was `refs/heads/dev`, wanted `refs/heads/main`"]
    passed = explain(hooks, "deploy", saved_request("refs/heads/main").replace(b"\r\n", b"\n"))
    assert passed.returncode == 0, passed.stderr
    assert passed.stdout.decode().endswith("the rules hold: hook deploy would run\n")
    bad_signature = explain(hooks, "deploy", saved_request("refs/heads/main", "sha256=00"))
    assert bad_signature.returncode == 1
    assert b"signature did not match" in bad_signature.stdout and SECRET.encode() not in \
        bad_signature.stdout
    assert not marker.exists()
    # bad input: one sentence, no traceback
    for hook_id, stdin, said in (
            ("deploy", b"not a request at all", "no HTTP request head"),
            ("deploy", b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 50\r\n\r\n{}",
             "shorter than its Content-Length"),
            ("deploy", b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
             "chunked body"),
            ("deploy", b"GET / HTTP/9.9\r\n\r\n", "the request is malformed"),
            ("nope", saved_request("refs/heads/main"), 'no hook "nope"')):
        result = explain(hooks, hook_id, stdin)
        err = result.stderr.decode()
        assert result.returncode == 2 and said in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
    missing = subprocess.run(python_cmd(WEBHOOKD, "-hooks", tmp_path / "absent.json",
                                        "-explain", "deploy"), input=b"", capture_output=True,
                             timeout=30)
    assert missing.returncode == 2 and b"Traceback" not in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr


def test_explain_never_shows_what_may_be_a_secret(tmp_path):
    bearer = "Bearer " + TOKEN
    hooks = write_hooks(tmp_path / "hooks.json", [
        {"id": "h", "execute-command": "/bin/true", "trigger-rule": {"or": [
            {"match": {"type": "regex", "regex": "^Bearer x", "parameter": {
                "source": "header", "name": "Authorization"}}},
            {"match": {"type": "regex", "regex": "never", "parameter": {
                "source": "entire-headers"}}},
            {"match": {"type": "value", "value": "other", "parameter": {
                "source": "payload", "name": "repository.api_key"}}},
            {"match": {"type": "regex", "regex": "never", "parameter": {
                "source": "raw-request-body"}}}]}}])
    body = json.dumps({"repository": {"api_key": "sk-" + TOKEN}}).encode()
    result = explain(hooks, "h", b"POST /hooks/h HTTP/1.1\r\nHost: a\r\nAuthorization: %s\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (bearer.encode(), len(body), body))
    out = result.stdout.decode()
    assert result.returncode == 1 and TOKEN not in out and "^Bearer x" not in out, out
    assert "header `Authorization` (%d characters) did not match" % len(bearer) in out
    assert "payload `repository.api_key` (%d characters) did not match" % (
        len(TOKEN) + 3) in out
    assert "  [no ] entire-headers (" in out and "  [no ] raw-request-body (" in out, out
    assert out.count("did not match") == 4, out


# ---------------------------------------------------------------------------------------------
# Several secrets; Standard Webhooks
# ---------------------------------------------------------------------------------------------

def standard_headers(body, key=WHSEC_KEY, stamp=None, msg_id="msg_2Lk9", extra=()):
    stamp = str(int(time.time()) if stamp is None else stamp)
    mac = base64.b64encode(hmac.new(key, b"%s.%s.%s" % (msg_id.encode(), stamp.encode(), body),
                                    hashlib.sha256).digest()).decode()
    return {"webhook-id": msg_id, "webhook-timestamp": stamp,
            "webhook-signature": " ".join(list(extra) + ["v1," + mac])}


def test_several_secrets_while_a_sender_rotates(tmp_path):
    with start(hooks_file(tmp_path, secret=["the-new-one", SECRET])) as daemon:
        body = b'{"ref": "refs/heads/main"}'
        for secret in ("the-new-one", SECRET):
            status, headers, _ = daemon.request("POST", "/hooks/deploy", body, {
                "Content-Type": "application/json",
                "X-Hub-Signature-256": signed(body, secret)})
            assert status == 200 and headers["x-webhookd-run"], secret
        status, _, answer = daemon.request("POST", "/hooks/deploy", body, {
            "Content-Type": "application/json",
            "X-Hub-Signature-256": signed(body, "a-third-one")})
        assert (status, answer) == (500, b"Error occurred while evaluating hook rules.")


def test_standard_webhooks_signatures(tmp_path):
    body = b'{"type": "invoice.paid"}'
    with start(hooks_file(tmp_path)) as daemon:
        def send(headers, payload=body):
            return daemon.request("POST", "/hooks/sw", payload, dict(
                headers, **{"Content-Type": "application/json"}))
        # several signatures offered (a sender rotating too): one that matches is enough
        status, headers, _ = send(standard_headers(body, extra=["v1,bm90IGl0", "v2,eHh4"]))
        assert status == 200 and headers["x-webhookd-run"]
        assert send(standard_headers(body, key=b"the-new-key"))[0] == 200
        refused = {
            "wrong key": standard_headers(body, key=b"another-key"),
            "changed body": standard_headers(b'{"type": "invoice.void"}'),
            "too old": standard_headers(body, stamp=int(time.time()) - 400),
            "from the future": standard_headers(body, stamp=int(time.time()) + 400),
            "not a time": dict(standard_headers(body), **{"webhook-timestamp": "soon"})}
        for what, headers in refused.items():
            status, _, answer = send(headers)
            assert (status, answer) == (500, b"Error occurred while evaluating hook rules."), what
        missing = standard_headers(body)
        del missing["webhook-signature"]
        assert send(missing)[2] == b"Hook rules were not satisfied."
        wait_until(lambda: len(refusals(daemon, "sw")) == 6, what="the six refusals")
        reasons = [r["reason"] for r in refusals(daemon, "sw")]
        assert reasons[0] == "header `Webhook-Signature` was missing"
        assert "header `Webhook-Signature`: signature did not match" in reasons[-1]
        assert WHSEC not in daemon.request("GET", "/status/runs")[2].decode()


def test_validate_knows_secret_lists_and_standard_webhooks(tmp_path):
    def validate(rule):
        hooks = write_hooks(tmp_path / "check.json", [
            {"id": "h", "execute-command": "/bin/true", "trigger-rule": {"match": rule}}])
        return subprocess.run(python_cmd(WEBHOOKD, "-hooks", hooks, "-validate"),
                              capture_output=True, text=True, timeout=30)
    header = {"source": "header", "name": "X-Hub-Signature-256"}
    good = [{"type": "payload-hmac-sha256", "secret": ["new-one", "old-one"],
             "parameter": header},
            {"type": "standard-webhooks", "secret": WHSEC},
            {"type": "standard-webhooks", "secret": [WHSEC, base64.b64encode(b"k").decode()]}]
    for rule in good:
        result = validate(rule)
        assert result.returncode == 0, (rule, result.stdout)
    bad = [({"type": "payload-hmac-sha256", "secret": ["new-one", ""], "parameter": header},
            "empty secret"),
           ({"type": "payload-hmac-sha256", "secret": [], "parameter": header},
            "empty list of secrets"),
           ({"type": "standard-webhooks", "secret": "whsec_not base64!"}, "not a whsec_ secret"),
           ({"type": "standard-webhooks", "secret": ""}, "empty secret"),
           ({"type": "value", "value": ["a", "b"], "parameter": header}, "expected a string"),
           ({"type": "regex", "regex": "x", "secret": ["a"], "parameter": header},
            "expected a string")]
    for rule, said in bad:
        result = validate(rule)
        assert result.returncode == 1 and said in result.stdout, (rule, result.stdout)


# ---------------------------------------------------------------------------------------------
# The page, in a real browser
# ---------------------------------------------------------------------------------------------

def test_a_refused_delivery_on_the_page_explained_and_escaped(browser, tmp_path):  # noqa: F811
    hooks = hooks_file(tmp_path)
    with start(hooks) as daemon:
        base = "http://127.0.0.1:%d" % daemon.port
        push(daemon, "refs/heads/" + HOSTILE + "x" * 500)
        [record] = wait_until(lambda: refusals(daemon), what="the refusal")
        page_problems(browser)
        browser.get(base + "/status/runs?state=refused")
        listed = text_of(browser, "section:last-of-type")
        assert record["id"] in listed and "refused: rule 2 of `and` - payload `ref` was " \
            "`refs/heads/%s" % HOSTILE in listed and "characters)" in listed
        browser.find_element("link text", record["id"]).click()
        from test_webhookd_page import wait_for
        wait_for(browser, lambda: "Refused delivery" in text_of(browser, "h1"), "its page")
        tree = text_of(browser, "ul.rules")
        assert "header `X-Hub-Signature-256` (71 characters) matched" in tree
        assert "wanted `refs/heads/main`" in tree and HOSTILE in tree
        command = text_of(browser, "#explain")
        assert command == "webhookd.py -hooks %s -explain deploy < saved-request" % hooks
        assert browser.execute_script("return window.pwned") is None
        assert SECRET not in browser.page_source
        assert page_problems(browser) == []
        # the page's HTML holds the value escaped, whatever a browser makes of it
        page = daemon.request("GET", "/status/runs/" + record["id"], headers=HTML)[2].decode()
        assert HOSTILE not in page and html_escaped(HOSTILE) in page


def html_escaped(text):
    import html
    return html.escape(text, quote=True)
