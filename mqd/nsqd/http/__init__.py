"""The broker's HTTP API: nsqd's endpoints plus mqd's peek, snapshot and metrics."""
