"""Engines other than the embedded one, behind `detent_audit.engine_api.Engine`."""
