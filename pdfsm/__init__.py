"""pdfsm: KV-cache transfer for prefill/decode disaggregated serving, correct by construction."""
