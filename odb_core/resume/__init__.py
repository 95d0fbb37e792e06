"""Resume: the loader's state as typed values (versioned, digested, checked field by field), where the consumer
stands in an epoch (round log, cursor), elastic resume to another world size, and ODB's part of a training
checkpoint. May import `odb_core.steps`, `odb_core.data`, `odb_core.planning`, `odb_core.settings`; never
`odb_core.ranks` (a state is plain data; the exchange that checks ranks agree lives in `odb_core.epoch`)."""
