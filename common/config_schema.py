"""Generic, strict conversion of parsed YAML into frozen config dataclasses.

PERSIA's serde structs silently ignored unknown keys, so a misspelt key ran with the default and
nobody noticed. Here the dataclass fields *are* the schema: :func:`build` walks a
mapping against a dataclass's fields and type hints, so adding a config key is one annotated line.
Every error names the dotted key path and the file it came from.

Supported field types: ``bool``, ``int``, ``float``, ``str``, ``Literal[...]`` of strings,
``tuple[X, ...]``, ``Mapping[str, X]``, ``X | None`` and nested dataclasses.

A PERSIA user's files must load unchanged, yet a typo must still fail. So a dataclass may name the keys
PERSIA's code and docs use that are not fields (``_persia_keys``): a :class:`Renamed` key is read as
ours (same meaning, another spelling), a :class:`NoEffect` key is accepted with one warning saying why
it does nothing here. Fields of ours that nothing reads yet (``_unused_keys``) warn when a file sets
them to anything but their default. Every other key is an error.

Every error of a file is reported at once, in one :class:`ConfigError` (a user fixes them all in one
go, not one per run): its unknown keys, each with its closest known key, its wrongly typed values and
the rules its values break.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, TypeVar

from persia_nats.common.errors import ConfigError

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")

log = logging.getLogger(__name__)


class FrozenMapping(Mapping[K, V]):
    """An immutable, hashable, picklable mapping that keeps insertion order.

    ``types.MappingProxyType`` would be read-only too, but it can be neither pickled (configs cross
    process boundaries when workers are spawned) nor hashed (frozen dataclasses hash their fields).
    """

    __slots__ = ("_data",)
    _data: dict[K, V]

    def __init__(self, items: Mapping[K, V] | typing.Iterable[tuple[K, V]] = ()) -> None:
        object.__setattr__(self, "_data", dict(items))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __reduce__(self) -> tuple[type, tuple[dict[K, V]]]:
        return (type(self), (self._data,))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._data!r})"


@dataclasses.dataclass(frozen=True, slots=True)
class Renamed:
    """A PERSIA spelling of one of our keys, with the same meaning: its value is read as ``to``, a key of
    the same mapping or a dotted path below it (``common_config.metrics_config``)."""

    to: str


@dataclasses.dataclass(frozen=True, slots=True)
class NoEffect:
    """A key PERSIA reads that does nothing here: accepted, its value ignored, with one warning saying ``why``."""

    why: str


PersiaKey = Renamed | NoEffect


class UnknownKeys(ConfigError):
    """One or more keys that are neither ours nor PERSIA's, each with its closest known key.

    ``notes`` holds ``(dotted key, "(known: ...); did you mean ...")`` pairs, in file order.
    """

    def __init__(self, notes: list[tuple[str, str]], source: str) -> None:
        self.notes = notes
        self.source = source
        if len(notes) == 1:
            message = f"unknown key '{notes[0][0]}' in {source} {notes[0][1]}"
        else:
            message = f"{len(notes)} unknown keys in {source}:" + "".join(f"\n  '{k}' {rest}" for k, rest in notes)
        super().__init__(message)


class ConfigErrors(ConfigError):
    """Several errors of one file, each a message of its own (as it would read alone), in file order."""

    def __init__(self, errors: list[ConfigError], source: str) -> None:
        self.errors = errors
        super().__init__(f"{len(errors)} errors in {source}:" + "".join(f"\n  {e}" for e in errors))


def _each(exc: ConfigError) -> list[ConfigError]:
    """The single errors ``exc`` stands for."""
    if isinstance(exc, ConfigErrors):
        return exc.errors
    if isinstance(exc, UnknownKeys) and len(exc.notes) > 1:
        return [UnknownKeys([note], exc.source) for note in exc.notes]
    return [exc]


def _raise_all(errors: list[ConfigError], source: str) -> None:
    """Raise ``errors`` as one: unknown keys alone as one :class:`UnknownKeys`, a single error as itself."""
    if not errors:
        return
    if all(isinstance(e, UnknownKeys) for e in errors):
        raise UnknownKeys([note for e in errors if isinstance(e, UnknownKeys) for note in e.notes], source)
    if len(errors) == 1:
        raise errors[0]
    raise ConfigErrors(errors, source)


class FieldViolation(ConfigError):
    """A value passed type checks but breaks a rule; raised from ``__post_init__``.

    ``key`` is relative to the dataclass that raised it; :func:`build` prefixes the path it was
    walking and the file, so a config built in code and one loaded from YAML fail the same way.
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"invalid '{key}': {reason}")
        self.key = key
        self.reason = reason


def build(cls: type[T], data: object, *, path: str = "", source: str = "<dict>") -> T:
    """Build dataclass ``cls`` from ``data`` (a mapping parsed from YAML), strictly.

    Args:
        cls: A dataclass type whose fields and type hints are the schema.
        data: The mapping to read. ``None`` means an empty section (all defaults).
        path: Dotted key path of ``data`` within the file ("" at the top level).
        source: The file name (or another label) to put in error messages.

    Returns:
        An instance of ``cls``.

    Raises:
        ConfigError: On an unknown, missing, derived or wrongly typed key, or a rule broken in
            ``__post_init__``; the message names the dotted key path and ``source``.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise _type_error(path, source, "mapping", data)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    derived: Mapping[str, str] = getattr(cls, "_derived_keys", {})
    persia: Mapping[str, PersiaKey] = getattr(cls, "_persia_keys", {})
    data = _read_persia_keys(data, persia, path, source)
    kwargs: dict[str, Any] = {}
    errors: list[ConfigError] = []
    misspelt = False
    for key, value in data.items():
        key_path = _join(path, key)
        if not isinstance(key, str):
            errors.append(ConfigError(f"key {key!r} under '{path or '<top level>'}' in {source} is not a string"))
        elif key in derived:
            errors.append(ConfigError(f"key '{key_path}' in {source} must not be set: {derived[key]}"))
        elif key not in fields:
            misspelt = True
            errors.append(UnknownKeys([_unknown_key(key_path, key, fields, persia)], source))
        else:
            try:
                kwargs[key] = convert(hints[key], value, path=key_path, source=source)
            except ConfigError as exc:  # go on: the user fixes every error of the file at once
                errors += _each(exc)
    if not errors:
        _warn_unused(cls, kwargs, fields, path, source)
    absent = [name for name, f in fields.items() if name not in kwargs
              and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if not misspelt:  # else the key is most likely there, misspelt: its suggestion says it all
        errors += [ConfigError(f"missing required key '{_join(path, name)}' in {source}")
                   for name in absent if name not in data]
    if absent:  # no instance without them: what is wrong with it stays unknown until they are there
        _raise_all(errors, source)
    # the keys that failed above take their defaults here, so the rules the other values break are reported too
    built, broken = _construct(cls, kwargs, path, source)
    _raise_all(errors + broken, source)
    assert built is not None
    return built


def _construct(cls: type[T], kwargs: dict[str, Any], path: str, source: str) -> tuple[T | None, list[ConfigError]]:
    """``cls(**kwargs)``, and every rule its ``__post_init__`` finds broken: it stops at the first, so each
    broken key is left to its default and the instance built again, until it builds or a rule breaks on a
    value the file did not set or one without a default (then the rest cannot be told apart from what that
    one caused)."""
    required = {f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    kwargs = dict(kwargs)
    broken: list[ConfigError] = []
    named: set[str] = set()
    while True:
        try:
            return cls(**kwargs), broken
        except FieldViolation as exc:
            if exc.key not in named:  # a default in the broken value's place can break its rule once more
                named.add(exc.key)
                broken.append(ConfigError(f"invalid '{_join(path, exc.key)}' in {source}: {exc.reason}"))
            name = exc.key.split(".", 1)[0].split("[", 1)[0]
            if name not in kwargs or name in required:
                return None, broken
            del kwargs[name]


def convert(tp: Any, value: object, *, path: str, source: str) -> Any:
    """Convert one YAML value to type ``tp``, or raise a ConfigError naming ``path`` and ``source``."""
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build(tp, value, path=path, source=source)
    if origin is typing.Literal:
        if isinstance(value, str) and value in typing.get_args(tp):
            return value
        raise _type_error(path, source, type_name(tp), value)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return convert(inner, value, path=path, source=source)
    if origin is tuple:
        return _convert_tuple(tp, value, path=path, source=source)
    if origin is Mapping:
        return _convert_mapping(tp, value, path=path, source=source)
    scalar = _SCALARS.get(tp)
    if scalar is None:
        raise TypeError(f"config_schema cannot convert to {tp!r} (field '{path}')")
    result = scalar(value)
    if result is None:
        raise _type_error(path, source, type_name(tp), value)
    return result


def type_name(tp: Any) -> str:
    """Describe a field type the way a YAML author thinks of it."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return "mapping"
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if origin is Mapping:
        return f"mapping of string to {type_name(typing.get_args(tp)[1])}"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(tp, repr(tp))


def _convert_tuple(tp: Any, value: object, *, path: str, source: str) -> tuple[Any, ...]:
    args = typing.get_args(tp)
    if len(args) != 2 or args[1] is not Ellipsis:
        raise TypeError(f"config_schema supports only tuple[X, ...], not {tp!r}")
    if value is None:
        return ()
    # A bare string is a sequence too, but "servers: a:1" meaning ('a', ':', '1') is never intended.
    if not isinstance(value, (list, tuple)):
        raise _type_error(path, source, type_name(tp), value)
    return tuple(_convert_all(args[0], list(enumerate(value)), path, source, lambda i: f"{path}[{i}]").values())


def _convert_mapping(tp: Any, value: object, *, path: str, source: str) -> FrozenMapping[str, Any]:
    key_tp, value_tp = typing.get_args(tp)
    if key_tp is not str:
        raise TypeError(f"config_schema supports only Mapping[str, X], not {tp!r}")
    if value is None:
        return FrozenMapping()
    if not isinstance(value, Mapping):
        raise _type_error(path, source, type_name(tp), value)
    for key in value:
        if not isinstance(key, str) or not key:
            raise ConfigError(f"key {key!r} under '{path}' in {source} must be a non-empty string")
    return FrozenMapping(_convert_all(value_tp, list(value.items()), path, source, lambda k: _join(path, k)))


def _convert_all(tp: Any, items: list[tuple[Any, object]], path: str, source: str,
                 key_path: Callable[[Any], str]) -> dict[Any, Any]:
    """Convert every item, reporting the errors of all of them together (eight slots, one error)."""
    out: dict[Any, Any] = {}
    errors: list[ConfigError] = []
    for key, item in items:
        try:
            out[key] = convert(tp, item, path=key_path(key), source=source)
        except ConfigError as exc:
            errors += _each(exc)
    _raise_all(errors, source)
    return out


def _to_bool(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def _to_int(value: object) -> int | None:
    # YAML `yes`/`true` are bools, and bool is an int subclass: never let one through as a count.
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, str):
        # PyYAML (YAML 1.1) reads `1e9` as a string; Decimal converts it exactly, unlike float.
        try:
            number = Decimal(value.strip())
        except InvalidOperation:
            return None
        if number.is_finite() and number == number.to_integral_value():
            return int(number)
    return None


def _to_float(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) else None


def _to_str(value: object) -> str | None:
    return value if isinstance(value, str) else None


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _type_error(path: str, source: str, expected: str, value: object) -> ConfigError:
    where = f"'{path}'" if path else "the top level"
    return ConfigError(
        f"wrong type for {where} in {source}: expected {expected}, "
        f"got {value!r} ({type(value).__name__})"
    )


def _unknown_key(key_path: str, key: str, fields: Mapping[str, Any], persia: Mapping[str, PersiaKey]
                 ) -> tuple[str, str]:
    """``key_path`` and ``(known: ...)`` with the closest key accepted, if any is close: ours, or PERSIA's
    (a PERSIA spelling of ours suggests ours)."""
    note = f"(known: {', '.join(fields)})"
    close = difflib.get_close_matches(key, [*fields, *persia], n=1)
    if close:
        rule = persia.get(close[0])
        note += f"; did you mean '{rule.to if isinstance(rule, Renamed) else close[0]}'?"
    return key_path, note


def _read_persia_keys(data: Mapping[Any, Any], persia: Mapping[str, PersiaKey], path: str,
                      source: str) -> Mapping[Any, Any]:
    """``data`` with PERSIA's keys read: a Renamed key moved to its target, a NoEffect key dropped with a warning.

    Raises:
        ConfigError: A Renamed key and its target (or another spelling of it) are both set.
    """
    if not any(k in persia for k in data):
        return data
    out: dict[Any, Any] = {k: v for k, v in data.items() if k not in persia}
    origin: dict[str, str] = {}
    for key, value in data.items():
        rule = persia.get(key) if isinstance(key, str) else None
        if rule is None:
            continue
        key_path = _join(path, key)
        if isinstance(rule, NoEffect):
            log.warning("config key '%s' in %s (PERSIA's) has no effect here: %s", key_path, source, rule.why)
            continue
        *parents, leaf = rule.to.split(".")
        target = out
        for i, part in enumerate(parents):
            inner = target.get(part)
            if inner is not None and not isinstance(inner, Mapping):
                raise _type_error(_join(path, ".".join(parents[:i + 1])), source, "mapping", inner)
            target[part] = target = dict(inner or {})
        to_path = _join(path, rule.to)
        if leaf in target:
            first = origin.get(rule.to, to_path)
            raise ConfigError(f"'{key_path}' (PERSIA's spelling of '{to_path}') and '{first}' are both set in "
                              f"{source}: keep one")
        target[leaf] = value
        origin[rule.to] = key_path
        log.info("config key '%s' in %s is PERSIA's spelling of '%s'", key_path, source, to_path)
    return out


def _warn_unused(cls: type, kwargs: Mapping[str, Any], fields: Mapping[str, dataclasses.Field[Any]], path: str,
                 source: str) -> None:
    """One warning per key of ours that nothing reads yet, when the file sets it to other than its default."""
    unused: Mapping[str, str] = getattr(cls, "_unused_keys", {})
    for key, why in unused.items():
        f = fields[key]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if key in kwargs and kwargs[key] != default:
            log.warning("config key '%s' in %s is set to %r, which has no effect here: %s",
                        _join(path, key), source, kwargs[key], why)
