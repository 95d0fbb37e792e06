"""odb_core: framework-neutral Online Dynamic Batching.

Buffer processed samples, group them under a token budget, align step counts across ranks (DGAP) and yield
model-ready batches with `StepInfo` beside them. Imports torch, numpy and the standard library only.
"""

from odb_core.data.collate import CollateError, PadCollator
from odb_core.data.sources import DatasetFetchError
from odb_core.epoch.loader import ODBDataLoader
from odb_core.epoch.pipeline import EpochReport
from odb_core.epoch.watch import WorkerDiedError
from odb_core.planning.budget import Item, SampleError
from odb_core.planning.planner import DesyncError
from odb_core.planning.simulate import EpochPlan, simulate_epoch
from odb_core.ranks.sync import GlooTransport, LocalTransport, PeerError, Transport
from odb_core.ranks.virtual import VirtualHub, VirtualTransport
from odb_core.ranks.virtual import run_virtual_ranks
from odb_core.settings.config import ODBConfig
from odb_core.steps.step_info import ODBBatch, StepInfo

__all__ = [
    "CollateError", "DatasetFetchError", "DesyncError", "EpochPlan", "EpochReport", "GlooTransport", "Item",
    "LocalTransport", "ODBBatch", "ODBConfig", "ODBDataLoader", "PadCollator", "PeerError", "SampleError",
    "StepInfo", "Transport", "VirtualHub", "VirtualTransport", "WorkerDiedError", "run_virtual_ranks",
    "simulate_epoch",
]
