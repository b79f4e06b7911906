"""What the wheel ships: the product packages (engine_bridge, media, livekit_omni), and none of the test helpers
(testkit/), tests or benchmarks (docs/architecture.md, Import rules; pyproject.toml, [tool.setuptools.packages.find]).

The wheel is built once per module from a copy of the working tree (the files git tracks plus untracked ones it does
not ignore) in a temporary folder, with this environment's setuptools and no network (``pip wheel --no-deps
--no-build-isolation --no-index``), so the build leaves no build/ or *.egg-info in the checkout. The C cores
compile during the build; the whole module takes about 4 s on the two-core dev VM.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The packages users install and import.
PRODUCT = ("engine_bridge", "media", "livekit_omni")
#: Folders of the repository that are for development only; no file of theirs may ship.
DEVELOPMENT_ONLY = ("testkit", "tests", "benchmarks", "agents")


def _working_tree_files() -> list[str]:
    """Repository-relative paths of the working tree as git sees it: tracked (and not deleted) plus untracked
    files that are not ignored."""
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
        timeout=60,
    )
    names = sorted({n.decode() for n in out.stdout.split(b"\0") if n})
    return [n for n in names if (ROOT / n).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    base = tmp_path_factory.mktemp("wheel")
    src, dist = base / "src", base / "dist"
    for name in _working_tree_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    build = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"),
            *("--disable-pip-version-check", "-q", "-w", str(dist), str(src)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    wheels = sorted(dist.glob("livekit_omni-*.whl"))
    assert len(wheels) == 1, f"expected one wheel, got {wheels}"
    with zipfile.ZipFile(wheels[0]) as zf:
        yield zf


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_wheel_ships_no_test_helpers_tests_or_benchmarks(wheel: zipfile.ZipFile) -> None:
    """No entry under a development-only folder, and no file whose bytes are those of a development-only file
    under another name (a helper copied back into the product, as livekit_omni/testing once was)."""
    names = wheel.namelist()
    by_path = sorted(n for n in names if n.split("/")[0] in DEVELOPMENT_ONLY)
    assert not by_path, f"the wheel ships development-only files: {by_path}"

    development = {
        _digest(data): name
        for name in _working_tree_files()
        if name.split("/")[0] in DEVELOPMENT_ONLY and (data := (ROOT / name).read_bytes()).strip()
    }
    assert any(n.startswith("testkit/") for n in development.values()), "testkit/ was not found in the tree"
    copied = sorted(
        f"{n} (= {development[d]})" for n in names if (d := _digest(wheel.read(n))) in development
    )
    assert not copied, f"the wheel ships copies of development-only files: {copied}"


def test_wheel_ships_every_module_of_the_product(wheel: zipfile.ZipFile) -> None:
    """Every .py and .pyi file of the product packages in the working tree is in the wheel, at the same path, and
    nothing but those packages and the wheel's metadata is."""
    names = set(wheel.namelist())
    modules = [n for n in _working_tree_files() if n.split("/")[0] in PRODUCT and n.endswith((".py", ".pyi"))]
    for package in PRODUCT:
        assert f"{package}/__init__.py" in modules, f"{package} was not found in the tree"
    missing = sorted(set(modules) - names)
    assert not missing, f"product modules missing from the wheel: {missing}"
    tops = {n.split("/")[0] for n in names}
    metadata = {t for t in tops if t.endswith(".dist-info")}
    assert len(metadata) == 1 and tops - metadata == set(PRODUCT), (
        f"unexpected top-level entries: {sorted(tops)}"
    )
