"""Data: what a processed sample is to odb. The per-sample checks that read its cost facts (and name the index
of a bad one), the index sources and dataset wrapper that tag samples with their index over a plain
`DataLoader`, each rank's stream of lengths as that sampler deals it (`sharding.shard`, for the simulator), and
collation into model-ready batches. May import `odb_core.planning` and `odb_core.settings`, torch and numpy;
never `torch.distributed`."""
