"""Adapters that bring serving runtimes (SGLang, vLLM) under their GPU's kvcached-broker."""
