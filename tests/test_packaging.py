"""The distribution as users get it: a wheel built from the checkout holds every package (the model families
and the C sources included), installs into a fresh venv (not editable) and generates from there with the
bundled model; a subcommand whose extra is missing says what to install instead of a traceback."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from cbserve.cluster.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(600)


def _packages_in_checkout() -> set[str]:
    return {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "cbserve").rglob("__init__.py")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy of the sources (a build folder left in the checkout could add stale modules)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "cbserve", src / "cbserve", ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (found,) = out.glob("cbserve-*.whl")
    return found


def test_the_wheel_holds_every_package_and_the_c_sources(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    packages = {str(Path(n).parent).replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert packages == _packages_in_checkout()
    assert "cbserve.worker.models" in packages and "cbserve/worker/models/llama.py" in names
    assert {"cbserve/worker/cpu/csrc/cb_cpu.h", "cbserve/worker/cpu/csrc/gemm.c"} <= set(names)
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_the_wheel_installed_in_a_fresh_venv_generates(wheel: Path, tmp_path: Path) -> None:
    """Not editable: the venv's cbserve is the wheel's; its dependencies come from this venv's site-packages
    (a path entry only, so this venv's editable cbserve is not seen)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                        "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = subprocess.run([str(py), "-c", "import cbserve.worker.models.llama as m; print(m.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert where.returncode == 0, where.stderr[-3000:]
    assert where.stdout.strip().startswith(site)
    gen = subprocess.run([str(venv / "bin" / "cbserve"), "generate", "--prompt", "The capital of France is",
                          "--max-tokens", "4"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert gen.returncode == 0, gen.stdout[-2000:] + gen.stderr[-3000:]
    assert "Paris" in gen.stdout


@pytest.mark.parametrize("command, module", [("serve", "ray"), ("bench", "aiohttp")])
def test_a_missing_extra_names_what_to_install(command: str, module: str, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    real = cli._importable
    monkeypatch.setattr(cli, "_importable", lambda name: name != module and real(name))
    assert cli.main([command]) == 1
    err = capsys.readouterr().err
    assert f"cbserve {command} needs the '{command}' extra" in err and f"missing: {module}" in err
    assert f"pip install 'cbserve[{command}]'" in err and "Traceback" not in err
    assert cli.missing_extra("generate") is None and cli.missing_extra(command) is not None


def test_installed_extras_pass_the_check() -> None:
    assert cli.missing_extra("serve") is None and cli.missing_extra("bench") is None
