"""The benchmark workloads: synthetic lengths and the datasets that serve them (`workloads`), real chat data
(`chat_data`) and the time-to-quality split of it (`chat_split`), cached real-data token lengths (`real_lengths`;
ShareGPT read by `sharegpt_records`, tokenized inside .venv-ref by the script `sharegpt_qwen`) and the MM-Mix-like
VLM pipeline (`mm_mix`), and the datasets of the overlap and buffer-memory benchmarks (`feeding`)."""
