"""Resuming `train_drafter data` after a kill: a torn last line is cut off, not counted as done.

The data command appends whole lines through a buffered file; a kill can leave the last one half
written. A resumed run must keep exactly the complete records and append valid JSONL after them
(for the responses file and the Magpie prompt file alike); a bad line with records after it is
damage, one error line naming the file and line.
"""

import json
import re
from types import SimpleNamespace

import pytest

from bastion_jax.testing import tiny_tokenizer
from bastion_jax.training.data import DataError, generate_responses, magpie_prompts, read_records, resume_jsonl


def record(i: int) -> dict:
    return {"source": "s", "prompt_ids": [4, 5 + i], "response_ids": [6, 7, 8 + i], "temperature": 0.0}


def torn_file(path, n: int, tail: bytes = b'{"source": "s", "prompt_ids": [4, 5], "respo'):
    """`n` complete response records and a half-written one after them, as a kill leaves it."""
    path.write_bytes(b"".join(json.dumps(record(i)).encode() + b"\n" for i in range(n)) + tail)
    return path


def test_a_torn_last_line_is_cut_off_and_the_next_append_is_valid(tmp_path, capsys):
    out = torn_file(tmp_path / "d.jsonl", 5)
    size = out.stat().st_size
    assert resume_jsonl(out, "response_ids") == [record(i) for i in range(5)]
    dropped = size - out.stat().st_size
    assert dropped == len(b'{"source": "s", "prompt_ids": [4, 5], "respo')
    err = capsys.readouterr().err
    assert f"dropped {dropped} bytes" in err and "line 6" in err and "5 records kept" in err
    with open(out, "a") as f:
        f.write(json.dumps(record(5)) + "\n")
    assert read_records(out) == [record(i) for i in range(6)]  # what `train` reads: valid JSONL throughout
    # A file that is whole is left as it is, silently.
    before = out.read_bytes()
    assert len(resume_jsonl(out, "response_ids")) == 6 and out.read_bytes() == before
    assert capsys.readouterr().err == ""
    # A blank line is neither a record nor damage (read_jsonl skips it too).
    out.write_text(json.dumps(record(0)) + "\n\n" + json.dumps(record(1)) + "\n")
    assert resume_jsonl(out, "response_ids") == [record(0), record(1)]


def test_a_torn_multibyte_character_and_a_last_record_without_newline(tmp_path):
    out = tmp_path / "p.jsonl"
    whole = json.dumps({"prompt": "caf\u00e9 au lait?"}, ensure_ascii=False).encode()
    out.write_bytes(json.dumps({"prompt": "first"}).encode() + b"\n" + whole[:whole.index(b"\xa9")])  # mid-character
    assert resume_jsonl(out, "prompt") == [{"prompt": "first"}]
    assert out.read_bytes() == json.dumps({"prompt": "first"}).encode() + b"\n"
    # A complete last record whose newline never reached the disk is kept, and the newline added.
    out.write_bytes(json.dumps({"prompt": "first"}).encode() + b"\n" + whole)
    assert resume_jsonl(out, "prompt") == [{"prompt": "first"}, {"prompt": "caf\u00e9 au lait?"}]
    assert out.read_bytes().endswith(whole + b"\n")


def test_damage_before_the_last_record_is_one_error_naming_file_and_line(tmp_path):
    out = tmp_path / "d.jsonl"
    # What the old resume made of a torn line: the next record appended onto it, then more records.
    out.write_text(json.dumps(record(0)) + "\n" + '{"source": "s", "pro' + json.dumps(record(1)) + "\n"
                   + json.dumps(record(2)) + "\n")
    before = out.read_bytes()
    with pytest.raises(DataError, match=rf"^{re.escape(str(out))}:2: not JSON .*records after it") as e:
        resume_jsonl(out, "response_ids")
    assert len(str(e.value).splitlines()) == 1 and out.read_bytes() == before  # refused, nothing cut
    # A file of other records (a prompt file given as --out) is refused, not counted or cut.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question": "w4"}) + "\n")
    with pytest.raises(DataError, match=rf"^{re.escape(str(prompts))}:1: a record without 'response_ids'"):
        resume_jsonl(prompts, "response_ids")


class FakeEngine:
    """Scripted generation: each prompt's response is [len(prompt)] (responses) or scripted batches (Magpie)."""

    stop_ids = frozenset({2})

    def __init__(self, batches=()):
        self.batches, self.calls = list(batches), []

    def cache_len_for(self, lengths, max_new_tokens, _):
        return max(lengths) + max_new_tokens

    def generate(self, prompts, *, max_new_tokens, mode, sampling, seed, max_len=None):
        self.calls.append([list(p) for p in prompts])
        tokens = self.batches.pop(0) if self.batches else [[len(p)] for p in prompts]
        return SimpleNamespace(tokens=tokens, stats=SimpleNamespace(tokens_per_s=1.0))


def test_responses_resume_after_the_complete_records(tmp_path, capsys):
    tok = tiny_tokenizer()
    prompts = [("s", f"w{10 + i} w{20 + i}") for i in range(7)]
    out = tmp_path / "d.jsonl"
    engine = FakeEngine()
    assert generate_responses(engine, tok, prompts[:3], out, max_new_tokens=4, max_prompt_tokens=64, batch_size=2,
                              progress=False) == 3
    torn = b'{"source": "s", "prompt_ids": [1'
    with open(out, "ab") as f:  # a kill in the middle of the fourth line
        f.write(torn)
    engine = FakeEngine()
    assert generate_responses(engine, tok, prompts, out, max_new_tokens=4, max_prompt_tokens=64, batch_size=2,
                              progress=False) == 4  # prompts 3..6: the torn one is not counted as done
    assert f"dropped {len(torn)} bytes" in capsys.readouterr().err
    rows = read_records(out)
    want = [tok(text)["input_ids"] for _, text in prompts]
    assert [r["prompt_ids"] for r in rows] == want and [r["response_ids"] for r in rows] == [[len(w)] for w in want]


def test_magpie_resume_cuts_a_torn_prompt_and_names_a_damaged_line(tmp_path, capsys):
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
    out = tmp_path / "m.jsonl"
    kept = "w10 w11 w12 w13 w14 w15 w16"
    torn = '{"prompt": "w20 w2'
    out.write_text(json.dumps({"prompt": kept}) + "\n" + torn)
    engine = FakeEngine()
    assert magpie_prompts(engine, tok, 1, out, batch_size=4, seed=7, progress=False) == [kept]
    assert engine.calls == [] and out.read_text() == json.dumps({"prompt": kept}) + "\n"
    assert f"dropped {len(torn)} bytes" in capsys.readouterr().err
    out.write_text(json.dumps({"prompt": kept}) + "\n" + '{"prompt": "w20 w2\n' + json.dumps({"prompt": "w30"}) + "\n")
    with pytest.raises(DataError, match=rf"^{re.escape(str(out))}:2: not JSON"):
        magpie_prompts(FakeEngine(), tok, 3, out, batch_size=4, seed=7, progress=False)


def test_cli_data_refuses_a_damaged_output_in_one_line(tmp_path, capsys):
    from bastion_jax.testing import save_tiny_hf
    from bastion_jax.train_drafter import main

    save_tiny_hf("qwen3", tmp_path / "hf")
    prompts = tmp_path / "my_train_split.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"w{i} w{i + 1}"}) + "\n" for i in range(4, 10)))
    out = tmp_path / "d.jsonl"
    out.write_text(json.dumps(record(0)) + "\n" + "{torn" + json.dumps(record(1)) + "\n" + json.dumps(record(2)) + "\n")
    capsys.readouterr()
    assert main(["data", "--target", str(tmp_path / "hf"), "--quiet", "--out", str(out), "--sources", str(prompts),
                 "--stdlib", "0", "--num", "4", "--max-new-tokens", "2", "--batch-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {out}:2: not JSON"), err
