"""The error answer of the OpenAI-compatible endpoints: :class:`APIError`, raised wherever a
request is found wanting and answered with OpenAI's error body."""

from __future__ import annotations

from ..errors import ContextOverflowError, SpecDecodeError


class APIError(Exception):
    """An error answered to the client with an OpenAI-style body.

    status: HTTP status. type/param/code: the fields of ``{"error": {...}}``; param names
    the request field at fault (None when no single field is).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_specdecode_error(e: SpecDecodeError, param: str | None = None) -> APIError:
    """A SpecDecodeError is the client's mistake here: a 400 with its message.

    The field is the error's own ``param`` when it names one, else ``param`` (e.g.
    "prompt" for errors found when the prompt is tokenized). A ContextOverflowError gets
    code context_length_exceeded.
    """
    code = "context_length_exceeded" if isinstance(e, ContextOverflowError) else None
    return APIError(400, str(e), param=e.param or param, code=code)
