"""The reference release (`online-dynamic-batching`): its environment (`setup_ref_env.sh`), the driver that runs
inside it (`ref_driver`) and the check of that driver against the release's real loader (`reference_release
--validate`). The .venv side that runs it as a peer of the comparison is `benchmarks.comparison.reference_peer`.

Standard library only: see benchmarks/__init__.py NOTE [ Standard-library package inits ]."""
