import os
import sys
from pathlib import Path

# Make tests/support.py and the tools at the top level importable by every test module.
HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

# Portability, on by default (TESTS_PORTABLE=0 turns it off): every process the tests start
# inherits this environment, so each tool runs with tests/portable/sitecustomize.py loaded,
# lacking what macOS or FreeBSD lack. Neither tool uses those names, so one run checks both the
# behaviour and the portability. The test process itself is left as it is.
if os.environ.get("TESTS_PORTABLE", "1") == "1":
    import support
    os.environ["PYTHONPATH"] = support.with_portable_path(os.environ.get("PYTHONPATH"))
