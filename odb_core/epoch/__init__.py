"""Epoch: running one epoch on one rank and the public loader around it. `ODBDataLoader`, the round pipeline
(fill the buffer, plan, align, collate, yield), the sample stream over DataLoader workers and the reader that
buffers it, the background producer, epoch-length estimates, the lifeline that ends workers with their rank
and the watch that reports a dead worker.
The top layer: may import every other odb_core package."""
