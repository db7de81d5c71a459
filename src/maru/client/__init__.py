"""The client: what an inference process links (handler, request path, pages, mapping)."""
