"""The stamp of scripts/setup_env.sh, from files alone: no torch and no project import, so
that a set-up with nothing to do takes a fraction of a second even on a busy machine.

The stamp hashes what the install is built from (setup.py, pyproject.toml, csrc/*, the
package's file list) and for (this Python, its prefix, the installed torch's version from
its metadata). It is printed only when ``import mp_offload`` from outside ROOT would find
ROOT's package and its C++ extensions for this Python are built (the hash of csrc/ says
whether they are the current ones); otherwise one line on stderr says why, and the exit status is 1.

    python scripts/setup_stamp.py ROOT
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import importlib.util
import os
import sys
import sysconfig

EXTENSIONS = ("_cpu_adam", "_host_ops")


def installed_package() -> str | None:
    """The directory ``import mp_offload`` would load (found, not imported)."""
    try:
        spec = importlib.util.find_spec("mp_offload")
    except (ImportError, ValueError):
        return None
    return os.path.dirname(spec.origin) if spec and spec.origin else None


def torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def sources(root: str) -> list[str]:
    """The files whose content the install is built from, sorted."""
    found = [os.path.join(root, "setup.py"), os.path.join(root, "pyproject.toml")]
    found += glob.glob(os.path.join(root, "csrc", "*"))
    return sorted(p for p in found if os.path.isfile(p))


def problem(root: str, package: str | None) -> str | None:
    """Why the install is not this checkout's, built; None when it is."""
    want = os.path.join(root, "mp_offload")
    if package is None or os.path.realpath(package) != os.path.realpath(want):
        return f"`import mp_offload` finds {package or 'nothing'}, not {want}"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for name in EXTENSIONS:
        path = os.path.join(want, name + suffix)
        if not os.path.isfile(path):
            return f"{path} is not built"
    return None


def stamp(root: str, package: str, torch: str) -> str:
    h = hashlib.sha256()
    for path in sources(root):
        h.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
    modules = glob.glob(os.path.join(root, "mp_offload", "**", "*.py"), recursive=True)
    h.update("\n".join(sorted(os.path.relpath(p, root) for p in modules)).encode())
    h.update(f"\0{sys.version}\0{sys.prefix}\0{torch}\0{package}".encode())
    return h.hexdigest()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/setup_stamp.py ROOT", file=sys.stderr)
        return 2
    root = os.path.abspath(argv[0])
    package = installed_package()
    why = problem(root, package)
    if why:
        print(f"setup_stamp: {why}", file=sys.stderr)
        return 1
    print(stamp(root, package, torch_version()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
