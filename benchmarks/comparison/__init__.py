"""The comparison of batching methods: the peers (`peers`), the `Schedule` every method produces and its measures
(`schedule`), batch quality over the workloads (`quality`) and the tables and figures (`report`)."""
