"""The engine: model specs → (model, tokenizer, fingerprint), the layer-stack view with its one adapter table,
the KV cache, the cost model and the entropy of a readout."""
