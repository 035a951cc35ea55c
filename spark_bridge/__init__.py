"""The Spark bridge: snapshots of the broker's queues read with PySpark, and topics as Structured Streaming sources and sinks."""
