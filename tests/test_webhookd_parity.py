"""Differential parity tests: the same cases against adnanh/webhook 2.8.0 and webhookd.py.

Every test runs twice through the ``runner`` fixture: once against the real
``/usr/bin/webhook`` (skipped only when it is not installed) and once against
``webhookd.py`` (never skipped: a missing tool must fail). The expectations
were verified against the real binary first; where webhook.md and the binary
disagree the binary wins (see /tmp/notes/webhook-observed.md).

To stay fast most cases share one daemon per runner (``srv``), started with a
single hooks file holding many hooks. Tests that need their own flags start
their own daemon. Commands are small Python scripts written to a temporary
directory; they print (capture mode) or record to a file (async mode) their
argv, cwd, environment, stdin and any pass-file files, so the arguments the
runner hands to the command are observable either way.

Behaviour where 2.8.0 is known broken and webhookd.py is specified better is
marked ``webhookd_only`` and skipped for the real binary. The command line,
startup, signals, reload and TLS cases are in test_webhookd_parity_cli.py.
"""
import base64
import hashlib
import hmac
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from pathlib import Path

import pytest

import support

GENERIC_500 = (b"Error occurred while executing the hook's command. "
               b"Please check your logs for more details.")
RULES_500 = b"Error occurred while evaluating hook rules."
MULTIPART_500 = b"Error occurred while parsing multipart form."
MISMATCH = b"Hook rules were not satisfied."
NOT_FOUND = b"Hook not found."
PAGE_NOT_FOUND = b"404 page not found\n"
SECRET = "s3cret"
POLL_TIMEOUT = 15.0


# ----------------------------------------------------------------------------
# Runners
# ----------------------------------------------------------------------------

class Runner:
    """How to start one implementation; the flags are the same for both."""

    def __init__(self, name, prefix):
        self.name = name
        self.prefix = list(prefix)

    def argv(self, *args):
        return self.prefix + [str(a) for a in args]

    def start(self, *args, port=None, env=None, cwd=None):
        """A Daemon listening on 127.0.0.1:port (``-ip``/``-port`` added unless given)."""
        args = [str(a) for a in args]
        port = port or support.free_port()
        if not any(a.lstrip("-").split("=")[0] == "port" for a in args):
            args += ["-port", str(port)]
        if not any(a.lstrip("-").split("=")[0] == "ip" for a in args):
            args += ["-ip", "127.0.0.1"]
        return support.Daemon(self.argv(*args), port, env=env, cwd=cwd, timeout=20.0)

    def run(self, *args, timeout=20.0):
        """Run to completion (for flags that exit): CompletedProcess with text output."""
        return subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module", params=["webhook", "webhookd"])
def runner(request):
    if request.param == "webhook":
        if support.WEBHOOK_BIN is None:
            pytest.skip("needs Debian's webhook: apt-get install webhook")
        return Runner("webhook", [support.WEBHOOK_BIN])
    return Runner("webhookd", support.python_cmd(support.WEBHOOKD))


def webhookd_only(runner, why):
    """Skip for the real binary: 2.8.0 is known broken here and webhookd is specified better."""
    if runner.name == "webhook":
        pytest.skip("webhookd only (2.8.0 known broken): " + why)


# ----------------------------------------------------------------------------
# Helper scripts (the hook commands)
# ----------------------------------------------------------------------------

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def install_script(path, fixture):
    """Copy a fixture script as an executable with this interpreter in its #! line.
    (-S skips site initialisation: the scripts need only the standard library.)
    The #! line names a link to the interpreter next to the script: the interpreter's own path
    (e.g. in a clone's .venv) may hold a space or be longer than the kernel reads of a #! line."""
    python = path.parent / "python"
    if not python.exists():
        python.symlink_to(sys.executable)
    path.write_text("#!" + str(python) + " -S\n" + (FIXTURES / fixture).read_text())
    path.chmod(0o755)
    return path


class Sandbox:
    """Directories and scripts shared by the hooks of one daemon."""

    def __init__(self, base):
        self.base = Path(base)
        self.bin = self.base / "bin"
        self.records = self.base / "records"
        self.tmp = self.base / "tmp"           # $TMPDIR of the runner
        self.workdir = self.base / "work"      # a command-working-directory
        self.cwd = self.base / "cwd"           # the runner's own cwd
        for d in (self.bin, self.records, self.tmp, self.workdir, self.cwd):
            d.mkdir(parents=True, exist_ok=True)
        self.dump = install_script(self.bin / "dump.py", "webhook_dump.py")
        self.interleave = install_script(self.bin / "interleave.py", "webhook_interleave.py")
        self.block = install_script(self.bin / "block.py", "webhook_block.py")
        # The Python interpreter under other names, so argv[0] as written is observable
        # through sys.orig_argv (a shebang script would only show its own path).
        for link in (self.bin / "parity-py", self.workdir / "wd-py", self.cwd / "local-py"):
            if not link.exists():
                link.symlink_to(sys.executable)

    def runner_env(self):
        """Environment additions for the runner (its commands inherit them)."""
        return {
            "PARITY_RECORD_DIR": str(self.records),
            "PARITY_INHERITED": "yes",
            "TMPDIR": str(self.tmp),
            "PATH": str(self.bin) + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"),
        }

    def wait_record(self, token, timeout=POLL_TIMEOUT):
        path = self.records / (token + ".json")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return json.loads(path.read_text())
            time.sleep(0.02)
        raise AssertionError(f"command never recorded token {token}")


def new_token():
    return uuid.uuid4().hex


# ----------------------------------------------------------------------------
# The shared daemon and its hooks
# ----------------------------------------------------------------------------

arg = support.hook_arg  # hooks below are built from many of these


def match(type_, parameter=None, **fields):
    m = {"type": type_}
    if parameter is not None:
        m["parameter"] = parameter
    m.update(fields)
    return {"match": m}


def value_rule(source, name, value):
    return match("value", arg(source, name), value=value)


def hmac_rule(kind, secret=SECRET, header="X-Sig"):
    return match(kind, arg("header", header), secret=secret)


def rule_hook(hook_id, rule, **fields):
    h = {"id": hook_id, "execute-command": "/bin/true", "response-message": "fired",
         "trigger-rule": rule}
    h.update(fields)
    return h


def shared_hooks(e):
    dump = str(e.dump)
    token_env = arg("url", "token", envname="PARITY_TOKEN")
    capture = {"include-command-output-in-response": True}
    hooks = [
        # --- §3 routing, methods, responses -------------------------------------------
        {"id": "async-msg", "execute-command": "/bin/true", "response-message": "queued",
         "success-http-response-code": 201,
         "response-headers": [{"name": "X-Hook", "value": "h1"},
                              {"name": "X-Global", "value": "overridden"}]},
        {"id": "group/deploy", "execute-command": "/bin/true", "response-message": "slash"},
        {"id": "code999", "execute-command": "/bin/true", "response-message": "c999",
         "success-http-response-code": 999},
        {"id": "bad-headers", "execute-command": "/bin/true", "response-message": "m",
         "response-headers": [{"name": "X A", "value": "v"}, {"name": "", "value": "v"},
                              {"name": "X-Split", "value": "a\r\nX-Injected: 1"},
                              {"name": "X-Ok", "value": "ok"}]},
        {"id": "ctype", "execute-command": "/bin/true", "response-message": '{"ok": true}',
         "response-headers": [{"name": "Content-Type", "value": "application/json"}]},
        {"id": "no-message", "execute-command": "/bin/true"},
        {"id": "methods", "execute-command": "/bin/true", "response-message": "m-ok",
         "http-methods": [" post", "Get "]},
        {"id": "async-rec", "execute-command": dump, "response-message": "queued",
         "pass-arguments-to-command": [arg("url", "a")],
         "pass-environment-to-command": [token_env],
         "pass-file-to-command": [arg("url", "a", envname="PARITY_AFILE")]},
        {"id": "async-fail", "execute-command": str(e.interleave), "response-message": "bg",
         "include-command-output-in-response-on-error": True,
         "pass-arguments-to-command": [arg("string", "4")]},
        {"id": "async-missing-cmd", "execute-command": "/nonexistent/cmd", "response-message": "bg"},
        {"id": "code204", "execute-command": "/bin/true", "response-message": "gone",
         "success-http-response-code": 204},
        {"id": "typo", "execute-comand": "/bin/true", "response-message": "typo"},
        {"id": "my hook", "execute-command": "/bin/true", "response-message": "spaced"},
        {"id": "d\u00e9ploy", "execute-command": "/bin/true", "response-message": "unicode"},
        {"id": "a+b", "execute-command": "/bin/true", "response-message": "plus"},
        {"id": "dup", "execute-command": "/bin/true", "response-message": "first"},
        {"id": "dup", "execute-command": "/bin/true", "response-message": "second"},
        # --- capture mode ------------------------------------------------------------
        dict(capture, **{"id": "cap-ok", "execute-command": str(e.interleave),
                         "success-http-response-code": 202}),
        dict(capture, **{"id": "cap-fail", "execute-command": str(e.interleave),
                         "pass-arguments-to-command": [arg("string", "3")],
                         "response-headers": [{"name": "X-Hook", "value": "h-fail"}]}),
        dict(capture, **{"id": "cap-fail-onerr", "execute-command": str(e.interleave),
                         "include-command-output-in-response-on-error": True,
                         "pass-arguments-to-command": [arg("string", "3")]}),
        dict(capture, **{"id": "cap-notfound", "execute-command": "/nonexistent/cmd"}),
        dict(capture, **{"id": "cap-notfound-onerr", "execute-command": "/nonexistent/cmd",
                         "include-command-output-in-response-on-error": True}),
        dict(capture, **{"id": "cap-badcwd", "execute-command": dump,
                         "command-working-directory": str(e.base / "no-such-dir")}),
        dict(capture, **{"id": "cap-badcwd-onerr", "execute-command": dump,
                         "include-command-output-in-response-on-error": True,
                         "command-working-directory": str(e.base / "no-such-dir")}),
        dict(capture, **{"id": "cap-space", "execute-command": "/bin/echo hi"}),
        dict(capture, **{"id": "cap-fail-ctype", "execute-command": str(e.interleave),
                         "pass-arguments-to-command": [arg("string", "3")],
                         "response-headers": [{"name": "content-type", "value": "text/csv"}]}),
        dict(capture, **{"id": "cap-fail-ctype-onerr", "execute-command": str(e.interleave),
                         "include-command-output-in-response-on-error": True,
                         "pass-arguments-to-command": [arg("string", "3")],
                         "response-headers": [{"name": "Content-Type", "value": "text/csv"}]}),
        dict(capture, **{"id": "cap-printf", "execute-command": "/usr/bin/printf",
                         "pass-arguments-to-command": [arg("url", "format")]}),
        dict(capture, **{"id": "cap-ok999", "execute-command": str(e.interleave),
                         "success-http-response-code": 999}),
        dict(capture, **{"id": "cap-bytes", "execute-command": "/usr/bin/printf",
                         "pass-arguments-to-command": [arg("string", "a\\377b\\000c")]}),
        dict(capture, **{"id": "cap-large", "execute-command": "/usr/bin/head",
                         "pass-arguments-to-command": [arg("string", "-c"), arg("string", "1048576"),
                                                       arg("string", "/dev/zero")]}),
        dict(capture, **{"id": "cap-block", "execute-command": str(e.block),
                         "pass-arguments-to-command": [arg("url", "release"), arg("url", "token")]}),
        {"id": "async-sh-block", "execute-command": "/bin/sh", "response-message": "started",
         "pass-arguments-to-command": [
             arg("string", "-c"),
             arg("string", 'while [ ! -e "$1" ]; do sleep 0.2; done; : > "$2"'),
             arg("string", "sh"), arg("url", "release"), arg("url", "done")]},
        {"id": "async-block", "execute-command": str(e.block), "response-message": "started",
         "pass-arguments-to-command": [arg("url", "release"), arg("url", "token")]},
        # --- execute-command resolution ------------------------------------------------
        dict(capture, **{"id": "rel-wd", "execute-command": "wd-py",
                         "command-working-directory": str(e.workdir),
                         "pass-arguments-to-command": [arg("string", dump), arg("string", "x")]}),
        dict(capture, **{"id": "rel-wd-not-path", "execute-command": "parity-py",
                         "command-working-directory": str(e.workdir),
                         "pass-arguments-to-command": [arg("string", dump)]}),
        dict(capture, **{"id": "rel-path", "execute-command": "parity-py",
                         "pass-arguments-to-command": [arg("string", dump)]}),
        dict(capture, **{"id": "rel-dot", "execute-command": "./local-py",
                         "pass-arguments-to-command": [arg("string", dump)]}),
        dict(capture, **{"id": "rel-wd-relative", "execute-command": "wd-py",
                         "command-working-directory": "../work",
                         "pass-arguments-to-command": [arg("string", dump)]}),
        dict(capture, **{"id": "cap-nocmd"}),
        {"id": "async-nocmd", "response-message": "nocmd"},
        dict(capture, **{"id": "full-env", "execute-command": "/usr/bin/env",
                         "pass-arguments-to-command": [arg("string", "-0")],
                         "pass-environment-to-command": [arg("url", "a")]}),
        dict(capture, **{"id": "abs-cwd", "execute-command": dump,
                         "command-working-directory": str(e.workdir)}),
        dict(capture, **{"id": "default-cwd", "execute-command": dump}),
        # --- parameter sources --------------------------------------------------------
        dict(capture, **{"id": "src", "execute-command": dump, "pass-arguments-to-command": [
            arg("header", "x-foo"), arg("url", "q"), arg("query", "q2"), arg("payload", "a.b"),
            arg("payload", "list.1.id"), arg("payload", "dotted.key"), arg("request", "method"),
            arg("request", "remote-addr"), arg("string", "literal value"), arg("payload", "num"),
            arg("payload", "big"), arg("payload", "flag"), arg("payload", "obj"),
            arg("payload", "missing.path"), arg("url", "missing"), arg("request", "bogus"),
            arg("header", "X-Missing"), arg("payload", "list.9.id"), arg("payload", "list.0"),
            arg("payload", "exp")]}),
        dict(capture, **{"id": "src-root", "execute-command": dump, "pass-arguments-to-command": [
            arg("payload", "root.0.x"), arg("payload", "root.1"), arg("payload", "0.x")]}),
        dict(capture, **{"id": "src-form", "execute-command": dump, "pass-arguments-to-command": [
            arg("payload", "a"), arg("payload", "b"), arg("payload", "c.d"), arg("payload", "e")]}),
        dict(capture, **{"id": "src-xml", "execute-command": dump, "pass-arguments-to-command": [
            arg("payload", "root.a.-x"), arg("payload", "root.a.#text"), arg("payload", "root.b.1"),
            arg("payload", "root.c"), arg("entire-payload")]}),
        dict(capture, **{"id": "src-multipart", "execute-command": dump,
                         "parse-parameters-as-json": [arg("payload", "pj")],
                         "pass-arguments-to-command": [
                             arg("payload", "f1"), arg("payload", "jf.k"), arg("payload", "pj.k"),
                             arg("payload", "txt")]}),
        dict(capture, **{"id": "pl", "execute-command": dump, "pass-arguments-to-command": [
            arg("payload", "x"), arg("entire-payload"), arg("payload", "x.k"),
            arg("payload", "r.x"), arg("payload", "r.x.#text")]}),
        dict(capture, **{"id": "nul-arg", "execute-command": dump,
                         "pass-arguments-to-command": [arg("payload", "s")]}),
        dict(capture, **{"id": "nul-env", "execute-command": dump,
                         "pass-environment-to-command": [arg("payload", "s")]}),
        dict(capture, **{"id": "src-override", "execute-command": dump,
                         "incoming-payload-content-type": "application/json",
                         "pass-arguments-to-command": [arg("payload", "a")]}),
        dict(capture, **{"id": "src-entire", "execute-command": dump, "pass-arguments-to-command": [
            arg("entire-payload"), arg("entire-query"), arg("entire-headers"),
            arg("raw-request-body")]}),
        dict(capture, **{"id": "ppj", "execute-command": dump,
                         "parse-parameters-as-json": [arg("url", "p"), arg("header", "X-J"),
                                                      arg("payload", "payload")],
                         "pass-arguments-to-command": [arg("url", "p.x"), arg("header", "X-J.y.z"),
                                                       arg("payload", "payload.repo.name")]}),
        dict(capture, **{"id": "ppj-null", "execute-command": dump,
                         "parse-parameters-as-json": [arg("url", "p")],
                         "pass-arguments-to-command": [arg("url", "p"), arg("url", "p.x")],
                         "pass-environment-to-command": [arg("url", "p")]}),
        # --- environment and files ----------------------------------------------------
        dict(capture, **{"id": "file-name-too-long", "execute-command": dump,
                         "pass-arguments-to-command": [arg("string", "ran")],
                         "pass-file-to-command": [
                             arg("string", "lost", envname="PARITY_" + "L" * 300),
                             arg("string", "kept", envname="PARITY_KEPT")]}),
        dict(capture, **{"id": "env", "execute-command": dump,
                         "pass-environment-to-command": [
                             arg("url", "branch"), arg("payload", "head_commit.timestamp"),
                             arg("header", "X-Foo", envname="PARITY_FOO"),
                             arg("header", "x-foo"),
                             arg("url", "inh", envname="PARITY_INHERITED"),
                             arg("url", "missing")],
                         "pass-file-to-command": [
                             arg("payload", "data"),
                             arg("payload", "b64", envname="PARITY_BIN", base64decode=True),
                             arg("payload", "head_commit.id"),
                             arg("url", "nofile")]}),
        dict(capture, **{"id": "raw-file", "execute-command": dump,
                         "pass-file-to-command": [arg("raw-request-body", envname="PARITY_RAW")]}),
        dict(capture, **{"id": "empty-names", "execute-command": dump,
                         "pass-arguments-to-command": [
                             arg("url", ""), arg("payload", ""), arg("payload", "."),
                             arg("payload", "a."), arg("string", ""), arg("header", "")]}),
        dict(capture, **{"id": "file-b64", "execute-command": dump,
                         "pass-file-to-command": [arg("url", "f", base64decode=True)],
                         "pass-environment-to-command": [arg("url", "f", base64decode=True)]}),
        dict(capture, **{"id": "env-wd", "execute-command": dump,
                         "command-working-directory": str(e.workdir),
                         "pass-file-to-command": [arg("url", "data", envname="PARITY_DATA")]}),
        # --- a realistic GitHub push deploy (async, recorded) ---------------------------
        {"id": "gh-push", "execute-command": dump, "command-working-directory": str(e.workdir),
         "http-methods": ["POST"], "response-message": "Deploy queued.\n",
         "pass-arguments-to-command": [arg("payload", "head_commit.id"),
                                       arg("payload", "pusher.name")],
         "pass-environment-to-command": [
             arg("payload", "repository.full_name", envname="PARITY_REPOSITORY"),
             arg("header", "X-GitHub-Delivery", envname="PARITY_TOKEN")],
         "trigger-rule": {"and": [hmac_rule("payload-hmac-sha256", header="X-Hub-Signature-256"),
                                  value_rule("payload", "ref", "refs/heads/main")]}},
        # --- rules --------------------------------------------------------------------
        rule_hook("r-and", {"and": [value_rule("header", "X-A", "1"), value_rule("url", "b", "2")]}),
        rule_hook("r-or", {"or": [value_rule("header", "X-A", "1"), value_rule("url", "b", "2")]}),
        rule_hook("r-not", {"not": value_rule("header", "X-A", "1")}),
        rule_hook("r-nested", {"and": [{"or": [value_rule("url", "a", "1"),
                                               value_rule("url", "a", "2")]},
                                       value_rule("url", "c", "y")]}),
        # a missing parameter: `and` propagates it (false), `or` ignores it, `not` negates the value
        rule_hook("r-not-in-and", {"and": [value_rule("url", "a", "2"),
                                           {"not": value_rule("url", "c", "x")}]}),
        rule_hook("r-not-in-or", {"or": [value_rule("url", "a", "1"),
                                         {"not": value_rule("url", "c", "x")}]}),
        rule_hook("r-not-not", {"not": {"not": value_rule("url", "c", "x")}}),
        rule_hook("r-not-and", {"not": {"and": [value_rule("url", "a", "2"),
                                                value_rule("url", "c", "x")]}}),
        rule_hook("r-or-missing-first", {"or": [value_rule("url", "c", "x"),
                                                value_rule("url", "a", "2")]}),
        rule_hook("r-num", {"and": [value_rule("payload", "n", "1"),
                                    value_rule("payload", "t", "true"),
                                    value_rule("payload", "f", "1.50")]}),
        rule_hook("r-regex", match("regex", arg("url", "branch"), regex="dev")),
        rule_hook("r-regex-anchored", match("regex", arg("url", "tag"), regex="^v[0-9]+$")),
        rule_hook("r-regex-bad", match("regex", arg("url", "tag"), regex="(")),
        # RE2 syntax: \z is end of text; look-around and back-references do not exist (500)
        rule_hook("r-regex-z", match("regex", arg("url", "tag"), regex=r"^v1\z")),
        rule_hook("r-regex-lookahead", match("regex", arg("url", "tag"), regex="v(?=1)")),
        rule_hook("r-regex-backref", match("regex", arg("url", "tag"), regex=r"(v)\1")),
        rule_hook("r-regex-flags", match("regex", arg("url", "tag"), regex="(?i)^V1$")),
        rule_hook("r-regex-fffd", match("regex", arg("url", "tag"), regex="^v\ufffd.$")),
        rule_hook("r-sha1", hmac_rule("payload-hmac-sha1")),
        rule_hook("r-sha256", hmac_rule("payload-hmac-sha256")),
        rule_hook("r-sha512", hmac_rule("payload-hmac-sha512")),
        rule_hook("r-hash-sha256", hmac_rule("payload-hash-sha256")),
        rule_hook("r-sha256-nosecret", hmac_rule("payload-hmac-sha256", secret="")),
        rule_hook("r-ip-cidr", match("ip-whitelist", **{"ip-range": "127.0.0.0/8"})),
        rule_hook("r-ip-bare", match("ip-whitelist", **{"ip-range": "127.0.0.1"})),
        rule_hook("r-ip-list", match("ip-whitelist", **{"ip-range": " 10.0.0.0/8\t 127.0.0.1/32 "})),
        rule_hook("r-ip-no", match("ip-whitelist", **{"ip-range": "10.0.0.0/8 192.168.1.1"})),
        rule_hook("r-ip-bad", match("ip-whitelist", **{"ip-range": "not-an-ip"})),
        rule_hook("r-scalr", match("scalr-signature", secret=SECRET)),
        rule_hook("r-unknown", {"bogus": {"x": 1}}),
        rule_hook("r-soft-off", {"or": [hmac_rule("payload-hmac-sha256"),
                                        value_rule("url", "b", "2")]}),
        rule_hook("r-soft-on", {"or": [hmac_rule("payload-hmac-sha256"),
                                       value_rule("url", "b", "2")]},
                  **{"trigger-signature-soft-failures": True}),
        rule_hook("r-code", value_rule("url", "b", "2"),
                  **{"trigger-rule-mismatch-http-response-code": 400,
                     "response-headers": [{"name": "X-Hook", "value": "h-rule"}]}),
        rule_hook("r-err-headers", match("regex", arg("url", "tag"), regex="("),
                  **{"response-headers": [{"name": "X-Hook", "value": "h-err"}]}),
        rule_hook("r-code999", value_rule("url", "b", "2"),
                  **{"trigger-rule-mismatch-http-response-code": 999}),
        rule_hook("r-ppj", value_rule("url", "p.x", "1"),
                  **{"parse-parameters-as-json": [arg("url", "p")]}),
        rule_hook("r-and-empty", {"and": []}),
        rule_hook("r-or-empty", {"or": []}),
        rule_hook("r-and-and-or", {"and": [value_rule("url", "a", "1")],
                                   "or": [value_rule("url", "a", "2")]}),
        rule_hook("r-no-type", {"match": {"parameter": arg("url", "a"), "value": "1"}}),
        rule_hook("r-bad-source", match("value", arg("nosuch", "a"), value="")),
        rule_hook("r-ip-hostbits", match("ip-whitelist", **{"ip-range": "127.0.0.5/8"})),
        rule_hook("r-ip-bad-prefix", match("ip-whitelist", **{"ip-range": "127.0.0.1/33"})),
        rule_hook("r-value-object", match("value", arg("payload", "o"), value='{"a":1,"b":[1,2]}')),
        rule_hook("r-value-absent", match("value", arg("url", "e"))),       # no "value": ""
        rule_hook("r-regex-number", match("regex", arg("payload", "n"), regex=r"^1\.50$")),
        rule_hook("r-regex-absent", match("regex", arg("url", "e"))),       # no "regex": ""
        rule_hook("r-method", match("value", arg("request", "method"), value="POST")),
        rule_hook("r-remote-addr", match("regex", arg("request", "remote-addr"),
                                         regex=r"^127\.0\.0\.1:[0-9]+$")),
        rule_hook("r-hmac-from-url", match("payload-hmac-sha256", arg("url", "sig"), secret="k")),
        rule_hook("r-ip-ignores-parameter", match("ip-whitelist", arg("url", "ip"),
                                                  **{"ip-range": "10.0.0.0/8"})),
        rule_hook("r-match-empty", {"match": {}}),
        rule_hook("r-entire-payload", match("regex", arg("entire-payload"), regex='"n":1.50')),
        rule_hook("r-raw-body", match("value", arg("raw-request-body"), value='{"n":1.50}')),
        rule_hook("r-string", match("value", arg("string", "abc"), value="abc")),
        rule_hook("r-header-canon", value_rule("header", "x-lower-case", "v")),
    ]
    return hooks


@pytest.fixture(scope="module")
def srv(runner, tmp_path_factory):
    e = Sandbox(tmp_path_factory.mktemp("parity-" + runner.name))
    hooks_file = e.base / "hooks.json"
    hooks_file.write_text(json.dumps(shared_hooks(e), indent=1))
    with runner.start("-hooks", hooks_file, "-verbose", "-header", "X-Global=g1=x",
                      "-header", "X-Second=two", env=e.runner_env(), cwd=e.cwd) as d:
        d.sandbox = e
        yield d


def call(srv, method, path, body=None, headers=None, timeout=20.0):
    return srv.request(method, path, body=body, headers=headers, timeout=timeout)


def hook_path(hook_id, **query):
    path = "/hooks/" + hook_id
    if query:
        path += "?" + urllib.parse.urlencode(query)
    return path


def dumped(srv, hook_id, method="POST", query=None, body=None, headers=None):
    """Trigger a capture-mode dump hook; return the recorded command invocation."""
    path = hook_path(hook_id) + ("?" + query if query else "")
    status, hdrs, data = call(srv, method, path, body, headers)
    assert status == 200, (status, data, srv.log()[-2000:])
    return json.loads(data)


def json_body(obj):
    return json.dumps(obj).encode(), {"Content-Type": "application/json"}


# ----------------------------------------------------------------------------
# Raw HTTP, multipart bodies, rule outcomes, signatures
# ----------------------------------------------------------------------------

def raw_exchange(port, head, body_chunks=(), expect_interim=False, timeout=20.0):
    """Send a hand-written request; return the raw bytes of the (final) response."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        if expect_interim:
            interim = b""
            while b"\r\n\r\n" not in interim:
                chunk = s.recv(4096)
                assert chunk, "connection closed before 100 Continue"
                interim += chunk
            assert interim.startswith(b"HTTP/1.1 100 Continue\r\n"), interim
        for chunk in body_chunks:
            s.sendall(chunk)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return data


def parse_response(data):
    """(status, lower-cased headers, body with chunked encoding removed) of raw response bytes."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower().decode()] = v.strip().decode()
    if headers.get("transfer-encoding") == "chunked":
        out, rest = b"", body
        while True:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        body = out
    return status, headers, body


def multipart(parts, boundary="PaRiTyBoUnDaRy"):
    """A multipart/form-data body and its headers from (name, filename, content-type, data)."""
    out = b""
    for name, filename, ctype, data in parts:
        out += b"--" + boundary.encode() + b"\r\n"
        disp = 'form-data; name="%s"' % name
        if filename:
            disp += '; filename="%s"' % filename
        out += b"Content-Disposition: " + disp.encode() + b"\r\n"
        if ctype:
            out += b"Content-Type: " + ctype.encode() + b"\r\n"
        out += b"\r\n" + data + b"\r\n"
    out += b"--" + boundary.encode() + b"--\r\n"
    return out, {"Content-Type": "multipart/form-data; boundary=" + boundary}


def fire(srv, hook_id, query="", body=None, headers=None, method="POST"):
    """(status, body) of one request to a rule hook: compare with FIRED/MISSED/RULE_ERROR."""
    status, _, data = call(srv, method, "/hooks/" + hook_id + ("?" + query if query else ""),
                           body, headers)
    return status, data


FIRED = (200, b"fired")
MISSED = (200, MISMATCH)
RULE_ERROR = (500, RULES_500)


def sign(kind, body, secret=SECRET):
    """Lower-case hex HMAC of the body, as GitHub and friends send it."""
    algo = {"sha1": hashlib.sha1, "sha256": hashlib.sha256, "sha512": hashlib.sha512}[kind]
    return hmac.new(secret.encode(), body, algo).hexdigest()


HMAC_BODY = b'{"ref": "refs/heads/main", "n": 1}'


def scalr_headers(body, when, secret=SECRET):
    """Scalr's X-Signature (HMAC-SHA1 of body + date) and Date headers for time ``when``."""
    date = time.strftime("%a %d %b %Y %H:%M:%S UTC", time.gmtime(when))
    sig = hmac.new(secret.encode(), body + date.encode(), hashlib.sha1).hexdigest()
    return {"X-Signature": sig, "Date": date}


# ----------------------------------------------------------------------------
# §3 routing and status rows
# ----------------------------------------------------------------------------

def test_root_answers_ok(srv):
    for method in ("GET", "POST"):
        status, hdrs, body = call(srv, method, "/")
        assert (status, body) == (200, b"OK")
        assert "x-global" not in hdrs  # 2.8.0 does not add -header values to /


@pytest.mark.parametrize("path", ["/nothing", "/hooks", "/other/hooks/async-msg"])
def test_outside_prefix_is_go_404(srv, path):
    status, hdrs, body = call(srv, "GET", path)
    assert (status, body) == (404, PAGE_NOT_FOUND)
    assert "x-global" not in hdrs


@pytest.mark.parametrize("path", ["/hooks/", "/hooks/nope", "/hooks/async-msg/extra"])
def test_unknown_hook_is_hook_not_found(srv, path):
    for method in ("GET", "PUT"):
        status, hdrs, body = call(srv, method, path)
        assert (status, body) == (404, NOT_FOUND)
        assert "x-global" not in hdrs and "x-hook" not in hdrs


@pytest.mark.parametrize("path,expected", [
    ("/hooks/group/deploy", (200, b"slash")),      # ids may contain "/"
    ("/hooks/group%2Fdeploy", (200, b"slash")),    # ... matched after URL-decoding
    ("/hooks/my%20hook", (200, b"spaced")),
    ("/hooks/d%C3%A9ploy", (200, b"unicode")),
    ("/hooks/a+b", (200, b"plus")),                # "+" is literal in a path
    ("/hooks/a%2Bb", (200, b"plus")),
    ("/hooks/code999", (200, b"c999")),            # a status Go does not know -> 200
    ("/hooks/code204", (204, b"")),                # 204 drops the response-message
    ("/hooks/no-message", (200, b"")),
    ("/hooks/dup", (200, b"first")),               # same id twice in one file: first wins
])
def test_simple_responses(srv, path, expected):
    assert call(srv, "POST", path)[::2] == expected


def test_an_unknown_field_on_a_hook_without_trigger_rule(srv, runner):
    """Go ignores the unknown field ("execute-comand") and serves the hook to anyone; webhookd
    does not serve a hook with an unknown field and no trigger-rule, which is more often a
    misspelt trigger-rule than a wish (a deliberate difference, in docs/webhookd.md)."""
    expected = (200, b"typo") if runner.name == "webhook" else (404, b"Hook not found.")
    assert call(srv, "POST", "/hooks/typo")[::2] == expected


@pytest.mark.parametrize("path,location", [
    ("/hooks//group/deploy", "/hooks/group/deploy"),
    ("/hooks/x/../group/deploy", "/hooks/group/deploy"),
    ("/hooks/./group/deploy?a=1", "/hooks/group/deploy?a=1"),
    ("/hooks/group/deploy/.", "/hooks/group/deploy"),
    ("//", "/"),
])
def test_unclean_paths_are_redirected(srv, path, location):
    # the Go router cleans the path first: 301 to the clean path, empty body, hook not run
    status, hdrs, body = call(srv, "GET", path)
    assert (status, body) == (301, b"")
    assert hdrs["location"] == location
    assert "x-global" not in hdrs


def test_async_response_message_code_and_headers(srv):
    status, hdrs, body = call(srv, "POST", "/hooks/async-msg")
    assert (status, body) == (201, b"queued")
    assert hdrs["x-hook"] == "h1"
    assert hdrs["x-global"] == "overridden"  # response-headers beat -header of the same name
    assert hdrs["x-second"] == "two"


def test_invalid_response_headers_are_not_sent(srv):
    # Go drops header fields with invalid names and turns CR/LF in values into spaces
    response = raw_exchange(
        srv.port, b"GET /hooks/bad-headers HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    status, _, body = parse_response(response)
    assert (status, body) == (200, b"m")
    lines = response.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]
    names = [line.partition(b":")[0] for line in lines]
    assert b"X A" not in names and b"" not in names
    assert b"X-Injected" not in names
    assert b"X-Ok: ok" in lines


def test_global_header_value_may_contain_equals(srv):
    status, hdrs, _ = call(srv, "GET", "/hooks/group/deploy")
    assert status == 200
    assert hdrs["x-global"] == "g1=x"
    assert hdrs["x-second"] == "two"


def test_response_headers_can_set_content_type(srv):
    status, hdrs, body = call(srv, "POST", "/hooks/ctype")
    assert (status, body) == (200, b'{"ok": true}')
    assert hdrs["content-type"] == "application/json"


def test_keep_alive_connection_serves_several_requests(srv):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=20)
    try:
        for method, path, expected in [("GET", "/", (200, b"OK")),
                                       ("POST", "/hooks/group/deploy", (200, b"slash")),
                                       ("GET", "/hooks/nope", (404, NOT_FOUND)),
                                       ("PUT", "/hooks/methods", (405, b"")),
                                       ("POST", "/hooks/r-code?b=3", (400, MISMATCH)),
                                       ("POST", "/hooks/cap-fail", (500, GENERIC_500)),
                                       ("GET", "/nothing", (404, PAGE_NOT_FOUND)),
                                       ("GET", "/", (200, b"OK"))]:
            conn.request(method, path, body=b"x=1" if method == "POST" else None)
            resp = conn.getresponse()
            assert (resp.status, resp.read()) == expected, (method, path)
    finally:
        conn.close()


def test_chunked_request_body(srv):
    body = json.dumps({"a": {"b": "chunked"}}).encode()
    head = (b"POST /hooks/src HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    chunks = [b"%x\r\n%s\r\n" % (len(body[:5]), body[:5]),
              b"%x\r\n%s\r\n" % (len(body[5:]), body[5:]), b"0\r\n\r\n"]
    status, _, data = parse_response(raw_exchange(srv.port, head, chunks))
    assert status == 200, data
    assert json.loads(data)["args"][3] == "chunked"


def test_expect_100_continue(srv):
    body = json.dumps({"a": {"b": "continued"}}).encode()
    head = (b"POST /hooks/src HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    status, _, data = parse_response(raw_exchange(srv.port, head, [body], expect_interim=True))
    assert status == 200, data
    assert json.loads(data)["args"][3] == "continued"


@pytest.mark.parametrize("length", [b"Content-Length: 0\r\n", b""])
def test_expect_100_continue_without_a_body_gets_no_interim_answer(srv, length):
    # Go writes `100 Continue` only when the request announces a body
    head = (b"POST /hooks/group/deploy HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            b"Connection: close\r\n" + length + b"\r\n")
    assert raw_exchange(srv.port, head).startswith(b"HTTP/1.1 200 OK\r\n")


def test_repeated_header_first_value_wins(srv):
    head = (b"POST /hooks/src HTTP/1.1\r\nHost: x\r\nX-Foo: first\r\nX-Foo: second\r\n"
            b"Content-Length: 0\r\nConnection: close\r\n\r\n")
    status, _, data = parse_response(raw_exchange(srv.port, head))
    assert status == 200, data
    assert json.loads(data)["args"][0] == "first"


def test_oversized_request_headers_get_431(srv):
    # Go accepts up to 1 MiB of headers and answers 431 beyond; the answer must reach the
    # client (close the write side and drain, not a reset that can discard the response)
    head = (b"GET /hooks/group/deploy HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: "
            + b"b" * 1100000 + b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as s:
        try:
            s.sendall(head)
        except OSError:
            pass   # the server may stop reading once it has answered
        data = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except ConnectionResetError:
            pass
    assert data.startswith(b"HTTP/1.1 431 "), data[:200]
    status, _, data = parse_response(raw_exchange(
        srv.port, b"GET /hooks/group/deploy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"X-Big: " + b"b" * 70000 + b"\r\n\r\n"))
    assert (status, data) == (200, b"slash")


def test_http_1_0_request(srv):
    response = raw_exchange(srv.port, b"GET /hooks/group/deploy HTTP/1.0\r\n\r\n")
    status, headers, data = parse_response(response)
    assert (status, data) == (200, b"slash")
    # the connection closes without a `Connection: close`, as Go answers HTTP/1.0
    assert response.startswith(b"HTTP/1.0 200 OK\r\n") and "connection" not in headers


def test_github_push_deploy(srv):
    payload = {"ref": "refs/heads/main", "head_commit": {"id": "9f2c1e0", "message": "fix <b>"},
               "pusher": {"name": "octocat"}, "repository": {"full_name": "octo/site"}}
    body = json.dumps(payload, indent=2).encode()
    delivery = new_token()
    headers = {"Content-Type": "application/json", "X-GitHub-Event": "push",
               "X-GitHub-Delivery": delivery, "User-Agent": "GitHub-Hookshot/abc",
               "X-Hub-Signature": "sha1=" + sign("sha1", body),
               "X-Hub-Signature-256": "sha256=" + sign("sha256", body)}
    assert call(srv, "POST", "/hooks/gh-push", body, headers)[::2] == (200, b"Deploy queued.\n")
    rec = srv.sandbox.wait_record(delivery)
    assert rec["args"] == ["9f2c1e0", "octocat"]
    assert rec["env"]["PARITY_REPOSITORY"] == "octo/site"
    assert rec["cwd"] == str(srv.sandbox.workdir)
    other = json.dumps(dict(payload, ref="refs/heads/dev")).encode()
    assert call(srv, "POST", "/hooks/gh-push", other,
                dict(headers, **{"X-Hub-Signature-256": "sha256=" + sign("sha256", other)})
                )[::2] == (200, MISMATCH)
    assert call(srv, "POST", "/hooks/gh-push", other, headers)[::2] == RULE_ERROR  # stale sig
    assert call(srv, "GET", "/hooks/gh-push")[::2] == (405, b"")


# ----------------------------------------------------------------------------
# §2.1 http-methods
# ----------------------------------------------------------------------------

def test_hook_http_methods_trimmed_and_upper_cased(srv):
    for method in ("POST", "GET"):
        status, _, body = call(srv, method, "/hooks/methods")
        assert (status, body) == (200, b"m-ok"), method


@pytest.mark.parametrize("method", ["PUT", "DELETE", "post", "HEAD", "OPTIONS"])
def test_method_not_allowed_is_empty_405(srv, method):
    status, hdrs, body = call(srv, method, "/hooks/methods")
    assert (status, body) == (405, b"")
    assert "content-type" not in hdrs
    assert "x-global" not in hdrs


@pytest.mark.parametrize("method", ["OPTIONS", "HEAD", "PATCH"])
def test_no_method_list_means_any_method_runs_command(srv, method):
    token = new_token()
    status, _, _ = call(srv, method, hook_path("async-rec", token=token, a=method))
    assert status == 200
    rec = srv.sandbox.wait_record(token)
    assert rec["args"] == [method]


# ----------------------------------------------------------------------------
# §3 async and capture modes
# ----------------------------------------------------------------------------

def test_async_pass_file_removed_after_the_command(srv):
    token = new_token()
    assert call(srv, "POST", hook_path("async-rec", token=token, a="async data"))[::2] == \
        (200, b"queued")
    f = srv.sandbox.wait_record(token)["files"]["PARITY_AFILE"]
    assert (f["content"], f["mode"]) == ("async data", 0o600)
    deadline = time.monotonic() + POLL_TIMEOUT
    while Path(f["path"]).exists():
        assert time.monotonic() < deadline, "async pass-file temp file not removed"
        time.sleep(0.02)


def test_async_failure_is_invisible(srv):
    for hook_id in ("async-fail", "async-missing-cmd"):
        status, _, body = call(srv, "POST", "/hooks/" + hook_id)
        assert (status, body) == (200, b"bg"), hook_id


def test_async_answers_before_command_finishes(srv, tmp_path):
    token, release = new_token(), tmp_path / "release-async"
    status, _, body = call(srv, "POST", hook_path("async-block", release=release, token=token))
    assert (status, body) == (200, b"started")
    # the command is still blocked, so we were answered before it finished
    assert not (srv.sandbox.records / (token + ".json")).exists()
    release.touch()
    assert srv.sandbox.wait_record(token) == {"released": True}


def test_many_async_triggers_are_all_answered_at_once(srv, tmp_path):
    # more triggers than webhookd's default -max-async-runs (64) of a hook whose command blocks:
    # every one is answered before any command ends, and every command runs eventually
    release = tmp_path / "release-many"
    markers = [tmp_path / ("done-%d" % i) for i in range(66)]
    results = []

    def trigger(marker):
        results.append(call(srv, "POST", hook_path("async-sh-block", release=release,
                                                   done=marker), timeout=40)[::2])

    threads = [threading.Thread(target=trigger, args=(m,)) for m in markers]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        assert results == [(200, b"started")] * len(markers)
        assert not any(m.exists() for m in markers)
    finally:
        release.touch()
    deadline = time.monotonic() + POLL_TIMEOUT * 2
    while not all(m.exists() for m in markers):
        assert time.monotonic() < deadline, "not every triggered command ran"
        time.sleep(0.05)


def test_requests_are_concurrent(srv, tmp_path):
    token, release = new_token(), tmp_path / "release-cap"
    result = {}

    def blocked():
        result["r"] = call(srv, "POST", hook_path("cap-block", release=release, token=token),
                           timeout=40)

    t = threading.Thread(target=blocked)
    t.start()
    try:
        started = srv.sandbox.records / (token + ".started")
        deadline = time.monotonic() + POLL_TIMEOUT
        while not started.exists():
            assert time.monotonic() < deadline, "blocking command never started"
            time.sleep(0.02)
        # one request is held by a running command; others must still be served
        status, _, body = call(srv, "POST", "/hooks/group/deploy")
        assert (status, body) == (200, b"slash")
        assert "r" not in result
    finally:
        release.touch()
        t.join(40)
    assert result["r"][0] == 200 and result["r"][2] == b"released"


def test_same_hook_runs_in_parallel(srv, tmp_path):
    # no per-hook limit by default: two runs of one hook are in flight at the same time
    release = tmp_path / "release-both"
    tokens = [new_token(), new_token()]
    results = []
    threads = [threading.Thread(target=lambda t=t: results.append(
        call(srv, "POST", hook_path("cap-block", release=release, token=t), timeout=40)))
        for t in tokens]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + POLL_TIMEOUT
        while not all((srv.sandbox.records / (t + ".started")).exists() for t in tokens):
            assert time.monotonic() < deadline, "the two runs were not in flight together"
            time.sleep(0.02)
    finally:
        release.touch()
        for t in threads:
            t.join(40)
    assert [r[::2] for r in results] == [(200, b"released")] * 2


def test_capture_interleaves_stdout_and_stderr(srv):
    status, _, body = call(srv, "POST", "/hooks/cap-ok")
    assert (status, body) == (202, b"out1\nerr1\nout2\n")


def test_capture_failure_is_generic_500(srv):
    status, hdrs, body = call(srv, "POST", "/hooks/cap-fail")
    assert (status, body) == (500, GENERIC_500)
    assert hdrs["content-type"] == "text/plain; charset=utf-8"
    assert hdrs["x-hook"] == "h-fail"   # hook response-headers also on the failing 500
    assert hdrs["x-global"] == "g1=x"


def test_head_answer_without_body_has_no_length(srv):
    # Go's server counts a HEAD answer's length only when the handler wrote a body
    status, hdrs, _ = call(srv, "HEAD", "/hooks/no-message")
    assert status == 200 and "content-length" not in hdrs
    status, hdrs, _ = call(srv, "HEAD", "/hooks/nope")
    assert (status, hdrs.get("content-length")) == (404, "15")


@pytest.mark.parametrize("hook_id,body", [("cap-fail-ctype", GENERIC_500),
                                          ("cap-fail-ctype-onerr", b"out1\nerr1\nout2\n")])
def test_capture_failure_keeps_the_hooks_content_type(srv, hook_id, body):
    # Go sets text/plain only after writing the 500's head: the hook's own type stays
    status, hdrs, data = call(srv, "POST", "/hooks/" + hook_id)
    assert (status, data, hdrs["content-type"]) == (500, body, "text/csv")


@pytest.mark.parametrize("output,content_type", [
    ("%%PDF-1.4", "application/pdf"),
    ("%%!PS-Adobe-3.0", "application/postscript"),
    ("GIF89a..", "image/gif"),
    ("\\211PNG\\r\\n\\032\\n....", "image/png"),
    ("\\377\\330\\377\\340", "image/jpeg"),
    ("PK\\003\\004....", "application/zip"),
    ("\\037\\213\\010....", "application/x-gzip"),
    ("RIFF\\001\\002\\003\\004WAVEfmt ", "audio/wave"),
    ("\\000\\000\\000\\030ftypmp42\\000\\000\\000\\000mp41isom", "video/mp4"),
    ("\\357\\273\\277text", "text/plain; charset=utf-8"),
    ("\\376\\377\\000a", "text/plain; charset=utf-16be"),
    ("\\000\\001\\000\\000", "font/ttf"),
    ("wOF2....", "font/woff2"),
    ("\\000asm\\001", "application/wasm"),
    ("  %%PDF-1.4", "text/plain; charset=utf-8"),     # binary signatures only at the very start
    ("  <?xml version='1.0'?>", "text/xml; charset=utf-8"),
    ("\\001binary", "application/octet-stream"),
])
def test_command_output_content_type_is_sniffed_as_go_does(srv, output, content_type):
    # (printf reads `output` as its format: `%%` is a `%`, `\NNN` an octal byte)
    status, hdrs, _ = call(srv, "POST", hook_path("cap-printf", format=output))
    assert (status, hdrs.get("content-type")) == (200, content_type)


def test_capture_failure_with_output_on_error(srv):
    status, _, body = call(srv, "POST", "/hooks/cap-fail-onerr")
    assert (status, body) == (500, b"out1\nerr1\nout2\n")


@pytest.mark.parametrize("hook_id", ["cap-notfound", "cap-badcwd", "cap-space", "rel-wd-not-path"])
def test_capture_command_never_started_is_generic_500(srv, hook_id):
    status, _, body = call(srv, "POST", "/hooks/" + hook_id)
    assert (status, body) == (500, GENERIC_500)


@pytest.mark.parametrize("hook_id", ["cap-notfound-onerr", "cap-badcwd-onerr"])
def test_capture_never_started_with_output_on_error_is_empty_500(srv, hook_id):
    status, _, body = call(srv, "POST", "/hooks/" + hook_id)
    assert (status, body) == (500, b"")


def test_capture_output_is_passed_as_raw_bytes(srv):
    assert call(srv, "POST", "/hooks/cap-bytes")[::2] == (200, b"a\xffb\x00c")
    status, _, body = call(srv, "POST", "/hooks/cap-large")
    assert (status, len(body), body.count(b"\0")) == (200, 1048576, 1048576)


def test_rule_error_has_global_but_not_hook_headers(srv):
    status, hdrs, body = call(srv, "POST", "/hooks/r-err-headers?tag=v1")
    assert (status, body) == RULE_ERROR
    assert hdrs["x-global"] == "g1=x" and "x-hook" not in hdrs


def test_capture_success_with_unknown_code_is_200(srv):
    status, _, body = call(srv, "POST", "/hooks/cap-ok999")
    assert (status, body) == (200, b"out1\nerr1\nout2\n")


# ----------------------------------------------------------------------------
# §2.1 execute-command resolution, cwd, stdin, environment
# ----------------------------------------------------------------------------

def test_relative_command_joined_with_working_directory(srv):
    rec = dumped(srv, "rel-wd")
    assert rec["orig0"] == "wd-py"      # argv[0] as written
    assert rec["args"] == ["x"]
    assert rec["cwd"] == str(srv.sandbox.workdir)


def test_bare_command_name_searched_on_path(srv):
    rec = dumped(srv, "rel-path")
    assert rec["orig0"] == "parity-py"
    assert rec["cwd"] == str(srv.sandbox.cwd)   # default cwd: the runner's own


def test_dot_slash_command_relative_to_runner_cwd(srv):
    rec = dumped(srv, "rel-dot")
    assert rec["orig0"] == "./local-py"


def test_relative_working_directory_is_relative_to_runner_cwd(srv):
    rec = dumped(srv, "rel-wd-relative")
    assert rec["orig0"] == "wd-py" and rec["cwd"] == str(srv.sandbox.workdir)


def test_hook_without_execute_command(srv):
    assert call(srv, "POST", "/hooks/cap-nocmd")[::2] == (500, GENERIC_500)
    assert call(srv, "POST", "/hooks/async-nocmd")[::2] == (200, b"nocmd")


def test_command_environment_is_exactly_inherited_plus_hook_variables(srv):
    status, _, body = call(srv, "GET", "/hooks/full-env?a=1")
    assert status == 200
    seen = dict(item.split("=", 1) for item in body.decode().split("\0") if item)
    expected = dict(os.environ, **srv.sandbox.runner_env(), HOOK_a="1")
    for changing in ("PYTEST_CURRENT_TEST",):   # pytest rewrites it per test phase
        seen.pop(changing, None)
        expected.pop(changing, None)
    assert seen == expected


def test_working_directory_stdin_and_inherited_environment(srv):
    rec = dumped(srv, "abs-cwd")
    assert rec["cwd"] == str(srv.sandbox.workdir)
    assert rec["stdin"] == "/dev/null"
    assert rec["env"]["PARITY_INHERITED"] == "yes"
    assert dumped(srv, "default-cwd")["cwd"] == str(srv.sandbox.cwd)


# ----------------------------------------------------------------------------
# §2.3 parameter sources
# ----------------------------------------------------------------------------

SRC_BODY = (b'{"a": {"b": "x"}, "list": [{"id": 1}, {"id": "two"}], "dotted.key": "lit",'
            b' "dotted": {"key": "path"}, "num": 1.50, "big": 12345678901234567890,'
            b' "flag": true, "obj": {"z": 1, "a": [1, "s"]}, "exp": 1e3}')


def test_sources_header_url_payload_request_string(srv):
    rec = dumped(srv, "src", query="q=a+b%21&q2=x&q=second",
                 body=SRC_BODY, headers={"Content-Type": "application/json", "X-Foo": "hv"})
    args = rec["args"]
    assert len(args) == 20
    assert args[0] == "hv"            # header, name canonicalised
    assert args[1] == "a b!"          # url, decoded, first value
    assert args[2] == "x"             # query alias
    assert args[3] == "x"             # payload a.b
    assert args[4] == "two"           # array index
    assert args[5] == "lit"           # literal dotted key wins over the path
    assert args[6] == "POST"
    host, _, port = args[7].rpartition(":")
    assert host == "127.0.0.1" and port.isdigit()
    assert args[8] == "literal value"
    assert args[9] == "1.50"          # numbers as written
    assert args[10] == "12345678901234567890"
    assert args[11] == "true"
    assert json.loads(args[12]) == {"z": 1, "a": [1, "s"]}
    assert args[12] == '{"a":[1,"s"],"z":1}'   # compact, keys sorted
    assert args[13:18] == ["", "", "", "", ""]  # missing values keep their position
    assert json.loads(args[18]) == {"id": 1}
    assert args[19] == "1e3"


def test_empty_and_dot_names(srv):
    body, hdrs = json_body({"": "e", "a": {"": "ae"}, ".": "dot"})
    rec = dumped(srv, "empty-names", query="=q", body=body, headers=hdrs)
    assert rec["args"] == ["q", "e", "dot", "ae", "", ""]


def test_request_method_source_reports_get(srv):
    rec = dumped(srv, "src", method="GET")
    assert rec["args"][6] == "GET"
    assert rec["args"][3] == ""       # no payload at all


def test_top_level_array_is_under_root(srv):
    body, hdrs = json_body([{"x": "r0"}, "second"])
    rec = dumped(srv, "src-root", body=body, headers=hdrs)
    assert rec["args"] == ["r0", "second", ""]


def test_form_payload_first_value_and_dotted_names(srv):
    rec = dumped(srv, "src-form", body=b"a=1&b=x+y%21&a=2&c.d=lit",
                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert rec["args"] == ["1", "x y!", "lit", ""]


def test_xml_payload_mxj_style(srv):
    body = b'<root><a x="1">t</a><b>1</b><b>2</b><c>plain</c></root>'
    rec = dumped(srv, "src-xml", body=body, headers={"Content-Type": "application/xml"})
    assert rec["args"][:4] == ["1", "t", "2", "plain"]
    assert json.loads(rec["args"][4]) == {"root": {"a": {"#text": "t", "-x": "1"},
                                                   "b": ["1", "2"], "c": "plain"}}
    rec = dumped(srv, "src-xml", body=body, headers={"Content-Type": "text/xml; charset=utf-8"})
    assert rec["args"][:4] == ["1", "t", "2", "plain"]


def test_multipart_fields_and_json_file_parts(srv):
    body, hdrs = multipart([
        ("f1", None, None, b"plain field"),
        ("jf", "j.json", "application/json", b'{"k": "from-json-part"}'),
        ("pj", "p.txt", "text/plain", b'{"k": "parsed-as-json"}'),
        ("txt", "t.txt", "text/plain", b'{"k": "ignored"}'),
    ])
    rec = dumped(srv, "src-multipart", body=body, headers=hdrs)
    assert rec["args"] == ["plain field", "from-json-part", "parsed-as-json", ""]


def test_malformed_multipart_is_500(srv):
    status, _, body = call(srv, "POST", "/hooks/src-multipart", body=b"--nope\r\ngarbage",
                           headers={"Content-Type": "multipart/form-data; boundary=XYZ"})
    assert (status, body) == (500, MULTIPART_500)


@pytest.mark.parametrize("query", ["a=%zz", "a=1;b=2", "x=%"])
def test_multipart_with_a_query_go_refuses_is_500(srv, query):
    # Go's ParseMultipartForm also parses the query and returns its error
    body, hdrs = multipart([("a", None, None, b"1")])
    status, _, data = call(srv, "POST", "/hooks/src-multipart?" + query, body, hdrs)
    assert (status, data) == (500, MULTIPART_500)
    status, _, data = call(srv, "POST", "/hooks/src-multipart?a=%41;", *json_body({"a": 1}))
    assert status == 200  # other bodies: the bad pair is only skipped


def test_multipart_without_fields_has_no_payload(srv):
    # only a plain file part (not JSON): no payload at all, entire-payload is null
    body, hdrs = multipart([("x", "f.bin", None, b"filecontent")])
    assert dumped(srv, "pl", body=body, headers=hdrs)["args"][:2] == ["", "null"]
    rec = dumped(srv, "pl", body=b"--B--\r\n",
                 headers={"Content-Type": "multipart/form-data; boundary=B"})
    assert rec["args"][:2] == ["", "null"]


def test_multipart_empty_body_is_500(srv):
    status, _, body = call(srv, "POST", "/hooks/pl", body=b"",
                           headers={"Content-Type": "multipart/form-data; boundary=B"})
    assert (status, body) == (500, MULTIPART_500)


@pytest.mark.parametrize("part", [b"[1, 2]", b"{broken", b'"text"'])
def test_multipart_json_file_part_that_is_not_an_object_is_null(srv, part):
    body, hdrs = multipart([("x", "a.json", "application/json", part)])
    args = dumped(srv, "pl", body=body, headers=hdrs)["args"]
    assert args[0] == "null"       # a nil map, rendered as JSON (not Go's <nil>)
    assert json.loads(args[1]) == {"x": None}


def test_multipart_json_file_part_beats_field_of_the_same_name(srv):
    body, hdrs = multipart([("x", None, None, b"field"),
                            ("x", "a.json", "application/json", b'{"k": "file"}')])
    assert dumped(srv, "pl", body=body, headers=hdrs)["args"][2] == "file"


def test_multipart_json_part_type_compared_exactly(srv):
    # "application/json; charset=utf-8" is not "application/json": the part is skipped
    body, hdrs = multipart([("x", "a.json", "application/json; charset=utf-8", b'{"k": 1}')])
    assert dumped(srv, "pl", body=body, headers=hdrs)["args"][:2] == ["", "null"]


def test_multipart_larger_than_max_multipart_mem(srv):
    # past -max-multipart-mem (1 MiB) Go spills parts to temp files; the result is the same
    big = "x" * (1536 * 1024)
    body, hdrs = multipart([("f1", None, None, b"small"),
                            ("jf", "a.json", "application/json",
                             json.dumps({"k": "large", "pad": big}).encode())])
    rec = dumped(srv, "src-multipart", body=body, headers=hdrs)
    assert rec["args"][:2] == ["small", "large"]


def test_multipart_numbers_kept_as_written(srv):
    body, hdrs = multipart([("x", "a.json", "application/json", b'{"k": 1.50}')])
    assert dumped(srv, "pl", body=body, headers=hdrs)["args"][2] == "1.50"


def test_multipart_with_bare_lf_line_endings(srv):
    body = b'--B\nContent-Disposition: form-data; name="x"\n\nlf\n--B--\n'
    rec = dumped(srv, "pl", body=body, headers={"Content-Type": "multipart/form-data; boundary=B"})
    assert rec["args"][0] == "lf"


def one_part(disposition, data=b"v", ctype=None):
    """A multipart body (boundary B) of one part with this raw Content-Disposition."""
    head = b"--B\r\nContent-Disposition: " + disposition + b"\r\n"
    if ctype:
        head += b"Content-Type: " + ctype + b"\r\n"
    return head + b"\r\n" + data + b"\r\n"


@pytest.mark.parametrize("disposition,payload", [
    (b'form-data; name=a', {"a": "v"}),
    (b'FORM-DATA ; NAME="a";', {"a": "v"}),              # case, spaces, a trailing ;
    (b'form-data; name="a\\"b\\\\c\\d"', {'a"b\\c\\d': "v"}),  # \ escapes only specials
    (b"form-data; name*=UTF-8''%41b", {"Ab": "v"}),        # RFC 2231 encoding
    (b'form-data; name*0="a"; name*1=b', {"ab": "v"}),      # RFC 2231 continuation
    (b"form-data; name*0*=utf-8''%41; name*1*=%42%zz; name*2=c", {"Ac": "v"}),
    (b"form-data; name=\"plain\"; name*=\"utf-8''enc\"", {"enc": "v"}),
    (b'form-data; name="a"; filename=""', {"a": "v"}),     # an empty filename: a field
    # refused by mime.ParseMediaType: the part has no name and is skipped
    (b'form-data; name="a"; name="a"', None),              # duplicate (even equal)
    (b'form-data; name="a"; ;', None),
    (b'form-data; name="a";;', None),
    (b'form-data; name=a b', None),
    (b'form-data; name="a" junk', None),
    (b'form-data; name="unterminated', None),
    (b'form-data; name=\xc3\xa9', None),                  # not a token
    (b'form-data; name=', None),
])
def test_multipart_content_disposition_read_as_go(srv, disposition, payload):
    body = one_part(disposition) + b"--B--\r\n"
    rec = dumped(srv, "pl", body=body, headers={"Content-Type": "multipart/form-data; boundary=B"})
    assert json.loads(rec["args"][1]) == payload


@pytest.mark.parametrize("content_type,status", [
    ("multipart/form-data;boundary=B;", 200),
    ('multipart/form-data; boundary="B"', 200),
    ("MULTIPART/FORM-DATA ; BOUNDARY=B", 200),
    ("multipart/form-data; boundary*=utf-8''B", 200),
    ("multipart/form-data; boundary*0=B", 200),
    ("multipart/form-data; boundary=B; boundary=B", 500),
    ("multipart/form-data; boundary=B x", 500),
    ("multipart/form-data; boundary=B; ;", 500),
    ("multipart/form-data;; boundary=B", 500),
    ("multipart/form-data; charset=x", 500),
])
def test_multipart_content_type_read_as_go(srv, content_type, status):
    body = one_part(b'form-data; name="a"') + b"--B--\r\n"
    assert call(srv, "POST", "/hooks/pl", body, {"Content-Type": content_type})[0] == status


def test_multipart_first_file_part_of_a_name_decides(srv):
    ctype = {"Content-Type": "multipart/form-data; boundary=B"}
    text_then_json = (one_part(b'form-data; name="x"; filename="a"', b"t", b"text/plain") +
                      one_part(b'form-data; name="x"; filename="b"', b'{"k": 1}',
                               b"application/json") + b"--B--\r\n")
    assert dumped(srv, "pl", body=text_then_json, headers=ctype)["args"][1] == "null"
    file_then_field = (one_part(b'form-data; name="x"; filename="a"', b"t", b"text/plain") +
                       one_part(b'form-data; name="x"', b"field") + b"--B--\r\n")
    assert json.loads(dumped(srv, "pl", body=file_then_field, headers=ctype)["args"][1]) == \
        {"x": "field"}


@pytest.mark.parametrize("parts,header_lines,status", [
    (1000, 1, 200), (1001, 1, 500),   # Go 1.19.8: at most 1000 parts (named or not) ...
    (1, 10000, 200), (1, 10001, 500),  # ... and 10,000 header lines in a part
])
def test_multipart_size_limits_as_go(srv, parts, header_lines, status):
    extra = b"X: y\r\n" * (header_lines - 1)
    body = (b"--B\r\n" + extra + b'Content-Disposition: form-data; name="a"\r\n\r\nv\r\n') * parts
    headers = {"Content-Type": "multipart/form-data; boundary=B"}
    assert call(srv, "POST", "/hooks/pl", body + b"--B--\r\n", headers)[0] == status


@pytest.mark.parametrize("xml,expected", [
    # mixed content: the last text run wins
    (b'<r><x a="1">t<y>2</y>u</x></r>', {"r": {"x": {"#text": "u", "-a": "1", "y": "2"}}}),
    # ... but text BEFORE any attribute or child makes the element a plain string (children lost)
    (b"<r>\n  text\n  <a>1</a>\n</r>", {"r": "text"}),
    (b"<r><a>1</a>tail</r>", {"r": {"#text": "tail", "a": "1"}}),
    # namespace prefixes dropped; the xmlns:ns declaration is kept as attribute -ns
    (b'<ns:r xmlns:ns="u"><ns:x>1</ns:x></ns:r>', {"r": {"-ns": "u", "x": "1"}}),
    # only the first root element is read
    (b'<r><x>1</x></r><second/>', {"r": {"x": "1"}}),
    # a declared non-UTF-8 encoding cannot be read: no payload
    (b'<?xml version="1.0" encoding="ISO-8859-1"?><r><x>\xe9</x></r>', None),
    (b'<r><x>1</x><y>2</y><x>3</x></r>', {"r": {"x": ["1", "3"], "y": "2"}}),
    (b"<r><x/><e>  sp  </e></r>", {"r": {"x": "", "e": "sp"}}),   # text trimmed
])
def test_xml_payload_details(srv, xml, expected):
    rec = dumped(srv, "pl", body=xml, headers={"Content-Type": "application/xml"})
    assert json.loads(rec["args"][1]) == expected


@pytest.mark.parametrize("hook_id", ["nul-arg", "nul-env"])
def test_nul_byte_in_argument_or_environment_is_generic_500(srv, hook_id):
    status, _, body = call(srv, "POST", "/hooks/" + hook_id, body=b'{"s": "a\\u0000b"}',
                           headers={"Content-Type": "application/json"})
    assert (status, body) == (500, GENERIC_500)


@pytest.mark.parametrize("body,ctype,expected", [
    (b"x=%zz&e=ok", "application/x-www-form-urlencoded", None),   # one bad pair fails the form
    (b"x=1;e=2", "application/x-www-form-urlencoded", None),
    (b"", "application/x-www-form-urlencoded", {}),
    (b"", "application/json", None),
    (b'{"x": 1} trailing', "application/json", {"x": 1}),           # first JSON value only
    (b'{"x": 1}{"x": 2}', "application/json", {"x": 1}),
    (b'"str"', "application/json", None),                          # not an object
    (b"42", "application/json", None),
    (b'\xef\xbb\xbf{"x": 1}', "application/json", None),            # BOM is a parse error
    (b'{"x": 1}', "APPLICATION/JSON", None),                       # match is case-sensitive
    (b'{"x": 1}', "text/json", {"x": 1}),
    (b"x=1", "application/x-www-form-urlencoded; charset=utf-8", {"x": "1"}),
])
def test_payload_parsing_edges(srv, body, ctype, expected):
    rec = dumped(srv, "pl", body=body, headers={"Content-Type": ctype})
    assert json.loads(rec["args"][1]) == expected


def test_query_pairs_with_semicolon_or_bad_escape_are_dropped(srv):
    rec = dumped(srv, "src-entire", method="GET", query="a=1;b=2&x=3&c=%zz&d")
    assert json.loads(rec["args"][1]) == {"x": "3", "d": ""}


def test_no_content_type_means_no_payload(srv):
    rec = dumped(srv, "src", body=SRC_BODY)
    assert rec["args"][3] == "" and rec["args"][9] == ""


def test_unknown_content_type_means_no_payload(srv):
    rec = dumped(srv, "src", body=SRC_BODY, headers={"Content-Type": "text/plain"})
    assert rec["args"][3] == ""


def test_json_content_type_variants(srv):
    rec = dumped(srv, "src", body=SRC_BODY,
                 headers={"Content-Type": "application/vnd.github+json; charset=utf-8"})
    assert rec["args"][3] == "x"


def test_broken_json_still_runs_with_empty_payload(srv):
    rec = dumped(srv, "src", body=b'{"a": {"b": ', headers={"Content-Type": "application/json"})
    assert rec["args"][3] == "" and rec["args"][6] == "POST"


def test_incoming_payload_content_type_override(srv):
    rec = dumped(srv, "src-override", body=b'{"a": "over"}', headers={"Content-Type": "text/plain"})
    assert rec["args"] == ["over"]
    rec = dumped(srv, "src-override", body=b'{"a": "none"}')
    assert rec["args"] == ["none"]


def test_entire_payload_query_headers_and_raw_body(srv):
    raw = b'{"b": [1, 2.50], "a": {"y": "z"}}'
    rec = dumped(srv, "src-entire", query="b=2&a=1&a=3", body=raw,
                 headers={"Content-Type": "application/json", "x-foo": "bar"})
    payload, query, headers, body = rec["args"]
    assert json.loads(payload) == {"a": {"y": "z"}, "b": [1, 2.5]}
    assert payload == '{"a":{"y":"z"},"b":[1,2.50]}'
    assert json.loads(query) == {"a": "1", "b": "2"}
    hdrs = json.loads(headers)
    assert hdrs["X-Foo"] == "bar"
    assert hdrs["Content-Type"] == "application/json"
    assert hdrs["Content-Length"] == str(len(raw))
    assert "Host" not in hdrs
    assert body == raw.decode()


def test_entire_payload_without_payload_is_null(srv):
    rec = dumped(srv, "src-entire", method="GET")
    assert rec["args"][0] == "null"
    assert json.loads(rec["args"][1]) == {}
    assert rec["args"][3] == ""


def test_bytes_that_are_not_utf8_read_and_written_as_go_does(srv):
    # Go's JSON decoder reads each byte that is not UTF-8, and a \u escape of a lone surrogate,
    # as U+FFFD; its encoder writes each such byte of a query, form or header value as \ufffd
    body = b'{"x": "a\\ud800b\\udc80c\xe6\x97d\xff"}'
    rec = dumped(srv, "pl", body=body, headers={"Content-Type": "application/json"})
    assert rec["args"][:2] == ["a\ufffdb\ufffdc\ufffd\ufffdd\ufffd",
                               '{"x":"a\ufffdb\ufffdc\ufffd\ufffdd\ufffd"}']
    rec = dumped(srv, "src-entire", method="GET", query="b=%E9x&c=%C3%A9")
    assert rec["args"][1] == '{"b":"\\ufffdx","c":"\u00e9"}'


def test_parse_parameters_as_json_leaves_non_objects_as_strings(srv):
    for raw in ("[1,2]", "notjson", '"str"'):
        rec = dumped(srv, "ppj", query=urllib.parse.urlencode({"p": raw}))
        assert rec["args"][0] == "", raw        # p.x does not exist
    rec = dumped(srv, "ppj", query=urllib.parse.urlencode({"p": '{"x": 1.50} trailing'}))
    assert rec["args"][0] == "1.50"             # first JSON value, numbers as written


def test_parse_parameters_as_json_null_is_a_nil_map(srv):
    # Go decodes `null` into a nil map, which it renders as JSON: `null`, never `<nil>`
    rec = dumped(srv, "ppj-null", query="p=null")
    assert (rec["args"], rec["env"]["HOOK_p"]) == (["null", ""], "null")


def test_parse_parameters_as_json(srv):
    query = "p=" + urllib.parse.quote('{"x": "from-url"}')
    body = b"payload=" + urllib.parse.quote('{"repo": {"name": "bb"}}').encode()
    rec = dumped(srv, "ppj", query=query, body=body,
                 headers={"Content-Type": "application/x-www-form-urlencoded",
                          "X-J": '{"y": {"z": "from-header"}}'})
    assert rec["args"] == ["from-url", "from-header", "bb"]


# ----------------------------------------------------------------------------
# §2.1 pass-environment-to-command / pass-file-to-command
# ----------------------------------------------------------------------------

def test_a_temp_file_that_cannot_be_created_is_left_out(srv):
    # Go logs the error, skips that file and its variable, and still runs the command
    rec = dumped(srv, "file-name-too-long")
    assert rec["args"] == ["ran"]
    assert not any(k.startswith("PARITY_L") for k in rec["env"])
    assert rec["env"]["PARITY_KEPT"] == rec["files"]["PARITY_KEPT"]["path"]
    assert rec["files"]["PARITY_KEPT"]["content"] == "kept"


def test_pass_environment_and_files(srv):
    body, hdrs = json_body({"head_commit": {"timestamp": "2024-01-01T00:00:00Z", "id": "c0ffee"},
                            "data": "file text\n",
                            "b64": base64.b64encode(b"\x00\xffbin\n").decode()})
    hdrs["X-Foo"] = "foo-value"
    rec = dumped(srv, "env", query="branch=main", body=body, headers=hdrs)
    env, files = rec["env"], rec["files"]
    assert env["HOOK_branch"] == "main"                           # case kept
    assert env["HOOK_head_commit.timestamp"] == "2024-01-01T00:00:00Z"  # dots kept
    assert env["PARITY_FOO"] == "foo-value"
    assert env["HOOK_x-foo"] == "foo-value"                      # name as written
    assert "HOOK_missing" not in env and "HOOK_NOFILE" not in env
    assert env["PARITY_INHERITED"] == "yes"         # not overridden when the value is missing
    assert set(files) == {"HOOK_DATA", "PARITY_BIN", "HOOK_HEAD_COMMIT.ID"}
    assert files["HOOK_HEAD_COMMIT.ID"]["content"] == "c0ffee"
    assert files["HOOK_DATA"]["content"] == "file text\n"
    assert files["PARITY_BIN"]["content"] == b"\x00\xffbin\n".decode("latin-1")
    for name, f in files.items():
        p = Path(f["path"])
        assert f["mode"] == 0o600, name
        assert p.parent == srv.sandbox.tmp, name          # no working dir: $TMPDIR
        assert p.name.startswith(name) and p.name[len(name):].isdigit()   # name + random digits
    deadline = time.monotonic() + POLL_TIMEOUT
    while any(Path(f["path"]).exists() for f in files.values()):
        assert time.monotonic() < deadline, "pass-file temp files not removed"
        time.sleep(0.02)


def test_large_raw_body_through_pass_file(srv):
    rnd = __import__("random").Random(20240101)
    raw = bytes(rnd.getrandbits(8) for _ in range(2 * 1024 * 1024))
    rec = dumped(srv, "raw-file", body=raw, headers={"Content-Type": "application/octet-stream"})
    f = rec["files"]["PARITY_RAW"]
    assert (f["size"], f["sha256"]) == (len(raw), hashlib.sha256(raw).hexdigest())


@pytest.mark.parametrize("value,content", [
    ("aGVsbG8=", "hello"),
    ("aGVsbG8", "hel"),        # unpadded: Go keeps the bytes decoded before the error
    ("!!notb64", ""),          # undecodable: an empty file, the command still runs
])
def test_pass_file_base64decode(srv, value, content):
    rec = dumped(srv, "file-b64", query=urllib.parse.urlencode({"f": value}))
    assert rec["files"]["HOOK_F"]["content"] == content
    assert rec["env"]["HOOK_f"] == value       # base64decode only applies to files


def test_hook_variable_overrides_inherited_one(srv):
    rec = dumped(srv, "env", query="inh=from-hook")
    assert rec["env"]["PARITY_INHERITED"] == "from-hook"


def test_pass_file_goes_to_working_directory(srv):
    rec = dumped(srv, "env-wd", query="data=hello")
    f = rec["files"]["PARITY_DATA"]
    assert Path(f["path"]).parent == srv.sandbox.workdir
    assert f["content"] == "hello" and f["mode"] == 0o600


# ----------------------------------------------------------------------------
# §2.2 trigger rules
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("hook_id,query,headers,expected", [
    ("r-and", "b=2", {"X-A": "1"}, FIRED),
    ("r-and", "b=3", {"X-A": "1"}, MISSED),
    ("r-and", "b=2", {}, MISSED),                 # missing parameter -> mismatch
    ("r-or", "b=2", {}, FIRED),                   # missing branch skipped
    ("r-or", "", {"X-A": "1"}, FIRED),
    ("r-or", "b=3", {"X-A": "0"}, MISSED),
    ("r-or", "", {}, MISSED),
    ("r-not", "", {"X-A": "1"}, MISSED),
    ("r-not", "", {"X-A": "2"}, FIRED),
    ("r-not", "", {}, FIRED),                     # missing parameter under not -> fires
    ("r-nested", "a=2&c=y", {}, FIRED),
    ("r-nested", "a=1&c=y", {}, FIRED),
    ("r-nested", "a=2&c=x", {}, MISSED),
    ("r-nested", "a=3&c=y", {}, MISSED),
    ("r-nested", "a=2", {}, MISSED),
    ("r-not-in-and", "a=2", {}, MISSED),          # `not` of a missing value inside `and`
    ("r-not-in-and", "a=2&c=y", {}, FIRED),
    ("r-not-in-and", "a=2&c=x", {}, MISSED),
    ("r-not-in-or", "a=2", {}, FIRED),            # ... inside `or`
    ("r-not-in-or", "a=2&c=x", {}, MISSED),
    ("r-not-not", "", {}, MISSED),
    ("r-not-not", "c=x", {}, FIRED),
    ("r-not-and", "a=2", {}, FIRED),
    ("r-not-and", "a=2&c=x", {}, MISSED),
    ("r-or-missing-first", "a=2", {}, FIRED),
    ("r-or-missing-first", "a=1", {}, MISSED),
    ("r-regex", "branch=feature-dev-1", {}, FIRED),   # unanchored search
    ("r-regex", "branch=main", {}, MISSED),
    ("r-regex-anchored", "tag=v12", {}, FIRED),
    ("r-regex-anchored", "tag=xv12", {}, MISSED),
    ("r-regex-bad", "tag=v1", {}, RULE_ERROR),
    ("r-regex-z", "tag=v1", {}, FIRED),
    ("r-regex-z", "tag=v12", {}, MISSED),
    ("r-regex-lookahead", "tag=v1", {}, RULE_ERROR),
    ("r-regex-backref", "tag=vv", {}, RULE_ERROR),
    ("r-regex-flags", "tag=v1", {}, FIRED),
    ("r-regex-fffd", "tag=v%FF%E6", {}, FIRED),      # each byte not UTF-8 read as U+FFFD
    ("r-regex-fffd", "tag=v%FFx", {}, FIRED),
    ("r-regex-fffd", "tag=v%E6%97%A5", {}, MISSED),
    ("r-ip-cidr", "", {}, FIRED),
    ("r-ip-bare", "", {}, FIRED),
    ("r-ip-list", "", {}, FIRED),
    ("r-ip-no", "", {"X-Forwarded-For": "10.1.1.1"}, MISSED),   # TCP peer only
    ("r-ip-bad", "", {}, RULE_ERROR),
    ("r-unknown", "", {}, MISSED),
    ("r-and-empty", "", {}, FIRED),
    ("r-or-empty", "", {}, MISSED),
    ("r-and-and-or", "a=1", {}, FIRED),          # `and` wins over a sibling `or` key
    ("r-and-and-or", "a=2", {}, MISSED),
    ("r-no-type", "a=1", {}, MISSED),
    ("r-bad-source", "a=1", {}, RULE_ERROR),
    ("r-ip-hostbits", "", {}, FIRED),
    ("r-ip-bad-prefix", "", {}, RULE_ERROR),
    ("r-header-canon", "", {"X-LOWER-CASE": "v"}, FIRED),
    ("r-ppj", "p=" + urllib.parse.quote('{"x": "1"}'), {}, FIRED),
    ("r-ppj", "p=" + urllib.parse.quote('{"x": "2"}'), {}, MISSED),
])
def test_rules(srv, hook_id, query, headers, expected):
    assert fire(srv, hook_id, query, headers=headers) == expected


@pytest.mark.parametrize("hook_id,query,body,expected", [
    ("r-value-object", "", b'{"o": {"b": [1, 2], "a": 1}}', FIRED),   # compact JSON, sorted keys
    ("r-value-object", "", b'{"o": {"a": 1}}', MISSED),
    ("r-value-absent", "e=", b"{}", FIRED),
    ("r-value-absent", "e=x", b"{}", MISSED),
    ("r-regex-number", "", b'{"n": 1.50}', FIRED),
    ("r-regex-absent", "e=anything", b"{}", FIRED),
    ("r-method", "", b"{}", FIRED),
    ("r-remote-addr", "", b"{}", FIRED),
    ("r-hmac-from-url", "sig=" + hmac.new(b"k", b'{"n": 1}', hashlib.sha256).hexdigest(),
     b'{"n": 1}', FIRED),
    ("r-hmac-from-url", "sig=00", b'{"n": 1}', RULE_ERROR),
    ("r-ip-ignores-parameter", "ip=10.1.1.1", b"{}", MISSED),   # the TCP peer counts
    ("r-match-empty", "", b"{}", RULE_ERROR),
    ("r-entire-payload", "", b'{"n": 1.50}', FIRED),
    ("r-raw-body", "", b'{"n":1.50}', FIRED),
    ("r-raw-body", "", b'{"n": 1.50}', MISSED),
    ("r-string", "", b"", FIRED),
])
def test_rule_parameter_sources(srv, hook_id, query, body, expected):
    assert fire(srv, hook_id, query, body=body,
                headers={"Content-Type": "application/json"}) == expected


def test_value_rule_compares_json_text_of_numbers_and_bools(srv):
    assert fire(srv, "r-num", body=b'{"n": 1, "t": true, "f": 1.50}',
                headers={"Content-Type": "application/json"}) == FIRED
    assert fire(srv, "r-num", body=b'{"n": 1.0, "t": true, "f": 1.50}',
                headers={"Content-Type": "application/json"}) == MISSED
    assert fire(srv, "r-num", body=b'{"n": 1, "t": true, "f": 1.5}',
                headers={"Content-Type": "application/json"}) == MISSED


def test_mismatch_code_and_headers(srv):
    status, hdrs, body = call(srv, "POST", "/hooks/r-code?b=3")
    assert (status, body) == (400, MISMATCH)
    assert "x-hook" not in hdrs            # hook response-headers only when triggered
    assert hdrs["x-global"] == "g1=x"      # -header values yes
    status, hdrs, body = call(srv, "POST", "/hooks/r-code?b=2")
    assert (status, body) == FIRED and hdrs["x-hook"] == "h-rule"
    assert fire(srv, "r-code999", "b=3") == MISSED


@pytest.mark.parametrize("kind", ["sha1", "sha256", "sha512"])
def test_hmac_signatures(srv, kind):
    hook_id = "r-" + kind
    good = sign(kind, HMAC_BODY)
    ctype = {"Content-Type": "application/json"}

    def with_sig(sig):
        return fire(srv, hook_id, body=HMAC_BODY, headers=dict(ctype, **{"X-Sig": sig}))

    assert with_sig(kind + "=" + good) == FIRED
    assert with_sig(good) == FIRED                                  # prefix optional
    assert with_sig(f"{kind}=deadbeef,{kind}={good}") == FIRED      # comma list
    assert with_sig(kind + "=" + "0" * len(good)) == RULE_ERROR     # wrong -> 500
    assert with_sig(kind + "=" + good.upper()) == RULE_ERROR        # upper-case hex fails
    assert with_sig(f"{kind}=deadbeef,{good}") == RULE_ERROR        # unprefixed entry in a list
    assert fire(srv, hook_id, body=HMAC_BODY, headers=ctype) == MISSED   # missing header
    # the signature covers the raw body, not a re-serialisation of it
    assert fire(srv, hook_id, body=HMAC_BODY + b" ",
                headers=dict(ctype, **{"X-Sig": good})) == RULE_ERROR


def test_deprecated_hash_alias_and_empty_secret(srv):
    good = sign("sha256", HMAC_BODY)
    assert fire(srv, "r-hash-sha256", body=HMAC_BODY, headers={"X-Sig": "sha256=" + good}) == FIRED
    assert fire(srv, "r-sha256-nosecret", body=HMAC_BODY,
                headers={"X-Sig": "sha256=" + sign("sha256", HMAC_BODY, "")}) == RULE_ERROR


def test_signature_soft_failures(srv):
    bad = {"X-Sig": "sha256=" + "0" * 64}
    assert fire(srv, "r-soft-off", "b=2", body=HMAC_BODY, headers=bad) == RULE_ERROR
    assert fire(srv, "r-soft-on", "b=2", body=HMAC_BODY, headers=bad) == FIRED
    assert fire(srv, "r-soft-on", "b=3", body=HMAC_BODY, headers=bad) == MISSED


def test_scalr_signature(srv):
    body = b'{"event": "x"}'
    assert fire(srv, "r-scalr", body=body, headers=scalr_headers(body, time.time())) == FIRED
    assert fire(srv, "r-scalr", body=body,
                headers=scalr_headers(body, time.time() - 3600)) == RULE_ERROR   # stale date
    bad = dict(scalr_headers(body, time.time()), **{"X-Signature": "0" * 40})
    assert fire(srv, "r-scalr", body=body, headers=bad) == RULE_ERROR
    assert fire(srv, "r-scalr", body=body) == MISSED                    # headers missing
