"""Tiny stdlib HTTP servers the benchmarks measure against (127.0.0.1 only).

    python3 bench/stub_server.py floor  --port N   # the Python floor for webhookd's cheap paths
    python3 bench/stub_server.py search --port N   # a stand-in search backend for searchkeys
    python3 bench/stub_server.py proxy --port N --upstream URL  # searchkeys' floor

``floor``: the design card's floor, a bare ``http.server`` + ``subprocess`` runner with no logic:
``/hooks/exec-sync`` runs ``/bin/true`` and answers its output (200), ``/hooks/exec-async`` starts
it and answers at once, every other GET gets 404 ``Hook not found.``; HTTP/1.1 keep-alive, the
threading server, TCP_NODELAY, one write per answer. It is the fastest a webhook runner built on
``http.server`` and ``subprocess`` can be on this machine.

``search``: answers every GET/POST with a small fixed Meilisearch-shaped search result, so that a
request through ``searchkeys.py serve --upstream`` can be compared with the same request sent to
this backend directly.

``proxy``: the design card's floor for ``searchkeys.py serve --upstream``: a bare ``http.server``
+ ``http.client`` pass-through proxy without any authorization (one keep-alive backend connection
per thread), so the guard's cost can be told from the cost of the standard library it stands on.
"""
import argparse
import http.client
import json
import subprocess
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def canned_response(status, reason, content_type, body):
    """Status line, headers and body as one byte string, so each answer is a single send."""
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body


class QuietKeepAliveHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive, no Nagle delay, no access log; answers ``self.response`` as is."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    response = canned_response(200, "OK", "text/plain", b"")

    def log_message(self, format, *args):
        pass

    def _respond(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.wfile.write(self.response)

    do_GET = do_POST = _respond


class FloorHandler(QuietKeepAliveHandler):
    response = canned_response(404, "Not Found", "text/plain; charset=utf-8", b"Hook not found.")

    def _respond(self):
        if self.path == "/hooks/exec-sync":
            done = subprocess.run(["/bin/true"], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.wfile.write(canned_response(200, "OK", "text/plain", done.stdout))
        elif self.path == "/hooks/exec-async":
            proc = subprocess.Popen(["/bin/true"], stdin=subprocess.DEVNULL)
            threading.Thread(target=proc.wait, daemon=True).start()
            self.wfile.write(canned_response(200, "OK", "text/plain", b""))
        else:
            QuietKeepAliveHandler._respond(self)

    do_GET = do_POST = _respond


SEARCH_RESULT = json.dumps({
    "hits": [{"id": 1, "title": "Benchmarks, not tests"}],
    "query": "bench", "processingTimeMs": 0, "limit": 20, "offset": 0, "estimatedTotalHits": 1,
}).encode()


class SearchStubHandler(QuietKeepAliveHandler):
    response = canned_response(200, "OK", "application/json", SEARCH_RESULT)
    no_joins = canned_response(200, "OK", "application/json", b"[]")

    def _respond(self):
        if self.path.endswith("/settings/foreign-keys"):  # the guard asks an index's joins
            self.wfile.write(self.no_joins)
        else:
            QuietKeepAliveHandler._respond(self)

    do_GET = do_POST = _respond


HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-connection", "content-length", "host"}


class ProxyHandler(QuietKeepAliveHandler):
    """Relays each request to ``upstream`` (set by main) and its answer back, nothing else."""

    upstream = None
    local = threading.local()

    def _respond(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPConnection(*self.upstream)
        conn.request(self.command, self.path, body=body, headers=headers)
        answer = conn.getresponse()
        data = answer.read()
        self.send_response_only(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _respond


HANDLERS = {"floor": FloorHandler, "search": SearchStubHandler, "proxy": ProxyHandler}


class QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # socketserver's default backlog of 5 drops SYNs at c=32

    def handle_error(self, request, client_address):
        pass  # load generators drop connections at the end of a run; not worth a traceback


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(HANDLERS))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", help="backend URL (proxy only)")
    args = parser.parse_args()
    if args.kind == "proxy":
        parts = urllib.parse.urlsplit(args.upstream)
        ProxyHandler.upstream = (parts.hostname, parts.port)
    server = QuietServer(("127.0.0.1", args.port), HANDLERS[args.kind])
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
