"""The house rules that keep cbserve readable, checked on the source tree itself: file and function sizes, no
import cycles between modules, the import directions of design.md (scheduler: stdlib only; worker: never
ray or the front end; front end: never ray or cluster; config, the one user configuration both read: never ray,
cluster or front end; bench: never ray), and inside each sub-package its folders in layers, no import running back
up, no folder of more than MAX_FOLDER_MODULES modules side by side."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cbserve"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def _source_files() -> Iterator[tuple[str, Path]]:
    """(module name, path) of every module of the distribution."""
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        yield ".".join(p for p in rel.parts if p != "__init__"), path


def _all_python_files() -> Iterator[Path]:
    for folder in ["cbserve", "benchmarks", "dashboards", "tests"]:
        yield from sorted((ROOT / folder).rglob("*.py"))


def _imports(module: str, path: Path) -> set[str]:
    """cbserve modules (or packages) that ``module`` imports anywhere in its body, lazy imports included."""
    is_package = path.name == "__init__.py"
    base = module.split(".") if is_package else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("cbserve"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("cbserve"):
                continue
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)  # `from pkg import module`
    return found


def _graph() -> dict[str, set[str]]:
    modules = dict(_source_files())
    return {m: {t for t in _imports(m, p) if t in modules and t != m} for m, p in modules.items()}


def _top_imports(path: Path) -> set[str]:
    """Top-level names of every absolute import in the file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
            if node.module.startswith("cbserve."):
                names.add(".".join(node.module.split(".")[:2]))
    return names


@pytest.mark.parametrize("path", list(_all_python_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_file_and_function_sizes(path: Path) -> None:
    text = path.read_text()
    assert text.count("\n") <= MAX_FILE_LINES, f"{path.name} has {text.count(chr(10))} lines (> {MAX_FILE_LINES})"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    """Package __init__ files re-export their modules, so an edge into a package counts as an edge into it."""
    graph = _graph()
    assert "cbserve.scheduler.engine_core" in graph  # the walk found the modules
    assert _cycles(graph) == []


def test_cycle_detection_works() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


FORBIDDEN = {
    "scheduler": {"torch", "ray", "transformers", "fastapi", "pydantic", "cbserve.worker", "cbserve.frontend",
                  "cbserve.cluster", "cbserve.bench", "cbserve.config"},
    "worker": {"ray", "fastapi", "cbserve.frontend", "cbserve.cluster", "cbserve.bench", "cbserve.config"},
    "frontend": {"ray", "cbserve.cluster", "cbserve.bench"},
    # pydantic, yaml, the scheduler's config and the torch-free worker modules; torch only lazily (a device)
    "config": {"ray", "fastapi", "transformers", "cbserve.cluster", "cbserve.frontend", "cbserve.bench"},
    "bench": {"ray", "cbserve.worker", "cbserve.frontend", "cbserve.cluster", "cbserve.scheduler", "cbserve.config"},
}


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_import_directions(folder: str) -> None:
    bad = {
        str(path.relative_to(ROOT)): sorted(_top_imports(path) & FORBIDDEN[folder])
        for path in sorted((PACKAGE / folder).rglob("*.py"))
    }
    assert {k: v for k, v in bad.items() if v} == {}


# Inside each sub-package, its parts in layers, lowest first: a folder ("name/") or root modules ("name"). A module
# imports its own layer and those before it, never one after (no import runs back up; __init__ files re-export).
LAYERS: dict[str, list[set[str]]] = {
    "scheduler": [{"config", "errors", "stats"}, {"requests/"}, {"kv/"},
                  {"outputs", "waiting_queue", "policies", "integrity", "fault_isolation", "spec_decode", "beam_search",
                   "scheduler", "sequence_updater", "engine_core"}],
    "worker": [{"config", "parallel", "faults", "shapes", "sim_cost", "fp8"}, {"cpu/"}, {"attention/"}, {"cuda/"},
               {"layers/"}, {"models/"}, {"loading/"}, {"sampling/"}, {"lora/"}, {"kv/"}, {"runner/"}],
    "frontend": [{"model_files"}, {"text/"}, {"protocol", "protocol_tools", "field_policy", "retention_hints",
                  "lora_registry", "lora_contents", "output"}, {"tools/"},
                 {"validation", "formatters", "serving", "embeddings", "llm"}, {"responses/"}],
    "cluster": [{"channel/"}, {"ops/"}, {"stores/"}, {"engine/"}, {"ingress/"}, {"app"}, {"cli/"}],
}
MAX_FOLDER_MODULES = 13


def _layer_of(package: str, module: str) -> int:
    """The layer of ``cbserve.<package>.<rest>``'s part."""
    rest = module.split(".")[2:]
    part = f"{rest[0]}/" if (PACKAGE / package / rest[0]).is_dir() else rest[0]
    for i, layer in enumerate(LAYERS[package]):
        if part in layer:
            return i
    raise AssertionError(f"{module}: its part {part!r} is in no layer of {package} (tests/test_structure.py)")


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_no_import_runs_back_up(package: str) -> None:
    graph = _graph()
    back_up = []
    for src, targets in graph.items():
        if not src.startswith(f"cbserve.{package}.") or src.endswith("__init__") or \
                (PACKAGE / package / f"{src.split('.')[-1]}" / "__init__.py").exists() and src.count(".") == 2:
            continue
        for dst in targets:
            if dst.startswith(f"cbserve.{package}.") and dst.count(".") >= 2 and \
                    _layer_of(package, dst) > _layer_of(package, src):
                back_up.append(f"{src} -> {dst}")
    assert back_up == []


def test_no_folder_holds_more_than_a_dozen_modules() -> None:
    crowded = {str(d.relative_to(ROOT)): n for d in [PACKAGE, *PACKAGE.rglob("*/")] if d.name != "__pycache__"
               and (n := len([f for f in d.glob("*.py") if f.name != "__init__.py"])) > MAX_FOLDER_MODULES}
    assert crowded == {}
