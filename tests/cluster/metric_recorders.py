"""Ray's metric classes replaced by recorders, for the tests of what the components export (``log``: every value
recorded, as (spec name, value, tags))."""

from __future__ import annotations

import pytest

from cbserve.cluster.ops import metric_specs as ms
from cbserve.cluster.ops import metrics as cm


class _Recorder:
    def __init__(self, spec: ms.MetricSpec, log: list[tuple[str, float, dict[str, str]]]) -> None:
        self.spec, self.log = spec, log
        self.default: dict[str, str] = {}

    def set_default_tags(self, tags: dict[str, str]) -> _Recorder:
        self.default = tags
        return self

    def _record(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.log.append((self.spec.name, value, {**self.default, **(tags or {})}))

    inc = observe = _record

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._record(value, tags)


def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float, dict[str, str]]]:
    records: list[tuple[str, float, dict[str, str]]] = []
    monkeypatch.setattr(cm, "_make", lambda spec: _Recorder(spec, records))
    monkeypatch.setattr(cm, "_counter_type", lambda: _Recorder)
    return records


def _values(log: list[tuple[str, float, dict[str, str]]], name: str) -> list[float]:
    return [v for n, v, _ in log if n == "cbserve_" + name]
