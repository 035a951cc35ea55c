"""mqd's loggers: twisted.logger, filtered by the broker's `log-level`.

twistd owns the log observers, so the level is applied where mqd emits:
every mqd logger writes through one FilteringLogObserver whose level can
change at run time (nsqd's `PUT /config/log_level`).
"""

from __future__ import annotations

from twisted.logger import (
    FilteringLogObserver,
    Logger,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogPublisher,
)

__all__ = ["get_logger", "set_log_level", "LEVELS"]

# nsqd's level names and the twisted.logger levels they mean.
LEVELS = {
    "debug": LogLevel.debug,
    "info": LogLevel.info,
    "warn": LogLevel.warn,
    "error": LogLevel.error,
    "fatal": LogLevel.critical,
}

_predicate = LogLevelFilterPredicate(defaultLogLevel=LogLevel.info)
_observer = FilteringLogObserver(globalLogPublisher, [_predicate])


def get_logger(namespace: str) -> Logger:
    return Logger(namespace=namespace, observer=_observer)


def set_log_level(name: str) -> None:
    """Apply an nsqd level name; raises KeyError for an unknown one.

    The level is set on the predicate's root namespace: assigning its
    `defaultLogLevel` alone changes nothing once the predicate is built.
    """
    level = LEVELS[name]
    _predicate.defaultLogLevel = level
    _predicate.setLogLevelForNamespace("", level)
