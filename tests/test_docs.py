"""The docs (and the README) stay true to the code: the map names every module, every
file a doc names exists, every `module.py` `Name` pair names something that module defines, and the
architecture stays a ten-minute read (issue 14: "an architecture a newcomer reads in ten minutes")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "bastion_jax"
# Where a doc's bare file names are looked up, in order (a module is named relative to the package).
SEARCH = (ROOT, PACKAGE, DOCS, ROOT / "benchmarks", ROOT / "benchmarks" / "results", PACKAGE / "modeling",
          PACKAGE / "training", PACKAGE / "checkpoints", PACKAGE / "assets" / "smollm2-135m-instruct-dflash",
          ROOT / "training_data" / "smollm2-135m-instruct")
# ~250 words a minute: what "reads in ten minutes" allows.
ARCHITECTURE_WORDS = 2600


def _text(name: str) -> str:
    return (ROOT / name if name == "README.md" else DOCS / name).read_text()


def _modules() -> list[Path]:
    """Every module of the package, as a path relative to it (sub-packages' `__init__.py` left out:
    a package is named by its directory)."""
    return sorted(p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")
                  if p.name != "__init__.py" or p.parent == PACKAGE)


def _groups(text: str) -> dict[str, str]:
    """The map's text per package directory it names: a bold group heading naming
    `bastion_jax/<dir>/` owns the text up to the next heading; a table row whose first cell is
    `<dir>/` owns that row."""
    groups: dict[str, str] = {}
    for part in re.split(r"\n(?=\*\*)", text):
        m = re.match(r"\*\*[^*]+\*\*[^\n]*`bastion_jax/(\w+)/`", part)
        if m:
            groups[m.group(1)] = groups.get(m.group(1), "") + part
    for row in re.finditer(r"^\| `(\w+)/` \|[^\n]*", text, re.M):
        groups[row.group(1)] = groups.get(row.group(1), "") + row.group(0)
    return groups


def _resolve(name: str) -> Path | None:
    for base in SEARCH:
        if (base / name).exists():
            return base / name
    return None


def test_map_names_every_module():
    text = _text("architecture.md")
    groups = _groups(text)
    missing = []
    for rel in _modules():
        top = rel.parts[0] if len(rel.parts) > 1 else None
        named = f"`{rel.as_posix()}`" in text or (top is not None and rel.name in groups.get(top, ""))
        if not named:
            missing.append(rel.as_posix())
    assert not missing, f"docs/architecture.md's map does not name: {missing}"


@pytest.mark.parametrize("doc", ["architecture.md", "internals.md", "findings.md", "policies.md", "README.md"])
def test_named_files_exist(doc):
    """Every `path` in backticks that names a file (an extension, or a directory ending in /) exists."""
    missing = []
    for token in re.findall(r"`([^`\s]+)`", _text(doc)):
        token = token.split(":")[0].rstrip(",.")
        if token.startswith(("../", "~", "$", "/", "-")) or any(c in token for c in "{}*<>()=|"):
            continue  # outside the repo, a pattern, a flag or an expression
        if not re.fullmatch(r"[\w./-]+\.(py|md|sh|json|npz|npy|csv|png|safetensors)|[\w./-]+/", token):
            continue
        if "runs/" in token or token.startswith(("params/", "best/", "run/", "DIR/", "OUT/")):
            continue  # a run's or a checkpoint's own folders, not the repo's
        if _resolve(token) is None:
            missing.append(token)
    assert not missing, f"{doc} names files that do not exist: {sorted(set(missing))}"


def _defines(source: str, name: str) -> bool:
    return re.search(rf"^\s*(def|class)\s+{name}\b|^\s*{name}\s*[:=]|^\s*self\.{name}\s*[:=]", source,
                     re.M) is not None


@pytest.mark.parametrize("doc", ["architecture.md", "internals.md"])
def test_named_definitions_exist(doc):
    """A module followed by a name (`engine.py` `Engine.stream`) names what that module defines."""
    wrong = []
    for module, name in re.findall(r"`([\w/]+\.py)`\s+`([A-Za-z_][\w.]*)`", _text(doc)):
        path = _resolve(module)
        assert path is not None, f"docs/{doc}: no module {module}"
        source = path.read_text()
        if not all(_defines(source, part) for part in name.split(".")):
            wrong.append(f"{module} {name}")
    assert not wrong, f"docs/{doc} names what its module does not define: {wrong}"


def test_architecture_is_a_ten_minute_read():
    words = len(_text("architecture.md").split())
    assert words <= ARCHITECTURE_WORDS, (f"docs/architecture.md has {words} words (> {ARCHITECTURE_WORDS}, about ten "
                                         "minutes): move details to docs/internals.md")
