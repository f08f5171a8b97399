"""Every test says which device it means (issue 37).

``ModelConfig``, ``LLM`` and ``CBServeConfig`` default to ``device="auto"``: CUDA where a GPU is found. A test that
builds one without a device runs on the GPU of a GPU machine and there compares bfloat16 CUDA results with CPU /
HF float32 references at CPU tolerances, or asks for the "cpu" attention backend and C kernels on CUDA. So each
such call in tests/ passes ``device=`` (or ``**kwargs`` that carry it: a dict literal of the same file that the
call unpacks must hold a "device" key), unless the test is in the GPU suite (marked ``cuda``, `pytest -m cuda`)
or is about the defaults themselves (ALLOWED below, each with its reason).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CUDA_MARK = "pytest.mark" + ".cuda"
# the classes whose device defaults to "auto"; the tests' own helpers that build them take **kwargs (checked below)
BUILDERS = frozenset({"ModelConfig", "LLM", "CBServeConfig"})
# (file relative to tests/, test function) -> why it builds a configuration without a device
ALLOWED: dict[tuple[str, str], str] = {
    ("frontend/test_llm_config.py", "test_every_field_is_taken_offline_with_its_default_or_refused_as_served_only"):
        "compares LLM's fields with CBServeConfig's defaults (device 'auto' included); builds no model",
    ("frontend/test_llm_config.py", "test_none_means_unset"):
        "a field set to None keeps CBServeConfig's default; builds no model",
}


def _is_cuda_mark(node: ast.expr) -> bool:
    """The ``cuda`` mark (``pytest.mark`` or ``mark`` then ``.cuda``), alone or in a list / tuple."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_cuda_mark(e) for e in node.elts)
    return isinstance(node, ast.Attribute) and node.attr == "cuda" and ast.unparse(node.value).endswith("mark")


def _module_marked_cuda(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return _is_cuda_mark(node.value)
    return False


def _module_dicts(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level ``NAME = {...}`` / ``NAME = dict(...)`` assignments."""
    found: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = node.value
    return found


def _dict_keys(node: ast.expr) -> set[str] | None:
    """The keys of a dict literal or ``dict(...)`` call; None when it is neither or unpacks something else."""
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            return None
        return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args:
        if any(k.arg is None for k in node.keywords):
            return None
        return {k.arg for k in node.keywords if k.arg}
    return None


def _unpacked_lacks_device(value: ast.expr, module_dicts: dict[str, ast.expr]) -> bool:
    """Whether ``**value`` is (an entry of) a dict defined in this module without a "device" key. What cannot be
    resolved here (function kwargs, imported names) is trusted."""
    if isinstance(value, ast.Name) and value.id in module_dicts:
        keys = _dict_keys(module_dicts[value.id])
        return keys is not None and "device" not in keys
    if isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name) and value.value.id in module_dicts:
        outer = module_dicts[value.value.id]
        if isinstance(outer, ast.Dict):
            entries = [_dict_keys(v) for v in outer.values]
            return any(keys is not None and "device" not in keys for keys in entries)
    return False


def _callee(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def _missing_device(node: ast.Call, module_dicts: dict[str, ast.expr]) -> bool:
    if any(k.arg == "device" for k in node.keywords):
        return False
    unpacked = [k.value for k in node.keywords if k.arg is None]
    return not unpacked or any(_unpacked_lacks_device(v, module_dicts) for v in unpacked)


def _calls(node: ast.AST, owner: str, cuda: bool) -> Iterator[tuple[ast.Call, str, bool]]:
    """(call, enclosing top-level function or class, whether a cuda mark covers it) for every call under node."""
    for child in ast.iter_child_nodes(node):
        child_owner, child_cuda = owner, cuda
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            child_owner = owner or child.name
            child_cuda = cuda or any(_is_cuda_mark(d) for d in child.decorator_list)
        if isinstance(child, ast.Call):
            yield child, owner, cuda
        yield from _calls(child, child_owner, child_cuda)


def _violations(path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(TESTS).as_posix()
    module_dicts = _module_dicts(tree)
    for call, owner, cuda in _calls(tree, "", _module_marked_cuda(tree)):
        if _callee(call) not in BUILDERS or cuda or (rel, owner) in ALLOWED:
            continue
        if _missing_device(call, module_dicts):
            yield f"tests/{rel}:{call.lineno}: {ast.unparse(call)[:100]}"


def test_every_configuration_a_test_builds_names_its_device() -> None:
    bad = [v for path in sorted(TESTS.rglob("*.py")) for v in _violations(path)]
    assert not bad, ("these calls build a configuration without device= (device 'auto' is CUDA on a GPU machine): "
                     "pass device=\"cpu\" (or \"cuda\" in a test marked cuda):\n" + "\n".join(bad))


def test_the_allow_list_names_tests_that_exist() -> None:
    for (rel, name), _reason in ALLOWED.items():
        tree = ast.parse((TESTS / rel).read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body), (rel, name)


def test_the_guard_sees_what_it_guards() -> None:
    # CUDA_MARK is spelt in two parts: gpu_check_correctness.py runs the files whose text holds the mark
    src = ("import pytest\nENGINE = {'max_model_len': 8}\nCPU = dict(device='cpu')\n"
           "def test_a():\n    ModelConfig(model='m')\n    LLM(**ENGINE)\n    LLM(**CPU)\n"
           "    cbserve.CBServeConfig(device='cpu')\n    LLM(**kw)\n"
           f"@{CUDA_MARK}\ndef test_b():\n    ModelConfig()\n")
    tree = ast.parse(src)
    module_dicts = _module_dicts(tree)
    flagged = [c.lineno for c, _, cuda in _calls(tree, "", False)
               if _callee(c) in BUILDERS and not cuda and _missing_device(c, module_dicts)]
    assert flagged == [5, 6]
    assert _module_marked_cuda(ast.parse(f"import pytest\npytestmark = [{CUDA_MARK}, pytest.mark.slow]\n"))
