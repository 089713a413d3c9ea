"""Rate limiting with no HTTP in it: bucket math, keys, stores, and failure policies."""
