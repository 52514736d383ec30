"""Serving engines behind the engine boundary, each with its plugin."""
