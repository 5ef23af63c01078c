"""Benchmark: searchkeys' JSON-file key store at realistic sizes.

    python3 bench/bench_store.py [--sizes 1000,10000] [--creates 200] [--repeat 5] [--dir PATH]

For each size, a store file of that many keys is written in the store's own format, then:

- ``open``: ``KeyStore(master_key, path)`` (read, parse, derive every key value), median of
  ``--repeat`` opens;
- ``serve``: spawn of ``searchkeys.py serve --store`` to its first answer on ``/health``;
- ``create``/``update``/``delete``: one durable change each (the whole document rewritten to a
  temp file, fsync, rename, fsync of the folder), ``--creates`` of each, p50 / p95 / max in ms.

Targets (issue 12): a create at 1,000 keys well under 20 ms; a start with 10,000 keys under 1 s.
``--dir`` picks the file system measured (default: a temp folder); fsync cost is the disk's.
Prints one JSON object.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import searchkeys  # noqa: E402  (the module measured, from this checkout)

MASTER_KEY = "bench-master-key-0123456789abcdef"
FIELDS = {"actions": ["search"], "indexes": ["blog"], "expiresAt": None,
          "description": "a frontend key of a realistic length"}


def millis(seconds):
    return round(seconds * 1000, 2)


def spread(samples):
    ordered = sorted(samples)
    return {"p50_ms": millis(ordered[len(ordered) // 2]),
            "p95_ms": millis(ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]),
            "max_ms": millis(ordered[-1])}


def write_store(path, size):
    """A store of `size` keys (the four defaults included), as the server writes it."""
    memory = searchkeys.KeyStore(MASTER_KEY)
    for number in range(size - len(memory)):
        memory.create(dict(FIELDS, name="key %d" % number))
    records = [key.stored_json() for key in reversed(memory.page(0, size)[0])]
    target = searchkeys.StoreFile(str(path), lambda message: None)
    target.write(records)


def time_open(path, repeat):
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        store = searchkeys.KeyStore(MASTER_KEY, str(path))
        samples.append(time.perf_counter() - started)
        store.close()
    return spread(samples)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def time_serve(path, repeat):
    samples = []
    for _ in range(repeat):
        port = free_port()
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, str(ROOT / "searchkeys.py"), "serve", "--port",
                                 str(port), "--master-key", MASTER_KEY, "--store", str(path)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = started + 30
            while time.perf_counter() < deadline:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                        if sock.recv(12).startswith(b"HTTP/1.1 200"):
                            break
                except OSError:
                    time.sleep(0.005)
            samples.append(time.perf_counter() - started)
        finally:
            proc.terminate()
            proc.wait(10)
    return spread(samples)


def time_changes(path, count):
    store = searchkeys.KeyStore(MASTER_KEY, str(path))
    made, figures = [], {}
    try:
        for name, change in (
                ("create", lambda i: made.append(store.create(dict(FIELDS, name="new %d" % i)))),
                ("update", lambda i: store.update(made[i].uid, {"name": "renamed %d" % i})),
                ("delete", lambda i: store.delete(made[i].uid))):
            samples = []
            for number in range(count):
                started = time.perf_counter()
                change(number)
                samples.append(time.perf_counter() - started)
            figures[name] = spread(samples)
    finally:
        store.close()
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--creates", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", help="folder to put the stores in (default: a temp folder)")
    args = parser.parse_args()
    result = {"python": sys.version.split()[0], "sizes": {}}
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for size in [int(s) for s in args.sizes.split(",")]:
            path = Path(folder) / ("keys-%d.json" % size)
            write_store(path, size)
            result["sizes"][size] = {
                "file_bytes": os.path.getsize(path),
                "open": time_open(path, args.repeat),
                "serve_to_first_answer": time_serve(path, min(args.repeat, 3)),
                **time_changes(path, args.creates),
            }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
