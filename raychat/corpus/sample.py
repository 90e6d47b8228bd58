"""The offline sample corpus: human-written text already on this machine (package descriptions,
Python's help topics, docstrings of the standard library and installed packages).

It is what `raychat.train` writes when there is no corpus and no network, so one command works on a
fresh box. It is a few MB of English prose about software: enough to check that training runs and
the loss falls, not to train a useful model (corpus.json says `sample`, and the plan says so too).
The same installed packages give byte-identical shards.
"""

import importlib.metadata
import inspect
import os
import random
import re
import sysconfig
from collections.abc import Callable
from pathlib import Path

from raychat.common import RaychatError
from raychat.corpus.check import CorpusSummary, validate_corpus
from raychat.corpus.index import ROW_GROUP_SIZE
from raychat.corpus.writer import CorpusWriter, split_val_count

SAMPLE_MAX_MB = 20.0
SAMPLE_DOCS_PER_SHARD = ROW_GROUP_SIZE
SAMPLE_SHUFFLE_SEED = 0
MIN_DOCSTRING_CHARS = 40
MIN_SAMPLE_DOC_CHARS = 200
# Docstrings: a triple-quoted string opening the file (after comments) or the line after one ending
# in ':' (a def/class header). Anchoring on the ':' keeps closing quotes of other strings from
# being mistaken for openings, without the cost of parsing every file.
DOCSTRING = re.compile(rb'''(?:\A(?:[ \t]*(?:#[^\n]*)?\n)*|:[ \t]*(?:#[^\n]*)?\n(?:[ \t]*\n)*)'''
                       rb'''[ \t]*[rRuU]?("""|\'\'\')(.*?)\1''', re.S)


def _package_descriptions() -> list[str]:
    """Long descriptions (READMEs) of the installed distributions, one per distribution name."""
    by_name: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower().replace("_", "-")
        text = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if name and len(text) >= MIN_SAMPLE_DOC_CHARS:
            by_name[name] = max(by_name.get(name, ""), text)  # two installs of one name: deterministic pick
    return [by_name[name] for name in sorted(by_name)]


def _help_topics() -> list[str]:
    """Python's interactive help topics: sections of the language reference."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [topics[key] for key in sorted(topics) if len(topics[key]) >= MIN_SAMPLE_DOC_CHARS]


def _python_source_files() -> list[Path]:
    """Every .py file of the standard library and the installed packages, in a fixed order."""
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"], paths["purelib"], paths["platlib"]]
    files: list[Path] = []
    seen_roots: set[str] = set()
    for root in roots:
        real = os.path.realpath(root)
        if real in seen_roots or not os.path.isdir(real):
            continue
        seen_roots.add(real)
        for dirpath, dirnames, filenames in os.walk(real):
            # site-packages sits inside the stdlib directory; it is walked as its own root.
            dirnames[:] = sorted(d for d in dirnames
                                 if d not in ("site-packages", "dist-packages", "__pycache__"))
            files += [Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return files


def _file_docstrings(path: Path) -> str:
    try:
        source = path.read_bytes()
    except OSError:
        return ""
    parts = []
    for match in DOCSTRING.finditer(source):
        raw = match.group(2)
        try:
            text = inspect.cleandoc(raw.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        if len(text) >= MIN_DOCSTRING_CHARS:
            parts.append(text)
    return "\n\n".join(parts)


def sample_documents(max_mb: float = SAMPLE_MAX_MB) -> list[str]:
    """Human-written text already on this machine, shuffled, about max_mb MB of UTF-8 (whole documents):
    package descriptions and help topics first (the most prose-like), then docstrings, one document per
    source file, from a fixed shuffle of the source files until the budget is met. Same installed
    packages -> same list."""
    budget = int(max_mb * 1e6)
    documents: list[str] = []
    seen: set[str] = set()
    size = 0

    def add(text: str) -> None:
        nonlocal size
        if len(text) < MIN_SAMPLE_DOC_CHARS or text in seen:
            return
        try:
            encoded_size = len(text.encode())
        except UnicodeEncodeError:  # lone surrogates from undecodable package metadata
            return
        seen.add(text)
        documents.append(text)
        size += encoded_size

    prose = _package_descriptions() + _help_topics()
    random.Random(SAMPLE_SHUFFLE_SEED).shuffle(prose)
    for text in prose:
        if size >= budget:
            break
        add(text)
    sources = _python_source_files()
    random.Random(SAMPLE_SHUFFLE_SEED).shuffle(sources)
    for path in sources:
        if size >= budget:
            break
        add(_file_docstrings(path))
    random.Random(SAMPLE_SHUFFLE_SEED).shuffle(documents)  # so val and every shard mix all sources
    return documents


def write_sample_corpus(out_dir: str | Path, max_mb: float = SAMPLE_MAX_MB,
                        docs_per_shard: int = SAMPLE_DOCS_PER_SHARD, val_docs: int | None = None,
                        overwrite: bool = False, log: Callable[[str], None] = print) -> CorpusSummary:
    """The offline default corpus (see sample_documents), written to out_dir."""
    documents = sample_documents(max_mb)
    if not documents:
        raise RaychatError("found no package descriptions or docstrings on this machine for the sample "
                           "corpus: use `python -m raychat.corpus ingest` or `synthetic` instead")
    num_val = split_val_count(len(documents), val_docs)
    with CorpusWriter(out_dir, docs_per_shard, overwrite, source="sample") as writer:
        writer.add_train(documents[:-num_val])
        writer.add_val(documents[-num_val:])
    size_mb = sum(len(d.encode()) for d in documents) / 1e6
    log(f"sample: {len(documents):,} documents, {size_mb:.1f} MB of text")
    return validate_corpus(out_dir)
