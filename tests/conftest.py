import os
import sys
from pathlib import Path

# Make tests/support.py and the tools at the top level importable by every test module.
HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

# The portability pass (TESTS_PORTABLE=1, run by .ci/run): every process the tests start
# inherits this environment, so each tool runs with tests/portable/sitecustomize.py loaded,
# as it would on macOS or FreeBSD. The test process itself is left as it is.
if os.environ.get("TESTS_PORTABLE") == "1":
    import support
    os.environ["PYTHONPATH"] = support.with_portable_path(os.environ.get("PYTHONPATH"))
