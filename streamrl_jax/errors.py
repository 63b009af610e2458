"""The one class of user mistakes: `UserError`.

A `UserError` is a mistake in the user's own input — a config field, a data
file, a checkpoint, a model file — whose message names the field or file.
`python -m streamrl_jax.launch` prints it as one `error:` line and exits with
status 2; any other exception is a bug and keeps its traceback. It is a
`ValueError`, so code that handled those still does.
"""


class UserError(ValueError):
    """A mistake in the user's input, named (see the module docstring)."""
