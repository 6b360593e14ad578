"""`python -m checkpoints_convert SRC OUT`: the conversion CLI. The readers and writers it drives
live in `bastion_jax.checkpoints`."""
