"""Strict mypy over the packages in PACKAGES, checked under the names they are installed as.

The editable install maps ``persia_nats.common`` to ``common/`` through an import hook that mypy cannot
follow, and mypy knows nothing of setuptools' package-dir. So this lays out the installed tree as
symlinks under build/typecheck/ (from pyproject.toml's package list and package-dir), runs mypy there
with the repository's [tool.mypy] config, and prints mypy's report with the repository's own paths.

Run as ``.venv/bin/python .ci/typecheck.py`` (``.ci/run`` does); extra arguments go to mypy.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

# the packages that pass mypy --strict; add one here to keep it passing
PACKAGES = ["persia_nats.common", "persia_nats.core"]

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "typecheck"


def lay_out(packages: list[str], package_dir: dict[str, str], view: Path) -> None:
    """Mirror the installed tree in ``view``: a folder that setuptools maps becomes one symlink to it,
    and any other package a folder of symlinks to its modules (its mapped subpackages link inside it)."""
    for name in sorted(set(packages) | set(package_dir)):
        if any(name.startswith(f"{mapped}.") for mapped in package_dir):
            continue  # inside a linked folder already
        dst = view.joinpath(*name.split("."))
        dst.parent.mkdir(parents=True, exist_ok=True)
        if name in package_dir:
            dst.symlink_to(ROOT / package_dir[name], target_is_directory=True)
            continue
        dst.mkdir()
        for module in ROOT.joinpath(*name.split(".")).glob("*.py"):
            (dst / module.name).symlink_to(module)


def main(argv: list[str]) -> int:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools.get("package-dir", {})
    view = WORK / "view"
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    lay_out(setuptools["packages"], package_dir, view)
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
           "--cache-dir", str(WORK / "cache"), *argv]
    for package in PACKAGES:
        cmd += ["-p", package]
    proc = subprocess.run(cmd, cwd=view, capture_output=True, text=True)
    # report common/codec.py:12, a path in the repository, not persia_nats/common/codec.py in the view
    renames = sorted(((name.replace(".", "/") + "/", folder.rstrip("/") + "/") for name, folder in package_dir.items()),
                     key=lambda r: -len(r[0]))
    for line in (proc.stdout + proc.stderr).splitlines():
        for installed, folder in renames:
            if line.startswith(installed):
                line = folder + line[len(installed):]
                break
        print(line)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
