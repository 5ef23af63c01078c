"""Differential parity tests, part 2: the command line, startup, signals, reload, TLS.

The same cases run against adnanh/webhook 2.8.0 and webhookd.py through the
``runner`` fixture of test_webhookd_parity.py (see its docstring). Every test
here starts its own runner with the flags it is about; expectations were
verified against the real binary first (notes: /tmp/notes/webhook-observed.md).
Cases where 2.8.0 is known broken and webhookd.py is specified better are
marked ``webhookd_only``.
"""
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time

import pytest

import support
from test_webhookd_parity import (  # noqa: F401  (runner is a fixture)
    NOT_FOUND, PAGE_NOT_FOUND, POLL_TIMEOUT, Sandbox, arg, new_token, runner, webhookd_only,
)


# ----------------------------------------------------------------------------
# Helpers: hooks files, runners that exit, readiness, rewriting files, TLS
# ----------------------------------------------------------------------------

def hooks_json(*ids, **fields):
    """A hooks file's text: one /bin/true hook per id answering "id=<id>", plus ``fields``."""
    return json.dumps([dict({"id": i, "execute-command": "/bin/true",
                             "response-message": "id=" + i}, **fields) for i in ids])


def simple_hooks(path, *ids, **fields):
    """Write hooks_json(*ids, **fields) to ``path``; return the path."""
    path.write_text(hooks_json(*ids, **fields))
    return path


def wait_exit(runner, *args, timeout=10.0):
    """Start a runner that should refuse to start; return (exit code, stdout, stderr)."""
    port = support.free_port()
    argv = runner.argv(*args, "-ip", "127.0.0.1", "-port", port)
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise AssertionError(f"{argv} kept running")
    return p.returncode, out, err


def wait_signal_handlers(runner, d, timeout=POLL_TIMEOUT):
    """2.8.0 installs its signal handlers in a goroutine after it starts listening, so a signal
    sent right after startup can still kill it with the default action; wait for its log line.
    (webhookd is expected to handle signals before it accepts connections.)"""
    if runner.name != "webhook":
        return
    deadline = time.monotonic() + timeout
    while "os signal watcher ready" not in d.log():
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.02)


def pid_file_appears(path, timeout=POLL_TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        time.sleep(0.02)
    raise AssertionError(f"{path} never written")


def rewrite_in_place(path, text):
    """Overwrite without truncating to zero first (same inode; padded to at least the old
    length so no reader can see an empty or truncated file)."""
    data = text.encode()
    old = path.stat().st_size
    if len(data) < old:
        data += b" " * (old - len(data))
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def wait_status(d, path, expected, timeout=POLL_TIMEOUT):
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        status, _, body = d.request("GET", path)
        got = (status, body)
        if got == expected:
            return
        time.sleep(0.02)
    raise AssertionError(f"{path}: wanted {expected}, last got {got}\n{d.log()[-3000:]}")


@pytest.fixture(scope="module")
def tls_pair(tmp_path_factory):
    """A self-signed certificate and key for 127.0.0.1 (skips without the openssl CLI)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command: apt-get install openssl")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def https_get(port, path, cafile, **context_options):
    """(status, body, negotiated TLS version, ALPN protocol) of one HTTPS GET."""
    ctx = ssl.create_default_context(cafile=str(cafile))
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    for name, value in context_options.items():
        setattr(ctx, name, value)
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=20)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read(), conn.sock.version(), conn.sock.selected_alpn_protocol()
    finally:
        conn.close()


GO_CIPHER_SUITES = """TLS_RSA_WITH_AES_128_CBC_SHA
TLS_RSA_WITH_AES_256_CBC_SHA
TLS_RSA_WITH_AES_128_GCM_SHA256
TLS_RSA_WITH_AES_256_GCM_SHA384
TLS_AES_128_GCM_SHA256
TLS_AES_256_GCM_SHA384
TLS_CHACHA20_POLY1305_SHA256
TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA
TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA
TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA
TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA
TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384
TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384
TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256
TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256
"""


# ----------------------------------------------------------------------------
# §2.4 flags (own daemons)
# ----------------------------------------------------------------------------


def test_go_flag_syntax_and_urlprefix(runner, tmp_path):
    hooks = simple_hooks(tmp_path / "h.json", "one")
    port = support.free_port()
    with runner.start("--hooks=" + str(hooks), "-ip=127.0.0.1", "--port", port, "-verbose=true",
                      "--urlprefix=api", "-nopanic", port=port) as d:
        assert d.request("GET", "/api/one")[::2] == (200, b"id=one")
        assert d.request("GET", "/hooks/one")[::2] == (404, PAGE_NOT_FOUND)
        assert d.request("GET", "/api/two")[::2] == (404, NOT_FOUND)
        assert d.request("GET", "/")[::2] == (200, b"OK")


def test_empty_urlprefix(runner, tmp_path):
    hooks = simple_hooks(tmp_path / "h.json", "one", "deep/id")
    with runner.start("-hooks", hooks, "-urlprefix", "", "-verbose") as d:
        assert d.request("GET", "/one")[::2] == (200, b"id=one")
        assert d.request("GET", "/deep/id")[::2] == (200, b"id=deep/id")
        assert d.request("GET", "/two")[::2] == (404, NOT_FOUND)
        assert d.request("GET", "/hooks/one")[::2] == (404, NOT_FOUND)
        assert d.request("GET", "/")[::2] == (200, b"OK")
        assert d.request("GET", "/one/")[::2] == (404, NOT_FOUND)


def test_unknown_flag_exits_2_with_usage(runner):
    p = runner.run("-bogus")
    assert p.returncode == 2
    assert "flag provided but not defined: -bogus" in p.stderr
    assert "-hooks" in p.stderr and "-urlprefix" in p.stderr


def test_bad_flag_value_exits_2(runner):
    p = runner.run("-port", "abc")
    assert p.returncode == 2
    assert "-port" in p.stderr


def test_flag_parsing_stops_at_first_positional_argument(runner, tmp_path):
    # "-verbose false" is "-verbose" followed by the positional argument "false"; Go's flag
    # package stops there and 2.8.0 ignores the rest, so the unknown flag after it is no error
    hooks = simple_hooks(tmp_path / "h.json", "one")
    port = support.free_port()
    with runner.start("-hooks", hooks, "-ip", "127.0.0.1", "-port", port, "-verbose", "false",
                      "-bogus", "-urlprefix", "ignored", port=port) as d:
        assert d.request("GET", "/hooks/one")[::2] == (200, b"id=one")
        assert d.request("GET", "/ignored/one")[::2] == (404, PAGE_NOT_FOUND)


@pytest.mark.parametrize("flag", ["-h", "-help"])
def test_help_exits_0(runner, flag):
    p = runner.run(flag)
    assert p.returncode == 0
    assert "-hooks" in p.stderr and "-hotreload" in p.stderr and "-http-methods" in p.stderr


def test_version(runner):
    p = runner.run("-version")
    assert p.returncode == 0
    assert p.stdout.startswith("webhook version ") or p.stdout.startswith("webhookd version ")
    assert p.stdout.endswith("\n") and p.stdout.count("\n") == 1


def test_template_getenv(runner, tmp_path):
    hooks = tmp_path / "h.json"
    # the template is expanded before JSON parsing, so the inner quotes are fine (upstream style)
    hooks.write_text('[{"id": "t", "execute-command": "/bin/true",'
                     ' "response-message":'
                     ' "msg={{ getenv "PARITY_MSG" }}|{{ getenv "PARITY_Q" | js }}"}]')
    with runner.start("-hooks", hooks, "-template", "-verbose",
                      env={"PARITY_MSG": "hello", "PARITY_Q": 'say "hi"'}) as d:
        assert d.request("GET", "/hooks/t")[::2] == (200, b'msg=hello|say "hi"')


def test_template_unset_variable_is_empty_and_errors_reject_the_file(runner, tmp_path):
    hooks = tmp_path / "h.json"
    hooks.write_text('[{"id": "t", "execute-command": "/bin/true",'
                     ' "response-message": "[{{ getenv "PARITY_SURELY_UNSET" }}]"}]')
    with runner.start("-hooks", hooks, "-template", "-verbose") as d:
        assert d.request("GET", "/hooks/t")[::2] == (200, b"[]")
    for broken in ('{{ nosuchfunction "x" }}', "{{ getenv "):
        hooks.write_text('[{"id": "t", "execute-command": "/bin/true", "response-message": "'
                         + broken + '"}]')
        code, out, _ = wait_exit(runner, "-hooks", hooks, "-template")
        assert code == 1, broken
        assert "couldn't load any hooks from file!" in out


def test_logfile_implies_verbose_and_other_flags_accepted(runner, tmp_path):
    logfile = tmp_path / "webhook.log"
    # no hooks at all and no -verbose/-nopanic: -logfile implies verbose, so it serves
    with runner.start("-hooks", tmp_path / "missing.json", "-logfile", logfile,
                      "-debug", "-x-request-id", "-x-request-id-limit", "8",
                      "-max-multipart-mem", "4096",
                      "-tls-min-version", "1.2") as d:
        status, headers, body = d.request("GET", "/hooks/x",
                                          headers={"X-Request-Id": "abcdefghijkl"})
        assert (status, body) == (404, NOT_FOUND)
        assert "x-request-id" not in headers        # used for logging only, never echoed
        deadline = time.monotonic() + POLL_TIMEOUT
        while not (logfile.exists() and logfile.stat().st_size > 0):
            assert time.monotonic() < deadline, "nothing logged to -logfile"
            time.sleep(0.02)


def test_setuid_without_setgid_exits_1(runner, tmp_path):
    hooks = simple_hooks(tmp_path / "h.json", "one")
    code, out, err = wait_exit(runner, "-hooks", hooks, "-setuid", "65534")
    assert code == 1
    assert "setuid and setgid options must be used together" in out + err


def test_setuid_setgid_drop_privileges(runner, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to drop privileges: run the suite as root to cover it")
    hooks = tmp_path / "h.json"
    hooks.write_text(json.dumps([
        {"id": "ids", "execute-command": "/bin/sh", "include-command-output-in-response": True,
         "pass-arguments-to-command": [arg("string", "-c"), arg("string", "id -u; id -g")]}]))
    if runner.name == "webhook":
        # Debian's 2.8.0 build cannot drop privileges on Linux at all
        code, out, err = wait_exit(runner, "-hooks", hooks, "-setuid", "65534", "-setgid", "65534")
        assert code == 1 and "error dropping privileges" in out + err
    webhookd_only(runner, "2.8.0 exits 1: 'setuid and setgid not supported on linux'")
    with runner.start("-hooks", hooks, "-verbose", "-setuid", "65534", "-setgid", "65534") as d:
        assert d.request("GET", "/hooks/ids")[::2] == (200, b"65534\n65534\n")


def test_secure_serves_https_without_http2(runner, tmp_path, tls_pair):
    cert, key = tls_pair
    hooks = simple_hooks(tmp_path / "h.json", "one")
    with runner.start("-hooks", hooks, "-verbose", "-secure", "-cert", cert, "-key", key) as d:
        status, body, version, alpn = https_get(d.port, "/hooks/one", cert)
        assert (status, body) == (200, b"id=one")
        assert alpn in (None, "http/1.1")            # HTTP/2 is disabled
        assert https_get(d.port, "/", cert)[:2] == (200, b"OK")
        # default -tls-min-version 1.2: a TLS 1.2 client is fine
        assert https_get(d.port, "/", cert, maximum_version=ssl.TLSVersion.TLSv1_2)[2] == "TLSv1.2"


def test_list_cipher_suites(runner):
    p = runner.run("-list-cipher-suites")
    assert (p.returncode, p.stdout + p.stderr) == (0, GO_CIPHER_SUITES)


def test_cipher_suites_restrict_tls_1_2(runner, tmp_path, tls_pair):
    cert, key = tls_pair
    hooks = simple_hooks(tmp_path / "h.json", "one")
    with runner.start("-hooks", hooks, "-verbose", "-secure", "-cert", cert, "-key", key,
                      "-cipher-suites", "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256") as d:
        ctx = ssl.create_default_context(cafile=str(cert))
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        with socket.create_connection(("127.0.0.1", d.port), timeout=20) as raw:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                assert tls.cipher()[0] == "ECDHE-RSA-CHACHA20-POLY1305"


def test_tls_min_version_1_3(runner, tmp_path, tls_pair):
    cert, key = tls_pair
    hooks = simple_hooks(tmp_path / "h.json", "one")
    with runner.start("-hooks", hooks, "-verbose", "-secure", "-cert", cert, "-key", key,
                      "-tls-min-version", "1.3") as d:
        assert https_get(d.port, "/hooks/one", cert)[2] == "TLSv1.3"
        with pytest.raises(ssl.SSLError):
            https_get(d.port, "/", cert, maximum_version=ssl.TLSVersion.TLSv1_2)


def test_global_http_methods_flag(runner, tmp_path):
    hooks = tmp_path / "h.json"
    hooks.write_text(json.dumps([
        {"id": "plain", "execute-command": "/bin/true", "response-message": "plain"},
        {"id": "own", "execute-command": "/bin/true", "response-message": "own",
         "http-methods": ["GET"]},
    ]))
    with runner.start("-hooks", hooks, "-verbose", "-http-methods", " post , put",
                      "-header", "X-G=1") as d:
        assert d.request("POST", "/hooks/plain")[::2] == (200, b"plain")
        assert d.request("PUT", "/hooks/plain")[::2] == (200, b"plain")
        status, hdrs, body = d.request("GET", "/hooks/plain")
        assert (status, body) == (405, b"") and "x-g" not in hdrs
        assert d.request("GET", "/hooks/own")[::2] == (200, b"own")       # hook list wins
        assert d.request("POST", "/hooks/own")[::2] == (405, b"")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_pidfile_created_and_removed(runner, tmp_path, sig):
    hooks = simple_hooks(tmp_path / "h.json", "one")
    pidfile = tmp_path / "run" / "sub" / "webhook.pid"
    with runner.start("-hooks", hooks, "-pidfile", pidfile, "-verbose") as d:
        assert pid_file_appears(pidfile).strip() == str(d.proc.pid)
        wait_signal_handlers(runner, d)
        d.signal(sig)
        assert d.proc.wait(POLL_TIMEOUT) == 0
        assert not pidfile.exists()


@pytest.mark.parametrize("content", [
    None, "[{ broken", "[]",
    # one bad field type rejects the whole file in 2.8.0
    '[{"id": "good", "execute-command": "/bin/true"},'
    ' {"id": "bad", "execute-command": "/bin/true", "success-http-response-code": "abc"}]',
    '[{"id": "rule", "execute-command": "/bin/true", "trigger-rule": {"and": {"match": {}}}}]',
], ids=["missing", "broken", "empty-array", "bad-type", "bad-rule-shape"])
def test_no_hooks_loaded_without_flags_exits_1(runner, tmp_path, content):
    hooks = tmp_path / "hooks.json"
    if content is not None:
        hooks.write_text(content)
    code, out, err = wait_exit(runner, "-hooks", hooks)
    assert code == 1
    assert "couldn't load any hooks from file!" in out
    assert "-nopanic" in out


@pytest.mark.parametrize("flag", ["-nopanic", "-verbose"])
def test_no_hooks_loaded_with_nopanic_or_verbose_serves(runner, tmp_path, flag):
    with runner.start("-hooks", tmp_path / "missing.json", flag) as d:
        assert d.request("GET", "/hooks/one")[::2] == (404, NOT_FOUND)
        assert d.request("GET", "/")[::2] == (200, b"OK")


def test_default_hooks_file_is_hooks_json_in_cwd(runner, tmp_path):
    simple_hooks(tmp_path / "hooks.json", "from-default")
    with runner.start(cwd=tmp_path) as d:
        assert d.request("GET", "/hooks/from-default")[::2] == (200, b"id=from-default")


def test_several_hooks_files_and_missing_one_skipped(runner, tmp_path):
    a = simple_hooks(tmp_path / "a.json", "one")
    b = simple_hooks(tmp_path / "b.json", "two")
    with runner.start("-hooks", a, "-hooks", tmp_path / "missing.json", "-hooks", b) as d:
        assert d.request("GET", "/hooks/one")[::2] == (200, b"id=one")
        assert d.request("GET", "/hooks/two")[::2] == (200, b"id=two")


def test_duplicate_ids_across_files_exit_1(runner, tmp_path):
    a = simple_hooks(tmp_path / "a.json", "one", "same")
    b = simple_hooks(tmp_path / "b.json", "same")
    code, out, err = wait_exit(runner, "-hooks", a, "-hooks", b, "-verbose", "-nopanic")
    assert code == 1


def test_same_file_twice_is_a_duplicate_id_exit_1(runner, tmp_path):
    a = simple_hooks(tmp_path / "a.json", "one")
    code, out, err = wait_exit(runner, "-hooks", a, "-hooks", a, "-verbose")
    assert code == 1
    assert "has already been loaded" in out + err


@pytest.mark.parametrize("args", [["-port", "99999"], ["-ip", "999.1.1.1"]],
                         ids=["port-out-of-range", "bad-ip"])
def test_unusable_listen_address_exits_1_without_traceback(runner, tmp_path, args):
    hooks = simple_hooks(tmp_path / "h.json", "one")
    argv = runner.argv("-hooks", hooks, "-verbose", "-ip", "127.0.0.1", "-port",
                       support.free_port(), *args)
    p = subprocess.run(argv, capture_output=True, text=True, timeout=POLL_TIMEOUT,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 1
    assert "Traceback" not in p.stdout + p.stderr


def test_port_in_use_exits_1(runner, tmp_path):
    hooks = simple_hooks(tmp_path / "h.json", "one")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        argv = runner.argv("-hooks", hooks, "-ip", "127.0.0.1", "-port", port, "-verbose")
        p = subprocess.run(argv, capture_output=True, text=True, timeout=POLL_TIMEOUT,
                           stdin=subprocess.DEVNULL)
    assert p.returncode == 1


# ----------------------------------------------------------------------------
# §2.5 signals and hot reload
# ----------------------------------------------------------------------------


def test_reload_on_usr1_and_hup(runner, tmp_path):
    hooks = tmp_path / "h.json"
    hooks.write_text(hooks_json("one"))
    with runner.start("-hooks", hooks, "-verbose") as d:
        assert d.request("GET", "/hooks/one")[::2] == (200, b"id=one")
        wait_signal_handlers(runner, d)
        for sig, hook_id in ((signal.SIGUSR1, "two"), (signal.SIGHUP, "three")):
            hooks.write_text(hooks_json(hook_id))
            d.signal(sig)
            wait_status(d, "/hooks/" + hook_id, (200, b"id=" + hook_id.encode()))
        assert d.request("GET", "/hooks/one")[::2] == (404, NOT_FOUND)
        assert d.request("GET", "/hooks/two")[::2] == (404, NOT_FOUND)
        assert d.proc.poll() is None


def test_signal_reload_of_broken_file_keeps_old_hooks(runner, tmp_path):
    hooks = tmp_path / "h.json"
    hooks.write_text(hooks_json("one"))
    with runner.start("-hooks", hooks, "-verbose") as d:
        wait_signal_handlers(runner, d)
        hooks.write_text("[{ broken")
        d.signal(signal.SIGUSR1)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert d.request("GET", "/hooks/one")[::2] == (200, b"id=one")
            time.sleep(0.05)
        hooks.write_text(hooks_json("two"))
        d.signal(signal.SIGHUP)
        wait_status(d, "/hooks/two", (200, b"id=two"))


def test_signal_reload_goes_file_by_file(runner, tmp_path):
    # files are reloaded in command-line order, each checked against the hooks loaded so far:
    # a duplicate id rejects only the file that brings it (it keeps its old hooks)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(hooks_json("one"))
    b.write_text(hooks_json("two"))
    with runner.start("-hooks", a, "-hooks", b, "-verbose") as d:
        wait_signal_handlers(runner, d)
        a.write_text(hooks_json("one", "same"))
        b.write_text(hooks_json("same", "three"))
        d.signal(signal.SIGHUP)
        wait_status(d, "/hooks/same", (200, b"id=same"))
        assert d.request("GET", "/hooks/two")[::2] == (200, b"id=two")      # b kept its old hooks
        assert d.request("GET", "/hooks/three")[::2] == (404, NOT_FOUND)
        assert d.request("GET", "/hooks/one")[::2] == (200, b"id=one")


def test_hot_reload_in_place_write_and_broken_json(runner, tmp_path):
    hooks = tmp_path / "h.json"
    hooks.write_text(hooks_json("one"))
    with runner.start("-hooks", hooks, "-verbose", "-hotreload") as d:
        assert d.request("GET", "/hooks/one")[::2] == (200, b"id=one")
        rewrite_in_place(hooks, hooks_json("two"))
        wait_status(d, "/hooks/two", (200, b"id=two"))
        rewrite_in_place(hooks, '[{"id": "three", "execute-command": ' + " " * 40)
        # a broken file keeps the old hooks serving; give the watcher time to see it
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert d.request("GET", "/hooks/two")[::2] == (200, b"id=two")
            time.sleep(0.05)
        rewrite_in_place(hooks, hooks_json("four"))
        wait_status(d, "/hooks/four", (200, b"id=four"))
        assert d.request("GET", "/hooks/two")[::2] == (404, NOT_FOUND)


def test_hot_reload_rejects_duplicate_ids_across_files(runner, tmp_path):
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    a.write_text(hooks_json("one"))
    b.write_text(hooks_json("two"))
    with runner.start("-hooks", a, "-hooks", b, "-verbose", "-hotreload") as d:
        assert d.request("GET", "/hooks/two")[::2] == (200, b"id=two")
        rewrite_in_place(b, hooks_json("three", "one"))
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert d.request("GET", "/hooks/two")[::2] == (200, b"id=two")
            assert d.request("GET", "/hooks/three")[::2] == (404, NOT_FOUND)
            time.sleep(0.05)
        rewrite_in_place(b, hooks_json("four"))
        wait_status(d, "/hooks/four", (200, b"id=four"))
        assert d.request("GET", "/hooks/one")[::2] == (200, b"id=one")


def test_hot_reload_atomic_rename_replace(runner, tmp_path):
    webhookd_only(runner, "rename over the hooks file is lost by 2.8.0's inotify watcher")
    hooks = tmp_path / "h.json"
    hooks.write_text(hooks_json("one"))
    with runner.start("-hooks", hooks, "-verbose", "-hotreload") as d:
        assert d.request("GET", "/hooks/one")[::2] == (200, b"id=one")
        tmp = tmp_path / ".h.json.swp"
        tmp.write_text(hooks_json("two"))
        os.replace(tmp, hooks)
        wait_status(d, "/hooks/two", (200, b"id=two"))
        rewrite_in_place(hooks, hooks_json("three"))   # later in-place writes still seen
        wait_status(d, "/hooks/three", (200, b"id=three"))


def test_hot_reload_delete_and_recreate(runner, tmp_path):
    hooks = tmp_path / "h.json"
    hooks.write_text(hooks_json("one"))
    with runner.start("-hooks", hooks, "-verbose", "-hotreload", "-nopanic") as d:
        assert d.request("GET", "/hooks/one")[::2] == (200, b"id=one")
        hooks.unlink()
        wait_status(d, "/hooks/one", (404, NOT_FOUND))     # both: deleting drops the hooks
        webhookd_only(runner, "2.8.0 drops a deleted file from its watch list for good")
        hooks.write_text(hooks_json("two"))
        wait_status(d, "/hooks/two", (200, b"id=two"))


# ----------------------------------------------------------------------------
# The user's own deployment line
# ----------------------------------------------------------------------------

def test_debian_unit_line_is_silent(runner, tmp_path):
    # /lib/systemd/system/webhook.service: -nopanic -hooks FILE (no -verbose): serves, logs nothing
    hooks = tmp_path / "webhook.conf"
    hooks.write_text(json.dumps([
        {"id": "sync", "execute-command": "/bin/echo", "include-command-output-in-response": True,
         "pass-arguments-to-command": [arg("url", "word")]},
        {"id": "fails", "execute-command": "/bin/false", "include-command-output-in-response": True},
    ]))
    with runner.start("-nopanic", "-hooks", hooks) as d:
        assert d.request("GET", "/hooks/sync?word=hi")[::2] == (200, b"hi\n")
        assert d.request("GET", "/hooks/fails")[0] == 500
        assert d.request("GET", "/hooks/nope")[::2] == (404, NOT_FOUND)
        assert d.log() == ""


def test_user_deployment_line(runner, tmp_path):
    e = Sandbox(tmp_path)
    hooks = tmp_path / "webhook.conf"

    def redeploy_hook(message):
        return {"id": "redeploy", "execute-command": str(e.dump),
                "command-working-directory": str(e.workdir), "response-message": message,
                "pass-arguments-to-command": [{"source": "url", "name": "branch"}],
                "pass-environment-to-command": [{"source": "url", "name": "token",
                                                 "envname": "PARITY_TOKEN"}]}

    hooks.write_text(json.dumps([redeploy_hook("")]))
    port = support.free_port()
    # exactly the service line: no -ip, so it listens on all addresses; we talk to 127.0.0.1
    argv = runner.argv("-nopanic", "-hooks", hooks, "-hotreload", "-verbose", "-port", port)
    with support.Daemon(argv, port, env=e.runner_env(), cwd=e.cwd, timeout=20.0) as d:
        token = new_token()
        status, _, body = d.request("GET", f"/hooks/redeploy?branch=main&token={token}")
        assert (status, body) == (200, b"")
        rec = e.wait_record(token)
        assert rec["args"] == ["main"]
        assert rec["cwd"] == str(e.workdir)
        # editing the file in place is picked up by -hotreload
        rewrite_in_place(hooks, json.dumps([redeploy_hook("Redeploying.")]))
        wait_status(d, "/hooks/redeploy?branch=dev", (200, b"Redeploying."))
