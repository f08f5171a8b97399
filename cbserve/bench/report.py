"""Reporting helpers of the benchmarks: the machine and commit a run was measured on, Markdown tables of
result summaries, and replacing a marked section of a Markdown file (so reruns replace their output)."""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def cpu_model(cpuinfo: str | os.PathLike[str] = "/proc/cpuinfo") -> str:
    """The CPU's model name from /proc/cpuinfo (falls back to platform.processor())."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def hardware_summary() -> str:
    """e.g. ``"AMD EPYC, 2 cores, no GPU"`` (the GPU named when torch sees one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"{cpu_model()}, {cores} cores, {gpu}"


def git_commit(repo: str | os.PathLike[str] | None = None) -> str:
    """Short commit hash of ``repo`` (``+dirty`` when the work tree has changes), or ``"unknown"``."""
    cwd = str(repo) if repo is not None else None
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def replace_section(path: str | os.PathLike[str], name: str, content: str) -> None:
    """Put ``content`` between ``<!-- {name}:begin -->`` and ``<!-- {name}:end -->`` in the Markdown file
    at ``path``, replacing what was there; append the marked section when the markers are missing."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    p = Path(path)
    text = p.read_text() if p.exists() else ""
    block = f"{begin}\n{content.rstrip()}\n{end}"
    i, j = text.find(begin), text.find(end)
    if i != -1 and j > i:
        text = text[:i] + block + text[j + len(end):]
    else:
        if (i == -1) != (j == -1) or j < i:
            raise ValueError(f"{path}: unbalanced markers for section {name!r}")
        text = (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
    p.write_text(text)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
