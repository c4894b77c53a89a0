"""The ``functools.cached_property`` attributes of a class, in one place for the tree walker
(``_tree``) and for tracing (``_dynamo_compat``), which must not import each other."""

from __future__ import annotations

import functools

__all__ = ["cached_property_names"]


def cached_property_names(cls: type) -> tuple[str, ...]:
    """The names of ``cls``'s ``functools.cached_property`` attributes, base classes' included.

    >>> import functools
    >>> class Sample:
    ...     @functools.cached_property
    ...     def area(self) -> int:
    ...         return 4
    >>> cached_property_names(Sample)
    ('area',)
    """
    return tuple(
        name
        for name in dict.fromkeys(n for klass in cls.__mro__ for n in vars(klass))
        if isinstance(getattr(cls, name, None), functools.cached_property)
    )
