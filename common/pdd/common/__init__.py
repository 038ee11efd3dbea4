"""Pure-Python pieces shared by the worker, the router and the operator (no torch here)."""
