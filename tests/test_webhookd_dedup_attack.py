"""Attacks on webhookd.py's redelivery-aware dedup and when-busy (issue 33, items 3 and 4):
ways to make a hook run twice for one delivery id, or to have someone else's trigger passed
over.  Each test starts the real daemon on a free 127.0.0.1 port and sends real HTTP; what ran
is what the hook's command appended to a file.  Nothing is mocked.
"""
import hashlib
import json
import time

from test_webhookd_busy import deploy, ran, record
from test_webhookd_dedup import deliver, lines
from test_webhookd_features import script, wait_until, write_hooks
from test_webhookd_refused import TOKEN, WHSEC, signed, standard_headers
from test_webhookd_runs import ended, get_json, hook, start, trigger


def test_a_redelivered_run_stays_the_one_remembered_after_a_restart(tmp_path):
    """A failed delivery redelivered within the same second: its two records' ids sort by
    their random part, and a restart must still remember the later (succeeded) one, not run
    the delivery a third time."""
    ran = tmp_path / "ran"
    command = script(tmp_path / "deploy.sh", 'echo "$1" >> %s\nexit "$2"\n' % ran)
    hooks = write_hooks(tmp_path / "hooks.json", [hook("deploy", command, **{
        "deduplicate": True, "pass-arguments-to-command": [
            {"source": "header", "name": "X-Note"}, {"source": "header", "name": "X-Code"}]})])
    runs_dir = tmp_path / "runs"
    pairs = []  # (delivery, the failed run, its redelivery that succeeded)
    with start(hooks, "-runs-dir", runs_dir) as daemon:
        for attempt in range(60):
            delivery = "guid-%d" % attempt
            _, failed, _ = deliver(daemon, "deploy", delivery, {
                "X-GitHub-Delivery": delivery, "X-Code": "1"})
            first = ended(daemon, failed)
            _, redone, _ = deliver(daemon, "deploy", delivery, {
                "X-GitHub-Delivery": delivery, "X-Code": "0"})
            second = ended(daemon, redone)
            assert (first["state"], second["state"]) == ("failed", "succeeded")
            assert second["redelivery_of"] == failed
            pairs.append((delivery, failed, redone))
            # the order a restart may see them in: the same second, the later id first
            if first["queued_at"] == second["queued_at"] and redone < failed:
                break
        else:
            raise AssertionError("no redelivery sorted before its failed run in 60 tries")
        time.sleep(0.3)  # the ended states reach -runs-dir a moment after the runs end
    assert len(lines(ran)) == 2 * len(pairs)
    # a hand-edited record (the folder is the daemon user's) whose fields are not as written
    (runs_dir / "20260101T000000Z-00000000.json").write_text(json.dumps({
        "id": "20260101T000000Z-00000000", "hook": "deploy", "state": "failed",
        "delivery": "guid-0", "redelivery_of": ["not", "an", "id"]}) + "\n")
    with start(hooks, "-runs-dir", runs_dir) as daemon:
        for delivery, failed, redone in pairs:
            status, answer, body = deliver(daemon, "deploy", "again", {
                "X-GitHub-Delivery": delivery, "X-Code": "0"})
            assert (status, answer, body) == (
                200, redone, b"Already run as %s (succeeded).\n" % redone.encode())
    assert "again" not in lines(ran)


def test_a_replayed_standard_webhooks_delivery_cannot_dodge_its_signed_id(tmp_path):
    """Standard Webhooks signs `webhook-id` (with the timestamp and body): it is what a replay
    within the 5 minutes' tolerance must be caught by.  Someone replaying a captured delivery
    adds a header that `"deduplicate": true` also reads, such as X-GitHub-Delivery, which no
    signature covers: the signed id still decides."""
    ran = tmp_path / "ran"
    command = script(tmp_path / "deploy.sh", 'echo "$1" >> %s\n' % ran)
    hooks = write_hooks(tmp_path / "hooks.json", [hook("deploy", command, **{
        "deduplicate": True,
        "pass-arguments-to-command": [{"source": "header", "name": "X-Note"}],
        "trigger-rule": {"match": {"type": "standard-webhooks", "secret": WHSEC}}})])
    signed = standard_headers(b"{}", msg_id="msg_2Lk9replayed")
    with start(hooks) as daemon:
        status, first, _ = deliver(daemon, "deploy", "sent", signed)
        assert status == 200 and first
        ended(daemon, first)
        for forged in ("X-GitHub-Delivery", "X-Gitea-Delivery", "X-Gitlab-Event-UUID"):
            status, answer, body = deliver(daemon, "deploy", "replayed", dict(
                signed, **{forged: "any-new-id"}))
            assert (status, answer, body) == (
                200, first, b"Already run as %s (succeeded).\n" % first.encode())
    assert lines(ran) == ["sent"]


def test_a_debounce_shortened_by_a_reload_holds_the_next_trigger_no_longer(tmp_path):
    """A quiet time of 1h, corrected to 1s by a reload: the next trigger takes the held one's
    place and runs after 1s, not when the old hour would have ended."""
    hooks = tmp_path / "hooks.json"
    (tmp_path / "release").touch()
    write_hooks(hooks, [deploy(tmp_path, "site", debounce="1h")])
    with start(hooks, "-hotreload") as daemon:
        held = trigger(daemon, "site?n=1")
        write_hooks(hooks, [deploy(tmp_path, "site", debounce="1s")])
        wait_until(lambda: daemon.log().count("loaded: site") == 2, what="the reload")
        newer = trigger(daemon, "site?n=2")
        assert record(daemon, held)["superseded_by"] == newer
        assert ended(daemon, newer)["state"] == "succeeded"
    assert ran(tmp_path) == ["2"]


def test_a_delivery_id_read_from_a_secret_header_is_kept_as_its_digest(tmp_path):
    """`"deduplicate"` may name a header that carries a secret or a signature (a signature
    header: one run per signed body; a token header): the run records, the run page and the
    log show its digest, never its value, and it still deduplicates."""
    ran = tmp_path / "ran"
    command = script(tmp_path / "deploy.sh", 'echo "$1" >> %s\n' % ran)
    arguments = {"pass-arguments-to-command": [{"source": "header", "name": "X-Note"}]}
    hooks = write_hooks(tmp_path / "hooks.json", [
        hook("github", command, deduplicate="X-Hub-Signature-256", **arguments, **{
            "trigger-rule": {"match": {"type": "payload-hmac-sha256", "secret": "s3cret-shh",
                                       "parameter": {"source": "header",
                                                     "name": "X-Hub-Signature-256"}}}}),
        hook("gitlab", command, deduplicate="X-Gitlab-Token", **arguments, **{
            "trigger-rule": {"match": {"type": "value", "value": TOKEN, "parameter": {
                "source": "header", "name": "X-Gitlab-Token"}}}})])
    signature = signed(b"{}", "s3cret-shh")
    sent = {"github": {"X-Hub-Signature-256": signature}, "gitlab": {"X-Gitlab-Token": TOKEN}}
    with start(hooks) as daemon:
        for hook_id, headers in sent.items():
            value = next(iter(headers.values()))
            status, first, _ = deliver(daemon, hook_id, hook_id, headers)
            assert status == 200 and first
            record = ended(daemon, first)
            assert record["delivery"] == "sha256:" + hashlib.sha256(value.encode()).hexdigest()
            status, again, body = deliver(daemon, hook_id, hook_id + "-again", headers)
            assert (status, again) == (200, first) and b"(succeeded)" in body
            shown = [json.dumps(get_json(daemon, "/status/runs")),
                     daemon.request("GET", "/status/runs/" + first, headers={
                         "Accept": "text/html"})[2].decode()]
            assert all(value not in text for text in shown)
        log = daemon.log()
    assert signature not in log and TOKEN not in log
    assert lines(ran) == ["github", "gitlab"]


def test_an_id_that_looks_like_a_digest_is_not_the_id_it_digests(tmp_path):
    """A long id is kept as `sha256:<its digest>`: an id sent as that very text is another
    delivery, and must neither pass as the long one's redelivery nor take its place."""
    ran = tmp_path / "ran"
    command = script(tmp_path / "deploy.sh", 'echo "$1" >> %s\n' % ran)
    hooks = write_hooks(tmp_path / "hooks.json", [hook("deploy", command, **{
        "deduplicate": "Idempotency-Key",
        "pass-arguments-to-command": [{"source": "header", "name": "X-Note"}]})])
    long_id = "order-" + "7" * 200
    looks_alike = "sha256:" + hashlib.sha256(long_id.encode()).hexdigest()
    with start(hooks) as daemon:
        first = deliver(daemon, "deploy", "long", {"Idempotency-Key": long_id})[1]
        other = deliver(daemon, "deploy", "look-alike", {"Idempotency-Key": looks_alike})[1]
        assert other != first
        for run_id in (first, other):
            ended(daemon, run_id)
        assert deliver(daemon, "deploy", "long-again", {"Idempotency-Key": long_id})[1] == first
        assert deliver(daemon, "deploy", "look-alike-again", {
            "Idempotency-Key": looks_alike})[1] == other
    assert sorted(lines(ran)) == ["long", "look-alike"]  # the two ran side by side


def test_credentials_a_request_passes_to_the_command_are_masked_where_the_run_is_shown(tmp_path):
    """A hook may hand the command a credential of the request (a script that checks a token
    itself, or calls on with it): its run record, run page and log show the branch, never the
    token, the Authorization header, the signature or all the headers."""
    command = script(tmp_path / "deploy.sh", "echo deployed\n")
    hooks = write_hooks(tmp_path / "hooks.json", [hook("deploy", command, **{
        "trigger-rule": {"match": {"type": "value", "value": "push", "parameter": {
            "source": "header", "name": "X-GitHub-Event"}}},
        "pass-arguments-to-command": [
            {"source": "payload", "name": "ref"},
            {"source": "payload", "name": "head_commit.author.name"},
            {"source": "header", "name": "Authorization"},
            {"source": "url", "name": "token"},
            {"source": "header", "name": "X-Hub-Signature-256"},
            {"source": "entire-headers"}],
        "pass-environment-to-command": [
            {"source": "header", "name": "X-Gitlab-Token", "envname": "GITLAB_TOKEN"},
            {"source": "payload", "name": "ref", "envname": "BRANCH"}]})])
    secrets = ("Bearer bearer-of-secrets-1", "query-secret-2", "sha256=signature-secret-3",
               "gitlab-secret-4")
    with start(hooks) as daemon:
        status, answer, _ = daemon.request("POST", "/hooks/deploy?token=" + secrets[1],
                                           b'{"ref": "refs/heads/main", "head_commit": '
                                           b'{"author": {"name": "Ada"}}}', {
            "Content-Type": "application/json", "X-GitHub-Event": "push",
            "Authorization": secrets[0], "X-Hub-Signature-256": secrets[2],
            "X-Gitlab-Token": secrets[3]})
        assert status == 200
        record = ended(daemon, answer["x-webhookd-run"])
        assert record["state"] == "succeeded"
        assert record["arguments"] == [command, "refs/heads/main", "Ada"] + ["********"] * 4
        assert record["environment"] == {"GITLAB_TOKEN": "********", "BRANCH": "refs/heads/main"}
        page = daemon.request("GET", "/status/runs/" + record["id"],
                              headers={"Accept": "text/html"})[2].decode()
        assert "refs/heads/main" in page
        log = wait_until(lambda: '"refs/heads/main" "Ada" "********" "********"' in daemon.log()
                         and daemon.log(), what="the executing line")  # (a log thread)
    for shown in (json.dumps(record), page):
        assert not any(secret in shown for secret in secrets)
    # the access log line keeps the request target as upstream's does (a query token is in
    # every proxy's log too); the command's arguments are not there
    assert not any(secret in log for secret in secrets[:1] + secrets[2:])
    assert '"refs/heads/main" "Ada" "********" "********"' in log
