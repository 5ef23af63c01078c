#!/usr/bin/env python3
"""webhookd.py -- a drop-in replacement for adnanh/webhook 2.8.0, in one file.

It serves the hooks of a webhook hooks file (a JSON array of hook objects) over HTTP:
``GET/POST /hooks/<id>`` finds the hook, parses the payload, checks the trigger rules, builds the
command's argv and environment from the request, runs the command (never through a shell) and
answers with the same status codes and bodies as the Go original.  The command line is the
original's (Go ``flag`` syntax), so an existing unit or script keeps working::

    python3 webhookd.py -nopanic -hooks /etc/webhook.conf -hotreload -verbose -port 9000

On top of upstream (each a flag or hook field the Go binary ignores, so hooks files stay portable):
polling hot reload that survives editors and ``git pull``, ``SIGHUP``/``SIGUSR1`` reload,
``-validate``, warnings for unknown hook fields, the hook fields ``max-concurrency``,
``command-timeout`` and ``stream-command-output``, a graceful stop on ``SIGTERM``, systemd
``sd_notify``/socket activation, ``-socket``, ``-template`` with ``getenv``/``cat``/``credential``,
request limits (``-max-body-bytes``, ``-read-header-timeout``, ``-max-connections``,
``-max-workers``, ``-max-async-runs``) and a JSON ``-status-path``.

Python 3.9+ standard library only.  Request pipeline::

    request -> find hook -> parse payload -> check rules -> build argv/env -> run -> respond
"""

import errno
import functools
import heapq
import itertools
import json
import logging
import os
import queue
import re
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections import deque

__version__ = "3.0.0"  # webhookd's own version (packaging reads this line)
VERSION = "2.8.0"  # the adnanh/webhook release whose behaviour webhookd reproduces
PROGRAM = "webhook"

# ---------------------------------------------------------------------------
# Upstream messages and Go compatibility tables
# ---------------------------------------------------------------------------

MSG_HOOK_NOT_FOUND = b"Hook not found."
MSG_RULES_NOT_SATISFIED = b"Hook rules were not satisfied."
MSG_RULES_ERROR = b"Error occurred while evaluating hook rules."
MSG_COMMAND_ERROR = (b"Error occurred while executing the hook's command. "
                     b"Please check your logs for more details.")
MSG_MULTIPART_ERROR = b"Error occurred while parsing multipart form."
MSG_TIMED_OUT = b"Hook command timed out."
MSG_PAGE_NOT_FOUND = b"404 page not found\n"
MSG_BODY_TOO_LARGE = b"Request body too large."
MSG_BACKLOG_FULL = b"Too many hook runs waiting; try again later."
TEXT_PLAIN = "text/plain; charset=utf-8"

# Go's net/http StatusText: a configured code outside this table is answered with 200, as upstream.
GO_STATUS_TEXT = {
    100: "Continue", 101: "Switching Protocols", 102: "Processing", 103: "Early Hints",
    200: "OK", 201: "Created", 202: "Accepted", 203: "Non-Authoritative Information",
    204: "No Content", 205: "Reset Content", 206: "Partial Content", 207: "Multi-Status",
    208: "Already Reported", 226: "IM Used",
    300: "Multiple Choices", 301: "Moved Permanently", 302: "Found", 303: "See Other",
    304: "Not Modified", 305: "Use Proxy", 307: "Temporary Redirect", 308: "Permanent Redirect",
    400: "Bad Request", 401: "Unauthorized", 402: "Payment Required", 403: "Forbidden",
    404: "Not Found", 405: "Method Not Allowed", 406: "Not Acceptable",
    407: "Proxy Authentication Required", 408: "Request Timeout", 409: "Conflict", 410: "Gone",
    411: "Length Required", 412: "Precondition Failed", 413: "Request Entity Too Large",
    414: "Request URI Too Long", 415: "Unsupported Media Type",
    416: "Requested Range Not Satisfiable", 417: "Expectation Failed", 418: "I'm a teapot",
    421: "Misdirected Request", 422: "Unprocessable Entity", 423: "Locked",
    424: "Failed Dependency", 425: "Too Early", 426: "Upgrade Required",
    428: "Precondition Required", 429: "Too Many Requests",
    431: "Request Header Fields Too Large", 451: "Unavailable For Legal Reasons",
    500: "Internal Server Error", 501: "Not Implemented", 502: "Bad Gateway",
    503: "Service Unavailable", 504: "Gateway Timeout", 505: "HTTP Version Not Supported",
    506: "Variant Also Negotiates", 507: "Insufficient Storage", 508: "Loop Detected",
    510: "Not Extended", 511: "Network Authentication Required",
}

# Go's crypto/tls names (as -list-cipher-suites prints them) mapped to OpenSSL names.  TLS 1.3
# suites are always on in OpenSSL, as in Go, so they map to None.
GO_CIPHER_SUITES = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_AES_128_GCM_SHA256": None,
    "TLS_AES_256_GCM_SHA384": None,
    "TLS_CHACHA20_POLY1305_SHA256": None,
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
}

log = logging.getLogger("webhookd")


# ---------------------------------------------------------------------------
# Configuration: command-line flags with Go `flag` semantics
# ---------------------------------------------------------------------------

class Flag:
    """One command-line flag: name, kind ("bool", "int", "string", "list"), default, help."""

    def __init__(self, name, kind, default, help):
        self.name, self.kind, self.default, self.help = name, kind, default, help

    @property
    def attr(self):
        return self.name.replace("-", "_")


FLAGS = [
    Flag("cert", "string", "cert.pem", "path to the HTTPS certificate pem file"),
    Flag("cipher-suites", "string", "", "comma-separated list of supported TLS cipher suites"),
    Flag("debug", "bool", False, "show debug output"),
    Flag("header", "list", None, "response header to return, specified in format name=value, "
         "use multiple times to set multiple headers"),
    Flag("hooks", "list", None, "path to the json file containing defined hooks the webhook "
         "should serve, use multiple times to load from different files"),
    Flag("hotreload", "bool", False, "watch hooks file for changes and reload them automatically"),
    Flag("http-methods", "string", "", 'set default allowed HTTP methods (ie. "POST"); separate '
         "methods with comma"),
    Flag("ip", "string", "0.0.0.0", "ip the webhook should serve hooks on"),
    Flag("key", "string", "key.pem", "path to the HTTPS certificate private key pem file"),
    Flag("list-cipher-suites", "bool", False, "list available TLS cipher suites"),
    Flag("logfile", "string", "", "send log output to a file; implicitly enables verbose logging"),
    Flag("max-async-runs", "int", 64, "webhookd: commands of default (not captured) hooks "
         "running at once; further triggers wait in order"),
    Flag("max-body-bytes", "int", 25 * 1024 * 1024, "webhookd: largest request body accepted; "
         "larger ones get 413 (0: no limit)"),
    Flag("max-connections", "int", 1024, "webhookd: open client connections at most; further "
         "connections wait in the listen backlog"),
    Flag("max-multipart-mem", "int", 1048576, "maximum memory in bytes for parsing multipart form "
         "data before disk caching"),
    Flag("max-workers", "int", 64, "webhookd: threads handling requests at most (a command "
         "holds one while it runs if its output streams or its request came over TLS or with a "
         "chunked, large or 100-continue body)"),
    Flag("nopanic", "bool", False, "do not panic if hooks cannot be loaded when webhook is not "
         "running in verbose mode"),
    Flag("pidfile", "string", "", "create PID file at the given path"),
    Flag("port", "int", 9000, "port the webhook should serve hooks on"),
    Flag("read-header-timeout", "int", 10, "webhookd: seconds a client may take to send the "
         "request line and headers (also the body's per-read inactivity limit; 0: no limit)"),
    Flag("secure", "bool", False, "use HTTPS instead of HTTP"),
    Flag("setgid", "int", 0, "set group ID after opening listening port; must be used with setuid"),
    Flag("setuid", "int", 0, "set user ID after opening listening port; must be used with setgid"),
    Flag("shutdown-timeout", "int", 60, "webhookd: on SIGTERM/SIGINT, seconds to wait for "
         "running commands before exiting"),
    Flag("socket", "string", "", "webhookd: serve on this Unix socket instead of -ip/-port"),
    Flag("status-path", "string", "", "webhookd: serve a JSON status page at this path (outside "
         "the hooks prefix); off when empty"),
    Flag("template", "bool", False, "parse hooks file as a Go template"),
    Flag("tls-min-version", "string", "1.2", "minimum TLS version (1.0, 1.1, 1.2, 1.3)"),
    Flag("urlprefix", "string", "hooks", "url prefix to use for served hooks "
         "(protocol://yourserver:port/PREFIX/:hook-id)"),
    Flag("validate", "bool", False, "webhookd: check the hooks files (fields, types, regexes, ip "
         "ranges, commands, directories, duplicate ids), list every problem, exit 0 or 1"),
    Flag("verbose", "bool", False, "show verbose output"),
    Flag("version", "bool", False, "display webhook version and quit"),
    Flag("x-request-id", "bool", False, "use X-Request-Id header, if present, as request ID"),
    Flag("x-request-id-limit", "int", 0, "truncate X-Request-Id header to limit; default no limit"),
]
FLAGS_BY_NAME = {f.name: f for f in FLAGS}


class UsageError(Exception):
    """A command-line problem: the message is printed before the usage text, exit status 2."""


class HelpRequested(Exception):
    """-h or -help: usage on stderr, exit status 0."""


class Options:
    """Parsed command-line values, one attribute per flag (dashes become underscores)."""

    def __init__(self):
        for flag in FLAGS:
            setattr(self, flag.attr, [] if flag.kind == "list" else flag.default)


def parse_go_bool(text):
    """strconv.ParseBool."""
    if text in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if text in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    raise ValueError("parse error")


def parse_go_int(text):
    """strconv.ParseInt(text, 0, 64): decimal, 0x/0o/0b prefixes, leading 0 for octal, `_`."""
    body = text.lstrip("+-")
    if not body or body.startswith("_") or body.endswith("_") or "__" in body:
        raise ValueError("parse error")
    lowered = body.lower()
    if lowered.startswith(("0x", "0o", "0b")):
        base = 0
    elif len(body) > 1 and body.startswith("0"):
        text = text.replace(body, "0o" + body[1:], 1)
        base = 0
    else:
        base = 10
    try:
        value = int(text, base)
    except ValueError:
        raise ValueError("parse error") from None
    if not -(1 << 63) <= value < (1 << 63):
        raise ValueError("value out of range")
    return value


def parse_header_flag(text):
    name, sep, value = text.partition("=")
    if not sep:
        raise ValueError("header flag must be in name=value format")
    return (name, value)


def parse_flags(argv):
    """Parse argv (without the program name) the way Go's flag package does.

    Flags are `-f` or `--f`, values `-f v` or `-f=v`, booleans only `-f` / `-f=false`; parsing
    stops at the first non-flag argument or at `--` (the rest is ignored, as upstream).
    """
    opts = Options()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if len(arg) < 2 or arg[0] != "-":
            break
        dashes = 2 if arg[1] == "-" else 1
        if dashes == 2 and len(arg) == 2:
            break
        name = arg[dashes:]
        if not name or name[0] in "-=":
            raise UsageError("bad flag syntax: %s" % arg)
        i += 1
        value, has_value = None, False
        if "=" in name[1:]:
            eq = name.index("=", 1)
            name, value, has_value = name[:eq], name[eq + 1:], True
        flag = FLAGS_BY_NAME.get(name)
        if flag is None:
            if name in ("h", "help"):
                raise HelpRequested()
            raise UsageError("flag provided but not defined: -%s" % name)
        if flag.kind == "bool":
            if has_value:
                try:
                    setattr(opts, flag.attr, parse_go_bool(value))
                except ValueError:
                    raise UsageError('invalid boolean value "%s" for -%s: parse error'
                                     % (value, name)) from None
            else:
                setattr(opts, flag.attr, True)
            continue
        if not has_value:
            if i >= len(argv):
                raise UsageError("flag needs an argument: -%s" % name)
            value = argv[i]
            i += 1
        try:
            if flag.kind == "int":
                setattr(opts, flag.attr, parse_go_int(value))
            elif flag.kind == "list":
                item = parse_header_flag(value) if name == "header" else value
                getattr(opts, flag.attr).append(item)
            else:
                setattr(opts, flag.attr, value)
        except ValueError as exc:
            raise UsageError('invalid value "%s" for flag -%s: %s' % (value, name, exc)) from None
    if not opts.hooks:
        opts.hooks = ["hooks.json"]
    return opts


def usage_text(program):
    """The flag list in the format of Go's flag.PrintDefaults."""
    lines = ["Usage of %s:" % program]
    for flag in sorted(FLAGS, key=lambda f: f.name):
        value_name = {"bool": "", "int": " int", "string": " string", "list": " value"}[flag.kind]
        lines.append("  -%s%s" % (flag.name, value_name))
        text = "    \t" + flag.help
        if flag.kind == "string" and flag.default:
            text += ' (default "%s")' % flag.default
        elif flag.kind == "int" and flag.default:
            text += " (default %d)" % flag.default
        lines.append(text)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# Hooks files: template expansion (pure)
# ---------------------------------------------------------------------------

class HooksFileError(Exception):
    """A hooks file that cannot be used; the message names file, line and column if known."""


TEMPLATE_ACTION = re.compile(r"\{\{(-?)(.*?)(-?)\}\}", re.S)
TEMPLATE_CALL = re.compile(
    r'^\s*(getenv|cat|credential)\s+("(?:[^"\\]|\\.)*"|`[^`]*`)\s*(\|\s*js\s*)?$', re.S)


def line_col(text, offset):
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


def js_escape(text):
    """Go's template `js` escaping, except `'` becomes \\u0027 so the result is also valid JSON."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch in "'<>&=" or code < 0x20:
            out.append("\\u%04X" % code)
        elif code >= 0x7F and not ch.isprintable():
            out.append("\\u%04X" % code)
        else:
            out.append(ch)
    return "".join(out)


def template_function(name, arg, environ):
    if name == "getenv":
        return environ.get(arg, "")
    if name == "cat":
        path = arg
    else:
        directory = environ.get("CREDENTIALS_DIRECTORY")
        if not directory:
            raise ValueError("credential %r: $CREDENTIALS_DIRECTORY is not set" % arg)
        if "/" in arg or arg in ("", ".", ".."):
            raise ValueError("credential %r: not a plain credential name" % arg)
        path = os.path.join(directory, arg)
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as handle:
            return handle.read()
    except OSError as exc:
        raise ValueError("%s %r: %s" % (name, arg, exc.strerror)) from None


def expand_template(text, filename, environ=None):
    """Expand `{{ getenv "X" }}`, `{{ cat "PATH" }}`, `{{ credential "NAME" }}` (each optionally
    `| js`, and with Go's `{{-`/`-}}` whitespace trimming); any other action is an error."""
    environ = os.environ if environ is None else environ
    out, pos = [], 0
    for match in TEMPLATE_ACTION.finditer(text):
        before = text[pos:match.start()]
        if match.group(1):
            before = before.rstrip(" \t\r\n")
        out.append(before)
        call = TEMPLATE_CALL.match(match.group(2))
        line, col = line_col(text, match.start())
        if call is None:
            raise HooksFileError("%s:%d:%d: unsupported template action %s (only getenv, cat "
                                 "and credential with an optional | js)"
                                 % (filename, line, col, match.group(0)))
        quoted = call.group(2)
        arg = quoted[1:-1] if quoted[0] == "`" else json.loads(quoted)
        try:
            value = template_function(call.group(1), arg, environ)
        except ValueError as exc:
            raise HooksFileError("%s:%d:%d: template: %s" % (filename, line, col, exc)) from None
        out.append(js_escape(value) if call.group(3) else value)
        pos = match.end()
        if match.group(3):
            while pos < len(text) and text[pos] in " \t\r\n":
                pos += 1
    rest = text[pos:]
    if "{{" in rest:
        line, col = line_col(text, pos + rest.index("{{"))
        raise HooksFileError("%s:%d:%d: unclosed template action" % (filename, line, col))
    out.append(rest)
    return "".join(out)


# ---------------------------------------------------------------------------
# Hook model, loading and validation (pure)
# ---------------------------------------------------------------------------

ARGUMENT_FIELDS = ("source", "name", "envname", "base64decode")
MATCH_FIELDS = ("type", "value", "regex", "secret", "ip-range", "parameter")
RULE_FIELDS = ("and", "or", "not", "match")
SOURCES = ("header", "url", "query", "payload", "string", "raw-request-body", "request",
           "entire-payload", "entire-query", "entire-headers")
MATCH_TYPES = ("value", "regex", "payload-hmac-sha1", "payload-hmac-sha256", "payload-hmac-sha512",
               "payload-hash-sha1", "payload-hash-sha256", "payload-hash-sha512", "ip-whitelist",
               "scalr-signature")
HMAC_TYPES = {"payload-hmac-sha1": ("sha1", "sha1="), "payload-hash-sha1": ("sha1", "sha1="),
              "payload-hmac-sha256": ("sha256", "sha256="),
              "payload-hash-sha256": ("sha256", "sha256="),
              "payload-hmac-sha512": ("sha512", "sha512="),
              "payload-hash-sha512": ("sha512", "sha512=")}

# hook field -> (attribute, kind); the last three are ours and ignored by upstream.
HOOK_FIELDS = {
    "id": ("id", "str"),
    "execute-command": ("execute_command", "str"),
    "command-working-directory": ("working_directory", "str"),
    "response-message": ("response_message", "str"),
    "response-headers": ("response_headers", "headers"),
    "include-command-output-in-response": ("capture_output", "bool"),
    "include-command-output-in-response-on-error": ("capture_output_on_error", "bool"),
    "pass-environment-to-command": ("pass_environment", "args"),
    "pass-arguments-to-command": ("pass_arguments", "args"),
    "pass-file-to-command": ("pass_files", "args"),
    "parse-parameters-as-json": ("json_parameters", "args"),
    "trigger-rule": ("trigger_rule", "rule"),
    "trigger-rule-mismatch-http-response-code": ("mismatch_status", "int"),
    "trigger-signature-soft-failures": ("signature_soft_failures", "bool"),
    "incoming-payload-content-type": ("incoming_content_type", "str"),
    "success-http-response-code": ("success_status", "int"),
    "http-methods": ("http_methods", "strlist"),
    "max-concurrency": ("max_concurrency", "posint"),
    "command-timeout": ("command_timeout", "posnumber"),
    "stream-command-output": ("stream_output", "bool"),
}
EMPTY = {"str": "", "bool": False, "int": 0, "posint": 0, "posnumber": None, "args": (),
         "headers": (), "strlist": (), "rule": None}


class Problems:
    """Warnings and errors found while loading a hooks file, each with where it was found."""

    def __init__(self, filename):
        self.filename = filename
        self.items = []  # (severity, message)

    def warn(self, where, message):
        self.items.append(("warning", "%s: %s: %s" % (self.filename, where, message)))

    def error(self, where, message):
        self.items.append(("error", "%s: %s: %s" % (self.filename, where, message)))


def did_you_mean(name, known):
    import difflib  # only needed when a typo is found
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return " (did you mean %r?)" % close[0] if close else ""


def expect(value, container, where):
    """value if it is a dict (JSON object) or list (JSON array) as asked, else HooksFileError."""
    if not isinstance(value, container):
        raise HooksFileError("%s: expected an %s, got %s" % (
            where, "object" if container is dict else "array", type_name(value)))
    return value


def fold_keys(obj, known, where, problems):
    """The fields of a JSON object by lower-case name (Go's encoding/json matches names
    case-insensitively); unknown names are warned, anything but an object is an error."""
    expect(obj, dict, where)
    folded = {}
    for key, value in obj.items():
        lowered = key.lower()
        if lowered in known:
            folded[lowered] = value
        else:
            problems.warn(where, "unknown field %r%s" % (key, did_you_mean(key, known)))
    return folded


def type_name(value):
    return {dict: "object", list: "array", str: "string", bool: "boolean",
            type(None): "null"}.get(type(value), "number")


def as_string(value, where):
    """Strings as is; numbers and booleans as their JSON text (upstream's YAML parser does so)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    raise HooksFileError("%s: expected a string, got %s" % (where, type_name(value)))


class Argument:
    """Where a value comes from: `source` + `name` (+ `envname`, `base64decode`)."""

    __slots__ = ("source", "name", "envname", "base64decode")

    def __init__(self, source, name, envname="", base64decode=False):
        self.source, self.name = source, name
        self.envname, self.base64decode = envname, base64decode

    def __repr__(self):
        return "{Source:%s Name:%s EnvName:%s Base64Decode:%s}" % (
            self.source, self.name, self.envname, "true" if self.base64decode else "false")


class MatchRule:
    """A `match` rule; `regex` is compiled at load (a bad pattern is an error at evaluation)."""

    __slots__ = ("type", "value", "regex", "secret", "ip_range", "parameter", "compiled",
                 "regex_error")

    def __init__(self, type, value="", regex="", secret="", ip_range="", parameter=None):
        self.type, self.value, self.regex, self.secret = type, value, regex, secret
        self.ip_range, self.parameter = ip_range, parameter or Argument("", "")
        self.compiled, self.regex_error = None, None
        if type == "regex":
            try:
                self.compiled = compile_re2(regex)
            except re.error as exc:
                self.regex_error = "error parsing regexp: %s: `%s`" % (exc, regex)


RE2_UNSUPPORTED = ("(?=", "(?!", "(?<=", "(?<!", "(?>", "(?P=", "(?#", "(?(")


def compile_re2(pattern):
    """Compile a Go (RE2) pattern with Python's re: RE2's `\\z` becomes `\\Z`, `$` without the
    m flag means end of text, \\d \\w \\s \\b are ASCII, and Perl-only syntax RE2 rejects
    (look-around, back-references, atomic groups, `\\Z`) is an error as in Go."""
    out, i, in_class = [], 0, False
    multiline = re.search(r"\(\?[a-zA-Z]*m", pattern) is not None
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            escaped = pattern[i + 1:i + 2]
            if not in_class and escaped in ("1", "2", "3", "4", "5", "6", "7", "8", "9", "Z"):
                raise re.error("invalid escape sequence: \\%s" % escaped)
            out.append("\\Z" if escaped == "z" and not in_class else pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
            out.append(ch)
            i += 1
            for prefix in ("^]", "]", "^"):
                if pattern.startswith(prefix, i):
                    out.append(prefix)
                    i += len(prefix)
                    break
            continue
        elif ch == "(" and pattern.startswith(RE2_UNSUPPORTED, i):
            raise re.error("invalid or unsupported Perl syntax: `%s`" % pattern[i:i + 3])
        elif ch == "$" and not multiline:
            ch = "\\Z"
        out.append(ch)
        i += 1
    return re.compile("".join(out), re.ASCII)


def parse_argument(obj, where, problems):
    obj = fold_keys(obj, ARGUMENT_FIELDS, where, problems)
    base64decode = obj.get("base64decode") or False
    if not isinstance(base64decode, bool):
        raise HooksFileError("%s.base64decode: expected a boolean" % where)
    arg = Argument(as_string(obj.get("source") or "", where + ".source"),
                   as_string(obj.get("name") or "", where + ".name"),
                   as_string(obj.get("envname") or "", where + ".envname"), base64decode)
    if arg.source not in SOURCES:
        problems.error(where, "unknown source %r%s"
                       % (arg.source, did_you_mean(arg.source, SOURCES)))
    return arg


def parse_arguments(value, where, problems):
    return tuple(parse_argument(item, "%s[%d]" % (where, i), problems)
                 for i, item in enumerate(expect(value, list, where)))


def parse_rule(obj, where, problems):
    """A rule tree as tuples: ("and", [rules]), ("or", [rules]), ("not", rule),
    ("match", MatchRule) or ("none",) for an object without a known key (always false)."""
    obj = fold_keys(obj, RULE_FIELDS, where, problems)
    for key in ("and", "or"):
        if obj.get(key) is not None:
            items = expect(obj[key], list, "%s.%s" % (where, key))
            return (key, [parse_rule(r, "%s.%s[%d]" % (where, key, i), problems)
                          for i, r in enumerate(items)])
    if obj.get("not") is not None:
        return ("not", parse_rule(obj["not"], where + ".not", problems))
    if obj.get("match") is not None:
        return ("match", parse_match(obj["match"], where + ".match", problems))
    problems.warn(where, "rule without and/or/not/match is never satisfied")
    return ("none",)


def parse_match(obj, where, problems):
    obj = fold_keys(obj, MATCH_FIELDS, where, problems)
    fields = {key: as_string(obj.get(key) or "", "%s.%s" % (where, key))
              for key in ("type", "value", "regex", "secret", "ip-range")}
    parameter = obj.get("parameter")
    parameter = (parse_argument(parameter, where + ".parameter", problems)
                 if parameter is not None else None)
    rule = MatchRule(fields["type"], fields["value"], fields["regex"], fields["secret"],
                     fields["ip-range"], parameter)
    kind = rule.type
    if kind not in MATCH_TYPES:
        problems.error(where, "unknown match type %r%s" % (kind, did_you_mean(kind, MATCH_TYPES)))
    if rule.regex_error:
        problems.error(where, rule.regex_error)
    if kind.startswith("payload-hash-"):
        problems.warn(where, "deprecated type %r, use %r" % (kind, kind.replace("hash", "hmac")))
    if (kind in HMAC_TYPES or kind == "scalr-signature") and not rule.secret:
        problems.error(where, "empty secret (every request would get 500)")
    for field in ("secret", "value"):
        if looks_like_placeholder(obj.get(field)):
            problems.warn(where, "the %s looks like an example placeholder: set a real one" % field)
    if kind == "ip-whitelist":
        for cidr in rule.ip_range.split():
            if parse_cidr(cidr) is None:
                problems.error(where, "invalid ip range %r" % cidr)
    if kind not in ("ip-whitelist", "scalr-signature") and parameter is None:
        problems.error(where, "match without a parameter")
    return rule


# Secrets that an example or a tutorial ships and nobody should serve with (the value is
# never printed: a real secret that happens to match must not end up in a log).
PLACEHOLDER_SECRET = re.compile(
    r"(replace|change)[-_ ]?(me|this|with)|your[-_ ]?(secret|token|key|password)"
    r"|^(my[-_ ]?)?(secret|token|password|example|todo)$|^x{3,}$|^<.*>$", re.IGNORECASE)


def looks_like_placeholder(text):
    return isinstance(text, str) and PLACEHOLDER_SECRET.search(text) is not None


def parse_field(kind, value, where, problems):
    if kind == "str":
        return as_string(value, where)
    if kind == "bool":
        if not isinstance(value, bool):
            raise HooksFileError("%s: expected a boolean, got %s" % (where, type_name(value)))
        return value
    if kind in ("int", "posint"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise HooksFileError("%s: expected an integer, got %s" % (where, type_name(value)))
        if kind == "posint" and value < 1:
            raise HooksFileError("%s: must be at least 1" % where)
        return value
    if kind == "posnumber":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise HooksFileError("%s: expected a number of seconds above 0" % where)
        return float(value)
    if kind == "args":
        return parse_arguments(value, where, problems)
    if kind == "rule":
        return parse_rule(value, where, problems)
    expect(value, list, where)
    if kind == "strlist":
        return tuple(as_string(v, "%s[%d]" % (where, i)) for i, v in enumerate(value))
    headers = []
    for i, item in enumerate(value):
        here = "%s[%d]" % (where, i)
        item = fold_keys(item, ("name", "value"), here, problems)
        headers.append((as_string(item.get("name") or "", here + ".name"),
                        as_string(item.get("value") or "", here + ".value")))
    return tuple(headers)


class Hook:
    """One hook definition.  Attributes are named after the fields (see HOOK_FIELDS)."""

    def __init__(self, obj, where, problems):
        obj = fold_keys(obj, HOOK_FIELDS, where, problems)
        for field, (attr, kind) in HOOK_FIELDS.items():
            value = obj.get(field)
            setattr(self, attr, EMPTY[kind] if value is None
                    else parse_field(kind, value, "%s.%s" % (where, field), problems))
        self.allowed_methods = tuple(m.strip().upper() for m in self.http_methods)
        self.secret_headers, self.secret_params = rule_parameters(self.trigger_rule)
        if not self.execute_command:
            problems.warn(where, "no execute-command")


SENSITIVE_HEADERS = frozenset(("Authorization", "Cookie", "X-Hub-Signature", "X-Hub-Signature-256",
                               "X-Signature", "X-Gitlab-Token", "X-Gitea-Signature"))


def rule_parameters(rule):
    """Header names and query names a trigger rule compares: they are kept out of the logs."""
    headers, params, pending = set(SENSITIVE_HEADERS), set(), [rule]
    while pending:
        node = pending.pop()
        if node is None or node[0] == "none":
            continue
        if node[0] == "match":
            arg = node[1].parameter
            if arg.source == "header":
                headers.add(canonical_header(arg.name))
            elif arg.source in ("url", "query"):
                params.add(arg.name)
        elif node[0] == "not":
            pending.append(node[1])
        else:
            pending.extend(node[1])
    return frozenset(headers), frozenset(params)


def redact_target(target, names):
    """The request target for the log, with the values of the named query parameters hidden."""
    path, sep, query = target.partition("?")
    if not names or not sep:
        return target
    pairs = []
    for pair in query.split("&"):
        key = pair.partition("=")[0]
        pairs.append(key + "=<redacted>" if go_unescape(key, True) in names else pair)
    return path + "?" + "&".join(pairs)


def describe(index, obj):
    hook_id = obj.get("id") if isinstance(obj, dict) else None
    return "hook %d (%s)" % (index, json.dumps(hook_id)) if isinstance(hook_id, str) else \
        "hook %d" % index


def parse_hooks(text, filename):
    """Parse the text of a hooks file: (list of Hook, Problems).  Raises HooksFileError."""
    problems = Problems(filename)
    if not text.strip():
        raise HooksFileError("%s: file is empty" % filename)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = ""
        if text.lstrip()[:1] not in ("[", "{"):
            hint = " (hooks files must be JSON; YAML is not supported)"
        raise HooksFileError("%s:%d:%d: %s%s" % (filename, exc.lineno, exc.colno, exc.msg, hint)) \
            from None
    if not isinstance(data, list):
        raise HooksFileError("%s: expected a JSON array of hooks, got %s"
                             % (filename, type_name(data)))
    hooks, seen = [], set()
    for index, obj in enumerate(data):
        where = describe(index, obj)
        try:
            hook = Hook(obj, where, problems)
        except HooksFileError as exc:
            raise HooksFileError("%s: %s" % (filename, exc)) from None
        if hook.id in seen:
            problems.error(where, "duplicate id %r in this file (the first one wins)" % hook.id)
        seen.add(hook.id)
        hooks.append(hook)
    return hooks, problems


def read_bytes(path):
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise HooksFileError("%s: %s" % (path, exc.strerror)) from None


def parse_hooks_file(raw, path, template=False):
    """Template-expand and parse the bytes of one hooks file: (hooks, Problems)."""
    text = raw.decode("utf-8", "surrogateescape")
    if template:
        text = expand_template(text, path)
    return parse_hooks(text, path)


def read_hooks_file(path, template=False):
    return parse_hooks_file(read_bytes(path), path, template)


def look_path(command, working_directory, path_env=None):
    """exec.LookPath as upstream calls it: the absolute path to run, or raise OSError."""
    if os.path.isabs(command) or not working_directory:
        candidate = command
    else:
        candidate = os.path.join(working_directory, command)
    if "/" in candidate:
        if is_executable(candidate):
            return os.path.abspath(candidate)
        raise OSError(errno.ENOENT, "exec: %r: no such executable file" % candidate)
    search = os.environ.get("PATH", "") if path_env is None else path_env
    for directory in search.split(os.pathsep):
        full = os.path.join(directory or ".", candidate)
        if is_executable(full):
            return os.path.abspath(full)
    raise OSError(errno.ENOENT, '"%s": executable file not found in $PATH' % candidate)


def is_executable(path):
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISDIR(mode) and bool(mode & 0o111)


def validate_files(paths, template=False):
    """-validate: every problem of every hooks file, as (severity, message) pairs."""
    found, owners = [], {}
    for path in paths:
        try:
            hooks, problems = read_hooks_file(path, template)
        except HooksFileError as exc:
            found.append(("error", str(exc)))
            continue
        found.extend(problems.items)
        for index, hook in enumerate(hooks):
            where = "%s: hook %d (%s)" % (path, index, json.dumps(hook.id))
            if hook.id in owners and owners[hook.id] != path:
                found.append(("error", "%s: duplicate id, already defined in %s"
                              % (where, owners[hook.id])))
            owners.setdefault(hook.id, path)
            if not hook.id:
                found.append(("error", "%s: empty id (unreachable)" % where))
            if hook.working_directory and not os.path.isdir(hook.working_directory):
                found.append(("error", "%s: command-working-directory %r does not exist"
                              % (where, hook.working_directory)))
            if hook.execute_command:
                try:
                    look_path(hook.execute_command, hook.working_directory)
                except OSError as exc:
                    found.append(("error", "%s: execute-command: %s" % (where, exc.strerror)))
    return found


# ---------------------------------------------------------------------------
# Payload parsing and parameter sources (pure)
# ---------------------------------------------------------------------------

class GoNumber(str):
    """A JSON number kept as written (Go's json.Number): `1.50` stays `1.50`."""


class NilMap(dict):
    """A multipart JSON part that did not decode into an object: Go keeps a nil map (`null`)."""


def _reject_constant(name):
    raise ValueError("invalid JSON value %s" % name)


JSON_DECODER = json.JSONDecoder(parse_float=GoNumber, parse_int=GoNumber,
                                parse_constant=_reject_constant)
JSON_SPACE = " \t\n\r"


def decode_json_value(text):
    """The first JSON value of text (Go's Decoder.Decode: trailing data is ignored)."""
    start = len(text) - len(text.lstrip(JSON_SPACE))
    if start == len(text):
        raise ValueError("EOF")
    try:
        value, _ = JSON_DECODER.raw_decode(text, start)
    except json.JSONDecodeError as exc:
        raise ValueError(str(exc)) from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    return value


def decode_json_object(text):
    """Decode into a map as Go does: an object, or None for `null`; anything else is an error."""
    value = decode_json_value(text)
    if value is not None and not isinstance(value, dict):
        raise ValueError("cannot unmarshal %s into Go value of type map[string]interface {}"
                         % type_name(value))
    return value


GO_JSON_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t",
                   "<": "\\u003c", ">": "\\u003e", "&": "\\u0026",
                   "\u2028": "\\u2028", "\u2029": "\\u2029"}
GO_JSON_SPECIAL = re.compile('["\\\\\x00-\x1f<>&\u2028\u2029\ud800-\udfff]')


def _go_escape_char(match):
    ch = match.group(0)
    escaped = GO_JSON_ESCAPES.get(ch)
    if escaped is None:
        escaped = "\ufffd" if "\ud800" <= ch <= "\udfff" else "\\u%04x" % ord(ch)
    return escaped


def go_json_string(text):
    return '"' + GO_JSON_SPECIAL.sub(_go_escape_char, text) + '"'


def go_json(value):
    """json.Marshal as Go does it: compact, map keys sorted, `<>&` escaped, numbers as written."""
    if value is None or isinstance(value, NilMap):
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, GoNumber):
        return str(value)
    if isinstance(value, str):
        return go_json_string(value)
    if isinstance(value, dict):
        return "{" + ",".join(go_json_string(k) + ":" + go_json(value[k])
                              for k in sorted(value)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(go_json(v) for v in value) + "]"
    return json.dumps(value)


def go_format(value):
    """fmt.Sprintf("%v") of a payload value, objects and arrays as Go JSON."""
    if isinstance(value, str):
        return value
    if value is None:
        return "<nil>"
    if isinstance(value, (dict, list)):  # NilMap included: Go marshals a nil map as null
        return go_json(value)
    if value is True:
        return "true"
    if value is False:
        return "false"
    return str(value)


class ParameterNodeError(Exception):
    """A referenced value is missing: a rule is just not satisfied."""


class SignatureError(Exception):
    """A payload signature did not verify."""


class RuleError(Exception):
    """Any other evaluation error: answered with 500."""


def is_ascii_digits(text):
    """0-9 only: str.isdigit() also accepts `²` and other scripts' digits, which int() refuses
    or reads, where Go's strconv refuses them all."""
    return text.isascii() and text.isdigit()


def get_parameter(path, params):
    """Upstream's GetParameter: a literal key (even with dots) wins, else a dot-path with array
    indexes.  Returns (value, error)."""
    while True:
        if params is None:
            return None, RuleError("no parameters")
        if isinstance(params, list):
            head, dot, rest = path.partition(".")
            index = head if dot else path
            if not params or not is_ascii_digits(index) or int(index) >= len(params):
                return None, ParameterNodeError(path)
            if not dot:
                return params[int(index)], None
            params, path = params[int(index)], rest
            continue
        if isinstance(params, dict):
            if path in params:
                return params[path], None
            head, dot, rest = path.partition(".")
            if head in params:
                if not dot:
                    return params[head], None
                params, path = params[head], rest
                continue
        return None, ParameterNodeError(path)


def replace_parameter(path, params, value):
    """Upstream's ReplaceParameter (for parse-parameters-as-json): True when replaced."""
    while True:
        head, dot, rest = path.partition(".")
        if isinstance(params, list):
            if not dot or not is_ascii_digits(head) or int(head) >= len(params):
                return False
            params, path = params[int(head)], rest
        elif isinstance(params, dict):
            if dot:
                params, path = params.get(head), rest
                continue
            if path in params:
                params[path] = value
                return True
            return False
        else:
            return False


_CANONICAL_CACHE = {}
TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz"
                        "ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def canonical_header(name):
    """textproto.CanonicalMIMEHeaderKey: `x-hub-signature` -> `X-Hub-Signature`."""
    cached = _CANONICAL_CACHE.get(name)
    if cached is not None:
        return cached
    if not name or not set(name) <= TOKEN_CHARS:
        result = name
    else:
        result = "-".join(part[:1].upper() + part[1:].lower() for part in name.split("-"))
    if len(_CANONICAL_CACHE) < 4096:
        _CANONICAL_CACHE[name] = result
    return result


_HEX = "0123456789abcdefABCDEF"


def go_unescape(text, plus_is_space):
    """url.QueryUnescape / url.PathUnescape: None when an escape is malformed."""
    if plus_is_space and "+" in text:
        text = text.replace("+", " ")
    if "%" not in text:
        return text
    parts = text.split("%")
    out = bytearray(parts[0].encode("utf-8", "surrogateescape"))
    for part in parts[1:]:
        if len(part) < 2 or part[0] not in _HEX or part[1] not in _HEX:
            return None
        out.append(int(part[:2], 16))
        out += part[2:].encode("utf-8", "surrogateescape")
    return out.decode("utf-8", "surrogateescape")


def parse_query(text):
    """url.ParseQuery: (first value per key, ok).  A bad pair (bad escape, `;`) is skipped and
    makes ok False, as Go returns an error then."""
    values, ok = {}, True
    for pair in text.split("&"):
        if not pair:
            continue
        if ";" in pair:
            ok = False
            continue
        key, _, value = pair.partition("=")
        key, value = go_unescape(key, True), go_unescape(value, True)
        if key is None or value is None:
            ok = False
            continue
        values.setdefault(key, value)
    return values, ok


class PayloadError(Exception):
    """The body could not be parsed: logged, the hook runs with no payload (as upstream)."""


class MultipartError(Exception):
    """A malformed multipart body: 500 "Error occurred while parsing multipart form."."""


def parse_json_payload(body):
    text = body.decode("utf-8", "replace")
    if text.lstrip(JSON_SPACE)[:1] == "[":
        try:
            return {"root": decode_json_value(text)}
        except ValueError as exc:
            raise PayloadError("error parsing JSON array payload %s" % exc) from None
    try:
        return decode_json_object(text)
    except ValueError as exc:
        raise PayloadError("error parsing JSON payload %s" % exc) from None


def parse_form_payload(body):
    values, ok = parse_query(body.decode("utf-8", "surrogateescape"))
    if not ok:
        raise PayloadError("error parsing form payload: invalid URL escape or semicolon")
    return values


XML_TRIM = "\t\r\b\n "
XML_MAX_DEPTH = 500  # deeper documents are refused: rendering them would exhaust the stack
XML_DECLARED_ENCODING = re.compile(rb"""\s*<\?xml[^>]*?encoding\s*=\s*["']([^"']*)["']""")


class XMLNode:
    """An element while parsing, as mxj builds it: attributes and children in a map; a text run
    seen while that map is still empty makes the element a plain string (children after it are
    dropped), a later one goes to `#text`; the last run wins."""

    __slots__ = ("value", "scalar")

    def __init__(self, attributes):
        self.value = {"-" + name.rpartition(":")[2]: v for name, v in attributes.items()}
        self.scalar = None

    def add_text(self, text):
        if self.value:
            self.value["#text"] = text
        else:
            self.scalar = text

    def result(self):
        if self.scalar is not None:
            return self.scalar
        return self.value or ""


def parse_xml_payload(body):
    """XML mapped as mxj does for upstream: {root: ...}, attributes as `-name` (namespace
    prefixes dropped), repeated children as lists, the last non-blank text run as a string or
    `#text`.  Only the first root element is read; a DOCTYPE is ignored and nothing is ever
    fetched, but entities it declares are an error (as in Go: no entity expansion attacks)."""
    declared = XML_DECLARED_ENCODING.match(body)
    if declared and declared.group(1).lower() not in (b"utf-8", b"utf8"):
        raise PayloadError("error parsing XML payload: unsupported encoding %s"
                           % declared.group(1).decode("ascii", "replace"))
    from xml.parsers import expat  # only needed for XML payloads
    parser = expat.ParserCreate()
    parser.buffer_text = True
    stack, done = [], []

    def refuse_entity(*_args):  # Go does not expand entities a DTD declares: an error
        raise PayloadError("error parsing XML payload: entities are not supported")

    def start(name, attributes):
        if len(stack) >= XML_MAX_DEPTH:
            raise PayloadError("error parsing XML payload: nested too deeply")
        stack.append((name.rpartition(":")[2], XMLNode(attributes)))

    def end(_name):
        name, node = stack.pop()
        value = node.result()
        if not stack:
            done.append({name: value})
            return
        parent = stack[-1][1].value
        if name not in parent:
            parent[name] = value
        elif isinstance(parent[name], list):
            parent[name].append(value)
        else:
            parent[name] = [parent[name], value]

    def text(data):
        data = data.strip(XML_TRIM)
        if data and stack:
            stack[-1][1].add_text(data)

    parser.StartElementHandler, parser.EndElementHandler = start, end
    parser.CharacterDataHandler = text
    parser.EntityDeclHandler = parser.SkippedEntityHandler = refuse_entity
    try:
        parser.Parse(body, True)
    except expat.ExpatError as exc:
        if not done:
            raise PayloadError("error parsing XML payload: %s" % exc) from None
    if not done:
        raise PayloadError("error parsing XML payload: EOF")
    return done[0]


def parse_media_params(value):
    """mime.ParseMediaType, enough for a boundary: (type, {param: value})."""
    media, _, rest = value.partition(";")
    params = {}
    for match in re.finditer(r';?\s*([^=;\s]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;\s]*)', ";" + rest):
        key, val = match.group(1).lower(), match.group(2)
        if val.startswith('"'):
            val = re.sub(r"\\(.)", r"\1", val[1:-1])
        params[key] = val
    return media.strip().lower(), params


def split_part(part):
    """Headers and content of one multipart part (CRLF or bare LF line endings)."""
    for separator in (b"\r\n\r\n", b"\n\n"):
        if part.startswith(separator[len(separator) // 2:]):
            return {}, part[len(separator) // 2:]
    crlf, lf = part.find(b"\r\n\r\n"), part.find(b"\n\n")
    if crlf < 0 and lf < 0:
        raise MultipartError("malformed MIME header: missing blank line")
    end, skip = (crlf, 4) if crlf >= 0 and (lf < 0 or crlf < lf) else (lf, 2)
    headers = {}
    for raw in re.split(b"\r?\n", part[:end]):
        name, sep, value = raw.decode("utf-8", "replace").partition(":")
        if not sep:
            raise MultipartError("malformed MIME header line: %s" % raw[:80])
        headers.setdefault(canonical_header(name.strip()), []).append(value.strip())
    return headers, part[end + skip:]


def parse_multipart(body, content_type, json_part_names):
    """multipart/form-data as upstream reads it: {field: first value}; file parts only when
    their Content-Type is exactly application/json or they are named in
    parse-parameters-as-json.  None when no field was found."""
    media, params = parse_media_params(content_type)
    boundary = params.get("boundary")
    if not media.startswith("multipart/") or not boundary:
        raise MultipartError("no multipart boundary param in Content-Type")
    delimiter = re.compile(b"(?:^|\r?\n)--" + re.escape(boundary.encode("utf-8", "replace")) +
                           b"(--)?[ \t]*(?:\r?\n|$)")
    marks = list(delimiter.finditer(body))
    if not marks:
        raise MultipartError("NextPart: EOF")
    payload, file_fields = None, set()
    for mark, following in zip(marks, marks[1:] + [None]):
        if mark.group(1):
            return payload
        if following is None:
            raise MultipartError("NextPart: unexpected EOF")
        headers, data = split_part(body[mark.end():following.start()])
        kind, disposition = parse_media_params(headers.get("Content-Disposition", [""])[0])
        name = disposition.get("name")
        if kind != "form-data" or not name:
            continue
        is_file = "filename" in disposition
        if is_file and not (name in json_part_names
                            or "application/json" in headers.get("Content-Type", [])):
            continue  # other file parts are not part of the payload
        if payload is None:
            payload = {}
        if name in file_fields:
            continue  # the first JSON file part of a name wins, over fields too (as upstream)
        if not is_file:
            payload.setdefault(name, data.decode("utf-8", "surrogateescape"))
        else:
            try:
                value = decode_json_object(data.decode("utf-8", "replace"))
            except ValueError:
                value = None
            payload[name] = NilMap() if value is None else value
            file_fields.add(name)
    return payload


class HookRequest:
    """What rules and arguments can see of one request."""

    __slots__ = ("id", "method", "remote_addr", "headers", "query", "payload", "body",
                 "content_type", "allow_signature_errors")

    def __init__(self, request_id, method, remote_addr, headers, query, body, content_type):
        self.id, self.method, self.remote_addr = request_id, method, remote_addr
        self.headers, self.query, self.body = headers, query, body
        self.content_type, self.payload = content_type, None
        self.allow_signature_errors = False


def parse_payload(request, hook, multipart_content_type):
    """Fill request.payload from the body as upstream does; returns log messages.
    Raises MultipartError for a malformed multipart body."""
    content_type = request.content_type
    if "json" in content_type:
        parser = parse_json_payload
    elif "x-www-form-urlencoded" in content_type:
        parser = parse_form_payload
    elif "xml" in content_type:
        parser = parse_xml_payload
    elif content_type.startswith("multipart/form-data;"):
        names = {a.name for a in hook.json_parameters if a.source == "payload"}
        request.payload = parse_multipart(request.body, multipart_content_type, names)
        request.body = b""  # upstream never reads a multipart body into the request body
        return []
    else:
        return ["error parsing body payload due to unsupported content type header: %s"
                % content_type]
    try:
        request.payload = parser(request.body)
    except PayloadError as exc:
        return [str(exc)]
    return []


def parameter_map(arg, request):
    """(map, key) an argument of a map source (header, url/query, payload) is looked up in;
    None for the other sources."""
    if arg.source == "header":
        return request.headers, canonical_header(arg.name)
    if arg.source in ("url", "query"):
        return request.query, arg.name
    if arg.source == "payload":
        return request.payload, arg.name
    return None


def get_argument(arg, request):
    """Argument.Get: (string value, error)."""
    lookup = parameter_map(arg, request)
    if lookup is not None:
        params, key = lookup
        if params is None:  # no payload
            return "", ParameterNodeError(key)
        value, err = get_parameter(key, params)
        if err is not None:
            return "", err
        return go_format(value), None
    source = arg.source
    if source == "string":
        return arg.name, None
    if source == "raw-request-body":
        return request.body.decode("utf-8", "surrogateescape"), None
    if source == "request":
        which = arg.name.lower()
        if which == "method":
            return request.method, None
        if which == "remote-addr":
            return request.remote_addr, None
        return "", RuleError("unsupported request key: %s" % json.dumps(arg.name))
    if source == "entire-payload":
        return go_json(request.payload), None
    if source == "entire-headers":
        return go_json(request.headers), None
    if source == "entire-query":
        return go_json(request.query), None
    return "", RuleError("no source for value retrieval")


def apply_json_parameters(hook, request):
    """parse-parameters-as-json: decode the named values in place; returns log messages."""
    messages = []
    for arg in hook.json_parameters:
        value, err = get_argument(arg, request)
        if err is not None:
            messages.append("couldn't retrieve argument for %r" % arg)
            continue
        try:
            decoded = decode_json_object(value)
        except ValueError as exc:
            messages.append("error parsing JSON parameters: %s" % exc)
            continue
        lookup = parameter_map(arg, request)
        if lookup is None:
            messages.append("invalid source for argument %r" % arg)
            continue
        target, key = lookup
        if not replace_parameter(key, target, decoded):
            messages.append("couldn't retrieve argument for %r" % arg)
    return messages


# ---------------------------------------------------------------------------
# Rule evaluation (pure)
# ---------------------------------------------------------------------------

def evaluate(rule, request):
    """Evaluate a rule tree exactly as upstream: returns (satisfied, error or None)."""
    kind = rule[0]
    if kind == "and":
        for sub in rule[1]:
            ok, err = evaluate(sub, request)
            if err is not None:
                return False, err
            if not ok:
                return False, None
        return True, None
    if kind == "or":
        for sub in rule[1]:
            ok, err = evaluate(sub, request)
            if err is not None and not isinstance(err, ParameterNodeError):
                if not (request.allow_signature_errors and isinstance(err, SignatureError)):
                    return False, err
            if ok:
                return True, None
        return False, None
    if kind == "not":
        ok, err = evaluate(rule[1], request)
        return not ok, err
    if kind == "match":
        return evaluate_match(rule[1], request)
    return False, None


def evaluate_match(rule, request):
    kind = rule.type
    if kind == "ip-whitelist":
        return check_ip_whitelist(request.remote_addr, rule.ip_range)
    if kind == "scalr-signature":
        return check_scalr_signature(request, rule.secret, time.time())
    value, err = get_argument(rule.parameter, request)
    if err is not None:
        return False, err
    if kind == "value":
        import hmac  # lazily: loading libcrypto costs ~4 MiB of idle memory
        return hmac.compare_digest(value.encode("utf-8", "surrogateescape"),
                                   rule.value.encode("utf-8", "surrogateescape")), None
    if kind == "regex":
        if rule.compiled is None:
            return False, RuleError(rule.regex_error)
        return rule.compiled.search(value) is not None, None
    if kind in HMAC_TYPES:
        if kind.startswith("payload-hash-"):
            log.warning("warn: use of deprecated option %s; use %s instead",
                        kind, kind.replace("hash", "hmac"))
        algorithm, prefix = HMAC_TYPES[kind]
        err = check_payload_signature(request.body, rule.secret, value, algorithm, prefix)
        return err is None, err
    return False, None


def extract_signatures(header, prefix):
    """`sha256=abc` or `abc`; a comma-separated list keeps only entries with the prefix."""
    if "," in header:
        return [part[len(prefix):] for part in header.split(",") if part.startswith(prefix)]
    return [header[len(prefix):] if header.startswith(prefix) else header]


def check_payload_signature(body, secret, header, algorithm, prefix):
    """None when one of the signatures in header is the lower-case hex HMAC of body."""
    if not secret:
        return RuleError("signature validation secret can not be empty")
    import hmac
    expected = hmac.new(secret.encode("utf-8", "surrogateescape"), body, algorithm).hexdigest()
    signatures = extract_signatures(header, prefix)
    for signature in signatures:
        if hmac.compare_digest(signature.encode("utf-8", "surrogateescape"), expected.encode()):
            return None
    return SignatureError("invalid payload signature")  # the presented value is not logged


@functools.lru_cache(maxsize=256)  # the ranges of ip-whitelist rules, parsed once, not per request
def parse_cidr(text):
    import ipaddress  # only needed by ip-whitelist rules
    if "/" not in text:
        text += "/32"
    address, _, bits = text.partition("/")
    try:
        if not bits.isdigit():
            return None
        return ipaddress.ip_network("%s/%s" % (address, bits), strict=False)
    except ValueError:
        return None


def check_ip_whitelist(remote_addr, ip_range):
    import ipaddress
    host = remote_addr.strip(" []")
    if ":" in host:
        host = host[:host.rindex(":")].strip(" []")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False, RuleError("invalid IP address found in remote address '%s'" % remote_addr)
    for text in ip_range.split():
        network = parse_cidr(text)
        if network is None:
            return False, RuleError("invalid CIDR address: %s" % text)
        if address.version != network.version:
            mapped = getattr(address, "ipv4_mapped", None)
            if mapped is not None and mapped in network:
                return True, None
            continue
        if address in network:
            return True, None
    return False, None


GO_DATE = re.compile(r"^[A-Za-z]{3} (\d{2}) ([A-Za-z]{3}) (\d{4}) (\d{2}):(\d{2}):(\d{2}) "
                     r"([A-Za-z]{3,5})$")
MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def parse_scalr_date(text):
    """time.Parse("Mon 02 Jan 2006 15:04:05 MST"); an unknown zone counts as UTC, as in Go."""
    import calendar
    match = GO_DATE.match(text)
    if not match or match.group(2) not in MONTHS:
        raise ValueError("parsing time %s: cannot parse" % json.dumps(text))
    day, month, year, hour, minute, second = (int(match.group(1)),
                                              MONTHS.index(match.group(2)) + 1,
                                              int(match.group(3)), int(match.group(4)),
                                              int(match.group(5)), int(match.group(6)))
    return calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0))


def check_scalr_signature(request, secret, now):
    headers = request.headers
    if "X-Signature" not in headers or "Date" not in headers:
        return False, None
    if not secret:
        return False, RuleError("signature validation signing key can not be empty")
    provided, date = headers["X-Signature"], headers["Date"]
    import hmac
    mac = hmac.new(secret.encode("utf-8", "surrogateescape"), request.body, "sha1")
    mac.update(date.encode("utf-8", "surrogateescape"))
    if not hmac.compare_digest(provided.encode("utf-8", "surrogateescape"),
                               mac.hexdigest().encode()):
        return False, SignatureError("invalid payload signature")
    try:
        sent = parse_scalr_date(date)
    except ValueError as exc:
        return False, RuleError(str(exc))
    if abs(now - sent) > 300:
        return False, SignatureError("invalid payload signature outdated")
    return True, None


def rules_satisfied(hook, request):
    """Returns (satisfied, error to answer 500 with or None, message to log or None)."""
    if hook.trigger_rule is None:
        return True, None, None
    request.allow_signature_errors = hook.signature_soft_failures
    ok, err = evaluate(hook.trigger_rule, request)
    if err is None:
        return ok, None, None
    if isinstance(err, ParameterNodeError):
        return ok, None, "couldn't retrieve parameter %s" % err
    return False, err, None


# ---------------------------------------------------------------------------
# Command execution: argv and environment, temp files, running, timeouts
# ---------------------------------------------------------------------------

KILL_GRACE_SECONDS = 5.0


class Invocation:
    """Everything needed to start a hook's command; `messages` are for the log."""

    def __init__(self, executable, argv, env_pairs, file_pairs, cwd, messages):
        self.executable, self.argv, self.env_pairs = executable, argv, env_pairs
        self.file_pairs, self.cwd, self.messages = file_pairs, cwd, messages


LONE_SURROGATE = re.compile("[\ud800-\udc7f\udd00-\udfff]")


def os_bytes(text):
    """A value as exec() gets it: UTF-8, raw request bytes kept, lone surrogates (from JSON
    `\\ud800` escapes) replaced by U+FFFD as Go's decoder does."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return LONE_SURROGATE.sub("\ufffd", text).encode("utf-8", "surrogateescape")


def lookup_all(args, request, purpose, messages):
    """[(argument, value)] with None where the request lacks the value (that is logged)."""
    found = []
    for arg in args:
        value, err = get_argument(arg, request)
        if err is not None:
            messages.append("error extracting command arguments%s: couldn't retrieve argument "
                            "for %r" % (purpose, arg))
            value = None
        found.append((arg, value))
    return found


def go_base64_decode(data):
    """base64.StdEncoding.DecodeString: strict padding, newlines skipped; on an error, the
    bytes of the complete groups before it (as Go returns them) and the error."""
    import base64  # only needed by pass-file-to-command with base64decode
    import binascii
    data = data.replace(b"\r", b"").replace(b"\n", b"")
    try:
        return base64.b64decode(data, validate=True), None
    except binascii.Error as exc:
        # the longest prefix of whole 4-character groups that decodes (alphabet characters,
        # then the padding of a last group): one scan, where decoding ever longer prefixes
        # would take quadratic time on a large payload
        valid = re.match(rb"[A-Za-z0-9+/]*", data).end()
        good = valid - valid % 4
        for padding in (b"=", b"=="):
            if (valid + len(padding)) % 4 == 0 and data.startswith(padding, valid):
                good = valid + len(padding)
        return base64.b64decode(data[:good]), exc


def env_entry(name, value):
    """(NAME, value bytes) as Go's exec passes `name=value`: with an `=` inside the name, the
    variable is the part before it and the rest goes in front of the value."""
    key, sep, prefix = name.partition("=")
    return key, os_bytes(prefix + sep) + value


def build_invocation(hook, request):
    """argv/env/files from the request (pure except for the PATH lookup).  Raises OSError when
    the command cannot be found, as upstream checks that first."""
    executable = look_path(hook.execute_command, hook.working_directory)
    messages = []
    argv = [os_bytes(hook.execute_command)]
    argv += [os_bytes(value or "") for _, value in lookup_all(hook.pass_arguments, request, "",
                                                                messages)]
    env_pairs = [env_entry(arg.envname or "HOOK_" + arg.name, os_bytes(value))
                 for arg, value in lookup_all(hook.pass_environment, request,
                                              " for environment", messages)
                 if value is not None]
    file_pairs = []
    for arg, value in lookup_all(hook.pass_files, request, " for file", messages):
        if value is None:
            continue
        data = os_bytes(value)
        if arg.base64decode:
            data, error = go_base64_decode(data)
            if error:
                messages.append("error decoding string [%s]" % error)
        file_pairs.append((arg.envname or "HOOK_" + arg.name.upper(), data))
    return Invocation(executable, argv, env_pairs, file_pairs, hook.working_directory or None,
                      messages)


def write_temp_files(invocation):
    """Write pass-file-to-command values to 0600 temp files; returns [(envname, path)]."""
    if not invocation.file_pairs:
        return []
    import random  # only needed by hooks that pass files
    import tempfile
    directory = os.path.abspath(invocation.cwd or tempfile.gettempdir())
    written = []
    try:
        for envname, data in invocation.file_pairs:
            while True:  # `<envname><9 random digits>`, as Go's ioutil.TempFile names them
                path = os.path.join(directory, "%s%09d" % (envname, random.randrange(10 ** 9)))
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                 0o600)
                    break
                except FileExistsError:
                    continue
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            written.append((envname, path))
    except OSError:
        remove_files(written)
        raise
    return written


def remove_files(written):
    """Remove the temp files of write_temp_files: [(envname, path)]."""
    remove_paths(path for _, path in written)


def remove_paths(paths):
    """Unlink each path; one that is already gone is fine."""
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


class CommandResult:
    """How a run ended: `started` False if it never ran; `returncode`; `timed_out`."""

    def __init__(self, started, returncode=None, output=b"", timed_out=False, error=None):
        self.started, self.returncode, self.output = started, returncode, output
        self.timed_out, self.error = timed_out, error

    @property
    def ok(self):
        return self.started and self.returncode == 0 and not self.timed_out


class Child:
    """A command started by Spawner: the subset of Popen that CommandRunner uses."""

    def __init__(self, pid):
        self.pid, self.returncode = pid, None

    def wait(self, timeout=None):
        if self.returncode is not None:
            return self.returncode
        if timeout is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            return self.returncode
        deadline, delay = time.monotonic() + timeout, 0.0005
        while self.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(self.pid, timeout)
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.05)
        return self.returncode

    def poll(self):
        """The exit code once the process has exited (it is reaped then), else None."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class Spawner:
    """posix_spawn(3) called through ctypes.  CPython 3.11's subprocess holds the GIL while the
    vfork()ed child execs (about a millisecond), which stalls every other thread; a ctypes call
    releases the GIL, so workers and the log writer go on while a command starts (the loop
    thread waits: about 0.2 ms for /bin/true, more on a busy machine).  The child gets its own
    session, stdin/stdout/stderr as given, SIGPIPE/SIGXFSZ reset to default as Popen does, and
    no other descriptors (Python opens everything close-on-exec)."""

    SETSIGDEF, SETSIGMASK, SETSID = 0x04, 0x08, 0x80  # glibc's POSIX_SPAWN_* flags

    def __init__(self):
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            raise OSError("not glibc: its posix_spawn flags and layouts are not known here")
        import ctypes  # only needed once a command runs
        self.ctypes = ctypes
        self.libc = libc = ctypes.CDLL(None, use_errno=True)
        for name in ("posix_spawn", "posix_spawn_file_actions_init",
                     "posix_spawn_file_actions_adddup2", "posix_spawn_file_actions_addchdir_np",
                     "posix_spawn_file_actions_destroy", "posix_spawnattr_init",
                     "posix_spawnattr_setflags", "posix_spawnattr_setsigdefault",
                     "posix_spawnattr_setsigmask", "sigemptyset", "sigaddset"):
            getattr(libc, name)  # AttributeError: not glibc-like; Popen is used instead
        # the same attributes for every command: set up once
        self.attributes = attributes = ctypes.create_string_buffer(1024)  # > glibc's struct
        libc.posix_spawnattr_init(attributes)
        self.reset_signals = self._sigset(signal.SIGPIPE, signal.SIGXFSZ)
        self.no_signals = self._sigset()
        libc.posix_spawnattr_setsigdefault(attributes, self.reset_signals)
        libc.posix_spawnattr_setsigmask(attributes, self.no_signals)
        libc.posix_spawnattr_setflags(attributes, ctypes.c_short(
            self.SETSIGDEF | self.SETSIGMASK | self.SETSID))

    def _sigset(self, *signums):
        sigset = self.ctypes.create_string_buffer(256)  # larger than any sigset_t
        self.libc.sigemptyset(sigset)
        for signum in signums:
            self.libc.sigaddset(sigset, int(signum))
        return sigset

    def c_strings(self, items):
        """A list of bytes as the NULL-terminated char *[] of argv/envp; prepared once, an
        environment can be given to spawn() again and again."""
        if any(b"\0" in item for item in items):
            raise ValueError("embedded null byte")
        return (self.ctypes.c_char_p * (len(items) + 1))(*items, None)

    def spawn(self, executable, argv, env, cwd, stdin_fd, stdout_fd):
        """Start executable (bytes) with argv and env (lists of bytes, or c_strings() of them);
        returns a Child."""
        if b"\0" in executable:
            raise ValueError("embedded null byte")
        argv = self.c_strings(argv)
        if isinstance(env, list):
            env = self.c_strings(env)
        ctypes, libc = self.ctypes, self.libc
        actions = ctypes.create_string_buffer(1024)  # larger than the glibc structure
        libc.posix_spawn_file_actions_init(actions)
        try:
            for source, target in ((stdin_fd, 0), (stdout_fd, 1), (stdout_fd, 2)):
                libc.posix_spawn_file_actions_adddup2(actions, source, target)
            if cwd:
                libc.posix_spawn_file_actions_addchdir_np(actions, os.fsencode(cwd))
            pid = ctypes.c_int()
            error = libc.posix_spawn(ctypes.byref(pid), executable, actions, self.attributes,
                                     argv, env)
        finally:
            libc.posix_spawn_file_actions_destroy(actions)
        if error:
            raise OSError(error, os.strerror(error))
        return Child(pid.value)


def environment_list(env):
    """An environment mapping as execve() wants it: [b"NAME=value"]."""
    pairs = []
    for name, value in env.items():
        name = os.fsencode(name)
        if b"=" in name or not name:
            raise ValueError("illegal environment variable name")
        pairs.append(name + b"=" + os.fsencode(value))
    return pairs


class StartedCommand:
    """A command CommandRunner.launch started: its process, the read end of the pipe its
    stdout and stderr share (None when the output is discarded), its temp files."""

    __slots__ = ("proc", "output", "files", "request_id")

    def __init__(self, files, request_id):
        self.proc = self.output = None
        self.files, self.request_id = files, request_id


class CommandRunner:
    """Runs invocations: argv (never a shell), stdin /dev/null, stdout+stderr in one pipe, its
    own process group (so a timeout or shutdown can stop the whole tree)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.processes = set()
        self.devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)  # opened once, not per run
        self.spawner = None  # created with the first command; False: not available here
        self.inherited_env = None
        self.watchable = None  # see can_watch(); decided with the first command

    def start(self, invocation, env, stdout_fd):
        """Start the command: through Spawner where the C library allows, else Popen."""
        if self.spawner is None:
            self.spawner = self._make_spawner()
        if self.spawner:
            if env is None:  # our own environment: converted once, it does not change
                if self.inherited_env is None:
                    self.inherited_env = self.spawner.c_strings(environment_list(os.environ))
                env_list = self.inherited_env
            else:
                env_list = environment_list(env)
            return self.spawner.spawn(os.fsencode(invocation.executable), invocation.argv,
                                      env_list, invocation.cwd, self.devnull, stdout_fd)
        return subprocess.Popen(invocation.argv, executable=invocation.executable,
                                cwd=invocation.cwd, env=env, stdin=self.devnull,
                                stdout=stdout_fd, stderr=subprocess.STDOUT,
                                start_new_session=True)

    @staticmethod
    def _make_spawner():
        try:
            return Spawner()
        except (ImportError, OSError, AttributeError, ValueError):
            return False

    def can_watch(self):
        """True when a run can be waited for without a thread (WatchedRun): its process is a
        plain child started by Spawner, and the kernel has pidfds (Linux 5.3+)."""
        if self.watchable is None:
            if self.spawner is None:
                self.spawner = self._make_spawner()
            watchable = False
            if self.spawner and hasattr(os, "pidfd_open"):
                try:
                    os.close(os.pidfd_open(os.getpid()))
                    watchable = True
                except OSError:  # ENOSYS: an older kernel
                    pass
            self.watchable = watchable
        return self.watchable

    def run(self, invocation, request_id, timeout=None, on_output=None, keep_output=True):
        """Run to completion in this thread.  Output goes to on_output(chunk) as it arrives
        when given, else it is collected into the result (or discarded when keep_output is
        False)."""
        started = self.launch(invocation, request_id, keep_output or on_output is not None)
        if isinstance(started, CommandResult):
            return started
        return self.wait(started, timeout, on_output)

    def launch(self, invocation, request_id, keep_output):
        """Write the temp files, log, start the command with its output in a pipe (or
        discarded): a StartedCommand, or the CommandResult of a command that did not start."""
        try:
            files = write_temp_files(invocation)
        except OSError as exc:
            return CommandResult(False, error=exc)
        env = None  # inherit our environment as is: cheaper than copying it
        if invocation.env_pairs or files:
            env = dict(os.environ)
            env.update(invocation.env_pairs)
            env.update(env_entry(name, os.fsencode(path)) for name, path in files)
        if log.isEnabledFor(logging.INFO):
            for envname, path in files:
                log.info("[%s] writing env %s file %s", request_id, envname, path)
            log.info("[%s] executing %s (%s) with arguments %s and environment %s using %s as "
                     "cwd", request_id, invocation.argv[0].decode("utf-8", "replace"),
                     invocation.executable,
                     go_quote_list(invocation.argv),
                     "[" + " ".join(name for name, _ in invocation.env_pairs + files) + "]",
                     invocation.cwd or "")
        started = StartedCommand(files, request_id)
        try:
            # a bare pipe (not Popen's file object around it): stdout and stderr share it
            write_end = self.devnull
            if keep_output:
                started.output, write_end = os.pipe2(os.O_CLOEXEC)
            try:
                started.proc = self.start(invocation, env, write_end)
            finally:
                if started.output is not None:
                    os.close(write_end)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            self.finish(started)  # ValueError: a NUL byte in argv/env
            return CommandResult(False, error=exc)
        with self.lock:
            self.processes.add(started.proc)
        return started

    def wait(self, started, timeout, on_output=None):
        """Block until a launched run has ended: read its output, reap it, finish()."""
        try:
            if started.output is None:
                return self._wait(started.proc, timeout)
            return self._collect(started.proc, started.output, timeout, on_output)
        finally:
            self.finish(started)

    def finish(self, started):
        """After a run (or a failed start): forget the process, close the pipe, remove the
        temp files."""
        with self.lock:
            self.processes.discard(started.proc)
        if started.output is not None:
            os.close(started.output)
        for _, path in started.files:
            log.info("[%s] removing file %s", started.request_id, path)
        remove_files(started.files)

    def _wait(self, proc, timeout):
        try:
            return CommandResult(True, proc.wait(timeout))
        except subprocess.TimeoutExpired:
            self.stop(proc)
            return CommandResult(True, proc.wait(), timed_out=True)

    def _collect(self, proc, fd, timeout, on_output):
        chunks = []
        sink = on_output or chunks.append
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = select.poll() if deadline is not None else None
        if poller:
            poller.register(fd, select.POLLIN | select.POLLHUP)
        timed_out = False
        while True:
            if poller:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not poller.poll(remaining * 1000):
                    if time.monotonic() >= deadline:
                        timed_out = True
                        self.stop(proc)
                        deadline, poller = None, None
                    continue
            try:
                chunk = os.read(fd, 65536)
            except InterruptedError:
                continue
            if not chunk:
                break
            sink(chunk)
        returncode = proc.wait()
        return CommandResult(True, returncode, b"".join(chunks), timed_out)

    def stop(self, proc):
        """SIGTERM to the process group, SIGKILL after a grace period."""
        signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(KILL_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        signal_group(proc, signal.SIGKILL)

    def kill_all(self):
        with self.lock:
            running = list(self.processes)
        for proc in running:
            signal_group(proc, signal.SIGKILL)


class WatchedRun:
    """Waits for a launched command without a thread, as CommandRunner.wait does with one: the
    connection loop watches the output pipe (non-blocking) and a pidfd of the process (readable
    once it has exited), and keeps the command-timeout and the kill grace period as timers.
    on_done(CommandResult) runs in the loop thread once the output has ended and the process
    has been reaped.  Raises OSError (nothing registered) when the loop cannot watch it."""

    def __init__(self, runner, started, loop, timeout, on_done):
        self.runner, self.started, self.loop, self.on_done = runner, started, loop, on_done
        self.proc = started.proc
        self.chunks = []
        self.timed_out = False
        self.timer = None
        self.pidfd = os.pidfd_open(self.proc.pid)
        self.reading = started.output is not None
        try:
            loop.watch(self.pidfd, self._reap)
            if self.reading:
                os.set_blocking(started.output, False)
                loop.watch(started.output, self._read)
        except OSError:
            if self.reading:
                os.set_blocking(started.output, True)
            loop.unwatch(self.pidfd)
            os.close(self.pidfd)
            raise
        if timeout is not None:
            self.timer = loop.call_later(timeout, self._time_out)

    def _read(self):
        try:
            chunk = os.read(self.started.output, 65536)
        except (BlockingIOError, InterruptedError):
            return
        if chunk:
            self.chunks.append(chunk)
            return
        self.loop.unwatch(self.started.output)
        self.reading = False
        self._end()

    def _reap(self):
        if self.proc.poll() is None:
            return
        self.loop.unwatch(self.pidfd)
        os.close(self.pidfd)
        self.pidfd = None
        if self.timed_out and self.timer is not None:  # as stop(): once the leader has gone
            self.loop.cancel(self.timer)
            self.timer = None
            signal_group(self.proc, signal.SIGKILL)
        self._end()

    def _time_out(self):
        """As CommandRunner.stop: SIGTERM to the group, SIGKILL when its leader has exited or
        the grace period is over; the output is read until it ends."""
        self.timed_out = True
        self.timer = None
        signal_group(self.proc, signal.SIGTERM)
        if self.pidfd is None:
            signal_group(self.proc, signal.SIGKILL)
        else:
            self.timer = self.loop.call_later(KILL_GRACE_SECONDS, self._kill)

    def _kill(self):
        self.timer = None
        signal_group(self.proc, signal.SIGKILL)

    def _end(self):
        if self.reading or self.pidfd is not None:
            return
        if self.timer is not None:
            self.loop.cancel(self.timer)
            self.timer = None
        self.runner.finish(self.started)
        self.on_done(CommandResult(True, self.proc.returncode, b"".join(self.chunks),
                                   self.timed_out))


def signal_group(proc, signum):
    try:
        os.killpg(proc.pid, signum)
    except OSError:
        pass


def go_quote_list(items):
    """Go's %q of a []string (items are bytes here)."""
    return "[" + " ".join(json.dumps(item.decode("utf-8", "replace"), ensure_ascii=False)
                          for item in items) + "]"


# ---------------------------------------------------------------------------
# Concurrency: bounded worker pools and per-hook FIFO gates
# ---------------------------------------------------------------------------

ASYNC_BACKLOG_LIMIT = 10000  # background runs waiting or running; more get 503 (memory bound)


class WorkerPool:
    """At most `size` daemon threads, started on demand; extra jobs wait in FIFO order."""

    def __init__(self, size, name):
        self.size, self.name = max(1, size), name
        self.jobs = queue.SimpleQueue()
        self.idle = threading.Semaphore(0)
        self.lock = threading.Lock()
        self.threads = 0

    def submit(self, job, *args):
        self.jobs.put((job, args))
        if self.idle.acquire(blocking=False):
            return
        with self.lock:
            if self.threads < self.size:
                self.threads += 1
                threading.Thread(target=self._work, name="%s-%d" % (self.name, self.threads),
                                 daemon=True).start()

    def busy(self):
        """True when jobs wait and the pool cannot start a thread for them (a job queued
        while a thread is being started or woken is not a reason to stop lingering)."""
        return self.threads >= self.size and not self.jobs.empty()

    def _work(self):
        while True:
            job, args = self.jobs.get()
            try:
                job(*args)
            except Exception:  # a bug in one job must not kill the worker
                log.exception("unexpected error in %s", self.name)
            self.idle.release()


class HookGate:
    """max-concurrency for one hook: at most `limit` runs at once (0 = no limit); the others
    wait in arrival order.  `enter(start)` calls start() once a slot is granted."""

    def __init__(self, limit):
        self.limit = limit
        self.lock = threading.Lock()
        self.running = 0
        self.waiting = deque()

    def enter(self, start):
        with self.lock:
            if self.limit and self.running >= self.limit:
                self.waiting.append(start)
                return
            self.running += 1
        start()

    def wait_turn(self):
        turn = threading.Event()
        self.enter(turn.set)
        turn.wait()

    def leave(self):
        with self.lock:
            self.running -= 1
            ready = self._take_ready()
        for start in ready:
            start()

    def set_limit(self, limit):
        with self.lock:
            self.limit = limit
            ready = self._take_ready()
        for start in ready:
            start()

    def _take_ready(self):
        ready = []
        while self.waiting and (not self.limit or self.running < self.limit):
            self.running += 1
            ready.append(self.waiting.popleft())
        return ready


# ---------------------------------------------------------------------------
# Hook registry and hot reload
# ---------------------------------------------------------------------------

def file_signature(path):
    """What the poller compares: inode, device, size, mtime (None if the file is missing)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns)


def iso_time(timestamp):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp)) if timestamp else None


MTIME_TICK_SECONDS = 2.0  # coarser than any file system's timestamp granularity


class HooksFile:
    """One -hooks file: its hooks as last loaded successfully, and the state of the last load."""

    def __init__(self, path):
        self.path = path
        self.hooks = []
        self.error = None
        self.loaded_at = None
        self.signature = None
        self.missing_since = None
        self.digest = None  # of the content last read, loaded or not
        self.recheck_until = 0.0  # while the mtime is this fresh, compare content too


class Registry:
    """The loaded hooks, by id; reloads swap the lookup table in one assignment."""

    VANISH_GRACE = 1.0  # a deleted file keeps its hooks this long (git's unlink + create)

    def __init__(self, paths, template):
        self.files = [HooksFile(p) for p in paths]  # a file given twice is a duplicate-id error
        self.template = template
        self.by_id = {}
        self.gates = {}
        self.lock = threading.Lock()
        self.last_load = None
        self.last_reload_failed = False

    def hook(self, hook_id):
        return self.by_id.get(hook_id)

    def gate(self, hook_id):
        return self.gates.get(hook_id)

    def count(self):
        return len(self.by_id)

    def load(self, files=None, startup=False):
        """(Re)load the given files (default all), one by one in command-line order, as
        upstream: a file that fails to parse, or that brings an id another file already serves,
        keeps its old hooks (at startup a duplicate id is fatal).  True if all loaded."""
        with self.lock:
            files = self.files if files is None else files
            ok, now = True, time.time()
            for hf in files:
                log.info("attempting to load hooks from %s", hf.path)
                hf.signature = file_signature(hf.path)
                if hf.signature:  # a second write within the same mtime tick keeps size and
                    # mtime: for a moment, poll() compares the content as well
                    hf.recheck_until = hf.signature[3] / 1e9 + MTIME_TICK_SECONDS
                try:
                    raw = read_bytes(hf.path)
                    hf.digest = hash(raw)
                    hooks, problems = parse_hooks_file(raw, hf.path, self.template)
                except HooksFileError as exc:
                    ok = self._keep_old(hf, "couldn't load hooks from file! %s" % exc, str(exc))
                    continue
                for severity, message in problems.items:
                    log.warning("%s: %s", severity, message)
                log.info("found %d hook(s) in file", len(hooks))
                served = {h.id for other in self.files if other is not hf for h in other.hooks}
                clash = sorted(served & {h.id for h in hooks})
                if clash:
                    message = ("error: hook with the id %s has already been loaded!\nplease "
                               "check your hooks file for duplicate hooks ids!" % clash[0])
                    if startup:
                        raise HooksFileError(message)
                    ok = self._keep_old(hf, message, "%s: duplicate hook id %r"
                                        % (hf.path, clash[0]))
                    continue
                hf.hooks, hf.error, hf.loaded_at = hooks, None, now
                for hook in hooks:
                    log.info("\tloaded: %s", hook.id)
            self._publish()
            self.last_load = now
            self.last_reload_failed = not ok
            return ok

    @staticmethod
    def _keep_old(hf, message, error):
        log.error("%s", message)
        if hf.hooks:
            log.error("keeping the %d hook(s) loaded before from %s", len(hf.hooks), hf.path)
        hf.error = error
        return False

    def _publish(self):
        table = {}
        for hf in self.files:
            for hook in hf.hooks:
                table.setdefault(hook.id, hook)  # first definition wins, as upstream
        for hook_id, hook in table.items():
            gate = self.gates.get(hook_id)
            if gate is None:
                self.gates[hook_id] = HookGate(hook.max_concurrency)
            elif gate.limit != hook.max_concurrency:
                gate.set_limit(hook.max_concurrency)
        self.by_id = table

    def poll(self):
        """Hot reload: the files whose inode, size or mtime changed (to be reloaded); a file
        missing for longer than VANISH_GRACE loses its hooks here."""
        changed, now = [], time.monotonic()
        for hf in self.files:
            signature = file_signature(hf.path)
            if signature is None:
                if hf.signature is None:
                    continue
                if hf.missing_since is None:
                    hf.missing_since = now
                elif now - hf.missing_since >= self.VANISH_GRACE:
                    self._drop(hf)
                continue
            hf.missing_since = None
            if signature != hf.signature or (time.time() < hf.recheck_until
                                             and self._content_changed(hf)):
                changed.append(hf)
        for hf in changed:
            log.info("hooks file %s modified", hf.path)
        return changed

    @staticmethod
    def _content_changed(hf):
        try:
            return hash(read_bytes(hf.path)) != hf.digest
        except HooksFileError:
            return True

    def _drop(self, hf):
        with self.lock:
            log.info("hooks file %s removed, dropping its %d hook(s)", hf.path, len(hf.hooks))
            hf.hooks, hf.signature, hf.missing_since = [], None, None
            hf.error = "%s: file removed" % hf.path
            self._publish()
            self.last_load = time.time()

    def status(self):
        files = [{"path": hf.path, "hooks": [h.id for h in hf.hooks], "loaded": hf.error is None,
                  "error": hf.error, "last_load": iso_time(hf.loaded_at)} for hf in self.files]
        return files, [hf.error for hf in self.files if hf.error]


# ---------------------------------------------------------------------------
# HTTP: request heads, bodies and responses
# ---------------------------------------------------------------------------

MAX_HEADER_BYTES = 1 << 20  # Go's DefaultMaxHeaderBytes
NO_TIMEOUT = 365 * 86400.0  # what -read-header-timeout 0 means
KEEPALIVE_IDLE_SECONDS = 75.0
LINGER_SECONDS = 0.1  # a worker waits this long for the next keep-alive request before parking
WRITE_TIMEOUT_SECONDS = 60.0
NO_BODY_STATUSES = frozenset((204, 304)) | frozenset(range(100, 200))


class BadRequest(Exception):
    """A malformed request: answered as Go's server does (`<code> <reason>[: detail]` as status
    line and body, unless `body` is given) and the connection closed."""

    def __init__(self, status, message, public=False, body=None):
        Exception.__init__(self, message)
        self.status = status
        self.public = "%d %s" % (status, GO_STATUS_TEXT.get(status, ""))
        if public:
            self.public += ": " + message
        self.body = body

    def response(self):
        head = ("HTTP/1.1 %s\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close"
                "\r\n\r\n" % self.public).encode()
        return head + (self.body if self.body is not None else self.public.encode())


class BodyError(Exception):
    """The request body broke off or was malformed mid-way: `partial` is what was read."""

    def __init__(self, message, partial):
        Exception.__init__(self, message)
        self.partial = partial


def head_end(buf):
    """Index just past the blank line ending the request head, or -1."""
    crlf = buf.find(b"\r\n\r\n")
    lf = buf.find(b"\n\n", 0, crlf if crlf >= 0 else len(buf))
    if lf >= 0:
        return lf + 2
    return crlf + 4 if crlf >= 0 else -1


class RequestHead:
    """Request line and headers: `headers` maps canonical names to all their values."""

    __slots__ = ("method", "target", "version", "headers")

    def __init__(self, method, target, version, headers):
        self.method, self.target, self.version, self.headers = method, target, version, headers

    def get(self, name, default=""):
        values = self.headers.get(name)
        return values[0] if values else default

    def keep_alive(self):
        connection = ",".join(self.headers.get("Connection", ())).lower()
        if self.version == "HTTP/1.1":
            return "close" not in connection
        return "keep-alive" in connection


HTTP_VERSION = re.compile(r"^HTTP/(\d)\.(\d)$")
CHUNK_SIZE = re.compile(rb"[0-9a-fA-F]{1,16}")  # Go refuses longer sizes too
CONTROL_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # not TAB, CR, LF


def parse_head(data):
    """Parse a request head (bytes up to and including the blank line) with the checks of Go's
    server: HTTP/1.x only, a Host header for 1.1, valid header names and values."""
    text = data.decode("utf-8", "surrogateescape").lstrip("\r\n")
    lines = text.split("\n")
    parts = lines[0].rstrip("\r").split(" ")
    if len(parts) != 3 or not parts[0] or not parts[1]:
        raise BadRequest(400, "malformed HTTP request %s" % json.dumps(lines[0][:100]))
    method, target, version = parts
    if not set(method) <= TOKEN_CHARS or CONTROL_CHARS.search(target) or "\t" in target:
        raise BadRequest(400, "invalid method or request target")
    bad_bytes = CONTROL_CHARS.search(text)  # one scan of the whole head: names and values
    numbers = HTTP_VERSION.match(version)
    if numbers is None:
        raise BadRequest(400, "malformed HTTP version %s" % json.dumps(version[:20]))
    if numbers.group(1) != "1":
        raise BadRequest(505, "unsupported protocol version", public=True)
    version = "HTTP/1.0" if numbers.group(2) == "0" else "HTTP/1.1"
    headers, last = {}, None
    for line in lines[1:]:
        line = line.rstrip("\r")
        if not line:
            break
        if line[0] in " \t" and last is not None:  # obsolete line folding: a continuation
            last[-1] = (last[-1] + " " + line.strip(" \t")).strip(" ")
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise BadRequest(400, "malformed MIME header line")
        if not name or not set(name) <= TOKEN_CHARS:
            raise BadRequest(400, "invalid header name", public=True)
        value = value.strip(" \t")
        if bad_bytes and CONTROL_CHARS.search(value) or "\r" in value:
            raise BadRequest(400, "invalid header value", public=True)
        last = headers.setdefault(canonical_header(name), [])
        last.append(value)
    hosts = headers.get("Host", ())
    if len(hosts) > 1:
        raise BadRequest(400, "too many Host headers")
    if not hosts and version == "HTTP/1.1":
        raise BadRequest(400, "missing required Host header", public=True)
    return RequestHead(method, target, version, headers)


_date_cache = [0, ""]


def http_date():
    now = int(time.time())
    if now != _date_cache[0]:
        _date_cache[1] = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now))
        _date_cache[0] = now
    return _date_cache[1]


HTML_SIGNATURES = (b"<!DOCTYPE HTML", b"<HTML", b"<HEAD", b"<SCRIPT", b"<IFRAME", b"<H1",
                   b"<DIV", b"<FONT", b"<TABLE", b"<A", b"<STYLE", b"<TITLE", b"<B", b"<BODY",
                   b"<BR", b"<P", b"<!--")
BINARY_BYTES = re.compile(b"[\x00-\x08\x0b\x0e-\x1a\x1c-\x1f]")


def sniff_content_type(body):
    """The common cases of Go's http.DetectContentType (HTML, XML, text, binary)."""
    data = body[:512].lstrip(b"\t\n\x0c\r ")
    if data.startswith(b"<"):
        upper = data[:16].upper()
        for signature in HTML_SIGNATURES:
            if upper.startswith(signature) and data[len(signature):len(signature) + 1] in (
                    b" ", b">"):
                return "text/html; charset=utf-8"
        if data.startswith(b"<?xml"):
            return "text/xml; charset=utf-8"
    if BINARY_BYTES.search(body, 0, 512):
        return "application/octet-stream"
    return TEXT_PLAIN


class Response:
    """A complete answer; headers as an ordered dict of canonical name -> value."""

    __slots__ = ("status", "headers", "body", "close", "sent", "secret_params")

    def __init__(self, status, body=b"", headers=None, close=False, sent=False):
        self.status, self.body, self.close, self.sent = status, body, close, sent
        self.secret_params = ()  # query parameters whose values the access log hides
        self.headers = headers if headers is not None else {}


HOP_BY_HOP = frozenset(("Content-Length", "Transfer-Encoding", "Connection"))


def header_lines(headers):
    """`Name: value` lines as Go writes them: names that are not tokens are dropped, CR and LF
    in values become spaces, framing headers are ours to set."""
    return ["%s: %s" % (name, value.replace("\r", " ").replace("\n", " "))
            for name, value in headers.items()
            if name not in HOP_BY_HOP and name and set(name) <= TOKEN_CHARS]


def serialize_response(response, head, keep_alive):
    """The whole response as one bytes object (status line, headers, body): one send."""
    status = response.status
    version = "HTTP/1.0" if head is not None and head.version == "HTTP/1.0" else "HTTP/1.1"
    lines = ["%s %d %s" % (version, status, GO_STATUS_TEXT.get(status, "status code %d" % status))]
    body = response.body
    headers = response.headers
    if body and "Content-Type" not in headers and status not in NO_BODY_STATUSES:
        lines.append("Content-Type: " + sniff_content_type(body))
    lines += header_lines(headers)
    lines.append("Date: " + http_date())
    if status in NO_BODY_STATUSES:
        body = b""
    else:
        lines.append("Content-Length: %d" % len(body))
    if not keep_alive:
        lines.append("Connection: close")
    elif version == "HTTP/1.0":
        lines.append("Connection: keep-alive")
    if head is not None and head.method == "HEAD":
        body = b""
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body


def clean_path(path):
    """Go's path.Clean, keeping a trailing slash, as gorilla/mux does before routing."""
    if path.startswith("/") and "//" not in path and "/." not in path:
        return path  # already clean: the common case, decided without splitting
    if path == "":
        return "/"
    if path[0] != "/":
        path = "/" + path
    parts = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if parts:
                parts.pop()
            continue
        parts.append(segment)
    cleaned = "/" + "/".join(parts)
    if path.endswith("/") and cleaned != "/":
        cleaned += "/"
    return cleaned


def go_escape_path(path):
    import urllib.parse  # only needed for redirects of unclean paths
    return urllib.parse.quote(path, safe="/:@!$&'()*+,;=-._~")


# ---------------------------------------------------------------------------
# Connections: a selector thread parks idle connections and gives cheap answers, workers
# serve the rest
# ---------------------------------------------------------------------------

class Connection:
    """One client connection: socket, peer address as Go prints it, unread bytes.

    Sockets stay in blocking mode with kernel timeouts (SO_RCVTIMEO/SO_SNDTIMEO) instead of
    Python socket timeouts: each recv or send is then a single system call and a single release
    of the GIL, which keeps per-request latency low when several threads are busy.
    """

    __slots__ = ("sock", "remote_addr", "buf", "deadline", "tls", "poller", "closed")

    def __init__(self, sock, remote_addr, read_timeout):
        self.sock, self.remote_addr, self.tls = sock, remote_addr, False
        self.buf = bytearray()
        self.deadline = 0.0
        self.poller = None
        self.closed = False
        sock.settimeout(None)
        for option, seconds in ((socket.SO_RCVTIMEO, read_timeout),
                                (socket.SO_SNDTIMEO, WRITE_TIMEOUT_SECONDS)):
            whole = int(seconds)
            sock.setsockopt(socket.SOL_SOCKET, option,
                            struct.pack("ll", whole, int((seconds - whole) * 1e6)))

    def recv_more(self):
        """One recv (waits at most the read timeout); the peer closing is an error here."""
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionResetError("client closed the connection")
        self.buf += data

    def wait_readable(self, seconds):
        if self.tls and self.sock.pending():
            return True
        if self.poller is None:
            self.poller = select.poll()
            self.poller.register(self.sock.fileno(), select.POLLIN)
        return bool(self.poller.poll(seconds * 1000.0))

    def read_exact(self, size):
        while len(self.buf) < size:
            self.recv_more()
        data = bytes(self.buf[:size])
        del self.buf[:size]
        return data

    def read_line(self, limit=4096):
        while True:
            end = self.buf.find(b"\n")
            if end >= 0:
                line = bytes(self.buf[:end + 1])
                del self.buf[:end + 1]
                return line
            if len(self.buf) > limit:
                raise BadRequest(400, "chunk header too long")
            self.recv_more()

    def read_chunked(self, limit):
        body = bytearray()
        while True:
            # as Go: hex digits only (int() would also take `-5`, `0x5`, ` 5`, `5_0`)
            line = self.read_line().rstrip(b" \t\r\n").split(b";")[0]
            if not CHUNK_SIZE.fullmatch(line):
                raise BodyError("invalid byte in chunk length", bytes(body))
            size = int(line, 16)
            if len(body) + size > limit:
                raise BadRequest(413, "request body too large", body=MSG_BODY_TOO_LARGE)
            if size == 0:
                while self.read_line().strip():
                    pass  # trailers are ignored
                return bytes(body)
            body += self.read_exact(size)
            if self.read_line().strip():
                raise BodyError("malformed chunked encoding", bytes(body))

    def send(self, data):
        self.sock.sendall(data)

    def close(self):
        """Close once; returns False if it was already closed."""
        if self.closed:
            return False
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
        return True


def format_peer(address):
    if isinstance(address, tuple) and len(address) >= 2:
        host = address[0]
        return ("[%s]:%d" if ":" in host else "%s:%d") % (host, address[1])
    return "@"  # Unix socket peers, as Go prints them


CALLS_PER_TURN = 8  # call_soon callbacks per loop turn (a command start blocks while it spawns)


class Timers:
    """Callbacks due at monotonic times, for the loop thread only: a heap where a cancelled
    entry stays until it comes up (or until cancelled entries are the larger part)."""

    def __init__(self):
        self.heap = []
        self.order = itertools.count()  # equal times: first added, first run
        self.cancelled = 0

    def add(self, when, callback):
        entry = [when, next(self.order), callback]
        heapq.heappush(self.heap, entry)
        return entry

    def cancel(self, entry):
        if entry[2] is None:
            return
        entry[2] = None
        self.cancelled += 1
        if self.cancelled > 64 and self.cancelled * 2 > len(self.heap):
            # long command-timeouts of runs that ended early must not pile up
            self.heap = [e for e in self.heap if e[2] is not None]
            heapq.heapify(self.heap)
            self.cancelled = 0

    def next_due(self):
        """The time of the next live callback, or None."""
        while self.heap and self.heap[0][2] is None:
            heapq.heappop(self.heap)
            self.cancelled -= 1
        return self.heap[0][0] if self.heap else None

    def run_due(self, now, call):
        while self.heap and self.heap[0][0] <= now:
            entry = heapq.heappop(self.heap)
            callback, entry[2] = entry[2], None
            if callback is None:
                self.cancelled -= 1
            else:
                call(callback)


class ConnectionLoop(threading.Thread):
    """Accepts connections and reads request heads without holding a worker thread: a slow or
    idle client costs a file descriptor, not a thread.  A complete request is served right
    here (Server.serve_in_loop) when nothing has to block: answers that run no command,
    background runs, and captured commands, whose output pipe and exit this thread waits for
    (WatchedRun) like the rest.  Anything else goes to the pool."""

    def __init__(self, server, listeners):
        threading.Thread.__init__(self, name="connections", daemon=True)
        self.server = server
        self.listeners = {l.fileno(): l for l in listeners}
        self.epoll = select.epoll()
        self.parked = {}
        self.lock = threading.Lock()
        self.open_count = 0
        self.accept_paused = False
        self.stopping = False
        self.watched = {}  # fd -> callback: pipes and pidfds of the commands of WatchedRuns
        self.timers = Timers()
        self.calls = deque()  # callbacks from call_soon, run after the events at hand
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)  # a full pipe means a wake-up is pending anyway
        self.epoll.register(self.wake_r, select.EPOLLIN)
        for fd, listener in self.listeners.items():
            listener.setblocking(False)
            self.epoll.register(fd, select.EPOLLIN)

    def run(self):
        next_sweep = time.monotonic() + 1.0
        while True:
            timeout = 1.0 if self.parked or self.accept_paused else -1
            due = self.timers.next_due()
            if self.calls:
                timeout = 0
            elif due is not None:
                left = max(0.0, due - time.monotonic())
                timeout = left if timeout < 0 else min(timeout, left)
            try:
                events = self.epoll.poll(timeout)
            except InterruptedError:
                continue
            for fd, _ in events:
                if fd == self.wake_r:
                    try:
                        os.read(self.wake_r, 512)
                    except OSError:
                        pass
                elif fd in self.listeners:
                    self._accept(self.listeners[fd])
                else:
                    conn = self.parked.pop(fd, None)
                    if conn is not None:
                        self._readable(conn)
                    elif fd in self.watched:
                        self._call(self.watched[fd])
            for _ in range(min(len(self.calls), CALLS_PER_TURN)):
                self._call(self.calls.popleft())
            now = time.monotonic()
            self.timers.run_due(now, self._call)
            if self.stopping and (self.listeners or self.parked):
                self._close_listeners()  # the thread goes on: runs may still finish here
                self._close_parked()
            if now >= next_sweep:
                next_sweep = now + 1.0
                for fd, conn in list(self.parked.items()):
                    if conn.deadline <= now and self.parked.pop(fd, None) is conn:
                        self.close(conn)
                self._resume_accepting()  # after an accept error, retried once a second

    def _accept(self, listener):
        while not self.accept_paused:
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.error("accept: %s", exc)
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    with self.lock:  # the listener stays readable: retrying now would spin
                        self._pause_accepting()
                return
            with self.lock:
                self.open_count += 1
                if self.open_count >= self.server.max_connections:
                    self._pause_accepting()
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock, format_peer(address), self.server.header_timeout)
            if self.server.tls_context is not None:
                self.server.workers.submit(self.server.serve_tls, conn)
            else:
                self.park(conn, time.monotonic() + self.server.header_timeout, register=True)

    def _pause_accepting(self):
        self.accept_paused = True
        for fd in self.listeners:
            self.epoll.modify(fd, 0)

    def _readable(self, conn):
        was_empty = not conn.buf
        try:
            data = conn.sock.recv(65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            self.park(conn, conn.deadline)
            return
        except OSError:
            data = b""
        if not data:
            self.close(conn)
            return
        conn.buf += data
        if head_end(conn.buf) >= 0:
            self.serve(conn)
        elif len(conn.buf) > MAX_HEADER_BYTES:
            self.server.workers.submit(self.server.reject, conn,
                                       BadRequest(431, "request header too large"))
        else:
            deadline = time.monotonic() + self.server.header_timeout if was_empty \
                else conn.deadline
            self.park(conn, deadline)

    def serve(self, conn):
        """Server.serve_in_loop: the complete requests in conn's buffer."""
        try:
            self.server.serve_in_loop(conn)
        except Exception:  # a bug must cost one connection, not this thread
            log.exception("unexpected error answering %s", conn.remote_addr)
            self.close(conn)

    def _call(self, callback):
        try:
            callback()
        except Exception:  # a bug must cost one request, not this thread
            log.exception("unexpected error in the connection loop")

    # -- for WatchedRun and the server: descriptors, timers, calls from other threads -----

    def watch(self, fd, callback):
        """callback() in this thread whenever fd is readable, until unwatch(fd)."""
        self.epoll.register(fd, select.EPOLLIN)
        self.watched[fd] = callback

    def unwatch(self, fd):
        self.watched.pop(fd, None)
        try:
            self.epoll.unregister(fd)
        except OSError:
            pass

    def call_later(self, delay, callback):
        """callback() in this thread after delay seconds; returns a handle for cancel()."""
        return self.timers.add(time.monotonic() + delay, callback)

    def cancel(self, timer):
        self.timers.cancel(timer)

    def call_soon(self, callback):
        """callback() in this thread soon; may be called from any thread."""
        self.calls.append(callback)
        if threading.get_ident() != self.ident:
            try:
                os.write(self.wake_w, b"x")
            except BlockingIOError:
                pass

    def park(self, conn, deadline, register=False):
        """Hand a connection (back) to this thread until its next request head is complete."""
        if self.stopping:
            self.close(conn)
            return
        conn.deadline = deadline
        fd = conn.sock.fileno()
        self.parked[fd] = conn
        try:
            if register:
                self.epoll.register(fd, select.EPOLLIN | select.EPOLLONESHOT)
            else:
                self.epoll.modify(fd, select.EPOLLIN | select.EPOLLONESHOT)
        except OSError:
            self.parked.pop(fd, None)
            self.close(conn)

    def close(self, conn):
        if not conn.close():
            return
        with self.lock:
            self.open_count -= 1
        self._resume_accepting()

    def _resume_accepting(self):
        """Accept again when paused and below -max-connections."""
        with self.lock:
            if self.accept_paused and self.open_count < self.server.max_connections \
                    and not self.stopping:
                self.accept_paused = False
                for fd in self.listeners:
                    self.epoll.modify(fd, select.EPOLLIN)

    def stop(self):
        """Stop accepting and close idle connections (done by this thread, woken up here);
        busy ones close after their answer."""
        self.stopping = True
        try:
            os.write(self.wake_w, b"x")
        except BlockingIOError:
            pass

    def _close_listeners(self):
        with self.lock:  # _resume_accepting in a worker must not touch a closed listener
            listeners, self.listeners = self.listeners, {}
        for fd, listener in listeners.items():
            self.epoll.unregister(fd)
            listener.close()

    def _close_parked(self):
        for fd in list(self.parked):
            conn = self.parked.pop(fd, None)
            if conn is not None:
                self.close(conn)


# ---------------------------------------------------------------------------
# The server: routing and the hook pipeline
# ---------------------------------------------------------------------------

INLINE_BODY_LIMIT = 64 << 10  # bodies up to this size, already read, may be answered inline
INLINE_REQUESTS_PER_TURN = 16  # then a long pipeline goes to a worker: other clients wait less


class Exchange:
    """One request in flight: its head, what decide() found, and the answer once known."""

    __slots__ = ("head", "rid", "keep_alive", "started", "hook", "request", "headers",
                 "broken", "response")

    def __init__(self, head, rid, keep_alive):
        self.head, self.rid, self.keep_alive = head, rid, keep_alive
        self.started = time.monotonic()
        self.hook = self.request = self.headers = self.response = None
        self.broken = False  # the body broke off: answer, then close


class Server:
    """Routes requests and runs hooks: find hook -> parse payload -> check rules (decide) ->
    build argv/env -> run (act) -> respond.  decide() never blocks once the body is in the
    buffer, so the loop thread runs it for small requests and answers those that end there."""

    def __init__(self, opts, registry):
        self.opts = opts
        self.registry = registry
        self.prefix = "/" + opts.urlprefix + "/" if opts.urlprefix else "/"
        self.response_headers = {canonical_header(n): v for n, v in opts.header}
        methods = opts.http_methods.replace(" ", "")
        self.default_methods = tuple(m.upper() for m in methods.split(",")) if methods else ()
        self.status_path = opts.status_path
        self.max_body = opts.max_body_bytes if opts.max_body_bytes > 0 else sys.maxsize
        self.header_timeout = float(opts.read_header_timeout) if opts.read_header_timeout > 0 \
            else NO_TIMEOUT
        self.max_connections = max(1, opts.max_connections)
        self.workers = WorkerPool(opts.max_workers, "worker")
        self.async_runs = WorkerPool(opts.max_async_runs, "command")  # where no WatchedRun
        self.async_slots = HookGate(max(1, opts.max_async_runs))  # background runs at once
        self.runner = CommandRunner()
        self.tls_context = None
        self.loop = None
        self.stopping = False
        self.busy = 0
        self.async_backlog = 0  # background runs accepted and not finished
        self.request_numbers = itertools.count(int.from_bytes(os.urandom(3), "big"))
        self.busy_lock = threading.Lock()
        self.started = time.time()
        self.debug = opts.debug

    # -- bookkeeping for the graceful stop -------------------------------------------------

    def enter_busy(self):
        with self.busy_lock:
            self.busy += 1

    def leave_busy(self):
        with self.busy_lock:
            self.busy -= 1

    # -- connections -------------------------------------------------------------------------

    def serve(self, conn):
        """Serve requests on conn while they come; park it when it goes idle."""
        try:
            while True:
                end = head_end(conn.buf)
                if end < 0:
                    if len(conn.buf) > MAX_HEADER_BYTES:
                        raise BadRequest(431, "request header too large")
                    if conn.buf and time.monotonic() > conn.deadline:
                        raise ConnectionResetError("request head not complete in time")
                    if not self.linger(conn):
                        return
                    continue
                head_bytes = bytes(conn.buf[:end])
                del conn.buf[:end]
                if not self.handle(conn, head_bytes) or self.stopping:
                    break
                conn.deadline = time.monotonic() + self.header_timeout
                if not conn.buf and not self.linger(conn):
                    return
        except BadRequest as exc:
            self.reject(conn, exc)
            return
        except (OSError, ValueError):
            pass
        self.loop.close(conn)

    def linger(self, conn):
        """Wait briefly in this thread for more of the next request, else park the connection
        with the selector.  TLS connections stay with their worker.  True: bytes arrived."""
        if conn.tls:
            wait = self.header_timeout if conn.buf else KEEPALIVE_IDLE_SECONDS
        else:
            wait = 0.0 if self.workers.busy() else LINGER_SECONDS
        if wait and conn.wait_readable(wait):
            if not conn.buf:
                conn.deadline = time.monotonic() + self.header_timeout
            conn.recv_more()
            return True
        if conn.tls:
            raise ConnectionResetError("idle TLS connection")
        if conn.buf:
            self.loop.park(conn, conn.deadline)
        else:
            self.loop.park(conn, time.monotonic() + KEEPALIVE_IDLE_SECONDS)
        return False

    def serve_tls(self, conn):
        try:
            conn.sock = self.tls_context.wrap_socket(conn.sock, server_side=True,
                                                     do_handshake_on_connect=False)
            conn.tls = True
            conn.sock.do_handshake()
        except (OSError, ValueError) as exc:
            log.info("TLS handshake with %s failed: %s", conn.remote_addr, exc)
            self.loop.close(conn)
            return
        conn.deadline = time.monotonic() + self.header_timeout
        self.serve(conn)

    def reject(self, conn, exc):
        log.info("bad request from %s: %s", conn.remote_addr, exc)
        try:
            conn.send(exc.response())
            # half-close and read what the client is still sending, so that it can read the
            # answer instead of getting a reset for unread data
            conn.sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + 1.0
            drained = 0
            while drained < MAX_HEADER_BYTES and time.monotonic() < deadline:
                if not conn.wait_readable(deadline - time.monotonic()):
                    break
                chunk = conn.sock.recv(65536)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass
        self.loop.close(conn)

    def handle(self, conn, head_bytes):
        """One request on conn: returns True to keep the connection open."""
        exchange = self.begin(parse_head(head_bytes))
        try:
            self.step(self.decide, conn, exchange)
        except BaseException:
            self.leave_busy()
            raise
        self.complete(conn, exchange)
        return exchange.keep_alive

    def complete(self, conn, exchange, unsent=None):
        """act (when decide() left a command to run) -> send the answer, or the `unsent` rest
        of it -> log the request."""
        try:
            if unsent is None:
                if exchange.response is None:
                    self.step(self.act, conn, exchange)
                unsent = self.answer_bytes(exchange)
            if unsent:
                conn.send(unsent)
        finally:
            self.leave_busy()
        self.log_request(exchange)

    def begin(self, head):
        exchange = Exchange(head, self.request_id(head), head.keep_alive() and not self.stopping)
        self.enter_busy()
        return exchange

    def step(self, work, conn, exchange):
        """decide or act; a bug must cost one 500, not a hung connection."""
        try:
            work(conn, exchange)
        except (BadRequest, OSError):
            raise
        except Exception:
            log.exception("unexpected error handling %s %s", exchange.head.method,
                          exchange.head.target)
            exchange.response = Response(500, b"500 Internal Server Error", close=True)

    def answer_bytes(self, exchange):
        """The serialized answer (b"" when it was streamed while the command ran)."""
        response = exchange.response
        if response.close:
            exchange.keep_alive = False
        if response.sent:
            return b""
        return serialize_response(response, exchange.head, exchange.keep_alive)

    def log_request(self, exchange):
        if log.isEnabledFor(logging.INFO):
            head, response = exchange.head, exchange.response
            log.info("[%s] %d | %d B | %.6fms | %s | %s %s", exchange.rid, response.status,
                     len(response.body), (time.monotonic() - exchange.started) * 1000.0,
                     head.get("Host"), head.method,
                     redact_target(head.target, response.secret_params))

    # -- answering in the loop thread --------------------------------------------------------

    def serve_in_loop(self, conn):
        """Loop thread: answer the complete requests in conn.buf, in order, with non-blocking
        sends.  Anything that could block (a body still to come, TLS, streamed output, a
        full socket buffer) goes to a worker together with the connection, at the request
        where it happens.  A captured command keeps the connection in this thread: its end
        answers the request and serves the next ones (act_in_loop)."""
        for _ in range(INLINE_REQUESTS_PER_TURN):
            end = head_end(conn.buf)
            if end < 0:
                break
            head = self.inline_head(conn, end)
            if head is None:
                self.workers.submit(self.serve, conn)
                return
            del conn.buf[:end]
            exchange = self.begin(head)
            try:
                self.step(self.decide, conn, exchange)
                if exchange.response is None and self.acts_in_loop(exchange.hook):
                    self.step(self.act_in_loop, conn, exchange)
                    if exchange.response is None:
                        return  # the command runs; its end carries on with conn
            except BadRequest as exc:
                self.leave_busy()
                self.workers.submit(self.reject, conn, exc)
                return
            except (OSError, ValueError):
                self.leave_busy()
                self.loop.close(conn)
                return
            if exchange.response is None:  # a command runs in a worker
                self.workers.submit(self.resume, conn, exchange)
                return
            if not self.send_in_loop(conn, exchange):
                return
        else:
            if head_end(conn.buf) >= 0:  # a long pipeline: the rest is served by a worker
                self.workers.submit(self.serve, conn)
                return
        if len(conn.buf) > MAX_HEADER_BYTES:
            self.workers.submit(self.reject, conn, BadRequest(431, "request header too large"))
        elif conn.buf:
            self.loop.park(conn, conn.deadline)
        else:
            self.loop.park(conn, time.monotonic() + KEEPALIVE_IDLE_SECONDS)

    def send_in_loop(self, conn, exchange):
        """Loop thread: send the answer without blocking (the rest from a worker) and log the
        request.  True when conn stays with this thread for its next request."""
        answer = self.answer_bytes(exchange)
        try:
            sent = conn.sock.send(answer, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self.leave_busy()
            self.loop.close(conn)
            return False
        if sent < len(answer):
            self.workers.submit(self.resume, conn, exchange, answer[sent:])
            return False
        self.leave_busy()
        self.log_request(exchange)
        if not exchange.keep_alive or self.stopping:
            self.loop.close(conn)
            return False
        conn.deadline = time.monotonic() + self.header_timeout
        return True

    def inline_head(self, conn, end):
        """The parsed head when the loop thread can answer this request without blocking:
        plain TCP, no 100-continue, a small Content-Length body already in the buffer.
        None sends the request the usual way (a worker; malformed heads are refused there)."""
        if conn.tls:
            return None
        try:
            head = parse_head(bytes(conn.buf[:end]))
            size = self.body_length(head)
        except BadRequest:
            return None
        if size is None or size > INLINE_BODY_LIMIT or len(conn.buf) - end < size \
                or "Expect" in head.headers:
            return None
        return head

    def resume(self, conn, exchange, unsent=None):
        """Worker: finish a request the loop thread began (run its command, or send the rest
        of its answer), then serve the connection as usual."""
        try:
            self.complete(conn, exchange, unsent)
        except (OSError, ValueError):
            self.loop.close(conn)
            return
        if not exchange.keep_alive or self.stopping:
            self.loop.close(conn)
            return
        conn.deadline = time.monotonic() + self.header_timeout
        self.serve(conn)

    def body_length(self, head):
        """The declared body size (None: chunked); a bad or too large one is refused."""
        if "Transfer-Encoding" in head.headers:
            encoding = ",".join(head.headers["Transfer-Encoding"]).strip().lower()
            if encoding != "chunked":
                raise BadRequest(501, "unsupported transfer encoding",
                                 body=b"Unsupported transfer encoding")
            return None
        lengths = head.headers.get("Content-Length")
        if not lengths:
            return 0
        if len(set(lengths)) != 1 or not is_ascii_digits(lengths[0]):
            raise BadRequest(400, "bad Content-Length")
        size = int(lengths[0])
        if size > self.max_body:
            raise BadRequest(413, "request body too large", body=MSG_BODY_TOO_LARGE)
        return size

    def read_body(self, conn, head):
        """The request body; Content-Length or chunked; capped at -max-body-bytes."""
        size = self.body_length(head)
        return conn.read_chunked(self.max_body) if size is None else conn.read_exact(size)

    def decide(self, conn, exchange):
        """find hook -> read the body -> parse payload -> check rules: sets exchange.response
        for a plain answer, else leaves it None with what act() needs to run the command."""
        head = exchange.head
        expects_continue = head.get("Expect").lower() == "100-continue"
        hook, raw_query, answer = self.find_hook(head)
        if answer is not None:
            exchange.response = self.without_body(conn, head, answer, expects_continue)
            return
        if expects_continue:
            self.body_length(head)  # a body we would refuse is refused before it is sent
            conn.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            body = self.read_body(conn, head)
        except BodyError as exc:  # as upstream: logged, the hook runs with what was read
            log.info("error reading the request body: %s", exc)
            body, exchange.broken = exc.partial, True
        exchange.hook = hook
        self.check_hook(conn, exchange, raw_query, body)
        if exchange.response is not None:
            self.finish_hook_response(exchange)

    def act(self, conn, exchange):
        """build argv/env -> run -> respond, in one of three modes."""
        hook, request, headers = exchange.hook, exchange.request, exchange.headers
        success = self.status_or_200(hook.success_status, request.id, hook)
        if hook.stream_output:
            response = self.run_streamed(conn, exchange.head, hook, request, headers, success)
        elif hook.capture_output:
            response = self.captured_response(hook, self.run_command(hook, request), headers,
                                              success)
        elif not self.run_async(hook, request):
            log.info("[%s] %d background runs waiting already: %s refused", request.id,
                     ASYNC_BACKLOG_LIMIT, hook.id)
            response = Response(503, MSG_BACKLOG_FULL, headers)
        else:
            response = Response(success, hook.response_message.encode("utf-8", "surrogateescape"),
                                headers)
        exchange.response = response
        self.finish_hook_response(exchange)

    @staticmethod
    def finish_hook_response(exchange):
        response = exchange.response
        response.close = response.close or exchange.broken
        response.secret_params = exchange.hook.secret_params

    def find_hook(self, head):
        """(hook, raw query, None) for a hook that may run, else (None, None, the answer)."""
        target = head.target
        if target.startswith(("http://", "https://")):
            target = "/" + target.split("/", 3)[3] if target.count("/") >= 3 else "/"
        if target == "*" and head.method == "OPTIONS":
            return None, None, Response(200)
        raw_path, _, raw_query = target.partition("?")
        path = go_unescape(raw_path, False)
        if path is None or not raw_path.startswith("/"):
            raise BadRequest(400, "invalid request target")
        cleaned = clean_path(path)
        if cleaned != path:
            location = go_escape_path(cleaned) + ("?" + raw_query if raw_query else "")
            return None, None, Response(301, b"", {"Location": location})
        if path == "/":
            return None, None, Response(200, b"OK")
        if self.status_path and path == self.status_path:
            return None, None, self.status_response(head)
        if not path.startswith(self.prefix) or "\n" in path:
            return None, None, Response(404, MSG_PAGE_NOT_FOUND, {
                "Content-Type": TEXT_PLAIN, "X-Content-Type-Options": "nosniff"})
        hook_id = path[len(self.prefix):]
        hook = self.registry.hook(hook_id)
        if hook is None:
            return None, None, Response(404, MSG_HOOK_NOT_FOUND)
        allowed = hook.allowed_methods or self.default_methods
        if allowed and head.method not in allowed:
            log.info("HTTP %s method not allowed for hook %s", head.method, json.dumps(hook_id))
            return None, None, Response(405)
        return hook, raw_query, None

    def without_body(self, conn, head, response, expects_continue):
        """Answer without needing the body: skip it, or close if the client waits for 100."""
        if expects_continue:
            response.close = True
        else:
            try:
                self.read_body(conn, head)
            except BodyError:
                response.close = True
        return response

    def request_id(self, head):
        if self.opts.x_request_id:
            given = head.get("X-Request-Id")
            if given:
                limit = self.opts.x_request_id_limit
                return given[:limit] if limit > 0 else given
        return "%06x" % (next(self.request_numbers) & 0xFFFFFF)

    # -- the hook pipeline ---------------------------------------------------------------

    def check_hook(self, conn, exchange, raw_query, body):
        """parse payload -> check rules, once the hook is found and its method allowed."""
        head, rid, hook = exchange.head, exchange.rid, exchange.hook
        if log.isEnabledFor(logging.INFO):
            log.info("[%s] incoming HTTP %s request from %s", rid, head.method, conn.remote_addr)
            log.info("[%s] %s got matched", rid, hook.id)
        if self.debug:
            shown = {name: ["<redacted>"] if name in hook.secret_headers else values
                     for name, values in head.headers.items()}
            log.debug("[%s] request dump: %s %s %s %r (%d byte body)", rid, head.method,
                      redact_target(head.target, hook.secret_params), head.version, shown,
                      len(body))
        headers = dict(self.response_headers)
        request_content_type = head.get("Content-Type")
        request = HookRequest(rid, head.method, conn.remote_addr,
                              {k: v[0] for k, v in head.headers.items()
                               if k not in ("Host", "Transfer-Encoding")},
                              parse_query(raw_query)[0], body,
                              hook.incoming_content_type or request_content_type)
        # parse payload
        try:
            messages = parse_payload(request, hook, request_content_type)
        except MultipartError as exc:
            log.info("[%s] error parsing multipart form: %s", rid, exc)
            exchange.response = Response(500, MSG_MULTIPART_ERROR, headers)
            return
        messages += apply_json_parameters(hook, request)
        for message in messages:
            log.info("[%s] %s", rid, message)

        # check rules
        satisfied, error, note = rules_satisfied(hook, request)
        if note:
            log.info("[%s] %s", rid, note)
        if error is not None:
            log.info("[%s] error evaluating hook: %s", rid, error)
            exchange.response = Response(500, MSG_RULES_ERROR, headers)
        elif not satisfied:
            log.info("[%s] %s got matched, but didn't get triggered because the trigger rules "
                     "were not satisfied", rid, hook.id)
            exchange.response = Response(self.status_or_200(hook.mismatch_status, rid, hook),
                                         MSG_RULES_NOT_SATISFIED, headers)
        else:
            log.info("[%s] %s hook triggered successfully", rid, hook.id)
            for name, value in hook.response_headers:
                headers[canonical_header(name)] = value
            exchange.request, exchange.headers = request, headers

    @staticmethod
    def status_or_200(code, rid, hook):
        if not code:
            return 200
        if code in GO_STATUS_TEXT and code >= 200:
            return code
        log.info("[%s] %s got matched, but the configured return code %d is unknown - "
                 "defaulting to 200", rid, hook.id, code)
        return 200

    def invocation(self, hook, request):
        """build argv/env, logged: an Invocation, or the CommandResult of a command that
        cannot be found."""
        try:
            invocation = build_invocation(hook, request)
        except OSError as exc:
            log.info("[%s] error in exec: %s", request.id, exc.strerror)
            if " " in hook.execute_command:
                log.info("[%s] use 'pass-arguments-to-command' to specify args for '%s'",
                         request.id, hook.execute_command.split()[0])
            return CommandResult(False, error=exc)
        for message in invocation.messages:
            log.info("[%s] %s", request.id, message)
        return invocation

    def run_command(self, hook, request, on_output=None, keep_output=True, slot_held=False):
        """build argv/env -> wait for a max-concurrency slot (unless the caller holds one) ->
        run -> log: a CommandResult."""
        invocation = self.invocation(hook, request)
        if isinstance(invocation, CommandResult):
            return invocation
        gate = None if slot_held else self.gate(hook)
        if gate is not None:
            gate.wait_turn()
        try:
            result = self.runner.run(invocation, request.id, hook.command_timeout, on_output,
                                     keep_output)
        finally:
            if gate is not None:
                gate.leave()
        self.log_result(hook, request.id, result, on_output is None and keep_output)
        return result

    def log_result(self, hook, rid, result, output_collected):
        if not result.started:
            log.info("[%s] error occurred: %s", rid, result.error)
        else:
            if output_collected:
                log.info("[%s] command output: %s", rid,
                         result.output.decode("utf-8", "replace"))
            if result.timed_out:
                log.info("[%s] error occurred: command timed out after %gs; process group "
                         "stopped", rid, hook.command_timeout)
            elif result.returncode:
                log.info("[%s] error occurred: %s", rid, describe_exit(result.returncode))
        log.info("[%s] finished handling %s", rid, hook.id)

    @staticmethod
    def captured_response(hook, result, headers, success):
        """The answer of include-command-output-in-response, once the command has ended."""
        if result.ok:
            return Response(success, result.output, headers)
        headers["Content-Type"] = TEXT_PLAIN
        if result.timed_out:
            return Response(504, MSG_TIMED_OUT, headers)
        body = result.output if hook.capture_output_on_error else MSG_COMMAND_ERROR
        return Response(500, body, headers)

    def gate(self, hook):
        return self.registry.gate(hook.id) or HookGate(0)

    def run_async(self, hook, request):
        """Default mode: answer now; the run waits for its max-concurrency slot and then for
        one of the -max-async-runs background slots without holding a thread, then runs:
        waited for by the loop thread where it can watch processes, else in the background
        pool.  False if the backlog is full."""
        with self.busy_lock:
            if self.async_backlog >= ASYNC_BACKLOG_LIMIT:
                return False
            self.async_backlog += 1
        self.enter_busy()
        gate = self.gate(hook)
        keep_output = log.isEnabledFor(logging.INFO)  # a background run's output is only logged

        def dropped():
            stopping = self.stopping
            if stopping:
                log.info("[%s] stopping: queued run of %s dropped", request.id, hook.id)
            return stopping

        def release():
            gate.leave()
            with self.busy_lock:
                self.async_backlog -= 1
            self.leave_busy()

        if self.runner.can_watch():
            def finished(_result=None):
                self.async_slots.leave()
                release()

            def start():  # loop thread
                if dropped():
                    finished()
                    return
                try:
                    self.run_in_loop(hook, request, keep_output, finished, slot_held=True)
                except Exception:  # a bug must not keep the run counted forever
                    log.exception("unexpected error starting %s", hook.id)
                    finished()
            gate.enter(lambda: self.async_slots.enter(
                functools.partial(self.loop.call_soon, start)))
            return True

        def job():
            try:
                if not dropped():
                    self.run_command(hook, request, keep_output=keep_output, slot_held=True)
            finally:
                release()
        gate.enter(lambda: self.async_runs.submit(job))
        return True

    # -- commands waited for in the loop thread ----------------------------------------------

    def acts_in_loop(self, hook):
        """Whether act() may run in the loop thread: a background run is only scheduled there,
        a captured one needs processes the loop can watch; streamed output needs a worker."""
        if hook.stream_output:
            return False
        return not hook.capture_output or self.runner.can_watch()

    def act_in_loop(self, conn, exchange):
        """Loop thread: act() without blocking.  A captured command is started and waited for
        here; exchange.response stays None until it has ended, then its answer is sent and the
        connection served on from here."""
        hook, request, headers = exchange.hook, exchange.request, exchange.headers
        if not hook.capture_output:
            self.act(conn, exchange)
            return
        success = self.status_or_200(hook.success_status, request.id, hook)

        def finished(result):
            exchange.response = self.captured_response(hook, result, headers, success)
            self.finish_hook_response(exchange)
            if self.send_in_loop(conn, exchange):
                self.loop.serve(conn)
        self.run_in_loop(hook, request, True, finished)

    def run_in_loop(self, hook, request, keep_output, on_done, slot_held=False):
        """run_command without a thread, in the loop thread: build argv/env -> wait for a
        max-concurrency slot (unless the caller holds one) holding nothing -> start -> the loop
        waits for the end -> log -> on_done(result), in the loop thread; after this returns
        unless slot_held (act_in_loop's caller is still serving the connection)."""
        invocation = self.invocation(hook, request)
        if isinstance(invocation, CommandResult):
            self.loop.call_soon(functools.partial(on_done, invocation))
            return
        gate = None if slot_held else self.gate(hook)

        def finished(result):
            if gate is not None:
                gate.leave()
            self.log_result(hook, request.id, result, keep_output)
            on_done(result)

        def start():
            try:
                started = self.runner.launch(invocation, request.id, keep_output)
            except Exception as exc:  # a bug must cost one run, not a request left hanging
                log.exception("unexpected error starting %s", hook.id)
                started = CommandResult(False, error=exc)
            if isinstance(started, CommandResult):
                finished(started)
                return
            try:
                WatchedRun(self.runner, started, self.loop, hook.command_timeout, finished)
            except OSError:  # no descriptor left for a pidfd: a worker waits instead
                self.workers.submit(self.wait_in_worker, started, hook.command_timeout, finished)
        if gate is None:
            start()
        else:
            gate.enter(functools.partial(self.loop.call_soon, start))

    def wait_in_worker(self, started, timeout, on_done):
        try:
            result = self.runner.wait(started, timeout)
        except Exception as exc:  # a bug must cost one run, not a request left hanging
            log.exception("unexpected error waiting for a command")
            result = CommandResult(False, error=exc)
        self.loop.call_soon(functools.partial(on_done, result))

    def run_streamed(self, conn, head, hook, request, headers, success):
        """stream-command-output: chunked output while the command runs.  A failed or timed
        out run ends without the closing chunk, so the client sees an incomplete response."""
        chunked = head.version == "HTTP/1.1"
        state = {"head_sent": False, "client_gone": False}
        headers.setdefault("Content-Type", TEXT_PLAIN)

        def send(data):
            if state["client_gone"]:
                return  # keep draining: a deploy is not cut short by a client hanging up
            try:
                conn.send(data)
            except OSError:
                state["client_gone"] = True

        def send_head():
            lines = ["HTTP/1.1 %d %s" % (success, GO_STATUS_TEXT[success])]
            lines += header_lines(headers)
            lines += ["Date: " + http_date(),
                      "Transfer-Encoding: chunked" if chunked else "Connection: close", "", ""]
            send("\r\n".join(lines).encode("utf-8", "surrogateescape"))
            state["head_sent"] = True

        def on_output(chunk):
            if not state["head_sent"]:
                send_head()
            if head.method != "HEAD":
                send(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)

        result = self.run_command(hook, request, on_output)
        if not result.started:
            headers["Content-Type"] = TEXT_PLAIN
            return Response(500, MSG_COMMAND_ERROR, headers)
        if not state["head_sent"]:
            send_head()
        with_body = head.method != "HEAD"
        if result.ok and chunked and with_body:
            send(b"0\r\n\r\n")
        keep_alive = result.ok and (chunked or not with_body) and not state["client_gone"]
        return Response(success, b"", headers, close=not keep_alive, sent=True)

    # -- status page ---------------------------------------------------------------------

    def status_response(self, head):
        if head.method not in ("GET", "HEAD"):
            return Response(405)
        files, errors = self.registry.status()
        runs = {}
        for hook_id, gate in list(self.registry.gates.items()):
            if gate.running or gate.waiting:
                runs[hook_id] = {"running": gate.running, "queued": len(gate.waiting)}
        degraded = self.registry.count() == 0 or self.registry.last_reload_failed
        now = time.time()
        document = {
            "status": "degraded" if degraded else "ok",
            "version": VERSION,
            "implementation": "webhookd.py",
            "started": iso_time(self.started),
            "uptime_seconds": round(now - self.started, 3),
            "hooks_loaded": self.registry.count(),
            "hooks_files": files,
            "last_load": iso_time(self.registry.last_load),
            "last_reload_failed": self.registry.last_reload_failed,
            "load_errors": errors,
            "runs": runs,
            "runs_in_progress": sum(r["running"] for r in runs.values()),
            "runs_queued": sum(r["queued"] for r in runs.values()),
        }
        body = (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()
        return Response(200, body, {"Content-Type": "application/json",
                                    "Cache-Control": "no-store"})


def describe_exit(returncode):
    if returncode < 0:
        try:
            return "signal: %s" % signal.Signals(-returncode).name
        except ValueError:
            return "signal: %d" % -returncode
    return "exit status %d" % returncode


# ---------------------------------------------------------------------------
# systemd integration: sd_notify and socket activation
# ---------------------------------------------------------------------------

class Notifier:
    """sd_notify without libsystemd: one datagram to $NOTIFY_SOCKET (`@` = abstract)."""

    def __init__(self, environ):
        address = environ.pop("NOTIFY_SOCKET", "")  # commands must not inherit it
        if address.startswith("@"):
            address = "\0" + address[1:]
        self.address = address or None

    def notify(self, message):
        if not self.address:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.connect(self.address)
                sock.sendall(message.encode())
        except OSError as exc:
            log.warning("sd_notify %r failed: %s", message, exc)

    def reloading(self):
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.notify("RELOADING=1\nMONOTONIC_USEC=%d" % usec)


def inherited_listeners(environ):
    """Sockets passed by systemd socket activation (LISTEN_PID/LISTEN_FDS, from fd 3)."""
    pid, count = environ.pop("LISTEN_PID", ""), environ.pop("LISTEN_FDS", "")
    environ.pop("LISTEN_FDNAMES", None)
    if not pid.isdigit() or int(pid) != os.getpid() or not count.isdigit():
        return []
    listeners = []
    for fd in range(3, 3 + int(count)):
        os.set_inheritable(fd, False)
        listeners.append(socket.socket(fileno=fd))
    return listeners


# ---------------------------------------------------------------------------
# Process setup: logging, listeners, TLS, privileges, pidfile
# ---------------------------------------------------------------------------

def setup_logging(opts):
    """Upstream logs nothing without -verbose; with it, `[webhook] date time message`, written
    by a thread of its own: a request never waits for stderr or the log file."""
    if not (opts.verbose or opts.debug or opts.logfile):
        log.setLevel(logging.CRITICAL + 1)
        log.propagate = False
        return None
    from logging import handlers  # only needed when logging (a plain import would rebind logging)

    class RecordQueueHandler(handlers.QueueHandler):
        def prepare(self, record):
            return record  # formatted by the logging thread, not by the request
    if opts.logfile:
        fd = os.open(opts.logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        target = logging.StreamHandler(os.fdopen(fd, "a", encoding="utf-8",
                                                 errors="backslashreplace"))
    else:
        target = logging.StreamHandler(sys.stderr)
    target.setFormatter(logging.Formatter("[webhook] %(asctime)s %(message)s",
                                          "%Y/%m/%d %H:%M:%S"))
    records = queue.SimpleQueue()
    listener = handlers.QueueListener(records, target)
    log.addHandler(RecordQueueHandler(records))
    log.setLevel(logging.DEBUG if opts.debug else logging.INFO)
    log.propagate = False
    listener.start()
    return listener


def open_listeners(opts, environ):
    inherited = inherited_listeners(environ)
    if inherited:
        log.info("using %d socket(s) passed by systemd", len(inherited))
        return inherited, "systemd socket"
    if opts.socket:
        if os.path.exists(opts.socket) and not os.path.isfile(opts.socket):
            os.unlink(opts.socket)  # a stale socket from a previous run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(opts.socket)
        sock.listen(1024)
        return [sock], "unix:" + opts.socket
    host = opts.ip
    family = socket.AF_INET6 if ":" in host or host == "" else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6 and host == "":
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        host = "::"
    sock.bind((host, opts.port))
    sock.listen(1024)
    return [sock], "%s:%d" % (("[%s]" % opts.ip) if ":" in opts.ip else opts.ip, opts.port)


def make_tls_context(opts):
    import ssl  # only needed with -secure
    versions = {"1.0": ssl.TLSVersion.TLSv1, "1.1": ssl.TLSVersion.TLSv1_1,
                "1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
    if opts.tls_min_version not in versions:
        raise SystemExit("error: unknown minimum TLS version: %s" % opts.tls_min_version)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = versions[opts.tls_min_version]
    if opts.cipher_suites:
        names = []
        for name in opts.cipher_suites.split(","):
            name = name.strip()
            if name not in GO_CIPHER_SUITES:
                raise SystemExit("error: unknown TLS cipher suite: %s" % name)
            if GO_CIPHER_SUITES[name]:
                names.append(GO_CIPHER_SUITES[name])
        if names:
            context.set_ciphers(":".join(names))
    context.set_alpn_protocols(["http/1.1"])
    try:
        context.load_cert_chain(opts.cert, opts.key)
    except (OSError, ssl.SSLError) as exc:
        raise SystemExit("error: loading TLS certificate %s / key %s: %s"
                         % (opts.cert, opts.key, exc))
    return context


# Imported only when first needed (idle memory, start-up time); before -setuid drops privileges
# they are imported at once, since the new user may not be able to read Python's library.
LAZY_MODULES = ("base64", "binascii", "calendar", "ctypes", "difflib", "hmac", "ipaddress",
                "random", "tempfile", "urllib.parse", "xml.parsers.expat")


def drop_privileges(uid, gid):
    for name in LAZY_MODULES:
        __import__(name)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def write_pidfile(path):
    try:
        with open(path) as handle:
            old = handle.read().strip()
        if old.isdigit() and os.path.exists("/proc/%s" % old) and int(old) != os.getpid():
            raise SystemExit("error: pid file found, ensure webhook is not running or delete %s"
                             % path)
    except OSError:
        pass
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, 0o755, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(str(os.getpid()))


def close_inherited_fds_on_exec():
    """Descriptors this process inherited (from a shell, a supervisor) must not reach the hook
    commands: Popen closed them in the child, posix_spawn relies on close-on-exec."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:
                pass  # the descriptor of the directory listing itself, already closed


def raise_fd_limit():
    """Go raises the soft open-files limit to the hard one at start; so do we."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


# ---------------------------------------------------------------------------
# Lifecycle: signals, hot-reload polling, graceful stop
# ---------------------------------------------------------------------------

POLL_INTERVAL = 0.2  # hot-reload polling period: a stat() per hooks file, nothing when idle


class SignalQueue:
    """Signals recorded by their handlers and handled later by the main loop.  Installed first
    thing, so a signal that arrives while starting up is not lost or fatal."""

    def __init__(self):
        self.pending = deque()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        for signum in (signal.SIGHUP, signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._record)

    def _record(self, signum, frame):
        self.pending.append(signum)

    def wait(self, timeout):
        """Sleep until a signal arrives or timeout seconds pass (None: no timeout)."""
        try:
            select.select([self.wake_r], [], [], timeout)
        except InterruptedError:
            pass
        try:
            while os.read(self.wake_r, 512):
                pass
        except OSError:
            pass


class Daemon:
    """Owns the main thread: waits for signals, polls the hooks files, stops gracefully."""

    def __init__(self, opts, registry, server, notifier, signals, cleanup_paths):
        self.opts, self.registry, self.server = opts, registry, server
        self.notifier, self.signals, self.cleanup_paths = notifier, signals, cleanup_paths

    def run(self):
        """Main loop; returns the exit status."""
        stop_deadline = None
        while True:
            polling = self.opts.hotreload or stop_deadline is not None
            self.signals.wait(POLL_INTERVAL if polling else None)
            while self.signals.pending:
                signum = self.signals.pending.popleft()
                if signum in (signal.SIGHUP, signal.SIGUSR1):
                    self.reload(signal.Signals(signum).name)
                elif stop_deadline is None:
                    stop_deadline = self.begin_stop(signum)
                else:
                    log.info("second stop signal: killing running commands")
                    self.server.runner.kill_all()
                    return self.finish()
            if stop_deadline is not None:
                if self.server.busy == 0 or time.monotonic() >= stop_deadline:
                    if self.server.busy:
                        log.info("shutdown timeout: killing %d running command(s)",
                                 len(self.server.runner.processes))
                        self.server.runner.kill_all()
                    return self.finish()
            elif self.opts.hotreload:
                changed = self.registry.poll()
                if changed:
                    self.notifier.reloading()
                    self.registry.load(changed)
                    self.notifier.notify("READY=1")

    def reload(self, reason):
        log.info("caught %s signal; reloading hooks", reason)
        self.notifier.reloading()
        self.registry.load()
        self.notifier.notify("READY=1")

    def begin_stop(self, signum):
        self.server.stopping = True
        self.server.loop.stop()  # no new connections from here on
        self.notifier.notify("STOPPING=1")
        name = "interrupt" if signum == signal.SIGINT else "terminated"
        log.info("caught %s signal; stopping: no new connections, waiting up to %ds for %d "
                 "running request(s) and command(s)", name, self.opts.shutdown_timeout,
                 self.server.busy)
        return time.monotonic() + max(0, self.opts.shutdown_timeout)

    def finish(self):
        remove_paths(self.cleanup_paths)
        log.info("exiting")
        return 0


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------

NO_HOOKS_MESSAGE = ("couldn't load any hooks from file!\naborting webhook execution since the "
                    "-verbose flag is set to false.\nIf, for some reason, you want webhook to "
                    "start without the hooks, either use -verbose flag, or -nopanic")


def run_validate(opts):
    problems = validate_files(opts.hooks, opts.template)
    for severity, message in problems:
        print("%s: %s" % (severity, message))
    errors = sum(1 for severity, _ in problems if severity == "error")
    print("%d file(s) checked: %d error(s), %d warning(s)"
          % (len(opts.hooks), errors, len(problems) - errors))
    return 1 if errors else 0


def main(argv=None):
    """Parse the command line, then validate, print something, or serve.  Exit status."""
    argv = sys.argv if argv is None else argv
    program = argv[0] if argv else "webhookd.py"
    try:
        opts = parse_flags(argv[1:])
    except HelpRequested:
        sys.stderr.write(usage_text(program))
        return 0
    except UsageError as exc:
        sys.stderr.write("%s\n%s" % (exc, usage_text(program)))
        return 2
    if opts.version:
        print("%s version %s" % (PROGRAM, VERSION))
        return 0
    if opts.list_cipher_suites:
        for name in GO_CIPHER_SUITES:
            print(name)
        return 0
    if opts.validate:
        return run_validate(opts)
    if (opts.setuid != 0) != (opts.setgid != 0):
        print("error: setuid and setgid options must be used together")
        return 1
    if opts.status_path and (not opts.status_path.startswith("/") or opts.status_path == "/"
                             or (opts.status_path + "/").startswith("/" + opts.urlprefix + "/")
                             or not opts.urlprefix):
        print("error: -status-path %r must be an absolute path outside the hooks prefix /%s/"
              % (opts.status_path, opts.urlprefix))
        return 1

    listener_thread = setup_logging(opts)
    try:
        return serve(opts)
    finally:
        if listener_thread is not None:
            listener_thread.stop()


def serve(opts):
    """Load the hooks, listen, and run until stopped.  Exit status."""
    signals = SignalQueue()
    log.info("version %s starting", VERSION)
    environ = os.environ
    notifier = Notifier(environ)
    close_inherited_fds_on_exec()
    raise_fd_limit()
    registry = Registry(opts.hooks, opts.template)
    try:
        registry.load(startup=True)
    except HooksFileError as exc:
        log.error("%s", exc)
        print(exc)
        return 1
    if registry.count() == 0 and not (opts.verbose or opts.debug or opts.logfile
                                      or opts.nopanic):
        print("[webhook] %s %s" % (time.strftime("%Y/%m/%d %H:%M:%S"), NO_HOOKS_MESSAGE))
        return 1

    cleanup = []
    server = Server(opts, registry)
    try:
        listeners, where = open_listeners(opts, environ)
    except (OSError, OverflowError, ValueError) as exc:
        message = "error listening on port: listen %s: %s" % (
            "unix " + opts.socket if opts.socket else "tcp %s:%d" % (opts.ip, opts.port),
            getattr(exc, "strerror", None) or exc)
        log.error("%s", message)
        print(message)
        return 1
    if opts.socket and where.startswith("unix:"):
        cleanup.append(opts.socket)
    try:  # a start that fails from here on leaves no socket file or pidfile behind
        if opts.pidfile:
            try:
                write_pidfile(opts.pidfile)
            except OSError as exc:
                raise SystemExit("Error creating pidfile: %s" % exc) from None
            cleanup.append(opts.pidfile)
        if opts.secure:
            server.tls_context = make_tls_context(opts)
        if opts.setuid and opts.setgid:
            try:
                drop_privileges(opts.setuid, opts.setgid)
            except OSError as exc:
                raise SystemExit("error dropping privileges: %s" % exc) from None
    except SystemExit:
        remove_paths(cleanup)
        raise
    daemon = Daemon(opts, registry, server, notifier, signals, cleanup)
    server.loop = ConnectionLoop(server, listeners)
    server.loop.start()
    scheme = "https" if opts.secure else "http"
    log.info("serving hooks on %s://%s%s{id}", scheme, where, server.prefix)
    notifier.notify("READY=1\nSTATUS=serving %d hook(s) on %s" % (registry.count(), where))
    return daemon.run()


if __name__ == "__main__":
    sys.exit(main())
