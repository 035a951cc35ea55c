"""Command-line parsing shared by the tools: NSQ's flag spellings on argparse.

Scripts written for nsq_tail, to_nsq, nsq_to_file and nsq_stat use every
form Go's flag package takes (`-topic=x`, `-topic x`, `--topic=x`,
`--topic x`, `-gzip`, `--gzip=false`), so `ToolParser` rewrites them into
argparse's before parsing. Go's flag package exits 2 on a bad command
line (argparse does the same); the tools' own checks are `log.Fatal` in
Go, exit 1: `fatal()` here.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

from mqd import __version__
from mqd.client.config import split_config_opt
from mqd.clusterinfo.bearer import SECRET_ENV, check_secret, env_secret, refusal_hint
from mqd.options import parse_duration
from mqd.wire.errors import go_quote

__all__ = [
    "ToolError",
    "ToolParser",
    "apply_config_opts",
    "bad_flag_value",
    "fatal",
    "go_bool",
    "go_duration",
    "http_auth_secret",
    "make_config",
    "refused_line",
    "run",
    "split_config_opt",
]

# strconv.ParseBool's spellings, which Go's boolean flags take after "=".
_TRUE = frozenset({"1", "t", "T", "true", "TRUE", "True"})
_FALSE = frozenset({"0", "f", "F", "false", "FALSE", "False"})


class ToolError(Exception):
    """A problem the tool reports in one line on stderr before exiting 1 (Go's log.Fatal)."""


def go_bool(text: str) -> bool:
    """A boolean flag value as Go's strconv.ParseBool reads it."""
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean {go_quote(text.encode())}")


def go_duration(text: str) -> float:
    """A duration flag value ("30s", "1m30s", "250ms", "0") in seconds."""
    try:
        return parse_duration(text)
    except ValueError:
        raise bad_flag_value(text) from None


def _go_int(text: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        raise bad_flag_value(text) from None


def _h(text: str) -> str:
    """Help text as argparse wants it: a literal % (strftime formats) doubled."""
    return text.replace("%", "%%")


class ToolParser(argparse.ArgumentParser):
    """argparse with Go's flag forms, `--version`, and NSQ's repeatable flags.

    Options are registered by their long name only (`--topic`, `--n`);
    `-name` is rewritten to `--name` when `--name` exists, and a bare
    boolean `--gzip` to `--gzip=true`, so a boolean never swallows the
    next argument. Abbreviations are refused, as Go refuses them.
    """

    def __init__(self, tool: str, description: str | None = None) -> None:
        super().__init__(prog=tool, description=description, allow_abbrev=False, exit_on_error=False)
        self.tool = tool
        self._bools: set[str] = set()
        self._lists: list[str] = []
        self.add_argument(
            "--version", action="version", version=f"{tool} v{__version__}",
            help="print version string",
        )

    # -- registering -------------------------------------------------------

    def add_bool(self, name: str, help: str, default: bool = False) -> None:
        """A Go boolean flag: `--name`, `-name`, `--name=false`."""
        self._bools.add(name)
        self.add_argument(
            f"--{name}", type=go_bool, nargs="?", const=True, default=default,
            metavar="true|false", help=_h(help),
        )

    def add_list(self, name: str, help: str, metavar: str = "VALUE",
                 type: Callable[[str], Any] | None = None) -> None:
        """A repeatable flag (nsq's app.StringArray): every occurrence is kept, in order."""
        self._lists.append(name.replace("-", "_"))
        self.add_argument(f"--{name}", action="append", default=None, metavar=metavar,
                          type=type,  # type: ignore[arg-type]  # None is argparse's default; typeshed omits it
                          help=_h(help))

    def add_duration(self, name: str, default: str, help: str) -> None:
        """A Go time.Duration flag; the value is in seconds."""
        self.add_argument(
            f"--{name}", type=go_duration, default=parse_duration(default), metavar="DURATION",
            help=_h(f"{help} (default {default})"),
        )

    def add_int(self, name: str, default: int, help: str) -> None:
        self.add_argument(
            f"--{name}", type=_go_int, default=default, metavar="INT",
            help=_h(f"{help} (default {default})"),
        )

    def add_str(self, name: str, default: str, help: str) -> None:
        shown = f" (default {default!r})" if default else ""
        self.add_argument(f"--{name}", default=default, metavar="STRING",
                          help=_h(help + shown))

    def add_addresses(self, nsqd: bool = True, lookupd: bool = True) -> None:
        if nsqd:
            self.add_list(
                "nsqd-tcp-address", "nsqd TCP address (may be given multiple times)", "ADDR"
            )
        if lookupd:
            self.add_list(
                "lookupd-http-address", "lookupd HTTP address (may be given multiple times)",
                "ADDR",
            )

    def add_http_auth_secret(self) -> None:
        """`--http-auth-secret`: the secret the tool's HTTP requests carry (`Authorization: Bearer`).

        For brokers and lookupds run with `--http-auth-required`. The TCP
        AUTH secret stays `--consumer-opt=auth_secret,...`, as in nsq's tools.
        The default, when the flag is not given, is $MQ_HTTP_AUTH_SECRET
        (read by `http_auth_secret`; never shown in the usage).
        """
        self.add_argument(
            "--http-auth-secret", default=None, metavar="STRING",
            help=f"secret sent as 'Authorization: Bearer' to lookupds and nsqds that require one "
                 f"(default: ${SECRET_ENV})")

    def add_config_opts(self, kind: str) -> None:
        """`--consumer-opt` / `--producer-opt` (kind "consumer" / "producer").

        The consumer's also answers to nsq's deprecated `--reader-opt`.
        """
        self.add_list(
            f"{kind}-opt",
            f"option to pass through to the {kind} (may be given multiple times; "
            "name=value or name,value as go-nsq's ConfigFlag; a bare name means true)",
            "NAME=VALUE", type=_config_opt,
        )
        if kind == "consumer":
            self.add_argument(
                "--reader-opt", action="append", dest="consumer_opt", metavar="NAME=VALUE",
                type=_config_opt, help="(deprecated) use --consumer-opt",
            )

    # -- parsing -------------------------------------------------------------

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        argv = list(sys.argv[1:] if args is None else args)
        try:
            ns = super().parse_args(list(self.go_forms(argv)), namespace)
        except argparse.ArgumentError as e:
            self.error(go_flag_error(e))
        for dest in self._lists:
            if getattr(ns, dest, None) is None:
                setattr(ns, dest, [])
        return ns

    def go_forms(self, args: Iterable[str]) -> Iterable[str]:
        """Rewrite Go's flag spellings into argparse's (see the class docstring)."""
        known = set(self._option_string_actions)
        rest = False
        for arg in args:
            if rest or arg == "--" or not arg.startswith("-") or arg == "-":
                rest = rest or arg == "--"
                yield arg
                continue
            if not arg.startswith("--") and f"-{arg.split('=', 1)[0]}" in known:
                arg = "-" + arg
            if arg.startswith("--") and arg[2:] in self._bools:
                arg += "=true"
            yield arg

    def error(self, message: str) -> NoReturn:
        """A bad command line as Go's flag package reports it: the error, the usage, exit status 2."""
        if message.startswith("unrecognized arguments: "):
            # Go stops at the first flag it does not know.
            message = f"flag provided but not defined: -{message.split()[2].lstrip('-').split('=')[0]}"
        sys.stderr.write(f"{message}\nUsage of {self.prog}:\n{self.go_usage()}")
        sys.stderr.flush()
        raise SystemExit(2)

    def print_help(self, file: Any = None) -> None:
        """`-h` / `--help` as Go's flag package answers it: `Usage of <tool>:` and the listing, on stderr.

        argparse exits with status 0 after it, as Go's tools do.
        """
        sys.stderr.write(f"Usage of {self.prog}:\n{self.go_usage()}")
        sys.stderr.flush()

    def go_usage(self) -> str:
        """The flags listed as Go's flag.PrintDefaults lists them."""
        lines = []
        for action in sorted(self._actions, key=lambda a: a.option_strings[0] if a.option_strings else ""):
            if not action.option_strings or action.option_strings[0] == "-h":
                continue
            name = action.option_strings[0].lstrip("-")
            repeatable = action.dest in self._lists
            kind = "" if name in self._bools or action.nargs == 0 else " " + _go_type_name(action, repeatable)
            lines.append(f"  -{name}{kind}\n    \t{(action.help or '').replace('%%', '%')}\n")
        return "".join(lines)

    def fatal(self, message: str) -> NoReturn:
        fatal(message)


def _go_type_name(action: argparse.Action, repeatable: bool) -> str:
    """The value's type as flag.PrintDefaults names it (a repeatable flag is a flag.Value: "value")."""
    if repeatable:
        return "value"
    names: dict[object, str] = {_go_int: "int", go_duration: "duration"}
    return names.get(action.type, "string")


def go_flag_error(error: argparse.ArgumentError) -> str:
    """argparse's complaint about one flag in Go's flag package's words."""
    name = "-" + (error.argument_name or "").split("/")[0].lstrip("-")
    message = error.message
    if message.startswith("expected one argument"):
        return f"flag needs an argument: {name}"
    if message.startswith("invalid boolean "):
        return f"invalid boolean value {message.split(' ', 2)[2]} for {name}: parse error"
    if message.startswith("invalid value "):
        # "invalid value <quoted>: <reason>" from the value's type.
        value, _, reason = message[len("invalid value "):].partition("\x00")
        return f"invalid value {value} for flag {name}: {reason}"
    return f"invalid value for flag {name}: {message}"


def bad_flag_value(text: str, reason: str = "parse error") -> argparse.ArgumentTypeError:
    """A flag value its type refuses; go_flag_error puts the flag's name in."""
    return argparse.ArgumentTypeError(f"invalid value {go_quote(text.encode())}\x00{reason}")


def fatal(message: str) -> NoReturn:
    """Go's log.Fatal: the message on stderr, exit status 1."""
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()
    raise SystemExit(1)


def parse_checked(parser: argparse.ArgumentParser, check: Callable[[Any], Any],
                  argv: Sequence[str] | None) -> tuple[Any, Any]:
    """(args, check(args)): a bad command line exits 2 (argparse), a refused one 1 (fatal)."""
    args = parser.parse_args(argv)
    try:
        return args, check(args)
    except ToolError as e:
        fatal(str(e))


# -- the HTTP auth secret -------------------------------------------------------
# $MQ_HTTP_AUTH_SECRET is read when --http-auth-secret is not given: a flag
# shows in `ps` and in the shell's history.


def http_auth_secret(args: Any) -> str:
    """The tool's HTTP auth secret: `--http-auth-secret`, else $MQ_HTTP_AUTH_SECRET, else ""; ToolError if unusable."""
    given = getattr(args, "http_auth_secret", None)
    secret, what = (given, "--http-auth-secret") if given is not None else (
        env_secret(SECRET_ENV), SECRET_ENV)
    try:
        return check_secret(secret, what)
    except ValueError as e:
        raise ToolError(str(e)) from None


def refused_line(error: Any) -> str:
    """A tool's one line for a refused secret: `ERROR: nsqd HOST:PORT answered 401 Unauthorized (AUTH_REQUIRED): ...`.

    `error` is an `HTTPRefusedError` (mqd.clusterinfo.bearer); the line
    names the node and the answer, and what to do, never the secret.
    """
    return f"ERROR: {error}: {refusal_hint(error.code, error.body, '--http-auth-secret')}"


# -- client options ------------------------------------------------------------


def _config_opt(opt: str) -> str:
    """A `--consumer-opt`/`--producer-opt` value, checked when the flag is read as go-nsq's ConfigFlag is.

    A bad one is a bad command line (exit 2): `invalid value "nosuch,1" for
    flag -consumer-opt: invalid option nosuch`.
    """
    from mqd.client.config import Config
    from mqd.client.errors import ClientConfigError

    name, value = split_config_opt(opt)
    try:
        Config().set(name, value)
    except (ClientConfigError, ValueError, TypeError) as e:
        reason = f"invalid option {name}" if str(e).startswith("unknown option") else str(e)
        raise bad_flag_value(opt, reason) from None
    return opt


def apply_config_opts(config: Any, opts: Iterable[str]) -> None:
    """`config.set` each `--consumer-opt`/`--producer-opt`; a bad one is a ToolError."""
    from mqd.client.errors import ClientConfigError

    for opt in opts:
        name, value = split_config_opt(opt)
        try:
            config.set(name, value)
        except (ClientConfigError, ValueError, TypeError) as e:
            raise ToolError(f"invalid option {opt!r}: {e}") from None


def make_config(tool: str, opts: Iterable[str], **after: Any) -> Any:
    """A client Config from the pass-through options, then the tool's own flags.

    As in nsq's tools, the dedicated flags (`--max-in-flight`) are applied
    after the pass-through options and so win over them. The user agent
    names the tool, as nsq's tools do ("nsq_tail/1.2.1 go-nsq/1.1.0").
    """
    from mqd.client.config import Config
    from mqd.client.errors import ClientConfigError

    config = Config()
    try:
        config.set("user_agent", f"{tool}/{__version__} mqd.client/{__version__}")
    except (ClientConfigError, ValueError):  # pragma: no cover - user_agent is a free string
        pass
    apply_config_opts(config, opts)
    try:
        for name, value in after.items():
            config.set(name, str(value))
        config.validate()
    except (ClientConfigError, ValueError, TypeError) as e:
        raise ToolError(str(e)) from None
    return config


# -- running -------------------------------------------------------------------


def run(main: Callable[..., Any], *args: Any, log_level: str = "info") -> NoReturn:
    """Run `main(reactor, *args)` under twisted.internet.task.react.

    Logs go to stderr (stdout is the tools' data). A ToolError from the
    setup or from the running tool ends it as log.Fatal would: one line,
    exit status 1.
    """
    from twisted.internet import defer, task
    from twisted.logger import (
        FilteringLogObserver,
        LogLevel,
        LogLevelFilterPredicate,
        globalLogBeginner,
        textFileLogObserver,
    )

    from mqd.logs import LEVELS, set_log_level

    set_log_level(log_level)
    # Twisted's own chatter ("Starting factory ...", "Main loop terminated")
    # is noise on a tool's stderr: only its warnings pass, mqd's lines at
    # the tool's level.
    predicate = LogLevelFilterPredicate(defaultLogLevel=LogLevel.warn)
    predicate.setLogLevelForNamespace("mqd", LEVELS[log_level])
    globalLogBeginner.beginLoggingTo(
        [FilteringLogObserver(textFileLogObserver(sys.stderr), [predicate])],
        discardBuffer=True, redirectStandardIO=False,
    )

    def _main(reactor: Any) -> defer.Deferred:
        d = defer.maybeDeferred(main, reactor, *args)

        def failed(failure: Any) -> Any:
            if failure.check(ToolError):
                sys.stderr.write(f"{failure.value}\n")
                sys.stderr.flush()
                raise SystemExit(1)
            return failure

        return d.addErrback(failed)

    # Go's signal.Notify takes back a SIGINT the shell left ignored (a
    # script's `mq-tail ... &`); Python keeps it ignored, and Twisted puts
    # its handler only over Python's default one.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    task.react(_main)
    raise SystemExit(0)  # pragma: no cover - react exits
