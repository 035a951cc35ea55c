"""One-off investigations kept for the record: how a design decision was measured."""
