"""The Spark bridge: LMDB snapshots read with PySpark (issue #7)."""
