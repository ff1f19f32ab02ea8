"""The install paths agree: env.yml (conda users) installs every distribution pyproject.toml's `dependencies` require,
with at least the same lower bound, and none of the test-only extras; `make install` installs the package without the
test extras, `make test` adds them (read from the real Makefile through `make -n`).

The check is computed from pyproject.toml each time, so a dependency someone adds there later fails here until env.yml
has it too (test_a_dependency_added_to_pyproject_only_is_reported proves that the check would notice)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import ROOT  # noqa: E402

# conda package name -> the PyPI distribution it provides (only where the two differ).
CONDA_TO_PYPI = {"pytorch": "torch", "python-xxhash": "xxhash", "pytorch-cuda": None, "python": None, "pip": None}


def _conda_requirement(spec: str) -> Requirement | None:
    """`numpy>=1.26`, `python=3.11` (conda's `=` is a prefix match), `pytorch-cuda=12.4` -> a Requirement of the PyPI
    distribution, or None for conda-only packages."""
    name = spec.split()[0]
    for i, ch in enumerate(name):
        if ch in "<>=!~":
            name, version = name[:i], name[i:]
            break
    else:
        version = ""
    pypi = CONDA_TO_PYPI.get(name, name)
    if pypi is None:
        return None
    if version.startswith("=") and not version.startswith("=="):
        version = f"=={version[1:]}.*"
    return Requirement(pypi + version)


def env_requirements(env_text: str) -> dict[str, Requirement]:
    deps = yaml.safe_load(env_text)["dependencies"]
    reqs: list[Requirement | None] = []
    for dep in deps:
        if isinstance(dep, dict):
            reqs += [Requirement(r) for r in dep.get("pip", [])]
        else:
            reqs.append(_conda_requirement(str(dep)))
    return {canonicalize_name(r.name): r for r in reqs if r is not None}


def _lower_bound(spec: SpecifierSet) -> Version | None:
    bounds = [Version(s.version.rstrip(".*")) for s in spec if s.operator in (">=", ">", "==", "~=")]
    return max(bounds) if bounds else None


def disagreements(pyproject_text: str, env_text: str) -> list[str]:
    """One line per required distribution that env.yml lacks or allows older than pyproject does, and per test-only
    extra that env.yml installs."""
    project = tomllib.loads(pyproject_text)["project"]
    env = env_requirements(env_text)
    problems = []
    required = [Requirement(r) for r in project["dependencies"]]
    for req in required:
        name = canonicalize_name(req.name)
        if name not in env:
            problems.append(f"{req.name}: required by pyproject.toml ({req}), missing from env.yml")
            continue
        want, have = _lower_bound(req.specifier), _lower_bound(env[name].specifier)
        if want is not None and (have is None or have < want):
            allowed = env[name].specifier or "any"
            problems.append(f"{req.name}: pyproject.toml requires {req.specifier}, env.yml allows {allowed}")
    runtime = {canonicalize_name(r.name) for r in required}
    for extra in project.get("optional-dependencies", {}).get("dev", []):
        name = canonicalize_name(Requirement(extra).name)
        if name not in runtime and name in env:
            problems.append(f"{name}: a test-only extra ([dev]) in env.yml, the training environment")
    return problems


def test_env_yml_installs_what_pyproject_requires():
    problems = disagreements((ROOT / "pyproject.toml").read_text(), (ROOT / "env.yml").read_text())
    assert not problems, "env.yml disagrees with pyproject.toml:\n" + "\n".join(problems)


def test_a_dependency_added_to_pyproject_only_is_reported():
    added = '\n  "zstandard>=0.22",'
    pyproject = (ROOT / "pyproject.toml").read_text().replace("dependencies = [", "dependencies = [" + added, 1)
    env = (ROOT / "env.yml").read_text()
    assert disagreements(pyproject, env) == [
        "zstandard: required by pyproject.toml (zstandard>=0.22), missing from env.yml"]
    older = env.replace("xxhash>=3.4", "xxhash>=3.0")
    assert disagreements((ROOT / "pyproject.toml").read_text(), older) == [
        "xxhash: pyproject.toml requires >=3.4, env.yml allows >=3.0"]
    with_pytest = env.replace("  - pip:\n", "  - pytest>=8\n  - pip:\n", 1)
    assert disagreements((ROOT / "pyproject.toml").read_text(), with_pytest) == [
        "pytest: a test-only extra ([dev]) in env.yml, the training environment"]


def _make_n(*goals: str) -> str:
    # -B: print every recipe as on a fresh machine (no stamps), -n: run none of them.
    out = subprocess.run(["make", "-n", "-B", "-C", str(ROOT), *goals], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_make_install_is_training_only_and_make_test_adds_the_test_extras():
    install = _make_n("install")
    assert "pip install -q -e .\n" in install, install
    assert ".[dev]" not in install, install
    train = _make_n("train")
    assert ".[dev]" not in train, train
    test = _make_n("test")
    assert "pip install -q -e '.[dev]'" in test, test
    assert test.index(".[dev]") < test.index("-m pytest"), test


def test_the_install_puts_only_the_checkpoint_package_on_the_import_path(tmp_path):
    """The wheel `pip install .` would install holds the checkpoint package and nothing else at the top level: no
    `model`, `dataset` or `distributed` (Dask's) shadowing another project's modules."""
    src = tmp_path / "src"  # a copy: setuptools leaves build/ behind, and would reuse a stale one
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "data", "build", "*.egg-info",
                                                             "__pycache__", "checkpoints", "results", "tests"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("*.whl")
    tops = {name.split("/", 1)[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"checkpoint"}, sorted(tops)
