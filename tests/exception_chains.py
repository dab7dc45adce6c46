"""Reading what a Hypothesis run raised: the whole chain of causes, contexts and grouped
exceptions as text, so a test can look for the finding it expects wherever it sits."""
from __future__ import annotations


def chain_text(exc: BaseException) -> str:
    parts, todo, seen = [], [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return "\n".join(parts)
