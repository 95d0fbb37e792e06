"""Settings: the one validated `ODBConfig`, the parser that reads ODB settings out of a framework's own
configuration (HF arguments, a DeepSpeed `odb` section, LLaMA-Factory YAML keys), and the console line every
adapter prints. The bottom layer: imports the standard library only (and `hjson`, lazily, for DeepSpeed files);
no other odb_core package, no torch."""
