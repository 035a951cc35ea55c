"""nsqd's TCP protocol V2: framing, errors and the broker-side Protocol."""
