"""Tool-call parsers."""
