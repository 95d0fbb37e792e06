"""odb_core: framework-neutral Online Dynamic Batching.

Buffer processed samples, group them under a token budget, align step counts across ranks (DGAP) and yield
model-ready batches with `StepInfo` beside them. Imports torch, numpy and the standard library only.
"""

from odb_core.budget import Item
from odb_core.collate import CollateError, PadCollator
from odb_core.config import ODBConfig
from odb_core.engine import DesyncError
from odb_core.loader import DatasetFetchError, ODBDataLoader
from odb_core.pipeline import EpochReport
from odb_core.sample import SampleError
from odb_core.simulate import EpochPlan, simulate_epoch
from odb_core.step_info import ODBBatch, StepInfo
from odb_core.sync import GlooTransport, LocalTransport, PeerError, Transport, VirtualHub, VirtualTransport

__all__ = [
    "CollateError", "DatasetFetchError", "DesyncError", "EpochPlan", "EpochReport", "GlooTransport", "Item",
    "LocalTransport", "ODBBatch", "ODBConfig", "ODBDataLoader", "PadCollator", "PeerError", "SampleError",
    "StepInfo", "Transport", "VirtualHub", "VirtualTransport", "simulate_epoch",
]
