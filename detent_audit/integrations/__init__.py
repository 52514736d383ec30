"""Engines other than the embedded one, behind `detent_audit.runtime.contract.Engine`."""
