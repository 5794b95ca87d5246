"""The error a user's argument, config field or request field gets.

`FieldError.field` names what to fix ("max_tokens", "stop_token_ids",
"train.batch_size"); readers (the server's 400 bodies, the CLIs' flag
names) take the field from it, never from the message text.
"""

from __future__ import annotations


class FieldError(ValueError):
    """A value refused for one field. str(e) is "field: detail"."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"{field}: {detail}")
        self.field, self.detail = field, detail

    def within(self, prefix: str) -> FieldError:
        """The same refusal with its field placed under `prefix` (e.g. "prompts[2]")."""
        return FieldError(f"{prefix}.{self.field}" if prefix else self.field, self.detail)
