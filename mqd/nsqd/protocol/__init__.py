"""The broker's side of NSQ's TCP protocol V2."""
