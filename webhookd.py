#!/usr/bin/env python3
"""webhookd.py -- a drop-in replacement for adnanh/webhook 2.8.0, in one file.

It serves the hooks of webhook hooks files (JSON, or YAML read as Go's webhook reads it) over HTTP:
``GET/POST /hooks/<id>`` finds the hook, parses the payload, checks the trigger rules, builds the
command's argv and environment from the request, runs the command (never through a shell) and
answers with the same status codes and bodies as the Go original.  The command line is the
original's (Go ``flag`` syntax), so an existing unit or script keeps working::

    python3 webhookd.py -nopanic -hooks /etc/webhook.conf -hotreload -verbose -port 9000

On top of upstream (each a flag or hook field the Go binary ignores, so hooks files stay portable):
polling hot reload that survives editors and ``git pull``, ``SIGHUP``/``SIGUSR1`` reload,
``-validate``, warnings for unknown hook fields, the hook fields ``max-concurrency``,
``command-timeout``, ``stream-command-output`` and ``pass-payload-to-stdin``, a graceful stop on
``SIGTERM``, systemd ``sd_notify``/socket activation, ``-socket``, ``-trusted-proxy``,
``-template`` with ``getenv``/``cat``/``credential``,
request limits (``-max-body-bytes``, ``-read-header-timeout``, ``-max-connections``,
``-max-async-runs``), a JSON ``-status-path`` and a run history under it: every run gets an id
(``X-Webhookd-Run``), a state and its output, in memory or under ``-runs-dir``, read at
``<status-path>/runs`` or with ``-runs``/``-runs-follow``.

Python 3.9+ standard library only (``http.server``, ``argparse``, ``subprocess``); runs on Linux
(glibc or musl), macOS and FreeBSD.  A request goes HookHandler -> App -> Runner -> the one
writer::

    request -> find hook -> parse payload -> check rules -> build argv/env -> run -> respond

The file reads in that order: Go's primitives used everywhere, the command line, the hooks model
(files, hooks, the registry with hot reload), HTTP (the Request and Response, then the transport:
http.server's handler and server over a waiting room), the App with its payload parsers and
rules, the runner, the run history, the status site, then the lifecycle (systemd, process
setup, signals, main with -validate and -runs); the HTML pages and the YAML reader are
appendices at the end.
"""

import argparse
import base64
import binascii
import bisect
import calendar
import contextlib
import difflib
import errno
import fcntl
import functools
import hashlib
import hmac
import html
import io
import ipaddress
import itertools
import json
import logging
import math
import os
import pwd
import queue
import random
import re
import resource
import select
import selectors
import shlex
import signal
import socket
import socketserver
import ssl
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import deque, namedtuple
from http.server import BaseHTTPRequestHandler, HTTPServer
from xml.parsers import expat

__version__ = "3.0.0"  # webhookd's own version (packaging reads this line)
VERSION = "2.8.0"  # the adnanh/webhook release whose behaviour webhookd reproduces
# How -version and the log's first line name the program (upstream: "version 2.8.0 starting");
# VERSION alone stays where health checks written for webhook read it.
VERSION_LINE = "webhookd version %s (webhook %s compatible)" % (__version__, VERSION)
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
MSG_BUSY_DROPPED = b"Hook is busy: this trigger was dropped (when-busy: drop)."
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
# Helpers used everywhere else: Go's primitives (header names, escapes, digits, addresses,
# times, errors)
# ---------------------------------------------------------------------------

# Header names are client text: the cache holds at most 4096 names of at most 64 characters
# (well under 1 MiB); longer or later names are canonicalised each time, never kept.
_CANONICAL_CACHE = {}
CANONICAL_CACHE_ENTRIES = 4096
CANONICAL_CACHE_NAME_MAX = 64
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
    if len(name) <= CANONICAL_CACHE_NAME_MAX and len(_CANONICAL_CACHE) < CANONICAL_CACHE_ENTRIES:
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


def is_ascii_digits(text):
    """0-9 only: str.isdigit() also accepts `²` and other scripts' digits, which int() refuses
    or reads, where Go's strconv refuses them all."""
    return text.isascii() and text.isdigit()


def parse_ip(text):
    """An IP address (IPv4-mapped IPv6 read as IPv4), or None."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    return getattr(address, "ipv4_mapped", None) or address


@functools.lru_cache(maxsize=256)  # the ranges of ip-whitelist rules, parsed once, not per request
def parse_cidr(text):
    if "/" not in text:
        text += "/32"
    address, _, bits = text.partition("/")
    try:
        if not bits.isdigit():
            return None
        return ipaddress.ip_network("%s/%s" % (address, bits), strict=False)
    except ValueError:
        return None


def peer_host(remote_addr):
    """The host of a remote address as format_peer() writes it (`host:port`, `[v6]:port`),
    cut as upstream's ip-whitelist does: up to the last colon, blanks and brackets trimmed."""
    host = remote_addr.rpartition(":")[0] if ":" in remote_addr else remote_addr
    return host.strip(" ").lstrip("[").rstrip("]")


def format_peer(address):
    """host:port as Go prints a remote address; an IPv4 client of a dual-stack listener is shown
    (and checked by ip-whitelist) as IPv4, as Go unmaps `::ffff:a.b.c.d`."""
    if isinstance(address, tuple) and len(address) >= 2:
        host = address[0]
        if host.lower().startswith("::ffff:") and "." in host:
            host = host[7:]
        return ("[%s]:%d" if ":" in host else "%s:%d") % (host, address[1])
    return "@"  # Unix socket peers, as Go prints them


def iso_time(timestamp):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp)) if timestamp else None


def go_errno_text(exc, op=None):
    """An OSError as Go words it: the reason in lower case (`permission denied`); with `op`,
    `open /run/x.pid: permission denied` (Go's PathError) when the error names a file."""
    text = exc.strerror or str(exc)
    text = text[:1].lower() + text[1:]
    return "%s %s: %s" % (op, exc.filename, text) if op and exc.filename is not None else text


def go_float32_text(value):
    """strconv.FormatFloat(value, 'g', -1, 32): how upstream writes a YAML float as a string."""
    if value != value:
        return "NaN"
    try:
        single = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        single = value * math.inf
    if math.isinf(single):
        return "+Inf" if single > 0 else "-Inf"
    if single == 0:
        return "-0" if math.copysign(1, single) < 0 else "0"
    for precision in range(1, 10):
        shortest = "%.*e" % (precision - 1, single)
        if struct.unpack("f", struct.pack("f", float(shortest)))[0] == single:
            break
    mantissa, exponent = shortest.split("e")
    sign, digits = ("-", mantissa[1:]) if mantissa[0] == "-" else ("", mantissa)
    digits = digits.replace(".", "").rstrip("0") or "0"
    exponent = int(exponent)
    if exponent < -4 or exponent >= 6:
        body = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return "%s%se%s%02d" % (sign, body, "-" if exponent < 0 else "+", abs(exponent))
    if exponent < 0:
        return sign + "0." + "0" * (-exponent - 1) + digits
    whole = digits[:exponent + 1].ljust(exponent + 1, "0")
    fraction = digits[exponent + 1:]
    return sign + whole + ("." + fraction if fraction else "")


# Go's time.ParseDuration, unsigned: "300ms", "5s", "1m30s", "1.5h" ("0" alone has no unit).
GO_DURATION = re.compile(r"(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:ns|us|\u00b5s|\u03bcs|ms|s|m|h))+")
GO_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3,
                     "s": 1.0, "m": 60.0, "h": 3600.0}


def go_duration(text):
    """The seconds a Go duration says, or None if it is not one (bounded: 64 characters)."""
    if text == "0":
        return 0.0
    if len(text) > 64 or not GO_DURATION.fullmatch(text):
        return None
    return sum(float(number) * GO_DURATION_UNITS[unit]
               for number, unit in re.findall(r"([0-9.]+)([^0-9.]+)", text))


# ---------------------------------------------------------------------------
# Command line: argparse built from one flag table, after a normalisation of Go's spellings
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
    Flag("explain", "string", "", "webhookd: read one raw HTTP request (head and body) on "
         "stdin and print how this hook's trigger rules judge it, each rule true or false with "
         "the value it saw, running nothing; exit 0 if they hold, 1 if not"),
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
    Flag("max-connections", "int", 1024, "webhookd: requests served at once (a thread each); "
         "idle and slow connections wait without a thread, and the oldest idle ones are closed "
         "when open files run short"),
    Flag("max-multipart-mem", "int", 1048576, "webhookd: accepted for compatibility; no effect "
         "(multipart bodies are bounded by -max-body-bytes and parsed in memory)"),
    Flag("max-workers", "int", 64, "webhookd: accepted for compatibility with webhookd 2; "
         "-max-connections bounds the request threads"),
    Flag("nopanic", "bool", False, "do not panic if hooks cannot be loaded when webhook is not "
         "running in verbose mode"),
    Flag("pidfile", "string", "", "create PID file at the given path"),
    Flag("port", "int", 9000, "port the webhook should serve hooks on"),
    Flag("read-header-timeout", "int", 10, "webhookd: seconds a client may take to send the "
         "request line and headers (also the body's per-read inactivity limit; 0: no limit)"),
    Flag("runs", "bool", False, "webhookd: list the runs recorded in -runs-dir, newest first, "
         "and exit"),
    Flag("runs-dir", "string", "", "webhookd: keep run records and output in this folder (0700) "
         "across restarts; in memory when empty"),
    Flag("runs-follow", "string", "", "webhookd: print the output of this run in -runs-dir, "
         "following it until the run ends, and exit (0 if it succeeded)"),
    Flag("runs-hook", "string", "", "webhookd: -runs lists only the runs of this hook"),
    Flag("runs-keep", "int", 50, "webhookd: runs kept per hook, oldest dropped first (0: no run "
         "history, no run ids)"),
    Flag("runs-max-bytes", "int", 64 * 1024 * 1024, "webhookd: total size of the kept runs "
         "(records and output), oldest dropped first"),
    Flag("runs-max-output", "int", 1024 * 1024, "webhookd: output kept per run; beyond it the "
         "tail is kept"),
    Flag("runs-since", "string", "", "webhookd: -runs lists only the runs queued since then: a "
         "time ago (90s, 30m, 2h, 7d, 1h30m) or a UTC date or time (2026-11-21, "
         "2026-11-21T14:00:00Z)"),
    Flag("runs-state", "string", "", "webhookd: -runs lists only the runs in this state "
         "(queued, running, succeeded, failed, timed-out, killed, interrupted, refused, "
         "superseded, dropped)"),
    Flag("secure", "bool", False, "use HTTPS instead of HTTP"),
    Flag("setgid", "int", 0, "set group ID after opening listening port; must be used with setuid"),
    Flag("setuid", "int", 0, "set user ID after opening listening port; must be used with setgid"),
    Flag("shutdown-timeout", "int", 60, "webhookd: on SIGTERM/SIGINT, seconds to wait for "
         "running commands before exiting"),
    Flag("socket", "string", "", "webhookd: serve on this Unix socket instead of -ip/-port"),
    Flag("status-path", "string", "", "webhookd: serve a status page at this path (outside "
         "the hooks prefix; JSON, or HTML to browsers), Prometheus metrics at PATH/metrics; off "
         "when empty"),
    Flag("status-token", "string", "", "webhookd: serve run history and the status page's "
         "details only to clients sending Authorization: Bearer <token> (or the token as "
         "their Basic password), loopback included (without a token: to loopback clients no "
         "proxy relays)"),
    Flag("status-token-file", "string", "", "webhookd: read -status-token from this file"),
    Flag("template", "bool", False, "expand {{ getenv \"NAME\" }}, {{ cat \"PATH\" }} and "
         "{{ credential \"NAME\" }} (optionally | js) in the hooks files before parsing them; "
         "any other template action is a load error"),
    Flag("tls-min-version", "string", "1.2", "minimum TLS version (1.0, 1.1, 1.2, 1.3)"),
    Flag("trusted-proxy", "list", None, "webhookd: a reverse proxy's address range (CIDR; "
         "repeat it or separate ranges with commas) whose X-Forwarded-For is believed: "
         "ip-whitelist, remote-addr and the log see the right-most address not in these "
         "ranges; the status page's access check never does"),
    Flag("urlprefix", "string", "hooks", "url prefix to use for served hooks "
         "(protocol://yourserver:port/PREFIX/:hook-id)"),
    Flag("validate", "bool", False, "webhookd: check the hooks files (fields, types, regexes, ip "
         "ranges, commands, directories, duplicate ids), list every problem, exit 0 or 1"),
    Flag("verbose", "bool", False, "show verbose output"),
    Flag("version", "bool", False, "display webhookd's version and quit"),
    Flag("write-timeout", "int", 60, "webhookd: seconds one write to a client may stay blocked "
         "(a client not reading its answer) before the connection is closed; a quiet streamed "
         "answer has no limit (0: no limit)"),
    Flag("x-request-id", "bool", False, "use X-Request-Id header, if present, as request ID"),
    Flag("x-request-id-limit", "int", 0, "truncate X-Request-Id header to limit; default no limit"),
]
FLAGS_BY_NAME = {f.name: f for f in FLAGS}


class UsageError(Exception):
    """A command-line problem: the message is printed before the usage text, exit status 2."""


class HelpRequested(Exception):
    """-h or -help: usage on stderr, exit status 0."""


class StartupError(Exception):
    """Serving cannot start (a hooks file, the log file, the run history, the pidfile, a
    listener, TLS, privileges): the one sentence saying why, exit status 1, reported by main.
    `as_flag`: a flag's file or folder cannot be used, said as check_flags says a bad flag
    (`error: ...` on stdout); else as Go's log.Fatal says it, on the log."""

    def __init__(self, sentence, as_flag=False):
        Exception.__init__(self, sentence)
        self.as_flag = as_flag


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


def parse_trusted_proxies(text):
    """-trusted-proxy: one range or several separated by commas -> ip_networks."""
    networks = []
    for piece in text.split(","):
        try:
            network = ipaddress.ip_network(piece.strip(), strict=True)
            mapped = getattr(network.network_address, "ipv4_mapped", None)
            if mapped is not None and network.prefixlen >= 96:  # as parse_ip reads a peer's
                network = ipaddress.ip_network("%s/%d" % (mapped, network.prefixlen - 96))
            networks.append(network)
        except ValueError as exc:
            raise ValueError("%s (write e.g. 10.0.0.0/8, 2001:db8::/32 or one address)"
                             % exc) from None
    return networks


LIST_CONVERTERS = {"header": parse_header_flag, "trusted-proxy": parse_trusted_proxies}


def go_value_type(flag, convert):
    """An argparse `type` that reports a bad value in the words of Go's flag package."""
    def parse(text):
        try:
            return convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError('invalid value "%s" for flag -%s: %s'
                                             % (text, flag.name, exc)) from None
    return parse


class GoFlagParser(argparse.ArgumentParser):
    """argparse with Go's error sentences (usage_text writes Go's usage: -h never reaches
    argparse)."""

    def error(self, message):
        raise UsageError(re.sub(r"^argument -[\w-]+: ", "", message))


def build_parser(program):
    parser = GoFlagParser(prog=program, add_help=False, allow_abbrev=False)
    converters = {"int": parse_go_int, "string": str}
    for flag in FLAGS:
        option = "-" + flag.name
        if flag.kind == "bool":
            parser.add_argument(option, dest=flag.attr, action="store_true", help=flag.help)
            parser.add_argument("-no-" + flag.name, dest=flag.attr, action="store_false",
                                help=argparse.SUPPRESS)  # only normalise_argv emits it
        elif flag.kind == "list":
            convert = LIST_CONVERTERS.get(flag.name, str)
            parser.add_argument(option, dest=flag.attr, action="append", default=[],
                                type=go_value_type(flag, convert), help=flag.help)
        else:
            parser.add_argument(option, dest=flag.attr, default=flag.default,
                                type=go_value_type(flag, converters[flag.kind]), help=flag.help)
    return parser


def normalise_argv(argv):
    """Go `flag` spellings -> argparse's: `--f` is `-f`, values become `-f=v`, `-b=false` for a
    boolean becomes a hidden `-no-b`; parsing stops at the first non-flag argument or `--`
    (the rest is ignored, as upstream)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if len(arg) < 2 or arg[0] != "-" or arg == "--":
            break
        name = arg[2:] if arg[1] == "-" else arg[1:]
        if not name or name[0] in "-=":
            raise UsageError("bad flag syntax: %s" % arg)
        i += 1
        name, has_value, value = name.partition("=")
        flag = FLAGS_BY_NAME.get(name)
        if flag is None:
            if name in ("h", "help"):
                raise HelpRequested()
            raise UsageError("flag provided but not defined: -%s" % name)
        if flag.kind == "bool":
            try:
                on = parse_go_bool(value) if has_value else True
            except ValueError:
                raise UsageError('invalid boolean value "%s" for -%s: parse error'
                                 % (value, name)) from None
            out.append(("-" if on else "-no-") + name)
            continue
        if not has_value:
            if i >= len(argv):
                raise UsageError("flag needs an argument: -%s" % name)
            value = argv[i]
            i += 1
        out.append("-%s=%s" % (name, value))
    return out


def parse_flags(argv):
    """The options of argv (without the program name), read as Go's flag package reads them."""
    opts = build_parser(PROGRAM).parse_args(normalise_argv(argv))
    if not opts.hooks:
        opts.hooks = ["hooks.json"]
    opts.trusted_proxy = tuple(net for group in opts.trusted_proxy for net in group)
    return opts


def check_flags(opts):
    """A sentence if the flags cannot work together, else None.  Only checks: the status
    token and -runs-dir are read and opened later (open_run_history), for serving."""
    for name in ("runs_keep", "runs_max_output", "runs_max_bytes"):
        if getattr(opts, name) < (0 if name == "runs_keep" else 1):
            return "invalid value %d for -%s" % (getattr(opts, name), name.replace("_", "-"))
    if (opts.runs or opts.runs_follow) and not opts.runs_dir:
        return "-runs and -runs-follow read the records in -runs-dir DIR"
    if (opts.runs_hook or opts.runs_state or opts.runs_since) and not opts.runs:
        return "-runs-hook, -runs-state and -runs-since choose what -runs lists: add -runs"
    if opts.runs_state and opts.runs_state not in RUN_STATES:
        return "-runs-state must be one of " + ", ".join(RUN_STATES)
    if opts.runs_since and runs_since(opts.runs_since, time.time()) is None:
        return ("-runs-since %s: give a time ago (90s, 30m, 2h, 7d, 1h30m) or a UTC date or "
                "time (2026-11-21, 2026-11-21T14:00:00Z)" % opts.runs_since)
    if opts.runs_dir and os.path.exists(opts.runs_dir) and not os.path.isdir(opts.runs_dir):
        return "-runs-dir %s is not a folder" % opts.runs_dir
    if opts.runs or opts.runs_follow:  # only read: any user allowed to may
        if not os.path.isdir(opts.runs_dir):
            return "no run folder %s: webhookd has recorded no runs there (see its -runs-dir)" \
                % opts.runs_dir
        return None  # the rest is about serving
    if (opts.setuid != 0) != (opts.setgid != 0):
        return "setuid and setgid options must be used together"
    status_path = opts.status_path  # routed as requests are: cleaned, query cut off
    if status_path and (clean_path(status_path) != status_path or status_path.endswith("/")
                        or "?" in status_path or "#" in status_path
                        or (status_path + "/").startswith("/" + opts.urlprefix + "/")
                        or ("/" + opts.urlprefix + "/").startswith(status_path + "/")
                        or not opts.urlprefix):
        return ("-status-path %r must be an absolute path outside the hooks prefix /%s/ (and "
                "the prefix outside it), without //, . or .. in it, a trailing /, ? or #"
                % (status_path, opts.urlprefix))
    return None


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
    """A hooks file that cannot be used; the message names file, line and column if known.
    `items`: every problem found in the file, as (severity, message) pairs for -validate."""

    def __init__(self, message, items=None):
        Exception.__init__(self, message)
        self.items = items or [("error", message)]


TEMPLATE_ACTION = re.compile(r"\{\{(-?)(.*?)(-?)\}\}", re.S)
TEMPLATE_FUNCTION_USE = re.compile(r"\{\{-?\s*(?:getenv|cat|credential)\b")  # without -template
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
    """Upstream master's getenv, cat and credential.  `cat`: the file's content, one trailing
    newline trimmed; "" when it cannot be read (missing, as upstream documents; any other
    failure, a folder or no permission, is also "" there, and logged here).  `credential`:
    `$CREDENTIALS_DIRECTORY/NAME` read as `cat`, or without that variable the environment
    variable NAME.  Unlike upstream, a name that is not one file name (a `/`, `..`) is a load
    error, never a path out of the folder."""
    if name == "getenv":
        return environ.get(arg, "")
    if name == "credential":
        if "/" in arg or arg in ("", ".", ".."):
            raise ValueError("credential %s: not a plain credential name" % json.dumps(arg))
        directory = environ.get("CREDENTIALS_DIRECTORY")
        if not directory:
            return environ.get(arg, "")
        arg = os.path.join(directory, arg)
    try:
        data = read_template_file(name, arg)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("template: %s %s: %s; using \"\"", name, json.dumps(arg),
                        exc.strerror or exc)
        return ""
    data = data[:-1] if data.endswith(b"\n") else data
    return data.decode("utf-8", "surrogateescape")


TEMPLATE_FILE_MAX_BYTES = 1 << 20  # what cat or credential reads: a secret, a key, a certificate


def read_template_file(name, path):
    """The bytes of the file `cat`/`credential` names.  Opened without waiting and read only if
    it is a regular file of at most TEMPLATE_FILE_MAX_BYTES (a folder fails at the read, as
    upstream's): a FIFO would hold the reload, and the main thread that handles SIGTERM with it,
    until someone writes to it, /dev/zero would fill the memory; they are load errors."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise ValueError("%s %s: not a regular file" % (name, json.dumps(path)))
        data = b""
        while len(data) <= TEMPLATE_FILE_MAX_BYTES:
            chunk = os.read(fd, TEMPLATE_FILE_MAX_BYTES + 1 - len(data))
            if not chunk:
                return data
            data += chunk
    finally:
        os.close(fd)
    raise ValueError("%s %s: larger than %d KiB" % (name, json.dumps(path),
                                                    TEMPLATE_FILE_MAX_BYTES >> 10))


def expand_template(text, filename, environ=None, empty=None, expanded=None):
    """Expand `{{ getenv "X" }}`, `{{ cat "PATH" }}`, `{{ credential "NAME" }}` (each optionally
    `| js`, and with Go's `{{-`/`-}}` whitespace trimming); any other action is an error.  Each
    action that gave "" (an unset variable, a missing file) is added to the list `empty` as
    `line:column: action`, if one is given; each value to the list `expanded` (the secrets a
    run's record masks), if one is given."""
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
        if not value and empty is not None:
            empty.append("%d:%d: %s" % (line, col, match.group(0)))
        if value and expanded is not None:
            expanded.append(value)
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
# Hook model: fields, rules and hooks, with their problems (pure)
# ---------------------------------------------------------------------------

ARGUMENT_FIELDS = ("source", "name", "envname", "base64decode")
MATCH_FIELDS = ("type", "value", "regex", "secret", "ip-range", "parameter")
RULE_FIELDS = ("and", "or", "not", "match")
SOURCES = ("header", "url", "query", "payload", "string", "raw-request-body", "request",
           "entire-payload", "entire-query", "entire-headers")
MATCH_TYPES = ("value", "regex", "payload-hmac-sha1", "payload-hmac-sha256", "payload-hmac-sha512",
               "payload-hash-sha1", "payload-hash-sha256", "payload-hash-sha512", "ip-whitelist",
               "scalr-signature", "standard-webhooks")
HMAC_TYPES = {"payload-hmac-sha1": ("sha1", "sha1="), "payload-hash-sha1": ("sha1", "sha1="),
              "payload-hmac-sha256": ("sha256", "sha256="),
              "payload-hash-sha256": ("sha256", "sha256="),
              "payload-hmac-sha512": ("sha512", "sha512="),
              "payload-hash-sha512": ("sha512", "sha512=")}
# ours: match types whose `secret` may be a list (any one of them signs), while a sender rotates
SECRET_LIST_TYPES = frozenset(HMAC_TYPES) | {"standard-webhooks"}

# hook field -> (attribute, kind); from max-concurrency on they are ours, ignored by upstream.
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
    "pass-payload-to-stdin": ("payload_to_stdin", "bool"),
    "mask": ("mask", "masks"),
    "deduplicate": ("delivery_headers", "delivery"),
    "when-busy": ("when_busy", "whenbusy"),
    "debounce": ("debounce", "duration"),
}
EMPTY = {"str": "", "bool": False, "int": 0, "posint": 0, "posnumber": None, "args": (),
         "headers": (), "strlist": (), "rule": None, "masks": (), "delivery": (),
         "whenbusy": "queue", "duration": None}
# `"deduplicate": true` reads a delivery's id from the first of these a request has: Standard
# Webhooks' first, the one id a signature covers (a replay that adds another of these headers
# must not pass as a new delivery), then GitHub's, Gitea's (and Forgejo's), GitLab's and
# Stripe-style senders'
DELIVERY_HEADERS = ("Webhook-Id", "X-Github-Delivery", "X-Gitea-Delivery", "X-Gitlab-Event-Uuid",
                    "Idempotency-Key")
WHEN_BUSY = ("queue", "latest", "drop")  # what a trigger does while its hook is busy (WhenBusy)
DEBOUNCE_LONGEST = 3600.0  # seconds: a longer quiet time is more likely a typo than a wish


class Problems:
    """Warnings and errors found while loading a hooks file, each with where it was found (and
    on which line, when the file was read by the YAML reader)."""

    def __init__(self, filename, data=None, text="", empty_actions=()):
        self.filename, self.data, self.text = filename, data, text
        self.empty_actions = empty_actions  # template actions that gave "" (expand_template)
        self.items = []  # (severity, message)
        self.refused = set()  # indexes of the hooks that must not be served
        self.fatal = []  # errors upstream refuses the whole file for

    def at(self, where, line=None):
        line = where_line(self.data, where) if line is None else line
        return "%s:%d: %s" % (self.filename, line, where) if line else \
            "%s: %s" % (self.filename, where)

    def warn(self, where, message, line=None):
        self.items.append(("warning", "%s: %s" % (self.at(where, line), message)))

    def error(self, where, message):
        self.items.append(("error", "%s: %s" % (self.at(where), message)))

    def refuse(self, where, message):
        """An error that keeps the hook named in `where` from being served."""
        self.error(where, message + "; this hook is not served")
        self.refused.add(int(WHERE_HOOK.match(where).group(1)))

    def file_error(self, exc):
        """A type error upstream refuses the whole file for; reading goes on to find the rest."""
        line = where_line(self.data, str(exc))
        message = "%s%s: %s" % (self.filename, ":%d" % line if line else "", exc)
        self.fatal.append(message)
        self.items.append(("error", message))

    def source_line(self, number):
        """Line `number` (from 1) of the text read, as the YAML reader counts lines."""
        lines = self.text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        return lines[number - 1] if number and number <= len(lines) else ""


WHERE_HOOK = re.compile(r'hook (\d+)(?: \("(?:[^"\\]|\\.)*"\))?')
WHERE_STEP = re.compile(r"\.([a-z-]+)|\[(\d+)\]")


def where_line(data, where):
    """The line of the value a message's `where` (`hook 2 ("id").trigger-rule.and[0]`) names,
    when the data came from the YAML reader; None otherwise."""
    found = WHERE_HOOK.match(where)
    if found is None or not hasattr(data, "lines") or int(found.group(1)) >= len(data):
        return None
    node, line, pos = data[int(found.group(1))], data.lines[int(found.group(1))], found.end()
    for step in WHERE_STEP.finditer(where, pos):
        if step.start() != pos:
            break
        if step.group(1) and isinstance(node, dict) and hasattr(node, "lines"):
            keys = [key for key in node if key.lower() == step.group(1)]
            if not keys:
                break
            line, node = node.lines[keys[-1]], node[keys[-1]]
        elif step.group(2) and isinstance(node, list) and hasattr(node, "lines") \
                and int(step.group(2)) < len(node):
            line, node = node.lines[int(step.group(2))], node[int(step.group(2))]
        else:
            break
        pos = step.end()
    return line


def did_you_mean(name, known):
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
        elif not_json(value):
            raise HooksFileError("%s.%s: %s is no JSON value, upstream refuses the file"
                                 % (where, key, not_json(value)))
        else:
            problems.warn(where, "unknown field %r%s" % (key, did_you_mean(key, known)),
                          getattr(obj, "lines", {}).get(key))
    return folded


def not_json(value):
    """The first infinite or NaN float in a value ("+Inf"), else "": upstream turns YAML into JSON
    before decoding, and that fails for them unless they land in a string field."""
    if isinstance(value, float) and not math.isfinite(value):
        return go_float32_text(value)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((found for found in map(not_json, items) if found), "")


def type_name(value):
    for kind, name in ((dict, "object"), (list, "array"), (str, "string"), (bool, "boolean")):
        if isinstance(value, kind):  # YamlMap and YamlList too
            return name
    return "null" if value is None else "number"


def as_string(value, where):
    """Strings as is; null, numbers and booleans as upstream's YAML layer turns them into strings
    (null is "", floats are written in Go's shortest float32 form: 1.10 -> "1.1")."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return go_float32_text(value)
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
    """A `match` rule; `regex` is compiled at load (a bad pattern is an error at evaluation);
    `secrets`: the secret, or the several a list gave (ours, on SECRET_LIST_TYPES)."""

    __slots__ = ("type", "value", "regex", "secrets", "ip_range", "parameter", "compiled",
                 "regex_error", "explained")

    def __init__(self, type, value="", regex="", secret="", ip_range="", parameter=None):
        self.type, self.value, self.regex = type, value, regex
        self.secrets = (secret,) if isinstance(secret, str) else tuple(secret)
        self.ip_range, self.parameter = ip_range, parameter or Argument("", "")
        self.compiled, self.regex_error = None, None
        self.explained = None  # what explaining it shows of the rule itself (explained_match)
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
    arg = Argument(as_string(obj.get("source"), where + ".source"),
                   as_string(obj.get("name"), where + ".name"),
                   as_string(obj.get("envname"), where + ".envname"), base64decode)
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


def parse_match(raw, where, problems):
    obj = fold_keys(raw, MATCH_FIELDS, where, problems)
    fields = {key: as_string(obj.get(key), "%s.%s" % (where, key))
              for key in ("type", "value", "regex", "ip-range")}
    kind, secret = fields["type"], obj.get("secret")
    if isinstance(secret, list) and kind in SECRET_LIST_TYPES:
        secret = tuple(as_string(item, "%s.secret[%d]" % (where, i))
                       for i, item in enumerate(secret))
        if not secret:
            problems.error(where + ".secret", "an empty list of secrets")
    else:
        secret = as_string(secret, where + ".secret")
    parameter = obj.get("parameter")
    parameter = (parse_argument(parameter, where + ".parameter", problems)
                 if parameter is not None else None)
    rule = MatchRule(kind, fields["value"], fields["regex"], secret, fields["ip-range"],
                     parameter)
    if kind not in MATCH_TYPES:
        problems.error(where, "unknown match type %r%s" % (kind, did_you_mean(kind, MATCH_TYPES)))
    if rule.regex_error:
        problems.error(where, rule.regex_error)
    if kind.startswith("payload-hash-"):
        problems.warn(where, "deprecated type %r, use %r" % (kind, kind.replace("hash", "hmac")))
    checked = "secret" if kind in SECRET_LIST_TYPES or kind == "scalr-signature" else \
        "value" if kind == "value" else None
    empty = checked == "secret" and not all(rule.secrets) or checked == "value" and not rule.value
    if empty and problems.empty_actions:
        # most likely an unset variable or a missing file: an empty value matches any request
        # that sends the parameter empty, so the hook is not served
        problems.refuse("%s.%s" % (where, checked), "empty after template expansion (in "
                        "this file %s gave \"\")" % ", ".join(problems.empty_actions[:3]))
    elif empty and checked == "secret":
        problems.error(where, "empty secret (every request would get 500)")
    if kind == "standard-webhooks":
        for secret in rule.secrets:
            if secret and standard_webhooks_key(secret) is None:
                problems.error(where + ".secret", "not a whsec_ secret (base64 after whsec_)")
    for field, text in [("secret", secret) for secret in rule.secrets] + [
            ("value", obj.get("value"))]:
        if is_shipped_placeholder(text):
            problems.refuse("%s.%s" % (where, field), "a placeholder from the example file "
                            "(replace-with-...), not a secret: set a real one")
        elif looks_like_placeholder(text):
            problems.warn(where, "the %s looks like an example placeholder: set a real one" % field)
    if isinstance(obj.get("value"), bool):
        warn_yaml_boolean(raw, where, problems)
    if kind == "ip-whitelist":
        for cidr in rule.ip_range.split():
            if parse_cidr(cidr) is None:
                problems.error(where, "invalid ip range %r" % cidr)
    if kind not in ("ip-whitelist", "scalr-signature", "standard-webhooks") and parameter is None:
        problems.error(where, "match without a parameter")
    return rule


# Secrets that an example or a tutorial ships and nobody should serve with (the value is
# never printed: a real secret that happens to match must not end up in a log).
PLACEHOLDER_SECRET = re.compile(
    r"(replace|change)[-_ ]?(me|this|with)|your[-_ ]?(secret|token|key|password)"
    r"|^(my[-_ ]?)?(secret|token|password|example|todo)$|^x{3,}$|^<.*>$", re.IGNORECASE)


def looks_like_placeholder(text):
    return isinstance(text, str) and PLACEHOLDER_SECRET.search(text) is not None


# The placeholders webhook.conf.example and the docs ship: a copy left unedited must not run a
# deploy for anyone who read the example.
SHIPPED_PLACEHOLDER = re.compile(r"replace[-_]with[-_]", re.IGNORECASE)


def is_shipped_placeholder(text):
    return isinstance(text, str) and SHIPPED_PLACEHOLDER.match(text.strip()) is not None


# YAML 1.1 words upstream's go-yaml v2 reads as booleans (`value: on` compares with "true").
YAML_BOOLEAN_WORD = re.compile(r"(?:^|[\s{,])value[\s]*:[\s]*(y|n|yes|no|on|off)[\s]*(?:[,}#]|$)",
                               re.IGNORECASE)


def warn_yaml_boolean(raw, where, problems):
    """Warn when a match `value` was written on/off/yes/no/y/n without quotes."""
    keys = [key for key in raw if key.lower() == "value"]
    line = getattr(raw, "lines", {}).get(keys[-1]) if keys else None
    word = YAML_BOOLEAN_WORD.search(problems.source_line(line)) if line else None
    if word:
        boolean = "true" if raw[keys[-1]] else "false"
        problems.warn(where + ".value", "the value %s is read as the boolean %s (YAML 1.1, as "
                      "upstream reads it), so only %s matches: write \"%s\" in quotes to match %s"
                      % ((word.group(1), boolean, boolean) + (word.group(1),) * 2), line)


def parse_field(kind, value, where, problems):
    if kind == "str":
        return as_string(value, where)
    if kind == "bool":
        if not isinstance(value, bool):
            raise HooksFileError("%s: expected a boolean, got %s" % (where, type_name(value)))
        return value
    if kind in ("int", "posint"):
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
            value = int(value)  # upstream writes 200.0 as JSON 200 before decoding it
        if isinstance(value, bool) or not isinstance(value, int) or not -2**63 <= value < 2**63:
            raise HooksFileError("%s: expected an integer, got %s" % (where, type_name(value)))
        if kind == "posint" and value < 1:
            raise HooksFileError("%s: must be at least 1" % where)
        return value
    if kind == "posnumber":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise HooksFileError("%s: expected a number of seconds above 0" % where)
        return float(value)
    if kind == "whenbusy":
        if value not in WHEN_BUSY:
            raise HooksFileError("%s: expected \"queue\", \"latest\" or \"drop\", got %s" % (
                where, json.dumps(value) if isinstance(value, str) else type_name(value)))
        return value
    if kind == "duration":
        seconds = go_duration(value) if isinstance(value, str) else None
        if seconds is None or not 0 < seconds <= DEBOUNCE_LONGEST:
            raise HooksFileError("%s: expected a duration above 0 and at most 1h, such as "
                                 "\"5s\", \"1m30s\" or \"500ms\"" % where)
        return seconds
    if kind == "args":
        return parse_arguments(value, where, problems)
    if kind == "rule":
        return parse_rule(value, where, problems)
    if kind == "delivery":  # true: the usual headers; a name: that header alone
        if isinstance(value, bool):
            return DELIVERY_HEADERS if value else ()
        if not isinstance(value, str) or not value or not set(value) <= TOKEN_CHARS:
            raise HooksFileError("%s: expected true, false or a header name, got %s" % (
                where, "%r" % value if isinstance(value, str) else type_name(value)))
        return (canonical_header(value),)
    expect(value, list, where)
    if kind == "strlist":
        return tuple(as_string(v, "%s[%d]" % (where, i)) for i, v in enumerate(value))
    if kind == "masks":
        patterns = tuple(as_string(v, "%s[%d]" % (where, i)) for i, v in enumerate(value))
        for i, pattern in enumerate(patterns):
            if mask_pattern_length(pattern) is None:
                raise HooksFileError("%s[%d]: not a mask pattern (ASCII characters, classes "
                                     "[...], \\d \\w \\s and ., each optionally {N} times: "
                                     "one fixed length, at most %d)" % (where, i, MASK_LONGEST))
        return patterns
    headers = []
    for i, item in enumerate(value):
        here = "%s[%d]" % (where, i)
        item = fold_keys(item, ("name", "value"), here, problems)
        headers.append((as_string(item.get("name"), here + ".name"),
                        as_string(item.get("value"), here + ".value")))
    return tuple(headers)


class Hook:
    """One hook definition.  Attributes are named after the fields (see HOOK_FIELDS)."""

    def __init__(self, raw, where, problems):
        obj = fold_keys(raw, HOOK_FIELDS, where, problems)
        for field, (attr, kind) in HOOK_FIELDS.items():
            value = obj.get(field)
            setattr(self, attr, EMPTY[kind])
            try:
                if value is not None:
                    setattr(self, attr, parse_field(kind, value, "%s.%s" % (where, field),
                                                    problems))
            except HooksFileError as exc:  # noted; the other fields are read all the same
                problems.file_error(exc)
        self.allowed_methods = tuple(m.strip().upper() for m in self.http_methods)
        self.secret_headers, self.secret_params = rule_parameters(self.trigger_rule)
        self.masker = NO_MASK  # parse_hooks_file gives it the file's: one hook may pass another's
        if not self.execute_command:
            problems.error(where, "no execute-command: the hook cannot run")
        held_back = '"when-busy": "%s"' % self.when_busy if self.when_busy != "queue" else \
            "debounce" if self.debounce else None
        answers_output = "stream-command-output" if self.stream_output else \
            "include-command-output-in-response" if self.capture_output else None
        if held_back and answers_output:
            problems.file_error(HooksFileError(
                "%s: %s and %s do not go together: its answer waits for the command's output, "
                "which a trigger that is superseded or dropped never has" % (
                    where, held_back, answers_output)))
        if self.when_busy != "queue" and not self.max_concurrency:
            self.max_concurrency = 1  # busy: a run going, unless max-concurrency allows more
        unknown = [key for key in raw if key.lower() not in HOOK_FIELDS]
        if unknown and self.trigger_rule is None:  # `trigger-rules`: the rule would be lost
            problems.refuse(where, "unknown field %s and no trigger-rule: if it is a misspelt "
                            "trigger-rule, anyone could run the hook (add the trigger-rule, or "
                            "remove the field)" % ", ".join(repr(key) for key in unknown))


# ---------------------------------------------------------------------------
# Secrets and masking: what the logs and a run's record must not show (pure)
# ---------------------------------------------------------------------------

SENSITIVE_HEADERS = frozenset(("Authorization", "Cookie", "X-Hub-Signature", "X-Hub-Signature-256",
                               "X-Signature", "X-Gitlab-Token", "X-Gitea-Signature"))


def match_nodes(rule):
    """The matches of a trigger rule, in no particular order (a walk without recursion)."""
    pending = [rule]
    while pending:
        node = pending.pop()
        if node is None or node[0] == "none":
            continue
        if node[0] == "match":
            yield node[1]
        elif node[0] == "not":
            pending.append(node[1])
        else:
            pending.extend(node[1])


def rule_parameters(rule):
    """Header names and query names a trigger rule compares: they are kept out of the logs."""
    headers, params = set(SENSITIVE_HEADERS), set()
    for match in match_nodes(rule):
        arg = match.parameter
        if arg.source == "header":
            headers.add(canonical_header(arg.name))
        elif arg.source in ("url", "query"):
            params.add(arg.name)
    return frozenset(headers), frozenset(params)


def compares_a_secret(arg):
    """Whether what a rule compares with this parameter may be a secret: a credential-like
    header or name, or a whole body, query or header set (which may hold one)."""
    return arg.source in WHOLE_SOURCES or canonical_header(arg.name) in SENSITIVE_HEADERS \
        or SECRET_NAME.search(arg.name) is not None


def passes_a_secret(arg):
    """Whether what a command is given from this parameter may be a credential of the request
    (a `string` is the hooks file's own: the hook's Masker knows its secrets)."""
    return arg.source != "string" and compares_a_secret(arg)


WHOLE_SOURCES = frozenset(("entire-headers", "entire-payload", "entire-query", "raw-request-body"))
SECRET_NAME = re.compile(r"token|secret|passw|signature|auth(?!or)|key|credential|cookie",
                         re.IGNORECASE)  # (an `author`'s name is what a person looks for)


def rule_secrets(rule):
    """The secrets a trigger rule holds: every `secret`, and the `value` a match compares with
    a parameter that may hold a secret."""
    found = []
    for match in match_nodes(rule):
        found.extend(secret for secret in match.secrets if secret)
        if match.type == "value" and compares_a_secret(match.parameter):
            found.append(match.value)
    return found


# What a run's record shows (its output, arguments and environment; the log's argv and output)
# never holds a secret of its hooks file: each is replaced with MASKED.  A hook's `mask` adds
# patterns of one fixed length, so that matching stays linear in the text: at each position at
# most MASK_LONGEST characters are looked at, with no backtracking.

MASKED = b"********"
MASK_MIN_CHARS = 4  # shorter values (a getenv'd "1") would garble the output, and guard nothing
MASK_LONGEST = 1024
MASK_ATOM = re.compile(r"(?:\\[dws]|\\[^A-Za-z0-9]|\[\^?\]?(?:[^\]\\]|\\[^A-Za-z0-9]|\\[dws])*\]"
                       r"|[^\\\[\]{}()|*+?^$])(?:\{([0-9]{1,4})\})?")


def mask_pattern_length(pattern):
    """The one length a `mask` pattern matches, or None if it is not a mask pattern: ASCII
    literals, classes `[...]`, `\\d \\w \\s .`, each optionally `{N}` times; no alternation,
    group or open repetition."""
    if not pattern.isascii():
        return None
    pos = length = 0
    while pos < len(pattern):
        atom = MASK_ATOM.match(pattern, pos)
        if atom is None:
            return None
        length, pos = length + int(atom.group(1) or 1), atom.end()
    try:
        re.compile(pattern.encode())
    except re.error:
        return None
    return length if 0 < length <= MASK_LONGEST else None


class Masker:
    """A hook's secrets (literals of at least MASK_MIN_CHARS) and `mask` patterns, replaced with
    MASKED in bytes, text, or a stream of chunks (stream())."""

    def __init__(self, literals=(), patterns=()):
        literals = sorted({text.encode("utf-8", "surrogateescape") for text in literals
                           if len(text) >= MASK_MIN_CHARS}, key=len, reverse=True)
        parts = [re.escape(literal) for literal in literals] + [p.encode() for p in patterns]
        self.regex = re.compile(b"|".join(parts)) if parts else None
        self.longest = max([len(literal) for literal in literals]
                           + [mask_pattern_length(p) for p in patterns], default=0)

    def bytes(self, data):
        return data if self.regex is None else self.regex.sub(MASKED, data)

    def head(self, text, chars):
        """The first `chars` characters of text, masked: a secret that begins among them is
        masked whole, and only `longest` characters after them are looked at."""
        if self.regex is None:
            return text[:chars]
        window = text[:chars + self.longest]  # surrogatepass: a JSON `\ud800` kept as it is
        data = window.encode("utf-8", "surrogatepass")
        limit = len(window[:chars].encode("utf-8", "surrogatepass"))
        return self.masked_until(data, limit)[0].decode("utf-8", "surrogatepass")

    def stream(self):
        """feed(chunk, last=False) -> the masked bytes that are certain: a secret split between
        two chunks is masked too (at most `longest` - 1 bytes wait for the next, or `last`)."""
        pending = b""

        def feed(chunk, last=False):
            nonlocal pending
            if self.regex is None:
                return chunk
            data = pending + chunk
            shown, end = self.masked_until(data, len(data) if last
                                           else max(0, len(data) - self.longest + 1))
            pending = data[end:]
            return shown
        return feed

    def masked_until(self, data, limit):
        """(data up to `limit` with each secret masked, where that ended): a secret beginning
        before `limit` is masked whole; one beginning after it (it might grow into a longer
        one) is left for later."""
        shown, pos = [], 0
        for found in self.regex.finditer(data):
            if found.start() >= limit:
                break
            shown += [data[pos:found.start()], MASKED]
            pos = found.end()
        end = max(limit, pos)
        shown.append(data[pos:end])
        return b"".join(shown), end


NO_MASK = Masker()


def redact_target(target, names):
    """The request target for the log, with the values of the named query parameters hidden."""
    path, sep, query = target.partition("?")
    if not names or not sep:
        return target
    parts = re.split("([&;])", query)  # the separators kept in place, `;` included
    for i in range(0, len(parts), 2):
        key = parts[i].partition("=")[0]
        if go_unescape(key, True) in names:
            parts[i] = key + "=<redacted>"
    return path + "?" + "".join(parts)


# ---------------------------------------------------------------------------
# Hooks files: reading (text to hooks, with the file's own checks) and -validate
# ---------------------------------------------------------------------------

def describe(index, obj):
    hook_id = obj.get("id") if isinstance(obj, dict) else None
    return "hook %d (%s)" % (index, json.dumps(hook_id)) if isinstance(hook_id, str) else \
        "hook %d" % index


def hooks_data(text, filename):
    """The value in a hooks file's text (see load_yaml): (data, read_as_json)."""
    try:
        return load_yaml(text)
    except YamlError as exc:
        raise HooksFileError("%s:%d:%d: %s" % (filename, exc.line, exc.column, exc.message)) \
            from None


def parse_hooks(text, filename, empty_actions=()):
    """Parse the text of a hooks file (JSON or YAML): (list of Hook, Problems).  Raises
    HooksFileError.  Problems in a JSON file are located by reading it again as YAML.
    `empty_actions`: the template actions that gave "" (see expand_template)."""
    if not text.strip():
        raise HooksFileError("%s: file is empty" % filename)
    data, read_as_json = hooks_data(text, filename)
    try:
        hooks, problems = build_hooks(data, filename, text, empty_actions)
        if not problems.items or not read_as_json:
            return hooks, problems
    except HooksFileError:
        if not read_as_json:
            raise
    try:
        data = load_yaml(text, lines=True)[0]  # the same values, now with the line of each
    except YamlError:
        pass
    return build_hooks(data, filename, text, empty_actions)


def build_hooks(data, filename, text="", empty_actions=()):
    """The hooks to serve and the Problems; HooksFileError (with every problem found) for a
    file upstream refuses.  A hook with a shipped placeholder secret, or a secret or value
    match emptied by the template, is left out."""
    problems = Problems(filename, data, text, empty_actions)
    if not isinstance(data, list):
        raise HooksFileError("%s: expected an array (a YAML sequence) of hooks, got %s"
                             % (filename, type_name(data)))
    hooks, seen = [], set()
    for index, obj in enumerate(data):
        where = describe(index, obj)
        try:
            hook = Hook(obj, where, problems)
        except HooksFileError as exc:  # not an object: nothing more to read in this hook
            problems.file_error(exc)
            continue
        if hook.id in seen:
            problems.error(where, "duplicate id %r in this file (the first one wins)" % hook.id)
        seen.add(hook.id)
        if index not in problems.refused:
            hooks.append(hook)
    if problems.fatal:
        more = len(problems.fatal) - 1
        raise HooksFileError(problems.fatal[0] + (" (and %d more problem(s): see -validate)"
                                                  % more if more else ""), problems.items)
    return hooks, problems


def read_bytes(path):
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise HooksFileError(go_errno_text(exc, "open")) from None


def parse_hooks_file(raw, path, template=False):
    """Template-expand and parse the bytes of one hooks file: (hooks, Problems)."""
    text = raw.decode("utf-8", "surrogateescape")
    empty_actions, expanded = [], []
    warnings = [("warning", "%s: %s is writable by group or others: a local user could run "
                            "any command as webhookd (chmod go-w)" % (path, writable))
                for writable in writable_by_others(path)]
    if template:
        text = expand_template(text, path, empty=empty_actions, expanded=expanded)
    else:
        action = TEMPLATE_FUNCTION_USE.search(text)
        if action:
            warnings.append(("warning", "%s:%d:%d: %s... is kept as this literal text (a secret "
                             "anyone can read here, not the one meant): start webhookd with "
                             "-template to expand it" % ((path,) + line_col(text, action.start())
                                                         + (action.group(0),))))
    try:
        hooks, problems = parse_hooks(text, path, empty_actions)
    except RecursionError:  # the readers and the model recurse once per level of nesting
        message = "%s: nested too deeply" % path
        raise HooksFileError(message, [("error", message)] + warnings) from None
    except HooksFileError as exc:
        exc.items.extend(warnings)
        raise
    problems.items.extend(warnings)
    # every secret of the file is masked in every hook's runs: one hook may pass another's
    secrets = expanded + [secret for hook in hooks for secret in rule_secrets(hook.trigger_rule)]
    for hook in hooks:
        hook.masker = Masker(secrets, hook.mask)
    return hooks, problems


def writable_by_others(path):
    """The hooks file, and its folder unless sticky, if others or a shared group (not the
    owner's own group, as umask 002 gives) may write to them."""
    found = []
    for name, is_folder in ((path, False), (os.path.dirname(os.path.abspath(path)), True)):
        try:
            st = os.stat(name)
        except OSError:
            continue
        shared = st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP
                                               and st.st_gid != own_group(st.st_uid))
        if shared and not (is_folder and st.st_mode & stat.S_ISVTX):
            found.append("the folder " + name if is_folder else "the file")
    return found


def own_group(uid):
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:  # no such user: no group of its own
        return None


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
            found.extend(exc.items)
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
# Hook registry and hot reload
# ---------------------------------------------------------------------------

def file_signature(path):
    """What the poller compares: inode, device, size, mtime (None if the file is missing)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns)


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
        self.content_hash = None  # hash() of the content last read, loaded or not
        self.recheck_until = 0.0  # while the mtime is this fresh, compare content too
        self.seen = None  # what the last poll saw: a change is loaded once seen twice


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
        self.last_good_load = None  # when every file last loaded
        self.load_failures = 0  # loads in which a file failed

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
                log.info("attempting to %s hooks from %s", "load" if startup else "reload",
                         hf.path)
                hf.signature = file_signature(hf.path)
                if hf.signature:  # a second write within the same mtime tick keeps size and
                    # mtime: for a moment, poll() compares the content as well
                    hf.recheck_until = hf.signature[3] / 1e9 + MTIME_TICK_SECONDS
                try:
                    raw = read_bytes(hf.path)
                    hf.content_hash = hash(raw)
                    hooks, problems = parse_hooks_file(raw, hf.path, self.template)
                except HooksFileError as exc:
                    ok = self._keep_old(hf, "couldn't load hooks from file! %s" % exc, str(exc))
                    continue
                except Exception as exc:  # a bug must not stop the daemon, nor drop the hooks
                    message = "%s: unexpected error: %s: %s" % (hf.path, type(exc).__name__, exc)
                    ok = self._keep_old(hf, "couldn't load hooks from file! " + message, message)
                    continue
                for severity, message in problems.items:  # errors are shown without -verbose
                    (log.error if severity == "error" else log.warning)("%s: %s", severity,
                                                                        message)
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
                self._warn_lost_rules(hf, hooks)
                hf.hooks, hf.error, hf.loaded_at = hooks, None, now
                for hook in hooks:
                    log.info("\tloaded: %s", hook.id)
            self._publish()
            self.last_load = now
            self.last_reload_failed = not ok
            if ok:
                self.last_good_load = now
            else:
                self.load_failures += 1
            return ok

    def _warn_lost_rules(self, hf, hooks):
        """A served hook that had a trigger-rule and has none now runs for every request: said
        loudly, as it is more often a half-written or mis-edited file than a wish."""
        for hook in hooks:
            served = self.by_id.get(hook.id)
            if hook.trigger_rule is None and served is not None and \
                    served.trigger_rule is not None:
                log.warning("warning: hook %s in %s lost its trigger-rule: it now runs for "
                            "every request", hook.id, hf.path)

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
        # the gate of a hook no file serves any more goes, unless runs still hold or wait for
        # it (a later load drops it): reloads that rename hooks never pile up gates
        gates = {hook_id: gate for hook_id, gate in self.gates.items()
                 if hook_id in table or gate.running or gate.waiting}
        for hook_id, hook in table.items():
            gate = gates.get(hook_id)
            if gate is None:
                gates[hook_id] = HookGate(hook.max_concurrency)
            elif gate.limit != hook.max_concurrency:
                gate.set_limit(hook.max_concurrency)
        self.gates, self.by_id = gates, table

    def poll(self):
        """Hot reload: the files whose inode, size or mtime changed (to be reloaded) and then
        stayed the same for one poll interval, so that a file being written is not loaded
        half-written; a file missing for longer than VANISH_GRACE loses its hooks here."""
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
            seen = (signature, self._content_hash(hf) if time.time() < hf.recheck_until else None)
            steady, hf.seen = seen == hf.seen, seen
            if steady and (signature != hf.signature or seen[1] not in (None, hf.content_hash)):
                changed.append(hf)
        for hf in changed:
            log.info("hooks file %s modified", hf.path)
        return changed

    @staticmethod
    def _content_hash(hf):
        try:
            return hash(read_bytes(hf.path))
        except HooksFileError:
            return "unreadable"

    def _drop(self, hf):
        with self.lock:
            log.info("hooks file %s removed, removing hooks that were loaded from it", hf.path)
            for hook in hf.hooks:
                log.info("\tremoving: %s", hook.id)
            log.info("removed %d hook(s) that were loaded from file %s", len(hf.hooks), hf.path)
            hf.hooks, hf.signature, hf.missing_since = [], None, None
            hf.error = "%s: file removed" % hf.path
            self._publish()
            self.last_load = time.time()

    def file_of(self, hook_id):
        """The path of the hooks file that serves hook_id, or None."""
        return next((hf.path for hf in self.files if any(h.id == hook_id for h in hf.hooks)),
                    None)

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
NEXT_REQUEST_WAIT_SECONDS = 0.01  # a worker waits this long for the next request, then parks
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
        """Go's bare answer: its status line, Content-Type and `Connection: close`, no Date."""
        return Response(self.status, self.body if self.body is not None else self.public.encode(),
                        {"Content-Type": TEXT_PLAIN}, close=True,
                        reason=self.public.partition(" ")[2], bare=True)


class BodyError(Exception):
    """The request body broke off or was malformed mid-way: `partial` is what was read."""

    def __init__(self, message, partial):
        Exception.__init__(self, message)
        self.partial = partial


class Request:
    """One request, from its head to its answer: what the client sent (`method`, `target`,
    `version`, `headers`: canonical names to all their values), where from (`peer`; `client`,
    the address after -trusted-proxy), `id` (X-Request-Id or ours), the target's `path` and
    `raw_query`, and `body`, a BodyReader whose read() gives the body when the App wants it
    (else the handler reads past it or closes)."""

    __slots__ = ("method", "target", "version", "headers", "peer", "client", "id", "path",
                 "raw_query", "body", "secret_params")

    def __init__(self, method, target, version, headers):
        self.method, self.target, self.version, self.headers = method, target, version, headers
        self.peer = self.client = self.id = self.path = self.raw_query = self.body = None
        self.secret_params = ()  # query parameters whose values the access log hides

    def get(self, name, default=""):
        values = self.headers.get(name)
        return values[0] if values else default

    def keep_alive(self):
        connection = ",".join(self.headers.get("Connection", ())).lower()
        if self.version == "HTTP/1.1":
            return "close" not in connection
        return "keep-alive" in connection


def body_too_large():
    """Go's 413 for a body over -max-body-bytes."""
    return BadRequest(413, "request body too large", body=MSG_BODY_TOO_LARGE)


def body_length(request, max_body):
    """The declared body size (None: chunked); a bad or too large one is refused."""
    if "Transfer-Encoding" in request.headers:
        encoding = ",".join(request.headers["Transfer-Encoding"]).strip().lower()
        if encoding != "chunked":
            raise BadRequest(501, "unsupported transfer encoding",
                             body=b"Unsupported transfer encoding")
        return None
    lengths = request.headers.get("Content-Length")
    if not lengths:
        return 0
    digits = lengths[0].lstrip("0") or "0"  # as Go: any number of leading zeros
    if len(set(lengths)) != 1 or not is_ascii_digits(lengths[0]) or len(digits) > 19:
        raise BadRequest(400, "bad Content-Length")  # (int() refuses over 4,300 digits)
    size = int(digits)
    if size >= 1 << 63:
        raise BadRequest(400, "bad Content-Length")
    if size > max_body:
        raise body_too_large()
    return size


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
    headers, last, folded = {}, None, []
    for line in lines[1:]:
        line = line.rstrip("\r")
        if not line:
            break
        if line[0] in " \t" and last is not None:  # obsolete line folding: a continuation
            folded.append(line.strip(" \t"))
            continue
        unfold(last, folded)
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
    unfold(last, folded)
    hosts = headers.get("Host", ())
    if len(hosts) > 1:
        raise BadRequest(400, "too many Host headers")
    if not hosts and version == "HTTP/1.1":
        raise BadRequest(400, "missing required Host header", public=True)
    return Request(method, target, version, headers)


def unfold(values, folded):
    """Join continuation lines to the last value, a space between non-empty pieces: in one
    join, as adding them one by one costs quadratic time."""
    if folded:
        values[-1] = " ".join(piece for piece in [values[-1]] + folded if piece)
        folded.clear()


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
# The rest of Go 1.19's table, in its order after the HTML signatures: (pattern, mask or None
# for an exact prefix, Content-Type). Only `<?xml` is looked for after leading whitespace.
RIFF_MASK = b"\xff\xff\xff\xff\x00\x00\x00\x00\xff\xff\xff\xff"  # any chunk size
SNIFF_SIGNATURES = (
    (b"%PDF-", None, "application/pdf"),
    (b"%!PS-Adobe-", None, "application/postscript"),
    (b"\xfe\xff\x00\x00", b"\xff\xff\x00\x00", "text/plain; charset=utf-16be"),
    (b"\xff\xfe\x00\x00", b"\xff\xff\x00\x00", "text/plain; charset=utf-16le"),
    (b"\xef\xbb\xbf\x00", b"\xff\xff\xff\x00", "text/plain; charset=utf-8"),
    (b"\x00\x00\x01\x00", None, "image/x-icon"),
    (b"\x00\x00\x02\x00", None, "image/x-icon"),
    (b"BM", None, "image/bmp"),
    (b"GIF87a", None, "image/gif"),
    (b"GIF89a", None, "image/gif"),
    (b"RIFF\x00\x00\x00\x00WEBPVP", RIFF_MASK + b"\xff\xff", "image/webp"),
    (b"\x89PNG\r\n\x1a\n", None, "image/png"),
    (b"\xff\xd8\xff", None, "image/jpeg"),
    (b"FORM\x00\x00\x00\x00AIFF", RIFF_MASK, "audio/aiff"),
    (b"ID3", None, "audio/mpeg"),
    (b"OggS\x00", None, "application/ogg"),
    (b"MThd\x00\x00\x00\x06", None, "audio/midi"),
    (b"RIFF\x00\x00\x00\x00AVI ", RIFF_MASK, "video/avi"),
    (b"RIFF\x00\x00\x00\x00WAVE", RIFF_MASK, "audio/wave"),
    (None, None, "video/mp4"),  # no fixed pattern: is_mp4 reads the box
    (b"\x1a\x45\xdf\xa3", None, "video/webm"),
    (b"\x00" * 34 + b"LP", b"\x00" * 34 + b"\xff\xff", "application/vnd.ms-fontobject"),
    (b"\x00\x01\x00\x00", None, "font/ttf"),
    (b"OTTO", None, "font/otf"),
    (b"ttcf", None, "font/collection"),
    (b"wOFF", None, "font/woff"),
    (b"wOF2", None, "font/woff2"),
    (b"\x1f\x8b\x08", None, "application/x-gzip"),
    (b"PK\x03\x04", None, "application/zip"),
    (b"Rar!\x1a\x07\x00", None, "application/x-rar-compressed"),
    (b"Rar!\x1a\x07\x01\x00", None, "application/x-rar-compressed"),
    (b"\x00asm", None, "application/wasm"),
)
BINARY_BYTES = re.compile(b"[\x00-\x08\x0b\x0e-\x1a\x1c-\x1f]")


def sniff_content_type(body):
    """Go's http.DetectContentType (Go 1.19, as Debian's webhook 2.8 is built): HTML and XML
    after leading whitespace, then the binary signatures at the very start, then text."""
    head = body[:512]
    data = head.lstrip(b"\t\n\x0c\r ")
    if data.startswith(b"<"):
        upper = data[:16].upper()
        for signature in HTML_SIGNATURES:
            if upper.startswith(signature) and data[len(signature):len(signature) + 1] in (
                    b" ", b">"):
                return "text/html; charset=utf-8"
        if data.startswith(b"<?xml"):
            return "text/xml; charset=utf-8"
    for pattern, mask, content_type in SNIFF_SIGNATURES:
        if pattern is None:
            if is_mp4(head):
                return content_type
        elif mask is None:
            if head.startswith(pattern):
                return content_type
        elif len(head) >= len(pattern) and all(
                b & m == p for b, m, p in zip(head, mask, pattern)):
            return content_type
    if BINARY_BYTES.search(data):
        return "application/octet-stream"
    return TEXT_PLAIN


def is_mp4(data):
    """Go's mp4 signature: an `ftyp` box whose brands include `mp4` (the version skipped)."""
    if len(data) < 12:
        return False
    size = int.from_bytes(data[:4], "big")
    if len(data) < size or size % 4 or data[4:8] != b"ftyp":
        return False
    return any(data[at:at + 3] == b"mp4" for at in range(8, size, 4) if at != 12)


class Response:
    """An answer: status, headers (an ordered dict of canonical name -> value) and body, bytes
    or a StreamedBody.  `close`: the connection ends after it.  `reason`: the status line's
    text where it is not Go's (a malformed request's detail); `bare`: Go's answer to a
    malformed request, without Date or Content-Length."""

    __slots__ = ("status", "headers", "body", "close", "reason", "bare")

    def __init__(self, status, body=b"", headers=None, close=False, reason=None, bare=False):
        self.status, self.body, self.close, self.reason, self.bare = (status, body, close,
                                                                       reason, bare)
        self.headers = headers if headers is not None else {}


def internal_error():
    """The answer to a bug (logged where it is caught): a 500, and the connection closed."""
    return Response(500, b"500 Internal Server Error", close=True)


class StreamedBody:
    """A body made while it is sent, as WSGI and bottle stream: `chunks` yields it piece by
    piece (a running command's output), and the writer sends each as it comes.  `complete`,
    read once it has ended: whether the answer ended as it should (else the closing chunk is
    left out, so the client sees it cut short).  `drain`: go on reading it once the client has
    gone (what makes it, a deploy, must not be held up by nobody reading)."""

    def __init__(self, chunks=None, drain=True):
        self.chunks, self.drain, self.complete = chunks, drain, True


HOP_BY_HOP = frozenset(("Content-Length", "Transfer-Encoding", "Connection"))


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
    """A path for Location, bytes that are not UTF-8 (kept as surrogates) included, as Go."""
    return urllib.parse.quote(path, safe="/:@!$&'()*+,;=-._~", errors="surrogateescape")


# ---------------------------------------------------------------------------
# HTTP transport: http.server's HTTPServer and BaseHTTPRequestHandler, through their documented
# hooks, over a WaitingRoom and a pool of Workers.  These two replace socketserver's
# ThreadingMixIn (a thread per connection) because of a product requirement: 5,000 idle and
# 500 slowly sending clients must not starve new ones (tests/test_webhookd_connections.py), so
# a connection holds no thread until a whole request head has come.  The application is
# reached through App.handle, App.answered and App.in_flight (a request being answered counts
# for the graceful stop).
# ---------------------------------------------------------------------------

def head_end(buf, start=0):
    """Index just past the blank line ending the request head, or -1.  The bytes before `start`
    are known to hold no end (a head arriving in pieces is scanned once, not again and again)."""
    start = max(0, start - 2)  # a line ends in LF or CRLF, so the blank one is LF [CR] LF
    crlf = buf.find(b"\n\r\n", start)
    lf = buf.find(b"\n\n", start, crlf if crlf >= 0 else len(buf))
    if lf >= 0:
        return lf + 2
    return crlf + 3 if crlf >= 0 else -1


def read_chunked(conn, limit):
    """A chunked request body from a Connection, capped at limit bytes; trailers are ignored."""
    body = bytearray()

    def line():
        text = conn.readline(4097)
        if not text.endswith(b"\n"):
            if len(text) > 4096:
                raise BadRequest(400, "chunk header too long")
            raise ConnectionResetError("client closed the connection")
        return text
    while True:
        # as Go: hex digits only (int() would also take `-5`, `0x5`, ` 5`, `5_0`)
        size_text = line().rstrip(b" \t\r\n").split(b";")[0]
        if not CHUNK_SIZE.fullmatch(size_text):
            raise BodyError("invalid byte in chunk length", bytes(body))
        size = int(size_text, 16)
        if len(body) + size > limit:
            raise body_too_large()
        if size == 0:
            while line().strip():
                pass
            return bytes(body)
        chunk = conn.read(size)
        if len(chunk) < size:
            raise ConnectionResetError("client closed the connection")
        body += chunk
        if line().strip():
            raise BodyError("malformed chunked encoding", bytes(body))


RECV_BYTES = 1 << 16
PARKED_HEAD_BYTES = 16384  # a head read in the WaitingRoom beyond this size counts against:
PARKED_LARGE_BYTES = 64 << 20  # what all such heads may hold together; beyond, one is closed
BODY_MIN_RATE = 16 << 10  # bytes/s a body must average (after -read-header-timeout's grace),
# counted on what has come: a 25 MiB body on a slow link still comes (27 min), a trickled one
# is cut off once it falls behind, not when its announced size would have been due
SKIP_BODY_BYTES = 256 << 10  # a body no one needs is read past up to this, as Go; else closed
SKIP_BODY_SECONDS = 0.5  # and for at most this long: a trickled one must not hold a worker
STALLED_READ_SECONDS = 1.0  # a worker's read stalled this long gives way to waiting connections
LINGER_SECONDS = 1.0  # closing with the client still sending: read on this long, then close
# Read on at most this much too: a client that sent a head of a few times the limit (Go's,
# 1 MiB) in one go still gets its 431 rather than a reset caused by its unread end.
LINGER_BYTES = 4 * MAX_HEADER_BYTES


class Limits:
    """What the transport is told by the daemon: -read-header-timeout (`header_timeout`, also
    each read of a body), -write-timeout, -max-body-bytes, and `stopping`, the Daemon's one
    stop signal (set: connections waiting for a request are closed, none is kept alive)."""

    def __init__(self, opts, stopping=None):
        self.header_timeout = float(opts.read_header_timeout) \
            if opts.read_header_timeout > 0 else NO_TIMEOUT
        self.write_timeout = float(opts.write_timeout) if opts.write_timeout > 0 else NO_TIMEOUT
        self.max_body = opts.max_body_bytes if opts.max_body_bytes > 0 else sys.maxsize
        self.stopping = stopping if stopping is not None else threading.Event()


class Connection:
    """One client connection: the handler's rfile and wfile.  Holds the bytes read ahead of the
    request being served (kept while the connection waits in the WaitingRoom, with no thread,
    and while a worker serves it) and the answer not yet sent (`outbox`: a client that does
    not read it waits in the WaitingRoom too).  A worker's reads time out at the head's
    deadline (`due`: from accept, or from the first byte of a later head), else after
    -read-header-timeout, and for a body also at `body_due`, which each byte of a body being
    paced moves on by 1/BODY_MIN_RATE s up to `body_ceiling`; its writes after
    -write-timeout."""

    __slots__ = ("sock", "address", "server", "limits", "tls", "buffer", "scanned", "due",
                 "body_due", "body_ceiling", "outbox", "handshaking", "closing")

    def __init__(self, sock, address, server, due):
        self.sock, self.address, self.server, self.due = sock, address, server, due
        self.limits, self.tls = server.limits, server.tls_context is not None
        self.body_due = self.body_ceiling = math.inf
        self.buffer, self.outbox = bytearray(), bytearray()
        self.scanned = 0  # the start of the buffer known to hold no head end
        self.handshaking = self.tls
        self.closing = False  # closed once the outbox is sent

    def scan_head_end(self):
        """head_end() of the buffer, remembering how far it holds no end."""
        end = head_end(self.buffer, self.scanned)
        if end < 0:
            self.scanned = len(self.buffer)
        return end

    def head_ready(self):
        """Whether a worker should take over: a whole head is here, or more than any head may
        be (answered 431)."""
        return self.scan_head_end() >= 0 or len(self.buffer) > MAX_HEADER_BYTES

    def still_open_after_wait(self, seconds):
        """A worker's short wait for the client's next request before parking the connection
        (cheaper than the round trip through the WaitingRoom): what comes is buffered; False
        if the client closed, True if it sent bytes or nothing yet.  A TLS record begun but
        not whole by then waits in the WaitingRoom, not here."""
        try:
            self.sock.settimeout(seconds)
            data = self.sock.recv(RECV_BYTES)
        except socket.timeout:
            return True
        except OSError:
            return False
        self.buffer += data
        return bool(data)

    def take(self, size):
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        self.scanned = 0
        return data

    def fill(self):
        """One recv into the buffer, before the read deadline: False at end of stream;
        socket.timeout once the deadline has passed, or once the client has kept a worker
        waiting STALLED_READ_SECONDS while other connections wait for one."""
        now = time.monotonic()
        due = min(self.due if self.due is not None else now + self.limits.header_timeout,
                  self.body_due)
        while True:
            if due <= now:
                raise socket.timeout("timed out")
            self.sock.settimeout(min(due - now, STALLED_READ_SECONDS))
            try:
                data = self.sock.recv(RECV_BYTES)
                break
            except socket.timeout:
                if self.server.room.workers.saturated():
                    raise
            now = time.monotonic()
        self.buffer += data
        if self.body_ceiling != math.inf:
            self.body_due = min(self.body_due + len(data) / BODY_MIN_RATE, self.body_ceiling)
        return bool(data)

    def skim(self, read, seconds):
        """read() (a body no one needs) for at most `seconds` in all: what it returns, or False
        if that was not enough time; the connection can answer either way."""
        until = time.monotonic() + seconds
        due, self.body_due = self.body_due, until
        try:
            return read()
        except socket.timeout:
            return False
        finally:
            self.body_due = due

    def read(self, size):
        while len(self.buffer) < size and self.fill():
            pass
        return self.take(size)

    def read1(self, size):
        """What is buffered, or one recv's worth: at most size bytes (b"" at end of stream)."""
        if not self.buffer:
            self.fill()
        return self.take(size)

    def readline(self, limit):
        while True:
            end = self.buffer.find(b"\n", 0, limit)
            if end >= 0:
                return self.take(end + 1)
            if len(self.buffer) >= limit or not self.fill():
                return self.take(limit)

    def write(self, data):
        self.outbox += data

    def flush(self, wait=True):
        """Send the outbox: all of it within -write-timeout (a client that does not read is cut
        off), or with `wait` False what the socket takes now, the rest left in the outbox."""
        if not self.outbox:
            return
        if wait:
            self.sock.settimeout(self.limits.write_timeout)
            self.sock.sendall(self.outbox)
            self.outbox.clear()
            return
        self.sock.settimeout(0.0)
        try:
            while self.outbox:
                del self.outbox[:self.sock.send(self.outbox)]
        except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            pass


def waiting_capacity(fd_limit, max_connections):
    """Connections that may wait for a request at once: a quarter of the descriptors and one
    per worker are left for the connections being served, commands and files."""
    if fd_limit == resource.RLIM_INFINITY:
        fd_limit = 1 << 20
    return max(64, fd_limit - fd_limit // 4 - max_connections)


class WaitingRoom:
    """Connections with no request to serve: new ones, kept-alive ones between requests, slow
    ones still sending a head, and those whose client has not read its last answer yet.  One
    thread watches them all with a selector (no thread each) and hands a connection to the
    Workers once a whole head has come.  It closes those past their deadline, and when more
    wait than descriptors allow, the oldest idle ones."""

    TICK_SECONDS = 0.25

    def __init__(self, workers, capacity, limits):
        self.workers, self.capacity, self.limits = workers, capacity, limits
        self.selector = selectors.DefaultSelector()
        self.inbox = deque()  # connections parked by other threads, for the watcher to take
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.idle = {}  # socket -> kept-alive Connection awaiting its next request, oldest first
        self.arriving = {}  # socket -> Connection whose request head is on its way
        self.sending = {}  # socket -> Connection whose client has not taken its answer yet
        self.large = 0  # bytes of the heads here beyond PARKED_HEAD_BYTES each
        threading.Thread(target=self._watch, name="waiting-room", daemon=True).start()

    def park(self, conn):
        """From any thread: the connection waits here, holding no thread, for its next head."""
        self.inbox.append(conn)
        try:
            self.wake_w.send(b"\0")
        except OSError:
            pass  # the wake-up socket is full: the watcher is about to run anyway

    def _watch(self):
        swept = 0.0
        while True:
            for key, _ in self.selector.select(self.TICK_SECONDS):
                if key.fileobj is self.wake_r:
                    self._take_inbox()
                else:
                    self._attend(key.data)
            now = time.monotonic()
            if now - swept >= self.TICK_SECONDS:
                swept = now
                stopping = self.limits.stopping.is_set()
                for waiting in (self.idle, self.arriving, self.sending):
                    for conn in [c for c in waiting.values()
                                 if c.due <= now or stopping and waiting is not self.sending]:
                        self._drop(conn)

    def _take_inbox(self):
        try:
            while self.wake_r.recv(4096):
                pass
        except OSError:
            pass
        while self.inbox:
            self._attend(self.inbox.popleft(), admit=True)
            # those waiting for a thread count too: they hold a descriptor each
            while (self.idle or self.arriving) and (
                    len(self.idle) + len(self.arriving) + len(self.sending)
                    + len(self.workers.ready) > self.capacity):
                self._drop(next(iter((self.idle or self.arriving).values())))

    def _admit(self, conn):
        conn.sock.setblocking(False)
        if conn.outbox:
            conn.due = time.monotonic() + self.limits.write_timeout
            self.sending[conn.sock] = conn
            self.selector.register(conn.sock, selectors.EVENT_WRITE, conn)
            return
        self._wait_for_head(conn, register=True)

    def _wait_for_head(self, conn, register=False):
        kept_alive = conn.due is None  # a new connection's head deadline runs from accept
        if kept_alive:
            conn.due = time.monotonic() + (self.limits.header_timeout if conn.buffer
                                           else KEEPALIVE_IDLE_SECONDS)
        waiting = self.idle if kept_alive and not conn.buffer else self.arriving
        waiting[conn.sock] = conn
        self.large += max(0, len(conn.buffer) - PARKED_HEAD_BYTES)
        if register:
            self.selector.register(conn.sock, selectors.EVENT_READ, conn)
        else:
            self.selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _attend(self, conn, admit=False):
        try:
            if admit:  # then read at once: bytes may be here (a TLS socket may even hold them)
                self._admit(conn)
            if conn.sock in self.sending:
                self._send(conn)
            elif conn.handshaking:
                self._handshake(conn)
            else:
                self._read(conn)
        except Exception:  # a bug costs one connection, never the watcher
            log.exception("unexpected error with the connection from %s",
                          format_peer(conn.address))
            self._drop(conn)

    def _send(self, conn):
        """The rest of an answer, as the client takes it; then its next request, or the end."""
        try:
            conn.flush(wait=False)
        except OSError:
            self._drop(conn)
            return
        if conn.outbox:
            return
        del self.sending[conn.sock]
        if conn.closing:
            self._drop(conn)
            return
        conn.due = None
        self._wait_for_head(conn)
        self._read(conn)

    def _handshake(self, conn):
        try:
            conn.sock.do_handshake()
        except ssl.SSLWantReadError:
            return
        except ssl.SSLWantWriteError:
            self.selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
            return
        except OSError as exc:  # closed at once, not when its deadline comes
            log.info("connection from %s: %s", format_peer(conn.address), exc)
            self._drop(conn)
            return
        conn.handshaking = False
        self.selector.modify(conn.sock, selectors.EVENT_READ, conn)
        self._read(conn)

    def _read(self, conn):
        """Take what the client sent; hand the connection over once its head is here."""
        try:
            while True:
                if conn.head_ready():
                    self._forget(conn)
                    conn.sock.setblocking(True)
                    try:
                        self.workers.hand_over(conn)
                    except RuntimeError as exc:  # no thread at all: refused, never left queued
                        log.error("connection from %s closed: no thread to serve it: %s",
                                  format_peer(conn.address), exc)
                        conn.sock.close()
                    return
                before = max(0, len(conn.buffer) - PARKED_HEAD_BYTES)
                data = conn.sock.recv(min(RECV_BYTES, MAX_HEADER_BYTES + 1 - len(conn.buffer))
                                      if len(conn.buffer) >= PARKED_HEAD_BYTES
                                      else PARKED_HEAD_BYTES - len(conn.buffer))
                if not data:  # the client closed it (mid-head too: as Go, no answer)
                    self._drop(conn)
                    return
                conn.buffer += data
                self.large += max(0, len(conn.buffer) - PARKED_HEAD_BYTES) - before
                if self.large > PARKED_LARGE_BYTES and conn.scan_head_end() < 0:
                    log.info("connection from %s closed: too many large request heads on their "
                             "way", format_peer(conn.address))
                    self._drop(conn)
                    return
                if not (conn.tls and conn.sock.pending()):
                    if conn.head_ready():
                        continue
                    break
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            pass
        except OSError:
            self._drop(conn)
            return
        if conn.buffer and self.idle.pop(conn.sock, None) is not None:
            conn.due = time.monotonic() + self.limits.header_timeout  # a head is coming
            self.arriving[conn.sock] = conn

    def _forget(self, conn):
        with contextlib.suppress(KeyError, ValueError):  # e.g. dropped after a failed hand-over
            self.selector.unregister(conn.sock)
        self.sending.pop(conn.sock, None)
        idle = self.idle.pop(conn.sock, None)
        if self.arriving.pop(conn.sock, None) is not None or idle is not None:
            self.large -= max(0, len(conn.buffer) - PARKED_HEAD_BYTES)

    def _drop(self, conn):
        self._forget(conn)
        conn.sock.close()


class Workers:
    """The threads serving requests: at most -max-connections, each serving one connection at
    a time, from its first complete head until it is parked again or closed.  A thread with
    nothing to do waits a while for the next connection, then ends."""

    IDLE_THREAD_SECONDS = 5.0

    def __init__(self, limit):
        self.limit = limit
        self.ready = deque()  # connections with a head, waiting for a thread
        self.cond = threading.Condition()
        self.threads = 0
        self.waiting = 0  # threads waiting for a connection

    def hand_over(self, conn):
        """Queue the connection for a thread, starting one if none is free.  When no thread
        can be started (a pids limit), the ones running take it; with none running, it is
        refused here (RuntimeError), never left queued for a thread that will not come."""
        with self.cond:
            self.ready.append(conn)
            if len(self.ready) > self.waiting and self.threads < self.limit:
                try:
                    threading.Thread(target=self._work, name="request", daemon=True).start()
                except RuntimeError:
                    if self.threads == 0:
                        self.ready.remove(conn)
                        raise
                    return
                self.threads += 1
            else:
                self.cond.notify()

    def saturated(self):
        """Every thread is taken and a connection waits: no time to wait for a client."""
        return self.threads >= self.limit and bool(self.ready)

    def _work(self):
        while True:
            with self.cond:
                until = time.monotonic() + self.IDLE_THREAD_SECONDS
                while not self.ready:
                    if time.monotonic() >= until:
                        self.threads -= 1
                        return
                    self.waiting += 1
                    self.cond.wait(until - time.monotonic())
                    self.waiting -= 1
                conn = self.ready.popleft()
            conn.server.finish_request(conn, conn.address)


class BodyReader:
    """A request's body, read when the App wants it (as WSGI's `wsgi.input`), built by the
    handler: read() takes it by Content-Length or chunked, capped at -max-body-bytes, after
    `100 Continue` (send_continue) if the client waits for it, all of it within
    -read-header-timeout plus its size (chunked: the cap) at BODY_MIN_RATE, so a client
    trickling it holds a worker for a bounded time (each byte by -read-header-timeout plus
    the bytes before it at BODY_MIN_RATE).  A chunked body malformed mid-way is logged and
    what came returned, `broken` set (as upstream: the hook runs with it, the connection
    closes).  A body that breaks off (the client closed, or fell behind that pace) raises
    OSError: unlike upstream, which logs `unexpected EOF` and runs the hook with what came,
    the hook does not run on half a payload, and a client gone or too slow gets no answer.
    `consumed` once read() was called (else the handler reads past it)."""

    __slots__ = ("request", "conn", "limits", "send_continue", "consumed", "broken")

    def __init__(self, request, conn, limits, send_continue):
        self.request, self.conn, self.limits = request, conn, limits
        self.send_continue = send_continue
        self.consumed = self.broken = False

    def read(self, limit=None):
        """The body; over `limit` bytes (or -max-body-bytes), a 413 (BadRequest)."""
        request, conn, limits = self.request, self.conn, self.limits
        max_body = limits.max_body if limit is None else min(limit, limits.max_body)
        size = body_length(request, max_body)  # refused before the client sends it
        self.consumed = True
        if request.get("Expect").lower() == "100-continue" and size != 0:
            self.send_continue()  # as Go: only when a body is announced
        # what was read ahead with the head counts for the body, as what comes later will;
        # bytes that are no body (trailers, chunk extensions) never take longer than all of it
        now = time.monotonic()
        conn.body_ceiling = now + limits.header_timeout + (
            max_body if size is None else size) / BODY_MIN_RATE
        conn.body_due = min(now + limits.header_timeout + len(conn.buffer) / BODY_MIN_RATE,
                            conn.body_ceiling)
        try:
            if size is None:
                return read_chunked(conn, max_body)
            body = bytearray()
            while len(body) < size:
                chunk = conn.read1(min(size - len(body), RECV_BYTES))
                if not chunk:
                    raise ConnectionResetError("client closed the connection")
                body += chunk
            return bytes(body)
        except BodyError as exc:
            log.info("error reading the request body: %s", exc)
            self.broken = True
            return exc.partial
        finally:
            conn.body_due = conn.body_ceiling = math.inf


class HookHandler(BaseHTTPRequestHandler):
    """BaseHTTPRequestHandler's cycle on a Connection a worker took from the WaitingRoom:
    handle() serves the requests whose heads have come; handle_one_request() reads the head
    and checks it as Go does (parse_request), makes it the one Request, asks the App for the
    Response (serve) and sends it with the one writer (send_answer: send_response,
    send_header, end_headers and wfile, with Go's header set).  Any method is served, as Go's
    mux does: there is no do_GET/do_POST dispatch."""

    protocol_version = "HTTP/1.1"

    def setup(self):
        self.conn = self.request  # a Connection: the socket and what was read ahead
        self.connection, self.rfile, self.wfile = self.conn.sock, self.conn, self.conn
        self.remote_addr = format_peer(self.client_address)
        self.request_version = "HTTP/1.1"
        self.kept_alive = False  # the connection is parked again, not closed, when we end
        self.answering = False  # some of the answer is written: too late for another
        self.body_unread = False  # the client may still be sending a body: close gently

    def handle(self):
        conn = self.conn
        while True:
            self.handle_one_request()
            if self.close_connection or self.server.limits.stopping.is_set():
                conn.closing = True
                self.kept_alive = bool(conn.outbox)  # sent from the WaitingRoom, then closed
                return
            if conn.outbox:  # the client reads slowly, or not at all: no thread waits for it
                self.kept_alive = True
                return
            if conn.head_ready():
                continue
            if not self.server.room.workers.saturated():
                if not conn.still_open_after_wait(NEXT_REQUEST_WAIT_SECONDS):
                    return  # the client closed it
                if conn.head_ready():
                    continue
            self.kept_alive = True  # the next request has not (fully) come: park it
            return

    def finish(self):
        pass  # each answer is flushed as it is made (or left to the WaitingRoom to send)

    def handle_one_request(self):
        self.close_connection, self.answering = True, False
        self.started = time.monotonic()
        try:
            self.parse_request()
            self.serve(self.head)
        except BadRequest as exc:
            self.answer_bad_request(exc)
        except OSError:  # the client went away or stalled: nothing to answer
            pass
        except Exception:  # a bug: logged and answered 500, never a silently dropped client
            log.exception("unexpected error handling a request from %s", self.remote_addr)
            if not self.answering:
                with contextlib.suppress(OSError):
                    self.send_answer(internal_error(), None)

    def parse_request(self):
        """Read the rest of the head, if it did not all come while the connection waited
        (-read-header-timeout for all of it), and check it as Go does: self.head, a Request.
        A bad head raises BadRequest (answered by handle_one_request through the one writer)
        rather than being answered here and False returned, as the base's does."""
        conn = self.conn
        if conn.due is None:  # a head that came while a worker held the connection
            conn.due = time.monotonic() + self.server.limits.header_timeout
        end = conn.scan_head_end()
        while end < 0 and len(conn.buffer) <= MAX_HEADER_BYTES:
            if not conn.fill():
                raise ConnectionResetError("client closed the connection")
            end = conn.scan_head_end()
        if end < 0 or end > MAX_HEADER_BYTES:
            raise BadRequest(431, "request header too large")
        self.head = parse_head(conn.take(end))
        conn.due = None  # from here on, each read of the body has -read-header-timeout

    def serve(self, request):
        """The request made whole (who sent it, its body to read), answered by the App."""
        app = self.server.app
        request.peer = self.remote_addr
        request.body = body = BodyReader(request, self.conn, self.server.limits,
                                         self.send_continue)
        app.in_flight.hold()
        try:
            response = app.handle(request)
            if body.broken:
                response.close = True
            elif not body.consumed:
                self.skip_body(request, response)
            self.send_answer(response, request)
        finally:  # no cycle (handler -> request -> body -> handler) keeps a large head alive
            app.in_flight.release()
            request.body = self.head = None
        if self.body_unread:
            self.linger()

    def skip_body(self, request, response):
        """An answer that does not need the body: read past a small one that comes at once (as
        Go, under 256 KiB), else close after the answer (so a body trickled in is no way to
        hold a worker), as when the client waits for `100 Continue`."""
        conn = self.conn
        try:
            size = body_length(request, self.server.limits.max_body)
        except BadRequest as exc:
            if exc.status != 413:  # a malformed one is Go's 400, whatever the route
                raise
            response.close = self.body_unread = True  # over -max-body-bytes: the app's answer
            return  # stands (Go's 404 or 405), and nothing more is read
        if size == 0:
            return
        skipped = False
        if request.get("Expect").lower() != "100-continue":  # else nothing comes
            try:
                if size is None:
                    skipped = conn.skim(lambda: read_chunked(conn, SKIP_BODY_BYTES) is not None,
                                        SKIP_BODY_SECONDS)
                elif size < SKIP_BODY_BYTES:
                    skipped = conn.skim(lambda: len(conn.read(size)) == size, SKIP_BODY_SECONDS)
            except (BodyError, BadRequest, OSError):  # too large, malformed, the client gone
                pass
        if not skipped:
            response.close = self.body_unread = True

    def send_continue(self):
        """`100 Continue`, sent by the BodyReader when the App reads a body the client waits
        to send (not the base's handle_expect_100: the base's parse_request, which calls that,
        is replaced, and Go sends it only once the body is read)."""
        self.protocol_version = "HTTP/1.1"  # (the last answer on the connection may be 1.0's)
        self.send_response_only(100)
        self.end_headers()
        self.wfile.flush()

    def answer_bad_request(self, exc):
        """Go's answer to a malformed request (a BadRequest): `<code> <reason>[: detail]`, then
        close; what the client is still sending is read for a moment so it gets the answer,
        not a reset."""
        log.info("bad request from %s: %s", self.remote_addr, exc)
        try:
            self.send_answer(exc.response(), None)
            self.linger()
        except OSError:
            pass

    def send_response(self, code, message=None):
        """The status line, with Go's reason phrase, and Date: no Server header (Go sends
        none)."""
        self.send_response_only(code, message or GO_STATUS_TEXT.get(code, "status code %d"
                                                                     % code))

    def send_header(self, keyword, value):
        """A header line as Go writes it: the bytes as they are (UTF-8), CR and LF in a value
        turned into spaces.  The base encodes in latin-1: the UTF-8 bytes are handed to it as
        the latin-1 text they spell, so the same bytes go out."""
        super().send_header(keyword, value.replace("\r", " ").replace("\n", " ").encode(
            "utf-8", "surrogateescape").decode("latin-1"))

    def send_answer(self, response, request):
        """The one writer of answers.  The head: Go's header set (Content-Type sniffed when the
        answer names none, Date, framing; names that are not tokens dropped).  The body: bytes
        in one write with the head, or a StreamedBody chunked as it comes (HTTP/1.0: ended by
        closing), without its closing chunk if it did not end complete.  HEAD gets the head.
        A bytes answer goes out as far as the client takes it now; the rest is sent from the
        WaitingRoom.  Counted (and logged) by the App once sent."""
        self.answering = True
        status, body, headers = response.status, response.body, response.headers
        version = request.version if request is not None else "HTTP/1.1"
        streamed = isinstance(body, StreamedBody)
        chunked = streamed and version == "HTTP/1.1"
        with_body = request is None or request.method != "HEAD"
        keep_alive = (request is not None and request.keep_alive() and not response.close
                      and not self.server.limits.stopping.is_set())
        self.protocol_version = self.request_version = version  # Go answers 1.0 in 1.0
        self.send_response(status, response.reason)
        if not streamed and body and "Content-Type" not in headers \
                and status not in NO_BODY_STATUSES:
            self.send_header("Content-Type", sniff_content_type(body))
        for name, value in headers.items():
            if name not in HOP_BY_HOP and name and set(name) <= TOKEN_CHARS:
                self.send_header(name, value)
        if not response.bare:
            self.send_header("Date", http_date())
        if streamed:
            keep_alive = keep_alive and chunked
            if chunked:
                self.send_header("Transfer-Encoding", "chunked")
        elif status in NO_BODY_STATUSES:
            body = b""
        elif not response.bare and (body or with_body):  # Go: a HEAD answer with no body
            self.send_header("Content-Length", str(len(body)))  # has no length at all
        if not keep_alive:
            if version != "HTTP/1.0":  # Go: an HTTP/1.0 answer closes without saying so
                self.send_header("Connection", "close")
        elif version == "HTTP/1.0":
            self.send_header("Connection", "keep-alive")
        self.end_headers()
        if streamed:
            keep_alive = self.send_streamed(body, chunked, with_body) and keep_alive
        else:
            if with_body:
                self.wfile.write(body)
            self.wfile.flush(wait=not keep_alive or response.bare)
        self.close_connection = not keep_alive
        self.server.app.answered(request, response, self.started)

    def send_streamed(self, body, chunked, with_body):
        """Send a StreamedBody's chunks as they come; whether the client got all of it, ended.
        Once the client has gone, the chunks are still read if the body says so."""
        wfile, alive = self.wfile, True
        try:
            wfile.flush()
        except OSError:
            alive = False
        for chunk in body.chunks:
            if alive and chunk and with_body:
                try:
                    wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                    wfile.flush()
                except OSError:
                    alive = False
            if not alive and not body.drain:
                body.chunks.close()
                break
        if alive and body.complete and chunked and with_body:
            try:
                wfile.write(b"0\r\n\r\n")
                wfile.flush()
            except OSError:
                alive = False
        return alive and body.complete

    def linger(self):
        """Before closing a connection the client may still be writing to: end our side and
        read what it sends for a moment, since closing with unread bytes sends a reset, which
        can destroy the answer before the client reads it."""
        self.conn.flush()
        self.connection.shutdown(socket.SHUT_WR)
        self.conn.due, drained = time.monotonic() + LINGER_SECONDS, 0
        while drained < LINGER_BYTES and self.conn.fill():
            drained += len(self.conn.buffer)
            self.conn.buffer.clear()


class HookServer(HTTPServer):
    """An HTTPServer on a socket opened before (-ip/-port, -socket or systemd's), made the
    documented way (bind_and_activate=False, then `socket`).  Overrides process_request where
    ThreadingMixIn would start a thread: an accepted connection holds no thread, but waits in
    the WaitingRoom until a whole request head has come; one of the Workers then serves it
    (finish_request: the handler's cycle), and it waits there again between requests."""

    def __init__(self, listener, app, room, limits, tls_context):
        HTTPServer.__init__(self, listener.getsockname(), HookHandler, bind_and_activate=False)
        self.socket.close()  # the one TCPServer made: ours was opened before
        self.socket, self.address_family = listener, listener.family
        self.app, self.room, self.limits, self.tls_context = app, room, limits, tls_context
        self.accept_delay = 0.0  # seconds get_request waits after running out of files

    def get_request(self):
        """accept(), backing off while open files run out (as Go's server does: 5 ms, doubled
        up to 1 s): the listener stays readable, and socketserver would retry at once, in a
        silent loop burning the CPU the connections already open need."""
        try:
            request = socketserver.TCPServer.get_request(self)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            self.accept_delay = min(1.0, self.accept_delay * 2 or 0.005)
            log.error("http: Accept error: %s; retrying in %dms", go_errno_text(exc),
                      self.accept_delay * 1000)
            time.sleep(self.accept_delay)
            raise
        self.accept_delay = 0.0
        return request

    def process_request(self, request, client_address):
        if self.limits.stopping.is_set():
            self.shutdown_request(request)
            return
        if request.family != socket.AF_UNIX:
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls_context is not None:  # the handshake is the WaitingRoom's, unblocked
            request = self.tls_context.wrap_socket(request, server_side=True,
                                                   do_handshake_on_connect=False)
        due = time.monotonic() + self.limits.header_timeout  # the first head's, from accept
        self.room.park(Connection(request, client_address, self, due))

    def finish_request(self, conn, client_address):
        """A worker's turn with a connection: its requests (the handler's cycle), then the
        connection parked again or closed."""
        handler = None
        try:
            handler = self.RequestHandlerClass(conn, client_address, self)
        except Exception:
            self.handle_error(conn.sock, client_address)
        if handler is not None and handler.kept_alive:
            self.room.park(conn)
        else:
            self.shutdown_request(conn.sock)

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.info("connection from %s: %s", format_peer(client_address), exc)
        else:
            log.exception("unexpected error serving %s", format_peer(client_address))


# ---------------------------------------------------------------------------
# App: request -> find hook -> payload -> rules -> argv/env -> run -> response
# ---------------------------------------------------------------------------

class HookRun:
    """One triggered hook, built once by Hooks.prepare (or Hooks.replay), carrying all a run
    needs to the runner: the hook, the request id, what to execute (`invocation`, or `failure`
    when it cannot run), the mode (`streamed`, `captured` or `background`), the hook's
    max-concurrency gate (`has_turn` once granted), the run's record (None without run
    history) and, in the background, the bytes its invocation holds in the backlog (`held`)."""

    def __init__(self, hook, request_id, mode, gate, record):
        self.hook, self.request_id, self.mode, self.gate = hook, request_id, mode, gate
        self.record, self.invocation, self.failure = record, None, None
        self.held = 0
        self.has_turn = False


class InFlight:
    """What the graceful stop waits for: requests being answered and background runs not
    ended (`count`: each hold() until its release()), and `stopping`, the Daemon's one stop
    signal (an Event, shared with the transport's Limits)."""

    def __init__(self, stopping=None):
        self.count = 0
        self.stopping = stopping if stopping is not None else threading.Event()
        self.lock = threading.Lock()

    def hold(self):
        with self.lock:
            self.count += 1

    def release(self):
        with self.lock:
            self.count -= 1


class App:
    """What a request does, with no socket in sight: handle() routes it as upstream's
    hookHandler does (its hook, or the plain answers: `/`, redirects, 404, 405, the status
    site) and returns the Response; a matched hook goes to Hooks.trigger."""

    def __init__(self, opts, registry, status_token, runs, stopping=None):
        self.opts = opts
        self.registry = registry
        self.prefix = "/" + opts.urlprefix + "/" if opts.urlprefix else "/"
        methods = opts.http_methods.replace(" ", "")
        self.default_methods = tuple(m.upper() for m in methods.split(",")) if methods else ()
        self.trusted_proxies = opts.trusted_proxy
        self.in_flight = InFlight(stopping)
        self.request_numbers = itertools.count(int.from_bytes(os.urandom(3), "big"))
        self.started = time.time()
        self.runs = runs
        self.metrics = Metrics(self.started)
        self.hooks = Hooks(opts, registry, self.runs, self.metrics, self.in_flight)
        self.runner = self.hooks.runner
        self.status_site = StatusSite(
            opts.status_path, status_token, registry, self.runs,
            lambda: self.metrics.render(self.registry, self.runner, self.hooks.background),
            self.started, self.in_flight.stopping.is_set, self.hooks)

    def request_id(self, request):
        if self.opts.x_request_id:
            given = request.get("X-Request-Id")
            if given:
                limit = self.opts.x_request_id_limit
                return given[:limit] if limit > 0 else given
        return "%06x" % (next(self.request_numbers) & 0xFFFFFF)

    def answered(self, request, response, started):
        """An answer has been sent (request None: to a malformed one): counted, and logged."""
        self.metrics.answered(response.status)
        if request is not None and request.id is not None and log.isEnabledFor(logging.INFO):
            body = response.body
            log.info("[%s] %d | %d B | %.6fms | %s | %s %s", request.id, response.status,
                     len(body) if isinstance(body, bytes) else 0,
                     (time.monotonic() - started) * 1000.0, request.get("Host"),
                     request.method, redact_target(request.target, request.secret_params))

    def handle(self, request):
        """The Response to a request, routed as upstream's hookHandler (through gorilla/mux):
        after the fixed answers (`*`, a redirect of an unclean path, `/`), to the status site
        (StatusSite.route) or a hook (answer_hook); 404 for anything else."""
        request.id = self.request_id(request)
        target = request.target
        if target.startswith(("http://", "https://")):
            target = "/" + target.split("/", 3)[3] if target.count("/") >= 3 else "/"
        if target == "*" and request.method == "OPTIONS":
            return Response(200)
        raw_path, _, request.raw_query = target.partition("?")
        path = request.path = go_unescape(raw_path, False)
        if path is None or not raw_path.startswith("/"):
            raise BadRequest(400, "invalid request target")
        cleaned = clean_path(path)
        if cleaned != path:
            location = go_escape_path(cleaned) + ("?" + request.raw_query
                                                  if request.raw_query else "")
            return Response(301, b"", {"Location": location})
        if path == "/":
            return Response(200, b"OK")
        status_route = self.status_site.route(path)
        if status_route:
            return self.status_site.answer(request, *status_route)
        if path.startswith(self.prefix) and "\n" not in path:
            return self.answer_hook(request, path[len(self.prefix):])
        return Response(404, MSG_PAGE_NOT_FOUND, {
            "Content-Type": TEXT_PLAIN, "X-Content-Type-Options": "nosniff"})

    def answer_hook(self, request, hook_id):
        """The answer of a path under the hook prefix: its hook's (Hooks.trigger), or 404/405."""
        request.client = self.client(request)
        log.info("[%s] incoming HTTP %s request from %s", request.id, request.method,
                 request.client)
        hook = self.registry.hook(hook_id)
        if hook is None:
            return Response(404, MSG_HOOK_NOT_FOUND)
        allowed = hook.allowed_methods or self.default_methods
        if allowed and request.method not in allowed:
            log.info("[%s] HTTP %s method not allowed for hook %s", request.id, request.method,
                     json.dumps(hook_id))
            return Response(405)
        request.secret_params = hook.secret_params
        body = request.body.read()
        try:
            return self.hooks.trigger(request, hook, self.hook_request(request, hook, body))
        except Exception:  # a bug must cost one 500, not a hung connection
            log.exception("unexpected error handling %s %s", request.method, request.target)
            return internal_error()

    def client(self, request):
        """Who sent a hook's request (see forwarded_client); the status page and run history
        never ask this (StatusSite.trusted: any relay header means relayed)."""
        if not self.trusted_proxies or "X-Forwarded-For" not in request.headers:
            return request.peer
        return forwarded_client(request.peer, ",".join(request.headers["X-Forwarded-For"]),
                                self.trusted_proxies)

    def hook_request(self, request, hook, body):
        """The plain HookRequest the hook model sees; logs the match."""
        rid = request.id
        log.info("[%s] %s got matched", rid, hook.id)
        if self.opts.debug:
            shown = {name: ["<redacted>"] if name in hook.secret_headers else values
                     for name, values in request.headers.items()}
            log.debug("[%s] request dump: %s %s %s %r (%d byte body)", rid, request.method,
                      redact_target(request.target, hook.secret_params), request.version,
                      shown, len(body))
        return HookRequest.of(request, hook, body)


class Hooks:
    """What a matched hook does, as upstream's handler after the match: trigger() parses the
    payload, checks the rules, builds argv/env and runs the command in the hook's mode
    (streamed, captured, or in the background, as its when-busy and debounce say), each run
    recorded and counted."""

    def __init__(self, opts, registry, runs, metrics, in_flight):
        self.registry, self.runs, self.metrics, self.in_flight = registry, runs, metrics, in_flight
        self.response_headers = {canonical_header(n): v for n, v in opts.header}
        self.runner = Runner()
        self.background = BackgroundRuns(opts.max_async_runs, opts.max_body_bytes
                                         if opts.max_body_bytes > 0 else sys.maxsize)
        self.when_busy = WhenBusy(self.run_in_background, self.pass_over)

    def trigger(self, http_request, hook, hook_request):
        """parse payload -> check rules -> build argv/env -> run -> the Response (for the
        HookRequest the App built from http_request, the Request)."""
        rid, headers = hook_request.id, dict(self.response_headers)
        try:
            messages = parse_payload(hook_request, hook, http_request.get("Content-Type"))
        except MultipartError as exc:
            log.info("[%s] error parsing multipart form: %s", rid, exc)
            return Response(500, MSG_MULTIPART_ERROR, headers)
        messages += apply_json_parameters(hook, hook_request)
        for message in messages:
            log.info("[%s] %s", rid, message)

        trace = [] if self.runs.keep else None  # explained only where it can be kept
        satisfied, error, note = rules_satisfied(hook, hook_request, trace)
        if note:
            log.info("[%s] %s", rid, note)
        if error is not None or not satisfied:
            self.metrics.refused(hook.id)
            if trace:
                self.runs.refused(hook.id, hook_request, trace[0])
        if error is not None:
            log.info("[%s] error evaluating hook: %s", rid, error)
            return Response(500, MSG_RULES_ERROR, headers)
        if not satisfied:
            log.info("[%s] %s got matched, but didn't get triggered because the trigger rules "
                     "were not satisfied", rid, hook.id)
            return Response(status_or_200(hook.mismatch_status, rid, hook),
                            MSG_RULES_NOT_SATISFIED, headers)
        for name, value in hook.response_headers:
            headers[canonical_header(name)] = value
        delivery = self.delivery(hook, hook_request)
        with self.runs.claim(hook.id, delivery) as (earlier, state):
            if state in DELIVERY_HANDLED:
                return self.deduplicated(hook, rid, delivery, earlier, state, headers)
            log.info("[%s] %s hook triggered successfully", rid, hook.id)
            mode = "streamed" if hook.stream_output else "captured" if hook.capture_output \
                else "background"
            run = self.prepare(hook, hook_request, mode, delivery, earlier)
        if run is None:
            log.info("[%s] the background runs' backlog is full (%d runs or %d bodies' worth "
                     "of commands): %s refused", rid, ASYNC_BACKLOG_LIMIT, ASYNC_BACKLOG_BODIES,
                     hook.id)
            return Response(503, MSG_BACKLOG_FULL, headers)
        if run.record is not None:
            headers["X-Webhookd-Run"] = run.record.id
        success = status_or_200(hook.success_status, rid, hook)
        if run.mode == "streamed":
            return self.run_streamed(run, headers, success)
        if run.mode == "captured":
            return captured_response(hook, self.run_captured(run), headers, success)
        if not self.when_busy.admit(run):  # when-busy: drop
            return Response(200, MSG_BUSY_DROPPED, headers)
        return Response(success, hook.response_message.encode("utf-8", "surrogateescape"),
                        headers)

    def delivery(self, hook, request):
        """The delivery id of a request to a deduplicating hook (delivery_id), or None."""
        delivery = delivery_id(hook, request)
        if delivery is not None and not self.runs.keep:
            log.warning("[%s] %s: delivery %s is not deduplicated: -runs-keep 0 keeps no runs "
                        "to compare it with", request.id, hook.id, delivery)
            return None
        return delivery

    def deduplicated(self, hook, rid, delivery, earlier, state, headers):
        """The answer to a delivery already run (or going): 200, naming that run and its
        state when claimed."""
        self.metrics.deduplicated(hook.id)
        log.info("[%s] %s: delivery %s was already run as %s (%s): not run again", rid,
                 hook.id, delivery, earlier.id, state)
        headers["X-Webhookd-Run"] = earlier.id
        headers.setdefault("Content-Type", TEXT_PLAIN)
        return Response(200, ("Already run as %s (%s).\n" % (earlier.id, state)).encode(),
                        headers)

    def prepare(self, hook, request, mode, delivery=None, earlier=None):
        """The HookRun of a triggered hook: its argv/env, built now so that no request or body
        waits in a queue, and its record (on disk before its id is handed out), which keeps the
        `delivery` id and the `earlier` run of it.  None when a background run would hold more
        than the backlog has room for (its bytes are counted before any record exists)."""
        invocation = failure = None
        try:
            invocation = build_invocation(hook, request)
        except (OSError, ValueError) as exc:  # ValueError: a NUL in a path
            log.info("[%s] error in exec: %s", request.id, getattr(exc, "strerror", None) or exc)
            if " " in hook.execute_command:
                log.info("[%s] use 'pass-arguments-to-command' to specify args for '%s'",
                         request.id, hook.execute_command.split()[0])
            failure = exc
        else:
            for message in invocation.messages:
                log.info("[%s] %s", request.id, message)
        held = invocation.size() if invocation and mode == "background" else 0
        if mode == "background" and not self.background.reserve(held):
            return None
        run = HookRun(hook, request.id, mode, self.gate(hook), self.runs.open(
            hook.id, request, invocation, delivery, earlier and earlier.id))
        run.invocation, run.failure, run.held = invocation, failure, held
        return run

    def replay(self, original, request):
        """POST <status-path>/runs/<id>/replay (StatusSite.replay): the kept invocation of the
        run `original` again, as it ran (argv, environment, stdin and files; not built again
        from a hooks file that may have changed since), in the background whatever the hook's
        mode (the output is in the record), under the hook as it is served now (it waits for
        its max-concurrency turn whatever the hook's when-busy; its command timeout and
        masking): (the new run's record, None), or (None, (status, why)) when it cannot run."""
        hook, invocation = self.registry.hook(original.hook), original.invocation
        refusal = self.replay_refusal(original, hook)  # (the hook looked up once: a reload
        if refusal is not None:  # may remove it meanwhile)
            return None, refusal
        if not self.background.reserve(invocation.size()):
            return None, (503, "the background runs' backlog is full: try again later")
        replayer = HookRequest(request.id, request.method, request.peer, {}, {}, b"", "")
        run = HookRun(hook, request.id, "background", self.gate(hook),
                      self.runs.open(hook.id, replayer, invocation, replay_of=original.id))
        run.invocation, run.held = invocation, invocation.size()
        log.info("[%s] replaying run %s of %s as run %s", request.id, original.id, hook.id,
                 run.record.id)
        # a deliberate replay waits for its max-concurrency turn in arrival order: when-busy's
        # latest/drop/debounce are about bursts of deliveries, not a person asking again
        run.gate.enter(lambda: self.run_in_background(run))
        return run.record, None

    def replay_refusal(self, record, hook):
        """Why a run cannot be replayed (`hook`: the one served under its hook's id now), as
        (status, sentence), or None if it can."""
        if record.state == "refused":
            return 409, "run %s is a refused delivery: it ran nothing to replay" % record.id
        if record.invocation is None:
            return 410, ("the invocation of run %s is not kept: only runs whose command was "
                         "built since the daemon started can be replayed (it is kept in memory "
                         "only, never in -runs-dir)" % record.id)
        if hook is None:
            return 409, ("hook %s is no longer served: only a hook the hooks files still hold "
                         "is replayed" % json.dumps(record.hook))
        return None

    def gate(self, hook):
        return self.registry.gate(hook.id) or HookGate(0)

    def start(self, run, keep, streamed=False):
        """Wait for the hook's max-concurrency turn (unless the run holds it), then start the
        command: the Running (not started: `failure`, or Runner.start's), and the generator of
        its output, which keeps each chunk in the record and, at its end, logs and records how
        the run ended and gives the turn back."""
        if not run.has_turn:
            run.gate.wait_turn()
        began, record = time.monotonic(), run.record
        try:
            if run.failure is not None:  # as Go: nothing more is logged
                running = Running(self.runner, run.request_id, None)
                running.result = CommandResult(False, error=run.failure)
            else:
                if record is not None:
                    self.runs.started(record)
                running = self.runner.start(run.invocation, run.request_id,
                                            run.hook.command_timeout,
                                            keep or streamed or record is not None)
        except BaseException:
            run.gate.leave()
            raise
        return running, self.run_output(run, running, began, keep)

    def run_output(self, run, running, began, keep):
        kept = [] if keep else None
        masked = run.hook.masker.stream()  # what the record keeps; the answer stays Go's
        try:
            for chunk in running.output():
                if run.record is not None:
                    shown = masked(chunk)
                    if shown:
                        self.runs.output(run.record, shown)
                if kept is not None:
                    kept.append(chunk)
                yield chunk
        finally:
            result = running.result or CommandResult(False, error="unexpected error")
            if kept is not None:
                result.output = b"".join(kept)
            try:
                if run.failure is None:
                    log_result(run.hook, run.request_id, result, kept is not None)
                stopping = self.in_flight.stopping.is_set()
                self.metrics.run_ended(run.hook.id, run_outcome(result, stopping)[0],
                                       time.monotonic() - began if result.started else None)
                if run.record is not None:
                    rest = masked(b"", last=True)
                    if rest:
                        self.runs.output(run.record, rest)
                    self.runs.ended(run.record, result, stopping)
            finally:
                run.gate.leave()

    def run_captured(self, run, keep_output=True):
        """Run to the end in this thread: the CommandResult, its output kept if asked."""
        running, output = self.start(run, keep_output)
        for _ in output:
            pass
        return running.result

    def run_in_background(self, run):
        """Default mode, the backlog reserved (`run.held` bytes with it), once the run's turn
        has come (WhenBusy: when-busy, debounce, max-concurrency; it waited holding no
        thread): it waits for a -max-async-runs thread."""
        run.has_turn = True
        self.in_flight.hold()  # released when the job ends, in another thread

        def job():
            try:
                if self.in_flight.stopping.is_set():  # its record says `killed` at exit
                    log.info("[%s] stopping: queued run of %s dropped", run.request_id,
                             run.hook.id)
                    run.gate.leave()
                else:
                    self.run_captured(run, keep_output=log.isEnabledFor(logging.INFO))
            finally:
                self.in_flight.release()

        self.background.submit(job, run.held)

    def pass_over(self, run, state, successor):
        """A background run that will never run (WhenBusy): `superseded` by the successor's
        run, or `dropped`; recorded, counted, and its room in the backlog given back."""
        log.info("[%s] %s not run: %s", run.request_id, run.hook.id, "dropped, the hook is busy"
                 if successor is None else "superseded by the run of request %s"
                 % successor.request_id)
        self.metrics.run_ended(run.hook.id, state, None)
        if run.record is not None:
            self.runs.passed_over(run.record, state,
                                  None if successor is None else successor.record.id)
        self.background.release(run.held)

    def run_streamed(self, run, headers, success):
        """stream-command-output: the answer's body is the output, sent (chunked) while the
        command runs.  A failed or timed out run ends without the closing chunk, so the client
        sees an incomplete response; one that could not start is a 500, before any head."""
        headers.setdefault("Content-Type", TEXT_PLAIN)
        headers.update(SANDBOXED)
        running, output = self.start(run, False, streamed=True)
        if running.result is not None and not running.result.started:
            for _ in output:  # ends at once: logged and recorded
                pass
            headers["Content-Type"] = TEXT_PLAIN
            return Response(500, MSG_COMMAND_ERROR, headers)
        body = StreamedBody()

        def chunks():
            for chunk in output:
                yield chunk
            body.complete = running.result.ok
        body.chunks = chunks()
        return Response(success, body, headers)


# a redelivery runs otherwise; a superseded delivery's work is its successor's (when-busy)
DELIVERY_HANDLED = frozenset(("queued", "running", "succeeded", "superseded"))
DELIVERY_ID = re.compile(r"[!-~]{1,128}")  # longer ids, or with other characters, are hashed


def delivery_id(hook, request):
    """The id of the delivery a request to a deduplicating hook carries: the value of the first
    of its `deduplicate` headers the request has (not empty), as sent if at most 128 visible
    ASCII characters, else `sha256:` and the hex digest of it (so that the id of any request
    costs the history as little, and shows no control character), as is a header kept out of
    the logs (a token, a signature: records and logs show the id) and one sent as `sha256:...`
    (it would be the id of the value it digests); None when it has none."""
    for name in hook.delivery_headers:
        value = request.headers.get(name)
        if value:
            if DELIVERY_ID.fullmatch(value) and name not in hook.secret_headers \
                    and not value.startswith("sha256:"):
                return value
            return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()
    return None


def status_or_200(code, rid, hook):
    """A hook's configured status, or 200 (logged) for a code Go's StatusText lacks, as upstream."""
    if not code:
        return 200
    if code in GO_STATUS_TEXT and code >= 200:
        return code
    log.info("[%s] %s got matched, but the configured return code %d is unknown - "
             "defaulting to 200", rid, hook.id, code)
    return 200


def log_result(hook, rid, result, output_collected):
    """Upstream's log lines for a finished (or failed) run."""
    if not result.started:
        log.info("[%s] error occurred: %s", rid, result.error)
    else:
        if output_collected:
            log.info("[%s] command output: %s", rid,
                     hook.masker.bytes(result.output).decode("utf-8", "replace"))
        if result.timed_out:
            log.info("[%s] error occurred: command timed out after %gs; process group "
                     "stopped", rid, hook.command_timeout)
        elif result.returncode:
            log.info("[%s] error occurred: %s", rid, describe_exit(result.returncode))
    log.info("[%s] finished handling %s", rid, hook.id)


# A command's output, which a client's input can shape, served from the status page's origin:
# as HTML (Go's sniffing may say so) it runs no script and reads nothing of that origin.
SANDBOXED = {"Content-Security-Policy": "sandbox"}


def captured_response(hook, result, headers, success):
    """The answer of include-command-output-in-response, once the command has ended."""
    headers.update(SANDBOXED)
    if result.ok:
        return Response(success, result.output, headers)
    # No Content-Type of ours: Go sets text/plain after writing the 500, which changes nothing,
    # so a Content-Type of `response-headers` stays and otherwise the body is sniffed.
    if result.timed_out:
        return Response(504, MSG_TIMED_OUT, headers)
    body = result.output if hook.capture_output_on_error else MSG_COMMAND_ERROR
    return Response(500, body, headers)


# ---------------------------------------------------------------------------
# Payload parsing and parameter sources (pure)
# ---------------------------------------------------------------------------

class GoNumber(str):
    """A JSON number kept as written (Go's json.Number): `1.50` stays `1.50`."""

    # No __dict__: a body of millions of numbers stays small.  Instances are still tracked by
    # the garbage collector, so integers are kept as plain ints where they read back the same
    # (go_integer): a 25 MiB body of numbers then costs other threads far less.
    __slots__ = ()


class NilMap(dict):
    """A multipart JSON part that did not decode into an object: Go keeps a nil map (`null`)."""


def _reject_constant(name):
    raise ValueError("invalid JSON value %s" % name)


def go_number(text):
    """GoNumber(text), called as Python code: the decoder runs a body of millions of numbers
    in one call, and only Python code lets other threads take turns meanwhile."""
    return GoNumber(text)


def go_integer(text):
    """An integer literal as a plain int where str() gives back the same text (the garbage
    collector does not track ints: a body of millions of them costs it nothing), else as
    written (`-0`; long literals, whose conversion would cost more than it saves)."""
    if len(text) > 18 or text == "-0":
        return GoNumber(text)
    return int(text)


JSON_DECODER = json.JSONDecoder(parse_float=go_number, parse_int=go_integer,
                                parse_constant=_reject_constant)
JSON_SPACE = " \t\n\r"


SURROGATE = re.compile("[\ud800-\udfff]")
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def decode_json_value(text):
    """The first JSON value of text (Go's Decoder.Decode: trailing data is ignored).  Text
    decoded with surrogateescape: Go reads each byte that is not UTF-8, and each `\\u` escape
    of a lone surrogate, as U+FFFD."""
    start = len(text) - len(text.lstrip(JSON_SPACE))
    if start == len(text):
        raise ValueError("EOF")
    try:
        value, _ = JSON_DECODER.raw_decode(text, start)
        if SURROGATE.search(text) or SURROGATE_ESCAPE.search(text):  # rare: scan only then
            value = without_surrogates(value)
    except json.JSONDecodeError as exc:
        raise ValueError(str(exc)) from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    return value


def without_surrogates(value):
    """value with every surrogate in its strings and keys replaced by U+FFFD."""
    if type(value) is str:  # not a GoNumber
        return SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {without_surrogates(k): without_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_surrogates(v) for v in value]
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
    if escaped is None:  # a surrogate: a byte that was not UTF-8, escaped as Go does
        escaped = "\\ufffd" if "\ud800" <= ch <= "\udfff" else "\\u%04x" % ord(ch)
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
    if isinstance(value, GoNumber) or type(value) is int:
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


QUERY_PAIR = re.compile("[^&]+")


def parse_query(text):
    """url.ParseQuery: (first value per key, ok).  A bad pair (bad escape, `;`) is skipped and
    makes ok False, as Go returns an error then."""
    values, ok = {}, True
    for found in QUERY_PAIR.finditer(text):  # one at a time: a body of millions of pairs
        pair = found.group()                 # would be split in one long call
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
    text = body.decode("utf-8", "surrogateescape")
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
UTF8_BOM = b"\xef\xbb\xbf"


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
    # Go reads UTF-8 only, skipping a byte order mark.  expat would also read UTF-16 and ask
    # Python's codec registry for any declared name (it remembers every name it is asked for,
    # and an unknown one raises LookupError): both are refused here, and expat is told UTF-8.
    if body[:2] in (b"\xfe\xff", b"\xff\xfe") or b"\x00" in body[:2]:
        raise PayloadError("error parsing XML payload: invalid UTF-8")
    declared = XML_DECLARED_ENCODING.match(body, len(UTF8_BOM) if body.startswith(UTF8_BOM) else 0)
    if declared and declared.group(1).lower() not in (b"utf-8", b"utf8"):
        raise PayloadError("error parsing XML payload: unsupported encoding %s"
                           % declared.group(1)[:64].decode("ascii", "replace"))
    parser = expat.ParserCreate("utf-8")
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


# Go's unicode.IsSpace, which mime.ParseMediaType trims with
GO_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008" \
           "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
MIME_TOKEN = r'[^\x00-\x20\x7f-\U0010ffff()<>@,;:\\"/\[\]?=]+'
MIME_TSPECIAL = r'[()<>@,;:\\"/\[\]?=]'
MIME_SPACES = re.compile("[%s]*" % GO_SPACE)
MIME_TYPE = re.compile(r"%s(?:/%s)?\Z" % (MIME_TOKEN, MIME_TOKEN))
# One `; name=value` with Go's quoting: a backslash escapes only a tspecial (otherwise it is a
# literal backslash), no line break inside quotes.  Every character has one reading: no
# backtracking, linear time.
MIME_PARAM = re.compile(r'[{s}]*;[{s}]*({tok})[{s}]*=[{s}]*(?:({tok})|"((?:\\{ts}|\\(?!{ts})|'
                        r'[^"\r\n\\])*)")'.format(s=GO_SPACE, tok=MIME_TOKEN, ts=MIME_TSPECIAL))
MIME_ESCAPE = re.compile(r"\\(%s)" % MIME_TSPECIAL)
MEDIA_TYPE_MAX = 16384  # longer Content-Type or Content-Disposition values are refused


class MediaTypeError(ValueError):
    """A Content-Type or Content-Disposition value mime.ParseMediaType refuses."""


def parse_media_params(value):
    """mime.ParseMediaType of Go 1.19: (type, {param: value}) with RFC 2231 continuations
    (`name*0`, `name*1*`) and encodings (`name*=utf-8''%41`) joined; a malformed parameter or a
    name given twice raises MediaTypeError, as does a value over MEDIA_TYPE_MAX characters."""
    if len(value) > MEDIA_TYPE_MAX:
        raise MediaTypeError("media type longer than %d characters" % MEDIA_TYPE_MAX)
    base = value.partition(";")[0]
    media = base.lower().strip(GO_SPACE)
    if not MIME_TYPE.match(media):
        raise MediaTypeError("mime: malformed media type")
    params, pieces, pos = {}, {}, len(base)
    while True:
        pos = MIME_SPACES.match(value, pos).end()
        if pos == len(value):
            break
        found = MIME_PARAM.match(value, pos)
        if found is None:
            if value[pos:].strip(GO_SPACE) == ";":
                break  # a trailing semicolon is allowed
            raise MediaTypeError("mime: invalid media parameter")
        key = found.group(1).lower()
        quoted = found.group(3)
        target = pieces.setdefault(key.partition("*")[0], {}) if "*" in key else params
        if key in target:
            raise MediaTypeError("mime: duplicate parameter name")
        target[key] = found.group(2) if quoted is None else MIME_ESCAPE.sub(r"\1", quoted)
        pos = found.end()
    for name, parts in pieces.items():
        joined = join_rfc2231(name, parts)
        if joined is not None:
            params[name] = joined
    return media, params


def join_rfc2231(name, parts):
    """The value of parameter `name` from its RFC 2231 pieces (`name*`, `name*0`, `name*1*`,
    ...) as Go joins them; None when there is none to use."""
    if name + "*" in parts:
        return decode_rfc2231(parts[name + "*"])
    joined, index = [], 0
    while True:
        piece = "%s*%d" % (name, index)
        if piece in parts:
            joined.append(parts[piece])
        elif piece + "*" in parts:
            encoded = parts[piece + "*"]
            decoded = decode_rfc2231(encoded) if index == 0 else go_unescape(encoded, False)
            joined.append(decoded or "")
        else:
            return "".join(joined) if index else None
        index += 1


def decode_rfc2231(text):
    """`charset'language'percent-encoded` (us-ascii or utf-8 only), None if not that."""
    fields = text.split("'", 2)
    if len(fields) != 3 or fields[0].lower() not in ("us-ascii", "utf-8"):
        return None
    return go_unescape(fields[2], False)


MULTIPART_DELIMITER_END = re.compile(rb"(--)?[ \t]*(?:\r?\n|$)")
MULTIPART_MAX_PARTS = 1000  # Go 1.19.8's limits: more is "multipart: message too large"
MULTIPART_MAX_HEADERS = 10000  # header lines in one part


def multipart_delimiters(body, boundary):
    """(start, end, is the closing one) of each delimiter line (`--boundary` at the start of
    the body or of a line, optionally `--`, blanks, a line end), lazily: a malformed part ends
    the scan.  Found with bytes.find, as a regex without a literal to start from would try
    every position of the body in one long call; and found with the line break in front, so
    a body of dashes is one scan, not one comparison of the boundary per byte."""
    dash_boundary = b"--" + boundary
    line_start = b"\n" + dash_boundary
    at, pos = (0 if body.startswith(dash_boundary) else -1), 0
    while True:
        if at < 0:
            found = body.find(line_start, pos)
            if found < 0:
                return
            at = found + 1
        after = MULTIPART_DELIMITER_END.match(body, at + len(dash_boundary))
        if after is None:  # `--boundary` then other text: look on from the next line
            at, pos = -1, at
            continue
        start = at - 2 if at - 2 >= pos and body[at - 2:at] == b"\r\n" else max(at - 1, 0)
        yield start, after.end(), after.group(1) is not None
        at, pos = -1, after.end()


def split_part(part):
    """Headers and content of one multipart part (CRLF or bare LF line endings)."""
    for separator in (b"\r\n\r\n", b"\n\n"):
        if part.startswith(separator[len(separator) // 2:]):
            return {}, part[len(separator) // 2:]
    crlf, lf = part.find(b"\r\n\r\n"), part.find(b"\n\n")
    if crlf < 0 and lf < 0:
        raise MultipartError("malformed MIME header: missing blank line")
    end, skip = (crlf, 4) if crlf >= 0 and (lf < 0 or crlf < lf) else (lf, 2)
    if part.count(b"\n", 0, end) >= MULTIPART_MAX_HEADERS:  # counted before any is split
        raise MultipartError("multipart: message too large")
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
    try:
        media, params = parse_media_params(content_type)
    except MediaTypeError as exc:
        raise MultipartError("request Content-Type isn't multipart/form-data: %s" % exc) from None
    boundary = params.get("boundary")
    if media != "multipart/form-data" or not boundary:
        raise MultipartError("no multipart boundary param in Content-Type")
    marks = multipart_delimiters(body, boundary.encode("utf-8", "replace"))
    mark = next(marks, None)
    if mark is None:
        raise MultipartError("NextPart: EOF")
    payload, file_names, json_files, count = None, set(), set(), 0
    while not mark[2]:
        following = next(marks, None)
        if following is None:
            raise MultipartError("NextPart: unexpected EOF")
        count += 1
        if count > MULTIPART_MAX_PARTS:
            raise MultipartError("multipart: message too large")
        headers, data = split_part(body[mark[1]:following[0]])
        mark = following
        name, is_file = form_part_name(headers)
        if not name or name in json_files:
            continue  # a JSON file part wins over fields of its name (as upstream)
        if is_file:
            if name in file_names:
                continue  # only the first file part of a name is looked at (as upstream)
            file_names.add(name)
            if not (name in json_part_names
                    or "application/json" in headers.get("Content-Type", [])):
                continue  # other file parts are not part of the payload
        if payload is None:
            payload = {}
        if not is_file:
            payload.setdefault(name, data.decode("utf-8", "surrogateescape"))
        else:
            try:
                value = decode_json_object(data.decode("utf-8", "surrogateescape"))
            except ValueError:
                value = None
            payload[name] = NilMap() if value is None else value
            json_files.add(name)
    return payload


def form_part_name(headers):
    """(form field name, is a file) of one part, as Go's Part.FormName and FileName see its
    Content-Disposition: no name when that is not form-data or cannot be parsed."""
    try:
        kind, disposition = parse_media_params(headers.get("Content-Disposition", [""])[0])
    except MediaTypeError:
        return "", False
    if kind != "form-data":
        return "", False
    return disposition.get("name", ""), bool(disposition.get("filename"))


class HookRequest:
    """What rules and arguments can see of one request."""

    __slots__ = ("id", "method", "remote_addr", "headers", "query", "query_ok", "payload",
                 "body", "raw_body", "content_type", "allow_signature_errors", "masker")

    def __init__(self, request_id, method, remote_addr, headers, query, body, content_type):
        self.id, self.method, self.remote_addr = request_id, method, remote_addr
        self.headers, self.query, self.body = headers, query, body
        self.raw_body = body  # as received, even where `body` is emptied (multipart)
        self.content_type, self.payload = content_type, None
        self.query_ok = True  # False: the query string had a pair url.ParseQuery refuses
        self.allow_signature_errors = False
        self.masker = None  # the hook's, that its explained rules are shown through

    @classmethod
    def of(cls, request, hook, body):
        """The HookRequest of an HTTP Request (its id and client set) and its body."""
        query, query_ok = parse_query(request.raw_query)
        hook_request = cls(request.id, request.method, request.client,
                           {k: v[0] for k, v in request.headers.items()
                            if k not in ("Host", "Transfer-Encoding")},
                           query, body, hook.incoming_content_type or request.get("Content-Type"))
        hook_request.query_ok = query_ok
        return hook_request


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
        if not request.query_ok:  # Go's ParseMultipartForm returns ParseForm's query error
            raise MultipartError("invalid URL escape or semicolon in the query string")
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
        if decoded is None:  # `null` leaves Go's map nil, which renders as `null`
            decoded = NilMap()
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

def evaluate(rule, request, trace=None):
    """Evaluate a rule tree exactly as upstream: returns (satisfied, error or None).  With
    `trace` (a list), the node is explained there too (see explain_node): what an operator
    reads about a refused delivery, and what -explain prints."""
    if trace is None:
        return evaluate_node(rule, request, None)
    node = explain_node(rule, request.masker)
    trace.append(node)
    ok, err = evaluate_node(rule, request, node)
    node["result"] = bool(ok)
    if err is not None and "error" not in node:
        node["error"] = explain_error(err)
    return ok, err


def evaluate_node(rule, request, node):
    kind = rule[0]
    children = None if node is None or kind in ("match", "none") else node.setdefault("rules", [])
    if kind == "and":
        for sub in rule[1]:
            ok, err = evaluate(sub, request, children)
            if err is not None:
                return False, err
            if not ok:
                return False, None
        return True, None
    if kind == "or":
        for sub in rule[1]:
            ok, err = evaluate(sub, request, children)
            if err is not None and not isinstance(err, ParameterNodeError):
                if not (request.allow_signature_errors and isinstance(err, SignatureError)):
                    return False, err
            if ok:
                return True, None
        return False, None
    if kind == "not":
        ok, err = evaluate(rule[1], request, children)
        return not ok, err
    if kind == "match":
        return evaluate_match(rule[1], request, node)
    return False, None


def evaluate_match(rule, request, node=None):
    kind = rule.type
    if kind == "ip-whitelist":
        if node is not None:
            node.update(value=request.remote_addr,
                        wanted=explained_match(rule, request.masker).wanted)
        return check_ip_whitelist(request.remote_addr, rule.ip_range)
    if kind == "scalr-signature":
        if node is not None:
            explain_signature(node, request.headers, "X-Signature")
        return check_scalr_signature(request, rule.secrets[0], time.time())
    if kind == "standard-webhooks":
        if node is not None:
            explain_signature(node, request.headers, "Webhook-Signature")
        return check_standard_webhooks(request, rule.secrets, time.time())
    value, err = get_argument(rule.parameter, request)
    if node is not None:
        explain_value(node, explained_match(rule, request.masker), value, err)
    if err is not None:
        return False, err
    if kind == "value":
        return hmac.compare_digest(value.encode("utf-8", "surrogateescape"),
                                   rule.value.encode("utf-8", "surrogateescape")), None
    if kind == "regex":
        if rule.compiled is None:
            return False, RuleError(rule.regex_error)
        # Go's regexp reads each byte that is not UTF-8 (a surrogate here) as U+FFFD
        return rule.compiled.search(SURROGATE.sub("\ufffd", value)) is not None, None
    if kind in HMAC_TYPES:
        if kind.startswith("payload-hash-"):
            log.warning("warn: use of deprecated option %s; use %s instead",
                        kind, kind.replace("hash", "hmac"))
        algorithm, prefix = HMAC_TYPES[kind]
        err = None
        for secret in rule.secrets:  # each secret while a sender rotates (ours: a list)
            err = check_payload_signature(request.body, secret, value, algorithm, prefix)
            if err is None or not isinstance(err, SignatureError):
                break
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
    expected = hmac.new(secret.encode("utf-8", "surrogateescape"), body, algorithm).hexdigest()
    signatures = extract_signatures(header, prefix)
    for signature in signatures:
        if hmac.compare_digest(signature.encode("utf-8", "surrogateescape"), expected.encode()):
            return None
    # Go's words, without the presented values (a correct MAC in other case would show it)
    return SignatureError("invalid payload signatures [<redacted>]%s"
                          % ("" if body else " on empty payload"))


UNKNOWN_CLIENT = "unknown"  # -trusted-proxy: a relayed address that could not be read


def forwarded_client(remote_addr, forwarded_for, trusted):
    """The client behind a peer (`remote_addr`, host:port) in a -trusted-proxy range: the
    right-most entry of X-Forwarded-For (`forwarded_for`: its lines joined in order) that is
    not in those ranges, or the left-most if all are; written host:port with the peer's port
    (the client's own is not forwarded).  An entry that is not an address (or has a zone),
    written by a proxy we trust, ends the walk at UNKNOWN_CLIENT, whom no ip-whitelist admits.
    Any other peer, or an empty header: `remote_addr`, as Go, whatever the header says."""
    host, port = peer_host(remote_addr), remote_addr.rpartition(":")[2]
    hop = parse_ip(host)
    if hop is None or not any(hop in net for net in trusted) or not forwarded_for.strip():
        return remote_addr
    for entry in reversed(forwarded_for.split(",")):  # linear; the head is bounded
        entry = entry.strip(" \t").strip("[]")
        # a zone (`fe80::1%eth0`) names a proxy's interface, and is any text a client likes
        hop = None if "%" in entry else parse_ip(entry)
        if hop is None:
            return UNKNOWN_CLIENT
        if not any(hop in net for net in trusted):
            break
    return format_peer((str(hop), int(port)))


def check_ip_whitelist(remote_addr, ip_range):
    if remote_addr == UNKNOWN_CLIENT:
        return False, None
    try:
        address = ipaddress.ip_address(peer_host(remote_addr))
    except ValueError:
        return False, RuleError("invalid IP address found in remote address '%s'" % remote_addr)
    for text in ip_range.split():
        network = parse_cidr(text)
        if network is None:
            return False, RuleError("invalid CIDR address: %s" % text)
        if address.version != network.version:
            if address.version == 4 and network.network_address.ipv4_mapped is not None:
                if ipaddress.IPv6Address("::ffff:" + str(address)) in network:
                    return True, None
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
    mac = hmac.new(secret.encode("utf-8", "surrogateescape"), request.body, "sha1")
    mac.update(date.encode("utf-8", "surrogateescape"))
    if not hmac.compare_digest(provided.encode("utf-8", "surrogateescape"),
                               mac.hexdigest().encode()):
        return False, SignatureError("invalid payload signature <redacted>")
    try:
        sent = parse_scalr_date(date)
    except ValueError as exc:
        return False, RuleError(str(exc))
    if abs(now - sent) > 300:
        return False, SignatureError("invalid payload signature outdated")
    return True, None


STANDARD_WEBHOOKS_TOLERANCE = 300  # seconds a Standard Webhooks timestamp may be off, as theirs


def standard_webhooks_key(secret):
    """The HMAC key of a Standard Webhooks secret (`whsec_` + base64), or None."""
    try:
        return base64.b64decode(secret[6:] if secret.startswith("whsec_") else secret,
                                validate=True) or None
    except (binascii.Error, ValueError):
        return None


def check_standard_webhooks(request, secrets, now):
    """The Standard Webhooks signature (standardwebhooks.com): `webhook-signature` holds
    space-separated `v1,<base64 HMAC-SHA256 of "<webhook-id>.<webhook-timestamp>.<body>">`,
    one of which must be made with one of the secrets; the timestamp within 5 minutes."""
    headers = request.headers
    names = ("Webhook-Id", "Webhook-Timestamp", "Webhook-Signature")
    if not all(name in headers for name in names):
        return False, None
    msg_id, stamp, given = (headers[name] for name in names)
    if not is_ascii_digits(stamp) or len(stamp) > 12:
        return False, SignatureError("invalid webhook-timestamp")
    if abs(now - int(stamp)) > STANDARD_WEBHOOKS_TOLERANCE:
        return False, SignatureError("invalid payload signature outdated")
    signed = b"%s.%s.%s" % (msg_id.encode("utf-8", "surrogateescape"), stamp.encode(),
                            request.body)
    offered = [part[3:].encode("utf-8", "surrogateescape") for part in given.split(" ")
               if part.startswith("v1,")][:16]  # bounded work per request
    for secret in secrets:
        key = standard_webhooks_key(secret)
        if key is None:
            return False, RuleError("signature validation secret is not a whsec_ secret")
        expected = base64.b64encode(hmac.new(key, signed, "sha256").digest())
        matched = False
        for signature in offered:  # each compared in full: constant time per signature
            matched |= hmac.compare_digest(signature, expected)
        if matched:
            return True, None
    return False, SignatureError("invalid payload signature <redacted>")


def rules_satisfied(hook, request, trace=None):
    """Returns (satisfied, error to answer 500 with or None, message to log or None); with
    `trace` (a list), the explained tree is its one item."""
    if hook.trigger_rule is None:
        return True, None, None
    request.allow_signature_errors, request.masker = hook.signature_soft_failures, hook.masker
    ok, err = evaluate(hook.trigger_rule, request, trace)
    if trace:
        shown_tree(trace[0], hook.masker)
    if err is None:
        return ok, None, None
    if isinstance(err, ParameterNodeError):
        return ok, None, "parameter node not found: %s" % err
    return False, err, None


# What a refused delivery shows (its record, the status page, -explain): every node evaluated,
# true or false, with the value each match saw, cut to EXPLAIN_VALUE_CHARS.  Never a secret:
# a signature shows only whether its header came and its length, and so does a value compared
# with a header or a parameter named like a credential, or with a whole body, query or header
# set (which may hold one).

EXPLAIN_VALUE_CHARS = 120
# controls and bytes not UTF-8 (as \xNN); bidi controls, line separators and invisible
# characters (as \uNNNN), which would reorder, break or hide in the line a value is shown in:
# `refs/heads/` RLO `niam` reads as `main`, and so does `ma` ZERO WIDTH SPACE `in`
SHOWN_AS_ESCAPE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]|([\xad\u061c\u200b-\u200f"
                             "\u2028-\u202e\u2060-\u2069\ufeff])")


def shown_escape(found):
    return "\\u%04x" % ord(found.group()) if found.group(1) else "\\x%02x" % (
        ord(found.group()) & 0xFF)


def cut(text, masker=NO_MASK):
    """A value as shown: the secrets of `masker` masked, control characters and bytes that are
    not UTF-8 as `\\xNN`, bidi controls and invisible characters as `\\uNNNN` (a terminal
    reading -explain or -runs, or the page, obeys or hides none), at most EXPLAIN_VALUE_CHARS
    characters (a secret begun among them masked whole), and how long it was."""
    shown = SHOWN_AS_ESCAPE.sub(shown_escape, masker.head(text, EXPLAIN_VALUE_CHARS))
    if len(text) <= EXPLAIN_VALUE_CHARS:
        return shown
    return "%s... (%d characters)" % (shown, len(text))


EXPLAIN_TEXTS = ("value", "error")  # what a request wrote (the hooks file's: explained_match)


def shown_tree(node, masker):
    """The explained tree made fit to show, in place: each text a request wrote masked with
    the hook's Masker (its file's secrets, its `mask` patterns) and cut."""
    for field in EXPLAIN_TEXTS:
        if field in node:
            node[field] = cut(node[field], masker)
    for child in node.get("rules", ()):
        shown_tree(child, masker)


def explain_node(rule, masker):
    if rule[0] == "match":
        return dict(explained_match(rule[1], masker).node)
    node = {"rule": rule[0]}
    if rule[0] in ("and", "or"):
        node["of"] = len(rule[1])
    return node


ExplainedMatch = namedtuple("ExplainedMatch", "masker node wanted hidden")


def explained_match(match, masker):
    """What a match's explanation shows of the rule itself: its node's first keys (the name
    masked and cut), what it wanted (masked and cut), and whether what it compares stays hidden
    (compares_a_secret).  Made once per rule and the hook's Masker, and kept on the rule: an
    optimization, they were made again for every request the rule refused."""
    explained = match.explained
    if explained is None or explained.masker is not masker:
        kind, arg = match.type, match.parameter
        node = {"rule": "match", "type": kind}
        if arg.source:
            node["source"], node["name"] = arg.source, cut(arg.name, masker)
        wanted = match.ip_range if kind == "ip-whitelist" else \
            match.value if kind == "value" else match.regex
        explained = match.explained = ExplainedMatch(masker, node, cut(wanted, masker),
                                                     compares_a_secret(arg))
    return explained


def explain_error(err):
    if isinstance(err, ParameterNodeError):
        return "parameter not found"
    if isinstance(err, SignatureError):
        return "signature did not match" if "<redacted>" in str(err) else str(err)
    return str(err)


def explain_signature(node, headers, name):
    node["header"] = name
    node["present"] = name in headers
    if name in headers:
        node["length"] = len(headers[name])


def explain_value(node, explained, value, err):
    """What a match with a parameter saw (its value), and what it wanted."""
    if explained.node["type"] in SECRET_LIST_TYPES:
        node["present"] = err is None
        if err is None:
            node["length"] = len(value)
    elif err is not None:
        node["present"] = False
    elif explained.hidden:
        node["present"], node["length"], node["hidden"] = True, len(value), True
    else:
        node["value"] = value
        node["wanted"] = explained.wanted


def explain_summary(node):
    """One line for a refused delivery: `rule 2 of `and` - payload `ref` was `refs/heads/dev`,
    wanted `refs/heads/main``."""
    path = []
    while node["rule"] in ("and", "or", "not") and node.get("rules"):
        children = node["rules"]
        if node["rule"] == "or":
            path.append("no rule of `or` held (%d)" % node["of"])
            break
        if node["rule"] == "and":
            path.append("rule %d of `and`" % len(children))
        else:
            path.append("`not`")
        node = children[-1]
    return " - ".join(path + [explain_leaf(node)])


def explain_leaf(node):
    kind = node.get("type")
    if "source" in node:
        where = "%s `%s`" % (node["source"], node["name"]) if node.get("name") else \
            node["source"]
    elif "header" in node:
        where = "header `%s`" % node["header"]
    else:
        where = kind or node["rule"]
    if node["rule"] in ("and", "or", "not"):
        return "`%s` %s" % (node["rule"], "held" if node["result"] else "did not hold")
    if node["rule"] == "none":
        return "a rule without and/or/not/match never holds"
    if node.get("present") is False:
        return "%s was missing" % where
    if "error" in node:
        return "%s: %s%s" % (where, node["error"], " (%d characters)" % node["length"]
                             if "length" in node else "")
    if "value" in node:
        return "%s was `%s`, %s `%s`" % (where, node["value"], "wanted a match of"
                                         if kind == "regex" else "wanted"
                                         if kind != "ip-whitelist" else "allowed",
                                         node["wanted"])
    if "length" in node:
        return "%s (%d characters) %s" % (where, node["length"], "matched" if node["result"]
                                          else "did not match")
    return "%s %s" % (where, "held" if node["result"] else "did not hold")


def explain_text(node):
    """A node's own line: a match's explanation, or the combinator and its size."""
    if node["rule"] in ("match", "none"):
        return explain_leaf(node)
    return "%s (%d rules)" % (node["rule"], node.get("of", 1))


def explain_lines(node, depth=0):
    """The tree as indented text lines (-explain; the page shows the same as a list)."""
    mark = "yes" if node.get("result") else "no "
    lines = ["%s[%s] %s" % ("  " * depth, mark, explain_text(node))]
    for child in node.get("rules", ()):
        lines.extend(explain_lines(child, depth + 1))
    if node.get("of", 0) > len(node.get("rules", ())):
        lines.append("%s(%d more not evaluated)" % ("  " * (depth + 1),
                                                   node["of"] - len(node["rules"])))
    return lines


# ---------------------------------------------------------------------------
# Command invocation: argv, environment, stdin and temp files, built from the request
# (first the runner's grace times and stdin write size, used by the Runs section next)
# ---------------------------------------------------------------------------

KILL_GRACE_SECONDS = 5.0
PIPE_GRACE_SECONDS = 1.0  # how long output is still read once the command has ended
EXIT_CHECK_SECONDS = 0.2  # how often a silent command is checked for having ended
PIPE_WRITE_BYTES = 65536  # one write to a command's stdin: a pipe's usual capacity


class Invocation:
    """Everything needed to start a hook's command; `messages` are for the log."""

    def __init__(self, executable, argv, env_pairs, file_pairs, cwd, messages, stdin=None,
                 masker=None, hidden=()):
        self.executable, self.argv, self.env_pairs = executable, argv, env_pairs
        self.file_pairs, self.cwd, self.messages = file_pairs, cwd, messages
        self.stdin = stdin  # pass-payload-to-stdin: the body; None: stdin is /dev/null
        self.masker = masker or NO_MASK  # the hook's: what the log and the record show
        self.hidden = hidden  # argv indexes, variable names: given a credential (passes_a_secret)

    def shown_argv(self):
        """argv as the log and the record show it: masked, a credential shown as MASKED."""
        return [MASKED if i in self.hidden else self.masker.bytes(arg)
                for i, arg in enumerate(self.argv)]

    def shown(self):
        """What a run's record shows of it: `arguments` (argv, the command first) and
        `environment` (each variable the hook sets, with its value; for a pass-file-to-command
        variable, the file's size), masked, each value cut."""
        def text(data):
            return cut(data.decode("utf-8", "surrogateescape"))
        environment = {name: text(MASKED if name in self.hidden else self.masker.bytes(value))
                       for name, value in self.env_pairs}
        environment.update((name, "(a file of %d bytes)" % len(data))
                           for name, data in self.file_pairs)
        return {"arguments": [text(arg) for arg in self.shown_argv()],
                "environment": environment}

    def size(self):
        """The bytes it holds that grow with the request: what a queued run keeps until it runs."""
        return (sum(map(len, self.argv)) + sum(len(k) + len(v) for k, v in self.env_pairs)
                + sum(len(data) for _, data in self.file_pairs) + len(self.stdin or b""))


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
    if not hook.execute_command:  # Go would try to execute the working directory
        raise OSError(errno.ENOENT, "hook has no execute-command")
    executable = look_path(hook.execute_command, hook.working_directory)
    messages = []
    argv = [os_bytes(hook.execute_command)]
    arguments = lookup_all(hook.pass_arguments, request, "", messages)
    argv += [os_bytes(value or "") for _, value in arguments]
    hidden = {i for i, (arg, _) in enumerate(arguments, 1) if passes_a_secret(arg)}
    env_pairs = []
    for arg, value in lookup_all(hook.pass_environment, request, " for environment", messages):
        if value is not None:
            env_pairs.append(env_entry(arg.envname or "HOOK_" + arg.name, os_bytes(value)))
            if passes_a_secret(arg):
                hidden.add(env_pairs[-1][0])
    file_pairs = []
    for arg, value in lookup_all(hook.pass_files, request, " for file", messages):
        if value is None:
            continue
        envname = arg.envname or "HOOK_" + arg.name.upper()
        if "/" in envname:  # a temp file name outside the folder: Go refuses it, so do we
            messages.append("error creating temp file [createtemp %s: pattern contains path "
                            "separator]" % envname)
            continue
        data = os_bytes(value)
        if arg.base64decode:
            data, error = go_base64_decode(data)
            if error:
                messages.append("error decoding string [%s]" % error)
        file_pairs.append((envname, data))
    return Invocation(executable, argv, env_pairs, file_pairs, hook.working_directory or None,
                      messages, request.raw_body if hook.payload_to_stdin else None,
                      hook.masker, hidden)


def write_temp_files(invocation, request_id):
    """Write pass-file-to-command values to 0600 temp files; returns [(envname, path)].  A file
    that cannot be written (a name too long, a full disk) is logged and left out, its variable
    unset, and the command still runs, as Go does."""
    written = []
    for envname, data in invocation.file_pairs:
        created = None
        try:
            directory = os.path.abspath(invocation.cwd or tempfile.gettempdir())
            while True:  # `<envname><9 random digits>`, as Go's ioutil.TempFile names them
                path = os.path.join(directory, "%s%09d" % (envname, random.randrange(10 ** 9)))
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                 0o600)
                    break
                except FileExistsError:
                    continue
            created = path
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
        except OSError as exc:
            log.info("[%s] error creating temp file [%s: %s]", request_id, envname,
                     exc.strerror or exc)
            if created is not None:
                remove_paths([created])
            continue
        written.append((envname, created))
    return written


def remove_files(written):
    """Remove the temp files of write_temp_files: [(envname, path)]."""
    remove_paths(path for _, path in written)


def remove_paths(paths, dir_fd=None):
    """Unlink each path; one that is already gone is fine."""
    for path in paths:
        try:
            os.unlink(path, dir_fd=dir_fd)
        except OSError:
            pass


# ---------------------------------------------------------------------------
# Runs: one way to run a command, on subprocess
# ---------------------------------------------------------------------------

class CommandResult:
    """How a run ended: `started` False if it never ran; `returncode`; `timed_out`."""

    def __init__(self, started, returncode=None, output=b"", timed_out=False, error=None):
        self.started, self.returncode, self.output = started, returncode, output
        self.timed_out, self.error = timed_out, error

    @property
    def ok(self):
        return self.started and self.returncode == 0 and not self.timed_out


def signal_name(returncode):
    """`SIGKILL` for a process a signal ended (Popen's negative returncode), else None."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return str(-returncode)


def describe_exit(returncode):
    """How the log tells a failed command's end: `exit status N`, or `signal: SIGKILL`."""
    name = signal_name(returncode)
    return "exit status %d" % returncode if name is None else "signal: " + name


def command_environment(pairs):
    """Our environment plus the hook's variables as bytes; a name set again moves to its last
    position with its last value, as Go's exec does."""
    env = dict(os.environb)
    for name, value in pairs:
        key = os.fsencode(name)
        env.pop(key, None)
        env[key] = value
    return env


def signal_group(proc, signum):
    try:
        os.killpg(proc.pid, signum)
    except OSError:
        pass


def go_quote_list(items):
    """Go's %q of a []string (items are bytes here)."""
    return "[" + " ".join(json.dumps(item.decode("utf-8", "replace"), ensure_ascii=False)
                          for item in items) + "]"


def wait_ready(fd, seconds, writing=False):
    """Whether fd became readable (or writable) within the time; poll() where the system has it
    (select() cannot watch descriptors above FD_SETSIZE)."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLOUT if writing else select.POLLIN)
        return bool(poller.poll(seconds * 1000.0))
    readers, writers = ([], [fd]) if writing else ([fd], [])
    readable, writable, _ = select.select(readers, writers, [], seconds)
    return bool(readable or writable)


def feed_stdin(pipe, data, finished):
    """pass-payload-to-stdin, in a thread of its own so that a command that reads nothing or
    writes a lot blocks neither side: write `data`, then close the pipe.  Ends quietly when
    the command stops reading (EPIPE) or once the run is over (`finished`: something it
    started may hold the pipe open without reading)."""
    fd = pipe.fileno()
    os.set_blocking(fd, False)
    rest = memoryview(data)
    try:
        while rest and not finished.is_set():
            if wait_ready(fd, EXIT_CHECK_SECONDS, writing=True):
                with contextlib.suppress(BlockingIOError):
                    rest = rest[os.write(fd, rest[:PIPE_WRITE_BYTES]):]
    except OSError:  # EPIPE: the command exited or closed its stdin before reading it all
        pass
    finally:
        pipe.close()


class Runner:
    """The one way a command runs: argv (never a shell), stdin /dev/null (or the request body:
    pass-payload-to-stdin), stdout and stderr in one pipe, a session of its own (so a timeout
    or a shutdown stops the whole tree), temp files removed afterwards.  Remembers the running
    processes for kill_all()."""

    def __init__(self):
        self.lock = threading.Lock()
        self.processes = set()
        self.active = 0  # runs not yet cleaned up (temp files removed)

    def start(self, invocation, request_id, timeout=None, capture=True):
        """Start the command: a Running, whose output() yields what it prints (nothing unless
        `capture`) until it ends.  A command that could not start is known here, before anyone
        answers: its Running yields nothing and its result says `started` False."""
        with self.lock:
            self.active += 1
        running = Running(self, request_id, timeout)
        try:
            running.files = write_temp_files(invocation, request_id)
            running.proc = self._spawn(invocation, running.files, request_id, capture)
            if running.proc.stdin is not None:
                threading.Thread(target=feed_stdin, args=(running.proc.stdin, invocation.stdin,
                                                          running.fed),
                                 name="stdin", daemon=True).start()
        except (OSError, ValueError, RuntimeError, subprocess.SubprocessError) as exc:
            # ValueError: a NUL; RuntimeError: no thread to feed stdin (never run without it)
            if running.proc is not None:
                self.stop(running.proc)
                running.proc.wait()
                running.proc.stdin.close()
            running.result = CommandResult(False, error=exc)
            running.clean_up()
        return running

    def _spawn(self, invocation, files, request_id, capture):
        file_pairs = [env_entry(name, os.fsencode(path)) for name, path in files]
        env = None  # our environment as it is, unless the hook adds to it
        if invocation.env_pairs or files:
            env = command_environment(invocation.env_pairs + file_pairs)
        if log.isEnabledFor(logging.INFO):
            for envname, path in files:
                log.info("[%s] writing env %s file %s", request_id, envname, path)
            log.info("[%s] executing %s (%s) with arguments %s and environment %s using %s as "
                     "cwd", request_id, invocation.argv[0].decode("utf-8", "replace"),
                     invocation.executable,
                     go_quote_list(invocation.shown_argv()),
                     "[" + " ".join(name for name, _ in invocation.env_pairs + files) + "]",
                     invocation.cwd or "")
        proc = subprocess.Popen(
            invocation.argv, executable=invocation.executable, cwd=invocation.cwd, env=env,
            stdin=subprocess.DEVNULL if invocation.stdin is None else subprocess.PIPE,
            stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
            stderr=subprocess.STDOUT, start_new_session=True, close_fds=True, bufsize=0)
        with self.lock:
            self.processes.add(proc)
        return proc

    @staticmethod
    def stop(proc):
        """SIGTERM to the process group, SIGKILL once its leader has gone or after a grace."""
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


class Running:
    """A started command (Runner.start).  output() yields its output as it comes, applying the
    timeout, and reaps it; then `result` says how it ended and its temp files are gone.  Once
    the process has ended (or been stopped), its pipe gets PIPE_GRACE_SECONDS to reach its
    end: a process it left behind that keeps the pipe open (`setsid daemon &`) holds up
    neither the answer nor the hook's slot (Go's Cmd.WaitDelay)."""

    def __init__(self, runner, request_id, timeout):
        self.runner, self.request_id, self.timeout = runner, request_id, timeout
        self.proc, self.files, self.result = None, [], None
        self.fed = threading.Event()  # set when the run is over: stdin is fed no longer

    def output(self):
        if self.result is not None:  # it never started
            return
        proc, timed_out = self.proc, False
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            if proc.stdout is None:
                try:
                    self.result = CommandResult(True, proc.wait(self.timeout))
                except subprocess.TimeoutExpired:
                    self.runner.stop(proc)
                    self.result = CommandResult(True, proc.wait(), timed_out=True)
                return
            fd, pipe_deadline = proc.stdout.fileno(), None
            while True:
                now = time.monotonic()
                if pipe_deadline is None and proc.poll() is not None:
                    pipe_deadline = now + PIPE_GRACE_SECONDS
                wait = min(t for t in (deadline, pipe_deadline, now + EXIT_CHECK_SECONDS)
                           if t is not None)
                if not wait_ready(fd, max(0.0, wait - now)):
                    if deadline is not None and time.monotonic() >= deadline:
                        timed_out, deadline = True, None
                        self.runner.stop(proc)
                    elif pipe_deadline is not None and time.monotonic() >= pipe_deadline:
                        log.info("[%s] the command has ended but something it started keeps "
                                 "its output open: no longer read", self.request_id)
                        break
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                yield chunk
            self.result = CommandResult(True, proc.wait(), timed_out=timed_out)
        finally:
            if self.result is None:  # abandoned mid-way (the daemon stopping): stopped now
                self.runner.stop(proc)
                self.result = CommandResult(True, proc.wait(), timed_out=timed_out)
            self.clean_up()

    def clean_up(self):
        self.fed.set()
        if self.proc is not None:
            with self.runner.lock:
                self.runner.processes.discard(self.proc)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        for _, path in self.files:
            log.info("[%s] removing file %s", self.request_id, path)
        remove_files(self.files)
        with self.runner.lock:
            self.runner.active -= 1


# ---------------------------------------------------------------------------
# Runs in the background and per-hook FIFO gates
# ---------------------------------------------------------------------------

ASYNC_BACKLOG_LIMIT = 10000  # background runs waiting or running; more get 503 (memory bound)
ASYNC_BACKLOG_BODIES = 8  # bodies of -max-body-bytes those runs' commands may hold (stdin, argv,
                          # environment, pass-file-to-command files) while they wait


class BackgroundRuns:
    """The one bounded queue of background runs: at most `size` threads, started on demand;
    further jobs wait in FIFO order; more than ASYNC_BACKLOG_LIMIT accepted are refused, as are
    those whose prepared commands (a body for stdin, arguments, variables or files from the
    request) would grow what the backlog holds beyond ASYNC_BACKLOG_BODIES of `max_body` (a hook
    with max-concurrency 1 queues them all)."""

    def __init__(self, size, max_body):
        self.size = max(1, size)
        self.max_held = ASYNC_BACKLOG_BODIES * max_body
        self.held = 0  # bytes of prepared commands the runs in the backlog hold
        self.jobs = queue.SimpleQueue()
        self.idle = threading.Semaphore(0)
        self.lock = threading.Lock()
        self.threads = self.backlog = 0

    def reserve(self, held=0):
        """Count one more run in the backlog, holding `held` bytes of command until its job
        ends; False when it is full."""
        with self.lock:
            if self.backlog >= ASYNC_BACKLOG_LIMIT or (
                    held and self.held and self.held + held > self.max_held):
                return False
            self.backlog += 1
            self.held += held
            return True

    def submit(self, job, held=0):
        """Queue a reserved job; an idle thread, or a new one below the bound, runs it."""
        self.jobs.put((job, held))
        if self.idle.acquire(blocking=False):
            return
        with self.lock:
            if self.threads >= self.size:
                return
            self.threads += 1
        try:
            threading.Thread(target=self._work, name="run-%d" % self.threads,
                             daemon=True).start()
        except RuntimeError as exc:  # the job stays queued for a thread that runs
            with self.lock:
                self.threads -= 1
            log.error("cannot start a thread for background runs: %s", exc)

    def _work(self):
        while True:
            job, held = self.jobs.get()
            try:
                job()
            except Exception:  # a bug in one run must not kill the thread
                log.exception("unexpected error in a background run")
            self.release(held)
            self.idle.release()

    def release(self, held=0):
        """A reserved run leaves the backlog: its job ended, or it will never run (WhenBusy)."""
        with self.lock:
            self.backlog -= 1
            self.held -= held


class HookGate:
    """max-concurrency for one hook: at most `limit` runs at once (0 = no limit); the others
    wait in arrival order.  `enter(start)` calls start() once a slot is granted."""

    def __init__(self, limit):
        self.limit = limit
        self.lock = threading.Lock()
        self.running = 0
        self.waiting = deque()

    def enter(self, start, wait=True):
        """start() now if a slot is free (True), else once one is (False; with `wait` False,
        never: the hook is busy, and the caller decides)."""
        with self.lock:
            if self.limit and self.running >= self.limit:
                if wait:
                    self.waiting.append(start)
                return False
            self.running += 1
        start()
        return True

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


class HeldRun:
    """The one run a hook holds back (WhenBusy): each newer trigger takes its place; `until`:
    when a debounced one's quiet time ends (time.monotonic)."""

    __slots__ = ("run", "until")

    def __init__(self, run):
        self.run, self.until = run, None


class WhenBusy:
    """A hook's `when-busy` and `debounce` (ours), in front of its HookGate, for its background
    runs.  `queue` (upstream's way): a trigger waits for its turn, in arrival order.  `latest`:
    at most one run waits; a newer trigger takes its place in the queue.  `drop`: a trigger
    that finds the hook busy never runs.  `debounce`: a trigger waits for a quiet time with no
    newer trigger (each newer one takes its place and starts the time again), then goes on as
    its when-busy says.  A run whose turn came goes to `start(run)`; one that will never run
    to `pass_over(run, state, successor)`: "superseded" by the successor's run, or "dropped"."""

    def __init__(self, start, pass_over):
        self.start, self.pass_over = start, pass_over
        self.changed = threading.Condition()
        self.waiting = {}  # hook id -> its HeldRun waiting in the gate (latest)
        self.quiet = {}  # hook id -> its HeldRun in a quiet time (debounce)

    def admit(self, run):
        """Take a triggered run; False if it was dropped, the hook being busy."""
        hook = run.hook
        with self.changed:
            held = self.quiet.get(hook.id)
            replaced = None if held is None else held.run
            fresh = hook.debounce and held is None
            if fresh:
                held = self.quiet[hook.id] = HeldRun(run)
            if hook.debounce:
                until = time.monotonic() + hook.debounce
                if held.until is not None and until < held.until:  # a reload shortened the
                    self.changed.notify_all()  # quiet time: its thread waits for the old end
                held.run, held.until = run, until
            elif held is not None:  # the newer trigger goes on, even if a reload removed
                del self.quiet[hook.id]  # debounce meanwhile; the thread of the quiet ends
                held.run = None
                self.changed.notify_all()
        if replaced is not None:
            self.pass_over(replaced, "superseded", run)
        if not hook.debounce:
            return self.enter(run)
        if fresh:
            try:
                threading.Thread(target=self.after_quiet, args=(hook.id, held),
                                 name="debounce", daemon=True).start()
            except RuntimeError as exc:  # no thread to wait with: no quiet time
                log.error("cannot start a thread for a debounced run: %s; it goes on now", exc)
                with self.changed:
                    held.until = 0
                self.after_quiet(hook.id, held)
        return True

    def after_quiet(self, hook_id, held):
        """Wait until no trigger came for the quiet time; then the newest goes on."""
        with self.changed:
            while held.run is not None:
                left = held.until - time.monotonic()
                if left <= 0:
                    break
                self.changed.wait(left)
            run, held.run = held.run, None
            if run is not None:
                del self.quiet[hook_id]
        if run is not None:
            self.enter(run)

    def enter(self, run):
        """The run goes for its turn as its hook's when-busy says; False if dropped."""
        gate, when_busy = run.gate, run.hook.when_busy
        if when_busy == "queue":
            gate.enter(lambda: self.start(run))
            return True
        if gate.enter(lambda: self.start(run), wait=False):
            return True
        if when_busy == "drop":
            self.pass_over(run, "dropped", None)
            return False
        with self.changed:
            held = self.waiting.get(run.hook.id)
            replaced = None if held is None else held.run
            if held is None:
                held = self.waiting[run.hook.id] = HeldRun(run)
            held.run = run
        if replaced is not None:
            self.pass_over(replaced, "superseded", run)
        else:
            gate.enter(lambda: self.start(self.turn_of(run.hook.id)))
        return True

    def turn_of(self, hook_id):
        """The run a hook held back, now that its turn has come."""
        with self.changed:
            return self.waiting.pop(hook_id).run


# ---------------------------------------------------------------------------
# Run history: run records and the bounded store (memory or -runs-dir)
# ---------------------------------------------------------------------------
# Every triggered run gets a RunRecord: its state and the tail of its output.  The store keeps
# them bounded (-runs-keep per hook, -runs-max-bytes in all) in memory, and with -runs-dir also
# as `<id>.json` + `<id>.log` files written by one thread of their own, so a slow or full disk
# never holds up a trigger: the record then says what was not saved.

RUN_STATES = ("queued", "running", "succeeded", "failed", "timed-out", "killed", "interrupted",
              "refused", "superseded", "dropped")
RUN_ENDED = frozenset(RUN_STATES[2:])
RUN_ID = re.compile(r"[0-9A-Za-z-]{1,64}")
RUN_RECORD_BYTES = 1024  # what a record counts for besides its output, in -runs-max-bytes:
# its file holds one JSON line of ~350 bytes per saved state (queued, running, ended), plus the
# length of the texts a client chose (a request id from -x-request-id) on each of those lines
RUNS_WRITE_DELAY = 0.05  # seconds the -runs-dir writer gathers changes before writing them
RUN_FIELDS = ("id", "hook", "state", "exit_code", "signal", "queued_at", "started_at",
              "ended_at", "duration_ms", "remote_addr", "request_id", "output_bytes",
              "output_truncated", "storage_error", "reason", "rules", "arguments",
              "environment", "delivery", "redelivery_of", "superseded_by", "replayOf")
RUN_FIELDS_UNSET = dict.fromkeys(RUN_FIELDS)


def new_run_id(now):
    """Sortable by time, unique without coordination: `20261123T214700Z-9f3a0c1e`."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + os.urandom(4).hex()


def run_outcome(result, stopping):
    """(state, exit_code, signal name) of a CommandResult; a run ended by a signal while we
    stop was killed by the shutdown."""
    if not result.started:
        return "failed", None, None
    code = result.returncode
    name = signal_name(code)
    if result.timed_out:
        return "timed-out", code, name
    if code == 0:
        return "succeeded", 0, None
    if name is not None and stopping:
        return "killed", code, name
    return "failed", code, name


def json_list_length(values):
    """len(json.dumps(list(values))), without writing the strings it would leave as they are.
    An optimization (a refused record, one per refused request, spent half its cost writing
    the JSON of its texts only to count it): see bench/README.md, webhookd round three."""
    length = 2 * max(len(values), 1)  # the brackets, and ", " between items
    for value in values:
        if value is None:
            length += 4
        elif type(value) is str and value.isascii() and value.isprintable() \
                and '"' not in value and "\\" not in value:  # no escapes: written as it is
            length += len(value) + 2
        else:
            length += len(json.dumps(value))
    return length


class RunRecord:
    """One run: the fields of RUN_FIELDS, the kept tail of its output, and `version`, bumped on
    every change so the disk writer saves each record once however often it changed."""

    def __init__(self, fields):
        known = {**RUN_FIELDS_UNSET, **fields}  # an optimization: a third of a per-name .get()
        if len(known) != len(RUN_FIELDS_UNSET):  # names that are no field (a file's)
            known = {name: known[name] for name in RUN_FIELDS}
        self.__dict__.update(known)
        self.output_bytes = self.output_bytes or 0
        self.output_truncated = bool(self.output_truncated)
        self.tail = None  # output bytes kept in memory (None: only on disk)
        self.started_ts = None
        self.version = self.saved_version = self.disk_total = self.disk_size = 0
        self.queued_output = False
        self.text_bytes = 3 * json_list_length((self.hook, self.request_id, self.remote_addr,
                                                 self.delivery, self.redelivery_of))
        if self.rules is not None or self.arguments is not None:  # written once, never grow
            self.text_bytes += json_list_length((self.reason, self.rules, self.arguments,
                                                 self.environment))
        # the Invocation as it ran, unmasked, for a replay: in memory only (RunStore.open),
        # never shown, never written to -runs-dir
        self.invocation = None

    @property
    def delivered(self):
        """The key of the delivery it ran for (hook id, delivery id), or None: refused ones
        ran nothing, and a record from -runs-dir may be hand-edited."""
        if self.state == "refused" or not isinstance(self.delivery, str):
            return None
        return self.hook, self.delivery

    @property
    def bucket(self):
        """What -runs-keep counts it among: its hook's runs, or its hook's refusals (so that
        refused deliveries, which anyone can send, never push a hook's runs out)."""
        return self.hook if self.state != "refused" else (self.hook, "refused")

    def as_dict(self):
        return {name: getattr(self, name) for name in RUN_FIELDS}

    @property
    def kept_bytes(self):
        return RUN_RECORD_BYTES + self.text_bytes + min(self.output_bytes, self.cap)

    cap = 0  # set by the store


class RunStore:
    """The run records, oldest first, bounded; saved to -runs-dir by RunFiles when given."""

    def __init__(self, keep, max_bytes, max_output, directory=None, dir_fd=None):
        self.keep, self.max_bytes, self.max_output = keep, max_bytes, max(1, max_output)
        self.changed = threading.Condition()  # held for every change; followers wait on it
        self.records = {}  # id -> RunRecord, in creation order
        self.by_hook = {}  # RunRecord.bucket -> deque of its records, in creation order
        self.deliveries = {}  # RunRecord.delivered -> the newest record of that delivery
        self.claims = threading.Lock()  # see claim()
        self.size = 0
        self.files = None if directory is None else RunFiles(directory, dir_fd, self)

    def start(self):
        """Load the records of earlier runs and start the disk writer: once the daemon runs as
        the user it runs as (after -setuid), so that the files are that user's."""
        if self.files is not None:
            self._load()
            self.files.start()

    # -- the run path --------------------------------------------------------

    @contextlib.contextmanager
    def claim(self, hook_id, delivery):
        """Within it, a run of a deduplicating hook finds the newest record of its delivery
        and that record's state as it was then, read under the store's lock (what it gives:
        (record, state), or (None, None)), and opens its own: of two deliveries with one id,
        the second finds the first's record, already on disk.  Holds nothing without a
        delivery id (there is none with -runs-keep 0: see Hooks.delivery)."""
        if delivery is None:
            yield None, None
            return
        with self.claims:
            with self.changed:
                earlier = self.deliveries.get((hook_id, delivery))
                state = None if earlier is None else earlier.state
            yield earlier, state

    def open(self, hook_id, request, invocation=None, delivery=None, redelivery_of=None,
             replay_of=None):
        """A queued record for a run about to be triggered by request (None when -runs-keep
        is 0: no history), showing its invocation (Invocation.shown) and keeping it for a
        replay (its bytes count in -runs-max-bytes), with the id of its delivery (see claim),
        or the run it replays.  With -runs-dir it is written before its id is handed out, so
        a daemon killed at once (kill -9) finds it `interrupted` on restart."""
        if not self.keep:
            return None
        now = time.time()
        shown = invocation.shown() if invocation is not None else {}
        record = RunRecord(dict(shown, id=new_run_id(now), hook=hook_id, state="queued",
                                queued_at=iso_time(now), remote_addr=request.remote_addr,
                                request_id=request.id, delivery=delivery,
                                redelivery_of=redelivery_of, replayOf=replay_of))
        if invocation is not None:
            record.invocation = invocation
            record.text_bytes += invocation.size()
        record.cap, record.tail = self.max_output, bytearray()
        record.version = 1
        written = self.files is not None and self.files.write_new(record)
        with self.changed:
            self._add(record)
            self._retain(record.bucket)
            if written:
                record.saved_version = record.version
            elif self.files is not None:
                self.files.put("record", record)
        return record

    def refused(self, hook_id, request, rules):
        """Keep a delivery the hook's rules refused, with its explained rules (None when
        -runs-keep is 0).  Written to -runs-dir in the background: no id is handed out."""
        if not self.keep:
            return None
        now = time.time()
        stamp = iso_time(now)
        record = RunRecord({"id": new_run_id(now), "hook": hook_id, "state": "refused",
                            "queued_at": stamp, "ended_at": stamp,
                            "remote_addr": request.remote_addr, "request_id": request.id,
                            "reason": explain_summary(rules), "rules": rules})
        record.cap, record.tail = self.max_output, bytearray()
        with self.changed:
            self._add(record)
            self._save(record)
            self._retain(record.bucket)
        return record

    def started(self, record):
        with self.changed:
            record.state, record.started_ts = "running", time.time()
            record.started_at = iso_time(record.started_ts)
            self._save(record)

    def output(self, record, chunk):
        with self.changed:
            self.size -= record.kept_bytes
            tail = record.tail
            tail += chunk
            record.output_bytes += len(chunk)
            if len(tail) > record.cap:
                del tail[:len(tail) - record.cap]
                record.output_truncated = True
            self.size += record.kept_bytes
            if self.files is not None and not record.queued_output:
                record.queued_output = True  # one write pending per run: the tail holds the rest
                self.files.put("output", record)
            self.changed.notify_all()

    def ended(self, record, result, stopping):
        now = time.time()
        with self.changed:
            record.state, record.exit_code, record.signal = run_outcome(result, stopping)
            started = record.started_ts
            record.duration_ms = None if started is None else int((now - started) * 1000)
            self._end(record, now)

    def passed_over(self, record, state, superseded_by=None):
        """A queued run that will never run (WhenBusy): `superseded` by the run of id
        superseded_by, or `dropped`.  The kept runs it superseded now point at that one too:
        each names the run that does the work it asked for."""
        with self.changed:
            for earlier in self.by_hook.get(record.bucket, ()):
                if earlier.superseded_by == record.id:
                    earlier.superseded_by = superseded_by
                    self._save(earlier)
            record.state, record.superseded_by = state, superseded_by
            self._end(record, time.time())

    def _end(self, record, now):
        record.ended_at = iso_time(now)
        self._save(record)
        self._retain(record.bucket)  # it may be dropped now, if beyond -runs-keep
        self.changed.notify_all()

    # -- reading -------------------------------------------------------------

    def get(self, run_id):
        with self.changed:
            return self.records.get(run_id)

    def listing(self, hook=None, state=None, limit=100):
        with self.changed:
            found = []
            for record in reversed(list(self.records.values())):
                if (hook is None or record.hook == hook) and (state is None
                                                              or record.state == state):
                    found.append(record.as_dict())
                    if len(found) >= limit:
                        break
            return found

    def last_per_hook(self):
        """hook id -> a summary of its newest run, for the status page."""
        last = {}
        with self.changed:
            for record in self.records.values():
                if record.state == "refused":
                    continue
                last[record.hook] = {name: getattr(record, name) for name in (
                    "id", "state", "exit_code", "signal", "queued_at", "started_at",
                    "ended_at", "duration_ms")}
        return last

    def read_output(self, record, position=0):
        """(bytes from `position` on, the position after them, ended?); a position older than
        the kept tail starts at the tail."""
        with self.changed:
            ended = record.state in RUN_ENDED
            if record.tail is not None:
                start = record.output_bytes - len(record.tail)
                data = bytes(record.tail[max(0, position - start):])
                return data, record.output_bytes, ended
        data = self.files.read_log(record)
        start = max(0, record.output_bytes - len(data))
        return data[max(0, position - start):], record.output_bytes, True

    def follow(self, record, position, stopped, timeout=1.0):
        """Wait for output past `position`, the end of the run, or `timeout` seconds."""
        with self.changed:
            if record.output_bytes == position and record.state not in RUN_ENDED \
                    and not stopped():
                self.changed.wait(timeout)

    def flush(self, timeout=2.0):
        """At exit: wait (bounded) for the runs being ended, mark those that never started
        `killed`, and wait for the disk writer."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while any(r.state == "running" for r in self.records.values()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.changed.wait(remaining)
            for record in self.records.values():
                if record.state == "queued":  # dropped by the stop before its turn came
                    record.state, record.ended_at = "killed", iso_time(time.time())
                    self._save(record)
        if self.files is not None:
            self.files.flush(deadline)

    # -- bounds --------------------------------------------------------------

    def _add(self, record):
        self.records[record.id] = record
        of_hook = self.by_hook.get(record.bucket)
        if of_hook is None:  # not setdefault(): it would make a deque on every call
            of_hook = self.by_hook[record.bucket] = deque()
        of_hook.append(record)
        self.size += record.kept_bytes
        if record.delivered is not None:
            self.deliveries[record.delivered] = record

    def _retain(self, bucket):
        """Drop the oldest ended runs beyond -runs-keep in this bucket (a hook's runs, or its
        refusals) and, beyond -runs-max-bytes, the oldest refusals first, then runs."""
        of_hook = self.by_hook.get(bucket, ())
        excess = len(of_hook) - self.keep
        for record in list(itertools.islice(of_hook, 0, max(0, excess))):
            if record.state in RUN_ENDED:
                self._drop(record)
        for droppable in ({"refused"}, RUN_ENDED):
            if self.size <= self.max_bytes:
                break
            for record in list(self.records.values()):
                if self.size <= self.max_bytes:
                    break
                if record.state in droppable:
                    self._drop(record)

    def _drop(self, record):
        del self.records[record.id]
        of_hook = self.by_hook[record.bucket]
        of_hook.remove(record)  # the oldest, near the left end
        if not of_hook:
            del self.by_hook[record.bucket]
        self.size -= record.kept_bytes
        if record.delivered is not None and self.deliveries.get(record.delivered) is record:
            del self.deliveries[record.delivered]
        if self.files is not None:
            self.files.put("delete", record)

    # -- the disk ------------------------------------------------------------

    def _save(self, record):
        record.version += 1
        if self.files is not None:
            self.files.put("record", record)

    def _load(self):
        loaded = self.files.load(self.max_output)
        redelivered = {r.redelivery_of for r in loaded if isinstance(r.redelivery_of, str)}
        with self.changed:
            for record in loaded:
                self._add(record)
                if record.version:
                    self.files.put("record", record)
            # records of one second load in the order of their ids' random part: a delivery's
            # newest record is the one no redelivery followed, wherever it was loaded
            for record in loaded:
                if record.delivered is not None and record.id not in redelivered:
                    self.deliveries[record.delivered] = record
            for bucket in {r.bucket for r in loaded}:
                self._retain(bucket)


class RunFiles:
    """The -runs-dir folder: `<id>.json` (the record) and `<id>.log` (the kept output) per run,
    0600, written by one thread of its own from a queue of (kind, record).  A record's file is
    created once, holding the queued record; each later state is appended as a line and the
    last whole line wins: an append costs ~20 µs, a new file (temp + rename) ~0.1-1 ms.  Every
    file is named relative to the folder held open (`dir_fd`, checked by open_runs_dir), never
    by its path: a link swapped in for the folder or a folder above it is never followed."""

    def __init__(self, directory, dir_fd, store):
        self.directory, self.store, self.changed = directory, store, store.changed
        self.dir_fd = dir_fd
        self.writes = queue.SimpleQueue()

    def start(self):
        threading.Thread(target=self._write_loop, name="runs-writer", daemon=True).start()

    def put(self, kind, record):
        self.writes.put((kind, record))

    def read_log(self, record):
        try:
            with open_no_link(record.id + ".log", self.dir_fd) as handle:
                return handle.read()[-record.cap:]
        except OSError:
            return b""

    def write_new(self, record):
        """Write a new record's file now, in the caller's thread (open, write, close: it
        survives the daemon being killed, not the machine losing power); False if it could
        not (the record says so)."""
        try:
            write_new_file(record.id + ".json", record_json(record.as_dict()), self.dir_fd)
            return True
        except OSError as exc:
            self.failed(record, exc)
            return False

    def failed(self, record, exc):
        with self.changed:
            record.storage_error = "not saved to %s: %s" % (self.directory, exc.strerror or exc)

    def flush(self, deadline):
        done = threading.Event()
        self.put("flush", done)
        done.wait(max(0.0, deadline - time.monotonic()))

    def load(self, cap):
        """The records of earlier runs, oldest first; those that were going when we died are
        `interrupted`.  An unreadable record is skipped, never fatal."""
        loaded = []
        for fields in read_run_files(self.dir_fd):
            record = RunRecord(fields)
            record.cap = cap
            if record.state not in RUN_ENDED:
                record.state = "interrupted"
                record.version = 1  # saved again by the writer
                with contextlib.suppress(OSError):  # output saved after the record was
                    logged = os.stat(record.id + ".log", dir_fd=self.dir_fd,
                                     follow_symlinks=False).st_size
                    record.output_bytes = max(record.output_bytes, logged)
            loaded.append(record)
        loaded.sort(key=lambda r: (r.queued_at or "", r.id))
        return loaded

    def _write_loop(self):
        """Write in batches, RUNS_WRITE_DELAY apart: a short run's three states and its
        output cost one record write and one output write."""
        while True:
            batch = [self.writes.get()]
            time.sleep(RUNS_WRITE_DELAY)
            while True:
                try:
                    batch.append(self.writes.get_nowait())
                except queue.Empty:
                    break
            done = set()
            for kind, record in batch:
                if (kind, id(record)) not in done:
                    done.add((kind, id(record)))
                    self._write(kind, record)

    def _write(self, kind, record):
        if kind == "flush":
            record.set()
            return
        try:
            if kind == "record":
                self._write_record(record)
            elif kind == "output":
                self._write_output(record)
            else:
                remove_paths([record.id + suffix for suffix in (
                    (".json", ".log") if record.output_bytes else (".json",))], self.dir_fd)
        except OSError as exc:  # e.g. a full disk: the run goes on, the record says so
            self.failed(record, exc)

    def _write_record(self, record):
        with self.changed:
            if record.saved_version >= record.version or record.id not in self.store.records:
                return
            version, document = record.version, record.as_dict()
            final_tail = bytes(record.tail) if record.state in RUN_ENDED \
                and record.tail is not None else None
            on_disk = record.disk_total == record.output_bytes and record.disk_size == len(
                final_tail or b"")
        if final_tail is not None and not on_disk:  # the log holds exactly the kept tail
            write_private_file(record.id + ".log", final_tail, self.dir_fd)
        append_record(record.id + ".json", record_json(document), self.dir_fd)
        with self.changed:
            record.saved_version = version
            if final_tail is not None:
                record.tail = None  # served from the file from now on

    def _write_output(self, record):
        """Append what came since the last write; once the log holds twice the cap, rewrite it
        with the kept tail (a reader following the file sees it shrink)."""
        with self.changed:
            record.queued_output = False
            if record.tail is None:
                return
            fresh = record.output_bytes - record.disk_total
            rewrite = record.disk_size + fresh > 2 * record.cap or fresh > len(record.tail)
            data = bytes(record.tail if rewrite else record.tail[len(record.tail) - fresh:])
            record.disk_total = record.output_bytes
        if rewrite:
            write_private_file(record.id + ".log", data, self.dir_fd)
        else:  # a short write (a full disk, a file size limit) is finished or raises
            fd = os.open(record.id + ".log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | NO_LINK,
                         0o600, dir_fd=self.dir_fd)
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
        with self.changed:  # read under it by _write_record
            record.disk_size = len(data) if rewrite else record.disk_size + len(data)


NO_LINK = os.O_NOFOLLOW | os.O_CLOEXEC  # a link planted in -runs-dir is never followed


def record_json(document):
    return (json.dumps(document, sort_keys=True) + "\n").encode()


def append_record(path, line, dir_fd=None):
    """Append a record's line to its file.  It starts with a newline of its own, so a line an
    earlier append left unfinished (a full disk) ends there and never joins this one."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NO_LINK, 0o600, dir_fd=dir_fd)
    try:
        write_all(fd, b"\n" + line)
    finally:
        os.close(fd)


def last_record(data):
    """The fields of the last line of a record file that is a JSON object (an unfinished line
    is not); ValueError when none is."""
    for line in reversed(data.split(b"\n")):
        if line.strip():
            with contextlib.suppress(ValueError):
                fields = json.loads(line)
                if isinstance(fields, dict):
                    return fields
    raise ValueError("no whole record line")


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_new_file(path, data, dir_fd=None):
    """Create path (0600; refused if anything, a link included, is there) holding data."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_LINK, 0o600, dir_fd=dir_fd)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


def write_private_file(path, data, dir_fd=None):
    """Replace path with data atomically (a new temp file 0600, then rename)."""
    temp = path + ".tmp"
    remove_paths([temp], dir_fd)  # left by a daemon killed while writing
    write_new_file(temp, data, dir_fd)
    os.replace(temp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def open_no_link(path, dir_fd=None):
    return open(os.open(path, os.O_RDONLY | NO_LINK, dir_fd=dir_fd), "rb")


def read_run_files(dir_fd):
    """The fields of each record in a -runs-dir held open as dir_fd; one that is unreadable,
    malformed or whose id is not its file name (retention deletes by id) is logged and
    skipped, never fatal."""
    for name in os.listdir(dir_fd):
        if not name.endswith(".json") or not RUN_ID.fullmatch(name[:-5]):
            continue
        try:
            with open_no_link(name, dir_fd) as handle:
                fields = last_record(handle.read())
            if not (isinstance(fields, dict) and fields.get("id") == name[:-5]
                    and isinstance(fields.get("hook"), str) and fields.get("state") in RUN_STATES
                    and isinstance(fields.get("output_bytes", 0), int)
                    and isinstance(fields.get("queued_at") or "", str)):
                raise ValueError("not a run record of this name")
        except (OSError, ValueError) as exc:
            log.info("run history: skipping %s: %s", name, exc)
            continue
        yield fields


RUNS_LOCK = "webhookd.lock"  # in -runs-dir, 0600: held locked while a daemon uses the folder


def open_runs_dir(path, uid, gid):
    """The -runs-dir folder of the user the daemon runs as (uid, gid: after -setuid), created
    0700 (and made 0700 if it was not), as a descriptor: the daemon names its files relative to
    it, so a link swapped in later for the folder (or one above it) is never followed.  Refused
    if another user owns it (they could plant records and links in it) or if it is a symbolic
    link (whoever owns the folder above could point it anywhere, /etc included, for root to
    hand over).  A folder root owns (made now, or by an earlier daemon running as root) is
    handed over to that user, through its open descriptor, and its entries without following
    links.  While the daemon runs it holds a lock on RUNS_LOCK, a 0600 file inside (opened
    without following links; not the folder itself, which anyone who opened it while it was
    readable could lock): a second daemon on it (the same -runs-dir in two units) would mark
    the first one's running runs interrupted and delete its records; it is refused."""
    os.makedirs(path, 0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | NO_LINK)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise OSError(errno.ELOOP, "a symbolic link, not a folder") from None
        raise
    lock = None
    try:
        st = os.fstat(fd)
        handing_over = st.st_uid != uid
        if handing_over and (st.st_uid != 0 or os.geteuid() != 0):
            raise PermissionError(errno.EPERM, "owned by uid %d, not by uid %d that "
                                               "webhookd runs as" % (st.st_uid, uid))
        try:
            lock = os.open(RUNS_LOCK, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | NO_LINK, 0o600,
                           dir_fd=fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(errno.ELOOP, "%s in it is a symbolic link" % RUNS_LOCK) from None
            raise
        lock_st = os.fstat(lock)
        if not stat.S_ISREG(lock_st.st_mode) or lock_st.st_uid != st.st_uid:
            raise PermissionError(errno.EPERM, "%s in it is not a file of the folder's owner"
                                  % RUNS_LOCK)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OSError(errno.EBUSY, "in use by another webhookd") from None
        if handing_over:
            os.fchown(fd, uid, gid)
            for name in os.listdir(fd):
                os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
        if stat.S_IMODE(lock_st.st_mode) != 0o600:
            os.fchmod(lock, 0o600)
    except BaseException:
        os.close(fd)
        if lock is not None:
            os.close(lock)
        raise
    return fd  # the lock's descriptor stays open, holding the lock, until the daemon exits


# ---------------------------------------------------------------------------
# Status site: <status-path>, its run pages and metrics, behind one access check (the pages
# themselves are Appendix A)
# ---------------------------------------------------------------------------

# Headers a reverse proxy adds: a loopback peer sending one, even empty, speaks for a client
# elsewhere (a proxy may add its own line after an empty one the client sent).
RELAY_HEADERS = ("Forwarded", "X-Forwarded-For", "X-Real-Ip")  # canonical, as heads keep them


def is_loopback_peer(remote_addr):
    """Whether a remote address as format_peer() writes it (`host:port`, `[v6]:port`, `@`) is
    on this machine's loopback.  Unix socket peers (`@`) are not: a reverse proxy usually sits
    behind such a socket, passing on clients from anywhere."""
    ip = parse_ip(peer_host(remote_addr).split("%")[0])
    return ip is not None and ip.is_loopback


def names_loopback(host):
    """Whether a Host header names this machine's loopback (or is absent, as in HTTP/1.0).  A
    web page whose DNS name its owner re-points at 127.0.0.1 makes the browser send that name:
    refusing it keeps such a page from reading the status of the browser's own machine."""
    if host.startswith("["):
        name = host[1:host.find("]")]
    else:
        name = host.rpartition(":")[0] if ":" in host else host
    name = name.rstrip(".").lower()
    if name in ("", "localhost") or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def json_response(status, document):
    body = (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()
    return Response(status, body, {"Content-Type": "application/json",
                                   "Cache-Control": "no-store"})


def forbidden(what):
    """The JSON answer to a client the one access check (StatusSite.refusal) refused."""
    return json_response(403, {"error": "%s served with Authorization: Bearer <-status-token>, "
                                        "or without one set to loopback clients no proxy "
                                        "relays" % what})


class StatusSite:
    """The status site: <status-path> (its health to anyone, the details to trusted clients),
    <status-path>/metrics and <status-path>/runs[/<id>[/output]] (the records and output of a
    RunStore), and POST <status-path>/runs/<id>/replay (a run again, by `hooks`), as JSON or,
    to a browser, HTML (RunsHtml).  Each path is one record of STATUS_ROUTES, holding the
    methods it takes (405 otherwise), its access, what it answers a client the one access
    check (`refusal`) refuses, and its handler.  An untrusted client never sees hook ids (some
    hooks rely on theirs being secret), paths, load errors or runs."""

    def __init__(self, path, token, registry, store, metrics_text, started, stopped, hooks):
        self.path, self.token = path, token
        self.registry, self.store, self.started = registry, store, started
        self.metrics_text, self.stopped, self.hooks = metrics_text, stopped, hooks
        self.html = RunsHtml(self.path)
        self.nonces = ReplayNonces()

    def route(self, path):
        """The route of STATUS_ROUTES a path takes, and its match; None off the site."""
        if self.path and path.startswith(self.path):
            for route in STATUS_ROUTES:
                match = route.shape.fullmatch(path, len(self.path))
                if match:
                    return route, match
        return None

    def answer(self, request, route, match):
        """A route's answer: 405 for a method it does not take, then the one access check as
        the route asks it, then its handler."""
        if request.method not in route.methods:
            return Response(405)
        as_html, arguments = prefers_html(request), match.groupdict()
        refusal = self.refusal(route, request, as_html, **arguments)
        if refusal is not None:
            return refusal
        return route.handler(self, request, as_html, **arguments)

    def refusal(self, route, request, as_html, run_id=None):
        """The one access check, as a route's record asks it: None where it lets the request
        through, else the answer to the client it refuses.  Every route asks for a `trusted`
        client; a route ASKED_HERE (a replay) also for, unless the bearer of the token asks by
        itself, a request from this site carrying the nonce of the run's page (`asked_here`):
        credentials a browser sends on its own (Basic, or none on loopback) would let any page
        it shows post a plain form."""
        if not self.trusted(request):
            return route.refused(self, as_html)
        if route.access == ASKED_HERE and not self.asked_here(request, run_id):
            return self.not_replayed(as_html, 403, "a replay is asked with Authorization: "
                                     "Bearer <-status-token>, or with the Replay button of the "
                                     "run's page (reload it: its nonce may be too old)")
        return None

    def trusted(self, request):
        """With -status-token, the bearers of the token (or browsers giving it as their Basic
        password), whoever they are; without, loopback clients no proxy relays."""
        if self.token:
            given = authorization_token(request.get("Authorization"))
            return given is not None and hmac.compare_digest(given, self.token.encode())
        relayed = any(name in request.headers for name in RELAY_HEADERS)
        return (is_loopback_peer(request.peer) and not relayed
                and names_loopback(request.get("Host")))

    def asked_here(self, request, run_id):
        """Whether the bearer of the token asks, or a request from this site (same_origin)
        with the nonce the run's page gave its Replay button."""
        if self.token and request.get("Authorization")[:7].lower() == "bearer ":
            return True
        form = request.body.read(REPLAY_FORM_BYTES)  # 413 for more than a nonce, chunked too
        nonce = parse_query(form.decode("latin-1"))[0].get("nonce", "")
        return same_origin(request) and self.nonces.valid(nonce, run_id)

    def sign_in(self, health=None):
        """What an untrusted browser gets: a sign-in prompt where a token would help."""
        return self.html.refused(health, bool(self.token))

    def health(self):
        return {"status": "degraded" if self.registry.count() == 0
                or self.registry.last_reload_failed else "ok", "version": VERSION}

    def details(self):
        """What the status page shows trusted clients besides its health."""
        files, errors = self.registry.status()
        running = {}
        for hook_id, gate in list(self.registry.gates.items()):
            if gate.running or gate.waiting:
                running[hook_id] = {"running": gate.running, "queued": len(gate.waiting)}
        return {
            "implementation": "webhookd.py",
            "webhookd_version": __version__,
            "started": iso_time(self.started),
            "uptime_seconds": round(time.time() - self.started, 3),
            "hooks_loaded": self.registry.count(),
            "hooks_files": files,
            "last_load": iso_time(self.registry.last_load),
            "last_reload_failed": self.registry.last_reload_failed,
            "load_errors": errors,
            "last_runs": self.store.last_per_hook(),
            "runs": running,
            "runs_in_progress": sum(r["running"] for r in running.values()),
            "runs_queued": sum(r["queued"] for r in running.values()),
        }

    def health_only(self, as_html):
        """The status path to an untrusted client: its health alone."""
        health = self.health()
        return self.sign_in(health) if as_html else json_response(200, health)

    def status(self, request, as_html):
        """The status path to a trusted client: the health and the details (as a page, above
        the runs the query asks for)."""
        details = dict(self.health(), **self.details())
        if as_html:
            return self.listing(request.raw_query, True, details)
        return json_response(200, details)

    def metrics(self, request, as_html):  # Prometheus sends the -status-token as its bearer
        return Response(200, self.metrics_text(), {"Content-Type": METRICS_CONTENT_TYPE,
                                                   "Cache-Control": "no-store"})

    def runs(self, request, as_html):
        return self.listing(request.raw_query, as_html)

    def run(self, request, as_html, run_id):
        """A run's record; as a page, with its output and its Replay button."""
        record = self.run_record(run_id)
        if record is None:
            return self.no_run(request, as_html)
        if as_html:
            refusal = self.hooks.replay_refusal(record, self.registry.hook(record.hook))
            return self.html.run(record.as_dict(), self.store.read_output(record)[0],
                                 self.registry.file_of(record.hook),
                                 None if refusal else self.nonces.issue(record.id),
                                 refusal and refusal[1])
        return json_response(200, record.as_dict())

    def run_output(self, request, as_html, run_id):
        """The kept output; while the run goes on, its body follows the run until it ends."""
        record = self.run_record(run_id)
        if record is None:
            return self.no_run(request, as_html)
        headers = {"Content-Type": TEXT_PLAIN, "Cache-Control": "no-store",
                   "X-Content-Type-Options": "nosniff"}
        data, position, ended = self.store.read_output(record)
        if ended or request.method == "HEAD":
            return Response(200, data, headers)

        def follow(data, position, ended):
            while True:
                if data:
                    yield data
                if ended or self.stopped():
                    return
                self.store.follow(record, position, self.stopped)
                data, position, ended = self.store.read_output(record, position)
        return Response(200, StreamedBody(follow(data, position, ended), drain=False), headers)

    def no_run(self, request, as_html):
        """Anything else under <status-path>/runs/: a run not there (any more)."""
        if as_html:
            return self.html.problem(404, "Run not found", "No run has this id (any more).")
        return json_response(404, {"error": "run not found"})

    def replay(self, request, as_html, run_id):
        """A run again (Hooks.replay): 202 (a browser: 303 to the new run's page), the new run
        in X-Webhookd-Run."""
        record = self.run_record(run_id)
        if record is None:
            return self.not_replayed(as_html, 404, "run not found")
        new, refusal = self.hooks.replay(record, request)
        if refusal is not None:
            return self.not_replayed(as_html, *refusal)
        response = json_response(202, {"id": new.id, "replayOf": record.id})
        if as_html:
            response = Response(303, b"", {"Location": self.html.run_url(new.id),
                                           "Cache-Control": "no-store"})
        response.headers["X-Webhookd-Run"] = new.id
        return response

    def not_replayed(self, as_html, status, why):
        if as_html:
            return self.html.problem(status, "Not replayed", why)
        return json_response(status, {"error": why})

    def run_record(self, run_id):
        return self.store.get(run_id) if RUN_ID.fullmatch(run_id) else None

    def listing(self, raw_query, as_html=False, details=None):
        """The runs a query asks for; as HTML, below the status page's `details` if given."""
        chosen, problem = runs_filter(raw_query)
        if problem:
            if as_html:
                return self.html.problem(400, "Bad filter", problem)
            return json_response(400, {"error": problem})
        runs = self.store.listing(*chosen)
        if as_html:
            return self.html.overview(details, runs, chosen)
        return json_response(200, runs)


def refused_as(what, pages=True):
    """A route's answer to a client the access check refuses: a browser gets a sign-in page
    (if the route serves pages), anyone else a 403 saying `what` needs the check."""
    def refused(site, as_html):
        return site.sign_in() if as_html and pages else forbidden(what)
    return refused


class StatusRoute(namedtuple("StatusRoute", "shape methods access refused handler")):
    """One route of the status site: the `shape` of the path after <status-path> (a pattern;
    its `run_id` names a run), the `methods` it takes, its `access` (TRUSTED or ASKED_HERE),
    what it answers a client the access check refuses (`refused`: site, as_html) and its
    `handler` (site, request, as_html, and the shape's run_id)."""

    __slots__ = ()


TRUSTED, ASKED_HERE = "trusted", "trusted, asked by this site's page"
READ_METHODS = ("GET", "HEAD")
RUN_HISTORY_REFUSED = refused_as("run history is")
# The first route whose shape fits the whole path wins; the last takes the rest under runs/.
STATUS_ROUTES = tuple(StatusRoute(re.compile(shape, re.DOTALL), *rest) for shape, *rest in (
    ("", READ_METHODS, TRUSTED, StatusSite.health_only, StatusSite.status),
    ("/metrics", READ_METHODS, TRUSTED, refused_as("metrics are", pages=False),
     StatusSite.metrics),
    ("/runs", READ_METHODS, TRUSTED, RUN_HISTORY_REFUSED, StatusSite.runs),
    ("/runs/(?P<run_id>[^/]+)/replay", ("POST",), ASKED_HERE, refused_as("replays are"),
     StatusSite.replay),
    ("/runs/(?P<run_id>[^/]*)", READ_METHODS, TRUSTED, RUN_HISTORY_REFUSED, StatusSite.run),
    ("/runs/(?P<run_id>[^/]*)/output", READ_METHODS, TRUSTED, RUN_HISTORY_REFUSED,
     StatusSite.run_output),
    ("/runs/.*", READ_METHODS, TRUSTED, RUN_HISTORY_REFUSED, StatusSite.no_run)))

REPLAY_FORM_BYTES = 1024  # a replay's form holds its nonce alone
REPLAY_NONCE_SECONDS = 3600  # how long a run page's Replay button works


class ReplayNonces:
    """The nonce a run's page gives its Replay button: the time it was served and an HMAC of
    that time and the run's id under a key made at start, so it is bound to the page served,
    unguessable, compared in constant time, and kept nowhere (memory does not grow with the
    pages served); it works for REPLAY_NONCE_SECONDS, and never after a restart."""

    def __init__(self):
        self.key = os.urandom(32)

    def issue(self, run_id):
        issued = str(int(time.time()))
        return "%s.%s" % (issued, self.sign(run_id, issued))

    def valid(self, nonce, run_id):
        issued, _, mac = nonce.partition(".")
        if not (is_ascii_digits(issued) and len(issued) <= 12):
            return False
        age = time.time() - int(issued)
        return 0 <= age <= REPLAY_NONCE_SECONDS and hmac.compare_digest(
            mac.encode("utf-8", "surrogateescape"), self.sign(run_id, issued).encode())

    def sign(self, run_id, issued):
        # any bytes of a path (a `%ff` decodes to a surrogate escape) sign as they came
        message = ("%s %s" % (run_id, issued)).encode("utf-8", "surrogateescape")
        return hmac.new(self.key, message, "sha256").hexdigest()


def same_origin(request):
    """Whether nothing says a request comes from another site's page: Sec-Fetch-Site, when
    sent, must be `same-origin`, and Origin, when sent, must name the Host the request was
    sent to.  A client can forge either, so they only ever refuse, never admit."""
    site = request.get("Sec-Fetch-Site")
    if site and site != "same-origin":
        return False
    origin = request.get("Origin")
    if not origin:
        return True
    scheme, sep, host = origin.partition("://")
    return bool(sep) and scheme in ("http", "https") and host.lower() == request.get(
        "Host").lower()


def runs_filter(raw_query):
    """((hook, state, limit), None) for a run-list query, or (None, what is wrong with it)."""
    query = parse_query(raw_query)[0]
    limit = query.get("limit", "100").lstrip("0") or "0"  # int() refuses over 4,300 digits
    if not is_ascii_digits(limit) or len(limit) > 5 or not 0 < int(limit) <= 10000:
        return None, "limit must be a whole number from 1 to 10000"
    state = query.get("state") or None
    if state is not None and state not in RUN_STATES:
        return None, "state must be one of " + ", ".join(RUN_STATES)
    return (query.get("hook") or None, state, int(limit)), None


def authorization_token(value):
    """The token an Authorization header gives, as bytes: `Bearer <token>`, or a browser's
    `Basic base64(<any user>:<token>)`; None for anything else, malformed included."""
    scheme, _, given = value.partition(" ")
    given = given.strip().encode("utf-8", "surrogateescape")
    scheme = scheme.lower()
    if scheme == "bearer":
        return given
    if scheme != "basic":
        return None
    try:
        user_and_password = base64.b64decode(given, validate=True)
    except (binascii.Error, ValueError):
        return None
    _, colon, password = user_and_password.partition(b":")
    return password if colon else None


ACCEPT_QUALITY = re.compile(r"0(?:\.[0-9]{0,3})?|1(?:\.0{0,3})?")  # RFC 9110's qvalue


def prefers_html(head):
    """Whether the Accept header ranks text/html above JSON, as a browser's does.  JSON stays
    the answer for everything else: no Accept, curl's `*/*`, a tie."""
    ranges = {}
    for item in ",".join(head.headers.get("Accept", ())).split(","):
        media, _, params = item.partition(";")
        quality = 1.0
        for param in params.split(";") if params else ():
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                value = value.strip()
                quality = float(value) if ACCEPT_QUALITY.fullmatch(value) else 0.0
        ranges.setdefault(media.strip().lower(), quality)

    def rank(media):
        for key in (media, media.split("/")[0] + "/*", "*/*"):
            if key in ranges:
                return ranges[key]
        return 0.0
    return rank("text/html") > rank("application/json")


# <status-path>/metrics: what Prometheus scrapes, in its text format 0.0.4.

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RUN_SECONDS_BUCKETS = (0.1, 0.5, 1, 5, 10, 30, 60, 300)  # upper bounds; +Inf follows


def label_value(value):
    """A label value as the text format writes it: backslashes, quotes and line feeds escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metric_labels(**labels):
    return "{%s}" % ",".join('%s="%s"' % (name, label_value(value))
                             for name, value in labels.items())


def metric_family(name, kind, help, samples):
    """The HELP and TYPE lines of one metric, then its samples: (suffix, labels, value)."""
    lines = ["# HELP webhookd_%s %s" % (name, help), "# TYPE webhookd_%s %s" % (name, kind)]
    lines += ["webhookd_%s%s%s %s" % (name, suffix, labels, value if isinstance(value, int)
                                      else repr(float(value)))
              for suffix, labels, value in samples]
    return lines


class Metrics:
    """The counts `<status-path>/metrics` shows, kept as answers go out and runs end (one lock
    and a dict entry each, run history on or off), and the gauges, read when scraped.  Hook
    labels come from loaded hooks only, never from a request: the series stay as few as the
    hooks (those a reload removed keep their counts)."""

    def __init__(self, started):
        self.started = started
        self.lock = threading.Lock()
        self.answers = {}  # status code -> answers sent
        self.runs = {}  # (hook id, final state) -> runs
        self.durations = {}  # hook id -> [runs in each bucket, the last above all; seconds]
        self.refusals = {}  # hook id -> deliveries its rules refused
        self.deduplications = {}  # hook id -> deliveries answered with the run they had

    def answered(self, status):
        with self.lock:
            self.answers[status] = self.answers.get(status, 0) + 1

    def refused(self, hook_id):
        with self.lock:
            self.refusals[hook_id] = self.refusals.get(hook_id, 0) + 1

    def deduplicated(self, hook_id):
        with self.lock:
            self.deduplications[hook_id] = self.deduplications.get(hook_id, 0) + 1

    def run_ended(self, hook_id, state, seconds):
        """A run of the hook ended in `state` after `seconds` (None: it never started)."""
        with self.lock:
            self.runs[hook_id, state] = self.runs.get((hook_id, state), 0) + 1
            if seconds is not None:
                counts = self.durations.get(hook_id)
                if counts is None:
                    counts = self.durations[hook_id] = [0] * (len(RUN_SECONDS_BUCKETS) + 1)
                    counts.append(0.0)
                counts[bisect.bisect_left(RUN_SECONDS_BUCKETS, seconds)] += 1
                counts[-1] += seconds

    def render(self, registry, runner, background):
        """The exposition text: bytes."""
        with self.lock:
            answers, runs = sorted(self.answers.items()), sorted(self.runs.items())
            refusals = sorted(self.refusals.items())
            deduplications = sorted(self.deduplications.items())
            durations = sorted((hook_id, list(c)) for hook_id, c in self.durations.items())
        queued = background.jobs.qsize() + sum(len(gate.waiting)
                                               for gate in list(registry.gates.values()))
        python = "%d.%d.%d" % sys.version_info[:3]
        lines = metric_family("build_info", "gauge", "webhookd's version, the webhook version "
                              "it reproduces, and the Python it runs on.", [(
                                  "", metric_labels(version=__version__, webhook_version=VERSION,
                                                    python=python,
                                                    implementation=sys.implementation.name), 1)])
        lines += metric_family("start_time_seconds", "gauge", "When webhookd started (Unix "
                               "time).", [("", "", self.started)])
        lines += metric_family("http_requests_total", "counter", "HTTP requests answered, by "
                               "status code.", [("", metric_labels(code=code), count)
                                                for code, count in answers])
        lines += metric_family("hooks_loaded", "gauge", "Hooks served now.",
                               [("", "", registry.count())])
        lines += metric_family("reload_failures_total", "counter", "Loads of the hooks files "
                               "(at start, on a signal or by -hotreload) in which a file failed "
                               "to load.", [("", "", registry.load_failures)])
        lines += metric_family("last_reload_successful", "gauge", "1 if every hooks file "
                               "loaded at the last (re)load, else 0.",
                               [("", "", 0 if registry.last_reload_failed else 1)])
        lines += metric_family("last_reload_success_timestamp_seconds", "gauge", "When every "
                               "hooks file last loaded (Unix time).",
                               [("", "", registry.last_good_load or 0)])
        lines += metric_family("runs_total", "counter", "Runs ended, by hook and final state.",
                               [("", metric_labels(hook=hook_id, state=state), count)
                                for (hook_id, state), count in runs])
        lines += metric_family("refused_total", "counter", "Requests to a hook that its "
                               "trigger rules refused (not satisfied, or a signature that did "
                               "not match), by hook.", [("", metric_labels(hook=hook_id), count)
                                                         for hook_id, count in refusals])
        lines += metric_family("deduplicated_total", "counter", "Deliveries a hook's "
                               "`deduplicate` did not run again (their id's run was queued, "
                               "running, succeeded, or superseded by a later trigger), by hook.",
                               [("", metric_labels(hook=hook_id), count)
                                for hook_id, count in deduplications])
        lines += metric_family("run_duration_seconds", "histogram", "How long the commands "
                               "ran, by hook (runs whose command never started are left out).",
                               [sample for hook_id, counts in durations
                                for sample in histogram_samples(hook_id, counts)])
        lines += metric_family("runs_in_progress", "gauge", "Commands running now.",
                               [("", "", runner.active)])
        lines += metric_family("runs_queued", "gauge", "Runs waiting for their hook's "
                               "max-concurrency turn or a -max-async-runs thread.",
                               [("", "", queued)])
        return ("\n".join(lines) + "\n").encode("utf-8", "replace")


def histogram_samples(hook_id, counts):
    """A hook's _bucket (cumulative), _sum and _count samples, from Metrics.durations."""
    samples, total, hook = [], 0, 'hook="%s"' % label_value(hook_id)
    for bound, count in zip(RUN_SECONDS_BUCKETS + ("+Inf",), counts):
        total += count
        samples.append(("_bucket", '{%s,le="%s"}' % (hook, bound), total))
    return samples + [("_sum", "{%s}" % hook, counts[-1]), ("_count", "{%s}" % hook, total)]


def open_run_history(opts):
    """For serving, before privileges are dropped: the status token (-status-token, or read
    from -status-token-file) and the RunStore, over -runs-dir opened (created, chowned to the
    user it will run as, locked) when given.  StartupError (as_flag) if either fails."""
    token = opts.status_token
    if opts.status_token_file:
        try:
            with open(opts.status_token_file, encoding="utf-8") as handle:
                token = handle.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise StartupError("cannot read -status-token-file %s: %s" % (
                opts.status_token_file, go_errno_text(exc) if isinstance(exc, OSError)
                else exc), as_flag=True) from None
        if not token:
            raise StartupError("-status-token-file %s is empty" % opts.status_token_file,
                               as_flag=True)
    dir_fd = None
    if opts.runs_dir:  # only the daemon creates it
        dropping = opts.setuid and opts.setgid
        try:
            dir_fd = open_runs_dir(opts.runs_dir, opts.setuid if dropping else os.geteuid(),
                                   opts.setgid if dropping else os.getegid())
        except OSError as exc:
            raise StartupError("cannot use -runs-dir %s: %s" % (
                opts.runs_dir, go_errno_text(exc)), as_flag=True) from None
    return token, RunStore(opts.runs_keep, opts.runs_max_bytes, opts.runs_max_output,
                           opts.runs_dir or None, dir_fd)


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

GO_LOG_TIME = "%Y/%m/%d %H:%M:%S"  # Go's log package: `[webhook] 2006/01/02 15:04:05 text`


def go_log_line(message):
    """A line as Go's log package writes it, without its newline."""
    return "[webhook] %s %s" % (time.strftime(GO_LOG_TIME), message)


def open_own_file(path, flags):
    """A descriptor on the file at path (made 0600 if missing), refused if it is a link: a log
    or pid file often sits in a folder another user can write, who could plant a symbolic or
    hard link there to a file of the daemon's user (root's /etc/shadow) to be written
    through."""
    fd = os.open(path, flags | os.O_CREAT | NO_LINK, 0o600)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise OSError(errno.EMLINK, "a link to another file", path)
    return fd


def setup_logging(opts):
    """`[webhook] date time message` lines, written by a thread of their own: a request never
    waits for stderr or the log file.  Without -verbose only errors, on stderr (upstream logs
    nothing then: a hooks file it cannot load went unexplained).  The thread, or None;
    StartupError if -logfile cannot be opened."""
    if opts.logfile:
        try:
            fd = open_own_file(opts.logfile, os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            raise StartupError('error opening log file "%s": %s'
                               % (opts.logfile, go_errno_text(exc, "open"))) from None
        target = logging.StreamHandler(os.fdopen(fd, "a", encoding="utf-8",
                                                 errors="backslashreplace"))
    else:
        target = logging.StreamHandler(sys.stderr)
    target.setFormatter(logging.Formatter("[webhook] %(asctime)s %(message)s", GO_LOG_TIME))
    log.propagate = False
    if not (opts.verbose or opts.debug or opts.logfile):
        log.addHandler(target)  # rare lines: written at once, before what main prints next
        log.setLevel(logging.ERROR)
        return None
    # Loaded only with a logging thread (~0.5 MiB); as `from` import, since a local
    # `import logging.handlers` would make `logging` a local name of this whole function.
    from logging.handlers import QueueHandler, QueueListener

    class RecordQueueHandler(QueueHandler):
        def prepare(self, record):
            return record  # formatted by the logging thread, not by the request
    records = queue.SimpleQueue()
    listener = QueueListener(records, target)
    log.addHandler(RecordQueueHandler(records))
    log.setLevel(logging.DEBUG if opts.debug else logging.INFO)
    listener.start()
    return listener


def open_listeners(opts, environ):
    inherited = inherited_listeners(environ)
    if inherited:
        log.info("using %d socket(s) passed by systemd", len(inherited))
        return inherited, "systemd socket"
    if opts.socket:
        remove_stale_socket(opts.socket)
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


def remove_stale_socket(path):
    """Unlink a socket file left by a previous run; one that a live server still answers on is
    refused (EADDRINUSE), not taken over."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return  # nothing there, or a file that is not ours to remove: bind() will say so
    except OSError:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # stale: nothing listens on it
            return
        except (socket.timeout, BlockingIOError):
            pass  # a full backlog: someone is listening
        except OSError:
            return  # e.g. no permission to connect: bind() will say what is wrong
    raise OSError(errno.EADDRINUSE, "address already in use: a running server answers there")


def make_tls_context(opts):
    versions = {"1.0": ssl.TLSVersion.TLSv1, "1.1": ssl.TLSVersion.TLSv1_1,
                "1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
    if opts.tls_min_version not in versions:
        raise StartupError("error: unknown minimum TLS version: %s" % opts.tls_min_version)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = versions[opts.tls_min_version]
    if opts.cipher_suites:
        names = []
        for name in opts.cipher_suites.split(","):
            name = name.strip()
            if name not in GO_CIPHER_SUITES:
                raise StartupError("error: unknown TLS cipher suite: %s" % name)
            if GO_CIPHER_SUITES[name]:
                names.append(GO_CIPHER_SUITES[name])
        if names:
            context.set_ciphers(":".join(names))
    context.set_alpn_protocols(["http/1.1"])
    try:
        for path in (opts.cert, opts.key):
            with open(path, "rb"):
                pass  # OpenSSL's own error does not say which file is missing
        context.load_cert_chain(opts.cert, opts.key)
    except OSError as exc:
        reason = go_errno_text(exc, "open") if not isinstance(exc, ssl.SSLError) else \
            "no PEM certificate with its matching private key in them"
        raise StartupError("error: loading TLS certificate %s / key %s: %s"
                         % (opts.cert, opts.key, reason)) from None
    return context


def drop_privileges(uid, gid):
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def process_exists(pid):
    """Whether a process with this id runs (signal 0: checked, nothing sent; no /proc needed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's process, or an id no process can have
    return True


def write_pidfile(path):
    try:
        with open(path) as handle:
            old = handle.read().strip()
        if old.isdigit() and int(old) != os.getpid() and process_exists(int(old)):
            raise StartupError("error: pid file found, ensure webhook is not running or delete %s"
                             % path)
    except OSError:
        pass
    directory = os.path.dirname(path)
    if directory:
        try:
            os.makedirs(directory, 0o755, exist_ok=True)
        except FileExistsError:  # a file where the folder should be: Go's words for it
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), directory) \
                from None
    with os.fdopen(open_own_file(path, os.O_WRONLY), "w") as handle:
        handle.truncate()
        handle.write(str(os.getpid()))


def raise_fd_limit():
    """Go raises the soft open-files limit to the hard one at start; so do we.  The limit now
    in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ---------------------------------------------------------------------------
# Lifecycle: signals, hot-reload polling, graceful stop
# ---------------------------------------------------------------------------

POLL_INTERVAL = 0.2  # hot-reload polling period: a stat() per hooks file, nothing when idle


class SignalQueue:
    """Signals recorded by their handlers and handled later by the main loop.  Installed first
    thing in serve, so a signal that arrives while the hooks load and the listeners open is
    not lost or fatal; one that comes earlier, while main opens the run history (which may
    chown a whole -runs-dir) and the log, still has its default action (SIGTERM ends it)."""

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
    """Owns the main thread: waits for signals, polls the hooks files, stops gracefully.  It
    alone sets `stopping`, the one stop signal the app and the transport read."""

    def __init__(self, opts, registry, app, servers, notifier, signals, cleanup_paths,
                 stopping):
        self.opts, self.registry, self.app, self.servers = opts, registry, app, servers
        self.notifier, self.signals, self.cleanup_paths = notifier, signals, cleanup_paths
        self.stopping = stopping

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
                    self.app.runner.kill_all()
                    self.wait_for_cleanup()
                    return self.finish()
            if stop_deadline is not None:
                if self.app.in_flight.count == 0 or time.monotonic() >= stop_deadline:
                    if self.app.in_flight.count:
                        log.info("shutdown timeout: killing %d running command(s)",
                                 len(self.app.runner.processes))
                        self.app.runner.kill_all()
                        self.wait_for_cleanup()
                    return self.finish()
            elif self.opts.hotreload:
                changed = self.registry.poll()
                if changed:
                    self.notifier.reloading()
                    self.registry.load(changed)
                    self.notifier.notify("READY=1")

    def wait_for_cleanup(self):
        """Killed runs remove their temp files as they end: give them a moment to."""
        deadline = time.monotonic() + 2.0
        while self.app.runner.active and time.monotonic() < deadline:
            time.sleep(0.01)

    def reload(self, reason):
        log.info("caught %s signal", reason[3:])  # SIGHUP: `caught HUP signal`, as upstream
        self.notifier.reloading()
        self.registry.load()
        self.notifier.notify("READY=1")

    def begin_stop(self, signum):
        self.stopping.set()
        for server in self.servers:  # no new connections from here on
            server.shutdown()
            server.server_close()
        self.notifier.notify("STOPPING=1")
        name = "interrupt" if signum == signal.SIGINT else "terminated"
        log.info("caught %s signal; stopping: no new connections, waiting up to %ds for %d "
                 "running request(s) and command(s)", name, self.opts.shutdown_timeout,
                 self.app.in_flight.count)
        return time.monotonic() + max(0, self.opts.shutdown_timeout)

    def finish(self):
        self.app.runs.flush()
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


def explain_command(opts, stdin=None, out=None):
    """-explain HOOK-ID: how the hook's rules, as its hooks file says now, judge the raw HTTP
    request on stdin (as the daemon would read it, from 127.0.0.1); nothing runs.  Exit 0 if
    they hold, 1 if not, 2 (one sentence) for input that is not that."""
    stdin, out = stdin or sys.stdin.buffer, out or sys.stdout
    hook = None
    try:
        for path in opts.hooks or ():
            hook = hook or next((h for h in read_hooks_file(path, opts.template)[0]
                                 if h.id == opts.explain), None)
        if hook is None:
            raise ValueError("no hook %s in %s" % (json.dumps(opts.explain), ", ".join(
                opts.hooks or ["the hooks files (none given: -hooks FILE)"])))
        request, body = read_saved_request(stdin, opts.max_body_bytes)
        request.id, request.peer = "explain", "127.0.0.1:0"
        request.client = request.peer
        hook_request = HookRequest.of(request, hook, body)
        for message in parse_payload(hook_request, hook, request.get("Content-Type")) + \
                apply_json_parameters(hook, hook_request):
            out.write("note: %s\n" % message)
    except (HooksFileError, ValueError, MultipartError) as exc:
        sys.stderr.write("cannot explain: %s\n" % exc)
        return 2
    if hook.trigger_rule is None:
        out.write("hook %s has no trigger-rule: every request triggers it\n" % hook.id)
        return 0
    trace = []
    satisfied, error, note = rules_satisfied(hook, hook_request, trace)
    for line in explain_lines(trace[0]):
        out.write(line + "\n")
    if error is None and satisfied:
        out.write("the rules hold: hook %s would run\n" % hook.id)
        return 0
    out.write("refused: %s\n" % explain_summary(trace[0]))
    return 1


def read_saved_request(stdin, max_body):
    """(Request, body) of the raw HTTP request a file holds, read with the daemon's checks;
    ValueError saying what is wrong with it."""
    max_body = max_body if max_body > 0 else sys.maxsize
    data = stdin.read(min(MAX_HEADER_BYTES + max_body + RECV_BYTES, sys.maxsize))
    end = head_end(data)
    if end < 0 or end > MAX_HEADER_BYTES:
        raise ValueError("standard input holds no HTTP request head (a request line, headers "
                         "and a blank line, at most %d bytes)" % MAX_HEADER_BYTES)
    try:
        request = parse_head(data[:end])
        request.raw_query = request.target.partition("?")[2]
        size = body_length(request, max_body)
        rest = data[end:]
        if size is None:
            return request, read_chunked(io.BytesIO(rest), max_body)
    except BadRequest as exc:
        raise ValueError("the request is malformed: %s" % exc) from None
    except (BodyError, ConnectionResetError) as exc:
        raise ValueError("the request's chunked body is malformed or cut short: %s"
                         % exc) from None
    if len(rest) < size:
        raise ValueError("the body is shorter than its Content-Length (%d of %d bytes)"
                         % (len(rest), size))
    return request, rest[:size]


# The operator's view from a shell: -runs lists, -runs-follow ID prints (and follows) output.

def runs_command(opts, out=None):
    """-runs / -runs-follow ID on the records in -runs-dir; exit status (follow: 0 if the run
    succeeded)."""
    out = out or sys.stdout
    directory = opts.runs_dir
    if opts.runs_follow:
        return follow_run_file(directory, opts.runs_follow, out)
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        sys.stderr.write("cannot read -runs-dir %s: %s\n" % (directory, go_errno_text(exc)))
        return 1
    since = runs_since(opts.runs_since, time.time()) if opts.runs_since else ""
    try:
        # The filters of the status page's run list (hook, state), and a time.
        records = [r for r in read_run_files(dir_fd)
                   if (not opts.runs_hook or r.get("hook") == opts.runs_hook)
                   and (not opts.runs_state or r.get("state") == opts.runs_state)
                   and (r.get("queued_at") or "") >= since]
    finally:
        os.close(dir_fd)
    records.sort(key=lambda r: (r.get("queued_at") or "", r.get("id") or ""), reverse=True)
    out.write("%-26s %-12s %-20s %5s %10s  %s\n" % ("ID", "STATE", "STARTED", "EXIT",
                                                   "MS", "HOOK  COMMAND"))
    for r in records:
        exit_text = r.get("signal") or ("" if r.get("exit_code") is None else r["exit_code"])
        # after the hook: why it was refused, or the command line as the record holds it
        # (masked, each value cut and escaped), quoted as a shell would; then its successor
        successor = r.get("superseded_by")
        if isinstance(r.get("reason"), str):
            after = "  refused: %s" % r["reason"]
        elif isinstance(r.get("arguments"), list):
            after = "  " + " ".join(shlex.quote(str(arg)) for arg in r["arguments"])
        else:
            after = ""
        if isinstance(successor, str) and RUN_ID.fullmatch(successor):
            after += "  superseded by %s" % successor
        out.write("%-26s %-12s %-20s %5s %10s  %s%s\n" % (
            r.get("id"), r.get("state"), r.get("started_at") or "-", exit_text,
            "" if r.get("duration_ms") is None else r["duration_ms"], r.get("hook"), after))
    out.flush()
    return 0


# A count of at most 12 digits (in seconds, over 31,000 years): longer ones overflowed the
# float subtraction, or passed Python's limit on reading an int, with a traceback.
RUNS_SINCE_AGO = re.compile(r"(?:[0-9]{1,12}[smhd])+")
RUNS_SINCE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
RUNS_SINCE_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}(?:T[0-9]{2}:[0-9]{2}(?::[0-9]{2})?Z?)?")


def runs_since(text, now):
    """-runs-since as a record's time (UTC, as `queued_at` is written), or None if unreadable:
    a time ago (`2h`, `1h30m`, `7d`) or a UTC date or time (`2026-11-21T14:00`, `Z` optional)."""
    if RUNS_SINCE_AGO.fullmatch(text):
        seconds = sum(int(count) * RUNS_SINCE_UNITS[unit]
                      for count, unit in re.findall(r"([0-9]+)([smhd])", text))
        return iso_time(max(now - seconds, 1))
    if not RUNS_SINCE_TIME.fullmatch(text):
        return None
    day, _, clock = text.rstrip("Z").partition("T")
    clock = clock or "00:00"
    if clock.count(":") == 1:
        clock += ":00"
    try:
        time.strptime(day + "T" + clock, "%Y-%m-%dT%H:%M:%S")
    except ValueError:  # (a month 13, a 25th hour)
        return None
    return day + "T" + clock + "Z"  # as written: strftime drops a year's leading zeros


def follow_run_file(directory, run_id, out):
    """Print a run's output as tail -f would, until its record says it ended.  The log is
    held open: when the daemon replaces it with the kept tail (a new file), what the old one
    still held is printed, then the new one from its start, announced (lines may repeat).  A
    run whose files are removed (-runs-keep or -runs-max-bytes may drop it as it ends, before
    its last state is written) ends the follow with status 1."""
    record_path = os.path.join(directory, run_id + ".json")
    if not RUN_ID.fullmatch(run_id) or not os.path.exists(record_path):
        sys.stderr.write("no run %s in %s\n" % (run_id, directory))
        return 1
    log_path, state, handle = os.path.join(directory, run_id + ".log"), None, None
    try:
        while True:
            try:
                with open_no_link(record_path) as record_file:
                    state = last_record(record_file.read()).get("state")
            except FileNotFoundError:
                follow_log(log_path, handle, getattr(out, "buffer", out))
                out.flush()
                sys.stderr.write("run %s was dropped from %s (-runs-keep, -runs-max-bytes) "
                                 "before its end was saved\n" % (run_id, directory))
                return 1
            except (OSError, ValueError):
                pass  # being written: read it next time
            handle = follow_log(log_path, handle, getattr(out, "buffer", out))
            out.flush()
            if state in RUN_ENDED:
                return 0 if state == "succeeded" else 1
            time.sleep(0.2)
    finally:
        if handle is not None:
            handle.close()


def follow_log(path, handle, out):
    """Print what the log held open has gained; the handle to follow from now on."""
    if handle is not None:
        out.write(handle.read())
    try:
        current = open_no_link(path)
    except OSError:
        return handle  # not written yet
    if handle is not None and os.path.sameopenfile(handle.fileno(), current.fileno()):
        current.close()
        return handle
    if handle is not None:
        handle.close()
        out.write(b"\n[webhookd: the log was cut to its kept tail, which follows]\n")
    out.write(current.read())
    return current


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
        print(VERSION_LINE)
        return 0
    if opts.list_cipher_suites:
        for name in GO_CIPHER_SUITES:
            print(name)
        return 0
    if opts.validate:
        return run_validate(opts)
    if opts.explain:
        return explain_command(opts)
    problem = check_flags(opts)
    if problem:
        print("error: " + problem)
        return 1
    if opts.runs or opts.runs_follow:
        return runs_command(opts)
    listener_thread, logging_set_up = None, False
    try:
        status_token, runs = open_run_history(opts)
        listener_thread, logging_set_up = setup_logging(opts), True
        return serve(opts, status_token, runs)
    except StartupError as exc:
        if exc.as_flag:
            print("error: %s" % exc)
        elif logging_set_up:  # as Go's log.Fatal: one line on the log (-logfile's, if given)
            log.error("%s", exc)
        else:  # the log file cannot be opened: that line on stderr
            sys.stderr.write(go_log_line(str(exc)) + "\n")
        return 1
    finally:
        if listener_thread is not None:
            listener_thread.stop()


def serve(opts, status_token, runs):
    """Load the hooks, listen, and run until stopped (the status site with `status_token`,
    run history in `runs`, as open_run_history gives them).  Exit status."""
    signals = SignalQueue()
    log.info("%s starting", VERSION_LINE)
    environ = os.environ
    notifier = Notifier(environ)
    fd_limit = raise_fd_limit()
    registry = Registry(opts.hooks, opts.template)
    try:
        registry.load(startup=True)
    except HooksFileError as exc:
        raise StartupError(str(exc)) from None
    if registry.count() == 0 and not (opts.verbose or opts.debug or opts.logfile
                                      or opts.nopanic):
        print(go_log_line(NO_HOOKS_MESSAGE))
        return 1

    for network in opts.trusted_proxy:
        if network.prefixlen == 0:
            log.warning("warning: -trusted-proxy %s trusts every address: a client that reaches "
                        "webhookd itself can name any address in X-Forwarded-For, and pass "
                        "ip-whitelist with it; give the proxies' own range", network)
    if opts.status_path and not status_token:
        log.warning("warning: %s and its run history are served without -status-token to "
                    "loopback clients no proxy relays: behind a proxy that adds no "
                    "X-Forwarded-For (nginx's proxy_pass does not by default, nor do stunnel "
                    "or ssh -L), every client counts as loopback: set -status-token",
                    opts.status_path)
    stopping = threading.Event()  # set by the Daemon alone
    app = App(opts, registry, status_token, runs, stopping)
    listeners, where, tls_context, cleanup = open_service(opts, environ)
    app.runs.start()  # as the user we now are: the run files are theirs
    servers = start_servers(opts, app, listeners, tls_context, fd_limit, stopping)
    scheme = "https" if opts.secure else "http"
    log.info("serving hooks on %s://%s%s{id}", scheme, where, app.prefix)
    if opts.status_path:  # where an operator finds the page the service unit offers
        log.info("status page and run history on %s://%s%s (%s)", scheme, where,
                 opts.status_path, "with -status-token" if status_token
                 else "loopback clients only")
    notifier.notify("READY=1\nSTATUS=serving %d hook(s) on %s" % (registry.count(), where))
    return Daemon(opts, registry, app, servers, notifier, signals, cleanup, stopping).run()


def open_service(opts, environ):
    """What serving takes from the system while it may (as root, if started so): the pidfile,
    the listeners and the TLS context, then privileges dropped.  (listeners, where they
    listen, the TLS context or None, the files to remove at exit); StartupError
    if a step fails, leaving no socket file or pidfile behind."""
    cleanup = []
    tls_context = None
    try:
        if opts.pidfile:  # before listening: a client that gets an answer finds the pidfile
            try:
                write_pidfile(opts.pidfile)
            except OSError as exc:
                raise StartupError("Error creating pidfile: %s" % go_errno_text(
                    exc, "mkdir" if exc.filename != opts.pidfile else "open")) from None
            cleanup.append(opts.pidfile)
        try:
            listeners, where = open_listeners(opts, environ)
        except (OSError, OverflowError, ValueError) as exc:
            step = "lookup %s: " % opts.ip if isinstance(exc, socket.gaierror) else "bind: "
            raise StartupError("error listening on port: listen %s: %s" % (
                "unix " + opts.socket if opts.socket else "tcp %s:%d" % (opts.ip, opts.port),
                step + go_errno_text(exc) if isinstance(exc, OSError) else exc)) from None
        if opts.socket and where.startswith("unix:"):
            cleanup.append(opts.socket)
        if opts.secure:
            tls_context = make_tls_context(opts)
        if opts.setuid and opts.setgid:
            try:
                drop_privileges(opts.setuid, opts.setgid)
            except OSError as exc:
                raise StartupError("error dropping privileges: %s" % go_errno_text(exc)) from None
    except StartupError:
        remove_paths(cleanup)
        raise
    return listeners, where, tls_context, cleanup


def start_servers(opts, app, listeners, tls_context, fd_limit, stopping):
    """A HookServer per listener, each accepting in a thread of its own, all handing their
    connections to one WaitingRoom and one pool of Workers."""
    limits = Limits(opts, stopping)
    workers = Workers(max(1, opts.max_connections))
    room = WaitingRoom(workers, waiting_capacity(fd_limit, opts.max_connections), limits)
    servers = [HookServer(listener, app, room, limits, tls_context) for listener in listeners]
    for server in servers:
        threading.Thread(target=server.serve_forever, name="accept", daemon=True).start()
    return servers


# ---------------------------------------------------------------------------
# Appendix A: HTML pages of the status site (the status page, the run list, a run), their
# CSS and JavaScript
# ---------------------------------------------------------------------------

def html_text(value):
    """Text (or a number) made safe inside HTML elements and quoted attributes."""
    return html.escape(str(value), quote=True)


def url_part(text, safe=""):
    """A hook id, run id or path percent-encoded for a link (surrogates kept as their bytes)."""
    return urllib.parse.quote(text.encode("utf-8", "surrogateescape"), safe=safe)


RUNS_PAGE_STYLE = """
:root{color-scheme:light dark;--muted:#767676;--line:#8885}
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;
max-width:75rem;padding:.75rem}
h1{font-size:1.35rem;margin:.2rem 0 .6rem}h2{font-size:1.1rem;margin:1.5rem 0 .5rem}
a{color:inherit}nav{margin-bottom:.5rem}.wide{overflow-x:auto}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:.3rem .5rem;border-bottom:1px solid var(--line);
vertical-align:top;white-space:nowrap}
td.text{white-space:pre-wrap;word-break:break-word;min-width:14rem}
.state{font-weight:600}.s-succeeded,.good{color:#16a34a}.s-running,.s-queued{color:#d97706}
.s-failed,.s-timed-out,.s-killed,.s-interrupted,.s-refused,.bad{color:#dc2626}
.s-superseded,.s-dropped{color:var(--muted)}
.muted{color:var(--muted)}
ul.rules{list-style:none;margin:0;padding-left:1.2rem}main>ul.rules{padding-left:0}
form{display:flex;flex-wrap:wrap;gap:.5rem;align-items:flex-end;margin:.5rem 0}
label{display:flex;flex-direction:column;font-size:.85rem}
input,select,button{font:inherit;padding:.25rem .4rem;max-width:100%}
dl{display:grid;grid-template-columns:max-content 1fr;gap:.2rem 1rem;margin:0}
dt{color:var(--muted)}dd{margin:0;word-break:break-word}
pre{background:#8881;border:1px solid var(--line);padding:.6rem;white-space:pre-wrap;
word-break:break-word;font-size:.85rem;min-height:1.5rem}
pre:empty::before{content:"no output";color:var(--muted)}
@media (max-width:40rem){body{font-size:14px;padding:.5rem}th,td{padding:.25rem .3rem}}
"""

# A running run's page follows its output (the streamed `/output`) and, once that ends,
# takes the run's final state from its page, read again; without JavaScript, a reload does.
RUNS_PAGE_SCRIPT = """
"use strict";
(function () {
  function say(text) {
    var note = document.getElementById("live");
    if (note) note.textContent = text;
  }
  function refresh() {
    return fetch(location.pathname, {headers: {Accept: "text/html"}, cache: "no-store"})
      .then(function (answer) {
        if (!answer.ok) throw new Error("HTTP " + answer.status);
        return answer.text();
      }).then(function (text) {
        var inert = document.createElement("template");  // nothing in it runs or applies
        inert.innerHTML = text;
        var fresh = inert.content.getElementById("run");
        var shown = document.getElementById("run");
        if (!fresh || !shown) throw new Error("no run in the page");
        shown.replaceWith(fresh);
      });
  }
  function follow() {
    var out = document.getElementById("output");
    if (!out || !out.dataset.live || !window.fetch || !window.TextDecoder) return;
    say("Following the output live\\u2026");
    fetch(out.dataset.live, {cache: "no-store"}).then(function (answer) {
      if (!answer.ok || !answer.body) throw new Error("HTTP " + answer.status);
      var reader = answer.body.getReader(), text = new TextDecoder(), first = true;
      var keep = Number(out.dataset.keep), shown = 0;
      function more(part) {
        if (part.done) return;
        if (first) out.textContent = "";  // the stream starts again from the kept output
        first = false;
        var piece = text.decode(part.value, {stream: true});
        out.append(piece);
        shown += piece.length;
        if (shown > 2 * keep) {  // a run printing on for hours: the page keeps the tail
          out.textContent = out.textContent.slice(-keep);
          shown = keep;
        }
        return reader.read().then(more);
      }
      return reader.read().then(more);
    }).then(refresh).then(function () {
      setTimeout(follow, 1000);  // still running (the stream was cut short): follow again
    }).catch(function (error) {
      say("Stopped following (" + error.message + "): reload to see more.");
    });
  }
  follow();
})();
"""


RUNS_PAGE_OUTPUT = 1 << 20  # bytes of a run's output its page holds (the tail); /output has all


class RunsHtml:
    """The status page and the run history as HTML for people: one small page each, with
    inline CSS (and script, on a run's page) allowed by a per-answer nonce, everything else
    refused by its Content-Security-Policy.  Shows exactly the documents the JSON answers
    hold (StatusSite.details, the run records, the output), every value escaped."""

    def __init__(self, status_path):
        self.status_url = url_part(status_path, safe="/")

    def page(self, status, title, body, script=False, headers=()):
        nonce = base64.b64encode(os.urandom(18)).decode()
        document = (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            '<link rel="icon" href="data:,"><title>%s</title>\n<style nonce="%s">%s</style>'
            '</head>\n<body>\n%s\n%s</body></html>\n'
            % (html_text(title), nonce, RUNS_PAGE_STYLE, body, '<script nonce="%s">%s</script>\n'
               % (nonce, RUNS_PAGE_SCRIPT) if script else ""))
        policy = ("default-src 'none'; style-src 'nonce-%s'; script-src 'nonce-%s'; "
                  "connect-src 'self'; img-src data:; form-action 'self'; base-uri 'none'; "
                  "frame-ancestors 'none'" % (nonce, nonce))
        # same-origin, not no-referrer: under no-referrer a form's POST says `Origin: null`,
        # and the Replay button's request could not show it comes from this site
        return Response(status, document.encode("utf-8", "replace"), dict({
            "Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-store",
            "Content-Security-Policy": policy, "X-Content-Type-Options": "nosniff",
            "X-Frame-Options": "DENY", "Referrer-Policy": "same-origin",
            "Vary": "Accept, Authorization"}, **dict(headers)))

    # -- pages ---------------------------------------------------------------

    def overview(self, details, runs, chosen):
        """The status page (`details`, as StatusSite.details gives them) above the runs the filter
        `chosen` (hook, state, limit) picked; without details, the runs alone."""
        parts = [self.nav()] if details is None else [self.summary(details),
                                                      self.hooks(details), self.files(details)]
        parts.append(self.runs(runs, chosen))
        return self.page(200, "webhookd" if details else "webhookd runs", "\n".join(parts))

    def run(self, record, output, hooks_file=None, replay_nonce=None, no_replay=None):
        """A run's record and its kept output; followed live while the run goes on; a Replay
        button posting `replay_nonce`, or why it cannot be replayed (`no_replay`).  A refused
        delivery: why (its rules, explained) and how to check a request again (-explain with
        `hooks_file`, the file serving the hook now)."""
        if record["state"] == "refused":
            return self.refusal(record, hooks_file)
        live = record["state"] not in RUN_ENDED
        facts = [("Hook", self.link(self.hook_url(record["hook"]), record["hook"])),
                 ("State", self.state(record)), ("Exit", self.exit(record)),
                 ("Queued", self.when(record["queued_at"])),
                 ("Started", self.when(record["started_at"])),
                 ("Ended", self.when(record["ended_at"])),
                 ("Took", self.how_long(record["duration_ms"])),
                 ("From", html_text(record["remote_addr"] or "-")),
                 ("Request id", html_text(record["request_id"] or "-")),
                 ("Output", "%d bytes%s" % (record["output_bytes"], ", only its tail kept"
                                            if record["output_truncated"] else ""))]
        if record["delivery"]:
            earlier = record["redelivery_of"]
            facts.append(("Delivery", "<code>%s</code>%s" % (html_text(record["delivery"]), (
                ", a redelivery after run %s" % self.link(self.run_url(earlier), earlier))
                if isinstance(earlier, str) else "")))
        arguments, environment = record["arguments"], record["environment"]
        if isinstance(arguments, list):  # (a record from -runs-dir may be hand-edited)
            facts.append(("Command", '<code>%s</code>' % html_text(
                " ".join(shlex.quote(str(arg)) for arg in arguments))))
        if isinstance(environment, dict) and environment:
            facts.append(("Environment", "<br>".join(
                "<code>%s=%s</code>" % (html_text(name), html_text(shlex.quote(str(value))))
                for name, value in sorted(environment.items()))))
        if isinstance(record["superseded_by"], str):
            facts.append(("Superseded by", self.link(self.run_url(record["superseded_by"]),
                                                     record["superseded_by"])))
        if isinstance(record["replayOf"], str):
            facts.append(("Replay of", self.link(self.run_url(record["replayOf"]),
                                                 record["replayOf"])))
        if record["storage_error"]:
            facts.append(("Not saved", '<span class="bad">%s</span>'
                          % html_text(record["storage_error"])))
        if replay_nonce:
            facts.append(("Replay", '<form method="post" action="%s/replay"><input type="hidden"'
                          ' name="nonce" value="%s"><button>Replay</button></form>'
                          % (html_text(self.run_url(record["id"])), html_text(replay_nonce))))
        elif no_replay:
            facts.append(("Replay", '<span class="muted">%s</span>' % html_text(no_replay)))
        raw = html_text(self.run_url(record["id"]) + "/output")
        notes = ['<p id="live" class="muted">This run is still going: reload to see more.</p>'
                 if live else ""]
        if len(output) > RUNS_PAGE_OUTPUT:  # a page a browser can hold; the rest is one click
            output = output[-RUNS_PAGE_OUTPUT:]
            notes.append('<p class="muted">Only the last %d KiB are shown here: <a href="%s">'
                         'all the kept output</a>.</p>' % (RUNS_PAGE_OUTPUT >> 10, raw))
        body = ('%s\n<main id="run"><h1>Run %s</h1>\n%s\n<h2>Output <small>(<a href="%s">raw'
                '</a>)</small></h2>%s\n<pre id="output"%s>%s</pre></main>'
                % (self.nav(), html_text(record["id"]), self.facts(facts), raw, "".join(notes),
                   ' data-live="%s" data-keep="%d"' % (raw, RUNS_PAGE_OUTPUT) if live else "",
                   html_text(output.decode("utf-8", "replace"))))
        return self.page(200, "webhookd run %s" % record["id"], body, script=True)

    def refusal(self, record, hooks_file):
        facts = [("Hook", self.link(self.hook_url(record["hook"]), record["hook"])),
                 ("State", self.state(record)), ("When", self.when(record["queued_at"])),
                 ("From", html_text(record["remote_addr"] or "-")),
                 ("Request id", html_text(record["request_id"] or "-")),
                 ("Why", '<span class="bad">%s</span>' % html_text(record["reason"] or "-"))]
        command = "webhookd.py -hooks %s -explain %s < saved-request" % (
            shlex.quote(hooks_file or "HOOKS-FILE"), shlex.quote(record["hook"]))
        body = ('%s\n<main id="run"><h1>Refused delivery %s</h1>\n%s\n<h2>Trigger rules</h2>'
                '\n%s\n<h2>Check a request again</h2><p>With the request saved as a file (its '
                'head and body, as the sender shows a delivery), this evaluates the rules of the '
                'hooks file as it is now, without running anything, and prints the same tree '
                '(exit 0 if they hold):</p>\n<pre id="explain">%s</pre></main>'
                % (self.nav(), html_text(record["id"]), self.facts(facts),
                   self.rule_tree(record["rules"]), html_text(command)))
        return self.page(200, "webhookd refused delivery %s" % record["id"], body)

    def refused(self, health, token):
        """401 with a Basic challenge where the token is the way in; else the health alone
        (200, as the JSON) on the status page, 403 under it."""
        said = "<p>webhookd is %s.</p>" % html_text(health["status"]) if health else ""
        if token:
            return self.page(401, "webhookd: sign in", (
                "<main><h1>Sign in</h1>%s<p>Hooks and runs are shown to those who give the "
                "status token: as the password, with any user name.</p></main>" % said),
                headers={"WWW-Authenticate": 'Basic realm="webhookd", charset="UTF-8"'})
        return self.page(403 if health is None else 200, "webhookd", (
            "<main><h1>Not shown here</h1>%s<p>Hooks and runs are shown only to clients on "
            "this machine that no proxy relays, or to those who give the status token once "
            "one is set.</p></main>" % said))

    def problem(self, status, title, message):
        return self.page(status, "webhookd: " + title, "%s\n<main><h1>%s</h1><p>%s</p></main>"
                         % (self.nav(), html_text(title), html_text(message)))

    # -- sections ------------------------------------------------------------

    def summary(self, details):
        status = details["status"]
        last_load = self.when(details["last_load"])
        if details["last_reload_failed"]:
            last_load += ' <span class="bad">(failed)</span>'
        facts = [("Status", '<span class="%s">%s</span>' % ("good" if status == "ok" else "bad",
                                                           html_text(status))),
                 ("Hooks loaded", html_text(details["hooks_loaded"])),
                 ("Runs", "%d running, %d queued" % (details["runs_in_progress"],
                                                     details["runs_queued"])),
                 ("Started", self.when(details["started"])), ("Last load", last_load),
                 ("Version", "webhookd.py %s (webhook %s)" % (
                     html_text(details["webhookd_version"]), html_text(details["version"])))]
        return "<header><h1>webhookd</h1>\n%s</header>" % self.facts(facts)

    def hooks(self, details):
        rows = []
        for hooks_file in details["hooks_files"]:
            for hook_id in hooks_file["hooks"]:
                last = details["last_runs"].get(hook_id)
                now = details["runs"].get(hook_id)
                rows.append((
                    self.link(self.hook_url(hook_id), hook_id),
                    self.link(self.run_url(last["id"]), self.state(last), escape=False)
                    if last else '<span class="muted">never run</span>',
                    self.when(last and (last["started_at"] or last["queued_at"])),
                    self.how_long(last and last["duration_ms"]),
                    "%d running, %d queued" % (now["running"], now["queued"]) if now else "",
                    html_text(hooks_file["path"])))
        return self.table("Hooks", ("Hook", "Last run", "When", "Took", "Now", "File"), rows,
                          "No hook is loaded.")

    def files(self, details):
        rows = [(html_text(hooks_file["path"]), html_text(len(hooks_file["hooks"])),
                 self.when(hooks_file["last_load"]),
                 '<td class="text bad">%s' % html_text(hooks_file["error"])
                 if hooks_file["error"] else "loaded")
                for hooks_file in details["hooks_files"]]
        return self.table("Hooks files", ("File", "Hooks", "Loaded at", "Last load"), rows, "")

    def runs(self, runs, chosen):
        hook, state, limit = chosen
        states = "".join('<option%s>%s</option>' % (" selected" if name == state else "", name)
                         for name in RUN_STATES)
        form = ('<form method="get"><label>Hook <input name="hook" value="%s"></label>'
                '<label>State <select name="state"><option value="">any</option>%s</select>'
                '</label><label>At most <input name="limit" type="number" min="1" '
                'max="10000" value="%d"></label><button>Show</button></form>'
                % (html_text(hook or ""), states, limit))
        rows = [(self.link(self.run_url(run["id"]), run["id"]),
                 self.link(self.hook_url(run["hook"]), run["hook"]), self.state(run),
                 self.when(run["queued_at"]), self.how_long(run["duration_ms"]),
                 '<td class="text">refused: %s' % html_text(run["reason"] or "-")
                 if run["state"] == "refused" else self.exit(run))
                for run in runs]
        return self.table("Runs", ("Run", "Hook", "State", "Queued", "Took", "Exit"), rows,
                          "No run matches.", form)

    # -- pieces --------------------------------------------------------------

    def rule_tree(self, node):
        """An explained rule tree (explain_node) as nested lists; a record read from
        -runs-dir may hold anything, so what is not a node is left out."""
        if not isinstance(node, dict) or not isinstance(node.get("rule"), str):
            return '<p class="muted">not recorded</p>'
        try:
            text = explain_text(node)
        except (KeyError, TypeError, ValueError):
            text = node["rule"]
        result = node.get("result")
        children = node.get("rules") if isinstance(node.get("rules"), list) else []
        more = node.get("of", 0) - len(children) if isinstance(node.get("of"), int) else 0
        return ('<ul class="rules"><li><span class="%s">%s</span> %s%s%s</li></ul>' % (
            "good" if result else "bad", "true" if result else "false", html_text(text),
            "".join(self.rule_tree(child) for child in children),
            '<p class="muted">%d more not evaluated</p>' % more if more > 0 else ""))

    def nav(self):
        return '<nav><a href="%s">webhookd status</a> &middot; <a href="%s/runs">all runs</a>' \
               '</nav>' % (self.status_url, self.status_url)

    @staticmethod
    def table(title, columns, rows, empty, before=""):
        """A titled table of rows of HTML cells (a cell may open its own `<td ...>`)."""
        head = "".join("<th>%s</th>" % name for name in columns)
        body = "\n".join("<tr>%s</tr>" % "".join(cell if cell.startswith("<td") else
                                                 "<td>%s" % cell for cell in row)
                         for row in rows)
        if not rows:
            return "<section><h2>%s</h2>%s<p class=\"muted\">%s</p></section>" % (
                title, before, empty) if empty else ""
        return ('<section><h2>%s</h2>%s<div class="wide"><table><thead><tr>%s</tr></thead>\n'
                '<tbody>%s</tbody></table></div></section>' % (title, before, head, body))

    @staticmethod
    def facts(pairs):
        return "<dl>%s</dl>" % "".join("<dt>%s</dt><dd>%s</dd>" % pair for pair in pairs)

    @staticmethod
    def link(url, text, escape=True):
        return '<a href="%s">%s</a>' % (html_text(url), html_text(text) if escape else text)

    def hook_url(self, hook_id):
        return "%s?hook=%s" % (self.status_url, url_part(hook_id))

    def run_url(self, run_id):
        return "%s/runs/%s" % (self.status_url, url_part(run_id))

    @staticmethod
    def state(record):
        return '<span class="state s-%s">%s</span>' % (html_text(record["state"]),
                                                        html_text(record["state"]))

    @staticmethod
    def exit(record):
        if record["signal"]:
            return html_text(record["signal"])
        return '<span class="muted">-</span>' if record["exit_code"] is None else \
            "exit %s" % html_text(record["exit_code"])

    @staticmethod
    def when(iso):
        if not iso or not isinstance(iso, str):  # (a record from -runs-dir may be hand-edited)
            return '<span class="muted">-</span>'
        return '<time datetime="%s">%s</time>' % (
            html_text(iso), html_text(iso.replace("T", " ").replace("Z", " UTC")))

    @staticmethod
    def how_long(ms):
        if not isinstance(ms, int):
            return '<span class="muted">-</span>'
        if ms < 1000:
            return "%d ms" % ms
        if ms < 60000:
            return "%.1f s" % (ms // 100 / 10.0)
        minutes, seconds = divmod(ms // 1000, 60)
        return "%d min %d s" % (minutes, seconds) if minutes < 60 else \
            "%d h %d min" % divmod(minutes, 60)


# ---------------------------------------------------------------------------
# Appendix B: YAML reader for hooks files (pure)
# ---------------------------------------------------------------------------
# Upstream reads every hooks file with go-yaml v2 (YAML 1.1) and turns the result into JSON before
# decoding it.  `load_yaml(text)` returns the same JSON-like values for the YAML hooks files use:
# block and flow collections, the three scalar styles, block scalars, anchors, aliases and merge
# keys.  What it does not read (tags, several documents, complex keys) is refused by line, never
# read differently.

class YamlError(ValueError):
    """A YAML text that cannot be read; `line` and `column` count from 1."""

    def __init__(self, message, line, column):
        ValueError.__init__(self, "%d:%d: %s" % (line, column, message))
        self.message, self.line, self.column = message, line, column


class YamlMap(dict):
    """A mapping read from YAML; `lines[key]` is the line the key is on."""

    __slots__ = ("lines",)


class YamlList(list):
    """A sequence read from YAML; `lines[i]` is the line item i starts on."""

    __slots__ = ("lines",)


YAML_CONSTANTS = {"": None, "~": None, "null": None, "Null": None, "NULL": None,
                  ".nan": float("nan"), ".NaN": float("nan"), ".NAN": float("nan")}
YAML_CONSTANTS.update(dict.fromkeys(("y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE",
                                     "on", "On", "ON"), True))
YAML_CONSTANTS.update(dict.fromkeys(("n", "N", "no", "No", "NO", "false", "False", "FALSE",
                                     "off", "Off", "OFF"), False))
for _sign, _value in (("", float("inf")), ("+", float("inf")), ("-", float("-inf"))):
    YAML_CONSTANTS.update(dict.fromkeys((_sign + ".inf", _sign + ".Inf", _sign + ".INF"), _value))
YAML_GO_INT = re.compile(r"([-+]?)(0[xX][0-9a-fA-F]+|0[bB][01]+|0[oO][0-7]+|0[0-7]*|[1-9][0-9]*)\Z")
YAML_FLOAT = re.compile(r"[-+]?[0-9]*\.?[0-9]+(?:[eE][-+][0-9]+)?\Z")
YAML_DOT_FLOAT = re.compile(r"\.[0-9]+(?:[eE][-+]?[0-9]+)?\Z")
YAML_ESCAPES = {"0": "\0", "a": "\a", "b": "\b", "t": "\t", "\t": "\t", "n": "\n", "v": "\v",
                "f": "\f", "r": "\r", "e": "\x1b", " ": " ", '"': '"', "'": "'", "\\": "\\",
                "N": "\x85", "_": "\xa0", "L": "\u2028", "P": "\u2029"}
YAML_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
# Where a plain scalar's line ends.  Blanks count only from the first of a run (look-behind):
# trying every blank of a long run as a start would take quadratic time.
YAML_BLANKS_END = r"(?<![ \t])(?:[ \t]+#|[ \t]*(?=[\n%s])|[ \t]*\Z)"
YAML_PLAIN_END = re.compile(r":(?=[ \t\n]|\Z)|" + YAML_BLANKS_END % "")
YAML_FLOW_PLAIN_END = re.compile(r":|[,?\[\]{}]|" + YAML_BLANKS_END % r",:?\[\]{}")
YAML_ANCHOR = re.compile(r"[0-9A-Za-z_-]+")
YAML_LINE_SPACE = re.compile(r"[ \t]*")
YAML_MAX_ALIASED = 100000  # values all aliases together may expand to
YAML_BLANK_LINES = re.compile(r"(?:[ \t]*(?:#[^\n]*)?\n)*")
YAML_CONTINUATION = re.compile(r"[ \t]*\n((?:[ \t]*\n)*)([ \t]*)")
YAML_DOUBLE_STOPS = re.compile(r'["\\\n]')
YAML_SINGLE_STOPS = re.compile(r"['\n]")
# Markers no decoded text contains (surrogateescape yields only U+DC80..U+DCFF): an escaped
# blank to keep at a line's edge, and an escaped line break.
YAML_KEEP, YAML_ESCAPED_BREAK = "\ud800", "\ud801"


def resolve_plain(text):
    """A plain (unquoted) scalar as go-yaml v2 resolves it: None, bool, int, float or str.
    YAML 1.1: `yes`/`on`/`y` are true, `0777` is octal, `1_000` is 1000, `1e3` stays a string."""
    if text in YAML_CONSTANTS:
        return YAML_CONSTANTS[text]
    first = text[:1]
    if first == "." and YAML_DOT_FLOAT.match(text):
        value = float(text)
        return text if math.isinf(value) else value
    if not first or first not in "+-0123456789":
        return text
    plain = text.replace("_", "")
    number = YAML_GO_INT.match(plain)
    if number:
        sign, digits = number.groups()
        base = {"x": 16, "b": 2, "o": 8}.get(digits[1:2].lower(), 8 if digits[:1] == "0" else 10)
        magnitude = int(digits[2:] if base != 10 and digits[1:2].isalpha() else digits, base)
        value = -magnitude if sign == "-" else magnitude
        if -2 ** 63 <= value < 2 ** 63 or (not sign and value < 2 ** 64):
            return value
    if YAML_FLOAT.match(plain):
        value = float(plain)
        if not math.isinf(value):
            return value
    return text


def yaml_key_text(key):
    """A mapping key as text, as upstream turns keys into JSON object names."""
    if isinstance(key, str):
        return key
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, int) and key < 2 ** 63:
        return str(key)
    if isinstance(key, float):
        return {"+Inf": ".inf", "-Inf": "-.inf", "NaN": ".nan"}.get(go_float32_text(key),
                                                                      go_float32_text(key))
    raise ValueError("unsupported map key %s" % ("null" if key is None else json.dumps(key)))


# JSON escapes go-yaml v2 refuses: such a file goes through the YAML reader to fail as upstream.
JSON_ONLY_ESCAPE = re.compile(r"\\(?:/|u[dD][89abAB])")


def load_yaml(text, lines=False):
    """The one entry point: the single document of a hooks file's text (JSON or YAML) as
    upstream reads it, as JSON-like Python values (dict, list, str, int, float, bool, None),
    scalars resolved as go-yaml v2 resolves them, for JSON too (`1e5` is a string there):
    (value, read_as_json).  JSON is tried first (fast), unless `lines` asks for the YAML
    reader, whose maps and lists know the line of each entry (`.lines`, for messages).
    Raises YamlError naming the line and column."""
    if not lines:
        try:
            data = json.loads(text, parse_int=resolve_plain, parse_float=resolve_plain,
                              parse_constant=str)
            if "\\" not in text or not JSON_ONLY_ESCAPE.search(text):
                return data, True
        except ValueError:
            pass
    return YamlReader(text).document(), False


class YamlScanner:
    """The cursor under YamlReader: `pos` is an offset into the text; positions for errors,
    blanks, comments and line ends, and the scalars (plain, quoted and block)."""

    def __init__(self, text):
        self.text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
        self.pos = 0
        self.anchors = {}
        self.aliased, self.sizes = 0, {}  # values reached through aliases; expanded_size memo
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", self.text)]

    # -- positions and errors

    def where(self, pos):
        line = bisect.bisect_right(self.line_starts, pos)
        return line, pos - self.line_starts[line - 1] + 1

    def line_of(self, pos):
        return bisect.bisect_right(self.line_starts, pos)

    def column(self, pos):
        return pos - self.line_starts[self.line_of(pos) - 1]

    def fail(self, message, pos=None):
        line, column = self.where(self.pos if pos is None else pos)
        raise YamlError(message, line, column)

    def char(self, offset=0):
        return self.text[self.pos + offset:self.pos + offset + 1]

    def blank_after(self, offset):
        return self.char(offset) in ("", " ", "\t", "\n")

    def at_marker(self, pos):
        text = self.text
        return (text.startswith(("---", "..."), pos) and (pos == 0 or text[pos - 1] == "\n")
                and text[pos + 3:pos + 4] in ("", " ", "\t", "\n"))

    def skip_line_space(self):
        """Skip blanks and a comment up to the end of the current line."""
        text = self.text
        pos = YAML_LINE_SPACE.match(text, self.pos).end()
        if text.startswith("#", pos) and (pos == self.pos or text[pos - 1] in " \t\n"):
            end = text.find("\n", pos)
            pos = len(text) if end < 0 else end
        self.pos = pos

    def at_line_end(self):
        self.skip_line_space()
        return self.pos >= len(self.text) or self.text[self.pos] == "\n"

    def next_content(self):
        """Skip blanks, comments and line breaks; the column of what follows, or -1 at the end
        of the document (end of text or a `---`/`...` marker)."""
        self.skip_line_space()
        text, pos = self.text, self.pos
        if pos < len(text) and text[pos] == "\n":
            self.pos = YAML_BLANK_LINES.match(text, pos + 1).end()
            self.skip_line_space()
            pos = self.pos
            start = text.rfind("\n", 0, pos) + 1
            if "\t" in text[start:pos] and pos < len(text):
                self.fail("found a tab character that violates indentation")
        else:
            start = text.rfind("\n", 0, pos) + 1
        if pos >= len(text) or self.at_marker(pos):
            return -1
        return pos - start

    # -- document

    def skip_to_line_end(self):
        end = self.text.find("\n", self.pos)
        self.pos = len(self.text) if end < 0 else end

    # -- block context

    def plain_line(self, pattern):
        """A plain scalar's text up to the end of its first line; (text, followed by `: `)."""
        end = pattern.search(self.text, self.pos)
        text = self.text[self.pos:end.start()]
        self.pos = end.start()
        return text, self.text.startswith(":", self.pos)

    def plain_continued(self, first, parent, flow=False):
        """Continue a plain scalar on more-indented lines (any line in flow context)."""
        lines, text = [first], self.text
        while True:
            more = YAML_CONTINUATION.match(text, self.pos)
            if more is None or more.end() >= len(text):
                break
            line_start, pos = more.start(2), more.end()
            if (text[pos] == "#" or self.at_marker(line_start)
                    or (flow and text[pos] in ",]}:?")
                    or (not flow and pos - line_start <= parent)):
                break
            self.pos = pos
            line, _ = self.plain_line(YAML_FLOW_PLAIN_END if flow else YAML_PLAIN_END)
            if flow and self.char() == ":" and not self.blank_after(1):
                self.fail("found unexpected ':'")
            lines.extend([""] * more.group(1).count("\n"))
            lines.append(line)
        return fold_lines(lines) if len(lines) > 1 else first

    def block_scalar(self, parent):
        """A `|` (literal) or `>` (folded) scalar with optional chomping (`+`/`-`) and
        indentation (1-9) indicators, folded and chomped as go-yaml v2 does."""
        start, text = self.pos, self.text
        folded = text[start] == ">"
        self.pos += 1
        chomping, increment = "clip", 0
        for _ in range(2):
            char = self.char()
            if char in ("+", "-") and chomping == "clip":
                chomping = "keep" if char == "+" else "strip"
            elif char in "0123456789" and char and not increment:
                if char == "0":
                    self.fail("found an indentation indicator equal to 0")
                increment = int(char)
            else:
                break
            self.pos += 1
        if self.char() not in ("", " ", "\t", "\n") or not self.at_line_end():
            self.fail("did not find expected comment or line break", start)
        indent = (parent + increment if parent >= 0 else increment) if increment else 0
        pos = self.pos + 1
        if not indent:
            deepest, probe = 0, pos
            while probe < len(text):
                end = text.find("\n", probe)
                line = text[probe:len(text) if end < 0 else end]
                deepest = max(deepest, len(line) - len(line.lstrip(" ")))
                if line.strip(" ") or end < 0:
                    break
                probe = end + 1
            indent = max(deepest, parent + 1, 1)
        entries, breaks, last_break = [], 0, False
        while pos < len(text):
            end = text.find("\n", pos)
            end = len(text) if end < 0 else end
            line = text[pos:end]
            if line.strip(" ") and len(line) - len(line.lstrip(" ")) < indent:
                break
            if len(line) > indent:
                entries.append((breaks, line[indent:]))
                breaks, last_break = 0, end < len(text)
            elif end < len(text):
                breaks += 1
            self.pos, pos = end, end + 1
        pieces, previous_blank = [], False
        for index, (before, content) in enumerate(entries):
            blank = content[:1] in (" ", "\t")
            if index:
                if folded and not previous_blank and not blank:
                    pieces.append("" if before else " ")
                else:
                    pieces.append("\n")
            pieces.append("\n" * before)
            pieces.append(content)
            previous_blank = blank
        if last_break and chomping != "strip":
            pieces.append("\n")
        if chomping == "keep":
            pieces.append("\n" * breaks)
        return "".join(pieces)

    # -- flow context and scalars

    def quoted(self):
        """A single- or double-quoted scalar (with YAML escapes), folded over lines."""
        start, text = self.pos, self.text
        quote = text[start]
        stops = YAML_DOUBLE_STOPS if quote == '"' else YAML_SINGLE_STOPS
        out, pos, lines = [], start + 1, []
        while True:
            found = stops.search(text, pos)
            if found is None:
                self.fail("found unexpected end of stream while scanning a quoted scalar", start)
            end = found.start()
            out.append(text[pos:end])
            char = text[end]
            if char == quote:
                if quote == "'" and text.startswith("''", end):
                    out.append("'")
                    pos = end + 2
                    continue
                pos = end + 1
                break
            if char == "\n":
                lines.append("".join(out))
                out, pos = [], end + 1
                if self.at_marker(pos):
                    self.fail("found unexpected document indicator", pos)
                continue
            escape = text[end + 1:end + 2]
            if escape == "\n":
                out.append(YAML_ESCAPED_BREAK)
                lines.append("".join(out))
                out, pos = [], end + 2
            elif escape in YAML_ESCAPES and escape:
                value = YAML_ESCAPES[escape]
                out.append(YAML_KEEP + value + YAML_KEEP if value in " \t" else value)
                pos = end + 2
            elif escape in YAML_HEX_ESCAPES and escape:
                width = YAML_HEX_ESCAPES[escape]
                digits = text[end + 2:end + 2 + width]
                if len(digits) < width or not all(c in "0123456789abcdefABCDEF" for c in digits):
                    self.fail("did not find expected hexdecimal number", end)
                code = int(digits, 16)
                if 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
                    self.fail("found invalid Unicode character escape code", end)
                out.append(chr(code))
                pos = end + 2 + width
            else:
                self.fail("found unknown escape character", end)
        self.pos = pos
        lines.append("".join(out))
        return fold_lines(lines) if len(lines) > 1 else lines[0].replace(YAML_KEEP, "")


class YamlReader(YamlScanner):
    """Recursive descent over the structure: documents, nodes, block and flow collections,
    anchors and aliases; indentation counts columns."""

    def document(self):
        text = self.text
        column = self.next_content()
        while column == 0 and text.startswith("%", self.pos):
            if not text.startswith("%YAML", self.pos):
                self.fail("directives other than %YAML are not supported")
            self.skip_to_line_end()
            column = self.next_content()
        value = None
        if column == -1 and text.startswith("---", self.pos):
            self.pos += 3
            if not self.at_line_end():
                value = self.node(-1, True)
            elif self.next_content() >= 0:
                value = self.node(-1, True)
        elif column >= 0:
            value = self.node(-1, True)
        column = self.next_content()
        if column == -1 and text.startswith("...", self.pos):
            self.pos += 3
            column = self.next_content()
        if column == -1 and text.startswith("---", self.pos):
            marker = self.pos
            self.pos += 3  # an empty document after it changes nothing (upstream reads one)
            if self.next_content() != -1 or self.pos < len(text):
                self.fail("several YAML documents in one file are not supported", marker)
        if self.pos < len(text):
            self.fail("did not find expected <document start>")
        return value

    def node(self, parent, can_be_key):
        """The node at `pos`, inside a block indented `parent` columns; `can_be_key`: it may open
        a block mapping (it does not follow a key on the same line)."""
        char, start = self.char(), self.pos
        if char == "!":
            self.fail("tags are not supported")
        if char == "&":
            name = self.anchor_name()
            if self.at_line_end():
                column = self.next_content()
                if column > parent:
                    value = self.node(parent, True)
                elif column == parent and self.char() == "-" and self.blank_after(1) and \
                        not can_be_key:
                    value = self.block_sequence(column)
                else:
                    value = None
            else:
                value = self.node(parent, False)
            self.anchors[name] = value
            return value
        if char == "*":
            value = self.alias()
            self.skip_line_space()
            if self.char() == ":":
                self.fail("aliases as mapping keys are not supported")
            if not self.at_line_end():
                self.fail("did not find expected key")
            return value
        if char == "-" and self.blank_after(1):
            if not can_be_key:
                self.fail("block sequence entries are not allowed in this context")
            return self.block_sequence(self.column(start))
        if char == "?" and self.blank_after(1):
            self.fail("complex mapping keys (?) are not supported")
        if char in "[{":
            value = self.flow_collection()
            self.skip_line_space()
            if self.char() == ":":
                self.fail("complex mapping keys (a collection as key) are not supported", start)
            if not self.at_line_end():
                self.fail("did not find expected key")
            return value
        if char in "|>":
            return self.block_scalar(parent)
        if char in ("'", '"'):
            value = self.quoted()
            if self.line_of(self.pos) == self.line_of(start):
                self.skip_line_space()
                if self.char() == ":" and self.blank_after(1):
                    if not can_be_key:
                        self.fail("mapping values are not allowed in this context")
                    return self.block_mapping(self.column(start), value, start)
            if not self.at_line_end():
                self.fail("did not find expected key")
            return value
        if char == ":" and self.blank_after(1):
            self.fail("a mapping key is missing (null keys are not supported)")
        if char in ",]}#@`%":
            self.fail("found character that cannot start any token")
        text, key_like = self.plain_line(YAML_PLAIN_END)
        if key_like:
            if not can_be_key:
                self.fail("mapping values are not allowed in this context")
            return self.block_mapping(self.column(start), resolve_plain(text), start)
        text = self.plain_continued(text, parent)
        if self.char() == ":":
            self.fail("mapping values are not allowed in this context")
        return resolve_plain(text)

    def block_mapping(self, column, key, key_pos):
        result = YamlMap()
        result.lines = {}
        while True:
            self.pos += 1  # the ':'
            if self.at_line_end():
                content = self.next_content()
                if content > column:
                    value = self.node(column, True)
                elif content == column and self.char() == "-" and self.blank_after(1):
                    value = self.block_sequence(column)
                else:
                    value = None
            else:
                value = self.node(column, False)
            self.store(result, key, value, key_pos)
            content = self.next_content()
            if content < column:
                return result
            if content > column:
                self.fail("bad indentation of a mapping entry")
            key_pos = self.pos
            key = self.mapping_key()

    def mapping_key(self):
        char = self.char()
        if char in ("'", '"'):
            key = self.quoted()
            self.skip_line_space()
        elif char == "?" and self.blank_after(1):
            self.fail("complex mapping keys (?) are not supported")
        elif char in "[{":
            self.fail("complex mapping keys (a collection as key) are not supported")
        elif char in "&*!":
            self.fail("anchors, aliases and tags on mapping keys are not supported")
        elif char == "-" and self.blank_after(1):
            self.fail("did not find expected key")
        elif char == ":" and self.blank_after(1):
            self.fail("a mapping key is missing (null keys are not supported)")
        else:
            text, _ = self.plain_line(YAML_PLAIN_END)
            key = resolve_plain(text)
        if not (self.char() == ":" and self.blank_after(1)):
            self.fail("could not find expected ':'")
        return key

    def store(self, mapping, key, value, key_pos):
        """Set one entry; a plain `<<` merges mappings in as go-yaml v2 does (in order)."""
        if key == "<<" and self.text.startswith("<<", key_pos):
            sources = value if isinstance(value, list) else [value]
            for source in reversed(sources):
                if not isinstance(source, dict):
                    self.fail("map merge requires map or sequence of maps as the value",
                              key_pos)
                for name, item in source.items():
                    mapping[name] = item
                    mapping.lines[name] = source.lines.get(name, self.line_of(key_pos))
            return
        try:
            name = yaml_key_text(key)
        except ValueError as exc:
            self.fail(str(exc), key_pos)
        mapping[name] = value
        mapping.lines[name] = self.line_of(key_pos)

    def block_sequence(self, column):
        result = YamlList()
        result.lines = []
        while True:
            result.lines.append(self.line_of(self.pos))
            self.pos += 1  # the '-'
            if self.at_line_end():
                item = self.node(column, True) if self.next_content() > column else None
            else:
                item = self.node(column, True)
            result.append(item)
            content = self.next_content()
            if content < column or (content == column and not (
                    self.char() == "-" and self.blank_after(1))):
                return result
            if content > column:
                self.fail("bad indentation of a sequence entry")

    def anchor_name(self):
        match = YAML_ANCHOR.match(self.text, self.pos + 1)
        if match is None or not self.blank_after(match.end() - self.pos) and \
                self.text[match.end()] not in ",[]{}":
            self.fail("did not find expected alphabetic or numeric character")
        self.pos = match.end()
        return match.group()

    def alias(self):
        """The anchored value (shared, not copied); what aliases expand to is counted, so a
        file of nested aliases (a "billion laughs") fails here instead of exhausting time
        and memory later, as go-yaml's "excessive aliasing" check does."""
        start = self.pos
        name = self.anchor_name()
        if name not in self.anchors:
            self.fail("unknown anchor '%s' referenced" % name, start)
        value = self.anchors[name]
        self.aliased += expanded_size(value, self.sizes)
        if self.aliased > YAML_MAX_ALIASED:
            self.fail("document contains excessive aliasing (aliases expand to more than %d "
                      "values)" % YAML_MAX_ALIASED, start)
        return value

    def flow_space(self):
        text = self.text
        while True:
            while self.pos < len(text) and text[self.pos] in " \t\n":
                self.pos += 1
            if self.char() == "#" and text[self.pos - 1] in " \t\n":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            else:
                return

    def flow_collection(self):
        start, mapping = self.pos, self.char() == "{"
        closing = "}" if mapping else "]"
        result = YamlMap() if mapping else YamlList()
        result.lines = {} if mapping else []
        self.pos += 1
        while True:
            self.flow_space()
            if self.char() == closing:
                self.pos += 1
                return result
            if not self.char():
                self.fail("did not find expected ',' or '%s'" % closing, start)
            if self.char() == "?" and self.blank_after(1):
                self.fail("complex mapping keys (?) are not supported")
            entry_pos = self.pos
            value = self.flow_node()
            self.flow_space()
            if self.char() == ":" or mapping:
                if isinstance(value, (list, dict)):
                    self.fail("complex mapping keys (a collection as key) are not supported",
                              entry_pos)
                key, value = value, None
                if self.char() == ":":
                    self.pos += 1
                    self.flow_space()
                    if self.char() not in (",", closing):
                        value = self.flow_node()
                        self.flow_space()
                pair = result if mapping else YamlMap()
                if not mapping:
                    pair.lines = {}
                self.store(pair, key, value, entry_pos)
                if not mapping:
                    result.append(pair)
                    result.lines.append(self.line_of(entry_pos))
            else:
                result.append(value)
                result.lines.append(self.line_of(entry_pos))
            if self.char() == ",":
                self.pos += 1
            elif self.char() != closing:  # at the end of the text: point at the opening
                self.fail("did not find expected ',' or '%s'" % closing,
                          None if self.char() else start)

    def flow_node(self):
        char = self.char()
        if char in "[{":
            return self.flow_collection()
        if char in ("'", '"'):
            return self.quoted()
        if char == "&":
            name = self.anchor_name()
            self.flow_space()
            value = None if self.char() in (",", "]", "}", ":") else self.flow_node()
            self.anchors[name] = value
            return value
        if char == "*":
            return self.alias()
        if char == "!":
            self.fail("tags are not supported")
        if char == "-" and self.blank_after(1):
            self.fail("block sequence entries are not allowed in this context")
        if not char or char in ",]}#|>@`%" or (char in "?:" and self.blank_after(1)):
            self.fail("did not find expected node content")
        text, _ = self.plain_line(YAML_FLOW_PLAIN_END)
        if self.char() == ":" and not self.blank_after(1):
            self.fail("found unexpected ':'")
        return resolve_plain(self.plain_continued(text, -1, flow=True))


def expanded_size(value, sizes):
    """How many values `value` is once every alias in it is expanded; each collection is
    counted once (`sizes`: memo by id, holding the collection so that its id stays its own)."""
    if not isinstance(value, (list, dict)):
        return 1
    known = sizes.get(id(value))
    if known is None:
        items = value.values() if isinstance(value, dict) else value
        known = (value, 1 + sum(expanded_size(item, sizes) for item in items))
        sizes[id(value)] = known
    return known[1]


def fold_lines(lines):
    """Fold the lines of a plain or quoted scalar: a break is a space, n empty lines are n
    breaks; in quoted ones an escaped break joins without a space and escaped blanks at a
    line's edge are kept (plain text never holds those markers)."""
    out, breaks, joined, last = [], 0, False, len(lines) - 1
    for index, line in enumerate(lines):
        escaped_break = index < last and line.endswith(YAML_ESCAPED_BREAK)
        if escaped_break:
            line = line[:-1]
        if index:
            line = line.lstrip(" \t")
        if index < last and not escaped_break:
            line = line.rstrip(" \t")
        line = line.replace(YAML_KEEP, "")
        if 0 < index < last and not line:
            breaks += 1
            continue
        if index:
            out.append("\n" * breaks if breaks else ("" if joined else " "))
        out.append(line)
        breaks, joined = 0, escaped_break
    return "".join(out)


if __name__ == "__main__":
    sys.exit(main())
