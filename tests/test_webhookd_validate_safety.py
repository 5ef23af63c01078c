"""Black-box tests of issue 29, section 3: what -validate and the daemon do with a hooks file
that would open a hook to everyone as a user migrating from Debian's webhook writes it: template
syntax without -template, a variable -template finds unset, a misspelt trigger-rule.

Each test runs `webhookd.py -validate` and the daemon on a free 127.0.0.1 port (real HTTP).
"""
import json
import subprocess

from support import WEBHOOKD, python_cmd
from test_webhookd_features import start, wait_until, write_hooks


def token_hook(hook_id, value):
    return {"id": hook_id, "execute-command": "/bin/echo", "include-command-output-in-response":
            True, "pass-arguments-to-command": [{"source": "string", "name": "deployed"}],
            "trigger-rule": {"match": {"type": "value", "value": value, "parameter": {
                "source": "header", "name": "X-Token"}}}}


def hmac_hook(hook_id, secret):
    return {"id": hook_id, "execute-command": "/bin/true", "trigger-rule": {"match": {
        "type": "payload-hmac-sha256", "secret": secret,
        "parameter": {"source": "header", "name": "X-Hub-Signature-256"}}}}


def validate(hooks_file, *flags, env=None):
    """(exit status, lines printed) of -validate."""
    result = subprocess.run(python_cmd(WEBHOOKD, "-validate", *flags, "-hooks", hooks_file),
                            capture_output=True, text=True, timeout=30, env=env)
    return result.returncode, result.stdout.splitlines()


def clean_env(**extra):
    import os
    env = {k: v for k, v in os.environ.items() if k not in ("DEPLOY_TOKEN", "GH_SECRET")}
    env.update(extra)
    return env


GETENV = "{{ getenv `DEPLOY_TOKEN` }}"  # Go's raw string: stays as is in JSON text


def templated_hooks(tmp_path):
    """The two hooks as upstream's README writes them, the secrets from the environment."""
    path = tmp_path / "hooks.json"
    text = json.dumps([token_hook("deploy", "@TOKEN@"), hmac_hook("gh", "@SECRET@")], indent=1)
    # upstream's own form: the template's quotes inside the JSON string, valid once expanded
    path.write_text(text.replace("@TOKEN@", '{{ getenv "DEPLOY_TOKEN" }}').replace(
        "@SECRET@", '{{ getenv "GH_SECRET" | js }}'))
    path.chmod(0o644)
    return path


def test_template_syntax_without_template_is_warned_by_validate_and_the_daemon(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [token_hook("deploy", GETENV)])
    hooks.chmod(0o644)
    code, lines = validate(hooks)
    assert code == 0 and lines[-1] == "1 file(s) checked: 0 error(s), 1 warning(s)", lines
    assert "-template" in lines[0] and "{{ getenv" in lines[0], lines
    with start(hooks) as daemon:  # served as Go serves it: the literal text
        wait_until(lambda: "-template to expand it" in daemon.log(), what="the warning")
        assert daemon.request("GET", "/hooks/deploy", headers={"X-Token": GETENV})[::2] == (
            200, b"deployed\n")


def test_a_secret_or_value_emptied_by_the_template_is_refused(tmp_path):
    hooks = templated_hooks(tmp_path)
    code, lines = validate(hooks, "-template", env=clean_env())
    assert code == 1, lines
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 2 and all("empty after template expansion" in e and
                                    "this hook is not served" in e for e in errors), lines
    assert '"deploy").trigger-rule.match.value' in errors[0] and \
        '{{ getenv "DEPLOY_TOKEN" }}' in errors[0], lines
    assert '"gh").trigger-rule.match.secret' in errors[1], lines
    with start(hooks, "-template", env={"DEPLOY_TOKEN": "", "GH_SECRET": ""}) as daemon:
        # an empty header matched the empty token and ran the deploy
        assert daemon.request("GET", "/hooks/deploy", headers={"X-Token": ""})[::2] == (
            404, b"Hook not found.")
        assert daemon.request("POST", "/hooks/gh")[0] == 404
        assert "empty after template expansion" in daemon.log()


def test_the_same_file_with_the_variables_set_validates_and_serves(tmp_path):
    hooks = templated_hooks(tmp_path)
    env = clean_env(DEPLOY_TOKEN="t0ken", GH_SECRET="s3cret")
    assert validate(hooks, "-template", env=env) == (
        0, ["1 file(s) checked: 0 error(s), 0 warning(s)"])
    with start(hooks, "-template", env={"DEPLOY_TOKEN": "t0ken", "GH_SECRET": "s3cret"}) as d:
        assert d.request("GET", "/hooks/deploy", headers={"X-Token": ""})[0] == 200
        assert d.request("GET", "/hooks/deploy", headers={"X-Token": ""})[2] == (
            b"Hook rules were not satisfied.")
        assert d.request("GET", "/hooks/deploy", headers={"X-Token": "t0ken"})[2] == (
            b"deployed\n")


def test_an_empty_value_written_as_such_is_served_as_upstream_serves_it(tmp_path):
    """Only what the template emptied is refused: a literal "" matches an empty parameter, in
    Go's webhook as here."""
    hooks = tmp_path / "hooks.json"
    hooks.write_text(json.dumps([token_hook("empty", ""), token_hook("set", GETENV)]))
    hooks.chmod(0o644)
    env = clean_env(DEPLOY_TOKEN="t0ken")
    assert validate(hooks, "-template", env=env)[0] == 0
    with start(hooks, "-template", env={"DEPLOY_TOKEN": "t0ken"}) as daemon:
        assert daemon.request("GET", "/hooks/empty", headers={"X-Token": ""})[2] == b"deployed\n"


def test_an_unknown_field_on_a_hook_without_trigger_rule_is_an_error(tmp_path):
    typo = dict(token_hook("typo", "t0ken"))
    typo["trigger-rules"] = typo.pop("trigger-rule")
    other = dict(token_hook("other", "t0ken"), **{"execute-comand": "/bin/true"})  # a rule: warned
    hooks = write_hooks(tmp_path / "hooks.json", [typo, other, token_hook("fine", "t0ken")])
    hooks.chmod(0o644)
    code, lines = validate(hooks)
    assert code == 1, lines
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and '"typo"' in errors[0] and "'trigger-rules'" in errors[0] \
        and "not served" in errors[0], lines
    assert any("did you mean 'trigger-rule'" in line for line in lines), lines
    with start(hooks, verbose=False) as daemon:  # the error is logged without -verbose
        assert daemon.request("GET", "/hooks/typo")[::2] == (404, b"Hook not found.")
        assert daemon.request("GET", "/hooks/other", headers={"X-Token": "t0ken"})[0] == 200
        assert daemon.request("GET", "/hooks/fine", headers={"X-Token": "t0ken"})[2] == \
            b"deployed\n"
        assert "'trigger-rules' and no trigger-rule" in daemon.log()
