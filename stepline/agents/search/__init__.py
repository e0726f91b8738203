"""The search harness: two-hop questions over a generated collection, a BM25 `search` tool, EM/F1 scoring."""
