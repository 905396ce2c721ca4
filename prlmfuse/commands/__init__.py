"""The subcommands of `prlmfuse`, one module per command group; `prlmfuse.cli` registers them.

Each module defines its commands without the root group, so a new command (say `prlmfuse report`)
is a new module here plus one line in `prlmfuse.cli`. Shared options and helpers live in `_common`.
"""
