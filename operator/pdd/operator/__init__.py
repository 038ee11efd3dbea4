"""PDD operator component."""
