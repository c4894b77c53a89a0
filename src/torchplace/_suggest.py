"""Close matches for a misspelt name: the one "did you mean ...?" of every message that names
what the user may have meant (a file beside a missing path, a checkpoint key, a public name, a
command or flag of the ``torchplace`` command). Plain Python, no torch.

Two kinds of near miss are caught: ordinary typos (a letter transposed, dropped, doubled or
wrong anywhere in the name), by ``difflib``'s similarity, and names cut short (a prefix of a
choice: ``model`` for ``model.safetensors``).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["close_matches", "did_you_mean"]


def close_matches(
    word: str, choices: Iterable[str], /, *, n: int = 3, cutoff: float = 0.6, same: bool = False
) -> list[str]:
    """The choices ``word`` most likely stands for, best first; none equal to it unless
    ``same`` (a word that is right but misplaced: ``cuda0`` for ``cuda:0``).

    >>> close_matches("laod_into", ["load", "load_into", "move"])
    ['load_into']
    >>> close_matches("dcoder.layer.0.weight", ["decoder.layer.0.weight", "head.weight"])
    ['decoder.layer.0.weight']
    >>> close_matches("model", ["model.pt", "optimizer.pt"])
    ['model.pt']

    Case is ignored when comparing (``Load_Into`` finds ``load_into``). ``cutoff`` is the least
    similarity (``difflib``'s ratio, 0 to 1) a typo needs.
    """
    options = list(dict.fromkeys(c for c in choices if same or c != word))
    folded: dict[str, list[str]] = {}
    for option in options:
        folded.setdefault(option.lower(), []).append(option)
    key = word.lower()
    typos = difflib.get_close_matches(key, list(folded), n=n, cutoff=cutoff)
    cut_short = [o for o in folded if key and o.startswith(key) and o not in typos]
    found = [option for f in [*typos, *cut_short] for option in folded[f]]
    return found[:n]


def did_you_mean(word: str, choices: Iterable[str], /, *, n: int = 1) -> str:
    """``"did you mean 'x'? "`` (up to ``n`` names, joined by "or") for the text of an error, or
    ``""`` when nothing is close.

    >>> did_you_mean("inspcet", ["doctor", "inspect", "remap", "bench"])
    "did you mean 'inspect'? "
    >>> did_you_mean("zzz", ["doctor", "inspect"])
    ''
    """
    found = close_matches(word, choices, n=n)
    return f"did you mean {' or '.join(repr(f) for f in found)}? " if found else ""
