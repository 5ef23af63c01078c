"""The files a user installs as they are: the example hooks file, the two systemd units and
the deploy-user recipe of docs/webhookd.md. Each is tried through the real tools. (The README's
commands: test_docs.py.)"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

import support
from support import SEARCHKEYS, WEBHOOKD, Daemon, free_port, python_cmd

ROOT = WEBHOOKD.parent
EXAMPLE = ROOT / "webhook.conf.example"
NOBODY = 65534


def unit(name):
    """A unit file as {section: {option: [values]}} (options may repeat)."""
    sections, current = {}, None
    for line in (ROOT / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        option, _, value = line.partition("=")
        current.setdefault(option.strip(), []).append(value.strip())
    return sections


def start_webhookd(hooks, *flags, **popen):
    port = free_port()
    return Daemon(python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", str(port),
                             "-verbose", *flags), port, **popen)


def eventually(read, condition, timeout=10.0):
    """read() once condition(read()) holds (a log line may follow its answer), else AssertionError."""
    deadline = time.monotonic() + timeout
    value = read()
    while not condition(value):
        if time.monotonic() > deadline:
            raise AssertionError(value)
        time.sleep(0.05)
        value = read()
    return value


# ---------------------------------------------------------------- webhook.conf.example

def test_example_as_shipped_serves_only_ping_and_names_each_placeholder_hook(tmp_path):
    """An unedited copy of the example must not run a deploy for anyone who read the example:
    a hook whose secret is a shipped placeholder is refused, with its file and line."""
    with start_webhookd(EXAMPLE) as daemon:
        assert daemon.request("GET", "/hooks/ping")[::2] == (200, b"pong\n")
        for hook in ("redeploy", "github-push"):
            assert daemon.request("POST", "/hooks/%s?branch=main" % hook, headers={
                "X-Deploy-Token": "replace-with-a-long-random-token"})[::2] == (404, b"Hook not found.")
        log = eventually(daemon.log, lambda text: "loaded: ping" in text)
    assert "deploy-site" not in log and "loaded: redeploy" not in log
    assert '%s:22: hook 0 ("github-push").trigger-rule.and[0].match.secret' % EXAMPLE in log
    assert '%s:54: hook 1 ("redeploy").trigger-rule.and[0].match.value' % EXAMPLE in log
    assert "this hook is not served" in log
    code, out = validate(EXAMPLE)
    assert code == 1 and out.count("placeholder from the example file") == 2, out
    # Without -verbose the refusal is said all the same (on stderr), and ping is served.
    port = free_port()
    with Daemon(python_cmd(WEBHOOKD, "-hooks", EXAMPLE, "-ip", "127.0.0.1", "-port", str(port)),
                port) as quiet:
        assert quiet.request("GET", "/hooks/ping")[0] == 200
        assert quiet.request("POST", "/hooks/redeploy?branch=main")[0] == 404
        assert eventually(quiet.log, lambda text: text.count("this hook is not served") == 2)


def test_example_with_its_secrets_set_answers_only_requests_that_carry_them(tmp_path):
    token, secret = "3f9a1c0e7b5d42a8a6c1e0f4d2b7c9e1", "Zx81-kq0P-maintenance-webhook"
    hooks = tmp_path / "hooks.json"
    hooks.write_text(EXAMPLE.read_text().replace("replace-with-a-long-random-token", token)
                     .replace("replace-with-the-secret-set-in-the-github-webhook", secret))
    with start_webhookd(hooks) as daemon:
        assert daemon.request("GET", "/hooks/ping")[::2] == (200, b"pong\n")
        not_satisfied = b"Hook rules were not satisfied."
        assert daemon.request("POST", "/hooks/redeploy?branch=main")[::2] == (200, not_satisfied)
        assert daemon.request("POST", "/hooks/redeploy?branch=main",
                              headers={"X-Deploy-Token": "guess"})[::2] == (200, not_satisfied)
        assert daemon.request("POST", "/hooks/redeploy?branch=main", headers={
            "X-Deploy-Token": "replace-with-a-long-random-token"})[::2] == (200, not_satisfied)
        assert daemon.request("GET", "/hooks/redeploy?branch=main")[0] == 405
        push = json.dumps({"ref": "refs/heads/main", "head_commit": {"id": "abc"}})
        assert daemon.request("POST", "/hooks/github-push", body=push,
                              headers={"Content-Type": "application/json"})[::2] == (200, not_satisfied)
        # With the token the rules pass: the deploy script is not installed here.
        assert daemon.request("POST", "/hooks/redeploy?branch=main",
                              headers={"X-Deploy-Token": token})[0] == 500
        log = eventually(daemon.log, lambda text: "deploy-site" in text)
    assert "loaded: github-push" in log and "placeholder" not in log


def secrets_in(rule):
    """The secrets a rule tree checks: HMAC/scalr secrets and values compared with a header."""
    if not rule:
        return []
    found = []
    for key in ("and", "or"):
        for item in rule.get(key) or []:
            found += secrets_in(item)
    match = rule.get("match") or {}
    if match.get("secret"):
        found.append(match["secret"])
    if match.get("type") == "value" and (match.get("parameter") or {}).get("source") == "header":
        found.append(match["value"])
    return found


def test_every_example_hook_is_safe_to_expose_as_shipped():
    for hook in json.loads(EXAMPLE.read_text()):
        if secrets_in(hook.get("trigger-rule")):
            continue
        # Without a secret a hook may only run a fixed command that no request can steer.
        passed = hook.get("pass-arguments-to-command", []) + hook.get("pass-environment-to-command", []) \
            + hook.get("pass-file-to-command", [])
        assert all(arg["source"] == "string" for arg in passed), hook["id"]
        assert hook["id"] == "ping", hook["id"]


def validate(path):
    result = subprocess.run(python_cmd(WEBHOOKD, "-validate", "-hooks", path), capture_output=True,
                            text=True, timeout=30)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("secret", ["changeme", "CHANGE_ME", "your-secret-here", "mysecret", "xxxxxxxx",
                                    "<token>"])
def test_validate_warns_about_a_placeholder_secret_without_printing_it(tmp_path, secret):
    hooks = tmp_path / "hooks.json"
    hooks.write_text(json.dumps([{"id": "push", "execute-command": "/bin/true", "trigger-rule": {
        "match": {"type": "payload-hmac-sha256", "secret": secret,
                  "parameter": {"source": "header", "name": "X-Hub-Signature-256"}}}}]))
    code, out = validate(hooks)
    assert code == 0, out  # a warning, not an error: the file still works
    assert 'hook 0 ("push")' in out and "the secret looks like an example placeholder" in out, out
    assert secret not in out


@pytest.mark.parametrize("secret", ["replace-with-the-secret-set-in-the-github-webhook",
                                    "Replace_With_Your_Token"])
def test_validate_refuses_a_shipped_placeholder_secret_without_printing_it(tmp_path, secret):
    hooks = tmp_path / "hooks.yaml"
    hooks.write_text("- id: ok\n  execute-command: /bin/true\n"
                     "- id: push\n  execute-command: /bin/true\n  trigger-rule:\n    match:\n"
                     "      type: payload-hmac-sha256\n      secret: %s\n"
                     "      parameter: {source: header, name: X-Hub-Signature-256}\n" % secret)
    code, out = validate(hooks)
    assert code == 1, out
    assert '%s:8: hook 1 ("push").trigger-rule.match.secret: a placeholder' % hooks in out, out
    assert "this hook is not served" in out and secret not in out


def test_validate_is_quiet_about_real_secrets_and_ordinary_values(tmp_path):
    hooks = tmp_path / "hooks.json"
    hooks.write_text(json.dumps([{"id": "deploy", "execute-command": "/bin/true", "trigger-rule": {"and": [
        {"match": {"type": "value", "value": "3f9a1c0e7b5d42a8a6c1e0f4d2b7c9e1",
                   "parameter": {"source": "header", "name": "X-Deploy-Token"}}},
        {"match": {"type": "value", "value": "refs/heads/main", "parameter": {"source": "payload", "name": "ref"}}},
        {"match": {"type": "payload-hmac-sha1", "secret": "Zx81-kq0P-maintenance-webhook",
                   "parameter": {"source": "header", "name": "X-Hub-Signature"}}}]}}]))
    code, out = validate(hooks)
    assert code == 0 and "placeholder" not in out and "0 warning(s)" in out, out


# ---------------------------------------------------------------- webhookd.service

# With User= these imply NoNewPrivileges=yes (systemd.exec(5)): sudo in a deploy script fails.
IMPLY_NO_NEW_PRIVILEGES = {
    "NoNewPrivileges", "DynamicUser", "LockPersonality", "MemoryDenyWriteExecute", "PrivateDevices",
    "ProtectClock", "ProtectHostname", "ProtectKernelLogs", "ProtectKernelModules",
    "ProtectKernelTunables", "RestrictAddressFamilies", "RestrictNamespaces", "RestrictRealtime",
    "RestrictSUIDSGID", "SystemCallArchitectures", "SystemCallFilter", "SystemCallLog"}
# A private mount namespace, read-only trees, hidden cgroups or devices: podman's container
# mounts and networks, global npm/pip installs, app unit files under /etc.
BREAK_DEPLOYS = {
    "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateUsers", "PrivateMounts", "PrivateNetwork",
    "ProtectControlGroups", "ProtectProc", "ProcSubset", "ReadOnlyPaths", "InaccessiblePaths",
    "TemporaryFileSystem", "MountFlags", "CapabilityBoundingSet", "AmbientCapabilities",
    "RootDirectory", "RootImage", "IPAddressDeny"}


def test_webhookd_unit_has_nothing_that_breaks_a_deploy():
    service = unit("webhookd.service")["Service"]
    assert not IMPLY_NO_NEW_PRIVILEGES & set(service), IMPLY_NO_NEW_PRIVILEGES & set(service)
    assert not BREAK_DEPLOYS & set(service), BREAK_DEPLOYS & set(service)
    assert "User" not in service  # root like Debian's unit; a deploy user is a drop-in (docs/webhookd.md)
    assert service["ExecStart"] == ["/usr/bin/python3 -m webhookd -nopanic -hooks "
                                    "/etc/webhook.conf -hotreload -verbose -port 9000"]
    # The module, from the bytecode cache the install makes, found through PYTHONPATH: hooks
    # without command-working-directory run in the daemon's folder (/), as with webhook.
    assert service["Environment"] == ["PYTHONPATH=" + MODULE_DIR]
    assert "WorkingDirectory" not in service
    assert service["Type"] == ["notify"] and service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert service["Restart"] == ["on-failure"]


needs_systemd_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                           reason="systemd-analyze missing (apt-get install systemd)")


@needs_systemd_analyze
@pytest.mark.parametrize("name", ["webhookd.service", "searchkeys.service"])
def test_unit_passes_systemd_analyze_verify(name):
    result = subprocess.run(["systemd-analyze", "verify", str(ROOT / name)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert name not in result.stderr, result.stderr


MODULE_DIR = "/usr/local/lib/webhookd"  # where the README installs webhookd.py and its cache


def unit_command(execstart, module_dir, replaced, python=sys.executable):
    """A webhookd.service command line as systemd runs it, with python, the module from
    module_dir and the paths in replaced: (argv, the environment the unit adds)."""
    argv = [replaced.get(arg, arg) for arg in execstart.split()]
    assert argv[:3] == ["/usr/bin/python3", "-m", "webhookd"], argv
    (environment,) = unit("webhookd.service")["Service"]["Environment"]
    name, _, value = environment.partition("=")
    assert (name, value) == ("PYTHONPATH", MODULE_DIR)
    return [python] + argv[1:], {name: str(module_dir)}


def doc_section(title):
    text = (ROOT / "docs" / "webhookd.md").read_text()
    start = text.index(title)
    return text[start:text.index("\n#", start + len(title))]


@needs_systemd_analyze
def test_readme_deploy_user_drop_in_passes_systemd_analyze_verify(tmp_path):
    """The drop-in the deploy-user recipe writes, next to the unit, as systemd will merge them."""
    recipe = doc_section("## Run the hooks as a deploy user")
    (printf_format,) = re.findall(r"printf '([^']*)'", recipe)
    drop_in = subprocess.run(["printf", printf_format], capture_output=True, text=True).stdout
    assert re.search(r"^User=deploy$", drop_in, re.M) and re.search(r"^Group=deploy$", drop_in, re.M)
    shutil.copy(ROOT / "webhookd.service", tmp_path)
    (tmp_path / "webhookd.service.d").mkdir()
    (tmp_path / "webhookd.service.d" / "user.conf").write_text(drop_in)
    result = subprocess.run(["systemd-analyze", "verify", "webhookd.service"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "webhookd" not in result.stderr, result.stderr


def offered_status_drop_in():
    """The settings webhookd.service offers, commented out, for the status page and run history:
    the drop-in an admin writes by uncommenting them (issue 31)."""
    text = (ROOT / "webhookd.service").read_text()
    offer = text[text.index("# The status page"):]
    return ["[Service]"] + [line[1:] for line in offer.splitlines()
                            if re.match(r"#[A-Z][A-Za-z]*=", line)]


@needs_systemd_analyze
def test_offered_status_page_drop_in_passes_systemd_analyze_verify(tmp_path):
    drop_in = offered_status_drop_in()
    assert "LoadCredential=status-token:/etc/webhookd/status-token" in drop_in
    assert "StateDirectory=webhookd" in drop_in and drop_in[-2] == "ExecStart="
    shutil.copy(ROOT / "webhookd.service", tmp_path)
    (tmp_path / "webhookd.service.d").mkdir()
    (tmp_path / "webhookd.service.d" / "status.conf").write_text("\n".join(drop_in) + "\n")
    result = subprocess.run(["systemd-analyze", "verify", "webhookd.service"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "webhookd" not in result.stderr, result.stderr


def test_offered_status_page_command_line_serves_the_page_to_the_token_and_keeps_runs(tmp_path):
    """The offered ExecStart as systemd would run it: %d is the credentials folder, the runs go
    under the state directory; here both in a scratch folder, on a free loopback port."""
    execstart = offered_status_drop_in()[-1].partition("=")[2]
    credentials, runs = tmp_path / "credentials", tmp_path / "state" / "runs"
    credentials.mkdir()
    (credentials / "status-token").write_text("offered-token-0123456789\n")
    (tmp_path / "state").mkdir(mode=0o700)
    hooks = tmp_path / "webhook.conf"
    shutil.copy(EXAMPLE, hooks)
    port = free_port()
    replaced = {"/etc/webhook.conf": str(hooks),
                "%d/status-token": str(credentials / "status-token"),
                "/var/lib/webhookd/runs": str(runs), "9000": str(port)}
    argv, env = unit_command(execstart, WEBHOOKD.parent, replaced)
    assert "%d" not in " ".join(argv)
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no cache written into the clone
    with Daemon(argv + ["-ip", "127.0.0.1"], port, env=env, cwd=tmp_path) as daemon:
        assert daemon.request("GET", "/hooks/ping")[0] == 200
        status, _, body = daemon.request("GET", "/-/status")
        assert status == 200 and set(json.loads(body)) == {"status", "version"}
        status, _, body = daemon.request("GET", "/-/status/runs", headers={
            "Authorization": "Bearer offered-token-0123456789"})
        assert status == 200 and [run["hook"] for run in json.loads(body)] == ["ping"]
        eventually(lambda: sorted(path.suffix for path in runs.iterdir()),
                   lambda suffixes: ".json" in suffixes)
        assert "status page and run history on http://127.0.0.1:%d/-/status (with " \
               "-status-token)" % port in daemon.log()
        assert "offered-token" not in daemon.log()


def nobody_python():
    """/usr/bin/python3 if user nobody may run it (the unit's interpreter), else None."""
    python = "/usr/bin/python3"
    if os.geteuid() != 0 or not os.access(python, os.X_OK):
        return None
    check = subprocess.run([python, "-c", "pass"], preexec_fn=as_nobody, capture_output=True)
    return python if check.returncode == 0 else None


def as_nobody():
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@pytest.fixture
def public_dir():
    """A scratch folder any user may enter (pytest's own tmp_path lives under a 0700 folder)."""
    with support.scratch_dir("webhookd-deploy-user-") as path:
        path.chmod(0o755)  # as /usr/local/lib and /etc are
        yield path


def test_deploy_user_recipe_serves_the_hooks_file(public_dir):
    """docs/webhookd.md's recipe: webhookd.py installed as the README does (0644, compiled by root),
    the hooks file root:<deploy group> 0640, the unit's command run as the deploy user. Here user
    and group nobody stand in for deploy."""
    python = nobody_python()
    if python is None:
        pytest.skip("needs root and a /usr/bin/python3 that user nobody may run: run the suite as root, apt-get install python3")
    tmp_path = public_dir
    module_dir = tmp_path / "lib"
    module_dir.mkdir()
    installed = module_dir / "webhookd.py"
    shutil.copy(WEBHOOKD, installed)
    installed.chmod(0o644)
    subprocess.run([python, "-m", "py_compile", str(installed)], check=True)
    site = tmp_path / "site"
    site.mkdir()
    os.chown(site, NOBODY, NOBODY)  # the deploy user owns what it deploys
    conf = tmp_path / "webhook.conf"
    conf.write_text(json.dumps([{"id": "deploy", "execute-command": "/usr/bin/touch",
                                 "command-working-directory": str(site),
                                 "include-command-output-in-response": True,
                                 "pass-arguments-to-command": [{"source": "string", "name": "deployed"}]},
                                {"id": "where", "execute-command": "/bin/pwd",
                                 "include-command-output-in-response": True}]))
    os.chown(conf, 0, NOBODY)
    conf.chmod(0o640)
    port = free_port()
    # Started the way systemd starts the unit's command with User= and Group= in a drop-in.
    (execstart,) = unit("webhookd.service")["Service"]["ExecStart"]
    argv, env = unit_command(execstart, module_dir, {"/etc/webhook.conf": str(conf),
                                                     "9000": str(port)}, python)
    log = tmp_path / "log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv + ["-ip", "127.0.0.1"], cwd="/", env=dict(os.environ, **env),
                                preexec_fn=as_nobody, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        try:
            support.wait_for_port(port, proc)
        except RuntimeError:
            raise AssertionError(log.read_text())
        status, _, _ = support.request(port, "POST", "/hooks/deploy")
        assert status == 200, log.read_text()
        assert (site / "deployed").exists() and (site / "deployed").stat().st_uid == NOBODY
        # Without command-working-directory a hook runs in the daemon's folder, as with webhook.
        assert support.request(port, "POST", "/hooks/where")[::2] == (200, b"/\n"), log.read_text()
    finally:
        proc.terminate()
        proc.wait(10)


# ---------------------------------------------------------------- searchkeys.service

def test_searchkeys_unit_keeps_keys_out_of_argv_and_the_store_in_its_state_directory():
    service = unit("searchkeys.service")["Service"]
    assert service["EnvironmentFile"] == ["/etc/searchkeys/searchkeys.env"]
    (execstart,) = service["ExecStart"]
    assert "--master-key" not in execstart and "--upstream-key" not in execstart
    (state,) = service["StateDirectory"]
    assert re.search(r"--store /var/lib/%s/\S+" % state, execstart), execstart
    assert service["Type"] == ["simple"]  # searchkeys.py does not send sd_notify
    assert "--upstream http://127.0.0.1:7701" in execstart


def test_searchkeys_unit_command_line_serves_with_keys_from_the_environment(tmp_path):
    """The unit's ExecStart, with this clone's file, a scratch store and a free port."""
    service = unit("searchkeys.service")["Service"]
    (execstart,) = service["ExecStart"]
    argv = execstart.split()
    assert argv[:3] == ["/usr/bin/python3", "-m", "searchkeys"]  # the module, from its bytecode
    assert service["WorkingDirectory"] == ["/usr/local/lib/searchkeys"]  # where -m finds it
    argv = [sys.executable, "-m", "searchkeys"] + [
        str(tmp_path / "keys.json") if a.startswith("/var/lib/") else a for a in argv[3:]]
    port = free_port()
    backend_port = free_port()
    argv = [a.replace("127.0.0.1:7701", "127.0.0.1:%d" % backend_port) for a in argv]
    env = {"MEILI_MASTER_KEY": "unit-test-master-key-0123456789", "SEARCHKEYS_UPSTREAM_KEY": "backend-key",
           "PYTHONDONTWRITEBYTECODE": "1"}  # no cache written into the clone
    with Daemon(argv + ["--port", str(port)], port, env=env, cwd=SEARCHKEYS.parent) as daemon:
        assert daemon.request("GET", "/health")[0] == 200
        assert daemon.request("GET", "/keys")[0] == 401
        status, _, body = daemon.request("GET", "/keys", headers={
            "Authorization": "Bearer unit-test-master-key-0123456789"})
        assert status == 200 and json.loads(body)["total"] >= 1
    assert (tmp_path / "keys.json").exists()
