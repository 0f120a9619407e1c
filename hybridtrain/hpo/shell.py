"""Where ``${name}`` placeholders sit in a trial's shell command.

A placeholder is replaced by the shell-quoted value (``'a b'``). Inside quotes that
quoting would be quoted again: in ``'--act=${act}'`` the value's own quotes end the
user's, so a categorical value such as ``x'; rm -rf ~; '`` reaches the shell as code.
:func:`quoted_placeholders` finds such placeholders so validation can refuse them.
"""

from __future__ import annotations

import re

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
