"""nsqd's HTTP API on twisted.web."""
