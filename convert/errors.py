class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked; the message names the cause and the fix."""
