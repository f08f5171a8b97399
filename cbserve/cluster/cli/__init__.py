"""The ``cbserve`` command (``main.py``): ``serve``, ``generate`` (and ``bench``, in cbserve.bench)."""

from __future__ import annotations

import sys
from typing import TextIO


def say(line: str, stream: TextIO | None = None) -> None:
    """One line of the command's output in one write: Ray's thread that prints the actors' logs to this process's
    output never lands inside it (``print`` writes the text and its newline apart)."""
    out = sys.stdout if stream is None else stream
    out.write(line + "\n")
    out.flush()
