"""One exception type for every way a checkpoint can be unusable, so CLIs print one line."""


class ConversionError(ValueError):
    """A checkpoint that cannot be read or does not match the model it claims to be."""
