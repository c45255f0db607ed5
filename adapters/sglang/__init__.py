"""SGLang adapter: DeepSeek-V4 per-pool reservations, broker-sized KV, elastic paged allocator."""
