"""Command-line tools on mqd.client, named after NSQ's and taking their flags."""
