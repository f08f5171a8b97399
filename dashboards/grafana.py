"""The Grafana JSON model dashboards/generate.py builds cbserve's dashboards with: the PromQL helpers (rates,
quantiles, means over the dashboards' label selectors), the 24-column grid of panels (``Board``), template variables
and the dashboard itself."""

from __future__ import annotations

from typing import Any

E = '{model=~"$model", replica=~"$replica"}'  # engine and worker series
M = '{model=~"$model"}'  # ingress series (no replica label)
S = '{application=~"$application"}'  # Ray Serve series
RI = "[$__rate_interval]"


def rate(metric: str, sel: str = E, by: str = "") -> str:
    grp = f" by ({by})" if by else ""
    return f"sum{grp}(rate({metric}{sel}{RI}))"


def quantile(q: float, hist: str, sel: str = E, by: str = "") -> str:
    labels = f"{by}, le" if by else "le"
    return f"histogram_quantile({q}, sum by ({labels})(rate({hist}_bucket{sel}{RI})))"


def mean(hist: str, sel: str = E, by: str = "") -> str:
    return f"{rate(hist + '_sum', sel, by)} / {rate(hist + '_count', sel, by)}"


def or_zero(expr: str) -> str:
    """For a series another component creates only at its first event (Ray Serve's error counter): the
    panel reads 0, not "No data", until then."""
    return f"{expr} or on() vector(0)"


def quantiles(hist: str, sel: str = E, by: str = "", qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list:
    suffix = "".join(f" {{{{{label.strip()}}}}}" for label in by.split(",") if label.strip())
    targets = [(quantile(q, hist, sel, by), f"p{round(q * 100)}{suffix}") for q in qs]
    return [*targets, (mean(hist, sel, by), f"mean{suffix}")]


class Board:
    """Lays out panels on Grafana's 24-column grid, row by row."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = 0
        self.y = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {"type": "row", "title": title, "id": self._id(), "collapsed": False, "panels": [],
             "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1}}
        )  # fmt: skip
        self.y += 1

    def panel(self, title: str, targets: list[tuple[str, str]], unit: str = "short", *, w: int = 8,
              kind: str = "timeseries", desc: str = "", stack: bool = False) -> None:  # fmt: skip
        if self.x + w > 24:
            self._newline()
        defaults: dict[str, Any] = {"unit": unit}
        if kind == "timeseries":
            defaults["custom"] = {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
            if stack:
                defaults["custom"].update(stacking={"mode": "normal", "group": "A"}, fillOpacity=40)
        self.panels.append({
            "type": kind,
            "title": title,
            "description": desc,
            "id": self._id(),
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"x": self.x, "y": self.y, "w": w, "h": 8},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": [
                {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                 "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                for i, (expr, legend) in enumerate(targets)
            ],
        })  # fmt: skip
        self.x += w

    def _newline(self) -> None:
        if self.x:
            self.x = 0
            self.y += 8

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def variable(name: str, query: str, label: str) -> dict[str, Any]:
    return {
        "name": name, "label": label, "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": f"var_{name}"}, "definition": query,
        "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*",
        "current": {"text": "All", "value": "$__all"}, "sort": 1,
    }  # fmt: skip


def dashboard(uid: str, title: str, board: Board, variables: list[dict[str, Any]]) -> dict[str, Any]:
    datasource = {
        "name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
        "current": {}, "hide": 0, "refresh": 1,
    }  # fmt: skip
    return {
        "uid": uid, "title": title, "tags": ["cbserve", "llm", "ray"], "timezone": "browser",
        "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1, "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"}, "timepicker": {},
        "annotations": {"list": []}, "links": [],
        "templating": {"list": [datasource, *variables]},
        "panels": board.panels,
    }  # fmt: skip
