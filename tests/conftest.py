import sys
from pathlib import Path

# Make tests/support.py and the tools at the top level importable by every test module.
HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
