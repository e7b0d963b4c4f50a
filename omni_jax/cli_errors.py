"""How the command lines answer a user's mistake: one line on stderr and exit code 2.

Every entry point (``omni-jax run|convert|demo|bench|plan``, ``python -m checkpoints_convert``)
parses with :class:`OneLineParser` and runs its command through :func:`run_command`, the one
place where errors become messages. What user input causes is reported as ``error: <message>``:

- ``ValueError``: the library's refusals (bad arguments, a missing or broken checkpoint, a
  dtype it does not serve, an impossible mesh or stage list, bad media, an unknown speaker;
  conversion's ``CheckpointError`` and ``ParamMismatchError`` are ``ValueError`` s too);
- ``OSError``: a path the user named that cannot be read or written;
- ``SystemExit("message")``: how the benchmark harness refuses its arguments.

Anything else is a bug and keeps its traceback; ``--debug`` shows the traceback of these too.
Warnings print as ``warning: <message>`` lines. Help texts taken from a docstring go through
:func:`plain_text`, so that ``--help`` shows no reStructuredText markup.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TextIO

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
"""A command stopped by Ctrl-C: the shell's code for a process SIGINT ended (128 + 2)."""
EXIT_BROKEN_PIPE = 141
"""A command whose output's reader went away (``omni-jax plan ... | head``): what a shell reports
for a program SIGPIPE ended (128 + 13), and nothing on stderr, as for such a program."""
USER_ERRORS = (ValueError, OSError)


def one_line(message: str) -> str:
    """``message`` with its lines joined: a refusal is one line, whatever the raiser wrote."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


_ROLE = re.compile(r":(?:\w+:)?\w+:`([^`]+)`")  # :func:`x`, :py:meth:`~a.b`
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)
_INTERPRETED = re.compile(r"`([^`]+)`")  # the default role's `text`, once the others are gone
_TITLED = re.compile(r"(.+?)\s*<[^<>]+>", re.DOTALL)  # :doc:`the guide <guide>`


def _role_text(role: re.Match[str]) -> str:
    """What Sphinx shows for a cross-reference: its title, else its target (only the last dotted
    part of a ``~`` target)."""
    target = role.group(1)
    if titled := _TITLED.fullmatch(target):
        return titled.group(1)
    return target.rsplit(".", 1)[-1] if target.startswith("~") else target


def plain_text(doc: str) -> str:
    """``doc``, a docstring's reStructuredText, as a command's ``--help`` shows it: without the
    markup of roles (``:func:`name```), literals (text in double backquotes) and interpreted
    text (in single ones), which Sphinx renders but a terminal would print as typed; their text
    stays."""
    return _INTERPRETED.sub(r"\1", _LITERAL.sub(r"\1", _ROLE.sub(_role_text, doc)))


class OneLineParser(argparse.ArgumentParser):
    """``argparse`` with one-line usage errors (exit code 2) and a ``--debug`` flag on every
    (sub)command; ``omni-jax run ... --debug`` and ``omni-jax --debug run ...`` both work."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.add_argument(
            "--debug",
            action="store_true",
            default=argparse.SUPPRESS,  # a subcommand's absent flag must not reset the top level's
            help="show the Python traceback of an error",
        )

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"error: {self.prog}: {one_line(message)} (see {self.prog} --help)\n")


def _warning_line(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    print(f"warning: {one_line(str(message))}", file=sys.stderr if file is None else file)


def _unmakeable(flag: str, path: str | Path, reason: str) -> OSError:
    """The refusal of a folder ``flag`` names, in one wording whether the check or ``mkdir`` finds it."""
    return OSError(f"{flag} {path}: cannot be made a folder ({reason})")


def output_folder(flag: str, path: str | Path) -> Path:
    """The folder ``flag`` names, checked before any work but not made: a path that cannot be a
    folder (a file is there or above it), or a folder this process cannot write into or create
    (read-only, another user's), is a mistake to say at once, not after the run; and a command
    that refuses its request leaves nothing behind (:func:`make_output_folder` makes the folder
    when there is something to write into it). The path is checked as ``mkdir`` will meet it:
    its nearest part that is there (a link too, even a broken one) must be a folder to write in."""
    if not str(path):
        raise OSError(f"{flag}: an empty path names no folder")
    folder = Path(path)
    there = next(p for p in (folder, *folder.absolute().parents) if os.path.lexists(p))
    if not there.is_dir():
        raise _unmakeable(flag, path, os.strerror(errno.EEXIST if there == folder else errno.ENOTDIR))
    if not os.access(there, os.W_OK | os.X_OK):
        if there == folder:
            raise OSError(f"{flag} {path}: this process cannot write into it")
        raise _unmakeable(flag, path, os.strerror(errno.EACCES))
    return folder


def make_output_folder(flag: str, folder: Path) -> Path:
    """``folder``, which :func:`output_folder` checked, made (with its parents) when the first
    file is to be written into it; what changed on disk since the check is said as it was."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unmakeable(flag, folder, e.strerror or str(e)) from None
    return folder


def run_command(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``command(args)``'s exit code; a user's mistake prints one line and returns
    :data:`EXIT_USAGE`, Ctrl-C prints ``interrupted`` and returns :data:`EXIT_INTERRUPTED`, a
    closed stdout returns :data:`EXIT_BROKEN_PIPE` in silence (each re-raised with its
    traceback under ``args.debug``)."""
    debug = bool(getattr(args, "debug", False))
    with warnings.catch_warnings():
        if not debug:
            warnings.showwarning = _warning_line
        try:
            code = command(args)
            sys.stdout.flush()  # a pipe's output is buffered: a gone reader shows here, not at exit
            return code
        except BrokenPipeError:  # before OSError: the reader of stdout is gone, not a mistake
            if debug:
                raise
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # what is still buffered goes nowhere at exit
            os.close(devnull)
            return EXIT_BROKEN_PIPE
        except USER_ERRORS as e:
            if debug:
                raise
            message = str(e) or type(e).__name__
        except SystemExit as e:
            if debug or not isinstance(e.code, str):
                raise
            message = e.code
        except KeyboardInterrupt:
            if debug:
                raise
            print("interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
    print(f"error: {one_line(message)}", file=sys.stderr)
    return EXIT_USAGE
