"""The benchmark workloads: synthetic lengths (`workloads`), real chat data (`chat_data`), cached real-data token
lengths (`real_lengths`) and the MM-Mix-like VLM pipeline (`mm_mix`)."""
