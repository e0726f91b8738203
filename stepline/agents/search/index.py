"""The `search` tool's BM25 index over the collection (bm25s), built once per process."""

from __future__ import annotations

from functools import cache

import bm25s

from stepline.agents.search.world import passages

TOP_K = 2


def _tokens(texts: list[str]) -> list[list[str]]:
    return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


class Index:
    def __init__(self, docs: list[str]):
        self.docs = docs
        self.retriever = bm25s.BM25()
        # Title boost: the passage's title (before ':') is indexed twice, so a name's own document
        # outranks the shorter documents that merely mention it.
        self.retriever.index(_tokens([f"{d.split(':')[0]} {d}" for d in docs]), show_progress=False)
        self.vocab = set(self.retriever.vocab_dict)

    def search(self, query: str, k: int = TOP_K) -> list[str]:
        """Up to k passages with a positive score, best first."""
        tokens = [t for t in _tokens([query])[0] if t in self.vocab]
        if not tokens:
            return []
        ids, scores = self.retriever.retrieve([tokens], k=min(k, len(self.docs)), show_progress=False)
        return [self.docs[int(i)] for i, s in zip(ids[0], scores[0], strict=True) if s > 0]


@cache
def index() -> Index:
    return Index(passages())
