"""Where ``${name}`` placeholders sit in a trial's shell command.

A placeholder is replaced by the shell-quoted value (``'a b'``). Inside quotes that
quoting would be quoted again: in ``'--act=${act}'`` the value's own quotes end the
user's, so a categorical value such as ``x'; rm -rf ~; '`` reaches the shell as code.
:func:`quoted_placeholders` finds such placeholders so validation can refuse them.
:func:`argv_without_shell` runs a command that needs no shell without one.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping

_PLACEHOLDER_AT = re.compile(r"\$\{([^}]*)\}")


def quoted_placeholders(command: str) -> list[tuple[str, str]]:
    """Placeholders of ``command`` that stand inside single or double quotes.

    A small POSIX ``sh`` quoting scanner: backslash escapes outside single quotes,
    ``'…'`` (no escapes inside) and ``"…"``. It errs on the side of refusing: a placeholder
    in ``"$(cmd ${x})"`` counts as double-quoted, although the shell would start a new
    quoting context inside ``$(…)``.

    Returns:
        ``(name, "single" | "double")`` for each placeholder inside quotes, in order.
    """
    found: list[tuple[str, str]] = []
    quote = ""  # "", "'" or '"'
    i = 0
    while i < len(command):
        ch = command[i]
        if quote != "'" and ch == "\\":
            i += 2  # the escaped character is literal
            continue
        if ch == "$" and (m := _PLACEHOLDER_AT.match(command, i)):
            if quote:
                found.append((m.group(1), "single" if quote == "'" else "double"))
            i = m.end()
            continue
        if ch in "'\"" and quote in ("", ch):
            quote = "" if quote else ch
        i += 1
    return found


# Characters with a meaning to the shell outside placeholders: quoting, expansions,
# globs, redirections, separators, comments, ``~`` and brace expansion (bash).
_SHELL_SYNTAX = re.compile(r"[|&;<>()$`\\\"'*?\[\]#~{}!\n]")
# Builtins without a program of the same name on the PATH that would do the same:
# POSIX special builtins and those that act on the shell itself.
_SHELL_ONLY = frozenset({
    ":", ".", "break", "continue", "eval", "exec", "exit", "export", "readonly", "return",
    "set", "shift", "times", "trap", "unset", "alias", "bg", "cd", "command", "fc", "fg",
    "getopts", "hash", "jobs", "local", "read", "source", "type", "ulimit", "umask",
    "unalias", "wait",
})


def argv_without_shell(command: str, values: Mapping[str, str], path: str | None,
                       cwd: str) -> list[str] | None:
    """The argument vector of ``command`` when it needs no shell, else ``None``.

    A command that is one simple command (words separated by blanks, no quoting,
    expansion, redirection, separator or assignment) whose program is on ``path`` runs
    as that program directly: the shell's own start costs more than the rest of the
    service's per-trial work (``benchmarks/hpo_overhead.py``). Each placeholder is
    replaced by its raw value inside its word, which is what the shell makes of the
    shell-quoted value: one argument, nothing expanded. Anything else (and a program
    that is not found, so the shell reports it with exit code 127 as before) runs
    through the shell.

    Args:
        command: the command template with ``${name}`` placeholders.
        values: the raw (unquoted) value of every placeholder.
        path: the ``PATH`` the trial runs with.
        cwd: the trial's working directory (relative program paths start there).
    """
    words = [w for w in re.split(r"[ \t]+", command) if w]
    bare = [_PLACEHOLDER_AT.sub("", w) for w in words]
    if not words or "=" in bare[0] or any(_SHELL_SYNTAX.search(w) for w in bare):
        return None
    argv = [_PLACEHOLDER_AT.sub(lambda m: values[m.group(1)], w) for w in words]
    program = argv[0]
    if not program or program in _SHELL_ONLY:
        return None
    found = os.path.join(cwd, program) if "/" in program else shutil.which(program, path=path)
    if found is None or not os.path.isfile(found) or not os.access(found, os.X_OK):
        return None
    return argv
