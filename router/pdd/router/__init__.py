"""PDD router component."""
