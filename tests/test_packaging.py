"""The wheel ships the C source, and a non-editable install builds and loads the kernels.

CI installs editable, where the source tree is on the path; a wheel holds only what
pyproject's package data names, so these build one and look inside it, then install it
into a fresh virtual environment (its dependencies from this one) and load the kernels
from there, built from the shipped source into an empty cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "src" / "tokenworks" / "kernels" / "csrc"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    tree = out / "tree"  # a clean copy: no build/ of an earlier build leaks into the wheel
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", tree / "src", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(out)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (found,) = out.glob("tokenworks-*.whl")
    return found


def test_the_wheel_holds_every_c_source_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {f"tokenworks/kernels/csrc/{p.name}" for p in CSRC.glob("*.[ch]")}
    assert want and want <= names, f"missing from the wheel: {sorted(want - names)}"
    assert "tokenworks/kernels/build.py" in names and "tokenworks/shapes.py" in names


def test_a_non_editable_install_builds_and_loads_the_kernels(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # torch and the rest from this environment, after the fresh one's own packages
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = (
        "import tokenworks, sys; from tokenworks.kernels import build; "
        f"assert tokenworks.__file__.startswith({str(venv)!r}), tokenworks.__file__; "
        "assert build.library() is not None, build.unavailable(); print(build.SOURCE)"
    )
    env = {**os.environ, "TOKENWORKS_HOME": str(tmp_path / "home")}
    env.pop("PYTHONPATH", None)
    run = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().startswith(str(venv))
    assert list((tmp_path / "home" / "kernels").glob("kernels-*.so"))  # built from the wheel
