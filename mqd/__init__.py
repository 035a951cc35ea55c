"""mqd: a message broker on Twisted that speaks NSQ's wire protocols."""

__version__ = "0.1.0"
