"""What the three twistd plugins share: nsqd's flag forms over an option table.

Each daemon (`twistd mqd`, `twistd mqlookupd`, `twistd mqadmin`) builds its
usage.Options from its own table in mqd.options, so flags, YAML keys and
their errors read the same everywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any, cast

from twisted.python import usage

from mqd import NSQ_VERSION, __version__
from mqd.options import ConfigError, Option, Settings, resolve

__all__ = ["TableOptions", "make_options_class", "settings_from"]


class TableOptions(usage.Options):
    """A daemon's usage.Options, made by `make_options_class` from its option table."""

    def flag_values(self) -> dict[str, Any]:
        """What the command line set explicitly, by option name."""
        raise NotImplementedError


def make_options_class(table: Sequence[Option], program: str) -> type[TableOptions]:
    """A usage.Options for an option table, accepting nsqd's flag forms.

    Go's flag package, which nsqd uses, takes `-name=value` as well as
    `--name=value` and `--flag=false` for booleans; scripts written for
    nsqd use all three, so they are rewritten into getopt's forms before
    parsing. Values stay strings here: they are checked, with the YAML
    file's, by `resolve`, so every bad value gets the same one-line error.
    """
    params = [[o.name, None, None, o.help] for o in table if o.kind not in ("bool", "list")]
    flags = [[o.name, None, o.help] for o in table if o.kind == "bool"]
    lists = [o for o in table if o.kind == "list"]
    long_names = {o.name for o in table} | {"config", "version", "help"}
    bool_names = {o.name for o in table if o.kind == "bool"}
    bare_values = {o.name: o.bare for o in table if o.bare is not None}

    class _Options(TableOptions):
        synopsis = f"[options]  (the flags of the NSQ program it replaces; see config/{program}.yaml)"
        optParameters = [["config", "c", None, "YAML config file (flags override it)"], *params]
        optFlags = flags

        def __init__(self) -> None:
            super().__init__()
            for opt in lists:
                self[opt.name] = []

        def opt_version(self) -> None:
            print(f"{program} v{__version__} (nsq protocol {NSQ_VERSION})")
            sys.exit(0)

        def parseOptions(self, options: Iterable[str] | None = None) -> None:
            if options is None:
                options = sys.argv[1:]
            self._false_flags: set[str] = set()
            super().parseOptions(list(self._rewrite(options)))

        def _rewrite(self, args: Iterable[str]):
            for arg in args:
                if arg.startswith("-") and not arg.startswith("--") and len(arg) > 2:
                    name = arg[1:].split("=", 1)[0]
                    if name in long_names:
                        arg = "-" + arg
                if arg.startswith("--") and arg[2:] in bare_values:
                    arg = f"{arg}={bare_values[arg[2:]]}"
                if arg.startswith("--") and "=" in arg:
                    name, value = arg[2:].split("=", 1)
                    if name in bool_names:
                        if value.strip().lower() in ("0", "f", "false", "no", "off"):
                            self._false_flags.add(name)
                            continue
                        arg = "--" + name
                yield arg

        def flag_values(self) -> dict[str, Any]:
            """What the command line set explicitly, by option name."""
            given: dict[str, Any] = {}
            for opt in table:
                value = self.get(opt.name)
                if opt.kind == "bool":
                    if opt.name in self._false_flags:
                        given[opt.name] = False
                    elif value:
                        given[opt.name] = True
                elif opt.kind == "list":
                    if value:
                        given[opt.name] = list(value)
                elif value is not None:
                    given[opt.name] = value
            return given

    def _appender(name: str, help: str):
        # usage.Options tells flags from parameters by the handler's
        # argument count, so the name is closed over, not a default argument.
        def _append(self, value: str) -> None:
            self[name].append(value)

        _append.__doc__ = f"{help} (repeatable)"
        return _append

    for opt in lists:
        setattr(_Options, "opt_" + opt.attr, _appender(opt.name, opt.help))

    _Options.__name__ = f"{program.capitalize()}Options"
    return _Options


def settings_from(options: usage.Options, table: Sequence[Option], program: str) -> Settings:
    """Resolve flags > YAML > defaults, or stop with one line saying what is wrong."""
    try:
        # twistd hands makeService the plugin's own Options: one of ours.
        flags = cast(TableOptions, options).flag_values()
        return resolve(table, flags, options["config"])
    except ConfigError as e:
        print(f"{program}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
