"""The ``cbserve`` command: ``serve``, ``generate`` and ``bench``. Each subcommand lives in its own module,
imported only when it runs (so ``cbserve generate`` never imports ray)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys

# subcommand -> (module, help). Each module defines add_arguments(parser) and main(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("cbserve.cluster.cli.serve", "start (or join) Ray and serve a model over the OpenAI API"),
    "generate": ("cbserve.cluster.cli.generate", "generate offline, in-process"),
    "bench": ("cbserve.bench.cli", "load-test an OpenAI-compatible server and report latencies"),
}

# subcommand -> (the optional extra it needs, modules of that extra it imports)
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "serve": ("serve", ("ray", "ray.serve", "fastapi", "uvicorn", "prometheus_client", "psutil")),
    "bench": ("bench", ("aiohttp",)),
}


def missing_extra(command: str | None) -> str | None:
    """What to install for ``command`` when a module of its extra is missing (None when nothing is)."""
    if command not in EXTRAS:
        return None
    extra, modules = EXTRAS[command]
    missing = [m for m in modules if not _importable(m)]
    if not missing:
        return None
    return (f"cbserve {command} needs the '{extra}' extra, which is not installed (missing: {', '.join(missing)}); "
            f"install it with: pip install 'cbserve[{extra}]'")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Build only the chosen subcommand's arguments, so a missing optional dependency of another
    # subcommand never breaks this one.
    parser = argparse.ArgumentParser(prog="cbserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    missing = missing_extra(chosen)
    if missing is not None:
        print(f"cbserve: error: {missing}", file=sys.stderr)
        return 1
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        sp.set_defaults(_module=module_name)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(sp)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(importlib.import_module(args._module).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
