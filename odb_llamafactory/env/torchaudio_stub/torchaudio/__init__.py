"""Stand-in for `torchaudio` in odb's LLaMA-Factory environment (.venv-lf). It is not torchaudio.

LLaMA-Factory 0.9.5 imports torchaudio at module level (`llamafactory/data/mm_plugin.py`) and calls it only to
load and resample audio inputs. PyPI has no torchaudio for torch 2.13 (the newest, 2.11.x, is built against
torch 2.11 and fails to load its extension beside torch 2.13), and its builds for other torch versions are CUDA
builds. Text SFT never touches audio, so this module only satisfies the import: every attribute access raises
an error that says so. Datasets with an `audios` column need a real torchaudio matching the installed torch.
"""

__version__ = "0.0.0+odb.stub"


def __getattr__(name: str):
    if name.startswith("__"):  # import machinery and introspection probe dunders; keep them ordinary
        raise AttributeError(name)
    raise AttributeError(f"torchaudio.{name} is unavailable: this environment's torchaudio is odb's import-only "
                         "stub (no torchaudio build matches the installed torch 2.13 CPU), so audio inputs are not "
                         "supported here; text datasets are unaffected (see odb_llamafactory/env/README.md)")
