"""The reference release (`online-dynamic-batching`) as a peer: its environment (`setup_ref_env.sh`), the driver
that runs inside it (`ref_driver`) and the .venv side that calls it (`reference_release`).

Standard library only: see benchmarks/__init__.py NOTE [ Standard-library package inits ]."""
