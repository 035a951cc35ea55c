"""What every scenario uses: brokers, the wire, the load processes, sessions, reports."""
