"""Serving: the signing node (receipts, run manifests) and the OpenAI-compatible HTTP server."""
