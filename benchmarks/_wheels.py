"""The wheels a GPU machine needs for `scripts/gpu-check`, derived rather than listed.

`download(folder)` runs where an index (PyPI) is reachable: it walks the requirements of the package (pyproject.toml's
dependencies, the extras gpu-check's experiments use, and the few development tools its parts run) and their
requirements in turn, each at its version in requirements/constraints.txt, and downloads a wheel of each for Python
3.12 on manylinux x86_64, except the heavy distributions a GPU image ships with its CUDA build (`ON_THE_IMAGE`:
JAX, PyTorch, NumPy, ...; their requirements are not followed either). It writes `requirements.json` beside the
wheels: every requirement met on the way, with the specifier that asked for it and its wheel, if any.

`install_missing(folder, site)` runs on the GPU machine, before anything imports: it installs into `site` (put on
`PYTHONPATH` after) only the wheels of distributions that `importlib.metadata` reports missing or whose installed
version the specifier does not admit, so the machine's own JAX and PyTorch stay in charge. Standard library and
`packaging` only (pip's own copy where `packaging` is not installed)."""

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # a bare Python: pip vendors the same library
    from pip._vendor.packaging.markers import Marker  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "requirements.json"
EXTRAS = ("dp",)  # the dp_sgd experiment's privacy accounting
DEV_TOOLS = ("scikit-learn", "pytest")  # the digits the experiments part writes; the tests part
# Heavy, compiled, and built for the machine's CUDA: the GPU image has them (/work/.library/device/KINDS.md's list)
ON_THE_IMAGE = frozenset(
    "jax jaxlib jax-cuda13-plugin jax-cuda13-pjrt torch triton numpy scipy scikit-learn matplotlib pillow pandas "
    "pyarrow tensorstore ml-dtypes opt-einsum".split()
)
# Python 3.12 on x86-64 Linux: the GPU machine (pip matches each manylinux tag exactly, hence the list)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64")
PLATFORMS += ("manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64")
TARGET = {
    "python_version": "3.12",
    "python_full_version": "3.12.0",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}


class WheelError(Exception):
    """A wheel could not be downloaded or installed; the message is one line."""


def top_requirements(root: Path = ROOT) -> list[Requirement]:
    """pyproject.toml's dependencies, its `EXTRAS`, and the `DEV_TOOLS` of its `dev` extra."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    found = [Requirement(r) for r in project["dependencies"]]
    found += [Requirement(r) for extra in EXTRAS for r in extras[extra]]
    found += [r for r in map(Requirement, extras["dev"]) if canonicalize_name(r.name) in DEV_TOOLS]
    return found


def pinned_versions(root: Path = ROOT) -> dict[str, str]:
    lines = (root / "requirements" / "constraints.txt").read_text().splitlines()
    pairs = (line.split("#")[0].strip().split("==") for line in lines)
    return {canonicalize_name(pair[0]): pair[1] for pair in pairs if len(pair) == 2}


def _applies(requirement: Requirement, extras: set[str]) -> bool:
    """Whether `requirement` is needed on the GPU machine's Python, given the requested `extras` of its parent."""
    marker: Marker | None = requirement.marker
    return marker is None or any(marker.evaluate({**TARGET, "extra": extra}) for extra in extras | {""})


def _requires(wheel: Path) -> list[str]:
    """The `Requires-Dist` lines of a wheel's METADATA."""
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        text = archive.read(name).decode()
    header = text.split("\n\n")[0]
    field = "Requires-Dist:"
    return [line.removeprefix(field).strip() for line in header.splitlines() if line.startswith(field)]


def _wheel_name(path: Path) -> str:
    return canonicalize_name(path.name.split("-")[0])


def _saved_wheel(folder: Path, name: str, version: str | None) -> Path:
    """The wheel of `name` (at `version` if pinned) in `folder`, the newest if an earlier download left others."""
    found = [w for w in folder.glob("*.whl") if _wheel_name(w) == name]
    found = [w for w in found if version is None or Version(w.name.split("-")[1]) == Version(version)]
    if not found:
        raise WheelError(f"pip reported {name} downloaded, but no wheel of it is in {folder}")
    return max(found, key=lambda w: w.stat().st_mtime)


def _pip_download(folder: Path, pins: list[str]) -> None:
    flags = ["--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    flags += [f"--platform={p}" for p in PLATFORMS]
    command = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", *flags, "-d", folder]
    result = subprocess.run([*command, *pins], capture_output=True, text=True)
    if result.returncode:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "")
        raise WheelError(
            f"pip could not download {' '.join(pins)} for Python 3.12 manylinux x86_64 ({reason}); "
            "--wheels needs a reachable package index (PyPI, or PIP_INDEX_URL)"
        )


def download(folder: Path, root: Path = ROOT) -> dict:
    """Download the wheels the GPU machine may lack into `folder` and write its `requirements.json`."""
    folder.mkdir(parents=True, exist_ok=True)
    pins = pinned_versions(root)
    wanted: dict[str, dict] = {}
    queue = [(r, set()) for r in top_requirements(root)]
    while queue:
        fetch = {}
        for requirement, parent_extras in queue:
            if not _applies(requirement, parent_extras):
                continue
            name = canonicalize_name(requirement.name)
            entry = wanted.setdefault(name, {"specifier": SpecifierSet(), "extras": set(), "wheel": None})
            entry["specifier"] &= requirement.specifier
            new_extras = set(requirement.extras) - entry["extras"]
            entry["extras"] |= new_extras
            if name in ON_THE_IMAGE or (entry["wheel"] and not new_extras):
                continue
            version = pins.get(name)
            fetch[name] = f"{name}=={version}" if version else f"{name}{entry['specifier']}"
        queue = []
        if not fetch:
            break
        _pip_download(folder, sorted(fetch.values()))
        for name in fetch:
            wheel = _saved_wheel(folder, name, pins.get(name))
            wanted[name]["wheel"] = wheel.name
            queue += [(Requirement(line), wanted[name]["extras"]) for line in _requires(folder / wheel)]
    manifest = {
        "python": "3.12",
        "requirements": {
            name: {"specifier": str(e["specifier"]), "wheel": e["wheel"], "on_the_image": name in ON_THE_IMAGE}
            for name, e in sorted(wanted.items())
        },
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def lacking(folder: Path) -> dict[str, dict]:
    """The requirements of `folder`'s manifest this Python does not meet: {name: {specifier, wheel, installed}}."""
    path = folder / MANIFEST
    if not path.exists():
        raise WheelError(f"{path} is missing: make the folder with `scripts/gpu-check --wheels {folder}`")
    requirements = json.loads(path.read_text())["requirements"]
    found = {}
    for name, entry in requirements.items():
        installed = _installed(name)
        admitted = installed is not None and SpecifierSet(entry["specifier"]).contains(Version(installed), True)
        if not admitted:
            found[name] = {**entry, "installed": installed}
    return found


def install_missing(folder: Path, site: Path) -> dict:
    """Install into `site` the wheels of `folder` whose distributions this Python lacks (or holds at a version its
    requirement does not admit). Returns what was installed and what stays unmet (no wheel for it)."""
    missing = lacking(folder)
    wheels = [folder / e["wheel"] for e in missing.values() if e["wheel"]]
    if wheels:
        command = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index"]
        command += ["--no-deps", "--no-compile", "--upgrade", "--target", str(site), *map(str, wheels)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            lines = [line for line in result.stderr.splitlines() if line.strip()] or ["(no message)"]
            raise WheelError(f"pip could not install the wheels of {folder}: {lines[-1].strip()}")
    installed = [f"{n}=={e['wheel'].split('-')[1]}" for n, e in missing.items() if e["wheel"]]
    unmet = [f"{n}{e['specifier']} (installed: {e['installed']})" for n, e in missing.items() if not e["wheel"]]
    return {"installed": sorted(installed), "unmet": sorted(unmet)}
