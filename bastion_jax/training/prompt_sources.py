"""Prompt sources that need no data set: Python's standard library, and openers for self-written prompts.

A drafter is only as good as the kinds of text it has seen. The training splits on hand (GSM8K train,
CodeAlpaca) cover word problems and short coding requests; the requests users make also include
completing a function from its signature and docstring (a code benchmark's form), competition maths
written in LaTeX, and open chat. These sources supply such prompts without touching an evaluation
set: function signatures and docstrings from the standard library's own sources, and opening words
from which the target writes the rest of a request itself (Magpie, `data.magpie_prompts`).
"""

from __future__ import annotations

import ast
import inspect
import random
import sysconfig
import textwrap
from pathlib import Path
from typing import Iterator

from bastion_jax.training.data import DataError

STDLIB_MODULES = ("json", "textwrap", "string", "heapq", "bisect", "statistics", "fractions", "difflib",
                  "shlex", "csv", "calendar", "argparse", "pathlib", "functools", "itertools", "collections",
                  "random", "datetime", "fnmatch", "glob", "base64", "html", "ipaddress", "colorsys", "pprint")

_CODE_TASKS = ("Explain what this Python function does, step by step:",
               "Write unit tests for this Python function:",
               "Rewrite this Python function to be easier to read, and explain your changes:",
               "Find possible bugs or edge cases in this Python function:")
_TEXT_TASKS = ("Summarize this documentation in a few sentences:",
               "Write a short tutorial with an example based on this documentation:",
               "Answer: what problem does the module described below solve?")


def stdlib_prompts(limit: int, seed: int = 0, max_chars: int = 1500) -> list[str]:
    """Prompts built from the Python standard library on this machine: function sources and docs."""
    import importlib

    rng = random.Random(seed)
    out: list[str] = []
    for name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if mod.__doc__ and len(mod.__doc__) > 200:
            out.append(f"{rng.choice(_TEXT_TASKS)}\n\n{mod.__doc__[:max_chars].strip()}")
        for _, fn in inspect.getmembers(mod, inspect.isfunction):
            if getattr(fn, "__module__", None) != name or fn.__name__.startswith("_"):
                continue
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            if 120 <= len(src) <= max_chars:
                out.append(f"{rng.choice(_CODE_TASKS)}\n\n```python\n{src.rstrip()}\n```")
    rng.shuffle(out)
    return out[:limit]


# Parts of the standard library that are tests, GUI or tooling rather than library code.
_SKIP_PARTS = frozenset({"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
                         "site-packages", "dist-packages", "__pycache__", "__phello__"})
_COMPLETE_TASKS = ("Complete this Python function:", "Implement the function below.",
                   "Write the body of this function:")


def _library_sources(root: str | Path | None) -> Iterator[tuple[list[str], ast.Module]]:
    """(lines, syntax tree) of each library source file under `root` (default: this interpreter's
    stdlib), tests and tooling skipped, in a fixed order; parsed, never imported (no side effects)."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise DataError(f"no Python sources to build docstring prompts from: {base} is not a directory")
    for path in sorted(base.rglob("*.py")):
        if _SKIP_PARTS & set(path.relative_to(base).parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        yield source.splitlines(), tree


def _documented(node: ast.AST, min_doc: int) -> bool:
    """A public function or method whose docstring has at least `min_doc` characters."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
        return False
    doc = ast.get_docstring(node)  # not None only when body[0] is the docstring's expression
    return bool(doc) and len(doc) >= min_doc


def _pose(code: str, rng: random.Random) -> str:
    """Two in three prompts are the bare code, as a code-completion benchmark poses it; the rest put a
    short instruction first."""
    return code if rng.random() < 2 / 3 else f"{rng.choice(_COMPLETE_TASKS)}\n\n```python\n{code}```"


def docstring_prompts(limit: int, seed: int = 0, max_chars: int = 1200, min_doc: int = 60,
                      root: str | Path | None = None) -> list[str]:
    """Function-completion prompts: a function's signature and docstring, its body left out.

    Read from the standard library's sources under `root` (`_library_sources`), public functions
    (not methods: `method_prompts`) whose docstring has at least `min_doc` characters, posed bare or
    after an instruction (`_pose`). The set depends on the Python version, which is why generated
    data is stored rather than regenerated."""
    rng = random.Random(seed)
    out: list[str] = []
    for lines, tree in _library_sources(root):
        for node in ast.walk(tree):
            if not _documented(node, min_doc):
                continue
            if node.args.args and node.args.args[0].arg in ("self", "cls"):
                continue  # a method: its body leans on a class the prompt does not show
            head = textwrap.dedent("\n".join(lines[node.lineno - 1:node.body[0].end_lineno])).rstrip()
            if len(head) <= max_chars:
                out.append(_pose(head + "\n", rng))
    rng.shuffle(out)
    return out[:limit]


def method_prompts(limit: int, seed: int = 0, max_chars: int = 1200, min_doc: int = 60,
                   root: str | Path | None = None) -> list[str]:
    """Method-completion prompts: a class statement, then one of its methods' decorators, signature
    and docstring, the body left out.

    Why a kind of its own: much of the code users ask about lives in classes, where the body reads
    `self`'s attributes; the class line (name and bases) is the context such a body starts from.
    Public methods (first argument self or cls) of classes in the standard library's sources
    (`_library_sources`), docstrings of at least `min_doc` characters, posed as `docstring_prompts`
    poses functions."""
    rng = random.Random(seed)
    out: list[str] = []
    for lines, tree in _library_sources(root):
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef) or cls.name.startswith("_"):
                continue
            header = lines[cls.lineno - 1:cls.body[0].lineno - 1]  # the class statement, bases included
            if not header:
                continue  # a one-line class
            for node in cls.body:
                if not _documented(node, min_doc) or not node.args.args or node.args.args[0].arg not in ("self", "cls"):
                    continue
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                code = textwrap.dedent("\n".join(header + lines[start - 1:node.body[0].end_lineno])).rstrip()
                if len(code) <= max_chars:
                    out.append(_pose(code + "\n", rng))
    rng.shuffle(out)
    return out[:limit]


# Tasks over a given passage (`passage_prompts`): answers that restate, condense or quote the prompt.
_PASSAGE_TASKS = ("Summarize the following text in a few sentences.", "Write a short summary of this passage.",
                  "What are the main points of the text below? Answer as a bulleted list.",
                  "Explain the following documentation to a beginner, with an example.",
                  "Based only on the text below, write three questions it answers, and answer them.",
                  "Rewrite the following passage in plain, simple English.",
                  "List the technical terms the text below uses, each with a one-line definition.")


def _chunks(text: str, min_chars: int, max_chars: int) -> list[str]:
    """`text` cut at paragraph breaks into pieces of at most `max_chars` (a longer paragraph is
    dropped), pieces shorter than `min_chars` dropped."""
    out: list[str] = []
    piece = ""
    for para in (p.strip() for p in text.split("\n\n")):
        if not para or len(para) > max_chars:
            continue
        if piece and len(piece) + 2 + len(para) > max_chars:
            out.append(piece)
            piece = ""
        piece = f"{piece}\n\n{para}" if piece else para
    out.append(piece)
    return [c for c in out if len(c) >= min_chars]


def passage_prompts(limit: int, seed: int = 0, min_chars: int = 300, max_chars: int = 1000,
                    root: str | Path | None = None) -> list[str]:
    """Tasks over a passage of prose the prompt gives: summarise, list the main points, explain,
    rewrite, question and answer.

    Why a kind of its own: summaries and answers grounded in a given text repeat the prompt's words
    and facts, which a drafter that reads the target's view of the context can learn to copy; the
    other sources pose no such text. Passages are the language reference topics the standard library
    ships (`pydoc_data/topics.py`, read as a literal, never imported) and its modules' docstrings,
    cut at paragraph breaks (`_chunks`); the task comes before or after the passage."""
    rng = random.Random(seed)
    texts: list[str] = []
    for lines, tree in _library_sources(root):
        doc = ast.get_docstring(tree)
        if doc:
            texts.append(doc)
        for node in tree.body:  # pydoc_data/topics.py: topics = {name: text, ...}
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    continue
                if isinstance(value, dict):
                    texts.extend(v for v in value.values() if isinstance(v, str))
    out: list[str] = []
    for text in texts:
        for chunk in _chunks(text, min_chars, max_chars):
            task = rng.choice(_PASSAGE_TASKS)
            out.append(f"{task}\n\n{chunk}" if rng.random() < 0.5 else f"{chunk}\n\n{task}")
    rng.shuffle(out)
    return out[:limit]


# Tasks over text the target wrote before (`own_text_prompts`): a summary, a rewrite or an extraction
# of a given text copies its names, numbers and phrases, as a news summary or a retrieval answer does.
_OWN_TEXT_TASKS = ("Summarize:", "Summarize the following text.", "Summarize this in two sentences:",
                   "TL;DR:", "Rewrite the following text in a more formal tone.",
                   "Rewrite this text for a ten-year-old.", "List the key facts in the text below.",
                   "Extract every name, number and date from this text, with what each refers to.",
                   "Write a headline and a one-paragraph summary for this text.",
                   "Based on the text below, answer: what is the main point, and what supports it?",
                   "Turn the following text into a list of questions and answers.",
                   "Correct any errors in the following text and return the corrected version.")


def own_text_prompts(texts: list[str], limit: int, seed: int = 0, min_chars: int = 400) -> list[str]:
    """Tasks (`_OWN_TEXT_TASKS`) over texts the target wrote itself (earlier data sets' responses).

    Why: the answers users ask for over a given text (news summaries, retrieval answers, edits) repeat
    the text's words, and a drafter learns to copy them only from answers that do; the standard
    library's prose (`passage_prompts`) is one register, while the target's own answers span every
    kind its chat sets cover. A text under `min_chars` is skipped; a task comes before the text (the
    bare "Summarize:" form as a prefix) or after it."""
    rng = random.Random(seed)
    pool = [t.strip() for t in texts if len(t.strip()) >= min_chars]
    rng.shuffle(pool)
    out = []
    for text in pool[:limit]:
        task = rng.choice(_OWN_TEXT_TASKS)
        out.append(f"{task} {text}" if task.endswith(":") and rng.random() < 0.7 else f"{text}\n\n{task}")
    return out


# Opening words for self-written prompts (`data.magpie_prompts(openers=...)`), by kind (OPENER_SETS).
# General chat: from the bare user prefix a small target writes one kind of request over and over
# (SmolLM2: "I'm planning ... how should I ...?" advice); a chat benchmark asks for essays, emails, role
# play, reasoning, maths, code, extraction, science and humanities. Starting each user turn with one of
# these generic words (no benchmark text) spreads the prompts over those kinds, and the target still
# writes the rest of the request.
MAGPIE_OPENERS = (
    "Write a", "Write a short story", "Compose an email", "Draft a", "Write a poem", "Write a persuasive",
    "Imagine you are", "Pretend to be", "Act as", "Role-play as",
    "Explain", "Explain why", "Describe", "Summarize", "Compare", "What is the difference between",
    "Why does", "How does", "What are the main", "Give me", "List", "Suggest",
    "Solve", "Calculate", "If a", "A train", "Prove that", "What is the probability",
    "Write a Python function", "Write a program", "Implement", "How do I", "Fix this code",
    "Extract", "Rewrite the following", "Translate", "Edit the following paragraph", "Classify",
    "In physics,", "In biology,", "In chemistry,", "In economics,", "In history,", "Discuss",
    "Evaluate", "Analyze", "Create a plan", "Help me",
)

# Competition-style maths in LaTeX. The only maths in the training splits is GSM8K's plain-text word
# problems, while the target answers LaTeX problems in LaTeX ($\frac{..}{..}$, \boxed{..}); these
# generic openings (no benchmark text) let the target write such problems, and then solve them.
MATH_OPENERS = (
    "Find the value of $", "Let $f(x) =", "Compute $", "Simplify $", "Solve for $x$:", "Evaluate $",
    "If $", "Suppose $", "Let $a$ and $b$ be", "Find all real numbers $x$ such that", "Express $",
    "How many positive integers", "What is the smallest positive integer", "What is the sum of all",
    "What is the remainder when", "What is the greatest common divisor of", "How many ways",
    "A bag contains", "The probability that", "In triangle $ABC$,", "A circle", "Find the area of",
    "A rectangle", "The sequence", "An arithmetic sequence", "A geometric sequence", "Find the coordinates of",
    "The graph of $y =", "Factor $", "Expand $", "Rationalize the denominator of $", "Convert $",
    "Find the number of", "Determine", "What is the value of $", "Find the maximum value of",
    "Find the minimum value of", "Let $n$ be", "The polynomial", "Find the domain of", "Solve the inequality",
)

# Programming tasks. The code in the training splits is code_alpaca_2k's 2,000 short requests (reused
# by every sampled set) and the standard library's own completions; code requests the target writes
# from these generic openings (no benchmark text) add self-contained function, class and script tasks,
# and the target's greedy answers to them are the code it writes at decoding time.
CODE_OPENERS = (
    "Write a Python function that", "Write a function to", "Write a Python function to", "Write a program that",
    "Write a Python script that", "Implement a function", "Implement a Python class", "Create a class",
    "Write a recursive function", "Given a list of integers,", "Given a string,", "Given two lists,",
    "Given a dictionary", "Given a sorted array", "Given a binary tree,", "Given a matrix", "Write a generator",
    "Write a decorator", "Write a function that takes", "Write a function that returns", "Write a one-line",
    "Write unit tests for", "Refactor this Python code", "What does this Python code do?", "Fix the bug in",
    "Optimize this function", "Write a SQL query", "Write a JavaScript function", "Write a bash script",
    "Implement a stack", "Implement a queue", "Implement a linked list", "Implement the algorithm",
    "Parse a", "Read a CSV file", "Count the number of", "Check whether", "Find the longest", "Sort a list of",
    "Convert a", "Remove duplicates from", "Merge two", "Write a regular expression",
)

OPENER_SETS = {"chat": MAGPIE_OPENERS, "math": MATH_OPENERS, "code": CODE_OPENERS}
