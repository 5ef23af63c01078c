"""Make this Python look like one on macOS or FreeBSD: Linux-only names gone, no ctypes.

The test suite's portability pass (``TESTS_PORTABLE=1``, see conftest.py) puts this folder on
PYTHONPATH for every process the tests start, so the tools run as they would where these
names do not exist. Python imports ``sitecustomize`` at start-up, before the tool's own code.
"""
import importlib.machinery
import importlib.util
import os
import select
import signal
import sys

# Linux-only: absent from macOS (which lacks pipe2 and, before 3.13, waitid) and FreeBSD.
REMOVED = {
    select: ("epoll", "EPOLLIN", "EPOLLOUT", "EPOLLPRI", "EPOLLERR", "EPOLLHUP", "EPOLLET",
             "EPOLLONESHOT", "EPOLLEXCLUSIVE", "EPOLLRDHUP", "EPOLLRDNORM", "EPOLLRDBAND",
             "EPOLLWRNORM", "EPOLLWRBAND", "EPOLLMSG", "EPOLL_CLOEXEC"),
    os: ("pipe2", "pidfd_open", "waitid", "P_PIDFD", "eventfd", "eventfd_read", "eventfd_write",
         "memfd_create", "splice", "sched_getaffinity"),
    signal: ("pidfd_send_signal",),
}
for module, names in REMOVED.items():
    for name in names:
        if hasattr(module, name):
            delattr(module, name)
if "selectors" in sys.modules:  # chose epoll before we got here: choose again
    selectors = sys.modules["selectors"]
    selectors.DefaultSelector = selectors.PollSelector
    del selectors.EpollSelector


class NoCtypes:
    """Refuses ``import ctypes``: the design card forbids it, whatever the platform has."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ctypes", "_ctypes"):
            raise ModuleNotFoundError("No module named %r (removed by the portability pass)" % name,
                                      name=name)
        return None


sys.meta_path.insert(0, NoCtypes())
for name in [n for n in sys.modules if n.split(".")[0] in ("ctypes", "_ctypes")]:
    del sys.modules[name]

# Run the sitecustomize this one hides (Debian's installs apport's hook), if there is one.
HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != HERE])
if _spec is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
