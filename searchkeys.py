#!/usr/bin/env python3
"""searchkeys -- a Meilisearch-compatible API-key service, guard and client.

One file, Python 3.9+ standard library only.

Server: speaks Meilisearch's ``/keys`` API (same bodies, field order, status
codes and error JSON as Meilisearch 1.50), authorizes every Meilisearch route
with upstream's permission model (actions, index patterns, expiry, tenant
tokens), and forwards authorized requests to a real search backend::

    MEILI_MASTER_KEY=... python3 searchkeys.py serve --store keys.json \\
        --upstream http://127.0.0.1:7701 --upstream-key "$BACKEND_MASTER_KEY"

``GET /authorize`` answers nginx ``auth_request`` sub-requests instead.

Client: manages keys on any Meilisearch-compatible server and mints tenant
tokens offline::

    python3 searchkeys.py keys create --preset search --indexes blog --quiet
    python3 searchkeys.py keys list
    python3 searchkeys.py token --api-key KEY --uid UID --rules '["blog"]'

Library: ``import searchkeys`` for ``ACTIONS``, ``expand``,
``pattern_matches``, ``authorize``, ``KeyStore``, ``derive_key``,
``sign_tenant_token``/``verify_tenant_token`` and ``Client``.

Request pipeline of the server:
    request -> route -> authenticate -> authorize (action, index) -> the route's handler
    (the /keys API: validate -> store -> respond; a backend route: decide -> forward -> relay)
The backend gets --upstream-key, not the caller's key, so for an index-scoped
key or a tenant token the guard also does what Meilisearch's handlers do with
the caller's key: check the indexes named in bodies, add tenant-token filters
to searches, filter index/stats/task listings. What a credential gets on a
route is one pure function, ``decide`` (with ``authorize`` and ``Principal``
before it); forwarding and ``GET /authorize`` both act on its Decision.

The file reads in that order: HTTP (requests, responses, http.server), the
service, the routes, the gate (restrictions, then authentication and the
permission model), the decision and the handler rules it applies, usage and
metrics, the /keys API and its store, the upstream; then the pure libraries
(restrictions, validation, UUIDs, dates, key derivation, tenant tokens), the
client and the command line; an appendix holds the keys page's HTML. The route
table, which names handlers and rules from all over, is built last, at the end
of the file.
"""

import argparse
import base64
import calendar
import collections
import contextlib
import datetime
import errno
import fcntl
import functools
import hashlib
import heapq
import hmac
import html
import http.client
import http.server
import io
import ipaddress
import itertools
import json
import os
import re
import resource
import secrets
import select
import selectors
import shlex
import signal
import stat
import socket
import socketserver
import sys
import threading
import time
import unicodedata
import urllib.error
import urllib.parse
import urllib.request

__version__ = "1.0"


# =============================================================================
# Constants: actions, wildcard expansion, index scopes
# =============================================================================

# The 58 action names, in upstream's declaration order (the order used in
# "expected one of ..." error lists).
ACTIONS = (
    "*", "search", "documents.*", "documents.add", "documents.get", "documents.delete",
    "indexes.*", "indexes.create", "indexes.get", "indexes.update", "indexes.delete",
    "indexes.swap",
    "tasks.*", "tasks.cancel", "tasks.delete", "tasks.get",
    "settings.*", "settings.get", "settings.update", "stats.*", "stats.get",
    "metrics.*", "metrics.get", "dumps.*", "dumps.create", "snapshots.*",
    "snapshots.create", "version",
    "keys.create", "keys.get", "keys.update", "keys.delete",
    "experimental.get", "experimental.update", "export", "network.get", "network.update",
    "chatCompletions", "chats.*", "chats.get", "chats.delete",
    "chatsSettings.*", "chatsSettings.get", "chatsSettings.update", "*.get",
    "webhooks.get", "webhooks.update", "webhooks.delete", "webhooks.create", "webhooks.*",
    "indexes.compact", "fields.post", "tasks.compact",
    "dynamicSearchRules.get", "dynamicSearchRules.create", "dynamicSearchRules.update",
    "dynamicSearchRules.delete", "dynamicSearchRules.*",
)
ACTION_SET = frozenset(ACTIONS)

# What "*.get" grants: upstream's "read" actions (not keys.get, not chatCompletions).
READ_ACTIONS = (
    "search", "documents.get", "export", "indexes.get", "tasks.get", "settings.get",
    "stats.get", "metrics.get", "version", "experimental.get", "network.get", "chats.get",
    "chatsSettings.get", "webhooks.get", "fields.post", "dynamicSearchRules.get",
)

# Wildcard actions and what a stored key holding them is granted. A wildcard
# does not grant itself (so "documents.*" does not pass a route that requires
# the literal "documents.*"); only "*" grants everything, itself included.
EXPANSIONS = {
    "*": ACTIONS,
    "*.get": READ_ACTIONS,
    "documents.*": ("documents.add", "documents.get", "documents.delete"),
    "indexes.*": ("indexes.create", "indexes.get", "indexes.update", "indexes.delete",
                  "indexes.swap", "indexes.compact"),
    "tasks.*": ("tasks.get", "tasks.delete", "tasks.cancel", "tasks.compact"),
    "settings.*": ("settings.get", "settings.update"),
    "stats.*": ("stats.get",),
    "metrics.*": ("metrics.get",),
    "dumps.*": ("dumps.create",),
    "snapshots.*": ("snapshots.create",),
    "chats.*": ("chats.get", "chats.delete"),
    "chatsSettings.*": ("chatsSettings.get", "chatsSettings.update"),
    "webhooks.*": ("webhooks.get", "webhooks.update", "webhooks.delete", "webhooks.create"),
    "dynamicSearchRules.*": ("dynamicSearchRules.get", "dynamicSearchRules.create",
                             "dynamicSearchRules.update", "dynamicSearchRules.delete"),
}

# Index scope of each action (upstream keys.rs `index_scope`).
# Global: refused on index-scoped keys, and needs an all-index key to be used.
GLOBAL_ACTIONS = frozenset((
    "metrics.*", "metrics.get", "dumps.*", "dumps.create", "snapshots.*", "snapshots.create",
    "version", "keys.create", "keys.get", "keys.update", "keys.delete",
    "experimental.get", "experimental.update", "export", "network.get", "network.update",
    "chats.*", "chats.get", "chats.delete",
    "chatsSettings.*", "chatsSettings.get", "chatsSettings.update",
    "webhooks.*", "webhooks.get", "webhooks.update", "webhooks.delete", "webhooks.create",
    "dynamicSearchRules.*", "dynamicSearchRules.get", "dynamicSearchRules.create",
    "dynamicSearchRules.update", "dynamicSearchRules.delete", "tasks.compact",
))
# Handler-checked: an index-scoped key may call the index-less route; the
# route itself filters results or validates the indexes named in the body.
HANDLER_CHECKED_ACTIONS = frozenset((
    "search", "documents.get", "indexes.create", "indexes.get", "indexes.swap",
    "tasks.cancel", "tasks.delete", "tasks.get", "settings.get", "stats.*", "stats.get",
    "chatCompletions",
))
# The rest (upstream's index-only actions and the wildcards spanning scopes)
# are allowed on keys with any indexes, and need no set of their own here.

KEYS_ACTIONS = frozenset(("keys.create", "keys.get", "keys.update", "keys.delete"))
# Routes needing one of these accept tenant tokens as well as API keys (a token
# reads documents when its parent key may: its filter holds it, as on searches).
TENANT_TOKEN_ACTIONS = frozenset(("search", "chatCompletions", "documents.get"))

# Body fields of POST /keys in upstream's order (also the order of error lists),
# and the fields PATCH may change.
CREATE_FIELDS = ("description", "name", "uid", "actions", "indexes", "expiresAt")
PATCH_FIELDS = ("description", "name")
IMMUTABLE_FIELDS = ("uid", "actions", "indexes", "expiresAt", "createdAt", "updatedAt")
LIST_PARAMETERS = ("offset", "limit")

PUBLIC = ()  # the "actions" of a route anyone may call

# The four keys created whenever the store is empty at startup, in creation
# order (listed newest first, so Search comes first in GET /keys).
DEFAULT_KEYS = (
    ("Default Chat API Key", "Use it to chat and search from the frontend",
     ["chatCompletions", "search"]),
    ("Default Read-Only Admin API Key",
     "Use it to read information across the whole database. Caution! Do not expose this key "
     "on a public frontend", ["*.get", "keys.get"]),
    ("Default Admin API Key",
     "Use it for anything that is not a search operation. Caution! Do not expose it on a "
     "public frontend", ["*"]),
    ("Default Search API Key", "Use it to search from the frontend", ["search"]),
)

# Presets of the client's `keys create --preset`.
PRESETS = {
    "search": ["search"],
    # what a server that adds data needs: documents, an index created on the first add,
    # task polling; not index deletion or settings changes
    "backend": ["search", "documents.*", "indexes.create", "indexes.get", "tasks.get",
                "settings.get", "stats.get"],
}

ERROR_LINK = "https://docs.meilisearch.com/errors#"
MAX_KEYS_BODY = 1024 * 1024  # bytes accepted on /keys bodies
MAX_HANDLER_BODY = 16 * 1024 * 1024  # bodies read to check their indexes (multi-search...)
DEFAULT_URL = "http://127.0.0.1:7700"
MAX_TOKEN_FILE = 4096  # bytes of --metrics-token-file


# =============================================================================
# Errors: upstream's JSON error shape
# =============================================================================


class ApiError(Exception):
    """An error answered as upstream's JSON: message, code, type, link.
    A refusal of the guard carries its `reason` (one of REFUSAL_REASONS, for
    usage and metrics) and, when the credential named one, the `key`."""

    reason = None
    key = None

    def __init__(self, status, code, message, kind="invalid_request"):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.kind = kind

    def to_json(self):
        return {"message": self.message, "code": self.code, "type": self.kind,
                "link": ERROR_LINK + self.code}

    def __repr__(self):
        return "ApiError(%d, %r, %r)" % (self.status, self.code, self.message)


def invalid_api_key(message="The provided API key is invalid."):
    return ApiError(403, "invalid_api_key", message, "auth")


def refused(reason, error):
    """`error`, marked as the guard's refusal for `reason`."""
    error.reason = reason
    return error


def missing_authorization_header():
    return ApiError(401, "missing_authorization_header",
                    "The Authorization header is missing. It must use the bearer "
                    "authorization method.", "auth")


def missing_master_key():
    return ApiError(401, "missing_master_key",
                    "Meilisearch is running without a master key. To access this API "
                    "endpoint, you must have set a master key at launch.", "auth")


def bad_request(message):
    return ApiError(400, "bad_request", message)


def internal_error(message):
    return ApiError(500, "internal", message, "internal")


def key_not_found(segment):
    return ApiError(404, "api_key_not_found", "API key `%s` not found." % segment)


def index_not_found(index, status=404):
    return ApiError(status, "index_not_found", "Index `%s` not found." % index)


# =============================================================================
# Requests and responses: what the service reads and answers
# =============================================================================

SMALL_BODY = 64 * 1024  # bodies up to this size are read whole (and retried if safe)
MAX_HEAD = 128 * 1024   # bytes in a request head, as actix-http
CLIENT_TIMEOUT = 30.0   # seconds a caller may stay silent mid-request or between requests
MIN_BODY_RATE = 1024    # bytes a second a body must average once CLIENT_TIMEOUT has passed
_ORIGIN_FORM_RE = re.compile(r"/[!$-;=?-~]*\Z")  # visible ASCII but `#`, `<` and `>`


class Headers:
    """A request's header lines, or a backend answer's, read as
    email.message.Message reads them for http.server and http.client
    (`get`, `get_all`, `items`; names without case, `get` the first of
    repeated ones), from lines checked by _HEADER_BLOCK_RE, each value
    without its leading blanks and line end as email.parser leaves them.
    An optimization, measured: without email's feed parser and per-call
    policy, the largest single cost of a guarded request, twice over
    (bench/README.md, "Where the guard's time goes", "round five")."""

    __slots__ = ("_lines", "_values")

    def __init__(self, block=""):
        self._lines = [(name, value.lstrip(" \t").rstrip("\r")) for name, _, value in
                       (line.partition(":") for line in block.split("\n")[:-1])]
        self._values = {}  # lower-case name -> its values, in order
        for name, value in self._lines:
            self._values.setdefault(name.lower(), []).append(value)

    def get(self, name, failobj=None):
        values = self._values.get(name.lower())
        return failobj if values is None else values[0]

    def get_all(self, name, failobj=None):
        values = self._values.get(name.lower())
        return failobj if values is None else list(values)

    def has_any(self, lower_names):
        """Is any of `lower_names` (a set of lower-case names) among them?"""
        return not self._values.keys().isdisjoint(lower_names)

    def items(self):
        return list(self._lines)


class BrokenBody(Exception):
    """A request body ended early or is not valid chunked coding."""


def payload_too_large(limit):
    return ApiError(413, "payload_too_large",
                    "The provided payload reached the size limit. The maximum accepted payload "
                    "size is %s." % ("%.2f MiB" % (limit / 1048576.0)))


def origin_form(target):
    """The request target if it is in origin form (`/path?query`), else a
    400: an absolute or bare target (`http://indexes/keys`, `x/keys`) is
    routed by the backend on a path the guard would not have authorized."""
    if not _ORIGIN_FORM_RE.match(target):
        raise bad_request("The request target `%s` is not supported: it must be a path "
                          "starting with `/`." % printable(target[:200]))
    return target


class BodyPace:
    """The slowest a body may come: after CLIENT_TIMEOUT seconds, at least
    MIN_BODY_RATE bytes a second on average, so a caller trickling a body
    holds a worker for a bounded time (each read alone is bounded too)."""

    def __init__(self):
        self.started, self.received = time.monotonic(), 0

    def check(self, size):
        self.received += size
        elapsed = time.monotonic() - self.started
        if elapsed > CLIENT_TIMEOUT and self.received < MIN_BODY_RATE * elapsed:
            raise BrokenBody("body sent slower than %d bytes a second" % MIN_BODY_RATE)


class Body:
    """A request body, framed by its Content-Length or by chunked coding,
    read from the caller's buffered stream as the service asks for it.
    `before_read` runs once before the first read (the deferred 100 Continue)."""

    def __init__(self, stream, length=0, chunked=False, before_read=None):
        self.stream = stream
        self.chunked = chunked
        self.remaining = length
        self.size_known = not chunked
        self.finished = not chunked and length == 0
        self.started = self.broken = False
        self.before_read = before_read

    @classmethod
    def of_request(cls, stream, headers, before_read=None):
        """The body a request announces; 400 ApiError for framing that two
        parties could read differently (the stuff of request smuggling)."""
        lengths = {value.strip() for value in headers.get_all("Content-Length", ())}
        encodings = headers.get_all("Transfer-Encoding", ())
        if encodings:
            if lengths or len(encodings) > 1 or encodings[0].strip().lower() != "chunked":
                raise bad_request("Unsupported request framing: use either Content-Length or "
                                  "Transfer-Encoding: chunked.")
            return cls(stream, chunked=True, before_read=before_read)
        if len(lengths) > 1:
            raise bad_request("Conflicting Content-Length headers.")
        length = lengths.pop() if lengths else "0"
        if not is_decimal(length):
            raise bad_request("The Content-Length header `%s` is invalid." % length)
        return cls(stream, int(length), before_read=before_read)

    def chunks(self, piece=SMALL_BODY):
        """Yield the body in pieces as it arrives."""
        if not self.started:
            self.started = True
            if self.before_read is not None and not self.finished:
                self.before_read()
        stream, pace = self.stream, BodyPace()
        try:
            while self.remaining:
                data = stream.read1(min(piece, self.remaining))
                if not data:
                    raise BrokenBody("body cut short")
                self.remaining -= len(data)
                pace.check(len(data))
                yield data
            while self.chunked and not self.finished:
                size_line = stream.readline(1024)
                size_text = size_line.split(b";", 1)[0].strip()
                if not size_line.endswith(b"\n") or not size_text \
                        or size_text.strip(b"0123456789abcdefABCDEF"):
                    raise BrokenBody("bad chunk size")
                size = int(size_text, 16)
                if size == 0:
                    self._skip_trailers()
                    break
                while size:
                    data = stream.read1(min(piece, size))
                    if not data:
                        raise BrokenBody("body cut short")
                    size -= len(data)
                    pace.check(len(data))
                    yield data
                if stream.readline(3) not in (b"\r\n", b"\n"):
                    raise BrokenBody("chunk not followed by CRLF")
        except BrokenBody:
            self.broken = True
            raise
        except (OSError, ValueError) as exc:  # a timeout, a reset, a chunk size past all
            self.broken = True
            raise BrokenBody(str(exc))
        self.finished = True

    def _skip_trailers(self):
        budget = MAX_HEAD
        while budget > 0:
            line = self.stream.readline(budget)
            if line in (b"\r\n", b"\n", b""):
                return
            budget -= len(line)
        raise BrokenBody("trailers too large")

    def read(self, limit):
        """The whole body, or a 413 ApiError when it is over `limit` bytes."""
        if self.size_known and self.remaining > limit:
            raise payload_too_large(limit)
        if self.size_known and self.remaining <= SMALL_BODY:  # the common case, in one read
            return b"".join(self.chunks(self.remaining))
        data, size = [], 0
        for chunk in self.chunks():
            size += len(chunk)
            if size > limit:
                raise payload_too_large(limit)
            data.append(chunk)
        return b"".join(data)

    def discard(self, limit=MAX_KEYS_BODY):
        """Skip an unread body so the connection can serve on; False when that
        is unwise (too big, broken, a caller still waiting for 100 Continue)
        or impossible without waiting (the stream does not block: a body not
        all there yet must not hold a worker, so the connection is closed
        instead)."""
        if self.finished:
            return True
        if self.broken or (self.before_read is not None and not self.started) or \
                (self.size_known and self.remaining > limit):
            return False
        try:
            size = 0
            for chunk in self.chunks():
                size += len(chunk)
                if size > limit:
                    return False
        except BrokenBody:
            return False
        return True


class Request:
    """One request as the service sees it: method, target (origin form is
    checked by the service), headers (`get`, `get_all`), body."""

    __slots__ = ("method", "target", "headers", "body", "peer", "key", "family", "place")

    def __init__(self, method, target, headers, body, peer=None):
        self.method, self.target, self.headers, self.body = method, target, headers, body
        self.peer = peer  # the socket's remote address (see Gate.client)
        self.key = None  # the API key it was made with, once known: its usage counts
        self.family = "other"  # its route's family, for metrics (Route.family)
        self.place = None  # its Place among its key's searches at once (Gate.enter), if any

    @property
    def path(self):
        return self.target.partition("?")[0]

    @property
    def query(self):
        return self.target.partition("?")[2]

    def read_json_body(self):
        """Content type, size cap, then JSON: upstream's order."""
        check_content_type(self.headers.get("Content-Type"))
        return parse_json_body(self.body.read(MAX_KEYS_BODY))


class Response:
    """An answer: status, headers, and a body as bytes, or as `stream`, an
    iterable of byte chunks of `length` bytes (None: unknown) that is closed
    once written or abandoned."""

    __slots__ = ("status", "headers", "body", "stream", "length")

    def __init__(self, status, headers=(), body=b"", stream=None, length=None):
        self.status, self.headers, self.body = status, list(headers), body
        self.stream, self.length = stream, length

    @classmethod
    def json(cls, status, value, headers=()):
        if value is None:
            return cls(status, headers)
        return cls(status, list(headers) + [("Content-Type", "application/json")],
                   compact_json(value).encode())

    @classmethod
    def error(cls, error, headers=()):
        return cls.json(error.status, error.to_json(), headers)


# =============================================================================
# HTTP: http.server, with a waiting room for connections between requests
# =============================================================================
# The request cycle is http.server's own (handle_one_request -> parse_request
# -> do_* -> send_response_only/send_header/end_headers -> wfile); the only
# way in or out of it is Service.handle(Request) -> Response. Overridden:
# parse_request (actix-http's head rules), handle_expect_100 (the 100 waits
# for the body's first read), send_error (upstream's JSON error; a method
# without do_* goes to the service), setup and finish (a connection's streams
# last a thread's turn on it) and, on the server, socketserver's
# process_request and shutdown_request, which hand a connection to the
# waiting room between requests instead of to a thread.

MAX_HEADERS = 100       # header lines in a head
MAX_LOGGED = 256        # characters of a request's method, and of its path, in its log line
LINGER_SECONDS = 2.0    # seconds a closing connection waits for the caller's last bytes
NEXT_REQUEST_WAIT = 0.002  # seconds a free thread waits for a keep-alive caller's next request
MAX_HEADS_HELD = 64 * 1024 * 1024  # bytes of unfinished requests the waiting room holds in all
OPEN_FILES_WANTED = 16384  # the open-files limit serve asks for: thousands of idle connections
_HTTP_VERSION_RE = re.compile(r"HTTP/(\d)\.(\d)\Z")
# Header lines as every party reads them alike: a token, a colon, a value of
# tab, space, visible ASCII and bytes 0x80-0xFF, as actix-http (httparse) takes
# them (a bare CR may read as a line break to a backend, which would then see
# headers, Transfer-Encoding..., the guard never saw); no continuation lines.
_HEADER_BLOCK_RE = re.compile(rb"(?:[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e\x80-\xff]*\r?\n)*")


class BadHead(Exception):
    """A head's header lines too large, or not read alike by every party."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def read_head(stream, budget):
    """The Headers of a head whose start line was read from `stream`, up to
    its blank line; BadHead past `budget` bytes or MAX_HEADERS lines, or for
    a line not every party reads alike (_HEADER_BLOCK_RE)."""
    lines = []
    while True:
        line = stream.readline(budget + 1)
        budget -= len(line)
        if budget < 0 or len(lines) > MAX_HEADERS:
            raise BadHead(431, "Header fields too large")
        if line in (b"\r\n", b"\n", b""):
            break
        lines.append(line)
    block = b"".join(lines)
    if not _HEADER_BLOCK_RE.fullmatch(block):
        raise BadHead(400, "Bad header line")
    return Headers(block.decode("iso-8859-1"))


class KeysHandler(http.server.BaseHTTPRequestHandler):
    """One request of a connection: http.server reads it, `server.service`
    answers it, `send_answer` writes the answer."""

    protocol_version = "HTTP/1.1"
    server_version = "searchkeys/" + __version__
    sys_version = ""
    timeout = CLIENT_TIMEOUT
    wbufsize = SMALL_BODY  # a head and a small body leave in one send
    default_request_version = "HTTP/1.1"  # answers to unreadable request lines get a head
    body = None
    started = None

    def setup(self):
        """StreamRequestHandler's, on a Connection: rfile reads the bytes the
        waiting room read (a whole head) before the socket."""
        self.connection = self.request.sock
        if self.connection.gettimeout() != self.timeout:  # a system call each time
            self.connection.settimeout(self.timeout)
        self.reader, self.rfile, self.wfile = self.request.streams(self.wbufsize)

    def finish(self):
        """StreamRequestHandler's, but the streams stay open: they are the
        connection's for the rest of this thread's turn on it."""
        try:
            self.wfile.flush()
        except OSError:  # the caller is gone
            pass

    def handle(self):
        """One request a turn (not http.server's loop): between requests the
        server holds the connection without a thread, with what was read
        past this one."""
        connection = self.request
        self.close_connection = True
        try:
            self.handle_one_request()
        except OSError:  # reset, or a broken pipe: the caller is gone
            self.close_connection = True
        connection.keep = not self.close_connection
        connection.take_back(self.reader.leftover(self.rfile) if connection.keep else b"")

    def parse_request(self):
        """Replaces http.server's: a request line of three words and HTTP/1.x
        (no HTTP/0.9, whose answers have no head), the whole head within
        MAX_HEAD but no cap per line, header lines every party reads alike,
        one unambiguous body framing. (Its header parsing, email's, is the
        cost Headers spares.)"""
        self.started, self.command = time.monotonic(), None
        self.request_version = self.default_request_version
        self.close_connection = True
        self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        words = self.requestline.split()
        if not words:
            return False
        version = _HTTP_VERSION_RE.match(words[-1])
        if len(words) != 3 or not version:
            self.send_error(400, "Bad request line")
            return False
        if version.group(1) != "1":
            self.send_error(505, "Only HTTP/1.0 and HTTP/1.1 are supported")
            return False
        self.command, self.path = words[0], words[1]  # the target as sent: the service checks it
        self.request_version = "HTTP/1.1" if int(version.group(2)) else "HTTP/1.0"
        try:
            self.headers = read_head(self.rfile, MAX_HEAD - len(self.raw_requestline))
        except BadHead as refusal:
            self.send_error(refusal.status, str(refusal))
            return False
        connection = self.headers.get("Connection", "").lower()
        self.close_connection = connection == "close" or (
            self.request_version == "HTTP/1.0" and connection != "keep-alive")
        expecting = self.request_version == "HTTP/1.1" and \
            self.headers.get("Expect", "").lower() == "100-continue" and self.handle_expect_100()
        try:
            self.body = Body.of_request(self.rfile, self.headers,
                                        self.send_continue if expecting else None)
        except ApiError as error:
            self.close_connection = True
            self.send_answer(Response.error(error))
            return False
        return True

    def handle_expect_100(self):
        """http.server's hook for `Expect: 100-continue`: the 100 is sent when
        the body is first read (send_continue), so a refused request never
        invites its body."""
        return True

    def send_continue(self):
        super().handle_expect_100()  # http.server's: the 100 Continue
        self.wfile.flush()

    def do_request(self):
        """Every method's do_*: the service routes methods as upstream does.
        A streamed answer is closed even when its head could not be sent
        (its backend connection, and its key's search place, go back)."""
        response = self.server.service.handle(Request(
            self.command, self.path, self.headers, self.body, self.client_address[0]))
        try:
            self.send_answer(response)
        finally:
            if response.stream is not None:
                response.stream.close()

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_request

    def send_error(self, code, message=None, explain=None):
        """http.server's refusals (a bad request line, a head too large...),
        as upstream's JSON error. Its 501 for a method without a do_* goes to
        the service instead, which answers any method as upstream does (404
        or 405). (Not a __getattr__ making up do_* methods: with one, every
        attribute read of a handler costs a second lookup, 8 % of a /health.)"""
        if code == http.HTTPStatus.NOT_IMPLEMENTED and self.command is not None:
            return self.do_request()
        self.close_connection = True  # (an HTTPStatus from http.server prints as a name on 3.9)
        error = ApiError(int(code), "bad_request", message or http.HTTPStatus(code).phrase)
        self.send_answer(Response.error(error))

    def send_answer(self, response):
        """Write a Response, framed for this hop: the one writer of answers."""
        body = self.body
        if body is not None and not body.finished:
            # only what has come already: waiting for the rest held this thread (a caller
            # announcing a body it never sent held one a second a request); a connection
            # with more to come is closed, and the waiting room sees it out
            self.connection.setblocking(False)
            if not body.discard():
                self.close_connection = True
            self.connection.settimeout(self.timeout)
        status, head_only = response.status, self.command == "HEAD"
        # a 1xx, 204 or 304 ends at its head (RFC 9112, 6.3), whatever body it was given (a
        # backend's 204 in chunked coding): written, the caller would read it as its next answer
        bodyless = status < 200 or status in (204, 304)
        self.log_request(status)
        self.send_response_only(status)
        names = set()
        for name, value in response.headers:
            names.add(name.lower())
            self.send_header(name, value)
        if "date" not in names:
            self.send_header("Date", self.date_time_string())
        chunked = False
        if response.stream is None:
            if not bodyless and not (head_only and "content-length" in names):
                self.send_header("Content-Length", str(len(response.body)))
        elif response.length is not None:
            self.send_header("Content-Length", str(response.length))
        elif self.request_version == "HTTP/1.1":
            chunked = True
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.close_connection = True  # an HTTP/1.0 caller: the end is the close
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if response.stream is None:
            if not (head_only or bodyless):
                self.wfile.write(response.body)
            return
        self.write_stream(response.stream, chunked)

    def write_stream(self, stream, chunked):
        """A streamed body, each piece sent as it comes; a backend or caller
        that breaks off ends the connection (its framing cannot be finished)."""
        try:
            for data in stream:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
                self.wfile.flush()
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
        except (OSError, http.client.HTTPException):
            self.close_connection = True
        finally:
            stream.close()

    _date = (0, "")

    def date_time_string(self, timestamp=None):
        """http.server's, formatted once a second (formatting is slow)."""
        if timestamp is not None:
            return super().date_time_string(timestamp)
        now = int(time.time())
        if KeysHandler._date[0] != now:
            KeysHandler._date = (now, super().date_time_string(now))
        return KeysHandler._date[1]

    def log_request(self, code="-", size="-"):
        """One line a request: method, path without its query or secrets,
        status, time taken (http.server's has the whole request line)."""
        taken = time.monotonic() - self.started if self.started else 0.0
        self.server.service.log("%s %s %s %.2fms" % (
            printable((self.command or "-")[:MAX_LOGGED]),
            safe_path(self.path)[:MAX_LOGGED] if self.command else "-", code, taken * 1000))

    def log_message(self, format, *args):
        self.server.service.log("searchkeys: %s" % printable(format % args))


class Connection:
    """A caller's connection between requests: its socket, the bytes of its
    next request read so far, and when that request's head must be in."""

    __slots__ = ("sock", "address", "pending", "scanned", "wanted", "deadline", "keep",
                 "closing", "_streams")

    def __init__(self, sock, address):
        self.sock, self.address = sock, address
        self.pending, self.scanned, self.wanted = bytearray(), 0, None
        self.deadline, self.keep = None, False
        self.closing = None  # once closing: the bytes the caller may still send, to be dropped
        self._streams = None

    def streams(self, wbufsize):
        """(reader, rfile, wfile) for its request: its ConnectionReader,
        starting with `pending`, buffered, and the socket's writer. Made when
        a thread's turn on it starts and kept while that thread serves on
        (an optimization, measured: making them cost ~35,000 instructions a
        request, 5 % of a guarded search); close_streams ends them."""
        if self._streams is None:
            reader = ConnectionReader(self.sock)
            self._streams = (reader, io.BufferedReader(reader),
                             self.sock.makefile("wb", wbufsize))
        self._streams[0].start(self.pending)
        return self._streams

    def close_streams(self):
        """At the end of a turn: a connection between requests holds no
        buffers (the waiting room holds thousands)."""
        if self._streams is not None:
            _, rfile, wfile = self._streams
            self._streams = None
            for stream in (wfile, rfile):
                try:
                    stream.close()
                except OSError:  # an unsent answer's end: the caller is gone
                    pass

    def take_back(self, data):
        """What was read past the request just answered: the next one's start."""
        self.pending, self.scanned, self.wanted = bytearray(data), 0, None

    def request_arrived(self):
        """Has a whole head come, with the small body it announces (see
        awaited_body), or more than a head may hold? Searched on from where
        the last search stopped (a head trickled a byte at a time is
        searched once in all, not once a byte)."""
        data = self.pending
        if self.wanted is None:
            start = max(0, self.scanned - 2)
            ends = [end + len(blank) for blank in (b"\n\r\n", b"\n\n")
                    for end in (data.find(blank, start),) if end >= 0]
            if not ends:
                self.scanned = len(data)
                return len(data) > MAX_HEAD
            end = min(ends)
            self.wanted = end + (awaited_body(data[:end]) if end <= MAX_HEAD else 0)
        return len(data) >= self.wanted


# The head's fields that say how its body comes: with a Content-Length alone,
# in full; chunked, or only once asked for (100-continue), otherwise.
_BODY_FRAMING_RE = re.compile(rb"\n(content-length|transfer-encoding|expect)[\t ]*:([^\r\n]*)",
                              re.IGNORECASE)


def awaited_body(head):
    """The bytes of body the waiting room awaits after `head`, as it awaits
    the head: its Content-Length when that is at most SMALL_BODY and nothing
    else frames the body, else 0 (a thread reads it, or refuses the head).
    So a body trickled by anyone holding a key (a search key is public) holds
    no thread either; the JSON bodies the guard reads whole are that small."""
    lengths = set()
    for name, value in _BODY_FRAMING_RE.findall(head):
        if name.lower() != b"content-length":
            return 0
        lengths.add(value.strip())
    length = lengths.pop() if len(lengths) == 1 else b""
    if not length.isdigit() or len(length) > 6:  # (int() of thousands of digits raises)
        return 0
    return int(length) if int(length) <= SMALL_BODY else 0


class ConnectionReader(io.RawIOBase):
    """What a handler's rfile reads: the bytes its connection's request came
    in so far, then the socket."""

    def __init__(self, sock):
        super().__init__()
        self.sock, self.pending, self.probing = sock, memoryview(b""), False

    def start(self, pending):
        """A request's reading: `pending` first."""
        self.pending, self.probing = memoryview(bytes(pending)), False

    def readable(self):
        return True

    def readinto(self, buffer):
        if self.pending:
            count = min(len(buffer), len(self.pending))
            buffer[:count] = self.pending[:count]
            self.pending = self.pending[count:]
            return count
        if self.probing:
            return None  # "nothing without waiting", to leftover()
        return self.sock.recv_into(buffer)

    def leftover(self, rfile):
        """What `rfile` (reading this) already holds past the request just
        answered: the start of the next one. Never waits."""
        self.probing = True
        pieces = []
        while True:
            piece = rfile.read1(SMALL_BODY)
            if not piece:
                return b"".join(pieces)
            pieces.append(piece)


class WaitingRoom:
    """Connections waiting for their next request's head, held without a
    thread: one thread watches them all (selectors) and reads what they send
    until a whole head is in (with its body, when small: see awaited_body),
    then hands the connection to `ready`. So no
    thread ever waits for a head, however slowly or long it comes (up to
    MAX_HEAD bytes). A connection has CLIENT_TIMEOUT for its head in total,
    then is closed; while `crowded()`, or the heads held pass MAX_HEADS_HELD
    bytes, the connection waiting longest is closed for newcomers. Closing
    connections are seen out here too (see_out), without a thread."""

    def __init__(self, ready, close, crowded):
        self.ready, self.close, self.crowded = ready, close, crowded
        self.held = 0  # bytes of the heads read so far
        self._selector = selectors.DefaultSelector()
        self._waiting = collections.OrderedDict()  # Connection -> None, oldest deadline first
        self._closing = collections.OrderedDict()  # the same, for connections seen out
        self._incoming = collections.deque()  # admitted by other threads, not yet watched
        self._wake, self._waker = socket.socketpair()
        for sock in (self._wake, self._waker):
            sock.setblocking(False)
        self._selector.register(self._wake, selectors.EVENT_READ)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="waiting-room", daemon=True)

    def start(self):
        self._thread.start()

    def admit(self, connection):
        """Hold `connection` until its next head is in (from any thread)."""
        connection.deadline = time.monotonic() + CLIENT_TIMEOUT
        self._incoming.append(connection)
        self._wake_up()

    def see_out(self, connection):
        """Close `connection` (its answer sent, its write side shut) once the
        caller has stopped sending, or after LINGER_SECONDS or MAX_KEYS_BODY
        bytes: what it still sends is read and dropped, as closing with unread
        bytes would reset the connection and lose an answer sent before its
        request was read to the end (a refused head, an oversized body)."""
        connection.deadline = time.monotonic() + LINGER_SECONDS
        connection.pending, connection.closing = bytearray(), MAX_KEYS_BODY
        self._incoming.append(connection)
        self._wake_up()

    def stop(self):
        self._running = False
        self._wake_up()
        if self._thread.is_alive():
            self._thread.join(5)
        for connection in list(self._waiting) + list(self._closing) + list(self._incoming):
            connection.sock.close()
        self._selector.close()
        self._wake.close()
        self._waker.close()

    def _wake_up(self):
        try:
            self._waker.send(b"\0")
        except OSError:
            pass  # full: a wake-up is pending anyway

    def _run(self):
        while self._running:
            for key, _ in self._selector.select(1.0):
                if key.data is None:
                    while self._drain():
                        pass
                else:
                    self._receive(key.data)
            while self._incoming:
                self._watch(self._incoming.popleft())
            now = time.monotonic()
            while self._closing and next(iter(self._closing)).deadline <= now:
                self._drop(next(iter(self._closing)))
            while self._waiting and (next(iter(self._waiting)).deadline <= now or
                                     self.crowded() or self.held > MAX_HEADS_HELD):
                self._drop(next(iter(self._waiting)))

    def _drain(self):
        try:
            return self._wake.recv(4096)
        except OSError:
            return b""

    def _watch(self, connection):
        try:
            connection.sock.setblocking(False)
            self._selector.register(connection.sock, selectors.EVENT_READ, connection)
        except (OSError, ValueError):  # closed meanwhile: nothing to watch
            self.close(connection)
            return
        (self._waiting if connection.closing is None else self._closing)[connection] = None
        self.held += len(connection.pending)

    def _unwatch(self, connection):
        del (self._waiting if connection.closing is None else self._closing)[connection]
        self._selector.unregister(connection.sock)
        self.held -= len(connection.pending)

    def _drop(self, connection):
        self._unwatch(connection)
        self.close(connection)

    def _receive(self, connection):
        if connection.closing is not None:
            self._drop_what_comes(connection)
            return
        try:
            data = connection.sock.recv(min(SMALL_BODY, MAX_HEAD + SMALL_BODY + 1 -
                                            len(connection.pending)))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""  # reset: nothing left to answer
            self.held -= len(connection.pending)
            connection.pending = bytearray()
        if data:
            connection.pending += data
            self.held += len(data)
            if not connection.request_arrived():
                return
        if not connection.pending:  # closed between requests
            self._drop(connection)
            return
        self._unwatch(connection)
        self.ready(connection)  # a head, or the end of a cut-off one

    def _drop_what_comes(self, connection):
        try:
            data = connection.sock.recv(SMALL_BODY)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        connection.closing -= len(data)
        if not data or connection.closing <= 0:
            self._drop(connection)


def raise_open_files_limit(wanted=OPEN_FILES_WANTED):
    """Raise the soft limit on open files towards `wanted` (within the hard
    limit): each waiting connection holds one. Returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (wanted, 10240, 4096):  # macOS refuses more than its OPEN_MAX
        if hard != resource.RLIM_INFINITY:
            target = min(target, hard)
        if soft == resource.RLIM_INFINITY or soft >= target:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            continue
    return soft


def listen_family(host):
    """AF_INET, or AF_INET6 for a host with only IPv6 addresses (`::1`, `::`)."""
    families = {info[0] for info in socket.getaddrinfo(host, None, 0, socket.SOCK_STREAM, 0,
                                                       socket.AI_PASSIVE)}
    return socket.AF_INET if socket.AF_INET in families or not families else socket.AF_INET6


def bound_socket(host, port):
    """The server's TCP socket, bound to (host, port) and not listening yet
    (serve binds before it loads the store: a start failing on a busy port
    leaves no store behind). Set up as HTTPServer's (SO_REUSEADDR); an IPv6
    socket takes IPv4 callers too where the system allows it (`--host ::` is
    then every address of both families)."""
    family = listen_family(host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            try:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            except (AttributeError, OSError):
                pass  # IPv6 only, as the system has it
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


class KeysServer(http.server.HTTPServer):
    """http.server's HTTPServer, with what socketserver does with a
    connection overridden: `process_request` (a new one) and
    `shutdown_request` (one whose request was answered) hand it to the
    waiting room until its next head is in; then one of at most
    `max_connections` threads serves it (`finish_request`, as socketserver
    does), the others waiting their turn in order; a connection that is not
    kept alive is seen out by the waiting room too. So idle keep-alive
    connections, slow heads and closing connections hold no thread, and a
    newcomer is served while thousands of them are open; past `max_open`
    connections the one waiting longest is closed. (ThreadingMixIn's thread
    for each connection is what this replaces.)
    It serves on `sock`, a bound_socket already listening, which the
    processes of `serve --workers` share: each has a KeysServer of its own
    on it."""

    request_queue_size = 1024  # the listen backlog: socketserver's 5 refuses a burst of callers
    # An optimization, measured: a thread with nothing to serve waits this long
    # for a next connection before it ends; starting a thread for each new
    # connection cost ~200 µs of CPU a request (~300 -> ~550 µs for a /health).
    thread_idle_seconds = 5.0

    def __init__(self, sock, service, max_connections=512, max_open=1000):
        socketserver.BaseServer.__init__(self, sock.getsockname(), KeysHandler)
        self.socket, self.address_family = sock, sock.family
        self.service = service
        self.max_threads, self.max_open = max(1, max_connections), max_open
        self.open = self._threads = self._idle_threads = 0
        self._ready = collections.deque()  # connections whose head is in, first come first
        self._lock = threading.Condition()  # over all of these counts; notified when one is ready
        self.waiting_room = WaitingRoom(self._head_in, lambda c: self._close(c.sock),
                                        lambda: self.open > self.max_open)

    def serve_forever(self, poll_interval=0.5):
        self.waiting_room.start()
        super().serve_forever(poll_interval)

    def server_close(self):
        super().server_close()
        self.waiting_room.stop()

    def process_request(self, request, client_address):
        """socketserver's hook for a new connection: it waits for its first
        head in the waiting room, like any other."""
        with self._lock:
            self.open += 1
        try:
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        self.waiting_room.admit(Connection(request, client_address))

    def _head_in(self, connection):
        """Serve `connection` on an idle thread, or a new one while there are
        fewer than max_threads; else a running one takes it in its turn."""
        with self._lock:
            self._ready.append(connection)
            start = len(self._ready) > self._idle_threads and self._threads < self.max_threads
            if start:
                self._threads += 1
            self._lock.notify()
        if start:
            try:
                threading.Thread(target=self._serve_ready, daemon=True).start()
            except RuntimeError:  # no thread to be had: the running ones take it
                with self._lock:
                    self._threads -= 1

    def _serve_ready(self):
        """A serving thread: connections whose head is in, until none has come
        for thread_idle_seconds; each served on while its next request comes
        at once and nobody else waits (_next_request_in)."""
        while True:
            with self._lock:
                while not self._ready:
                    self._idle_threads += 1
                    woken = self._lock.wait(self.thread_idle_seconds)
                    self._idle_threads -= 1
                    if not woken and not self._ready:
                        self._threads -= 1
                        return
                connection = self._ready.popleft()
            while True:
                try:
                    self.finish_request(connection, connection.address)
                except Exception:
                    self.handle_error(connection, connection.address)
                    connection.keep = False
                if not self._next_request_in(connection):
                    break
            self.shutdown_request(connection)

    def _next_request_in(self, connection):
        """Is the next request of `connection` (kept alive) in, within
        NEXT_REQUEST_WAIT, while nobody else waits? Then the thread that
        served it serves on, as http.server's own loop would: no trip
        through the waiting room nor the queue's lock."""
        if not connection.keep or self._ready:
            return False
        if not connection.request_arrived():
            self._next_request_soon(connection)
        return connection.keep and connection.request_arrived()

    def shutdown_request(self, request):
        """socketserver's hook once a connection's turn is over: kept alive,
        it waits in turn if its next head is in, else in the waiting room;
        otherwise the waiting room sees it out."""
        connection = request if isinstance(request, Connection) else Connection(request, None)
        connection.close_streams()
        if not connection.keep:
            try:
                connection.sock.shutdown(socket.SHUT_WR)
            except OSError:  # gone already
                self._close(connection.sock)
            else:
                self.waiting_room.see_out(connection)
        elif connection.request_arrived():
            with self._lock:  # taken in turn, after those already waiting
                self._ready.append(connection)
        else:
            self.waiting_room.admit(connection)

    @staticmethod
    def _next_request_soon(connection):
        """Read what comes within NEXT_REQUEST_WAIT: a keep-alive caller sends
        its next request right away more often than not, and serving it here
        saves the trip through the waiting room to another thread."""
        sock = connection.sock
        try:  # waited for apart: changing the socket's timeout costs a system call
            if not _readable(sock, NEXT_REQUEST_WAIT):
                return  # the waiting room will see what comes
            data = sock.recv(SMALL_BODY)
        except (OSError, ValueError):  # (ValueError: select() past descriptor 1023)
            return
        if not data:
            connection.keep = False  # closed by the caller
        connection.pending += data

    def _close(self, sock):
        self.close_request(sock)
        with self._lock:
            self.open -= 1

    def handle_error(self, request, client_address):
        self.service.log("searchkeys: internal error: %s" % printable(
            repr(sys.exc_info()[1])))


# =============================================================================
# Service: route -> Gate -> the route's handler (the /keys API, or decide -> forward)
# =============================================================================


class Service:
    """The server's request pipeline, pure of sockets: `handle(request)`
    returns the Response; every refusal is upstream's JSON error."""

    def __init__(self, store, master_key, upstream=None, log=None, limits=None, metrics=None,
                 metrics_token=None):
        self.store = store
        self.guard = Guard(store, master_key)
        self.keys_api = KeysApi(store)
        self.keys_page = KeysPage(self, master_key)
        self.gate = Gate(self.guard, limits)
        self.upstream = upstream
        self.log = log or (lambda message: None)
        self.metrics = metrics or Metrics()
        self.metrics_token = metrics_token  # bytes: --metrics-token-file's token, or None
        self.settings = SettingsCache()  # index settings the guard checks against

    def handle(self, request):
        reason = None
        try:
            response = self.dispatch(request)
        except ApiError as error:
            response = Response.error(error, getattr(error, "headers", ()))
            reason = error.reason
            request.key = request.key or error.key
        except BrokenBody as exc:
            response = Response.error(bad_request("The request body is malformed: %s." % exc))
        except Exception as exc:  # a bug: answer 500, never a traceback
            self.log("searchkeys: internal error on %s %s: %s: %s" % (
                printable(request.method), safe_path(request.target), type(exc).__name__, exc))
            response = Response.error(internal_error("An internal error occurred."))
        if request.place is not None:  # held until the answer has gone
            if response.stream is None:
                request.place.leave()
            else:
                response.stream = LeavingStream(response.stream, request.place)
        if request.headers.get("Origin") and not any(
                name.lower() == "access-control-allow-origin" for name, _ in response.headers):
            response.headers.append(("Access-Control-Allow-Origin", "*"))
        self.metrics.count(request.family, response.status, reason)
        if reason == "expiry" and request.key is not None:
            self.metrics.expired_key_used(request.key.uid)
        if request.key is not None:
            self.store.usage.count(request.key.uid, reason, time.time_ns(),
                                   from_browser(request.headers))
        return response

    def dispatch(self, request):
        """Route, authenticate, then the route's handler answers, stores or forwards."""
        method = request.method
        if method == "OPTIONS" and request.headers.get("Access-Control-Request-Method"):
            return Response(200, _preflight_headers(request.headers))
        found = match_route(method, path_segments(origin_form(request.target)))
        if found is None:
            return Response(404)
        if found == "method":
            return Response(405)
        route, index, params = found
        request.family = route.family
        principal = self.gate.check(request, route.actions, index, route.people,
                                    route.master_only) if route.gated else OPEN
        return route.handler(self, Call(request, route, index, params, principal))

    def forward(self, call):
        """Send the backend what `decide` makes of the request, once `enforce`
        has run its checks and fetched the backend's facts it needs (which
        indexes the key covers, a task's index); relay the answer."""
        request, decision, upstream = call.request, call.decision, self.upstream
        value, query, facts = self.enforce(call, request.query, forwarding=True)
        context = RuleContext(call.principal, call.params, query, facts)
        for step in decision.query_steps:
            query = step.apply(query, context)
        method = call.route.method
        target = request.target if query == request.query else \
            request.path + ("?" + query if query else "")
        answer_filter = None if decision.answer_filter is None else \
            functools.partial(decision.answer_filter, context)
        self.gate.charge(request, call.principal,
                         decision.searches(value) if decision.searches is not None else 1)
        if decision.concurrent is not None:
            self.gate.enter(request, call.principal, decision.concurrent)
        headers = upstream.headers_for(request.headers.items(), answer_filter is None)
        if decision.fetches_document:
            method = "POST"
            target = "/indexes/%s/documents/fetch" % urllib.parse.quote(call.index, safe="")
            headers = _kept_headers(headers, {"content-type", "content-encoding"}) + [
                ("Content-Type", "application/json")]
        if decision.needs_body:
            body = compact_json(value).encode()
        else:
            body = self.caller_body(request.body, headers)
        return upstream.forward(method, target, headers, body, call.route.repeatable,
                                answer_filter)

    def enforce(self, call, query, forwarding):
        """The decision's checks, in the one order both edges keep (so that
        forwarding and `GET /authorize` give a request the same answer):
        1. its refusal;
        2. the request itself, pure: forwarding runs its value steps (they
           rewrite the search value or refuse it); /authorize checks nginx
           may forward it as sent (Decision.check_unchanged);
        3. the backend's facts: the index exists (for a caller who may not
           create it), the indexes searched join no documents the principal
           may not see whole, then the facts the other steps need;
        4. forwarding runs its fact steps.
        `query`: the query string of the request judged. Returns the search
        value and query string to forward, and the facts."""
        decision, upstream = call.decision, self.upstream
        if decision.refusal is not None:
            raise decision.refusal
        if forwarding:
            if decision.fetches_document:
                value = fetch_one_document(call.params["document_id"], query)
            else:
                value = call.json if decision.needs_body else None
            value, query = decision.rewrite(value, query, decision.value_steps)
            if upstream is None:
                raise no_upstream()
        else:
            decision.check_unchanged(call.route, call.principal, call.params, query)
            value = None
        if decision.needs_existing_index:
            if upstream is None:
                raise refused("action", invalid_api_key(
                    "This API key may not create indexes, and searchkeys runs without "
                    "--upstream, so it cannot check that the index `%s` exists; the request "
                    "is refused." % call.index))
            check_index_exists(upstream, call.index, 404 if forwarding else 403)
        if decision.checks_joins:
            # (/authorize never reads the body naming a multi-search's indexes)
            if upstream is None or call.index is None and not forwarding:
                raise scope_not_enforceable(call.route, "without --upstream, which it needs "
                                            "to see whether the index joins others "
                                            "(foreignKeys)")
            check_joins(call.principal, fetch_joins(upstream, searched_indexes(call),
                                                    self.settings))
        facts = fetch_facts(upstream, call, decision.facts, self.settings)
        if forwarding:
            value, query = decision.rewrite(value, query, decision.fact_steps, facts)
        return value, query, facts

    @staticmethod
    def caller_body(body, headers):
        """The caller's body to send on: bytes when small, else its chunks
        as they arrive (with its length when it announced one)."""
        if body.finished:
            return b""
        if body.size_known and body.remaining <= SMALL_BODY:
            return body.read(SMALL_BODY)
        if body.size_known:
            headers.append(("Content-Length", str(body.remaining)))
        return body.chunks()

    def answer_authorize(self, call):
        """nginx auth_request: 204 when the original request is allowed as it
        is. nginx relays no body of a refusal: its JSON error also rides in the
        header X-Searchkeys-Error (ASCII JSON), for the recipe to answer it."""
        try:
            return self._authorize(call.request)
        except ApiError as error:
            error.headers = list(getattr(error, "headers", ())) + [
                ("X-Searchkeys-Error", error_header(error))]
            raise

    def _authorize(self, request):
        uri = request.headers.get("X-Original-URI")
        if not uri:
            raise bad_request("`GET /authorize` needs the `X-Original-URI` header (and "
                              "`X-Original-Method`) of the request to authorize.")
        method = (request.headers.get("X-Original-Method") or "").strip().upper()
        if not method:  # judged as a GET, a POST adding documents would pass as a read
            raise bad_request("`GET /authorize` needs the `X-Original-Method` header (and "
                              "`X-Original-URI`) of the request to authorize.")
        found = match_route(method, path_segments(origin_form(uri)))
        if found is None or found == "method":
            raise ApiError(403, "unknown_route", "`%s %s` is not a Meilisearch route."
                           % (printable(method), safe_path(uri)), "auth")
        route, index, params = found
        principal = self.gate.check(request, route.actions, index)
        forged = next((name for name, _ in request.headers.items()
                       if name.lower().startswith(NETWORK_HEADER_PREFIXES)), None)
        if forged is not None:  # the guard drops them; nginx would send them with its key
            raise refused("action", invalid_api_key(
                "The request carries `%s`, one of the headers Meilisearch believes only from "
                "its network peers; it is refused." % printable(forged[:100])))
        if route.handler is not Service.forward:  # nginx would send it on with the backend's key
            raise ApiError(403, "unknown_route", "`%s %s` is answered by searchkeys itself, "
                           "never by Meilisearch: route it to searchkeys, not through "
                           "`GET /authorize`." % (route.method, route.pattern), "auth")
        self.enforce(Call(request, route, index, params, principal), uri.partition("?")[2],
                     forwarding=False)
        return Response(204, authorize_headers(principal))

    def answer_health(self, call):
        return Response.json(200, {"status": "available"})

    def answer_metrics(self, call):
        """GET /metrics, this server's: for the token of --metrics-token-file,
        the master key, or a key granting `metrics.get` (Meilisearch's right
        to its own /metrics)."""
        request, token = call.request, self.metrics_token
        scheme, _, given = (request.headers.get("Authorization") or "").partition(" ")
        if token is None or scheme != "Bearer" or not hmac.compare_digest(
                given.encode("utf-8", "replace"), token):
            self.gate.check(request, call.route.actions, None)
        text = self.metrics.render(len(self.store), len(self.gate.counters), len(
            self.store.expiring(EXPIRY_WARNING_DAYS * DAY_NS, time.time_ns())),
            self.store.history.failures)
        return Response(200, [("Content-Type", PROMETHEUS_TEXT)], text.encode())


MAX_ERROR_HEADER = 1024  # bytes of X-Searchkeys-Error: nginx's header buffer is 4 KiB


def error_header(error):
    """An error's JSON as one header value: ASCII (JSON escapes the rest),
    its message shortened to fit MAX_ERROR_HEADER (a key with many index
    patterns names them all)."""
    value = error.to_json()
    text = json.dumps(value)
    while len(text) > MAX_ERROR_HEADER:
        value["message"] = value["message"][:len(value["message"]) - (
            len(text) - MAX_ERROR_HEADER) - 3] + "..."
        text = json.dumps(value)
    return text


class Call:
    """One request on its way from the handler to the answer: the Request,
    its route, index and path parameters, the principal it acts for, the
    decision for them (made once), and its JSON body (read and parsed once,
    when the decision needs it)."""

    __slots__ = ("request", "route", "index", "params", "principal", "_decision", "_json")

    def __init__(self, request, route, index, params, principal):
        self.request, self.route, self.index = request, route, index
        self.params, self.principal = params, principal
        self._decision = self._json = None

    @property
    def decision(self):
        if self._decision is None:
            self._decision = decide(self.route, self.principal, self.index)
        return self._decision

    @property
    def json(self):
        if self._json is None:
            self._json = (parse_json_body(self.request.body.read(MAX_HANDLER_BODY)),)
        return self._json[0]


def _preflight_headers(headers):
    """CORS preflight, as upstream's permissive actix-cors answers it."""
    answer = [("Access-Control-Allow-Origin", "*"),
              ("Access-Control-Allow-Methods", headers.get("Access-Control-Request-Method", "")),
              ("Access-Control-Max-Age", "86400")]
    wanted = headers.get("Access-Control-Request-Headers")
    if wanted:
        answer.append(("Access-Control-Allow-Headers", wanted))
    return answer


def printable(text):
    """`text` safe to print on one log line: controls and non-ASCII escaped."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(c if " " <= c <= "~" else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def safe_path(raw):
    """The path for logs: normalized, no query string, no segment that may
    be a secret (a key value after /keys/, or any long token), and escaped
    (a decoded `%0A` must not start a forged log line)."""
    segments = list(path_segments(raw))
    for i, segment in enumerate(segments):
        after_keys = i > 0 and segments[i - 1] == "keys"
        if (after_keys or len(segment) >= 32) and not _CANONICAL_UUID_RE.match(segment.lower()):
            segments[i] = "<hidden>"
    return printable("/" + "/".join(segments))


# =============================================================================
# Routes: one record per route, holding its handler, and how a path finds it
# =============================================================================

QUERY, BODY = "query", "body"  # where a route's search parameters live: its carrier


def count_queries(body):
    """The searches a multi-search body runs (federated or not): one a query."""
    queries = body.get("queries") if isinstance(body, dict) else None
    return len(queries) if isinstance(queries, list) else 1


class Route(collections.namedtuple(
        "Route", "method pattern actions handler rule hits searches repeatable creates_index "
                 "forced carrier family gated joins people master_only one_document")):
    """One route:
    - `actions`: what a credential must hold (PUBLIC: nothing);
    - `handler(service, call)`: who answers (Service.forward: the backend);
    - `rule`: the handler rule holding a scoped principal to its indexes;
    - `hits(value, cap)`: caps the hits its search value asks for (the key's
      maxHitsPerQuery), None when it asks for none;
    - `searches(body)`: how many searches its body runs (rate limits); None: one;
    - `repeatable`: safe to send twice (GETs and read-only POSTs);
    - `creates_index`: creates its missing index when the caller may create
      indexes (upstream's allow_index_creation; the settings deletions pass it
      too, and the guard does not rely on Meilisearch's scheduler dropping it);
    - `forced(restrictions, index, value)`: the key's forcedParameters applied
      to its search value, or REFUSED_WHEN_FORCED, or None: they do not apply;
    - `carrier`: where its search value lives, QUERY (a GET's query string)
      or BODY (its JSON body);
    - `family`: what /metrics counts it under;
    - `gated`: the Gate checks its credential before the handler (/metrics
      checks its own: its token may stand in);
    - `joins`: it searches documents, whose hits may carry documents of the
      indexes the searched one joins (check_joins);
    - `people`: a page for people (the keys page): the master key alone
      opens it, given as HTTP Basic's password (any user name) or as Bearer,
      and from a browser, the one place where browser_refusal does not keep
      it out; anything else gets 401 with a Basic challenge (Gate.check);
    - `master_only`: what only the master key may do on it, the words of
      the 403 any API key holding its actions gets (Gate.check), or None;
    - `one_document`: it reads the one document its path's `document_id`
      names: under a filter, or for a tenant token, the backend is asked for
      it by a documents fetch (Decision.fetches_document)."""

    def __new__(cls, method, pattern, actions, handler=None, rule=None, hits=None,
                searches=None, repeatable=None, creates_index=False, forced=None, gated=True,
                joins=False, people=False, master_only=None, one_document=False):
        repeatable = method == "GET" if repeatable is None else repeatable
        handler = handler or Service.forward
        return super().__new__(cls, method, pattern, tuple(actions), handler, rule, hits,
                               searches, repeatable, creates_index, forced,
                               QUERY if method == "GET" else BODY,
                               route_family(pattern, handler is not Service.forward), gated,
                               joins, people, master_only, one_document)

    def scope_rule(self, principal, index):
        """The rule that holds `principal` to its indexes and filters on
        this route (None: the index check was enough)."""
        rule = self.rule
        return rule if rule is not None and rule.applies(principal, index) else None


def route_family(pattern, local):
    """The family /metrics counts a route's requests under, one of a small
    fixed set: search, multi-search, documents, settings, indexes, tasks,
    keys, authorize, health, metrics, other. `local`: searchkeys answers it."""
    parts = pattern.split("/")
    if local:
        return parts[1]  # keys, authorize, health, metrics
    if parts[1] == "indexes" and len(parts) > 3:
        return {"search": "search", "similar": "search", "facet-search": "search",
                "documents": "documents", "settings": "settings"}.get(parts[3], "indexes")
    return {"multi-search": "multi-search", "indexes": "indexes", "swap-indexes": "indexes",
            "stats": "indexes", "tasks": "tasks", "batches": "tasks"}.get(parts[1], "other")


def _settings_routes():
    """The per-setting sub-routes: most are updated with PUT, five with PATCH."""
    put_names = (
        "filterable-attributes", "sortable-attributes", "displayed-attributes",
        "searchable-attributes", "stop-words", "non-separator-tokens", "separator-tokens",
        "dictionary", "synonyms", "distinct-attribute", "proximity-precision",
        "localized-attributes", "ranking-rules", "search-cutoff-ms", "facet-search",
        "prefix-search", "foreign-keys",
    )
    patch_names = ("typo-tolerance", "faceting", "pagination", "embedders", "chat")
    routes = []
    for names, verb in ((put_names, "PUT"), (patch_names, "PATCH")):
        for name in names:
            pattern = "/indexes/{index_uid}/settings/" + name
            routes += [Route("GET", pattern, ("settings.get",)),
                       Route(verb, pattern, ("settings.update",), creates_index=True,
                             forced=REFUSED_WHEN_FORCED if name == "embedders" else None),
                       Route("DELETE", pattern, ("settings.update",), creates_index=True)]
    return routes


def build_routes():
    """The routes of Meilisearch 1.50 (spec §8) and this server's own, one record
    each. Like actix, the first pattern matching a path wins (in table order);
    a method it lacks is a 405. "{index_uid}" segments are checked against the
    key's index patterns; other "{...}" segments match anything.
    Built once every handler and rule exists (called at the end of the
    file, so that this module reads in the order a request travels)."""
    restricting = "read or change the restrictions of a key"  # master_only, for three routes
    return tuple([
        Route("GET", "/health", PUBLIC, handler=Service.answer_health),
        Route("GET", "/authorize", PUBLIC, handler=Service.answer_authorize),
        Route("GET", "/", PUBLIC),
        Route("GET", "/version", ("version",)),
        Route("GET", "/stats", ("stats.get",), rule=Rule(
            SCOPED, answer=lambda c, a: filter_stats(c.principal, a, c.facts["covered_indexes"]),
            facts=("covered_indexes",))),
        Route("GET", "/keys", ("keys.get",), handler=on_keys_api(KeysApi.list_keys)),
        Route("POST", "/keys", ("keys.create",), handler=on_keys_api(KeysApi.create_key)),
        # before /keys/{key}: no key has these uids or values
        Route("GET", "/keys/history", ("keys.get",), handler=on_keys_api(KeysApi.history)),
        Route("GET", "/keys/deleted", ("keys.get",), handler=on_keys_api(KeysApi.deleted_keys)),
        Route("GET", "/keys/page", ("keys.get",), people=True,
              handler=lambda service, call: service.keys_page.show(call)),
        Route("POST", "/keys/page", ("keys.create", "keys.delete"), people=True,
              handler=lambda service, call: service.keys_page.change(call)),
        Route("GET", "/keys/{key}", ("keys.get",), handler=on_keys_api(KeysApi.get_key)),
        Route("PATCH", "/keys/{key}", ("keys.update",),
              handler=on_keys_api(KeysApi.update_key)),
        Route("DELETE", "/keys/{key}", ("keys.delete",),
              handler=on_keys_api(KeysApi.delete_key)),
        Route("GET", "/keys/{key}/restrictions", ("keys.get",), master_only=restricting,
              handler=on_keys_api(KeysApi.get_restrictions)),
        Route("PUT", "/keys/{key}/restrictions", ("keys.update",), master_only=restricting,
              handler=on_keys_api(KeysApi.put_restrictions)),
        Route("DELETE", "/keys/{key}/restrictions", ("keys.update",),
              master_only=restricting, handler=on_keys_api(KeysApi.delete_restrictions)),
        Route("POST", "/keys/{key}/rotate", ("keys.create", "keys.delete"),
              handler=on_keys_api(KeysApi.rotate_key)),
        Route("GET", "/keys/{key}/usage", ("keys.get",), master_only="read the usage of a key",
              handler=on_keys_api(KeysApi.key_usage)),
        Route("POST", "/keys/{key}/revoke-tokens", ("keys.update",),
              handler=on_keys_api(KeysApi.revoke_tokens)),
        Route("POST", "/keys/{key}/revoke-token", ("keys.update",),
              handler=on_keys_api(KeysApi.revoke_token)),
        Route("POST", "/keys/{key}/restore", ("keys.create",),
              master_only="restore a deleted key", handler=on_keys_api(KeysApi.restore_key)),
        Route("GET", "/indexes", ("indexes.get",), rule=Rule(
            SCOPED, query=_index_page_query, answer=_index_page_answer)),
        Route("POST", "/indexes", ("indexes.create",),
              rule=Rule(SCOPED, value=check_new_index_uid)),
        Route("GET", "/indexes/{index_uid}", ("indexes.get",)),
        Route("PATCH", "/indexes/{index_uid}", ("indexes.update",),
              rule=Rule(SCOPED, value=check_new_index_uid), forced=force_same_on_rename),
        Route("DELETE", "/indexes/{index_uid}", ("indexes.delete",)),
        Route("GET", "/indexes/{index_uid}/stats", ("stats.get",)),
        Route("POST", "/indexes/{index_uid}/fields", ("fields.post",)),
        Route("POST", "/indexes/{index_uid}/compact", ("indexes.compact",)),
        Route("GET", "/indexes/{index_uid}/search", ("search",), rule=SEARCH_RULE,
              hits=cap_search_object, forced=force_search_on(SEARCH_PARAMETERS), joins=True),
        Route("POST", "/indexes/{index_uid}/search", ("search",), rule=SEARCH_RULE,
              hits=cap_search_object, repeatable=True,
              forced=force_search_on(SEARCH_PARAMETERS), joins=True),
        Route("POST", "/indexes/{index_uid}/facet-search", ("search",), rule=SEARCH_RULE,
              repeatable=True, forced=force_facet_search, joins=True),
        Route("GET", "/indexes/{index_uid}/similar", ("search",), rule=SEARCH_RULE,
              hits=cap_search_object, forced=force_search_on(SIMILAR_PARAMETERS), joins=True),
        Route("POST", "/indexes/{index_uid}/similar", ("search",), rule=SEARCH_RULE,
              hits=cap_search_object, repeatable=True,
              forced=force_search_on(SIMILAR_PARAMETERS), joins=True),
        Route("GET", "/indexes/{index_uid}/documents", ("documents.get",), rule=SEARCH_RULE,
              forced=force_documents),
        Route("POST", "/indexes/{index_uid}/documents", ("documents.add",), creates_index=True),
        Route("PUT", "/indexes/{index_uid}/documents", ("documents.add",), creates_index=True),
        Route("DELETE", "/indexes/{index_uid}/documents", ("documents.delete",)),
        Route("POST", "/indexes/{index_uid}/documents/delete-batch", ("documents.delete",)),
        Route("POST", "/indexes/{index_uid}/documents/delete", ("documents.delete",)),
        Route("POST", "/indexes/{index_uid}/documents/edit", ("documents.*",)),
        Route("POST", "/indexes/{index_uid}/documents/fetch", ("documents.get",), repeatable=True,
              rule=SEARCH_RULE, forced=force_documents),
        Route("GET", "/indexes/{index_uid}/documents/{document_id}", ("documents.get",),
              rule=SEARCH_RULE, forced=force_documents, one_document=True),
        Route("DELETE", "/indexes/{index_uid}/documents/{document_id}", ("documents.delete",)),
        Route("GET", "/indexes/{index_uid}/settings", ("settings.get",)),
        Route("PATCH", "/indexes/{index_uid}/settings", ("settings.update",), creates_index=True,
              forced=refuse_embedders),
        Route("DELETE", "/indexes/{index_uid}/settings", ("settings.update",), creates_index=True),
    ] + _settings_routes() + [
        Route("POST", "/multi-search", ("search",), rule=Rule(SCOPED, value=scope_multi_search),
              hits=cap_multi_search, searches=count_queries, repeatable=True,
              forced=force_multi_search, joins=True),
        Route("POST", "/swap-indexes", ("indexes.swap",),
              rule=Rule(SCOPED, value=check_index_swap), forced=force_same_on_swap),
        Route("POST", "/render-template", ("settings.get", "documents.get"),
              rule=NOT_ENFORCEABLE_RULE, forced=REFUSED_WHEN_FORCED),
        Route("GET", "/tasks", ("tasks.get",), rule=TASK_LISTING_RULE),
        Route("DELETE", "/tasks", ("tasks.delete",), rule=Rule(
            SCOPED, query=_task_change_query("delete"), facts=("covered_indexes",))),
        Route("POST", "/tasks/cancel", ("tasks.cancel",), rule=Rule(
            SCOPED, query=_task_change_query("cancel"), facts=("covered_indexes",))),
        Route("POST", "/tasks/compact", ("tasks.compact",)),
        Route("GET", "/tasks/{task_id}", ("tasks.get",), rule=Rule(
            SCOPED, answer=lambda c, a: check_task_answer(c.principal, c.params["task_id"], a))),
        Route("GET", "/tasks/{task_id}/documents", ("tasks.get",), rule=Rule(
            SCOPED, query=_task_documents_query, facts=("task",)), forced=REFUSED_WHEN_FORCED),
        Route("GET", "/batches", ("tasks.get",), rule=TASK_LISTING_RULE),
        Route("GET", "/batches/{batch_id}", ("tasks.get",), rule=Rule(
            SCOPED, answer=lambda c, a: check_batch_answer(c.principal, c.params["batch_id"], a))),
        Route("POST", "/dumps", ("dumps.create",)),
        Route("POST", "/snapshots", ("snapshots.create",)),
        Route("GET", "/metrics", ("metrics.get",), handler=Service.answer_metrics,
              gated=False),
        Route("POST", "/logs/stream", ("metrics.get",), forced=REFUSED_WHEN_FORCED),
        Route("DELETE", "/logs/stream", ("metrics.get",)),
        Route("POST", "/logs/stderr", ("metrics.get",)),
        Route("GET", "/experimental-features", ("experimental.get",)),
        Route("PATCH", "/experimental-features", ("experimental.update",)),
        Route("POST", "/export", ("export",), forced=REFUSED_WHEN_FORCED),
        Route("GET", "/network", ("network.get",), forced=REFUSED_WHEN_FORCED),
        Route("PATCH", "/network", ("network.update",), forced=REFUSED_WHEN_FORCED),
        Route("POST", "/network/control", ("network.update",), forced=REFUSED_WHEN_FORCED),
        Route("GET", "/webhooks", ("webhooks.get",)),
        Route("POST", "/webhooks", ("webhooks.create",)),
        Route("GET", "/webhooks/{webhook_uuid}", ("webhooks.get",)),
        Route("PATCH", "/webhooks/{webhook_uuid}", ("webhooks.update",)),
        Route("DELETE", "/webhooks/{webhook_uuid}", ("webhooks.delete",)),
        Route("POST", "/dynamic-search-rules", ("dynamicSearchRules.get",)),
        Route("DELETE", "/dynamic-search-rules", ("dynamicSearchRules.delete",)),
        Route("GET", "/dynamic-search-rules/{rule_uid}", ("dynamicSearchRules.get",)),
        Route("PATCH", "/dynamic-search-rules/{rule_uid}", ("dynamicSearchRules.update",)),
        Route("DELETE", "/dynamic-search-rules/{rule_uid}", ("dynamicSearchRules.delete",)),
        Route("GET", "/chats", ("chats.get",)),
        Route("GET", "/chats/{workspace}", ("chats.get",)),
        Route("DELETE", "/chats/{workspace}", ("chats.delete",)),
        Route("GET", "/chats/{workspace}/settings", ("chatsSettings.get",)),
        Route("PATCH", "/chats/{workspace}/settings", ("chatsSettings.update",),
              forced=REFUSED_WHEN_FORCED),
        Route("DELETE", "/chats/{workspace}/settings", ("chatsSettings.update",)),
        Route("POST", "/chats/{workspace}/chat/completions", ("chatCompletions",),
              rule=NOT_ENFORCEABLE_RULE, forced=REFUSED_WHEN_FORCED),
    ])


def match_route(method, segments):
    """Find the route of a request path given as decoded segments (see
    path_segments).

    Returns (Route, index_uid, params) when the route exists, "method" when
    the path exists but not for this method, None when no route has the path.
    """
    for parts, methods in _ROUTES_BY_SHAPE.get(segments[:1] + (len(segments),), ()):
        params = _match_segments(parts, segments)
        if params is None:
            continue
        if method not in methods:
            return "method"
        return methods[method], params.get("index_uid"), params
    return None


def _match_segments(parts, segments):
    if len(parts) != len(segments):
        return None
    params = {}
    for want, got in zip(parts, segments):
        if want.startswith("{"):
            if not got:
                return None
            params[want[1:-1]] = got
        elif want != got:
            return None
    return params


def _routes_by_shape(routes):
    """(path parts, {method: Route}) of each pattern, grouped by (first
    segment, segment count), in table order: a request is matched against a
    handful of patterns, not all of them."""
    by_pattern = {}
    for route in routes:
        by_pattern.setdefault(route.pattern, {})[route.method] = route
    shapes = {}
    for pattern, methods in by_pattern.items():
        parts = tuple(pattern.split("/")[1:]) if pattern != "/" else ()
        shapes.setdefault(parts[:1] + (len(parts),), []).append((parts, methods))
    return shapes


def path_segments(raw_path):
    """Upstream's view of a request path: `//` merged, one trailing slash
    trimmed, then each segment percent-decoded (so `%2F` stays inside its
    segment). `/` is the empty tuple."""
    path = raw_path.split("?", 1)[0]
    if "//" in path:
        path = re.sub("/{2,}", "/", path)
    if path.endswith("/"):
        path = path[:-1]
    segments = path.split("/")[1:]
    if "%" in path:
        segments = [urllib.parse.unquote(s, errors="replace") for s in segments]
    return tuple(segments)


# =============================================================================
# Gate: client address -> brute-force throttle -> Guard -> admin credentials
# from browsers -> the key's restrictions (IPs, rates, referrers; searches at
# once, entered by the forwarding edge)
# =============================================================================


class Limits(collections.namedtuple("Limits", "trusted_proxies throttle max_clients")):
    """Server-wide settings of the Gate: trusted proxy ranges, the brute-force
    throttle (a Rate of failures, or None: off) and the counters' bound."""

    def __new__(cls, trusted_proxies=(), throttle=None, max_clients=100000):
        return super().__new__(cls, tuple(trusted_proxies), throttle, max_clients)


class TooManyRequests(ApiError):
    """429 with Retry-After and RateLimit-* headers (`headers`)."""

    def __init__(self, message, wait, rate):
        super().__init__(429, "too_many_requests", message)
        seconds = str(max(1, int(-(-wait // 1))))
        self.headers = [("Retry-After", seconds), ("RateLimit-Limit", str(rate.count)),
                        ("RateLimit-Remaining", "0"), ("RateLimit-Reset", seconds),
                        ("RateLimit-Policy", "%d;w=%d" % (rate.count, rate.window))]
        self.headers += NOT_CACHEABLE


class TooManySearches(ApiError):
    """429 for a key running its maxConcurrentSearches already (Meilisearch
    answers its own full search queue with this code, as a 503)."""

    def __init__(self, most):
        super().__init__(429, "too_many_search_requests", "Too many searches with this API key "
                         "at the same time: %d (its `maxConcurrentSearches` restriction). Retry "
                         "after 1s." % most, "system")
        self.headers = [("Retry-After", "1")] + NOT_CACHEABLE


def too_many_failures(wait, throttle):
    return refused("throttled", TooManyRequests(
        "Too many failed authentications from your address; retry later.", wait, throttle))


# An answer that depends on more than method, URI and credential (the client's
# address, its Origin, the time) must not be kept by nginx's decision cache.
NOT_CACHEABLE = [("Cache-Control", "no-store")]


# The refusal reason (see USAGE_REASONS) of each restriction.
RESTRICTION_REASONS = {"allowedIps": "ip", "allowedReferrers": "referrer", "rateLimit": "rate",
                       "maxHitsPerQuery": "hits", "forcedParameters": "forced",
                       "maxConcurrentSearches": "concurrency"}


def restriction_refused(field, what):
    """403 naming the restriction, never its settings."""
    error = ApiError(403, "forbidden_by_restriction", "This API key cannot be used %s (its "
                     "`%s` restriction)." % (what, field), "auth")
    error.headers = NOT_CACHEABLE
    return refused(RESTRICTION_REASONS[field], error)


def authorize_headers(principal):
    """Headers of /authorize's 204: not cacheable for a restricted key."""
    key = principal.key
    return NOT_CACHEABLE if key is not None and key.restrictions is not None else ()


BROWSER_SIGNALS = {"origin", "sec-fetch-mode", "referer"}  # headers browsers send, tools not


def from_browser(headers):
    """Does the request carry a browser's signals? (Any of BROWSER_SIGNALS,
    whatever its value: a header a client can forge counts against it.)"""
    return headers.has_any(BROWSER_SIGNALS)


def browser_refusal(principal, headers):
    """The refusal of an admin credential sent from a browser (admin keys
    belong on servers: meilisearch #2369), or None. Refused: the master key,
    and an API key holding any action beyond `search` unless its
    restrictions say `allowBrowser`; a tenant token only ever searches and
    reads documents, held to its rules."""
    if principal.rules is not None or not from_browser(headers):
        return None
    key = principal.key
    if key is None:
        if principal is not MASTER:
            return None
        what = "The master key"
    else:
        beyond = [action for action in key.actions if action != "search"]
        if not beyond or (key.restrictions is not None and key.restrictions.allow_browser):
            return None
        what = "This API key holds actions beyond `search` (%s): it" % backticked(beyond)
    error = ApiError(403, "api_key_not_for_browsers", "%s must not be used from a browser (the "
                     "request has an `Origin`, `Referer` or `Sec-Fetch-Mode` header). Keep admin "
                     "keys on servers; give browsers a key holding only `search`, or a tenant "
                     "token%s." % (what, "" if key is None else ", or mark this key "
                                   "`allowBrowser: true` with `PUT /keys/%s/restrictions` if a "
                                   "browser must use it" % key.uid), "auth")
    error.key, error.headers = key, NOT_CACHEABLE
    return refused("browser", error)


def basic_as_bearer(authorization):
    """A browser's `Basic base64(user:password)` as the `Bearer password`
    Guard.check reads (pages for people only: the API takes Bearer alone,
    so a browser's remembered Basic password never reaches it); anything
    else as it is."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "basic":
        return authorization
    try:
        user_and_password = base64.b64decode(given.strip(), validate=True).decode("utf-8")
    except ValueError:  # not base64, or not UTF-8
        return "Bearer "
    _, colon, password = user_and_password.partition(":")
    return "Bearer " + (password if colon else "")


def sign_in_refusal(reason, key):
    """A page for people's refusal of a credential (for `reason`, of `key`
    if it named one: usage and metrics count it): 401 with a Basic
    challenge, so that a browser asks for the master key."""
    refusal = ApiError(401, "master_key_required", "This page is for the master key: give it "
                       "as the password (any user name), or as `Authorization: Bearer`.", "auth")
    refusal.reason, refusal.key = reason, key
    refusal.headers = [("WWW-Authenticate", 'Basic realm="searchkeys", charset="UTF-8"')] + \
        NOT_CACHEABLE
    return refusal


class Gate:
    """Guard.check plus what restrictions add: callers over the brute-force
    throttle get 429 before their credential is looked at; an admin
    credential sent from a browser is refused (browser_refusal), but on a
    page for people (Route.people), which the master key alone opens; an
    authorized key's (or tenant token's parent key's) restrictions are then
    applied, and a search enters the key's places (`enter`, for
    Decision.concurrent)."""

    def __init__(self, guard, limits=None):
        self.guard = guard
        self.limits = limits or Limits()
        self.counters = Counters(self.limits.max_clients)
        self.failures = FailureCounts(self.limits.throttle, self.limits.max_clients)
        self.searching = Searching()

    def client(self, request):
        trusted = self.limits.trusted_proxies
        forwarded = None
        if trusted:
            forwarded = ",".join(request.headers.get_all("X-Forwarded-For") or ())
        return client_address(request.peer or "", forwarded, trusted)

    def check(self, request, actions, index, people=False, master_only=None):
        """The Principal, as Guard.check; raises its refusals, 403 for an
        address or referrer the key does not allow, 429 over a rate.
        `people`: the route is a page for people (Route.people): the master
        key only, as Bearer or Basic, from browsers too; else 401.
        `master_only`: what only the master key may do on the route
        (Route.master_only): any API key gets 403, once its own
        restrictions have been applied (and counted) as on any route."""
        throttle, address = self.limits.throttle, None
        if throttle is not None and actions:
            address = self.client(request)
            left = self.failures.throttled(counter_client(address))
            if left is not None:
                raise too_many_failures(left, throttle)
        authorization = request.headers.get("Authorization")
        try:
            principal = self.guard.check(basic_as_bearer(authorization) if people
                                         else authorization, actions, index)
        except ApiError as error:
            if error.reason is None:  # no key: none, an unknown one, a bad tenant token
                error.reason = "credential"
            if throttle is not None and actions and \
                    not self.failures.fail(counter_client(address)):
                raise too_many_failures(throttle.window, throttle)
            if people and error.code != "missing_master_key":  # (no master key: no page)
                raise sign_in_refusal(error.reason, error.key)
            raise
        key = request.key = principal.key
        if people:
            if principal is not MASTER:
                raise sign_in_refusal("action", key)
            return principal
        refusal = browser_refusal(principal, request.headers)
        if refusal is not None:
            raise refusal
        restrictions = key.restrictions if key is not None else None
        if restrictions is not None:
            self._hold(request, key, address)
        if master_only is not None:
            require_master(principal, master_only)
        return principal

    def _hold(self, request, key, address):
        """Raise the refusal of the key's restrictions on who sends it,
        from where and how often (counting the request against its rates)."""
        restrictions = key.restrictions
        if address is None:
            address = self.client(request)
        if restrictions.ips is not None and not in_ranges(address, restrictions.ips):
            raise restriction_refused("allowedIps", "from your address")
        self._take(self._rates(key, address))  # before the referrer check: a refusal counts
        if restrictions.referrers is not None and not referrer_allowed(
                restrictions.referrers, request.headers.get("Origin"),
                request.headers.get("Referer")):
            raise restriction_refused("allowedReferrers", "from this site")

    def charge(self, request, principal, searches):
        """Count a request's further searches (a multi-search runs one a
        query; `check` counted the first) against the key's rates: 429 over
        a rate, 403 when one request holds more than a rate allows."""
        key = principal.key
        if searches <= 1 or key is None or key.restrictions is None:
            return
        wanted = self._rates(key, self.client(request))
        if any(searches > rate.count for _, rate in wanted):
            raise restriction_refused("rateLimit", "for %d searches in one request" % searches)
        for _ in range(searches - 1):
            self._take(wanted)

    def enter(self, request, principal, most):
        """Take one of the `most` places the key has for searches at once
        (in this process), until the request's answer has gone (see
        Service.handle, which gives it back); 429 when all are taken."""
        uid = principal.key.uid
        if not self.searching.enter(uid, most):
            raise refused("concurrency", TooManySearches(most))
        request.place = Place(self.searching, uid)

    @staticmethod
    def _rates(key, address):
        """The (counter, Rate) pairs a request with `key` from `address` counts against."""
        restrictions, wanted = key.restrictions, []
        if restrictions.per_ip is not None:
            wanted.append(((key.uid, counter_client(address)), restrictions.per_ip))
        if restrictions.per_key is not None:
            wanted.append((key.uid, restrictions.per_key))
        return wanted

    def _take(self, wanted):
        refusal = self.counters.take(wanted) if wanted else None
        if refusal is not None:
            wait, rate = refusal
            raise refused("rate", TooManyRequests(
                "Too many requests with this API key (its `rateLimit` restriction); retry in "
                "%d seconds." % max(1, -(-wait // 1)), wait, rate))


# =============================================================================
# Authentication: Authorization header -> master key, API key or tenant token
# =============================================================================


def _visible_ascii(value):
    """The header as actix's `to_str()` sees it: empty unless visible ASCII."""
    if value is None:
        return None
    if value.isascii() and value.replace("\t", " ").isprintable():
        return value
    return ""


class Guard:
    """Decides whether a bearer credential may perform a route's actions."""

    def __init__(self, store, master_key):
        self.store = store
        self.master_key = master_key
        self._master_bytes = master_key.encode() if master_key is not None else None

    def check(self, authorization, actions, index):
        """The Principal allowed to perform `actions` on `index` (None on
        index-less routes); raises upstream's 401/403 ApiError otherwise."""
        if not actions:
            return OPEN  # public route: no header check at all
        header = _visible_ascii(authorization)
        if header is None:
            if self.master_key is not None:
                raise missing_authorization_header()
            return self._authenticate("", actions, index)  # open instance: all but /keys
        scheme, space, token = header.partition(" ")
        if scheme != "Bearer":
            raise missing_authorization_header()
        if not space:
            raise invalid_api_key()
        return self._authenticate(token, actions, index)

    def _authenticate(self, token, actions, index):
        principal = OPEN
        for action in actions:
            principal = self.policy(token, action, index)
        return principal

    def policy(self, token, action, index):
        """Upstream's ActionPolicy for one action: a Principal, or raises."""
        if self.master_key is None:  # no master key: everything but /keys is open
            if action in KEYS_ACTIONS:
                raise missing_master_key()
            return OPEN
        if hmac.compare_digest(self._master_bytes, token.encode()):
            return MASTER
        rules = None
        key = None
        if action in TENANT_TOKEN_ACTIONS and "." in token:  # API keys are plain hex
            try:
                claims = verify_tenant_token(token, self.store.derive)
            except NotATenantToken:
                pass
            except TenantTokenError as exc:
                raise invalid_api_key(str(exc))
            else:
                rules = claims["searchRules"]
                key = self.store.by_uid(claims["apiKeyUid"])
                if key is None:
                    raise invalid_api_key()
                revoked = key.revocation and key.revocation.refusal(claims, token,
                                                                    int(time.time()))
                if revoked:
                    revoked.key = key
                    raise revoked
        if rules is None:
            key = self.store.by_value(token)
            if key is None:
                raise invalid_api_key()
        refusal = authorize(key, action, index, tenant_rules=rules)
        if refusal is not None:
            refusal.key = key
            raise refusal
        return Principal(key, rules)


# =============================================================================
# Permission model (pure): expansion, index patterns, Principal, authorize
# =============================================================================


def expand(action):
    """The set of actions that holding `action` grants."""
    return frozenset(EXPANSIONS.get(action, (action,)))


@functools.lru_cache(maxsize=4096)
def grants(actions):
    """Everything a key with the tuple `actions` may do (cached: keys share shapes)."""
    granted = set()
    for action in actions:
        granted |= expand(action)
    return frozenset(granted)


_PATTERN_RE = re.compile(r"[A-Za-z0-9_-]{1,400}\*?\Z|\*\Z")


def is_valid_index_pattern(pattern):
    """`*`, or 1..400 ASCII alphanumerics/`-`/`_` with an optional trailing star."""
    return isinstance(pattern, str) and _PATTERN_RE.match(pattern) is not None


def pattern_matches(pattern, index):
    """Does index pattern `pattern` cover index uid `index`?"""
    if pattern.endswith("*"):
        return index.startswith(pattern[:-1])
    return pattern == index


_RUST_ESCAPES = {"\0": "\\0", "\t": "\\t", "\r": "\\r", "\n": "\\n", "\\": "\\\\",
                 '"': '\\"'}
# What Rust's char::escape_debug writes as \u{...}: the categories its
# is_printable leaves out (but the space), and grapheme extenders.
_RUST_UNPRINTABLE = frozenset(("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs", "Mn", "Me"))


def rust_debug_str(text):
    """A string the way Rust's `{:?}` prints it: quoted, with \\n, \\" and
    \\u{7f}-style escapes."""
    out = []
    for char in text:
        if char in _RUST_ESCAPES:
            out.append(_RUST_ESCAPES[char])
        elif char != " " and unicodedata.category(char) in _RUST_UNPRINTABLE:
            out.append("\\u{%x}" % ord(char))
        else:
            out.append(char)
    return '"%s"' % "".join(out)


def rust_debug_list(strings):
    """A list of strings the way Rust's `{:?}` prints a Vec<String>: ["a", "b"]."""
    return "[" + ", ".join(rust_debug_str(s) for s in strings) + "]"


def authorize(key, action, index=None, now_ns=None, tenant_rules=None):
    """May `key` perform `action` on `index` (None on index-less routes)?

    Returns None when allowed, else the ApiError upstream answers. Mirrors
    upstream's order: index checks (tenant token rules, then the key's
    patterns) come before the action and expiry checks. `tenant_rules` are
    the `searchRules` of a tenant token signed by `key`, if any.
    """
    if index is not None:
        refusal = Principal(key, tenant_rules).index_refusal(index)
        if refusal is not None:
            return refused("index", refusal)
    if action not in key.grants:
        return refused("action", invalid_api_key())
    if key.is_expired(now_ns):
        return refused("expiry", invalid_api_key())
    if key.is_global or index is not None:
        return None
    # An index-less route with an index-scoped key: only handler-checked
    # actions let it in (the route restricts what it sees).
    if action in HANDLER_CHECKED_ACTIONS and key.indexes:
        return None
    return refused("index", invalid_api_key())


class Principal:
    """Who an authorized request acts for: a key (None for the master key or
    an instance without one) and the searchRules of a tenant token, if any.
    The one owner of "may this credential touch this index" (upstream's
    AuthFilter::is_index_authorized): `authorize`, the handler rules and the
    listing filters all ask it."""

    __slots__ = ("key", "rules")

    def __init__(self, key=None, rules=None):
        self.key = key
        self.rules = rules

    @property
    def unscoped(self):
        return self.key is None or (self.key.is_global and self.rules is None)

    def index_refusal(self, index):
        """None when the credential covers `index`, else upstream's refusal
        (the token's rules are checked before its parent key's patterns).
        "acces" is Meilisearch's own spelling in these three messages
        (meilisearch/src/extractors/authentication/error.rs): clients and
        tests match them byte for byte."""
        key, rules = self.key, self.rules
        if key is None:
            return None
        if rules is not None and not search_rules_allow(rules, index):
            return invalid_api_key(
                "The provided tenant token cannot acces the index `%s`, allowed indexes "
                "are %s." % (index, rust_debug_list(sorted(set(rules)))))
        if any(pattern_matches(p, index) for p in key.indexes):
            return None
        if rules is not None:
            return invalid_api_key("The API key used to generate this tenant token cannot "
                                   "acces the index `%s`." % index)
        return invalid_api_key("The API key cannot acces the index `%s`, authorized indexes "
                               "are %s." % (index, rust_debug_list(sorted(set(key.indexes)))))

    def may_use_index(self, index):
        return self.index_refusal(index) is None

    def may_create_index(self, index):
        """Upstream's allow_index_creation: may a write that finds no index
        `index` create it? Only when the key grants indexes.create and
        covers `index` (the master key always may)."""
        return self.key is None or authorize(self.key, "indexes.create", index,
                                             tenant_rules=self.rules) is None

    @property
    def restrictions(self):
        """The key's (or the token's parent key's) Restrictions, or None."""
        return self.key.restrictions if self.key is not None else None


OPEN = Principal()
MASTER = Principal()  # the master key: OPEN's rights, but a credential (see browser_refusal)


def search_rules_allow(rules, index):
    """Do a tenant token's `searchRules` (a list of index patterns, or an
    object keyed by them) name a pattern matching `index`?"""
    return any(pattern_matches(p, index) for p in rules)


def index_scoped_global_action(actions, indexes):
    """The first global action of a key scoped to some indexes, or None."""
    if not indexes or "*" in indexes:
        return None
    for action in actions:
        if action in GLOBAL_ACTIONS:
            return action
    return None


# =============================================================================
# Decision: what a principal's request on a route gets (pure), and the
# backend's facts it needs, fetched at the edge
# =============================================================================

# Why a Step is taken: the index scope of a key or tenant token (its
# handler rule), or the restriction field that asks for it.
SCOPE = "scope"


class Step(collections.namedtuple("Step", "why apply")):
    """One check or rewrite of what a request asks the backend: `why` is
    SCOPE or a restriction field. A value step's `apply(value)` returns the
    search value to forward; a query step's `apply(query, context)` the query
    string of a listing. Either raises its refusal."""


class Decision(collections.namedtuple(
        "Decision", "refusal needs_existing_index facts value_steps query_steps carrier "
                    "answer_filter searches checks_joins concurrent fetches_document "
                    "fact_steps")):
    """What a principal's request on a route and index gets, before anything
    of the request but its route is read:
    - `refusal`: an ApiError, or None;
    - `needs_existing_index`: the index must already exist (the caller may
      not create it, the backend's key may);
    - `facts`: the backend's facts its query steps and answer filter need
      (names, see fetch_facts);
    - `value_steps`: Steps on its search value, which lives in its `carrier`
      (BODY: the JSON body; QUERY: a GET's query string, parsed once);
    - `query_steps`: Steps on a listing's query string;
    - `answer_filter(context, answer)`: rewrites a 200 JSON answer, or None;
    - `searches(body)`: the searches a body runs, for the key's rate
      limits, or None (one);
    - `checks_joins`: the indexes searched (or read under a filter: the
      caller's, a token's, a forced one) must not
      join (Meilisearch's foreignKeys) documents the principal may not see
      whole (check_joins);
    - `concurrent`: the searches the key may run at once (its
      maxConcurrentSearches), this one holding a place until its answer
      has gone, or None;
    - `fetches_document`: a GET of one document under a filter (a tenant
      token's, forced parameters') or by any tenant token (its fields cut,
      see fact_steps): the backend is asked for it by a
      documents fetch of its id (carrier BODY, the value from
      fetch_one_document), so that it answers only a document that passes,
      and `answer_filter` makes the answer the document, or Meilisearch's
      own 404 as if it were missing;
    - `fact_steps`: Steps on its search value that read the backend's
      `facts` (`apply(value, facts)`), run once those are fetched: a tenant
      token's documents read cut to what a search shows (show_displayed)."""

    @property
    def needs_body(self):
        return bool(self.value_steps or self.fact_steps) and self.carrier == BODY \
            or self.searches is not None

    def rewrite(self, value, query, steps, *facts):
        """The search value and query string to forward once `steps` (the
        value steps, or the fact steps given the facts) ran on them: `value`
        is the JSON body's (carrier BODY) or None; a GET's value is read from
        its query string and written back to it."""
        if steps and self.carrier == QUERY:
            read = parse_search_query(query)
            value = dict(read[0])
        for step in steps:
            value = step.apply(value, *facts)
        if steps and self.carrier == QUERY:
            query = encode_search_query(query, read, value)
        return value, query

    def check_unchanged(self, route, principal, params, query):
        """For `GET /authorize`, which lets nginx forward the request as sent,
        without its body or answer: raise unless the decision allows it with
        nothing to read, fetch or rewrite (the steps on its query string may
        run: they must leave it as it is). Its refusal is raised before."""
        unseen = None
        if self.value_steps and self.carrier == BODY:
            unseen = self.value_steps[0].why
        elif self.searches is not None:
            unseen = "rateLimit"
        elif self.concurrent is not None:  # nginx never says when the answer has gone
            unseen = "maxConcurrentSearches"
        elif self.facts or self.answer_filter is not None:
            unseen = SCOPE
        elif self.value_steps:
            value = parse_search_query(query)[0]
            for step in self.value_steps:
                if step.apply(value) != value:
                    unseen = step.why
                    break
        context = RuleContext(principal, params, query, {})
        for step in () if unseen else self.query_steps:
            if step.apply(query, context) != query:
                unseen = step.why
                break
        if unseen is None:
            return
        if unseen == SCOPE:
            raise scope_not_enforceable(
                route, "through `GET /authorize`, which never sees the body nor the answer "
                "(use `searchkeys.py serve --upstream` for such keys)")
        raise restriction_refused(unseen, "through `GET /authorize` on this request, which "
                                  "it would have to read or rewrite (send it through "
                                  "`searchkeys.py serve --upstream`)")


def decide(route, principal, index):
    """The one decision of what `principal` (already allowed the route's
    actions on `index` by `authorize`) gets on `route`: pure, no I/O. Both
    the forwarding path and `GET /authorize` act on it."""
    rule = route.scope_rule(principal, index)
    restrictions = principal.restrictions
    refusal, facts, answer_filter, searches = None, (), None, None
    value_steps, query_steps = [], []
    if rule is not None:
        if rule.when == UNENFORCEABLE:
            refusal = scope_not_enforceable(route, "")
        facts, answer_filter = rule.facts, rule.answer
        if rule.value is not None:
            value_steps.append(Step(SCOPE, lambda value: rule.value(principal, index, value)))
        if rule.query is not None:
            query_steps.append(Step(SCOPE, lambda query, context: rule.query(
                context._replace(query=query))))
    forcing = route.forced
    if forcing is not None and restrictions is not None and restrictions.forced is not None:
        if forcing != REFUSED_WHEN_FORCED:
            value_steps.append(Step("forcedParameters", lambda value: forcing(
                restrictions, index, value)))
        elif index is None or forced_parameters(restrictions, index) is not None:
            refusal = refusal or restriction_refused(
                "forcedParameters", "on `%s %s`, which cannot apply its forced search "
                "parameters" % (route.method, route.pattern))
    cap = restrictions.max_hits if restrictions is not None else None
    if cap is not None and route.hits is not None:
        value_steps.append(Step("maxHitsPerQuery", functools.partial(cap_hits, route, cap)))
    if route.searches is not None and restrictions is not None and restrictions.rated:
        searches = route.searches
    searching = route.joins  # the routes that run searches, whose hits may hydrate joins
    documents_read = route.forced is force_documents
    # a documents read held to a filter (a token's, a forced one), or a documents list or
    # fetch, whose caller's own filter may reach into joined documents (`_foreign(...)`):
    # checked for the same principals as a search
    held_read = documents_read and (
        rule is not None or documents_forced(restrictions, index) is not None)
    filtered_read = documents_read and not route.one_document
    checks_joins = held_read or (searching or filtered_read) and not (
        principal.unscoped and (restrictions is None or restrictions.forced is None))
    concurrent = restrictions.max_concurrent if searching and restrictions is not None else None
    # a tenant token's documents read shows what its searches would (issue 34), not every
    # field as Meilisearch's documents routes do
    token_read = documents_read and principal.rules is not None
    fact_steps = ()
    if token_read:
        facts = facts + ("displayed_attributes",)
        fact_steps = (Step(SCOPE, show_displayed),)
    fetches_document = route.one_document and (held_read or token_read)
    if fetches_document:
        answer_filter = one_document_answer
    return Decision(refusal, route.creates_index and not principal.may_create_index(index),
                    facts, tuple(value_steps), tuple(query_steps),
                    BODY if fetches_document else route.carrier, answer_filter, searches,
                    checks_joins, concurrent, fetches_document, fact_steps)


def check_joins(principal, joins):
    """Meilisearch's experimental foreignKeys put the whole document of a
    joined index into each hit (and `_foreign(...)` filters on it): `joins`
    ({index searched: the indexes it joins}, see fetch_joins) must name only
    indexes the principal covers with nothing to hold it to there (no forced
    parameters, no tenant-token filter): the guard applies neither to joined
    documents."""
    restrictions = principal.restrictions
    for index, joined in joins.items():
        for uid in joined:
            if uid is None or not principal.may_use_index(uid) or \
                    tenant_filter(principal.rules, uid) is not None or \
                    forced_parameters(restrictions, uid) is not None:
                raise refused("index", invalid_api_key(
                    "The index `%s` joins documents of another index (its `foreignKeys`) "
                    "that this API key may not see whole; the request is refused." % index))


def searched_indexes(call):
    """The indexes a search request searches: its path's, or its queries'."""
    if call.index is not None:
        return [call.index]
    queries = call.json.get("queries") if isinstance(call.json, dict) else None
    return sorted({q["indexUid"] for q in queries if isinstance(q, dict)
                   and isinstance(q.get("indexUid"), str)} if isinstance(queries, list) else ())


MAX_JOIN_LOOKUPS = 20  # distinct indexes whose foreignKeys one search request may need


def fetch_joins(upstream, indexes, cache):
    """{index: the indexes it joins} for the indexes a request searches: from
    `cache` (a SettingsCache) while fresh, else from the backend (joined_indexes)."""
    if len(indexes) > MAX_JOIN_LOOKUPS:  # one request must not make hundreds of the backend
        raise refused("index", invalid_api_key(
            "This API key may search at most %d indexes in one request (searchkeys looks at "
            "each one's `foreignKeys`); the request is refused." % MAX_JOIN_LOOKUPS))
    return {index: cache.setting(joined_indexes, upstream, index) for index in indexes}


def fetch_setting(upstream, index, setting):
    """The backend's (status, answer) to `GET /indexes/{index}/settings/
    {setting}` with the upstream key; its index_not_found relayed."""
    status, answer = upstream.fetch_json("/indexes/%s/settings/%s" % (
        urllib.parse.quote(index, safe=""), setting))
    if status == 404 and isinstance(answer, dict) and answer.get("code") == "index_not_found":
        raise index_not_found(index)
    return status, answer


def joined_indexes(upstream, index):
    """The uids of the indexes `index` joins, from its foreignKeys setting on
    the backend (None for an entry naming none). Its index_not_found is
    relayed; a backend without the route (another 404: an older
    Meilisearch) joins nothing; anything else but the setting (a list) fails
    closed (a --upstream-key without settings.get gets 403 here)."""
    status, answer = fetch_setting(upstream, index, "foreign-keys")
    if status == 404:
        return ()
    if status != 200 or not isinstance(answer, list):
        raise upstream_unreachable(upstream, "asking for the foreignKeys of index %s "
                                   "answered %s" % (index, status))
    uids = (foreign.get("foreignIndexUid") if isinstance(foreign, dict) else None
            for foreign in answer)
    return tuple(dict.fromkeys(uid if isinstance(uid, str) else None for uid in uids))


SETTINGS_FRESH_FOR = 0.25  # seconds an index's setting is reused, as STORE_POLL_SECONDS
MAX_CACHED_SETTINGS = 1024  # settings remembered at once; the whole cache is dropped when full
MAX_CACHED_SETTING_SIZE = 1024  # an entry's index uid and strings, plus 64 for each one's cost


class SettingsCache:
    """An optimization, isolated here: the index settings the guard checks
    against (an index's foreignKeys, see joined_indexes; its
    displayedAttributes, see displayed_attributes), as the backend answered
    them, reused for SETTINGS_FRESH_FOR seconds from the moment they were
    asked for, so that a scoped search or documents read does not cost one
    more backend round trip each time (bench/README.md, searchkeys round
    three). These checks were never atomic (a settings task may finish
    between the lookup and the forwarded request): this widens that window
    from one round trip to SETTINGS_FRESH_FOR, the time in which another
    `serve --workers` process learns of a deleted key. Only the setting is
    kept (a tuple of strings and Nones, or the () a backend without the
    route answers for foreignKeys); index_not_found and errors are raised,
    so asked again each time. Index uids are client text: an entry weighing
    more than MAX_CACHED_SETTING_SIZE is not kept, so the cache holds at most
    MAX_CACHED_SETTINGS entries of ~1 KiB (4 KiB were every character one of
    Python's widest). One per process; threads share it."""

    def __init__(self):
        # (reader, index uid) -> (monotonic time it expires, the setting it read)
        self._entries = {}
        self._lock = threading.Lock()

    def setting(self, read, upstream, index):
        """`read(upstream, index)`: an index's setting, from the backend
        unless this cache holds a fresh one."""
        asked = time.monotonic()
        entry = self._entries.get((read, index))  # one dict read: no lock
        if entry is not None and asked < entry[0]:
            return entry[1]
        value = read(upstream, index)
        if sum(64 + len(item or "") for item in (index,) + value) <= MAX_CACHED_SETTING_SIZE:
            with self._lock:
                if len(self._entries) >= MAX_CACHED_SETTINGS and \
                        (read, index) not in self._entries:
                    self._entries.clear()
                self._entries[(read, index)] = (asked + SETTINGS_FRESH_FOR, value)
        return value


def cap_hits(route, cap, value):
    """A search value asking for at most `cap` hits a query; a multi-search
    of more than MAX_CAPPED_QUERIES queries is refused."""
    if route.searches is not None and route.searches(value) > MAX_CAPPED_QUERIES:
        raise restriction_refused("maxHitsPerQuery", "for more than %d queries in one "
                                  "request" % MAX_CAPPED_QUERIES)
    return route.hits(value, cap)


def check_index_exists(upstream, index, missing_status):
    """A documents or settings write on a missing index creates it when the
    caller may create indexes (upstream's allow_index_creation). The backend
    gets our --upstream-key, which may: for a caller who may not, the index
    must exist already. Upstream would enqueue a task failing with
    `index_not_found`; the guard cannot enqueue, so it answers that error
    now (`missing_status`: 403 for /authorize, as nginx takes any other
    refusal for its own error).
    An index deleted between this check and the forward is still created:
    the backend offers no "write only if the index exists"."""
    try:
        fetch_or_refuse(upstream, "/indexes/" + urllib.parse.quote(index, safe=""),
                        "asking for index %s" % index)
    except ApiError as error:
        if error.status == 404:
            raise index_not_found(index, missing_status)
        raise


def fetch_facts(upstream, call, names, settings):
    """The backend's facts a decision's steps need ({name: value}), fetched
    once for the request: `covered_indexes`, the index objects the principal
    covers; `task`, the task of the path's task_id (its refusal relayed);
    `displayed_attributes`, the path index's (from `settings`, a
    SettingsCache)."""
    facts = {}
    if "covered_indexes" in names:
        status, answer = upstream.fetch_json("/indexes?offset=0&limit=%d" % ALL_INDEXES_LIMIT)
        if status != 200 or not isinstance(answer, dict):
            raise upstream_unreachable(upstream, "listing its indexes answered %s" % status)
        facts["covered_indexes"] = [
            i for i in answer.get("results", ()) if isinstance(i, dict)
            and isinstance(i.get("uid"), str) and call.principal.may_use_index(i["uid"])]
    if "task" in names:
        task_id = call.params["task_id"]
        facts["task"] = fetch_or_refuse(upstream, "/tasks/" + urllib.parse.quote(
            task_id, safe=""), "asking for task %s" % _uid_shown(task_id))
    if "displayed_attributes" in names:
        facts["displayed_attributes"] = settings.setting(displayed_attributes, upstream,
                                                         call.index)
    return facts


def displayed_attributes(upstream, index):
    """The attributes a search of `index` shows, from its displayedAttributes
    setting on the backend (`("*",)`: all). Its index_not_found is relayed;
    anything else but the setting (a list of strings) fails closed."""
    status, answer = fetch_setting(upstream, index, "displayed-attributes")
    if status != 200 or not isinstance(answer, list) or \
            not all(isinstance(name, str) for name in answer):
        raise upstream_unreachable(upstream, "asking for the displayedAttributes of index %s "
                                   "answered %s" % (index, status))
    return tuple(answer)


def _check_route_table(routes):
    """Index-scoped keys pass `authorize` on index-less routes of
    HANDLER_CHECKED_ACTIONS on the promise that the route's handler rule
    holds them to their indexes: every such route forwarded must have one."""
    for route in routes:
        if route.handler is Service.forward and "{index_uid}" not in route.pattern \
                and set(route.actions) & HANDLER_CHECKED_ACTIONS and route.rule is None:
            raise AssertionError("%s %s lets index-scoped keys in without a rule"
                                 % (route.method, route.pattern))


# =============================================================================
# Handler rules: what upstream's handlers check and filter for a scoped
# principal (an index-scoped key or a tenant token), and the hit caps of a
# key's maxHitsPerQuery. The backend gets our --upstream-key, not the
# caller's credential, so the guard applies them.
# =============================================================================

DEFAULT_SEARCH_LIMIT = 20  # Meilisearch's default `limit` and `hitsPerPage`


# The queries one multi-search of a key with maxHitsPerQuery may run (as Typesense's
# limit_multi_searches): one request asks for at most this many times the cap.
MAX_CAPPED_QUERIES = 20


def _capped(value, cap):
    """A requested count, capped; values that are not counts are left for
    the backend to refuse."""
    if type(value) is int and value > cap:
        return cap
    return value


def cap_search_object(query, cap):
    """A search query object (POST search/similar body, one multi-search
    query, a federation) asking for at most `cap` hits. Meilisearch pages by
    `hitsPerPage` when `page` or `hitsPerPage` is set (null is unset), else
    by `limit`: that count is capped (its default 20 made explicit when the
    cap is lower), and the other one too when it is given."""
    if not isinstance(query, dict):
        return query
    paged = query.get("page") is not None or query.get("hitsPerPage") is not None
    field, other = ("hitsPerPage", "limit") if paged else ("limit", "hitsPerPage")
    wanted = query.get(field)
    capped = {field: _capped(DEFAULT_SEARCH_LIMIT if wanted is None else wanted, cap)}
    if query.get(other) is not None:
        capped[other] = _capped(query[other], cap)
    if all(query.get(name, DEFAULT_SEARCH_LIMIT) == count for name, count in capped.items()):
        return query
    return dict(query, **capped)


def cap_multi_search(body, cap):
    """Every query of a multi-search, and its federation's window, capped."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if isinstance(body.get("queries"), list):
        federated = isinstance(body.get("federation"), dict)
        # federated queries may not carry `limit` (Meilisearch refuses it)
        body["queries"] = body["queries"] if federated else \
            [cap_search_object(q, cap) for q in body["queries"]]
    if isinstance(body.get("federation"), dict):
        body["federation"] = cap_search_object(body["federation"], cap)
    return body


def _parameter_name(part):
    name = part.partition("=")[0]
    return urllib.parse.unquote_plus(name) if "%" in name or "+" in name else name


def parse_search_query(query):
    """A GET search or similar's query string, read once: (its search
    value, the shape of a POST body, as Meilisearch reads each parameter; the
    parts as sent; their names). The last of a repeated parameter counts."""
    parts = query.split("&") if query else []
    names = [_parameter_name(part) for part in parts]
    value = {}
    for part, name in zip(parts, names):
        value[name] = query_parameter(name, urllib.parse.unquote_plus(part.partition("=")[2]))
    return value, parts, names


def query_parameter(name, text):
    """One GET search (or documents) parameter as its POST body spells it:
    the filter as query_filter reads it, lists comma-separated (a documents
    read's `fields` too), booleans, page counts as Rust's usize reads them;
    anything else (or what does not parse: the backend refuses it) as the
    text."""
    if name == "filter":
        return query_filter(text)
    if name == "fields":
        return text.split(",")
    if name in ("limit", "hitsPerPage", "page"):
        count = parse_rust_uint(text)
        return text if count is None else count
    spec = FORCED_PARAMETERS.get(name)
    if spec is _STRINGS:
        return text.split(",")
    if spec is _BOOLEAN and text in ("true", "false"):
        return text == "true"
    return text


def encode_search_query(query, read, value):
    """The query string of the search value `value` that `read`
    (parse_search_query's answer for `query`) became: `query` itself when
    nothing changed, else its parts as sent but those of the changed
    parameters, each of which is written once at the end (forced lists that
    are empty, the parameter's default, left out)."""
    before, parts, names = read
    changed = [name for name in value if name not in before or before[name] != value[name]]
    if not changed:
        return query
    kept = [part for part, name in zip(parts, names) if name not in changed]
    for name in changed:
        if value[name] != [] or name not in EMPTY_IS_DEFAULT:
            kept.append(urllib.parse.urlencode([(name, query_value(name, value[name]))]))
    return "&".join(kept)


def most_specific_rule(rules, index):
    """The value in `rules` (index pattern -> value) of the most specific
    pattern covering `index` (exact beats prefix, longer beats shorter), or
    None: how tenant tokens' searchRules and forcedParameters are matched."""
    matching = [p for p in rules if pattern_matches(p, index)]
    if not matching:
        return None
    return rules[max(matching, key=lambda p: (not p.endswith("*"), len(p)))]


def tenant_filter(rules, index):
    """The filter a tenant token adds to searches on `index`: that of the
    most specific matching rule, or None."""
    if not isinstance(rules, dict):
        return None
    rule = most_specific_rule(rules, index)
    return rule.get("filter") if isinstance(rule, dict) else None


def fuse_filters(left, right):
    """Upstream's fuse_filters (None: no filter): both sides as one AND-list,
    an array side spliced in, so an inner array keeps meaning OR."""
    if left is None:
        return right
    if right is None:
        return left
    return (left if isinstance(left, list) else [left]) + \
        (right if isinstance(right, list) else [right])


def with_tenant_filter(query, rules, index):
    """A search query (JSON object) with the token's filter fused in, the
    way upstream's add_search_rules does it."""
    rule = tenant_filter(rules, index)
    if rule is None or not isinstance(query, dict):
        return query
    return dict(query, filter=fuse_filters(query.get("filter"), rule))


def check_new_index_uid(principal, index, body):
    """POST /indexes, and PATCH /indexes/{uid} renaming an index: the new
    uid must be one the key covers (Meilisearch checks only the old one of a
    rename, whose documents would leave the key's indexes for any name)."""
    uid = body.get("uid") if isinstance(body, dict) else None
    if isinstance(uid, str) and not principal.may_use_index(uid):
        raise refused("index", invalid_api_key())
    return body


def scope_multi_search(principal, index, body):
    """POST /multi-search (federated or not): every query's indexUid, and
    every index the federation's facetsByIndex names (the backend's errors
    about it would show that index and its filterable attributes), must be
    covered; a tenant token's filters are fused into each query."""
    federation = body.get("federation") if isinstance(body, dict) else None
    by_index = federation.get("facetsByIndex") if isinstance(federation, dict) else None
    for uid in by_index if isinstance(by_index, dict) else ():
        if not principal.may_use_index(uid):
            raise refused("index", invalid_api_key(
                "Inside `.federation.facetsByIndex`: The provided API key is invalid."))
    queries = body.get("queries") if isinstance(body, dict) else None
    if not isinstance(queries, list):
        return body
    scoped, grown, rule_sizes = [], 0, {}
    for position, query in enumerate(queries):
        uid = query.get("indexUid") if isinstance(query, dict) else None
        if isinstance(uid, str):
            if not principal.may_use_index(uid):
                raise refused("index", invalid_api_key(
                    "Inside `.queries[%d]`: The provided API key is invalid." % position))
            rule = tenant_filter(principal.rules, uid)
            if rule is not None:
                # a token's filter is copied into each query: many small queries and a
                # long filter must not grow the forwarded body past what one may send
                if uid not in rule_sizes:
                    rule_sizes[uid] = len(compact_json(rule))
                grown += rule_sizes[uid]
                if grown > MAX_HANDLER_BODY:
                    raise payload_too_large(MAX_HANDLER_BODY)
                query = dict(query, filter=fuse_filters(query.get("filter"), rule))
        scoped.append(query)
    return dict(body, queries=scoped)


def check_index_swap(principal, index, body):
    """POST /swap-indexes: both indexes of every swap must be covered."""
    for swap in body if isinstance(body, list) else ():
        indexes = swap.get("indexes") if isinstance(swap, dict) else None
        for uid in indexes if isinstance(indexes, list) else ():
            if isinstance(uid, str) and not principal.may_use_index(uid):
                raise refused("index", invalid_api_key())
    return body


def scope_search_value(principal, index, value):
    """Search, facet-search, similar on one index, and the documents read
    there (listed, fetched, one by its id): fuse the token's filter."""
    return with_tenant_filter(value, principal.rules, index)


def query_filter(value):
    """A GET search's `filter` parameter as upstream reads it: JSON when it
    parses as JSON, else a string; a JSON null is upstream's Some(Null),
    which fuse_filters keeps as one element."""
    try:
        current = strict_json(value)
    except (ValueError, RecursionError):
        current = value
    return [None] if current is None else current


def _is_string_list(value):
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _is_filter(value):
    """Meilisearch's filter shape: a string, or an AND-array of strings and
    OR-arrays of strings (or null: no filter)."""
    return value is None or isinstance(value, str) or isinstance(value, list) and all(
        isinstance(item, str) or _is_string_list(item) for item in value)


def _filters_nothing(value):
    """Whether a filter of _is_filter's shape holds no condition: null, a
    blank string, or arrays of those, which Meilisearch reads as no filter."""
    if isinstance(value, list):
        return all(_filters_nothing(item) for item in value)
    return value is None or not value.strip()


_STRINGS = ("an array of strings", _is_string_list)
_BOOLEAN = ("a boolean", lambda value: type(value) is bool)
_STRING = ("a string", lambda value: isinstance(value, str))
# The search parameters a key may force, with what Meilisearch accepts for
# each. Page sizes are not among them: `maxHitsPerQuery` caps those.
FORCED_PARAMETERS = {
    "filter": ("a string, an array of strings and arrays of strings, or null", _is_filter),
    "attributesToRetrieve": _STRINGS, "attributesToHighlight": _STRINGS,
    "attributesToCrop": _STRINGS, "facets": _STRINGS, "attributesToSearchOn": _STRINGS,
    "locales": _STRINGS,
    "cropLength": ("a positive integer", lambda value: type(value) is int and value >= 0),
    "cropMarker": _STRING, "highlightPreTag": _STRING, "highlightPostTag": _STRING,
    "distinct": _STRING,
    "showMatchesPosition": _BOOLEAN, "showRankingScore": _BOOLEAN,
    "showRankingScoreDetails": _BOOLEAN, "retrieveVectors": _BOOLEAN,
    "matchingStrategy": ("one of `last`, `all`, `frequency`",
                         lambda value: value in ("last", "all", "frequency")),
    "rankingScoreThreshold": ("a number from 0.0 to 1.0", lambda value: type(value) in (
        int, float) and 0 <= value <= 1),
}


# Which forced parameters exist where: every one on a search (but `facets`
# in a federated query, which the federation's facetsByIndex takes); some
# on similar and facet search, whose bodies refuse unknown fields.
SEARCH_PARAMETERS = frozenset(FORCED_PARAMETERS)
FEDERATED_PARAMETERS = SEARCH_PARAMETERS - {"facets"}
SIMILAR_PARAMETERS = frozenset(("filter", "attributesToRetrieve", "retrieveVectors",
                                "showRankingScore", "showRankingScoreDetails",
                                "rankingScoreThreshold"))
FACET_SEARCH_PARAMETERS = frozenset(("filter", "matchingStrategy", "attributesToSearchOn",
                                     "rankingScoreThreshold", "locales"))
FORMATTED_PARAMETERS = ("attributesToHighlight", "attributesToCrop")
# A forced list that is empty means the parameter's default on a GET, so the
# parameter is left out; for the others an empty list has no GET spelling.
EMPTY_IS_DEFAULT = frozenset(FORMATTED_PARAMETERS + ("facets", "locales"))


MAX_FORCED_PARAMETERS = 16 * 1024  # bytes of forcedParameters JSON: added to every query


def _validate_forced_parameters(value):
    """forcedParameters: 1 to 100 index patterns, each with at least one
    search parameter Meilisearch would accept, at most 16 KiB in all."""
    code = "invalid_restrictions_forced_parameters"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise wrong_type(code, ".forcedParameters", "an object", value)
    if not value or len(value) > MAX_RESTRICTION_ITEMS:
        raise invalid_value(code, ".forcedParameters", "give 1 to %d index patterns (or null "
                            "for no restriction)." % MAX_RESTRICTION_ITEMS)
    if len(compact_json(value).encode()) > MAX_FORCED_PARAMETERS:
        raise invalid_value(code, ".forcedParameters", "give at most %d bytes of JSON."
                            % MAX_FORCED_PARAMETERS)
    for pattern, parameters in value.items():
        where = ".forcedParameters.%s" % printable(pattern)
        if not is_valid_index_pattern(pattern):
            raise invalid_value(code, where, "`%s` is not an index pattern: give an index uid "
                                "(A-Z a-z 0-9 - _), with `*` at its end for any text."
                                % printable(pattern))
        if not isinstance(parameters, dict):
            raise wrong_type(code, where, "an object", parameters)
        if not parameters:
            raise invalid_value(code, where, "give at least one search parameter.")
        for name, forced in parameters.items():
            if name not in FORCED_PARAMETERS:
                raise ApiError(400, code, "Unknown field `%s` inside `%s`: %sexpected one of %s"
                               % (printable(name), where, did_you_mean(name, FORCED_PARAMETERS),
                                  backticked(FORCED_PARAMETERS)))
            expected, accepts = FORCED_PARAMETERS[name]
            if not accepts(forced):
                raise wrong_type(code, "%s.%s" % (where, name), expected, forced)
            if name == "filter" and _filters_nothing(forced):
                # A forced filter is a promise that the key sees only what it lets
                # through: one that lets everything through must not look like one.
                raise invalid_value(code, "%s.filter" % where, "`%s` holds no condition, so it "
                                    "would restrict nothing: give a filter such as "
                                    "`published = true`, or leave `filter` out."
                                    % compact_json(forced))
    return value


def forced_parameters(restrictions, index):
    """The search parameters a key's forcedParameters force on `index` (those
    of its most specific pattern, as for a tenant token's searchRules), or None."""
    if restrictions is None or restrictions.forced is None:
        return None
    return most_specific_rule(restrictions.forced, index)


def force_object(query, forced, names):
    """A search query object with the `forced` parameters (those in `names`,
    the route's): `filter` fused in as a tenant token's is, the others
    replacing the caller's. Under a forced attributesToRetrieve, the
    attributes the caller highlights or crops (which `_formatted` shows) are
    cut to the forced ones, unless those are forced too, and the ranking score
    details are turned off (unless forced): those of a sort, or of the index's
    custom ranking rules (`price:desc`), show each hit's value of the ranked
    attribute, shown or not (Meilisearch hides only those outside
    displayedAttributes), and the guard does not know the index's rules. So
    are the vectors, unless `_vectors` is among the forced attributes."""
    if forced is None or not isinstance(query, dict):
        return query
    query = dict(query)
    for name, value in forced.items():
        if name not in names:
            continue
        if name != "filter":
            query[name] = value
        elif value is not None:
            query["filter"] = fuse_filters(query.get("filter"), value)
    shown = forced.get("attributesToRetrieve") if "attributesToRetrieve" in names else None
    if shown is not None and "*" not in shown:
        for name in FORMATTED_PARAMETERS:
            if name not in forced and isinstance(query.get(name), list):
                query[name] = within_attributes(query[name], shown)
        if "showRankingScoreDetails" in names and "showRankingScoreDetails" not in forced \
                and query.get("showRankingScoreDetails") is True:
            query["showRankingScoreDetails"] = False
        # `_vectors` is added to each hit whatever attributesToRetrieve says: the embeddings
        # are made from any of the document's fields (as force_documents turns them off)
        if "retrieveVectors" in names and "retrieveVectors" not in forced \
                and "_vectors" not in shown and query.get("retrieveVectors") is True:
            query["retrieveVectors"] = False
    return query


def within_attributes(asked, shown):
    """Highlighted or cropped attributes (`title`, `title:10`, `*`) kept to
    the `shown` ones: `*` stands for all of those; anything else is dropped."""
    kept = []
    for item in asked:
        if not isinstance(item, str):
            kept.append(item)  # the backend refuses it
            continue
        name, colon, length = item.rpartition(":")
        name, suffix = (name, colon + length) if colon and is_decimal(length) else (item, "")
        if name == "*":
            kept.extend(attribute + suffix for attribute in shown)
        elif name in shown:
            kept.append(item)
    return kept


def force_search_on(names):
    """Search or similar on one index: the key's forced parameters (those in `names`)."""
    return lambda restrictions, index, value: force_object(
        value, forced_parameters(restrictions, index), names)


def query_value(name, value):
    """A forced parameter's value as a GET search spells it; 403 when it
    has no spelling there (a comma inside a list item, an empty list)."""
    if name == "filter":
        return compact_json(value)
    if isinstance(value, list):
        if not value or any("," in item for item in value):
            raise restriction_refused("forcedParameters", "on a GET request, which cannot "
                                      "spell its forced `%s`: use POST" % name)
        return ",".join(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else compact_json(value)


def force_facet_search(restrictions, index, body):
    """POST facet-search: the forced parameters that exist there; under a
    forced `facets`, only those facets' values may be searched."""
    forced = forced_parameters(restrictions, index)
    if forced is None or not isinstance(body, dict):
        return body
    facets, name = forced.get("facets"), body.get("facetName")
    if facets is not None and "*" not in facets and isinstance(name, str) \
            and name not in facets:
        raise restriction_refused("forcedParameters", "to search the values of this facet")
    return force_object(body, forced, FACET_SEARCH_PARAMETERS)


# The forced parameters a documents read gets: a documents fetch has no other.
DOCUMENT_PARAMETERS = frozenset(("filter", "attributesToRetrieve", "retrieveVectors"))


def documents_forced(restrictions, index):
    """The forced parameters of DOCUMENT_PARAMETERS on `index`, or None."""
    forced = forced_parameters(restrictions, index) or {}
    return {name: value for name, value in forced.items()
            if name in DOCUMENT_PARAMETERS} or None


def force_documents(restrictions, index, value):
    """GET documents, POST documents/fetch, and one document (asked by a
    fetch): the forced filter fused in as on a search; under a forced
    attributesToRetrieve, the `fields` asked cut to those (all of those when
    none, `*` or no list is asked) and no vectors (embeddings are made from
    any of the document's fields, shown or not), unless `_vectors` is among
    them; a forced retrieveVectors replaces the caller's."""
    forced = documents_forced(restrictions, index)
    if forced is None or not isinstance(value, dict):
        return value
    value = dict(value)
    if "filter" in forced:
        value["filter"] = fuse_filters(value.get("filter"), forced["filter"])
    shown = forced.get("attributesToRetrieve")
    if shown is not None and "*" not in shown:
        cut_fields(value, shown)
    if "retrieveVectors" in forced:
        value["retrieveVectors"] = forced["retrieveVectors"]
    return value


def show_displayed(value, facts):
    """A tenant token's documents read, its fields limited as a search's
    (issue 34; Meilisearch's documents routes ignore displayedAttributes):
    cut to the index's displayedAttributes unless they are `*`."""
    displayed = facts["displayed_attributes"]
    if "*" in displayed or not isinstance(value, dict):
        return value
    return cut_fields(dict(value), displayed)


def cut_fields(value, shown):
    """A documents read's value with its `fields` cut to `shown` (all of
    those when none, `*` or no list is asked) and no vectors (embeddings are
    made from any of the document's fields, shown or not) unless `_vectors`
    is among them."""
    asked = value.get("fields")
    value["fields"] = list(shown) if not isinstance(asked, list) or "*" in asked else \
        [name for name in asked if name in shown]
    if "_vectors" not in shown and "retrieveVectors" in value:
        value["retrieveVectors"] = False
    return value


ONE_DOCUMENT_PARAMETERS = ("fields", "retrieveVectors")
# A document id Meilisearch accepts (milli's validate_document_id_str); no
# document has another, and its fetch refuses another in `ids`.
_DOCUMENT_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,511}\Z")


def fetch_one_document(document_id, query):
    """GET /indexes/{i}/documents/{id}'s query string as the documents fetch
    the backend is asked instead (Decision.fetches_document): that one id
    (none when no document can have it, so that the answer is the same 404),
    the fields and vectors asked, one result. The query string is read as
    Meilisearch reads it on that route, and refused as it refuses it."""
    asked = parse_search_query(query)[0]
    for name in asked:
        if name not in ONE_DOCUMENT_PARAMETERS:
            raise bad_request("Unknown parameter `%s`: %sexpected one of %s" % (
                name, did_you_mean(name, ONE_DOCUMENT_PARAMETERS),
                backticked(ONE_DOCUMENT_PARAMETERS)))
    vectors = asked.get("retrieveVectors", False)
    if type(vectors) is not bool:
        raise ApiError(400, "invalid_document_retrieve_vectors", "Invalid value in parameter "
                       "`retrieveVectors`: could not parse `%s` as a boolean, expected either "
                       "`true` or `false`" % vectors)
    value = {"ids": [document_id] if _DOCUMENT_ID_RE.match(document_id) else [], "limit": 1}
    if "fields" in asked and "*" not in asked["fields"]:
        value["fields"] = asked["fields"]
    if vectors:
        value["retrieveVectors"] = True
    return value


def one_document_answer(context, answer):
    """The documents fetch's answer to a GET of one document: the document,
    or Meilisearch's own 404 for a missing one when none passed the filter."""
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list):
        raise ApiError(502, "upstream_unavailable", "The search backend's answer to a "
                       "documents fetch has no `results`.", "system")
    if not results:
        raise ApiError(404, "document_not_found",
                       "Document `%s` not found." % context.params["document_id"])
    return results[0]


def force_multi_search(restrictions, index, body):
    """POST /multi-search: each query gets its index's forced parameters; in
    a federated one, a forced `facets` becomes the federation's facetsByIndex
    entry for that index, whatever the caller asked there."""
    queries = body.get("queries") if isinstance(body, dict) else None
    if not isinstance(queries, list):
        return body
    federation = body.get("federation")
    names = FEDERATED_PARAMETERS if isinstance(federation, dict) else SEARCH_PARAMETERS
    if len(queries) * len(compact_json(restrictions.forced)) > MAX_HANDLER_BODY:
        raise payload_too_large(MAX_HANDLER_BODY)  # what this key's queries would grow to
    facets, forced_queries = {}, []
    for query in queries:
        uid = query.get("indexUid") if isinstance(query, dict) else None
        forced = forced_parameters(restrictions, uid) if isinstance(uid, str) else None
        forced_queries.append(force_object(query, forced, names))
        if forced is not None and "facets" in forced:
            facets[uid] = forced["facets"]
    body = dict(body, queries=forced_queries)
    if isinstance(federation, dict):
        body["federation"] = force_facets_by_index(restrictions, federation, facets)
    return body


def force_facets_by_index(restrictions, federation, facets):
    """A federation whose facetsByIndex holds the forced `facets` (index uid
    -> list) of the queried indexes, and of every covered index it names."""
    by_index = federation.get("facetsByIndex")
    if (by_index is None and not facets) or not isinstance(by_index, (dict, type(None))):
        return federation  # nothing to force, or a value the backend refuses
    by_index = dict(by_index or {}, **facets)
    for uid in by_index:
        forced = forced_parameters(restrictions, uid)
        if forced is not None and "facets" in forced:
            by_index[uid] = forced["facets"]
    return dict(federation, facetsByIndex=by_index)


def _same_forced(restrictions, uid, other):
    return forced_parameters(restrictions, uid) == forced_parameters(restrictions, other)


def force_same_on_swap(restrictions, index, body):
    """POST /swap-indexes: a swap (or a rename) moves each index's documents
    under the other's name, so both names must have the same forced
    parameters: else a covered index's documents would be searched
    without them."""
    for swap in body if isinstance(body, list) else ():
        uids = swap.get("indexes") if isinstance(swap, dict) else None
        uids = [uid for uid in uids if isinstance(uid, str)] if isinstance(uids, list) else []
        if any(not _same_forced(restrictions, uids[0], uid) for uid in uids[1:]):
            raise restriction_refused("forcedParameters", "to swap or rename indexes whose "
                                      "forced search parameters differ")
    return body


def force_same_on_rename(restrictions, index, body):
    """PATCH /indexes/{uid} with a new `uid` renames the index: the new name
    must have the same forced parameters as the old (see force_same_on_swap)."""
    uid = body.get("uid") if isinstance(body, dict) else None
    if isinstance(uid, str) and not _same_forced(restrictions, index, uid):
        raise restriction_refused("forcedParameters", "to rename an index to a name whose "
                                  "forced search parameters differ")
    return body


REFUSED_WHEN_FORCED = "refused when forced"  # a route that would bypass forced parameters


def refuse_embedders(restrictions, index, body):
    """PATCH /indexes/{uid}/settings on a covered index: not its `embedders`,
    as the embedders route is refused (REFUSED_WHEN_FORCED): a REST
    embedder's documentTemplate sends every document, whole, to its URL."""
    if isinstance(body, dict) and body.get("embedders") is not None \
            and forced_parameters(restrictions, index) is not None:
        raise restriction_refused("forcedParameters", "to change the embedders of an index "
                                  "it searches with forced parameters")
    return body


ALL_INDEXES_LIMIT = 1000000  # GET /indexes asks the backend for every index, then filters


def all_indexes_query(query):
    """GET /indexes for a scoped key: (the query that asks the backend
    for every index, offset, limit to apply after filtering); upstream's 400
    ApiError for parameters it refuses, so none goes unfiltered."""
    offset, limit = validate_list_query(query, "index")
    return "offset=0&limit=%d" % ALL_INDEXES_LIMIT, offset, limit


def filter_index_list(principal, answer, offset, limit):
    """GET /indexes for a scoped key: only its indexes, paginated after
    filtering as upstream does."""
    if not isinstance(answer, dict) or not isinstance(answer.get("results"), list):
        return answer
    allowed = [i for i in answer["results"]
               if isinstance(i, dict) and principal.may_use_index(str(i.get("uid")))]
    return dict(answer, results=allowed[offset:offset + limit], offset=offset, limit=limit,
                total=len(allowed))


def filter_stats(principal, answer, covered):
    """GET /stats for a scoped key: only its indexes, and upstream's
    `lastUpdate` over them: the latest `updatedAt` of `covered` (the
    backend's index objects the key covers), null for none."""
    if not isinstance(answer, dict) or not isinstance(answer.get("indexes"), dict):
        return answer
    updates = [(instant.ns, text) for instant, text in (
        (parse_expires_at(i.get("updatedAt")) if isinstance(i.get("updatedAt"), str) else None,
         i.get("updatedAt")) for i in covered) if instant is not None]
    return dict(answer, lastUpdate=max(updates)[1] if updates else None,
                indexes={uid: stats for uid, stats in answer["indexes"].items()
                         if principal.may_use_index(uid)})


def scope_task_query(query, allowed_uids):
    """GET /tasks, /batches, DELETE /tasks, POST /tasks/cancel: limit the
    `indexUids` parameter to the indexes the key covers. With none left,
    name an index that cannot exist, so the backend matches nothing."""
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    asked = [v for n, v in pairs if n == "indexUids"]
    uids = set(allowed_uids)
    if asked:
        wanted = {u.strip() for u in ",".join(asked).split(",")}
        if "*" not in wanted:
            uids &= wanted
    if not uids:
        uids = {"searchkeys-no-index-" + secrets.token_hex(8)}
    pairs = [(n, v) for n, v in pairs if n != "indexUids"]
    return urllib.parse.urlencode(pairs + [("indexUids", ",".join(sorted(uids)))])


def check_task_answer(principal, task_id, answer):
    """GET /tasks/{id} for a scoped key: a task on another index (or on
    none) does not exist for it."""
    uid = answer.get("indexUid") if isinstance(answer, dict) else None
    if not isinstance(uid, str) or not principal.may_use_index(uid):
        raise ApiError(404, "task_not_found", "Task `%s` not found." % _uid_shown(task_id))
    return answer


# Task kinds of one index (upstream's Kind::related_to_one_index); a batch
# of other kinds (a swap, a dump...) is never shown to a scoped key.
ONE_INDEX_TASK_KINDS = frozenset((
    "documentAdditionOrUpdate", "documentEdition", "documentDeletion", "settingsUpdate",
    "indexCreation", "indexDeletion", "indexUpdate", "indexCompaction", "dsrUpdate", "dsrClear"))


def check_batch_answer(principal, batch_id, answer):
    """GET /batches/{id} for a scoped key: as upstream's
    get_batch_ids_from_authorized_indexes means it (and as GET /batches
    lists it), a batch of one-index tasks with at least one covered index.
    (Upstream subtracts the task uids of the other kinds from the batch
    uids, a slip: it would show a dump batch to every scoped key.)"""
    stats = answer.get("stats") if isinstance(answer, dict) else None
    uids = stats.get("indexUids") if isinstance(stats, dict) else None
    kinds = stats.get("types") if isinstance(stats, dict) else None
    if not isinstance(uids, dict) or not any(principal.may_use_index(uid) for uid in uids) \
            or not isinstance(kinds, dict) or not ONE_INDEX_TASK_KINDS.issuperset(kinds):
        raise ApiError(404, "batch_not_found", "Batch `%s` not found." % _uid_shown(batch_id))
    return answer


def check_task_filters(query, verb):
    """DELETE /tasks, POST /tasks/cancel: upstream's 400 without a filter
    (the guard would otherwise add one: "every task of my indexes"). Every
    parameter upstream accepts there is a filter; with another, it refuses
    the request itself."""
    if not urllib.parse.parse_qsl(query, keep_blank_values=True):
        raise ApiError(400, "missing_task_filters", "Query parameters to filter the tasks to %s "
                       "are missing. Available query parameters are: `uids`, `indexUids`, "
                       "`statuses`, `types`, `canceledBy`, `beforeEnqueuedAt`, "
                       "`afterEnqueuedAt`, `beforeStartedAt`, `afterStartedAt`, "
                       "`beforeFinishedAt`, `afterFinishedAt`." % verb)


def _uid_shown(text):
    """A task or batch uid as upstream's message shows it: the parsed u32."""
    number = parse_rust_uint(text, U32_MAX)
    return text if number is None else number


class RuleContext(collections.namedtuple("RuleContext", "principal params query facts")):
    """What a handler rule sees of one request: the principal, the route's
    parameters, the query string, and the backend's `facts` its rule asked
    for (see fetch_facts), fetched at the edge."""

    def allowed_indexes(self):
        """The uids of the backend's indexes the principal covers."""
        return [i["uid"] for i in self.facts["covered_indexes"]]


# When a rule applies: to any scoped principal, only to a tenant token whose
# rules filter the route's index, or never forwarded for such principals.
SCOPED, TOKEN_FILTER, UNENFORCEABLE = "scoped", "token filter", "unenforceable"


class Rule(collections.namedtuple("Rule", "when value query answer facts")):
    """A handler rule: `value(principal, index, value)` checks or rewrites the
    search value (the JSON body; a GET search's parsed query string);
    `query(context)` returns the query string of a listing to forward;
    `answer(context, json)` checks or filters a 200 answer; `facts`: the
    backend's facts (see fetch_facts) `query` and `answer` read."""

    def __new__(cls, when, value=None, query=None, answer=None, facts=()):
        return super().__new__(cls, when, value, query, answer, tuple(facts))

    def applies(self, principal, index):
        if principal.unscoped:
            return False
        if self.when == TOKEN_FILTER:
            return index is not None and tenant_filter(principal.rules, index) is not None
        return True


def _index_page_query(context):
    return all_indexes_query(context.query)[0]


def _index_page_answer(context, answer):
    _, offset, limit = all_indexes_query(context.query)
    return filter_index_list(context.principal, answer, offset, limit)


def _task_listing_query(context):
    return scope_task_query(context.query, context.allowed_indexes())


def _task_change_query(verb):
    def query(context):
        check_task_filters(context.query, verb)
        return _task_listing_query(context)
    return query


def fetch_or_refuse(upstream, target, what):
    """GET `target` from the backend for the guard's own check: its 200
    JSON answer; its refusal (a Meilisearch error: a bad uid, not found...)
    relayed as the caller's; anything else a 502, so the check fails closed."""
    status, answer = upstream.fetch_json(target)
    if status != 200 and status < 500 and isinstance(answer, dict) \
            and all(isinstance(answer.get(f), str) for f in ("message", "code", "type")):
        raise ApiError(status, answer["code"], answer["message"], answer["type"])
    if status != 200:
        raise upstream_unreachable(upstream, "%s answered %s" % (what, status))
    return answer


def _task_documents_query(context):
    """A task's documents, only once the backend showed the task, on an
    index the principal covers."""
    check_task_answer(context.principal, context.params["task_id"], context.facts["task"])
    return context.query


SEARCH_RULE = Rule(TOKEN_FILTER, value=scope_search_value)
TASK_LISTING_RULE = Rule(SCOPED, query=_task_listing_query, facts=("covered_indexes",))
# The chat's search tool and the document a template renders are scoped by
# handlers the guard does not reproduce: refused instead.
NOT_ENFORCEABLE_RULE = Rule(UNENFORCEABLE)


def scope_not_enforceable(route, where):
    return refused("index", invalid_api_key(
        "This API key is scoped to some indexes (or is a tenant token), and searchkeys "
        "cannot enforce that scope on `%s %s`%s; the request is refused."
        % (route.method, route.pattern, " " + where if where else "")))


# =============================================================================
# Usage per key and server metrics: counted in memory on each answer
# =============================================================================

# Why the guard refused a request. A key's usage counts the first eleven (a
# refusal that names a key); metrics count them all, with "credential" (no
# key, an unknown one, a bad tenant token) and "throttled" (--throttle-failures).
USAGE_REASONS = ("action", "index", "expiry", "rate", "referrer", "ip", "hits", "forced",
                 "revoked", "concurrency", "browser")
REFUSAL_REASONS = USAGE_REASONS + ("credential", "throttled")
_USAGE_SLOT = dict(zip((None,) + USAGE_REASONS, itertools.count()))  # allowed is slot 0
_USAGE_TIMES = len(_USAGE_SLOT)  # then two times (ns, 0: never): seen from a browser, last used
USAGE_FLUSH_SECONDS = 5.0  # usage counts reach the store file at most this late
BACKEND_ERRORS = ("connection", "timeout")
EXPIRY_WARNING_DAYS = 7  # keys that stop working this soon are counted, and logged once a day
DAY_NS = 86400 * 10 ** 9
HOUR_NS = 3600 * 10 ** 9
USAGE_HOURS = 24  # the hours of requests per key the keys page charts (in memory, per process)
EXPIRY_CHECK_SECONDS = 60.0  # how often serve looks for keys expiring soon, to log them
MAX_EXPIRED_SEEN = 100000  # expired keys remembered as used, for their first-use counter
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class Usage:
    """Per key (by uid): requests allowed, refused by reason, last used;
    and its requests in each of the last USAGE_HOURS hours (`hourly`).

    A request costs a few increments under one lock, in this process's
    memory. The KeyStore saves them with each change of keys and, when there
    are some, every USAGE_FLUSH_SECONDS (a kill -9 loses at most those last
    seconds): saving adds them to the totals the store file holds, to which
    every process sharing the store adds its own. A key's usage reads as
    those saved totals plus this process's counts not saved yet. The hourly
    counts are this process's alone, in memory only: a chart's, not a record."""

    def __init__(self):
        self._lock = threading.Lock()
        self._saved = {}   # uid -> counts: the store file's totals, as last read or written
        self._counts = {}  # uid -> counts of this process, not saved yet
        # counts: [allowed, one per USAGE_REASONS..., seen from a browser ns, last used ns]
        self._hours = {}  # uid -> [requests in hour h at h % USAGE_HOURS..., then which h each]

    @property
    def changed(self):
        """Whether there are counts to save."""
        return bool(self._counts)

    def count(self, uid, reason, now_ns, browser=False):
        """One request with key `uid`: allowed (reason None) or refused for
        `reason`; `browser`: it came with a browser's signals."""
        slot = _USAGE_SLOT.get(reason)
        if slot is None:  # not a refusal of this key's
            return
        with self._lock:
            counts = self._counts.get(uid)
            if counts is None:
                counts = self._counts[uid] = [0] * (_USAGE_TIMES + 2)
            counts[slot] += 1
            counts[-1] = now_ns
            if browser:
                counts[-2] = now_ns
            hour = now_ns // HOUR_NS
            hours = self._hours.get(uid)
            if hours is None:
                hours = self._hours[uid] = [0] * (2 * USAGE_HOURS)
            at = hour % USAGE_HOURS
            if hours[USAGE_HOURS + at] != hour:  # the bucket held an hour a day or more ago
                hours[USAGE_HOURS + at], hours[at] = hour, 0
            hours[at] += 1

    def hourly(self, uid, now_ns):
        """Key `uid`'s requests (allowed or refused) in each of the last
        USAGE_HOURS hours, oldest first, the current hour last: this process's."""
        now = now_ns // HOUR_NS
        with self._lock:
            hours = self._hours.get(uid) or [0] * (2 * USAGE_HOURS)
            return [hours[hour % USAGE_HOURS] if hours[USAGE_HOURS + hour % USAGE_HOURS] == hour
                    else 0 for hour in range(now - USAGE_HOURS + 1, now + 1)]

    def forget(self, uid):
        with self._lock:
            self._saved.pop(uid, None)
            self._counts.pop(uid, None)
            self._hours.pop(uid, None)

    def to_json(self, uid):
        """`allowed`, `refused` (every reason) and `lastUsedAt` (null: never)
        of key `uid`: the saved totals plus this process's unsaved counts."""
        with self._lock:
            counts = _added(self._saved.get(uid), self._counts.get(uid))
        return {"allowed": counts[0],
                "refused": dict(zip(USAGE_REASONS, counts[1:_USAGE_TIMES])),
                "lastUsedAt": format_timestamp(counts[-1]) if counts[-1] else None,
                "seenFromBrowserAt": format_timestamp(counts[-2]) if counts[-2] else None}

    def unsaved(self, uid):
        """The part of key `uid`'s usage only this process has counted yet:
        `allowed` and `refused` (all reasons)."""
        with self._lock:
            counts = self._counts.get(uid) or [0] * (_USAGE_TIMES + 2)
        return {"allowed": counts[0], "refused": sum(counts[1:_USAGE_TIMES])}

    def take(self, keep):
        """(the totals to save, for the uids `keep(uid)` holds (a deleted
        key's are left out), the unsaved counts they include): the counts
        are no longer unsaved. After the write, saved(totals), or
        give_back(taken) if it failed."""
        with self._lock:
            taken, self._counts = self._counts, {}
            totals = {uid: _added(self._saved.get(uid), taken.get(uid))
                      for uid in itertools.chain(self._saved, taken.keys() - self._saved.keys())
                      if keep(uid)}
        return totals, taken

    def saved(self, totals):
        with self._lock:
            self._saved = totals

    def give_back(self, taken):
        with self._lock:
            for uid, counts in taken.items():
                self._counts[uid] = _added(counts, self._counts.get(uid))

    def load(self, section, keys):
        """Take the store file's usage section as the saved totals; returns
        what was wrong with it (counts of unknown keys are dropped, bad
        entries skipped)."""
        saved, problems = {}, []
        if section is not None and not isinstance(section, dict):
            problems.append("the usage section is not an object")
        elif section is not None:
            for uid, record in section.items():
                try:
                    counts = _usage_counts(record)
                except (ValueError, TypeError, KeyError, AttributeError):
                    problems.append("bad usage counts for key %s" % printable(uid))
                    continue
                if uid in keys:
                    saved[uid] = counts
        with self._lock:
            self._saved = saved
            # (keys another process deleted: their hours go with them)
            self._hours = {uid: hours for uid, hours in self._hours.items() if uid in keys}
        return problems


def usage_section(totals):
    """Usage totals as the store file holds them (reasons with no refusal left out)."""
    return {uid: dict({"allowed": counts[0],
                       "refused": {reason: n for reason, n in zip(USAGE_REASONS,
                                                                  counts[1:_USAGE_TIMES]) if n},
                       "lastUsedAt": counts[-1]},
                      **({"seenFromBrowserAt": counts[-2]} if counts[-2] else {}))
            for uid, counts in totals.items()}


def _added(counts, more):
    """Two usage counts of a key added up (the later last use kept); either may be None."""
    if counts is None or more is None:
        return list(counts or more or [0] * (_USAGE_TIMES + 2))
    return [a + b for a, b in zip(counts[:_USAGE_TIMES], more[:_USAGE_TIMES])] + \
        [max(a, b) for a, b in zip(counts[_USAGE_TIMES:], more[_USAGE_TIMES:])]


def _usage_counts(record):
    """A stored usage record -> counts; ValueError (or TypeError) if it is not one."""
    allowed, refusals, last = record["allowed"], record["refused"], record["lastUsedAt"]
    counts = [allowed] + [refusals.pop(reason, 0) for reason in USAGE_REASONS]
    counts.append(record.get("seenFromBrowserAt", 0))
    counts.append(0 if last is None else last)
    if refusals or any(type(n) is not int or n < 0 for n in counts):
        raise ValueError("not usage counts")
    return counts


class Metrics:
    """Server-wide counters for GET /metrics, in Prometheus's text format
    0.0.4. Labels come from fixed sets (route families, answer codes,
    refusal reasons), never from a request's text; no label per key."""

    BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
               300.0)

    def __init__(self):
        self._lock = threading.Lock()
        self._requests = {}  # (route family, status) -> answers
        self._refusals = dict.fromkeys(REFUSAL_REASONS, 0)
        self._latency = [0] * (len(self.BUCKETS) + 1)  # per bucket, the last one +Inf
        self._latency_sum = 0.0
        self._backend_errors = dict.fromkeys(BACKEND_ERRORS, 0)
        self._expired_seen = set()  # uids of the expired keys used (at most MAX_EXPIRED_SEEN)

    def count(self, family, status, reason):
        with self._lock:
            self._requests[family, status] = self._requests.get((family, status), 0) + 1
            if reason is not None:
                self._refusals[reason] += 1

    def expired_key_used(self, uid):
        """A request with the expired key `uid`: counted the first time only."""
        with self._lock:
            if uid in self._expired_seen or len(self._expired_seen) >= MAX_EXPIRED_SEEN:
                return
            self._expired_seen.add(uid)

    def observe_backend(self, seconds):
        """One backend answer's head arrived `seconds` after the request was sent."""
        slot = 0
        for bound in self.BUCKETS:  # a plain loop: cheaper than a generator here
            if seconds <= bound:
                break
            slot += 1
        with self._lock:
            self._latency[slot] += 1
            self._latency_sum += seconds

    def backend_error(self, exc):
        kind = "timeout" if isinstance(exc, (socket.timeout, TimeoutError)) else "connection"
        with self._lock:
            self._backend_errors[kind] += 1

    def render(self, keys, rate_clients, expiring, history_failures):
        """The exposition text, with the gauges given (keys stored, rate-limit
        table size, keys expiring within EXPIRY_WARNING_DAYS) and the store's
        count of history lines it could not append."""
        with self._lock:
            requests, refusals = sorted(self._requests.items()), dict(self._refusals)
            latency, latency_sum = list(self._latency), self._latency_sum
            errors, expired_used = dict(self._backend_errors), len(self._expired_seen)
        out = []

        def family(name, kind, text, samples):
            out.append("# HELP searchkeys_%s %s\n# TYPE searchkeys_%s %s\n" % (name, text, name,
                                                                             kind))
            out.extend("searchkeys_%s%s %s\n" % sample for sample in samples)
        family("requests_total", "counter", "Requests answered, by route family and status.",
               [("requests_total", '{family="%s",code="%d"}' % key, n)
                for key, n in requests])
        family("refusals_total", "counter", "Requests the guard refused, by reason.",
               [("refusals_total", '{reason="%s"}' % r, n) for r, n in refusals.items()])
        cumulative = list(itertools.accumulate(latency))
        bounds = ["%g" % bound for bound in self.BUCKETS] + ["+Inf"]
        family("backend_request_duration_seconds", "histogram", "Time from sending a request "
               "to the backend to its answer's head.",
               [("backend_request_duration_seconds_bucket", '{le="%s"}' % le, n)
                for le, n in zip(bounds, cumulative)] +
               [("backend_request_duration_seconds_sum", "", repr(latency_sum)),
                ("backend_request_duration_seconds_count", "", cumulative[-1])])
        family("backend_errors_total", "counter", "Backend requests that failed, by kind.",
               [("backend_errors_total", '{kind="%s"}' % k, n) for k, n in errors.items()])
        family("rate_limit_clients", "gauge", "Rate-limit counters held (at most --max-clients).",
               [("rate_limit_clients", "", rate_clients)])
        family("keys", "gauge", "API keys stored.", [("keys", "", keys)])
        family("keys_expiring", "gauge", "API keys that stop working within %d days."
               % EXPIRY_WARNING_DAYS, [("keys_expiring", "", expiring)])
        family("expired_keys_used_total", "counter", "Expired API keys used (each counted at "
               "its first refused use in this process).",
               [("expired_keys_used_total", "", expired_used)])
        family("history_write_failures_total", "counter", "Changes to keys made whose line "
               "could not be appended to the history (each also logged).",
               [("history_write_failures_total", "", history_failures)])
        family("build_info", "gauge", "The searchkeys version and Python running it.",
               [("build_info", '{version="%s",python="%s"}' % (
                   __version__, "%d.%d.%d" % sys.version_info[:3]), 1)])
        return "".join(out)


class ExpiryWarnings:
    """One log line a day per key that stops working within
    EXPIRY_WARNING_DAYS (in this process: each of --workers logs its own)."""

    def __init__(self):
        self._warned = {}  # uid -> when it was last logged (ns)

    def lines(self, keys, now_ns):
        """The lines to log now for `keys` (those expiring soon)."""
        warned = {uid: at for uid, at in self._warned.items() if now_ns - at < DAY_NS}
        lines = []
        for key in keys:
            if key.uid in warned:
                continue
            warned[key.uid] = now_ns
            lines.append("searchkeys: warning: key %s%s stops working at %s (in %.1f days)%s" % (
                key.uid, " (%s)" % printable(key.name) if key.name else "",
                format_timestamp(key.end_ns), (key.end_ns - now_ns) / DAY_NS,
                ": it is being rotated" if key.retirement is not None else
                ": rotate it or give its clients another key"))
        self._warned = warned
        return lines


# =============================================================================
# The /keys API: validate -> store -> respond
# =============================================================================


def require_master(principal, what):
    """Only the master key may `what`: any API key gets 403."""
    if principal.key is not None:
        raise refused("action", ApiError(403, "invalid_api_key", "Only the master key can %s."
                                         % what, "auth"))


def master_if_restricted(principal, what):
    """A check of a key about to be deleted or rotated: only the master key
    may `what` to a key with restrictions (an admin key could delete it and
    create it again, same uid and value, without them). The store runs it
    under its lock, on the key as the file holds it."""
    def check(key):
        if key.restrictions is not None:
            require_master(principal, what)
    return check


def actor(principal):
    """Who makes a change, as the history says it: the key's uid, or "master"."""
    return principal.key.uid if principal.key is not None else "master"


def without_parameter(query, name):
    """(the query string without the parameter `name`, its values in order):
    searchkeys' additions to a listing's `offset` and `limit`."""
    if name not in query:
        return query, []
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    return (urllib.parse.urlencode([(n, value) for n, value in pairs if n != name]),
            [value for n, value in pairs if n == name])


def usage_asked(query):
    """(the query without `usage`, whether `usage=true` asked GET /keys for
    each key's usage): searchkeys' one addition to Meilisearch's listing,
    which answers 400 to it (a bulk route under /keys/ would be a key's)."""
    rest, asked = without_parameter(query, "usage")
    if asked and asked[-1] not in ("true", "false"):
        raise ApiError(400, "invalid_api_key_usage", "Invalid value in parameter `usage`: "
                       "expected `true` or `false`.")
    return rest, asked[-1:] == ["true"]


def listing(results, offset, limit, total):
    """A page of a listing, in GET /keys' shape."""
    return Response.json(200, {"results": results, "offset": offset, "limit": limit,
                               "total": total})


class KeysApi:
    """The /keys API, once the request is authorized: one method a route,
    each taking the Call and answering its Response."""

    def __init__(self, store):
        self.store = store

    def list_keys(self, call):
        query, with_usage = usage_asked(call.request.query)
        if with_usage:
            require_master(call.principal, "read the usage of keys")
        offset, limit = validate_list_query(query)
        keys, total = self.store.page(offset, limit)
        results = [k.to_json() for k in keys]
        for key, shown in zip(keys, results) if with_usage else ():
            shown["usage"] = self.store.usage.to_json(key.uid)
        return listing(results, offset, limit, total)

    def get_key(self, call):
        return Response.json(200, self.store.find(call.params["key"]).to_json())

    def create_key(self, call):
        fields = validate_create(call.request.read_json_body(), time.time_ns())
        return Response.json(201, self._write(self.store.create, fields,
                                              actor(call.principal)).to_json())

    def update_key(self, call):
        segment = call.params["key"]
        changes = validate_patch(call.request.read_json_body())
        return Response.json(200, self._write(self.store.update, segment, changes,
                                              actor(call.principal)).to_json())

    def delete_key(self, call):
        self._write(self.store.delete, call.params["key"], master_if_restricted(
            call.principal, "delete a key that has restrictions"), actor(call.principal))
        return Response(204)

    def history(self, call):
        """GET /keys/history: the changes to keys, newest first; `key`: a
        uid, whose changes alone are listed. Restrictions are the master
        key's to read (GET /keys/{key}/restrictions): for an API key, a
        `restrict` line keeps its field names only (`valuesLeftOut`)."""
        query, asked = without_parameter(call.request.query, "key")
        uid = None
        if asked:
            try:
                uid = parse_uuid(asked[-1])
            except ValueError as exc:
                raise ApiError(400, "invalid_api_key_uid", "Invalid value in parameter `key`: "
                               "expected a key's uid: %s" % exc)
        offset, limit = validate_list_query(query)
        try:
            entries = self.store.history.entries(uid)
        except StoreError as exc:
            self.store.log("searchkeys: %s" % exc)
            raise internal_error("The history of keys cannot be read: %s" % exc)
        shown = [dict(entry, fields=dict.fromkeys(entry["fields"]), valuesLeftOut=True)
                 if entry.get("change") == "restrict" and call.principal.key is not None
                 else entry for entry in entries[offset:offset + limit]]
        return listing(shown, offset, limit, len(entries))

    def deleted_keys(self, call):
        """GET /keys/deleted: the deleted keys that can be restored, most
        recently deleted first."""
        offset, limit = validate_list_query(call.request.query)
        tombstones = self.store.tombstones()
        return listing([t.to_json() for t in tombstones[offset:offset + limit]], offset, limit,
                       len(tombstones))

    def restore_key(self, call):
        """POST /keys/{uid}/restore, master key only: the deleted key back
        (201, as POST /keys answers)."""
        segment = call.params["key"]
        try:
            uid = parse_uuid(segment)
        except ValueError:
            raise key_not_found(segment)
        return Response.json(201, self._write(self.store.restore, uid,
                                              actor(call.principal)).to_json())

    def rotate_key(self, call):
        """POST /keys/{key}/rotate: the new key's JSON. The body is optional."""
        request, segment = call.request, call.params["key"]
        check = master_if_restricted(call.principal, "rotate a key that has restrictions")
        check(self.store.find(segment))  # 404 (and 403) before 400, as PATCH
        data = request.body.read(MAX_KEYS_BODY)
        if data:
            check_content_type(request.headers.get("Content-Type"))
        grace = validate_rotation(parse_json_body(data) if data else {})
        return Response.json(201, self._write(self.store.rotate, segment, grace, check,
                                              actor(call.principal)).to_json())

    def revoke_tokens(self, call):
        """POST /keys/{key}/revoke-tokens: every tenant token the key signed
        before `issuedBefore` (default: now) stops working. The body is optional."""
        request = call.request
        data = request.body.read(MAX_KEYS_BODY)
        if data:
            check_content_type(request.headers.get("Content-Type"))
        self.store.find(call.params["key"])  # 404 before 400, as PATCH
        before = validate_revoke_tokens(parse_json_body(data) if data else {}, time.time_ns())
        key = self._write(self.store.revoke_tokens, call.params["key"], before,
                          actor(call.principal))
        return self._revocation(key)

    def revoke_token(self, call):
        """POST /keys/{key}/revoke-token: one tenant token of the key stops
        working (it is denied until its exp)."""
        key = self.store.find(call.params["key"])
        token, exp = validate_revoke_token(call.request.read_json_body(), key)
        return self._revocation(self._write(self.store.revoke_token, key.uid, token, exp,
                                            actor(call.principal)))

    @staticmethod
    def _revocation(key):
        return Response.json(200, dict({"uid": key.uid},
                                       **(key.revocation or NO_REVOCATION).to_json()))

    def key_usage(self, call):
        """GET /keys/{key}/usage: the key's uid, `allowed`, `refused`,
        `lastUsedAt` and `unsaved`, the part only this process has counted;
        master key only."""
        key = self.store.find(call.params["key"])
        return Response.json(200, dict({"uid": key.uid}, **self.store.usage.to_json(key.uid),
                                       unsaved=self.store.usage.unsaved(key.uid)))

    def get_restrictions(self, call):
        """GET /keys/{key_or_uid}/restrictions, master key only (as the other two)."""
        return self._restrictions(200, self.store.find(call.params["key"]))

    def put_restrictions(self, call):
        self.store.find(call.params["key"])  # 404 before 400, as PATCH /keys/{key}
        restrictions = Restrictions.from_json(call.request.read_json_body())
        return self._restrictions(200, self._write(self.store.restrict, call.params["key"],
                                                   restrictions, actor(call.principal)))

    def delete_restrictions(self, call):
        self._write(self.store.restrict, call.params["key"], None, actor(call.principal))
        return Response(204)

    @staticmethod
    def _restrictions(status, key):
        return Response.json(status, key.restrictions.to_json() if key.restrictions
                             else dict.fromkeys(RESTRICTION_FIELDS))

    def _write(self, operation, *args):
        """Run a store change; one that could not be made durable was not
        applied: log it for the operator and answer 500."""
        try:
            return operation(*args)
        except StoreWriteError as exc:
            self.store.log("searchkeys: %s" % exc)
            raise internal_error("The change could not be saved: %s" % exc)


def on_keys_api(method):
    """The route handler (service, call) answering with `method` of the
    service's KeysApi."""
    def handler(service, call):
        return method(service.keys_api, call)
    return handler


# The keys page (GET /keys/page) and its forms (POST /keys/page): for people,
# with the master key (Route.people); its HTML is the appendix at the end.

PAGE_NONCE_SECONDS = 3600  # how long a served page's forms may be sent back
PAGE_FORM_MAX = 4096  # bytes of a form the keys page takes
PAGE_KEYS_SHOWN = 1000  # keys the page lists, newest first (`keys list` pages through all)
PAGE_REVEAL_SECONDS = 60  # a key made this recently shows its value, on the page after the change


class PageNonces:
    """The nonce each served keys page puts in its forms, which a change
    must send back: unguessable (a random part), signed with the time it was
    served, compared in constant time. It is bound to no page, form or
    session: any nonce served in the last PAGE_NONCE_SECONDS is taken by any
    form. What it proves is that the sender read a page only the master key
    opens, which a cross-site form cannot. Signed with a secret derived from
    the master key rather than kept, so that memory holds none, and any of
    `serve --workers`' processes checks the nonce of a page another one
    served."""

    def __init__(self, master_key):
        self._secret = None if master_key is None else hmac.new(
            master_key.encode(), b"searchkeys keys page nonce", hashlib.sha256).digest()

    def mint(self, now):
        served = "%x.%s" % (int(now), secrets.token_urlsafe(16))
        return served + "." + self._signature(served)

    def valid(self, nonce, now):
        served, _, signature = nonce.rpartition(".")
        if self._secret is None or not hmac.compare_digest(
                self._signature(served).encode(), signature.encode("utf-8", "replace")):
            return False
        return 0 <= now - int(served.partition(".")[0], 16) <= PAGE_NONCE_SECONDS

    def _signature(self, served):
        return base64.urlsafe_b64encode(hmac.new(self._secret, served.encode("utf-8", "replace"),
                                                 hashlib.sha256).digest()).decode().rstrip("=")


def page_change_refused(message):
    return ApiError(403, "keys_page_change_refused", message, "auth")


def cross_site(headers):
    """Why a form sent to the keys page comes from another site, or None:
    its `Sec-Fetch-Site` is not `same-origin`, or its `Origin` is not this
    server as the request names it (`Host`). Headers a client can forge
    only count against it: without them it passes (the nonce still holds).
    (The page's `Referrer-Policy: no-referrer` makes a browser send its
    forms with `Origin: null`: that is the page's only with `Sec-Fetch-Site:
    same-origin`, which no script can set.)"""
    site = headers.get("Sec-Fetch-Site")
    if site is not None and site != "same-origin":
        return "Sec-Fetch-Site: %s" % site
    origin = headers.get("Origin")
    if origin is None or origin == "null" and site == "same-origin":
        return None
    scheme, _, host = origin.partition("://")
    if scheme not in ("http", "https") or host.lower() != (headers.get("Host") or "").lower():
        return "Origin: %s" % origin
    return None


def page_form(request):
    """The fields of a form the keys page sent (urlencoded UTF-8, at most
    PAGE_FORM_MAX bytes; of a repeated field, the last)."""
    media = (request.headers.get("Content-Type") or "").partition(";")[0].strip().lower()
    if media != "application/x-www-form-urlencoded":
        raise ApiError(415, "invalid_content_type", "The keys page takes its own forms "
                       "(`application/x-www-form-urlencoded`) only.")
    try:
        return dict(urllib.parse.parse_qsl(request.body.read(PAGE_FORM_MAX).decode("utf-8"),
                                           keep_blank_values=True, errors="strict",
                                           max_num_fields=16))
    except ValueError:  # not UTF-8 (before or after percent-decoding), too many fields
        raise bad_request("The form is malformed.")


class KeysPage:
    """The keys page: every key (up to PAGE_KEYS_SHOWN) with its actions,
    indexes, restrictions, expiry and usage, and a chart of its requests
    by hour, then the deleted keys that can be restored; its forms create
    a key from a preset, rotate, delete or restore one.
    A change is made by the /keys API route that makes it, given the body a
    client would send (one way to change a key), once the form is shown to
    come from the page: same origin (cross_site) and the page's nonce. Key
    values are never listed: a key's shows only on the page its creation
    (or rotation) leads to, for PAGE_REVEAL_SECONDS after it was made."""

    def __init__(self, service, master_key):
        self.service = service
        self.nonces = PageNonces(master_key)

    def show(self, call, status=200, problem=None):
        now, store = time.time_ns(), self.service.store
        keys, total = store.page(0, PAGE_KEYS_SHOWN)
        shown = [self._key(key, now) for key in keys]
        created = None
        if problem is None:
            uid = dict(urllib.parse.parse_qsl(call.request.query)).get("created", "")
            key = store.by_uid(uid) if _CANONICAL_UUID_RE.match(uid) else None
            if key is not None and 0 <= now - key.created_ns <= PAGE_REVEAL_SECONDS * 10 ** 9:
                created = key.to_json()
        deleted = [tombstone.to_json() for tombstone in store.tombstones()[:PAGE_KEYS_SHOWN]]
        return KeysPageHtml.page(status, shown, total, sorted(PRESETS),
                                 self.nonces.mint(now / 10 ** 9), created, problem, deleted)

    def _key(self, key, now):
        """What the page shows of `key`: its /keys JSON but its value, its
        restrictions, usage and hourly requests, and whether it has stopped
        working or stops within EXPIRY_WARNING_DAYS (`ends`)."""
        shown = key.to_json()
        del shown["key"]
        end = key.end_ns
        shown["ends"] = None if end is None else "expired" if end <= now else \
            "soon" if end - now <= EXPIRY_WARNING_DAYS * DAY_NS else None
        shown["restrictions"] = key.restrictions and {
            field: value for field, value in key.restrictions.to_json().items()
            if value is not None}
        shown["usage"] = self.service.store.usage.to_json(key.uid)
        shown["hours"] = self.service.store.usage.hourly(key.uid, now)
        return shown

    def change(self, call):
        """POST /keys/page: a form's change, then 303 back to the page; a
        refused or failed change gets the page again, saying why."""
        try:
            where = cross_site(call.request.headers)
            if where is not None:
                raise page_change_refused("This change was sent from another site (%s): "
                                          "nothing was changed." % printable(where[:200]))
            form = page_form(call.request)
            if not self.nonces.valid(form.get("nonce", ""), time.time()):
                raise page_change_refused("This form is not from this page, or is over an "
                                          "hour old: nothing was changed. Try again here.")
            made = self._apply(call, form)
        except ApiError as error:
            return self.show(call, error.status, error.message)
        return Response(303, [("Location", "/keys/page" + (
            "?created=" + made if made else "")), ("Cache-Control", "no-store")])

    def _apply(self, call, form):
        """Make the form's change; the uid of the key it made, if any."""
        change, uid = form.get("change"), form.get("uid", "")
        if change == "create":
            preset = form.get("preset")
            if preset not in PRESETS:
                raise bad_request("Choose a preset: %s." % ", ".join(sorted(PRESETS)))
            indexes = [part.strip() for part in form.get("indexes", "").split(",")
                       if part.strip()]
            body = {"name": form.get("name") or None, "actions": PRESETS[preset],
                    "indexes": indexes or ["*"], "expiresAt": form.get("expiresAt") or None}
            return self._through_api(call, "POST", "/keys", {}, body)["uid"]
        if change == "rotate":
            return self._through_api(call, "POST", "/keys/{key}/rotate", {"key": uid})["uid"]
        if change == "delete":
            self._through_api(call, "DELETE", "/keys/{key}", {"key": uid})
            return None
        if change == "restore":
            self._through_api(call, "POST", "/keys/{key}/restore", {"key": uid})
            return None
        raise bad_request("Unknown change: choose create, rotate, delete or restore.")

    def _through_api(self, call, method, pattern, params, body=None):
        """The answer of the /keys API route (method, pattern) to the request
        a client would send it (`body` as JSON), made by the route's own
        handler for the page's principal; raises its refusal."""
        route = ROUTE_INDEX[method, pattern]
        data = b"" if body is None else compact_json(body).encode()
        target = re.sub(r"\{(\w+)\}", lambda name: urllib.parse.quote(params[name.group(1)],
                                                                     safe=""), pattern)
        request = Request(method, target, Headers("Content-Type: application/json\n"),
                          Body(io.BytesIO(data), len(data)), call.request.peer)
        answer = route.handler(self.service, Call(request, route, None, params, call.principal))
        return json.loads(answer.body) if answer.body else None


# =============================================================================
# Keys and the key store
# =============================================================================


class StoreError(Exception):
    """The store file cannot be used; the server must not start."""


class StoreWriteError(Exception):
    """A change could not be made durable; it was not applied."""


class ApiKey:
    """One stored API key. Immutable: a change makes a new ApiKey."""

    __slots__ = ("uid", "name", "description", "actions", "indexes", "expires_at",
                 "created_ns", "updated_ns", "value", "grants", "is_global", "_stored",
                 "restrictions", "retirement", "revocation")

    def __init__(self, uid, name, description, actions, indexes, expires_at, created_ns,
                 updated_ns, value, restrictions=None, retirement=None, revocation=None):
        self.uid = uid
        self.name = name
        self.description = description
        self.actions = tuple(actions)
        self.indexes = tuple(indexes)
        self.expires_at = expires_at  # Instant or None (never)
        self.created_ns = created_ns
        self.updated_ns = updated_ns
        self.value = value  # derived hex value; None without a master key
        self.grants = grants(self.actions)
        self.is_global = "*" in self.indexes
        self._stored = None  # stored_json(), once computed
        self.restrictions = restrictions  # Restrictions, or None: kept off the /keys API
        self.retirement = retirement  # Retirement of a rotated key, or None
        self.revocation = revocation  # TokenRevocation of its tenant tokens, or None

    def is_expired(self, now_ns=None):
        end = self.end_ns
        return end is not None and (time.time_ns() if now_ns is None else now_ns) >= end

    @property
    def end_ns(self):
        """When it stops working: its expiresAt or, rotated, its retiresAt
        (the earlier), or None: never."""
        deadlines = [self.expires_at.ns] if self.expires_at is not None else []
        if self.retirement is not None:
            deadlines.append(self.retirement.at_ns)
        return min(deadlines) if deadlines else None

    def expires_at_text(self):
        return format_rfc3339(self.expires_at) if self.expires_at else None

    def changed(self, changes, updated_ns):
        """A copy with `name`/`description` from `changes` and a new updatedAt."""
        return ApiKey(self.uid, changes.get("name", self.name),
                      changes.get("description", self.description), self.actions,
                      self.indexes, self.expires_at, self.created_ns, updated_ns, self.value,
                      restrictions=self.restrictions, retirement=self.retirement,
                      revocation=self.revocation)

    def with_restrictions(self, restrictions):
        return ApiKey(self.uid, self.name, self.description, self.actions, self.indexes,
                      self.expires_at, self.created_ns, self.updated_ns, self.value,
                      restrictions=restrictions, retirement=self.retirement,
                      revocation=self.revocation)

    def with_revocation(self, revocation):
        return ApiKey(self.uid, self.name, self.description, self.actions, self.indexes,
                      self.expires_at, self.created_ns, self.updated_ns, self.value,
                      restrictions=self.restrictions, retirement=self.retirement,
                      revocation=revocation)

    def successor(self, uid, value, now_ns):
        """The key a rotation makes: a new uid and value, all else the same
        (restrictions as they are, whatever fields they hold; no revocation:
        the old key's tokens do not verify with the new value)."""
        return ApiKey(uid, self.name, self.description, self.actions, self.indexes,
                      self.expires_at, now_ns, now_ns, value, restrictions=self.restrictions)

    def retiring(self, at_ns, replaced_by):
        return ApiKey(self.uid, self.name, self.description, self.actions, self.indexes,
                      self.expires_at, self.created_ns, self.updated_ns, self.value,
                      restrictions=self.restrictions,
                      retirement=Retirement(at_ns, replaced_by), revocation=self.revocation)

    def created_fields(self):
        """What a new key's history line says of it (never its value)."""
        return {"name": self.name, "description": self.description,
                "actions": list(self.actions), "indexes": list(self.indexes),
                "expiresAt": self.expires_at_text()}

    def to_json(self):
        """The key as upstream shows it, in upstream's field order."""
        shown = {
            "name": self.name,
            "description": self.description,
            "key": self.value,
            "uid": self.uid,
            "actions": list(self.actions),
            "indexes": list(self.indexes),
            "expiresAt": self.expires_at_text(),
            "createdAt": format_timestamp(self.created_ns),
            "updatedAt": format_timestamp(self.updated_ns),
        }
        if self.retirement is not None:  # only on a rotated key: the official clients ignore them
            shown["retiresAt"] = format_timestamp(self.retirement.at_ns)
            shown["replacedBy"] = self.retirement.replaced_by
        return shown

    def stored_json(self):
        """to_record() as compact JSON text, computed once: every write of
        the store includes every key, and re-encoding them each time is slow.
        (Always from the record, never from the file's text: a file edited
        by hand is written back whole.)"""
        if self._stored is None:
            self._stored = compact_json(self.to_record())
        return self._stored

    def to_record(self):
        """The key as stored: everything but the (derived, secret) value."""
        record = {
            "uid": self.uid, "name": self.name, "description": self.description,
            "actions": list(self.actions), "indexes": list(self.indexes),
            "expiresAt": self.expires_at_text(),
            "createdAt": self.created_ns, "updatedAt": self.updated_ns,
        }
        if self.restrictions is not None:
            record["restrictions"] = self.restrictions.to_record()
        if self.retirement is not None:
            record["retiresAt"] = self.retirement.at_ns
            record["replacedBy"] = self.retirement.replaced_by
        if self.revocation is not None:
            record["tokenRevocation"] = self.revocation.to_record()
        return record

    @classmethod
    def from_record(cls, record, derive):
        """A stored record -> ApiKey; ValueError says what is wrong with it.

        `derive` computes the value from the uid (see key_deriver), or is
        None without a master key.
        """
        if not isinstance(record, dict) or record.keys() - _OPTIONAL_RECORD_FIELDS \
                != _RECORD_FIELDS:
            raise ValueError("a key record needs exactly the fields %s"
                             % ", ".join(sorted(_RECORD_FIELDS)))
        uid = record["uid"]
        if not isinstance(uid, str) or not _CANONICAL_UUID_RE.match(uid):
            raise ValueError("bad uid %r" % (uid,))
        name, description = record["name"], record["description"]
        if not (name is None or isinstance(name, str)) \
                or not (description is None or isinstance(description, str)):
            raise ValueError("bad name or description in key %s" % uid)
        actions, indexes = record["actions"], record["indexes"]
        if not isinstance(actions, list) or not _valid_stored_actions(tuple(actions)):
            raise ValueError("bad actions in key %s" % uid)
        if not isinstance(indexes, list) or not _valid_stored_indexes(tuple(indexes)):
            raise ValueError("bad indexes in key %s" % uid)
        expires_at = record["expiresAt"]
        if expires_at is not None:
            expires_at = parse_expires_at(expires_at) if isinstance(expires_at, str) else None
            if expires_at is None:
                raise ValueError("bad expiresAt in key %s" % uid)
        created, updated = record["createdAt"], record["updatedAt"]
        if type(created) is not int or type(updated) is not int or created < 0 or updated < 0:
            raise ValueError("bad createdAt or updatedAt in key %s" % uid)
        return cls(uid, name, description, actions, indexes, expires_at, created, updated,
                   derive(uid) if derive is not None else None,
                   stored_restrictions(record.get("restrictions"), uid),
                   Retirement.from_record(record, uid),
                   TokenRevocation.from_record(record.get("tokenRevocation"), uid))


class Retirement(collections.namedtuple("Retirement", "at_ns replaced_by")):
    """A rotated key's end: it stops working at `at_ns` (then it is removed)
    and was replaced by the key of uid `replaced_by`."""

    @classmethod
    def from_record(cls, record, uid):
        """The record's retiresAt/replacedBy (both or neither), or None."""
        at_ns, replaced_by = record.get("retiresAt"), record.get("replacedBy")
        if at_ns is None and replaced_by is None:
            return None
        if type(at_ns) is not int or at_ns < 0 or not isinstance(replaced_by, str) \
                or not _CANONICAL_UUID_RE.match(replaced_by):
            raise ValueError("bad retiresAt or replacedBy in key %s" % uid)
        return cls(at_ns, replaced_by)


class Tombstone:
    """A deleted key, kept to be restored (KeyStore.restore): the key as it
    was, when it was deleted (ns) and by whom (a uid, "master" or LOCAL)."""

    __slots__ = ("key", "deleted_ns", "deleted_by", "_stored")

    def __init__(self, key, deleted_ns, deleted_by):
        self.key, self.deleted_ns, self.deleted_by = key, deleted_ns, deleted_by
        self._stored = None

    def to_json(self):
        """GET /keys/deleted's item: the key as GET /keys shows it, then
        `deletedAt` and `deletedBy`."""
        return dict(self.key.to_json(), deletedAt=format_timestamp(self.deleted_ns),
                    deletedBy=self.deleted_by)

    def stored_json(self):
        """The store's record (the key's, with deletedAt and deletedBy) as
        compact JSON, computed once."""
        if self._stored is None:
            self._stored = compact_json(dict(self.key.to_record(), deletedAt=self.deleted_ns,
                                             deletedBy=self.deleted_by))
        return self._stored

    @classmethod
    def from_record(cls, record, derive):
        """A record of the store's `deleted` section -> Tombstone; ValueError
        says what is wrong with it."""
        if not isinstance(record, dict):
            raise ValueError("a deleted key's record is not an object")
        record = dict(record)
        deleted_ns, deleted_by = record.pop("deletedAt", None), record.pop("deletedBy", None)
        key = ApiKey.from_record(record, derive)
        if type(deleted_ns) is not int or deleted_ns < 0 or not isinstance(deleted_by, str):
            raise ValueError("bad deletedAt or deletedBy in deleted key %s" % key.uid)
        return cls(key, deleted_ns, deleted_by)


DEFAULT_TOMBSTONE_DAYS = 30  # how long a deleted key can be restored (serve --tombstone-days)
MAX_TOMBSTONE_DAYS = 3650
MAX_TOMBSTONES = 1000  # deleted keys kept at most (the latest), as Algolia restores
LOCAL = "local"  # who made a change through the library (the default keys of a new store)
MAX_REVOKED_TOKENS = 1000  # tokens revoked singly and not expired yet, per key
IAT_LEEWAY = 60  # seconds a token's iat may be ahead of this clock (the signer's may be)


class TokenRevocation(collections.namedtuple("TokenRevocation", "issued_before denied")):
    """What is revoked of a key's tenant tokens: every token issued (`iat`,
    Unix seconds) before `issued_before` (None: none), and the tokens of
    `denied` ({SHA-256 of the token, hex: its exp}) until their exp."""

    def refusal(self, claims, token, now):
        """None, or the ApiError for a token (`claims` verified) this revokes
        at `now` (Unix seconds). An `iat` in the future (past IAT_LEEWAY)
        counts as none: a token signed to outlive every revocation by time
        is revoked by the first."""
        iat = claims["iat"]
        if iat is not None and iat > now + IAT_LEEWAY:
            iat = None
        if self.issued_before is not None and (iat is None or iat < self.issued_before):
            return refused("revoked", invalid_api_key(
                "This tenant token was revoked: its API key's tokens issued before %s no "
                "longer work%s." % (format_timestamp(self.issued_before * 10 ** 9),
                                    "" if iat is not None else
                                    " (a token without `iat` counts as issued before)")))
        if self.denied and token_digest(token) in self.denied:
            return refused("revoked", invalid_api_key("This tenant token was revoked."))
        return None

    def pruned(self, now):
        """This revocation without the denied tokens expired at `now`
        (Unix seconds), or None when nothing is left of it."""
        denied = {digest: exp for digest, exp in self.denied.items() if exp >= now}
        if self.issued_before is None and not denied:
            return None
        return TokenRevocation(self.issued_before, denied)

    def to_json(self):
        return {"issuedBefore": None if self.issued_before is None else
                format_timestamp(self.issued_before * 10 ** 9),
                "revokedTokens": len(self.denied)}

    def to_record(self):
        return {"issuedBefore": self.issued_before, "denied": dict(self.denied)}

    @classmethod
    def from_record(cls, record, uid):
        if record is None:
            return None
        try:
            issued_before, denied = record["issuedBefore"], record["denied"]
            if record.keys() != {"issuedBefore", "denied"} or not (
                    issued_before is None or type(issued_before) is int) \
                    or not all(_SHA256_HEX_RE.match(d) and type(exp) is int
                               for d, exp in denied.items()):
                raise ValueError
        except (ValueError, TypeError, KeyError, AttributeError):
            raise ValueError("bad tokenRevocation in key %s" % uid)
        return cls(issued_before, dict(denied))


NO_REVOCATION = TokenRevocation(None, {})
_SHA256_HEX_RE = re.compile(r"[0-9a-f]{64}\Z")


def token_digest(token):
    """How a revoked token is kept: its SHA-256 (hex), never the token."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


@functools.lru_cache(maxsize=4096)
def _valid_stored_actions(actions):
    # cached: a large store has few distinct action lists
    return all(isinstance(a, str) and a in ACTION_SET for a in actions)


@functools.lru_cache(maxsize=4096)
def _valid_stored_indexes(indexes):
    return all(is_valid_index_pattern(i) for i in indexes)


_RECORD_FIELDS = frozenset(("uid", "name", "description", "actions", "indexes", "expiresAt",
                            "createdAt", "updatedAt"))
_OPTIONAL_RECORD_FIELDS = frozenset(("restrictions", "retiresAt", "replacedBy",
                                     "tokenRevocation"))


class KeyStore:
    """All keys in memory, indexed by uid and by derived value, optionally
    made durable in a StoreFile that any number of processes may share.

    A change holds this store's lock (against this process's threads) and
    the file's lock (against other processes) for the change alone, starts
    from the file's current content, and is written before it goes live.
    refresh(), called every STORE_POLL_SECONDS, takes in what other
    processes wrote. Readers (the per-request key lookup) never wait: keys
    are immutable and dict reads are atomic.
    """

    def __init__(self, master_key=None, path=None, log=None, master_key_changed=False,
                 tombstone_days=DEFAULT_TOMBSTONE_DAYS):
        self.derive = key_deriver(master_key) if master_key is not None else None
        # what the file records of the master key (--open: whatever it holds)
        self.fingerprint = master_key_fingerprint(master_key) if master_key else None
        self.log = log or (lambda message: None)
        self.clock = Clock()
        self._keys = {}       # uid -> ApiKey, oldest first
        self._by_value = {}   # derived value -> ApiKey
        self._retiring = {}   # uid -> when that rotated key stops working (ns)
        self._next_retirement = float("inf")  # the earliest of those
        self._tombstones = {}  # uid -> Tombstone of a deleted key, oldest deletion first
        self.tombstone_days = tombstone_days  # how long a deleted key can be restored; 0: not
        # reentrant: a change looks keys up, and a lookup may sweep out retired keys
        self._lock = threading.RLock()
        self._file = StoreFile(path, self.log) if path else None
        self._file_locked = False  # whether this process holds the file's lock
        self._unloadable = None  # (signature of a file that failed to load, whether logged)
        self.usage = Usage()
        self.history = KeyHistory(self._file and self._file.path, self.log)
        with self._lock:
            if self._file is None:
                self._create_defaults()
                return
            self._file.refuse_journal()
            self._file.lock()
            try:
                record = self._open(master_key_changed)
                self._file.remove_stale_temp_files()
                if not self._keys:
                    self._create_defaults()
                elif record or self._next_retirement <= time.time_ns():
                    self._tidy()
            finally:
                self._file.unlock()

    def _tidy(self):
        """At start, record the master key's fingerprint and drop retired
        keys now; if that write fails, the next change makes it."""
        try:
            self._commit_all((), ())
        except StoreWriteError as exc:
            self.log("searchkeys: warning: %s; the next change will save it" % exc)

    def _create_defaults(self):
        """Create the four keys a store without keys starts with, in one write."""
        keys = [self._new_key(new_uid(), name, description, actions, ["*"], None)
                for name, description, actions in DEFAULT_KEYS]
        self._commit_all(keys, ())
        for key in keys:
            self.history.append("create", key, LOCAL, key.created_fields())

    def _open(self, master_key_changed):
        """Load the file at start; whether its master key fingerprint is to be
        recorded now. Refuses another master key than the one the store's keys
        were made with (every key value would change), unless that is intended."""
        keys, stored = self._reload()
        if self.derive is None:  # --open: no key values at all; keep what is recorded
            return False
        if stored is None or not keys or hmac.compare_digest(stored, self.fingerprint):
            # a store without one (made with --open) records this one now: else a store that
            # never changes would take another master key silently at every start
            return stored != self.fingerprint
        if not master_key_changed:
            raise StoreError(
                "store %s was made with another master key, so every one of its %d keys would "
                "get a new value and every key handed out would stop working: start with the "
                "master key the store was made with, or add --master-key-changed if the change "
                "is intended" % (self._file.shown, len(keys)))
        self.log("searchkeys: warning: --master-key-changed: store %s was made with another "
                 "master key; its %d keys now have new values (the uids stay), and the store "
                 "records the new master key" % (self._file.shown, len(keys)))
        return True

    def _reload(self):
        """Load the file's current content if it is not the one in memory:
        (its keys, its master key fingerprint); StoreError if it cannot be
        used (memory then stays as it was). A missing file keeps memory too:
        the next change writes it anew."""
        data, signature, fd = self._file.read()
        if data is None or signature == self._file.loaded:
            if fd is not None:
                os.close(fd)
            return list(self._keys.values()), self.fingerprint
        usage = self._file.new_usage_only(data)
        if usage is not None:  # another process saved its usage counts
            try:
                section = json.loads(usage) if usage else None
            except (UnicodeDecodeError, ValueError) as exc:
                os.close(fd)
                raise StoreError("store %s is corrupt (not JSON: %s); the file is left "
                                 "untouched" % (self._file.shown, exc))
            self._load_usage(section)
            self._file.hold(fd, signature, data)
            return list(self._keys.values()), self.fingerprint
        try:
            records, stored, section, deleted = self._file.parse(data)
            if self.derive is not None and stored is not None and self._keys \
                    and not hmac.compare_digest(stored, self.fingerprint):
                raise StoreError("store %s now records another master key (a process was "
                                 "started with --master-key-changed): this process keeps the "
                                 "keys it holds; restart it with that master key"
                                 % self._file.shown)
            try:
                keys = self._build(records)
                tombstones = self._build_tombstones(deleted)
            except ValueError as exc:
                raise StoreError("store %s holds a bad key: %s" % (self._file.shown, exc))
        except BaseException:
            os.close(fd)
            raise
        self._install(keys, section)
        self._tombstones = tombstones
        if self.derive is None:
            self.fingerprint = stored
        self._file.hold(fd, signature, data)
        return keys, stored

    def _build(self, records):
        """The keys of `records`; a key unchanged since the last load is kept
        as it is (its value is not derived again)."""
        keys = []
        for position, record in enumerate(records):
            uid = record.get("uid") if isinstance(record, dict) else None
            old = self._keys.get(uid) if isinstance(uid, str) else None
            if old is None or old.stored_json() != compact_json(record):
                old = ApiKey.from_record(record, self.derive)
            keys.append(old)
            records[position] = None  # free the parsed record early
        return keys

    def _build_tombstones(self, records):
        """The Tombstones of the store's `deleted` section (None: none), by
        uid; one unchanged since the last load is kept as it is."""
        if records is None:
            return {}
        if not isinstance(records, list):
            raise ValueError("the deleted section is not a list")
        tombstones = {}
        for record in records:
            uid = record.get("uid") if isinstance(record, dict) else None
            old = self._tombstones.get(uid) if isinstance(uid, str) else None
            if old is None or old.stored_json() != compact_json(record):
                old = Tombstone.from_record(record, self.derive)
            tombstones[old.key.uid] = old
        return tombstones

    def _install(self, keys, section):
        """Make `keys` (and the usage totals of `section`) what memory holds."""
        if any(a.created_ns > b.created_ns for a, b in zip(keys, keys[1:])):
            keys = sorted(keys, key=lambda key: key.created_ns)  # newest-first listing needs it
        by_uid = {key.uid: key for key in keys}
        retiring = {key.uid: key.retirement.at_ns for key in keys if key.retirement is not None}
        self._by_value = {key.value: key for key in by_uid.values() if key.value is not None}
        self._keys, self._retiring = by_uid, retiring
        self._next_retirement = min(retiring.values(), default=float("inf"))
        if keys:
            self.clock.advance_past(max(key.created_ns for key in keys))
        self._load_usage(section)

    def _load_usage(self, section):
        for problem in self.usage.load(section, self._keys):
            self.log("searchkeys: warning: store %s: %s; counting afresh"
                     % (self._file.shown, problem))

    def refresh(self):
        """Take in a change another process made to the file. A file that
        cannot be loaded (one being written in place, half-written, is not a
        whole document) leaves memory as it is; it is logged once it stays
        so for a poll."""
        if self._file is None:
            return
        signature = self._file.signature()
        if signature in (None, self._file.loaded) or self._unloadable == (signature, True):
            return
        with self._lock:
            try:
                self._reload()
            except StoreError as exc:
                logged = self._unloadable == (signature, False)  # the second poll that failed
                self._unloadable = (signature, logged)
                if logged:
                    self.log("searchkeys: warning: %s; the keys loaded before stay in use"
                             % exc)

    # -- reads ---------------------------------------------------------------

    def __len__(self):
        return len(self._keys)

    def by_uid(self, uid):
        self.sweep()
        return self._keys.get(uid)

    def by_value(self, token):
        """The key whose value is `token` (hex, any case), or None.

        A hash lookup finds the one candidate; the final comparison is
        constant time.
        """
        if len(token) != 64 or not token.isascii():
            return None
        self.sweep()
        token = token.lower()
        key = self._by_value.get(token)
        if key is not None and hmac.compare_digest(key.value.encode(), token.encode()):
            return key
        return None

    def find(self, key_or_uid):
        """Resolve a /keys/{key_or_uid} path segment; 404 ApiError if none.
        A key not in memory is looked for again once the file's changes are
        taken in: one made a moment ago through another process is found (a
        script's next request may reach another worker)."""
        self.sweep()
        try:
            uid = parse_uuid(key_or_uid)
        except ValueError:
            uid = None
        for looked_again in (False, True):
            key = self.by_value(key_or_uid) if uid is None else self._keys.get(uid)
            if key is not None:
                return key
            if not looked_again:
                self.refresh()
        raise key_not_found(key_or_uid if uid is None else uid)

    def expiring(self, within_ns, now_ns):
        """The keys that stop working within `within_ns` of `now_ns` (not before it)."""
        return [key for key in list(self._keys.values())
                if key.end_ns is not None and now_ns < key.end_ns <= now_ns + within_ns]

    def page(self, offset, limit):
        """(keys newest first, skipping `offset`, at most `limit`; total)."""
        self.sweep()
        with self._lock:
            total = len(self._keys)
            start, stop = min(offset, total), min(offset + limit, total)
            return list(itertools.islice(reversed(self._keys.values()), start, stop)), total

    # -- writes --------------------------------------------------------------

    # Each change takes `actor`, who makes it, for the history: a key's uid,
    # "master" (the master key), or LOCAL (this process, through the library).

    def create(self, fields, actor=LOCAL):
        """Create a key from validated POST fields; 409 ApiError on a used uid."""
        with self._changing():
            uid = fields.get("uid")
            if uid is None:
                uid = self._unused_uid()
            elif uid in self._keys:
                raise ApiError(409, "api_key_already_exists",
                               "`uid` field value `%s` is already an existing API key." % uid)
            key = self._new_key(uid, fields.get("name"), fields.get("description"),
                                fields["actions"], fields["indexes"], fields.get("expiresAt"))
            self._commit(key)
            self.history.append("create", key, actor, key.created_fields())
            return key

    def update(self, key_or_uid, changes, actor=LOCAL):
        with self._changing():
            key = self.find(key_or_uid).changed(changes, self.clock.now_ns())
            self._commit(key)
            self.history.append("update", key, actor, dict(changes))
            return key

    def delete(self, key_or_uid, check=None, actor=LOCAL):
        """Delete a key, kept as a Tombstone for `tombstone_days` (see
        restore); `check(key)` may refuse it first, under the lock, on the
        key as the store holds it (another process may have changed it)."""
        with self._changing():
            key = self.find(key_or_uid)
            if check is not None:
                check(key)
            tombstones = dict(self._tombstones)
            tombstones.pop(key.uid, None)  # a uid deleted again: its latest deletion counts
            if self.tombstone_days:
                tombstones[key.uid] = Tombstone(key, time.time_ns(), actor)
            self._commit_all((), (key.uid,), tombstones)
            self.history.append("delete", key, actor, {})

    def restore(self, uid, actor=LOCAL):
        """Bring a deleted key back from its Tombstone: the same uid, value,
        restrictions and token revocations. 404 ApiError when none is kept,
        409 when its uid is a key again or it expired meanwhile."""
        with self._changing():
            tombstone = {t.key.uid: t for t in self.tombstones()}.get(uid)
            if tombstone is None:
                raise ApiError(404, "api_key_not_found", "API key `%s` not found among the "
                               "deleted keys, which are kept %d days." % (uid,
                                                                          self.tombstone_days))
            key = tombstone.key
            if uid in self._keys:
                raise ApiError(409, "api_key_already_exists", "`uid` field value `%s` is already "
                               "an existing API key: the deleted one cannot be restored." % uid)
            if key.is_expired():
                raise ApiError(409, "api_key_expired", "API key `%s` stopped working at %s, "
                               "while it was deleted: restored, it would work no more. Create "
                               "a new key instead." % (uid, format_timestamp(key.end_ns)))
            tombstones = dict(self._tombstones)
            del tombstones[uid]
            self._commit_all((key,), (), tombstones)
            self.history.append("restore", key, actor, {})
            return key

    def tombstones(self):
        """The deleted keys that can be restored (Tombstones), most recently
        deleted first."""
        return self._restorable(self._tombstones)

    def _restorable(self, tombstones):
        """Those of `tombstones` (by uid) within their days and among the
        MAX_TOMBSTONES deleted last, most recently deleted first."""
        if not self.tombstone_days:
            return []
        since = time.time_ns() - self.tombstone_days * DAY_NS
        kept = sorted((t for t in tombstones.values() if t.deleted_ns > since),
                      key=lambda tombstone: tombstone.deleted_ns, reverse=True)
        return kept[:MAX_TOMBSTONES]

    def purge_tombstones(self):
        """Drop from the file the Tombstones past their days (or past the
        MAX_TOMBSTONES newest); serve's keeper calls it, never a request.
        A failure is logged; the next change drops them."""
        if len(self.tombstones()) == len(self._tombstones):
            return
        try:
            with self._changing():
                self._commit_all((), ())
        except StoreWriteError as exc:
            self.log("searchkeys: warning: deleted keys past their %d days not purged: %s"
                     % (self.tombstone_days, exc))

    def restrict(self, key_or_uid, restrictions, actor=LOCAL):
        """Set (None: remove) a key's restrictions; its /keys fields stay as they are."""
        with self._changing():
            key = self.find(key_or_uid)
            self._commit(key.with_restrictions(restrictions))
            self.history.append("restrict", key, actor, {
                "restrictions": restrictions and restrictions.to_record()})
            return self._keys[key.uid]

    def rotate(self, key_or_uid, grace_seconds, check=None, actor=LOCAL):
        """A new key (new uid, all else the same) for the key `key_or_uid`,
        which keeps working for `grace_seconds`, then is removed. Both
        changes are one write. 409 for a key already rotated. `check(key)`
        as for delete."""
        with self._changing():
            old = self.find(key_or_uid)
            if check is not None:
                check(old)
            if old.retirement is not None:
                raise ApiError(409, "api_key_already_rotated", "API key `%s` was already rotated: "
                               "its replacement is `%s`, and it stops working at %s. Rotate the "
                               "replacement, or delete this key to stop it now." % (
                                   old.uid, old.retirement.replaced_by,
                                   format_timestamp(old.retirement.at_ns)))
            uid = self._unused_uid()
            now = self.clock.now_ns()
            new = old.successor(uid, self.derive(uid) if self.derive else None, now)
            # the uid may have been deleted before and created again (same value): that
            # deletion's tombstone would bring back the value rotated away
            tombstones = dict(self._tombstones)
            tombstones.pop(old.uid, None)
            retires = None
            if grace_seconds:  # by the wall clock: `now` is past every stored createdAt
                retires = time.time_ns() + grace_seconds * 10 ** 9
                self._commit_all([old.retiring(retires, uid), new], (), tombstones)
            else:
                self._commit_all([new], (old.uid,), tombstones)
            self.history.append("rotate", old, actor, {
                "replacedBy": uid, "retiresAt": retires and format_timestamp(retires)})
            return new

    def revoke_tokens(self, key_or_uid, issued_before, actor=LOCAL):
        """Revoke the key's tenant tokens issued before `issued_before` (Unix
        seconds; a later revocation's time wins over an earlier one's)."""
        with self._changing():
            key = self.find(key_or_uid)
            old = key.revocation or NO_REVOCATION
            before = max(issued_before, old.issued_before or issued_before)
            self._commit(key.with_revocation(
                TokenRevocation(before, old.denied).pruned(int(time.time()))))
            self.history.append("revoke-tokens", key, actor, {
                "issuedBefore": format_timestamp(before * 10 ** 9)})
            return self._keys[key.uid]

    def revoke_token(self, key_or_uid, token, exp, actor=LOCAL):
        """Deny one tenant token of the key (verified by the caller) until its `exp`."""
        with self._changing():
            key = self.find(key_or_uid)
            old = (key.revocation or NO_REVOCATION).pruned(int(time.time())) or NO_REVOCATION
            denied = dict(old.denied)
            denied[token_digest(token)] = exp
            if len(denied) > MAX_REVOKED_TOKENS:
                raise ApiError(400, "too_many_revoked_tokens", "API key `%s` already has %d "
                               "tokens revoked that have not expired: revoke all its tokens "
                               "issued before a time with `POST /keys/%s/revoke-tokens` instead."
                               % (key.uid, MAX_REVOKED_TOKENS, key.uid))
            self._commit(key.with_revocation(TokenRevocation(old.issued_before, denied)))
            self.history.append("revoke-token", key, actor, {"revokedTokens": len(denied)})
            return self._keys[key.uid]

    def sweep(self):
        """Remove the rotated keys whose grace period is over (they are
        refused already: see ApiKey.is_expired). Cheap when none is due."""
        if self._next_retirement > time.time_ns():
            return
        try:
            with self._changing():
                if self._next_retirement <= time.time_ns():  # not swept meanwhile
                    self._commit_all((), ())  # a write drops them
        except StoreWriteError as exc:  # they stay refused; try again in a minute
            self._next_retirement = time.time_ns() + 60 * 10 ** 9
            self.log("searchkeys: cannot remove retired keys: %s" % exc)

    def _unused_uid(self):
        uid = new_uid()
        while uid in self._keys:
            uid = new_uid()
        return uid

    def _new_key(self, uid, name, description, actions, indexes, expires_at):
        now = self.clock.now_ns()
        value = self.derive(uid) if self.derive is not None else None
        return ApiKey(uid, name, description, actions, indexes, expires_at, now, now, value)

    @contextlib.contextmanager
    def _changing(self):
        """Hold the store for one change: this process's other writers wait,
        and with a file every other process's too, and memory holds the
        file's current content (StoreWriteError if it cannot be read)."""
        with self._lock:
            if self._file is None or self._file_locked:
                yield
                return
            try:
                self._file.lock()
            except StoreError as exc:
                raise StoreWriteError(str(exc))
            self._file_locked = True
            try:
                try:
                    self._reload()
                except StoreError as exc:
                    raise StoreWriteError("%s; the change was not made" % exc)
                yield
            finally:
                self._file_locked = False
                self._file.unlock()

    def _commit(self, key, removed=None):
        """Write the store with `key` put (or uid `removed` deleted), then
        make the change live."""
        self._commit_all([key] if key is not None else [], [removed] if removed else [])

    def _commit_all(self, keys, removed, tombstones=None):
        """Write the store with `keys` put, the uids `removed` deleted, the
        rotated keys past their grace period dropped, and `tombstones` (None:
        the ones held) without those past their days, in one write, then make
        it live; StoreWriteError leaves everything as it was. The caller
        holds the store (_changing) or is the constructor."""
        now = time.time_ns()
        removed = set(removed) | {uid for uid, at_ns in self._retiring.items() if at_ns <= now}
        changed = {key.uid: key for key in keys}
        kept = [changed.get(uid, old) for uid, old in self._keys.items() if uid not in removed]
        added = [key for uid, key in changed.items() if uid not in self._keys]
        # an update keeps its place, a new key goes last: the file stays in createdAt order;
        # a restored key goes back to its place
        restored = kept and added and added[0].created_ns < kept[-1].created_ns
        kept_tombstones = {t.key.uid: t for t in reversed(self._restorable(
            self._tombstones if tombstones is None else tombstones))}  # oldest deletion first
        if self._file:
            ordered = sorted(kept + added, key=lambda key: key.created_ns) if restored \
                else kept + added
            self._write([key.stored_json() for key in ordered],
                        lambda uid: uid not in removed and uid in self._keys,
                        kept_tombstones.values())
        for key in keys:
            self._put(key)
        for uid in removed:
            self._remove(uid)
        if restored:
            self._keys = {key.uid: key for key in sorted(self._keys.values(),
                                                         key=lambda key: key.created_ns)}
        self._tombstones = kept_tombstones

    def _write(self, records, keep, tombstones):
        """Write `records` and `tombstones` with the usage totals of the
        uids `keep(uid)` holds."""
        totals, taken = self.usage.take(keep)
        try:
            self._file.write(records, usage_section(totals), self.fingerprint,
                             [tombstone.stored_json() for tombstone in tombstones])
        except StoreWriteError:
            self.usage.give_back(taken)  # still to be saved
            raise
        self.usage.saved(totals)

    def flush_usage(self):
        """Save the usage counts if there are some; a failure is logged and
        tried again at the next flush."""
        if not self._file or not self.usage.changed:
            return
        try:
            with self._changing():
                self._write(self._records(), self._keys.__contains__,
                            self._tombstones.values())
        except StoreWriteError as exc:
            self.log("searchkeys: warning: usage counts not saved: %s" % exc)

    def _put(self, key):
        old = self._keys.get(key.uid)
        if old is not None and old.value is not None:
            self._by_value.pop(old.value, None)
        self._keys[key.uid] = key
        if key.value is not None:
            self._by_value[key.value] = key
        self._note_retirement(key.uid, key.retirement and key.retirement.at_ns)

    def _remove(self, uid):
        old = self._keys.pop(uid, None)
        if old is not None and old.value is not None:
            self._by_value.pop(old.value, None)
        self.usage.forget(uid)
        self._note_retirement(uid, None)

    def _note_retirement(self, uid, at_ns):
        if at_ns is None and uid not in self._retiring:
            return  # the common case: no rotated key involved
        if at_ns is None:
            del self._retiring[uid]
        else:
            self._retiring[uid] = at_ns
        self._next_retirement = min(self._retiring.values(), default=float("inf"))

    def _records(self):
        return [key.stored_json() for key in self._keys.values()]

    def close(self):
        """Save the usage counts (the file is locked only for a change)."""
        self.flush_usage()


def new_uid():
    import uuid  # here: ~0.2 MiB and ~3 ms of start-up that only key creation needs
    return str(uuid.uuid4())


STORE_POLL_SECONDS = 0.25  # a change made by another process is taken in at most this late


class StoreFile:
    """The keys on disk: one JSON document, rewritten whole on each change.

    A write goes to a temp file in the same folder, is fsync'd, renamed over
    the store and the folder fsync'd, so the store is always either the old
    or the new document, and an acknowledged change survives kill -9 and
    power loss. A symlinked store is written through to its target (the
    link stays). Any number of processes share it: FILE.lock is held with
    flock for one change at a time, never for a process's life, and a
    process tells a new version by its signature (inode, size, mtime). The
    version a process holds in memory stays open, so its inode cannot be
    handed to a later version. Files are 0600 and hold uids and metadata,
    never key values, and a fingerprint of the master key (another one would
    change every value).
    """

    FORMAT = "searchkeys-store"
    VERSION = 1
    _HEADER = b'{"format": "%s", "version": %d, "keys": [\n' % (FORMAT.encode(), VERSION)
    _FINGERPRINTED_HEADER = b'{"format": "%s", "version": %d, "masterKeyFingerprint": "%%s", ' \
                            b'"keys": [\n' % (FORMAT.encode(), VERSION)

    def __init__(self, path, log):
        self.shown = path
        self.path = os.path.realpath(path)  # write through a symlink to its target
        self.folder = os.path.dirname(self.path)
        self.lock_path = self.path + ".lock"
        self.log = log
        self.loaded = None  # the signature of the version held in memory
        self._held = None  # that version, open
        self._keys_digest = None  # of that version's bytes up to its keys' end (_keys_end)
        self._lock_fd = None

    def refuse_journal(self):
        """Development builds (never a release) kept changes in FILE.journal:
        one there is refused in one sentence, and left alone."""
        journal = os.path.abspath(self.shown) + ".journal"
        if os.path.islink(journal):
            raise StoreError("%s is a symbolic link; refusing to follow it (a store keeps no "
                             "journal: remove it)" % journal)
        if os.path.lexists(journal):
            raise StoreError("store %s has a journal %s, which only development builds of "
                             "searchkeys wrote and this version does not read: remove it, or "
                             "start the build that wrote it once to fold it in"
                             % (self.shown, journal))

    def lock(self):
        """Wait for FILE.lock: one change at a time, across processes."""
        try:  # never through a link someone planted, 0600 from its creation
            fd = os.open(self.lock_path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            if os.path.islink(self.lock_path):
                raise StoreError("the lock file %s of store %s is a symbolic link; refusing to "
                                 "follow it (remove it)" % (self.lock_path, self.shown))
            raise StoreError("cannot open the lock file %s of store %s: %s"
                             % (self.lock_path, self.shown, exc.strerror or exc))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            os.close(fd)
            raise StoreError("cannot lock %s of store %s: %s"
                             % (self.lock_path, self.shown, exc.strerror or exc))
        self._lock_fd = fd

    def unlock(self):
        os.close(self._lock_fd)  # also drops the flock
        self._lock_fd = None

    def signature(self):
        """The store's (inode, device, size, mtime), or None if there is none."""
        try:
            return _signature(os.stat(self.path))
        except OSError:
            return None

    def read(self):
        """(the file's bytes, its signature, an open descriptor of it for
        hold()), or (None, None, None) if there is none."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None, None, None
        except OSError as exc:
            raise StoreError("cannot read store %s: %s" % (self.shown, exc.strerror or exc))
        try:
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                raise StoreError("store %s is a folder, not a file" % self.shown)
            if stat.S_IMODE(info.st_mode) & 0o077:
                self._tighten(fd, stat.S_IMODE(info.st_mode))
            with open(fd, "rb", closefd=False) as file:
                return file.read(), _signature(info), fd
        except OSError as exc:
            os.close(fd)
            raise StoreError("cannot read store %s: %s" % (self.shown, exc.strerror or exc))
        except BaseException:
            os.close(fd)
            raise

    def hold(self, fd, signature, data):
        """Note the version of `signature` (its bytes: `data`) as the one in
        memory and keep it open (`fd`), letting the last one go."""
        if self._held is not None:
            os.close(self._held)
        self._held, self.loaded = fd, signature
        end = _keys_end(data)
        self._keys_digest = None if end is None else hashlib.sha256(data[:end]).digest()

    def new_usage_only(self, data):
        """The usage section's text (b"" for none) if `data` differs from
        the version in memory in that section alone, else None.

        An optimization, measured: a process saves its usage counts every
        USAGE_FLUSH_SECONDS, and every other process sharing the store would
        otherwise load all its keys again each time (10,000 keys: ~60 ms on
        a quiet machine, 150-800 ms on a busy one; this check: a few ms).
        Safe: the bytes up to the keys' end are the same (by their SHA-256),
        and after them comes only write()'s tail."""
        end = _keys_end(data)
        if end is None or self._keys_digest is None \
                or hashlib.sha256(data[:end]).digest() != self._keys_digest:
            return None
        return data[end + len(_USAGE_TAIL):-2]

    def _tighten(self, fd, mode):
        try:
            os.fchmod(fd, 0o600)
            self.log("searchkeys: store file %s had mode %04o; now 0600" % (self.shown, mode))
        except OSError as exc:
            self.log("searchkeys: warning: store file %s has mode %04o and cannot be made "
                     "0600: %s" % (self.shown, mode, exc.strerror or exc))

    def parse(self, data):
        """(the key records, the master key fingerprint or None, the usage
        section or None, the deleted keys' records or None) of a store
        document; StoreError if it is not one."""
        try:
            document = json.loads(data)
        except (UnicodeDecodeError, ValueError) as exc:
            raise StoreError("store %s is corrupt (not JSON: %s); the file is left untouched"
                             % (self.shown, exc))
        if not isinstance(document, dict) or document.get("format") != self.FORMAT \
                or document.get("version") != self.VERSION \
                or not isinstance(document.get("keys"), list):
            raise StoreError("store %s is not a searchkeys store (format %s, version %d); the "
                             "file is left untouched" % (self.shown, self.FORMAT, self.VERSION))
        fingerprint = document.get("masterKeyFingerprint")
        if fingerprint is not None and not (isinstance(fingerprint, str)
                                            and _FINGERPRINT_RE.match(fingerprint)):
            raise StoreError("store %s has a bad masterKeyFingerprint; the file is left "
                             "untouched" % self.shown)
        return document["keys"], fingerprint, document.get("usage"), document.get("deleted")

    def remove_stale_temp_files(self):
        # temp files of a process killed mid-write: the lock is held, so no one writes one now
        prefix = os.path.basename(self.path) + ".tmp-"
        try:
            names = [name for name in os.listdir(self.folder) if name.startswith(prefix)]
            for name in names:
                os.unlink(os.path.join(self.folder, name))
        except OSError:
            pass  # harmless leftovers; the next start tries again

    def write(self, records, usage=None, fingerprint=None, deleted=()):
        """Replace the document with `records` (JSON texts, one a line), the
        `deleted` keys' records (the same; the section left out when empty),
        the `usage` section (left out when empty) and the master key's
        `fingerprint` atomically, or raise StoreWriteError leaving it as it was."""
        temp = "%s.tmp-%d-%s" % (self.path, os.getpid(), secrets.token_hex(4))
        header = self._HEADER if fingerprint is None \
            else self._FINGERPRINTED_HEADER % fingerprint.encode()
        body = ",\n".join(records).encode("utf-8")
        data = header + body + (b"\n]" if records else b"]")
        if deleted:  # before usage: _keys_end's digest covers it
            data += b',\n"deleted": [\n' + ",\n".join(deleted).encode("utf-8") + b"\n]"
        if usage:
            data += b',\n"usage": ' + compact_json(usage).encode("utf-8")
        data += b"}\n"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _write_all(fd, data)
                os.fsync(fd)
                info = os.fstat(fd)
                os.replace(temp, self.path)
            except OSError:
                os.close(fd)
                raise
        except OSError as exc:
            try:
                os.unlink(temp)
            except OSError:
                pass
            raise StoreWriteError("cannot write store %s: %s" % (self.path, exc.strerror or exc))
        self.hold(fd, _signature(info), data)
        self._sync_folder(self.folder)

    def _sync_folder(self, folder):
        """fsync a folder after a rename. The change is made once that
        succeeded (the file holds it, and so must memory); a failed sync only
        leaves it less durable, so it is logged, not raised."""
        try:
            _fsync_folder(folder)
        except OSError as exc:
            self.log("searchkeys: warning: cannot sync folder %s (the change to %s is made, but "
                     "may not survive a power loss): %s"
                     % (folder, self.shown, exc.strerror or exc))


def _write_all(fd, data):
    """os.write until all of `data` is written (a write may be partial)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


_USAGE_TAIL = b'\n],\n"usage": '


def _keys_end(data):
    """Where the keys (and the deleted keys after them) of a document in
    write()'s layout end (its last "\n]", then "}\n" or the usage section:
    compact JSON has no newline), or None if `data` is not in that layout."""
    end = data.rfind(b"\n]")
    tail = data[end:]
    if end < 0 or not (tail == b"\n]}\n"
                       or tail.startswith(_USAGE_TAIL) and tail.endswith(b"}\n")):
        return None
    return end


def _signature(info):
    return (info.st_ino, info.st_dev, info.st_size, info.st_mtime_ns)


def _fsync_folder(folder):
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


MAX_HISTORY_BYTES = 4 * 1024 * 1024  # past this, FILE.history becomes FILE.history.1
MAX_HISTORY_LINE = 4096  # bytes of a line; reading the last lines begins one line early
MAX_HISTORY_NAME = 256  # characters of a key's name kept on a line too long to keep whole
_HISTORY_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # a FIFO: no wait


class KeyHistory:
    """Who changed which key, when and how: one JSON line per change, appended
    beside the store (FILE.history, 0600, opened without following a link),
    or, without a store file, the last MAX_HISTORY_BYTES of lines in memory.

    A line holds `at`, `change` (create, update, restrict, rotate, delete,
    restore, revoke-tokens or revoke-token), the key's `uid` and
    `name`, `by` (the uid of the key that made it, "master" or LOCAL) and
    `fields` (what changed: names and new values; never a key's value or a
    token). The KeyStore appends it once the change is written, while it
    holds the store's lock, so lines follow the order of changes and one
    process at a time appends, each line in one write (O_APPEND) and
    fsync'd before the answer. The change is what counts: a line that
    cannot be appended is logged and counted (`failures`), never undoes it.
    Bounded: past MAX_HISTORY_BYTES the file is renamed FILE.history.1
    (replacing the one before), so the last 4-8 MiB are kept."""

    def __init__(self, store_path, log):
        self.path = store_path and store_path + ".history"
        self.log = log
        self.failures = 0  # lines that could not be appended, in this process
        self._memory = None if self.path else collections.deque()  # lines, oldest first
        self._memory_bytes = 0
        self._memory_lock = threading.Lock()

    def append(self, change, key, by, fields):
        line = history_line({"at": format_timestamp(time.time_ns()), "change": change,
                             "uid": key.uid, "name": key.name, "by": by, "fields": fields})
        if self._memory is not None:
            with self._memory_lock:
                self._memory.append(line)
                self._memory_bytes += len(line)
                while self._memory_bytes > MAX_HISTORY_BYTES:
                    self._memory_bytes -= len(self._memory.popleft())
            return
        try:
            self._append_line(line)
        except OSError as exc:
            self.failures += 1
            self.log("searchkeys: warning: key %s was changed (%s), but the line saying so could "
                     "not be added to %s: %s" % (key.uid, change, self.path,
                                                 _history_error(exc)))

    def _append_line(self, line):
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _HISTORY_OPEN, 0o600)
        try:
            info = _regular_file(fd)
            if stat.S_IMODE(info.st_mode) & 0o077:
                os.fchmod(fd, 0o600)
            if os.write(fd, line) != len(line):
                raise OSError("the line was written in part")
            os.fsync(fd)
        finally:
            os.close(fd)
        folder = os.path.dirname(self.path)
        if info.st_size + len(line) > MAX_HISTORY_BYTES:
            os.replace(self.path, self.path + ".1")
            _fsync_folder(folder)
        elif info.st_size == 0:  # a new file: its name must survive a power loss too
            _fsync_folder(folder)

    def entries(self, uid=None):
        """The changes (of the key `uid`, or all), newest first: the key's
        own, and a rotation that replaced a key by it. StoreError if the
        file cannot be read."""
        if self._memory is not None:
            with self._memory_lock:
                blobs = [b"".join(self._memory)]
        else:
            blobs = self._read_files()
        entries = [entry for data in blobs for entry in _history_entries(data, uid)]
        if uid is not None:
            entries = [entry for entry in entries if uid in (
                entry["uid"], entry["fields"].get("replacedBy"))]
        entries.reverse()
        return entries

    def _read_files(self):
        """The bytes of FILE.history.1 then FILE.history (the last
        MAX_HISTORY_BYTES of each, cut at a line's start): the current file is
        opened first, so a rotation meanwhile is seen once, not twice."""
        opened = []
        try:
            for path in (self.path, self.path + ".1"):
                try:
                    fd = os.open(path, os.O_RDONLY | _HISTORY_OPEN)
                except FileNotFoundError:
                    continue
                opened.append(fd)
                info = _regular_file(fd)
                if any(_signature(os.fstat(other))[:2] == _signature(info)[:2]
                       for other in opened[:-1]):
                    opened.pop()
                    os.close(fd)
            blobs = []
            for fd in reversed(opened):
                size = os.fstat(fd).st_size
                start = max(0, size - MAX_HISTORY_BYTES - MAX_HISTORY_LINE)
                data = os.pread(fd, size - start, start)
                blobs.append(data[data.find(b"\n") + 1:] if start else data)
            return blobs
        except OSError as exc:
            raise StoreError("cannot read the history %s: %s"
                             % (self.path, _history_error(exc)))
        finally:
            for fd in opened:
                os.close(fd)


def history_line(entry):
    """A history entry as one line of at most MAX_HISTORY_LINE bytes: when
    it would be longer, its name is cut (to MAX_HISTORY_NAME characters and
    "..."), then, if that is not enough, its values are left out (`fields`
    null each, `valuesLeftOut`: restrictions may reach 16 KiB)."""
    def encoded(entry):
        return (compact_json(entry) + "\n").encode("utf-8", "surrogatepass")
    line, name = encoded(entry), entry["name"]
    if len(line) > MAX_HISTORY_LINE and name and len(name) > MAX_HISTORY_NAME:
        entry = dict(entry, name=name[:MAX_HISTORY_NAME] + "...")
        line = encoded(entry)
    if len(line) > MAX_HISTORY_LINE:
        entry = dict(entry, fields=dict.fromkeys(entry["fields"]), valuesLeftOut=True)
        line = encoded(entry)
    return line


def _history_entries(data, uid):
    """The entries of history lines `data` (of key `uid` only, when given,
    as a quick test before parsing); a line that is not one is skipped."""
    needle = uid.encode() if uid is not None else b""
    for line in data.splitlines():
        if needle not in line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("uid"), str) \
                and isinstance(entry.get("fields"), dict):
            yield entry


def _regular_file(fd):
    """os.fstat of `fd`, which must be a regular file (not a FIFO or device
    planted in its place)."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise OSError("not a regular file")
    return info


def _history_error(exc):
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        return "it is a symbolic link, which is not followed (remove it)"
    return exc.strerror or str(exc)


# =============================================================================
# Forwarding: one Upstream on http.client, with a shared connection pool
# =============================================================================

HOP_BY_HOP = frozenset(("connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                        "proxy-authorization", "te", "trailer", "trailers",
                        "transfer-encoding", "upgrade"))
# Request headers the proxy sets itself.
NOT_FORWARDED = HOP_BY_HOP | {"host", "authorization", "content-length", "expect"}
# Meilisearch believes these from its network peers (a remote's search, an
# import): a caller must not send them with our backend key.
NETWORK_HEADER_PREFIXES = ("x-meili-proxy-", "meili-proxy-")
# Answer headers not relayed as is: this hop frames the body itself, and a
# filtered answer is re-encoded as plain JSON.
NOT_RELAYED = HOP_BY_HOP | {"content-length"}
NOT_RELAYED_FILTERED = NOT_RELAYED | {"content-encoding"}
MAX_UPSTREAM_JSON = 256 * 1024 * 1024  # backend answers the handler rules read whole


def _kept_headers(headers, dropped):
    """`headers` as (name, value) pairs, without the names in `dropped` and
    those the Connection header lists (hop-by-hop too)."""
    for name, value in headers:
        if name.lower() == "connection":
            dropped = dropped | {token.strip().lower() for token in value.split(",")}
    return [(name, value) for name, value in headers if name.lower() not in dropped]


MAX_INTERIM_ANSWERS = 16  # 1xx heads a backend may send before its answer


class BackendResponse(http.client.HTTPResponse):
    """http.client's answer, its head read by read_head, not email.parser.
    An optimization, measured: parsing a backend's answer head with email
    cost a guarded search ~120,000 instructions, 16 % of it (bench/README.md,
    "round five"). `begin` is http.client's, but for that line and the
    interim answers: a head read_head refuses (a folded line...) fails the
    answer (502); every 1xx before the answer is skipped, as RFC 9110 (15.2)
    asks, not 100 alone (http.client takes a 103 Early Hints for the answer,
    and the answer that follows for the next request's on the pooled
    connection: another caller's); a 101 fails it, for an upgrade the
    guard never asks for (it forwards no Upgrade)."""

    def begin(self):
        if self.headers is not None:
            return
        version, status, reason = self._read_status()
        interim = 0
        while 100 <= status < 200:  # an interim answer: its head is skipped
            interim += 1
            if status == http.client.SWITCHING_PROTOCOLS:
                raise http.client.HTTPException("its answer: an upgrade never asked for")
            if interim > MAX_INTERIM_ANSWERS:  # endless: it would hold this thread
                raise http.client.HTTPException("its answer: interim answers without end")
            self._read_head()
            version, status, reason = self._read_status()
        self.code = self.status = status
        self.reason = reason.strip()
        if version in ("HTTP/1.0", "HTTP/0.9"):
            self.version = 10
        elif version.startswith("HTTP/1."):
            self.version = 11
        else:
            raise http.client.UnknownProtocol(version)
        self.headers = self.msg = self._read_head()
        encoding = self.headers.get("transfer-encoding")
        self.chunked = bool(encoding) and encoding.lower() == "chunked"
        self.chunk_left = None
        self.will_close = self._check_close()
        self.length = None
        if len({value.strip() for value in self.headers.get_all("content-length", ())}) > 1:
            raise http.client.HTTPException("its answer: conflicting Content-Length headers")
        length = self.headers.get("content-length")
        if length and not self.chunked:
            try:
                self.length = int(length)
            except ValueError:
                pass
            else:
                if self.length < 0:  # ignored, as http.client does
                    self.length = None
        if status in (204, 304) or self._method == "HEAD":
            self.length = 0
        if not self.will_close and not self.chunked and self.length is None:
            self.will_close = True  # the body ends when the backend closes

    def _read_head(self):
        try:
            return read_head(self.fp, MAX_HEAD)
        except BadHead as exc:
            raise http.client.HTTPException("its answer's head: %s" % exc)


class UpstreamError(Exception):
    """The backend could not be reached, or answered something that is not HTTP."""


def upstream_unreachable(upstream, reason):
    """502 that names no internal address nor exception (the log has them)."""
    upstream.log("searchkeys: the search backend at %s could not be reached: %s"
                 % (upstream.display_url, printable(str(reason))))
    return ApiError(502, "upstream_unavailable", "The search backend is unavailable.",
                    "system")


def no_upstream():
    return ApiError(501, "no_upstream",
                    "searchkeys runs without --upstream: there is no search backend to "
                    "forward the request to.", "system")


def _readable(sock, wait=0.0):
    """Has `sock` data or an EOF waiting (the backend closed an idle one),
    or within `wait` seconds? poll() where there is one: select() fails on
    descriptors past 1023."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(wait * 1000))
    return bool(select.select([sock], [], [], wait)[0])


# What a pooled connection the backend closed (a keep-alive timeout, a
# restart) fails with before any byte of an answer: the only failures retried.
CLOSED_BY_BACKEND = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


class Upstream:
    """The search backend: keep-alive http.client connections shared by all
    callers. A request is sent at most once, unless it is safe to repeat
    and its body is at hand: then, when a pooled connection turns out to be
    closed before any answer came, it is sent once more on a new one (never
    after a timeout: the backend may still be working on it)."""

    def __init__(self, base_url, api_key=None, timeout=300.0, pool_size=64, log=None,
                 metrics=None):
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("--upstream must be an http:// or https:// URL, got %r" % base_url)
        self.host_header = parts.netloc.rpartition("@")[2]  # without any user:password@
        self.display_url = "%s://%s" % (parts.scheme, self.host_header)
        self.prefix = parts.path.rstrip("/")
        self.authorization = "Bearer " + api_key if api_key else None
        self.timeout = timeout
        self.pool_size = pool_size
        self.tls = parts.scheme == "https"
        self.address = (parts.hostname, parts.port or (443 if self.tls else 80))
        self.log = log or (lambda message: None)
        self.metrics = metrics or Metrics()  # latency and errors, for /metrics
        self._idle = []
        self._lock = threading.Lock()

    def _connection(self, check, fresh=False):
        """(connection, reused): a pooled connection or (`fresh`) a new one.
        With `check` (a request that may not be repeated), a pooled
        connection the backend closed while idle is dropped before anything
        is sent."""
        while True:
            connection = None
            if not fresh:
                with self._lock:
                    connection = self._idle.pop() if self._idle else None
            if connection is None:
                if self.tls:
                    import ssl  # here: a Python built without ssl still serves http backends
                    connection = http.client.HTTPSConnection(
                        *self.address, timeout=self.timeout,
                        context=ssl.create_default_context())
                else:
                    connection = http.client.HTTPConnection(*self.address, timeout=self.timeout)
                connection.response_class = BackendResponse
                return connection, False
            if not check or not _readable(connection.sock):
                return connection, True
            connection.close()

    def _release(self, connection):
        with self._lock:
            if len(self._idle) < self.pool_size:
                self._idle.append(connection)
                return
        connection.close()

    def headers_for(self, incoming, keep_encoding=True):
        """The caller's headers minus hop-by-hop ones and its credential, plus ours."""
        dropped = NOT_FORWARDED if keep_encoding else NOT_FORWARDED | {"accept-encoding"}
        headers = [(name, value) for name, value in _kept_headers(incoming, dropped)
                   if not name.lower().startswith(NETWORK_HEADER_PREFIXES)]
        headers.append(("Host", self.host_header))
        if self.authorization:
            headers.append(("Authorization", self.authorization))
        return headers

    def send(self, method, target, headers, body, repeatable):
        """Send one request: (connection, http.client.HTTPResponse), head read.
        `headers` go as they are, repeated ones included; `body` is bytes,
        or an iterable of chunks sent as they come (with the Content-Length
        in `headers`, or chunked)."""
        at_hand = isinstance(body, bytes)
        chunked = not at_hand and not any(n.lower() == "content-length" for n, _ in headers)
        if at_hand and (body or method in ("POST", "PUT", "PATCH")):
            headers = headers + [("Content-Length", str(len(body)))]
        elif chunked:
            headers = headers + [("Transfer-Encoding", "chunked")]
        started, retried = time.monotonic(), False
        while True:  # once more only for a reused connection the backend had closed
            connection, reused = self._connection(not (repeatable and at_hand), retried)
            try:
                connection.putrequest(method, self.prefix + target, skip_host=True,
                                      skip_accept_encoding=True)
                for name, value in headers:
                    connection.putheader(name, value)
                connection.endheaders(body or None, encode_chunked=chunked)
                response = connection.getresponse()
                self.metrics.observe_backend(time.monotonic() - started)
                return connection, response
            except BrokenBody:  # the caller's body broke off: the backend got half a request
                connection.close()
                raise
            except (OSError, http.client.HTTPException) as exc:
                connection.close()
                if not (repeatable and at_hand and reused and not retried and
                        isinstance(exc, CLOSED_BY_BACKEND)):
                    self.metrics.backend_error(exc)
                    raise UpstreamError("%s: %s" % (type(exc).__name__, exc) if str(exc)
                                        else type(exc).__name__)
                retried = True

    def finish(self, connection, response):
        """After a fully read answer: keep the connection for the next request."""
        response.close()  # read1 leaves a finished answer open, and the connection unusable
        if response.will_close or connection.sock is None:
            connection.close()
        else:
            self._release(connection)

    def fetch_json(self, target):
        """GET `target` with the upstream key: (status, JSON value or None).
        Used by the handler rules, e.g. to learn which indexes exist."""
        headers = [("Accept", "application/json"), ("Host", self.host_header)]
        if self.authorization:
            headers.append(("Authorization", self.authorization))
        try:
            connection, response = self.send("GET", target, headers, b"", True)
            data = response.read(MAX_UPSTREAM_JSON)
        except (UpstreamError, OSError, http.client.HTTPException) as exc:
            raise upstream_unreachable(self, exc)
        self.finish(connection, response)
        try:
            return response.status, json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return response.status, None

    def forward(self, method, target, headers, body, repeatable, answer_filter=None):
        """The backend's answer to one request, as a Response: whole when it
        is small or filtered (`answer_filter` rewrites a 200 JSON answer),
        else streamed through as it arrives."""
        try:
            connection, response = self.send(method, target, headers, body, repeatable)
        except UpstreamError as exc:
            raise upstream_unreachable(self, exc)
        try:
            headers = list(response.getheaders())
            if answer_filter is not None and response.status == 200:
                data = self._filtered(response, answer_filter)
                headers = _kept_headers(headers, NOT_RELAYED_FILTERED)
                if not any(name.lower() == "content-type" for name, _ in headers):
                    headers.append(("Content-Type", "application/json"))
            elif response.length is not None and response.length <= SMALL_BODY \
                    or response.status in (204, 304):
                data = response.read()
                headers = _kept_headers(headers, NOT_RELAYED)
            else:
                return Response(response.status, _kept_headers(headers, NOT_RELAYED),
                                stream=self._relay(connection, response),
                                length=response.length)
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            self.metrics.backend_error(exc)
            raise upstream_unreachable(self, "its answer broke off: %s" % type(exc).__name__)
        except BaseException:
            connection.close()
            raise
        self.finish(connection, response)
        return Response(response.status, headers, data)

    @staticmethod
    def _filtered(response, answer_filter):
        data = response.read(MAX_UPSTREAM_JSON + 1)
        try:
            if len(data) > MAX_UPSTREAM_JSON:
                raise ValueError("too large")
            return compact_json(answer_filter(json.loads(data.decode("utf-8")))).encode()
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise ApiError(502, "upstream_unavailable", "The search backend's answer is not "
                           "JSON; it cannot be filtered for this key.", "system")

    def _relay(self, connection, response):
        """The answer's body, piece by piece as the backend sends it; the
        connection is kept only if the whole answer went through."""
        done = False
        try:
            while True:
                data = response.read1(SMALL_BODY)
                if not data:
                    break
                yield data
            done = True
        finally:
            if done:
                self.finish(connection, response)
            else:
                connection.close()


# =============================================================================
# Key restrictions (pure): rate specs, referrer patterns, IP ranges, client
# addresses, and the bounded counters that rate limits keep (the hit caps a
# key's maxHitsPerQuery puts on a search are with the handler rules)
# =============================================================================

RESTRICTION_FIELDS = ("rateLimit", "allowedReferrers", "allowedIps", "maxHitsPerQuery",
                      "forcedParameters", "maxConcurrentSearches", "allowBrowser")
MAX_CONCURRENT_SEARCHES = 10000  # the largest maxConcurrentSearches
RATE_FIELDS = ("perIp", "perKey")
RATE_WINDOWS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
_RATE_RE = re.compile(r"([1-9][0-9]{0,8})/(second|minute|hour|day)\Z")
MAX_RESTRICTION_ITEMS = 100  # referrer patterns or IP ranges on one key
MAX_REFERRER_PATTERN = 512
MAX_REFERRER = 4096  # bytes of an Origin or Referer looked at (browsers send at most 4096)
# What `keys restrict --preset search` sets on a public search key: a visitor
# typing fires a query per keystroke (bursts up to the limit are let through),
# and no results page needs more than 100 hits.
RESTRICTION_PRESETS = {"search": {"rateLimit": {"perIp": "120/minute"}, "maxHitsPerQuery": 100}}


class Rate(collections.namedtuple("Rate", "count window text")):
    """`count` requests per `window` seconds, written `text` (`60/minute`)."""

    @property
    def interval(self):
        return self.window / self.count


def parse_rate(text):
    """`60/minute` -> Rate; ValueError otherwise."""
    match = _RATE_RE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError("`%s` is not a rate: write COUNT/second, COUNT/minute, COUNT/hour or "
                         "COUNT/day, with COUNT from 1 to 999999999 (e.g. `60/minute`)" % (text,))
    return Rate(int(match.group(1)), RATE_WINDOWS[match.group(2)], text)


def referrer_pattern(text):
    """A parsed allowedReferrers pattern: `*` stands for any text. A
    pattern with `://` is matched against the whole URL, one without it
    (`*.example.org`) against the host only; both ignore case."""
    if not isinstance(text, str) or not text.strip("*") or len(text) > MAX_REFERRER_PATTERN \
            or not (text.isascii() and text.isprintable()) or " " in text:
        raise ValueError("`%s` is not a referrer pattern: give a URL or host name in which "
                         "`*` stands for any text, e.g. `https://example.com/*` or "
                         "`*.example.org`" % (text,))
    text = text.lower()
    if "://" not in text:
        return tuple(text.split("*")), False, None
    scheme, _, rest = text.partition("://")
    site = scheme + "://" + rest.split("/", 1)[0]
    return tuple(text.split("*")), True, tuple(site.split("*"))


def wildcard_match(pieces, subject):
    """Does `subject` read as pieces[0] * pieces[1] * ... (pieces joined by
    any text)? Greedy, left to right: each piece is found once, so the time
    is linear in the subject (a regex with several `.*` backtracks)."""
    first, last = pieces[0], pieces[-1]
    if len(pieces) == 1:
        return subject == first
    if len(subject) < len(first) + len(last) or not subject.startswith(first) \
            or not subject.endswith(last):
        return False
    position, end = len(first), len(subject) - len(last)
    for piece in pieces[1:-1]:
        found = subject.find(piece, position, end)
        if found < 0:
            return False
        position = found + len(piece)
    return True


def _url_parts(url):
    """(host, `scheme://host[:port]`) of a URL, or (None, None) when it has
    no host or is malformed (`http://[::1/`)."""
    try:
        parts = urllib.parse.urlsplit(url) if "://" in url else None
        if parts is None or not parts.hostname:
            return None, None
        return parts.hostname, parts.scheme + "://" + parts.netloc.rpartition("@")[2]
    except ValueError:
        return None, None


def referrer_allowed(patterns, origin, referer):
    """Does Origin or Referer (either may be None) match one of `patterns`?
    A whole-URL pattern must also match the URL's own site (scheme, host,
    port), so a `*` cannot reach across into a path the sending page
    chooses (`https://evil.com/.example.com/`). Values longer than
    MAX_REFERRER never do."""
    urls = [u for u in ((origin + "/") if origin else None, referer) if u]
    if any(len(url) > MAX_REFERRER for url in urls):
        return False
    for url in urls:
        url = url.lower()
        host, site = _url_parts(url)
        if host is None:
            continue
        for pieces, whole_url, site_pieces in patterns:
            if whole_url and wildcard_match(pieces, url) and wildcard_match(site_pieces, site):
                return True
            if not whole_url and wildcard_match(pieces, host):
                return True
    return False


def ip_range(text):
    """`10.0.0.0/8`, `2001:db8::/32` or one address -> ip_network; ValueError otherwise."""
    try:
        if not isinstance(text, str):
            raise ValueError("not a string")
        return ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        raise ValueError("`%s` is not an IP range: %s (write e.g. `10.0.0.0/8`, "
                         "`2001:db8::/32` or one address)" % (text, exc))


@functools.lru_cache(maxsize=4096)
def parse_address(text):
    """An IP address (IPv4-mapped IPv6 as IPv4), or None for anything else."""
    try:
        address = ipaddress.ip_address(text.strip().strip("[]"))
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


def in_ranges(address, ranges):
    return address is not None and any(address in network for network in ranges)


def client_address(peer, forwarded_for, trusted):
    """The caller's address: the socket's `peer`, unless that is a trusted
    proxy; then the right-most X-Forwarded-For entry (`forwarded_for`, all
    such headers joined) that is not a trusted proxy. An entry that is not
    an address stops the walk at the last trusted hop, which wrote it."""
    address = parse_address(peer)
    if not trusted or not in_ranges(address, trusted) or not forwarded_for:
        return address
    for entry in reversed(forwarded_for.split(",")):
        hop = parse_address(entry)
        if hop is None:
            return address
        address = hop
        if not in_ranges(hop, trusted):
            return hop
    return address


# IPv6 prefixes (their top 96 bits) that carry an IPv4 address in their last 32
# bits: IPv4-mapped (::ffff:0:0/96) and NAT64's well-known 64:ff9b::/96 (RFC 6052).
_IPV4_IN_IPV6 = (0xFFFF, 0x64FF9B << 64)


@functools.lru_cache(maxsize=4096)
def counter_client(address):
    """What per-client counters count: an IPv4 address, or an IPv6 address's
    /64 (one host usually holds a whole /64, and could rotate through it).
    An IPv4 address carried in IPv6 counts as itself: behind NAT64 every
    IPv4 user would otherwise share one /64."""
    if address is None:
        return "unknown"
    if address.version == 6:
        number = int(address)
        if number >> 32 in _IPV4_IN_IPV6:
            return str(ipaddress.IPv4Address(number & 0xFFFFFFFF))
        return "%x/64" % (number >> 64)
    return str(address)


class Restrictions:
    """What one key's restrictions allow, parsed once (immutable)."""

    __slots__ = ("per_ip", "per_key", "referrers", "ips", "max_hits", "forced", "_json",
                 "max_concurrent", "allow_browser")

    def __init__(self, per_ip=None, per_key=None, referrers=None, ips=None, max_hits=None,
                 source=None, forced=None, max_concurrent=None, allow_browser=False):
        self.per_ip, self.per_key, self.max_hits = per_ip, per_key, max_hits
        self.max_concurrent = max_concurrent  # searches at once with the key, in this process
        self.allow_browser = allow_browser  # may be used from browsers though it holds more
        self.forced = forced  # index pattern -> forced search parameters, or None
        self.referrers = None if referrers is None else [referrer_pattern(p) for p in referrers]
        self.ips = None if ips is None else [ip_range(r) for r in ips]
        self._json = source

    @property
    def rated(self):
        """Does a rate limit count this key's requests?"""
        return self.per_ip is not None or self.per_key is not None

    def to_json(self):
        """All the fields, null when not set (the GET answer)."""
        return dict(dict.fromkeys(RESTRICTION_FIELDS), **self._json)

    def to_record(self):
        """Only the fields that are set (the store's record)."""
        return dict(self._json)

    @classmethod
    def from_json(cls, body):
        """A PUT body (or a stored record) -> Restrictions, or None when
        nothing is restricted; ApiError with Meilisearch's message shapes."""
        fields = {}
        for name, value in require_object(body).items():
            if name not in RESTRICTION_FIELDS:
                raise unknown_field(name, RESTRICTION_FIELDS)
            if value is not None:
                fields[name] = value
        rate = _validate_rate_limit(fields.get("rateLimit"))
        referrers = _validate_restriction_list("allowedReferrers", fields.get("allowedReferrers"),
                                               referrer_pattern)
        ips = _validate_restriction_list("allowedIps", fields.get("allowedIps"), ip_range)
        forced = _validate_forced_parameters(fields.get("forcedParameters"))
        max_hits = _validate_count("maxHitsPerQuery", fields.get("maxHitsPerQuery"))
        max_concurrent = _validate_count("maxConcurrentSearches",
                                         fields.get("maxConcurrentSearches"),
                                         MAX_CONCURRENT_SEARCHES)
        allow_browser = fields.pop("allowBrowser", False)
        if type(allow_browser) is not bool:
            raise wrong_type("invalid_restrictions_allow_browser", ".allowBrowser", "a boolean",
                             allow_browser)
        if allow_browser:
            fields["allowBrowser"] = True  # false is the default: not kept
        if rate is not None:
            fields["rateLimit"] = {n: rate[n].text for n in RATE_FIELDS if rate[n]}
        else:
            fields.pop("rateLimit", None)
        if not fields:
            return None
        return cls(rate and rate["perIp"], rate and rate["perKey"], referrers and list(referrers),
                   ips and list(ips), max_hits, fields, forced, max_concurrent, allow_browser)


def _validate_count(field, value, maximum=None):
    """A restriction that is a count, 1 or more (to `maximum`), or None."""
    code = "invalid_restrictions_" + re.sub("([A-Z])", r"_\1", field).lower()
    if value is None:
        return None
    if type(value) is not int:
        raise wrong_type(code, "." + field, "a positive integer", value)
    if value < 1:
        raise invalid_value(code, "." + field, "`%d` is not 1 or more." % value)
    if maximum is not None and value > maximum:
        raise invalid_value(code, "." + field, "`%d` is more than %d." % (value, maximum))
    return value


def stored_restrictions(record, uid):
    """A store record's `restrictions` -> Restrictions; ValueError if bad."""
    if record is None:
        return None
    try:
        restrictions = Restrictions.from_json(record)
    except ApiError as exc:
        raise ValueError("bad restrictions in key %s: %s" % (uid, exc.message))
    if restrictions is None:
        raise ValueError("empty restrictions in key %s" % uid)
    return restrictions


def _validate_rate_limit(value):
    code = "invalid_restrictions_rate_limit"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise wrong_type(code, ".rateLimit", "an object", value)
    rates = dict.fromkeys(RATE_FIELDS)
    for name, text in value.items():
        if name not in RATE_FIELDS:
            raise ApiError(400, code, "Unknown field `%s` inside `.rateLimit`: %sexpected one "
                           "of %s" % (name, did_you_mean(name, RATE_FIELDS),
                                      backticked(RATE_FIELDS)))
        if text is None:
            continue
        if not isinstance(text, str):
            raise wrong_type(code, ".rateLimit." + name, "a string", text)
        try:
            rates[name] = parse_rate(text)
        except ValueError as exc:
            raise invalid_value(code, ".rateLimit." + name, "%s." % exc)
    return rates if any(rates.values()) else None


def _validate_restriction_list(field, value, parse):
    code = "invalid_restrictions_" + re.sub("([A-Z])", r"_\1", field).lower()
    if value is None:
        return None
    _string_list(code, field, value)
    if not value or len(value) > MAX_RESTRICTION_ITEMS:
        raise invalid_value(code, "." + field, "give 1 to %d items (or null for no "
                            "restriction)." % MAX_RESTRICTION_ITEMS)
    for i, item in enumerate(value):
        try:
            parse(item)
        except ValueError as exc:
            raise invalid_value(code, ".%s[%d]" % (field, i), "%s." % exc)
    return value


class Counters:
    """Rate counters in memory, bounded: an LRU of at most `capacity`
    counters (the least recently used one is forgotten first, which only
    ever lets its client start afresh). Rates use the generic cell rate
    algorithm: one float a counter, bursts of up to the rate's count.
    Failed authentications are counted apart, by a FailureCounts."""

    def __init__(self, capacity=100000, clock=time.monotonic):
        self.capacity = capacity
        self.clock = clock
        self._tat = collections.OrderedDict()  # counter -> theoretical arrival time
        self._lock = threading.Lock()

    def __len__(self):
        return len(self._tat)

    def take(self, wanted):
        """Count one request against each (counter, Rate) of `wanted`, all
        or none: None when every rate allows it, else (seconds to wait,
        Rate) of the first that refuses."""
        now = self.clock()
        with self._lock:
            updates = []
            for counter, rate in wanted:
                tat = max(self._tat.get(counter, now), now)
                wait = (tat - now) - (rate.window - rate.interval)  # exact 0 when fresh
                if wait > 0:
                    return wait, rate
                updates.append((counter, tat + rate.interval))
            for counter, tat in updates:
                self._remember(counter, tat)
        return None

    def _remember(self, counter, value):
        tat = self._tat
        tat[counter] = value
        tat.move_to_end(counter)
        while len(tat) > self.capacity:
            tat.popitem(last=False)




class Searching:
    """The searches running with each key in this process (uid -> count;
    a key running none has no entry, so it holds one per search at most)."""

    def __init__(self):
        self._running = {}
        self._lock = threading.Lock()

    def enter(self, uid, most):
        """Count one more search with key `uid`, unless `most` are running: whether it may run."""
        with self._lock:
            running = self._running.get(uid, 0)
            if running >= most:
                return False
            self._running[uid] = running + 1
            return True

    def leave(self, uid):
        with self._lock:
            running = self._running.pop(uid) - 1
            if running:
                self._running[uid] = running


class Place:
    """One search's place among its key's (Searching.enter), given back
    once, by `leave`, whatever happened to the search."""

    __slots__ = ("searching", "uid")

    def __init__(self, searching, uid):
        self.searching, self.uid = searching, uid

    def leave(self):
        searching, self.searching = self.searching, None
        if searching is not None:
            searching.leave(self.uid)


class LeavingStream:
    """A streamed answer (see Response) whose Place is given back when it is
    closed: written whole, broken off, or never started."""

    __slots__ = ("stream", "place")

    def __init__(self, stream, place):
        self.stream, self.place = stream, place

    def __iter__(self):
        return iter(self.stream)

    def close(self):
        try:
            self.stream.close()
        finally:
            self.place.leave()


class FailureCounts:
    """Failed authentications per client, `rate.count` at most in a fixed
    window of `rate.window` seconds, for at most `capacity` clients. Unlike
    a rate counter, a throttled client must not be forgotten (it would
    start afresh): clients under the limit go least recently used first,
    a throttled one only when its window ends; when every entry is a live
    throttle, a new failing client is refused as if throttled."""

    def __init__(self, rate, capacity=100000, clock=time.monotonic):
        self.rate, self.capacity, self.clock = rate, capacity, clock
        self._counting = collections.OrderedDict()  # client -> (window end, failures)
        self._throttled = {}  # client -> window end
        self._ends = []       # heap of (window end, client) of _throttled
        self._lock = threading.Lock()

    def __len__(self):
        return len(self._counting) + len(self._throttled)

    def throttled(self, client):
        """Seconds until `client` may try again, or None when it may now."""
        now = self.clock()
        end = self._throttled.get(client)
        return end - now if end is not None and end > now else None

    def fail(self, client):
        """Count one failure of `client`: False when it could not be
        remembered (every entry a live throttle), and is refused."""
        now = self.clock()
        with self._lock:
            self._expire(now)
            if client in self._throttled:
                return True
            end, failures = self._counting.pop(client, (0, 0))
            if end <= now:
                end, failures = now + self.rate.window, 0
            while len(self) >= self.capacity and self._counting:
                self._counting.popitem(last=False)
            if len(self) >= self.capacity:
                return False
            if failures + 1 >= self.rate.count:
                self._throttled[client] = end
                heapq.heappush(self._ends, (end, client))
            else:
                self._counting[client] = (end, failures + 1)
            return True

    def _expire(self, now):
        ends = self._ends
        while ends and ends[0][0] <= now:
            end, client = heapq.heappop(ends)
            if self._throttled.get(client) == end:
                del self._throttled[client]


# =============================================================================
# Validation: bodies and query parameters, with upstream's exact messages
# =============================================================================


def damerau_levenshtein(a, b):
    """Unrestricted Damerau-Levenshtein distance (transpositions of any span)."""
    infinity = len(a) + len(b)
    last_row_of = {}
    d = [[infinity] * (len(b) + 2)]
    d += [[infinity] + list(range(len(b) + 1))]
    for i in range(1, len(a) + 1):
        d.append([infinity, i] + [0] * len(b))
        last_match_col = 0
        for j in range(1, len(b) + 1):
            i1 = last_row_of.get(b[j - 1], 0)
            j1 = last_match_col
            cost = 0 if a[i - 1] == b[j - 1] else 1
            if cost == 0:
                last_match_col = j
            d[i + 1][j + 1] = min(
                d[i][j] + cost,             # substitution
                d[i + 1][j] + 1,            # insertion
                d[i][j + 1] + 1,            # deletion
                d[i1][j1] + (i - i1 - 1) + 1 + (j - j1 - 1),  # transposition
            )
        last_row_of[a[i - 1]] = i
    return d[len(a) + 1][len(b) + 1]


def did_you_mean(received, accepted):
    """deserr's hint: "did you mean `x`? " for a close enough accepted name."""
    length = len(received.encode())
    if length <= 3:
        return ""
    allowed = 1 if length <= 7 else 2 if length <= 12 else 3 if length <= 17 \
        else 4 if length <= 24 else 5
    best = None
    for name in accepted:
        if abs(len(received) - len(name)) > allowed:
            continue  # too far apart anyway; and keeps a 1 MB name from costing minutes
        distance = damerau_levenshtein(received, name)
        if distance <= allowed and (best is None or distance < best[0]):
            best = (distance, name)
    return "did you mean `%s`? " % best[1] if best else ""


def is_decimal(text):
    """Only ASCII digits (str.isdigit alone also takes `²`, which int() refuses)."""
    return text.isascii() and text.isdigit()


def backticked(names):
    return ", ".join("`%s`" % n for n in names)


_COMPACT_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def compact_json(value):
    """JSON without spaces, like serde_json (one shared encoder: creating one is slow)."""
    return _COMPACT_ENCODER.encode(value)


def describe_json(value):
    """deserr's description of a JSON value: `a string: `"x"``, `null`, ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        kind = "a boolean"
    elif isinstance(value, int):
        kind = "a positive integer" if value >= 0 else "a negative integer"
    elif isinstance(value, float):
        kind = "a number"
    elif isinstance(value, str):
        kind = "a string"
    elif isinstance(value, list):
        kind = "an array"
    else:
        kind = "an object"
    return "%s: `%s`" % (kind, compact_json(value))


def wrong_type(code, path, expected, value):
    where = " at `%s`" % path if path else ""
    return ApiError(400, code, "Invalid value type%s: expected %s, but found %s"
                    % (where, expected, describe_json(value)))


def invalid_value(code, path, detail):
    return ApiError(400, code, "Invalid value at `%s`: %s" % (path, detail))


def expires_at_error(raw):
    return invalid_value(
        "invalid_api_key_expires_at", ".expiresAt",
        "`%s` is not a valid date. It should follow the RFC 3339 format to represents a date "
        "or datetime in the future or specified as a null value. e.g. 'YYYY-MM-DD' or "
        "'YYYY-MM-DD HH:MM:SS'.\n" % raw)


def check_content_type(value):
    """Upstream accepts any `*/json` or `*/*+json` media type on bodies."""
    accepted = "Accepted values for the Content-Type header are: `application/json`"
    if value is None:
        raise ApiError(415, "missing_content_type",
                       "A Content-Type header is missing. " + accepted)
    media = value.split(";", 1)[0].strip().lower()
    kind, _, subtype = media.partition("/")
    if not kind or not (subtype == "json" or subtype.endswith("+json")):
        raise ApiError(415, "invalid_content_type",
                       "The Content-Type `%s` is invalid. %s" % (value, accepted))


def _reject_constant(name):
    raise ValueError("invalid number %s" % name)


# JSON as serde_json reads it (no NaN/Infinity); one shared decoder, as
# building one per call is slow.
_STRICT_JSON = json.JSONDecoder(parse_constant=_reject_constant)
MAX_JSON_DEPTH = 128  # serde_json's recursion limit
_SURROGATE_ESCAPE_RE = re.compile(r"\\u[dD][89a-fA-F]")


def strict_json(text):
    """Parse JSON the way serde_json would accept it: no NaN, no lone
    surrogates, at most 128 levels of nesting (deeper values would also
    overflow Python's stack wherever they are printed later)."""
    value = _STRICT_JSON.decode(text)
    if _nesting_over(value, MAX_JSON_DEPTH):
        raise RecursionError("recursion limit exceeded")
    if _SURROGATE_ESCAPE_RE.search(text):  # the only way a lone surrogate gets in
        compact_json(value).encode("utf-8")  # UnicodeEncodeError on a lone one
    return value


def _nesting_over(value, limit):
    """Does `value` nest lists and objects more than `limit` deep? Walked
    with one iterator per open level, so the walk holds memory for the depth,
    not for each value (a tuple per value made an 8 MB body cost ~340 MiB)."""
    if not isinstance(value, (list, dict)):
        return False
    levels = [iter(value.values() if isinstance(value, dict) else value)]
    while levels:
        for item in levels[-1]:
            if isinstance(item, (list, dict)):
                if len(levels) >= limit:
                    return True
                levels.append(iter(item.values() if isinstance(item, dict) else item))
                break
        else:
            levels.pop()
    return False


def parse_json_body(body):
    """Bytes -> JSON value, or upstream's missing/malformed payload error."""
    if not body:
        raise ApiError(400, "missing_payload", "A json payload is missing.")
    try:
        return strict_json(body.decode("utf-8"))
    except UnicodeEncodeError:
        detail = "lone leading surrogate in hex escape"
    except UnicodeDecodeError as exc:
        detail = "invalid unicode at byte %d" % exc.start
    except json.JSONDecodeError as exc:
        detail = "%s at line %d column %d" % (exc.msg, exc.lineno, exc.colno)
    except (ValueError, RecursionError):
        detail = "recursion limit exceeded"
    raise ApiError(400, "malformed_payload",
                   "The json payload provided is malformed. `%s`." % detail)


def require_object(value):
    if not isinstance(value, dict):
        raise wrong_type("bad_request", None, "an object", value)
    return value


def _optional_string(field, value):
    """`name` / `description`: a string or null."""
    if value is not None and not isinstance(value, str):
        raise wrong_type("invalid_api_key_" + field, "." + field, "a string", value)
    return value


def _string_list(code, field, value):
    if not isinstance(value, list):
        raise wrong_type(code, "." + field, "an array", value)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise wrong_type(code, ".%s[%d]" % (field, i), "a string", item)
    return value


def validate_actions(value):
    _string_list("invalid_api_key_actions", "actions", value)
    for i, action in enumerate(value):
        if action not in ACTION_SET:
            raise ApiError(400, "invalid_api_key_actions",
                           "Unknown value `%s` at `.actions[%d]`: %sexpected one of %s"
                           % (action, i, did_you_mean(action, ACTIONS), backticked(ACTIONS)))
    return list(value)


def validate_indexes(value):
    _string_list("invalid_api_key_indexes", "indexes", value)
    for i, pattern in enumerate(value):
        if not is_valid_index_pattern(pattern):
            raise invalid_value(
                "invalid_api_key_indexes", ".indexes[%d]" % i,
                "`%s` is not a valid index uid pattern. Index uid patterns can be an integer "
                "or a string containing only alphanumeric characters, hyphens (-), "
                "underscores (_), and optionally end with a star (*)." % pattern)
    return list(value)


def validate_uid(value):
    if not isinstance(value, str):
        raise wrong_type("invalid_api_key_uid", ".uid", "a string", value)
    try:
        return parse_uuid(value)
    except ValueError as exc:
        raise invalid_value("invalid_api_key_uid", ".uid", str(exc))


def validate_expires_at(value, now_ns):
    if value is None:
        return None
    if not isinstance(value, str):
        raise wrong_type("invalid_api_key_expires_at", ".expiresAt", "a string", value)
    instant = parse_expires_at(value)
    if instant is None or instant.ns <= now_ns:
        raise expires_at_error(value)
    return instant


def unknown_field(field, accepted):
    return bad_request("Unknown field `%s`: %sexpected one of %s"
                       % (field, did_you_mean(field, accepted), backticked(accepted)))


def validate_create(body, now_ns):
    """A POST /keys body -> dict of validated fields (uid None = random).

    Fields are visited in document order and the first problem wins; then
    missing required fields in the order actions, indexes, expiresAt; then
    the index-scope rule.
    """
    fields = {"description": None, "name": None, "uid": None}
    for name, value in require_object(body).items():
        if name in PATCH_FIELDS:
            fields[name] = _optional_string(name, value)
        elif name == "uid":
            fields[name] = validate_uid(value)
        elif name == "actions":
            fields[name] = validate_actions(value)
        elif name == "indexes":
            fields[name] = validate_indexes(value)
        elif name == "expiresAt":
            fields[name] = validate_expires_at(value, now_ns)
        else:
            raise unknown_field(name, CREATE_FIELDS)
    for name, code in (("actions", "missing_api_key_actions"),
                       ("indexes", "missing_api_key_indexes"),
                       ("expiresAt", "missing_api_key_expires_at")):
        if name not in fields:
            raise ApiError(400, code, "Missing field `%s`" % name)
    action = index_scoped_global_action(fields["actions"], fields["indexes"])
    if action is not None:
        raise ApiError(
            400, "index_scoped_api_key_with_global_action",
            'cannot create index-scoped API key with global action `"%s"`\n  - Hint: remove '
            'action `"%s"` from the action list, or remove `indexes` to make the key global'
            % (action, action))
    return fields


def validate_patch(body):
    """A PATCH /keys/{k} body -> dict with the `name`/`description` to change."""
    changes = {}
    for name, value in require_object(body).items():
        if name in PATCH_FIELDS:
            changes[name] = _optional_string(name, value)
        elif name in IMMUTABLE_FIELDS:
            code = "immutable_api_key_" + re.sub("([A-Z])", r"_\1", name).lower()
            raise ApiError(400, code, "Immutable field `%s`: expected one of %s"
                           % (name, backticked(PATCH_FIELDS)))
        else:
            raise unknown_field(name, PATCH_FIELDS)
    return changes


ROTATE_FIELDS = ("grace",)
GRACE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
DEFAULT_GRACE = 300  # seconds a rotated key keeps working: clients switch over meanwhile
MAX_GRACE = 30 * 86400
_GRACE_RE = re.compile(r"([0-9]{1,7})([smhd]?)\Z")


MAX_EXPIRING = 3650 * 86400  # the longest `keys list --expiring`


def duration_seconds(text):
    """`30s`, `5m`, `1h`, `2d` or whole seconds -> seconds, or None."""
    match = _GRACE_RE.match(text)
    return int(match.group(1)) * GRACE_UNITS[match.group(2)] if match else None


def parse_duration(text, option, maximum):
    """A command line duration (`30m`, `12h`, `7d`, or seconds) -> seconds,
    at most `maximum`; ValueError naming `option`."""
    seconds = duration_seconds(text)
    if seconds is None or seconds > maximum:
        raise ValueError("%s `%s`: expected a duration such as `30m`, `12h` or `7d` (or whole "
                         "seconds), at most %d days" % (option, text, maximum // 86400))
    return seconds


def parse_grace(value):
    """`30s`, `5m`, `1h`, `2d` or whole seconds (`90` or 90), 0 to 30 days -> seconds;
    ValueError saying what is accepted."""
    if isinstance(value, str):
        seconds = duration_seconds(value)
    else:
        seconds = value if type(value) is int else None
    if seconds is None or not 0 <= seconds <= MAX_GRACE:
        raise ValueError("expected a duration such as `30s`, `5m`, `1h` or `2d` (or whole "
                         "seconds), from 0 to 30 days")
    return seconds


def validate_rotation(body):
    """A POST /keys/{k}/rotate body -> the grace period in seconds."""
    grace = DEFAULT_GRACE
    for name, value in require_object(body).items():
        if name not in ROTATE_FIELDS:
            raise unknown_field(name, ROTATE_FIELDS)
        if value is not None:
            try:
                grace = parse_grace(value)
            except ValueError as exc:
                raise invalid_value("invalid_rotation_grace", ".grace", "%s, but found %s"
                                    % (exc, describe_json(value)))
    return grace


REVOKE_TOKENS_FIELDS = ("issuedBefore",)
REVOKE_TOKEN_FIELDS = ("token",)


def validate_revoke_tokens(body, now_ns):
    """A POST /keys/{k}/revoke-tokens body -> the Unix second before which
    the key's tokens are revoked: `issuedBefore` (RFC 3339, not in the
    future) or now, rounded up (a token's `iat` is whole seconds: one signed
    in the same second as the revocation is revoked too)."""
    before_ns = now_ns
    for name, value in require_object(body).items():
        if name not in REVOKE_TOKENS_FIELDS:
            raise unknown_field(name, REVOKE_TOKENS_FIELDS)
        if value is None:
            continue
        instant = parse_expires_at(value) if isinstance(value, str) else None
        if instant is None or instant.ns > now_ns:
            raise invalid_value("invalid_revocation_issued_before", ".issuedBefore",
                                "expected an RFC 3339 date (e.g. `2030-01-31T00:00:00Z`) not in "
                                "the future, or null for now, but found %s"
                                % describe_json(value))
        before_ns = instant.ns
    return -(-before_ns // 10 ** 9)


def validate_revoke_token(body, key):
    """A POST /keys/{k}/revoke-token body -> (the token, its exp): a tenant
    token `key` signed that has not expired and has an `exp` (a token
    without one would have to be denied forever)."""
    code = "invalid_revocation_token"
    for name in require_object(body):
        if name not in REVOKE_TOKEN_FIELDS:
            raise unknown_field(name, REVOKE_TOKEN_FIELDS)
    token = body.get("token")
    if not isinstance(token, str):
        raise wrong_type(code, ".token", "a tenant token (a string)", token)
    try:
        claims = verify_tenant_token(token, key.value)
    except NotATenantToken:
        raise invalid_value(code, ".token", "this is not a tenant token (a JWT).")
    except TenantTokenError as exc:
        raise invalid_value(code, ".token", "this is not a tenant token of API key `%s` that "
                            "works: %s" % (key.uid, exc))
    if claims["apiKeyUid"] != key.uid:
        raise invalid_value(code, ".token", "this tenant token was signed by another API key "
                            "(`%s`)." % claims["apiKeyUid"])
    if claims["exp"] is None:
        raise invalid_value(code, ".token", "this tenant token has no `exp`, so it cannot be "
                            "revoked singly (it would have to be denied forever): revoke "
                            "every token of API key `%s` issued before now with `POST "
                            "/keys/%s/revoke-tokens`, or rotate the key." % (key.uid, key.uid))
    return token, claims["exp"]


USIZE_MAX = 2 ** 64 - 1
U32_MAX = 2 ** 32 - 1  # task and batch uids


def parse_rust_uint(text, maximum=USIZE_MAX):
    """`text` read as Rust's `usize::from_str` (u32 with `maximum`) reads a
    query parameter: ASCII digits, one optional leading `+`, leading zeros
    allowed, no `-` (not even `-0`), no whitespace, no overflow. None when
    Rust would refuse it."""
    digits = text[1:] if text.startswith("+") else text
    if not is_decimal(digits):
        return None
    digits = digits.lstrip("0") or "0"
    if len(digits) > len(str(maximum)):  # also keeps int() off huge strings
        return None
    value = int(digits)
    return value if value <= maximum else None


def validate_list_query(query, resource="api_key"):
    """GET /keys (or, with resource "index", GET /indexes) query string ->
    (offset, limit). Parameters are taken as upstream's query extractor
    takes them: the last of repeated ones wins, in the place of the first."""
    values = {"offset": 0, "limit": 20}
    asked = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
    for name, raw in asked.items():
        if name not in LIST_PARAMETERS:
            raise bad_request("Unknown parameter `%s`: %sexpected one of %s"
                              % (name, did_you_mean(name, LIST_PARAMETERS),
                                 backticked(LIST_PARAMETERS)))
        number = parse_rust_uint(raw)
        if number is None:
            raise ApiError(400, "invalid_%s_%s" % (resource, name),
                           "Invalid value in parameter `%s`: could not parse `%s` as a "
                           "positive integer" % (name, raw))
        values[name] = number
    return values["offset"], values["limit"]


# =============================================================================
# UUIDs: the `uuid` crate's accepted forms and error messages
# =============================================================================

_CANONICAL_UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")
_HEX = frozenset("0123456789abcdefABCDEF")


def parse_uuid(text):
    """Any spelling the uuid crate accepts -> lowercase hyphenated; ValueError
    with the crate's message otherwise."""
    if len(text) == 32 and all(c in _HEX for c in text):
        body = text
    else:
        inner = text
        if len(text) == 38 and text[0] == "{" and text[-1] == "}":
            inner = text[1:-1]
        elif len(text) == 45 and text.startswith("urn:uuid:"):
            inner = text[9:]
        groups = inner.split("-")
        if len(inner) != 36 or [len(g) for g in groups] != [8, 4, 4, 4, 12] \
                or not all(c in _HEX for c in "".join(groups)):
            raise ValueError(_uuid_error(text))
        body = "".join(groups)
    body = body.lower()
    return "%s-%s-%s-%s-%s" % (body[:8], body[8:12], body[12:16], body[16:20], body[20:])


def _uuid_error(text):
    """The uuid crate's explanation of why `text` is not a UUID."""
    offset, inner, simple = 0, text, True
    if len(text) >= 2 and text[0] == "{" and text[-1] == "}":
        offset, inner, simple = 1, text[1:-1], False
    elif text.startswith("urn:uuid:"):
        offset, inner, simple = 9, text[9:], False
    hyphens = []
    for i, char in enumerate(inner):
        if char == "-":
            hyphens.append(i)
        elif char not in _HEX:
            return "invalid character: found `%s` at %d" % (char, len(inner[:i].encode()) + offset)
    if not hyphens and simple:
        return "invalid length: found %d" % len(text.encode())
    if len(hyphens) != 4:
        return "invalid group count: expected 5, found %d" % (len(hyphens) + 1)
    starts = (0, 9, 14, 19, 24)
    expected = (8, 4, 4, 4, 12)
    for group in range(4):
        if hyphens[group] != starts[group + 1] - 1:
            return "invalid group length in group %d: expected %d, found %d" % (
                group, expected[group], hyphens[group] - starts[group])
    return "invalid group length in group 4: expected 12, found %d" % (len(inner) - starts[4])


# =============================================================================
# Dates: RFC 3339 with nanoseconds and the client's UTC offset
# =============================================================================


class Instant:
    """A point in time with nanosecond precision and the UTC offset it was
    written with (so `expiresAt` is echoed the way the client sent it)."""

    __slots__ = ("ns", "offset_minutes")

    def __init__(self, ns, offset_minutes=0):
        self.ns = ns
        self.offset_minutes = offset_minutes

    def __repr__(self):
        return "Instant(%r)" % format_rfc3339(self)


# As the `time` crate (0.3.47) parses them: ASCII digits only; RFC 3339 takes
# any one byte between date and time and a leap second; the other forms take
# a sign before the year.
_RFC3339_RE = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[\x00-\x7f](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?"
    r"(?:([Zz])|([+-])(\d{2}):(\d{2}))\Z", re.ASCII | re.DOTALL)
_NAIVE_RE = re.compile(r"([+-]?)(\d{4})-(\d{2})-(\d{2})(?:([T ])(\d{2}):(\d{2}):(\d{2}))?\Z",
                       re.ASCII)


def _epoch_seconds(year, month, day, hour, minute, second):
    """Seconds since the epoch of a UTC civil time; ValueError when invalid."""
    moment = datetime.datetime(year, month, day, hour, minute, second)
    return calendar.timegm(moment.timetuple())


def parse_expires_at(text):
    """Upstream's accepted `expiresAt` spellings -> Instant, or None.

    RFC 3339 first (keeping the offset), then `YYYY-MM-DDTHH:MM:SS`,
    `YYYY-MM-DD HH:MM:SS` and `YYYY-MM-DD`, all three taken as UTC.
    """
    try:
        match = _RFC3339_RE.match(text)
        if match:
            y, mo, d, h, mi, s, fraction, zulu, sign, oh, om = match.groups()
            if int(oh or 0) > 23 or int(om or 0) > 59:
                return None
            offset = 0 if zulu else (int(oh) * 60 + int(om)) * (1 if sign == "+" else -1)
            leap = s == "60"  # read as the last nanosecond before it, as `time` does
            seconds = _epoch_seconds(int(y), int(mo), int(d), int(h), int(mi),
                                     59 if leap else int(s))
            nanos = 999999999 if leap else int((fraction or "0")[:9].ljust(9, "0"))
            instant = Instant((seconds - offset * 60) * 10 ** 9 + nanos, offset)
            return instant if not leap or _ends_a_utc_month(seconds - offset * 60) else None
        match = _NAIVE_RE.match(text)
        if match:
            sign, y, mo, d, _sep, h, mi, s = match.groups()
            if sign == "-":
                return None  # a year before 0: in the past, refused as unparsable ones are
            seconds = _epoch_seconds(int(y), int(mo), int(d), int(h or 0), int(mi or 0),
                                     int(s or 0))
            return Instant(seconds * 10 ** 9)
    except (ValueError, OverflowError):
        return None
    return None


def _ends_a_utc_month(epoch_seconds):
    """Is this second 23:59:59 UTC on the last day of a month (where a leap
    second may follow)?"""
    moment = time.gmtime(epoch_seconds)
    return moment.tm_hour == 23 and moment.tm_min == 59 and moment.tm_sec == 59 \
        and moment.tm_mday == calendar.monthrange(moment.tm_year, moment.tm_mon)[1]


def format_rfc3339(instant):
    """Instant -> RFC 3339 in its own offset; fraction trimmed, omitted when zero."""
    seconds, nanos = divmod(instant.ns + instant.offset_minutes * 60 * 10 ** 9, 10 ** 9)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    if nanos:
        text += "." + ("%09d" % nanos).rstrip("0")
    if instant.offset_minutes == 0:
        return text + "Z"
    sign = "+" if instant.offset_minutes > 0 else "-"
    hours, minutes = divmod(abs(instant.offset_minutes), 60)
    return "%s%s%02d:%02d" % (text, sign, hours, minutes)


def format_timestamp(ns):
    """createdAt/updatedAt: UTC, nanoseconds trimmed (always non-zero, see Clock)."""
    return format_rfc3339(Instant(ns))


class Clock:
    """Strictly increasing wall-clock nanoseconds, never on a whole second.

    Strictly increasing keeps `createdAt` order equal to creation order (the
    default keys are created within nanoseconds); the non-zero fraction keeps
    the official Python SDK happy (it cannot parse `...:00Z`).
    """

    def __init__(self, last_ns=0):
        self._last = last_ns
        self._lock = threading.Lock()

    def now_ns(self):
        with self._lock:
            ns = max(time.time_ns(), self._last + 1)
            if ns % 10 ** 9 == 0:
                ns += 1
            self._last = ns
            return ns

    def advance_past(self, ns):
        with self._lock:
            self._last = max(self._last, ns)


# =============================================================================
# Key derivation
# =============================================================================


def derive_key(master_key, uid):
    """A key's value: lowercase hex HMAC-SHA256(master key, uid)."""
    return key_deriver(master_key)(uid)


FINGERPRINT_MESSAGE = b"searchkeys master key fingerprint v1"
_FINGERPRINT_RE = re.compile(r"[0-9a-f]{64}\Z")


def master_key_fingerprint(master_key):
    """What the store records of the master key: an HMAC of a constant
    with it (hex), which tells another key apart and reveals nothing of it."""
    return hmac.digest(master_key.encode(), FINGERPRINT_MESSAGE, "sha256").hex()


def key_deriver(master_key):
    """derive_key with the master key fixed: a function uid -> value. The
    keyed HMAC state is made once and copied for each uid (a start derives
    every stored key's value)."""
    keyed = hmac.new(master_key.encode(), digestmod=hashlib.sha256)

    def derive(uid):
        state = keyed.copy()
        state.update(uid.encode())
        return state.hexdigest()
    return derive


# =============================================================================
# Tenant tokens (JWT HS256/384/512 signed with the parent key's value)
# =============================================================================

JWT_HASHES = {"HS256": hashlib.sha256, "HS384": hashlib.sha384, "HS512": hashlib.sha512}
# Every `alg` the JWT library knows; any other value is a header decoding error.
JWT_KNOWN_ALGORITHMS = ("HS256", "HS384", "HS512", "ES256", "ES384", "RS256", "RS384",
                        "RS512", "PS256", "PS384", "PS512", "EdDSA")
_B64URL_VALUES = {symbol: value for value, symbol in enumerate(
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")}
_PAD = ord("=")


class NotATenantToken(Exception):
    """The bearer token is not shaped like a JWT: treat it as an API key."""


class TenantTokenError(Exception):
    """A JWT that cannot be used; str() is upstream's complete message."""


def b64url_encode(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _base64_error(detail, *numbers):
    return TenantTokenError("Base64 error: " + detail % numbers)


def b64url_decode(text):
    """Strict unpadded base64url, checked in the order and with the messages
    of the `base64` crate (0.22) URL_SAFE_NO_PAD engine jsonwebtoken uses."""
    data = text.encode("utf-8", "surrogatepass")
    rest = len(data) % 4
    if rest == 1 and data[-1] != _PAD and data[-1] not in _B64URL_VALUES:
        raise _base64_error("Invalid symbol %d, offset %d.", data[-1], len(data) - 1)
    start = max(0, len(data) - rest - (4 if rest == 0 else 0))  # the last quad is checked apart
    for offset in range(start):
        if data[offset] not in _B64URL_VALUES:
            raise _base64_error("Invalid symbol %d, offset %d.", data[offset], offset)
    morsels, padding = [], None
    for offset in range(start, len(data)):
        byte = data[offset]
        if byte == _PAD:
            if offset - start < 2:
                raise _base64_error("Invalid symbol %d, offset %d.", byte, offset)
            padding = offset if padding is None else padding
            continue
        if padding is not None:
            raise _base64_error("Invalid symbol %d, offset %d.", _PAD, padding)
        if byte not in _B64URL_VALUES:
            raise _base64_error("Invalid symbol %d, offset %d.", byte, offset)
        morsels.append(_B64URL_VALUES[byte])
    if data and len(morsels) < 2:
        raise _base64_error("Invalid input length: %d", start + len(morsels))
    if padding is not None:
        raise _base64_error("Invalid padding")
    leftover = 0
    for position, morsel in enumerate(morsels):
        leftover |= morsel << (26 - 6 * position)
    if leftover & (0xFFFFFFFF >> (len(morsels) * 6 // 8 * 8)):
        raise _base64_error("Invalid last symbol %d, offset %d.", data[start + len(morsels) - 1],
                            start + len(morsels) - 1)
    return base64.urlsafe_b64decode(data + b"=" * (-len(data) % 4))


# Header fields as jsonwebtoken 10.4 types them, and the claims it reads
# itself (serde checks fields in the order they come, then the missing ones).
_VALIDATED_CLAIMS = ("exp", "nbf", "sub", "iss", "aud")  # jsonwebtoken's own pass
_HEADER_TEXT_FIELDS = ("typ", "cty", "jku", "kid", "x5u", "x5t", "x5t#S256")
_HEADER_LIST_FIELDS = ("x5c", "crit")
_HEADER_FIELDS = ("alg", "jwk", "enc") + _HEADER_TEXT_FIELDS + _HEADER_LIST_FIELDS
_I64_MIN, _I64_MAX, _U64_MAX = -2 ** 63, 2 ** 63 - 1, 2 ** 64 - 1


class _SerdeError(Exception):
    """serde's complaint about one JSON value; `where` says where serde_json
    stands when it reports it: "after" the value, "at" its first byte (maps
    and sequences it does not enter), just "past" that byte (a peek), or,
    for an error it places only on leaving the enclosing object, "closing":
    past its `}` when the value was the last member, else at the comma."""

    def __init__(self, message, where="after"):
        super().__init__(message)
        self.where = where


_JSON_SPACE = re.compile(r"[ \t\n\r]*")


class _TokenPart:
    """A JWT part decoded to JSON text, with its top-level members in order
    (repeats included) and where each stands, so errors carry serde_json's
    `at line L column C`."""

    def __init__(self, text, what):
        try:
            self.data = b64url_decode(text).decode("utf-8")
            value = strict_json(self.data)
        except TenantTokenError:
            raise
        except UnicodeEncodeError:
            raise TenantTokenError("JSON error: lone leading surrogate in hex escape")
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise TenantTokenError("JSON error: %s" % (getattr(exc, "msg", None) or exc))
        start = self._space(0)
        if not isinstance(value, dict):
            raise self.error(_invalid_type(value, what), start, len(self.data.rstrip()))
        self.members = list(self._items(start + 1, "}", keyed=True))
        self.end = self.members[-1][4] if self.members else start + 1
        self.end = self._space(self.end) + 1  # past the closing brace

    def _space(self, offset):
        return _JSON_SPACE.match(self.data, offset).end()

    def _items(self, offset, closing, keyed):
        """(name, value, key end, value start, value end) of an object's
        members, or (None, value, None, start, end) of an array's items."""
        offset = self._space(offset)
        while self.data[offset] != closing:
            name = key_end = None
            if keyed:
                name, key_end = json.decoder.scanstring(self.data, offset + 1)
                offset = self._space(self._space(key_end) + 1)  # past the colon
            value, end = _STRICT_JSON.raw_decode(self.data, offset)
            yield name, value, key_end, offset, end
            offset = self._space(end)
            if self.data[offset] == ",":
                offset = self._space(offset + 1)

    def items_of(self, member):
        """The items of an array member, placed like members."""
        return self._items(member[3] + 1, "]", keyed=False)

    def error(self, problem, start, end):
        """TenantTokenError for `problem` (a _SerdeError) about the value at start..end."""
        if problem.where == "closing":
            end = self._space(end)
            offset = end + 1 if self.data[end] == "}" else end
        else:
            offset = {"after": end, "at": start, "past": start + 1}[problem.where]
        return self.error_at(str(problem), offset)

    def error_at(self, message, offset):
        line_start = self.data.rfind("\n", 0, offset) + 1
        return TenantTokenError("JSON error: %s at line %d column %d" % (
            message, self.data.count("\n", 0, offset) + 1,
            len(self.data[line_start:offset].encode("utf-8"))))

    def missing(self, field):
        return self.error_at("missing field `%s`" % field, self.end)

    def once(self, fields):
        """serde's `duplicate field` error for a known field given twice."""
        seen = set()
        for name, _, key_end, _, _ in self.members:
            if name in fields:
                if name in seen:
                    raise self.error_at("duplicate field `%s`" % name, key_end)
                seen.add(name)


def serde_unexpected(value):
    """How serde names an unexpected JSON value in `invalid type: ...`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean `%s`" % ("true" if value else "false")
    if isinstance(value, int):
        return "integer `%d`" % value
    if isinstance(value, float):
        import decimal  # here: ~0.3 MiB and ~4 ms of start-up for this rare message
        text = format(decimal.Decimal(repr(value)), "f")  # Rust prints no exponent
        return "floating point `%s`" % (text if "." in text else text + ".0")
    if isinstance(value, str):
        return "string " + rust_debug_str(value)
    return "sequence" if isinstance(value, list) else "map"


def _invalid_type(value, expected):
    return _SerdeError("invalid type: %s, expected %s" % (serde_unexpected(value), expected),
                       "at" if isinstance(value, (list, dict)) else "after")


def _check_header(part):
    """The header's `alg`, once its typed fields are as jsonwebtoken reads them."""
    part.once(_HEADER_FIELDS)
    for member in part.members:
        name, value, _, start, end = member
        try:
            if name == "alg":
                _read_algorithm(value)
            elif value is None:
                continue
            elif name in _HEADER_TEXT_FIELDS and not isinstance(value, str):
                raise _invalid_type(value, "a string")
            elif name in _HEADER_LIST_FIELDS:
                if not isinstance(value, list):
                    raise _invalid_type(value, "a sequence")
                for _, item, _, start, end in part.items_of(member):
                    if not isinstance(item, str):
                        raise _invalid_type(item, "a string")
        except _SerdeError as problem:
            raise part.error(problem, start, end)
    header = dict((member[0], member[1]) for member in part.members)
    if "alg" not in header:
        raise part.missing("alg")
    return header["alg"]


def _read_algorithm(value):
    if not isinstance(value, str):
        raise _SerdeError("expected value", "past")  # serde_json wants a variant name
    if value not in JWT_KNOWN_ALGORITHMS:
        raise _SerdeError("unknown variant `%s`, expected one of %s"
                          % (value, backticked(JWT_KNOWN_ALGORITHMS)))


def read_search_rules(rules):
    """`searchRules` as Meilisearch's untagged SearchRules reads them: a list
    of patterns, or an object of pattern -> null | rules object | [filter]
    (serde reads a one-field struct from a one-element array too); the
    object form comes back with {"filter": ...} objects. _SerdeError
    otherwise."""
    if isinstance(rules, list) and all(isinstance(p, str) for p in rules):
        return rules
    if isinstance(rules, dict):
        read = {}
        for pattern, rule in rules.items():
            if isinstance(rule, list) and len(rule) == 1:
                rule = {"filter": rule[0]}
            if not (rule is None or isinstance(rule, dict)):
                break
            read[pattern] = rule
        else:
            return read
    raise _SerdeError("data did not match any variant of untagged enum SearchRules", "closing")


def _read_exp(value):
    """`exp` as serde_json reads an Option<i64>."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid_type(value, "i64")
    if isinstance(value, float) or value < _I64_MIN or value > _U64_MAX:
        raise _invalid_type(float(value), "i64")  # serde_json holds these as floats
    if value > _I64_MAX:
        raise _SerdeError("invalid value: integer `%d`, expected i64" % value)
    return value


def _read_uid(value):
    if not isinstance(value, str):
        raise _invalid_type(value, "a formatted UUID string")
    try:
        return parse_uuid(value)
    except ValueError as exc:
        raise _SerdeError("UUID parsing failed: %s" % exc)


_CLAIM_READERS = {"searchRules": read_search_rules, "exp": _read_exp, "apiKeyUid": _read_uid}


def _check_claims(part):
    part.once(_CLAIM_READERS)
    claims = {"exp": None}
    for name, value, _, start, end in part.members:
        if name in _CLAIM_READERS:
            try:
                claims[name] = _CLAIM_READERS[name](value)
            except _SerdeError as problem:
                raise part.error(problem, start, end)
    for field in ("searchRules", "apiKeyUid"):
        if field not in claims:
            raise part.missing(field)
    claims["iat"] = _issued_at(part)
    return claims


def _issued_at(part):
    """The token's `iat` in Unix seconds, or None (none, more than one, not
    a number). Meilisearch ignores it; searchkeys' revocation reads it, and
    counts a token without one as issued before any time a revocation names
    (TokenRevocation.refusal)."""
    values = [value for name, value, _, _, _ in part.members if name == "iat"]
    if len(values) != 1 or isinstance(values[0], bool) \
            or not isinstance(values[0], (int, float)) or values[0] != values[0]:
        return None
    return values[0]


def _audience_error(part):
    """jsonwebtoken's pass over the registered claims, as Meilisearch
    configures it (no audience expected): any readable `aud` refuses."""
    try:
        part.once(_VALIDATED_CLAIMS)
    except TenantTokenError as exc:
        return str(exc)
    aud = dict((member[0], member[1]) for member in part.members).get("aud")
    if isinstance(aud, str) or (isinstance(aud, list) and all(isinstance(a, str) for a in aud)):
        return "InvalidAudience"
    return None


def decode_tenant_token(token):
    """Read a tenant token without checking its signature.

    Returns (algorithm, claims, signed_part, signature, refusal): claims
    hold `searchRules`, `exp`, `apiKeyUid` and `iat` (None when unreadable); refusal is what jsonwebtoken
    says of the registered claims once the signature is good, or None. Raises
    NotATenantToken when `token` does not have the three JWT parts, and
    TenantTokenError (the detail of "Could not decode tenant token, ...")
    when a part cannot be decoded or a required claim is missing or wrong.
    """
    signed_part, dot, signature = token.rpartition(".")
    header_text, dot2, payload_text = signed_part.rpartition(".")
    if not dot or not dot2:
        raise NotATenantToken()
    algorithm = _check_header(_TokenPart(header_text, "struct Header"))
    payload = _TokenPart(payload_text, "struct Claims")
    claims = _check_claims(payload)
    # reported after the signature check, as jsonwebtoken does
    return algorithm, claims, signed_part, signature, _audience_error(payload)


def decoded_tenant_token(token):
    """decode_tenant_token, remembered for the last 256 short tokens: a
    frontend sends its token with every search, and decoding it was most of
    the guard's work on such a search. Only the decoding: the signature and
    the expiry are checked on every request. (The claims are shared: read only.)"""
    if len(token) > 2048:
        return decode_tenant_token(token)
    return _recent_tenant_token(token)


_recent_tenant_token = functools.lru_cache(maxsize=256)(decode_tenant_token)


def _jwt_digest(algorithm, secret, signed_part):
    return hmac.new(secret.encode(), signed_part.encode("utf-8", "surrogatepass"),
                    JWT_HASHES[algorithm]).digest()


def _jwt_signature(algorithm, secret, signed_part):
    return b64url_encode(_jwt_digest(algorithm, secret, signed_part))


def sign_tenant_token(api_key, api_key_uid, search_rules, expires_at=None, algorithm="HS256",
                      issued_at=None):
    """Mint a tenant token for the key `api_key` (its 64-hex value) of uid
    `api_key_uid`. `expires_at`: None, Unix seconds, or an aware datetime.
    `iat` is `issued_at` (Unix seconds), or now: a revocation of the key's
    tokens issued before some time reads it."""
    if algorithm not in JWT_HASHES:
        raise ValueError("algorithm must be one of %s" % ", ".join(JWT_HASHES))
    if isinstance(expires_at, datetime.datetime):
        expires_at = int(expires_at.timestamp())
    header = b64url_encode(compact_json({"alg": algorithm, "typ": "JWT"}).encode())
    claims = {"searchRules": search_rules, "apiKeyUid": parse_uuid(api_key_uid),
              "exp": expires_at,
              "iat": int(time.time()) if issued_at is None else issued_at}
    payload = b64url_encode(compact_json(claims).encode())
    signed_part = header + "." + payload
    return signed_part + "." + _jwt_signature(algorithm, api_key, signed_part)


def verify_tenant_token(token, api_key, now=None):
    """Check a tenant token against its parent key's value; return its claims.

    `api_key` is the parent key's value, or a function uid -> value (a server
    learns the uid from the token). Raises NotATenantToken, or
    TenantTokenError carrying upstream's full message.
    """
    try:
        algorithm, claims, signed_part, signature, refusal = decoded_tenant_token(token)
        if algorithm not in JWT_HASHES:
            raise TenantTokenError("InvalidAlgorithm")
        secret = api_key(claims["apiKeyUid"]) if callable(api_key) else api_key
        # compared as text (the expected one is canonical base64url); a signature that
        # differs is decoded first, as upstream does: a malformed one is a Base64 error
        expected = _jwt_signature(algorithm, secret, signed_part).encode()
        if not hmac.compare_digest(expected, signature.encode("utf-8", "surrogatepass")):
            b64url_decode(signature)
            raise TenantTokenError("InvalidSignature")
        if refusal is not None:
            raise TenantTokenError(refusal)
    except TenantTokenError as exc:
        raise TenantTokenError("Could not decode tenant token, %s." % exc)
    now = int(time.time()) if now is None else now
    if claims["exp"] is not None and now > claims["exp"]:
        raise TenantTokenError("Tenant token expired. Was valid up to `%d` and we're now `%d`."
                               % (claims["exp"], now))
    return dict(claims)


# =============================================================================
# Client: manage keys on any Meilisearch-compatible server
# =============================================================================


class ClientError(Exception):
    """The server answered with an error: `status`, `code`, `message`."""

    def __init__(self, status, code, message):
        super().__init__("%s: %s" % (code, message))
        self.status = status
        self.code = code
        self.message = message


class ConnectionFailed(Exception):
    """The server could not be reached; the message names the URL tried."""


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """urllib would send the Authorization header on to wherever a redirect
    points (another host, https to http): a redirect is answered as is."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_RefuseRedirects)


class Client:
    """A small client of the /keys API (urllib; used by the CLI). It never
    follows a redirect: the credential would go along."""

    def __init__(self, url=DEFAULT_URL, key=None, timeout=30.0):
        self.url = url.rstrip("/")
        self.key = key
        self.timeout = timeout

    def request(self, method, path, body=None):
        """JSON in, JSON out; ClientError or ConnectionFailed on failure."""
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = compact_json(body).encode()
            headers["Content-Type"] = "application/json"
        if self.key:
            headers["Authorization"] = "Bearer " + self.key
        url = self.url + path
        try:
            req = urllib.request.Request(url, data=data, method=method, headers=headers)
        except ValueError as exc:  # not a URL urllib can use, e.g. no http://
            raise ConnectionFailed("cannot connect to %s: %s" % (url, exc))
        try:
            with _OPENER.open(req, timeout=self.timeout) as response:
                status, payload = response.status, response.read()
        except urllib.error.HTTPError as exc:
            if 300 <= exc.code < 400:
                raise ClientError(exc.code, "redirected", "%s answered %d, a redirect to %s, "
                                  "which is not followed as the key would go along: give "
                                  "that URL with --url if it is the server" % (
                                      url, exc.code, printable(exc.headers.get("Location") or
                                                               "nowhere")))
            raise _client_error(exc.code, exc.read())
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            raise ConnectionFailed("cannot connect to %s: %s" % (url, reason))
        try:
            return json.loads(payload.decode("utf-8")) if payload else None
        except (UnicodeDecodeError, ValueError):  # not a Meilisearch-compatible server
            raise ClientError(status, "invalid_response",
                              "%s answered %d with a body that is not JSON" % (url, status))

    def create_key(self, actions, indexes, expires_at=None, name=None, description=None,
                   uid=None):
        """POST /keys. `expires_at`: None (never) or an RFC 3339 / date string."""
        body = {}
        for field, value in (("description", description), ("name", name), ("uid", uid)):
            if value is not None:
                body[field] = value
        body.update(actions=list(actions), indexes=list(indexes), expiresAt=expires_at)
        return self.request("POST", "/keys", body)

    def list_keys(self, offset=None, limit=None, path="/keys"):
        """GET /keys (or another listing: `path`), a page of it."""
        params = _page_parameters(offset, limit)
        query = "?" + urllib.parse.urlencode(params) if params else ""
        return self.request("GET", path + query)

    def history(self, key_or_uid=None, offset=None, limit=None):
        """GET /keys/history (searchkeys only): a page of the changes to keys,
        newest first; of one key when given (its uid, or the value of a key
        that exists, looked up). A server without it is a ClientError saying so."""
        params = []
        if key_or_uid is not None:
            try:
                params.append(("key", parse_uuid(key_or_uid)))
            except ValueError:
                params.append(("key", self.get_key(key_or_uid)["uid"]))
        try:
            return self.request("GET", "/keys/history?" + urllib.parse.urlencode(
                params + _page_parameters(offset, limit)))
        except ClientError as exc:
            if exc.status not in (404, 405):  # Meilisearch: key `history` not found
                raise
            raise ClientError(exc.status, "no_history_api", "%s keeps no history of keys (a "
                              "Meilisearch?): only searchkeys.py serve does" % self.url)

    def get_key(self, key_or_uid):
        return self.request("GET", _key_path(key_or_uid))

    def update_key(self, key_or_uid, **changes):
        """PATCH /keys/{k} with `name` and/or `description` (None clears)."""
        return self.request("PATCH", _key_path(key_or_uid), changes)

    def delete_key(self, key_or_uid):
        self.request("DELETE", _key_path(key_or_uid))

    def rotate_key(self, key_or_uid, grace=None):
        """POST /keys/{k}/rotate (searchkeys only): the new key."""
        return self.request("POST", _key_path(key_or_uid) + "/rotate",
                            None if grace is None else {"grace": grace})

    def list_keys_seen_from_browsers(self, offset=None, limit=None):
        """GET /keys, each key used from a browser flagged with its
        `seenFromBrowserAt` (searchkeys' usage, for the master key; from a
        Meilisearch, or with another key, the plain listing)."""
        try:
            listing = self.request("GET", "/keys?" + urllib.parse.urlencode(
                [("usage", "true")] + _page_parameters(offset, limit)))
            results = listing["results"]
            usages = [key.pop("usage") for key in results]
            for key, usage in zip(results, usages):
                if usage.get("seenFromBrowserAt"):
                    key["seenFromBrowserAt"] = usage["seenFromBrowserAt"]
            return listing
        except ClientError as exc:
            if exc.status not in (400, 403):
                raise
        except (TypeError, KeyError, AttributeError):
            pass
        return self.list_keys(offset, limit)

    def all_keys(self, page=1000):
        """Every key (GET /keys, page by page)."""
        keys, offset = [], 0
        while True:
            listing = self.list_keys(offset, page)
            results = listing.get("results") or []
            keys += results
            offset += len(results)
            if not results or offset >= listing.get("total", 0):
                return keys

    def keys_with_usage(self, page=1000):
        """Every key with its `usage`, page by page: searchkeys' GET
        /keys?usage=true. A server without it (Meilisearch answers 400 to
        the parameter) is a ClientError saying so."""
        keys, offset = [], 0
        while True:
            try:
                listing = self.request("GET", "/keys?usage=true&offset=%d&limit=%d"
                                       % (offset, page))
                results = listing["results"]
                if not all(isinstance(key.get("usage"), dict) for key in results):
                    raise TypeError("no usage")
            except (ClientError, TypeError, KeyError, AttributeError) as exc:
                if isinstance(exc, ClientError) and exc.status != 400:
                    raise
                raise ClientError(400, "no_usage_api", "%s keeps no usage counts (a "
                                  "Meilisearch?): only searchkeys.py serve counts them"
                                  % self.url)
            keys += results
            offset += len(results)
            if not results or offset >= listing.get("total", 0):
                return keys


def _key_path(key_or_uid):
    return "/keys/" + urllib.parse.quote(key_or_uid, safe="")


def _page_parameters(offset, limit):
    return [(name, value) for name, value in (("offset", offset), ("limit", limit))
            if value is not None]


def no_such_route(error):
    """Did the server answer that it lacks a route searchkeys has (a plain
    Meilisearch), rather than that the key is unknown?"""
    return error.status in (404, 405) and error.code != "api_key_not_found"


def _client_error(status, payload):
    try:
        error = json.loads(payload.decode("utf-8"))
        return ClientError(status, error["code"], error["message"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        text = payload.decode("utf-8", "replace").strip() or http.client.responses.get(status, "")
        return ClientError(status, "http_%d" % status, text)


# =============================================================================
# Command line: restrictions (`serve` flags, `keys restrict`)
# =============================================================================


def add_restriction_flags(serve):
    """`serve` flags of the Gate."""
    serve.add_argument("--trusted-proxy", action="append", default=[], metavar="CIDR",
                       type=_argument_type(ip_range, "CIDR"),
                       help="a proxy (e.g. nginx) whose X-Forwarded-For is believed; the client "
                            "is the right-most address not in these ranges (repeatable)")
    serve.add_argument("--throttle-failures", metavar="COUNT/WINDOW",
                       type=_argument_type(parse_rate, "rate"),
                       help="after COUNT refused credentials from one address within WINDOW "
                            "(second, minute, hour, day), answer it 429 until the window ends "
                            "(default: off), e.g. 10/minute")
    serve.add_argument("--max-clients", type=_argument_type(positive_int, "count"),
                       default=100000, help="clients counted for rates, and apart for "
                                            "--throttle-failures (100000: ~25 MiB each)")


def add_restrict_command(key_commands, common):
    restrict = key_commands.add_parser(
        "restrict", parents=[common], help="show, set or clear a key's restrictions",
        description="Without options, show the key's restrictions. Otherwise replace them "
                    "with the ones given (and the preset's, which options override).")
    restrict.add_argument("key_or_uid", metavar="KEY_OR_UID", help="the key's value or uid")
    restrict.add_argument("--preset", choices=sorted(RESTRICTION_PRESETS),
                          help="search: %s" % compact_json(RESTRICTION_PRESETS["search"]))
    restrict.add_argument("--rate", metavar="COUNT/WINDOW",
                          help="requests per client address, e.g. 60/minute")
    restrict.add_argument("--rate-per-key", metavar="COUNT/WINDOW",
                          help="requests with the key from all clients, e.g. 10000/hour")
    restrict.add_argument("--referrer", action="append", metavar="PATTERN",
                          help="allowed Origin/Referer, `*` for any text: "
                               "'https://example.com/*' or '*.example.org' (repeatable)")
    restrict.add_argument("--ip", action="append", metavar="CIDR",
                          help="allowed client range, e.g. 10.0.0.0/8 (repeatable)")
    restrict.add_argument("--max-hits", type=int, metavar="N", help="hits per query at most")
    restrict.add_argument("--max-concurrent", type=int, metavar="N",
                          help="searches with the key at once, per searchkeys process; more "
                               "get 429 (1 to %d)" % MAX_CONCURRENT_SEARCHES)
    restrict.add_argument("--filter", action="append", metavar="INDEX=FILTER",
                          help="a filter AND-ed to every search on the indexes of the pattern "
                               "INDEX (`*` at its end for any text), e.g. "
                               "\"movies*=public = true\" (repeatable)")
    restrict.add_argument("--fields", action="append", metavar="[INDEX=]A,B",
                          help="the only attributes searches return (attributesToRetrieve), on "
                               "INDEX or, without it, on every INDEX of --filter and --force")
    restrict.add_argument("--force", action="append", metavar="INDEX=JSON",
                          help="other search parameters forced on INDEX, as a JSON object, "
                               "e.g. 'movies={\"facets\": [\"genre\"]}' (repeatable)")
    restrict.add_argument("--allow-browser", action="store_true",
                          help="let browsers use the key although it holds actions beyond "
                               "search (an admin page's key); without it such a key sent from a "
                               "browser gets 403")
    restrict.add_argument("--clear", action="store_true", help="remove every restriction")


def restrictions_from_args(args):
    """The PUT body `keys restrict` sends, or None to only show them;
    ValueError for a bad option (checked here, before any request)."""
    body = json.loads(json.dumps(RESTRICTION_PRESETS.get(args.preset, {})))
    rates = body.setdefault("rateLimit", {})
    for option, field in (("rate", "perIp"), ("rate_per_key", "perKey")):
        if getattr(args, option) is not None:
            rates[field] = parse_rate(getattr(args, option)).text
    if not rates:
        del body["rateLimit"]
    for option, field, check in (("referrer", "allowedReferrers", referrer_pattern),
                                 ("ip", "allowedIps", ip_range)):
        for item in getattr(args, option) or ():
            check(item)
            body.setdefault(field, []).append(item)
    if args.max_hits is not None:
        if args.max_hits < 1:
            raise ValueError("--max-hits must be 1 or more")
        body["maxHitsPerQuery"] = args.max_hits
    if args.allow_browser:
        body["allowBrowser"] = True
    if args.max_concurrent is not None:
        if not 1 <= args.max_concurrent <= MAX_CONCURRENT_SEARCHES:
            raise ValueError("--max-concurrent must be 1 to %d" % MAX_CONCURRENT_SEARCHES)
        body["maxConcurrentSearches"] = args.max_concurrent
    forced = forced_parameters_from_args(args)
    if forced:
        body["forcedParameters"] = forced
    if args.clear and body:
        raise ValueError("--clear removes every restriction: give it alone")
    return body or None


# What every Meilisearch filter condition has: a comparison, or an operator word.
FILTER_OPERATOR = re.compile(r"[=<>]|\b(?:TO|EXISTS|IS|IN|CONTAINS|STARTS|_geoRadius|"
                             r"_geoBoundingBox|_geoPolygon)\b", re.IGNORECASE)
# Quoted text (to its end if unclosed), and the words that join conditions.
FILTER_QUOTED = re.compile(r""""(?:[^"\\]|\\.)*(?:"|$)|'(?:[^'\\]|\\.)*(?:'|$)""", re.DOTALL)
FILTER_JOIN = re.compile(r"(?<![^\s()])(?:AND|OR)(?![^\s()])")


def _condition_without_operator(expression):
    """The first of the filter's conditions (its parts between AND and OR, outside quotes)
    that has no operator, or None."""
    masked = FILTER_QUOTED.sub(lambda match: match.group()[0] * len(match.group()), expression)
    start = 0
    for join in list(FILTER_JOIN.finditer(masked)) + [None]:
        end = join.start() if join else len(masked)
        if not FILTER_OPERATOR.search(masked, start, end):
            return expression[start:end].strip()
        start = join and join.end()
    return None


def forced_parameters_from_args(args):
    """forcedParameters from --filter, --force and --fields (validated as
    the server does), or None; ValueError for a bad option."""
    forced = {}
    for text in args.force or ():
        pattern, value = _index_option("--force", text)
        try:
            value = strict_json(value)
        except (ValueError, RecursionError) as exc:
            raise ValueError("--force %s: the parameters are not JSON: %s" % (pattern, exc))
        if not isinstance(value, dict):
            raise ValueError("--force %s: give the parameters as a JSON object" % pattern)
        forced.setdefault(pattern, {}).update(value)
    for text in args.filter or ():
        pattern, expression = _index_option("--filter", text)
        lacking = _condition_without_operator(expression) if expression.strip() else None
        if lacking is not None:
            # `status=published AND price > 1` reads as index `status`, filter `published
            # AND ...`: the index meant would get no filter at all.
            raise ValueError("--filter %s: `%s` is not a filter (%s has no operator such as "
                             "`=`, `IN` or `EXISTS`), so index `%s` would get it and no other "
                             "index any filter; write INDEX=FILTER, e.g. --filter "
                             "'INDEX=%s'" % (text, expression.strip(), "it" if lacking ==
                                             expression.strip() else "`%s`" % lacking,
                                             pattern, text))
        parameters = forced.setdefault(pattern, {})
        parameters["filter"] = fuse_filters(parameters.get("filter"), expression)
    for text in args.fields or ():
        pattern, fields = _index_option("--fields", text, optional=True)
        if pattern is None and not forced:
            raise ValueError("--fields %s: name the indexes (--fields INDEX=A,B) or give "
                             "--filter or --force" % text)
        for name in [pattern] if pattern is not None else list(forced):
            forced.setdefault(name, {})["attributesToRetrieve"] = _split_list(fields)
    if not forced:
        return None
    try:
        return _validate_forced_parameters(forced)
    except ApiError as exc:
        raise ValueError(exc.message)


def _index_option(option, text, optional=False):
    """`INDEX=VALUE` -> (INDEX, VALUE); (None, text) when `optional` and
    text does not start with an index pattern and `=`."""
    pattern, equals, value = text.partition("=")
    if equals and is_valid_index_pattern(pattern):
        return pattern, value
    if optional:
        return None, text
    raise ValueError("%s %s: write INDEX=VALUE, INDEX an index uid or a pattern ending in `*`"
                     % (option, text))


def run_restrict(client, args):
    path = _key_path(args.key_or_uid) + "/restrictions"
    if args.clear:
        client.request("DELETE", path)
        return 0
    if args.restrictions is None:
        return _print(args, client.request("GET", path), [])
    forced = args.restrictions.get("forcedParameters") or {}
    if forced:
        # A pattern the key's indexes never reach would force nothing, as when
        # `--filter 'status=published AND ...'` names `status` as the index.
        indexes = client.request("GET", _key_path(args.key_or_uid)).get("indexes") or []
        unreached = [p for p in forced if not any(_patterns_overlap(p, i) for i in indexes)]
        if unreached:
            _log_to_stderr("error: the key's indexes (%s) never reach %s, so nothing would be "
                           "forced there: name one of its indexes before the first `=` "
                           "(--filter INDEX=FILTER); nothing was changed"
                           % (", ".join(indexes), ", ".join("`%s`" % p for p in unreached)))
            return 1
    return _print(args, client.request("PUT", path, args.restrictions), [])


def _patterns_overlap(first, second):
    """Whether some index uid matches both index patterns."""
    if first.endswith("*") and second.endswith("*"):
        return first.startswith(second[:-1]) or second.startswith(first[:-1])
    if first.endswith("*"):
        return pattern_matches(first, second)
    return pattern_matches(second, first)


# =============================================================================
# Command line
# =============================================================================


def _split_list(text):
    return [item.strip() for item in text.split(",") if item.strip()]


def check_actions(text):
    """--actions A,B -> list; ValueError naming an unknown action (with a hint)."""
    actions = _split_list(text)
    for action in actions:
        if action not in ACTION_SET:
            hint = did_you_mean(action, ACTIONS).strip()
            raise ValueError("unknown action `%s`%s" % (action, ": " + hint if hint else ""))
    if not actions:
        raise ValueError("--actions is empty")
    return actions


def check_indexes(text):
    indexes = _split_list(text)
    if not indexes:
        raise ValueError("--indexes is empty: name at least one index, or `*` for all")
    for pattern in indexes:
        if not is_valid_index_pattern(pattern):
            raise ValueError("`%s` is not a valid index uid pattern" % pattern)
    return indexes


def port_number(text):
    """--port value -> int; ValueError outside 0-65535 (0: any free port)."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError("%s is not a TCP port (0 to 65535)" % text)
    return port


def positive_int(text):
    number = int(text)
    if number < 1:
        raise ValueError("%s is not 1 or more" % text)
    return number


def tombstone_days(text):
    """--tombstone-days value -> int: 0 (deleted keys are not kept) to MAX_TOMBSTONE_DAYS."""
    days = int(text)
    if not 0 <= days <= MAX_TOMBSTONE_DAYS:
        raise ValueError("%s is not 0 to %d" % (text, MAX_TOMBSTONE_DAYS))
    return days


def worker_count(text):
    """--workers value -> int: a count of 1 or more, or `auto`: one per core
    this process may run on."""
    if text != "auto":
        return positive_int(text)
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on macOS or FreeBSD
        return os.cpu_count() or 1


def http_url(text):
    """An http:// or https:// URL with a host and a valid port; ValueError otherwise."""
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # raises on a port out of range
    except ValueError as exc:
        raise ValueError("%r is not a URL (%s)" % (text, exc))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("%r is not an http:// or https:// URL" % text)
    return text


def _argument_type(check, name):
    """`check` as an argparse type: its ValueError's message becomes the usage error."""
    def convert(text):
        try:
            return check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).replace("invalid literal for int() with "
                                                              "base 10: ", "not a number: "))
    convert.__name__ = name
    return convert


def check_expires_at(text):
    """--expires-at value -> what to send: None for `never`, else the text."""
    if text == "never":
        return None
    instant = parse_expires_at(text)
    if instant is None:
        raise ValueError("`%s` is not a valid date: use RFC 3339 (2030-01-31T00:00:00Z), "
                         "'YYYY-MM-DD HH:MM:SS' or 'YYYY-MM-DD', or `never`" % text)
    if instant.ns <= time.time_ns():
        raise ValueError("--expires-at `%s` is in the past" % text)
    return text


class CommandParser(argparse.ArgumentParser):
    """An unknown option is an error of the (sub-)command it was given to, with that command's
    usage; argparse would report it at the top, or report a missing COMMAND first.
    `command_parser` in the result: the innermost command's parser, for later errors."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error("unrecognized arguments: %s" % " ".join(extras))
        if not hasattr(namespace, "command_parser"):  # set first by the innermost command
            namespace.command_parser = self
        return namespace, extras


def add_serve_command(commands):
    serve = commands.add_parser("serve", help="run the key service / guard")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (127.0.0.1)")
    serve.add_argument("--port", type=_argument_type(port_number, "port"), default=7700,
                       help="listen port, 0 to 65535 (7700)")
    serve.add_argument("--master-key", help="master key (env MEILI_MASTER_KEY); required "
                                            "unless --open")
    serve.add_argument("--open", action="store_true",
                       help="run without a master key, as Meilisearch's development mode: /keys "
                            "answers 401 and every other route is open to anyone")
    serve.add_argument("--store", help="JSON file of keys (default: in memory)")
    serve.add_argument("--master-key-changed", action="store_true",
                       help="start even though the store's keys were made with another master "
                            "key: every key gets a new value (the uids stay)")
    serve.add_argument("--upstream", type=_argument_type(http_url, "URL"),
                       help="search backend to forward authorized requests to")
    serve.add_argument("--upstream-key",
                       help="bearer token sent upstream (env SEARCHKEYS_UPSTREAM_KEY); must not "
                            "be empty")
    serve.add_argument("--max-connections", type=_argument_type(positive_int, "count"),
                       default=512, help="requests served at once, a thread each (512)")
    serve.add_argument("--workers", type=_argument_type(worker_count, "count"), default=1,
                       metavar="N",
                       help="processes serving the port and --store, restarted if one ends, "
                            "all stopped by SIGTERM; `auto`: one per core (1). A key created, "
                            "changed or deleted through one is honoured or refused by all "
                            "within 1 s. Each keeps its own rate counters, failure throttle, "
                            "metrics and usage counts not saved yet (usage is added into the "
                            "store every 5 s)")
    serve.add_argument("--tombstone-days", type=_argument_type(tombstone_days, "days"),
                       default=DEFAULT_TOMBSTONE_DAYS, metavar="N",
                       help="days a deleted key is kept in the store and can be restored "
                            "(POST /keys/UID/restore); 0: deleted keys are not kept (%d)"
                            % DEFAULT_TOMBSTONE_DAYS)
    serve.add_argument("--metrics-token-file", metavar="FILE",
                       help="file holding a bearer token that may read GET /metrics, besides "
                            "the master key")
    add_restriction_flags(serve)


def build_parser():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS,
                        help="server URL (env MEILI_URL, default %s)" % DEFAULT_URL)
    common.add_argument("--key", default=argparse.SUPPRESS,
                        help="credential sent as Bearer (env MEILI_MASTER_KEY)")
    common.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS,
                        help="print only key values")

    parser = CommandParser(
        prog="searchkeys.py", parents=[common],
        description="Meilisearch-compatible API-key service, guard and client.")
    parser.add_argument("--version", action="version", version="searchkeys.py " + __version__)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND",
                                     parser_class=CommandParser)

    add_serve_command(commands)

    keys = commands.add_parser("keys", help="manage API keys on a server")
    key_commands = keys.add_subparsers(dest="keys_command", metavar="ACTION")
    key_commands.required = True
    create = key_commands.add_parser("create", parents=[common], help="create a key")
    shape = create.add_mutually_exclusive_group(required=True)
    shape.add_argument("--preset", choices=sorted(PRESETS),
                       help="search: %s (for a frontend), with the restrictions of `keys "
                            "restrict --preset search`: %s; backend: %s (add and delete "
                            "documents, create indexes, follow tasks; no index deletion, no "
                            "settings changes)" % (", ".join(PRESETS["search"]),
                                                   compact_json(RESTRICTION_PRESETS["search"]),
                                                   ", ".join(PRESETS["backend"])))
    shape.add_argument("--actions", metavar="A,B",
                       help="comma-separated actions, from: %s" % ", ".join(ACTIONS))
    create.add_argument("--indexes", required=True, metavar="I,J",
                        help="comma-separated index uids or patterns (`blog`, `blog_*`, `*`)")
    create.add_argument("--expires-at", default="never",
                        help="RFC 3339 date (2030-01-31T00:00:00Z), 'YYYY-MM-DD', or `never` "
                             "(default)")
    create.add_argument("--description", help="free text shown with the key")
    create.add_argument("--name", help="a name shown with the key")
    create.add_argument("--uid", help="the key's UUID (default: a random one)")
    create.add_argument("--no-restrictions", action="store_true",
                        help="with --preset search: create the key without its restrictions")
    listing = key_commands.add_parser("list", parents=[common], help="list keys")
    listing.add_argument("--offset", type=int, help="keys to skip (0)")
    listing.add_argument("--limit", type=int, help="keys to list at most (20)")
    listing.add_argument("--expiring", metavar="DURATION",
                         help="only the keys that stop working within DURATION (30m, 12h, 7d "
                              "or seconds), soonest first: every key is read, so --offset and "
                              "--limit do not apply")
    get = key_commands.add_parser("get", parents=[common], help="show one key")
    get.add_argument("key_or_uid", metavar="KEY_OR_UID", help="the key's value or uid")
    update = key_commands.add_parser("update", parents=[common],
                                     help="change a key's name or description")
    update.add_argument("key_or_uid", metavar="KEY_OR_UID", help="the key's value or uid")
    update.add_argument("--name", help="the new name")
    update.add_argument("--description", help="the new description")
    delete = key_commands.add_parser("delete", parents=[common], help="delete a key")
    delete.add_argument("key_or_uid", metavar="KEY_OR_UID", help="the key's value or uid")
    key_commands.add_parser("usage", parents=[common],
                            help="each key's requests allowed and refused, most used first "
                                 "(searchkeys only)")
    history = key_commands.add_parser(
        "history", parents=[common], help="who changed which key, when and how, newest first "
                                          "(searchkeys only)")
    history.add_argument("key_or_uid", metavar="KEY_OR_UID", nargs="?",
                         help="only this key's changes (its uid, or its value while it exists)")
    deleted = key_commands.add_parser(
        "deleted", parents=[common], help="the deleted keys that can be restored, most "
                                          "recently deleted first (searchkeys only)")
    restore = key_commands.add_parser(
        "restore", parents=[common], help="bring a deleted key back: same uid, value and "
                                          "restrictions (searchkeys only; master key)")
    restore.add_argument("uid", metavar="UID", help="the deleted key's uid (see keys deleted)")
    for paged in (history, deleted):
        paged.add_argument("--offset", type=int, help="entries to skip (0)")
        paged.add_argument("--limit", type=int, help="entries to show at most (20)")
    rotate = key_commands.add_parser(
        "rotate", parents=[common], help="replace a key by a new one; the old one keeps "
                                         "working for a grace period")
    rotate.add_argument("key_or_uid", metavar="KEY_OR_UID", help="the key's value or uid")
    rotate.add_argument("--grace", metavar="DURATION",
                        help="how long the old key keeps working: 30s, 5m, 1h, 2d or "
                             "seconds, 0 to 30 days (default 5m)")
    revoke = key_commands.add_parser(
        "revoke-tokens", parents=[common], help="revoke every tenant token a key signed "
                                                "before a time (searchkeys only)")
    revoke.add_argument("key_or_uid", metavar="KEY_OR_UID", help="the key's value or uid")
    revoke.add_argument("--before", metavar="TIME",
                        help="RFC 3339 date; tokens whose `iat` is earlier (or that have none) "
                             "stop working (default: now)")
    revoke_one = key_commands.add_parser(
        "revoke-token", parents=[common], help="revoke one tenant token of a key until it "
                                               "expires (searchkeys only)")
    revoke_one.add_argument("key_or_uid", metavar="KEY_OR_UID", help="the key's value or uid")
    revoke_one.add_argument("token", metavar="TOKEN",
                            help="the tenant token (it needs an `exp`); `-` reads it from "
                                 "standard input, out of sight of ps and the shell's history")
    add_restrict_command(key_commands, common)

    token = commands.add_parser("token", parents=[common],
                                help="mint a tenant token offline")
    token.add_argument("--api-key", required=True, help="the parent key's value")
    token.add_argument("--uid", required=True, help="the parent key's uid")
    token.add_argument("--rules", required=True,
                       help='searchRules as JSON, e.g. \'["blog"]\' or '
                            '\'{"blog": {"filter": "user = 1"}}\'')
    token.add_argument("--expires-at", help="ISO 8601 date")
    token.add_argument("--algorithm", choices=sorted(JWT_HASHES), default="HS256")
    return parser


def _log_to_stderr(message):
    sys.stderr.write(message + "\n")


def check_serve_args(parser, args):
    """Fail closed: no master key only with --open; no empty secrets."""
    if args.master_key == "":
        parser.error("--master-key is empty")
    try:
        check_text_args(args, ("master_key", "upstream_key"))
    except ValueError as exc:
        parser.error(str(exc))
    if args.master_key is None:
        args.master_key = os.environ.get("MEILI_MASTER_KEY") or None
    if args.open and args.master_key is not None:
        parser.error("--open runs without a master key, but one is set (--master-key or "
                     "MEILI_MASTER_KEY)")
    if not args.open and args.master_key is None:
        parser.error("no master key: give --master-key or set MEILI_MASTER_KEY (add --open to "
                     "run without one, with every route but /keys open to anyone)")
    if args.store == "":
        parser.error("--store is empty: name a file, or leave the option out to keep keys in "
                     "memory")
    if args.workers > 1 and args.store is None:
        parser.error("--workers %d needs --store: keys kept in memory are one process's, so "
                     "a key made through one worker would be unknown to the others"
                     % args.workers)
    if args.upstream_key is None:
        args.upstream_key = os.environ.get("SEARCHKEYS_UPSTREAM_KEY")
        if args.upstream_key == "":
            parser.error("SEARCHKEYS_UPSTREAM_KEY is set but empty: set it to the backend's "
                         "key, or unset it to forward without a key")
    elif not args.upstream_key:
        parser.error("--upstream-key is empty (an unset shell variable?): give the backend's "
                     "key, or leave the option out to forward without a key")
    if args.metrics_token_file is not None:
        try:
            args.metrics_token = read_token_file(args.metrics_token_file)
        except ValueError as exc:
            parser.error(str(exc))
    else:
        args.metrics_token = None


def read_token_file(path):
    """The bearer token in `path` (around it, whitespace and a newline are
    dropped), as bytes; ValueError says what is wrong with it."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_TOKEN_FILE + 1)
    except OSError as exc:
        raise ValueError("cannot read --metrics-token-file %s: %s" % (path, exc.strerror or exc))
    token = data.strip()
    if not token:
        raise ValueError("--metrics-token-file %s is empty" % path)
    if len(data) > MAX_TOKEN_FILE or any(not 32 < byte < 127 for byte in token):
        raise ValueError("--metrics-token-file %s must hold one token of visible ASCII "
                         "characters, at most %d bytes" % (path, MAX_TOKEN_FILE))
    return token


def keep_store(store, stop):
    """serve's store keeper, until the Event `stop` is set: takes in what
    other processes wrote every STORE_POLL_SECONDS, saves the usage
    counts every USAGE_FLUSH_SECONDS, and looks for keys expiring soon
    (ExpiryWarnings) and purges deleted keys past their days every
    EXPIRY_CHECK_SECONDS."""
    flushed, checked, warnings = time.monotonic(), None, ExpiryWarnings()
    while True:
        if checked is None or time.monotonic() - checked >= EXPIRY_CHECK_SECONDS:
            now, checked = time.time_ns(), time.monotonic()
            for line in warnings.lines(store.expiring(EXPIRY_WARNING_DAYS * DAY_NS, now), now):
                store.log(line)
            store.purge_tombstones()
        if stop.wait(STORE_POLL_SECONDS):
            return
        store.refresh()
        if time.monotonic() - flushed >= USAGE_FLUSH_SECONDS:
            store.flush_usage()
            flushed = time.monotonic()


def release_startup_memory():
    """An optimization, measured: hand the C heap's free pages back to the
    system once serve has started. Compiling this file (run as a script, not
    imported from its bytecode) leaves ~13 MiB freed but kept by glibc's
    malloc; malloc_trim(0) returns it (idle RSS ~36 -> ~25 MiB on Debian's
    Python 3.11). Best effort: nothing happens without ctypes or glibc."""
    try:
        import ctypes  # here: optional (absent on some systems), and ~0.3 MiB
        ctypes.CDLL(None).malloc_trim(0)
    except (ImportError, OSError, AttributeError):  # no ctypes, no libc, not glibc
        pass


def run_serve(args):
    master_key = args.master_key
    if master_key is None:
        _log_to_stderr("searchkeys: warning: --open: no master key: /keys answers 401 and every "
                       "other route is open to anyone")
    elif len(master_key.encode()) < 16:
        _log_to_stderr("searchkeys: warning: the master key is shorter than 16 bytes "
                       "(Meilisearch refuses such a key in production)")
    # one file each: a connection, a worker's backend connection, the pool and the store
    max_open = max(64, raise_open_files_limit() - args.max_connections - 128)
    # the port first: a start that fails on a busy port leaves no store behind; callers are
    # taken (listen) once the store is loaded
    try:
        sock = bound_socket(args.host, args.port)
    except OSError as exc:  # a busy port, an unknown host
        return cannot_listen(args, exc)
    try:
        store = KeyStore(master_key, args.store, _log_to_stderr, args.master_key_changed,
                         args.tombstone_days)
        metrics = Metrics()
        upstream = Upstream(args.upstream, args.upstream_key or None, log=_log_to_stderr,
                            metrics=metrics) if args.upstream else None
        limits = Limits(args.trusted_proxy, args.throttle_failures, args.max_clients)
        service = Service(store, master_key, upstream, _log_to_stderr, limits, metrics,
                          args.metrics_token)
    except (StoreError, StoreWriteError, ValueError) as exc:
        sock.close()
        _log_to_stderr("searchkeys: cannot start: %s" % exc)
        return 1
    try:
        sock.listen(KeysServer.request_queue_size)
    except OSError as exc:
        sock.close()
        return cannot_listen(args, exc)
    _log_to_stderr("searchkeys: %d keys%s; listening on http://%s:%d%s%s" % (
        len(store), " in " + args.store if args.store else " in memory",
        "[%s]" % args.host if ":" in args.host else args.host,
        sock.getsockname()[1], " -> " + upstream.display_url if upstream else "",
        "; %d workers" % args.workers if args.workers > 1 else ""))

    def serve_on_socket():  # in a worker: a server of its own (threads, watcher) on it
        return serve_until_stopped(KeysServer(sock, service, args.max_connections, max_open),
                                   store)
    if args.workers == 1:
        return serve_on_socket()
    try:
        return run_workers(args.workers, serve_on_socket)
    finally:
        sock.close()


def cannot_listen(args, exc):
    _log_to_stderr("searchkeys: cannot listen on %s port %d: %s"
                   % (args.host, args.port, exc.strerror or exc))
    return 1


def serve_until_stopped(server, store):
    """Serve until SIGTERM (or ^C), keeping the store fresh; the exit status."""
    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    store.refresh()  # a worker started later than the store was opened
    stopping = threading.Event()
    keeper = threading.Thread(target=keep_store, name="store-keeper", args=(store, stopping),
                              daemon=True)
    keeper.start()
    release_startup_memory()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        stopping.set()
        keeper.join(10)  # its last flush ends before close's
        store.close()  # saves the usage counts
    return 0


class _Stop(Exception):
    """SIGTERM (or ^C) reached the process running the workers."""


WORKER_DEATHS = (5, 10.0)  # this many workers ending within so many seconds stop them all


def run_workers(count, serve):
    """serve --workers: `serve()` in `count` processes forked from this one
    (they share its listening socket and the store as it loaded it); one that
    ends is started again, SIGTERM stops them all. Returns the exit status."""
    workers = set()
    deaths = collections.deque(maxlen=WORKER_DEATHS[0])

    def start():
        pid = os.fork()
        if pid == 0:  # the worker
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # until it sets its own
            status = 1
            try:
                status = serve()
            except BaseException as exc:
                _log_to_stderr("searchkeys: worker %d failed: %s"
                               % (os.getpid(), printable(repr(exc))))
            finally:
                os._exit(status)
        workers.add(pid)

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop
        raise _Stop
    signal.signal(signal.SIGTERM, stop)
    status = 0
    try:
        for _ in range(count):
            start()
        while True:
            pid, code = os.wait()
            if pid not in workers:
                continue
            workers.discard(pid)
            code = os.waitstatus_to_exitcode(code)
            ended = "worker %d ended (%s)" % (
                pid, "signal %d" % -code if code < 0 else "status %d" % code)
            deaths.append(time.monotonic())
            if len(deaths) == deaths.maxlen and deaths[-1] - deaths[0] < WORKER_DEATHS[1]:
                _log_to_stderr("searchkeys: %s, the %dth within %g s; stopping"
                               % ((ended,) + WORKER_DEATHS))
                status = 1
                break
            _log_to_stderr("searchkeys: %s; starting another" % ended)
            start()
    except (_Stop, KeyboardInterrupt):
        pass
    except OSError as exc:  # fork: no process to be had
        _log_to_stderr("searchkeys: cannot start a worker: %s; stopping"
                       % (exc.strerror or exc))
        status = 1
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for pid in workers:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    return status


def run_keys(args):
    client = Client(args.url, args.key)
    command = args.keys_command
    if command == "create":
        key = client.create_key(args.actions, args.indexes, args.expires_at, name=args.name,
                                description=args.description, uid=args.uid)
        if args.preset == "search" and not args.no_restrictions:
            restrict_created_key(client, key)
    elif command == "list" and args.expiring is not None:
        listing = expiring_keys(client.all_keys(), args.expiring, time.time())
        return _print(args, listing, [k.get("key") for k in listing["results"]])
    elif command == "list":
        listing = client.list_keys_seen_from_browsers(args.offset, args.limit)
        return _print(args, listing, [k.get("key") for k in listing.get("results", [])])
    elif command == "get":
        key = client.get_key(args.key_or_uid)
    elif command == "update":
        changes = {f: getattr(args, f) for f in ("name", "description")
                   if getattr(args, f) is not None}
        key = client.update_key(args.key_or_uid, **changes)
    elif command == "restrict":
        return run_restrict(client, args)
    elif command == "rotate":
        key = rotate_key(client, args.key_or_uid, args.grace)
    elif command == "revoke-tokens":
        return _print(args, client.request("POST", _key_path(args.key_or_uid) + "/revoke-tokens",
                                           {"issuedBefore": args.before}), [])
    elif command == "revoke-token":
        return _print(args, client.request("POST", _key_path(args.key_or_uid) + "/revoke-token",
                                           {"token": args.token}), [])
    elif command == "usage":
        print(usage_table(client.keys_with_usage()))
        return 0
    elif command == "history":
        print(history_table(client.history(args.key_or_uid, args.offset, args.limit)))
        return 0
    elif command == "deleted":
        listing = client.list_keys(args.offset, args.limit, "/keys/deleted")
        return _print(args, listing, [k.get("key") for k in listing.get("results", [])])
    elif command == "restore":
        key = client.request("POST", _key_path(args.uid) + "/restore")
    else:
        client.delete_key(args.key_or_uid)
        return 0
    return _print(args, key, [key.get("key")])


def expiring_keys(keys, within, now):
    """`keys list --expiring`: the keys (GET /keys results) that stop working
    (expiresAt, or retiresAt of a rotated key on searchkeys) within `within`
    seconds of `now`, soonest first, as a listing."""
    def end(key):
        ends = [parse_expires_at(key[field]) for field in ("expiresAt", "retiresAt")
                if isinstance(key.get(field), str)]
        return min((instant.ns for instant in ends if instant is not None), default=None)
    soon = sorted((end(key), position, key) for position, key in enumerate(keys)
                  if end(key) is not None and now * 10 ** 9 < end(key) <= (now + within) * 10 ** 9)
    return {"results": [key for _, _, key in soon], "total": len(soon)}


def usage_table(keys):
    """The usage of `keys` (GET /keys?usage=true results) as a text table,
    most used first; a key never used says so in its last column."""
    rows = [["NAME", "UID", "ALLOWED", "REFUSED"] + [r.upper() for r in USAGE_REASONS] +
            ["LAST USED"]]

    def total(key):
        return key["usage"]["allowed"] + sum(key["usage"]["refused"].values())

    for key in sorted(keys, key=lambda key: -total(key)):
        usage = key["usage"]
        rows.append([printable(key.get("name") or "-")[:40], key["uid"], usage["allowed"],
                     total(key) - usage["allowed"]] +
                    [usage["refused"].get(reason, 0) for reason in USAGE_REASONS] +
                    [usage["lastUsedAt"] or "never"])
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths))
                     .rstrip() for row in rows)


def history_table(page):
    """A page of GET /keys/history as a text table, newest first: when, what
    change, which key, by whom, and the fields it set (JSON)."""
    rows = [["AT", "CHANGE", "UID", "NAME", "BY", "FIELDS"]]
    for entry in page.get("results", []):
        rows.append([entry.get("at"), entry.get("change"), entry.get("uid"),
                     printable(entry.get("name") or "-")[:40], entry.get("by"),
                     printable(compact_json(entry.get("fields") or {}))])
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) + "  " +
             row[-1] for row in rows]
    lines.append("(%d of %d changes)" % (len(rows) - 1, page.get("total", 0)))
    return "\n".join(line.rstrip() for line in lines)


def restrict_created_key(client, key):
    """Give a new search-preset key the search restrictions.  A server without the restrictions
    API (Meilisearch) keeps the key, with a warning; any other failure deletes it again, so no
    unrestricted frontend key is left behind (fail closed)."""
    path = _key_path(key["uid"]) + "/restrictions"
    try:
        client.request("PUT", path, RESTRICTION_PRESETS["search"])
        return
    except ClientError as exc:
        if no_such_route(exc):
            _log_to_stderr("searchkeys: warning: %s has no restrictions API (Meilisearch?): the "
                           "key is created without a rate limit or hit cap" % client.url)
            return
        failure = exc
    except ConnectionFailed as exc:
        failure = exc
    try:
        client.delete_key(key["uid"])
        outcome = "the key was deleted again"
    except (ClientError, ConnectionFailed):
        outcome = "the key %s is left WITHOUT restrictions: delete it" % key["uid"]
    context = " (while setting the search preset's restrictions; %s)" % outcome
    if isinstance(failure, ClientError):
        raise ClientError(failure.status, failure.code, failure.message + context)
    raise ConnectionFailed(str(failure) + context)


def rotate_key(client, key_or_uid, grace):
    """`keys rotate`: the server's rotation; on a plain Meilisearch (no such
    route), a copy of the key, and a line saying how to delete the old one."""
    try:
        return client.rotate_key(key_or_uid, grace)
    except ClientError as exc:
        if not no_such_route(exc):
            raise
    old = client.get_key(key_or_uid)
    check_no_restrictions_lost(client, old["uid"])
    new = client.create_key(old["actions"], old["indexes"], old.get("expiresAt"),
                            name=old.get("name"), description=old.get("description"))
    _log_to_stderr(
        "searchkeys: warning: %s cannot rotate keys (Meilisearch?): created a copy with a new "
        "value instead (no restrictions can be set there, and --grace does not apply); once "
        "every client uses it, delete the old key: searchkeys.py keys delete %s --url %s"
        % (client.url, old["uid"], shlex.quote(client.url)))
    return new


def check_no_restrictions_lost(client, uid):
    """A copy made with POST /keys has no restrictions: refuse to make one of
    a key that has some (a searchkeys older than rotation, or one behind a
    proxy that hides the route), as it would hand out the key unrestricted."""
    context = " (while checking that the key has no restrictions a copy would lose)"
    try:
        restrictions = client.request("GET", _key_path(uid) + "/restrictions")
    except ClientError as exc:
        if no_such_route(exc):
            return  # a plain Meilisearch: no restrictions to lose
        raise ClientError(exc.status, exc.code, exc.message + context)
    if isinstance(restrictions, dict) and any(
            restrictions.get(field) is not None for field in RESTRICTION_FIELDS):
        raise ClientError(404, "rotation_unavailable", "%s cannot rotate keys, and a copy of "
                          "key %s would not have its restrictions: rotate it where searchkeys "
                          "has the route (or copy it and its restrictions by hand)"
                          % (client.url, uid))


def _print(args, value, key_values):
    if args.quiet:
        for key_value in key_values:
            print(key_value)
    else:
        print(json.dumps(value, indent=2, ensure_ascii=False))
    return 0


def run_token(args):
    print(sign_tenant_token(args.api_key, args.uid, args.rules, args.expires_at,
                            args.algorithm))
    return 0


def check_client_args(parser, args):
    """Catch bad arguments before any request is sent."""
    args.url = getattr(args, "url", None) or os.environ.get("MEILI_URL") or DEFAULT_URL
    args.key = getattr(args, "key", None) or os.environ.get("MEILI_MASTER_KEY")
    args.quiet = getattr(args, "quiet", False)
    try:
        check_text_args(args, ("key", "name", "description", "key_or_uid", "api_key", "rules",
                               "token", "before"))
        if args.command == "keys":
            check_connection_args(args)
        if args.command == "keys" and args.keys_command == "create":
            args.actions = PRESETS[args.preset] if args.preset else check_actions(args.actions)
            if args.no_restrictions and args.preset != "search":
                raise ValueError("--no-restrictions goes with --preset search")
            args.indexes = check_indexes(args.indexes)
            args.expires_at = check_expires_at(args.expires_at)
            if args.uid is not None:
                args.uid = check_uid(args.uid)
        elif args.command == "keys" and args.keys_command == "restrict":
            args.restrictions = restrictions_from_args(args)
        elif args.command == "keys" and args.keys_command == "revoke-tokens" \
                and args.before is not None and parse_expires_at(args.before) is None:
            raise ValueError("--before `%s` is not a date: write it as RFC 3339, e.g. "
                             "2030-01-31T00:00:00Z" % args.before)
        elif args.command == "keys" and args.keys_command == "revoke-token" \
                and args.token == "-":
            args.token = token_from_stdin()
        elif args.command == "keys" and args.keys_command == "rotate" \
                and args.grace is not None:
            try:
                parse_grace(args.grace)
            except ValueError as exc:
                raise ValueError("--grace `%s`: %s" % (args.grace, exc))
        elif args.command == "keys" and args.keys_command in ("list", "history", "deleted"):
            for name in ("offset", "limit"):
                if getattr(args, name) is not None and getattr(args, name) < 0:
                    raise ValueError("--%s must be 0 or more" % name)
            if args.keys_command == "list" and args.expiring is not None:
                args.expiring = parse_duration(args.expiring, "--expiring", MAX_EXPIRING)
        elif args.command == "keys" and args.keys_command == "restore":
            args.uid = check_uid(args.uid, "UID")
        elif args.command == "token":
            args.uid = check_uid(args.uid)
            try:
                args.rules = json.loads(args.rules)
            except ValueError as exc:
                raise ValueError("--rules is not JSON: %s" % exc)
            try:
                read_search_rules(args.rules)
            except _SerdeError:
                raise ValueError("--rules must be a JSON array of index patterns or an object "
                                 "of index pattern -> null or {\"filter\": ...}")
            if args.expires_at is not None:
                text = check_expires_at(args.expires_at)  # None for `never`: no `exp`
                args.expires_at = parse_expires_at(text).ns // 10 ** 9 if text else None
    except ValueError as exc:
        parser.error(str(exc))


def check_text_args(args, names):
    """The named options, where given, must be non-empty UTF-8 text (not
    undecodable bytes from the command line)."""
    for name in names:
        value = getattr(args, name, None)
        shown = name.upper() if name == "key_or_uid" else "--" + name.replace("_", "-")
        if value == "" and name in ("key_or_uid", "api_key"):
            raise ValueError("%s is empty" % shown)
        try:
            value is None or value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("%s is not valid UTF-8 text" % shown)


def token_from_stdin():
    """`keys revoke-token KEY -`: the tenant token from standard input, its
    surrounding whitespace (a final newline) dropped; at most MAX_HEAD bytes,
    as no request could carry a longer one."""
    data = sys.stdin.buffer.read(MAX_HEAD + 1).strip()
    if not data:
        raise ValueError("TOKEN is `-`, but standard input holds no token")
    if len(data) > MAX_HEAD:
        raise ValueError("TOKEN is `-`, but standard input holds more than %d bytes: no "
                         "tenant token is that long" % MAX_HEAD)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("TOKEN is `-`, but standard input is not valid UTF-8 text")


def check_connection_args(args):
    try:
        http_url(args.url)
    except ValueError as exc:
        raise ValueError("--url %s" % exc)
    if args.key is not None and not (args.key.isascii() and args.key.isprintable()):
        raise ValueError("--key holds a character that cannot be sent in an HTTP header")


def check_uid(text, shown="--uid"):
    try:
        return parse_uuid(text)
    except ValueError as exc:
        raise ValueError("%s `%s` is not a UUID: %s" % (shown, text, exc))


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # checked here, after unknown options: those are said first
        parser.error("the following arguments are required: COMMAND")
    if args.command == "serve":
        check_serve_args(args.command_parser, args)
        return run_serve(args)
    check_client_args(args.command_parser, args)
    try:
        if args.command == "token":
            return run_token(args)
        return run_keys(args)
    except ClientError as exc:
        _log_to_stderr("error: %s: %s" % (exc.code, exc.message))
    except ConnectionFailed as exc:
        _log_to_stderr("error: %s" % exc)
    return 1


# =============================================================================
# Appendix: the keys page as HTML (pure), its CSS and JavaScript
# =============================================================================

KEYS_PAGE_STYLE = """
:root{color-scheme:light dark;--muted:#767676;--line:#8885;--warn:#b45309;--bad:#dc2626}
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;
max-width:90rem;padding:.75rem}
h1{font-size:1.35rem;margin:.2rem 0 .6rem}h2{font-size:1.1rem;margin:1.2rem 0 .5rem}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:.35rem .5rem;border-bottom:1px solid var(--line);
vertical-align:top;overflow-wrap:break-word}
code{font-size:.85rem}.muted{color:var(--muted)}
.soon,.never{color:var(--warn);font-weight:600}.expired,.bad{color:var(--bad);font-weight:600}
tr.ends-soon td,tr.ends-expired td{background:#f59e0b1a}
.note,.problem{border:1px solid var(--line);padding:.5rem .75rem;margin:.5rem 0}
.problem{border-color:var(--bad)}.note code{user-select:all;font-size:1rem}
form{display:flex;flex-wrap:wrap;gap:.5rem;align-items:flex-end;margin:.25rem 0}
td form{display:inline-flex;margin:0 .25rem .25rem 0}
label{display:flex;flex-direction:column;font-size:.85rem}
input,select,button{font:inherit;padding:.25rem .4rem;max-width:100%}
svg.hours{width:8rem;height:2rem;color:#2563eb;display:block}
svg.hours rect.none{color:var(--line)}
@media (max-width:48rem){
body{font-size:14px;padding:.5rem}thead{display:none}
table,tbody,tr,td{display:block;width:auto}tr{border-bottom:2px solid var(--line);padding:.4rem 0}
td{border:0;padding:.15rem 0;display:grid;grid-template-columns:6.5rem 1fr;gap:.5rem;
overflow-wrap:anywhere}td::before{content:attr(data-label);color:var(--muted)}}
"""

# Rotating, deleting or restoring asks first (a form's `data-confirm`); nothing else needs script.
KEYS_PAGE_SCRIPT = """
"use strict";
document.querySelectorAll("form[data-confirm]").forEach(function (form) {
  form.addEventListener("submit", function (event) {
    if (!window.confirm(form.dataset.confirm)) event.preventDefault();
  });
});
"""


def html_text(value):
    """Text (or a number) made safe inside HTML elements and quoted attributes."""
    return html.escape(str(value), quote=True)


class KeysPageHtml:
    """The keys page (KeysPage) as HTML for people, from the values it is
    given: every one escaped; inline CSS and script allowed by a nonce per
    answer, everything else refused by its Content-Security-Policy; never
    cached, framed or named in a Referer."""

    COLUMNS = ("Key", "Actions", "Indexes", "Restrictions", "Expires", "Usage",
               "Last %d hours" % USAGE_HOURS, "Change")

    @classmethod
    def page(cls, status, keys, total, presets, nonce, created=None, problem=None, deleted=()):
        """`keys`: what KeysPage._key shows of each; `total`: how many there
        are; `nonce`: the forms' (PageNonces); `created`: a key just made,
        whose value is shown; `problem`: why a change was not made;
        `deleted`: the deleted keys that can be restored (GET /keys/deleted's
        items, whose values are not shown)."""
        parts = ["<h1>searchkeys: API keys</h1>"]
        if problem is not None:
            parts.append('<p class="problem" id="problem">%s</p>' % html_text(problem))
        if created is not None:
            parts.append(
                '<div class="note" id="created"><p>New key <b>%s</b> (<code>%s</code>): copy '
                'its value now, this page shows it only now:</p><p><code>%s</code></p></div>'
                % (html_text(created["name"] or "without a name"), html_text(created["uid"]),
                   html_text(created["key"])))
        parts.append(cls.create_form(presets, nonce))
        more = "" if len(keys) == total else " (the newest %d of %d)" % (len(keys), total)
        parts.append("<h2>Keys%s</h2>" % more)
        parts.append('<table id="keys"><thead><tr>%s</tr></thead><tbody>\n%s</tbody></table>' % (
            "".join("<th>%s</th>" % name for name in cls.COLUMNS),
            "\n".join(cls.row(key, nonce) for key in keys)))
        parts.append('<p class="muted">Usage counts are kept in the store; the hourly '
                     'requests are this process\'s since it started.</p>')
        if deleted:
            parts.append(cls.deleted_table(deleted, nonce))
        script_nonce = secrets.token_urlsafe(18)
        document = (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            '<meta name="referrer" content="no-referrer">\n'
            '<link rel="icon" href="data:,"><title>searchkeys: API keys</title>\n'
            '<style nonce="%s">%s</style></head>\n<body><main>\n%s\n</main>\n'
            '<script nonce="%s">%s</script>\n</body></html>\n'
            % (script_nonce, KEYS_PAGE_STYLE, "\n".join(parts), script_nonce, KEYS_PAGE_SCRIPT))
        policy = ("default-src 'none'; style-src 'nonce-%s'; script-src 'nonce-%s'; "
                  "img-src data:; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
                  % (script_nonce, script_nonce))
        return Response(status, [
            ("Content-Type", "text/html; charset=utf-8"), ("Cache-Control", "no-store"),
            ("Content-Security-Policy", policy), ("X-Content-Type-Options", "nosniff"),
            ("X-Frame-Options", "DENY"), ("Referrer-Policy", "no-referrer")],
            document.encode("utf-8", "replace"))

    @staticmethod
    def create_form(presets, nonce):
        options = "".join('<option>%s</option>' % html_text(name) for name in presets)
        return (
            '<h2>New key</h2><form method="post" action="/keys/page" id="create">'
            '<input type="hidden" name="nonce" value="%s">'
            '<input type="hidden" name="change" value="create">'
            '<label>Preset <select name="preset">%s</select></label>'
            '<label>Name <input name="name" maxlength="200"></label>'
            '<label>Indexes <input name="indexes" value="*" maxlength="1000"></label>'
            '<label>Expires at <input name="expiresAt" placeholder="2030-01-01T00:00:00Z" '
            'maxlength="40"></label><button>Create</button></form>' % (html_text(nonce), options))

    @classmethod
    def row(cls, key, nonce):
        ends, usage = key["ends"], key["usage"]
        expires = html_text(key["expiresAt"] or "never")
        if key.get("retiresAt"):
            expires += '<br>rotated: retires %s, replaced by <code>%s</code>' % (
                html_text(key["retiresAt"]), html_text(key["replacedBy"]))
        if ends is not None:
            expires = '<span class="%s">%s</span> %s' % (ends, "expired" if ends == "expired"
                                                          else "expires soon", expires)
        refused = ", ".join("%s %d" % (html_text(reason), n)
                            for reason, n in usage["refused"].items() if n)
        last = usage["lastUsedAt"]
        cells = [
            ('<b>%s</b><br><code>%s</code>%s' % (
                html_text(key["name"]) if key["name"] else '<span class="muted">no name</span>',
                html_text(key["uid"]), "<br>" + html_text(key["description"])
                if key["description"] else "")),
            html_text(", ".join(key["actions"])),
            html_text(", ".join(key["indexes"])),
            html_text(compact_json(key["restrictions"])) if key["restrictions"]
            else '<span class="muted">none</span>',
            expires,
            "allowed %d<br>refused %s<br>%s" % (
                usage["allowed"], refused or "0",
                "last used " + html_text(last) if last else '<span class="never">never used'
                                                              '</span>'),
            cls.chart(key["hours"]),
            cls.change_form("rotate", "Rotate", key, nonce) +
            cls.change_form("delete", "Delete", key, nonce)]
        return '<tr id="key-%s"%s>%s</tr>' % (
            html_text(key["uid"]), ' class="ends-%s"' % ends if ends else "",
            "".join('<td data-label="%s"><div>%s</div></td>' % (name, cell)
                    for name, cell in zip(cls.COLUMNS, cells)))

    @classmethod
    def deleted_table(cls, deleted, nonce):
        rows = "\n".join(
            '<tr id="deleted-%s"><td data-label="Key"><div><b>%s</b><br><code>%s</code></div></td>'
            '<td data-label="Actions"><div>%s</div></td><td data-label="Indexes"><div>%s</div>'
            '</td><td data-label="Deleted"><div>%s<br>by %s</div></td>'
            '<td data-label="Change"><div>%s</div></td></tr>' % (
                html_text(key["uid"]), html_text(key["name"]) if key["name"]
                else '<span class="muted">no name</span>', html_text(key["uid"]),
                html_text(", ".join(key["actions"])), html_text(", ".join(key["indexes"])),
                html_text(key["deletedAt"]), html_text(key["deletedBy"]),
                cls.change_form("restore", "Restore", key, nonce))
            for key in deleted)
        return ('<h2>Deleted keys</h2><table id="deleted"><thead><tr><th>Key</th><th>Actions'
                '</th><th>Indexes</th><th>Deleted</th><th>Change</th></tr></thead><tbody>\n%s'
                '</tbody></table>' % rows)

    @staticmethod
    def change_form(change, label, key, nonce):
        question = "%s the key %s (%s)?%s" % (
            label, key["name"] or "without a name", key["uid"],
            " Its clients must be given the new key's value." if change == "rotate" else
            " It works again, with its old value." if change == "restore" else
            " It stops working now.")
        return ('<form method="post" action="/keys/page" data-confirm="%s">'
                '<input type="hidden" name="nonce" value="%s">'
                '<input type="hidden" name="change" value="%s">'
                '<input type="hidden" name="uid" value="%s"><button>%s</button></form>'
                % (html_text(question), html_text(nonce), change, html_text(key["uid"]), label))

    @staticmethod
    def chart(hours):
        """An inline SVG bar per hour, oldest first; each bar's title says its count."""
        top, width, last = max(hours) or 1, 4, len(hours) - 1
        bars = "".join(
            '<rect x="%d" y="%.1f" width="%d" height="%.1f" fill="currentColor"%s>'
            '<title>%s: %d</title></rect>' % (
                i * width, 24 - (20.0 * n / top if n else 1), width - 1,
                20.0 * n / top if n else 1, "" if n else ' class="none"',
                "this hour" if i == last else "1 hour ago" if i == last - 1
                else "%d hours ago" % (last - i), n)
            for i, n in enumerate(hours))
        return ('<svg class="hours" viewBox="0 0 %d 24" role="img" aria-label="%d requests in '
                'the last %d hours">%s</svg>' % (width * len(hours), sum(hours), len(hours), bars))


ROUTES = build_routes()
ROUTE_INDEX = {(route.method, route.pattern): route for route in ROUTES}
_ROUTES_BY_SHAPE = _routes_by_shape(ROUTES)
_check_route_table(ROUTES)


if __name__ == "__main__":
    sys.exit(main())
