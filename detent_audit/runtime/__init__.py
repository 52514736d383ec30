"""The runtime every engine stands on and none owns: the engine contract, the request vocabulary, models,
facts helpers and the selection-to-kernel bridge (docs/design.md section 2)."""
