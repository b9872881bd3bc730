"""``--config-file``: horovodrun's YAML format, read as is, plus long flag names.

horovodrun's file has a top-level ``controller:`` and sections whose keys are
relative to the section (``params: {fusion_threshold_mb: 32}``,
``stall_check: {enabled: false}``, ``logging: {level: INFO}``, ...).  hvdlite
reads those with Horovod's meaning, and also any long flag name (dashes or
underscores), at the top level or inside any section (``elastic: {min-np: 2}``).
Each value lands on the flag it belongs to, so a refused feature (a hierarchical
allreduce, NCCL streams) is refused with the same message as its flag.
"""

import argparse
import logging
from typing import Any, Callable, Dict, Optional, Tuple

import yaml

from hvdlite.common.config import tunables
from hvdlite.common.exceptions import HvdliteConfigError

log = logging.getLogger(__name__)


def _same(value):
    return value


def _negate(value):
    return not value


#: horovodrun's keys that belong to no tunable: section -> {its key: (flag dest, value
#: conversion)}; the tunables' keys come from ``common.tunables``
_OTHER_KEYS: Dict[str, Dict[str, Tuple[str, Callable[[Any], Any]]]] = {
    "library_options": {
        "mpi_threads_disable": ("mpi_threads_disable", _same),
        "mpi_threads_disabled": ("mpi_threads_disable", _same),  # older Horovod spelling
        "num_nccl_streams": ("num_nccl_streams", _same),
        "thread_affinity": ("thread_affinity", _same),
    },
    "logging": {
        "with_timestamp": ("log_with_timestamp", _same),
        "hide_timestamp": ("log_with_timestamp", _negate),  # older Horovod spelling
    },
    "elastic": {
        "slots": ("slots_per_host", _same),  # horovod.run's name
        "cooldown_range": ("blacklist_cooldown_range", _same),  # horovod.run's name
    },
}


def _sections() -> Dict[str, Dict[str, Tuple[str, Callable[[Any], Any]]]]:
    """Every section's keys: the tunables' (from their table) and the others."""
    sections: Dict[str, Dict[str, Tuple[str, Callable[[Any], Any]]]] = {}
    for t in tunables.TUNABLES:
        for y in t.yaml:
            sections.setdefault(y.section, {})[y.key] = (y.dest, _negate if y.negate else _same)
    for section, keys in _OTHER_KEYS.items():
        sections.setdefault(section, {}).update(keys)
    return sections


#: horovodrun's sections: section -> {its key: (flag dest, value conversion)}; keys the
#: section does not list may still be long flag names
HOROVOD_SECTIONS = _sections()

#: keys that only older Horovod versions knew and today's horovodrun ignores: ignored here
#: too (with a note) so that such a file still runs
IGNORED_KEYS = {
    ("autotune", "cycles_per_sample"),
    ("library_options", "mlsl_bgt_affinity"),
    ("library_options", "ccl_bgt_affinity"),
}

#: a section's ``enabled: false`` switches off the feature its other keys configure
_SWITCHED = {"autotune": "autotune", "timeline": "timeline_filename"}


#: a settings file is a few KiB; anything past this is not one (and /dev/zero never ends)
_MAX_FILE_BYTES = 1024 * 1024


def _load(path: str) -> Dict[str, Any]:
    """The file's YAML mapping.

    Raises:
        HvdliteConfigError: unreadable, not UTF-8 (names the line) or not valid YAML.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise HvdliteConfigError(f"--config-file {path}: {exc.strerror}") from None
    if len(raw) > _MAX_FILE_BYTES:
        raise HvdliteConfigError(
            f"--config-file {path}: more than {_MAX_FILE_BYTES} bytes; "
            f"expected a YAML file of settings"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise HvdliteConfigError(
            f"--config-file {path}: line {line} is not UTF-8 text (byte "
            f"{raw[exc.start : exc.start + 1]!r}); expected a YAML file"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise HvdliteConfigError(f"--config-file {path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise HvdliteConfigError(f"--config-file {path}: expected a mapping of flag names")
    return data


def _actions(parser: argparse.ArgumentParser) -> Dict[str, argparse.Action]:
    """Every long option name (without dashes) and every dest -> its action."""
    by_name: Dict[str, argparse.Action] = {}
    for action in parser._actions:
        for opt in action.option_strings:
            by_name.setdefault(opt.lstrip("-").replace("_", "-"), action)
    for action in parser._actions:
        by_name.setdefault(action.dest.replace("_", "-"), action)
    return by_name


def _converter(action: argparse.Action) -> Callable[[Any], Any]:
    """The flag's ``type=``: every flag of hvdlite-run's parser gives a callable."""
    convert = action.type
    if not callable(convert):
        raise TypeError(f"{action.dest}: type={convert!r} is not callable")
    return convert


class _Reader:
    """Turns one file's entries into ``{dest: value}``, naming the file in every error."""

    def __init__(self, parser: argparse.ArgumentParser, path: str):
        self.path = path
        self.by_name = _actions(parser)
        self.by_dest = {a.dest: a for a in parser._actions}
        self.out: Dict[str, Any] = {}
        #: dest -> the key it was read from, as written in the file
        self.keys: Dict[str, str] = {}

    def error(self, what: str) -> HvdliteConfigError:
        return HvdliteConfigError(f"--config-file {self.path}: {what}")

    def flag_entry(self, key: str, value: Any, where: str) -> None:
        """A long flag name; a switch's true value means the flag was given."""
        name = str(key).replace("_", "-")
        action = self.by_name.get(name)
        if action is None or name in ("config-file", "command", "help", "version", "check-build"):
            raise self.error(f"unknown key '{where}{key}'")
        if action.nargs == 0:  # a switch: true gives it, false leaves it
            if not isinstance(value, bool):
                raise self.error(f"{where}{key}: expected true or false, got {value!r}")
            if value:
                self.out[action.dest] = action.const
            return
        if action.dest == "env" and isinstance(value, str):
            value = [value]
        self.set(action.dest, value, f"{where}{key}")

    def check_boolean(self, dest: str, value: Any, key: str) -> None:
        """A switch's key takes a YAML boolean (true/false, yes/no unquoted), never text.

        ``enabled: "false"`` is a non-empty string, so Python's truth would turn the
        feature ON; Horovod's reader has that bug.  Quoted "yes"/"no" are refused too:
        quoting says the writer meant text.

        Raises:
            HvdliteConfigError: names the key and the value seen.
        """
        action = self.by_dest.get(dest)
        switch = action is not None and (
            action.nargs == 0
            or isinstance(action, (argparse._StoreConstAction, argparse._StoreTrueAction))
        )
        if switch and value is not None and not isinstance(value, bool):
            raise self.error(
                f"{key}: expected true or false (a YAML boolean, unquoted), got {value!r}"
            )

    def set(self, dest: str, value: Any, key: str) -> None:
        """Store ``value`` for ``dest`` after the flag's own type and choice checks."""
        action = self.by_dest[dest]
        value = self._shape(action, value, key)
        if isinstance(value, list):  # nargs=N or a repeatable flag: checked
            self.out[dest] = value
            self.keys[dest] = key
            return
        if action.type is not None and action.nargs is None and value is not None:
            if isinstance(value, str):
                try:
                    value = _converter(action)(value)
                except ValueError:
                    raise self.error(f"{key}: {value!r} is not a valid value") from None
            elif action.type in (int, float) and (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or (action.type is int and not isinstance(value, int))
            ):
                raise self.error(f"{key}: {value!r} is not a valid {action.type.__name__}")
        if action.choices is not None and value not in action.choices:
            raise self.error(f"{key}: {value!r} is not one of {', '.join(action.choices)}")
        self.out[dest] = value
        self.keys[dest] = key

    def _shape(self, action: argparse.Action, value: Any, key: str) -> Any:
        """A value of the shape the flag takes: a scalar for a plain flag, a list of N for
        ``nargs=N``, a list of strings for a repeatable one (-x); YAML gives any shape.

        Raises:
            HvdliteConfigError: a list or mapping where one value belongs, or the reverse.
        """
        if isinstance(action, argparse._AppendAction):
            items = value if isinstance(value, list) else [value]
            if not all(isinstance(v, str) for v in items):
                raise self.error(f"{key}: expected a name or a list of names, got {value!r}")
            return list(items)
        if isinstance(action.nargs, int) and action.nargs > 0:
            if not isinstance(value, list) or len(value) != action.nargs:
                raise self.error(f"{key}: expected a list of {action.nargs} values, got {value!r}")
            out = []
            for v in value:
                if action.type in (int, float) and (
                    isinstance(v, bool) or not isinstance(v, (int, float))
                ):
                    raise self.error(f"{key}: {v!r} is not a number")
                out.append(_converter(action)(v) if action.type is not None else v)
            return out
        if not isinstance(action, argparse._StoreAction):
            return value  # a switch's constant (checked by caller)
        if isinstance(value, (list, dict)):
            kind = "list" if isinstance(value, list) else "mapping"
            raise self.error(f"{key}: expected one value, got a {kind} {value!r}")
        if action.type is None and value is not None and not isinstance(value, str):
            if isinstance(value, bool):
                raise self.error(f"{key}: expected text, got {value!r}")
            value = str(value)  # e.g. "hosts: 5" is the text "5"
        return value

    def section(self, name: str, entries: Dict[str, Any]) -> None:
        known = HOROVOD_SECTIONS.get(name, {})
        switch = _SWITCHED.get(name)
        if "enabled" in entries and not isinstance(entries["enabled"], bool):
            raise self.error(
                f"{name}.enabled: expected true or false (a YAML boolean, "
                f"unquoted), got {entries['enabled']!r}"
            )
        if switch and entries.get("enabled") is False:
            # Horovod exports a section's settings only with its feature on
            log.info(
                "--config-file %s: %s is disabled; its other keys are ignored", self.path, name
            )
            return
        for key, value in entries.items():
            norm = str(key).replace("-", "_")
            if (name, norm) in IGNORED_KEYS:
                log.warning(
                    "--config-file %s: %s.%s is ignored (today's horovodrun ignores it too)",
                    self.path,
                    name,
                    key,
                )
            elif name == "timeline" and norm == "enabled":
                continue  # the switch itself, handled above
            elif norm in known:
                dest, convert = known[norm]
                self.check_boolean(dest, value, f"{name}.{key}")
                self.set(dest, None if value is None else convert(value), f"{name}.{key}")
            else:
                self.flag_entry(key, value, f"{name}.")


def config_file_defaults(
    parser: argparse.ArgumentParser,
    path: str,
    controller_given: bool = False,
    keys: Optional[Dict[str, str]] = None,
) -> Dict[str, Any]:
    """Read ``--config-file`` into ``{flag dest: value}`` (parser defaults; flags win).

    ``controller_given``: --gloo/--mpi/--jsrun is on the command line, so the file's
    ``controller:`` does not apply (they exclude each other).  ``keys``, when given, is
    filled with the file's key for each dest (so later checks can name the key).

    Raises:
        HvdliteConfigError: unreadable file, not a mapping, an unknown key or a bad value
            (names the file and the key).
    """
    reader = _Reader(parser, path)
    for key, value in _load(path).items():
        if key == "controller":
            _controller(reader, value, controller_given)
        elif isinstance(value, dict):
            reader.section(str(key), value)
        else:
            reader.flag_entry(key, value, "")
    if keys is not None:
        keys.update(reader.keys)
    return reader.out


def _controller(reader: _Reader, value: Optional[str], given: bool) -> None:
    choice = str(value).strip().lower()
    if choice not in ("gloo", "mpi"):
        raise reader.error(f"controller: {value!r} is not 'gloo' or 'mpi'")
    if not given:
        reader.out[choice] = True
