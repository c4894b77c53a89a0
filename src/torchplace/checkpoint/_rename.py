"""``rename=``: another program's names fitted to the model's before ``load_into`` checks them.

A rename is a callable ``str -> str | None`` (None drops the key) or a dict of regular
expressions to replacements, applied in order with ``re.sub`` (``{r"^module\\.": ""}`` for a file
saved from DDP, ``{r"^model\\.": ""}`` for a Lightning module's ``state_dict``); a replacement of
None drops a key that its pattern matches at that point of the order.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Union

from .._errors import CheckpointError, TorchplaceError

Rename = Union[Callable[[str], Union[str, None]], Mapping[str, Union[str, None]]]  # noqa: UP007


class _NotGiven:
    """A rename torchplace made itself where the caller gave none (a wrapper's prefix taken
    off, a disk module's keys dropped): messages then speak of the file's keys, not of a
    ``rename=`` the caller never passed."""

    def __init__(self, rename: Callable[[str], str | None]) -> None:
        self.rename = rename

    def __call__(self, key: str) -> str | None:
        return self.rename(key)


def not_given(rename: Callable[[str], str | None], /) -> Callable[[str], str | None]:
    """``rename``, marked as torchplace's own (``given`` is False for it)."""
    return _NotGiven(rename)


def given(rename: Rename | None, /) -> bool:
    """Whether the caller gave ``rename`` (not None, nor one ``not_given`` marked)."""
    return rename is not None and not isinstance(rename, _NotGiven)


def guarded(
    label: Path | str, rename: Callable[[str], str | None], /
) -> Callable[[str], str | None]:
    """``rename`` whose own failure on a key is a ``CheckpointError`` naming ``label`` and the key
    (as ``renamed`` words it), wherever the key is renamed first."""

    def fitted(key: str) -> str | None:
        try:
            return rename(key)
        except Exception as exc:
            raise CheckpointError(
                f"{label}: rename= raised {type(exc).__name__} on key {key!r}: {exc}",
                path=_file(label),
            ) from exc

    return fitted


def _file(label: Path | str) -> Path | None:
    """The file a label names, for an error's ``path`` (a state dict's label names none)."""
    return label if isinstance(label, Path) else None


def as_renamer(rename: Any, /) -> Callable[[str], str | None]:
    """``rename`` as one callable, its regular expressions compiled and checked.

    >>> as_renamer({r"^module\\.": "", r"\\.gamma$": ".weight"})("module.norm.gamma")
    'norm.weight'
    >>> as_renamer({r"^module\\.": "", r"^head\\.": None})("module.head.bias") is None
    True
    """
    if callable(rename):
        return rename  # type: ignore[no-any-return]
    if not isinstance(rename, Mapping):
        raise TorchplaceError(
            f"rename= takes a callable str -> str | None or a dict of regular expressions to "
            f"replacements, not {type(rename).__name__}; e.g. rename={{r'^module\\.': ''}}"
        )
    rules: list[tuple[re.Pattern[str], str | None]] = []
    for pattern, replacement in rename.items():
        if not isinstance(pattern, str) or not isinstance(replacement, (str, type(None))):
            raise TorchplaceError(
                f"rename= maps regular expressions (str) to replacements (str, or None to drop "
                f"the keys the pattern matches), but it holds {pattern!r}: {replacement!r}"
            )
        try:
            rules.append((re.compile(pattern), replacement))
        except re.error as exc:
            raise TorchplaceError(
                f"rename= holds {pattern!r}, which is not a regular expression ({exc})"
            ) from exc

    def renamer(key: str) -> str | None:
        for rule, replacement in rules:
            if replacement is None:
                if rule.search(key):
                    return None  # dropped, as the name stands after the patterns before it
            else:
                key = rule.sub(replacement, key)
        return key

    return renamer


def not_a_name(label: Path | str, key: str, new: object) -> CheckpointError:
    """The error for a rename that turned ``key`` into ``new``, neither a str nor None."""
    return CheckpointError(
        f"{label}: rename= turned {key!r} into {new!r}; it must return a str (the new name) or "
        "None (to drop the key)",
        path=_file(label),
    )


def renamed(
    label: Path | str, state: Mapping[str, Any], rename: Callable[[str], str | None]
) -> dict[str, Any]:
    """``state`` under its new names (keys renamed to None dropped), ``_metadata`` renamed too.

    Two keys renamed to one name would lose one of them: that raises ``CheckpointError`` naming
    both, as does a callable that returns something other than a str or None.
    """
    out: dict[str, Any] = {}
    source: dict[str, str] = {}
    for key, value in state.items():
        try:
            new = rename(key)
        except Exception as exc:
            raise CheckpointError(
                f"{label}: rename= raised {type(exc).__name__} on key {key!r}: {exc}",
                path=_file(label),
            ) from exc
        if new is None:
            continue
        if not isinstance(new, str):
            raise not_a_name(label, key, new)
        if new in out:
            raise CheckpointError(
                f"{label}: rename= gives {source[new]!r} and {key!r} the same name {new!r}, so "
                "one of them would be lost; rename them apart, or drop one (map it to None: a "
                "pattern to None in a dict, or return None from a callable)",
                path=_file(label),
            )
        out[new] = value
        source[new] = key
    metadata = getattr(state, "_metadata", None)
    if isinstance(metadata, Mapping):
        # Metadata is kept by module path ("" for the root, "bn" for a child); a module's path
        # is renamed as its keys' common beginning, "bn." is.
        moved: dict[str, Any] = {}
        for path, value in metadata.items():
            if not isinstance(path, str) or not path:
                moved[path] = value
                continue
            try:
                new = rename(path + ".")
            except Exception:  # a rename written for keys only: the metadata stays as it was
                new = path + "."
            if isinstance(new, str) and new.endswith("."):
                moved.setdefault(new[:-1], value)
        result: Any = collections.OrderedDict(out)
        result._metadata = moved
        return result  # type: ignore[no-any-return]
    return out
