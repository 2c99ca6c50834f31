"""Checks requirements/ against pyproject.toml; `.ci/run` runs it before the tests.

    python .ci/lockcheck.py            # exit 1, naming each problem, when the locks are stale or wrong
    python .ci/lockcheck.py --list     # the locks `.ci/lock` writes, as `name:extra,extra` lines
    python .ci/lockcheck.py --stamp    # records pyproject.toml's dependency tables (run by .ci/lock)

A lock is stale when pyproject.toml's dependency tables changed since `bash .ci/lock` last wrote them
(the stamp), or when a pin no longer satisfies a requirement. A lock is wrong when it pins a CUDA
package or a torch other than the CPU build: the locks are for CPU machines, and a CUDA torch is
chosen on purpose (docs/operations.md), never by the resolver.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tomllib
from pathlib import Path

# what every lock is resolved under: torch's CPU build
CONSTRAINTS = "requirements/constraints.in"
# lock name -> the extras it installs, beside the dependencies. ci is what .ci/bootstrap installs.
LOCKS: dict[str, tuple[str, ...]] = {
    "base": (),
    "nn": ("nn",),
    "local": ("local",),
    "s3": ("s3",),
    "gcs": ("gcs",),
    "bench": ("bench",),
    "test": ("test",),
    "ci": ("test", "test-s3"),
}
# the interpreter and platform the locks are resolved for (.ci/lock's --python-version/--python-platform)
MARKER_ENV = {
    "python_version": "3.11",
    "python_full_version": "3.11.0",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
CUDA_PREFIXES = ("nvidia-", "triton", "cuda-", "cupy")
STAMP = "requirements/pyproject.sha256"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;\\]+)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def input_digest(root: Path) -> str:
    """What the locks were resolved from: pyproject's dependency tables, the torch pin and LOCKS."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    inputs = {
        "name": project["name"],
        "requires-python": project.get("requires-python"),
        "dependencies": project.get("dependencies", []),
        "optional-dependencies": project.get("optional-dependencies", {}),
        "constraints": (root / CONSTRAINTS).read_text(),
        "locks": LOCKS,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def read_pins(path: Path) -> tuple[dict[str, str], list[str]]:
    """name -> version of every pin in a lock, and the pins that carry no hash."""
    pins: dict[str, str] = {}
    unhashed: list[str] = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        match = _PIN.match(line)
        if not match:
            continue
        name = canonical(match.group(1))
        pins[name] = match.group(3)
        block = [line]
        for follow in lines[i + 1:]:
            if not follow.startswith(" "):
                break
            block.append(follow)
        if not any("--hash=sha256:" in part for part in block):
            unhashed.append(name)
    return pins, unhashed


def requirements_for(project: dict[str, object], extras: tuple[str, ...]) -> list[str]:
    """The project's requirements with these extras, its own extras (persia-nats[local,nn]) expanded."""
    from packaging.requirements import Requirement

    optional = project.get("optional-dependencies", {})
    assert isinstance(optional, dict)
    own = canonical(str(project["name"]))
    out: list[str] = list(project.get("dependencies", []))  # type: ignore[call-overload]
    todo, seen = list(extras), set[str]()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        if extra not in optional:
            raise SystemExit(f"lockcheck: LOCKS names extra {extra!r}, which pyproject.toml does not define")
        for text in optional[extra]:
            req = Requirement(text)
            if canonical(req.name) == own:
                todo.extend(req.extras)
            else:
                out.append(text)
    return out


def torch_cpu(root: Path) -> str:
    """The torch version the constraints pin (2.13.0+cpu)."""
    for line in (root / CONSTRAINTS).read_text().splitlines():
        if line.startswith("torch=="):
            return line.split("==", 1)[1].strip()
    raise SystemExit(f"lockcheck: {CONSTRAINTS} pins no torch")


def problems(root: Path) -> list[str]:
    from packaging.requirements import Requirement
    from packaging.version import Version

    found: list[str] = []
    torch = torch_cpu(root)
    if not torch.endswith("+cpu"):
        found.append(f"{CONSTRAINTS}: torch=={torch} is not a CPU build (+cpu)")
    stamp = root / STAMP
    if not stamp.exists() or stamp.read_text().strip() != input_digest(root):
        found.append("pyproject.toml's dependencies changed since the locks were written: run `bash .ci/lock`")
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    for name, extras in LOCKS.items():
        path = root / "requirements" / f"{name}.txt"
        if not path.exists():
            found.append(f"{path.relative_to(root)} is missing: run `bash .ci/lock`")
            continue
        pins, unhashed = read_pins(path)
        where = path.relative_to(root)
        for pkg in unhashed:
            found.append(f"{where}: {pkg} has no --hash")
        for pkg in pins:
            if pkg.startswith(CUDA_PREFIXES):
                found.append(f"{where}: pins the CUDA package {pkg}=={pins[pkg]} (the locks are for CPU)")
        if "torch" in pins and pins["torch"] != torch:
            found.append(f"{where}: torch=={pins['torch']}, not the CPU build {torch}")
        for text in requirements_for(project, extras):
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(MARKER_ENV):
                continue
            have = pins.get(canonical(req.name))
            if have is None:
                found.append(f"{where}: {req.name} is required ({text!r}) but not pinned")
            elif not req.specifier.contains(Version(have), prereleases=True):
                found.append(f"{where}: {req.name}=={have} does not satisfy {text!r}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--list", action="store_true", help="print the locks as name:extras lines")
    parser.add_argument("--stamp", action="store_true", help="record pyproject.toml's dependency tables")
    args = parser.parse_args()
    if args.list:
        for name, extras in LOCKS.items():
            print(f"{name}:{','.join(extras)}")
        return 0
    if args.stamp:
        (args.root / STAMP).write_text(input_digest(args.root) + "\n")
        return 0
    found = problems(args.root)
    for line in found:
        print(f"lockcheck: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
