"""`--odb-option key=value` of the benchmarks that build an ODBDataLoader (overlap, buffer_memory): each pair
becomes a keyword argument of the loader, with its value read as an int, a float, true/false, none, or else the
string. Options the loader does not know are passed all the same, and the loader refuses them."""

from __future__ import annotations


def parse_value(text: str):
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_options(pairs: list[str]) -> dict:
    """`["window=512", "min_window=256"]` -> `{"window": 512, "min_window": 256}`."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--odb-option {pair!r}: write key=value, e.g. window=512")
        options[key.strip()] = parse_value(value.strip())
    return options
