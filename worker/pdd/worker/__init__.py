"""PDD worker component."""
