"""User-facing errors: one clear line, raised before any heavy work."""


class SpecjaxError(Exception):
  """A mistake in what the user asked for (path, config, input, capacity).

  The CLI prints `error: <message>` and exits non-zero without a traceback.
  """


class OutOfPagesError(SpecjaxError):
  """The paged KV cache has no free pages left for a request."""
