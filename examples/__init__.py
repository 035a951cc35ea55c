"""Runnable examples of mqd with Spark (see events_pipeline.py and publish_events.py)."""
