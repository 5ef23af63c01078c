"""Differential fuzzer (issue 35): webhookd.py against Debian's Go webhook 2.8, case by case.

A seeded generator writes hooks and requests; each case is one hook (its own id) and one request,
sent to both programs, started with the same hooks file (JSON or YAML), the same flags and the
same environment, each on a free loopback port. Compared, byte for byte, is everything a sender
or a command can observe:

  - the answer: status line, body, and the headers a sender sees, minus `Date` and webhookd's own
    `X-Webhookd-Run`; the request goes with `Connection: close`, kept alive (then `GET /` on the
    same connection, whose answer is compared too), as HTTP/1.0, with a chunked body, or with
    `Expect: 100-continue` (an interim answer is part of the status line compared);
  - what the command got: the hook's command is tests/fixtures/webhook_record.py under a link
    named after the case, which records its argv, environment, stdin and the files the
    environment names (pass-file-to-command), and prints the same (for
    include-command-output-in-response).

The client's port (`remote-addr`) is the only value written as a placeholder on both sides.
One daemon of each program serves a batch of cases (one hooks file with a hook per case).
Every difference fails the test unless it is in DELIBERATE (each entry with its reason).

DIFF_SEED (default fixed) and DIFF_CASES choose the run; DIFF_CASE=N runs one case (with its
batch's flags). A failure prints the seed, the case number, the hook and the raw request.
"""
import collections
import concurrent.futures
import hashlib
import hmac
import json
import os
import random
import re
import socket
import sys
import time
import urllib.parse
from email.utils import formatdate
from pathlib import Path

import pytest

import support

SEED = int(os.environ.get("DIFF_SEED", "20261127"))
CASES = int(os.environ.get("DIFF_CASES", "1000"))
ONLY_CASE = os.environ.get("DIFF_CASE")
BATCH = 200          # cases per pair of daemons
WORKERS = 4          # cases in flight at once
SHOWN = 20           # failures printed in full (the others by number)
# content-security-policy: ours only, on purpose: a command's output is sent sandboxed (issue 29:
# Go's sniffing may serve it as HTML on the status page's origin)
IGNORED_HEADERS = {"date", "x-webhookd-run", "content-security-policy"}


# ---------------------------------------------------------------------------------------------
# Deliberate differences: (name, reason, predicate(case, go, ours)). A difference is excused
# only when a predicate says it is this one.
# ---------------------------------------------------------------------------------------------

def _placeholder_secret(case, go, ours):
    return "replace-with-" in json.dumps(case.hook) and ours["code"] == 404 \
        and ours["body"] == (b"" if case.method == "HEAD" else b"Hook not found.") \
        and ours["command"] is None


FRAMING = {"content-length", "transfer-encoding"}


def _framing(case, go, ours):
    if go["status"] != ours["status"] or go["body"] != ours["body"] \
            or go["command"] != ours["command"] \
            or go["next on the connection"] != ours["next on the connection"]:
        return False
    rest = [[h for h in side["headers"] if h[0] not in FRAMING] for side in (go, ours)]
    chunked = ("transfer-encoding", "chunked")
    go_unframed = not any(h[0] == "content-length" for h in go["headers"])
    return rest[0] == rest[1] and go_unframed and chunked not in ours["headers"]


def _continue_before_multipart_error(case, go, ours):
    multipart_500 = b"Error occurred while parsing multipart form."
    if case.method == "HEAD":
        multipart_500 = b""
    return case.transport == "expect" and go["body"] == ours["body"] == multipart_500 \
        and go["code"] == 500 \
        and ours["status"] == "HTTP/1.1 100 Continue + " + go["status"] \
        and all(go[k] == ours[k] for k in ("headers", "command"))


DELIBERATE = [
    ("placeholder secret",
     "a hook whose secret or value is still a shipped `replace-with-...` placeholder is not "
     "served by webhookd (upstream serves it to anyone who read the example); docs/webhookd.md",
     _placeholder_secret),
    ("framing",
     "Go's server sends an answer of more than 2 KiB chunked (to HTTP/1.0: ended by closing "
     "the connection; to HEAD: with no length at all); "
     "webhookd knows the whole body and sends its Content-Length. The same bytes arrive "
     "(compared after de-chunking); only the framing headers differ",
     _framing),
    ("100 Continue before a multipart error",
     "webhookd reads a hook's body (asking for it with `100 Continue`) before parsing it; Go's "
     "multipart reader refuses a request whose own Content-Type is not multipart with a "
     "boundary (e.g. under incoming-payload-content-type) before reading. Both answer the same "
     "500; only the interim answer differs",
     _continue_before_multipart_error),
]


# ---------------------------------------------------------------------------------------------
# Generator: pools of keys, values, numbers and headers
# ---------------------------------------------------------------------------------------------

KEYS = ["a", "b", "ref", "name", "repository", "commits", "id", "x.y", "0", "Ünï", "with space",
        "key-dash", "UPPER", "日本", "a.b", "head_commit", "payload", ""]
STRINGS = ["plain", "with space", "ünïcödé", "日本語", "emoji 😀", 'quote"in', "back\\slash",
           "<b>&amp;</b>", "line\nbreak", "tab\tin", "", "refs/heads/main", "1.50", "true",
           "null", "a,b;c", "%41+%2B", "sha1=x", "  padded  ", "\u00e9", "\u2028sep",
           "bad\udcffbyte", "cut\udce6\udc97",   # (surrogates: bytes that are not UTF-8)
           "long " + "x" * 2100]   # output over 2 KiB: Go's answer is chunked
NUMBERS = ["0", "-0", "1", "-1", "42", "1.0", "1.50", "-0.0", "1e5", "1E5", "1e+5", "1e-5",
           "1.5e300", "1e400", "123456789012345678901234567890", "9007199254740993", "0.1",
           "-12.340e-2", "3.14159", "100000000000000000000.0", "5e-324"]
HEADERS = ["X-Event", "x-custom-header", "X-GITHUB-EVENT", "x-Request-ID", "X-Token", "Foo",
           "X-Dup", "x_under", "X-Hub-Signature", "X-Weird-CASE"]
HEADER_VALUES = ["push", "Deploy Now", "ünï", "a, b", "  spaced  ", "token-123", "", "1",
                 "sha1=abc", "日本", "raw\udcff"]
CONTENT_TYPES = {
    "json": ["application/json", "application/json; charset=utf-8", "Application/JSON",
             "application/vnd.api+json", "text/json"],
    "form": ["application/x-www-form-urlencoded",
             "application/x-www-form-urlencoded; charset=UTF-8"],
    "xml": ["application/xml", "text/xml", "application/atom+xml; charset=utf-8"],
    "multipart": ["multipart/form-data"],
    "none": [None],
    "unknown": ["text/plain", "application/octet-stream", "foo/bar-json-ish"],
}
SECRET_POOL = ["s3cr3t", "another-secret", "ünïcödé-secret", "k" * 40, "mellon"]
METHODS = ["POST"] * 6 + ["GET"] * 2 + ["PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


class Payload:
    """A body and the parameter names (dot paths) it holds, with their rendering when simple."""

    def __init__(self):
        self.body = b""
        self.paths = {}     # name -> rendering (str) or None when not simple


def json_string(rng, s):
    """JSON text of s with random escaping (\\u escapes, surrogate pairs, \\/)."""
    out = ['"']
    if rng.random() < 0.03:
        out.append(rng.choice(["\\ud800", "\\udc80", "\\ud83dx"]))    # a lone surrogate
    for ch in s:
        cp = ord(ch)
        if 0xdc80 <= cp <= 0xdcff:
            out.append(ch)              # a raw byte that is not UTF-8
        elif ch in '"\\':
            out.append("\\" + ch)
        elif ch == "/" and rng.random() < 0.5:
            out.append("\\/")
        elif cp < 0x20 or (cp > 0x7e and rng.random() < 0.3):
            if cp > 0xffff:
                cp -= 0x10000
                out.append("\\u%04x\\u%04x" % (0xd800 + (cp >> 10), 0xdc00 + (cp & 0x3ff)))
            else:
                out.append("\\u%04x" % cp)
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def gen_json(rng, depth, path, paths):
    """Random JSON text; records leaf paths in `paths`."""
    r = rng.random()
    if depth < 3 and r < 0.25:
        items, keys = [], []
        for _ in range(rng.randint(0, 4)):
            key = rng.choice(KEYS)
            if keys and rng.random() < 0.15:
                key = rng.choice(keys)      # a duplicate key: the last one wins
            keys.append(key)
            sub = (path + "." if path else "") + key
            items.append(json_string(rng, key) + ":" + gen_json(rng, depth + 1, sub, paths))
        paths.setdefault(path, None)
        return "{" + ",".join(items) + "}"
    if depth < 3 and r < 0.4:
        items = [gen_json(rng, depth + 1, (path + "." if path else "") + str(i), paths)
                 for i in range(rng.randint(0, 3))]
        paths.setdefault(path, None)
        return "[" + ", ".join(items) + "]"
    if r < 0.6:
        s = rng.choice(STRINGS)
        paths[path] = s
        return json_string(rng, s)
    if r < 0.85:
        n = rng.choice(NUMBERS)
        paths[path] = n
        return n
    lit = rng.choice(["true", "false", "null"])
    paths[path] = lit if lit != "null" else None
    return lit


def gen_json_payload(rng):
    p = Payload()
    r = rng.random()
    if r < 0.7:
        items = []
        for _ in range(rng.randint(1, 5)):
            key = rng.choice(KEYS)
            if rng.random() < 0.15:
                # a string holding JSON, for parse-parameters-as-json
                inner = {}
                text = gen_json(rng, 1, "", inner)
                p.paths[key] = None
                for k in inner:
                    p.paths.setdefault(key + ("." + k if k else ""), None)
                items.append(json_string(rng, key) + ":" + json_string(rng, text))
            else:
                items.append(json_string(rng, key) + ":" + gen_json(rng, 1, key, p.paths))
        text = "{" + ",".join(items) + "}"
    elif r < 0.85:
        text = gen_json(rng, 1, "root", p.paths)
        if not text.startswith("["):
            text = "[" + text + "]"
            p.paths = {"root.0" + k[4:]: v for k, v in p.paths.items()}
    elif r < 0.93:
        text = gen_json(rng, 3, "", {})      # a scalar at the top
    else:
        text = rng.choice(['{"a": 1', '{"a": 1}{"b": 2}', "not json", "", '{"a":1,}'])
    if rng.random() < 0.2:
        text = " \n" + text + "\n"
    p.body = raw_bytes(text)
    return p


def raw_bytes(text):
    """Text to bytes, surrogates back to the bytes they stand for."""
    return text.encode("utf-8", "surrogateescape")


def encode_component(rng, s):
    s = raw_bytes(s)
    r = rng.random()
    if r < 0.5:
        return urllib.parse.quote_plus(s, safe="")
    if r < 0.8:
        return urllib.parse.quote(s, safe="")
    if r < 0.95:
        return urllib.parse.quote(s, safe="/:@!$'()*,;")
    return urllib.parse.quote(s, safe=" ").replace(" ", "+")


def gen_pairs(rng, count):
    pairs = []
    for _ in range(count):
        key = rng.choice(KEYS[:8] + ["q", "token", "mode"]) if pairs == [] or rng.random() > 0.2 \
            else pairs[-1][0]          # a repeated parameter: the first one counts
        pairs.append((key, rng.choice(STRINGS + NUMBERS[:5])))
    return pairs


def encode_pairs(rng, pairs):
    parts = []
    for k, v in pairs:
        if v == "" and rng.random() < 0.3:
            parts.append(encode_component(rng, k))
        else:
            parts.append(encode_component(rng, k) + "=" + encode_component(rng, v))
    if rng.random() < 0.05:
        parts.append(rng.choice(["%zz=1", "a=%", "&", "=x", "b=%E9"]))
    return "&".join(parts)


def first_values(pairs):
    seen = {}
    for k, v in pairs:
        seen.setdefault(k, v)
    return seen


def gen_form_payload(rng):
    p = Payload()
    pairs = gen_pairs(rng, rng.randint(0, 5))
    if rng.random() < 0.2:
        inner = {}
        text = gen_json(rng, 1, "", inner)
        pairs.append(("payload", text))
        for k in inner:
            p.paths.setdefault("payload" + ("." + k if k else ""), None)
    p.body = encode_pairs(rng, pairs).encode()
    for k, v in first_values(pairs).items():
        p.paths.setdefault(k, v)
    return p


def gen_multipart_payload(rng, boundary):
    p = Payload()
    parts = []
    for _ in range(rng.randint(0, 4)):
        name = rng.choice(KEYS[:8] + ["payload", "file"])
        r = rng.random()
        if r < 0.55:
            value = rng.choice(STRINGS)
            head = 'Content-Disposition: form-data; name="%s"' % name
            parts.append(head.encode() + b"\r\n\r\n" + raw_bytes(value))
            p.paths.setdefault(name, value)
        else:
            inner = {}
            text = gen_json(rng, 1, "", inner)
            ctype = rng.choice(["application/json", "text/plain",
                                "application/json; charset=utf-8"])
            head = 'Content-Disposition: form-data; name="%s"; filename="%s.json"\r\n' \
                   'Content-Type: %s' % (name, name, ctype)
            parts.append(head.encode() + b"\r\n\r\n" + raw_bytes(text))
            for k in inner:
                p.paths.setdefault(name + ("." + k if k else ""), None)
    body = b"".join(b"--" + boundary + b"\r\n" + part + b"\r\n" for part in parts)
    body += b"--" + boundary + b"--\r\n"
    if rng.random() < 0.05:
        body = body[:-4]             # malformed: no final boundary
    p.body = body
    return p


XML_NAMES = ["root", "a", "b", "item", "name", "x"]


def gen_xml(rng, depth, path, paths):
    tag = rng.choice(XML_NAMES[1:])
    attrs = ""
    if rng.random() < 0.3:
        attrs = ' id="%s"' % rng.choice(["1", "x", "ü"])
        paths.setdefault(path + "." + tag + ".-id", None)
    if depth < 2 and rng.random() < 0.5:
        kids = "".join(gen_xml(rng, depth + 1, path + "." + tag, paths)
                       for _ in range(rng.randint(1, 3)))
        return "<%s%s>%s</%s>" % (tag, attrs, kids, tag)
    text = rng.choice(["text", "1.50", "ünï", "", "a &amp; b", "42"])
    paths.setdefault(path + "." + tag, None)
    return "<%s%s>%s</%s>" % (tag, attrs, text, tag)


def gen_xml_payload(rng):
    p = Payload()
    inner = "".join(gen_xml(rng, 1, "root", p.paths) for _ in range(rng.randint(1, 3)))
    text = "<root>" + inner + "</root>"
    if rng.random() < 0.3:
        text = '<?xml version="1.0" encoding="UTF-8"?>\n' + text
    if rng.random() < 0.05:
        text = text[:-3]
    p.body = text.encode()
    return p


# ---------------------------------------------------------------------------------------------
# Generator: a case is one hook and one request
# ---------------------------------------------------------------------------------------------

class Case:
    def __init__(self, number, hook, method, target, headers, body, transport):
        self.number = number
        self.hook = hook
        self.method = method
        self.target = target
        self.headers = headers      # [(name, value)] in order, as sent
        self.body = body
        # "close" (Connection: close), "keep-alive" (then `GET /` on the same connection),
        # "http/1.0", "chunked" (the body in chunks), "expect" (Expect: 100-continue, the body
        # sent at once): all but keep-alive with Connection: close
        self.transport = transport

    def raw(self):
        version = "HTTP/1.0" if self.transport == "http/1.0" else "HTTP/1.1"
        head = "%s %s %s\r\n" % (self.method, self.target, version)
        lines = [("Host", "example.org")] + self.headers
        if self.transport in ("close", "chunked", "expect"):
            lines.append(("Connection", "close"))
        if self.transport == "expect":
            lines.append(("Expect", "100-continue"))
        body = self.body
        if self.transport == "chunked":
            lines.append(("Transfer-Encoding", "chunked"))
            size = max(1, len(body) // 3)
            body = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                            for i in range(0, len(body), size)) + b"0\r\n\r\n"
        elif self.body or self.method in ("POST", "PUT", "PATCH"):
            lines.append(("Content-Length", str(len(self.body))))
        data = head.encode() + b"".join(
            n.encode() + b": " + raw_bytes(v) + b"\r\n" for n, v in lines) + b"\r\n"
        return data + body


class Request:
    """What the request offers to the hook's parameters."""

    def __init__(self):
        self.method = "POST"
        self.headers = []
        self.query = []
        self.payload = Payload()
        self.ctype = None


def odd_case(rng, name):
    r = rng.random()
    if r < 0.5:
        return name
    if r < 0.7:
        return name.lower()
    if r < 0.85:
        return name.upper()
    return "".join(c.upper() if rng.random() < 0.5 else c.lower() for c in name)


def gen_request(rng):
    req = Request()
    req.method = rng.choice(METHODS)
    req.query = gen_pairs(rng, rng.choice([0, 0, 1, 2, 3, 4]))
    for _ in range(rng.randint(0, 4)):
        name = rng.choice(HEADERS)
        req.headers.append((odd_case(rng, name), rng.choice(HEADER_VALUES)))
        if rng.random() < 0.15:
            req.headers.append((odd_case(rng, name), rng.choice(HEADER_VALUES)))
    kind = rng.choice(["json"] * 4 + ["form", "form", "multipart", "xml", "none", "unknown"])
    req.kind = kind
    if kind == "json":
        req.payload = gen_json_payload(rng)
    elif kind == "form":
        req.payload = gen_form_payload(rng)
    elif kind == "multipart":
        boundary = rng.choice([b"XyZ", b"----boundary1234", b"a'b"])
        req.payload = gen_multipart_payload(rng, boundary)
        ctype = "multipart/form-data; boundary=" + (
            boundary.decode() if b"'" not in boundary else '"' + boundary.decode() + '"')
        if rng.random() < 0.05:
            ctype = "multipart/form-data"          # no boundary
        req.ctype = ctype
    elif kind == "xml":
        req.payload = gen_xml_payload(rng)
    elif kind == "unknown":
        req.payload = gen_json_payload(rng) if rng.random() < 0.5 else gen_form_payload(rng)
    if kind != "multipart":
        req.ctype = rng.choice(CONTENT_TYPES[kind])
        if kind == "none" and rng.random() < 0.5:
            req.payload = gen_json_payload(rng)     # a body without a Content-Type
    return req


def gen_argument(rng, req, for_rule=False):
    """(argument object, known rendering or None)."""
    r = rng.random()
    if r < 0.2 and req.headers:
        name, value = rng.choice(req.headers)
        return {"source": "header", "name": odd_case(rng, name)}, None
    if r < 0.35 and req.query:
        key = rng.choice(req.query)[0]
        return {"source": rng.choice(["url", "query"]), "name": key}, first_values(req.query)[key]
    if r < 0.7 and req.payload.paths:
        name = rng.choice(sorted(req.payload.paths))
        return {"source": "payload", "name": name}, req.payload.paths[name]
    if r < 0.76:
        return {"source": "request", "name": rng.choice(["method", "remote-addr", "method",
                                                         "Method", "other"])}, None
    if r < 0.82:
        s = rng.choice(STRINGS)
        return {"source": "string", "name": s}, s
    if r < 0.92 and not for_rule:
        return {"source": rng.choice(["raw-request-body", "entire-payload", "entire-headers",
                                      "entire-query"])}, None
    source = rng.choice(["header", "url", "payload", "query", "bogus"])
    return {"source": source, "name": rng.choice(KEYS + HEADERS)}, None   # probably missing


def regex_for(rng, value):
    special = set("\\.+*?()|[]{}^$")
    if value is not None and rng.random() < 0.6:
        lit = "".join("\\" + c if c in special else c for c in value)
        return rng.choice(["^" + lit + "$", lit, "(?i)" + lit, "^" + lit[:3]])
    return rng.choice(["^[a-z]+$", ".*", "(?i)PUSH", "\\d+", "^$", "[", "ü", "(a|b)c*",
                       "\\w+\\.\\d"])


def sign(algo, secret, body):
    return hmac.new(secret.encode(), body, getattr(hashlib, algo)).hexdigest()


class Signer:
    """Signature headers the rules ask for, added once the body is known."""

    def __init__(self):
        self.todo = []

    def apply(self, rng, req_headers, body):
        for kind, header, secret, mode in self.todo:
            if kind == "scalr":
                date = formatdate(usegmt=True) if mode != "stale" else \
                    formatdate(time.time() - 3600, usegmt=True)
                sig = hmac.new(secret.encode(), body + date.encode(), hashlib.sha1).hexdigest()
                if mode == "bad":
                    sig = "0" * 40
                req_headers.append(("Date", date))
                req_headers.append((odd_case(rng, "X-Signature"), sig))
                continue
            algo = kind
            good = sign(algo, secret, body)
            if mode == "missing":
                continue
            value = {"plain": good, "prefixed": algo + "=" + good, "upper": good.upper(),
                     "bad": "0" * len(good), "list": "%s=%s,%s=%s" % (algo, "0" * len(good),
                                                                         algo, good),
                     "wrongprefix": "md5=" + good, "spaced": " " + good}[mode]
            req_headers.append((odd_case(rng, header), value))


def gen_rule(rng, req, signer, depth=0):
    r = rng.random()
    if depth < 2 and r < 0.15:
        return {rng.choice(["and", "or"]): [gen_rule(rng, req, signer, depth + 1)
                                            for _ in range(rng.randint(1, 3))]}
    if depth < 2 and r < 0.22:
        return {"not": gen_rule(rng, req, signer, depth + 1)}
    r = rng.random()
    if r < 0.35:
        arg, value = gen_argument(rng, req, for_rule=True)
        want = value if value is not None and rng.random() < 0.7 else rng.choice(STRINGS)
        return {"match": {"type": "value", "value": want, "parameter": arg}}
    if r < 0.55:
        arg, value = gen_argument(rng, req, for_rule=True)
        return {"match": {"type": "regex", "regex": regex_for(rng, value), "parameter": arg}}
    if r < 0.8:
        kind = rng.choice(["payload-hmac-sha1", "payload-hmac-sha256", "payload-hmac-sha512",
                           "payload-hash-sha1", "payload-hash-sha256", "payload-hash-sha512"])
        algo = kind.rsplit("-", 1)[1]
        header = rng.choice(["X-Hub-Signature", "X-Sig", "x-signature-256"])
        secret = rng.choice(SECRET_POOL + [""] + (["replace-with-a-secret"] if rng.random() < 0.2
                                                  else []))
        mode = rng.choice(["plain"] * 3 + ["prefixed"] * 2 + ["upper", "bad", "list", "missing",
                                                                "wrongprefix", "spaced"])
        signer.todo.append((algo, header, secret, mode))
        return {"match": {"type": kind, "secret": secret,
                          "parameter": {"source": "header", "name": header}}}
    if r < 0.92:
        ip = rng.choice(["127.0.0.1/32", "127.0.0.0/8", "10.0.0.0/8", "127.0.0.1",
                         "10.0.0.1 127.0.0.1/32", "::1/128", "bogus", "  127.0.0.1/32  ",
                         "192.168.0.0/16"])
        return {"match": {"type": "ip-whitelist", "ip-range": ip}}
    secret = rng.choice(SECRET_POOL)
    signer.todo.append(("scalr", "X-Signature", secret, rng.choice(["good", "good", "bad",
                                                                     "stale"])))
    return {"match": {"type": "scalr-signature", "secret": secret}}


def gen_case(number, batch_flags):
    rng = random.Random("%d:%d" % (SEED, number))
    req = gen_request(rng)
    hook = {"id": "c%d" % number if rng.random() > 0.05 else "g/c%d" % number}
    fails = rng.random() < 0.1
    hook["execute-command"] = str(batch_flags["bin"] / (("f" if fails else "c") + str(number)))
    if rng.random() < 0.7:
        hook["pass-arguments-to-command"] = [gen_argument(rng, req)[0]
                                             for _ in range(rng.randint(1, 5))]
    if rng.random() < 0.5:
        env = []
        for _ in range(rng.randint(1, 3)):
            arg = gen_argument(rng, req)[0]
            if rng.random() < 0.5:
                arg["envname"] = rng.choice(["MY_VAR", "X", "HOOK_X", "lower_var", "VAR_%d" %
                                             rng.randint(0, 9)])
            env.append(arg)
        hook["pass-environment-to-command"] = env
    if rng.random() < 0.3:
        files = []
        for _ in range(rng.randint(1, 2)):
            arg = gen_argument(rng, req)[0]
            if rng.random() < 0.6:
                arg["envname"] = rng.choice(["FILE_A", "FILE_B", "F1"])
            if rng.random() < 0.3:
                arg["base64decode"] = True
            files.append(arg)
        hook["pass-file-to-command"] = files
    if rng.random() < 0.2:
        names = [n for n, v in req.payload.paths.items() if v is None and n] or ["payload"]
        hook["parse-parameters-as-json"] = [
            {"source": rng.choice(["payload", "payload", "url", "header"]),
             "name": rng.choice(names).split(".")[0]}]
    if rng.random() < 0.35:
        hook["include-command-output-in-response"] = True
        if rng.random() < 0.5:
            hook["include-command-output-in-response-on-error"] = True
    if rng.random() < 0.5:
        hook["response-message"] = rng.choice(["ok", "Deploying…", "<html><b>hi</b></html>",
                                               "", "line1\nline2", "%PDF-1.4", "{\"a\": 1}"])
    if rng.random() < 0.3:
        hook["response-headers"] = [
            {"name": odd_case(rng, rng.choice(["X-Hook", "Content-Type", "X-Global",
                                               "Access-Control-Allow-Origin"])),
             "value": rng.choice(["v1", "text/html", "*", "ünï"])}
            for _ in range(rng.randint(1, 2))]
    if rng.random() < 0.2:
        hook["http-methods"] = rng.sample(["POST", "get", " put ", "Patch", "HEAD", "delete"],
                                          rng.randint(0, 3))
    if rng.random() < 0.2:
        hook["incoming-payload-content-type"] = rng.choice(
            ["application/json", "application/x-www-form-urlencoded", "text/xml",
             "multipart/form-data; boundary=XyZ"])
    if rng.random() < 0.25:
        hook["success-http-response-code"] = rng.choice([200, 201, 202, 204, 299, 400, 418,
                                                         500, 999])
    signer = Signer()
    if rng.random() < 0.75:
        hook["trigger-rule"] = gen_rule(rng, req, signer)
        if rng.random() < 0.3:
            hook["trigger-rule-mismatch-http-response-code"] = rng.choice([400, 403, 404, 999])
        if rng.random() < 0.2:
            hook["trigger-signature-soft-failures"] = True
    # the request
    body = req.payload.body
    if req.method in ("GET", "HEAD", "OPTIONS", "DELETE") and rng.random() < 0.6:
        body = b""
    headers = list(req.headers)
    signer.apply(rng, headers, body)
    if req.ctype is not None:
        headers.insert(rng.randint(0, len(headers)), (odd_case(rng, "Content-Type"), req.ctype))
    hook = utf8_only(hook)
    prefix = batch_flags["prefix"]
    hook_id = hook["id"]
    if rng.random() < 0.05:
        hook_id = "unknown-%d" % number
    path = ("/" + prefix if prefix else "") + "/" + (
        hook_id if rng.random() < 0.9 else urllib.parse.quote(hook_id, safe=""))
    target = path + ("?" + encode_pairs(rng, req.query) if req.query else "")
    transport = rng.choice(["close"] * 12 + ["keep-alive"] * 5 + ["http/1.0", "chunked",
                                                                 "expect"])
    return Case(number, hook, req.method, target, headers, body, transport)


def utf8_only(value):
    """A hooks file is UTF-8: bytes that are not (surrogates here) become U+FFFD."""
    if isinstance(value, str):
        return re.sub("[\ud800-\udfff]", "\ufffd", value)
    if isinstance(value, dict):
        return {utf8_only(k): utf8_only(v) for k, v in value.items()}
    if isinstance(value, list):
        return [utf8_only(v) for v in value]
    return value


def gen_batch_flags(batch, bin_dir):
    rng = random.Random("%d:batch:%d" % (SEED, batch))
    flags = {"bin": bin_dir, "prefix": rng.choice(["hooks"] * 4 + ["", "api/v1"]),
             "yaml": rng.random() < 0.4, "args": []}
    if flags["prefix"] != "hooks":
        flags["args"] += ["-urlprefix", flags["prefix"]]
    if rng.random() < 0.3:
        flags["args"] += ["-header", "X-Global=g1", "-header", "x-other=a=b"]
    if rng.random() < 0.2:
        flags["args"] += ["-http-methods", rng.choice(["POST,PUT", " post , get ,HEAD"])]
    return flags


# ---------------------------------------------------------------------------------------------
# Hooks files: JSON and block-style YAML
# ---------------------------------------------------------------------------------------------

YAML_PLAIN = re.compile(r"^[A-Za-z][A-Za-z0-9_/-]*$")
YAML_SPECIAL = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}


def yaml_scalar(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if YAML_PLAIN.match(v) and v.lower() not in YAML_SPECIAL:
        return v
    return json.dumps(v, ensure_ascii=False)


def yaml_lines(v, indent):
    pad = " " * indent
    if isinstance(v, dict):
        if not v:
            return [pad + "{}"]
        out = []
        for k, x in v.items():
            if isinstance(x, (dict, list)) and x:
                out.append(pad + yaml_scalar(k) + ":")
                out += yaml_lines(x, indent + 2)
            else:
                out.append(pad + yaml_scalar(k) + ": " + (yaml_scalar(x) if not isinstance(
                    x, (dict, list)) else ("{}" if isinstance(x, dict) else "[]")))
        return out
    if isinstance(v, list):
        if not v:
            return [pad + "[]"]
        out = []
        for x in v:
            sub = yaml_lines(x, indent + 2)
            out.append(pad + "- " + sub[0].lstrip())
            out += sub[1:]
        return out
    return [pad + yaml_scalar(v)]


def hooks_text(hooks, yaml):
    if yaml:
        return "\n".join(yaml_lines(hooks, 0)) + "\n"
    return json.dumps(hooks, indent=1, ensure_ascii=False) + "\n"


# ---------------------------------------------------------------------------------------------
# Running a batch against both programs
# ---------------------------------------------------------------------------------------------

NEXT_ON_CONNECTION = b"GET / HTTP/1.1\r\nHost: example.org\r\nConnection: close\r\n\r\n"


def send(port, case, timeout=20.0):
    """Send the case's request and read its answer as framed; a keep-alive case then sends
    `GET /` on the same connection and reads that answer too.
    Returns (client port, status line, [(name, value)], body, the next answer or None)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        client_port = sock.getsockname()[1]
        sock.sendall(case.raw())
        stream = sock.makefile("rb")
        status, headers, body = read_response(stream, case.method)
        following = None
        if case.transport == "keep-alive":
            sock.sendall(NEXT_ON_CONNECTION)
            following = read_response(stream, "GET")
    return client_port, status, headers, body, following


def read_response(stream, method):
    """One answer: status line (after any 1xx interim ones), headers, body (by
    Content-Length, chunked, or to the end)."""
    status = line = stream.readline().rstrip(b"\r\n").decode("latin-1")
    while line.startswith("HTTP/1.1 1"):   # `100 Continue` is part of the status we compare
        while stream.readline() not in (b"\r\n", b"\n", b""):
            pass
        line = stream.readline().rstrip(b"\r\n").decode("latin-1")
        status += " + " + line
    headers = []
    while True:
        line = stream.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.rstrip(b"\r\n").partition(b":")
        headers.append((name.decode("latin-1"), value.strip().decode("latin-1")))
    fields = {n.lower(): v for n, v in headers}
    code = status.rpartition(" + ")[2].split(" ")[1] if status.count(" ") else ""
    if method == "HEAD" or code in ("204", "304") or code.startswith("1"):
        body = b""
    elif "chunked" in fields.get("transfer-encoding", "").lower():
        parts = []
        while True:
            size = int(stream.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while stream.readline() not in (b"\r\n", b"\n", b""):
                    pass
                break
            parts.append(stream.read(size))
            stream.readline()
        body = b"".join(parts)
    elif "content-length" in fields:
        body = stream.read(int(fields["content-length"]))
    else:
        body = stream.read()
    return status, headers, body


class Side:
    """One program serving one batch."""

    def __init__(self, name, argv, work, env):
        self.name = name
        self.records = work / ("records-" + name)
        self.records.mkdir()
        # `env -i`: both start with exactly this environment, which their commands inherit
        full_env = dict(env, DIFF_RECORD_DIR=str(self.records))
        for attempt in range(3):  # another test on this machine may take the port meanwhile
            port = support.free_port()
            try:
                self.daemon = support.Daemon(
                    ["env", "-i"] + ["%s=%s" % kv for kv in sorted(full_env.items())] + argv
                    + ["-ip", "127.0.0.1", "-port", str(port)], port, cwd=str(work / "cwd"),
                    timeout=30.0)
                break
            except RuntimeError as exc:
                if "address already in use" not in str(exc) or attempt == 2:
                    raise
        self.port = port

    def observe(self, case):
        try:
            client_port, status, headers, body, following = send(self.port, case)
        except (OSError, ValueError) as exc:    # a timeout, a reset, a broken frame
            return {"client_port": 0, "status_line": "no answer: %r" % exc, "status": 0,
                    "headers": [], "body": b"", "following": None}
        final = status.rpartition(" + ")[2]
        return {"client_port": client_port, "status_line": status,
                "status": int(final.split()[1]) if len(final.split()) > 1 else 0,
                "headers": headers, "body": body, "following": following}

    def record(self, case):
        name = os.path.basename(case.hook["execute-command"])
        path = self.records / (name + ".json")
        return json.loads(path.read_text()) if path.exists() else None

    def quiet(self):
        """No command of this daemon still running."""
        return not support.descendants(self.daemon.proc.pid)


def normalize(obs, record):
    """What is compared: the client's port replaced, ignored headers dropped."""
    port = str(obs["client_port"]).encode()

    def fix(b):
        return b.replace(b"127.0.0.1:" + port, b"127.0.0.1:<port>")

    headers = [(n.lower(), fix(v.encode("latin-1")).decode("latin-1"))
               for n, v in obs["headers"] if n.lower() not in IGNORED_HEADERS]
    rec = None
    if record is not None:
        rec = json.loads(fix(json.dumps(record, sort_keys=True).encode()).decode())
    following = obs["following"]
    if following is not None:   # `GET /` after the case on a kept-alive connection
        following = (following[0], sorted((n.lower(), v) for n, v in following[1]
                                          if n.lower() not in IGNORED_HEADERS), following[2])
    return {"code": obs["status"], "status": obs["status_line"],
            "headers": sorted(headers, key=lambda h: h[0]), "body": fix(obs["body"]),
            "command": rec, "next on the connection": following}


def differences(case, go, ours):
    out = []
    for key in ("status", "headers", "body", "command", "next on the connection"):
        if go[key] != ours[key]:
            out.append(key)
    return out


def excused(case, go_raw, ours_raw):
    for name, reason, predicate in DELIBERATE:
        if predicate(case, go_raw, ours_raw):
            return name
    return None


def clip(value, limit=3000):
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "... (%d characters)" % len(text)


def report(case, flags, diffs, go, ours):
    hooks = hooks_text([case.hook], flags["yaml"])
    lines = ["case %d (DIFF_SEED=%d DIFF_CASE=%d): differs in %s" % (
        case.number, SEED, case.number, ", ".join(diffs)),
        "flags: %s" % " ".join(flags["args"]) if flags["args"] else "flags: (none)",
        "hooks file (%s):" % ("YAML" if flags["yaml"] else "JSON"), hooks,
        "raw request: %r" % case.raw()]
    if case.transport == "keep-alive":
        lines.append("then on the same connection: %r" % NEXT_ON_CONNECTION)
    for key in diffs:
        lines.append("  %s webhook : %s" % (key, clip(go[key])))
        lines.append("  %s webhookd: %s" % (key, clip(ours[key])))
    return "\n".join(lines)


def run_batch(batch, numbers, work, flags):
    cases = [gen_case(n, flags) for n in numbers]
    for c in cases:
        link = Path(c.hook["execute-command"])
        if not link.exists():
            link.symlink_to(work / "bin" / "record.py")
    hooks_file = work / ("hooks-%d.%s" % (batch, "yaml" if flags["yaml"] else "json"))
    hooks_file.write_text(hooks_text([c.hook for c in cases], flags["yaml"]))
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "TMPDIR": str(work / "tmp"),
           "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "DIFF_INHERITED": "yes"}
    args = ["-hooks", str(hooks_file), "-nopanic"] + flags["args"]
    batch_work = work / ("batch-%d" % batch)
    batch_work.mkdir()
    (batch_work / "cwd").mkdir()
    go = ours = None
    try:
        go = Side("webhook", [support.WEBHOOK_BIN] + args, batch_work, env)
        ours = Side("webhookd", support.python_cmd(support.WEBHOOKD) + args, batch_work, env)
        answers = {}
        with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
            futures = {pool.submit(lambda c: (go.observe(c), ours.observe(c)), c): c
                       for c in cases}
            for fut in concurrent.futures.as_completed(futures):
                answers[futures[fut].number] = fut.result()
        # background commands: wait until neither daemon runs any
        time.sleep(0.3)
        deadline = time.monotonic() + 30
        calm = 0
        while calm < 2 and time.monotonic() < deadline:
            calm = calm + 1 if go.quiet() and ours.quiet() else 0
            time.sleep(0.1)
        failures, excuses = [], collections.Counter()
        for c in cases:
            go_obs, our_obs = answers[c.number]
            g = normalize(go_obs, go.record(c))
            o = normalize(our_obs, ours.record(c))
            excuses["(answered %d)" % g["code"]] += 1
            excuses["(ran the command)"] += g["command"] is not None
            diffs = differences(c, g, o)
            if not diffs:
                continue
            why = excused(c, g, o)
            if why:
                excuses[why] += 1
            else:
                failures.append(report(c, flags, diffs, g, o))
        return failures, excuses
    finally:
        for side in (go, ours):
            if side is not None:
                side.daemon.__exit__()


@pytest.fixture(scope="module")
def work():
    if support.WEBHOOK_BIN is None:
        pytest.skip("needs Debian's webhook (apt-get install webhook) as the oracle")
    with support.scratch_dir("webhookd-diff-") as base:
        for d in ("bin", "tmp", "cwd"):
            (base / d).mkdir()
        python = base / "bin" / "python"
        python.symlink_to(sys.executable)
        recorder = base / "bin" / "record.py"
        recorder.write_text("#!" + str(python) + " -IS\n" + (
            Path(__file__).resolve().parent / "fixtures" / "webhook_record.py").read_text())
        recorder.chmod(0o755)
        yield base


def test_differential(work):
    numbers = [int(ONLY_CASE)] if ONLY_CASE else list(range(CASES))
    by_batch = collections.OrderedDict()
    for n in numbers:
        by_batch.setdefault(n // BATCH, []).append(n)
    failures, excuses = [], collections.Counter()
    for batch, nums in by_batch.items():
        flags = gen_batch_flags(batch, work / "bin")
        f, e = run_batch(batch, nums, work, flags)
        failures += f
        excuses += e
    seen = {k: v for k, v in sorted(excuses.items()) if k.startswith("(")}
    excused = {k: v for k, v in sorted(excuses.items()) if not k.startswith("(")}
    summary = "seed %d, %d cases, %d differences, excused: %s; webhook %s" % (
        SEED, len(numbers), len(failures), excused or "none", seen)
    print(summary)
    if failures:
        listing = [f.partition("\n")[0] for f in failures]
        pytest.fail(summary + "\n\n" + "\n\n".join(failures[:SHOWN]) + "\n\nall of them:\n"
                    + "\n".join(listing), pytrace=False)
