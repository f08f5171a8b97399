"""Suite-wide settings.

After the last report is written, the pytest process leaves with ``os._exit(exit status)``: the
interpreter's own teardown would next unload Ray's and Triton's native extensions, which print pages of
nanobind "leaked" warnings (Triton) and have been seen to crash (exit 139) after every test had passed,
turning a green run red. Set CBSERVE_TESTS_CLEAN_EXIT=0 to get the ordinary interpreter exit.
"""

from __future__ import annotations

import os
import sys

import pytest

_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None or os.environ.get("CBSERVE_TESTS_CLEAN_EXIT", "1") == "0":
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
