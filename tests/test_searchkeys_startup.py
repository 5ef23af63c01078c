"""Black-box tests of `searchkeys.py serve` at startup: it fails closed, a bad flag or file gets
one sentence and a non-zero exit (never a traceback), and the store file is guarded (lock, mode,
symlink, a development build's journal). Each test runs the real script as a subprocess.
"""
import json
import os
import socket
import stat
import subprocess

import pytest

from support import (SEARCHKEYS, Daemon, free_port, ipv6_loopback, python_cmd, request,
                     status_with_piped_token)

MASTER = "startup-master-key-0123456789"


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MEILI_MASTER_KEY", "SEARCHKEYS_UPSTREAM_KEY")}
    env.update(extra)
    return env


def serve_argv(port, *args):
    return python_cmd(SEARCHKEYS, "serve", "--host", "127.0.0.1", "--port", str(port), *args)


def refused(*args, env=None, port=None):
    """Run serve expecting it to stop at once: (exit status, output)."""
    proc = subprocess.run(serve_argv(port or free_port(), *args), capture_output=True, text=True,
                          timeout=20, env=env or clean_env(), stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines, "no message"
    return proc.returncode, lines[-1]


def start(port, *args, env=None):
    return Daemon(serve_argv(port, *args), port, env=env or clean_env(), timeout=20.0)


def stored_uids(path):
    return [record["uid"] for record in json.loads(path.read_text())["keys"]]


def seeded_store(folder, extra_keys=1):
    store = folder / "keys.json"
    port = free_port()
    with start(port, "--master-key", MASTER, "--store", str(store)) as server:
        for number in range(extra_keys):
            status, _, _ = server.request("POST", "/keys", json.dumps(
                {"name": "k%d" % number, "actions": ["search"], "indexes": ["*"],
                 "expiresAt": None}), {"Authorization": "Bearer " + MASTER,
                                      "Content-Type": "application/json"})
            assert status == 201
    return store


# ---------------------------------------------------------------------------------------------
# Fail closed (issue 12 hole 6)
# ---------------------------------------------------------------------------------------------

def test_no_master_key_on_a_store_with_keys_refuses_to_start(tmp_path):
    store = seeded_store(tmp_path)
    before = store.read_bytes()
    for env in (clean_env(), clean_env(MEILI_MASTER_KEY="")):
        code, message = refused("--store", str(store), "--upstream", "http://127.0.0.1:1",
                                "--upstream-key", "admin", env=env)
        assert code == 2 and "master key" in message and "--open" in message, message
    assert store.read_bytes() == before


def test_open_mode_only_when_asked(tmp_path):
    store = seeded_store(tmp_path)
    port = free_port()
    with start(port, "--open", "--store", str(store)) as server:
        status, _, body = server.request("GET", "/keys")
        assert status == 401 and json.loads(body)["code"] == "missing_master_key"
        assert "--open" in server.log()  # the warning says why it is open
    code, message = refused("--open", "--master-key", MASTER)
    assert "--open" in message


@pytest.mark.parametrize("args,env,needle", [
    (["--master-key", ""], {}, "--master-key"),
    (["--master-key", MASTER, "--upstream", "http://127.0.0.1:1", "--upstream-key", ""], {},
     "--upstream-key"),
    (["--master-key", MASTER, "--upstream", "http://127.0.0.1:1"],
     {"SEARCHKEYS_UPSTREAM_KEY": ""}, "SEARCHKEYS_UPSTREAM_KEY"),
    (["--master-key", MASTER, "--port", "99999"], {}, "--port"),
    (["--master-key", MASTER, "--port", "-1"], {}, "--port"),
    (["--master-key", MASTER, "--port", "http"], {}, "--port"),
    (["--master-key", MASTER, "--max-connections", "0"], {}, "--max-connections"),
    (["--master-key", MASTER, "--max-connections", "many"], {}, "--max-connections"),
    (["--master-key", MASTER, "--upstream", "127.0.0.1:7701"], {}, "--upstream"),
    (["--master-key", MASTER, "--upstream", "http://127.0.0.1:77001"], {}, "--upstream"),
    (["--master-key", MASTER, "--upstream", "ftp://127.0.0.1"], {}, "--upstream"),
    (["--master-key", MASTER, "--store", ""], {}, "--store"),
    (["--master-key", MASTER, "--frobnicate"], {}, "--frobnicate"),
])
def test_bad_flag_values_are_usage_errors(args, env, needle):
    code, message = refused(*args, env=clean_env(**env))
    assert code == 2 and needle in message, message


def test_busy_port_and_unknown_host_are_one_sentence(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, message = refused("--master-key", MASTER, port=port)
        assert code == 1 and str(port) in message and "in use" in message, message
    code, message = refused("--master-key", MASTER, "--host", "no-such-host.invalid")
    assert code == 1 and "no-such-host.invalid" in message, message


@pytest.mark.parametrize("case", ["missing folder", "folder", "unreadable"])
def test_bad_store_paths_are_one_sentence(tmp_path, case):
    if case == "missing folder":
        store = tmp_path / "nowhere" / "keys.json"
    elif case == "folder":
        store = tmp_path
    else:
        if os.geteuid() == 0:
            pytest.skip("root reads any file: run the suite as another user to cover it (test_searchkeys_attack covers it as nobody)")
        store = seeded_store(tmp_path)
        store.chmod(0)
    code, message = refused("--master-key", MASTER, "--store", str(store))
    assert code == 1 and str(store) in message, message


# ---------------------------------------------------------------------------------------------
# The store file (issue 12 "Key store", hole 5)
# ---------------------------------------------------------------------------------------------

def test_loose_store_mode_is_tightened_with_a_log_line(tmp_path):
    store = seeded_store(tmp_path)
    store.chmod(0o644)
    port = free_port()
    with start(port, "--master-key", MASTER, "--store", str(store)) as server:
        assert stat.S_IMODE(store.stat().st_mode) == 0o600
        assert "0644" in server.log() and "0600" in server.log(), server.log()


def test_symlinked_store_is_written_through(tmp_path):
    target = seeded_store(tmp_path)
    link = tmp_path / "link.json"
    link.symlink_to(target.name)
    port = free_port()
    with start(port, "--master-key", MASTER, "--store", str(link)) as server:
        status, _, body = server.request("POST", "/keys", json.dumps(
            {"name": "through the link", "actions": ["search"], "indexes": ["*"],
             "expiresAt": None}), {"Authorization": "Bearer " + MASTER,
                                  "Content-Type": "application/json"})
        assert status == 201
        uid = json.loads(body)["uid"]
    assert link.is_symlink() and os.readlink(link) == target.name
    assert uid in stored_uids(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_a_journal_of_a_development_build_is_refused_in_one_sentence(tmp_path):
    """Only development builds, never a release, kept `keys.json.journal` beside the store;
    this version does not read one: the start stops with one sentence, both files untouched."""
    store = seeded_store(tmp_path, extra_keys=0)
    journal = tmp_path / "keys.json.journal"
    journal.write_text(json.dumps({"op": "delete", "uid": stored_uids(store)[0]}) + "\n")
    before = (store.read_bytes(), journal.read_bytes())
    code, message = refused("--master-key", MASTER, "--store", str(store))
    assert code == 1 and "keys.json.journal" in message and "development" in message, message
    assert message.count(". ") == 0, message  # one sentence
    assert (store.read_bytes(), journal.read_bytes()) == before


def test_a_journal_that_is_a_symlink_is_refused_and_its_target_left_alone(tmp_path):
    """The folding of an older version's journal read a planted `keys.json.journal` link
    and made its target 0600: now the link is refused in one sentence, nothing touched."""
    store = seeded_store(tmp_path, extra_keys=0)
    record = json.loads(store.read_text())["keys"][0]
    target = tmp_path / "elsewhere.txt"
    target.write_text(json.dumps({"op": "put", "key": dict(record, name="planted")}) + "\n")
    target.chmod(0o644)
    (tmp_path / "keys.json.journal").symlink_to(target)
    before = store.read_bytes()
    code, message = refused("--master-key", MASTER, "--store", str(store))
    assert code == 1 and "symbolic link" in message and "keys.json.journal" in message, message
    assert stat.S_IMODE(target.stat().st_mode) == 0o644 and store.read_bytes() == before
    assert (tmp_path / "keys.json.journal").is_symlink()


def _health(family, host, port, proc, timeout=20.0):
    """GET /health over `family` once the server listens: the status, or None."""
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.socket(family) as sock:
                sock.settimeout(5)
                sock.connect((host, port))
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                return int(sock.recv(100).split()[1])
        except OSError:
            time.sleep(0.05)
    return None


def _free_dual_stack_port():
    with socket.socket(socket.AF_INET6) as probe:
        probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        probe.bind(("::", 0))
        return probe.getsockname()[1]


@pytest.mark.skipif(not ipv6_loopback(), reason="needs an IPv6 loopback address (::1): enable IPv6 on lo")
@pytest.mark.parametrize("host, families", [
    ("::1", [(socket.AF_INET6, "::1")]),
    ("::", [(socket.AF_INET6, "::1"), (socket.AF_INET, "127.0.0.1")])])
def test_serve_listens_on_ipv6_and_dual_stack(host, families):
    """`--host ::1` failed ("Address family not supported"); `--host ::` takes IPv4 too."""
    for attempt in range(3):  # a port taken meanwhile by another test's connection: again
        port = _free_dual_stack_port()
        argv = python_cmd(SEARCHKEYS, "serve", "--host", host, "--port", str(port),
                          "--master-key", MASTER)
        with Daemon(argv, port, env=clean_env(), wait=False) as server:
            statuses = [_health(family, address, port, server.proc)
                        for family, address in families]
            if "Address already in use" in server.log():
                continue
            assert statuses == [200] * len(families), server.log()
            assert "listening on http://[%s]:%d" % (host, port) in server.log()
            return
    pytest.fail("no free port for --host %s" % host)


def test_a_piped_metrics_token_is_read_once(tmp_path):
    """`--metrics-token-file /dev/stdin` (or a shell's `<(...)`) can be read once only: serve
    reads it once, and the token then opens /metrics."""
    port, token = free_port(), "piped-metrics-token-0123456789"
    argv = python_cmd(SEARCHKEYS, "serve", "--host", "127.0.0.1", "--port", str(port),
                      "--master-key", MASTER, "--metrics-token-file", "/dev/stdin")
    assert status_with_piped_token(argv, port, "/metrics", token, clean_env()) == 200
