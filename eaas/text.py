"""Text that is safe to print on a terminal.

Generated text can hold any character the tokenizer can produce, including control characters
(``\\r`` moves the cursor, ``\\x0c`` clears some terminals, ``\\x1b`` starts escape sequences,
``\\x00`` truncates lines in some tools). Whatever the CLI prints that it did not write itself
goes through :func:`printable` first.
"""

from __future__ import annotations

import re

# C0 controls except tab and newline, DEL, and the C1 controls (U+0080..U+009F).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_NAMED = {"\r": "\\r", "\x0c": "\\f", "\x0b": "\\v", "\x08": "\\b", "\x07": "\\a", "\x00": "\\0"}


def printable(text: str, *, keep_newlines: bool = True) -> str:
    """``text`` with every control character escaped (``\\r``, ``\\f``, ``\\x1b``, ...).

    Args:
        text: any string (e.g. a completion).
        keep_newlines: leave ``\\n`` and ``\\t`` as they are (True) or escape them too.

    Returns:
        A string without terminal control characters; printable characters, including
        non-ASCII letters, are unchanged.
    """
    out = _CONTROL.sub(lambda m: _NAMED.get(m.group(), f"\\x{ord(m.group()):02x}"), text)
    if not keep_newlines:
        out = out.replace("\n", "\\n").replace("\t", "\\t")
    return out
