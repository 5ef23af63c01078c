"""The defects of issue 11 and the command-line errors of issue 17, each through the real
interface: against Debian's webhook too where Go has the behaviour (the `runner` fixture)."""
import os
import signal
import socket
import subprocess

import pytest

import support
from test_webhookd_features import wait_until, write_hooks
from test_webhookd_parity import runner  # noqa: F401 - the fixture: webhook and webhookd

TRACEBACK = "Traceback (most recent call last)"


def webhookd(*args, **kwargs):
    return subprocess.run(support.python_cmd(support.WEBHOOKD, *map(str, args)),
                          capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
                          **kwargs)


# ---------------------------------------------------------------------------------------------
# 1. dual-stack listeners see IPv4 clients as IPv4
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(not support.ipv6_loopback(), reason="needs IPv6 on loopback (::1): sysctl net.ipv6.conf.lo.disable_ipv6=0")
def test_dual_stack_listener_unmaps_ipv4_clients(runner, tmp_path):
    def whitelisted(hook_id, ip_range):
        return {"id": hook_id, "execute-command": "/bin/true", "response-message": "in",
                "trigger-rule": {"match": {"type": "ip-whitelist", "ip-range": ip_range}}}
    hooks = write_hooks(tmp_path / "hooks.json", [
        whitelisted("v6-only", "::1"), whitelisted("mapped", "::ffff:127.0.0.0/104"),
        whitelisted("v4", "127.0.0.1/32"),
        {"id": "addr", "execute-command": "/bin/echo", "include-command-output-in-response": True,
         "pass-arguments-to-command": [{"source": "request", "name": "remote-addr"}]}])
    port = support.free_port()
    with runner.start("-hooks", hooks, "-ip", "", "-port", port, port=port) as d:
        assert d.request("GET", "/hooks/v6-only")[::2] == (200, b"Hook rules were not satisfied.")
        assert d.request("GET", "/hooks/mapped")[::2] == (200, b"in")
        assert d.request("GET", "/hooks/v4")[::2] == (200, b"in")
        status, _, body = d.request("GET", "/hooks/addr")
        assert status == 200 and body.startswith(b"127.0.0.1:"), body


# ---------------------------------------------------------------------------------------------
# 2. pass-file-to-command never writes outside the temp folder
# ---------------------------------------------------------------------------------------------

def test_pass_file_envname_with_a_path_separator_is_refused(runner, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    hooks = write_hooks(tmp_path / "hooks.json", [{
        "id": "pf", "execute-command": "/bin/sh", "include-command-output-in-response": True,
        "command-working-directory": str(work),
        "pass-arguments-to-command": [{"source": "string", "name": "-c"},
                                      {"source": "string", "name": 'echo "[$OK]"; ls'}],
        "pass-file-to-command": [{"source": "url", "name": "a", "envname": "../ESCAPED"},
                                 {"source": "url", "name": "a", "envname": "OK"}]}])
    refusal = "error creating temp file [createtemp ../ESCAPED: pattern contains path separator]"
    with runner.start("-hooks", hooks, "-verbose") as d:
        status, _, body = d.request("GET", "/hooks/pf?a=payload")
        wait_until(lambda: refusal in d.log(), 20, "the refusal in the log")  # (a log thread)
    assert status == 200 and body.startswith(b"[" + str(work).encode() + b"/OK")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("ESCAPED")]


def test_build_invocation_skips_a_file_whose_envname_has_a_path_separator(tmp_path):
    import webhookd as w
    hook = w.Hook({"id": "x", "execute-command": "/bin/true", "pass-file-to-command": [
        {"source": "string", "name": "data", "envname": "a/b"}]}, "hook 0", w.Problems("f"))
    request = w.HookRequest("r", "GET", "127.0.0.1:1", {}, {}, b"", "")
    invocation = w.build_invocation(hook, request)
    assert invocation.file_pairs == []
    assert invocation.messages == ["error creating temp file [createtemp a/b: pattern contains "
                                   "path separator]"]


# ---------------------------------------------------------------------------------------------
# 3. the access log hides rule secrets after `;` too
# ---------------------------------------------------------------------------------------------

def test_access_log_redacts_semicolon_separated_secrets(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [{
        "id": "s", "execute-command": "/bin/true", "trigger-rule": {"match": {
            "type": "value", "value": "TOPSECRET1", "parameter": {"source": "url",
                                                                  "name": "token"}}}}])
    port = support.free_port()
    argv = support.python_cmd(support.WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port",
                              port, "-verbose")
    with support.Daemon(argv, port) as d:
        d.request("GET", "/hooks/s?x=1;token=TOPSECRET1")
        d.request("GET", "/hooks/s?token=TOPSECRET1&y=2;token=TOPSECRET1")
        log = wait_until(lambda: d.log().count("| GET /hooks/s") == 2 and d.log(),
                         what="two access lines")
    assert "TOPSECRET1" not in log
    assert "GET /hooks/s?x=1;token=<redacted>" in log
    import webhookd as w
    assert w.redact_target("/h?a=1;t=s&b=2", {"t"}) == "/h?a=1;t=<redacted>&b=2"


# ---------------------------------------------------------------------------------------------
# 4. -shutdown-timeout removes the temp files of the commands it kills
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("captured", [True, False])
def test_shutdown_timeout_removes_temp_files_of_killed_commands(tmp_path, captured):
    work = tmp_path / "work"
    work.mkdir()
    hooks = write_hooks(tmp_path / "hooks.json", [{
        "id": "slow", "execute-command": "/bin/sleep", "command-working-directory": str(work),
        "include-command-output-in-response": captured,
        "pass-arguments-to-command": [{"source": "string", "name": "30"}],
        "pass-file-to-command": [{"source": "url", "name": "p", "envname": "PAYLOAD"}]}])
    port = support.free_port()
    argv = support.python_cmd(support.WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port",
                              port, "-verbose", "-shutdown-timeout", "1")
    with support.Daemon(argv, port) as d:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"GET /hooks/slow?p=secret HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_until(lambda: list(work.iterdir()), what="the temp file")
        d.signal(signal.SIGTERM)
        assert d.proc.wait(20) == 0
        sock.close()
        log = d.log()
    assert list(work.iterdir()) == [], log
    assert "shutdown timeout: killing" in log and "removing file" in log


# ---------------------------------------------------------------------------------------------
# 5. a variable set twice: the last value, in the last one's position (as Go's exec)
# ---------------------------------------------------------------------------------------------

def test_environment_name_set_twice_keeps_the_last(runner, tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [{
        "id": "env", "execute-command": "/usr/bin/env", "include-command-output-in-response": True,
        "pass-environment-to-command": [
            {"source": "url", "name": "a", "envname": "DUP"},
            {"source": "url", "name": "b", "envname": "MIDDLE"},
            {"source": "url", "name": "c", "envname": "DUP"}]}])
    with runner.start("-hooks", hooks) as d:
        status, _, body = d.request("GET", "/hooks/env?a=first&b=m&c=last")
    lines = body.decode().splitlines()
    names = [line.split("=")[0] for line in lines]
    assert status == 200 and "DUP=last" in lines and "DUP=first" not in lines
    assert names.count("DUP") == 1 and names.index("DUP") > names.index("MIDDLE")


# ---------------------------------------------------------------------------------------------
# 6 and issue 17: command-line and start-up errors are one sentence and a non-zero exit
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["missing-folder", "folder", "unwritable"])
def test_logfile_that_cannot_be_opened(runner, tmp_path, where):
    hooks = write_hooks(tmp_path / "hooks.json", [{"id": "x", "execute-command": "/bin/true"}])
    target = {"missing-folder": tmp_path / "nope" / "w.log", "folder": tmp_path,
              "unwritable": tmp_path / "ro.log"}[where]
    if where == "unwritable":
        target.write_text("")
        target.chmod(0o400)
        if os.access(target, os.W_OK):
            pytest.skip("root may write any file: run the suite as another user to cover it")
    p = runner.run("-hooks", hooks, "-logfile", target, "-port", support.free_port(),
                   "-ip", "127.0.0.1")
    assert p.returncode == 1
    output = p.stdout + p.stderr
    assert 'error opening log file "%s": open %s: ' % (target, target) in output, output
    assert TRACEBACK not in output and output.count("\n") == 1


def test_busy_port_is_one_sentence(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [{"id": "x", "execute-command": "/bin/true"}])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        p = webhookd("-hooks", hooks, "-ip", "127.0.0.1", "-port", busy.getsockname()[1])
    assert p.returncode == 1 and "error listening on port" in p.stdout + p.stderr
    assert TRACEBACK not in p.stdout + p.stderr


@pytest.mark.parametrize("args,code,words", [
    (["-port", "x"], 2, 'invalid value "x" for flag -port'),
    (["-port", "70000"], 1, "error listening on port"),
    (["-port", "-1"], 1, "error listening on port"),
    (["-ip", "not-an-ip"], 1, "error listening on port"),
    (["-max-connections", "many"], 2, 'invalid value "many" for flag -max-connections'),
    (["-read-header-timeout", "1.5"], 2, "invalid value"),
    (["-header", "novalue"], 2, "header flag must be in name=value format"),
    (["-hooks", "/nonexistent/hooks.json"], 1, "couldn't load any hooks"),
    (["-hooks", "{dir}"], 1, "couldn't load any hooks"),
    (["-hooks", "{unreadable}"], 1, "couldn't load any hooks"),
    (["-secure", "-cert", "/nonexistent/cert.pem"], 1, "loading TLS certificate"),
    (["-secure", "-tls-min-version", "2.0"], 1, "unknown minimum TLS version"),
    (["-secure", "-cipher-suites", "NOPE"], 1, "unknown TLS cipher suite"),
    (["-pidfile", "{dir}"], 1, "Error creating pidfile"),
    (["-socket", "/nonexistent/dir/w.sock"], 1, "error listening on port"),
    (["-status-path", "status"], 1, "-status-path"),
    (["-setuid", "1"], 1, "setuid and setgid options must be used together"),
    (["-validate", "-hooks", "/nonexistent/hooks.json"], 1, "/nonexistent/hooks.json"),
    (["-template", "-hooks", "{template}"], 1, "couldn't load any hooks"),
])
def test_bad_flag_values_and_paths_are_one_sentence(tmp_path, args, code, words):
    (tmp_path / "unreadable.json").write_text("[]")
    (tmp_path / "unreadable.json").chmod(0)
    (tmp_path / "template.json").write_text('[{"id": "{{ env "X" }}"}]')
    hooks = write_hooks(tmp_path / "hooks.json", [{"id": "x", "execute-command": "/bin/true"}])
    args = [a.format(dir=tmp_path, unreadable=tmp_path / "unreadable.json",
                     template=tmp_path / "template.json") for a in args]
    if "-hooks" not in args:
        args = ["-hooks", str(hooks)] + args
    if "-port" not in args:
        args += ["-port", str(support.free_port())]
    if "-ip" not in args:
        args += ["-ip", "127.0.0.1"]
    p = webhookd(*args)
    output = p.stdout + p.stderr
    assert p.returncode == code, output
    assert words in output and TRACEBACK not in output, output


# ---------------------------------------------------------------------------------------------
# 7. a hook without execute-command is an error
# ---------------------------------------------------------------------------------------------

def test_hook_without_execute_command_is_an_error(tmp_path):
    # -validate fails; served, the hook answers as Go's does (the parity tests pin that: a
    # captured one 500, a background one its message) but never executes anything
    work = tmp_path / "work"
    work.mkdir()
    work.chmod(0o755)
    good = {"id": "good", "execute-command": "/bin/true"}
    typo = {"id": "typo", "execute-comand": "/bin/true", "command-working-directory": str(work),
            "include-command-output-in-response": True,  # a rule: else refused for the typo
            "trigger-rule": {"match": {"type": "ip-whitelist", "ip-range": "127.0.0.1"}}}
    hooks = write_hooks(tmp_path / "hooks.json", [good, typo])
    p = webhookd("-validate", "-hooks", hooks)
    assert p.returncode == 1
    assert "error: " in p.stdout and "no execute-command" in p.stdout
    port = support.free_port()
    argv = support.python_cmd(support.WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port",
                              port, "-verbose")
    with support.Daemon(argv, port) as d:
        assert d.request("GET", "/hooks/typo")[0] == 500
        assert d.request("GET", "/hooks/good")[0] == 200
        log = wait_until(lambda: "error in exec" in d.log() and d.log())
    assert "error: " in log and "no execute-command" in log  # at load
    assert "error in exec: hook has no execute-command" in log
    assert "using %s as cwd" % work not in log  # nothing was executed there


# ---------------------------------------------------------------------------------------------
# 8. -version names webhookd and its version
# ---------------------------------------------------------------------------------------------

def test_version_names_webhookd():
    import webhookd as w
    p = webhookd("-version")
    assert p.returncode == 0
    assert p.stdout == "webhookd version %s (webhook 2.8.0 compatible)\n" % w.__version__


def test_pidfile_of_a_running_process_is_refused_a_stale_one_replaced(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [{"id": "x", "execute-command": "/bin/true"}])
    pidfile = tmp_path / "w.pid"
    pidfile.write_text(str(os.getpid()))  # this test's process: running
    p = webhookd("-hooks", hooks, "-ip", "127.0.0.1", "-port", support.free_port(),
                 "-pidfile", pidfile)
    assert p.returncode == 1 and "pid file found" in p.stdout + p.stderr
    gone = subprocess.Popen(["/bin/true"])
    gone.wait()
    pidfile.write_text(str(gone.pid))  # a process that has exited
    port = support.free_port()
    argv = support.python_cmd(support.WEBHOOKD, "-hooks", hooks, "-ip", "127.0.0.1", "-port",
                              port, "-pidfile", pidfile)
    with support.Daemon(argv, port) as d:
        wait_until(lambda: pidfile.read_text() == str(d.proc.pid), what="the new pidfile")


def test_a_link_planted_at_the_pidfile_path_is_never_written_through(tmp_path):
    """-pidfile in a shared folder (/tmp, /var/tmp): another user can plant a symbolic or hard
    link there before the daemon (often root) starts; it was opened with O_TRUNC and written
    through, so /etc/shadow or any file lost its content for the daemon's pid."""
    hooks = write_hooks(tmp_path / "hooks.json", [{"id": "x", "execute-command": "/bin/true"}])
    victim = tmp_path / "victim"
    for plant in (os.symlink, os.link):
        victim.write_text("precious\n")
        pidfile = tmp_path / "w.pid"
        plant(victim, pidfile)
        p = webhookd("-hooks", hooks, "-ip", "127.0.0.1", "-port", support.free_port(),
                     "-pidfile", pidfile)
        output = p.stdout + p.stderr
        assert p.returncode == 1 and "Error creating pidfile: open %s: " % pidfile in output, \
            output
        assert output.count("\n") == 1 and "Errno" not in output, output
        assert victim.read_text() == "precious\n", plant
        os.unlink(pidfile)


def test_a_link_planted_at_the_logfile_path_is_never_written_through(tmp_path):
    """-logfile in a folder another user can write: a planted symbolic or hard link had the
    daemon (often root) append lines holding request text to the file it points at."""
    hooks = write_hooks(tmp_path / "hooks.json", [{"id": "x", "execute-command": "/bin/true"}])
    victim = tmp_path / "victim"
    for plant in (os.symlink, os.link):
        victim.write_text("precious\n")
        logfile = tmp_path / "w.log"
        plant(victim, logfile)
        p = webhookd("-hooks", hooks, "-ip", "127.0.0.1", "-port", support.free_port(),
                     "-logfile", logfile)
        output = p.stdout + p.stderr
        assert p.returncode == 1 and 'error opening log file "%s": open %s: ' % (
            logfile, logfile) in output, output
        assert output.count("\n") == 1 and "Errno" not in output, output
        assert victim.read_text() == "precious\n", plant
        os.unlink(logfile)
