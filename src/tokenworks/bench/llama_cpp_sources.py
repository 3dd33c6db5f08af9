"""llama.cpp's own test material, the oracle for the world's files: tokenizer vocabularies
with their test vectors, real chat templates, test-chat.cpp's parsed outputs, grammars and
the GGUF converter.

It is read from the llama-cpp-python sdist that benchmarks/peers.sh builds the peer from
(the same llama.cpp version), fetched with pip once into $TOKENWORKS_HOME and kept there;
nothing of it is part of tokenworks.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tokenworks import paths

VERSION = "0.3.36"  # llama-cpp-python, as benchmarks/peers.sh pins it
# the parts of vendor/llama.cpp kept: vocabularies and templates, the chat and tokenizer
# tests, grammars, and the converter with the gguf-py it imports
_KEPT = ("models", "tests", "grammars", "conversion", "gguf-py", "convert_hf_to_gguf.py")


class SourcesUnavailable(RuntimeError):
    pass


def llama_cpp_sources(home: Path | None = None) -> Path:
    """vendor/llama.cpp of the pinned sdist, fetched and unpacked on first use."""
    root = (home or paths.home()) / "llama-cpp-sources" / VERSION
    done = root / "llama.cpp"
    if done.is_dir():
        return done
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
             "llama-cpp-python", f"llama-cpp-python=={VERSION}", "-d", scratch],
            capture_output=True, text=True,
        )  # fmt: skip
        sdists = list(Path(scratch).glob("llama_cpp_python-*.tar.gz"))
        if fetched.returncode != 0 or not sdists:
            raise SourcesUnavailable(
                f"pip could not fetch the llama-cpp-python {VERSION} sdist (llama.cpp's test "
                f"material): {fetched.stderr.strip()[-500:]}"
            )
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        unpacked = Path(scratch) / "unpacked"
        with tarfile.open(sdists[0]) as tar:
            members = [
                m for m in tar.getmembers()
                if m.name.startswith(prefix) and m.name[len(prefix):].split("/")[0] in _KEPT
            ]  # fmt: skip
            tar.extractall(unpacked, members=members, filter="data")
        shutil.move(str(unpacked / prefix), str(done))  # whole, or not there at all
    return done


def vocabulary(path: Path):
    """The tokenizer of one of models/ggml-vocab-*.gguf (a vocabulary with no weights),
    built from its metadata as a model file's is."""
    from tokenworks.models.gguf_metadata import read_metadata
    from tokenworks.tokenizer import TokenizerWrapper
    from tokenworks.tokenizer.tokenizer import tokenizer_from_gguf_fields

    metadata = read_metadata(path)
    return TokenizerWrapper(
        tokenizer_from_gguf_fields(metadata, metadata.get("general.architecture"))
    )


def vocab_vectors(path: Path) -> list[tuple[str, list[int]]]:
    """A vocabulary's test vectors as test-tokenizer-0 reads them: the .inp texts between
    separators and the .out line of ids for each."""
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    if texts[-1] == "":  # the file ends with a separator
        texts.pop()
    lines = Path(f"{path}.out").read_text(encoding="utf-8").splitlines()
    if len(texts) != len(lines):
        raise ValueError(f"{path}: {len(texts)} texts but {len(lines)} lines of ids")
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines, strict=True)]
