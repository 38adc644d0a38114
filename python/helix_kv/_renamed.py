"""Deprecated names of renamed fields, attributes and keywords, kept for one release.

A renamed attribute keeps its old name as a :class:`Renamed` class attribute, which a type
checker sees as a read-only attribute of the new one's type; on a dataclass,
:func:`renamed_fields` makes ``__init__`` take the old names as keywords too::

    @renamed_fields
    @dataclass(frozen=True)
    class RankPlacement:
        cp_size: int
        ...
        cp = Renamed[int]("cp_size")  # unannotated: not a field

Reading ``placement.cp`` or passing ``cp=`` works and warns (a ``DeprecationWarning`` pointing at
the caller); passing both ``cp=`` and ``cp_size=`` is a ``TypeError``, and the old name cannot
be set. Fields, ``repr``, equality and pickles know the new names only, and
``dataclasses.replace`` takes either name (it passes every field on, so there an old keyword
replaces the new name's value). A renamed keyword of a function: :func:`renamed_keywords`.
Signatures, as a type checker sees them, have the new names only. The Rust classes do the same
by hand (``Layout.cp``, ``RequestMetrics.preemptions``).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import warnings
from collections.abc import Mapping
from types import CodeType, FrameType
from typing import Any, Callable, Generic, NoReturn, TypeVar, cast, overload

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)

_REMOVAL = "it is removed in the next release"

#: The dataclasses functions that call the class with every field filled in (``replace``, and
#: ``_replace`` behind it from Python 3.13): an old keyword given to them comes with the new
#: name's current value, which the old one's replaces.
_REPLACE_CODES: frozenset[CodeType] = frozenset(
    getattr(dataclasses, name).__code__
    for name in ("replace", "_replace")
    if hasattr(dataclasses, name)
)


class Renamed(Generic[T]):
    """The deprecated old name of the attribute ``new``: reading it warns and reads ``new``."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.old = self.owner = ""
        self.__doc__ = f"Deprecated name of ``{new}`` (kept for one release)."

    def __set_name__(self, owner: type, name: str) -> None:
        self.old, self.owner = name, owner.__name__

    def __repr__(self) -> str:
        return f"<deprecated name {self.owner}.{self.old} of {self.owner}.{self.new}>"

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Renamed[T]: ...

    @overload
    def __get__(self, obj: Any, owner: type | None = None) -> T: ...

    def __get__(self, obj: Any, owner: type | None = None) -> T | Renamed[T]:
        if obj is None:
            return self
        warnings.warn(
            f"{self.owner}.{self.old} is deprecated ({_REMOVAL}): read {self.owner}.{self.new}",
            DeprecationWarning,
            stacklevel=2,
        )
        value: T = getattr(obj, self.new)
        return value

    def __set__(self, obj: Any, value: NoReturn) -> NoReturn:
        # ``value: NoReturn``: a type checker rejects the assignment too
        raise AttributeError(
            f"{self.owner}.{self.old} is a deprecated read-only name: set {self.owner}.{self.new}"
        )


def renamed_keywords(**renames: str) -> Callable[[F], F]:
    """Makes a function take the deprecated keyword ``old`` of each ``old="new"`` as ``new``
    (warning at the caller; both given: ``TypeError``)."""

    def decorate(function: F) -> F:
        return _accepting(function, renames, function.__qualname__)

    return decorate


def renamed_fields(cls: C) -> C:
    """Makes a dataclass's ``__init__`` take the old name of each :class:`Renamed` attribute
    of ``cls`` as a deprecated keyword for its field (also through ``dataclasses.replace``)."""
    renames = {name: value.new for name, value in vars(cls).items() if isinstance(value, Renamed)}
    fields = {field.name for field in dataclasses.fields(cls)}
    if not renames or not fields.issuperset(renames.values()):
        raise TypeError(f"{cls.__name__}: renamed fields {renames} are not fields {fields}")
    setattr(cls, "__init__", _accepting(vars(cls)["__init__"], renames, cls.__name__))  # noqa: B010
    return cls


def _accepting(function: F, renames: Mapping[str, str], where: str) -> F:
    """``function``, taking the old keywords of ``renames`` (named ``where`` in the messages)."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs and not renames.keys().isdisjoint(kwargs):
            _rename(kwargs, renames, where, sys._getframe(1))
        return function(*args, **kwargs)

    return cast(F, call)


def _rename(
    kwargs: dict[str, Any], renames: Mapping[str, str], where: str, caller: FrameType
) -> None:
    """Gives the value of each old keyword in ``kwargs`` to its new one; warns at ``caller``,
    or at the caller of ``dataclasses.replace`` when that is ``caller``."""
    stacklevel = 3  # this function, the wrapper, its caller
    frame: FrameType | None = caller
    while frame is not None and frame.f_code in _REPLACE_CODES:
        frame, stacklevel = frame.f_back, stacklevel + 1
    replacing = frame is not caller  # replace gives every field: the new name came with it
    for old, new in renames.items():
        if old not in kwargs:
            continue
        if new in kwargs and not replacing:
            raise TypeError(
                f"{where}() got both {new} and its deprecated name {old}; give {new} only"
            )
        kwargs[new] = kwargs.pop(old)
        warnings.warn(
            f"{where}({old}=...) is deprecated ({_REMOVAL}): the keyword is {new}",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
