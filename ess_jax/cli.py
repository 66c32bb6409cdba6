"""What the command-line entry points share: an argument parser whose errors are one line."""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """``argparse`` with the module docstring kept as written and errors printed as one line starting
    with ``error:`` (no usage dump), exit status 2, like every other bad-input error of the CLIs."""

    def __init__(self, prog: str, description: str | None):
        super().__init__(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")
