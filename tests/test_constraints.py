"""constraints.txt pins exactly what this environment installs: every pin is installed at its
version (a pin of a package nothing installs misleads whoever reads it), and every dependency
of pyproject.toml is pinned."""
import importlib.metadata
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return dict(line.split("==") for line in (l.split("#")[0].strip() for l in lines) if line)


def test_every_pin_is_installed_at_its_version():
    for name, version in _pins().items():
        assert importlib.metadata.version(name) == version, name


def test_every_dependency_is_pinned():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0].lower() for d in deps}
    assert names <= set(_pins())


# The GPU image the ladder rung ran on unchanged (one H200, 2026-12): Python 3.12 with these.
GPU_IMAGE = {"jax": "0.11.2", "flax": "0.12.10", "optax": "0.2.8"}


def _allowed(name: str, version: str, python: str, group: list[str]) -> bool:
    """Whether pyproject's requirements of `name` (in `group`) admit `version` on `python`."""
    from packaging.requirements import Requirement

    reqs = [r for r in map(Requirement, group) if r.name == name
            and (r.marker is None or r.marker.evaluate({"python_version": python}))]
    assert reqs, (name, python)
    return all(r.specifier.contains(version) for r in reqs)


def test_python_312_may_take_the_gpu_images_jax_and_311_stays_below():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps, gpu = project["dependencies"], project["optional-dependencies"]["gpu"]
    for name, version in GPU_IMAGE.items():
        assert _allowed(name, version, "3.12", deps), name
    assert _allowed("jax", GPU_IMAGE["jax"], "3.12", gpu)
    assert not _allowed("jax", GPU_IMAGE["jax"], "3.11", deps)   # 3.11 (CI) stays on the pinned line
    assert not _allowed("jax", GPU_IMAGE["jax"], "3.11", gpu)
    assert _allowed("jax", _pins()["jax"], "3.11", deps) and _allowed("jax", _pins()["jax"], "3.12", deps)
    assert not _allowed("jax", "0.12.0", "3.12", deps)           # nothing past what ran
