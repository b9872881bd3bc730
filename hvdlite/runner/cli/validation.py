"""Every setting checked once, in the launcher, with one message naming the flag or file key.

Without this, a bad value (``--op-timeout-seconds nan``, ``--gloo-threads 0``,
``--fusion-threshold-mb -1``) reaches the ranks, and every rank prints its own
traceback.  The rules themselves live in one place, the table ``common.tunables``,
applied by ``common.config.Config`` (also to variables set directly, for 1-rank runs); here the
launcher builds that Config from exactly what the ranks will get, the user's
exported ``HVDLITE_*`` / ``HOROVOD_*`` variables overridden by the flags, and
turns a refused variable back into the flag or ``--config-file`` key it came from.
"""

import argparse
import math
import os
from typing import Dict, Mapping, Optional

from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteConfigError
from hvdlite.runner.cli.options import LaunchOptions


def flag_name(parser: argparse.ArgumentParser, dest: str) -> str:
    """The flag a user most likely typed for ``dest`` (its longest spelling)."""
    for action in parser._actions:
        if action.dest == dest and action.option_strings:
            return max(action.option_strings, key=len)
    return dest


def setting_name(args: LaunchOptions, parser: argparse.ArgumentParser, dest: str) -> str:
    """``--flag`` or ``--config-file FILE: key`` for the setting ``dest``."""
    if dest in args.config_file_keys:
        return f"--config-file {args.config_file}: {args.config_file_keys[dest]}"
    return flag_name(parser, dest)


def _show(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(_show(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_finite_numbers(args: LaunchOptions, parser: argparse.ArgumentParser) -> None:
    """Every number-valued flag given is a finite number (argparse's ``float`` takes
    ``nan`` and ``inf``; so does YAML's ``.nan``).

    Raises:
        HvdliteConfigError: names the flag (or file key) and the value.
    """
    for action in parser._actions:
        if action.type not in (int, float):
            continue
        value = args.value(action.dest) if action.dest != "help" else None
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise HvdliteConfigError(
                    f"{setting_name(args, parser, action.dest)} {_show(value)}: must be a finite "
                    f"number"
                )


def check_tunables(
    args: LaunchOptions,
    parser: argparse.ArgumentParser,
    tunable_flags: Mapping[str, tuple],
    tunable_env: Mapping[str, str],
    environ: Optional[Mapping[str, str]] = None,
) -> cfg.Config:
    """Build the ranks' Config from the launcher's side and refuse it as the ranks would.

    ``tunable_flags`` maps flag dests to (variable, conversion) (``flags.TUNABLE_FLAGS``);
    ``tunable_env`` is what the flags set.

    Raises:
        HvdliteConfigError: names the flag or file key, or else the exported variable.
    """
    env = os.environ if environ is None else environ
    merged: Dict[str, str] = {
        k: v
        for k, v in env.items()
        if (k.startswith(cfg.PREFIX) or k.startswith(cfg.HOROVOD_PREFIX)) and k not in _IDENTITY
    }
    merged.update(tunable_env)
    try:
        return cfg.Config.from_env(merged, warn=False)
    except cfg.HvdliteSettingError as exc:
        for dest, (var, _) in tunable_flags.items():
            value = args.value(dest)
            if var == exc.variable and value is not None:
                raise HvdliteConfigError(
                    f"{setting_name(args, parser, dest)} {_show(value)}: the value must be "
                    f"{exc.reason.replace('must be ', '')} (it is {_show(exc.value)})"
                ) from None
        raise HvdliteConfigError(f"{exc} (set in this environment)") from None


#: per-rank and per-job facts, set by the launcher itself: never validated from our env
_IDENTITY = set(cfg.LAUNCHER_SET) | set(cfg.HOROVOD_ALIASES.values())
