"""Where the router keeps what replicas share: the prefix index and in-flight counts."""
