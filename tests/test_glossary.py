"""docs/glossary.md against the pages and the code: every abbreviation a page uses has an
entry (or is a name, not a term: GENERAL below), a page that spells one out spells it as
its entry does, every entry names code that defines it, and no term has two entries."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "docs" / "glossary.md"
# (docs/sources.md is left out: its citations are names of venues and papers, not terms)
PAGES = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "sources.md"]
PAGES += [ROOT / "README.md"]
ENTRY = re.compile(r"^### (.+?)(?: \(([A-Za-z0-9]+)\))?\n\n(.*?)(?=^#|\Z)", re.M | re.S)
CODE = re.compile(r"^Code: `([^`]+)` `([^`]+)`$", re.M)

# Names of things, not terms of the trade: hardware, instruction sets, formats, protocols,
# companies and programs, whose pages say what they are where they matter.
GENERAL = set(
    """
    A3B AMD AMX API ASCII AVX AVX2 BF16 BPE CC CI CLI CPU CUDA DELETE DIR EOS EPYC FILE FMA
    GB GCC GELU GET GNU GPT GPU H100 HF HISTORY HOST HTTP JSON KB KEY KIND L1 L2 LLM LM LRU MB
    MLP MODEL NAME NCCL NNNNN NTK NULL O3 OS PEER PEERS PNG PORT PV PYTHON Q4 QKV R1 RAM
    RECORDS REPL RMS SDK SDPA SIGILL SIGINT SIGKILL SIGTERM SXM TB TCP TFLOP UTC URL V2 V3 VEX
    VM VNNI XML YAML ARGS FAILED GFLOP AWQ H200 UTF IQ IQ1 IQ2 IQ3 IQ4 MXFP4 TQ1 TQ2 F16 F32
    GLM LFM2 K2 V4 K3 M2 M3 OSS R7B CDATA ATEM
    """.split()
)
WORD = re.compile(r"\b[A-Z][A-Z0-9]{1,6}\b")


def entries() -> list[tuple[str, str | None, str]]:
    return ENTRY.findall(GLOSSARY.read_text())


def prose(text: str) -> str:
    """A page without its code blocks, inline code and link targets."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`]*`", "", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def defined() -> dict[str, str | None]:
    """Abbreviation -> what its entry spells it out as: "Time to first token (TTFT)", or
    None where the entry's name holds it as it is ("KV cache", "GGUF")."""
    found: dict[str, str | None] = {abbr: name for name, abbr, _ in entries() if abbr}
    for name, _, _ in entries():
        found.update({w: None for w in WORD.findall(name) if w not in found})
    return found


def test_every_term_has_one_entry_and_names_code_that_defines_it():
    names = [name.lower() for name, _, _ in entries()]
    assert len(names) >= 40 and len(names) == len(set(names))
    for name, _, body in entries():
        found = CODE.findall(body)
        assert found, f"{name}: no Code: line"
        for path, symbol in found:
            source = ROOT / "src" / "tokenworks" / path
            assert source.is_file(), f"{name}: no module {path}"
            s = re.escape(symbol)
            assert re.search(
                rf"\b(def|class) {s}\b|\b{s}\s*(:|=[^=])|[\"']{s}[\"']", source.read_text()
            ), f"{name}: {path} defines no {symbol}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_abbreviation_a_page_uses_has_an_entry(page):
    terms = defined()
    used = set(WORD.findall(prose(page.read_text())))
    numerals = re.compile(r"[IVX]+")  # the book's parts
    missing = sorted(
        w for w in used if w not in terms and w not in GENERAL and not numerals.fullmatch(w)
    )
    assert not missing, f"{page.name} uses {missing}: give each an entry in docs/glossary.md"


def spelled_otherwise(text: str) -> list[str]:
    """Each "words (ABBR)" in text whose words do not end with the entry's name, or with
    its last two words or more ("latent attention (MLA)")."""
    wrong = []
    for abbr, name in defined().items():
        if name is None:
            continue
        full = name.lower().split()
        tails = [full[i:] for i in range(len(full) - 1)] or [full]
        for before in re.findall(rf"((?:[\w-]+ ){{1,5}})\({abbr}\)", prose(text)):
            words = before.lower().split()
            if not any(words[-len(t) :] == t for t in tails):
                wrong.append(f"'{before.strip()} ({abbr})', but {abbr} is {name}")
    return wrong


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_a_page_spells_an_abbreviation_out_as_its_entry_does(page):
    wrong = spelled_otherwise(page.read_text())
    assert not wrong, f"{page.name}: {wrong}"


def test_the_checker_catches_a_term_in_another_sense():
    assert spelled_otherwise("The median time to first byte (TTFT) fell.")
    assert not spelled_otherwise("The median time to first token (TTFT) fell.")
    assert not spelled_otherwise("DeepSeek's latent attention (MLA) caches less.")
    assert WORD.findall(prose("a `KVX` in code, a ZZQ in prose")) == ["ZZQ"]
