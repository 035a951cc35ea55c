"""The measured scenarios ``python -m bench`` runs (see bench/__main__.py's command table)."""
