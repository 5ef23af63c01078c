"""Issue 20, the connection layer: nothing a client does, or leaves undone, stalls others,
leaks or cuts an answer short.  Each test talks to the real daemon over loopback or a Unix
socket; generous timeouts are hang detectors, not latency checks (figures are in bench/)."""
import os
import socket
import subprocess

import support
from support import WEBHOOKD, Daemon, python_cmd
from test_webhookd_features import echo_hook, unix_request, wait_until, write_hooks


# ---------------------------------------------------------------------------------------------
# -socket PATH: a live instance's socket is refused, a stale one replaced
# ---------------------------------------------------------------------------------------------

def unix_daemon(hooks, path):
    daemon = Daemon(python_cmd(WEBHOOKD, "-hooks", hooks, "-socket", path, "-verbose"), 0,
                    wait=False)
    def listening():
        if daemon.proc.poll() is not None:
            return True
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            return probe.connect_ex(path) == 0
    wait_until(listening, what="a listening socket at " + path)
    return daemon


def test_socket_of_a_live_instance_is_refused_a_stale_one_replaced(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [echo_hook("unix")])
    path = str(tmp_path / "webhookd.sock")
    get = b"GET /hooks/unix HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with unix_daemon(hooks, path) as first:
        second = subprocess.run(python_cmd(WEBHOOKD, "-hooks", hooks, "-socket", path),
                                capture_output=True, text=True, timeout=30,
                                stdin=subprocess.DEVNULL)
        output = second.stdout + second.stderr
        assert second.returncode == 1 and output.count("\n") == 1, output
        assert "address already in use" in output and "Traceback" not in output, output
        assert unix_request(path, get).endswith(b"\r\n\r\nunix\n")  # the first still serves
        assert first.proc.poll() is None
    # a socket file nothing listens on (a killed instance's) is replaced
    os.unlink(path) if os.path.exists(path) else None
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()
    with unix_daemon(hooks, path) as again:
        assert again.proc.poll() is None, again.log()
        assert unix_request(path, get).endswith(b"\r\n\r\nunix\n")
