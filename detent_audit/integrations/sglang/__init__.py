"""SGLang behind the engine boundary: its plugin, its engine, its facts (docs/structure.md)."""
