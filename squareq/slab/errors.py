"""The one exception type the slab reader and writer raise for a bad file or bad request."""


class SlabError(Exception):
    """A slab cannot be read or written; the message is one sentence naming the file and what to do."""


def brief(exc: BaseException, limit: int = 200) -> str:
    """An exception's text on one line and at most ``limit`` characters, for quoting inside a one-sentence error
    (a damaged file's key names can hold newlines)."""
    return " ".join(str(exc).split())[:limit]
