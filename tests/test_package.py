"""The package's public names, imported on first use: `import bastion_jax` and every CLI's `--help` or
argument error run without JAX (they took ~2 s, ~1.1 s of it importing JAX, before a single check)."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import bastion_jax

ROOT = Path(__file__).resolve().parents[1]
CLIS = ["bastion_jax.generate", "bastion_jax.profile", "bastion_jax.train_drafter", "checkpoints_convert",
        "benchmarks.run", "benchmarks.step_costs", "benchmarks.cond_head_tree_cost"]


def test_every_public_name_is_its_defining_module_object():
    assert sorted(bastion_jax.__all__) == sorted(bastion_jax._MODULE_OF)
    for name in bastion_jax.__all__:
        module = importlib.import_module(bastion_jax._MODULE_OF[name])
        assert getattr(bastion_jax, name) is getattr(module, name), name
    assert set(bastion_jax.__all__) <= set(dir(bastion_jax))


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        bastion_jax.Engin  # noqa: B018
    with pytest.raises(ImportError):
        exec("from bastion_jax import Engin", {})


def test_import_and_every_cli_help_and_refusal_run_without_jax():
    # one fresh interpreter: the package, then each CLI's --help and an unknown flag, then the check
    script = f"""
import runpy, sys
import bastion_jax
for module in {CLIS!r}:
    for argv in (["--help"], ["--no-such-flag"]):
        sys.argv = [module, *argv]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            assert e.code == (0 if argv == ["--help"] else 2), (module, argv, e.code)
        else:
            raise AssertionError((module, argv, "did not exit"))
loaded = sorted(m for m in ("jax", "flax", "transformers", "torch") if m in sys.modules)
print("LOADED", loaded)
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "LOADED []" in out.stdout, out.stdout[-500:]
    assert "unrecognized arguments: --no-such-flag" in out.stderr
