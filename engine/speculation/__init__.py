"""Speculative decoding: proposers (n-gram, draft model, layer skip), verification, and the seam into the step."""
