"""vLLM adapter: DeepSeek-V4 cache groups, broker-sized KV cache, broker-gated elastic block pool."""
