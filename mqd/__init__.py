"""mqd: a message broker on Twisted that speaks NSQ's wire protocols."""

__version__ = "0.1.0"

# The nsqd release whose protocol and API mqd reproduces; clients and tools
# read it from IDENTIFY and /info.
NSQ_VERSION = "1.3.0"
