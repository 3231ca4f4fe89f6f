"""Model sources and the architecture table."""
