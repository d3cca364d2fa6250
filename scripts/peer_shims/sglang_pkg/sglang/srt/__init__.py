import peer_stub

peer_stub.install(["sglang.srt.entrypoints", "sglang.srt.managers", "sglang.srt.openai_api"], {})
