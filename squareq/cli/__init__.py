"""The `squareq` command line: a thin layer that parses flags, calls the library and prints. The group and its
global options are cli/group.py's; each command is its own module's, added to the group here."""
from . import accept, compile, demo, inspect, sample, train
from .group import USER_ERRORS, main

for command in (accept.accept, compile.compile_cmd, train.train, train.cache_cmd, sample.sample, sample.export_lora,
                inspect.inspect, inspect.families, demo.demo):
    main.add_command(command)
del command

__all__ = ["USER_ERRORS", "main"]
