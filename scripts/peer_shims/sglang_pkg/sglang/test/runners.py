"""Stand-in for sglang/test/runners.py: rerank data for SGLang's own rerank tests (not served)."""

TEST_RERANK_QUERY_DOCS = []
