"""The demo model's training corpus: prose from Python's standard library, the dependencies and licences.

Owns assembling the text ``train_demo_model.py`` trains on, deterministically (sorted,
deduplicated, held-out split by a hash of each document's name), from what every machine with
tokenmill installed has: docstrings, pydoc's help topics and licence texts.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import io
import re
import sys
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# Packages that are tests, demos or GUI tooling rather than library documentation, and
# modules whose import does something (opens a browser, prints a poem).
SKIPPED_MODULES = frozenset(
    {"test", "idlelib", "turtledemo", "lib2to3", "ensurepip", "pydoc_data", "antigravity", "this"}
)


# Import names of the runtime dependencies in pyproject.toml, whose docstrings are also used.
DEPENDENCY_PACKAGES = (
    "torch",
    "safetensors",
    "tokenizers",
    "jinja2",
    "numpy",
    "tqdm",
    "fastapi",
    "uvicorn",
    "pydantic",
    "prometheus_client",
    "httpx",
    "matplotlib",
    "psutil",
)


HELDOUT_PERCENT = 5


@dataclass(frozen=True)
class Document:
    """One training document: the prose of one source file or licence, paragraph per line."""

    name: str
    text: str

    @property
    def is_heldout(self) -> bool:
        """A stable ~5% split by name, so adding documents never moves existing ones."""
        digest = hashlib.sha256(self.name.encode()).digest()
        return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def prose_paragraphs(text: str) -> list[str]:
    """Reflowed prose paragraphs of a docstring or licence; code, doctests and tables dropped."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", inspect.cleandoc(text)):
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines or lines[0].startswith((" ", "\t")):
            continue  # indented: a code example, option table or literal block
        if any(line.lstrip().startswith((">>>", "...", "$ ", "#")) for line in lines):
            continue
        flat = " ".join(line.strip() for line in lines)
        letters = sum(c.isalpha() or c == " " for c in flat)
        if len(flat.split()) < 3 or letters < 0.85 * len(flat):
            continue
        paragraphs.append(flat)
    return paragraphs


def _source_docstrings(path: Path) -> list[str]:
    """Docstrings of a source file's module and public classes, functions and methods."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return []
    docs = [ast.get_docstring(tree, clean=False) or ""]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if child.name.startswith("_") and child.name != "__init__":
                    continue
                docs.append(ast.get_docstring(child, clean=False) or "")
                if isinstance(child, ast.ClassDef):
                    visit(child)

    visit(tree)
    return docs


def _runtime_docstrings(name: str) -> list[str]:
    """Docstrings of a compiled module (``math``, ``itertools``) and its public members."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            module = importlib.import_module(name)
    except Exception:  # a module missing on this build contributes nothing
        return []
    docs = [module.__doc__ or ""]
    for member_name, member in sorted(vars(module).items()):
        if member_name.startswith("_") or getattr(member, "__module__", None) != name:
            continue
        docs.append(getattr(member, "__doc__", None) or "")
        if inspect.isclass(member):
            for attr_name, attr in sorted(vars(member).items()):
                if not attr_name.startswith("_"):
                    docs.append(getattr(attr, "__doc__", None) or "")
    return [d for d in docs if isinstance(d, str)]


def _is_public_source(relative: Path) -> bool:
    """Not a test, demo or private module (``_internal.py``, ``torch/_dynamo/``)."""
    for part in relative.parts:
        stem = part.removesuffix(".py")
        if stem in SKIPPED_MODULES or stem.startswith(("test", "idle_test")):
            return False
        if stem.startswith("_") and stem != "__init__":
            return False
    return True


def _tree_documents(label: str, root: Path) -> list[tuple[str, list[str]]]:
    base = root.parent
    return [
        (f"{label}/{path.relative_to(base).as_posix()}", _source_docstrings(path))
        for path in sorted(root.rglob("*.py"))
        if _is_public_source(path.relative_to(base))
    ]


def stdlib_documents() -> list[tuple[str, list[str]]]:
    """``(name, docstrings)`` per stdlib source file or compiled module, sorted by name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, list[str]]] = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIPPED_MODULES:
            continue
        if (stdlib / f"{name}.py").is_file():
            found.append((f"stdlib/{name}.py", _source_docstrings(stdlib / f"{name}.py")))
        elif (stdlib / name).is_dir():
            found += _tree_documents("stdlib", stdlib / name)
        else:
            found.append((f"stdlib/{name} (compiled)", _runtime_docstrings(name)))
    return found


def pydoc_topic_documents() -> list[tuple[str, list[str]]]:
    """The language reference sections behind ``help('if')`` and friends."""
    from pydoc_data.topics import topics

    return [(f"pydoc-topics/{key}", [topics[key]]) for key in sorted(topics)]


def dependency_documents() -> list[tuple[str, list[str]]]:
    """Docstrings of tokenmill's runtime dependencies that are installed here."""
    found: list[tuple[str, list[str]]] = []
    for name in DEPENDENCY_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            found += _tree_documents(
                "site-packages", Path(next(iter(spec.submodule_search_locations)))
            )
    return found


def dependency_distributions() -> dict[str, str]:
    """``{distribution: version}`` of the installed runtime dependencies, sorted by name."""
    by_import = importlib.metadata.packages_distributions()
    names = sorted({dist for name in DEPENDENCY_PACKAGES for dist in by_import.get(name, [])})
    return {name: importlib.metadata.version(name) for name in names}


def licence_documents() -> list[tuple[str, list[str]]]:
    """``(name, [text])`` for /usr/share/common-licenses and the dependencies' licence files.

    Only the dependencies', not every installed package's, so the corpus does not change
    when someone installs a tool into the same environment.
    """
    found: list[tuple[str, list[str]]] = []
    common = Path("/usr/share/common-licenses")
    if common.is_dir():
        found += [
            (f"common-licenses/{p.name}", [p.read_text(encoding="utf-8", errors="replace")])
            for p in sorted(common.iterdir())
            if p.is_file()
        ]
    for name in dependency_distributions():
        dist = importlib.metadata.distribution(name)
        for file in sorted(dist.files or [], key=str):
            path = file.as_posix() if hasattr(file, "as_posix") else str(file)
            if ".dist-info/" in path and re.search(
                r"/(licen[cs]es?/|licen[cs]e|copying)", path, re.I
            ):
                text = Path(dist.locate_file(file)).read_text(encoding="utf-8", errors="replace")
                found.append((f"licences/{name.lower()}/{path.split('.dist-info/', 1)[1]}", [text]))
    return found


def build_corpus() -> list[Document]:
    """Every document's prose, paragraphs deduplicated across the whole corpus (first kept)."""
    seen: set[str] = set()
    documents = []
    sources = [stdlib_documents, pydoc_topic_documents, dependency_documents, licence_documents]
    for name, texts in (doc for source in sources for doc in source()):
        kept = []
        for text in texts:
            for paragraph in prose_paragraphs(text):
                key = paragraph.lower()
                if key not in seen:
                    seen.add(key)
                    kept.append(paragraph)
        if kept:
            documents.append(Document(name, "\n".join(kept)))
    return documents


CHAT_QUESTIONS = ("What does {} do?", "Tell me about {}.", "Explain {} briefly.", "What is {} for?")


CHAT_SYSTEM = "You are a helpful assistant."


def chat_documents(documents: list[Document]) -> list[str]:
    """ChatML exchanges that answer "what is X" with the first paragraph of X's document.

    A few percent of the training tokens: enough for the model to learn the template's turn
    structure and to end its answer with ``<|im_end|>``, so chat replies stop on their own.
    """
    chats = []
    for i, doc in enumerate(documents):
        source, _, rest = doc.name.partition("/")
        if source not in ("stdlib", "site-packages") or rest.endswith("(compiled)"):
            continue
        subject = rest.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        answer = doc.text.split("\n", 1)[0]
        if len(answer.split()) < 6:
            continue
        system = f"<|im_start|>system\n{CHAT_SYSTEM}<|im_end|>\n" if i % 2 else ""
        question = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)].format(subject)
        chats.append(
            f"{system}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"
        )
    return chats


def source_chars(documents: list[Document]) -> dict[str, int]:
    """Characters per source: stdlib, pydoc-topics, site-packages/<package>, licences."""
    chars: Counter[str] = Counter()
    for doc in documents:
        parts = doc.name.split("/")
        chars[parts[0] if parts[0] != "site-packages" else f"site-packages/{parts[1]}"] += len(
            doc.text
        )
    return dict(sorted(chars.items()))


def word_counts(documents: list[Document]) -> Counter[str]:
    """Lowercase alphabetic words of the documents, for the English check in the tests."""
    return Counter(
        w for d in documents for w in re.findall(r"[a-z]+", d.text.lower()) if len(w) > 1
    )
