"""Prompt sources without a data set: function-completion prompts from Python sources, opener sets."""

import pytest

from bastion_jax.training.prompt_sources import _OWN_TEXT_TASKS
from bastion_jax.training.prompt_sources import _PASSAGE_TASKS as _TASKS
from bastion_jax.training.prompt_sources import (CODE_OPENERS, MAGPIE_OPENERS, MATH_OPENERS, OPENER_SETS, _chunks,
                                                 docstring_prompts, method_prompts, own_text_prompts,
                                                 passage_prompts)

LIB = '''"""A module."""

def clamp(value, low, high):
    """Return value limited to the closed range [low, high].

    >>> clamp(5, 0, 3)
    3
    """
    if value < low:
        return low
    return min(value, high)


def short(x):
    """Too short."""
    return x


def _private(x):
    """A private helper whose docstring is long enough to count otherwise, but it is private."""
    return x


class Box:
    def area(self, scale=1):
        """The area of the box times scale, a method the prompt could not show the class of."""
        return self.w * self.h * scale


def outer(items,
          key=None):
    """Sort items by key and return the first one, or None when there are no items at all."""
    def helper(y):
        return y
    return sorted(items, key=key)[0] if items else None
'''


def write_lib(root):
    (root / "pkg").mkdir()
    (root / "pkg" / "mod.py").write_text(LIB)
    (root / "test").mkdir()  # the stdlib's tests are not library code
    (root / "test" / "test_mod.py").write_text(LIB.replace("clamp", "clamp_in_test"))
    (root / "broken.py").write_text("def f(:\n")  # unparsable files are skipped


def test_docstring_prompts_keep_signature_and_docstring_and_drop_the_body(tmp_path):
    write_lib(tmp_path)
    got = docstring_prompts(100, seed=0, root=tmp_path)
    assert len(got) == 2  # clamp and outer: not short, _private, the method or the test copy
    codes = []
    for prompt in got:
        code = prompt.split("```python\n")[1].split("```")[0] if "```" in prompt else prompt
        codes.append(code)
    by_name = {c.split("(")[0]: c for c in codes}
    assert set(by_name) == {"def clamp", "def outer"}
    clamp = by_name["def clamp"]
    assert clamp.startswith("def clamp(value, low, high):\n    \"\"\"Return value limited")
    assert clamp.rstrip().endswith('"""') and ">>> clamp(5, 0, 3)" in clamp
    assert "return" not in clamp and "if value" not in clamp  # the body is left out
    assert by_name["def outer"].startswith("def outer(items,\n          key=None):")  # multi-line signature whole
    assert "helper" not in by_name["def outer"]
    assert docstring_prompts(100, seed=0, root=tmp_path) == got  # deterministic
    assert docstring_prompts(1, seed=0, root=tmp_path) == got[:1]


def test_docstring_prompts_mix_bare_code_and_instructions(tmp_path):
    body = "".join(f'def f{i}(x):\n    """Return x plus {i}, a docstring long enough to be kept as a prompt."""\n'
                   f"    return x + {i}\n\n\n" for i in range(60))
    (tmp_path / "many.py").write_text(body)
    got = docstring_prompts(100, seed=1, root=tmp_path)
    assert len(got) == 60
    bare = [p for p in got if p.startswith("def ")]
    assert 20 <= len(bare) <= 55  # about two in three are the bare code, the rest carry an instruction
    assert all("```python\ndef " in p for p in got if not p.startswith("def "))


def test_opener_sets_and_the_cli_choice():
    from bastion_jax.train_drafter import build_parser

    assert OPENER_SETS == {"chat": MAGPIE_OPENERS, "math": MATH_OPENERS, "code": CODE_OPENERS}
    assert any("$" in o for o in MATH_OPENERS)  # LaTeX-style problems
    parse = lambda *a: build_parser().parse_args(["data", "--out", "o.jsonl", *a])  # noqa: E731
    assert parse("--magpie-openers").magpie_openers == "chat"  # bare flag: the chat openers, as before
    assert parse("--magpie-openers", "math").magpie_openers == "math"
    assert parse("--magpie-openers", "code").magpie_openers == "code"
    assert parse().magpie_openers is None
    assert parse("--docstrings", "7").docstrings == 7
    assert parse("--methods", "5").methods == 5 and parse().methods == 0
    assert parse("--passages", "4").passages == 4 and parse().passages == 0
    assert parse("--passage-chars", "2500").passage_chars == 2500 and parse().passage_chars == 1000
    assert parse("--text-tasks", "3", "--text-from", "a.npz", "b.npz").text_from == ["a.npz", "b.npz"]
    assert parse().text_tasks == 0 and parse().text_from == []
    with pytest.raises(SystemExit):
        parse("--magpie-openers", "poetry")
    for flag in ("--stdlib", "--magpie", "--docstrings", "--methods", "--passages", "--text-tasks"):
        assert getattr(parse(flag, "0"), flag[2:].replace("-", "_")) == 0  # none of that source
        with pytest.raises(SystemExit):
            parse(flag, "-3")  # refused: a slice bound of -3 would keep all but the last 3


def test_docstring_prompts_refuse_a_missing_source_tree(tmp_path):
    from bastion_jax.training.data import DataError

    with pytest.raises(DataError, match="not a directory"):
        docstring_prompts(5, root=tmp_path / "no-such-stdlib")  # never a silent empty source


METHODS = '''
class Outer:
    class Stack(list,
                metaclass=type):
        """A stack."""

        def push(self, item):
            """Put item on top of the stack and return the new number of items on it."""
            self.append(item)
            return len(self)

        @classmethod
        def of(cls, items):
            """A stack holding items, the last of them on top, built in one call."""
            return cls(items)

        def _hidden(self):
            """A private method whose docstring is long enough to count otherwise."""
            return 0

        @staticmethod
        def helper(x):
            """A static method has no self for a body to lean on, so it is no method prompt."""
            return x

        def peek(self):
            """Short."""
            return self[-1]


class _Private:
    def run(self):
        """A public method of a private class, with a docstring long enough to count."""
        return 1


class One: x = 1
'''


def test_method_prompts_keep_the_class_line_signature_and_docstring(tmp_path):
    (tmp_path / "stack.py").write_text(METHODS)
    got = method_prompts(100, seed=0, root=tmp_path)
    codes = sorted(p.split("```python\n")[1].split("```")[0] if "```" in p else p for p in got)
    assert len(codes) == 2  # push and of: not private, static, short, a private class's or a one-liner's
    of, push = codes
    assert push == ("class Stack(list,\n            metaclass=type):\n"
                    "    def push(self, item):\n"
                    '        """Put item on top of the stack and return the new number of items on it."""\n')
    assert of.startswith("class Stack(list,\n") and "    @classmethod\n    def of(cls, items):" in of
    assert "return" not in of and '"""A stack."""' not in of  # bodies and the class docstring left out
    functions = docstring_prompts(100, seed=0, root=tmp_path)  # a static method stands alone: a function
    assert len(functions) == 1 and "def helper(x):" in functions[0] and "class" not in functions[0]
    assert method_prompts(100, seed=0, root=tmp_path) == got  # deterministic


def test_chunks_cut_at_paragraph_breaks_within_the_bounds():
    paras = [f"p{i} " + "x" * (40 + 10 * i) for i in range(8)]
    got = _chunks("\n\n".join(paras) + "\n\n" + "y" * 500, 100, 200)
    assert got and all(100 <= len(c) <= 200 for c in got)
    assert "y" * 500 not in "".join(got)  # a paragraph longer than a chunk is dropped, never cut
    flat = [q for c in got for q in c.split("\n\n")]
    assert all(q in paras for q in flat) and flat == sorted(flat, key=paras.index)  # whole, in order


def test_passage_prompts_pose_tasks_over_topics_and_module_docs(tmp_path):
    topic = "\n\n".join(f"Paragraph {i} of the for statement topic. " + "word " * 30 for i in range(6))
    (tmp_path / "pydoc_data").mkdir()
    (tmp_path / "pydoc_data" / "topics.py").write_text(f"topics = {{'for': {topic!r}, 'tiny': 'too short'}}\n")
    (tmp_path / "mod.py").write_text('"""' + "A module docstring long enough to be a passage. " * 8 + '"""\n')
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.py").write_text('"""' + "A test module's docstring. " * 20 + '"""\n')
    got = passage_prompts(100, seed=0, min_chars=150, max_chars=400, root=tmp_path)
    passages = [p.replace(t, "").strip() for p in got for t in _TASKS if t in p]
    assert len(passages) == len(got)  # every prompt carries one task, before or after its passage
    assert sum("for statement topic" in q for q in passages) >= 3  # the topic, cut into several chunks
    assert any(q.startswith("A module docstring") for q in passages)
    assert not any("test module" in q or "too short" in q for q in passages)
    assert all(len(q) <= 400 for q in passages)
    assert {p.startswith(tuple(_TASKS)) for p in got} == {True, False}  # task first and task last
    assert passage_prompts(100, seed=0, min_chars=150, max_chars=400, root=tmp_path) == got


def test_own_text_prompts_pose_one_task_over_each_long_enough_text():
    texts = [f"Answer {i}: " + "the target's own words " * (4 + 3 * i) for i in range(12)]
    got = own_text_prompts(texts, 100, seed=3, min_chars=120)
    kept = [t.strip() for t in texts if len(t.strip()) >= 120]
    assert 0 < len(kept) < len(texts) and len(got) == len(kept)  # short texts skipped, each long one once
    for p in got:
        tasks = [t for t in _OWN_TEXT_TASKS if p.startswith(t + " ") or p.endswith("\n\n" + t)]
        assert len(tasks) == 1, p  # one task, before the text (only the "...:" forms) or after it
        body = p[len(tasks[0]) + 1:] if p.startswith(tasks[0] + " ") else p[:-len(tasks[0]) - 2]
        assert body in kept  # the text whole
    assert sorted(p for p in got if any(p.startswith(t + " ") for t in _OWN_TEXT_TASKS))  # prefix forms used
    assert own_text_prompts(texts, 100, seed=3, min_chars=120) == got  # deterministic in the seed
    assert len(own_text_prompts(texts, 2, seed=3, min_chars=120)) == 2


def test_text_tasks_and_their_source_files_go_together(tmp_path, capsys):
    from bastion_jax.train_drafter import main

    for half in (["--text-tasks", "5"], ["--text-from", "a.npz"]):  # either alone would be ignored
        rc = main(["data", "--out", str(tmp_path / "o.jsonl"), "--sources", "--stdlib", "0", *half,
                   "--target", str(tmp_path / "no-such-target")])
        err = capsys.readouterr().err
        assert rc != 0 and "--text-tasks N and --text-from FILES go together" in err
        assert "no-such-target" not in err  # refused before any target loads
