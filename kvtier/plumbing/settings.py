"""Settings declared once. A service's settings class is a dataclass whose fields carry, beside
their default, the flag that sets them (`setting`, `choice`, `on_off`, `switch`, `required`):
its name, help text and how its text is read. `kvtier <command>` gets its flags from there
(`add_flags`, the KVTIER_* variables through the command's parser), builds the typed settings
from what was parsed in one call (`read_settings`, which runs the class's `validate()`), and
docs/DEPLOY.md's flag tables come from that parser. The services themselves only ever see the
typed settings, never argparse's Namespace; so do the operator tools (kvtier/tools/settings.py),
whose flags need a little more of argparse: flags that exclude one another (`exclusive`), an
optional value with a `const`, an action class, a positional argument, and a subcommand's flag
that may also be given to its parent command (`inherit`).

Also here: the types that read a flag's text (`positive_int`, ...), so a service can declare
them without importing the commands."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

#: The field metadata key holding a setting's `Flag` (or `FlagGroup`).
FLAG = "kvtier.flag"
#: Flags whose values are secrets: --help never shows their value, nor does a settings repr.
SECRET_FLAG = re.compile(r"(password|token|api-key)$")

T = TypeVar("T")


class SettingsError(ValueError):
    """Settings that cannot work together: the command reports it as a one-line usage error."""


class Choice(str, enum.Enum):
    """A mode given by name: equal to its name as text, and printed as it (in --help too)."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def former_names(cls) -> dict[str, str]:
        """Names a mode had before it was renamed -> its name now: still read (on the command
        line, in KVTIER_*, given by name), so deployments written with them keep working."""
        return {}

    @classmethod
    def _missing_(cls, value):
        now = cls.former_names().get(value) if isinstance(value, str) else None
        return cls(now) if now is not None else None


@dataclass(frozen=True)
class Flag:
    """How one setting is given on the command line (and as KVTIER_<FLAG>)."""

    name: str
    help: str
    #: Reads the flag's text (argparse's `type`); None: the text as it is.
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    #: The Namespace name, where other code reads it under another name than the field's
    #: (`--nats` is args.nats wherever the connection options are read).
    dest: str | None = None
    required: bool = False
    #: argparse's action: "store_true" for a switch, "append" for a repeatable flag, or an
    #: argparse.Action class (UrlListAction).
    action: str | type[argparse.Action] | None = None
    #: The field's default as the flag writes it (an enum's name, "on" for True).
    text_default: Any = None
    #: The parsed flag -> the field's value (None: the same).
    to_field: Callable[[Any], Any] | None = None
    #: argparse's nargs and const: "?" with a const is a flag whose value may be left out.
    nargs: str | int | None = None
    const: Any = None
    #: Flags with the same name here exclude one another (one argparse mutually exclusive
    #: group). They are read from the command line only: argparse adds a group's flags past
    #: the parser's KVTIER_* defaults, and two variables set at once could not be refused
    #: the way two flags are.
    exclusive: str | None = None
    #: A subcommand's flag that its parent command has too: not given after the subcommand,
    #: the parent's value (given before it, or its default) stands, so the subcommand's parser
    #: writes no default of its own (argparse.SUPPRESS).
    inherit: bool = False

    @property
    def positional(self) -> bool:
        """A name without a leading '-' is a positional argument (argparse's dest is the name)."""
        return not self.name.startswith("-")

    def key(self, field_name: str) -> str:
        """The Namespace attribute the parsed value lands in."""
        return self.name if self.positional else self.dest or field_name

    def argparse_options(self, field_name: str) -> dict[str, Any]:
        """add_argument's keywords; only those set, since a switch takes no `type` and the
        environment's parser reads a `type` wherever there is one."""
        options: dict[str, Any] = {"help": self.help}
        if not self.positional:  # argparse takes neither a dest nor `required` for a positional
            options["dest"] = self.dest or field_name
            if self.required:
                options["required"] = True
        if self.inherit:
            options["default"] = argparse.SUPPRESS
        elif not self.required:
            options["default"] = list(self.text_default) if isinstance(self.text_default, list) else self.text_default
        for key, value in (("type", self.parse), ("metavar", self.metavar), ("action", self.action),
                           ("nargs", self.nargs), ("const", self.const)):
            if value is not None:
                options[key] = value
        if self.choices is not None:
            options["choices"] = list(self.choices)
        return options

    def value(self, parsed: Any) -> Any:
        return parsed if self.to_field is None else self.to_field(parsed)


@dataclass(frozen=True)
class FlagGroup:
    """Flags declared somewhere else, added at this field's place: a nested settings class,
    or another module's `add`/`read` pair (the scoring weights, the cost model)."""

    add: Callable[[Any], None]
    read: Callable[[Any], Any]
    #: The nested settings class, when the group is one (so its declarations can be listed).
    settings: type | None = None


def _field(default: Any, flag: Flag | FlagGroup, *, secret: bool = False) -> Any:
    metadata = {FLAG: flag}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata, repr=not secret)


def setting(default: Any, *, flag: str, help: str, parse: Callable[[str], Any] | None = None,
            metavar: str | None = None, dest: str | None = None, repeat: bool = False,
            action: type[argparse.Action] | None = None, nargs: str | None = None, const: Any = None,
            exclusive: str | None = None, inherit: bool = False,
            to_field: Callable[[Any], Any] | None = None) -> Any:
    """A setting with a value: `default` unless the flag (or KVTIER_<FLAG>) says otherwise.
    `repeat`: the flag may be given more than once, each value added to a list; `action`: an
    argparse.Action class that stores the value instead; `nargs`/`const`, `exclusive`,
    `inherit` and `to_field`: as `Flag` says."""
    spec = Flag(name=flag, help=help, parse=parse, metavar=metavar, dest=dest, text_default=default,
                action=action or ("append" if repeat else None), nargs=nargs, const=const, exclusive=exclusive,
                inherit=inherit, to_field=to_field)
    return _field(default, spec, secret=bool(SECRET_FLAG.search(flag)))


def required(*, flag: str, help: str, parse: Callable[[str], Any] | None = None, dest: str | None = None) -> Any:
    """A setting with no default: the flag (or KVTIER_<FLAG>) must give it; a `flag` without a
    leading '-' is a positional argument."""
    return dataclasses.field(metadata={FLAG: Flag(name=flag, help=help, parse=parse, dest=dest, required=True)})


def choice(kind: type[enum.Enum], default: enum.Enum | None, *, flag: str, help: str, dest: str | None = None) -> Any:
    """A mode, one of the names of `kind` (a str-valued Enum, its former names too: Choice's
    `former_names`); None: not given."""
    former = tuple(kind.former_names()) if issubclass(kind, Choice) else ()
    spec = Flag(name=flag, help=help, dest=dest, choices=(*(str(member.value) for member in kind), *former),
                text_default=None if default is None else default.value,
                to_field=lambda text: None if text is None else kind(text))
    return _field(default, spec)


def text_choice(default: str | None, *, choices: tuple[str, ...], flag: str, help: str) -> Any:
    """A name among `choices` that the service passes on as text (no code branches on it)."""
    return _field(default, Flag(name=flag, help=help, choices=choices, text_default=default))


def on_off(default: bool | None, *, flag: str, help: str, dest: str | None = None) -> Any:
    """A yes/no setting written `on` or `off`; None: not given."""
    spec = Flag(name=flag, help=help, dest=dest, choices=("on", "off"),
                text_default=None if default is None else ("on" if default else "off"),
                to_field=lambda text: None if text is None else text == "on")
    return _field(default, spec)


def switch(*, flag: str, help: str, inherit: bool = False) -> Any:
    """Off unless the flag is given (a KVTIER_<FLAG> of 1, true, yes or on turns it on).
    `inherit`: as `Flag` says."""
    return _field(False, Flag(name=flag, help=help, action="store_true", text_default=False, inherit=inherit))


def group(settings: type) -> Any:
    """A nested settings class whose flags stand at this field's place."""
    spec = FlagGroup(add=lambda parser: add_flags(parser, settings),
                     read=lambda args: read_settings(settings, args), settings=settings)
    return dataclasses.field(default_factory=settings, metadata={FLAG: spec})


def flag_group(add: Callable[[Any], None], read: Callable[[Any], Any], default_factory: Callable[[], Any]) -> Any:
    """Flags another module declares (`add(parser)`) and reads (`read(args)`), at this place."""
    return dataclasses.field(default_factory=default_factory, metadata={FLAG: FlagGroup(add=add, read=read)})


def declared(settings: type) -> list[tuple[dataclasses.Field, Flag | FlagGroup]]:
    """The fields of a settings class that a flag sets, in flag order."""
    return [(f, f.metadata[FLAG]) for f in dataclasses.fields(settings) if FLAG in f.metadata]


def flags_of(settings: type) -> list[tuple[dataclasses.Field, Flag]]:
    """Every flag a settings class declares itself, nested settings classes included."""
    found: list[tuple[dataclasses.Field, Flag]] = []
    for f, spec in declared(settings):
        if isinstance(spec, Flag):
            found.append((f, spec))
        elif spec.settings is not None:
            found += flags_of(spec.settings)
    return found


def add_flags(parser: Any, settings: type) -> None:
    """The flags of a settings class, in its field order, on `parser` (an argparse parser); each
    `exclusive` name's group is made where its first flag stands."""
    groups: dict[str, Any] = {}
    for f, spec in declared(settings):
        if isinstance(spec, Flag):
            target = parser
            if spec.exclusive is not None:
                if spec.exclusive not in groups:
                    groups[spec.exclusive] = parser.add_mutually_exclusive_group()
                target = groups[spec.exclusive]
            target.add_argument(spec.name, **spec.argparse_options(f.name))
        else:
            spec.add(parser)


def read_settings(settings: type[T], args: Any) -> T:
    """The typed settings from what the parser parsed, checked by their `validate()`
    (SettingsError). Fields no flag sets keep their defaults."""
    values: dict[str, Any] = {}
    for f, spec in declared(settings):
        if isinstance(spec, Flag):
            key = spec.key(f.name)
            if spec.inherit and not hasattr(args, key):
                continue  # given to neither command, and no parser wrote a default: the field's own
            values[f.name] = spec.value(getattr(args, key))
        else:
            values[f.name] = spec.read(args)
    built = settings(**values)
    validate = getattr(built, "validate", None)
    if validate is not None:
        validate()
    return built


# The types that read a flag's text; their names appear in argparse's "invalid <type> value".

def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def worker_id_text(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_\-]{1,128}", text):
        raise argparse.ArgumentTypeError(
            f"worker id {text!r} must be 1-128 characters of letters, digits, '_' or '-' "
            "(it becomes a NATS subject token and part of Redis keys)")
    return text


def partition_list(text: str) -> list[int] | str | None:
    if text in ("", "all"):
        return None
    if text == "auto":
        return "auto"
    parts: list[int] = []
    for piece in text.split(","):
        if "-" in piece:
            lo, hi = piece.split("-", 1)
            parts.extend(range(int(lo), int(hi) + 1))
        else:
            parts.append(int(piece))
    if any(p < 0 for p in parts):
        raise argparse.ArgumentTypeError("partitions are non-negative integers")
    return sorted(set(parts))


def url_list(text: str) -> list[str]:
    """One URL or several, comma-separated (for flags given more than once, or from the environment)."""
    return [part.strip() for part in text.split(",") if part.strip()]


class UrlListAction(argparse.Action):
    """Repeatable flag taking comma-separated URLs; the first use on the command line replaces
    the environment's default instead of adding to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        if current is self.default or current is None:
            current = []
        setattr(namespace, self.dest, [*current, *values])


def model_and_path(value: str) -> tuple[str, str]:
    model, sep, path = value.partition("=")
    if not sep or not model or not path:
        raise argparse.ArgumentTypeError(f"expected MODEL=PATH, got {value!r}")
    return model, path
