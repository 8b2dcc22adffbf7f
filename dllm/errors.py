"""`FieldError`: a bad value of one named input field, as data (no HTTP here); `TooLong`: one that does not fit.

Raised where an input is checked -- `SamplingParams.validate`, `BlockRunner.new_sequence`,
the wire schemas' own rules (`rollout_client.protocol`) -- and turned into a response only at
the edge (the server's exception handlers map it to a 400 whose `param` is `field`, a `TooLong`
to a 413). It is a
`ValueError` whose text is `"<field>: <message>"`, so library users and CLIs see a plain message.

    raise FieldError("steps", "must be an integer in [1, block_size=4], got 9")
    except FieldError as e: e.field, e.message, str(e)   # "steps", "must be ...", "steps: must be ..."
"""

from __future__ import annotations


class FieldError(ValueError):
    """`field` (a request/config key, dotted when nested) is wrong; `message` says why."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    def renamed(self, field: str) -> FieldError:
        """The same error reported under another field name (e.g. the request's prompt field)."""
        return type(self)(field, self.message)


class TooLong(FieldError):
    """The input is well formed but does not fit: a prompt (with its completion) over the context length."""
