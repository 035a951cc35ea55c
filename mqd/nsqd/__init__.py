"""The broker (`twistd mqd`): topics, channels, the V2 protocol, the HTTP API, stats and snapshots."""
