"""Errors that specdecode reports to users.

Every error a user can cause (bad option, missing or corrupt model file, incompatible
vocabularies, a prompt that does not fit) is a :class:`SpecDecodeError` whose message
names the offending values. The CLI prints it as one line and exits non-zero; the server
answers 400 and names ``param`` as the offending request field.
"""


class SpecDecodeError(Exception):
    """A user-facing error: the message says what is wrong and shows the values.

    param: the option or request field at fault (e.g. "top_p", "max_tokens"), when one is.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelFileError(SpecDecodeError):
    """A model file is missing, truncated, corrupt or does not match its checksum."""


class IncompatibleVocabularyError(SpecDecodeError):
    """The draft model's vocabulary differs from the target's."""


class ContextOverflowError(SpecDecodeError):
    """The prompt does not fit in the target's (or draft's) context window."""
