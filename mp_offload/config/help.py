"""``--help`` that shows defaults, for every command-line entry point of the project."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each flag's default: "(default: X)" is appended unless the help
    already says what the default is, or there is none to show (None, a False switch)."""

    def _get_help_string(self, action):
        help_ = action.help or ""
        default = action.default
        if (
            "default" in help_
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return help_
        shown = " ".join(map(str, default)) if isinstance(default, list) else "%(default)s"
        return f"{help_} (default: {shown})"
