"""The training benchmarks' torchrun ranks (`train_worker`, `mm_train_worker`) and the CPU training launcher and
summary (`training`). Ranks are launched as modules (`-m benchmarks.workers.<worker>`) from the repository root."""
