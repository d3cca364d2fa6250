"""Stand-in for the `sglang` package: test_utils launches mla-serve, hf_transformers_utils gives
the demo tokenizer, the rest are stubs (peer_stub)."""
