"""Shared benchmark plumbing: server processes, a keep-alive load generator, wrk, /proc figures.

Used by ``bench_webhookd.py`` and ``bench_searchkeys.py``; not a benchmark by itself.
Everything talks to 127.0.0.1 only, every loop is bounded (request counts, deadlines), and every
process started here is stopped at exit, on Ctrl-C and on errors (see ``ProcessRegistry``).

The load generator is a raw-socket HTTP/1.1 client (pre-encoded request bytes, one keep-alive
connection per simulated user). Python threads share the GIL, so above concurrency 1 the users are
spread over ``client_procs`` forked processes (default 2, one per CPU of the benchmark machine);
each process runs its share of the users as threads. The client still shares the CPUs with the
server, so cheap paths are partly client-bound: compare runners measured in the same run.
"""
import array
import atexit
import json
import math
import multiprocessing
import os
import platform
import re
import resource
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
WRK = shutil.which("wrk")
# The interpreter the measured Python servers run on: the system one, as the systemd unit runs
# them (/usr/bin/python3), when present. (This machine's default pyenv python also imports a
# sandbox CA bundle from a .pth file at every start: +5 MiB RSS and +35 ms per process.)
DEFAULT_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
HOST = "127.0.0.1"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024


def log(*parts):
    """Progress goes to stderr; stdout carries only the final JSON object."""
    print(time.strftime("%H:%M:%S"), *parts, file=sys.stderr, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(ours, theirs, digits=3):
    if ours is None or not theirs:
        return None
    return round(ours / theirs, digits)


def percentile(sorted_values, pct):
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(pct / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


# --------------------------------------------------------------------------------------------
# Machine and /proc figures
# --------------------------------------------------------------------------------------------

def load_average():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def machine_description():
    cpu_model = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kib = int(f.readline().split()[1])
    wrk_version = None
    if WRK:
        out = subprocess.run([WRK, "-v"], capture_output=True, text=True, timeout=10)
        wrk_version = (out.stdout + out.stderr).split("Copyright")[0].strip()
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "wrk": wrk_version,
    }


def python_version(interpreter):
    out = subprocess.run([interpreter, "-V"], capture_output=True, text=True, timeout=10)
    return f"{interpreter}: {(out.stdout or out.stderr).strip()}"


def proc_status(pid):
    """VmRSS / VmHWM in KiB and the thread count of a live process."""
    wanted = {"VmRSS": "rss_kib", "VmHWM": "hwm_kib", "Threads": "threads"}
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in wanted:
                    out[wanted[key]] = int(value.split()[0])
    except OSError:
        return None
    return out


def proc_cpu_seconds(pid):
    """User + system CPU seconds consumed so far by the process itself (not its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def proc_children(pid):
    """PIDs of the live direct children of a process (all its threads)."""
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.extend(int(p) for p in f.read().split())
    except OSError:
        pass
    return kids


def wait_children_gone(pid, timeout=15.0):
    """Let background commands of an async burst finish before the next measurement."""
    deadline = time.monotonic() + timeout
    while proc_children(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(proc_children(pid))


class PeakSampler:
    """While in its ``with`` block, samples a process every ``interval`` s from a thread: peak
    threads, peak live direct children (e.g. running commands) and peak RSS; ``peaks()``."""

    def __init__(self, pid, interval=0.02):
        self.pid, self.interval = pid, interval
        self.threads = self.children = self.rss_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            st = proc_status(self.pid) or {}
            self.threads = max(self.threads, st.get("threads", 0))
            self.rss_kib = max(self.rss_kib, st.get("rss_kib", 0), st.get("hwm_kib", 0))
            self.children = max(self.children, len(proc_children(self.pid)))
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)

    def peaks(self):
        return {"peak_threads": self.threads, "peak_children": self.children,
                "peak_rss_mib": round(self.rss_kib / 1024, 1)}


# --------------------------------------------------------------------------------------------
# Server processes
# --------------------------------------------------------------------------------------------

class ProcessRegistry:
    """Every process group this benchmark started, so that all are stopped whatever happens."""

    def __init__(self):
        self._servers = []
        atexit.register(self.stop_all)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def add(self, server):
        self._servers.append(server)

    def remove(self, server):
        if server in self._servers:
            self._servers.remove(server)

    def stop_all(self):
        for server in list(self._servers):
            server.stop()

    @staticmethod
    def _on_sigterm(signum, frame):
        raise KeyboardInterrupt  # unwinds through the finally blocks, then atexit stops the rest


REGISTRY = ProcessRegistry()


def http_get_status(port, path, timeout=1.0):
    """Status of one GET on a fresh connection, or None when nothing answers."""
    try:
        conn = Connection(port, timeout=timeout)
        try:
            return conn.exchange(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())[0]
        finally:
            conn.close()
    except (OSError, ValueError):
        return None


class Server:
    """A server under measurement, in its own process group, output to a log file.

    ``startup_s`` is the time from spawn to the first complete HTTP answer on ``ready_path``.
    """

    def __init__(self, name, argv, port, ready_path="/", env=None, log_dir=None, timeout=30.0):
        self.name = name
        self.port = port
        self.argv = [str(a) for a in argv]
        log_dir = log_dir or tempfile.gettempdir()
        self.log_path = Path(log_dir) / f"{name}-{port}.log"
        self._log = open(self.log_path, "wb")
        full_env = dict(os.environ)
        full_env.update(env or {})
        started = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=full_env,
                                     start_new_session=True)
        REGISTRY.add(self)
        deadline = started + timeout
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{name} exited with {self.proc.returncode} before answering; "
                                   f"log:\n{self.log_path.read_text(errors='replace')[-2000:]}")
            if http_get_status(port, ready_path, timeout=1.0) is not None:
                break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not answer within {timeout}s")
            time.sleep(0.001)
        self.startup_s = time.monotonic() - started
        self.startup_cpu_s = proc_cpu_seconds(self.proc.pid)  # less noisy than wall time

    @property
    def pid(self):
        return self.proc.pid

    def status(self):
        return proc_status(self.pid)

    def cpu_seconds(self):
        return proc_cpu_seconds(self.pid)

    def stop(self, timeout=10.0):
        REGISTRY.remove(self)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        # Commands left behind in the group (async hooks) go too.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()
        return self.proc.returncode


def measure_startup(make_server, repeat):
    """Median wall time from spawn to first answer over ``repeat`` fresh starts, and the CPU
    time the server had used by then (user + system, the server process only)."""
    samples, cpu = [], []
    for _ in range(repeat):
        server = make_server()
        samples.append(server.startup_s)
        cpu.append(server.startup_cpu_s)
        server.stop()
    return {"samples_ms": [round(s * 1000, 1) for s in samples],
            "median_ms": round(median(samples) * 1000, 1),
            "cpu_samples_ms": [round(s * 1000, 1) for s in cpu],
            "cpu_median_ms": round(median(cpu) * 1000, 1)}


def idle_figures(servers, seconds):
    """CPU % and RSS of idle servers, all measured over the same window."""
    before = {s.name: s.cpu_seconds() for s in servers}
    time.sleep(seconds)
    out = {}
    for s in servers:
        used = s.cpu_seconds() - before[s.name]
        st = s.status() or {}
        out[s.name] = {"cpu_percent": round(100.0 * used / seconds, 2),
                       "rss_mib": round(st.get("rss_kib", 0) / 1024, 1),
                       "threads": st.get("threads"),
                       "window_s": seconds}
    return out


# --------------------------------------------------------------------------------------------
# Raw keep-alive HTTP client
# --------------------------------------------------------------------------------------------

def build_request(method, path, headers=None, body=b""):
    """Pre-encoded HTTP/1.1 request bytes (keep-alive is HTTP/1.1's default)."""
    if isinstance(body, str):
        body = body.encode()
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class Connection:
    """One keep-alive connection; ``exchange`` sends a request and reads the whole response."""

    def __init__(self, port, timeout=30.0):
        self.port = port
        self.timeout = timeout
        self.sock = None
        self.buf = b""
        self.connects = 0

    def connect(self):
        self.sock = socket.create_connection((HOST, self.port), timeout=self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.connects += 1

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _fill(self):
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed by server mid-response")
        self.buf += chunk

    def exchange(self, request):
        if self.sock is None:
            self.connect()
        self.sock.sendall(request)
        return self._read_response(head_request=request.startswith(b"HEAD "))

    def _read_response(self, head_request=False):
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(self.buf) > 1 << 20:
                raise ValueError("response headers too large")
            self._fill()
        head = self.buf[:end].decode("latin-1").split("\r\n")
        self.buf = self.buf[end + 4:]
        version, status = head[0].split(" ", 2)[:2]
        status = int(status)
        length, chunked, close = None, False, version == "HTTP/1.0"
        for line in head[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            value = value.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value:
                chunked = True
            elif name == "connection":
                close = value == "close" or (close and value != "keep-alive")
        if head_request or status in (204, 304) or 100 <= status < 200:
            body = b""
        elif chunked:
            body = self._read_chunked()
        elif length is not None:
            while len(self.buf) < length:
                self._fill()
            body, self.buf = self.buf[:length], self.buf[length:]
        else:  # delimited by close
            close = True
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                self.buf += chunk
            body, self.buf = self.buf, b""
        if close:
            self.close()
        return status, body

    def _read_chunked(self):
        parts = []
        while True:
            while b"\r\n" not in self.buf:
                self._fill()
            line, self.buf = self.buf.split(b"\r\n", 1)
            size = int(line.split(b";")[0], 16)
            if size == 0:
                while True:  # trailers, ended by an empty line
                    while b"\r\n" not in self.buf:
                        self._fill()
                    line, self.buf = self.buf.split(b"\r\n", 1)
                    if not line:
                        return b"".join(parts)
            while len(self.buf) < size + 2:
                self._fill()
            parts.append(self.buf[:size])
            self.buf = self.buf[size + 2:]


# --------------------------------------------------------------------------------------------
# Load generator: bounded request counts, users spread over processes x threads
# --------------------------------------------------------------------------------------------

def _user(port, requests, count, ready, go, out, index):
    """One simulated user: ``count`` requests in sequence on one keep-alive connection."""
    conn = Connection(port)
    lat = array.array("d")
    statuses = {}
    errors = 0
    error_sample = None
    try:
        conn.connect()
    except OSError as exc:
        errors, error_sample = 1, repr(exc)
    ready.release()
    go.wait(600)
    started = time.monotonic()
    n_req = len(requests)
    for i in range(count):
        request = requests[(index + i) % n_req]
        t0 = time.perf_counter()
        try:
            status, _ = conn.exchange(request)
        except (OSError, ValueError) as exc:
            errors += 1
            error_sample = error_sample or repr(exc)
            conn.close()
            continue
        lat.append(time.perf_counter() - t0)
        statuses[status] = statuses.get(status, 0) + 1
    finished = time.monotonic()
    connects = conn.connects
    conn.close()
    out.append((lat, statuses, errors, error_sample, started, finished, connects))


def _client_process(port, requests, counts, first_index, ready, go, pipe):
    """A forked client process running several users as threads; results go back on a pipe."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    out = []
    threads = [threading.Thread(target=_user,
                                args=(port, requests, n, ready, go, out, first_index + k),
                                daemon=True)
               for k, n in enumerate(counts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    payload = [(lat.tobytes(), st, err, sample, s, f, c) for lat, st, err, sample, s, f, c in out]
    pipe.send(payload)
    pipe.close()


def run_load(port, requests, total, concurrency, client_procs=2, expected=None, server_pid=None,
             keep_raw=False):
    """Send ``total`` requests with ``concurrency`` keep-alive users; return the figures.

    ``requests`` is a list of pre-encoded requests used round-robin. Figures: rps (completed
    requests over wall time from the first start to the last finish), latency p50/p99/max in ms,
    the number of requests slower than 40 ms, status counts, unexpected statuses and errors;
    with ``server_pid``, the server's own CPU time per request in microseconds (user + system,
    children excluded), which other load on the machine disturbs far less than wall time.
    With ``keep_raw``, returns the raw latencies and counts instead, for ``summarize``.
    """
    ctx = multiprocessing.get_context("fork")
    nprocs = max(1, min(client_procs, concurrency))
    per_user = [total // concurrency + (1 if i < total % concurrency else 0)
                for i in range(concurrency)]
    groups = [per_user[p::nprocs] for p in range(nprocs)]
    ready = ctx.Semaphore(0)
    go = ctx.Event()
    procs, pipes = [], []
    for p, counts in enumerate(groups):
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_client_process,
                           args=(port, requests, counts, p * 1000, ready, go, child_end),
                           daemon=True)
        proc.start()
        child_end.close()
        procs.append(proc)
        pipes.append(parent_end)
    try:
        for _ in range(concurrency):
            if not ready.acquire(timeout=30):
                raise RuntimeError("client users did not connect")
        cpu_before = proc_cpu_seconds(server_pid) if server_pid else None
        go.set()
        results = []
        for pipe, proc in zip(pipes, procs):
            if not pipe.poll(600):
                raise RuntimeError("client process did not finish within 600 s")
            results.extend(pipe.recv())
            proc.join(10)
        cpu_used = proc_cpu_seconds(server_pid) - cpu_before if server_pid else None
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
    lat = array.array("d")
    statuses = {}
    errors = 0
    error_sample = None
    connects = 0
    for raw, st, err, sample, _, _, conns in results:
        part = array.array("d")
        part.frombytes(raw)
        lat.extend(part)
        for k, v in st.items():
            statuses[k] = statuses.get(k, 0) + v
        errors += err
        error_sample = error_sample or sample
        connects += conns
    part = {"latencies": lat, "statuses": statuses, "errors": errors,
            "error_sample": error_sample, "connections": connects,
            "seconds": max(r[5] for r in results) - min(r[4] for r in results),
            "server_cpu_s": cpu_used}
    return part if keep_raw else summarize([part], expected)


def summarize(parts, expected=None):
    """Figures of one or more runs of the same load (slices of one measurement, see
    ``run_load(keep_raw=True)``): rps = all requests / the sum of the runs' wall times."""
    ordered = sorted(v for part in parts for v in part["latencies"])
    statuses = {}
    for part in parts:
        for k, v in part["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    seconds = sum(part["seconds"] for part in parts)
    cpu = [part["server_cpu_s"] for part in parts]
    cpu_used = None if None in cpu else sum(cpu)
    unexpected = sum(v for k, v in statuses.items() if expected and k not in expected)
    return {
        "requests": len(ordered),
        "rps": round(len(ordered) / seconds, 1) if seconds > 0 else None,
        "p50_ms": _ms(percentile(ordered, 50)),
        "p99_ms": _ms(percentile(ordered, 99)),
        "max_ms": _ms(ordered[-1] if ordered else None),
        "over_40ms": sum(1 for v in ordered if v > 0.040),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "unexpected": unexpected,
        "errors": sum(part["errors"] for part in parts),
        "error_sample": next((p["error_sample"] for p in parts if p["error_sample"]), None),
        "connections": sum(part["connections"] for part in parts),
        "server_cpu_us_per_req": round(cpu_used * 1e6 / len(ordered), 1)
        if cpu_used is not None and ordered else None,
    }


def _ms(seconds):
    return None if seconds is None else round(seconds * 1000, 3)


# --------------------------------------------------------------------------------------------
# A crowd of idle and slow connections, and a new client timed through it
# --------------------------------------------------------------------------------------------

def raise_fd_limit(needed):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Crowd:
    """Holds `idle` keep-alive connections (each answered one request, then silent) and
    `trickling` connections sending a header byte every 0.3 s (reopened when a server cuts
    one off), until the `with` block ends."""

    REQUEST = build_request("GET", "/hooks/no-such-hook")

    def __init__(self, port, idle, trickling, timeout=60.0):
        self.port = port
        self.idle = [self._open() for _ in range(idle)]
        self.idle_answered = self._one_request_each(timeout)
        self.trickling = [self._open() for _ in range(trickling)]
        self.trickling_held = trickling
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._trickle, daemon=True)
        self.thread.start()
        time.sleep(0.5)  # the first bytes of every trickling head are in

    def _open(self):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex((HOST, self.port))
        return sock

    def _one_request_each(self, timeout):
        selector = selectors.DefaultSelector()
        for sock in self.idle:
            selector.register(sock, selectors.EVENT_WRITE)
        answered, pending, deadline = 0, len(self.idle), time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            for key, events in selector.select(0.5):
                sock = key.fileobj
                try:
                    if events & selectors.EVENT_WRITE:
                        sock.send(self.REQUEST)
                        selector.modify(sock, selectors.EVENT_READ)
                        continue
                    chunk = sock.recv(65536)
                    data = (key.data or b"") + chunk
                    if chunk and not data.endswith(b"Hook not found."):
                        selector.modify(sock, selectors.EVENT_READ, data)
                        continue
                    answered += bool(chunk)
                except OSError:
                    pass
                selector.unregister(sock)
                pending -= 1
        selector.close()
        return answered

    def _trickle(self):
        started = set()  # the connections whose head has begun
        while not self.stop.wait(0.3 if started else 0):
            for i, sock in enumerate(self.trickling):
                try:
                    sock.send(b"a" if sock in started else b"GET / HTTP/1.1\r\nX-Slow: ")
                    started.add(sock)
                except BlockingIOError:
                    pass
                except OSError:  # cut off (a head deadline): another takes its place
                    started.discard(sock)
                    sock.close()
                    self.trickling[i] = self._open()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        for sock in self.idle + self.trickling:
            sock.close()


def timed_new_client(port, path, timeout=10.0):
    """Seconds from connecting to having read the whole answer, on a new connection."""
    started = time.perf_counter()
    conn = Connection(port, timeout=timeout)
    try:
        conn.exchange(build_request("GET", path, {"Connection": "close"}))
    finally:
        conn.close()
    return time.perf_counter() - started


# --------------------------------------------------------------------------------------------
# wrk: fixed short duration, C load generator
# --------------------------------------------------------------------------------------------

_UNIT_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}


def _wrk_ms(text):
    m = re.match(r"([\d.]+)(us|ms|s|m)$", text)
    return round(float(m.group(1)) * _UNIT_MS[m.group(2)], 3) if m else None


def run_wrk(port, path, concurrency, seconds, headers=None, method="GET", body=None):
    """One wrk run; returns rps, p50/p99 latency in ms, non-2xx/3xx count and socket errors."""
    if not WRK:
        return None
    argv = [WRK, "-t", str(min(2, concurrency)), "-c", str(concurrency),
            "-d", f"{seconds}s", "--latency", "--timeout", "10s"]
    for name, value in (headers or {}).items():
        argv += ["-H", f"{name}: {value}"]
    script = None
    if method != "GET" or body:
        script = tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False)
        script.write(f"wrk.method = {json.dumps(method)}\n"
                     f"wrk.body = {json.dumps(body or '')}\n")
        script.close()
        argv += ["-s", script.name]
    argv.append(f"http://{HOST}:{port}{path}")
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60).stdout
    finally:
        if script:
            os.unlink(script.name)
    figures = {"rps": None, "p50_ms": None, "p99_ms": None, "non_2xx_3xx": 0, "socket_errors": 0}
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if m:
        figures["rps"] = round(float(m.group(1)), 1)
    for pct, key in (("50", "p50_ms"), ("99", "p99_ms")):
        m = re.search(rf"^\s+{pct}%\s+(\S+)", out, re.M)
        if m:
            figures[key] = _wrk_ms(m.group(1))
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if m:
        figures["non_2xx_3xx"] = int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        figures["socket_errors"] = sum(int(x) for x in m.groups())
    m = re.search(r"(\d+) requests in", out)
    figures["requests"] = int(m.group(1)) if m else None
    return figures


# --------------------------------------------------------------------------------------------
# Aggregation and output
# --------------------------------------------------------------------------------------------

LOAD_KEYS = ("rps", "p50_ms", "p99_ms", "server_cpu_us_per_req")


def merge_repeats(runs):
    """Median of each figure over repeats; worst case for max latency, sums for error counts."""
    runs = [r for r in runs if r]
    if not runs:
        return None
    merged = {k: median([r.get(k) for r in runs]) for k in LOAD_KEYS if k in runs[0]}
    for k in ("max_ms", "over_40ms"):
        if any(k in r for r in runs):
            merged[k] = max(r.get(k, 0) or 0 for r in runs)
    for k in ("unexpected", "errors", "non_2xx_3xx", "socket_errors"):
        if any(k in r for r in runs):
            merged[k] = sum(r.get(k, 0) or 0 for r in runs)
    if any("statuses" in r for r in runs):
        merged["statuses"] = sorted({s for r in runs for s in r.get("statuses", {})})
    merged["repeats"] = len(runs)
    merged["rps_samples"] = [r.get("rps") for r in runs]
    return merged


def compare(ours, theirs):
    """ours / theirs for throughput, latency and server CPU per request (rps: > 1 is better;
    latency and CPU: < 1 is better)."""
    if not ours or not theirs:
        return None
    return {k: ratio(ours.get(k), theirs.get(k)) for k in LOAD_KEYS if k in ours and k in theirs}


def add_load_arguments(parser, requests, concurrency, python_for):
    """The options both benchmarks share (defaults in the help; None until ``apply_defaults``)."""
    parser.add_argument("--repeat", type=int, help="repeats per figure, median reported (3)")
    parser.add_argument("--requests", type=int,
                        help=f"Python-client requests per run and server ({requests})")
    parser.add_argument("--slices", type=int,
                        help="each Python-client run is split in this many slices alternating "
                             "between the servers compared (4)")
    parser.add_argument("--wrk-seconds", type=int, help="wrk duration per run (2)")
    parser.add_argument("--no-wrk", action="store_true", help="skip the wrk runs")
    parser.add_argument("--concurrency", default=concurrency,
                        help=f"comma-separated ({concurrency})")
    parser.add_argument("--client-procs", type=int, default=2,
                        help="client processes the users are spread over (2)")
    parser.add_argument("--python", default=DEFAULT_PYTHON,
                        help=f"interpreter for {python_for} (%(default)s)")


def apply_defaults(args, defaults):
    """Fill the options left unset (``--quick`` changes the defaults), parse the lists."""
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if not WRK:
        args.no_wrk = True


def utc_now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def new_result(name, args, setting_names, client_note=""):
    """The head of a result: what ran where, with which settings, under which load."""
    result = {"benchmark": name, "started_utc": utc_now(),
              "machine": dict(machine_description(),
                              server_python=python_version(args.python)),
              "load_average": {"start": load_average()},
              "settings": {k: getattr(args, k) for k in setting_names},
              "client": f"Python raw-socket keep-alive client, users spread over "
                        f"{args.client_procs} processes x threads (GIL), bounded request counts"
                        f"{client_note}; wrk -t min(2,c) -c c -d {args.wrk_seconds}s"}
    log("load average", result["load_average"]["start"])
    return result


class Targets(list):
    """Targets met or missed, each with the figure it was judged on."""

    def __init__(self, docs):
        super().__init__()
        self.docs = docs

    def add(self, key, what, value, limit, met):
        self.append({"target": key, "what": what, "value": value, "limit": limit,
                     "met": bool(met), "doc": self.docs[key]})


def finish_result(name, result, targets):
    result["load_average"]["end"] = load_average()
    result["finished_utc"] = utc_now()
    result["targets"] = targets
    write_result(name, result)


def write_result(name, result):
    """Print the one JSON object on stdout and keep a copy in bench/results/."""
    RESULTS_DIR.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = RESULTS_DIR / f"{name}-{stamp}.json"
    text = json.dumps(result, indent=1, sort_keys=False)
    path.write_text(text + "\n")
    (RESULTS_DIR / f"{name}-latest.json").write_text(text + "\n")
    print(text)
    log("written", path)
