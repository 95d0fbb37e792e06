"""Planning: the pure decisions. Budget constraints, grouping a buffer under the budget, DGAP alignment,
join/non-join termination, one rank's round planner, global (pooled) planning, and the virtual-cluster simulator
behind `odb plan`. Functions of plain data (lengths, counts, gathered rank states) to plan dataclasses; no I/O,
no threads. May import `odb_core.settings`, numpy and the standard library; never torch (checked by
import-linter), so that the same code runs on Gloo, on a virtual cluster and in the simulator."""
