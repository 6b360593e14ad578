"""An exported drafter's training.json says where, when, how far and how long it trained.

Beside the settings it recorded before (planned steps, data, target, init, this process's seconds,
validation): the device, the UTC date, the step the weights reached (below the planned steps when
--max-seconds cut the run) and the wall time summed over every --resume of the work dir.
"""

import datetime
import json

import jax


def test_training_json_records_device_date_step_and_time_across_resumes(tmp_path):
    from bastion_jax.testing import save_tiny_hf
    from bastion_jax.train_drafter import main

    save_tiny_hf("qwen3", tmp_path / "hf")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": [4 + i, 5 + i, 6], "response_ids": [7 + i, 8, 9 + i, 10, 11, 12]})
                            + "\n" for i in range(12)))
    run = ["train", "--target", str(tmp_path / "hf"), "--quiet", "--data", str(data), "--out", str(tmp_path / "run"),
           "--layers", "1", "--block-size", "4", "--steps", "4", "--batch-size", "2", "--seq-len", "16",
           "--anchors", "4", "--held-out", "2", "--walk-rows", "0", "--export-dtype", "float32"]
    exported = tmp_path / "run" / "drafter" / "training.json"
    # A wall-time limit far below one step's: the run stops after its first step (resumable).
    assert main([*run, "--max-seconds", "0.001"]) == 0
    first = json.loads(exported.read_text())
    assert first["train_config"]["steps"] == 4 and first["step"] == 1  # planned 4, reached 1
    dev = jax.devices()[0]
    assert first["device"] == {"kind": dev.device_kind, "platform": dev.platform, "count": jax.device_count()}
    today = datetime.datetime.now(datetime.timezone.utc).date()
    assert datetime.date.fromisoformat(first["date"]) in (today, today - datetime.timedelta(days=1))
    assert first["seconds_total"] == first["seconds"] > 0  # a fresh run: nothing earlier to add
    assert json.loads((tmp_path / "run" / "best" / "training.json").read_text())["step"] == 1
    assert main([*run, "--resume"]) == 0
    second = json.loads(exported.read_text())
    assert second["step"] == 4 and second["train_config"]["steps"] == 4
    # This process's seconds plus the first run's up to its last checkpoint: the total counts both runs.
    # (The first run's seconds also cover its export after that checkpoint, which the second run's, with
    # a checkpoint restored, steps trained, a checkpoint saved and an export of its own, outlast.)
    assert second["seconds_total"] > second["seconds"] and second["seconds_total"] >= first["seconds"]
    for key in ("train_config", "data", "target", "init", "seconds", "best_validation", "vocab_ranking"):
        assert key in second  # the keys it had before are kept


def test_a_block_size_other_than_the_inits_is_refused(tmp_path, capsys):
    """A drafter's block size is fixed by its training: --block-size beside an --init of another size
    was silently ignored (its default, 16, always was); now it is refused, and below 2 while parsing."""
    import pytest
    from flax import nnx

    from bastion_jax.checkpoints import load_target, random_drafter, save_drafter
    from bastion_jax.testing import one_error_line, save_tiny_hf, tiny_drafter_config
    from bastion_jax.train_drafter import main

    save_tiny_hf("qwen3", tmp_path / "hf")
    target = load_target(tmp_path / "hf")
    drafter = random_drafter(tiny_drafter_config(target.config, block_size=4), target.dtype)
    (tmp_path / "init").mkdir()
    save_drafter(tmp_path / "init", drafter.config, nnx.to_pure_dict(drafter.state))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": [4, 5, 6], "response_ids": [7 + i, 8, 9, 10, 11, 12]}) + "\n"
                            for i in range(6)))
    run = ["train", "--target", str(tmp_path / "hf"), "--quiet", "--data", str(data), "--out", str(tmp_path / "run"),
           "--init", str(tmp_path / "init"), "--steps", "1", "--seq-len", "16", "--anchors", "4", "--held-out", "2"]
    capsys.readouterr()
    assert main([*run, "--block-size", "8"]) == 2
    one_error_line(capsys.readouterr().err, "--block-size 8 differs from --init's block size 4")
    with pytest.raises(SystemExit) as e:
        main([*run, "--block-size", "1"])
    assert e.value.code == 2
    one_error_line(capsys.readouterr().err, "--block-size", ">= 2")

