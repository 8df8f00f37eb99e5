"""The ``router`` command: ``main`` parses, loads the config, sets up logging and runs one
command. Each command lives in a module of its own that adds its sub-parser
(``router.cli.parser``); what they print and return is in ``router.cli.output``.

Layer: the top of the package. Nothing in ``router`` imports it.
"""

from router.cli.main import main

__all__ = ["main"]
