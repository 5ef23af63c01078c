"""Issue 24, first run and operations: what an operator reads when something is wrong. Errors
name the file and the reason in Go's words, once, on stderr (also without -verbose); -validate
reports every problem of a file; reload log lines are upstream's. Compared with Debian's webhook
where Go has the behaviour."""
import json
import os
import signal
import socket
import subprocess

import pytest

import support
from support import WEBHOOK_BIN, WEBHOOKD, Daemon, free_port, python_cmd
from test_webhookd_features import wait_until, write_hooks

needs_webhook = pytest.mark.skipif(WEBHOOK_BIN is None, reason="needs Debian's webhook: apt-get install webhook")
TRUE_HOOK = {"id": "a", "execute-command": "/bin/true"}


def run(argv, **kwargs):
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL, **kwargs)


def webhookd(*args):
    return run(python_cmd(WEBHOOKD, *args))


def lines_without_date(text):
    """`[webhook] 2026/01/02 03:04:05 message` -> `[webhook] message`."""
    return [line[:10] + line[30:] if line.startswith("[webhook] 2") else line
            for line in text.splitlines()]


# ---------------------------------------------------------------------------------------------
# -validate: every problem of a file, hooks files others can write, YAML booleans
# ---------------------------------------------------------------------------------------------

def test_validate_reports_every_type_error_of_a_file_not_only_the_first(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [
        {"id": "a", "execute-command": "/bin/true", "http-methods": "POST",
         "include-command-output-in-response": "yes", "max-concurrency": 0},
        {"id": "b", "execute-command": "/bin/true", "trigger-rule": {"and": {}},
         "command-timeout": "5"},
        {"id": "c", "execute-command": "/bin/true", "response-headers": [{"name": "X", "value": []}]},
    ])
    p = webhookd("-validate", "-hooks", hooks)
    assert p.returncode == 1, p.stdout
    for needle in ('("a").http-methods: expected an array, got string',
                   '("a").include-command-output-in-response: expected a boolean',
                   '("a").max-concurrency: must be at least 1',
                   '("b").trigger-rule.and: expected an array, got object',
                   '("b").command-timeout: expected a number of seconds',
                   '("c").response-headers[0].value: expected a string, got array'):
        assert needle in p.stdout, (needle, p.stdout)
    assert "6 error(s)" in p.stdout
    # Served, the file is refused as upstream refuses it; the log says there is more to see.
    port = free_port()
    argv = python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", port, "-nopanic")
    with Daemon(argv, port) as daemon:
        assert daemon.request("GET", "/hooks/a")[0] == 404
        log = wait_until(lambda: "couldn't load hooks" in daemon.log() and daemon.log())
    assert "(and 5 more problem(s): see -validate)" in log


def test_validate_warns_about_a_hooks_file_or_folder_others_can_write(tmp_path):
    folder = tmp_path / "etc"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    hooks = write_hooks(folder / "hooks.json", [TRUE_HOOK])
    hooks_path = str(hooks)
    os.chmod(hooks_path, 0o644)
    p = webhookd("-validate", "-hooks", hooks)
    assert p.returncode == 0 and "0 warning(s)" in p.stdout, p.stdout
    os.chmod(hooks_path, 0o646)
    p = webhookd("-validate", "-hooks", hooks)
    assert p.returncode == 0, p.stdout
    assert "%s: the file is writable by group or others" % hooks in p.stdout, p.stdout
    os.chmod(hooks_path, 0o644)
    folder.chmod(0o777)  # anyone may replace the file
    p = webhookd("-validate", "-hooks", hooks)
    assert "the folder %s is writable by group or others" % folder in p.stdout, p.stdout
    folder.chmod(0o1777)  # sticky, as /tmp: others cannot replace someone else's file
    p = webhookd("-validate", "-hooks", hooks)
    assert "0 warning(s)" in p.stdout, p.stdout


def test_yaml_value_on_off_yes_no_is_warned_as_read_as_a_boolean(tmp_path):
    hooks = tmp_path / "hooks.yaml"
    hooks.write_text("- id: flag\n  execute-command: /bin/true\n  trigger-rule:\n    and:\n"
                     "    - match:\n        type: value\n        value: on\n"
                     "        parameter: {source: url, name: flag}\n"
                     "    - match: {type: value, value: No, parameter: {source: url, name: x}}\n"
                     "    - match: {type: value, value: true, parameter: {source: url, name: t}}\n"
                     "    - match: {type: value, value: 'off', parameter: {source: url, name: z}}\n")
    p = webhookd("-validate", "-hooks", hooks)
    assert p.returncode == 0, p.stdout
    assert '%s:7: hook 0 ("flag").trigger-rule.and[0].match.value: the value on is read as ' \
        "the boolean true" % hooks in p.stdout, p.stdout
    assert "%s:9:" % hooks in p.stdout and "the value No is read as the boolean false" in p.stdout
    assert "2 warning(s)" in p.stdout, p.stdout  # not `true`, not the quoted 'off'
    port = free_port()  # and it is so: ?flag=on does not match, ?flag=true does
    argv = python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", port)
    with Daemon(argv, port) as daemon:
        assert daemon.request("GET", "/hooks/flag?flag=on&x=no&t=true&z=off")[0] == 200
        assert daemon.request("GET", "/hooks/flag?flag=on&x=no&t=true&z=off")[2] == \
            b"Hook rules were not satisfied."
        assert daemon.request("GET", "/hooks/flag?flag=true&x=false&t=true&z=off")[2] == b""


# ---------------------------------------------------------------------------------------------
# Start-up errors: one sentence in Go's words, once, on stderr
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("verbose", [[], ["-verbose"]])
def test_busy_port_is_said_once_on_stderr_as_go_says_it(tmp_path, verbose):
    hooks = write_hooks(tmp_path / "hooks.json", [TRUE_HOOK])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["-hooks", hooks, "-ip", "127.0.0.1", "-port", port] + verbose
        ours = webhookd(*args)
        expected = "error listening on port: listen tcp 127.0.0.1:%d: bind: address already " \
            "in use" % port
        assert ours.returncode == 1 and ours.stdout == "", ours.stdout
        assert lines_without_date(ours.stderr).count("[webhook] " + expected) == 1, ours.stderr
        if WEBHOOK_BIN:
            go = run([WEBHOOK_BIN] + args)
            assert go.returncode == 1 and go.stdout == ""
            assert lines_without_date(go.stderr)[-1] == "[webhook] " + expected


def test_missing_or_broken_hooks_file_is_named_without_verbose(tmp_path):
    missing, broken = tmp_path / "missing.json", tmp_path / "broken.json"
    broken.write_text('[{"id": "a",\n')
    p = webhookd("-hooks", missing, "-ip", "127.0.0.1", "-port", free_port())
    assert p.returncode == 1
    assert "couldn't load hooks from file! open %s: no such file or directory" % missing \
        in p.stderr, p.stderr
    assert "couldn't load any hooks from file!" in p.stdout  # upstream's words, as upstream
    port = free_port()
    argv = python_cmd(WEBHOOKD, "-hooks", broken, "-ip", "127.0.0.1", "-port", port, "-nopanic")
    with Daemon(argv, port) as daemon:  # serves no hook, but says why
        assert daemon.request("GET", "/hooks/a")[0] == 404
        log = wait_until(lambda: "couldn't load hooks from file!" in daemon.log() and daemon.log())
    assert "couldn't load hooks from file! %s:1:2: did not find" % broken in log, log


def test_pidfile_and_tls_errors_read_as_go_not_as_python(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [TRUE_HOOK])
    a_file = tmp_path / "hooks.json"
    args = ["-hooks", hooks, "-ip", "127.0.0.1", "-port", free_port()]
    pidfile = ["-pidfile", "%s/webhook.pid" % a_file]
    p = webhookd(*args, *pidfile)
    expected = "Error creating pidfile: mkdir %s: not a directory" % a_file
    assert p.returncode == 1 and "Errno" not in p.stderr, p.stderr
    assert lines_without_date(p.stderr) == ["[webhook] " + expected], p.stderr
    if WEBHOOK_BIN:  # Go says it only with -verbose
        go = run([WEBHOOK_BIN] + args + pidfile + ["-verbose"])
        assert go.returncode == 1
        assert lines_without_date(go.stderr)[-1] == "[webhook] " + expected, go.stderr
    p = webhookd(*args, "-secure", "-cert", tmp_path / "cert.pem", "-key", tmp_path / "key.pem")
    assert p.returncode == 1 and "Errno" not in p.stderr
    assert "open %s: no such file or directory" % (tmp_path / "cert.pem") in p.stderr, p.stderr
    p = webhookd(*args, "-secure", "-cert", hooks, "-key", hooks)
    assert p.returncode == 1 and "no PEM certificate with its matching private key" in p.stderr
    assert "_ssl.c" not in p.stderr


def test_runs_says_when_there_is_no_run_folder(tmp_path):
    folder, a_file = tmp_path / "runs", tmp_path / "hooks.json"
    a_file.write_text("[]")
    p = webhookd("-runs", "-runs-dir", folder)
    assert p.returncode == 1 and "no run folder %s" % folder in p.stdout, p.stdout
    assert not folder.exists()  # reading never creates it
    for flags in (["-runs"], ["-runs-follow", "20260101T000000Z-0001"], ["-hooks", a_file]):
        p = webhookd(*flags, "-runs-dir", a_file, "-port", free_port())
        assert p.returncode == 1, p.stdout
        assert "-runs-dir %s is not a folder" % a_file in p.stdout, p.stdout


# ---------------------------------------------------------------------------------------------
# Hot reload: upstream's log lines
# ---------------------------------------------------------------------------------------------

def test_reload_log_lines_are_upstreams(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [TRUE_HOOK])
    port = free_port()
    argv = python_cmd(WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port", port, "-verbose",
                      "-hotreload")
    with Daemon(argv, port) as daemon:
        write_hooks(hooks, [TRUE_HOOK, {"id": "b", "execute-command": "/bin/true"}])
        wait_until(lambda: "loaded: b" in daemon.log(), what="reload")
        daemon.signal(signal.SIGHUP)
        wait_until(lambda: "caught HUP signal" in daemon.log(), what="HUP")
        os.unlink(str(hooks))
        log = wait_until(lambda: "that were loaded from file" in daemon.log() and daemon.log(),
                         what="removal")
    lines = lines_without_date(log)
    assert "[webhook] hooks file %s modified" % hooks in lines
    assert lines.count("[webhook] attempting to reload hooks from %s" % hooks) >= 2, log
    assert lines.count("[webhook] attempting to load hooks from %s" % hooks) == 1, log
    assert "[webhook] caught HUP signal" in lines
    assert "[webhook] \tremoving: b" in lines
    assert "[webhook] removed 2 hook(s) that were loaded from file %s" % hooks in lines


@needs_webhook
def test_reload_lines_match_debians_webhook(tmp_path):
    """The same edit on both: the lines after the change are the same words."""
    seen = {}
    for name, program in (("go", [WEBHOOK_BIN]), ("py", python_cmd(WEBHOOKD))):
        hooks = write_hooks(tmp_path / ("%s.json" % name), [TRUE_HOOK])
        port = free_port()
        with Daemon(program + ["-hooks", str(hooks), "-ip", "127.0.0.1", "-port", str(port),
                               "-verbose", "-hotreload"], port) as daemon:
            wait_until(lambda: "serving hooks" in daemon.log(), what="start")
            with open(str(hooks), "w") as handle:  # in place: Go's watcher sees a write
                json.dump([TRUE_HOOK, {"id": "b", "execute-command": "/bin/true"}], handle)
            wait_until(lambda: "loaded: b" in daemon.log(), what="reload")
            log = daemon.log()
        seen[name] = set(lines_without_date(log.replace(str(hooks), "FILE")))
    for line in ("[webhook] hooks file FILE modified", "[webhook] attempting to reload hooks from "
                 "FILE", "[webhook] found 2 hook(s) in file", "[webhook] \tloaded: b"):
        assert line in seen["go"] and line in seen["py"], (line, seen)
