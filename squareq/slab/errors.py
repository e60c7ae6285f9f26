"""The one exception type the slab reader and writer raise for a bad file or bad request."""


class SlabError(Exception):
    """A slab cannot be read or written; the message is one sentence naming the file and what to do."""
