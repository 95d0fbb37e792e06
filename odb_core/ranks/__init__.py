"""Ranks: everything that crosses a rank boundary. The transports (single process, Gloo, virtual) and W virtual
ranks run as threads of one process (`run_virtual_ranks`), the liveness heartbeat, the sample moves of global
planning, and one round's collectives around the pure planners. The only package that imports
`torch.distributed` (checked by import-linter). May import `odb_core.data`, `odb_core.planning` and
`odb_core.settings`."""
