"""One declaration per setting: a config section is a frozen dataclass (a `Section`) whose fields carry the default,
the allowed values and a one-line help (`setting`). The base config, the generic checks of `resolve`, the Plan's
typed sections and docs/configuration.md are all read from those declarations."""
from __future__ import annotations

import copy
import dataclasses
import difflib
import math
from typing import Any, Callable, ClassVar

from ml_collections import config_dict

from train.exit_codes import ConfigError

_SPEC = "setting"  # the dataclasses.field metadata key that holds a field's Spec


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one setting is: its default and help, what values it takes, and how the Plan holds it."""
    default: Any
    help: str
    choices: tuple | None = None  # checked: the value must be one of them
    minimum: float | None = None  # checked: value >= minimum
    above: float | None = None    # checked: value > above
    maximum: float | None = None  # checked: value <= maximum
    below: float | None = None    # checked: value < below
    whole: bool = False           # checked: an int (not a bool)
    error: str | None = None      # the message after `section.key=value: `, where the usual one does not fit
    kind: type | None = None      # the config type when the default does not show it (a None placeholder)
    allowed: str = ""             # what the reference says it takes, where another module checks it
    parse: Callable[[Any], Any] | None = None  # config value -> the Plan section's value (default: the type)

    @property
    def type(self) -> type:
        return self.kind or type(self.default)

    @property
    def checked(self) -> bool:
        numeric = self.whole or any(b is not None for b in (self.minimum, self.above, self.maximum, self.below))
        return bool(self.choices or numeric or self.error or self.type is bool)

    def message(self) -> str:
        """The part of the one-line error after `section.key=value: `."""
        if self.error:
            return self.error
        if self.choices:
            return "use one of " + ", ".join(map(str, self.choices))
        if self.type is bool:
            return "use True or False"
        if self.minimum == 0:
            return "must be a number >= 0 (0 turns it off)"
        return "must be a positive number"

    def accepts(self, value: Any) -> bool:
        if self.choices:
            return value in self.choices
        if self.type in (bool, str):
            return isinstance(value, self.type)
        if self.whole and (not isinstance(value, int) or isinstance(value, bool)):
            return False
        if not isinstance(value, (int, float)) or not math.isfinite(value):  # nan passes every comparison
            return False
        return not ((self.minimum is not None and value < self.minimum) or
                    (self.above is not None and value <= self.above) or
                    (self.maximum is not None and value > self.maximum) or
                    (self.below is not None and value >= self.below))

    def convert(self, value: Any) -> Any:
        if self.parse is not None:
            return self.parse(value)
        return value if value is None or isinstance(self.default, dict) else self.type(value)


def setting(default: Any, help: str, **spec: Any) -> Any:
    """A dataclass field declaring one setting (Spec's keywords: choices, minimum, above, maximum, below, whole,
    error, kind, allowed, parse); the field's own default is the Plan's value of the config default."""
    s = Spec(default, help, **spec)
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata={_SPEC: s})
    return dataclasses.field(default=s.convert(default), metadata={_SPEC: s})


def nearest(value: Any, choices: Any) -> str:
    """'did you mean 'x'? ' for the choice closest to a misspelled `value` (difflib's ratio), else ''."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def names(text: Any) -> tuple[str, ...]:
    """A comma-separated list setting (train.loggers, train.actions) as a tuple of its names."""
    return tuple(n.strip() for n in str(text or "").split(",") if n.strip())


class Section:
    """A config section declared as a frozen dataclass of `setting` fields; KEY is its name in the config.
    Fields without a setting are what resolve adds (e.g. the data's token files), not config keys."""
    KEY: ClassVar[str]

    @classmethod
    def specs(cls) -> dict[str, Spec]:
        return {f.name: f.metadata[_SPEC] for f in dataclasses.fields(cls) if _SPEC in f.metadata}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The section of the base config: every key with its default (None: a typed placeholder)."""
        return {name: config_dict.placeholder(s.type) if s.default is None else copy.deepcopy(s.default)
                for name, s in cls.specs().items()}

    @classmethod
    def check(cls, values: Any) -> None:
        """Every declared check of the section, as one-line errors naming the setting."""
        for name, s in cls.specs().items():
            value = values.get(name, s.default)
            if s.checked and not s.accepts(value):
                infinite = isinstance(value, float) and not math.isfinite(value) and not s.choices
                message = "must be a finite number" if infinite else s.message()
                if s.choices and isinstance(value, str) and "use one of" in message:  # the nearest, then all
                    message = message.replace("use one of", nearest(value, s.choices) + "use one of", 1)
                raise ConfigError(f"{cls.KEY}.{name}={value!r}: {message}")

    @classmethod
    def from_config(cls, values: Any, **extra: Any) -> Any:
        """The typed section of a validated config section; a key an older config lacks takes its default."""
        return cls(**{name: s.convert(values.get(name, s.default)) for name, s in cls.specs().items()}, **extra)
