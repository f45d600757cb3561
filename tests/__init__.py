"""genfleet's tests: helpers in support/, fixtures in conftest.py, fakes in fakes/."""

import os

# pytest-xdist starts its workers with COLUMNS=80 and LINES=24 set. rich's consoles, made when
# genfleet's modules are first imported (conftest.py's imports, right after this), would keep
# 80 columns for good and wrap long paths mid-name; without them they size themselves at each
# print, as in a serial run, and the in-process CLI's 400 columns (support.commands.invoke) hold.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)
