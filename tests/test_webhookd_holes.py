"""Black-box tests of the holes of issue 29, section 2: what a client can make the daemon keep,
what a local user can make it write, and what a reload or a query can make it fail on.

Each test starts the real daemon on a free 127.0.0.1 port and talks HTTP to it (the XML cases
also to Debian's Go webhook, when installed: the answers must match); timeouts are hang
detectors only.
"""
import os
import socket

import pytest

import support
from support import WEBHOOK_BIN, WEBHOOKD, Daemon, free_port, python_cmd
from test_webhookd_features import exchange, script, wait_until, write_hooks
from test_webhookd_runs import hook, start

needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                                reason="needs Linux: reads the daemon's RSS from /proc")


def rss_mib(pid):
    with open("/proc/%d/status" % pid) as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def raw_request(port, head, body=b""):
    """(status, body) of one request sent as raw bytes on its own connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        data = exchange(sock, head + body)
    answer_head, _, answer_body = data.partition(b"\r\n\r\n")
    return int(answer_head.split()[1]), answer_body


# ---------------------------------------------------------------------------------------------
# Client text the daemon must not keep
# ---------------------------------------------------------------------------------------------

@needs_proc
def test_long_header_names_are_not_kept_after_their_request(tmp_path):
    hooks = write_hooks(tmp_path / "hooks.json", [hook("h", "/bin/true")])
    with start(hooks) as daemon:
        assert daemon.request("GET", "/hooks/h")[0] == 200
        before = rss_mib(daemon.proc.pid)
        for n in range(40):  # 40 distinct names of 512 KiB: 20 MiB of names, 40 kept as is
            name = b"X-%d-" % n + b"a" * (512 << 10)
            status, _ = raw_request(daemon.port, b"GET /hooks/h HTTP/1.1\r\nHost: x\r\n"
                                    b"Connection: close\r\n%s: 1\r\n\r\n" % name)
            assert status == 200
        grown = rss_mib(daemon.proc.pid) - before
    assert grown < 12, "%.1f MiB kept" % grown
